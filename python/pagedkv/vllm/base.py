"""vLLM 0.33's ``KVCacheManager`` over pagedkv's core: the manager of every layout.

vLLM's ``Request`` keeps its own tokens and block hashes (hashed by the engine
with whatever hash function it runs); the core is built with
``external_block_hashes`` and each call first hands it what the request gained
since the last call (a slice of each list). Block objects are made once per
block id: their ``ref_cnt`` and ``block_hash`` read the core, so vLLM's types
cost no allocation per step beyond the lists ``KVCacheBlocks`` holds.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import vllm.v1.core.kv_cache_manager as _vllm_manager_module
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.distributed.kv_events import KVCacheEvent
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request

from pagedkv import _core
from pagedkv.errors import InvalidArgumentError, InvalidConfigError
from pagedkv.vllm.blocks import BlockRun, PagedBlock, PagedKVCacheBlocks
from pagedkv.vllm.convert import (
    add_to_core,
    core_group,
    engine_managed,
    engine_managed_group,
    feed_collector,
    sync_with_core,
    token_list,
    vllm_events,
)
from pagedkv.vllm.engine import EngineGroups
from pagedkv.vllm.groups import SingleTypeManagerView
from pagedkv.vllm.handle import ManagerHandle
from pagedkv.vllm.pool import BlockPoolView
from pagedkv.vllm.stats import LiveStats, frozen_stats
from pagedkv.vllm.views import coordinator_view

logger = logging.getLogger(__name__)


class PagedKVCacheManager:
    """vLLM 0.33's ``KVCacheManager``, answered by pagedkv's core (every
    layout; :mod:`pagedkv.vllm.hisparse` adds HiSparse's host source)."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        *,
        allow_partial_hash_hits: bool = True,
    ) -> None:
        assert watermark >= 0.0, "watermark must be non-negative"
        groups = [
            engine_managed_group(i, g.kv_cache_spec)
            if engine_managed(g)
            else core_group(g.kv_cache_spec, dcp_world_size, pcp_world_size)
            for i, g in enumerate(kv_cache_config.kv_cache_groups)
        ]
        self._group_block_sizes = [g["block_size"] for g in groups]
        options: dict[str, Any] = {
            "enable_caching": enable_caching,
            "use_eagle": use_eagle,
            "eagle_groups": [
                i
                for i, g in enumerate(kv_cache_config.kv_cache_groups)
                if getattr(g, "is_eagle_group", False)
            ],
            "log_stats": log_stats,
            "enable_kv_cache_events": enable_kv_cache_events,
            "watermark": watermark,
            "hash_block_size": hash_block_size,
            "external_block_hashes": True,
            "record_stats_at_admission": False,
            "num_hash_lookahead_tokens": num_hash_lookahead_tokens,
            "num_prefill_lookahead": num_prefill_lookahead,
            # vLLM's coordinator allows fine-grained hits wherever they apply
            # (a coordinator built on its own may turn them off).
            "partial_hash_hits": allow_partial_hash_hits,
            "dcp_world_size": dcp_world_size,
            "mamba_shared_prefix_checkpoint": enable_mamba_shared_prefix_checkpoint,
            # Mamba layouts and mixed-precision caches zero fresh attention blocks.
            "zero_new_blocks": bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False)),
        }
        if metrics_collector is not None:
            # The pool logs its block activity for vLLM's residency collector.
            options["kv_cache_metrics"] = True
        if max_in_flight_tokens is not None:
            options["max_in_flight_tokens"] = max_in_flight_tokens
        retention = getattr(kv_cache_config, "prefix_cache_retention_interval", None)
        if retention is not None:
            options["prefix_cache_retention_interval"] = retention
        # A HiSparse host tier builds its pool with the same options.
        self._core_options = options
        try:
            self._core = _core.KVCacheManager(
                kv_cache_config.num_blocks, groups, max_model_len, **options
            )
        except InvalidConfigError as e:
            raise ValueError(str(e)) from e
        self._allocate_synced = self._core.allocate_slots_synced
        # Events off: the core reads no token id's value (vLLM hashes), so a
        # new request's prompt is registered by its length, not converted.
        self._prompt_by_length = not self._core.reads_token_values
        self.max_model_len = max_model_len
        self.max_in_flight_tokens = max_in_flight_tokens
        self.dcp_world_size = dcp_world_size
        self.pcp_world_size = pcp_world_size
        self.num_prefill_lookahead = num_prefill_lookahead
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.kv_cache_config = kv_cache_config
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.mamba_shared_prefix_checkpoint: bool = self._core.mamba_shared_prefix_checkpoint
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.kv_cache_event_metadata = tuple(
            (
                get_kv_cache_spec_kind(g.kv_cache_spec).value,
                get_kv_cache_spec_sliding_window(g.kv_cache_spec),
            )
            for g in kv_cache_config.kv_cache_groups
        )
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in groups))
        # One block object per block id, made once (block 0 is the null block).
        self._blocks = [
            PagedBlock(i, self._core, i == 0) for i in range(kv_cache_config.num_blocks)
        ]
        # Requests the core holds, by id (vLLM forgets a request at free()).
        self._live: dict[str, Request] = {}
        # req_to_blocks lists handed out, frozen when their request is forgotten.
        self._live_lists: dict[str, list[weakref.ref[Any]]] = {}
        self._live_stats = LiveStats(self._core) if log_stats else None
        # Events appended to block_pool.kv_event_queue (with the core's before them).
        self._queued_events: list[KVCacheEvent] = []
        # Groups vLLM's own managers run on the pool (see pagedkv.vllm.hisparse).
        self._engine = EngineGroups()
        # What the views read and call of this manager.
        self._handle = ManagerHandle(
            owner=self,
            core=self._core,
            blocks=self._blocks,
            live=self._live,
            live_lists=self._live_lists,
            engine=self._engine,
            sync=self._sync,
            observe_blocks=self._observe_blocks,
            hook_allocations=self._hook_allocations,
            queue_event=self._queue_event,
            num_queued_events=lambda: len(self._queued_events),
        )
        self.block_pool = BlockPoolView(self._handle)
        self.coordinator = coordinator_view(self._handle, self, self._group_block_sizes)
        if metrics_collector is not None:
            # Each allocation feeds the collector (no cost when there is none).
            self._hook_allocations()

    # ---- requests ------------------------------------------------------------

    def _sync(self, request: Request) -> str:
        """Registers the request with the core on first sight, then hands the
        core the tokens and block hashes the request gained since."""
        rid = self._register(request)
        sync_with_core(self._core, request)
        return rid

    def _register(self, request: Request) -> str:
        """Registers the request with the core on first sight (its prompt)."""
        rid = request.request_id
        core = self._core
        if self._live.get(rid) is not request:
            if rid in self._live:
                # Another request object under a known id (a lookup that was
                # never scheduled, then a new request): start over.
                self._freeze_lists(rid)
                core.remove_request(rid)
            add_to_core(core, request, self._prompt_by_length)
            self._live[rid] = request
        return rid

    def _wrap(self, groups: Sequence[Any]) -> KVCacheBlocks:
        if not any(map(len, groups)):  # most decode steps allocate nothing
            return self.empty_kv_cache_blocks
        # Block objects are fetched only where read (see `BlockRun`).
        pool = self._blocks
        return PagedKVCacheBlocks(tuple([BlockRun(g, pool) for g in groups]))

    # ---- properties ----------------------------------------------------------

    @property
    def usage(self) -> float:
        """The fraction of the pool in use (vLLM's ``usage``)."""
        return self._core.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats since the last ``make_prefix_cache_stats``, not reset: a
        live view of the core's counters (vLLM's object is updated in place)."""
        return self._live_stats

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats since the last call, then reset (None without ``log_stats``)."""
        t = self._core._make_prefix_cache_stats()
        if t is None:
            return None
        if self._live_stats is not None:
            self._live_stats._freeze(t)
            self._live_stats = LiveStats(self._core)
        return frozen_stats(t)

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        """Whether a local prefix-cache lookup may run for this request."""
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Records an admitted request's lookup (the scheduler calls this)."""
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        self._core.record_prefix_cache_stats(
            request.num_tokens, num_hits, request.num_preemptions > 0
        )

    # ---- lookup and allocation ----------------------------------------------

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """The request's longest cached prefix: blocks, tokens, and the shared
        prefix boundary a sparse-retention group has not cached yet."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        rid = self._sync(request)
        hit = self._core.get_computed_blocks(rid, max_cache_hit_length)
        return self._hit_blocks(rid, hit), hit.num_computed_tokens, hit.shared_prefix_boundary

    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        """The local hit for a request scheduled with a KV connector. In a
        hybrid Mamba model, the full-attention hit even where another group's
        own hit is shorter, flagged (``hit_diverged``): only a connector that
        supplies the state there makes it usable."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0, False
        rid = self._sync(request)
        hit, diverged = self._core.get_computed_blocks_for_connector(rid, max_cache_hit_length)
        return (
            self._hit_blocks(rid, hit),
            hit.num_computed_tokens,
            hit.shared_prefix_boundary,
            diverged,
        )

    def _hit_blocks(self, rid: str, hit: Any) -> KVCacheBlocks:
        """A lookup's blocks, remembering the core's hit for ``allocate_slots``."""
        blocks = self._wrap(hit.block_ids)
        if blocks is not self.empty_kv_cache_blocks:
            blocks._pagedkv_hit = (rid, blocks.blocks, hit)  # type: ignore[attr-defined]
        return blocks

    def _hit(self, rid: str, blocks: KVCacheBlocks | None, num_new_computed_tokens: int) -> Any:
        if blocks is None or blocks is self.empty_kv_cache_blocks:
            return None
        kept = getattr(blocks, "_pagedkv_hit", None)
        if kept is not None and kept[0] == rid and kept[1] is blocks.blocks:
            return kept[2]
        # Blocks the caller built itself (a connector's, a test's): vLLM adopts
        # whatever it is handed.
        ids = self._hit_block_ids(blocks)
        if num_new_computed_tokens == 0 and not any(ids):
            return None
        return self._core.computed_blocks_from_ids(
            rid, ids, num_new_computed_tokens, check_cached=False
        )

    def _hit_block_ids(self, blocks: KVCacheBlocks) -> list[list[int]]:
        """The ids, per group, of a hit the caller built."""
        return [[b.block_id for b in g] for g in blocks.blocks]

    def allocate_slots(
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
        *,
        engine_managed_blocks: tuple[int, int] | None = None,
    ) -> KVCacheBlocks | None:
        """Slots for the request's new tokens (vLLM 0.33's ``allocate_slots``):
        the newly allocated blocks, or None when they do not fit.

        The one call of the core's ``allocate_slots_synced``: the request's
        new tokens and hashes, then the step's allocation, in one crossing (its
        checks included: vLLM's ``ValueError`` for a step with nothing to
        compute or adopt is the core's ``InvalidArgumentError``, a
        ``ValueError`` with vLLM's message). Beyond vLLM's arguments, for the
        HiSparse manager: ``engine_managed_blocks``, what the engine-managed
        groups take in this step (counted in the capacity checks)."""
        rid = request.request_id
        if self._live.get(rid) is not request:
            self._register(request)
        hit = (
            None
            if new_computed_blocks is None
            else self._hit(rid, new_computed_blocks, num_new_computed_tokens)
        )
        new = self._allocate_synced(
            rid,
            token_list(request),
            request.block_hashes,
            request.shared_prefix_boundary,
            num_new_tokens,
            request.num_computed_tokens,
            num_new_computed_tokens,
            hit,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
            request.num_in_flight_tokens,
            skip_zeroing_group_ids or None,  # nothing to convert on the common path
            request.num_prompt_tokens,
            engine_managed_blocks,
        )
        if not new:  # None (does not fit), or () (nothing allocated: most decode steps)
            return None if new is None else self.empty_kv_cache_blocks
        return self._wrap(new)

    def _hook_allocations(self) -> None:
        """From now on each ``allocate_slots`` is followed by what watches the
        pool: the metrics collector, the watchers of unpinned blocks. Installed
        on the instance once either exists, so without them it costs nothing."""
        if "allocate_slots" not in self.__dict__:
            self.allocate_slots = self._allocate_slots_hooked  # type: ignore[method-assign]

    def _allocate_slots_hooked(self, *args: Any, **kwargs: Any) -> KVCacheBlocks | None:
        """``allocate_slots``, then the block activity it caused to the collector
        and the reuse of unpinned blocks to their watchers."""
        try:
            return type(self).allocate_slots(self, *args, **kwargs)
        finally:
            self._observe_blocks()
            self.block_pool.fire_reused()

    def _observe_blocks(self) -> None:
        """Feeds vLLM's ``metrics_collector`` the pool's block activity since the
        last call, in order, as vLLM's pool calls it: blocks allocated, cached
        blocks adopted by a hit, blocks evicted, the cache reset."""
        feed_collector(self.metrics_collector, self._core, self._blocks)

    # ---- freeing ---------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first, and forgets it."""
        rid = request.request_id
        if self._live_lists:
            self._freeze_lists(rid)
        if self._live.pop(rid, None) is not None:
            self._core.remove_request(rid)

    def _freeze_lists(self, rid: str) -> None:
        for ref in self._live_lists.pop(rid, ()):
            live = ref()
            if live is not None:
                live._freeze()

    def pop_blocks_for_free(self, request: Request) -> list[PagedBlock]:
        """Forgets the request and returns its blocks, still referenced, in
        allocation order; ``block_pool.free_blocks`` returns them later."""
        rid = request.request_id
        if self._live_lists:
            self._freeze_lists(rid)
        if self._live.pop(rid, None) is None:
            return []
        blocks = self._blocks
        return [blocks[i] for i in self._core.pop_blocks_for_free(rid).tolist()]

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Releases blocks that fell out of the attention window."""
        if request_id in self._live:
            self._core.remove_skipped_blocks(request_id, processed_computed_tokens)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drops these blocks from the prefix cache."""
        self._core.evict_blocks(block_ids)
        self._observe_blocks()

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache when no block is in use."""
        ok = self._core.reset_prefix_cache()
        self._observe_blocks()
        self.block_pool.fire_reused(reset=True)
        return ok

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publishes the request's full blocks up to ``num_computed_tokens``."""
        if self.enable_caching:
            rid = self._sync(request)
            self._core.cache_blocks(rid, num_computed_tokens)

    def new_step_starts(self) -> None:
        """Marks a scheduler step boundary."""
        self._core.new_step_starts()

    # ---- reading a request's blocks -------------------------------------------

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group."""
        if request_id not in self._live:
            return self.empty_kv_cache_blocks
        return self._wrap(self._core.get_block_ids(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group."""
        if request_id not in self._live:
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return tuple(a.tolist() for a in self._core.get_block_ids(request_id))

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        """Block ids covering the request's computed tokens."""
        out: list[list[int]] = []
        for group, ids in zip(
            self.kv_cache_config.kv_cache_groups, self.get_block_ids(request_id), strict=True
        ):
            spec = group.kv_cache_spec
            if not isinstance(spec, AttentionSpec) or isinstance(
                spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec)
            ):
                out.append(ids)
            else:
                out.append(ids[: cdiv(num_computed_tokens, spec.block_size)])
        return tuple(out)

    def estimate_cached_tokens(self, request: Request) -> int:
        """Tokens of the request's prefix that its blocks hold cached."""
        if request.request_id not in self._live:
            return 0
        return self._core.estimate_cached_tokens(request.request_id)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Always zeros, as vLLM 0.33 (cascade attention was removed)."""
        return [0] * self.num_kv_cache_groups

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[Any], ...]) -> KVCacheBlocks:
        """``KVCacheBlocks`` of these lists, or the shared empty one."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def truncate_computed_blocks(
        self, blocks: KVCacheBlocks, num_computed_tokens: int
    ) -> KVCacheBlocks:
        """A lookup result cut at a block-aligned token count."""
        out: list[list[Any]] = []
        for group_blocks, manager in zip(
            blocks.blocks, self.coordinator.single_type_managers, strict=True
        ):
            if not getattr(manager.kv_cache_spec, "prefix_cacheable", True):
                # A scratch group (a ring, a replayed window) never hits, and
                # its block size need not divide the endpoint.
                assert not group_blocks
                out.append([])
                continue
            assert num_computed_tokens % manager.block_size == 0
            n = num_computed_tokens // manager.block_size
            # An external hit may supply the final Mamba state where the local
            # Mamba hit ends earlier; every other group must cover the end.
            if isinstance(manager.kv_cache_spec, MambaSpec):
                n = min(n, len(group_blocks))
            assert n <= len(group_blocks)
            out.append(list(group_blocks[:n]))
        return self.create_kv_cache_blocks(tuple(out))

    # ---- things pagedkv's layouts never produce -------------------------------

    def take_new_block_ids(self) -> list[int]:
        """Fresh attention blocks the worker zeroes before use (layouts that
        need it: Mamba hybrids, mixed-precision caches), listed since the last
        call, plus copy-on-write copies."""
        return self._core.take_new_block_ids()

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Lists the request's blocks from ``start_token`` (block-aligned) on
        for zeroing again: blocks a failed KV load left unwritten."""
        try:
            self._core.record_blocks_for_zeroing(request_id, start_token)
        except InvalidArgumentError as e:
            raise AssertionError(str(e)) from e

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[PagedBlock]]:
        """The block copies queued since the last call (a prefix hit ending inside
        a block continues in a private copy) and their endpoints, each holding
        one reference the caller returns with ``block_pool.free_blocks`` once
        the copy has run."""
        pairs = self._core.take_block_copies()
        blocks = self._blocks
        copies = [KVCacheBlockCopy(src_block_id=s, dst_block_id=d) for s, d in pairs]
        retained = [blocks[b] for pair in pairs for b in pair]
        # Then those another component queued on a group's list, as vLLM
        # drains each manager's.
        for m in self.coordinator.single_type_managers:
            if isinstance(m, SingleTypeManagerView):
                for src, dst in m.take_pending_cow_copies():
                    copies.append(
                        KVCacheBlockCopy(src_block_id=src.block_id, dst_block_id=dst.block_id)
                    )
                    retained += [src, dst]
        return copies, retained

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """This step's Mamba boundary-state hand-offs for a KV connector:
        ``{request_id: [(group_id, block_id, boundary_tokens), ...]}``."""
        offloads: dict[str, list[tuple[int, int, int]]] = {}
        for rid, group, block, tokens in self._core.take_boundary_state_offloads():
            offloads.setdefault(rid, []).append((group, block, tokens))
        return offloads

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """The boundaries a finishing request registered inside its running
        Mamba state blocks, when nothing was forwarded past them."""
        rid = request.request_id
        if rid not in self._live:
            return []
        return self._core.finalize_partial_tail_offloads(
            rid, request.num_computed_tokens, request.num_in_flight_tokens
        )

    # ---- events -------------------------------------------------------------------

    def take_events(self) -> list[KVCacheEvent]:
        """The KV-cache events since the last call, as vLLM's event objects: the
        core's and those appended to ``block_pool.kv_event_queue``, in order,
        each ``BlockStored`` annotated with its group's spec (vLLM's rules)."""
        events = self._queued_events
        self._queued_events = []
        events += self._core_events()
        if not self.enable_kv_cache_events:
            return []  # as vLLM's pool, which keeps no event then
        meta = self.kv_cache_event_metadata
        for ev in events:
            if not isinstance(ev, VllmBlockStored) or ev.group_idx is None:
                continue
            g = ev.group_idx
            if not 0 <= g < len(meta):
                _vllm_manager_module.logger.warning("Group index `%s` not in KV cache metadata", g)
                continue
            ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window = meta[g]
        return events

    def _queue_event(self, event: KVCacheEvent) -> None:
        """``block_pool.kv_event_queue.append``: another component's event, after
        every event the core recorded so far."""
        self._queued_events += self._core_events()
        self._queued_events.append(event)

    def _core_events(self) -> list[KVCacheEvent]:
        """Drains the core's events as vLLM's event objects (not annotated)."""
        return vllm_events(self._core)
