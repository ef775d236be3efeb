"""Reads one vLLM ``benchmark_serving`` result: what was sent, how, and what was measured.

:func:`parse_benchmark` checks a result object (the JSON ``benchmark_serving.py``
/ ``vllm bench serve --save-result`` writes) field by field and gives a
:class:`Benchmark`: its requests' lengths, its client (``max_concurrency``
closed-loop clients and/or a ``request_rate`` with its ``burstiness``) and its
measured figures. The step-time fit (:mod:`pagedkv.sim.stepfit`) reads files of
them and replays each (:mod:`pagedkv.sim.benchmark_replay`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FIGURES",
    "MAX_BENCHMARK_REQUESTS",
    "MAX_REQUEST_TOKENS",
    "MAX_TOTAL_TOKENS",
    "Benchmark",
    "BenchmarkFormatError",
    "parse_benchmark",
]

#: The most requests one benchmark may replay, and the most tokens of one request
#: and of all of them.
MAX_BENCHMARK_REQUESTS = 100_000
MAX_REQUEST_TOKENS = 10_000_000
MAX_TOTAL_TOKENS = 200_000_000

#: Figures of a run, as ``benchmark_serving`` names them (duration in seconds,
#: throughput in tokens per second, the rest in milliseconds).
FIGURES = ("mean_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "duration", "output_throughput")


class BenchmarkFormatError(ValueError):
    """A benchmark file that cannot be read (the message says where and why)."""


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
