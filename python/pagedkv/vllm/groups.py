"""The per-group manager views: each KV-cache group's single-type manager as
vLLM's scheduler reads it (``req_to_blocks``, ``num_cached_block``, Mamba
checkpoints, partial hits), over a manager's handle, and one explicit class per
vLLM manager class a group may have, also an instance of that class."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.core import single_type_kv_cache_manager as vllm_managers
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import KVCacheSpec, MambaSpec

from pagedkv.vllm.blocks import BlockList, PagedBlock

if TYPE_CHECKING:
    from pagedkv.vllm.handle import ManagerHandle, ViewedManager


class LiveBlocks(BlockList):
    """One request's blocks in one group, read from the core at each access (a
    list vLLM's managers keep and mutate in place, so a caller holding it sees
    later allocations). When the manager forgets the request, the list keeps
    the blocks it held then, as vLLM's popped list does."""

    def __init__(self, rows: ReqToBlocks, request_id: str) -> None:
        self._rows = rows
        self._request_id = request_id
        self._frozen: list[KVCacheBlock] | None = None

    def _list(self) -> list[KVCacheBlock]:
        if self._frozen is not None:
            return self._frozen
        ids = self._rows._ids(self._request_id) or []
        blocks = self._rows.handle.blocks
        return [blocks[i] for i in ids]

    def _freeze(self) -> None:
        """Keeps the blocks held now (called before the request is forgotten)."""
        if self._frozen is None:
            self._frozen = self._list()

    def __eq__(self, other: object) -> bool:
        return self._list() == (list(other) if isinstance(other, Sequence) else other)


class ReqToBlocks(Mapping[str, Sequence[PagedBlock]]):
    """``req_to_blocks`` of one group: request id -> its blocks (read-only, live)."""

    def __init__(self, handle: ManagerHandle, group: int) -> None:
        self.handle = handle
        self._group = group

    def __getitem__(self, request_id: str) -> Sequence[PagedBlock]:
        if self._ids(request_id) is None:
            raise KeyError(request_id)
        live = LiveBlocks(self, request_id)
        self.handle.live_lists.setdefault(request_id, []).append(weakref.ref(live))
        return live

    def _ids(self, request_id: str) -> list[int] | None:
        """The request's block ids in this group; None unless it holds blocks
        (vLLM's entry appears with the first allocation)."""
        if request_id not in self.handle.live:
            return None
        ids: list[int] = self.handle.core.group_block_ids(request_id, self._group)
        return ids or None

    def __iter__(self) -> Iterator[str]:
        return iter([r for r in sorted(self.handle.live) if self._ids(r) is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _NumCachedBlock(Mapping[str, int]):
    """``num_cached_block`` of one group: request id -> leading blocks cached."""

    def __init__(self, handle: ManagerHandle, group: int) -> None:
        self.handle = handle
        self._group = group

    def _get(self, request_id: str) -> int | None:
        if request_id not in self.handle.live:
            return None
        n: int | None = self.handle.core.num_cached_blocks(request_id)[self._group]
        return n

    def __getitem__(self, request_id: str) -> int:
        n = self._get(request_id)
        if n is None:
            raise KeyError(request_id)
        return n

    def __iter__(self) -> Iterator[str]:
        return iter([r for r in sorted(self.handle.live) if self._get(r) is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _Checkpoints(Mapping[str, tuple[int, int]]):
    """``_checkpoints`` of a Mamba group: request id -> ``(position, column)``
    of the prefill checkpoint its last allocation reserved."""

    def __init__(self, handle: ManagerHandle, group: int) -> None:
        self.handle = handle
        self._group = group

    def _get(self, request_id: str) -> tuple[int, int] | None:
        if request_id not in self.handle.live:
            return None
        return self.handle.core.mamba_checkpoint(request_id, self._group)

    def __getitem__(self, request_id: str) -> tuple[int, int]:
        c = self._get(request_id)
        if c is None:
            raise KeyError(request_id)
        return c

    def __iter__(self) -> Iterator[str]:
        return iter([r for r in sorted(self.handle.live) if self._get(r) is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _PartialHits(Mapping[str, tuple[int, PagedBlock]]):
    """``_partial_hit_reqs`` of one group: request id -> ``(index, block)`` of a
    hit ending inside that block, copied on write at the next allocation."""

    def __init__(self, handle: ManagerHandle, group: int) -> None:
        self.handle = handle
        self._group = group

    def _get(self, request_id: str) -> tuple[int, PagedBlock] | None:
        if request_id not in self.handle.live:
            return None
        hit = self.handle.core.partial_hit(request_id, self._group)
        return None if hit is None else (hit[0], self.handle.blocks[hit[1]])

    def __getitem__(self, request_id: str) -> tuple[int, PagedBlock]:
        h = self._get(request_id)
        if h is None:
            raise KeyError(request_id)
        return h

    def __iter__(self) -> Iterator[str]:
        return iter([r for r in sorted(self.handle.live) if self._get(r) is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class SingleTypeManagerView:
    """One KV-cache group's manager, as the scheduler reads it."""

    # Class attributes: they stand in front of vLLM's properties of the same
    # names on the view classes that also derive from vLLM's manager classes.
    retains_longer_hit = False
    #: Whether the group drops its last hit block for EAGLE (the coordinator sets it).
    use_eagle = False

    def __init__(
        self,
        handle: ManagerHandle,
        manager: ViewedManager,
        group: int,
        spec: KVCacheSpec,
        block_size: int,
    ) -> None:
        self.kv_cache_group_id = group
        self.kv_cache_spec = spec
        self.block_size = block_size
        self.dcp_world_size = block_size // spec.block_size
        self.block_pool = manager.block_pool
        self.enable_caching = manager.enable_caching
        self.req_to_blocks = ReqToBlocks(handle, group)
        self.num_cached_block = _NumCachedBlock(handle, group)
        self._null_block = handle.blocks[0]
        core = handle.core
        self._core = core
        self.cache_hit_alignment_tokens = (
            manager.hash_block_size if core.partial_hash_hits else manager.scheduler_block_size
        )
        self._partial_hit_reqs = _PartialHits(handle, group)
        # Copies another component queues on the group, ``(source, copy)``
        # blocks it holds (vLLM's list, drained with the core's own copies).
        self._pending_cow_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        if isinstance(spec, MambaSpec):
            self.mamba_cache_mode = spec.mamba_cache_mode
            self.num_speculative_blocks = spec.num_speculative_blocks
            self._checkpoints = _Checkpoints(handle, group)
            self.drop_eagle_checkpoint_block = manager.use_eagle
            self.shared_prefix_checkpoint = core.mamba_shared_prefix_checkpoint

    @property
    def records_new_block_ids(self) -> bool:
        """Whether the worker zeroes this group's fresh blocks."""
        return self._core.records_new_block_ids[self.kv_cache_group_id]

    def take_new_block_ids(self) -> list[int]:
        return self._core.take_new_block_ids(self.kv_cache_group_id)

    def take_pending_cow_copies(self) -> list[Any]:
        """The copies queued on ``_pending_cow_copies`` since the last call (the
        core's own come from ``take_kv_cache_block_copies``)."""
        pending, self._pending_cow_copies = self._pending_cow_copies, []
        return pending

    def take_pending_boundary_state_offloads(self) -> list[Any]:
        return []

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> None:
        return None


# One class per vLLM single-type manager class a group may have: the view's
# state and methods first in line, also an instance of vLLM's class (its
# ``isinstance`` checks see the kind), under that class's name. vLLM's own
# ``__init__`` never runs.


class FullAttentionManager(SingleTypeManagerView, vllm_managers.FullAttentionManager):  # type: ignore[misc]
    """A full-attention (or MLA) group: vLLM's ``FullAttentionManager``."""


class SinkFullAttentionManager(  # type: ignore[misc]
    SingleTypeManagerView, vllm_managers.SinkFullAttentionManager
):
    """A full-attention group with sink tokens: vLLM's ``SinkFullAttentionManager``."""


class SlidingWindowManager(SingleTypeManagerView, vllm_managers.SlidingWindowManager):  # type: ignore[misc]
    """A sliding-window group: vLLM's ``SlidingWindowManager``."""


class ChunkedLocalAttentionManager(  # type: ignore[misc]
    SingleTypeManagerView, vllm_managers.ChunkedLocalAttentionManager
):
    """A chunked local attention group: vLLM's ``ChunkedLocalAttentionManager``."""


class MambaManager(SingleTypeManagerView, vllm_managers.MambaManager):  # type: ignore[misc]
    """A Mamba group: vLLM's ``MambaManager``."""


class CrossAttentionManager(SingleTypeManagerView, vllm_managers.CrossAttentionManager):  # type: ignore[misc]
    """A cross-attention group: vLLM's ``CrossAttentionManager``."""


class CircularBufferManager(SingleTypeManagerView, vllm_managers.CircularBufferManager):  # type: ignore[misc]
    """A circular-buffer group: vLLM's ``CircularBufferManager``."""


class HiSparseSourceManager(SingleTypeManagerView, vllm_managers.HiSparseSourceManager):  # type: ignore[misc]
    """HiSparse's host source group until the HiSparse manager puts vLLM's own
    manager in its place: vLLM's ``HiSparseSourceManager``."""


#: The view class of each vLLM single-type manager class above.
VIEW_CLASSES: dict[type, type[SingleTypeManagerView]] = {
    vllm_managers.FullAttentionManager: FullAttentionManager,
    vllm_managers.SinkFullAttentionManager: SinkFullAttentionManager,
    vllm_managers.SlidingWindowManager: SlidingWindowManager,
    vllm_managers.ChunkedLocalAttentionManager: ChunkedLocalAttentionManager,
    vllm_managers.MambaManager: MambaManager,
    vllm_managers.CrossAttentionManager: CrossAttentionManager,
    vllm_managers.CircularBufferManager: CircularBufferManager,
    vllm_managers.HiSparseSourceManager: HiSparseSourceManager,
}
