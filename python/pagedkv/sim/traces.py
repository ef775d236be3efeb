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
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .capacity import BlockRequest, lru_hit_curve
from .policy import Request
from .tracefile import (
    MAX_REQUEST_TOKENS,
    MAX_REQUESTS,
    MAX_STEPS,
    MAX_TOTAL_TOKENS,
    TraceFormatError,
    bounded_lines,
    count,
    loads,
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


def _csv_header(line: str) -> list[str]:
    """A CSV header line's column names, unquoted and stripped."""
    try:
        row = next(csv.reader([line]), [])
    except csv.Error:
        return []
    return [c.strip() for c in row]


def detect_format(path: str | Path) -> str:
    """The format of a trace file, from its first non-blank line (pagedkv's own
    JSONL unless it is recognisably another)."""
    for _, line in bounded_lines(path):
        if line.startswith("#"):
            continue
        if line.startswith("{"):
            try:
                rec = loads(line)
            except ValueError:
                return "pagedkv"  # its reader names what is wrong
            if isinstance(rec, dict) and "hash_ids" in rec and "input_length" in rec:
                return "mooncake"
            return "pagedkv"
        header = _csv_header(line)
        if "Request tokens" in header and "Response tokens" in header:
            return "burstgpt"
        if "ContextTokens" in header and "GeneratedTokens" in header:
            return "azure"
        break
    # Anything else is read as pagedkv's own format, whose reader says what is wrong.
    return "pagedkv"


def _count(v: Any, what: str, where: str, minimum: int = 0, *, text: bool = False) -> int:
    """:func:`~pagedkv.sim.tracefile.count`; ``text``: a CSV field's digits."""
    if text and isinstance(v, str) and v.strip().isascii() and v.strip().isdigit():
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
    """Counts requests and tokens against ``MAX_REQUESTS``, ``MAX_REQUEST_TOKENS``
    (one request's prompt and output together) and ``MAX_TOTAL_TOKENS``."""

    def __init__(self, path: str | Path) -> None:
        self.path, self.total, self.requests = path, 0, 0

    def add(self, prompt: int, output: int, lineno: int) -> None:
        where = f"{self.path}:{lineno}"
        self.requests += 1
        if self.requests > MAX_REQUESTS:
            raise TraceFormatError(f"{where}: more requests than the limit of {MAX_REQUESTS:,}")
        if prompt + output > MAX_REQUEST_TOKENS:
            raise TraceFormatError(
                f"{where}: a request of {prompt} prompt and {output} output tokens is past "
                f"the limit of {MAX_REQUEST_TOKENS} tokens"
            )
        self.total += prompt + output
        if self.total > MAX_TOTAL_TOKENS:
            raise TraceFormatError(
                f"{where}: the trace's tokens are past the limit of {MAX_TOTAL_TOKENS}"
            )


class _Record:
    """One request of a lengths-and-arrivals trace, validated: arrival in seconds
    (as the file gives it), prompt and output lengths (an output of 0 is 1), and
    Mooncake's block hash ids."""

    __slots__ = ("arrival_s", "hash_ids", "input_length", "lineno", "output_length")

    def __init__(
        self, lineno: int, arrival_s: float, n: int, out: int, hash_ids: list[int]
    ) -> None:
        self.lineno, self.arrival_s = lineno, arrival_s
        self.input_length, self.output_length, self.hash_ids = n, out, hash_ids


def _finite_seconds(v: float, what: str, where: str) -> float:
    if not math.isfinite(v) or abs(v) > _MAX_SECONDS:
        raise TraceFormatError(
            f"{where}: {what} {v!r} s is outside -{_MAX_SECONDS:g}..{_MAX_SECONDS:g} s"
        )
    return v


#: Largest absolute time read from a trace (seconds; ~31,700 years).
_MAX_SECONDS = 1e12


def _mooncake_records(path: str | Path) -> Iterator[_Record]:
    """The one reader of Mooncake traces (``simulate`` and ``trace-stats``)."""
    budget = _Budget(path)
    for lineno, line in bounded_lines(path):
        where = f"{path}:{lineno}"
        try:
            rec = loads(line)
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
        out = max(1, _count(rec["output_length"], "output_length", where))
        ts = rec["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, int | float):
            raise TraceFormatError(
                f"{where}: timestamp must be a number of milliseconds, got {ts!r}"
            )
        secs = _finite_seconds(float(ts) / 1000.0, "timestamp", where)
        if secs < 0:
            raise TraceFormatError(f"{where}: timestamp {ts!r} is negative")
        budget.add(n, out, lineno)
        yield _Record(lineno, secs, n, out, ids)


def _read_mooncake(path: str | Path, step_ms: float, seed: int) -> Workload:
    blocks: dict[int, np.ndarray] = {}
    reqs: list[Request] = []
    for rec in _mooncake_records(path):
        where = f"{path}:{rec.lineno}"
        parts = []
        for h in rec.hash_ids:
            block = blocks.get(h)
            if block is None:
                rng = np.random.Generator(np.random.PCG64([seed, h]))
                block = blocks[h] = rng.integers(0, VOCAB, MOONCAKE_BLOCK)
            parts.append(block)
        prompt = np.concatenate(parts)[: rec.input_length]
        out_rng = np.random.Generator(np.random.PCG64([seed, 1 << 62, rec.lineno]))
        reqs.append(
            Request(
                request_id=f"r{len(reqs)}",
                prompt=prompt,
                output=out_rng.integers(0, VOCAB, rec.output_length).tolist(),
                arrival_step=_step(rec.arrival_s, step_ms, where),
                arrival_s=rec.arrival_s,
            )
        )
    return _workload(path, reqs, "mooncake", step_ms)


def _csv_rows(path: str | Path) -> Iterator[tuple[int, dict[str, str]]]:
    numbered = bounded_lines(path)
    lines: list[int] = []

    def text() -> Iterator[str]:
        for lineno, line in numbered:
            lines.append(lineno)
            yield line

    rows = csv.DictReader(text())
    try:
        names = rows.fieldnames
    except csv.Error as e:
        raise TraceFormatError(f"{path}:1: {e}") from None
    if names is not None:
        # Column names unquoted and stripped (``"Request tokens"``, ``" TIMESTAMP"``).
        rows.fieldnames = [n.strip() for n in names]
    while True:
        try:
            fields = next(rows)
        except StopIteration:
            return
        except csv.Error as e:  # an oversized field, a NUL byte, a broken quote
            raise TraceFormatError(f"{path}:{lines[-1] if lines else 1}: {e}") from None
        yield lines[-1], fields


_AZURE_STAMP = re.compile(
    r"(?P<head>\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2})?)"
    r"(?:[.,](?P<frac>\d+))?"
    r"\s*(?P<tz>Z|UTC|[+-]\d{2}(?::?\d{2})?)?"
)


def _azure_seconds(stamp: str, where: str) -> float:
    """Seconds since the epoch of an Azure ``TIMESTAMP``: a date and time with any
    number of fraction digits (Azure writes 7; past nanoseconds they are
    dropped), and an optional UTC offset (``+05:00``, ``-0800``, ``Z``; none: UTC)."""
    m = _AZURE_STAMP.fullmatch(stamp.strip())
    if m is None:
        raise TraceFormatError(f"{where}: TIMESTAMP {stamp!r} is not a date and time")
    try:
        t = dt.datetime.fromisoformat(m["head"].replace(" ", "T"))
    except ValueError:
        raise TraceFormatError(f"{where}: TIMESTAMP {stamp!r} is not a date and time") from None
    offset = 0
    tz = m["tz"]
    if tz and tz not in ("Z", "UTC"):
        digits = tz[1:].replace(":", "")
        hours, minutes = int(digits[:2]), int(digits[2:4] or 0)
        if hours > 23 or minutes > 59:
            raise TraceFormatError(f"{where}: TIMESTAMP {stamp!r} has a bad UTC offset")
        offset = (1 if tz[0] == "+" else -1) * (hours * 3600 + minutes * 60)
    frac: str = (m["frac"] or "0")[:9]  # nanoseconds at most
    seconds = t.replace(tzinfo=dt.timezone.utc).timestamp() - offset
    return float(seconds + int(frac) / 10 ** len(frac))


def _length_records(path: str | Path, fmt: str) -> Iterator[_Record]:
    """The one reader of BurstGPT and Azure CSV traces (``simulate`` and
    ``trace-stats``): arrivals as the file gives them, in seconds."""
    cols = {
        "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
        "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    }[fmt]
    budget = _Budget(path)
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
                raise TraceFormatError(
                    f"{where}: Timestamp must be a number of seconds, got {row[cols[0]]!r}"
                ) from None
        secs = _finite_seconds(secs, cols[0], where)
        n = _count(row[cols[1]], cols[1], where, 1, text=True)
        out_len = max(1, _count(row[cols[2]], cols[2], where, text=True))
        budget.add(n, out_len, lineno)
        yield _Record(lineno, secs, n, out_len, [])


def _read_lengths(path: str | Path, fmt: str, step_ms: float, seed: int) -> Workload:
    recs = list(_length_records(path, fmt))
    # Rows in any order: arrivals count from the earliest.
    first = min((r.arrival_s for r in recs), default=0.0)
    reqs: list[Request] = []
    for rec in recs:
        where = f"{path}:{rec.lineno}"
        rng = np.random.Generator(np.random.PCG64([seed, rec.lineno]))
        reqs.append(
            Request(
                request_id=f"r{len(reqs)}",
                prompt=rng.integers(0, VOCAB, rec.input_length),
                output=rng.integers(0, VOCAB, rec.output_length).tolist(),
                arrival_step=_step(rec.arrival_s - first, step_ms, where),
                arrival_s=rec.arrival_s - first,
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


def _token_block_requests(w: Workload, block_size: int) -> Iterator[BlockRequest]:
    """The workload's requests as a prefix cache sees them: the whole
    ``block_size``-token blocks a request leaves cached (its prompt and every
    output token but the last, never computed), each named by its whole prefix;
    the whole blocks of its prompt can hit. A block is named by a 64-bit hash
    chained over its prefix's token bytes (a name per block, not the bytes: a
    large trace's blocks stay a set of integers)."""
    for r in w.requests:
        prompt = np.asarray(r.prompt, dtype=np.int64)
        seq = np.concatenate([prompt, np.asarray(r.output[:-1], dtype=np.int64)])
        keys: list[int] = []
        chain = 0
        for i in range(len(seq) // block_size):
            chain = hash((chain, seq[i * block_size : (i + 1) * block_size].tobytes()))
            keys.append(chain)
        yield BlockRequest(keys, [block_size] * (len(prompt) // block_size), len(prompt))


def _mooncake_block_requests(records: Iterable[_Record]) -> Iterator[BlockRequest]:
    """Mooncake requests as a prefix cache sees them: one block per hash id (the
    last possibly partial, counting its tokens), each named by its whole prefix."""
    ids: dict[tuple[int, int], int] = {}
    for rec in records:
        keys: list[int] = []
        parent = -1
        for h in rec.hash_ids:
            parent = ids.setdefault((parent, h), len(ids))
            keys.append(parent)
        n = rec.input_length
        hit = [min(MOONCAKE_BLOCK, n - k * MOONCAKE_BLOCK) for k in range(len(keys))]
        yield BlockRequest(keys, hit, n)


def _ceiling_hits(requests: Iterable[BlockRequest]) -> tuple[int, int]:
    """(hit tokens, prompt tokens) with an unlimited cache: each request's longest
    prefix of blocks that an earlier request left."""
    seen: set[Any] = set()
    hit = total = 0
    for req in requests:
        for key, n in zip(req.blocks, req.hit_tokens, strict=False):
            if key not in seen:
                break
            hit += n
        seen.update(req.blocks)
        total += req.prompt_tokens
    return hit, total


def _prefix_hits(w: Workload, block_size: int) -> tuple[int, int]:
    """(tokens of each prompt's longest prefix of whole blocks that an earlier
    request computed, prompt tokens), over the workload in order."""
    return _ceiling_hits(_token_block_requests(w, block_size))


def prefix_hit_ceiling(w: Workload, block_size: int = 16) -> float:
    """The theoretical maximum prefix-hit rate of the workload with an unlimited
    cache: each prompt's longest prefix of whole ``block_size``-token blocks that
    an earlier request computed (its prompt, or its answer: a later turn of a
    conversation resends it), over all prompt tokens."""
    hit, total = _prefix_hits(w, block_size)
    return hit / total if total else 0.0


def trace_stats(
    path: str | Path,
    fmt: str | None = None,
    *,
    block_size: int = 16,
    step_ms: float = 50.0,
    capacities: Sequence[float] = (),
) -> dict[str, Any]:
    """What a trace holds before any simulation: requests, duration and rate,
    length percentiles, and the theoretical maximum prefix-hit rate with an
    unlimited cache (each request's longest prefix already seen in earlier
    requests, in tokens: whole Mooncake blocks, or ``block_size``-token blocks
    of the prompts for the other formats, capped at the prompt). With
    ``capacities`` (tokens), ``lru_hit_rate``: the hit rate of one LRU cache of
    each size (:mod:`pagedkv.sim.capacity`), in the order given."""
    fmt = fmt or detect_format(path)
    inputs: list[int] = []
    outputs: list[int] = []
    stamps: list[float] = []
    requests: Iterable[BlockRequest]
    if fmt == "mooncake":

        def records() -> Iterator[_Record]:
            for rec in _mooncake_records(path):
                inputs.append(rec.input_length)
                outputs.append(rec.output_length)
                stamps.append(rec.arrival_s)
                yield rec

        requests = _mooncake_block_requests(records())
        block = MOONCAKE_BLOCK
    else:
        w = load_trace(path, fmt, step_ms=step_ms)
        for r in w.requests:
            inputs.append(len(r.prompt))
            outputs.append(len(r.output))
        steps = [r.arrival_step for r in w.requests]
        stamps = [(s - min(steps)) * step_ms / 1000.0 for s in steps]
        requests = _token_block_requests(w, block_size)
        block = block_size
    curve = None
    if capacities:
        requests = list(requests)
        curve = lru_hit_curve(requests)
    hit, total = _ceiling_hits(requests)
    if not stamps:
        raise TraceFormatError(f"{path}: no request")
    duration = max(stamps) - min(stamps)
    n = len(inputs)
    out: dict[str, Any] = {
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
    if curve is not None:
        out["block_size"] = block
        out["lru_hit_rate"] = [
            {
                "capacity_tokens": int(c) if c == int(c) else c,
                "capacity_blocks": int(c // block),
                "hit_rate": round(curve.hit_rate(int(c // block)), 6),
            }
            for c in capacities
        ]
    return out
