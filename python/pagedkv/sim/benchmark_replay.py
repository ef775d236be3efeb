"""Replays a benchmark on the simulator and records its schedule as linear forms of the clock.

:func:`simulate` replays a :class:`~pagedkv.sim.benchmark.Benchmark` on the
simulator's scheduler and KV-cache manager (the serving process of
:mod:`pagedkv.sim.serving`) with a given clock, and records every step's
features ``(1, prefill tokens / 1000, decode sequences, context tokens / 1000)``
and when each request arrived, got its first token and its last: the figures of
the run (:class:`Run`) and the same figures as linear forms of the coefficients
of ``--step-time`` on this schedule. :func:`result_json` writes a run as
``benchmark_serving`` writes a result.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .benchmark import Benchmark
from .config import SimConfig
from .deployment import build_config
from .policy import Request
from .serving import ServingProcess
from .steptime import Latencies, StepShape, StepTimeModel
from .workloads import Workload

__all__ = ["Run", "arrival_times", "result_json", "simulate", "workload"]


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
    process = ServingProcess.start(config, kv_config, max_model_len, background_hashing=False)
    rec = _Recorder(model)
    ev = _Events(rec, keep_tokens)
    reqs = wl.requests
    end = process.drive(reqs, rec, latencies=ev)
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
