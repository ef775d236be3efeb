"""``pagedkv simulate`` under hostile arguments and output paths: every refusal is
one line on stderr with exit status 2, no traceback, no NaN or Infinity in JSON,
and no file that is not the output replaced."""

from __future__ import annotations

import json
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
    cfg = Path(__file__).parents[1] / "examples" / "configs" / "qwen2.5-7b-instruct-1m.json"
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
