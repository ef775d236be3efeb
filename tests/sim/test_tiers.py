"""The simulator's host and disk tiers (``pagedkv.sim.tiers``): the core's tier
under each manager, its copies on the clock, hits per tier, and the options that
set them up."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import pagedkv as pk
import pytest
from pagedkv import cli
from pagedkv.sim import calibration as cal
from pagedkv.sim.config import SimConfig
from pagedkv.sim.deployment import deploy
from pagedkv.sim.perf import step_time_model
from pagedkv.sim.policy import Request, Scheduler, timed_step
from pagedkv.sim.runner import run_pagedkv
from pagedkv.sim.serving import ServingProcess
from pagedkv.sim.steptime import Latencies
from pagedkv.sim.tiers import HOST_LINKS, TieredBackend, host_link_gbps
from pagedkv.sim.workloads import Workload, WorkloadOptions, generate

FAST = ["--memory", "1", "--max-model-len", "4096", "-q"]


def chat(n: int = 120) -> Workload:
    return generate("chat", WorkloadOptions(num_requests=n, max_context=4096))


def cfg(**kw: object) -> SimConfig:
    return replace(SimConfig(memory_gib=1.0, max_model_len=4096), **kw)  # type: ignore[arg-type]


def test_a_host_tier_keeps_what_the_device_evicts_and_hits_add_up() -> None:
    w = chat()
    base = run_pagedkv(w, cfg())
    tiered = run_pagedkv(w, cfg(cpu_offload_gib=16.0))
    assert "tiers" not in base.extra
    t = tiered.extra["tiers"]
    # The device alone keeps under half of the chat's reuse at 1 GiB; the host
    # tier keeps the rest of what the device evicted.
    assert base.hit_rate < 0.6 < tiered.hit_rate
    assert t["host_hit_tokens"] > 0 and t["disk_hit_tokens"] == 0
    assert t["device_hit_tokens"] + t["host_hit_tokens"] == tiered.hit_tokens
    assert t["device_hit_rate"] + t["host_hit_rate"] == pytest.approx(tiered.hit_rate, abs=2e-6)
    # Every host hit was loaded, every stored block copied once.
    block_bytes = pk.OffloadConfig.bytes_per_block(deploy(cfg(), w).kv_config)
    assert t["load_bytes"] >= t["host_hit_tokens"] // 16 * block_bytes
    assert t["store_bytes"] > 0 and t["stores"] > 0 and t["loads"] > 0
    assert t["cpu_offload_gib_per_instance"] == 16.0 and t["offload_policy"] == "lru"
    assert t["host_tier"]["num_chunks"] == 16 * 2**30 // block_bytes
    assert tiered.finished == base.finished == len(w.requests)


def test_a_disk_tier_below_a_small_host_tier_serves_what_host_memory_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    w = chat()
    small = run_pagedkv(w, cfg(cpu_offload_gib=1.0))
    disk = run_pagedkv(w, cfg(cpu_offload_gib=1.0, disk_offload_gib=64.0))
    t = disk.extra["tiers"]
    assert t["disk_hit_tokens"] > 0 and t["disk_read_bytes"] > 0 and t["disk_write_bytes"] > 0
    assert disk.hit_rate > small.hit_rate
    assert t["device_hit_tokens"] + t["host_hit_tokens"] + t["disk_hit_tokens"] == disk.hit_tokens
    assert list(tmp_path.iterdir()) == []  # the simulated disk keeps its index only


def test_write_back_fills_host_memory_smaller_than_the_device_where_write_through_cannot() -> None:
    """Host memory half the device's cache: written through, it holds copies
    of what the device still holds (a few host hits, and the held stores cost
    hits); written back as the device evicts, it holds what the device
    dropped."""
    w = chat()
    none = run_pagedkv(w, cfg())
    through = run_pagedkv(w, cfg(cpu_offload_gib=0.5))
    back = run_pagedkv(w, cfg(cpu_offload_gib=0.5, offload_write="write-back"))
    tt, tb = through.extra["tiers"], back.extra["tiers"]
    assert (tt["offload_write"], tb["offload_write"]) == ("write-through", "write-back")
    assert tb["host_hit_tokens"] > 4 * tt["host_hit_tokens"]
    assert back.hit_rate > none.hit_rate > through.hit_rate
    # Only what the device evicts is copied.
    assert tb["store_bytes"] < tt["store_bytes"]
    assert back.finished == len(w.requests)


def test_transfers_add_time_and_a_slower_link_adds_more() -> None:
    w = chat()
    fast = run_pagedkv(w, cfg(cpu_offload_gib=16.0, host_link="10000"))
    slow = run_pagedkv(w, cfg(cpu_offload_gib=16.0, host_link="0.5"))
    tf, ts = fast.extra["tiers"], slow.extra["tiers"]
    assert tf["load_bytes"] > 0
    # The wait is the loads' bytes over the link (one GPU).
    assert tf["load_wait_s"] == pytest.approx(tf["load_bytes"] / 10000e9, abs=1e-6)
    assert ts["load_wait_s"] > 1000 * tf["load_wait_s"]
    assert slow.timing["ttft_ms"]["mean"] > fast.timing["ttft_ms"]["mean"]
    assert slow.timing["duration_s"] > fast.timing["duration_s"]


def _sched(host_gbps: float) -> tuple[pk.KVCacheManager, Scheduler[Request], TieredBackend]:
    spec = pk.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    config = pk.KVCacheConfig(
        num_blocks=9,
        kv_cache_groups=[pk.KVCacheGroupSpec(["l"], spec)],
        kv_cache_tensors=[pk.KVCacheTensor(size=9 * 65536, shared_by=["l"])],
    )
    kv = pk.KVCacheManager(config, 256, offload=pk.OffloadConfig(cpu_bytes=64 * 65536))
    be = TieredBackend(kv, ways=1, host_gbps=host_gbps, disk_gbps=1.0)
    return kv, Scheduler(be), be


class _Clock:
    """One millisecond a step, whatever it computes."""

    def step_seconds(self, shape: object) -> float:
        return 1e-3


def test_stores_hold_their_blocks_until_the_link_has_copied_them() -> None:
    # 65,536 bytes a block at 65,536 bytes/s: one second a block.
    kv, sched, be = _sched(65536 / 1e9)
    sched.add_request(Request("a", list(range(64)), [1]))
    done, end = timed_step(sched, _Clock(), 0.0)
    assert [r.request_id for r in done] == ["a"] and end == pytest.approx(1e-3)
    # 4 full blocks stored in one job, in the background: done 4 s later.
    assert be.next_transfer_done() == pytest.approx(1e-3 + 4.0)
    assert be.transfers_pending() and kv.num_transfers_in_flight == 1
    # The stored blocks stay held: 8 usable, 4 held, so a 6-block prompt waits...
    sched.add_request(Request("b", list(range(1000, 1096)), [1]))
    done, end = timed_step(sched, _Clock(), end)
    assert not sched.last_scheduled and end == pytest.approx(1e-3 + 4.0)
    # ... until the store completes at that step's end.
    done, end = timed_step(sched, _Clock(), end)
    assert [r.request_id for r in done] == ["b"]
    kv.check_invariants()


def test_a_host_hit_is_loaded_before_the_step_that_uses_it() -> None:
    kv, sched, be = _sched(65536 / 1e9 * 1000)  # 1 ms a block
    prompt = list(range(64))
    sched.add_request(Request("a", prompt, [1]))
    timed_step(sched, _Clock(), 0.0)
    be.clock_to(10.0)  # the stores complete
    kv.reset_prefix_cache()  # the device forgets: the host tier has the prefix
    sched.add_request(Request("b", [*prompt, 7, 8], [1]))
    _, end2 = timed_step(sched, _Clock(), 10.0)
    # 4 blocks hit in host memory: 4 ms of loads before the 1 ms step.
    assert be.tiers.host_hit_tokens == 64 and be.tiers.device_hit_tokens == 0
    assert end2 - 10.0 == pytest.approx(1e-3 + 4e-3)
    assert be.transfer_s == pytest.approx(4e-3)
    kv.check_invariants()


def test_host_links_by_name_number_and_gpu() -> None:
    assert host_link_gbps(SimConfig(gpu="H200")) == HOST_LINKS["pcie5"]
    assert host_link_gbps(SimConfig(gpu="A100-80GB")) == HOST_LINKS["pcie4"]
    assert host_link_gbps(SimConfig(host_link="nvlink-c2c")) == HOST_LINKS["nvlink-c2c"]
    assert host_link_gbps(SimConfig(host_link="12.5")) == 12.5
    for bad in ("pcie9", "nan", "-1", "0"):
        with pytest.raises(ValueError, match="host link"):
            host_link_gbps(SimConfig(host_link=bad))


@pytest.mark.parametrize(
    "extra",
    [
        ["--cpu-offload", "-1"],
        ["--cpu-offload", "nan"],
        ["--cpu-offload", "inf"],
        ["--cpu-offload", "1e12"],
        ["--disk-offload", "-5"],
        ["--host-link", "pcie9"],
        ["--host-link", "0"],
        ["--host-link", "nan"],
        ["--disk-link", "0"],
        ["--disk-link", "1e300"],
        ["--offload-policy", "mru"],
        ["--offload-write", "sometimes"],
        ["--compare", "offload-write=write-back,write-around", "--cpu-offload", "1"],
        ["--eviction", "fifo"],
        ["--tier-weights", "nan:0"],
        ["--tier-weights", "2:0"],
        ["--tier-weights", "0.5"],
        ["--tier-weights", "-0.1:0.2"],
        ["--compare", "tier-weights=0.75:0.25,1:x"],
        ["--disk-offload", "8"],  # no host memory above it
        ["--engine", "vllm", "--cpu-offload", "4"],
        ["--sweep", "offload-policy=lru,mru", "--cpu-offload", "1"],
        ["--compare", "cpu-offload=1,-2"],
    ],
)
def test_bad_tier_options_are_one_line_errors_with_no_output(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, extra: list[str]
) -> None:
    out_csv = tmp_path / "out.csv"
    try:
        code = cli.main(["simulate", "-n", "4", *FAST, "--csv", str(out_csv), *extra])
    except SystemExit as e:
        code = int(str(e.code))
    _, err = capsys.readouterr()
    if "--sweep" in extra:
        # A sweep reports a bad value as its point and runs the others.
        assert code == 0 and "mru" in out_csv.read_text()
        return
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("pagedkv simulate: error: ")
    assert len([line for line in err.splitlines() if "error:" in line]) == 1
    assert not out_csv.exists()


def test_a_sweep_of_host_memory_reports_each_tier_and_the_capacity(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_csv = tmp_path / "s.csv"
    code = cli.main(
        [
            "simulate",
            "-n",
            "60",
            *FAST,
            "--sweep",
            "cpu-offload=0,8",
            "--csv",
            str(out_csv),
            "--json",
        ]
    )
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    p0, p8 = doc["points"]
    assert p0["host_hit_rate"] == 0 and p8["host_hit_rate"] > 0
    assert p8["hit_rate"] > p0["hit_rate"]
    assert p8["capacity_tokens"] - p0["capacity_tokens"] == (
        p8["run"]["tiers"]["host_tier"]["num_chunks"] * 16
    )
    rows = list(csv.DictReader(out_csv.read_text().splitlines()))
    assert [r["value"] for r in rows] == ["0", "8"]
    assert float(rows[1]["host_hit_rate"]) == p8["host_hit_rate"]


def test_replicas_with_host_tiers_add_up_their_tiers() -> None:
    w = chat(80)
    r = run_pagedkv(w, cfg(cpu_offload_gib=4.0, replicas=2, router="prefix-aware"))
    t = r.extra["tiers"]
    assert t["host_tier"]["num_chunks"] == 2 * 4 * 2**30 // (2 * 2**20)
    assert t["device_hit_tokens"] + t["host_hit_tokens"] == r.hit_tokens
    assert t["host_hit_tokens"] > 0


QUICK = [r for r in cal.load_rows() if r.role == "quick"][::6]


def _row_run(row: cal.Row, config: SimConfig) -> tuple[float, ServingProcess]:
    kv_config, max_model_len, workload = cal.row_setup(row, config)
    lat = Latencies()
    process = ServingProcess.start(config, kv_config, max_model_len)
    process.drive(workload.requests, step_time_model(config), latencies=lat)
    return cal.metric_of(row, cal._figures(row, lat)), process


@pytest.mark.parametrize("row", QUICK, ids=[r.id for r in QUICK])
def test_calibration_rows_keep_their_figures_with_a_host_tier(row: cal.Row) -> None:
    """The clock's calibration holds with a host tier under the manager (which
    needs prefix caching: on in both runs). The benchmarks' random prompts share
    no prefix, so no first admission hits the tier; a run without preemptions
    only stores, in the background, and keeps its figures exactly. A preempted
    request reloads its own blocks from host memory instead of recomputing
    them: that run's figures move, as they would on an engine with the tier."""
    cached = replace(cal.row_config(row), enable_caching=True)
    plain, p0 = _row_run(row, cached)
    tiered, p1 = _row_run(row, replace(cached, cpu_offload_gib=64.0))
    tiers = p1.tiers
    assert tiers is not None and p0.tiers is None
    assert tiers.host_hit_tokens == 0 and tiers.stores > 0
    if p1.sched.stats.preemptions == 0:
        assert tiered == plain
        assert abs(cal.error(row, tiered)) <= abs(row.recorded_error) + 0.005
    else:
        assert tiers.load_bytes > 0 and p1.sched.stats.hit_tokens > p0.sched.stats.hit_tokens


def test_a_tier_aware_router_finds_more_hits_than_a_tier_blind_one() -> None:
    """Replicas whose host tiers hold what their devices evicted: the router
    weighing host hits at 0.75 sends a returning conversation where its prefix
    is kept; weights of 0 see only the devices."""
    w = generate("chat", WorkloadOptions(num_requests=300, max_context=4096, rate=0.15))
    base = cfg(cpu_offload_gib=2.0, replicas=4, router="prefix-aware")
    aware = run_pagedkv(w, base)
    blind = run_pagedkv(w, replace(base, tier_weights=(0.0, 0.0)))
    assert aware.extra["tiers"]["host_hit_tokens"] > blind.extra["tiers"]["host_hit_tokens"]
    assert aware.hit_rate > blind.hit_rate


@pytest.mark.parametrize("policy", ["lru", "arc", "slru"])
def test_the_device_eviction_option_reaches_each_manager(policy: str) -> None:
    c = cfg(eviction=policy)
    d = deploy(c, chat(4))
    process = ServingProcess.start(c, d.kv_config, d.max_model_len)
    assert process.kv.eviction == policy
