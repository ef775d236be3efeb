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

The per-layer specs live in :mod:`pagedkv.spec_base`, :mod:`pagedkv.spec_attention`
and :mod:`pagedkv.spec_pages`; this module holds the groups and configs built of
them and re-exports every spec.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ._util import cdiv
from .errors import InvalidConfigError
from .spec_attention import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from .spec_base import KVCacheSpec, dtype_size
from .spec_pages import EngineManagedSpec, HiSparseHotSpec, HiSparseResidentSpec, MambaSpec

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
