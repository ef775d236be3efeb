"""The simulator's command line around its runs: output files, lengths, sessions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pagedkv import cli
from pagedkv.sim import plot
from pagedkv.sim.policy import Request
from pagedkv.sim.runner import SimConfig, run_pagedkv
from pagedkv.sim.tracefile import read_trace, write_trace
from pagedkv.sim.workloads import Workload

BLOCK_BYTES = 32 * 16 * 2 * 8 * 128 * 2  # llama-3.1-8b, 16 tokens


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(
        ["simulate", "-q", "-n", "10", "--memory", "1", "--max-model-len", "4096", *argv]
    )
    out, err = capsys.readouterr()
    return code, out, err


def test_automatic_length_does_not_refuse_a_workload_that_fits() -> None:
    # 8,100 tokens round up to 9,216, which 510 blocks cannot hold; 8,100 fit.
    w = Workload("w", [Request("a", list(range(8000)), [1] * 100)])
    r = run_pagedkv(w, SimConfig(memory_gib=510 * BLOCK_BYTES / (1 << 30)))
    assert r.config["max_model_len"] == 8100 and r.finished == 1
    with pytest.raises(ValueError, match="KV cache is needed"):
        run_pagedkv(w, SimConfig(memory_gib=500 * BLOCK_BYTES / (1 << 30)))


@pytest.mark.parametrize("option", ["--plot", "--csv", "--save-trace"])
def test_output_paths_are_checked_before_simulating(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, option: str
) -> None:
    extra = ["--sweep", "memory=1,2"] if option == "--csv" else []
    name = "x.png" if option == "--plot" else "x.out"
    code, out, err = _run(capsys, *extra, option, str(tmp_path / "missing" / name))
    assert code == 2 and "no directory" in err and out == ""
    (tmp_path / name).mkdir()
    code, out, err = _run(capsys, *extra, option, str(tmp_path / name))
    assert code == 2 and "is a directory" in err


def test_a_failed_plot_keeps_the_json(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(plot, "plot_results", broken)
    code, out, err = _run(capsys, "--json", "--plot", str(tmp_path / "x.png"))
    assert code == 2 and "disk full" in err
    assert json.loads(out)["runs"][0]["finished"] == 10


def test_save_trace_refuses_several_workloads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = _run(
        capsys, "--compare", "workload=chat,rag", "--save-trace", str(tmp_path / "t.jsonl")
    )
    assert code == 2 and "writes one workload" in err


def test_a_later_turn_keeps_its_sessions_adapter_and_salt(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"id": "a", "session": "s", "prompt_len": 40, "output_len": 2, '
        '"lora": "l1", "salt": "x"}\n'
        '{"id": "b", "session": "s", "history": true, "prompt_len": 8, "output_len": 2}\n'
        '{"id": "c", "session": "s", "history": true, "prompt_len": 8, "output_len": 2, '
        '"lora": null}\n'
    )
    a, b, c = read_trace(p).requests
    assert (b.lora_name, b.lora_path, b.cache_salt) == ("l1", "/adapters/l1", "x")
    assert (c.lora_name, c.cache_salt) == (None, "x")
    # The history of b is cached under a's adapter and salt: b hits it.
    r = run_pagedkv(read_trace(p), SimConfig(memory_gib=1.0, max_model_len=1024))
    assert r.hit_tokens >= 32
    # Written and read back: the same keys per turn.
    out = tmp_path / "again.jsonl"
    write_trace(read_trace(p), out)
    again = read_trace(out).requests
    assert [(r.lora_name, r.cache_salt) for r in again] == [
        (r.lora_name, r.cache_salt) for r in (a, b, c)
    ]


def test_sweep_reports_points_that_do_not_fit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    csv_path = tmp_path / "s.csv"
    code, out, err = _run(capsys, "--sweep", "memory=0.01,1,2", "--csv", str(csv_path), "--json")
    assert code == 0, err
    doc = json.loads(out)
    status = [(p["value"], p["status"]) for p in doc["points"]]
    assert status == [(0.01, "does not fit"), (1, "ok"), (2, "ok")]
    assert "KV cache is needed" in doc["points"][0]["reason"]
    assert doc["points"][1]["run"]["finished"] == 10
    assert 0 < doc["prefix_hit_ceiling"] <= 1
    rows = csv_path.read_text().splitlines()
    assert rows[0].startswith("axis,value,status,reason,num_blocks")
    assert len(rows) == 4 and rows[1].startswith("memory,0.01,does not fit,")


def test_csv_of_compared_variants(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    csv_path = tmp_path / "c.csv"
    code, _, err = _run(capsys, "--compare", "caching", "--csv", str(csv_path))
    assert code == 0, err
    rows = csv_path.read_text().splitlines()
    assert [r.split(",")[1] for r in rows[1:]] == ["caching=on", "caching=off"]


def test_vllm_subprocess_progress_reaches_the_caller(tmp_path: Path) -> None:
    from pagedkv.sim import runner

    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        "echo 'pagedkv-progress 10 1' >&2\n"
        "echo 'pagedkv-progress ten 1' >&2\n"
        "echo 'some warning' >&2\n"
        "echo 'pagedkv-progress 20 2' >&2\n"
        "echo '{\"ok\": true}'\n"
    )
    fake.chmod(0o755)
    seen: list[tuple[int, int]] = []
    out = runner._run_subprocess({}, str(fake), lambda s, f: seen.append((s, f)))
    assert out == {"ok": True} and seen == [(10, 1), (20, 2)]
    fake.write_text("#!/bin/sh\necho 'pagedkv-progress 1 0' >&2\necho boom >&2\nexit 1\n")
    with pytest.raises(runner.EngineUnavailableError, match="boom"):
        runner._run_subprocess({}, str(fake))
