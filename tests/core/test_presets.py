"""Model presets: layer layouts from public configs, and the configs vLLM 0.33 builds
for them (``get_kv_cache_configs``, ``get_max_concurrency_for_kv_cache_config`` and
``estimate_max_model_len`` run on the same specs gave the expected numbers; the Jamba
attention block sizes come from vLLM's ``Platform._align_hybrid_block_size`` with a
FlashAttention backend)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pagedkv as pk
import pytest
from pagedkv import presets

GiB = 1 << 30


def test_names_and_lookup() -> None:
    assert presets.names() == [
        "llama-3.1-8b",
        "llama-3.1-70b",
        "gemma-3-27b",
        "gpt-oss-120b",
        "llama-4-scout",
        "jamba-1.5-mini",
        "deepseek-v3",
        "whisper-large-v3",
        "llama-3.1-8b-fp8",
        "llama-3.1-70b-fp8",
        "llama-3.3-70b-fp8",
    ]
    assert presets.get("Gemma-3-27B") is presets.get("gemma-3-27b")
    with pytest.raises(KeyError, match=r"llama-3\.1-8b"):
        presets.get("gpt-5")
    for name in presets.names():
        p = presets.get(name)
        assert isinstance(p, pk.ModelPreset) and p.name == name
        assert p.model and p.source and p.max_model_len > 0


def _kinds(specs: dict[str, pk.KVCacheSpec]) -> Counter[str]:
    return Counter(s.kind for s in specs.values())


def test_llama_3_1_8b() -> None:
    p = presets.get("llama-3.1-8b")
    specs = p.layer_specs()
    assert p.max_model_len == 131072
    assert _kinds(specs) == {"full_attention": 32}
    assert set(specs.values()) == {pk.FullAttentionSpec(16, 8, 128, "bfloat16")}
    assert list(specs)[:2] == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    # 128 KiB of KV cache per token.
    assert sum(s.page_size_bytes for s in p.layer_specs(block_size=1).values()) == 131072


def test_gemma_3_27b() -> None:
    p = presets.get("gemma-3-27b")
    specs = p.layer_specs()
    assert p.max_model_len == 131072
    assert _kinds(specs) == {"sliding_window": 52, "full_attention": 10}
    layers = list(specs.values())
    assert [i for i, s in enumerate(layers) if s.kind == "full_attention"] == list(range(5, 62, 6))
    assert layers[0] == pk.SlidingWindowSpec(16, 16, 128, "bfloat16", 1024)
    assert layers[5] == pk.FullAttentionSpec(16, 16, 128, "bfloat16")


def test_gpt_oss_120b() -> None:
    specs = presets.get("gpt-oss-120b").layer_specs()
    assert _kinds(specs) == {"sliding_window": 18, "full_attention": 18}
    layers = list(specs.values())
    assert layers[0] == pk.SlidingWindowSpec(16, 8, 64, "bfloat16", 128)
    assert layers[1] == pk.FullAttentionSpec(16, 8, 64, "bfloat16")
    assert next(iter(specs)) == "model.layers.0.attn.attn"


def test_llama_4_scout() -> None:
    p = presets.get("llama-4-scout")
    specs = p.layer_specs()
    assert p.max_model_len == 10485760
    assert _kinds(specs) == {"chunked_local_attention": 36, "full_attention": 12}
    layers = list(specs.values())
    assert [i for i, s in enumerate(layers) if s.kind == "full_attention"] == list(range(3, 48, 4))
    assert layers[0] == pk.ChunkedLocalAttentionSpec(16, 8, 128, "bfloat16", 8192)


@pytest.mark.parametrize(
    ("block_size", "attn_block_size", "page"),
    [(16, 80, 327680), (8, 80, 327680), (32, 96, 393216), (128, 128, 524288)],
)
def test_jamba_aligns_attention_block_to_mamba_page(
    block_size: int, attn_block_size: int, page: int
) -> None:
    p = presets.get("jamba-1.5-mini")
    specs = p.layer_specs(block_size)
    assert p.max_model_len == 262144
    assert _kinds(specs) == {"mamba": 28, "full_attention": 4}
    attn = specs["model.layers.4.self_attn.attn"]
    mamba = specs["model.layers.0.mamba"]
    assert [n for n, s in specs.items() if s.kind == "full_attention"] == [
        f"model.layers.{i}.self_attn.attn" for i in (4, 12, 20, 28)
    ]
    assert attn == pk.FullAttentionSpec(attn_block_size, 8, 128, "bfloat16")
    assert isinstance(mamba, pk.MambaSpec)
    assert mamba.shapes == ((3, 8192), (8192, 16))
    assert mamba.real_page_size_bytes == 311296
    assert mamba.page_size_bytes == attn.page_size_bytes == page
    assert mamba.block_size == attn_block_size
    assert mamba.core_spec() == {
        "kind": "mamba",
        "block_size": attn_block_size,
        "mamba_cache_mode": "align",
        "num_speculative_blocks": 0,
    }


def test_jamba_none_mode_spans_max_model_len() -> None:
    p = presets.get("jamba-1.5-mini")
    mamba = p.layer_specs(mamba_cache_mode="none", num_speculative_blocks=1)["model.layers.0.mamba"]
    assert isinstance(mamba, pk.MambaSpec)
    assert (mamba.block_size, mamba.mamba_cache_mode, mamba.num_speculative_blocks) == (
        262144,
        "none",
        1,
    )
    short = p.layer_specs(mamba_cache_mode="none", max_model_len=4096)["model.layers.0.mamba"]
    assert short.block_size == 4096


def test_deepseek_v3() -> None:
    p = presets.get("deepseek-v3")
    specs = p.layer_specs(block_size=64)
    assert p.max_model_len == 163840
    assert _kinds(specs) == {"mla_attention": 61}
    assert set(specs.values()) == {pk.MLAAttentionSpec(64, 1, 576, "bfloat16")}
    assert next(iter(specs.values())).page_size_bytes == 64 * 576 * 2


def test_whisper_large_v3() -> None:
    p = presets.get("whisper-large-v3")
    specs = p.layer_specs()
    assert (p.max_model_len, p.max_num_encoder_input_tokens) == (448, 1500)
    assert _kinds(specs) == {"full_attention": 32, "cross_attention": 32}
    assert list(specs)[:2] == [
        "model.decoder.layers.0.self_attn.attn",
        "model.decoder.layers.0.encoder_attn.attn",
    ]
    assert specs["model.decoder.layers.0.encoder_attn.attn"] == pk.CrossAttentionSpec(
        16, 20, 64, "bfloat16"
    )


def test_dtype_option() -> None:
    specs = presets.get("gpt-oss-120b").layer_specs(32, dtype="fp8")
    assert next(iter(specs.values())) == pk.SlidingWindowSpec(32, 8, 64, "fp8", 128)
    with pytest.raises(ValueError):
        presets.get("llama-3.1-8b").layer_specs(0)


#: (preset, layer_specs keywords, memory, config keywords, num_blocks, layers per
#: group, group kinds, tensors, tensor bytes, max concurrency, estimated max model len
#: for the preset's own max_model_len) -- all from vLLM 0.33.
PRESET_CASES: list[
    tuple[str, dict[str, Any], int, dict[str, Any], int, list[int], list[str], int, int, float, int]
] = [
    (
        "llama-3.1-8b",
        {},
        40 * GiB,
        {"max_model_len": 131072},
        20480,
        [32],
        ["full_attention"],
        32,
        1342177280,
        2.5,
        131072,
    ),
    (
        "llama-3.1-8b",
        {"dtype": "fp8"},
        40 * GiB,
        {"max_model_len": 131072},
        40960,
        [32],
        ["full_attention"],
        32,
        1342177280,
        5.0,
        131072,
    ),
    (
        "gemma-3-27b",
        {},
        40 * GiB,
        {"max_model_len": 131072, "max_in_flight_tokens": 8192},
        32768,
        [9, 9, 9, 9, 8, 8, 10],
        ["sliding_window"] * 6 + ["full_attention"],
        10,
        4294967296,
        2.8117384588982324,
        131072,
    ),
    (
        "gpt-oss-120b",
        {},
        40 * GiB,
        {"max_model_len": 131072, "max_in_flight_tokens": 16384},
        72817,
        [18, 18],
        ["sliding_window", "full_attention"],
        18,
        2386067456,
        7.893441734417344,
        131072,
    ),
    (
        "llama-4-scout",
        {},
        40 * GiB,
        {"max_model_len": 131072, "max_in_flight_tokens": 8192},
        54613,
        [12, 12, 12, 12],
        ["chunked_local_attention"] * 3 + ["full_attention"],
        12,
        3579117568,
        4.848455255681818,
        824656,
    ),
    (
        "jamba-1.5-mini",
        {},
        40 * GiB,
        {"max_model_len": 262144},
        32768,
        [4] * 8,
        ["mamba"] * 7 + ["full_attention"],
        4,
        10737418240,
        9.956852020662412,
        262144,
    ),
    (
        "jamba-1.5-mini",
        {"mamba_cache_mode": "none", "max_model_len": 65536},
        40 * GiB,
        {"max_model_len": 65536},
        32768,
        [4] * 8,
        ["mamba"] * 7 + ["full_attention"],
        4,
        10737418240,
        39.62273276904474,
        262144,
    ),
    (
        "deepseek-v3",
        {"block_size": 64},
        40 * GiB,
        {"max_model_len": 163840},
        9549,
        [61],
        ["mla_attention"],
        61,
        704028672,
        3.730078125,
        163840,
    ),
    (
        "whisper-large-v3",
        {},
        4 * GiB,
        {"max_model_len": 448, "max_num_encoder_input_tokens": 1500},
        1638,
        [32, 32],
        ["full_attention", "cross_attention"],
        32,
        134184960,
        13.426229508196721,
        448,
    ),
]


@pytest.mark.parametrize(
    (
        "name",
        "spec_kw",
        "memory",
        "config_kw",
        "num_blocks",
        "group_sizes",
        "kinds",
        "num_tensors",
        "tensor_size",
        "concurrency",
        "estimate",
    ),
    PRESET_CASES,
    ids=[f"{c[0]}-{i}" for i, c in enumerate(PRESET_CASES)],
)
def test_preset_configs_match_vllm(
    name: str,
    spec_kw: dict[str, Any],
    memory: int,
    config_kw: dict[str, Any],
    num_blocks: int,
    group_sizes: list[int],
    kinds: list[str],
    num_tensors: int,
    tensor_size: int,
    concurrency: float,
    estimate: int,
) -> None:
    p = presets.get(name)
    specs = p.layer_specs(**spec_kw)
    config = pk.get_kv_cache_config(specs, memory, **config_kw)
    assert config.num_blocks == num_blocks
    assert [len(g.layer_names) for g in config.kv_cache_groups] == group_sizes
    assert [g.kv_cache_spec.kind for g in config.kv_cache_groups] == kinds
    assert len(config.kv_cache_tensors) == num_tensors
    assert {t.size for t in config.kv_cache_tensors} == {tensor_size}
    assert pk.get_max_concurrency_for_kv_cache_config(config, **config_kw) == concurrency
    sizing = {k: v for k, v in config_kw.items() if k != "max_model_len"}
    assert (
        pk.estimate_max_model_len(specs, memory, max_model_len=p.max_model_len, **sizing)
        == estimate
    )
    # Every group spec has a core spec for the manager.
    for group in config.kv_cache_groups:
        core = group.kv_cache_spec.core_spec()
        assert core["kind"] == group.kv_cache_spec.kind
        assert core["block_size"] == group.kv_cache_spec.block_size


def test_gemma_3_groups_are_strided() -> None:
    specs = presets.get("gemma-3-27b").layer_specs()
    config = pk.get_kv_cache_config(
        specs, 40 * GiB, max_model_len=131072, max_in_flight_tokens=8192
    )
    index = {name: i for i, name in enumerate(specs)}
    first = [index[n] for n in config.kv_cache_groups[0].layer_names]
    assert first == [0, 7, 14, 21, 28, 36, 43, 50, 57]
    assert [index[n] for n in config.kv_cache_groups[-1].layer_names] == list(range(5, 62, 6))
    # Tensor i is shared by the i-th layer of each of the 7 groups (the last 2 local
    # groups have 8 layers, so tensor 8 has 5 local layers and 1 global one).
    assert [len(t.shared_by) for t in config.kv_cache_tensors] == [7] * 8 + [5, 1]


def test_llama_4_scout_needs_a_shorter_context_in_40_gib() -> None:
    p = presets.get("llama-4-scout")
    with pytest.raises(pk.NotEnoughKVCacheMemoryError) as info:
        pk.get_kv_cache_config(
            p.layer_specs(), 40 * GiB, max_model_len=p.max_model_len, max_in_flight_tokens=8192
        )
    assert info.value.estimated_max_model_len == 824640


@pytest.mark.parametrize("name", presets.names())
def test_preset_configs_drive_a_manager(name: str) -> None:
    p = presets.get(name)
    max_model_len = min(p.max_model_len, 32768)
    config = pk.get_kv_cache_config(
        p.layer_specs(),
        16 * GiB,
        max_model_len=max_model_len,
        max_in_flight_tokens=2048,
        max_num_encoder_input_tokens=p.max_num_encoder_input_tokens,
    )
    manager = pk.KVCacheManager(config, max_model_len=max_model_len, max_in_flight_tokens=2048)
    assert manager.num_kv_cache_groups == len(config.kv_cache_groups)
    if p.max_num_encoder_input_tokens is not None:
        return  # cross-attention requests carry encoder inputs; not exercised here
    manager.add_request("r0", list(range(400)))
    hit = manager.get_computed_blocks("r0")
    new = manager.allocate_slots("r0", 400, num_computed_tokens=0, new_computed_blocks=hit)
    assert new is not None and len(new) == len(config.kv_cache_groups)
    assert all(len(ids) > 0 for ids in new)
