"""Specs of layers that hold no attention KV: engine-managed and HiSparse pages, Mamba state.

:mod:`pagedkv.specs` re-exports them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ._util import cdiv
from .errors import InvalidConfigError
from .spec_base import (
    KVCacheSpec,
    _canonical_dtype,
    _check_non_negative_int,
    _check_positive_int,
    _check_sizing,
    dtype_size,
)

__all__ = ["EngineManagedSpec", "HiSparseHotSpec", "HiSparseResidentSpec", "MambaSpec"]


_MAMBA_CACHE_MODES = ("none", "align", "all")


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
