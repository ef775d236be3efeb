"""Many replicas behind a router (``--replicas``, ``--router``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from pagedkv import cli
from pagedkv.sim.cluster import run_cluster
from pagedkv.sim.policy import Request
from pagedkv.sim.runner import SimConfig, run_pagedkv
from pagedkv.sim.traces import prefix_hit_ceiling
from pagedkv.sim.workloads import Workload, WorkloadOptions, generate

BASE = SimConfig(memory_gib=2.0, max_model_len=4096)


def test_one_replica_runs_exactly_like_the_single_scheduler() -> None:
    w = generate("chat", WorkloadOptions(num_requests=120, seed=4))
    single = run_pagedkv(w, BASE)
    cluster = run_cluster(w, replace(BASE, replicas=1))
    assert cluster.timing == single.timing
    for key in ("steps", "hit_tokens", "query_tokens", "preemptions", "admissions"):
        assert getattr(cluster, key) == getattr(single, key), key
    assert cluster.series["time_s"] == single.series["time_s"]


def test_round_robin_takes_turns() -> None:
    w = generate("tenants", WorkloadOptions(num_requests=40))
    r = run_pagedkv(w, replace(BASE, replicas=4, router="round-robin"))
    assert [x["requests"] for x in r.extra["replicas"]] == [10, 10, 10, 10]
    assert r.finished == 40 and sum(x["steps"] for x in r.extra["replicas"]) == r.steps


def _long_then_short() -> Workload:
    long = Request("long", list(range(3000)), [1] * 400, arrival_s=0.0)
    short = [
        Request(
            f"s{i}",
            list(range(10_000 + 100 * i, 10_050 + 100 * i)),
            [1] * 4,
            arrival_s=0.1 + 0.05 * i,
        )
        for i in range(6)
    ]
    return Workload("skew", [long, *short])


def test_least_loaded_avoids_the_busy_replica() -> None:
    rr = run_pagedkv(_long_then_short(), replace(BASE, replicas=2, router="round-robin"))
    ll = run_pagedkv(_long_then_short(), replace(BASE, replicas=2, router="least-loaded"))
    # Each short request finishes before the next arrives. Round robin puts
    # three of them beside the long decode; least-loaded sends all of them to
    # the replica with nothing running.
    assert [x["requests"] for x in rr.extra["replicas"]] == [4, 3]
    assert [x["requests"] for x in ll.extra["replicas"]] == [1, 6]


def test_prefix_aware_routing_keeps_conversations_on_their_cache() -> None:
    w = generate("chat", WorkloadOptions(num_requests=200, seed=1, rate=0.01))
    ceiling = prefix_hit_ceiling(w, 16)
    cfg = replace(BASE, memory_gib=8.0, replicas=4)
    aware = run_pagedkv(w, replace(cfg, router="prefix-aware"))
    rr = run_pagedkv(w, replace(cfg, router="round-robin"))
    # Turns go where their history is cached (unless that replica's running
    # requests hold more blocks than the history saves): close to the hit rate
    # of one unlimited cache, where round robin loses most of it.
    assert ceiling - 0.05 < aware.hit_rate <= ceiling
    assert rr.hit_rate < ceiling - 0.3
    assert aware.timing["ttft_ms"]["mean"] < rr.timing["ttft_ms"]["mean"]


def test_replicas_and_router_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(
        [
            "simulate",
            "-q",
            "-n",
            "60",
            "--memory",
            "2",
            "--max-model-len",
            "4096",
            "--replicas",
            "3",
            "--sweep",
            "router=round-robin,least-loaded,prefix-aware",
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out)
    assert [p["value"] for p in doc["points"]] == ["round-robin", "least-loaded", "prefix-aware"]
    for p in doc["points"]:
        assert p["status"] == "ok" and len(p["run"]["replicas"]) == 3
        assert p["run"]["finished"] == 60


@pytest.mark.parametrize(
    "argv",
    [["--replicas", "0"], ["--replicas", "100000"], ["--router", "random"]],
)
def test_bad_replica_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["simulate", *argv])
    assert e.value.code == 2


def test_vllm_engine_runs_one_replica(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "-q", "--engine", "vllm", "--replicas", "2"]) == 2
    assert "one replica" in capsys.readouterr().err


def test_prefix_aware_routing_does_not_depend_on_the_hash_algorithm() -> None:
    # Every manager of a simulation hashes alike: with a non-cryptographic hash
    # (random seed per manager by default) the router's hashes must still match
    # the replicas' events, so routing is the same as with sha256_cbor.
    w = generate("chat", WorkloadOptions(num_requests=150, seed=1, rate=0.01))
    cfg = replace(BASE, memory_gib=8.0, replicas=3, router="prefix-aware")
    runs = [run_pagedkv(w, replace(cfg, hash_algo=h)) for h in ("sha256_cbor", "xxh3_native")]
    assert runs[0].hit_rate == runs[1].hit_rate > 0.7
    assert [x["requests"] for x in runs[0].extra["replicas"]] == [
        x["requests"] for x in runs[1].extra["replicas"]
    ]
