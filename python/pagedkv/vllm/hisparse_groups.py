"""The HiSparse group views: the resident and hot groups in the core as
vLLM's ``HiSparseCoordinator`` reads and writes them (rows, the residency
overlay, engine-held pages, the hot requirement), also instances of vLLM's
``HiSparseResidentManager`` and ``HiSparseHotManager``."""

from __future__ import annotations

from collections.abc import Iterator, Set
from typing import TYPE_CHECKING, Any

from vllm.v1.core import single_type_kv_cache_manager as vllm_managers
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import KVCacheSpec

from pagedkv.vllm.groups import ReqToBlocks, SingleTypeManagerView

if TYPE_CHECKING:
    from pagedkv.vllm.handle import ManagerHandle, ViewedManager


class _RowSnapshots(ReqToBlocks):
    """``req_to_blocks`` of a HiSparse group: ``[]`` hands out a live list as
    for any group; ``get``, which vLLM's ``HiSparseCoordinator`` calls on every
    step for every request, a plain list of the row as it is now."""

    def get(self, request_id: str, default: Any = None) -> Any:
        ids = self._ids(request_id)
        if ids is None:
            return default
        rows = self.handle.blocks
        return [rows[i] for i in ids]

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and self._ids(request_id) is not None


class _HiSparseView(SingleTypeManagerView):
    """A HiSparse group in the core, as vLLM's ``HiSparseCoordinator`` (bound
    on ``coordinator``) reads it: ``req_to_blocks.get`` hands out plain lists."""

    coordinator: Any = None

    def __init__(
        self,
        handle: ManagerHandle,
        manager: ViewedManager,
        group: int,
        spec: KVCacheSpec,
        block_size: int,
    ) -> None:
        super().__init__(handle, manager, group, spec, block_size)
        self._handle = handle
        self._manager = manager
        self.req_to_blocks = _RowSnapshots(handle, group)


class ResidentManagerView(_HiSparseView):
    """HiSparse's resident group in the core (vLLM's
    ``HiSparseResidentManager``): the rows, their residency overlay and their
    engine-held pages live in the core; vLLM's ``HiSparseCoordinator`` reads
    and writes them through these calls."""

    def __init__(
        self,
        handle: ManagerHandle,
        manager: ViewedManager,
        group: int,
        spec: KVCacheSpec,
        block_size: int,
    ) -> None:
        super().__init__(handle, manager, group, spec, block_size)
        self._rows = handle.blocks
        self.max_admission_blocks_per_request = spec.max_admission_blocks_per_request(  # type: ignore[attr-defined]
            max_in_flight_tokens=manager.max_in_flight_tokens or manager.max_model_len,
            max_model_len=manager.max_model_len,
        )

    def adopt_resident_page(self, request_id: str, block_idx: int, block: KVCacheBlock) -> bool:
        """Points a host-only page at a device copy of its contents. vLLM's
        coordinator pins the block right after (``block_pool.touch``); the
        core pins it in the adoption itself, so no page ever reads a block
        nobody pins, and that touch is this pin (see ``BlockPoolView.touch``)."""
        if request_id not in self._handle.live:
            return False
        adopted = bool(
            self._handle.core.hisparse_adopt_page(
                request_id, self.kv_cache_group_id, block_idx, block.block_id, pin=True
            )
        )
        if adopted:
            pins = self._handle.adoption_pins
            pins[block.block_id] = pins.get(block.block_id, 0) + 1
        return adopted

    def drop_resident_page(self, request_id: str, block_idx: int) -> KVCacheBlock | None:
        """The page is read from the host from now on; the block it was read from."""
        if request_id not in self._handle.live:
            return None
        b = self._handle.core.hisparse_drop_page(request_id, self.kv_cache_group_id, block_idx)
        return None if b is None else self._rows[b]

    def get_resident_page(self, request_id: str, block_idx: int) -> KVCacheBlock | None:
        """The device block the page is read from; None when read from the host."""
        if request_id not in self._handle.live:
            return None
        b = self._handle.core.hisparse_resident_page(request_id, self.kv_cache_group_id, block_idx)
        return None if b is None else self._rows[b]

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """Pages up to ``num_tokens`` tokens (this group alone)."""
        return _group_allocate(self, request_id, num_tokens)

    def get_residency_row(self, request_id: str, start: int = 0) -> list[KVCacheBlock]:
        """The row from ``start`` with the overlay applied (host-only pages null)."""
        if request_id not in self._handle.live:
            return []
        rows = self._rows
        ids = self._handle.core.hisparse_residency_row(request_id, self.kv_cache_group_id, start)
        return [rows[i] for i in ids.tolist()]


def _group_allocate(view: _HiSparseView, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
    """One HiSparse group's ``allocate_new_blocks``, outside a whole allocation
    (vLLM's tests call it on the group's manager)."""
    handle = view._handle
    ids = handle.core.hisparse_allocate_new_blocks(request_id, view.kv_cache_group_id, num_tokens)
    handle.observe_blocks()
    view._manager.block_pool.fire_reused()
    rows = handle.blocks
    return [rows[i] for i in ids.tolist()]


class _HotRequired(Set[str]):
    """``hot_required`` of a hot group: the requests that need their hot region
    (read-only, live; ``require_hot`` adds one)."""

    def __init__(self, handle: ManagerHandle, group: int) -> None:
        self._handle = handle
        self._group = group

    def __contains__(self, request_id: object) -> bool:
        handle = self._handle
        return request_id in handle.live and bool(
            handle.core.hisparse_hot_required(request_id, self._group)
        )

    def __iter__(self) -> Iterator[str]:
        return iter([r for r in sorted(self._handle.live) if r in self])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class HotManagerView(_HiSparseView):
    """HiSparse's hot group in the core (vLLM's ``HiSparseHotManager``)."""

    def __init__(
        self,
        handle: ManagerHandle,
        manager: ViewedManager,
        group: int,
        spec: KVCacheSpec,
        block_size: int,
    ) -> None:
        super().__init__(handle, manager, group, spec, block_size)
        self.blocks_per_request: int = spec.blocks_per_request  # type: ignore[attr-defined]
        self.hot_required = _HotRequired(handle, group)

    def require_hot(self, request_id: str) -> None:
        """The request takes its hot region at its next allocation."""
        handle = self._handle
        if request_id not in handle.live:
            raise KeyError(f"request {request_id!r} is not known to the KV-cache manager")
        handle.core.hisparse_require_hot(request_id, self.kv_cache_group_id)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """The hot region, once required (this group alone)."""
        return _group_allocate(self, request_id, num_tokens)

    def has_hot(self, request_id: str) -> bool:
        return len(self.req_to_blocks.get(request_id, ())) == self.blocks_per_request

    def get_num_required_blocks(self, request_id: str) -> int:
        return max(self.blocks_per_request - len(self.req_to_blocks.get(request_id, ())), 0)


class HiSparseResidentManager(  # type: ignore[misc]
    ResidentManagerView, vllm_managers.HiSparseResidentManager
):
    """HiSparse's resident group: vLLM's ``HiSparseResidentManager``."""


class HiSparseHotManager(HotManagerView, vllm_managers.HiSparseHotManager):  # type: ignore[misc]
    """HiSparse's hot group: vLLM's ``HiSparseHotManager``."""
