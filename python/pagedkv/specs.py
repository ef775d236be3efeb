"""KV-cache specs and configs, shaped like vLLM's (``vllm/v1/kv_cache_interface.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "AttentionSpec",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "dtype_size",
]

_DTYPE_SIZES = {
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float32": 4,
    "float": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def dtype_size(dtype: Any) -> int:
    """Bytes per element of ``dtype``: a name ("float16", "bfloat16", "float32", "fp8")
    or anything with an ``itemsize`` (``torch.dtype``, ``numpy.dtype``)."""
    if isinstance(dtype, str):
        try:
            return _DTYPE_SIZES[dtype.removeprefix("torch.")]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}") from None
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int) and itemsize > 0:
        return itemsize
    raise ValueError(f"unknown dtype {dtype!r}")


@dataclass(frozen=True)
class KVCacheSpec:
    """Base class of the per-layer KV-cache specs."""

    block_size: int

    #: vLLM's ``KVCacheSpecKind`` value; the manager picks its rules by it.
    kind: ClassVar[str] = "unknown"

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer."""
        raise NotImplementedError

    def max_memory_usage_bytes(self, max_model_len: int) -> int:
        """Bytes one request of ``max_model_len`` tokens can need in one layer."""
        return -(-max_model_len // self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """Attention layers: K and V pages of ``num_kv_heads`` x ``head_size``."""

    num_kv_heads: int
    head_size: int
    dtype: Any

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_kv_heads", "head_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        dtype_size(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * dtype_size(self.dtype)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Full (causal) attention: a request keeps every block until it finishes."""

    kind: ClassVar[str] = "full_attention"


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek): one latent vector per token and head
    slot, no separate V; managed like full attention."""

    kind: ClassVar[str] = "mla_attention"

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size * dtype_size(self.dtype)


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
    """One raw buffer of ``size`` bytes shared by ``shared_by`` layers."""

    size: int
    shared_by: Sequence[str]


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV cache of a model: ``num_blocks`` blocks shared by every group."""

    num_blocks: int
    kv_cache_groups: Sequence[KVCacheGroupSpec]
    kv_cache_tensors: Sequence[KVCacheTensor] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {self.num_blocks!r}")
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))
        object.__setattr__(self, "kv_cache_tensors", tuple(self.kv_cache_tensors))
        if not self.kv_cache_groups:
            raise ValueError("a KVCacheConfig needs at least one KV-cache group")
        for g in self.kv_cache_groups:
            if not isinstance(g, KVCacheGroupSpec):
                raise TypeError(f"kv_cache_groups must hold KVCacheGroupSpec, got {g!r}")
