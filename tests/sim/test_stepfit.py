"""``pagedkv calibrate``: fitting ``--step-time`` to benchmark_serving results.

The ground truth is the simulator itself: benchmark files written from runs with
known coefficients must give those coefficients back, and every figure the files
hold; real result files (hand-written with vLLM's field names) are accepted;
hostile files are refused in one line."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pagedkv import cli
from pagedkv.sim import stepfit
from pagedkv.sim.runner import SimConfig, run_pagedkv
from pagedkv.sim.stepfit import Benchmark
from pagedkv.sim.steptime import LinearModel

TRUTH = LinearModel(4.0, 25.0, 0.08, 0.015)
THETA = np.array([1.0, 4.0, 25.0, 0.08, 0.015])
CFG = SimConfig(
    memory_gib=2.0,
    max_num_seqs=64,
    enable_caching=False,
    background_hashing=False,
    hash_algo="xxh3_native",
    on_overlong="fail",
)
ARGS = ["--memory", "2", "--max-num-seqs", "64"]


def _lens(rng: np.random.Generator, lo: int, hi: int, n: int) -> tuple[int, ...]:
    return tuple(int(x) for x in rng.integers(lo, hi + 1, n))


def _benchmarks() -> list[Benchmark]:
    """Concurrency 1, 8 and 32; inputs 256..2048, outputs 64..256."""
    rng = np.random.default_rng(1)
    return [
        Benchmark("c1", (256,) * 4, (64,) * 4, max_concurrency=1),
        Benchmark("c8", (1024,) * 16, (128,) * 16, max_concurrency=8),
        Benchmark("c32", _lens(rng, 256, 2048, 64), _lens(rng, 64, 256, 64), max_concurrency=32),
    ]


def _write(tmp_path: Path, name: str, doc: Any) -> str:
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return str(p)


def _files(tmp_path: Path, benchmarks: list[Benchmark], detailed: bool = False) -> list[str]:
    out = []
    for b in benchmarks:
        run = stepfit.simulate(b, CFG, TRUTH, keep_tokens=True)
        doc = stepfit.result_json(b, run, detailed=detailed or b.name == "c32")
        out.append(_write(tmp_path, f"{b.name}.json", doc))
    return out


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in the JSON output")

    return json.loads(text, parse_constant=refuse)


def _calibrate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["calibrate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ the linear forms


def _plain_run(b: Benchmark, model: LinearModel) -> dict[str, Any]:
    """The same benchmark through ``run_pagedkv`` (the simulator's own figures)."""
    text = f"{model.a},{model.b},{model.c},{model.d}"
    cfg = replace(CFG, step_time=text, max_concurrency=b.max_concurrency)
    return run_pagedkv(stepfit.workload(b), cfg).timing


@pytest.mark.parametrize(
    "bench",
    [
        Benchmark("closed", (300, 900, 1500, 2100) * 3, (20, 40, 60, 80) * 3, max_concurrency=4),
        # Poisson arrivals slow enough for the engine to sit idle between them
        Benchmark("open", (500,) * 12, (30,) * 12, request_rate=2.0),
        Benchmark("bursty", (800,) * 20, (50,) * 20, request_rate=40.0, burstiness=0.5),
        # arrivals at a rate, sent only while one of 3 clients is free
        Benchmark("both", (600, 1400) * 8, (40, 25) * 8, max_concurrency=3, request_rate=20.0),
    ],
)
def test_linear_forms_give_the_figures_of_the_run_they_came_from(bench: Benchmark) -> None:
    run = stepfit.simulate(bench, CFG, TRUTH)
    timing = _plain_run(bench, TRUTH)
    for key, section in (
        ("mean_ttft_ms", "ttft_ms"),
        ("mean_tpot_ms", "tpot_ms"),
        ("mean_itl_ms", "itl_ms"),
    ):
        assert run.forms[key] @ THETA == pytest.approx(timing[section]["mean"], abs=2e-3)
        assert run.figures[key] == pytest.approx(timing[section]["mean"], abs=2e-3)
    # summarize's duration runs from the first arrival; the benchmark's from 0
    first = float(stepfit.arrival_times(bench)[0])
    assert run.forms["duration"] @ THETA / 1000 - first == pytest.approx(
        timing["duration_s"], abs=2e-6
    )
    assert run.figures["duration"] - first == pytest.approx(timing["duration_s"], abs=2e-6)


def test_a_closed_loop_schedule_is_linear_for_any_coefficients() -> None:
    """Closed-loop clients send at step boundaries: the schedule does not depend
    on the clock, so the forms of one run give every other run's figures."""
    bench = Benchmark("closed", (300, 1200, 2000) * 4, (30, 70, 110) * 4, max_concurrency=5)
    forms = stepfit.simulate(bench, CFG, TRUTH).forms
    other = LinearModel(9.0, 3.0, 0.5, 0.002)
    want = stepfit.simulate(bench, CFG, other).figures
    theta = np.array([1.0, 9.0, 3.0, 0.5, 0.002])
    for key in ("mean_ttft_ms", "mean_tpot_ms", "mean_itl_ms"):
        assert forms[key] @ theta == pytest.approx(want[key], rel=1e-9)
    assert forms["duration"] @ theta / 1000 == pytest.approx(want["duration"], rel=1e-9)


def test_arrivals_are_drawn_as_benchmark_serving_draws_them() -> None:
    n = 10
    even = Benchmark("e", (10,) * n, (2,) * n, request_rate=4.0, burstiness=math.inf)
    assert stepfit.arrival_times(even) == pytest.approx([(k + 1) / 4.0 for k in range(n)])
    poisson = Benchmark("p", (10,) * n, (2,) * n, request_rate=4.0)
    t = stepfit.arrival_times(poisson, seed=3)
    assert t[-1] == pytest.approx(n / 4.0)  # rescaled: the last is sent at n / rate
    assert (np.diff(t) > 0).all()
    assert not np.allclose(np.diff(t), 0.25)
    assert (stepfit.arrival_times(Benchmark("i", (10,) * n, (2,) * n)) == 0).all()


def test_nnls_keeps_coefficients_non_negative() -> None:
    # Separable: each coefficient is fitted alone; the negative one is held at 0.
    m = np.vstack([np.eye(4), np.eye(4)])
    y = np.array([1.0, -1.0, 2.0, 3.0, 1.0, -3.0, 2.0, 3.0])
    assert stepfit.nnls(m, y) == pytest.approx([1.0, 0.0, 2.0, 3.0])
    # Unconstrained solution already non-negative: the least squares itself.
    a = np.array([[1.0, 0, 0, 0], [0, 2, 0, 0], [0, 0, 1, 1], [0, 0, 1, -1], [1, 1, 1, 1]])
    x = np.array([0.5, 1.0, 2.0, 1.0])
    assert stepfit.nnls(a, a @ x) == pytest.approx(x)


# ------------------------------------------------------------------ the fit


def test_calibrate_recovers_the_coefficients_of_simulated_benchmarks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    files = _files(tmp_path, _benchmarks())
    code, out, err = _calibrate(capsys, *files, *ARGS, "--json")
    assert code == 0, err
    assert err == ""
    doc = _strict_json(out)
    got = doc["coefficients_ms"]
    for k, want in zip("abcd", (4.0, 25.0, 0.08, 0.015), strict=True):
        assert got[k] == pytest.approx(want, rel=0.03), (k, got)
    assert LinearModel.parse(doc["step_time"]) == LinearModel(**got)
    assert doc["settled"] is True
    assert len(doc["benchmarks"]) == 3
    for row in doc["benchmarks"]:
        assert row["fitted"] == ["mean_ttft_ms", "mean_tpot_ms", "duration"]
        assert set(row["error"]) == {
            "mean_ttft_ms",
            "mean_tpot_ms",
            "mean_itl_ms",
            "output_throughput",
            "duration",
        }
        for key, e in row["error"].items():
            assert abs(e) <= 0.02, (row["file"], key, e)
            assert row["simulated"][key] == pytest.approx(row["measured"][key] * (1 + e), rel=1e-9)
    c32 = doc["benchmarks"][2]
    assert c32["per_request_lengths"] is True
    assert c32["client"] == "32 concurrent"


def test_calibrate_table_names_the_step_time_and_each_figure(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    files = _files(tmp_path, _benchmarks())
    code, out, err = _calibrate(capsys, *files, *ARGS)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1] == "--step-time 4,25,0.08,0.015"
    assert f"{files[1]}: 16 requests of 1,024 in / 128 out tokens (mean), 8 concurrent" in lines
    ttft = [ln for ln in lines if ln.strip().startswith("TTFT mean (ms)")]
    assert len(ttft) == 3 and all(ln.endswith("+0.0%  fitted") for ln in ttft)


def test_an_open_loop_benchmark_is_fitted_within_two_percent(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    benches = [*_benchmarks(), Benchmark("rate", (512,) * 40, (100,) * 40, request_rate=8.0)]
    files = _files(tmp_path, benches)
    code, out, err = _calibrate(capsys, *files, *ARGS, "--json")
    assert code == 0, err
    doc = _strict_json(out)
    assert doc["benchmarks"][3]["client"] == "8 req/s"
    for row in doc["benchmarks"]:
        for key in row["fitted"]:
            assert abs(row["error"][key]) <= 0.02, (row["file"], key, row["error"][key])


def test_one_benchmark_is_too_few_figures(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    files = _files(tmp_path, _benchmarks()[1:2])
    line = _refused(capsys, *files, *ARGS)
    assert "3 figure(s)" in line and "4 coefficients" in line


def test_the_same_benchmark_twice_does_not_determine_four_coefficients(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (f,) = _files(tmp_path, _benchmarks()[1:2])
    copy = _write(tmp_path, "copy.json", json.loads(Path(f).read_text()))
    line = _refused(capsys, f, copy, *ARGS)
    assert "do not determine" in line


def test_one_concurrency_warns_that_a_and_c_trade_off(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rng = np.random.default_rng(5)
    benches = [
        Benchmark("short", _lens(rng, 200, 400, 24), _lens(rng, 20, 60, 24), max_concurrency=8),
        Benchmark("long", _lens(rng, 1500, 2000, 24), _lens(rng, 150, 250, 24), max_concurrency=8),
    ]
    files = _files(tmp_path, benches, detailed=True)
    code, out, err = _calibrate(capsys, *files, *ARGS, "--json")
    assert code == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("pagedkv calibrate: warning: every benchmark ran 8 request(s)")
    assert "(A)" in lines[0] and "(C)" in lines[0]
    assert _strict_json(out)["warnings"] == [lines[0].removeprefix("pagedkv calibrate: warning: ")]


def test_without_a_roofline_the_fit_starts_from_a_default() -> None:
    benches = _benchmarks()
    parsed = []
    for b in benches:
        run = stepfit.simulate(b, CFG, TRUTH, keep_tokens=True)
        parsed.append(stepfit.parse_benchmark(stepfit.result_json(b, run, detailed=True), b.name))
    result = stepfit.fit(parsed, CFG, start=stepfit.DEFAULT_START)
    assert result.model == TRUTH
    assert result.settled


def test_clock_free_benchmarks_are_replayed_once_and_then_with_the_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    benches = _benchmarks()
    parsed = []
    for b in benches:
        run = stepfit.simulate(b, CFG, TRUTH, keep_tokens=True)
        parsed.append(stepfit.parse_benchmark(stepfit.result_json(b, run, detailed=True), b.name))
    calls: list[str] = []
    real = stepfit.simulate

    def counted(b: Benchmark, *args: Any, **kw: Any) -> stepfit.Run:
        calls.append(b.name)
        return real(b, *args, **kw)

    monkeypatch.setattr(stepfit, "simulate", counted)
    result = stepfit.fit(parsed, CFG, start=stepfit.DEFAULT_START)
    assert result.model == TRUTH and result.rounds == 2
    assert calls == ["c1", "c8", "c32"] * 2


def test_one_token_answers_do_not_determine_the_decode_coefficient(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    benches = [
        Benchmark("a", (256,) * 8, (1,) * 8, max_concurrency=1),
        Benchmark("b", (1024,) * 8, (1,) * 8, max_concurrency=4),
    ]
    files = _files(tmp_path, benches)
    line = _refused(capsys, *files, *ARGS)
    assert "do not determine the coefficients C" in line


def test_a_fit_far_from_the_figures_warns_about_the_deployment(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Benchmarks of one deployment replayed on another (a 10-token prefill
    budget instead of 8192) cannot be fitted: the fit says so."""
    files = _files(tmp_path, _benchmarks()[:2])
    code, out, err = _calibrate(capsys, *files, *ARGS, "--max-num-batched-tokens", "10")
    assert code == 0, err
    (line,) = err.strip().splitlines()
    assert line.startswith("pagedkv calibrate: warning: the fit leaves ")
    assert "--max-num-batched-tokens" in line
    assert out.startswith("pagedkv calibrate: ")


def test_seed_must_be_non_negative(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    files = _files(tmp_path, _benchmarks()[:2])
    assert "--seed must be" in _refused(capsys, *files, *ARGS, "--seed", "-1")


# ------------------------------------------------------------------ real files

#: ``vllm bench serve --save-result`` (no --save-detailed), Llama-3.1-8B on one
#: H100, random dataset: the fields vLLM writes, figures of the kind it reports.
REAL = {
    "date": "20250612-101112",
    "endpoint_type": "vllm",
    "backend": "vllm",
    "label": None,
    "model_id": "meta-llama/Llama-3.1-8B-Instruct",
    "tokenizer_id": "meta-llama/Llama-3.1-8B-Instruct",
    "num_prompts": 64,
    "request_rate": "inf",
    "burstiness": 1.0,
    "max_concurrency": 16,
    "duration": 10.71,
    "completed": 64,
    "failed": 0,
    "total_input_tokens": 65536,
    "total_output_tokens": 16384,
    "request_throughput": 5.976,
    "request_goodput": None,
    "output_throughput": 1529.79,
    "total_token_throughput": 7648.9,
    "max_output_tokens_per_s": 1680.0,
    "max_concurrent_requests": 16,
    "rtfx": 0.0,
    "mean_ttft_ms": 61.2,
    "median_ttft_ms": 55.4,
    "std_ttft_ms": 21.0,
    "p99_ttft_ms": 120.3,
    "mean_tpot_ms": 9.95,
    "median_tpot_ms": 9.9,
    "std_tpot_ms": 0.3,
    "p99_tpot_ms": 10.6,
    "mean_itl_ms": 9.95,
    "median_itl_ms": 9.7,
    "std_itl_ms": 2.1,
    "p99_itl_ms": 18.2,
    "mean_e2el_ms": 2598.0,
    "median_e2el_ms": 2590.0,
    "std_e2el_ms": 30.0,
    "p99_e2el_ms": 2660.0,
}


def test_a_real_benchmark_serving_result_is_read() -> None:
    b = stepfit.parse_benchmark(REAL, "real.json")
    assert b.input_lens == (1024,) * 64
    assert b.output_lens == (256,) * 64
    assert b.max_concurrency == 16 and b.request_rate == math.inf
    assert b.measured == {
        "duration": 10.71,
        "mean_ttft_ms": 61.2,
        "mean_tpot_ms": 9.95,
        "mean_itl_ms": 9.95,
        "output_throughput": 1529.79,
    }
    assert b.fitted() == ["mean_ttft_ms", "mean_tpot_ms", "duration"]
    assert not b.detailed


def test_the_writer_uses_benchmark_serving_field_names() -> None:
    b = _benchmarks()[0]
    doc = stepfit.result_json(b, stepfit.simulate(b, CFG, TRUTH, keep_tokens=True), detailed=True)
    assert set(REAL) - {"max_output_tokens_per_s", "max_concurrent_requests", "rtfx"} <= set(doc)
    detailed = {"input_lens", "output_lens", "ttfts", "itls", "start_times", "errors"}
    assert detailed <= set(doc)
    assert len(doc["itls"][0]) == 63 and doc["output_lens"] == [64] * 4


def test_calibrate_accepts_real_results(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    one = _write(tmp_path, "c1.json", REAL | {"max_concurrency": 1, "num_prompts": 8,
                 "completed": 8, "total_input_tokens": 8192, "total_output_tokens": 2048,
                 "duration": 15.12, "mean_ttft_ms": 28.0, "mean_tpot_ms": 7.3,
                 "mean_itl_ms": 7.3, "output_throughput": 135.4})  # fmt: skip
    many = _write(tmp_path, "c16.json", REAL)
    code, out, err = _calibrate(capsys, one, many, "--json")
    assert code == 0, err
    doc = _strict_json(out)
    coeffs = LinearModel.parse(doc["step_time"])
    assert coeffs.a + coeffs.b + coeffs.c + coeffs.d > 0
    assert [r["file"] for r in doc["benchmarks"]] == [one, many]
    assert [r["requests"] for r in doc["benchmarks"]] == [8, 64]


def test_infinite_rate_and_burstiness_are_read_as_written() -> None:
    text = json.dumps(REAL | {"request_rate": 4.0, "burstiness": float("inf")})
    assert '"burstiness": Infinity' in text  # how json.dump writes it
    b = stepfit.parse_benchmark(json.loads(text), "r.json")
    assert b.request_rate == 4.0 and b.burstiness == math.inf
    text = json.dumps(REAL | {"request_rate": float("inf"), "max_concurrency": None})
    b = stepfit.parse_benchmark(json.loads(text), "i.json")
    assert b.request_rate == math.inf and b.client() == "all at once"
    for bad in ({"burstiness": float("nan")}, {"request_rate": float("-inf")}):
        with pytest.raises(stepfit.BenchmarkFormatError, match="must be a finite number"):
            stepfit.parse_benchmark(REAL | bad, "x.json")


def test_appended_results_are_one_benchmark_each(tmp_path: Path) -> None:
    second = REAL | {"max_concurrency": 4, "mean_ttft_ms": 40.0}
    p = tmp_path / "appended.json"
    p.write_text(json.dumps(REAL) + "\n" + json.dumps(second))
    got = stepfit.load_benchmarks(p)
    assert [b.name for b in got] == [f"{p}#1", f"{p}#2"]
    assert [b.max_concurrency for b in got] == [16, 4]


def test_detailed_lengths_leave_out_failed_requests() -> None:
    doc = REAL | {
        "completed": 2,
        "total_input_tokens": 300,
        "total_output_tokens": 30,
        "input_lens": [100, 200, 50],
        "output_lens": [10, 20, 0],
        "errors": ["", "", "timeout"],
    }
    b = stepfit.parse_benchmark(doc, "d.json")
    assert b.input_lens == (100, 200) and b.output_lens == (10, 20)
    assert b.detailed


# ------------------------------------------------------------------ hostile files


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = cli.main(["calibrate", *argv])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pagedkv calibrate: error: "), err
    return lines[0]


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"not json at all", "not JSON"),
        (b"", "empty"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[1, 2, 3]", "a JSON object, got list"),
        (b"[" * 100_000, "not JSON"),
        (json.dumps({"completed": 3}).encode(), "no total_input_tokens"),
        (json.dumps(REAL | {"completed": -4}).encode(), "completed must be an integer"),
        (json.dumps(REAL | {"completed": True}).encode(), "completed must be an integer"),
        (json.dumps(REAL | {"completed": 10**12}).encode(), "completed must be an integer"),
        (json.dumps(REAL | {"duration": float("nan")}).encode(), "duration must be a finite"),
        (json.dumps(REAL | {"duration": 1e300}).encode(), "duration must be a finite"),
        (json.dumps(REAL | {"duration": 0}).encode(), "duration must be a finite"),
        (json.dumps(REAL | {"mean_ttft_ms": -1.0}).encode(), "mean_ttft_ms must be"),
        (json.dumps(REAL | {"mean_tpot_ms": "fast"}).encode(), "mean_tpot_ms must be a number"),
        (json.dumps(REAL | {"request_rate": "soon"}).encode(), "request_rate must be a number"),
        (json.dumps(REAL | {"request_rate": -2}).encode(), "request_rate must be"),
        (json.dumps(REAL | {"max_concurrency": 0}).encode(), "max_concurrency must be"),
        (json.dumps(REAL | {"total_output_tokens": 3}).encode(), "total_output_tokens must be"),
        (json.dumps(REAL | {"ramp_up_strategy": "linear"}).encode(), "ramp-up"),
        (json.dumps(REAL | {"input_lens": [5, 6]}).encode(), "go together"),
        (
            json.dumps(REAL | {"input_lens": [5, 6], "output_lens": [1]}).encode(),
            "input_lens has 2 requests, output_lens 1",
        ),
        (
            json.dumps(REAL | {"input_lens": [5, -6], "output_lens": [1, 1]}).encode(),
            "input_lens[1] must be an integer",
        ),
        (
            json.dumps(REAL | {"input_lens": "many", "output_lens": [1]}).encode(),
            "input_lens must be a list",
        ),
        (
            json.dumps(REAL | {"input_lens": [5], "output_lens": [0]}).encode(),
            "no request in input_lens/output_lens succeeded",
        ),
    ],
)
def test_a_hostile_file_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: bytes, says: str
) -> None:
    p = tmp_path / "bad.json"
    p.write_bytes(content)
    good = _write(tmp_path, "good.json", REAL)
    line = _refused(capsys, good, str(p))
    assert says in line, line
    assert str(p) in line


def test_a_file_past_the_size_limit_is_refused_unread(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stepfit, "MAX_FILE_BYTES", 1000)
    p = tmp_path / "big.json"
    with open(p, "wb") as f:  # sparse: 100 MB long, nothing written
        f.truncate(100 << 20)
    line = _refused(capsys, str(p))
    assert "larger than the limit of 1,000 bytes" in line


def test_too_many_appended_results_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    p = tmp_path / "many.json"
    p.write_text("\n".join(json.dumps(REAL) for _ in range(stepfit.MAX_BENCHMARKS + 1)))
    line = _refused(capsys, str(p))
    assert f"more than the limit of {stepfit.MAX_BENCHMARKS} benchmark results" in line


def test_missing_files_and_directories_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert "No such file" in _refused(capsys, str(tmp_path / "nope.json"))
    assert "a directory" in _refused(capsys, str(tmp_path))


def test_a_request_longer_than_the_context_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    good = _write(tmp_path, "a.json", REAL)
    other = _write(tmp_path, "b.json", REAL | {"max_concurrency": 2})
    line = _refused(capsys, good, other, "--max-model-len", "512")
    assert "512" in line
