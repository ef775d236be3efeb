"""KV-cache tensors of a :class:`~pagedkv.KVCacheConfig`.

One raw byte buffer is allocated per :class:`~pagedkv.KVCacheTensor`; every layer
that shares it gets a typed view of the whole buffer (vLLM's
``_allocate_kv_cache_tensors`` + ``_reshape_kv_cache_tensors``):

* attention layers (full, sliding window, chunked local, sinks, cross attention):
  ``(2, num_blocks, block_size, num_kv_heads, head_size)``, K at index 0 and V at 1
  (the flash-attention layout). A padded page (``page_size_padded``) gives the same
  shape over block-major pages, with the padding skipped by the strides;
* MLA layers: the latent cache ``(num_blocks, block_size, head_size)``
  (``(num_blocks, block_size, num_kv_heads, head_size)`` when ``num_kv_heads > 1``);
* Mamba layers: one tensor per state, ``(num_blocks, *shape)``, carved out of each
  page at the offset of the states before it.

Layers of different groups that share a buffer alias the same bytes: a block id
belongs to one group at a time, so they never use the same page at once. Block 0 is
the null block and is never written by a correct model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidConfigError
from ..specs import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
    dtype_size,
)

__all__ = [
    "KVCache",
    "LayerCache",
    "allocate_kv_cache",
    "default_device",
    "layer_specs",
    "torch_dtype",
]

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "double": torch.float64,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
    "fp8_e5m2": torch.float8_e5m2,
    "float8_e5m2": torch.float8_e5m2,
    "float8_e5m2fnuz": torch.float8_e5m2fnuz,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
}


def torch_dtype(dtype: Any) -> torch.dtype:
    """The ``torch.dtype`` of a spec dtype (a name such as ``"bfloat16"`` or ``"fp8"``,
    or a ``torch.dtype``). Raises ``ValueError`` for an unknown dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"no torch dtype for {dtype!r}") from None


def default_device() -> torch.device:
    """CUDA when available, CPU otherwise."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def layer_specs(config: KVCacheConfig) -> dict[str, tuple[int, KVCacheSpec]]:
    """Layer name -> (group index, the layer's own spec). A
    :class:`~pagedkv.UniformTypeKVCacheSpecs` group gives each layer its own spec.
    Raises ``InvalidConfigError`` when a layer is in two groups."""
    out: dict[str, tuple[int, KVCacheSpec]] = {}
    for gid, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        for name in group.layer_names:
            if name in out:
                raise InvalidConfigError(f"layer {name!r} is in more than one KV-cache group")
            own = spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
            out[name] = (gid, own)
    return out


@dataclass(frozen=True)
class LayerCache:
    """The KV cache of one layer.

    ``kv``: the layer's tensor in its layout (see the module docstring), or for Mamba
    the tuple of state tensors. ``block_tensors``: tensors whose dim 0 is the block id
    (K and V for attention, the latent cache for MLA, each state for Mamba): what
    block copies and swaps index.
    """

    name: str
    group_id: int
    spec: KVCacheSpec
    kv: torch.Tensor | tuple[torch.Tensor, ...]
    block_tensors: tuple[torch.Tensor, ...]
    buffer_index: int


def _page_view(
    raw: torch.Tensor,
    num_blocks: int,
    page: int,
    offset: int,
    nbytes: int,
    dtype: torch.dtype,
    shape: Sequence[int],
) -> torch.Tensor:
    """``(num_blocks, *shape)`` of ``dtype``: bytes ``[offset, offset + nbytes)`` of each
    ``page``-byte page of ``raw``."""
    itemsize = dtype_size(str(dtype).removeprefix("torch."))
    if page % itemsize or offset % itemsize:
        raise InvalidConfigError(
            f"a {dtype} view needs pages and offsets divisible by {itemsize} bytes "
            f"(page {page}, offset {offset})"
        )
    pages = raw[: num_blocks * page].view(num_blocks, page)[:, offset : offset + nbytes]
    return pages.view(dtype).view(num_blocks, *shape)


def _layer_view(
    name: str, spec: KVCacheSpec, raw: torch.Tensor, num_blocks: int
) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    page = spec.page_size_bytes
    if isinstance(spec, MambaSpec):
        states = []
        offset = 0
        for shape, dt in zip(spec.shapes, spec.dtypes, strict=True):
            tdt = torch_dtype(dt)
            nbytes = dtype_size(dt) * _prod(shape)
            states.append(_page_view(raw, num_blocks, page, offset, nbytes, tdt, shape))
            offset += nbytes
        return tuple(states), tuple(states)
    if not isinstance(spec, AttentionSpec):
        raise InvalidConfigError(f"layer {name!r}: no tensor layout for {type(spec).__name__}")
    dtype = torch_dtype(spec.dtype)
    bs, heads, hs = spec.block_size, spec.num_kv_heads, spec.head_size
    if isinstance(spec, MLAAttentionSpec):
        shape = (bs, hs) if heads == 1 else (bs, heads, hs)
        latent = _page_view(raw, num_blocks, page, 0, spec.real_page_size_bytes, dtype, shape)
        return latent, (latent,)
    if spec.head_size_v != hs:
        raise InvalidConfigError(
            f"layer {name!r}: the (2, num_blocks, ...) layout needs head_size_v == head_size "
            f"(got {spec.head_size_v} and {hs})"
        )
    if spec.page_size_padded is None:
        kv = raw[: num_blocks * page].view(dtype).view(2, num_blocks, bs, heads, hs)
    else:
        blocks = _page_view(
            raw, num_blocks, page, 0, spec.real_page_size_bytes, dtype, (2, bs, heads, hs)
        )
        kv = blocks.transpose(0, 1)
    return kv, (kv[0], kv[1])


def _prod(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class KVCache:
    """The KV cache of a config on one device: raw buffers and per-layer views.

    ``layers[name]`` is the :class:`LayerCache` of a layer; ``kv_caches[name]`` its
    tensor (vLLM's ``kv_caches`` dict); ``buffers[i]`` the raw ``uint8`` buffer of
    ``config.kv_cache_tensors[i]``.
    """

    def __init__(
        self,
        config: KVCacheConfig,
        buffers: Sequence[torch.Tensor],
        layers: Mapping[str, LayerCache],
        num_blocks: int,
    ) -> None:
        self.config = config
        self.buffers = tuple(buffers)
        self.layers = dict(layers)
        self.num_blocks = num_blocks

    @property
    def device(self) -> torch.device:
        return self.buffers[0].device

    @property
    def kv_caches(self) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
        return {name: layer.kv for name, layer in self.layers.items()}

    def __getitem__(self, layer_name: str) -> torch.Tensor | tuple[torch.Tensor, ...]:
        try:
            return self.layers[layer_name].kv
        except KeyError:
            raise KeyError(f"no KV cache for layer {layer_name!r}") from None

    def group_layers(self, group_id: int) -> Iterator[LayerCache]:
        """The layers of group ``group_id``, in the group's order."""
        for name in self.config.kv_cache_groups[group_id].layer_names:
            yield self.layers[name]

    def group_block_tensors(self, group_id: int) -> list[torch.Tensor]:
        """Every block-indexed tensor of group ``group_id``'s layers (what copying or
        swapping a block of that group must move)."""
        return [t for layer in self.group_layers(group_id) for t in layer.block_tensors]

    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)


def allocate_kv_cache(
    config: KVCacheConfig,
    device: torch.device | str | None = None,
    *,
    num_blocks: int | None = None,
    pin_memory: bool | None = None,
) -> KVCache:
    """Allocates the KV cache of ``config`` on ``device`` (default: CUDA when
    available, else CPU), zero-filled.

    One ``uint8`` buffer per ``config.kv_cache_tensors`` entry (each layer of
    ``shared_by`` viewing all of it); a config without tensors gets one buffer per
    layer of ``num_blocks * page_size_bytes``. ``num_blocks`` (default
    ``config.num_blocks``) sizes the buffers instead, e.g. for a CPU swap space of
    the same layout. ``pin_memory`` (CPU only; default: when CUDA is available)
    pins the buffers for asynchronous copies. Raises ``InvalidConfigError`` when a
    tensor is too small for its layers or a layer has no buffer or two.
    """
    if not isinstance(config, KVCacheConfig):
        raise TypeError(f"config must be a KVCacheConfig, got {config!r}")
    dev = default_device() if device is None else torch.device(device)
    if num_blocks is None:
        num_blocks = config.num_blocks
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
    if pin_memory is None:
        pin_memory = dev.type == "cpu" and torch.cuda.is_available()
    if pin_memory and dev.type != "cpu":
        raise ValueError("pin_memory applies to CPU buffers only")
    specs = layer_specs(config)
    scale = num_blocks / config.num_blocks

    plan: list[tuple[int, Sequence[str]]] = []
    if config.kv_cache_tensors:
        for t in config.kv_cache_tensors:
            if t.size % config.num_blocks:
                raise InvalidConfigError(
                    f"KV-cache tensor of {t.size} bytes is not a whole number of pages for "
                    f"{config.num_blocks} blocks"
                )
            plan.append((int(t.size * scale), t.shared_by))
    else:
        plan = [(spec.page_size_bytes * num_blocks, (name,)) for name, (_, spec) in specs.items()]

    seen: dict[str, int] = {}
    for index, (_, shared_by) in enumerate(plan):
        for name in shared_by:
            if name not in specs:
                raise InvalidConfigError(f"KV-cache tensor {index} names unknown layer {name!r}")
            if name in seen:
                raise InvalidConfigError(
                    f"layer {name!r} is in KV-cache tensors {seen[name]} and {index}"
                )
            seen[name] = index
    missing = [name for name in specs if name not in seen]
    if missing:
        raise InvalidConfigError(f"layers without a KV-cache tensor: {missing}")

    buffers: list[torch.Tensor] = []
    layers: dict[str, LayerCache] = {}
    for index, (size, shared_by) in enumerate(plan):
        raw = torch.zeros(size, dtype=torch.uint8, device=dev, pin_memory=bool(pin_memory))
        buffers.append(raw)
        for name in shared_by:
            gid, spec = specs[name]
            if spec.page_size_bytes * num_blocks > size:
                raise InvalidConfigError(
                    f"layer {name!r} needs {spec.page_size_bytes * num_blocks} bytes, its "
                    f"KV-cache tensor has {size}"
                )
            kv, block_tensors = _layer_view(name, spec, raw, num_blocks)
            layers[name] = LayerCache(name, gid, spec, kv, block_tensors, index)
    ordered = {name: layers[name] for name in specs}
    return KVCache(config, buffers, ordered, num_blocks)
