"""KV-cache metrics as vLLM counts them, and their Prometheus export.

- :class:`CachingMetrics`: vLLM's sliding-window prefix-cache hit rate over the
  most recent requests (``vllm/v1/metrics/stats.py``).
- :class:`KVCacheMetricsCollector`: vLLM's sampled block-residency metrics
  (``vllm/v1/core/kv_cache_metrics.py``): a sampled block's lifetime from
  allocation to eviction, its idle time before eviction, and the gaps between
  its last accesses (up to four kept).
- :class:`MeteredKVCacheManager`: a :class:`~pagedkv.KVCacheManager` that feeds
  both, and counts stored / evicted blocks and cache resets from its events.
- :class:`PrometheusExporter`: exports a :class:`KVCacheMetrics` through
  ``prometheus-client`` (an HTTP endpoint or any registry).

Residency is observed where vLLM observes it, in the block pool: a manager built
with ``kv_cache_metrics`` logs every block its pool pops from the free queue
(evicted, then allocated), every prefix-hit block it takes (accessed), every
eviction and reset, in order, as vLLM's pool calls its collector; the metered
manager feeds that log to its collector after each call that can add to it
(blocks allocated for connector-computed tokens included).

``prometheus-client`` is needed only by :class:`PrometheusExporter` (the
``events`` extra).
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from . import _core
from .events import BlockRemoved, BlockStored, KVCacheEvent
from .manager import KVCacheManager
from .stats import PrefixCacheStats

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

__all__ = [
    "BlockMetricsState",
    "CachingMetrics",
    "KVCacheEvictionEvent",
    "KVCacheMetrics",
    "KVCacheMetricsCollector",
    "MeteredKVCacheManager",
    "PrometheusExporter",
]


class CachingMetrics:
    """Prefix-cache hit rate over the most recent ``max_recent_requests`` requests
    (vLLM's ``CachingMetrics``).

    ``observe`` resets first when the stats carry ``reset``; stats without
    requests are skipped (so they do not push useful entries out); the oldest
    entries are dropped while more than one is kept and the requests exceed the
    limit (the newest entry always stays).
    """

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent_requests = max_recent_requests
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self.query_queue: deque[tuple[int, int, int]] = deque()

    def observe(self, stats: PrefixCacheStats) -> None:
        if stats.reset:
            self.reset()
        if stats.requests == 0:
            return
        self.query_queue.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        while len(self.query_queue) > 1 and self.aggregated_requests > self.max_recent_requests:
            requests, queries, hits = self.query_queue.popleft()
            self.aggregated_requests -= requests
            self.aggregated_query_total -= queries
            self.aggregated_query_hit -= hits

    def reset(self) -> None:
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self.query_queue.clear()

    @property
    def empty(self) -> bool:
        return self.aggregated_requests == 0

    @property
    def hit_rate(self) -> float:
        if self.aggregated_query_total == 0:
            return 0.0
        return self.aggregated_query_hit / self.aggregated_query_total


@dataclass(frozen=True)
class KVCacheEvictionEvent:
    """One sampled block's residency, recorded when it was evicted."""

    lifetime_seconds: float
    idle_seconds: float
    reuse_gaps_seconds: tuple[float, ...]


class BlockMetricsState:
    """Allocation time, last access and the last four accesses of one block."""

    __slots__ = ("access_history", "birth_time_ns", "last_access_ns")

    def __init__(self, now_ns: int) -> None:
        self.birth_time_ns = now_ns
        self.last_access_ns = now_ns
        self.access_history: deque[int] = deque(maxlen=4)

    def record_access(self, now_ns: int) -> None:
        self.last_access_ns = now_ns
        self.access_history.append(now_ns)

    def get_lifetime_seconds(self, now_ns: int) -> float:
        return (now_ns - self.birth_time_ns) / 1e9

    def get_idle_time_seconds(self, now_ns: int) -> float:
        return (now_ns - self.last_access_ns) / 1e9

    def get_reuse_gaps_seconds(self) -> list[float]:
        h = list(self.access_history)
        return [(h[i] - h[i - 1]) / 1e9 for i in range(1, len(h))]


class KVCacheMetricsCollector:
    """Sampled block residency (vLLM's ``KVCacheMetricsCollector``).

    A block is sampled at allocation with probability ``sample_rate``; accesses
    of a sampled block are recorded; its eviction queues a
    :class:`KVCacheEvictionEvent` (``drain_events``). ``clock`` returns
    nanoseconds (``time.monotonic_ns`` by default); ``rng`` draws the samples.
    """

    def __init__(
        self,
        sample_rate: float = 0.01,
        *,
        clock: Callable[[], int] = time.monotonic_ns,
        rng: Callable[[], float] = random.random,
    ) -> None:
        if not 0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1.0], got {sample_rate}")
        self.sample_rate = sample_rate
        self._clock = clock
        self._rng = rng
        self.block_metrics: dict[int, BlockMetricsState] = {}
        self._eviction_events: list[KVCacheEvictionEvent] = []

    def should_sample_block(self) -> bool:
        return self._rng() < self.sample_rate

    def on_block_allocated(self, block_id: int) -> None:
        if self.should_sample_block():
            self.block_metrics[block_id] = BlockMetricsState(self._clock())

    def on_block_accessed(self, block_id: int) -> None:
        state = self.block_metrics.get(block_id)
        if state is not None:
            state.record_access(self._clock())

    def on_block_evicted(self, block_id: int) -> None:
        state = self.block_metrics.pop(block_id, None)
        if state is None:
            return
        now = self._clock()
        self._eviction_events.append(
            KVCacheEvictionEvent(
                lifetime_seconds=state.get_lifetime_seconds(now),
                idle_seconds=state.get_idle_time_seconds(now),
                reuse_gaps_seconds=tuple(state.get_reuse_gaps_seconds()),
            )
        )

    def reset(self) -> None:
        self.block_metrics.clear()
        self._eviction_events.clear()

    def drain_events(self) -> list[KVCacheEvictionEvent]:
        events, self._eviction_events = self._eviction_events, []
        return events


@dataclass
class KVCacheMetrics:
    """Cumulative KV-cache metrics of one manager.

    Prefix-cache counters accumulate the stats snapshots (tokens, as vLLM counts
    them); ``blocks_evicted`` / ``blocks_stored`` / ``cache_resets`` come from the
    manager's events; ``usage`` / ``num_free_blocks`` and the counts of KV events
    and block activity entries dropped undrained (``dropped_events``,
    ``dropped_block_activity``: the manager's ``num_dropped_events`` /
    ``num_dropped_block_activity``) are the values at the last
    :meth:`MeteredKVCacheManager.make_prefix_cache_stats` (or ``record_usage``).
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    cache_resets: int = 0
    blocks_stored: int = 0
    blocks_evicted: int = 0
    usage: float = 0.0
    num_free_blocks: int = 0
    dropped_events: int = 0
    dropped_block_activity: int = 0
    caching: CachingMetrics = field(default_factory=CachingMetrics)
    residency: KVCacheMetricsCollector | None = None
    _listeners: list[Callable[[list[KVCacheEvictionEvent]], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe_stats(self, stats: PrefixCacheStats) -> None:
        with self._lock:
            self.requests += stats.requests
            self.queries += stats.queries
            self.hits += stats.hits
            self.preempted_requests += stats.preempted_requests
            self.preempted_queries += stats.preempted_queries
            self.preempted_hits += stats.preempted_hits
            self.caching.observe(stats)

    def observe_events(self, events: Iterable[Any]) -> None:
        """Counts :mod:`pagedkv.events` objects (or vLLM's, by their class names)."""
        stored = evicted = resets = 0
        for ev in events:
            name = type(ev).__name__
            if isinstance(ev, BlockStored) or name == "BlockStored":
                stored += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved) or name == "BlockRemoved":
                evicted += len(ev.block_hashes)
            elif name == "AllBlocksCleared":
                resets += 1
        with self._lock:
            self.blocks_stored += stored
            self.blocks_evicted += evicted
            self.cache_resets += resets

    def flush_residency(self) -> list[KVCacheEvictionEvent]:
        """Drains the residency events and hands them to the listeners (the
        Prometheus histograms)."""
        if self.residency is None:
            return []
        events = self.residency.drain_events()
        if events:
            for listener in self._listeners:
                listener(events)
        return events

    def add_residency_listener(self, fn: Callable[[list[KVCacheEvictionEvent]], None]) -> None:
        self._listeners.append(fn)

    def snapshot(self) -> dict[str, float]:
        """A consistent copy of the counters and gauges."""
        with self._lock:
            return {
                "requests": self.requests,
                "queries": self.queries,
                "hits": self.hits,
                "preempted_requests": self.preempted_requests,
                "preempted_queries": self.preempted_queries,
                "preempted_hits": self.preempted_hits,
                "cache_resets": self.cache_resets,
                "blocks_stored": self.blocks_stored,
                "blocks_evicted": self.blocks_evicted,
                "usage": self.usage,
                "num_free_blocks": self.num_free_blocks,
                "dropped_events": self.dropped_events,
                "dropped_block_activity": self.dropped_block_activity,
                "hit_rate": self.caching.hit_rate,
            }


class MeteredKVCacheManager(KVCacheManager):
    """A :class:`~pagedkv.KVCacheManager` that keeps :class:`KVCacheMetrics`.

    Same constructor, plus ``kv_cache_metrics`` (vLLM's ``--kv-cache-metrics``:
    sample block residency; the pool then logs its block activity),
    ``kv_cache_metrics_sample`` (the sampling rate), ``residency_collector`` (a
    collector of one's own, which also turns sampling on) and
    ``max_recent_requests`` (the hit-rate window). Prefix-cache counters need
    ``log_stats=True``; eviction counts need ``enable_kv_cache_events=True``.
    The metrics are fed on the calling (scheduler) thread; exporters read
    snapshots.
    """

    metrics: KVCacheMetrics

    def __new__(
        cls,
        *args: Any,
        kv_cache_metrics: bool = False,
        kv_cache_metrics_sample: float = 0.01,
        max_recent_requests: int = 1000,
        residency_collector: KVCacheMetricsCollector | None = None,
        **kwargs: Any,
    ) -> MeteredKVCacheManager:
        if residency_collector is None and kv_cache_metrics:
            residency_collector = KVCacheMetricsCollector(kv_cache_metrics_sample)
        kwargs["kv_cache_metrics"] = residency_collector is not None
        self = cast(MeteredKVCacheManager, super().__new__(cls, *args, **kwargs))
        self.metrics = KVCacheMetrics(
            caching=CachingMetrics(max_recent_requests), residency=residency_collector
        )
        self.record_usage()
        return self

    def record_usage(self) -> None:
        """Copies ``usage``, ``num_free_blocks`` and the counts of undrained KV
        events and block activity entries dropped into the metrics."""
        with self.metrics._lock:
            self.metrics.usage = self.usage
            self.metrics.num_free_blocks = self.num_free_blocks
            self.metrics.dropped_events = self.num_dropped_events
            self.metrics.dropped_block_activity = self.num_dropped_block_activity

    def _observe_blocks(self) -> None:
        """Feeds the pool's block activity since the last call to the collector."""
        col = self.metrics.residency
        if col is None:
            return
        kinds, ids = self.take_block_activity()
        for kind, bid in zip(kinds.tolist(), ids.tolist(), strict=True):
            if kind == _core.BLOCK_ALLOCATED:
                col.on_block_allocated(bid)
            elif kind == _core.BLOCK_ACCESSED:
                col.on_block_accessed(bid)
            elif kind == _core.BLOCK_EVICTED:
                col.on_block_evicted(bid)
            else:
                col.reset()

    def allocate_slots(self, request_id: str, num_new_tokens: int, **kwargs: Any) -> Any:
        result = super().allocate_slots(request_id, num_new_tokens, **kwargs)
        self._observe_blocks()
        return result

    def allocate_slots_batch(self, *args: Any, **kwargs: Any) -> Any:
        result = super().allocate_slots_batch(*args, **kwargs)
        self._observe_blocks()
        return result

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        super().evict_blocks(block_ids)
        self._observe_blocks()

    def reset_prefix_cache(self) -> bool:
        ok = super().reset_prefix_cache()
        self._observe_blocks()
        return ok

    def take_events(self, *, raw_hashes: bool = False) -> list[KVCacheEvent]:
        events = super().take_events(raw_hashes=raw_hashes)
        if events:
            self.metrics.observe_events(events)
        return events

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats since the last call (also added to the metrics), after
        recording usage and handing residency events to the exporters."""
        stats = super().make_prefix_cache_stats()
        if stats is not None:
            self.metrics.observe_stats(stats)
        self.record_usage()
        self.metrics.flush_residency()
        return stats


# Residency histogram buckets, in seconds: vLLM 0.33's `kv_cache_residency` family
# (millisecond reuse gaps up to 30-minute lifetimes).
RESIDENCY_BUCKETS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0,
    60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0,
)  # fmt: skip


class PrometheusExporter:
    """Exports a :class:`KVCacheMetrics` through ``prometheus-client``.

    Counters (``<prefix>prefix_cache_queries_total``, ``..._hits_total``,
    ``..._requests_total``, the preempted trio, ``<prefix>kv_cache_blocks_stored_total``,
    ``<prefix>kv_cache_evictions_total``, ``<prefix>prefix_cache_resets_total``,
    ``<prefix>kv_events_dropped_total`` and ``<prefix>kv_block_activity_dropped_total``:
    entries of the manager's capped queues dropped because nobody drained them),
    gauges (``<prefix>kv_cache_usage_perc``, ``<prefix>kv_cache_free_blocks``,
    ``<prefix>prefix_cache_hit_rate`` over the sliding window) and the residency
    histograms ``<prefix>kv_block_lifetime_seconds``,
    ``<prefix>kv_block_idle_before_evict_seconds``, ``<prefix>kv_block_reuse_gap_seconds``.
    ``prefix="vllm:"`` gives vLLM's names. ``labels`` are constant labels on every
    series (e.g. ``{"replica": "r0"}``).
    """

    def __init__(
        self,
        metrics: KVCacheMetrics,
        *,
        registry: CollectorRegistry | None = None,
        prefix: str = "pagedkv:",
        labels: dict[str, str] | None = None,
    ) -> None:
        from prometheus_client import CollectorRegistry, Histogram

        self.metrics = metrics
        self.registry = registry if registry is not None else CollectorRegistry()
        self.prefix = prefix
        self.labels = dict(labels or {})
        self._server: Any = None
        self._thread: threading.Thread | None = None
        names = list(self.labels)

        def hist(name: str, doc: str) -> Any:
            h = Histogram(
                prefix + name, doc, names, registry=self.registry, buckets=RESIDENCY_BUCKETS
            )
            return h.labels(**self.labels) if names else h

        self._lifetime = hist("kv_block_lifetime_seconds", "Sampled KV block lifetime.")
        self._idle = hist(
            "kv_block_idle_before_evict_seconds", "Sampled KV block idle time before eviction."
        )
        self._reuse = hist("kv_block_reuse_gap_seconds", "Gaps between sampled block accesses.")
        metrics.add_residency_listener(self._observe)
        self.registry.register(self)

    def _observe(self, events: list[KVCacheEvictionEvent]) -> None:
        for ev in events:
            self._lifetime.observe(ev.lifetime_seconds)
            self._idle.observe(ev.idle_seconds)
            for gap in ev.reuse_gaps_seconds:
                self._reuse.observe(gap)

    _COUNTERS = (
        ("prefix_cache_queries", "queries", "Prefix-cache queries, in tokens."),
        ("prefix_cache_hits", "hits", "Prefix-cache hits, in tokens."),
        ("prefix_cache_requests", "requests", "Requests looked up in the prefix cache."),
        ("prefix_cache_preempted_queries", "preempted_queries", "Preempted requests' queries."),
        ("prefix_cache_preempted_hits", "preempted_hits", "Hits of preempted requests."),
        ("prefix_cache_preempted_requests", "preempted_requests", "Preempted requests."),
        ("prefix_cache_resets", "cache_resets", "Successful prefix-cache resets."),
        ("kv_cache_blocks_stored", "blocks_stored", "Blocks entered into the prefix cache."),
        ("kv_cache_evictions", "blocks_evicted", "Cached blocks evicted."),
        ("kv_events_dropped", "dropped_events", "KV events dropped undrained."),
        ("kv_block_activity_dropped", "dropped_block_activity",
         "Block activity entries dropped undrained."),
    )  # fmt: skip
    _GAUGES = (
        ("kv_cache_usage_perc", "usage", "Fraction of KV-cache blocks in use (0-1)."),
        ("kv_cache_free_blocks", "num_free_blocks", "Free KV-cache blocks."),
        ("prefix_cache_hit_rate", "hit_rate", "Prefix-cache hit rate, recent requests."),
    )

    def _families(self, snap: dict[str, Any] | None) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        names, values = list(self.labels), list(self.labels.values())
        p = self.prefix
        kinds = ((CounterMetricFamily, self._COUNTERS), (GaugeMetricFamily, self._GAUGES))
        for family, metrics in kinds:
            for name, key, doc in metrics:
                f = family(p + name, doc, labels=names)
                if snap is not None:
                    f.add_metric(values, snap[key])
                yield f

    def collect(self) -> Iterable[Any]:
        """The counters and gauges at scrape time (a prometheus-client collector)."""
        return self._families(self.metrics.snapshot())

    def describe(self) -> Iterable[Any]:
        """The metric names without values, so a registry can filter by name
        (``/metrics?name[]=...``) without scraping."""
        return self._families(None)

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serves ``/metrics`` over HTTP on a daemon thread; returns the port."""
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        """Stops the HTTP server (if any)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
