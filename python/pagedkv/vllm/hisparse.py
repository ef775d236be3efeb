"""vLLM 0.33's HiSparse layout on pagedkv: host-backed sparse residency.

A HiSparse model's KV-cache groups are ``[source, indexer, resident*, hot*,
regular...]``. vLLM's own ``HiSparseCoordinator`` (a Python state machine that
vLLM's tests, connector and scheduler drive directly) reads and writes the
source, resident and hot groups' managers. The resident and hot groups are the
core's (``hisparse_resident``, ``hisparse_hot``): their rows, the residency
overlay, the engine-held resident pages and the hot regions live in the core,
and the coordinator reaches them through views that are also vLLM's
``HiSparseResidentManager`` and ``HiSparseHotManager``
(:mod:`pagedkv.vllm.views`). The source group runs vLLM's own
``HiSparseSourceManager`` on the host tier, a second pagedkv pool
(:class:`HostTier`: its own free queue, prefix cache and events, reported with
medium ``"CPU"`` in the device pool's event stream, as vLLM's host pool reports
them) in place of vLLM's host ``BlockPool``. The core keeps the source as an
engine-managed group (its place in the group order, its need in the capacity
checks) and runs every device group itself.

Each call runs the groups in vLLM's order: the core adopts and allocates for
every device group in group order; the source (group 0, ahead of them) runs on
its own pool, so only the event stream tells its place: its events go ahead of
the core's. The coordinator's own work happens where vLLM's resident manager
calls it: a hit's host pages are committed once the source holds them, and a
free lets go of the pinned pages at the first resident group's place
(``free_groups_before`` / ``pop_blocks_before``). Device block ids and the event
stream are vLLM's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_coordinator import replay_boundaries
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.core.single_type_kv_cache_manager import get_manager_for_kv_cache_spec
from vllm.v1.kv_cache_interface import HiSparseResidentSpec
from vllm.v1.request import Request

from pagedkv import _core
from pagedkv.vllm.base import PagedKVCacheManager
from pagedkv.vllm.blocks import BlockRun, PagedBlock
from pagedkv.vllm.convert import (
    add_to_core,
    core_group,
    engine_managed,
    engine_managed_group,
    feed_collector,
    sync_with_core,
    vllm_events,
)
from pagedkv.vllm.engine import EngineGroups, engine_group_hit, engine_groups_need
from pagedkv.vllm.handle import ManagerHandle
from pagedkv.vllm.pool import BlockPoolView


class HostTier:
    """The host tier of HiSparse's source group: a pagedkv pool of host blocks
    (block 0 the null block), with the device pool's options, its own free
    queue and prefix cache. Its core has the device layout's groups, the source
    group a core group and every other one engine-managed, so block hashes and
    events carry the source group's id. Its events join the device pool's event
    stream as they happen, with medium ``"CPU"``. It answers the calls its pool
    view (:class:`HostBlockPool`) makes through its handle."""

    def __init__(self, device: PagedKVCacheManager, group: int, num_blocks: int) -> None:
        config = device.kv_cache_config
        spec = config.kv_cache_groups[group].kv_cache_spec
        groups = [
            core_group(spec) if g == group else engine_managed_group(g, other.kv_cache_spec)
            for g, other in enumerate(config.kv_cache_groups)
        ]
        collector = device.metrics_collector
        options = {
            **device._core_options,
            "enable_caching": device.enable_caching and spec.prefix_cacheable,
            "log_stats": False,
            "kv_cache_metrics": collector is not None,
        }
        self._core = _core.KVCacheManager(num_blocks, groups, device.max_model_len, **options)
        self._device = device
        self._group = group
        self._blocks = [PagedBlock(i, self._core, i == 0) for i in range(num_blocks)]
        self._prompt_by_length = not self._core.reads_token_values
        self.metrics_collector = (
            KVCacheMetricsCollector(collector.sample_rate) if collector is not None else None
        )
        self.enable_caching = bool(options["enable_caching"])
        self.enable_kv_cache_events = device.enable_kv_cache_events
        self.hash_block_size = device.hash_block_size
        self.num_hash_lookahead_tokens = device.num_hash_lookahead_tokens
        self.coordinator = device.coordinator
        # What the host pool's view reads and calls of the tier.
        self.handle = ManagerHandle(
            owner=self,
            core=self._core,
            blocks=self._blocks,
            live={},
            live_lists={},
            engine=EngineGroups(),
            sync=self._sync,
            observe_blocks=self._observe_blocks,
            hook_allocations=self._hook_allocations,
            queue_event=device._queue_event,
            num_queued_events=lambda: 0,
        )

    def _sync(self, request: Request) -> str:
        """Registers the request (its prompt, tokens and block hashes) for one
        caching call; :meth:`forget` drops it after."""
        rid = request.request_id
        if rid not in self._core:
            add_to_core(self._core, request, self._prompt_by_length)
        sync_with_core(self._core, request)
        return rid

    def forget(self, request_id: str) -> None:
        """Drops a request registered for a caching call (its cached blocks
        stay: the engine holds them)."""
        if request_id in self._core:
            self._core.remove_request(request_id)

    def _observe_blocks(self) -> None:
        """The host pool's block activity to its metrics collector, then its
        events to the device pool's stream."""
        feed_collector(self.metrics_collector, self._core, self._blocks)
        for ev in vllm_events(self._core, MEDIUM_CPU):
            self._device._queue_event(ev)

    def _hook_allocations(self) -> None:
        """Nothing to install: the host pool's calls observe themselves."""

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self._core.evict_blocks(list(block_ids))
        self._observe_blocks()

    def reset_prefix_cache(self) -> bool:
        ok = bool(self._core.reset_prefix_cache())
        self._observe_blocks()
        return ok

    def take_events(self) -> list[Any]:
        """The device pool's events, the host tier's among them."""
        return self._device.take_events()


class HostBlockPool(BlockPoolView):
    """vLLM's host ``BlockPool`` of the source group, over a :class:`HostTier`:
    its events go to the device pool's queue (vLLM's
    ``SharedEventQueueBlockPool``) with medium ``"CPU"``."""

    def __init__(self, tier: HostTier, device_pool: BlockPoolView) -> None:
        super().__init__(tier.handle)
        self._tier = tier
        self.kv_event_queue = device_pool.kv_event_queue
        self.medium = MEDIUM_CPU

    def cache_full_blocks(self, request: Any, *args: Any, **kwargs: Any) -> None:
        """vLLM's ``cache_full_blocks`` on host blocks the source holds."""
        try:
            super().cache_full_blocks(request, *args, **kwargs)
        finally:
            self._tier.forget(request.request_id)

    def cache_partial_block(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``cache_partial_block`` on a host block the source holds."""
        try:
            return super().cache_partial_block(request, *args, **kwargs)
        finally:
            self._tier.forget(request.request_id)


class HiSparseManager(PagedKVCacheManager):
    """The manager of a layout with HiSparse groups (vLLM's
    ``hisparse_host_num_blocks``): vLLM's source manager on the host tier,
    every device group (indexer, resident, hot, regular) in the core.
    ``pagedkv.vllm.manager.HiSparseKVCacheManager`` is this class as vLLM's
    ``KVCacheManager``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = self.kv_cache_config
        coordinator = self.coordinator
        alignment = coordinator._cache_hit_alignment_tokens
        managers = list(coordinator.single_type_managers)
        engine: list[tuple[int, Any]] = []
        for g, group in enumerate(config.kv_cache_groups):
            if not engine_managed(group):
                continue
            manager = get_manager_for_kv_cache_spec(
                group.kv_cache_spec,
                self.max_in_flight_tokens or self.max_model_len,
                self.max_model_len,
                role=group.role,
                block_pool=self.block_pool,
                enable_caching=self.enable_caching,
                kv_cache_group_id=g,
                dcp_world_size=self.dcp_world_size,
                pcp_world_size=self.pcp_world_size,
                scheduler_block_size=self.scheduler_block_size,
                needs_kv_cache_zeroing=config.needs_kv_cache_zeroing,
            )
            manager.cache_hit_alignment_tokens = alignment
            if hasattr(manager, "bind_host_pool"):
                # The coordinator binds the source's host pool: pagedkv's.
                manager.bind_host_pool = self._host_binder(manager, g)
            managers[g] = manager
            engine.append((g, manager))
        coordinator.single_type_managers = tuple(managers)
        groups = self._engine
        groups.groups = tuple(engine)
        groups.ids = frozenset(g for g, _ in engine)
        first_core = next((g for g in range(len(managers)) if g not in groups.ids), len(managers))
        if any(g > first_core for g, _ in engine):
            # vLLM's coordinator refuses such a layout too (the host group must
            # precede the resident ones).
            raise ValueError("HiSparse's host source group must precede every device group")
        # Engine groups looked up for hits (the host source), before the core's.
        groups.lookup = tuple((g, m) for g, m in engine if m.kv_cache_spec.prefix_cacheable)
        self.retained_hit_group_ids = tuple(g for g, m in engine if m.retains_longer_hit)
        groups.drop_eagle = coordinator.eagle_group_ids if self.use_eagle else set()
        # The resident groups, in the core: vLLM's coordinator lets go of the
        # pages it pins where the first one is freed.
        self._resident: tuple[tuple[int, Any], ...] = tuple(
            (g, managers[g])
            for g, group in enumerate(config.kv_cache_groups)
            if isinstance(group.kv_cache_spec, HiSparseResidentSpec)
        )

    def _host_binder(self, manager: Any, group: int) -> Any:
        """The source manager's ``bind_host_pool``: its blocks from a host tier
        (:class:`HostTier`) of ``num_blocks`` blocks instead of the device pool."""

        def bind_host_pool(num_blocks: int) -> None:
            pool = HostBlockPool(HostTier(self, group, num_blocks), self.block_pool)
            manager.block_pool = pool
            manager._null_block = pool.null_block

        return bind_host_pool

    # ---- lookups -------------------------------------------------------------

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """The longest cached prefix: the host source's hit first, then the
        core's groups' hit capped at it. The source keeps its longer hit (vLLM's
        ``retains_longer_hit``); the hit length is the reconciled one."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        rid = self._sync(request)
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        cap = max_cache_hit_length
        longest = 0
        found: dict[int, list[Any]] = {}
        drop_eagle = self._engine.drop_eagle
        for g, m in self._engine.lookup:
            found[g], n = engine_group_hit(g, m, request.block_hashes, cap, g in drop_eagle)
            cap = n
            longest = max(longest, n)
        hit = self._core.get_computed_blocks(rid, cap)
        num = hit.num_computed_tokens
        longest = max(longest, hit.shared_prefix_boundary or num)
        for g, m in self._engine.lookup:
            if not m.retains_longer_hit:
                del found[g][cdiv(num, m.block_size) :]
        pool = self._blocks
        merged = tuple(
            found.get(g, []) if g in self._engine.ids else BlockRun(ids, pool)
            for g, ids in enumerate(hit.block_ids)
        )
        if not any(map(len, merged)):
            return self.empty_kv_cache_blocks, 0, 0
        blocks = KVCacheBlocks(merged)
        blocks._pagedkv_hit = (rid, merged, hit)  # type: ignore[attr-defined]
        return blocks, num, longest if longest > num else 0

    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        """``get_computed_blocks`` and False (no Mamba group to diverge)."""
        return *self.get_computed_blocks(request, max_cache_hit_length), False

    def _hit_block_ids(self, blocks: KVCacheBlocks) -> list[list[int]]:
        """The core's groups' ids of a hit the caller built (the engine-managed
        groups' blocks are their managers')."""
        engine = self._engine.ids
        return [
            [] if g in engine else [b.block_id for b in group]
            for g, group in enumerate(blocks.blocks)
        ]

    # ---- allocation ------------------------------------------------------------

    # vLLM's signature: what the engine-managed groups take is counted here, so
    # the base's ``engine_managed_blocks`` is not taken from the caller.
    def allocate_slots(  # type: ignore[override]
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """vLLM's ``allocate_slots`` over both pools: every group's need is
        counted before any allocates; then the core adopts and allocates for
        the device groups, vLLM's source manager for the host one, and every
        group caches in group order. The counts vLLM's managers get, and
        whether the step adopts its hit, are the core's
        (``hisparse_allocation_step``)."""
        rid = request.request_id
        if self._live.get(rid) is not request:
            self._register(request)
        ext = num_external_computed_tokens
        empty = self.empty_kv_cache_blocks.blocks
        hit_groups: tuple[Sequence[Any], ...] = empty
        if new_computed_blocks is not None:
            hit_groups = new_computed_blocks.blocks
            if self.retained_hit_group_ids:
                # Only the prefix the local and external hits cover is adopted.
                reused = num_new_computed_tokens + ext
                trimmed = list(hit_groups)
                for g in self.retained_hit_group_ids:
                    bs = self.coordinator.single_type_managers[g].block_size
                    trimmed[g] = trimmed[g][: cdiv(reused, bs)]
                hit_groups = tuple(trimmed)
        engine = self._engine.groups
        events = self.enable_kv_cache_events
        if events:
            # Events recorded before this call keep their place ahead of its own.
            self._queued_events += self._core_events()
        sync_with_core(self._core, request)
        local, total, main, need_slot, full, prefill_end, to_cache, adopting = (
            self._core.hisparse_allocation_step(
                rid,
                num_new_tokens,
                request.num_computed_tokens,
                num_new_computed_tokens,
                num_lookahead_tokens,
                ext,
                hit_groups is not empty,  # vLLM: a list other than its shared empty one
                any(rid in m.num_cached_block for _, m in engine),
            )
        )
        full_need = 0
        if full_sequence_must_fit:
            full_need = engine_groups_need(
                engine, rid, full, hit_groups, total, local, full, True, prefill_end
            )
        step_need = engine_groups_need(
            engine, rid, need_slot, hit_groups, local + ext, local, main, False, prefill_end
        )
        new = super().allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            ext,
            True,  # cached below, after every group allocated (vLLM's order)
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
            skip_zeroing_group_ids,
            engine_managed_blocks=(step_need, full_need),
        )
        if new is None:
            return None
        # The core adopted and allocated for its groups. vLLM runs the groups
        # before the core's first one ahead of them: on the host pool (the
        # source), so only the event stream tells; their events go first.
        core_events = self._core_events() if events else []
        self._observe_blocks()
        self.block_pool.fire_reused()
        if adopting:
            for g, m in engine:
                m.add_local_computed_blocks(rid, hit_groups[g], local, ext)
            if ext > 0:
                for g, m in engine:
                    m.allocate_external_computed_blocks(
                        rid, local, ext, record_for_zeroing=g not in skip_zeroing_group_ids
                    )
        added = {g: m.allocate_new_blocks(rid, need_slot, main) for g, m in engine}
        self._queued_events += core_events
        if adopting:
            # vLLM's resident groups report the host pages a hit adopted (once
            # the source holds them).
            for _, m in self._resident:
                if m.coordinator is not None:
                    m.coordinator.commit_computed_blocks(rid, cdiv(local, m.block_size))
        if self.enable_caching and not delay_cache_blocks:
            self._cache_in_group_order(request, to_cache)
        out = tuple(
            added[g] if g in added else new.blocks[g] for g in range(self.num_kv_cache_groups)
        )
        return self.create_kv_cache_blocks(out)

    def _hook_allocations(self) -> None:
        """Nothing to install: this ``allocate_slots`` feeds the collector and
        runs the reuse watchers itself."""

    def _cache_in_group_order(self, request: Request, num_tokens: int) -> None:
        """Every group's ``cache_blocks`` in vLLM's group order: the host
        source first (it publishes once its copies are durable), then the
        core's (synced by the allocation)."""
        coordinator = self.coordinator
        boundaries = replay_boundaries(
            request.num_prompt_tokens,
            self.scheduler_block_size,
            use_eagle=bool(self._engine.drop_eagle),
        )
        cacheable = max(0, num_tokens - coordinator.num_reprefillable_tokens)
        retention = coordinator.retention_interval
        for _, m in self._engine.groups:
            if m.enable_caching:
                m.cache_blocks(
                    request,
                    cacheable,
                    retention_interval=retention,
                    replay_boundaries=boundaries,
                )
        self._core.cache_blocks(request.request_id, num_tokens)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publishes the request's full blocks in every group, in group order."""
        if self.enable_caching:
            self._sync(request)
            self._cache_in_group_order(request, num_computed_tokens)

    # ---- freeing -----------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Frees the request's blocks in every group, in vLLM's group order."""
        rid = request.request_id
        for _, m in self._engine.groups:
            m.free(rid)
        self._release_resident(rid, self._core.free_groups_before)
        super().free(request)

    def pop_blocks_for_free(self, request: Request) -> list[Any]:
        """Every group's blocks, in group order, still referenced: the caller
        returns them with ``block_pool.free_blocks`` (host blocks go back to
        the host pool)."""
        rid = request.request_id
        out: list[Any] = []
        for _, m in self._engine.groups:
            out += m.pop_blocks_for_free(rid)
        ids = self._release_resident(rid, self._core.pop_blocks_before)
        if ids is not None:
            blocks = self._blocks
            out += [blocks[i] for i in ids.tolist()]
        out += super().pop_blocks_for_free(request)
        return out

    def _release_resident(self, request_id: str, release: Any) -> Any:
        """At the first resident group's place in the group order: the groups
        before it released (``release``: the core's ``free_groups_before`` or
        ``pop_blocks_before``; its answer is returned), then vLLM's HiSparse
        coordinator lets go of the request's pages (vLLM's resident manager
        calls it as it frees). None without resident groups or an unknown
        request."""
        if not self._resident:
            return None
        if self._live_lists:
            # Lists handed out keep the blocks they showed before any release.
            self._freeze_lists(request_id)
        g, m = self._resident[0]
        out = release(request_id, g) if request_id in self._live else None
        if m.coordinator is not None:
            m.coordinator.free(request_id)
        return out

    def reset_prefix_cache(self) -> bool:
        """Resets every pool once: the host pool, then the device pool."""
        pools = dict.fromkeys(
            m.block_pool for _, m in self._engine.groups if m.block_pool is not self.block_pool
        )
        host_ok = all([pool.reset_prefix_cache() for pool in pools])
        return super().reset_prefix_cache() and host_ok

    # ---- reading a request's blocks -----------------------------------------------

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group (the source manager's row for the host group)."""
        engine = dict(self._engine.groups)
        core_ids = self._core.get_block_ids(request_id) if request_id in self._live else None
        pool = self._blocks
        out = tuple(
            list(engine[g].req_to_blocks.get(request_id) or [])
            if g in engine
            else (BlockRun(core_ids[g], pool) if core_ids is not None else [])
            for g in range(self.num_kv_cache_groups)
        )
        return self.create_kv_cache_blocks(out)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group."""
        return tuple([b.block_id for b in g] for g in self.get_blocks(request_id).blocks)

    def estimate_cached_tokens(self, request: Request) -> int:
        """Tokens of the request's prefix cached in every cacheable group (the
        host source's blocks included)."""
        cached = super().estimate_cached_tokens(request)
        for _, m in self._engine.lookup:
            blocks = m.req_to_blocks.get(request.request_id) or []
            cached = min(cached, max((b.block_hash_num_tokens or 0 for b in blocks), default=0))
        return cached

    def new_step_starts(self) -> None:
        """Marks a step boundary for every group."""
        super().new_step_starts()
        for _, m in self._engine.groups:
            m.new_step_starts()

    # ---- block lists for the worker -------------------------------------------

    def take_new_block_ids(self) -> list[int]:
        """Fresh blocks to zero: the core's groups', then the source manager's."""
        ids = super().take_new_block_ids()
        for _, m in self._engine.groups:
            ids.extend(m.take_new_block_ids())
        return ids

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Lists the request's blocks from ``start_token`` on for zeroing again,
        in every group that zeroes."""
        super().record_blocks_for_zeroing(request_id, start_token)
        for _, m in self._engine.groups:
            if m.records_new_block_ids:
                assert start_token % m.block_size == 0
                blocks = m.req_to_blocks[request_id][start_token // m.block_size :]
                m.new_block_ids.extend(b.block_id for b in blocks)

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        """The core's block copies, then those the source manager queued."""
        copies, blocks = super().take_kv_cache_block_copies()
        for _, m in self._engine.groups:
            for src, dst in m.take_pending_cow_copies():
                copies.append(
                    KVCacheBlockCopy(src_block_id=src.block_id, dst_block_id=dst.block_id)
                )
                blocks += [src, dst]
        return copies, blocks
