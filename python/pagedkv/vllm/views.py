"""The coordinator view: vLLM's ``KVCacheCoordinator`` as its scheduler reads
it, over a manager's handle, one explicit class per coordinator kind vLLM
builds (no prefix cache, unitary, hybrid), each also an instance of vLLM's
class; and the group views it holds, one per KV-cache group, of the class vLLM
would build for that group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.core import kv_cache_coordinator as vllm_coordinators
from vllm.v1.core import single_type_kv_cache_manager as vllm_managers
from vllm.v1.core.kv_cache_coordinator import SpecGroup
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from pagedkv.vllm.blocks import BlockRun, PagedBlock, PagedKVCacheBlocks
from pagedkv.vllm.engine import engine_group_hit, engine_groups_need
from pagedkv.vllm.groups import VIEW_CLASSES, SingleTypeManagerView
from pagedkv.vllm.hisparse_groups import HiSparseHotManager, HiSparseResidentManager
from pagedkv.vllm.pool import BlockPoolView

if TYPE_CHECKING:
    from pagedkv.vllm.handle import ManagerHandle, ViewedManager

__all__ = [
    "BlockPoolView",
    "BlockRun",
    "CoordinatorView",
    "HybridKVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "PagedBlock",
    "PagedKVCacheBlocks",
    "SingleTypeManagerView",
    "UnitaryKVCacheCoordinator",
    "coordinator_view",
    "view_class",
    "vllm_manager_class",
]

#: Every group view class by the vLLM single-type manager class it stands for.
_GROUP_VIEWS: dict[type, type[SingleTypeManagerView]] = {
    **VIEW_CLASSES,
    vllm_managers.HiSparseResidentManager: HiSparseResidentManager,
    vllm_managers.HiSparseHotManager: HiSparseHotManager,
}


def vllm_manager_class(group: Any) -> type | None:
    """The single-type manager class vLLM would build for a group."""
    cls: type | None = KVCacheSpecRegistry.get_manager_class(
        group.kv_cache_spec, getattr(group, "role", None)
    )
    return cls


def view_class(group: Any) -> type[SingleTypeManagerView]:
    """The view's class for a group: the explicit view class of the single-type
    manager class vLLM would build for it (``isinstance`` checks on
    ``single_type_managers`` see the kind), a plain view for a group vLLM has
    no manager class for."""
    vllm_cls = vllm_manager_class(group)
    if vllm_cls is None:
        return SingleTypeManagerView
    return _GROUP_VIEWS.get(vllm_cls, SingleTypeManagerView)


class CoordinatorView:
    """The coordinator, as the scheduler reads it."""

    def __init__(
        self, handle: ManagerHandle, manager: ViewedManager, group_block_sizes: Sequence[int]
    ) -> None:
        self._handle = handle
        self._manager = manager
        self.block_pool = manager.block_pool
        self.enable_caching = manager.enable_caching
        self.single_type_managers = tuple(
            view_class(group)(handle, manager, g, group.kv_cache_spec, group_block_sizes[g])
            for g, group in enumerate(manager.kv_cache_config.kv_cache_groups)
        )
        self.group_block_sizes = tuple(group_block_sizes)
        self.num_single_type_manager = len(self.single_type_managers)
        self.enable_partial_hash_hits: bool = handle.core.partial_hash_hits
        flagged = {
            i
            for i, g in enumerate(manager.kv_cache_config.kv_cache_groups)
            if getattr(g, "is_eagle_group", False)
        }
        self.eagle_group_ids = flagged or (
            set(range(len(self.single_type_managers))) if manager.use_eagle else set()
        )
        self.num_reprefillable_tokens = max(0, manager.num_prefill_lookahead - 1)
        self.use_eagle = manager.use_eagle
        # Each group's EAGLE last-block drop, as vLLM's coordinators mark
        # their managers: one group's own flag, or its lookup group's.
        drop = self.eagle_group_ids if manager.use_eagle else set()
        lookup = handle.core.lookup_groups
        for g, m in enumerate(self.single_type_managers):
            m.use_eagle = lookup is None and g in drop
        for ids, eagle in lookup or ():
            for g in ids:
                self.single_type_managers[g].use_eagle = eagle
        self.max_model_len = manager.max_model_len
        self.scheduler_block_size = manager.scheduler_block_size
        self.hash_block_size = manager.hash_block_size
        self.num_hash_lookahead_tokens = manager.num_hash_lookahead_tokens

    @property
    def full_attention_group_id(self) -> int | None:
        """The first full-attention group looked up (a hybrid coordinator's)."""
        group: int | None = self._handle.core.full_attention_group
        return group

    def find_longest_cache_hit(
        self, block_hashes: Sequence[Any], max_cache_hit_length: int
    ) -> tuple[tuple[list[PagedBlock], ...], int, int]:
        """The longest cached prefix of these block hashes within
        ``max_cache_hit_length`` tokens: the hit blocks per group, the hit in
        tokens, and the tokens of a longer prefix one group has cached and
        another not."""
        handle = self._handle
        if handle.engine.ids:
            raise NotImplementedError(
                "find_longest_cache_hit with engine-managed groups: use get_computed_blocks"
            )
        groups, hit, uncached = handle.core.find_longest_cache_hit(
            block_hashes, max_cache_hit_length
        )
        blocks = handle.blocks
        return tuple([blocks[i] for i in g.tolist()] for g in groups), hit, uncached

    def find_longest_cache_hit_per_group(
        self, block_hashes: Sequence[Any], max_cache_hit_length: int
    ) -> tuple[tuple[list[PagedBlock], ...], tuple[int, ...]]:
        """Each lookup group's own hit, unreconciled: blocks and tokens per group."""
        handle = self._handle
        found = handle.core.find_longest_cache_hit_per_group(block_hashes, max_cache_hit_length)
        if found is None:
            raise AttributeError("per-group hits: only a hybrid coordinator has them")
        groups, hits = found
        blocks = handle.blocks
        out_blocks = [[blocks[i] for i in g.tolist()] for g in groups]
        out_hits = list(hits)
        engine = handle.engine
        for g, manager in engine.lookup:
            out_blocks[g], out_hits[g] = engine_group_hit(
                g, manager, block_hashes, max_cache_hit_length, g in engine.drop_eagle
            )
        return tuple(out_blocks), tuple(out_hits)

    @property
    def attention_groups(self) -> list[SpecGroup]:
        """The groups whose hits are looked up together, in lookup order (vLLM's
        hybrid coordinator's attribute; a single group or caching off has none)."""
        lookup = self._handle.core.lookup_groups
        if lookup is None:
            raise AttributeError("attention_groups: only a hybrid coordinator has them")
        engine = self._handle.engine
        groups = self._manager.kv_cache_config.kv_cache_groups
        # The engine-managed groups looked up (a host source) come first, as
        # vLLM orders full-attention groups by group id.
        looked_up = [
            SpecGroup(m.kv_cache_spec, [g], type(m), g in engine.drop_eagle)
            for g, m in engine.lookup
        ]
        return looked_up + [
            SpecGroup(
                groups[ids[0]].kv_cache_spec,
                list(ids),
                vllm_manager_class(groups[ids[0]]) or SingleTypeManagerView,
                eagle,
            )
            for ids, eagle in lookup
        ]

    @property
    def _cache_hit_alignment_tokens(self) -> int:
        """Tokens every hit aligns to: the hash block with partial hits."""
        manager = self._manager
        return (
            manager.hash_block_size
            if self.enable_partial_hash_hits
            else manager.scheduler_block_size
        )

    @property
    def retention_interval(self) -> int | None:
        """Sparse retention of sliding-window and Mamba states (settable)."""
        interval: int | None = self._handle.core.prefix_cache_retention_interval
        return interval

    @retention_interval.setter
    def retention_interval(self, interval: int | None) -> None:
        self._handle.core.prefix_cache_retention_interval = interval

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Any,
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int | None = None,
        num_tokens_main_model: int | None = None,
        apply_admission_cap: bool = False,
        prefill_end: int | None = None,
    ) -> int:
        """Blocks a request without a new hit in the core's groups needs for
        ``num_tokens`` tokens, with what the engine-managed groups need."""
        handle = self._handle
        engine = handle.engine
        if any(b for g, b in enumerate(new_computed_blocks) if g not in engine.ids):
            raise NotImplementedError(
                "get_num_blocks_to_allocate with new computed blocks: use allocate_slots"
            )
        main = num_tokens if num_tokens_main_model is None else num_tokens_main_model
        local = (
            total_computed_tokens
            if num_local_computed_tokens is None
            else num_local_computed_tokens
        )
        n: int = handle.core.num_blocks_to_allocate(
            request_id if request_id in handle.live else None,
            num_tokens,
            total_computed_tokens=total_computed_tokens,
            num_tokens_main_model=main,
            num_encoder_tokens=num_encoder_tokens,
            apply_admission_cap=apply_admission_cap,
            num_local_computed_tokens=local,
        )
        n += engine_groups_need(
            engine.groups,
            request_id,
            num_tokens,
            new_computed_blocks,
            total_computed_tokens,
            local,
            main,
            apply_admission_cap,
            prefill_end or 0,
        )
        return n

    def get_blocks(self, request_id: str) -> tuple[list[PagedBlock], ...]:
        return self._manager.get_blocks(request_id).blocks  # type: ignore[return-value]


class KVCacheCoordinatorNoPrefixCache(  # type: ignore[misc]
    CoordinatorView, vllm_coordinators.KVCacheCoordinatorNoPrefixCache
):
    """The coordinator with caching off: vLLM's ``KVCacheCoordinatorNoPrefixCache``."""


class UnitaryKVCacheCoordinator(  # type: ignore[misc]
    CoordinatorView, vllm_coordinators.UnitaryKVCacheCoordinator
):
    """The coordinator of one lookup group: vLLM's ``UnitaryKVCacheCoordinator``."""


class HybridKVCacheCoordinator(  # type: ignore[misc]
    CoordinatorView, vllm_coordinators.HybridKVCacheCoordinator
):
    """The coordinator of several lookup groups: vLLM's ``HybridKVCacheCoordinator``."""


def coordinator_view(
    handle: ManagerHandle, manager: ViewedManager, group_block_sizes: Sequence[int]
) -> CoordinatorView:
    """The coordinator view, of the kind vLLM would build (no prefix cache, one
    lookup group, or hybrid), so ``isinstance`` checks on
    ``manager.coordinator`` see the kind. vLLM's own ``__init__`` never runs."""
    cls: type[CoordinatorView]
    if not manager.enable_caching:
        cls = KVCacheCoordinatorNoPrefixCache
    elif handle.core.lookup_groups is None:
        cls = UnitaryKVCacheCoordinator
    else:
        cls = HybridKVCacheCoordinator
    return cls(handle, manager, group_block_sizes)
