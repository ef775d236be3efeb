"""Per-layer KV-cache specs: page sizes, memory bounds, core specs, validation.

The expected page sizes and ``max_memory_usage_bytes`` values were computed with
vLLM 0.33's ``vllm/v1/kv_cache_interface.py`` (same fields, ``max_in_flight_tokens``
and ``max_num_encoder_input_tokens`` set on the config), except where a test says
otherwise.
"""

from __future__ import annotations

import dataclasses

import pagedkv as pk
import pytest
from pagedkv.specs import dtype_size

F = pk.FullAttentionSpec
S = pk.SlidingWindowSpec
C = pk.ChunkedLocalAttentionSpec
M = pk.MLAAttentionSpec
X = pk.CrossAttentionSpec
K = pk.SinkFullAttentionSpec
Ma = pk.MambaSpec

#: (max_model_len, max_in_flight_tokens, max_num_encoder_input_tokens)
SIZINGS = [
    (16384, 1024, 1500),
    (16384, None, 1500),
    (100, 8, 1500),
    (1, None, 16),
    (131072, 8192, 448),
]

#: (id, spec, page_size_bytes, max_memory_usage_bytes for each of SIZINGS) from vLLM 0.33.
SPEC_CASES: list[tuple[str, pk.KVCacheSpec, int, list[int]]] = [
    (
        "full-qwen1.5-7b",
        F(16, 32, 128, "float16"),
        262144,
        [268435456, 268435456, 1835008, 262144, 2147483648],
    ),
    (
        "full-llama3-8b",
        F(16, 8, 128, "bfloat16"),
        65536,
        [67108864, 67108864, 458752, 65536, 536870912],
    ),
    ("full-fp8", F(16, 8, 128, "fp8"), 32768, [33554432, 33554432, 229376, 32768, 268435456]),
    (
        "full-head-size-v",
        F(16, 8, 128, "float32", head_size_v=64),
        98304,
        [100663296, 100663296, 688128, 98304, 805306368],
    ),
    (
        "full-padded",
        F(16, 8, 128, "bfloat16", page_size_padded=100000),
        100000,
        [102400000, 102400000, 700000, 100000, 819200000],
    ),
    ("mla-16", M(16, 1, 576, "bfloat16"), 18432, [18874368, 18874368, 129024, 18432, 150994944]),
    ("mla-64", M(64, 1, 576, "bfloat16"), 73728, [18874368, 18874368, 147456, 73728, 150994944]),
    (
        "swa-1024-fp16",
        S(16, 32, 128, "float16", 1024),
        262144,
        [33816576, 268697600, 2097152, 524288, 151257088],
    ),
    (
        "swa-gemma3",
        S(16, 16, 128, "bfloat16", 1024),
        131072,
        [16908288, 134348800, 1048576, 262144, 75628544],
    ),
    (
        "swa-gpt-oss",
        S(16, 8, 64, "bfloat16", 128),
        32768,
        [2392064, 33587200, 262144, 65536, 17072128],
    ),
    ("swa-small", S(4, 1, 64, "float32", 4), 2048, [528384, 8390656, 8192, 4096, 4198400]),
    (
        "chunked-llama4",
        C(16, 8, 128, "bfloat16", 8192),
        65536,
        [37748736, 67108864, 458752, 65536, 67108864],
    ),
    ("chunked-small", C(2, 1, 64, "float32", 4), 1024, [526336, 8388608, 6144, 1024, 4196352]),
    (
        "cross-whisper",
        X(16, 20, 64, "bfloat16"),
        81920,
        [7700480, 7700480, 7700480, 81920, 2293760],
    ),
    ("sink", K(16, 8, 128, "bfloat16", 32), 65536, [67108864, 67108864, 458752, 65536, 536870912]),
    (
        "mamba-jamba-align",
        Ma(80, ((8192, 3), (8192, 16)), ("bfloat16", "bfloat16"), mamba_cache_mode="align"),
        311296,
        [622592] * 5,
    ),
    (
        "mamba-padded-spec2",
        Ma(
            80,
            ((8192, 3), (8192, 16)),
            ("bfloat16", "bfloat16"),
            mamba_cache_mode="align",
            page_size_padded=327680,
            num_speculative_blocks=2,
        ),
        327680,
        [1310720] * 5,
    ),
    (
        "mamba2-none",
        Ma(2048, ((3, 10240), (128, 64, 128)), ("bfloat16", "float32")),
        4255744,
        [4255744] * 5,
    ),
]


@pytest.mark.parametrize(
    ("spec", "page", "max_memory"), [c[1:] for c in SPEC_CASES], ids=[c[0] for c in SPEC_CASES]
)
def test_page_size_and_max_memory_usage_match_vllm(
    spec: pk.KVCacheSpec, page: int, max_memory: list[int]
) -> None:
    assert spec.page_size_bytes == page
    got = [
        spec.max_memory_usage_bytes(mml, inflight, max_num_encoder_input_tokens=enc)
        for mml, inflight, enc in SIZINGS
    ]
    assert got == max_memory


def test_sliding_window_blocks_per_request_of_the_vllm_concurrency_test() -> None:
    # vLLM's test_get_max_concurrency_for_kv_cache_config: window 1024, 1024 batched
    # tokens, 16-token blocks -> 129 blocks per request (1023 + 1024 tokens + 1).
    spec = S(16, 32, 128, "float16", 1024)
    assert spec.max_admission_blocks_per_request(1024, 16384) == 129
    assert spec.max_memory_usage_bytes(16384, 1024) == 129 * spec.page_size_bytes
    # Capped by max_model_len: cdiv(100, 16) + 1.
    assert spec.max_admission_blocks_per_request(1024, 100) == 8
    # window 4, block 4: a 4-token window [CDEF] may straddle two blocks.
    assert S(4, 1, 1, "float32", 4).max_admission_blocks_per_request(1, 100) == 2


def test_chunked_local_blocks_per_request() -> None:
    spec = C(16, 8, 128, "bfloat16", 8192)
    assert spec.max_admission_blocks_per_request(8192, 131072) == 1024
    assert spec.max_admission_blocks_per_request(1, 100) == 7
    assert spec.max_admission_blocks_per_request(2048, 1 << 20) == 640


def test_max_in_flight_tokens_none_means_max_model_len() -> None:
    spec = S(16, 8, 64, "bfloat16", 128)
    assert spec.max_memory_usage_bytes(4096) == spec.max_memory_usage_bytes(4096, 4096)
    assert spec.max_memory_usage_bytes(4096) == (4096 // 16 + 1) * spec.page_size_bytes


def test_mamba_memory_by_mode() -> None:
    shapes, dtypes = ((4, 8), (16,)), ("float32", "float16")
    page = 4 * 8 * 4 + 16 * 2
    none = Ma(16, shapes, dtypes)
    align = Ma(16, shapes, dtypes, mamba_cache_mode="align", num_speculative_blocks=3)
    assert none.page_size_bytes == page
    assert none.max_memory_usage_bytes(1000) == page
    assert Ma(16, shapes, dtypes, num_speculative_blocks=2).max_memory_usage_bytes(1) == 3 * page
    assert align.max_memory_usage_bytes(1000) == (2 + 3) * page
    # "all" (a state per block) is not a vLLM 0.33 mode; sized like vLLM before it:
    # one page per block of max_model_len.
    all_ = Ma(16, shapes, dtypes, mamba_cache_mode="all")
    assert all_.max_memory_usage_bytes(1000) == 63 * page


def test_cross_attention_needs_the_encoder_length() -> None:
    spec = X(16, 20, 64, "bfloat16")
    with pytest.raises(pk.InvalidConfigError, match="max_num_encoder_input_tokens"):
        spec.max_memory_usage_bytes(448)
    assert spec.max_memory_usage_bytes(448, max_num_encoder_input_tokens=1500) == 94 * 81920


def test_mla_has_no_v() -> None:
    spec = M(16, 1, 576, "bfloat16")
    assert spec.head_size_v == 0
    assert spec.page_size_bytes == 16 * 576 * 2
    # DeepSeek-V3: 61 layers x 576 x 2 bytes = 70,272 bytes per token.
    assert 61 * M(1, 1, 576, "bfloat16").page_size_bytes == 70272


def test_kinds() -> None:
    assert F(16, 1, 1, "float16").kind == "full_attention"
    assert M(16, 1, 1, "float16").kind == "mla_attention"
    assert S(16, 1, 1, "float16", 4).kind == "sliding_window"
    assert C(16, 1, 1, "float16", 16).kind == "chunked_local_attention"
    assert X(16, 1, 1, "float16").kind == "cross_attention"
    assert K(16, 1, 1, "float16", 16).kind == "sink_full_attention"
    assert Ma(16, ((1,),), ("float16",)).kind == "mamba"


def test_core_specs() -> None:
    assert F(16, 8, 128, "bfloat16").core_spec() == {"kind": "full_attention", "block_size": 16}
    assert M(64, 1, 576, "bfloat16").core_spec() == {"kind": "mla_attention", "block_size": 64}
    assert S(16, 8, 64, "bfloat16", 128).core_spec() == {
        "kind": "sliding_window",
        "block_size": 16,
        "sliding_window": 128,
    }
    assert C(16, 8, 128, "bfloat16", 8192).core_spec() == {
        "kind": "chunked_local_attention",
        "block_size": 16,
        "attention_chunk_size": 8192,
    }
    assert X(16, 20, 64, "bfloat16").core_spec() == {"kind": "cross_attention", "block_size": 16}
    assert K(16, 8, 128, "bfloat16", 32).core_spec() == {
        "kind": "sink_full_attention",
        "block_size": 16,
        "sink_len": 32,
    }
    assert Ma(
        80, ((3, 4),), ("bfloat16",), mamba_cache_mode="align", num_speculative_blocks=2
    ).core_spec() == {
        "kind": "mamba",
        "block_size": 80,
        "mamba_cache_mode": "align",
        "num_speculative_blocks": 2,
    }
    assert Ma(80, ((3, 4),), ("bfloat16",)).core_spec()["mamba_cache_mode"] == "none"


def test_positional_fields_in_vllm_order() -> None:
    assert S(16, 8, 64, "bfloat16", 128) == pk.SlidingWindowSpec(
        block_size=16, num_kv_heads=8, head_size=64, dtype="bfloat16", sliding_window=128
    )
    assert C(16, 8, 128, "bfloat16", 8192).attention_chunk_size == 8192
    assert K(16, 8, 128, "bfloat16", 32).sink_len == 32
    mamba = Ma(16, [[3, 4]], ["float32"])
    assert mamba.shapes == ((3, 4),) and mamba.dtypes == ("float32",)
    with pytest.raises(TypeError):
        F(16, 8, 128, "bfloat16", 64)  # type: ignore[misc]  # head_size_v is keyword-only


class _FakeTorchDtype:
    """Stands in for ``torch.float16`` (torch is not a dependency)."""

    def __init__(self, name: str, itemsize: int) -> None:
        self.name, self.itemsize = name, itemsize

    def __str__(self) -> str:
        return f"torch.{self.name}"


class _OddDtype:
    itemsize = 3


def test_dtypes() -> None:
    assert dtype_size("bfloat16") == 2
    assert dtype_size("torch.float32") == 4
    assert dtype_size("fp8") == 1
    assert dtype_size(_FakeTorchDtype("float16", 2)) == 2
    # torch.float16 and "float16" make equal specs (they group together).
    assert F(16, 8, 128, _FakeTorchDtype("float16", 2)) == F(16, 8, 128, "float16")
    assert F(16, 8, 128, "torch.bfloat16").dtype == "bfloat16"
    assert Ma(16, ((2,),), (_FakeTorchDtype("float32", 4),)).dtypes == ("float32",)
    odd = F(16, 1, 1, _OddDtype())
    assert odd.page_size_bytes == 2 * 16 * 3
    for bad in ("float13", None, 2):
        with pytest.raises(ValueError, match="unknown dtype"):
            F(16, 8, 128, bad)


@pytest.mark.parametrize(
    "make",
    [
        lambda: F(0, 8, 128, "float16"),
        lambda: F(16, 0, 128, "float16"),
        lambda: F(16, 8, -1, "float16"),
        lambda: F(16, 8, 128, "float16", page_size_padded=10),
        lambda: F(True, 8, 128, "float16"),
        lambda: S(16, 8, 128, "float16", 0),
        lambda: C(16, 8, 128, "float16", 0),
        lambda: K(16, 8, 128, "float16", 0),
        lambda: Ma(16, ((3, 4),), ("float16", "float16")),
        lambda: Ma(16, (), ()),
        lambda: Ma(16, ((0,),), ("float16",)),
        lambda: Ma(16, "ab", ("float16",)),
        lambda: Ma(16, ((3, 4),), ("float16",), mamba_cache_mode="everything"),
        lambda: Ma(16, ((3, 4),), ("float16",), num_speculative_blocks=-1),
        lambda: Ma(16, ((3, 4),), ("float16",), page_size_padded=23),
    ],
    ids=[
        "block_size",
        "heads",
        "head_size",
        "padded",
        "bool",
        "window",
        "chunk",
        "sink",
        "mamba-lengths",
        "mamba-empty",
        "mamba-zero",
        "mamba-str",
        "mamba-mode",
        "mamba-spec",
        "mamba-padded",
    ],
)
def test_invalid_specs_raise(make: object) -> None:
    with pytest.raises(ValueError):
        make()  # type: ignore[operator]


def test_bad_sizing_arguments() -> None:
    spec = S(16, 8, 64, "bfloat16", 128)
    with pytest.raises(ValueError, match="max_model_len"):
        spec.max_memory_usage_bytes(0)
    with pytest.raises(ValueError, match="max_in_flight_tokens"):
        spec.max_memory_usage_bytes(100, 0)
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens"):
        X(16, 1, 1, "float16").max_memory_usage_bytes(100, max_num_encoder_input_tokens=0)


def test_specs_are_frozen_and_hashable() -> None:
    spec = S(16, 8, 64, "bfloat16", 128)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.sliding_window = 4  # type: ignore[misc]
    assert len({spec, S(16, 8, 64, "bfloat16", 128), F(16, 8, 64, "bfloat16")}) == 2
    assert spec.copy_with_new_block_size(32) == S(32, 8, 64, "bfloat16", 128)
    assert hash(Ma(16, [[3, 4]], ["float32"])) == hash(Ma(16, ((3, 4),), ("float32",)))


def test_merge_follows_vllm() -> None:
    full, sink = F(16, 8, 128, "bfloat16"), K(16, 8, 128, "bfloat16", 32)
    # FullAttentionSpec.merge accepts sinks (they are FullAttentionSpecs) and builds a
    # FullAttentionSpec; SinkFullAttentionSpec.merge keeps the first sink_len.
    assert F.merge([full, sink]) == full
    assert K.merge([sink, full]) == sink
    assert K.merge([sink, K(16, 8, 128, "bfloat16", 64)]).sink_len == 32
    for specs in (
        [full, M(16, 8, 128, "bfloat16")],
        [full, F(16, 4, 128, "bfloat16")],
        [full, S(16, 8, 128, "bfloat16", 4)],
    ):
        with pytest.raises(ValueError):
            type(specs[0]).merge(specs)
    with pytest.raises(ValueError):
        M.merge([M(16, 1, 576, "bfloat16"), full])
    swa = S(16, 8, 128, "bfloat16", 4)
    assert S.merge([swa, S(16, 8, 128, "bfloat16", 4)]) == swa
    with pytest.raises(ValueError):
        S.merge([swa, S(16, 8, 128, "bfloat16", 8)])


def test_uniform_type_specs() -> None:
    a, b = F(16, 8, 128, "bfloat16"), F(16, 4, 128, "bfloat16")
    mla = M(16, 1, 576, "bfloat16")
    u = pk.UniformTypeKVCacheSpecs.from_specs({"a": a, "b": b, "m": mla})
    assert u is not None
    assert u.kind == "full_attention"  # full + MLA: one type, vLLM reports full attention
    assert u.core_spec() == {"kind": "full_attention", "block_size": 16}
    assert u.page_size_bytes == a.page_size_bytes + b.page_size_bytes + mla.page_size_bytes
    assert u.max_memory_usage_pages(1000) == 63
    assert u.max_memory_usage_bytes(1000) == 63 * u.page_size_bytes
    assert hash(u) == hash(pk.UniformTypeKVCacheSpecs(16, {"a": a, "b": b, "m": mla}))
    swa = pk.UniformTypeKVCacheSpecs(
        16, {"x": S(16, 8, 64, "bfloat16", 128), "y": S(16, 2, 64, "bfloat16", 128)}
    )
    assert swa.kind == "sliding_window"
    assert swa.core_spec() == {"kind": "sliding_window", "block_size": 16, "sliding_window": 128}
    assert swa.copy_with_new_block_size(32).first_spec == S(32, 8, 64, "bfloat16", 128)
    # Not one type: different windows, block sizes, full + SWA, Mamba pages.
    assert (
        pk.UniformTypeKVCacheSpecs.from_specs(
            {"x": S(16, 8, 64, "bfloat16", 128), "y": S(16, 8, 64, "bfloat16", 64)}
        )
        is None
    )
    assert pk.UniformTypeKVCacheSpecs.from_specs({"a": a, "c": F(32, 8, 128, "bfloat16")}) is None
    assert (
        pk.UniformTypeKVCacheSpecs.from_specs({"a": a, "s": S(16, 8, 128, "bfloat16", 8)}) is None
    )
    assert (
        pk.UniformTypeKVCacheSpecs.from_specs(
            {"x": Ma(16, ((2,),), ("float32",)), "y": Ma(16, ((4,),), ("float32",))}
        )
        is None
    )
    assert pk.UniformTypeKVCacheSpecs.from_specs({}) is None
    with pytest.raises(ValueError, match="one type"):
        pk.UniformTypeKVCacheSpecs(16, {"a": a, "s": S(16, 8, 128, "bfloat16", 8)})
    with pytest.raises(ValueError, match="block_size"):
        pk.UniformTypeKVCacheSpecs(32, {"a": a})
    with pytest.raises(ValueError, match="non-empty"):
        pk.UniformTypeKVCacheSpecs(16, {})
    with pytest.raises(TypeError):
        pk.UniformTypeKVCacheSpecs(16, {"u": u})


def test_group_tensor_and_config_containers() -> None:
    spec = F(16, 8, 128, "bfloat16")
    group = pk.KVCacheGroupSpec(["a", "b"], spec)
    assert group.layer_names == ("a", "b")
    tensor = pk.KVCacheTensor(size=1024, shared_by=["a"])
    assert tensor.shared_by == ("a",)
    with pytest.raises(TypeError):
        pk.KVCacheTensor(size=1, shared_by="a")
    with pytest.raises(TypeError):
        pk.KVCacheGroupSpec("a", spec)
    config = pk.KVCacheConfig(10, [group], [tensor])
    assert config.kv_cache_groups == (group,) and config.kv_cache_tensors == (tensor,)
    with pytest.raises(ValueError):
        pk.KVCacheConfig(0, [group])
    with pytest.raises(ValueError):
        pk.KVCacheConfig(10, [])
