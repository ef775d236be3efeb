"""``pagedkv simulate --sweep`` run in worker processes (``--jobs``) and on Ray
(``--ray-address``): the same points as a serial run, in the values' order, each
reported as it finishes, compact, and bad options refused before anything runs."""

from __future__ import annotations

import json
import math
import os
import pickle
import sys
import time
from dataclasses import replace
from typing import Any

import pytest
from pagedkv import cli
from pagedkv.sim import SimResult, WorkloadOptions, generate, parallel, runner
from pagedkv.sim.parallel import SweepPoint, SweepWorkloads

# 1 GiB of llama-3.1-8b KV cache is 512 blocks of 16 tokens (128 KiB per token).
SWEEP = ["-w", "chat", "-n", "60", "--max-model-len", "2048", "--sweep", "memory=0.5,1,2"]

#: figures measured on the wall clock, which differ between any two runs
WALL_CLOCK = {
    "wall_s",
    "manager_ns",
    "manager_ms",
    "manager_us_per_step",
    "manager_us_per_call",
    "ms",
    "us_per_call",
}


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["simulate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = _run(capsys, *argv, "--json")
    assert code == 0, err
    doc: dict[str, Any] = json.loads(out)
    return doc


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code, out, err = _run(capsys, *argv)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pagedkv simulate: error: "), err
    return lines[0]


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two documents' figures differ (the wall-clock ones left out)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted((a.keys() | b.keys()) - WALL_CLOCK)
        return [d for k in keys for d in _differences(a.get(k), b.get(k), f"{path}/{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _never(*_: Any, **__: Any) -> Any:
    raise AssertionError("a point ran in this process")


def test_two_jobs_give_the_points_of_a_serial_run(capsys: pytest.CaptureFixture[str]) -> None:
    serial = _json(capsys, *SWEEP, "--jobs", "1")
    parallel_doc = _json(capsys, *SWEEP, "--jobs", "2")
    assert _differences(parallel_doc, serial) == []
    points = parallel_doc["points"]
    assert [p["value"] for p in points] == [0.5, 1, 2]
    assert [p["num_blocks"] for p in points] == [256, 512, 1024]
    assert all(p["status"] == "ok" and p["run"]["finished"] == 60 for p in points)
    # not three copies of one point: less memory, fewer hits
    assert points[0]["hit_rate"] < points[2]["hit_rate"]


def test_jobs_run_the_points_in_worker_processes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The spawned workers import pagedkv afresh: the patch reaches only this process.
    monkeypatch.setattr(runner, "run_pagedkv", _never)
    statuses = [p["status"] for p in _json(capsys, *SWEEP, "--jobs", "2")["points"]]
    assert statuses == ["ok", "ok", "ok"]
    statuses = [p["status"] for p in _json(capsys, *SWEEP)["points"]]
    assert statuses == ["failed", "failed", "failed"]


def test_each_point_is_reported_as_it_finishes_and_the_table_is_in_value_order(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(
        capsys,
        *SWEEP[:-1],
        "memory=2,0.01,abc,0.5,1",
        "--jobs",
        "2",
    )
    assert code == 0, err
    lines = err.strip().splitlines()
    # a line per point run (not the invalid value), counted in completion order
    assert [line.split("]")[0] for line in lines] == ["[1/4", "[2/4", "[3/4", "[4/4"]
    by_label = {line.split("] ")[1].split(":")[0]: line for line in lines}
    assert sorted(by_label) == ["memory=0.01", "memory=0.5", "memory=1", "memory=2"]
    assert "does not fit" in by_label["memory=0.01"]
    assert "hit rate" in by_label["memory=1"] and "preemptions" in by_label["memory=1"]
    # the first cell of each row (a long reason wraps onto lines of empty cells)
    cells = [r.split("│")[1].strip() for r in out.splitlines() if r.startswith("│")]
    assert [c for c in cells if c] == ["2", "0.01", "abc", "0.5", "1"]


@pytest.mark.parametrize("flag", ["-q", "--json"])
def test_quiet_and_json_report_no_point(capsys: pytest.CaptureFixture[str], flag: str) -> None:
    code, out, err = _run(capsys, *SWEEP, "--jobs", "2", flag)
    assert code == 0 and out and err == ""


def test_a_time_scale_point_is_the_run_at_that_time_scale(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    base = ["-w", "chat", "-n", "60", "--max-model-len", "2048", "--memory", "0.5"]
    alone = [_json(capsys, *base, "--time-scale", x, "-q")["runs"][0] for x in ("0.5", "3")]
    generated: list[str] = []
    real = cli.generate

    def counted(name: str, opts: WorkloadOptions) -> Any:
        generated.append(name)
        return real(name, opts)

    # the parent makes the workload once; each point scales a copy where it runs
    monkeypatch.setattr(cli, "generate", counted)
    doc = _json(capsys, *base, "--sweep", "time-scale=0.5,3", "--jobs", "2")
    assert generated == ["chat"]
    for run, point in zip(alone, doc["points"], strict=True):
        del run["workload"]  # a plain run's JSON names its workload
        assert _differences(point["run"], run | {"label": point["run"]["label"]}) == []
    assert doc["points"][0]["run"]["ttft_ms"] != doc["points"][1]["run"]["ttft_ms"]
    # the same through --jobs 1
    assert _differences(_json(capsys, *base, "--sweep", "time-scale=0.5,3"), doc) == []


def test_a_scaled_copy_leaves_the_held_workload_alone() -> None:
    w = generate("chat", WorkloadOptions(num_requests=40))
    arrivals = [r.arrival_step for r in w.requests]
    pauses = [r.pause for r in w.requests]
    held = SweepWorkloads({"chat": w})
    scaled = held.get("chat", 4.0)
    assert [r.arrival_step for r in scaled.requests] == [math.floor(a / 4) for a in arrivals]
    assert [r.pause for r in scaled.requests] == [math.floor(p / 4) for p in pauses]
    assert [r.arrival_step for r in w.requests] == arrivals
    assert [r.pause for r in w.requests] == pauses
    assert "time_scale" not in w.params and scaled.params["time_scale"] == 4.0
    assert held.get("chat", 1.0) is w
    # a workload already scaled is not scaled again from there
    with pytest.raises(ValueError, match="time scale 2"):
        SweepWorkloads({"chat": w}, time_scale=2.0).get("chat", 4.0)


def _contains_sim_result(x: Any) -> bool:
    if isinstance(x, SimResult):
        return True
    if isinstance(x, dict):
        return any(_contains_sim_result(v) for v in x.values())
    if isinstance(x, list | tuple):
        return any(_contains_sim_result(v) for v in x)
    return False


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_point_comes_back_as_a_compact_record(jobs: int) -> None:
    w = generate("chat", WorkloadOptions(num_requests=300, max_context=2048))
    cfg = runner.SimConfig(memory_gib=0.5, max_model_len=2048)
    points = [
        SweepPoint("memory", v, f"memory={v}", replace(cfg, memory_gib=float(v)), "chat", 1.0)
        for v in ("0.5", "1")
    ]
    records = parallel.run_points(points, SweepWorkloads({"chat": w}), jobs=jobs)
    assert [r["value"] for r in records] == [0.5, 1]
    full = runner.run_pagedkv(w, cfg)
    # the run's per-step series alone is far bigger than the record
    assert len(pickle.dumps(full.series)) > 100_000
    for r in records:
        assert r["status"] == "ok" and r["run"]["steps"] > 1000
        assert not _contains_sim_result(r) and "series" not in r["run"]
        assert len(pickle.dumps(r)) < 8_000


class _DyingWorkloads(SweepWorkloads):
    """Ends the worker process running the point of the workload ``die``."""

    def get(self, name: str, time_scale: float) -> Any:
        if name == "die":
            os._exit(1)
        return super().get(name, time_scale)


def test_a_point_whose_worker_dies_is_failed_and_the_others_come_back() -> None:
    w = generate("chat", WorkloadOptions(num_requests=10, max_context=2048))
    cfg = runner.SimConfig(memory_gib=0.5, max_model_len=2048)
    points = [SweepPoint("workload", n, f"workload={n}", cfg, n, 1.0) for n in ("chat", "die")]
    records = parallel.run_points(points, _DyingWorkloads({"chat": w, "die": w}), jobs=2)
    assert [r["value"] for r in records] == ["chat", "die"]
    assert records[1]["status"] == "failed"
    assert "worker process died" in records[1]["reason"]


class _MarkedWorkloads(SweepWorkloads):
    """Leaves a file named after each point's workload in ``marks`` as the point
    starts; the points of ``slow...`` workloads take 20 s more."""

    marks = ""

    def get(self, name: str, time_scale: float) -> Any:
        with open(os.path.join(self.marks, name), "w"):
            pass
        if name.startswith("slow"):
            time.sleep(20)
        return super().get(name, time_scale)


def test_an_interrupted_sweep_runs_no_further_point(tmp_path: Any) -> None:
    w = generate("chat", WorkloadOptions(num_requests=10, max_context=2048))
    cfg = runner.SimConfig(memory_gib=0.5, max_model_len=2048)
    names = ["fast", "slow1", "slow2", "slow3"]
    points = [SweepPoint("workload", n, f"workload={n}", cfg, n, 1.0) for n in names]
    workloads = _MarkedWorkloads(dict.fromkeys(names, w))
    workloads.marks = str(tmp_path)

    def interrupt(i: int, record: dict[str, Any]) -> None:
        assert record["value"] == "fast"
        raise KeyboardInterrupt  # Ctrl-C as the first point comes back

    with pytest.raises(KeyboardInterrupt):
        parallel.run_points(points, workloads, jobs=2, on_done=interrupt)
    # the two workers were stopped in their slow points: the last point never began
    started = sorted(p.name for p in tmp_path.iterdir())
    assert "fast" in started and "slow3" not in started


@pytest.mark.parametrize("jobs", ["0", "-1", "1025", "abc", "2.5", ""])
def test_bad_jobs_are_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, jobs: str
) -> None:
    monkeypatch.setattr(runner, "run_pagedkv", _never)
    assert "--jobs must be 1 to 1024" in _refused(capsys, *SWEEP, "--jobs", jobs)


@pytest.mark.parametrize(
    "extra",
    [
        ["--jobs", "2"],
        ["--jobs", "2", "--compare", "caching"],
        ["--ray-address", "local"],
        ["--jobs", "2", "--sweep", "memory=1,2", "--ray-address", "local"],
    ],
)
def test_jobs_and_ray_go_with_a_sweep_alone(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, extra: list[str]
) -> None:
    monkeypatch.setattr(runner, "run_pagedkv", _never)
    _refused(capsys, "-n", "4", "--memory", "1", "-q", *extra)


@pytest.mark.parametrize(
    "address",
    [
        "",
        "foo",
        "host:0",
        "host:65536",
        "host:abc",
        ":6379",
        "a b:6379",
        "local:",
        "host:+80",
        "host\n:6379",
        "ray://host:10001",
    ],
)
def test_bad_ray_addresses_are_refused_before_anything_runs(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, address: str
) -> None:
    monkeypatch.setattr(runner, "run_pagedkv", _never)
    monkeypatch.setattr(parallel, "import_ray", _never)
    assert "--ray-address" in _refused(capsys, *SWEEP, "--ray-address", address)


@pytest.mark.parametrize(
    "address", ["auto", "local", "10.0.0.7:6379", "head-0.example.com:1", "[::1]:65535"]
)
def test_good_ray_addresses(address: str) -> None:
    assert parallel.check_ray_address(address) == address


def test_ray_address_without_ray_names_the_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "run_pagedkv", _never)
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    assert "pip install 'pagedkv[ray]'" in _refused(capsys, *SWEEP, "--ray-address", "auto")


def test_a_local_ray_instance_gives_the_points_of_a_serial_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ray = pytest.importorskip("ray")
    serial = _json(capsys, *SWEEP)
    on_ray = _json(capsys, *SWEEP, "--ray-address", "local")
    assert _differences(on_ray, serial) == []
    assert [p["value"] for p in on_ray["points"]] == [0.5, 1, 2]
    assert not ray.is_initialized()  # the instance the sweep started is shut down
