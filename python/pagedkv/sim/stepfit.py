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
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .backend import ManagerBackend
from .policy import Request, Scheduler, drive_timed
from .runner import SimConfig, build_config, make_manager, scheduler_config, step_time_model
from .steptime import MAX_COEFFICIENT_MS, Latencies, LinearModel, StepShape, StepTimeModel
from .workloads import Workload

__all__ = [
    "COEFFICIENTS",
    "DEFAULT_START",
    "MAX_FILE_BYTES",
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
#: The most requests one benchmark may replay, and the most tokens of one request
#: and of all of them.
MAX_BENCHMARK_REQUESTS = 100_000
MAX_REQUEST_TOKENS = 10_000_000
MAX_TOTAL_TOKENS = 200_000_000
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

#: Figures of a run, as ``benchmark_serving`` names them (duration in seconds,
#: throughput in tokens per second, the rest in milliseconds).
FIGURES = ("mean_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "duration", "output_throughput")


class BenchmarkFormatError(ValueError):
    """A benchmark file that cannot be read (the message says where and why)."""


# ------------------------------------------------------------------ reading


@dataclass(frozen=True)
class Benchmark:
    """One benchmark run: what was sent, how, and what was measured.

    ``request_rate``: requests per second, ``math.inf`` for all at once;
    ``measured``: the file's figures (:data:`FIGURES`, those it has)."""

    name: str
    input_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    max_concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    measured: dict[str, float] = field(default_factory=dict)
    #: per-request lengths (``--save-detailed``) rather than the means
    detailed: bool = False

    @property
    def num_requests(self) -> int:
        return len(self.input_lens)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def clock_free(self) -> bool:
        """Whether the schedule is the same whatever the clock: requests all sent
        at the start, or by closed-loop clients as others finish (at the end of
        a step), never at a time of their own."""
        return math.isinf(self.request_rate)

    def client(self) -> str:
        """How the requests were sent, in words."""
        parts = []
        if self.max_concurrency is not None:
            parts.append(f"{self.max_concurrency} concurrent")
        if math.isinf(self.request_rate):
            parts.append("all at once" if self.max_concurrency is None else "")
        else:
            parts.append(f"{self.request_rate:g} req/s")
        return ", ".join(p for p in parts if p)

    def fitted(self) -> list[str]:
        """The figures the fit uses: mean TTFT, mean TPOT (else mean ITL) when some
        request has two or more output tokens, and the duration."""
        out = []
        m = self.measured
        if m.get("mean_ttft_ms", 0.0) > 0:
            out.append("mean_ttft_ms")
        if max(self.output_lens, default=0) > 1:
            if m.get("mean_tpot_ms", 0.0) > 0:
                out.append("mean_tpot_ms")
            elif m.get("mean_itl_ms", 0.0) > 0:
                out.append("mean_itl_ms")
        out.append("duration")
        return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _count(doc: dict[str, Any], key: str, where: str, lo: int, hi: int) -> int:
    v = doc[key]
    if not _is_int(v) or not lo <= v <= hi:
        raise BenchmarkFormatError(
            f"{where}: {key} must be an integer from {lo} to {hi}, got {v!r}"
        )
    return int(v)


def _number(v: Any, what: str, where: str, *, positive: bool = False, hi: float = 1e12) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BenchmarkFormatError(f"{where}: {what} must be a number, got {v!r}")
    x = float(v)
    ok = math.isfinite(x) and (x > 0 if positive else x >= 0) and x <= hi
    if not ok:
        sign = "positive" if positive else ">= 0"
        raise BenchmarkFormatError(
            f"{where}: {what} must be a finite number {sign} and at most {hi:g}, got {v!r}"
        )
    return x


def _infinite(v: Any) -> bool:
    return v == "inf" or (isinstance(v, float) and v == math.inf)


def _lengths(doc: dict[str, Any], key: str, where: str, lo: int) -> list[int]:
    v = doc[key]
    if not isinstance(v, list) or not 0 < len(v) <= MAX_BENCHMARK_REQUESTS:
        raise BenchmarkFormatError(
            f"{where}: {key} must be a list of 1 to {MAX_BENCHMARK_REQUESTS:,} token counts"
        )
    for i, x in enumerate(v):
        if not _is_int(x) or not lo <= x <= MAX_REQUEST_TOKENS:
            raise BenchmarkFormatError(
                f"{where}: {key}[{i}] must be an integer from {lo} to {MAX_REQUEST_TOKENS}, "
                f"got {x!r}"
            )
    return v


REQUIRED = (
    "completed",
    "total_input_tokens",
    "total_output_tokens",
    "duration",
    "mean_ttft_ms",
    "request_rate",
)


def parse_benchmark(doc: Any, name: str) -> Benchmark:
    """A ``benchmark_serving`` result object (the parsed JSON) as a
    :class:`Benchmark`; raises :class:`BenchmarkFormatError` saying what is wrong."""
    if not isinstance(doc, dict):
        raise BenchmarkFormatError(
            f"{name}: a benchmark result is a JSON object, got {type(doc).__name__}"
        )
    missing = [k for k in REQUIRED if k not in doc]
    if missing:
        raise BenchmarkFormatError(
            f"{name}: not a benchmark_serving result (no {', '.join(missing)})"
        )
    if doc.get("ramp_up_strategy") is not None:
        raise BenchmarkFormatError(f"{name}: ramp-up request rates are not replayed")
    completed = _count(doc, "completed", name, 1, MAX_BENCHMARK_REQUESTS)
    total_in = _count(doc, "total_input_tokens", name, completed, MAX_TOTAL_TOKENS)
    total_out = _count(doc, "total_output_tokens", name, completed, MAX_TOTAL_TOKENS)
    # benchmark_serving writes an infinite rate as "inf", an infinite burstiness
    # as JSON's Infinity (Python's json reads both)
    rate_v = doc["request_rate"]
    if _infinite(rate_v):
        rate = math.inf
    else:
        rate = _number(rate_v, "request_rate", name, positive=True, hi=1e9)
    conc = doc.get("max_concurrency")
    if conc is not None:
        conc = _count(doc, "max_concurrency", name, 1, 10**6)
    burst_v = doc.get("burstiness", 1.0)
    burst = math.inf if _infinite(burst_v) else _number(burst_v, "burstiness", name, positive=True)
    measured = {
        "duration": _number(doc["duration"], "duration", name, positive=True, hi=1e9),
        "mean_ttft_ms": _number(doc["mean_ttft_ms"], "mean_ttft_ms", name, hi=1e9),
    }
    for key in ("mean_tpot_ms", "mean_itl_ms", "output_throughput"):
        if doc.get(key) is not None:
            measured[key] = _number(doc[key], key, name, hi=1e9)
    if "output_throughput" not in measured:
        measured["output_throughput"] = total_out / measured["duration"]
    has_in, has_out = "input_lens" in doc, "output_lens" in doc
    if has_in != has_out:
        raise BenchmarkFormatError(f"{name}: input_lens and output_lens go together")
    if has_in:
        ins = _lengths(doc, "input_lens", name, 0)
        outs = _lengths(doc, "output_lens", name, 0)
        if len(ins) != len(outs):
            raise BenchmarkFormatError(
                f"{name}: input_lens has {len(ins)} requests, output_lens {len(outs)}"
            )
        errors = doc.get("errors")
        if errors is not None and (not isinstance(errors, list) or len(errors) != len(ins)):
            raise BenchmarkFormatError(f"{name}: errors must be a list, one per request")
        # The successful requests (vLLM gives a failed one no output and an error).
        kept = [
            (i, o)
            for k, (i, o) in enumerate(zip(ins, outs, strict=True))
            if o >= 1 and (errors is None or not errors[k])
        ]
        if not kept:
            raise BenchmarkFormatError(f"{name}: no request in input_lens/output_lens succeeded")
        if any(i < 1 for i, _ in kept):
            raise BenchmarkFormatError(f"{name}: a successful request has an empty prompt")
        if sum(i + o for i, o in kept) > MAX_TOTAL_TOKENS:
            raise BenchmarkFormatError(f"{name}: more than {MAX_TOTAL_TOKENS:,} tokens")
        input_lens = tuple(i for i, _ in kept)
        output_lens = tuple(o for _, o in kept)
    else:
        input_lens = (max(1, round(total_in / completed)),) * completed
        output_lens = (max(1, round(total_out / completed)),) * completed
    return Benchmark(
        name=name,
        input_lens=input_lens,
        output_lens=output_lens,
        max_concurrency=conc,
        request_rate=rate,
        burstiness=burst,
        measured=measured,
        detailed=has_in,
    )


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


# ------------------------------------------------------------------ one run


def arrival_times(b: Benchmark, seed: int = 0) -> np.ndarray:
    """When each request is ready to be sent (seconds), as ``benchmark_serving``
    draws them: gamma intervals of shape ``burstiness`` and mean ``1 / rate``
    (exponential at 1, constant at ``inf``), summed and rescaled so the last is
    ``n / rate``; zeros for an infinite rate."""
    n = b.num_requests
    if math.isinf(b.request_rate):
        return np.zeros(n)
    if math.isinf(b.burstiness):
        gaps = np.full(n, 1.0 / b.request_rate)
    else:
        rng = np.random.default_rng(seed)
        theta = 1.0 / (b.request_rate * b.burstiness)
        gaps = rng.gamma(shape=b.burstiness, scale=theta, size=n)
    t = np.cumsum(gaps)
    if t[-1] > 0:
        t *= (n / b.request_rate) / t[-1]
    return t


def workload(b: Benchmark, seed: int = 0) -> Workload:
    """The benchmark's requests. Prompt caching is off in the replay, so every
    prompt is a view of one random token array (nothing is copied per request)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 120_000, size=max(b.input_lens), dtype=np.int64)
    times = arrival_times(b, seed)
    reqs = [
        Request(f"r{i}", tokens[:n], [1] * m, arrival_s=float(times[i]))
        for i, (n, m) in enumerate(zip(b.input_lens, b.output_lens, strict=True))
    ]
    return Workload(f"benchmark:{b.name}", reqs, {"benchmark": b.name})


class _Recorder(StepTimeModel):
    """A step-time model that records each step's features and duration."""

    name = "recorder"

    def __init__(self, model: StepTimeModel) -> None:
        self.model = model
        self.features: list[tuple[float, float, float, float]] = []
        self.seconds = array("d")

    def step_seconds(self, shape: StepShape) -> float:
        s = self.model.step_seconds(shape)
        prefill, decode = shape.prefill_tokens / 1000, float(len(shape.decode))
        self.features.append((1.0, prefill, decode, shape.context_tokens / 1000))
        self.seconds.append(max(s, 1e-9))  # as drive_timed bounds it
        return s

    def to_dict(self) -> dict[str, Any]:
        return self.model.to_dict()


class _Events(Latencies):
    """Latencies that also say in which step each arrival, first and last token
    happened."""

    def __init__(self, recorder: _Recorder, keep_tokens: bool) -> None:
        super().__init__()
        self.rec = recorder
        self.arrive_step: dict[str, int] = {}
        self.first_step: dict[str, int] = {}
        self.last_step: dict[str, int] = {}
        self.token_times: dict[str, array[float]] | None = {} if keep_tokens else None

    def arrive(self, rid: str, t: float, prompt_tokens: int) -> None:
        super().arrive(rid, t, prompt_tokens)
        self.arrive_step[rid] = len(self.rec.features)

    def token(self, rid: str, t: float) -> None:
        super().token(rid, t)
        k = len(self.rec.features) - 1
        self.first_step.setdefault(rid, k)
        self.last_step[rid] = k
        if self.token_times is not None:
            self.token_times.setdefault(rid, array("d")).append(t)


@dataclass
class Run:
    """One replay: its figures (:data:`FIGURES`), and the same figures as linear
    forms of the coefficients: ``forms[key] @ (1, a, b, c, d)`` is the figure
    (milliseconds; the duration too) for any coefficients, on this schedule."""

    figures: dict[str, float]
    forms: dict[str, np.ndarray]
    steps: int
    #: per request (in the workload's order): arrival, first token and finish
    #: times (seconds) and token times, with ``keep_tokens``
    arrival: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    finish: list[float] = field(default_factory=list)
    token_times: list[list[float]] | None = None


def _forms(reqs: Sequence[Request], rec: _Recorder, ev: _Events) -> dict[str, np.ndarray]:
    """The run's figures as linear forms ``(const, a, b, c, d)`` in ms."""
    steps = len(rec.features)
    feats = np.asarray(rec.features, dtype=np.float64).reshape(steps, 4)
    # The clock, replayed with drive_timed's arithmetic: a step starts at the end
    # of the previous one, or later at an arrival when the engine was idle.
    latest: dict[int, float] = {}
    for rid, k in ev.arrive_step.items():
        latest[k] = max(latest.get(k, -math.inf), ev.arrival[rid])
    clock = 0.0
    starts = np.empty(steps)
    jump = np.zeros(steps, dtype=bool)
    jump[0] = True
    start_const = np.zeros(steps)
    for k in range(steps):
        t = latest.get(k)
        if t is not None and t > clock:
            clock = t
            jump[k] = True
        starts[k] = clock
        start_const[k] = clock if jump[k] else 0.0
        clock += rec.seconds[k]
    # end_k = (const of its segment, sum of the features since the segment began)
    cum = np.cumsum(feats, axis=0)
    seg = np.cumsum(jump) - 1
    seg_first = np.flatnonzero(jump)
    base = np.zeros((len(seg_first), 4))
    base[1:] = cum[seg_first[1:] - 1]
    end_lin = cum - base[seg]
    end_const = start_const[seg_first][seg] * 1000
    end = np.column_stack([end_const, end_lin])  # (steps, 5) in ms

    def start_form(k: int) -> np.ndarray:
        if jump[k]:
            return np.array([starts[k] * 1000, 0.0, 0.0, 0.0, 0.0])
        return np.asarray(end[k - 1])

    arrivals = np.zeros((len(reqs), 5))
    first_idx = np.empty(len(reqs), dtype=np.int64)
    last_idx = np.empty(len(reqs), dtype=np.int64)
    outs = np.empty(len(reqs), dtype=np.float64)
    for j, r in enumerate(reqs):
        rid = r.request_id
        k = ev.arrive_step[rid]
        t = ev.arrival[rid]
        if t == starts[k]:
            arrivals[j] = start_form(k)
        else:
            # Sent while step k - 1 ran: it keeps its place in that step (the
            # share of the step still to run when it arrived), so that its wait
            # scales with the clock as the steps around it do.
            left = (starts[k] - t) / rec.seconds[k - 1]
            arrivals[j] = end[k - 1]
            arrivals[j, 1:] -= left * feats[k - 1]
        first_idx[j] = ev.first_step[rid]
        last_idx[j] = ev.last_step[rid]
        outs[j] = ev.num_output[rid]
    first = end[first_idx]
    last = end[last_idx]
    forms = {"mean_ttft_ms": (first - arrivals).mean(axis=0), "duration": end[-1].copy()}
    multi = outs > 1
    if multi.any():
        span = last[multi] - first[multi]
        forms["mean_tpot_ms"] = (span / (outs[multi] - 1)[:, None]).mean(axis=0)
        forms["mean_itl_ms"] = span.sum(axis=0) / (outs[multi] - 1).sum()
    else:
        forms["mean_tpot_ms"] = forms["mean_itl_ms"] = np.zeros(5)
    return forms


def simulate(
    b: Benchmark,
    cfg: SimConfig,
    model: StepTimeModel,
    *,
    seed: int = 0,
    keep_tokens: bool = False,
) -> Run:
    """Replays ``b`` on ``cfg``'s model, GPUs, KV cache and scheduler with the
    clock ``model``: the benchmark's figures as the simulator has them, and their
    linear forms on this schedule."""
    config = replace(cfg, max_concurrency=b.max_concurrency, enable_caching=False)
    wl = workload(b, seed)
    kv_config, max_model_len = build_config(config, wl)
    kv = make_manager(config, kv_config, max_model_len, background_hashing=False)
    sched = Scheduler(ManagerBackend(kv), scheduler_config(config, kv_config))
    rec = _Recorder(model)
    ev = _Events(rec, keep_tokens)
    reqs = wl.requests
    end = drive_timed(
        sched,
        reqs,
        rec,
        tick_s=config.tick_s,
        make_request=lambda i: reqs[i].fresh(),
        latencies=ev,
        max_concurrency=config.max_concurrency,
    )
    ids = [r.request_id for r in reqs]
    ttft = [ev.first_token[r] - ev.arrival[r] for r in ids]
    spans = [(ev.last_token[r] - ev.first_token[r], ev.num_output[r] - 1) for r in ids]
    multi = [(s, n) for s, n in spans if n > 0]
    out_tokens = sum(ev.num_output[r] for r in ids)
    figures = {
        "mean_ttft_ms": 1000 * sum(ttft) / len(ttft),
        "mean_tpot_ms": 1000 * sum(s / n for s, n in multi) / len(multi) if multi else 0.0,
        "mean_itl_ms": 1000 * sum(s for s, _ in multi) / sum(n for _, n in multi) if multi else 0.0,
        "duration": end,
        "output_throughput": out_tokens / end,
    }
    tokens = None
    if ev.token_times is not None:
        tokens = [ev.token_times[r].tolist() for r in ids]
    return Run(
        figures=figures,
        forms=_forms(reqs, rec, ev),
        steps=len(rec.features),
        arrival=[ev.arrival[r] for r in ids],
        first_token=[ev.first_token[r] for r in ids],
        finish=[ev.finish[r] for r in ids],
        token_times=tokens,
    )


def _unit(key: str) -> float:
    """Milliseconds per unit of a measured figure."""
    return 1000.0 if key == "duration" else 1.0


def result_json(b: Benchmark, run: Run, *, detailed: bool = False) -> dict[str, Any]:
    """``run`` as ``benchmark_serving --save-result`` writes a result (with
    ``detailed``: ``--save-detailed``'s per-request lists; needs a run made
    with ``keep_tokens``)."""
    ins, outs = list(b.input_lens), list(b.output_lens)
    dur = run.figures["duration"]
    ttfts = [f - a for f, a in zip(run.first_token, run.arrival, strict=True)]
    lat = [e - a for e, a in zip(run.finish, run.arrival, strict=True)]
    tpots = [
        (e - f) / (n - 1)
        for e, f, n in zip(run.finish, run.first_token, outs, strict=True)
        if n > 1
    ]
    doc: dict[str, Any] = {
        "date": "20260101-000000",
        "endpoint_type": "vllm",
        "backend": "vllm",
        "label": None,
        "model_id": "pagedkv-simulated",
        "tokenizer_id": "pagedkv-simulated",
        "num_prompts": len(ins),
        "request_rate": "inf" if math.isinf(b.request_rate) else b.request_rate,
        "burstiness": b.burstiness,
        "max_concurrency": b.max_concurrency,
        "duration": dur,
        "completed": len(ins),
        "failed": 0,
        "total_input_tokens": sum(ins),
        "total_output_tokens": sum(outs),
        "request_throughput": len(ins) / dur,
        "request_goodput": None,
        "output_throughput": sum(outs) / dur,
        "total_token_throughput": (sum(ins) + sum(outs)) / dur,
    }
    itls: list[list[float]] = []
    if run.token_times is not None:
        itls = [[b2 - a2 for a2, b2 in itertools.pairwise(t)] for t in run.token_times]
    flat = [x for g in itls for x in g]
    for name, values, mean in (
        ("ttft", ttfts, run.figures["mean_ttft_ms"] / 1000),
        ("tpot", tpots, run.figures["mean_tpot_ms"] / 1000),
        ("itl", flat, run.figures["mean_itl_ms"] / 1000),
        ("e2el", lat, float(np.mean(lat))),
    ):
        v = np.asarray(values or [0.0])
        doc[f"mean_{name}_ms"] = mean * 1000
        doc[f"median_{name}_ms"] = float(np.median(v)) * 1000
        doc[f"std_{name}_ms"] = float(np.std(v)) * 1000
        doc[f"p99_{name}_ms"] = float(np.percentile(v, 99)) * 1000
    if detailed:
        if run.token_times is None:
            raise ValueError("a detailed result needs a run made with keep_tokens")
        doc.update(
            input_lens=ins,
            output_lens=outs,
            ttfts=ttfts,
            itls=itls,
            start_times=list(run.arrival),
            generated_texts=[""] * len(ins),
            errors=[""] * len(ins),
        )
    return doc


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
