"""Building KV-cache configs: grouping, block counts, shared tensors, memory checks.

Expected values come from vLLM 0.33 (``get_kv_cache_configs`` for one worker with the
layer-outermost layout, ``estimate_max_model_len``,
``get_max_concurrency_for_kv_cache_config``) run on the same specs, and from the vLLM
unit tests described in the reference notes (§8.2, §11.2). vLLM 0.33 describes a
tensor by its layers and byte offsets; the ``shared_by`` lists here are the layers
whose regions coincide (layer *i* of every group).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pagedkv as pk
import pytest
from pagedkv import config_builder as cb

F = pk.FullAttentionSpec
S = pk.SlidingWindowSpec
M = pk.MLAAttentionSpec
Ma = pk.MambaSpec


def spec(
    block_size: int = 16,
    num_kv_heads: int = 2,
    head_size: int = 64,
    dtype: str = "float32",
    sliding_window: int | None = None,
) -> pk.KVCacheSpec:
    """vLLM's test helper ``new_kv_cache_spec`` / ``new_sliding_window_spec``."""
    if sliding_window is None:
        return F(block_size, num_kv_heads, head_size, dtype)
    return S(block_size, num_kv_heads, head_size, dtype, sliding_window)


PAGE = 16384  # spec().page_size_bytes

Specs = dict[str, pk.KVCacheSpec]
Group = tuple[tuple[str, ...], str, int, int]  # layer names, kind, block size, page bytes
Tensor = tuple[int, tuple[str, ...]]  # size, shared_by

#: (id, specs, available memory, get_kv_cache_config keywords, num_blocks, groups, tensors)
CONFIG_CASES: list[
    tuple[str, Callable[[], Specs], int, dict[str, Any], int, list[Group], list[Tensor]]
] = [
    (
        "full-2-layers",
        lambda: {"layer_1": spec(), "layer_2": spec()},
        PAGE * 2 * 32,
        {"max_model_len": 16},
        32,
        [(("layer_1", "layer_2"), "full_attention", 16, PAGE)],
        [(PAGE * 32, ("layer_1",)), (PAGE * 32, ("layer_2",))],
    ),
    # Reference notes §8.2: 1 full + 1 SWA with memory for 64 pages -> one 64-block
    # tensor shared by both.
    (
        "full+swa",
        lambda: {"layer_1": spec(), "layer_2": spec(sliding_window=1)},
        PAGE * 2 * 32,
        {"max_model_len": 16},
        64,
        [(("layer_1",), "full_attention", 16, PAGE), (("layer_2",), "sliding_window", 16, PAGE)],
        [(PAGE * 64, ("layer_1", "layer_2"))],
    ),
    # Reference notes §8.2: 2 full + 4 SWA -> (l1, l2), (l3, l5), (l4, l6); two tensors
    # shared by (l1, l3, l4) and (l2, l5, l6).
    (
        "2full+4swa",
        lambda: {
            "layer_1": spec(),
            "layer_2": spec(),
            **{f"layer_{i}": spec(sliding_window=1) for i in range(3, 7)},
        },
        PAGE * 2 * 32,
        {"max_model_len": 16},
        32,
        [
            (("layer_1", "layer_2"), "full_attention", 16, PAGE),
            (("layer_3", "layer_5"), "sliding_window", 16, PAGE),
            (("layer_4", "layer_6"), "sliding_window", 16, PAGE),
        ],
        [
            (PAGE * 32, ("layer_1", "layer_3", "layer_4")),
            (PAGE * 32, ("layer_2", "layer_5", "layer_6")),
        ],
    ),
    (
        "2full+3swa-padded",
        lambda: {
            "l1": spec(),
            "l2": spec(),
            "l3": spec(sliding_window=1),
            "l4": spec(sliding_window=1),
            "l5": spec(sliding_window=1),
        },
        PAGE * 2 * 32,
        {"max_model_len": 16},
        32,
        [
            (("l1", "l2"), "full_attention", 16, PAGE),
            (("l3", "l5"), "sliding_window", 16, PAGE),
            (("l4",), "sliding_window", 16, PAGE),
        ],
        [(PAGE * 32, ("l1", "l3", "l4")), (PAGE * 32, ("l2", "l5"))],
    ),
    (
        "interleaved",
        lambda: {
            "l1": spec(),
            "l2": spec(sliding_window=1),
            "l3": spec(),
            "l4": spec(sliding_window=1),
        },
        PAGE * 2 * 32,
        {"max_model_len": 16},
        32,
        [(("l1", "l3"), "full_attention", 16, PAGE), (("l2", "l4"), "sliding_window", 16, PAGE)],
        [(PAGE * 32, ("l1", "l2")), (PAGE * 32, ("l3", "l4"))],
    ),
    # A smaller page takes a larger block size (unify_kv_cache_spec_page_size).
    (
        "unify-block-size",
        lambda: {"l1": spec(), "l2": spec(num_kv_heads=1, sliding_window=1)},
        PAGE * 32,
        {"max_model_len": 16},
        32,
        [(("l1",), "full_attention", 16, PAGE), (("l2",), "sliding_window", 32, PAGE)],
        [(PAGE * 32, ("l1", "l2"))],
    ),
    # One type, different head counts: one UniformTypeKVCacheSpecs group, a tensor per
    # layer.
    (
        "uniform-type",
        lambda: {"l1": spec(), "l2": spec(num_kv_heads=4)},
        PAGE * 3 * 32,
        {"max_model_len": 16},
        32,
        [(("l1", "l2"), "full_attention", 16, 3 * PAGE)],
        [(PAGE * 32, ("l1",)), (2 * PAGE * 32, ("l2",))],
    ),
    (
        "mla+full-uniform-type",
        lambda: {"m": M(16, 1, 576, "bfloat16"), "f": F(16, 8, 128, "bfloat16")},
        10**7,
        {"max_model_len": 16},
        119,
        [(("m", "f"), "full_attention", 16, 83968)],
        [(2193408, ("m",)), (7798784, ("f",))],
    ),
    # num_gpu_blocks_override = 16 (vLLM's test value).
    (
        "override",
        lambda: {"l1": spec(), "l2": spec(sliding_window=1)},
        PAGE * 64,
        {"max_model_len": 16, "num_gpu_blocks_override": 16},
        16,
        [(("l1",), "full_attention", 16, PAGE), (("l2",), "sliding_window", 16, PAGE)],
        [(PAGE * 16, ("l1", "l2"))],
    ),
    # gpt-oss + EAGLE: 12 SWA + 13 full -> groups of 13 (13 < 1.5 * 12), one padding slot.
    (
        "12swa+13full",
        lambda: {
            **{f"swa.{i}": spec(sliding_window=128) for i in range(12)},
            **{f"full.{i}": spec() for i in range(13)},
        },
        PAGE * 13 * 100,
        {"max_model_len": 16},
        100,
        [
            (tuple(f"swa.{i}" for i in range(12)), "sliding_window", 16, PAGE),
            (tuple(f"full.{i}" for i in range(13)), "full_attention", 16, PAGE),
        ],
        [*((PAGE * 100, (f"swa.{i}", f"full.{i}")) for i in range(12)), (PAGE * 100, ("full.12",))],
    ),
    # A Mamba page smaller than the attention page is padded to it.
    (
        "mamba-hybrid",
        lambda: {
            "attn.0": F(16, 2, 64, "bfloat16"),
            **{
                f"mamba.{i}": Ma(
                    16, ((64, 3), (64, 16)), ("bfloat16",) * 2, mamba_cache_mode="align"
                )
                for i in range(3)
            },
        },
        8192 * 30,
        {"max_model_len": 64},
        30,
        [
            (("attn.0",), "full_attention", 16, 8192),
            (("mamba.0",), "mamba", 16, 8192),
            (("mamba.1",), "mamba", 16, 8192),
            (("mamba.2",), "mamba", 16, 8192),
        ],
        [(8192 * 30, ("attn.0", "mamba.0", "mamba.1", "mamba.2"))],
    ),
    # An attention page that does not divide the largest page is padded.
    (
        "attention-padded",
        lambda: {"a": F(16, 3, 64, "float16"), "b": S(16, 2, 64, "float16", 8)},
        10**6,
        {"max_model_len": 100},
        81,
        [(("a",), "full_attention", 16, 12288), (("b",), "sliding_window", 16, 12288)],
        [(12288 * 81, ("a", "b"))],
    ),
    (
        "cross-attention",
        lambda: {
            "self.0": F(16, 20, 64, "bfloat16"),
            "cross.0": pk.CrossAttentionSpec(16, 20, 64, "bfloat16"),
        },
        81920 * 200,
        {"max_model_len": 448, "max_num_encoder_input_tokens": 1500},
        200,
        [(("self.0",), "full_attention", 16, 81920), (("cross.0",), "cross_attention", 16, 81920)],
        [(81920 * 200, ("self.0", "cross.0"))],
    ),
]


@pytest.mark.parametrize(
    ("make", "memory", "kwargs", "num_blocks", "groups", "tensors"),
    [c[1:] for c in CONFIG_CASES],
    ids=[c[0] for c in CONFIG_CASES],
)
def test_get_kv_cache_config_matches_vllm(
    make: Callable[[], Specs],
    memory: int,
    kwargs: dict[str, Any],
    num_blocks: int,
    groups: list[Group],
    tensors: list[Tensor],
) -> None:
    config = pk.get_kv_cache_config(make(), memory, **kwargs)
    assert config.num_blocks == num_blocks
    assert [
        (
            tuple(g.layer_names),
            g.kv_cache_spec.kind,
            g.kv_cache_spec.block_size,
            g.kv_cache_spec.page_size_bytes,
        )
        for g in config.kv_cache_groups
    ] == groups
    assert [(t.size, tuple(t.shared_by)) for t in config.kv_cache_tensors] == tensors
    # Every layer is in exactly one group and one tensor.
    layers = sorted(make())
    assert sorted(n for g in config.kv_cache_groups for n in g.layer_names) == layers
    assert sorted(n for t in config.kv_cache_tensors for n in t.shared_by) == layers


def test_groups_keep_merged_specs() -> None:
    specs = {"a": spec(), "b": spec(sliding_window=4)}
    groups = pk.get_kv_cache_groups(specs)
    assert [g.kv_cache_spec for g in groups] == [spec(), spec(sliding_window=4)]
    assert pk.get_kv_cache_groups({}) == []
    uniform = pk.get_kv_cache_groups({"a": spec(), "b": spec(num_kv_heads=4)})
    assert isinstance(uniform[0].kv_cache_spec, pk.UniformTypeKVCacheSpecs)
    assert uniform[0].kv_cache_spec.core_spec() == {"kind": "full_attention", "block_size": 16}


def test_full_and_sink_layers_merge_into_full_attention() -> None:
    # vLLM quirk kept: FullAttentionSpec.merge accepts sink layers.
    groups = pk.get_kv_cache_groups(
        {"a": spec(), "b": pk.SinkFullAttentionSpec(16, 2, 64, "float32", 16)}
    )
    assert len(groups) == 1 and groups[0].kv_cache_spec == spec()


def test_strided_group_assignment_of_gemma3_pattern() -> None:
    # 5 local : 1 global over 12 layers -> 2 full layers, groups of 2.
    specs = {f"l{i}": spec() if i % 6 == 5 else spec(sliding_window=8) for i in range(12)}
    groups = pk.get_kv_cache_groups(specs)
    # Buckets in first-seen order (local first); local layers[i::5] per group.
    assert [g.layer_names for g in groups] == [
        ("l0", "l6"),
        ("l1", "l7"),
        ("l2", "l8"),
        ("l3", "l9"),
        ("l4", "l10"),
        ("l5", "l11"),
    ]
    assert [g.kv_cache_spec.kind for g in groups] == ["sliding_window"] * 5 + ["full_attention"]


def test_unify_page_size_rules() -> None:
    unified = cb.unify_kv_cache_spec_page_size(
        {
            "big": spec(num_kv_heads=4),
            "half": spec(),
            "odd": F(16, 3, 64, "float32"),
            "mamba": Ma(16, ((10,),), ("float32",)),
        }
    )
    assert unified["big"] == spec(num_kv_heads=4)
    assert unified["half"] == spec(block_size=32)
    assert unified["odd"] == F(16, 3, 64, "float32", page_size_padded=2 * PAGE)
    assert unified["mamba"] == Ma(16, ((10,),), ("float32",), page_size_padded=2 * PAGE)
    with pytest.raises(pk.InvalidConfigError, match="cannot be padded"):
        cb.unify_kv_cache_spec_page_size({"a": spec(), "m": M(16, 1, 100, "float32")})
    assert cb.get_uniform_page_size(unified.values()) == 2 * PAGE
    with pytest.raises(pk.InvalidConfigError):
        cb.get_uniform_page_size([spec(), spec(num_kv_heads=4)])
    assert cb.is_kv_cache_spec_uniform({})
    assert not cb.is_kv_cache_spec_uniform({"a": spec(), "b": spec(num_kv_heads=4)})


@pytest.mark.parametrize(("max_model_len", "expected"), [(16385, 16384), (16383, 16383)])
def test_estimate_max_model_len_qwen1_5_7b(max_model_len: int, expected: int) -> None:
    # vLLM's test_estimate_max_model_len: Qwen1.5-7B (32 layers, 32 KV heads of 128,
    # fp16) in 8 GiB: 512 KiB per token -> 16,384 tokens.
    specs = {f"layer_{i}": F(16, 32, 128, "float16") for i in range(32)}
    assert pk.estimate_max_model_len(specs, 8 << 30, max_model_len=max_model_len) == expected


def test_estimate_max_model_len_edges() -> None:
    specs = {"a": spec()}
    assert pk.estimate_max_model_len(specs, PAGE - 1, max_model_len=100) == 0
    assert pk.estimate_max_model_len(specs, PAGE, max_model_len=100) == 16
    # SWA memory stops growing past the window: the whole max_model_len fits.
    swa = {"a": spec(sliding_window=16)}
    assert (
        pk.estimate_max_model_len(swa, PAGE * 4, max_model_len=10**6, max_in_flight_tokens=32)
        == 10**6
    )


def test_get_max_concurrency_for_kv_cache_config_vllm_cases() -> None:
    # vLLM's test: Qwen1.5-7B, max_model_len 16384, 1024 batched tokens, window 1024.
    full = F(16, 32, 128, "float16")
    swa = S(16, 32, 128, "float16", 1024)
    kw: dict[str, Any] = {"max_model_len": 16384, "max_in_flight_tokens": 1024}
    layers = [f"layer_{i}" for i in range(32)]
    config_full = pk.KVCacheConfig(int(1024 * 1.5), [pk.KVCacheGroupSpec(layers, full)])
    assert pk.get_max_concurrency_for_kv_cache_config(config_full, **kw) == 1.5
    config_swa = pk.KVCacheConfig(129 * 3, [pk.KVCacheGroupSpec(layers, swa)])
    assert pk.get_max_concurrency_for_kv_cache_config(config_swa, **kw) == 3
    config_hybrid = pk.KVCacheConfig(
        (1024 + 129) * 3,
        [
            pk.KVCacheGroupSpec(layers, full),
            pk.KVCacheGroupSpec([f"layer_{i}" for i in range(32, 64)], swa),
        ],
    )
    assert pk.get_max_concurrency_for_kv_cache_config(config_hybrid, **kw) == 3
    assert pk.get_kv_cache_capacity(config_hybrid, **kw) == (3 * 16384, 3.0)


def test_not_enough_memory_error_has_the_numbers() -> None:
    specs = {f"layer_{i}": F(16, 32, 128, "float16") for i in range(32)}
    # 8 GiB holds 16,384 tokens but one block is kept for the null block.
    with pytest.raises(pk.NotEnoughKVCacheMemoryError) as info:
        pk.get_kv_cache_config(specs, 8 << 30, max_model_len=16384)
    err = info.value
    assert isinstance(err, pk.InvalidConfigError) and isinstance(err, ValueError)
    assert err.max_model_len == 16384
    assert err.needed_memory == 8 << 30
    assert err.available_memory == (8 << 30) - 32 * 262144
    assert err.estimated_max_model_len == 16368
    message = str(err)
    assert "max seq len (16384)" in message
    assert "8.0 GiB (8589934592 bytes)" in message
    assert "7.99 GiB, 8581545984 bytes" in message
    assert "the estimated maximum model length is 16368" in message
    # The same numbers from the public check (per-layer sums).
    with pytest.raises(
        pk.NotEnoughKVCacheMemoryError, match="estimated maximum model length is 16368"
    ):
        pk.check_enough_kv_cache_memory(specs, 8 << 30, max_model_len=16384)
    pk.check_enough_kv_cache_memory(specs, (8 << 30) + 32 * 262144, max_model_len=16384)
    config = pk.get_kv_cache_config(specs, 8 << 30, max_model_len=16368)
    assert config.num_blocks == 1024


def test_no_memory_and_padding_in_the_check() -> None:
    with pytest.raises(pk.NotEnoughKVCacheMemoryError, match="No available memory"):
        pk.get_kv_cache_config({"a": spec()}, PAGE, max_model_len=16)
    with pytest.raises(pk.NotEnoughKVCacheMemoryError, match="No available memory"):
        pk.check_enough_kv_cache_memory({"a": spec()}, 0, max_model_len=16)
    pk.check_enough_kv_cache_memory({}, 0, max_model_len=16)
    # 2 full + 3 SWA: the groups (with the padding slot) need 3 blocks of 2 pages per
    # request of 16 tokens (the SWA group needs 2 blocks); layer by layer it is 8 pages.
    specs = {
        "l1": spec(),
        "l2": spec(),
        "l3": spec(sliding_window=1),
        "l4": spec(sliding_window=1),
        "l5": spec(sliding_window=1),
    }
    with pytest.raises(pk.NotEnoughKVCacheMemoryError) as info:
        pk.get_kv_cache_config(specs, PAGE * 2 * 5, max_model_len=16)
    assert info.value.needed_memory == PAGE * 2 * 5
    assert info.value.available_memory == PAGE * 2 * 4
    pk.get_kv_cache_config(specs, PAGE * 2 * 6, max_model_len=16)


def test_max_memory_usage_bytes_sums_layers() -> None:
    specs = [spec(), spec(sliding_window=16)]
    assert cb.max_memory_usage_bytes(specs, max_model_len=64, max_in_flight_tokens=16) == (
        4 * PAGE + 3 * PAGE
    )


def test_invalid_arguments() -> None:
    with pytest.raises(pk.InvalidConfigError, match="no KV-cache layers"):
        pk.get_kv_cache_config({}, 1 << 30, max_model_len=16)
    with pytest.raises(pk.InvalidConfigError, match="max_model_len"):
        pk.get_kv_cache_config({"a": spec()}, 1 << 30, max_model_len=0)
    with pytest.raises(pk.InvalidConfigError, match="available_memory"):
        pk.get_kv_cache_config({"a": spec()}, -1, max_model_len=16)
    with pytest.raises(pk.InvalidConfigError, match="num_gpu_blocks_override"):
        pk.get_kv_cache_config({"a": spec()}, 1 << 30, max_model_len=16, num_gpu_blocks_override=0)
    with pytest.raises(pk.InvalidConfigError, match="max_in_flight_tokens"):
        pk.get_kv_cache_config({"a": spec()}, 1 << 30, max_model_len=16, max_in_flight_tokens=0)
    with pytest.raises(pk.InvalidConfigError, match="max_num_encoder_input_tokens"):
        pk.get_kv_cache_config(
            {"c": pk.CrossAttentionSpec(16, 1, 1, "float16")}, 1 << 30, max_model_len=16
        )
    with pytest.raises(TypeError):
        pk.get_kv_cache_config([spec()], 1 << 30, max_model_len=16)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pk.get_kv_cache_config({"a": "full"}, 1 << 30, max_model_len=16)  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        pk.get_max_concurrency_for_kv_cache_config("config", max_model_len=16)  # type: ignore[arg-type]
    with pytest.raises(pk.InvalidConfigError):
        cb.get_kv_cache_config_from_groups([], 1 << 30)
    with pytest.raises(pk.InvalidConfigError, match="hold no block"):
        cb.get_kv_cache_config_from_groups(pk.get_kv_cache_groups({"a": spec()}), PAGE - 1)


def test_config_from_groups_without_check() -> None:
    groups = pk.get_kv_cache_groups({"a": spec(), "b": spec(sliding_window=2)})
    config = cb.get_kv_cache_config_from_groups(groups, PAGE * 10 + 5)
    assert config.num_blocks == 10
    assert [(t.size, t.shared_by) for t in config.kv_cache_tensors] == [(PAGE * 10, ("a", "b"))]
    config = cb.get_kv_cache_config_from_groups(groups, 0, num_gpu_blocks_override=3)
    assert config.num_blocks == 3


def test_config_drives_a_manager() -> None:
    specs = {f"layers.{i}": F(16, 8, 128, "bfloat16") for i in range(4)}
    config = pk.get_kv_cache_config(specs, 64 * 4 * 65536, max_model_len=512)
    assert config.num_blocks == 64
    manager = pk.KVCacheManager(config, max_model_len=512)
    assert manager.kv_cache_config is config


def test_error_message_estimate_matches_groups() -> None:
    # The estimate in get_kv_cache_config's message counts blocks per group, like
    # vLLM's _estimate_max_model_len_from_groups.
    specs = {"l1": spec(), "l2": spec(), "l3": spec(sliding_window=1)}
    with pytest.raises(pk.NotEnoughKVCacheMemoryError) as info:
        pk.get_kv_cache_config(specs, PAGE * 2 * 10, max_model_len=1000)
    match = re.search(r"estimated maximum model length is (\d+)", str(info.value))
    assert match is not None and int(match.group(1)) == info.value.estimated_max_model_len == 96
