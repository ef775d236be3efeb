"""``pagedkv simulate``: every workload and output mode, with the figures checked
for internal consistency."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from pagedkv import cli
from pagedkv.sim import WORKLOADS, vllm_engine
from pagedkv.sim.plot import DPI, FIGSIZE

# Small and quick: 1 GiB of llama-3.1-8b KV cache is 512 blocks (8,192 tokens).
FAST = ["--memory", "1", "--max-model-len", "4096", "-q"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["simulate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = _run(capsys, *argv, "--json")
    assert code == 0, err
    doc: dict[str, Any] = json.loads(out)
    return doc


def _check_consistent(run: dict[str, Any], workload: dict[str, Any]) -> None:
    assert run["finished"] == run["requests"] == workload["requests"]
    assert 0 <= run["hit_tokens"] <= run["query_tokens"]
    assert 0 <= run["hit_tokens_all"] <= run["query_tokens_all"]
    assert run["query_tokens"] <= run["query_tokens_all"]
    # every request is admitted at least once, with its whole prompt looked up
    assert run["query_tokens"] >= workload["prompt_tokens"]
    assert 0.0 <= run["hit_rate"] <= 1.0
    assert 0.0 <= run["mean_usage"] <= run["peak_usage"] <= 1.0
    assert run["free_blocks_at_end"] == run["usable_blocks"] == run["num_blocks"] - 1
    assert run["admissions"] >= run["requests"]
    assert run["admissions"] == run["requests"] + run["preemptions"]
    assert run["steps"] > 0 and run["manager_calls"] > run["steps"]
    assert run["manager_us_per_step"] > 0
    api = run["per_api"]
    assert api["add_request"]["calls"] == run["requests"]
    assert api["remove_request"]["calls"] == run["requests"]
    assert api["new_step_starts"]["calls"] == run["steps"]
    assert api.get("free", {"calls": 0})["calls"] == run["preemptions"]
    total_ms = sum(v["ms"] for v in api.values())
    assert total_ms == pytest.approx(run["manager_ms"], abs=0.01 * len(api))


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_each_workload_runs_to_the_end_with_consistent_figures(
    capsys: pytest.CaptureFixture[str], workload: str
) -> None:
    doc = _json(capsys, "--workload", workload, "-n", "60", *FAST)
    (w,) = doc["workloads"]
    (run,) = doc["runs"]
    assert w["name"] == workload and w["requests"] == 60
    _check_consistent(run, w)
    assert run["config"]["model"] == "llama-3.1-8b" and run["num_blocks"] == 512


def test_default_run_is_the_chat_workload_on_llama(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys)
    (run,) = doc["runs"]
    (w,) = doc["workloads"]
    assert w["name"] == "chat" and w["requests"] == 1000
    assert run["config"]["model"] == "llama-3.1-8b"
    # vLLM's sizing on one H100-SXM (81,559 MiB): 90 % of it, less 16.06 GB of
    # bfloat16 weights, less the activation reserve (8,192 tokens x (4 x 4,096 +
    # 2 x 14,336) bfloat16 values, 256 x 128,256 float32 logits, 1 GiB runtime),
    # rounded down to whole blocks of 32 layers x 16 tokens x 2 x 8 x 128 x 2 bytes.
    reserve = 2 * 8192 * (4 * 4096 + 2 * 14336) + 256 * 128256 * 4 + (1 << 30)
    kv = int(81559 * (1 << 20) * 0.9 - 2 * 8.03e9 - reserve)
    block = 32 * 16 * 2 * 8 * 128 * 2
    assert run["num_blocks"] == kv // block
    assert run["config"]["gpu"] == "H100-SXM" and run["config"]["tp"] == 1
    _check_consistent(run, w)
    assert run["hit_rate"] > 0.5  # chat turns resend their history


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "-n", "30", *FAST)
    assert code == 0, err
    for row in (
        "requests finished",
        "30 / 30",
        "prefix hit rate (tokens)",
        "preemptions",
        "KV usage peak",
        "per step",
        "per call",
        "allocate_slots_batch",
        "get_computed_blocks",
        "workload chat: 30 requests",
    ):
        assert row in out


def test_salted_tenants_share_less(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(
        capsys,
        "-w",
        "tenants",
        "--compare",
        "workload=tenants,tenants-salted",
        "-n",
        "80",
        "--tenants",
        "16",
        "--arrival",
        "at-once",
        *FAST,
    )
    plain, salted = doc["runs"]
    assert (plain["workload"], salted["workload"]) == ("tenants", "tenants-salted")
    assert salted["hit_tokens"] < plain["hit_tokens"]


def test_lora_and_salt_flags(capsys: pytest.CaptureFixture[str]) -> None:
    base = _json(capsys, "-w", "rag", "-n", "40", *FAST)["runs"][0]
    lora = _json(capsys, "-w", "rag", "-n", "40", "--loras", "4", *FAST)["runs"][0]
    salt = _json(capsys, "-w", "rag", "-n", "40", "--cache-salt", *FAST)["runs"][0]
    assert lora["hit_tokens"] < base["hit_tokens"] and salt["hit_tokens"] < base["hit_tokens"]


def test_compare_caching(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, "-w", "chat", "-n", "40", "--compare", "caching", *FAST)
    on, off = doc["runs"]
    assert (on["label"], off["label"]) == ("caching=on", "caching=off")
    assert on["hit_tokens"] > 0 and off["hit_tokens"] == 0 == off["hit_tokens_all"]
    for run in (on, off):
        _check_consistent(run, doc["workloads"][0])


def test_compare_grid_of_block_sizes_and_memory(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(
        capsys, "-n", "40", "--compare", "block-size=16,32", "--compare", "memory=1,2", *FAST
    )
    labels = [r["label"] for r in doc["runs"]]
    assert labels == [
        "block-size=16, memory=1",
        "block-size=16, memory=2",
        "block-size=32, memory=1",
        "block-size=32, memory=2",
    ]
    blocks = [r["num_blocks"] for r in doc["runs"]]
    assert blocks == [512, 1024, 256, 512]
    for run in doc["runs"]:
        _check_consistent(run, doc["workloads"][0])


def test_compare_hashes_gives_the_same_allocations(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, "-n", "40", "--compare", "hash=sha256_cbor,xxhash_cbor,xxh3_native", *FAST)
    assert len({r["alloc_checksum"] for r in doc["runs"]}) == 1
    assert [r["config"]["hash_algo"] for r in doc["runs"]] == [
        "sha256_cbor",
        "xxhash_cbor",
        "xxh3_native",
    ]


def test_hybrid_model_preset(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(
        capsys, "-m", "gemma-3-27b", "-n", "30", "--memory", "8", "-q", "--max-model-len", "8192"
    )
    run = doc["runs"][0]
    groups = run["config"]["kv_cache_groups"]
    assert len(groups) > 1
    assert {g.split("x")[0] for g in groups} == {"SlidingWindowSpec", "FullAttentionSpec"}
    _check_consistent(run, doc["workloads"][0])


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert data[-8:-4] == b"IEND"
    return width, height


def test_plot_is_a_png_of_the_expected_size(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    png = tmp_path / "sim.png"
    code, out, err = _run(capsys, "-n", "30", "--plot", str(png), *FAST)
    assert code == 0, err
    assert f"plot written to {png}" in out
    assert _png_size(png) == (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))


def test_plot_of_a_comparison(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "cmp.png"
    _json(capsys, "-n", "30", "--compare", "caching", "--plot", str(png), *FAST)
    assert _png_size(png) == (1200, 900)


def test_json_series(capsys: pytest.CaptureFixture[str]) -> None:
    run = _json(capsys, "-n", "30", "--series", *FAST)["runs"][0]
    s = run["series"]
    assert len(s["usage"]) == len(s["running"]) == len(s["hit_rate"]) == run["steps"]
    assert max(s["usage"]) == pytest.approx(run["peak_usage"])
    assert max(s["running"]) == run["peak_running"] and s["running"][-1] == 0
    assert s["hit_rate"][-1] == pytest.approx(run["hit_rate"])


def test_trace_file_and_save_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    saved = tmp_path / "agentic.jsonl"
    first = _json(capsys, "-w", "agentic", "-n", "25", "--save-trace", str(saved), *FAST)
    again = _json(capsys, "--trace", str(saved), *FAST)
    assert first["runs"][0]["alloc_checksum"] == again["runs"][0]["alloc_checksum"]
    assert again["workloads"][0]["name"] == "agentic.jsonl"
    _check_consistent(again["runs"][0], again["workloads"][0])


def test_bad_trace_exits_2_naming_the_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_len": 10, "output_len": 2}\n{"prompt_len": 10}\n')
    code, _, err = _run(capsys, "--trace", str(bad), *FAST)
    assert code == 2 and "bad.jsonl:2: missing field 'output_len'" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--compare", "colour=red"], "unknown axis 'colour'"),
        (["--compare", "memory"], "give the values"),
        (["--compare", "caching=maybe"], "caching is on or off"),
        (["--model", "gpt-5"], "unknown model 'gpt-5'"),
        (["--memory", "0.01"], "KV cache is needed"),
        (["--max-model-len", "256"], "max_context 256 (--max-model-len) is too short"),
        (["--engine", "vllm", "--compare", "caching"], "drop --compare"),
        (["--vllm-python", "/usr/bin/python3"], "goes with --engine vllm"),
    ],
)
def test_bad_arguments_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = _run(capsys, "-n", "10", "-q", *argv)
    assert code == 2 and message in err and out == ""


def test_engine_vllm_without_vllm_says_what_to_do(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    code, out, err = _run(capsys, "--engine", "vllm", "-n", "10", *FAST)
    assert code == 3 and out == ""
    assert "vLLM is not importable in this Python" in err and "--vllm-python PATH" in err


def test_engine_vllm_with_a_python_lacking_vllm(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = _run(
        capsys, "--engine", "vllm", "--vllm-python", str(tmp_path / "nope"), "-n", "10", *FAST
    )
    assert code == 3 and "not an executable file" in err


def test_help_teaches_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["simulate", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for word in (
        *WORKLOADS,
        "--trace",
        "--compare",
        "--engine",
        "--plot",
        "--json",
        "llama-3.1-8b",
        "examples:",
        "docs/simulate.md",
    ):
        assert word in text
    assert cli.main([]) == 2
    assert "simulate" in capsys.readouterr().out


def _history_bomb() -> str:
    """A small file whose turns each repeat the whole session before them: about
    9e9 tokens (70 GB) if read without a limit."""
    first = '{"session": "s", "prompt_len": 1000, "output_len": 1000}\n'
    turn = '{"session": "s", "history": true, "prompt_len": 1000, "output_len": 1000}\n'
    return first + turn * 3000


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"arrival": 1e308, "prompt_len": 10, "output_len": 2}\n', "past the limit"),
        ("[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
        ('{"prompt_len": 1000000000000, "output_len": 2}\n', "past the limit"),
        ('{"prompt_len": 10, "output_len": 1000000000000}\n', "past the limit"),
        ('{"arrival_step": 1e5, "prompt_len": 10, "output_len": 2}\n', "integer"),
        (_history_bomb(), "past the limit"),
    ],
    ids=[
        "arrival_1e308",
        "deep_nesting",
        "prompt_len_1e12",
        "output_len_1e12",
        "float_step",
        "history_bomb",
    ],
)
def test_hostile_traces_exit_2_naming_the_file_line_and_limit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, message: str
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    code, out, err = _run(capsys, "--trace", str(bad), *FAST)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "bad.jsonl:" in err and message in err


def test_a_file_without_newlines_is_refused_at_the_line_limit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = _run(capsys, "--trace", "/dev/zero", *FAST)
    assert code == 2 and "longer than the limit" in err and err.count("\n") == 1


def test_a_cut_saved_trace_does_not_read_as_a_shorter_one(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    saved = tmp_path / "t.jsonl"
    _json(capsys, "-w", "chat", "-n", "12", "--save-trace", str(saved), *FAST)
    lines = saved.read_text().splitlines(keepends=True)
    assert json.loads(lines[-1]) == {"type": "end", "requests": 12}
    assert not list(tmp_path.glob(".t.jsonl.tmp*"))  # written beside, renamed over
    saved.write_text("".join(lines[:-3]))  # an interrupted write
    code, _, err = _run(capsys, "--trace", str(saved), *FAST)
    assert code == 2 and "end record is missing" in err


@pytest.mark.parametrize(
    "argv",
    [["--memory", "inf"], ["--memory", "nan"], ["-n", str(10**12)], ["--num-blocks", str(10**12)]],
)
def test_unbounded_arguments_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["simulate", *argv])
    assert e.value.code == 2
    assert "up to" in capsys.readouterr().err
