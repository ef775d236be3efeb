"""What a capacity study needs: closed-loop clients (``--max-concurrency``),
requests longer than the model rejected and counted (``--on-overlong``), the LRU
hit rate against cache size (``trace-stats --capacity``) and the KV-cache memory
line of the summary."""

from __future__ import annotations

import json
import random
import zlib
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import pytest
from pagedkv import cli
from pagedkv.sim import runner
from pagedkv.sim.backend import ManagerBackend
from pagedkv.sim.policy import Request, Scheduler, drive_timed
from pagedkv.sim.runner import SimConfig, run_pagedkv
from pagedkv.sim.steptime import Latencies, LinearModel
from pagedkv.sim.tracefile import write_trace
from pagedkv.sim.workloads import Workload, WorkloadOptions, generate

# Every step lasts 10 ms, whatever it computes.
TEN_MS = "10,0,0,0"
CFG = SimConfig(memory_gib=1.0, max_model_len=4096, step_time=TEN_MS)


def _req(rid: str, out: int, *, arrival: float = 0.0, **kw: Any) -> Request:
    # 16 distinct prompt tokens: a request's first step computes its prompt and
    # samples its first token, each later step one more token.
    base = 1000 * (zlib.crc32(rid.encode()) % 1_000_000)
    return Request(rid, list(range(base, base + 16)), [1] * out, arrival_s=arrival, **kw)


def _drive(items: list[Request], cfg: SimConfig = CFG) -> Latencies:
    w = Workload("t", items)
    config, max_model_len = runner.build_config(cfg, w)
    kv = runner.make_manager(cfg, config, max_model_len)
    sched = Scheduler(ManagerBackend(kv), runner.scheduler_config(cfg, config))
    lat = Latencies()
    drive_timed(
        sched,
        [r.fresh() for r in items],
        LinearModel.parse(TEN_MS),
        tick_s=cfg.tick_s,
        latencies=lat,
        max_concurrency=cfg.max_concurrency,
    )
    return lat


def _ms(times: dict[str, float]) -> dict[str, float]:
    return {k: round(v * 1000, 6) for k, v in times.items()}


# ------------------------------------------------------------------ max concurrency


def test_at_most_n_requests_are_in_flight_and_the_others_are_sent_when_one_finishes() -> None:
    items = [_req(f"r{i}", 3) for i in range(4)]
    free = _drive(items)
    # No limit: all four run together, three steps of 10 ms.
    assert _ms(free.arrival) == {"r0": 0, "r1": 0, "r2": 0, "r3": 0}
    assert _ms(free.finish) == {"r0": 30, "r1": 30, "r2": 30, "r3": 30}
    two = _drive(items, replace(CFG, max_concurrency=2))
    # Two in flight: r2 and r3 are sent when r0 and r1 finish (30 ms), and their
    # latency counts from then, as benchmark_serving measures it.
    assert _ms(two.arrival) == {"r0": 0, "r1": 0, "r2": 30, "r3": 30}
    assert _ms(two.first_token) == {"r0": 10, "r1": 10, "r2": 40, "r3": 40}
    assert _ms(two.finish) == {"r0": 30, "r1": 30, "r2": 60, "r3": 60}


def test_a_later_request_waits_for_its_arrival_not_just_for_a_slot() -> None:
    items = [_req("a", 2), _req("b", 2, arrival=0.005), _req("c", 1, arrival=0.1)]
    lat = _drive(items, replace(CFG, max_concurrency=1))
    # b is ready at 5 ms but the one slot is a's until 20 ms; c's slot is free
    # long before it is ready at 100 ms.
    assert _ms(lat.arrival) == {"a": 0, "b": 20, "c": 100}
    assert _ms(lat.finish) == {"a": 20, "b": 40, "c": 110}


def test_session_turns_wait_for_their_answer_and_count_toward_the_limit() -> None:
    items = [
        _req("s0", 3, session="s"),
        _req("x", 3),
        _req("s1", 3, session="s"),
    ]
    lat = _drive(items, replace(CFG, max_concurrency=1))
    # s0 holds the one slot until 30 ms; x was ready before s1 (ready at 30 ms,
    # when s0 answered) and goes first; s1 is sent when x finishes.
    assert _ms(lat.arrival) == {"s0": 0, "x": 30, "s1": 60}
    assert _ms(lat.finish) == {"s0": 30, "x": 60, "s1": 90}
    free = _drive(items)
    assert _ms(free.arrival) == {"s0": 0, "x": 0, "s1": 30}


def test_the_limit_counts_every_replica_and_the_first_freed_slot_goes_first() -> None:
    items = [_req("long", 5), _req("short", 2), _req("waits", 4)]
    cfg = replace(CFG, max_concurrency=2, replicas=2, router="round-robin")
    r = run_pagedkv(Workload("t", items), cfg)
    # long on replica 0 until 50 ms, short on replica 1 until 20 ms: the third
    # request is sent at 20 ms (the first slot freed, on either replica) to
    # replica 0 (its turn), and runs beside long from 20 to 60 ms.
    assert r.timing["duration_s"] == pytest.approx(0.06)
    assert r.timing["e2e_ms"]["mean"] == pytest.approx((50 + 20 + 40) / 3, abs=1e-3)
    assert r.finished == 3 and [x["requests"] for x in r.extra["replicas"]] == [2, 1]
    free = run_pagedkv(Workload("t", items), replace(cfg, max_concurrency=None))
    # Without the limit it arrives at 0 and finishes at 40 ms.
    assert free.timing["duration_s"] == pytest.approx(0.05)
    assert free.timing["e2e_ms"]["mean"] == pytest.approx((50 + 20 + 40) / 3, abs=1e-3)


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_never_exceed_the_limit_and_waste_no_slot(seed: int) -> None:
    rng = random.Random(seed)
    limit = rng.randint(1, 4)
    items: list[Request] = []
    for i in range(rng.randint(5, 25)):
        session = f"s{rng.randint(0, 3)}" if rng.random() < 0.4 else None
        items.append(
            _req(
                f"r{i}",
                rng.randint(1, 5),
                arrival=round(rng.uniform(0, 0.2), 3),
                session=session,
                pause_s=rng.choice([0.0, 0.015]) if session else None,
            )
        )
    lat = _drive(items, replace(CFG, max_concurrency=limit))
    arrive, finish = lat.arrival, lat.finish
    assert set(arrive) == set(finish) == {r.request_id for r in items}
    previous: dict[str, Request] = {}
    for r in items:
        rid, t = r.request_id, arrive[r.request_id]
        # Never more than the limit in flight once it is sent (a request
        # finishing at that instant has given its slot back).
        in_flight = sum(1 for x in items if arrive[x.request_id] <= t < finish[x.request_id])
        assert in_flight <= limit, (rid, t)
        # Sent no earlier than ready: its arrival, or its pause after the
        # previous turn of its session finished.
        prev = previous.get(r.session) if r.session else None
        ready = r.arrival_s or 0.0
        if prev is not None:
            ready = max(ready, finish[prev.request_id] + (r.pause_s or 0.0))
        assert t >= ready - 1e-12, rid
        # Sent later only when a slot was taken until then: some request
        # finished at that very instant.
        if t > ready + 1e-12:
            assert any(abs(f - t) < 1e-12 for f in finish.values()), rid
            # ... and every slot freed while it waited was taken at once.
            for f in finish.values():
                if ready <= f < t - 1e-12:
                    busy = sum(1 for x in items if arrive[x.request_id] <= f < finish[x.request_id])
                    assert busy == limit, (rid, f)
        if r.session:
            previous[r.session] = r


def test_max_concurrency_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "-n", "12", "--arrival", "at-once", "-w", "tenants", "--memory", "1"]
    argv += ["--max-model-len", "4096", "--step-time", TEN_MS, "-q"]
    assert cli.main([*argv, "--max-concurrency", "3", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["config"]["max_concurrency"] == 3 and run["peak_running"] == 3
    assert run["finished"] == 12
    assert cli.main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["peak_running"] == 12
    assert cli.main([*argv, "--max-concurrency", "3"]) == 0
    out = capsys.readouterr().out
    assert "max concurrency" in out and "3 in flight" in out
    assert cli.main(argv) == 0
    assert "max concurrency" not in capsys.readouterr().out
    assert cli.main([*argv, "--compare", "max-concurrency=1,4", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [x["config"]["max_concurrency"] for x in runs] == [1, 4]
    assert [x["peak_running"] for x in runs] == [1, 4]


def test_find_max_rate_with_a_limit_reports_the_rate_achieved() -> None:
    w = Workload("t", [_req(f"r{i}", 3, arrival=0.5 * i) for i in range(4)])
    cfg = replace(CFG, max_concurrency=1, slo_ttft_ms=10_000)
    found = runner.find_max_rate(w, cfg, iterations=0)
    at_one = next(p for p in found["tried"] if p["time_scale"] == 1.0)
    # One at a time, 30 ms each, arriving 0.5 s apart: 4 requests over 1.53 s.
    assert at_one["requests_per_s"] == pytest.approx(4 / 1.53, rel=1e-3)
    # Arrivals all at once: no time scale changes the load, limit or not.
    at_once = Workload("t", [_req(f"r{i}", 3) for i in range(4)])
    with pytest.raises(ValueError, match="arrive at the same time"):
        runner.find_max_rate(at_once, cfg)


def test_the_vllm_engine_gets_the_limit() -> None:
    w = Workload("t", [_req("a", 2), _req("b", 2)])
    payload = runner.vllm_payload(w, replace(CFG, max_concurrency=1))
    assert payload["clock"]["max_concurrency"] == 1
    json.dumps(payload)  # what the subprocess reads


# ------------------------------------------------------------------ KV-cache memory

# llama-3.1-8b in bfloat16: 32 layers x 8 KV heads x 128 head dim x 2 (K, V) x 2 bytes.
LLAMA_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
GIB = 2**30


def _config(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code = cli.main(["simulate", "-n", "4", "-q", "--json", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    config: dict[str, Any] = json.loads(out)["runs"][0]["config"]
    return config


@pytest.mark.parametrize("clock", [[], ["--step-time", "1,1,1,1"]])
@pytest.mark.parametrize("tp", [1, 2])
def test_kv_cache_memory_of_a_fixed_block_count(
    capsys: pytest.CaptureFixture[str], clock: list[str], tp: int
) -> None:
    assert LLAMA_BYTES_PER_TOKEN == 131_072
    # 6,250,000 blocks of 16 tokens: 10^8 tokens, 12,207.03 GiB for the
    # instance, each of two GPUs holding half of the 8 KV heads.
    c = _config(capsys, "--num-blocks", "6250000", "--tp", str(tp), *clock)
    total = 6_250_000 * 16 * LLAMA_BYTES_PER_TOKEN / GIB
    assert c["kv_cache_gib"] == pytest.approx(total, abs=1e-3)
    assert c["kv_cache_gib_per_gpu"] == pytest.approx(total / tp, abs=1e-3)
    assert c["kv_cache_gib_per_gpu"] > c["gpu_kv_cache_gib"]


@pytest.mark.parametrize("tp", [1, 2])
def test_kv_cache_memory_of_a_memory_budget(capsys: pytest.CaptureFixture[str], tp: int) -> None:
    # 8 GiB per GPU: 4,096 blocks of 16 tokens x 128 KiB per token on one GPU,
    # twice as many on two (each holds half the heads of a block).
    c = _config(capsys, "--memory", "8", "--tp", str(tp), "--step-time", "1,1,1,1")
    blocks = 8 * GIB * tp // (16 * LLAMA_BYTES_PER_TOKEN)
    assert blocks == 4096 * tp
    assert c["kv_cache_gib"] == pytest.approx(blocks * 16 * LLAMA_BYTES_PER_TOKEN / GIB)
    assert c["kv_cache_gib_per_gpu"] == pytest.approx(8.0)
    assert c["kv_cache_gib_per_gpu"] < c["gpu_kv_cache_gib"]


def test_kv_cache_memory_line_of_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "-n", "4", "-q", "--num-blocks", "6250000", "--step-time", "1,1,1,1"]
    assert cli.main([*argv, "--tp", "2"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "KV-cache memory" in x)
    assert "6,103.52 GiB per GPU, 12,207.03 GiB for the instance" in line
    assert "(over the" in line
    assert cli.main(["simulate", "-n", "4", "-q", "--memory", "8"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "KV-cache memory" in x)
    assert "8.00 GiB" in line and "per GPU" not in line and "leaves" not in line
    assert "replicas" not in line
    assert cli.main(["simulate", "-n", "4", "-q", "--memory", "8", "--replicas", "3"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "KV-cache memory" in x)
    assert "8.00 GiB, on each of 3 replicas" in line


# ------------------------------------------------------------------ overlong requests


def _lengths(*sizes: tuple[int, int], arrivals: list[float] | None = None) -> Workload:
    """Requests of (prompt, output) tokens, prompts of distinct tokens."""
    reqs = []
    start = 0
    for i, (n, out) in enumerate(sizes):
        t = arrivals[i] if arrivals is not None else 0.0
        reqs.append(Request(f"q{i}", list(range(start, start + n)), [1] * out, arrival_s=t))
        start += n
    return Workload("lengths", reqs)


# max_model_len 1024: 100 + 10 fits; 1020 + 5 and 1024 + 1 (a prompt of the whole
# context) are over; 1023 + 1 = 1024 fits exactly.
EDGE = ((100, 10), (1020, 5), (1024, 1), (1023, 1))


@pytest.mark.parametrize("replicas", [1, 2])
def test_requests_longer_than_the_context_are_rejected_and_counted(replicas: int) -> None:
    cfg = replace(CFG, max_model_len=1024, replicas=replicas)
    r = run_pagedkv(_lengths(*EDGE), cfg)
    assert (r.rejected_requests, r.rejected_prompt_tokens) == (2, 1020 + 1024)
    assert r.requests == r.finished == 2
    # Only the accepted requests reach the scheduler and the figures.
    assert r.prompt_tokens == r.query_tokens == 100 + 1023
    assert r.output_tokens == 10 + 1
    assert r.timing["throughput"]["input_tokens_per_s"] * r.timing["duration_s"] == (
        pytest.approx(1123, rel=1e-3)
    )
    d = r.to_dict()
    assert d["rejected_requests"] == 2 and d["rejected_prompt_tokens"] == 2044


def test_on_overlong_fail_raises_before_running() -> None:
    cfg = replace(CFG, max_model_len=1024, on_overlong="fail")
    with pytest.raises(runner.OverlongRequestError, match=r"1025 tokens .* --max-model-len 1024"):
        run_pagedkv(_lengths(*EDGE), cfg)
    # A workload that fits runs as before.
    assert run_pagedkv(_lengths((100, 10), (1023, 1)), cfg).rejected_requests == 0


def test_a_workload_of_only_overlong_requests_is_refused() -> None:
    with pytest.raises(runner.OverlongRequestError, match="all 2 requests"):
        run_pagedkv(_lengths((1024, 1), (2000, 5)), replace(CFG, max_model_len=1024))


def test_the_automatic_length_is_the_longest_accepted_request() -> None:
    # llama-3.1-8b's context is 131,072 tokens: a request of 131,072 + 1 is
    # rejected, and max_model_len is the longest other one (2,500 + 500 tokens)
    # rounded up to 1,024.
    w = _lengths((131_072, 1), (2_500, 500), (100, 10))
    r = run_pagedkv(w, replace(CFG, max_model_len=None))
    assert r.rejected_requests == 1 and r.finished == 2
    assert r.config["max_model_len"] == 3072


def test_a_rejected_turn_of_a_session_is_skipped() -> None:
    p = list(range(50))
    turns = [
        Request("t0", p, [1] * 3, arrival_s=0.0, session="s"),
        Request("t1", list(range(2000)), [1] * 3, session="s"),
        Request("t2", p + [7] * 20, [1] * 3, session="s"),
    ]
    r = run_pagedkv(Workload("s", turns), replace(CFG, max_model_len=1024))
    # t2 follows t0's answer (30 ms) and finds t0's three whole blocks cached.
    assert r.rejected_requests == 1 and r.finished == 2
    assert r.hit_tokens == 48
    assert r.timing["duration_s"] == pytest.approx(0.06)


def test_find_max_rate_offers_the_rate_of_the_accepted_requests() -> None:
    # Four requests a second apart, then one over the context at 10 s: the
    # server sees 4 requests over 3 s.
    w = _lengths((100, 2), (100, 2), (100, 2), (100, 2), (5000, 2), arrivals=[0, 1, 2, 3, 10])
    found = runner.find_max_rate(
        w, replace(CFG, max_model_len=1024, slo_ttft_ms=10_000), iterations=0
    )
    at_one = next(p for p in found["tried"] if p["time_scale"] == 1.0)
    assert at_one["requests_per_s"] == pytest.approx(4 / 3)


def test_builtin_workloads_fit_the_shortest_context_of_the_runs() -> None:
    assert cli._builtin_context([SimConfig()]) == runner.DEFAULT_MAX_CONTEXT == 16384
    assert cli._builtin_context([SimConfig(), SimConfig(model="whisper-large-v3")]) == 448
    assert cli._builtin_context([SimConfig(model="no-such-model")]) == 16384


def _mooncake(path: Any, lengths: list[tuple[int, int]]) -> None:
    # Distinct hash ids per request: no sharing.
    lines, next_id = [], 0
    for i, (n, out) in enumerate(lengths):
        k = -(-n // 512)
        ids = list(range(next_id, next_id + k))
        next_id += k
        rec = {"timestamp": 100 * i, "input_length": n, "output_length": out, "hash_ids": ids}
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")


def test_overlong_requests_of_a_trace_on_the_command_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    trace = tmp_path / "mc.jsonl"
    # llama-3.1-8b's context is 131,072: the second request (131,000 + 100) is over.
    _mooncake(trace, [(3000, 20), (131_000, 100), (2000, 10)])
    argv = ["simulate", "--trace", str(trace), "--memory", "2", "-q", "--step-time", TEN_MS]
    assert cli.main([*argv, "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert (run["rejected_requests"], run["rejected_prompt_tokens"]) == (1, 131_000)
    assert run["requests"] == run["finished"] == 2 and run["prompt_tokens"] == 5000
    assert run["config"]["max_model_len"] == 3072
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "rejected: longer than the context" in out and "1 (131,000 prompt tokens)" in out
    csv = tmp_path / "s.csv"
    assert cli.main([*argv, "--sweep", "max-num-seqs=4,8", "--csv", str(csv)]) == 0
    capsys.readouterr()
    head, *rows = csv.read_text().splitlines()
    col = head.split(",").index("rejected_requests")
    assert [r.split(",")[col] for r in rows] == ["1", "1"]
    # --on-overlong fail: one line, exit 2, nothing run.
    assert cli.main([*argv, "--on-overlong", "fail"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert "131100 tokens" in err and "llama-3.1-8b's context (131072)" in err


# ------------------------------------------------------------------ LRU hit rate by capacity

MOONCAKE = "/work/shared/data/mooncake/synthetic_trace.jsonl.gz"


def _reference_hits(reqs: list[tuple[list[Any], list[int]]], capacity_blocks: int) -> int:
    """Hit tokens of one LRU cache of ``capacity_blocks`` blocks, from the
    definition: each request's longest prefix of cached blocks hits, then its
    blocks are used in order, the least recently used leaving a full cache."""
    cache: OrderedDict[Any, None] = OrderedDict()
    hit = 0
    for keys, hit_tokens in reqs:
        for key, n in zip(keys, hit_tokens, strict=False):
            if key not in cache:
                break
            hit += n
        for key in keys:
            if key in cache:
                cache.move_to_end(key)
            else:
                cache[key] = None
                if len(cache) > capacity_blocks:
                    cache.popitem(last=False)
    return hit


def _write_mooncake(path: Any, requests: list[tuple[list[int], int]]) -> None:
    path.write_text(
        "".join(
            json.dumps({"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": ids})
            + "\n"
            for i, (ids, n) in enumerate(requests)
        )
    )


def _capacity_rates(
    capsys: pytest.CaptureFixture[str], path: Any, capacities: str, *extra: str
) -> dict[str, Any]:
    code = cli.main(["trace-stats", str(path), "--capacity", capacities, "--json", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc: dict[str, Any] = json.loads(out)
    return doc


def test_lru_hit_rate_of_a_tiny_trace_by_hand(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    # Blocks named by their prefix: A = 1, B = 1/2, C = 1/2/3, D = 1/2/4.
    # r0 A B C (1,500 tokens) hits nothing. r1 A B D: in the recency stack C B A,
    # A is third: a cache of 3 blocks hits A B (1,024 tokens), one of 2 has lost
    # A. r2 A B C (1,400 tokens): stack D B A C: 3 blocks hit A B (1,024), 4 hit
    # all three (C is partial: 376 tokens).
    p = tmp_path / "tiny.jsonl"
    _write_mooncake(p, [([1, 2, 3], 1500), ([1, 2, 4], 1536), ([1, 2, 3], 1400)])
    doc = _capacity_rates(capsys, p, "1024,1536,2047,2048,1e12")
    total = 1500 + 1536 + 1400
    got = [(x["capacity_tokens"], x["capacity_blocks"], x["hit_rate"]) for x in doc["lru_hit_rate"]]
    assert got == [
        (1024, 2, 0.0),
        (1536, 3, round(2048 / total, 6)),
        (2047, 3, round(2048 / total, 6)),
        (2048, 4, round(2424 / total, 6)),
        (1e12, 1953125000, round(2424 / total, 6)),
    ]
    assert doc["max_prefix_hit_rate"] == round(2424 / total, 4)
    assert doc["block_size"] == 512


def test_a_request_longer_than_the_cache_keeps_only_its_last_blocks(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    # Two blocks of cache: r0 (four blocks) leaves its blocks 3 and 4; r1, the
    # same prompt, misses at its first block; r2 = blocks 1-2 then new ones
    # also misses. Four blocks keep everything: r1 hits 2,048, r2 1,024.
    p = tmp_path / "long.jsonl"
    _write_mooncake(p, [([1, 2, 3, 4], 2048), ([1, 2, 3, 4], 2048), ([1, 2, 9], 1100)])
    doc = _capacity_rates(capsys, p, "1024,2048")
    total = 2048 + 2048 + 1100
    assert [x["hit_rate"] for x in doc["lru_hit_rate"]] == [0.0, round((2048 + 1024) / total, 6)]


def _random_mooncake(rng: random.Random, n: int) -> list[tuple[list[int], int]]:
    out: list[tuple[list[int], int]] = []
    fresh = 1000
    for _ in range(n):
        ids: list[int] = []
        if out and rng.random() < 0.7:
            base = rng.choice(out)[0]
            ids = base[: rng.randint(0, len(base))]
        for _ in range(rng.randint(0 if ids else 1, 6)):
            ids.append(fresh if rng.random() < 0.6 else rng.randint(0, 5))
            fresh += 1
        k = len(ids)
        out.append((ids, rng.randint((k - 1) * 512 + 1, k * 512)))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_lru_hit_rate_agrees_with_a_plain_lru_on_random_traces(
    capsys: pytest.CaptureFixture[str], tmp_path: Any, seed: int
) -> None:
    rng = random.Random(seed)
    reqs = _random_mooncake(rng, rng.randint(1, 40))
    p = tmp_path / "r.jsonl"
    _write_mooncake(p, reqs)
    longest = max(len(ids) for ids, _ in reqs)
    # Capacities from none to past the whole trace, below the longest request too.
    caps = sorted({0.5, 511, 512, 1000, *(512 * b + rng.randint(0, 511) for b in range(1, 12))})
    caps = [c for c in caps if c > 0]
    doc = _capacity_rates(capsys, p, ",".join(map(str, caps)))
    keyed = [
        (
            [tuple(ids[: i + 1]) for i in range(len(ids))],
            [min(512, n - 512 * i) for i in range(len(ids))],
        )
        for ids, n in reqs
    ]
    total = sum(n for _, n in reqs)
    assert any(c // 512 < longest for c in caps)
    for point in doc["lru_hit_rate"]:
        blocks = int(point["capacity_tokens"] // 512)
        assert point["capacity_blocks"] == blocks
        assert point["hit_rate"] == round(_reference_hits(keyed, blocks) / total, 6), point
    unlimited = _reference_hits(keyed, 10**9)
    assert doc["max_prefix_hit_rate"] == round(unlimited / total, 4)


@pytest.mark.parametrize("seed", range(3))
def test_lru_hit_rate_of_token_traces_agrees_with_a_plain_lru(
    capsys: pytest.CaptureFixture[str], tmp_path: Any, seed: int
) -> None:
    w = generate("chat", WorkloadOptions(num_requests=25, seed=seed, max_context=2048))
    p = tmp_path / "chat.jsonl"
    write_trace(w, p)
    bs = 16
    caps = [16, 100, 512, 2000, 4096, 10_000, 50_000]
    doc = _capacity_rates(capsys, p, ",".join(map(str, caps)), "--block-size", str(bs))
    keyed = []
    for r in w.requests:
        seq = [*map(int, r.prompt), *r.output[:-1]]
        keys = [tuple(seq[: (i + 1) * bs]) for i in range(len(seq) // bs)]
        keyed.append((keys, [bs] * (len(r.prompt) // bs)))
    total = sum(len(r.prompt) for r in w.requests)
    rates = [x["hit_rate"] for x in doc["lru_hit_rate"]]
    assert rates == [round(_reference_hits(keyed, c // bs) / total, 6) for c in caps]
    assert rates[-1] > 0


def test_lru_hit_rate_of_the_mooncake_trace(capsys: pytest.CaptureFixture[str]) -> None:
    caps = "1e5,3e5,1e6,2e6,3e6,5e6,1e7,2e7,3e7,5e7,1e8,1000000000000"
    doc = _capacity_rates(capsys, MOONCAKE, caps)
    rates = [x["hit_rate"] for x in doc["lru_hit_rate"]]
    assert len(rates) == 12 and doc["max_prefix_hit_rate"] == 0.6512
    assert rates == sorted(rates) and 0 < rates[0] < rates[-1]
    assert rates[-1] <= 0.6512 + 5e-5
    assert rates[-1] == pytest.approx(0.6512, abs=1e-4)  # nothing is evicted at 10^12
    assert cli.main(["trace-stats", MOONCAKE, "--capacity", "1e6,1e12"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "1,000,000 tokens" in lines[-3] and "1,953 blocks" in lines[-3]
    assert lines[-1].split() == ["unlimited", "65.1", "%"]


@pytest.mark.parametrize(
    "value",
    ["0", "-1", "nan", "inf", "1e13", "1000000000001", "ten", "", "1e5,,1e6", "1e5,1e5"],
)
def test_bad_capacities_are_refused(capsys: pytest.CaptureFixture[str], value: str) -> None:
    code = cli.main(["trace-stats", MOONCAKE, "--capacity", value])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("pagedkv trace-stats: error: --capacity")


def test_at_most_64_capacities(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    p = tmp_path / "one.jsonl"
    _write_mooncake(p, [([1], 100)])
    many = ",".join(str(512 * (i + 1)) for i in range(64))
    assert len(_capacity_rates(capsys, p, many)["lru_hit_rate"]) == 64
    assert cli.main(["trace-stats", str(p), "--capacity", many + ",1e9"]) == 2
    assert "65 values, more than 64" in capsys.readouterr().err
