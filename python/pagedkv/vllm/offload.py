"""vLLM 0.33's ``CPUOffloadingManager`` on pagedkv's host tier.

The class vLLM's ``CPUOffloadingSpec`` (behind the ``OffloadingConnector``) and
its tiering manager build: the same constructor and calls, answered by
``pagedkv._core.OffloadTier``. This module converts only: vLLM's request
contexts to the tier's request ints, their recorded key positions to position
lists, the tier's answers to vLLM's types. A policy other than ``lru`` /
``arc`` (an out-of-tree one) gets vLLM's own class.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu import manager as _vllm_cpu_manager
from vllm.v1.kv_offload.cpu.common import (
    CPULoadStoreSpec,
    CPUOffloadingInfo,
    CPUOffloadingMetrics,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from pagedkv._core import OffloadTier
from pagedkv.vllm.offload_views import ARCPolicyView, LRUPolicyView, TrackerView, policy_view

__all__ = ["VLLM_CPU_OFFLOADING_MANAGER", "CPUOffloadingManager"]

#: vLLM's own class, kept before ``install()`` replaces the name.
VLLM_CPU_OFFLOADING_MANAGER: type = _vllm_cpu_manager.CPUOffloadingManager

_RECORDED_POSITION = ReqContext.get_offload_key_position
_LOOKUP = (LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING)
_MEDIA = {"CPU": Medium.CPU}


def _spec(slots: npt.NDArray[np.int32]) -> CPULoadStoreSpec:
    """vLLM's ``CPULoadStoreSpec`` of the slots (its constructor takes a list and
    keeps it as an int32 array; the slots are one already)."""
    spec = CPULoadStoreSpec.__new__(CPULoadStoreSpec)
    spec.block_ids = slots
    return spec


class _TierRequest:
    """A request context's int in one tier (kept in the context's state)."""

    __slots__ = ("owner", "req")

    def __init__(self, owner: object, req: int) -> None:
        self.owner = owner
        self.req = req


class CPUOffloadingManager(OffloadingManager):
    """vLLM's CPU offloading manager (LRU or ARC) on pagedkv's core."""

    def __new__(cls, num_chunks: int, cache_policy: str = "lru", *args: Any, **kwargs: Any) -> Any:
        if cache_policy not in ("lru", "arc"):
            return VLLM_CPU_OFFLOADING_MANAGER(num_chunks, cache_policy, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info: CPUOffloadingInfo | None = None,
    ) -> None:
        del cache_policy_module_path  # built-in policies only reach this class
        self.medium: Medium = Medium.CPU
        self._tier = OffloadTier(
            num_chunks,
            cache_policy,
            enable_events=enable_events,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
        )
        self._policy: ARCPolicyView | LRUPolicyView = policy_view(self._tier)
        self.counts: TrackerView | None = TrackerView(self._tier) if store_threshold >= 2 else None
        self._config_info: ConfigInfoMapping = info.as_config_info() if info is not None else {}
        self._num_chunks = num_chunks
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self._next_req = itertools.count(1)
        # requests whose context was collected: forgotten at the next call
        self._gone: list[int] = []

    # --- request contexts ---

    def _req(self, ctx: ReqContext) -> int:
        state = ctx.get_state(_TierRequest)
        if state is not None and state.owner is self:
            return state.req
        if self._gone:
            self._forget_gone()
        req = next(self._next_req)
        ctx.set_state(_TierRequest(self, req))
        weakref.finalize(ctx, self._gone.append, req)
        return req

    def _forget_gone(self) -> None:
        # the same list object throughout: every finalizer appends to it
        while self._gone:
            self._tier.forget_request(self._gone.pop())

    @staticmethod
    def _positions(
        keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> dict[OffloadKey, int] | list[int | None] | None:
        known = ctx._offload_key_positions
        if not known:
            return None
        if type(ctx).get_offload_key_position is _RECORDED_POSITION:
            return known  # the tier reads the context's own record
        position = ctx.get_offload_key_position
        return [position(k) for k in keys]

    # --- OffloadingManager ---

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._tier.on_new_request(self._req(req_context))
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _LOOKUP[self._tier.lookup(key)]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        req = self._req(req_context)
        return _spec(self._tier.prepare_load(keys, req, self._positions(keys, req_context)))

    def _prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext, *, record_access: bool
    ) -> LoadStoreSpec:
        """vLLM's pin with or without a request access (its tiering manager's
        ``prepare_read`` pins without one)."""
        if record_access:
            return self.prepare_load(keys, req_context)
        return _spec(self._tier.prepare_read(list(keys)))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._tier.touch(list(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._tier.complete_load(list(keys))

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        keys = list(keys)
        req = self._req(req_context)
        out = self._tier.prepare_store(keys, req, self._positions(keys, req_context))
        if out is None:
            return None
        to_store, slots, evicted = out
        return PrepareStoreOutput(
            keys_to_store=to_store, store_spec=_spec(slots), evicted_keys=evicted
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self._tier.complete_store(list(keys), success)

    def on_request_finished(self, req_context: ReqContext) -> None:
        state = req_context.get_state(_TierRequest)
        if state is None or state.owner is not self:
            return
        self._tier.on_request_finished(state.req, None, req_context._offload_key_positions)

    def reset_cache(self) -> None:
        self._tier.reset_cache()

    def take_events(self) -> Iterator[OffloadingEvent]:
        for keys, medium, removed, metadata_only in self._tier.take_events():
            yield OffloadingEvent(
                keys=keys, medium=_MEDIA[medium], removed=removed, metadata_only=metadata_only
            )

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._config_info]

    def get_stats(self) -> OffloadingConnectorStats | None:
        usage, write_usage, read_usage, sizes, skipped = self._tier.stats()
        stats = OffloadingConnectorStats()
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, usage)
        for size in sizes:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write_usage)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, read_usage)
        if skipped is not None:
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, skipped)
        return stats

    # --- pagedkv's own read-outs ---

    @property
    def tier(self) -> OffloadTier:
        """The core tier behind this manager."""
        return self._tier

    @property
    def stores_skipped_in_current_batch(self) -> int:
        return self._tier.stores_skipped_in_current_batch

    @property
    def allocation_sizes_in_current_batch(self) -> list[int]:
        return self._tier.allocation_sizes_in_current_batch

    @property
    def _num_evictable_cache_chunks(self) -> int:
        return self._tier.num_evictable

    @property
    def _num_allocated_chunks(self) -> int:
        return self._tier.num_slots_used

    @property
    def _free_list(self) -> list[int]:
        return self._tier.freed_slots

    @property
    def _num_write_pending_chunks(self) -> int:
        return self._tier.num_write_pending
