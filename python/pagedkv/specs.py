"""KV-cache specs and configs, shaped like vLLM's (``vllm/v1/kv_cache_interface.py``).

One spec describes the KV cache of one layer: how many tokens a block holds
(``block_size``), how many bytes one block of that layer takes
(``page_size_bytes``), and how many bytes one request can need at most
(``max_memory_usage_bytes``, the startup check). ``core_spec()`` is what the
Rust manager reads: the spec's kind (vLLM's ``KVCacheSpecKind`` value), its
block size and the fields that change the manager's rules (window, chunk,
Mamba mode, sinks).

Field names and positional order follow vLLM 0.33; optional fields
(``head_size_v``, ``page_size_padded``, Mamba's mode...) are keyword-only. A
``dtype`` is a name ("float16", "bfloat16", "float32", "fp8", ...) or anything
with an ``itemsize`` and a ``torch.``-style name (``torch.float16``,
``numpy.dtype("float16")``); known dtypes are stored by their name, so
``torch.float16`` and ``"float16"`` give equal specs.

Sizing arguments that vLLM reads from its ``VllmConfig``:

* ``max_model_len``: the longest request (prompt + output) in tokens.
* ``max_in_flight_tokens``: tokens scheduled but not yet settled, vLLM's
  ``VllmConfig.max_in_flight_tokens`` = ``max_num_batched_tokens`` x concurrent
  batches (2 with async scheduling). Sliding-window and chunked-local layers hold
  at most the window plus these. ``None``: ``max_model_len``, as vLLM's
  ``KVCacheManager`` does when it is not given (the bound is then
  ``max_model_len``).
* ``max_num_encoder_input_tokens``: encoder output length for cross-attention
  (vLLM's ``scheduler_config.max_num_encoder_input_tokens``; 1500 for Whisper).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, cast

from ._util import cdiv
from .errors import InvalidConfigError

__all__ = [
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "CircularBufferSpec",
    "CrossAttentionSpec",
    "EngineManagedSpec",
    "FullAttentionSpec",
    "HiSparseHotSpec",
    "HiSparseResidentSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "MambaSpec",
    "SinkFullAttentionSpec",
    "SlidingWindowSpec",
    "UniformTypeKVCacheSpecs",
    "dtype_size",
]

_DTYPE_SIZES = {
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float32": 4,
    "float": 4,
    "float64": 8,
    "double": 8,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
}

_MAMBA_CACHE_MODES = ("none", "align", "all")

_SpecT = TypeVar("_SpecT", bound="KVCacheSpec")


def dtype_size(dtype: Any) -> int:
    """Bytes per element of ``dtype``: a name ("float16", "bfloat16", "float32", "fp8")
    or anything with an ``itemsize`` (``torch.dtype``, ``numpy.dtype``)."""
    if isinstance(dtype, str):
        try:
            return _DTYPE_SIZES[dtype.removeprefix("torch.")]
        except KeyError:
            raise InvalidConfigError(f"unknown dtype {dtype!r}") from None
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int) and not isinstance(itemsize, bool) and itemsize > 0:
        return itemsize
    raise InvalidConfigError(f"unknown dtype {dtype!r}")


def _canonical_dtype(dtype: Any) -> Any:
    """The dtype as stored in a spec: a known name stays a name, ``torch.float16`` /
    ``numpy.dtype("float16")`` become ``"float16"``; anything else with an
    ``itemsize`` is kept as given. Raises ``InvalidConfigError`` (a ``ValueError``)
    for an unknown dtype."""
    dtype_size(dtype)
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    name = str(dtype).removeprefix("torch.")
    return name if name in _DTYPE_SIZES else dtype


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidConfigError(f"{name} must be a positive int, got {value!r}")


def _check_non_negative_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidConfigError(f"{name} must be a non-negative int, got {value!r}")


def _check_sizing(max_model_len: int, max_in_flight_tokens: int | None) -> int:
    """Validates the sizing arguments; returns ``max_in_flight_tokens`` resolved."""
    _check_positive_int("max_model_len", max_model_len)
    if max_in_flight_tokens is None:
        return max_model_len
    _check_positive_int("max_in_flight_tokens", max_in_flight_tokens)
    return max_in_flight_tokens


@dataclass(frozen=True)
class KVCacheSpec:
    """Base class of the per-layer KV-cache specs."""

    block_size: int

    #: vLLM's ``KVCacheSpecKind`` value; the manager picks its rules by it.
    kind: ClassVar[str] = "unknown"

    def __post_init__(self) -> None:
        _check_positive_int("block_size", self.block_size)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer."""
        raise NotImplementedError

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        *,
        max_num_encoder_input_tokens: int | None = None,
    ) -> int:
        """Bytes one request of ``max_model_len`` tokens can need in one layer."""
        _check_sizing(max_model_len, max_in_flight_tokens)
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes

    def core_spec(self) -> dict[str, Any]:
        """What the Rust manager needs: ``kind``, ``block_size`` and the fields that
        change its rules."""
        return {"kind": self.kind, "block_size": self.block_size}

    def copy_with_new_block_size(self: _SpecT, block_size: int) -> _SpecT:
        """This spec with another block size (vLLM's name)."""
        return dataclasses.replace(self, block_size=block_size)

    @classmethod
    def merge(cls: type[_SpecT], specs: Sequence[_SpecT]) -> _SpecT:
        """The spec of a group holding layers of ``specs`` (vLLM's ``merge``): they
        must all be equal. Raises ``InvalidConfigError`` when they cannot share a group."""
        if not specs:
            raise InvalidConfigError("merge needs at least one spec")
        if not all(spec == specs[0] for spec in specs[1:]):
            raise InvalidConfigError("All layers in the same KV cache group must be the same.")
        return specs[0]


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """Attention layers: K and V pages of ``num_kv_heads`` x ``head_size``.

    ``head_size_v`` (V head size, default ``head_size``) and ``page_size_padded``
    (a page enlarged to share a pool with bigger pages, at least the real page)
    are keyword-only, as in vLLM.
    """

    num_kv_heads: int
    head_size: int
    dtype: Any
    head_size_v: int | None = field(default=None, kw_only=True)
    page_size_padded: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int("num_kv_heads", self.num_kv_heads)
        _check_positive_int("head_size", self.head_size)
        object.__setattr__(self, "dtype", _canonical_dtype(self.dtype))
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self._default_head_size_v())
        _check_non_negative_int("head_size_v", self.head_size_v)
        if self.page_size_padded is not None:
            _check_positive_int("page_size_padded", self.page_size_padded)
            if self.page_size_padded < self.real_page_size_bytes:
                raise InvalidConfigError(
                    f"page_size_padded ({self.page_size_padded}) is smaller than the real "
                    f"page size ({self.real_page_size_bytes} bytes)"
                )

    def _default_head_size_v(self) -> int:
        return self.head_size

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one block without padding:
        ``block_size * num_kv_heads * (head_size + head_size_v) * dtype_size``."""
        head_size_v = self.head_size if self.head_size_v is None else self.head_size_v
        return (
            self.block_size
            * self.num_kv_heads
            * (self.head_size + head_size_v)
            * dtype_size(self.dtype)
        )

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    @classmethod
    def _attention_fields_equal(cls, specs: Sequence[KVCacheSpec]) -> bool:
        """Whether ``specs`` agree on every field ``AttentionSpec`` declares (vLLM
        compares ``fields(AttentionSpec)`` when merging)."""
        names = [f.name for f in dataclasses.fields(AttentionSpec)]
        first = specs[0]
        return all(getattr(s, n) == getattr(first, n) for s in specs[1:] for n in names)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Full (causal) attention: a request keeps every block until it finishes."""

    kind: ClassVar[str] = "full_attention"

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        *,
        max_num_encoder_input_tokens: int | None = None,
    ) -> int:
        """``cdiv(max_model_len, block_size) * page_size_bytes``."""
        _check_sizing(max_model_len, max_in_flight_tokens)
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes

    @classmethod
    def merge(cls: type[_SpecT], specs: Sequence[_SpecT]) -> _SpecT:
        """vLLM's ``FullAttentionSpec.merge``: every spec is a ``FullAttentionSpec``
        (sinks included, MLA excluded) with equal attention fields; the result is
        a ``cls`` built from the first spec's attention fields."""
        if not specs:
            raise InvalidConfigError("merge needs at least one spec")
        if not all(isinstance(s, FullAttentionSpec) for s in specs):
            raise InvalidConfigError(
                "All attention layers in the same KV cache group must be FullAttentionSpec."
            )
        if any(isinstance(s, MLAAttentionSpec) for s in specs):
            raise InvalidConfigError(
                "MLAAttentionSpec layers merge only with MLAAttentionSpec layers."
            )
        if not AttentionSpec._attention_fields_equal(specs):
            raise InvalidConfigError(
                "All attention layers in the same KV cache group must have the same attention spec."
            )
        return cls(**cast("type[FullAttentionSpec]", cls)._merged_fields(specs))

    @classmethod
    def _merged_fields(cls, specs: Sequence[KVCacheSpec]) -> dict[str, Any]:
        first = specs[0]
        return {f.name: getattr(first, f.name) for f in dataclasses.fields(AttentionSpec)}


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek): one latent vector per token and head
    slot, no separate V (``head_size_v`` = 0); managed like full attention.
    ``head_size`` is ``kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek-V3)."""

    kind: ClassVar[str] = "mla_attention"

    def _default_head_size_v(self) -> int:
        return 0

    @classmethod
    def merge(cls: type[_SpecT], specs: Sequence[_SpecT]) -> _SpecT:
        if not specs:
            raise InvalidConfigError("merge needs at least one spec")
        if not all(isinstance(s, MLAAttentionSpec) for s in specs):
            raise InvalidConfigError(
                "All attention layers in the same KV cache group must be MLAAttentionSpec."
            )
        if not AttentionSpec._attention_fields_equal(specs):
            raise InvalidConfigError(
                "All attention layers in the same KV cache group must have the same attention spec."
            )
        return specs[0]


@dataclass(frozen=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with ``sink_len`` attention-sink tokens. Managed like full
    attention (vLLM 0.33's manager takes no blocks for the sinks); the manager
    requires ``sink_len`` to be a multiple of ``block_size`` (checked there, as in
    vLLM: the config builder may still enlarge a hybrid model's block sizes)."""

    sink_len: int

    kind: ClassVar[str] = "sink_full_attention"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int("sink_len", self.sink_len)

    def core_spec(self) -> dict[str, Any]:
        return {**super().core_spec(), "sink_len": self.sink_len}

    @classmethod
    def _merged_fields(cls, specs: Sequence[KVCacheSpec]) -> dict[str, Any]:
        fields = super()._merged_fields(specs)
        sink_len = getattr(specs[0], "sink_len", None)
        if sink_len is None:
            raise InvalidConfigError("a SinkFullAttentionSpec group needs a sink_len")
        fields["sink_len"] = sink_len
        return fields


@dataclass(frozen=True)
class _RecyclingAttentionSpec(AttentionSpec):
    """Attention whose requests recycle blocks (sliding window, chunked local): a
    request holds at most ``max_admission_blocks_per_request`` blocks, which also
    sizes the pool (vLLM's single source of truth for both)."""

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        raise NotImplementedError

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        *,
        max_num_encoder_input_tokens: int | None = None,
    ) -> int:
        in_flight = _check_sizing(max_model_len, max_in_flight_tokens)
        return (
            self.max_admission_blocks_per_request(in_flight, max_model_len) * self.page_size_bytes
        )


@dataclass(frozen=True)
class SlidingWindowSpec(_RecyclingAttentionSpec):
    """Sliding-window attention: the next token sees the last ``sliding_window``
    tokens; blocks entirely before the window are freed (replaced by the null
    block).

    ``bounded_replay`` (keyword-only; vLLM's ``SlidingWindowMLASpec`` field):
    the group's KV is never cached. Prefix hits come from the other groups; after
    one, the engine recomputes the hit's last ``sliding_window`` tokens for this
    group, which holds null blocks below them and fresh blocks from there on.

    ``extra_retained_tokens`` (keyword-only; vLLM's field of the same name): a
    request keeps that many more tokens below the window, not attended (an
    engine whose multi-module speculative decoding prefills them again). Their
    blocks are freed that much later and count in the admission cap."""

    sliding_window: int
    bounded_replay: bool = field(default=False, kw_only=True)
    extra_retained_tokens: int = field(default=0, kw_only=True)

    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int("sliding_window", self.sliding_window)
        _check_non_negative_int("extra_retained_tokens", self.extra_retained_tokens)

    @property
    def num_retained_tokens(self) -> int:
        """Tokens below a request's next position that stay readable:
        ``sliding_window - 1 + extra_retained_tokens``."""
        return self.sliding_window - 1 + self.extra_retained_tokens

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        """Most blocks one request holds:
        ``cdiv(min(num_retained_tokens + max_in_flight_tokens, max_model_len), block_size)
        + 1`` (+1: the window may start inside a block)."""
        _check_positive_int("max_in_flight_tokens", max_in_flight_tokens)
        _check_positive_int("max_model_len", max_model_len)
        num_tokens = min(self.num_retained_tokens + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) + 1

    def core_spec(self) -> dict[str, Any]:
        spec = {**super().core_spec(), "sliding_window": self.sliding_window}
        if self.bounded_replay:
            spec["bounded_replay"] = True
        if self.extra_retained_tokens:
            spec["extra_retained_tokens"] = self.extra_retained_tokens
        return spec


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(_RecyclingAttentionSpec):
    """Chunked local attention (Llama 4): a token sees only its own
    ``attention_chunk_size``-token chunk; blocks of earlier chunks are freed."""

    attention_chunk_size: int

    kind: ClassVar[str] = "chunked_local_attention"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int("attention_chunk_size", self.attention_chunk_size)

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        """Most blocks one request holds:
        ``cdiv(min(attention_chunk_size + max_in_flight_tokens, max_model_len),
        block_size)``."""
        _check_positive_int("max_in_flight_tokens", max_in_flight_tokens)
        _check_positive_int("max_model_len", max_model_len)
        num_tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size)

    def core_spec(self) -> dict[str, Any]:
        return {**super().core_spec(), "attention_chunk_size": self.attention_chunk_size}


@dataclass(frozen=True)
class CrossAttentionSpec(AttentionSpec):
    """Cross-attention of an encoder-decoder model (Whisper): K/V of the encoder
    output, allocated once per request and never prefix-cached. Sized by
    ``max_num_encoder_input_tokens``, not by ``max_model_len``."""

    kind: ClassVar[str] = "cross_attention"

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        *,
        max_num_encoder_input_tokens: int | None = None,
    ) -> int:
        """``cdiv(max_num_encoder_input_tokens, block_size) * page_size_bytes``."""
        _check_sizing(max_model_len, max_in_flight_tokens)
        if max_num_encoder_input_tokens is None:
            raise InvalidConfigError(
                "a cross-attention layer is sized by the encoder output length: pass "
                "max_num_encoder_input_tokens (e.g. 1500 for Whisper)"
            )
        _check_positive_int("max_num_encoder_input_tokens", max_num_encoder_input_tokens)
        return cdiv(max_num_encoder_input_tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class CircularBufferSpec(AttentionSpec):
    """One block per request for its whole life (vLLM's ``CircularBufferSpec``:
    a ring of the raw keys of the token group still being compressed,
    ``block_size`` rows). Claimed at the request's first allocation, never
    prefix-cached, never freed before the request ends."""

    kind: ClassVar[str] = "circular_buffer"

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        *,
        max_num_encoder_input_tokens: int | None = None,
    ) -> int:
        """One page: the ring holds one block whatever the request's length."""
        _check_sizing(max_model_len, max_in_flight_tokens)
        return self.page_size_bytes


@dataclass(frozen=True)
class _PagedSpec(KVCacheSpec):
    """A spec sized by ``page_size`` (bytes of one block of one layer) alone."""

    page_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int("page_size", self.page_size)

    @property
    def page_size_bytes(self) -> int:
        """``page_size``."""
        return self.page_size


@dataclass(frozen=True)
class EngineManagedSpec(_PagedSpec):
    """A group whose blocks the engine manages itself, with the manager's
    engine calls (``get_new_blocks``, ``touch_blocks``, ``unpin_blocks``,
    ``free_blocks``): the manager allocates, caches and looks up nothing for
    it, keeps its place in the group order, and counts the blocks the engine
    says it takes (``allocate_slots(..., engine_managed_blocks=(step, full))``)
    in its capacity checks. vLLM's HiSparse host source runs so.
    ``page_size``: bytes of one block of one layer."""

    kind: ClassVar[str] = "engine_managed"


@dataclass(frozen=True)
class HiSparseResidentSpec(_PagedSpec):
    """HiSparse's resident group (vLLM's ``HiSparseResidentSpec``): per
    request, a row of device pages for KV whose home is a host tier. Pages of
    a host-backed prefix start as the null block; the engine points them at
    pinned device copies and back (``hisparse_adopt_page``,
    ``hisparse_drop_page``) and pins and unpins the blocks itself, so a row's
    references are engine-held (``free_blocks`` / ``unpin_blocks`` return
    them). A connector's import keeps only its last page on the device. Never
    cached, never looked up. ``page_size``: bytes of one block of one layer."""

    kind: ClassVar[str] = "hisparse_resident"

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        *,
        max_num_encoder_input_tokens: int | None = None,
    ) -> int:
        """The pages of the tokens one request can have in flight (the rest of
        its context lives on the host)."""
        tokens = min(_check_sizing(max_model_len, max_in_flight_tokens), max_model_len)
        return cdiv(tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class HiSparseHotSpec(_PagedSpec):
    """HiSparse's hot group (vLLM's ``HiSparseHotSpec``): ``blocks_per_request``
    blocks a request takes once it reads host-backed history (a connector's
    import, a resumed host prefix, or ``hisparse_require_hot``). Never cached,
    never looked up. ``page_size``: bytes of one block of one layer."""

    blocks_per_request: int

    kind: ClassVar[str] = "hisparse_hot"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int("blocks_per_request", self.blocks_per_request)

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        *,
        max_num_encoder_input_tokens: int | None = None,
    ) -> int:
        """The hot region: ``blocks_per_request`` pages."""
        _check_sizing(max_model_len, max_in_flight_tokens)
        return self.blocks_per_request * self.page_size_bytes

    def core_spec(self) -> dict[str, Any]:
        return {**super().core_spec(), "blocks_per_request": self.blocks_per_request}


def _normalize_shapes(shapes: Any) -> tuple[tuple[int, ...], ...]:
    if isinstance(shapes, (str, bytes)) or not isinstance(shapes, Sequence):
        raise InvalidConfigError(f"shapes must be a sequence of shapes, got {shapes!r}")
    out = []
    for shape in shapes:
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
            raise InvalidConfigError(f"each shape must be a sequence of ints, got {shape!r}")
        for dim in shape:
            _check_non_negative_int("a state dimension", dim)
        out.append(tuple(int(d) for d in shape))
    return tuple(out)


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """Mamba / linear-attention state: one page holds every state tensor of a
    layer (conv state + SSM state), ``shapes[i]`` of ``dtypes[i]``.

    ``mamba_cache_mode``: ``"none"`` (no prefix caching; vLLM then sets the block
    size to ``max_model_len``: one state block per request), ``"align"`` (prefix
    caching for hybrid models: a state is cached at each block boundary, a
    request holds ~2 blocks), or ``"all"`` (a state per block; not in vLLM 0.33,
    kept from earlier versions). ``num_speculative_blocks``: extra state blocks
    for speculative decoding (``num_speculative_tokens``). ``page_size_padded``:
    the page enlarged to the attention page of a hybrid model.
    ``prefill_checkpoint_alignment`` (``"align"`` only; vLLM's prefill
    checkpoints, one checkpoint block): with partial hits on, the chunk that
    ends a prefill reserves one more state block where the kernel exports the
    state at the prompt's reusable boundary (a multiple of this many tokens past
    the chunk start), so a later request can resume inside a block.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    page_size_padded: int | None = field(default=None, kw_only=True)
    mamba_cache_mode: str = field(default="none", kw_only=True)
    num_speculative_blocks: int = field(default=0, kw_only=True)
    prefill_checkpoint_alignment: int | None = field(default=None, kw_only=True)

    kind: ClassVar[str] = "mamba"

    def __post_init__(self) -> None:
        super().__post_init__()
        shapes = _normalize_shapes(self.shapes)
        if isinstance(self.dtypes, (str, bytes)) or not isinstance(self.dtypes, Sequence):
            raise InvalidConfigError(f"dtypes must be a sequence of dtypes, got {self.dtypes!r}")
        dtypes = tuple(_canonical_dtype(d) for d in self.dtypes)
        if len(shapes) != len(dtypes):
            raise InvalidConfigError(
                f"shapes and dtypes differ in length ({len(shapes)} != {len(dtypes)})"
            )
        if not shapes:
            raise InvalidConfigError("a MambaSpec needs at least one state tensor")
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", dtypes)
        if self.mamba_cache_mode not in _MAMBA_CACHE_MODES:
            raise InvalidConfigError(
                f"mamba_cache_mode must be one of {_MAMBA_CACHE_MODES}, "
                f"got {self.mamba_cache_mode!r}"
            )
        _check_non_negative_int("num_speculative_blocks", self.num_speculative_blocks)
        if self.prefill_checkpoint_alignment is not None:
            _check_positive_int("prefill_checkpoint_alignment", self.prefill_checkpoint_alignment)
            if self.mamba_cache_mode != "align":
                raise InvalidConfigError(
                    "prefill_checkpoint_alignment needs mamba_cache_mode='align'"
                )
        if self.real_page_size_bytes <= 0:
            raise InvalidConfigError("a MambaSpec's state tensors must not be empty")
        if self.page_size_padded is not None:
            _check_positive_int("page_size_padded", self.page_size_padded)
            if self.page_size_padded < self.real_page_size_bytes:
                raise InvalidConfigError(
                    f"page_size_padded ({self.page_size_padded}) is smaller than the real "
                    f"page size ({self.real_page_size_bytes} bytes)"
                )

    @property
    def real_page_size_bytes(self) -> int:
        """``sum(prod(shape) * dtype_size)`` over the state tensors."""
        return sum(
            math.prod(shape) * dtype_size(dtype)
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        *,
        max_num_encoder_input_tokens: int | None = None,
    ) -> int:
        """``"none"``: ``page * (1 + num_speculative_blocks)``; ``"align"``:
        ``page * (2 + num_speculative_blocks)`` (one more with prefill
        checkpoints); ``"all"``:
        ``cdiv(max_model_len, block_size) * page``."""
        _check_sizing(max_model_len, max_in_flight_tokens)
        if self.mamba_cache_mode == "align":
            checkpoint = int(self.prefill_checkpoint_alignment is not None)
            return self.page_size_bytes * (2 + self.num_speculative_blocks + checkpoint)
        if self.mamba_cache_mode == "all":
            return cdiv(max_model_len, self.block_size) * self.page_size_bytes
        return self.page_size_bytes * (1 + self.num_speculative_blocks)

    def core_spec(self) -> dict[str, Any]:
        spec = {
            **super().core_spec(),
            "mamba_cache_mode": self.mamba_cache_mode,
            "num_speculative_blocks": self.num_speculative_blocks,
        }
        if self.prefill_checkpoint_alignment is not None:
            spec["prefill_checkpoint_alignment"] = self.prefill_checkpoint_alignment
        return spec


def _uniform_type_base(spec: KVCacheSpec) -> type[KVCacheSpec]:
    """The class whose instances count as "the same type" (vLLM's registry
    ``uniform_type_base_spec``): full attention, MLA and sinks are all full
    attention."""
    for cls in (
        FullAttentionSpec,
        SlidingWindowSpec,
        ChunkedLocalAttentionSpec,
        MambaSpec,
        CrossAttentionSpec,
    ):
        if isinstance(spec, cls):
            return cls
    return type(spec)


def _same_type(first: KVCacheSpec, spec: KVCacheSpec) -> bool:
    """vLLM's ``is_uniform_with_collection`` for one pair."""
    if isinstance(first, SlidingWindowSpec):
        return (
            isinstance(spec, SlidingWindowSpec)
            and spec.sliding_window == first.sliding_window
            and spec.bounded_replay == first.bounded_replay
        )
    if isinstance(first, ChunkedLocalAttentionSpec):
        return (
            isinstance(spec, ChunkedLocalAttentionSpec)
            and spec.attention_chunk_size == first.attention_chunk_size
        )
    if isinstance(first, MambaSpec):
        return (
            isinstance(spec, MambaSpec)
            and spec.num_speculative_blocks == first.num_speculative_blocks
            and spec.page_size_bytes == first.page_size_bytes
        )
    return isinstance(spec, _uniform_type_base(first))


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers of one attention type (same block size, same number of token slots
    per request) whose pages differ in size, e.g. full attention layers with
    different head counts. They form one group; a block of the group is one page
    of every layer, so ``page_size_bytes`` is the sum of the layers' pages.

    ``kind`` (and ``core_spec()``) is the layers' kind; the manager treats the group
    like one of its layers (vLLM's ``generate_scheduler_kv_cache_config``).
    """

    kv_cache_specs: Mapping[str, KVCacheSpec]

    kind: ClassVar[str] = "unknown"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.kv_cache_specs, Mapping) or not self.kv_cache_specs:
            raise InvalidConfigError(
                "kv_cache_specs must be a non-empty mapping of layer name to spec"
            )
        specs = dict(self.kv_cache_specs)
        for name, spec in specs.items():
            if not isinstance(spec, KVCacheSpec) or isinstance(spec, UniformTypeKVCacheSpecs):
                raise TypeError(f"layer {name!r}: expected a per-layer KVCacheSpec, got {spec!r}")
            if spec.block_size != self.block_size:
                raise InvalidConfigError(
                    f"layer {name!r} has block_size {spec.block_size}, expected {self.block_size}"
                )
        if not self.is_uniform_type(specs):
            raise InvalidConfigError("the layers of a UniformTypeKVCacheSpecs must have one type")
        object.__setattr__(self, "kv_cache_specs", specs)
        kinds = {spec.kind for spec in specs.values()}
        if len(kinds) == 1:
            kind = kinds.pop()
        elif all(isinstance(s, FullAttentionSpec) for s in specs.values()):
            kind = FullAttentionSpec.kind
        else:  # pragma: no cover - is_uniform_type rules this out
            kind = "unknown"
        object.__setattr__(self, "kind", kind)

    def __hash__(self) -> int:
        return hash((self.block_size, tuple(self.kv_cache_specs.items())))

    @classmethod
    def is_uniform_type(cls, kv_cache_specs: Mapping[str, KVCacheSpec]) -> bool:
        """Whether every layer has the same type and block size (vLLM's rule:
        sliding windows must be equal, chunk sizes equal, Mamba pages and
        speculative blocks equal; full attention, MLA and sinks are one type)."""
        specs = list(kv_cache_specs.values())
        if not specs:
            return False
        if len({spec.block_size for spec in specs}) > 1:
            return False
        return all(_same_type(specs[0], spec) for spec in specs)

    @classmethod
    def from_specs(
        cls, kv_cache_specs: Mapping[str, KVCacheSpec]
    ) -> UniformTypeKVCacheSpecs | None:
        """The combined spec if ``kv_cache_specs`` is of one type, else ``None``."""
        if not cls.is_uniform_type(kv_cache_specs):
            return None
        block_size = next(iter(kv_cache_specs.values())).block_size
        return cls(block_size=block_size, kv_cache_specs=kv_cache_specs)

    @property
    def first_spec(self) -> KVCacheSpec:
        return next(iter(self.kv_cache_specs.values()))

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    def max_memory_usage_pages(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        *,
        max_num_encoder_input_tokens: int | None = None,
    ) -> int:
        """Blocks one request needs: the most any layer needs."""
        return max(
            cdiv(
                spec.max_memory_usage_bytes(
                    max_model_len,
                    max_in_flight_tokens,
                    max_num_encoder_input_tokens=max_num_encoder_input_tokens,
                ),
                spec.page_size_bytes,
            )
            for spec in self.kv_cache_specs.values()
        )

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        *,
        max_num_encoder_input_tokens: int | None = None,
    ) -> int:
        """``max_memory_usage_pages * page_size_bytes`` (pages of every layer)."""
        return (
            self.max_memory_usage_pages(
                max_model_len,
                max_in_flight_tokens,
                max_num_encoder_input_tokens=max_num_encoder_input_tokens,
            )
            * self.page_size_bytes
        )

    def core_spec(self) -> dict[str, Any]:
        return self.first_spec.core_spec()

    def copy_with_new_block_size(self, block_size: int) -> UniformTypeKVCacheSpecs:
        return UniformTypeKVCacheSpecs(
            block_size=block_size,
            kv_cache_specs={
                n: s.copy_with_new_block_size(block_size) for n, s in self.kv_cache_specs.items()
            },
        )


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table (and one spec)."""

    layer_names: Sequence[str]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self) -> None:
        if isinstance(self.layer_names, str):
            raise TypeError("layer_names must be a sequence of layer names, not a str")
        if not isinstance(self.kv_cache_spec, KVCacheSpec):
            raise TypeError(f"kv_cache_spec must be a KVCacheSpec, got {self.kv_cache_spec!r}")
        object.__setattr__(self, "layer_names", tuple(self.layer_names))


@dataclass(frozen=True)
class KVCacheTensor:
    """One raw buffer of ``size`` bytes shared by ``shared_by`` layers (one layer
    of each group: a block id belongs to one group at a time, so they never use
    the same bytes at once)."""

    size: int
    shared_by: Sequence[str]

    def __post_init__(self) -> None:
        if isinstance(self.shared_by, str):
            raise TypeError("shared_by must be a sequence of layer names, not a str")
        object.__setattr__(self, "shared_by", tuple(self.shared_by))


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV cache of a model: ``num_blocks`` blocks shared by every group."""

    num_blocks: int
    kv_cache_groups: Sequence[KVCacheGroupSpec]
    kv_cache_tensors: Sequence[KVCacheTensor] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or self.num_blocks <= 0:
            raise InvalidConfigError(f"num_blocks must be a positive int, got {self.num_blocks!r}")
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))
        object.__setattr__(self, "kv_cache_tensors", tuple(self.kv_cache_tensors))
        if not self.kv_cache_groups:
            raise InvalidConfigError("a KVCacheConfig needs at least one KV-cache group")
        for g in self.kv_cache_groups:
            if not isinstance(g, KVCacheGroupSpec):
                raise TypeError(f"kv_cache_groups must hold KVCacheGroupSpec, got {g!r}")
