"""Public serving traces for ``pagedkv simulate --trace`` and ``pagedkv trace-stats``.

Formats (detected from the content, or named with ``--trace-format``; gzip
accepted for all):

``pagedkv``
    pagedkv's own JSONL (:mod:`pagedkv.sim.tracefile`).
``mooncake``
    Mooncake's FAST'25 traces (kvcache-ai/Mooncake, ``FAST25-release/traces``):
    one JSON object per line, ``timestamp`` (ms), ``input_length``,
    ``output_length``, ``hash_ids`` (one per 512-token block of the input, the
    last block possibly partial; equal ids are equal token blocks). Each id
    stands for 512 token ids drawn from a generator seeded with the id, so
    requests sharing ids share those prompt blocks exactly.
``burstgpt``
    BurstGPT's CSV (HPMLL/BurstGPT): ``Timestamp`` (s), ``Model``, ``Request
    tokens``, ``Response tokens``, ...: lengths and arrivals only, so prompts are
    random and share nothing.
``azure``
    Azure's LLM-inference CSV (Azure/AzurePublicDataset, ``AzureLLMInferenceTrace``):
    ``TIMESTAMP`` (a date and time), ``ContextTokens``, ``GeneratedTokens``:
    lengths and arrivals only.

The limits of :mod:`pagedkv.sim.tracefile` apply to every format.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .policy import Request
from .tracefile import (
    MAX_STEPS,
    MAX_TOTAL_TOKENS,
    TraceFormatError,
    bounded_lines,
    count,
    read_trace,
    seconds_to_steps,
)
from .workloads import Workload

__all__ = [
    "FORMATS",
    "MOONCAKE_BLOCK",
    "detect_format",
    "load_trace",
    "prefix_hit_ceiling",
    "scale_arrivals",
    "trace_stats",
]

FORMATS = ("pagedkv", "mooncake", "burstgpt", "azure")
#: Tokens per Mooncake hash id.
MOONCAKE_BLOCK = 512
VOCAB = 32000


def detect_format(path: str | Path) -> str:
    """The format of a trace file, from its first non-blank line (pagedkv's own
    JSONL unless it is recognisably another)."""
    for _, line in bounded_lines(path):
        if line.startswith("#"):
            continue
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                return "pagedkv"  # its reader names what is wrong
            if isinstance(rec, dict) and "hash_ids" in rec and "input_length" in rec:
                return "mooncake"
            return "pagedkv"
        header = [c.strip() for c in line.split(",")]
        if "Request tokens" in header and "Response tokens" in header:
            return "burstgpt"
        if "ContextTokens" in header and "GeneratedTokens" in header:
            return "azure"
        break
    # Anything else is read as pagedkv's own format, whose reader says what is wrong.
    return "pagedkv"


def _count(v: Any, what: str, where: str, minimum: int = 0) -> int:
    """:func:`~pagedkv.sim.tracefile.count`, also of a CSV field's digits."""
    if isinstance(v, str) and v.strip().isdigit():
        v = int(v.strip())
    try:
        return count(v, what, minimum)
    except ValueError as e:
        raise TraceFormatError(f"{where}: {e}") from None


def _step(seconds: float, step_ms: float, where: str) -> int:
    try:
        return seconds_to_steps(seconds, "arrival", step_ms)
    except ValueError:
        raise TraceFormatError(
            f"{where}: arrival {seconds} s is outside 0..{MAX_STEPS} steps"
        ) from None


class _Budget:
    """Counts tokens against ``MAX_TOTAL_TOKENS``."""

    def __init__(self, path: str | Path) -> None:
        self.path, self.total = path, 0

    def add(self, n: int, lineno: int) -> None:
        self.total += n
        if self.total > MAX_TOTAL_TOKENS:
            raise TraceFormatError(
                f"{self.path}:{lineno}: the trace's tokens are past the limit of {MAX_TOTAL_TOKENS}"
            )


def _mooncake_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    for lineno, line in bounded_lines(path):
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(line)
        except RecursionError:
            raise TraceFormatError(f"{where}: JSON nested too deeply") from None
        except ValueError as e:
            raise TraceFormatError(f"{where}: {e}") from None
        if not isinstance(rec, dict):
            raise TraceFormatError(f"{where}: each line must be a JSON object")
        for key in ("timestamp", "input_length", "output_length", "hash_ids"):
            if key not in rec:
                raise TraceFormatError(f"{where}: missing field '{key}'")
        ids = rec["hash_ids"]
        if not isinstance(ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 2**63 for h in ids
        ):
            raise TraceFormatError(f"{where}: hash_ids must be a list of non-negative ints")
        n = _count(rec["input_length"], "input_length", where, 1)
        if not (len(ids) - 1) * MOONCAKE_BLOCK < n <= len(ids) * MOONCAKE_BLOCK:
            raise TraceFormatError(
                f"{where}: {len(ids)} hash ids of {MOONCAKE_BLOCK} tokens do not make "
                f"input_length {n}"
            )
        yield lineno, rec


def _read_mooncake(path: str | Path, step_ms: float, seed: int) -> Workload:
    blocks: dict[int, np.ndarray] = {}
    budget = _Budget(path)
    reqs: list[Request] = []
    for lineno, rec in _mooncake_records(path):
        where = f"{path}:{lineno}"
        n = rec["input_length"]
        out_len = max(1, _count(rec["output_length"], "output_length", where))
        budget.add(n + out_len, lineno)
        parts = []
        for h in rec["hash_ids"]:
            block = blocks.get(h)
            if block is None:
                rng = np.random.Generator(np.random.PCG64([seed, h]))
                block = blocks[h] = rng.integers(0, VOCAB, MOONCAKE_BLOCK)
            parts.append(block)
        prompt = np.concatenate(parts)[:n]
        ts = rec["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, int | float):
            raise TraceFormatError(f"{where}: timestamp must be a number of milliseconds")
        out_rng = np.random.Generator(np.random.PCG64([seed, 1 << 62, lineno]))
        reqs.append(
            Request(
                request_id=f"r{len(reqs)}",
                prompt=prompt,
                output=out_rng.integers(0, VOCAB, out_len).tolist(),
                arrival_step=_step(float(ts) / 1000.0, step_ms, where),
                arrival_s=float(ts) / 1000.0,
            )
        )
    return _workload(path, reqs, "mooncake", step_ms)


def _csv_rows(path: str | Path) -> Iterator[tuple[int, dict[str, str]]]:
    text = (line for _, line in bounded_lines(path))
    rows = csv.DictReader(text)
    row = 1
    while True:
        row += 1
        try:
            fields = next(rows)
        except StopIteration:
            return
        except csv.Error as e:  # an oversized field, a NUL byte, a broken quote
            raise TraceFormatError(f"{path}:{row}: {e}") from None
        yield row, fields


def _azure_seconds(stamp: str, where: str) -> float:
    s = stamp.strip()
    try:
        # Fractions past microseconds (Azure writes 7 digits) are dropped.
        head, dot, frac = s.partition(".")
        t = dt.datetime.fromisoformat(head if not dot else f"{head}.{frac[:6]}")
    except ValueError:
        raise TraceFormatError(f"{where}: TIMESTAMP {stamp!r} is not a date and time") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return t.timestamp()


def _read_lengths(path: str | Path, fmt: str, step_ms: float, seed: int) -> Workload:
    cols = {
        "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
        "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    }[fmt]
    budget = _Budget(path)
    reqs: list[Request] = []
    first: float | None = None
    for lineno, row in _csv_rows(path):
        where = f"{path}:{lineno}"
        missing = [c for c in cols if row.get(c) is None]
        if missing:
            raise TraceFormatError(f"{where}: missing column(s) {', '.join(missing)}")
        if fmt == "azure":
            secs = _azure_seconds(row[cols[0]], where)
        else:
            try:
                secs = float(row[cols[0]])
            except ValueError:
                raise TraceFormatError(f"{where}: Timestamp must be a number of seconds") from None
        first = secs if first is None else first
        n = _count(row[cols[1]], cols[1], where, 1)
        out_len = max(1, _count(row[cols[2]], cols[2], where))
        budget.add(n + out_len, lineno)
        rng = np.random.Generator(np.random.PCG64([seed, lineno]))
        reqs.append(
            Request(
                request_id=f"r{len(reqs)}",
                prompt=rng.integers(0, VOCAB, n),
                output=rng.integers(0, VOCAB, out_len).tolist(),
                arrival_step=_step(secs - first, step_ms, where),
                arrival_s=secs - first,
            )
        )
    return _workload(path, reqs, fmt, step_ms)


def _workload(path: str | Path, reqs: list[Request], fmt: str, step_ms: float) -> Workload:
    if not reqs:
        raise TraceFormatError(f"{path}: no request")
    # Arrival order (the simulator admits by arrival time).
    reqs.sort(key=lambda r: (r.arrival_s or 0.0, r.arrival_step))
    return Workload(Path(path).name, reqs, {"trace": str(path), "format": fmt, "step_ms": step_ms})


def load_trace(
    path: str | Path, fmt: str | None = None, *, step_ms: float = 50.0, seed: int = 0
) -> Workload:
    """Reads a trace file of any format (detected when ``fmt`` is None)."""
    if step_ms <= 0:
        raise ValueError("step_ms must be positive")
    fmt = fmt or detect_format(path)
    if fmt == "pagedkv":
        return read_trace(path, step_ms=step_ms)
    if fmt == "mooncake":
        return _read_mooncake(path, step_ms, seed)
    if fmt in ("burstgpt", "azure"):
        return _read_lengths(path, fmt, step_ms, seed)
    raise ValueError(f"unknown trace format {fmt!r} (one of {', '.join(FORMATS)})")


def scale_arrivals(workload: Workload, time_scale: float) -> Workload:
    """The workload with its arrivals ``time_scale`` times faster (> 1: more
    load), pauses between session turns too."""
    if not math.isfinite(time_scale) or time_scale <= 0:
        raise ValueError(f"time_scale must be a positive number, got {time_scale}")
    if time_scale == 1.0:
        return workload
    for r in workload.requests:
        r.arrival_step = math.floor(r.arrival_step / time_scale)
        r.pause = math.floor(r.pause / time_scale)
        if r.arrival_s is not None:
            r.arrival_s /= time_scale
        if r.pause_s is not None:
            r.pause_s /= time_scale
    workload.params["time_scale"] = time_scale
    return workload


def _percentiles(values: list[int]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {
        "mean": round(float(a.mean()), 1),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


def _prefix_hits(w: Workload, block_size: int) -> tuple[int, int]:
    """(tokens of each prompt's longest prefix of whole blocks that an earlier
    request computed, prompt tokens), over the workload in order."""
    seen: set[Any] = set()
    hit = total = 0
    for r in w.requests:
        prompt = np.asarray(r.prompt, dtype=np.int64)
        # What the request leaves cached: its prompt and every output token but
        # the last (never computed), in whole blocks.
        seq = np.concatenate([prompt, np.asarray(r.output[:-1], dtype=np.int64)])
        k = 0
        chain = 0
        matching = True
        for i in range(len(seq) // block_size):
            chain = hash((chain, seq[i * block_size : (i + 1) * block_size].tobytes()))
            if matching and (i + 1) * block_size <= len(prompt) and chain in seen:
                k += 1
            else:
                matching = False
            seen.add(chain)
        hit += k * block_size
        total += len(prompt)
    return hit, total


def prefix_hit_ceiling(w: Workload, block_size: int = 16) -> float:
    """The theoretical maximum prefix-hit rate of the workload with an unlimited
    cache: each prompt's longest prefix of whole ``block_size``-token blocks that
    an earlier request computed (its prompt, or its answer: a later turn of a
    conversation resends it), over all prompt tokens."""
    hit, total = _prefix_hits(w, block_size)
    return hit / total if total else 0.0


def trace_stats(
    path: str | Path, fmt: str | None = None, *, block_size: int = 16, step_ms: float = 50.0
) -> dict[str, Any]:
    """What a trace holds before any simulation: requests, duration and rate,
    length percentiles, and the theoretical maximum prefix-hit rate with an
    unlimited cache (each request's longest prefix already seen in earlier
    requests, in tokens: whole Mooncake blocks, or ``block_size``-token blocks
    of the prompts for the other formats, capped at the prompt)."""
    fmt = fmt or detect_format(path)
    seen: set[Any] = set()
    hit = total = 0
    inputs: list[int] = []
    outputs: list[int] = []
    if fmt == "mooncake":
        stamps: list[float] = []
        for _, rec in _mooncake_records(path):
            n = rec["input_length"]
            k = 0
            chain = 0
            for h in rec["hash_ids"]:
                chain = hash((chain, h))
                if chain not in seen:
                    break
                k += 1
            chain = 0
            for h in rec["hash_ids"]:
                chain = hash((chain, h))
                seen.add(chain)
            hit += min(k * MOONCAKE_BLOCK, n)
            total += n
            inputs.append(n)
            outputs.append(int(rec["output_length"]))
            stamps.append(float(rec["timestamp"]) / 1000.0)
        duration = max(stamps) - min(stamps)
    else:
        w = load_trace(path, fmt, step_ms=step_ms)
        hit, total = _prefix_hits(w, block_size)
        for r in w.requests:
            inputs.append(len(r.prompt))
            outputs.append(len(r.output))
        steps = [r.arrival_step for r in w.requests]
        duration = (max(steps) - min(steps)) * step_ms / 1000.0
    n = len(inputs)
    return {
        "trace": str(path),
        "format": fmt,
        "requests": n,
        "duration_s": round(duration, 3),
        "requests_per_s": round(n / duration, 3) if duration > 0 else None,
        "input_tokens": _percentiles(inputs),
        "output_tokens": _percentiles(outputs),
        "total_input_tokens": total,
        "max_prefix_hit_rate": round(hit / total, 4) if total else 0.0,
    }
