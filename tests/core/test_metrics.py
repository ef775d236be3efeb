"""Metrics: vLLM's hit-rate window and residency sampling, and the Prometheus
endpoint scraped over HTTP against the manager's own stats."""

from __future__ import annotations

import random
import urllib.request
from typing import Any

import pytest
from pagedkv.metrics import (
    CachingMetrics,
    KVCacheMetricsCollector,
    MeteredKVCacheManager,
)
from pagedkv.stats import PrefixCacheStats

from tests._util import make_manager


def _stats(requests: int, queries: int, hits: int, reset: bool = False) -> PrefixCacheStats:
    return PrefixCacheStats(reset=reset, requests=requests, queries=queries, hits=hits)


def test_caching_metrics_window_follows_vllm() -> None:
    # vLLM's test_metrics / test_metrics_empty_stats with max_recent_requests=5.
    m = CachingMetrics(max_recent_requests=5)
    assert m.empty and m.hit_rate == 0.0
    m.observe(_stats(1, 20, 9))
    assert m.hit_rate == pytest.approx(0.45)
    m.observe(_stats(4, 80, 16))
    assert m.hit_rate == pytest.approx(0.25)
    m.observe(_stats(1, 10, 2))  # six requests: the first entry leaves the window
    assert (m.aggregated_requests, m.aggregated_query_total, m.aggregated_query_hit) == (5, 90, 18)
    assert m.hit_rate == pytest.approx(0.2)
    m.observe(_stats(0, 0, 0))  # empty stats do not enter the window
    assert m.aggregated_requests == 5
    m.observe(_stats(0, 0, 0, reset=True))
    assert m.empty and m.hit_rate == 0.0
    m.observe(_stats(11, 20, 10))  # larger than the window: only the newest stays
    assert m.hit_rate == pytest.approx(0.5)
    m.observe(_stats(22, 40, 30))
    assert m.hit_rate == pytest.approx(0.75) and len(m.query_queue) == 1


class Clock:
    def __init__(self) -> None:
        self.t = 0

    def at(self, seconds: float) -> None:
        self.t = int(seconds * 1e9)

    def __call__(self) -> int:
        return self.t


def test_residency_collector_follows_vllm() -> None:
    for bad in (-0.1, 1.5, 0.0):
        with pytest.raises(ValueError):
            KVCacheMetricsCollector(bad)
    clock = Clock()
    c = KVCacheMetricsCollector(1.0, clock=clock)
    clock.at(1)
    c.on_block_allocated(7)
    clock.at(2)
    c.on_block_accessed(7)
    clock.at(3)
    c.on_block_accessed(7)
    clock.at(4)
    c.on_block_evicted(7)
    (ev,) = c.drain_events()
    assert (ev.lifetime_seconds, ev.idle_seconds, ev.reuse_gaps_seconds) == (3.0, 1.0, (1.0,))
    assert 7 not in c.block_metrics and c.drain_events() == []
    # Without accesses idle time equals lifetime; only the last four accesses count.
    c.on_block_allocated(1)
    c.on_block_allocated(2)
    for t in range(5, 10):
        clock.at(t)
        c.on_block_accessed(2)
    clock.at(10)
    c.on_block_evicted(1)
    c.on_block_evicted(2)
    c.on_block_evicted(3)  # never sampled
    e1, e2 = c.drain_events()
    assert (e1.lifetime_seconds, e1.idle_seconds, e1.reuse_gaps_seconds) == (6.0, 6.0, ())
    assert e2.reuse_gaps_seconds == (1.0, 1.0, 1.0) and e2.idle_seconds == 1.0
    c.on_block_allocated(4)
    c.reset()
    assert c.block_metrics == {} and c.drain_events() == []
    half = KVCacheMetricsCollector(0.5, rng=random.Random(0).random)
    for b in range(1000):
        half.on_block_allocated(b)
    assert 400 <= len(half.block_metrics) <= 600


def _workload(mgr: MeteredKVCacheManager, steps: int, seed: int = 0) -> dict[str, Any]:
    """Runs requests sharing prefixes; returns the stats and events the caller saw."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(30_000) for _ in range(32)] for _ in range(4)]
    seen = {"requests": 0, "queries": 0, "hits": 0, "removed": 0, "stored": 0, "residency": 0}
    for step in range(steps):
        for i in range(3):
            rid = f"{step}-{i}"
            prompt = rng.choice(prefixes)[: rng.randrange(4, 33)] + [
                rng.randrange(30_000) for _ in range(rng.randrange(1, 20))
            ]
            mgr.add_request(rid, prompt)
            hit = mgr.get_computed_blocks(rid)
            n = hit.num_computed_tokens
            mgr.allocate_slots(
                rid,
                len(prompt) - n,
                num_computed_tokens=0,
                num_new_computed_tokens=n,
                new_computed_blocks=hit,
            )
            mgr.remove_request(rid)
        for ev in mgr.take_events():
            if type(ev).__name__ == "BlockRemoved":
                seen["removed"] += len(ev.block_hashes)  # type: ignore[union-attr]
            elif type(ev).__name__ == "BlockStored":
                seen["stored"] += len(ev.block_hashes)  # type: ignore[union-attr]
        stats = mgr.make_prefix_cache_stats()
        assert stats is not None
        seen["requests"] += stats.requests
        seen["queries"] += stats.queries
        seen["hits"] += stats.hits
    return seen


def _metered(**kw: Any) -> MeteredKVCacheManager:
    base = make_manager(block_size=4, num_blocks=48)
    return MeteredKVCacheManager(
        base.kv_cache_config, max_model_len=4096, log_stats=True, enable_kv_cache_events=True, **kw
    )


def test_metered_manager_counts_what_the_manager_reports() -> None:
    mgr = _metered(kv_cache_metrics=True, kv_cache_metrics_sample=1.0)
    residency: list[Any] = []
    mgr.metrics.add_residency_listener(residency.extend)
    seen = _workload(mgr, 60)
    snap = mgr.metrics.snapshot()
    assert snap["requests"] == seen["requests"] == 180
    assert (snap["queries"], snap["hits"]) == (seen["queries"], seen["hits"])
    assert seen["hits"] > 0 and seen["removed"] > 0
    assert (snap["blocks_evicted"], snap["blocks_stored"]) == (seen["removed"], seen["stored"])
    assert snap["usage"] == mgr.usage and snap["num_free_blocks"] == mgr.num_free_blocks
    # Every block popped again from the free queue ends a sampled residency.
    assert residency and all(e.lifetime_seconds >= e.idle_seconds >= 0 for e in residency)
    assert any(e.reuse_gaps_seconds for e in residency)  # prefix hits touched blocks
    assert mgr.reset_prefix_cache() and mgr.metrics.residency is not None
    assert mgr.metrics.residency.block_metrics == {}


def test_blocks_for_connector_tokens_are_sampled_too() -> None:
    # Blocks allocated for tokens computed elsewhere (num_external_computed_tokens)
    # are held by the request but not returned as new blocks: residency sampling
    # (rate 1) still starts for every block the request holds.
    mgr = _metered(kv_cache_metrics=True, kv_cache_metrics_sample=1.0)
    mgr.add_request("r", list(range(20)))
    new = mgr.allocate_slots("r", 4, num_computed_tokens=0, num_external_computed_tokens=16)
    assert new is not None
    held = [int(b) for b in mgr.get_block_ids("r")[0]]
    returned = [int(b) for b in new[0]]
    assert len(held) == 5 and len(returned) < len(held)  # the connector's blocks exist
    assert mgr.metrics.residency is not None
    assert set(mgr.metrics.residency.block_metrics) == set(held)


def test_prometheus_endpoint_matches_the_managers_stats() -> None:
    pytest.importorskip("prometheus_client")
    from pagedkv.metrics import PrometheusExporter
    from prometheus_client.parser import text_string_to_metric_families

    mgr = _metered(kv_cache_metrics=True, kv_cache_metrics_sample=1.0)
    exporter = PrometheusExporter(mgr.metrics, labels={"replica": "r0"})
    port = exporter.serve(0)
    try:
        seen = _workload(mgr, 40, seed=1)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    finally:
        exporter.close()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
    }

    def value(name: str, **extra: str) -> float:
        return samples[(name, tuple(sorted({"replica": "r0", **extra}.items())))]

    assert value("pagedkv:prefix_cache_queries_total") == seen["queries"]
    assert value("pagedkv:prefix_cache_hits_total") == seen["hits"]
    assert value("pagedkv:prefix_cache_requests_total") == seen["requests"] == 120
    assert value("pagedkv:kv_cache_evictions_total") == seen["removed"] > 0
    assert value("pagedkv:kv_cache_blocks_stored_total") == seen["stored"]
    assert value("pagedkv:kv_cache_usage_perc") == pytest.approx(mgr.usage)
    assert value("pagedkv:kv_cache_free_blocks") == mgr.num_free_blocks
    assert value("pagedkv:prefix_cache_hit_rate") == pytest.approx(seen["hits"] / seen["queries"])
    lifetimes = value("pagedkv:kv_block_lifetime_seconds_count")
    assert lifetimes > 0
    assert value("pagedkv:kv_block_idle_before_evict_seconds_count") == lifetimes
    assert value("pagedkv:kv_block_lifetime_seconds_bucket", le="+Inf") == lifetimes


def test_undrained_queue_drops_are_counted_and_exported() -> None:
    pytest.importorskip("prometheus_client")
    from pagedkv.metrics import PrometheusExporter
    from prometheus_client import generate_latest

    mgr = _metered(max_pending_events=4)
    exporter = PrometheusExporter(mgr.metrics)
    for i in range(20):  # events never drained
        mgr.add_request(f"r{i}", [i * 8 + t for t in range(8)])
        assert mgr.allocate_slots(f"r{i}", 8, num_computed_tokens=0) is not None
        mgr.remove_request(f"r{i}")
    assert mgr.metrics.snapshot()["dropped_events"] == 0  # read at the next stats
    mgr.make_prefix_cache_stats()
    dropped = mgr.num_dropped_events
    assert dropped > 0
    snap = mgr.metrics.snapshot()
    assert (snap["dropped_events"], snap["dropped_block_activity"]) == (dropped, 0)
    text = generate_latest(exporter.registry).decode()
    assert f"pagedkv:kv_events_dropped_total {float(dropped)}" in text
    assert "pagedkv:kv_block_activity_dropped_total 0.0" in text


def test_vllm_metric_names_by_prefix() -> None:
    pytest.importorskip("prometheus_client")
    from pagedkv.metrics import PrometheusExporter
    from prometheus_client import generate_latest

    mgr = _metered()
    exporter = PrometheusExporter(mgr.metrics, prefix="vllm:")
    _workload(mgr, 2)
    text = generate_latest(exporter.registry).decode()
    for name in (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:kv_cache_usage_perc",
        "vllm:kv_block_lifetime_seconds_count",
    ):
        assert name in text


def test_a_scrape_filtered_by_name_keeps_the_counters_and_gauges() -> None:
    pytest.importorskip("prometheus_client")
    from pagedkv.metrics import PrometheusExporter
    from prometheus_client import generate_latest

    mgr = _metered()
    exporter = PrometheusExporter(mgr.metrics)
    _workload(mgr, 2)
    # What `/metrics?name[]=...` serves: the registry restricted to those names.
    wanted = ["pagedkv:prefix_cache_hits_total", "pagedkv:kv_cache_free_blocks"]
    text = generate_latest(exporter.registry.restricted_registry(wanted)).decode()
    assert "pagedkv:prefix_cache_hits_total" in text
    assert f"pagedkv:kv_cache_free_blocks {float(mgr.num_free_blocks)}" in text
    assert "pagedkv:prefix_cache_queries_total" not in text


def test_residency_histograms_use_vllms_buckets() -> None:
    from pagedkv.metrics import RESIDENCY_BUCKETS

    # vLLM 0.33's `kv_cache_residency` bucket family (vllm/v1/metrics/buckets.py).
    assert RESIDENCY_BUCKETS == (
        0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120,
        300, 600, 1200, 1800,
    )  # fmt: skip
