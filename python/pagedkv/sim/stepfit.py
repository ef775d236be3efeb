"""Fits the linear step-time model (``--step-time A,B,C,D``) to a user's own
benchmark results: the JSON files vLLM's ``benchmark_serving.py`` / ``vllm bench
serve --save-result`` writes.

Each file is one experiment (:class:`Benchmark`): its requests (the per-request
``input_lens`` / ``output_lens`` of a ``--save-detailed`` file, else
``completed`` requests of the mean lengths; random prompts that share nothing)
and its client (``max_concurrency`` closed-loop clients, and/or ``request_rate``
arrivals drawn as the benchmark draws them: gamma intervals of shape
``burstiness``, Poisson at 1, rescaled so the last request is sent at
``completed / request_rate``; all at once for ``inf``). :func:`simulate` replays
one on the simulator's scheduler and KV-cache manager and records its schedule:
every step's features ``(1, prefill tokens / 1000, decode sequences, context
tokens / 1000)``, when each request arrived, got its first token and its last.

With the schedule fixed, every figure is linear in the coefficients: a step
lasts the dot product of its features with ``(A, B, C, D)``; a step starts where
the previous one ended, or at a request's arrival when the engine sat idle; a
request sent while a step ran keeps its place in that step; TTFT is the steps
between a request's arrival and its first token; TPOT and ITL the steps between
its first and last; the duration the steps up to the last finish. :func:`fit`
solves the non-negative least squares of the relative errors of mean TTFT, mean
TPOT (else ITL) and duration of every file, re-simulates with the new
coefficients (the schedule moves with the clock) and repeats until the
coefficients settle. ``docs/simulate.md`` ("Fitting --step-time") explains the
method and its limits.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .benchmark import (
    FIGURES,
    MAX_BENCHMARK_REQUESTS,
    MAX_REQUEST_TOKENS,
    MAX_TOTAL_TOKENS,
    Benchmark,
    BenchmarkFormatError,
    parse_benchmark,
)
from .benchmark_replay import Run, _unit, arrival_times, result_json, simulate, workload
from .config import SimConfig
from .perf import step_time_model
from .steptime import MAX_COEFFICIENT_MS, LinearModel, StepTimeModel

__all__ = [
    "COEFFICIENTS",
    "DEFAULT_START",
    "FIGURES",
    "MAX_BENCHMARK_REQUESTS",
    "MAX_FILE_BYTES",
    "MAX_REQUEST_TOKENS",
    "MAX_TOTAL_TOKENS",
    "Benchmark",
    "BenchmarkFormatError",
    "Fit",
    "Run",
    "arrival_times",
    "fit",
    "load_all",
    "load_benchmarks",
    "nnls",
    "parse_benchmark",
    "result_json",
    "simulate",
    "workload",
]

#: The most bytes read from one benchmark file.
MAX_FILE_BYTES = 64 << 20
#: The most benchmarks one fit replays (files, and results appended in them).
MAX_BENCHMARKS = 256
#: The most re-simulations of the fit, and when the coefficients have settled.
MAX_ROUNDS = 8
SETTLED = 0.005
#: A fitted figure further off than this after the fit gets a warning.
POOR_FIT = 0.10
#: The coefficients' names, in ``--step-time`` order.
COEFFICIENTS = ("a", "b", "c", "d")
#: The first round's clock when the model has no roofline (no compute figures).
DEFAULT_START = LinearModel(5.0, 20.0, 0.1, 0.01)


# ------------------------------------------------------------------ reading


def load_benchmarks(path: str | os.PathLike[str]) -> list[Benchmark]:
    """The benchmarks of one result file: one JSON object, or several one after
    the other (``--append-result``). At most :data:`MAX_FILE_BYTES` are read."""
    name = str(path)
    with open(path, "rb") as f:
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise BenchmarkFormatError(f"{name}: larger than the limit of {MAX_FILE_BYTES:,} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BenchmarkFormatError(f"{name}: not UTF-8 text") from None
    dec = json.JSONDecoder()
    docs: list[Any] = []
    pos = 0
    try:
        while True:
            while pos < len(text) and text[pos] in " \t\r\n":
                pos += 1
            if pos == len(text):
                break
            doc, pos = dec.raw_decode(text, pos)
            docs.append(doc)
    except json.JSONDecodeError as e:
        raise BenchmarkFormatError(f"{name}: not JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise BenchmarkFormatError(f"{name}: not JSON (nested too deeply)") from None
    if not docs:
        raise BenchmarkFormatError(f"{name}: empty")
    if len(docs) == 1:
        return [parse_benchmark(docs[0], name)]
    return [parse_benchmark(d, f"{name}#{i + 1}") for i, d in enumerate(docs)]


# ------------------------------------------------------------------ the fit


def nnls(m: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``argmin ||m x - y||`` over ``x >= 0`` (at most a handful of columns):
    the least squares of every subset of columns, the best whose solution is
    non-negative (the optimum is the least squares on its own support). Zeros when
    no subset gives a positive solution."""
    cols = m.shape[1]
    best, best_x = math.inf, np.zeros(cols)
    for r in range(1, cols + 1):
        for subset in itertools.combinations(range(cols), r):
            idx = list(subset)
            sol, *_ = np.linalg.lstsq(m[:, idx], y, rcond=None)
            if (sol < 0).any():
                continue
            x = np.zeros(cols)
            x[idx] = sol
            res = float(np.sum((m @ x - y) ** 2))
            if res < best:
                best, best_x = res, x
    return best_x


@dataclass
class Fit:
    """The fitted coefficients, and each benchmark simulated with them."""

    model: LinearModel
    #: ``--step-time``'s text (what ``model`` holds: four significant digits)
    step_time: str
    rounds: int
    settled: bool
    runs: list[Run]
    warnings: list[str]


def _system(benchmarks: Sequence[Benchmark], runs: Sequence[Run]) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``form / measured`` (a, b, c, d) and right-hand sides
    ``1 - const / measured``: relative errors."""
    rows, rhs = [], []
    for b, run in zip(benchmarks, runs, strict=True):
        for key in b.fitted():
            measured = b.measured[key] * _unit(key)
            form = run.forms[key]
            rows.append(form[1:] / measured)
            rhs.append(1.0 - form[0] / measured)
    return np.asarray(rows).reshape(len(rows), 4), np.asarray(rhs)


def _undetermined(m: np.ndarray) -> list[str] | None:
    """None when the system determines all four coefficients, else the names of
    those that trade off against each other."""
    norms = np.linalg.norm(m, axis=0)
    zero = [COEFFICIENTS[i].upper() for i in range(4) if norms[i] == 0]
    if zero:
        return zero
    _, s, vt = np.linalg.svd(m / norms, full_matrices=False)
    if len(s) == 4 and s[-1] > 1e-6 * s[0]:
        return None
    null = vt[-1]
    return [COEFFICIENTS[i].upper() for i in range(4) if abs(null[i]) > 0.1]


def _rounded(x: np.ndarray) -> LinearModel:
    vals = [float(f"{max(v, 0.0):.4g}") for v in x]
    if max(vals) > MAX_COEFFICIENT_MS:
        raise ValueError(
            f"the fit needs a coefficient of {max(vals):g} ms, beyond {MAX_COEFFICIENT_MS:g}: "
            "do the benchmark figures belong to this model and GPU?"
        )
    if not any(vals):
        raise ValueError("no non-negative step-time coefficients fit these benchmarks")
    return LinearModel(*vals)


def _text(model: LinearModel) -> str:
    return ",".join(f"{getattr(model, k):.4g}" for k in COEFFICIENTS)


def _squared_error(
    benchmarks: Sequence[Benchmark], runs: Sequence[Run], model: LinearModel
) -> float:
    """The sum of the fitted figures' squared relative errors with ``model``'s
    clock: a clock-free run's figures through its forms, another's as it ran
    (with ``model``)."""
    theta = np.array([1.0, model.a, model.b, model.c, model.d])
    total = 0.0
    for b, run in zip(benchmarks, runs, strict=True):
        for key in b.fitted():
            if b.clock_free:
                got = float(run.forms[key] @ theta) / _unit(key)
            else:
                got = run.figures[key]
            total += (got / b.measured[key] - 1.0) ** 2
    return total


def figure_count(benchmarks: Sequence[Benchmark]) -> int:
    return sum(len(b.fitted()) for b in benchmarks)


def concurrency_warning(benchmarks: Sequence[Benchmark], cfg: SimConfig) -> str | None:
    """A warning when every benchmark ran at one concurrency (closed-loop
    clients, or all at once): decode steps then all batch about as many
    sequences, and the per-step and per-sequence coefficients trade off."""
    levels = set()
    for b in benchmarks:
        if not math.isinf(b.request_rate) and b.max_concurrency is None:
            return None  # open-loop arrivals: the batch size varies
        n = b.max_concurrency or b.num_requests
        levels.add(min(n, b.num_requests, cfg.max_num_seqs))
    if len(levels) != 1:
        return None
    (n,) = levels
    return (
        f"every benchmark ran {n} request(s) at a time: decode steps all batch about {n} "
        "sequences, so the per-step (A) and per-sequence (C) coefficients can trade off "
        "(and the context one, D, unless lengths differ); add a benchmark at another "
        "--max-concurrency"
    )


def fit(
    benchmarks: Sequence[Benchmark],
    cfg: SimConfig,
    *,
    start: StepTimeModel | None = None,
    seed: int = 0,
    max_rounds: int = MAX_ROUNDS,
) -> Fit:
    """Fits ``--step-time`` to ``benchmarks`` replayed on ``cfg`` (see the module
    docstring). ``start``: the first round's clock (default: the roofline of
    ``cfg``'s model and GPU, else :data:`DEFAULT_START`). Raises ValueError when the
    benchmarks hold fewer independent figures than the four coefficients."""
    n = figure_count(benchmarks)
    if n < 4:
        raise ValueError(
            f"the benchmarks give {n} figure(s) to fit and the model has 4 coefficients: "
            "give more benchmark files (other concurrencies or lengths)"
        )
    warnings = []
    note = concurrency_warning(benchmarks, cfg)
    if note:
        warnings.append(note)
    if start is None:
        try:
            start = step_time_model(replace(cfg, step_time=None))
        except ValueError:
            start = DEFAULT_START
    model: StepTimeModel = start
    runs: list[Run] = []
    #: (squared relative error of the fitted figures, coefficients) of each clock
    tried: list[tuple[float, LinearModel]] = []
    settled = False
    rounds = 0
    while rounds < max_rounds and not settled:
        rounds += 1
        # A clock-free schedule is the same in every round: its forms give the
        # figures of any coefficients, and it is replayed once.
        runs = [
            simulate(b, cfg, model, seed=seed) if rounds == 1 or not b.clock_free else runs[i]
            for i, b in enumerate(benchmarks)
        ]
        if isinstance(model, LinearModel):
            tried.append((_squared_error(benchmarks, runs, model), model))
        m, y = _system(benchmarks, runs)
        missing = _undetermined(m)
        if missing is not None:
            raise ValueError(
                f"the benchmarks do not determine the coefficients {', '.join(missing)} "
                f"({len(y)} figures, but these trade off against each other): add "
                "benchmarks at other concurrencies or lengths"
            )
        new = _rounded(nnls(m, y))
        settled = isinstance(model, LinearModel) and _close(model, new, m)
        model = new
    if not settled:
        warnings.append(
            f"the coefficients still moved after {rounds} rounds (the schedule changes with "
            "the clock): the round whose replay fits best is reported"
        )
    assert isinstance(model, LinearModel)
    fresh = [simulate(b, cfg, model, seed=seed) for b in benchmarks]
    tried.append((_squared_error(benchmarks, fresh, model), model))
    _, best = min(tried, key=lambda t: t[0])
    if best != model:
        fresh = [simulate(b, cfg, best, seed=seed) for b in benchmarks]
    worst = max(
        (abs(run.figures[k] / b.measured[k] - 1.0), b.name, k)
        for b, run in zip(benchmarks, fresh, strict=True)
        for k in b.fitted()
    )
    if worst[0] > POOR_FIT:
        warnings.append(
            f"the fit leaves {worst[2]} of {worst[1]} {100 * worst[0]:.0f} % off: the "
            "simulated deployment may not be the benchmarked one (check --model, --gpu, "
            "--tp, --max-num-seqs, --max-num-batched-tokens and the KV-cache memory)"
        )
    return Fit(
        model=best,
        step_time=_text(best),
        rounds=rounds,
        settled=settled,
        runs=fresh,
        warnings=warnings,
    )


def _close(old: LinearModel, new: LinearModel, m: np.ndarray) -> bool:
    """Every coefficient moved by less than :data:`SETTLED` of its value, or by
    an amount that moves no fitted figure by that much."""
    for i, k in enumerate(COEFFICIENTS):
        a, b = getattr(old, k), getattr(new, k)
        if abs(b - a) <= SETTLED * max(a, b):
            continue
        if float(np.max(np.abs(m[:, i]) * abs(b - a))) <= SETTLED:
            continue
        return False
    return True


def load_all(paths: Sequence[str | os.PathLike[str]]) -> list[Benchmark]:
    """Every benchmark of every file, in order."""
    out: list[Benchmark] = []
    for p in paths:
        if Path(p).is_dir():
            raise BenchmarkFormatError(f"{p}: a directory, not a benchmark result file")
        out.extend(load_benchmarks(p))
        if len(out) > MAX_BENCHMARKS:
            raise BenchmarkFormatError(
                f"{p}: more than the limit of {MAX_BENCHMARKS} benchmark results in all"
            )
    return out
