"""``pagedkv simulate`` under hostile arguments and output paths: every refusal is
one line on stderr with exit status 2, no traceback, no NaN or Infinity in JSON,
and no file that is not the output replaced."""

from __future__ import annotations

import json
import math
import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
from pagedkv import cli
from pagedkv.sim import outputs, runner, sweep
from pagedkv.sim.outputs import OutputPathError, check_output, open_output

FAST = ["--memory", "1", "--max-model-len", "4096", "-q"]
SMALL = ["-n", "4", *FAST]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["simulate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _refused(capsys: pytest.CaptureFixture[str], *argv: str, command: str = "simulate") -> str:
    code = cli.main([command, *argv])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"pagedkv {command}: error: "), err
    return lines[0]


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in the JSON output")

    return json.loads(text, parse_constant=refuse)


def _trace(tmp_path: Path, name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_text(
        "\n".join(
            json.dumps({"arrival": i * 0.5, "prompt_len": 40, "output_len": 4}) for i in range(4)
        )
        + "\n"
    )
    return p


# ---------------------------------------------------------------- output paths


def _reader(path: Path, into: list[bytes]) -> threading.Thread:
    def read() -> None:
        with open(path, "rb") as f:
            into.append(f.read())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("option", ["--csv", "--save-trace", "--plot"])
def test_an_output_to_a_fifo_is_written_through_and_the_fifo_stays(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, option: str
) -> None:
    fifo = tmp_path / ("out.png" if option == "--plot" else "out")
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = _reader(fifo, got)
    code, _, err = _run(capsys, *SMALL, option, str(fifo))
    reader.join(30)
    assert code == 0, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert got and got[0]
    if option == "--csv":
        assert got[0].startswith(b"axis,value,status")
    elif option == "--save-trace":
        assert b'"type": "end"' in got[0]
    else:
        assert got[0].startswith(b"\x89PNG")


def test_an_output_to_a_character_device_is_written_in_place(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = os.stat("/dev/null")
    code, _, err = _run(capsys, *SMALL, "--csv", "/dev/null", "--save-trace", "/dev/null")
    assert code == 0, err
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_ino == before.st_ino


def test_dev_stdout_gets_the_csv_and_stays_a_device(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "stdout.txt"
    with open(out, "wb") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "pagedkv.cli", "simulate", *SMALL, "--csv", "/dev/stdout"],
            stdout=f,
            stderr=subprocess.PIPE,
            timeout=120,
            check=False,
        )
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "axis,value,status" in text
    # what the shell redirected stdout to was written, not replaced by a rename
    assert stat.S_ISREG(os.lstat(out).st_mode)


@pytest.mark.parametrize("option", ["--csv", "--save-trace"])
def test_a_symlink_is_followed_and_stays_a_link(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, option: str
) -> None:
    target = tmp_path / "real.out"
    target.write_text("old\n")
    link = tmp_path / "link.out"
    link.symlink_to(target)
    code, _, err = _run(capsys, *SMALL, option, str(link))
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() != "old\n" and target.stat().st_size > 0


def test_a_dangling_symlink_creates_its_target(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = tmp_path / "new.csv"
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    code, _, err = _run(capsys, *SMALL, "--csv", str(link))
    assert code == 0, err
    assert link.is_symlink() and target.read_text().startswith("axis,")


@pytest.mark.parametrize("option", ["--csv", "--save-trace", "--plot"])
def test_an_output_that_is_the_input_trace_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, option: str
) -> None:
    trace = _trace(tmp_path, "t.png" if option == "--plot" else "t.jsonl")
    before = trace.read_bytes()
    msg = _refused(capsys, "--trace", str(trace), *FAST, option, str(trace))
    assert "is the input" in msg
    assert trace.read_bytes() == before


def test_an_output_linked_to_the_input_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = _trace(tmp_path)
    before = trace.read_bytes()
    link = tmp_path / "out.jsonl"
    link.symlink_to(trace)
    hard = tmp_path / "hard.jsonl"
    os.link(trace, hard)
    for path in (link, hard, tmp_path / "." / "t.jsonl"):
        msg = _refused(capsys, "--trace", str(trace), *FAST, "--save-trace", str(path))
        assert "is the input" in msg
    assert trace.read_bytes() == before


def test_an_output_that_is_the_model_config_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cfg = Path(__file__).parents[2] / "examples" / "configs" / "qwen2.5-7b-instruct-1m.json"
    copy = tmp_path / "config.json"
    copy.write_bytes(cfg.read_bytes())
    msg = _refused(capsys, *SMALL, "-m", str(copy), "--csv", str(copy))
    assert "is the input" in msg
    assert copy.read_bytes() == cfg.read_bytes()


def test_two_outputs_to_one_file_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "x.out"
    msg = _refused(capsys, *SMALL, "--csv", str(path), "--save-trace", str(path))
    assert "another output" in msg
    assert not path.exists()


@pytest.mark.parametrize("option", ["--csv", "--save-trace", "--plot"])
def test_directories_and_missing_directories_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, option: str
) -> None:
    d = tmp_path / ("d.png" if option == "--plot" else "d")
    d.mkdir()
    assert "is a directory" in _refused(capsys, *SMALL, option, str(d))
    link = tmp_path / ("l.png" if option == "--plot" else "l")
    link.symlink_to(d)
    assert "is a directory" in _refused(capsys, *SMALL, option, str(link))
    missing = tmp_path / "nope" / ("x.png" if option == "--plot" else "x")
    assert "no directory" in _refused(capsys, *SMALL, option, str(missing))
    assert d.is_dir() and link.is_symlink()


def test_a_socket_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import socket

    path = tmp_path / "s.sock"
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(path))
        assert "not a regular file" in _refused(capsys, *SMALL, "--csv", str(path))
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
    finally:
        s.close()


def test_a_regular_file_keeps_its_mode_and_no_temporary_file_is_left(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "x.csv"
    path.write_text("old\n")
    path.chmod(0o640)
    code, _, err = _run(capsys, *SMALL, "--csv", str(path))
    assert code == 0, err
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.csv"]


def test_an_interrupted_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("old\n")
    with pytest.raises(RuntimeError), open_output(path) as f:
        f.write("half")
        raise RuntimeError("interrupted")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["x.csv"]


def test_the_api_refuses_too(tmp_path: Path) -> None:
    trace = _trace(tmp_path)
    with pytest.raises(OutputPathError, match="is the input"):
        check_output(trace, inputs=[trace])
    with pytest.raises(OutputPathError, match="is a directory"):
        check_output(tmp_path)
    with pytest.raises(OutputPathError, match="empty path"):
        check_output("")
    with pytest.raises(OutputPathError, match="is a directory"), open_output(tmp_path):
        pass
    from pagedkv.sim.traces import load_trace

    w = load_trace(trace)
    from pagedkv.sim.tracefile import write_trace

    with pytest.raises(OutputPathError, match="is the input"):
        write_trace(w, trace)
    assert outputs.__all__
    rows = [sweep.point("variant", "x", runner.run_pagedkv(w, runner.SimConfig(memory_gib=1)))]
    sweep.write_csv(rows, tmp_path / "ok.csv")
    assert (tmp_path / "ok.csv").read_text().startswith("axis,")


# ------------------------------------------------------ numbers that are not numbers


@pytest.mark.parametrize(
    "coefficients",
    [
        "1e308,1e308,1e308,1e308",
        "1e7,0,0,0",
        "1,1e300,0,0",
        "1,0,inf,0",
        "nan,1,1,1",
        "1,-0.5,0,0",
        "0,0,0,0",
        "1,2,3",
        "1,2,3,4,5",
        "1,2,3,x",
        "",
    ],
)
def test_bad_step_time_coefficients_are_refused(
    capsys: pytest.CaptureFixture[str], coefficients: str
) -> None:
    assert "step-time" in _refused(capsys, *SMALL, "--step-time", coefficients, "--json")


def test_the_largest_step_time_gives_finite_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, *SMALL, "--step-time", "1e6,1e6,1e6,1e6", "--json")
    assert code == 0, err
    run = _strict_json(out)["runs"][0]
    assert run["ttft_ms"]["p99"] > 0


@pytest.mark.parametrize("workload", ["tenants", "rag"])
def test_find_max_rate_refuses_arrivals_all_at_once(
    capsys: pytest.CaptureFixture[str], workload: str
) -> None:
    msg = _refused(
        capsys,
        "-w",
        workload,
        *SMALL,
        "--arrival",
        "at-once",
        "--slo-ttft",
        "100",
        "--find-max-rate",
        "--json",
    )
    assert "arrive at the same time" in msg


def test_find_max_rate_refuses_a_trace_of_simultaneous_arrivals(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"prompt_len": 30, "output_len": 3}) + "\n" * 2)
    p.write_text(p.read_text() + json.dumps({"prompt_len": 40, "output_len": 3}) + "\n")
    msg = _refused(
        capsys, "--trace", str(p), *FAST, "--slo-tpot", "50", "--find-max-rate", "--json"
    )
    assert "arrive at the same time" in msg


def test_find_max_rate_json_is_strict(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = _run(
        capsys,
        "--trace",
        str(_trace(tmp_path)),
        *FAST,
        "--slo-ttft",
        "1000",
        "--find-max-rate",
        "--json",
    )
    assert code == 0, err
    doc = _strict_json(out)
    assert all(math.isfinite(p["requests_per_s"]) for p in doc["tried"])


def test_a_non_finite_figure_is_never_printed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = runner.SimResult.to_dict

    def with_nan(self: runner.SimResult) -> dict[str, Any]:
        return real(self) | {"hit_rate": float("nan")}

    monkeypatch.setattr(runner.SimResult, "to_dict", with_nan)
    msg = _refused(capsys, *SMALL, "--json")
    assert "not a finite number" in msg
    assert "NaN" not in capsys.readouterr().out


def test_a_huge_compare_grid_is_refused_before_any_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*_: Any, **__: Any) -> Any:
        raise AssertionError("a variant ran")

    monkeypatch.setattr(runner, "run_pagedkv", never)
    values = ",".join(str(i) for i in range(1, 1001))
    msg = _refused(
        capsys,
        *SMALL,
        "--compare",
        f"num-blocks={values}",
        "--compare",
        f"max-num-seqs={values}",
        "--compare",
        f"block-size={values}",
    )
    assert "1000 x 1000 x 1000 = 1,000,000,000 variants" in msg
    assert "limit of 256" in _refused(capsys, *SMALL, "--compare", f"num-blocks={values}")
    assert "limit" in _refused(capsys, *SMALL, "--sweep", f"memory={values}")


@pytest.mark.parametrize(
    "spec",
    [
        "memory=2,2",
        "memory=2,2.0",
        "caching=on,on",
        "block-size=16,016",
        "num-blocks=600,600",
        "time-scale=1,1.0",
    ],
)
def test_duplicate_values_are_refused(capsys: pytest.CaptureFixture[str], spec: str) -> None:
    for flag in ("--sweep", "--compare"):
        assert "repeats" in _refused(capsys, *SMALL, flag, spec)


def test_a_bad_sweep_value_is_reported_and_the_sweep_goes_on(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    csv_path = tmp_path / "s.csv"
    code, out, err = _run(
        capsys,
        *SMALL,
        "--sweep",
        "memory=1,abc,-2,nan,inf,0.001,2",
        "--json",
        "--csv",
        str(csv_path),
    )
    assert code == 0, err
    points = _strict_json(out)["points"]
    assert [p["status"] for p in points] == [
        "ok",
        "invalid",
        "invalid",
        "invalid",
        "invalid",
        "does not fit",
        "ok",
    ]
    assert "positive finite number" in points[1]["reason"]
    rows = csv_path.read_text().splitlines()
    assert len(rows) == 1 + len(points)
    # every value bad: nothing to run
    assert "memory=abc" in _refused(capsys, *SMALL, "--sweep", "memory=abc,-1")


def test_a_point_that_fails_otherwise_is_reported_and_the_sweep_goes_on(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = runner.run_pagedkv

    def flaky(w: Any, cfg: runner.SimConfig, **kw: Any) -> runner.SimResult:
        if cfg.max_num_seqs == 7:
            raise ZeroDivisionError("boom")
        return real(w, cfg, **kw)

    monkeypatch.setattr(runner, "run_pagedkv", flaky)
    code, out, err = _run(capsys, *SMALL, "--sweep", "max-num-seqs=4,7,8", "--json")
    assert code == 0, err
    points = _strict_json(out)["points"]
    assert [p["status"] for p in points] == ["ok", "failed", "ok"]
    assert points[1]["reason"] == "ZeroDivisionError: boom"
    code, out, err = _run(capsys, *SMALL, "--sweep", "max-num-seqs=4,7,8")
    assert code == 0 and "failed: ZeroDivisionError" in out


@pytest.mark.parametrize(
    "extra",
    [
        ["-n", "5"],
        ["--requests", "1000"],
        ["--rate", "3"],
        ["--arrival", "poisson"],
        ["--tenants", "8"],
        ["--loras", "0"],
        ["--cache-salt"],
    ],
)
def test_workload_options_with_a_trace_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, extra: list[str]
) -> None:
    msg = _refused(capsys, "--trace", str(_trace(tmp_path)), *FAST, *extra)
    assert extra[0] in msg and "--trace replays" in msg


@pytest.mark.parametrize(
    "extra",
    [
        ["--loras", "-1"],
        ["--loras", str(10**12)],
        ["--time-scale", "nan"],
        ["--time-scale", "inf"],
        ["--time-scale", "0"],
        ["--rate", "-1"],
        ["--rate", "1e400"],
        ["--memory", "nan"],
        ["--slo-ttft", "inf"],
        ["--slo-target", "nan"],
        ["--gpu-memory-utilization", "1.5"],
        ["--step-ms", "0"],
        ["--max-concurrency", "0"],
        ["--max-concurrency", "1000001"],
        ["--max-concurrency", "1.5"],
        ["--max-concurrency", "many"],
        ["--on-overlong", "truncate"],
        ["--quantization", "int4"],
        ["--quantization", ""],
        ["--clock", "sglang"],
        ["--compare", "quantization=fp8,int4"],
    ],
)
def test_bad_numbers_are_refused(capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    # argparse's own refusals print the usage, then one error line, and exit 2
    try:
        code = cli.main(["simulate", *SMALL, *extra])
    except SystemExit as e:
        code = int(str(e.code))
    _, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("pagedkv simulate: error: ")
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


@pytest.mark.parametrize("spec", ["max-concurrency=0,2", "max-concurrency=2,1e9"])
def test_bad_max_concurrency_axis_values_are_refused(
    capsys: pytest.CaptureFixture[str], spec: str
) -> None:
    line = _refused(capsys, *SMALL, "--compare", spec)
    assert "max-concurrency=" in line and "1 to 1000000" in line
