"""The JSONL trace format of ``pagedkv simulate --trace FILE`` (see docs/simulate.md).

One JSON object per line; blank lines and lines starting with ``#`` are skipped.

``{"type": "header", "format": "pagedkv-trace", "version": 1, "seed": 0, "vocab_size": 32000}``
    optional, first line: the seed of the random tokens drawn for ``prompt_len`` /
    ``output_len`` and their vocabulary.
``{"type": "prefix", "id": "sys", "len": 1500}`` or ``{"type": "prefix", "id": "sys",
"tokens": [...]}``
    a shared prefix (a system prompt, a document), referenced by id.
a request (``"type": "request"`` or no type)::

    {"id": "r7", "arrival": 1.25, "prefix": ["sys", "doc3"], "prompt_len": 120,
     "output_len": 64, "session": "u1", "history": true, "pause": 2.0,
     "salt": "tenant-a", "lora": "adapter-1"}

    id          optional, default "r<n>" (n = index of the request); unique
    arrival     arrival time in seconds (step = floor(arrival * 1000 / step_ms)),
                or arrival_step: the step itself; default 0
    prefix      a prefix id or a list of them, placed first, in order
    prompt      the prompt's token ids (after the prefixes), or
    prompt_len  that many random token ids instead
    output      the token ids to sample, or output_len: that many random ones (>= 1)
    session     turns of one session run one after the other, in file order
    history     true: the prompt starts with the session's previous turn
                (its prompt and output), then prefixes and prompt
    pause       seconds (or pause_steps: steps) between the end of the session's
                previous turn and this one's arrival (no earlier than ``arrival``)
    salt        cache salt; lora: LoRA adapter name (lora_path optional)

Random tokens are drawn from NumPy's PCG64 seeded with (seed, line number), so a
trace file always gives the same requests.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

import numpy as np

from .outputs import check_output, open_output
from .policy import Request
from .workloads import Workload

__all__ = ["TraceFormatError", "read_trace", "write_trace"]

FORMAT = "pagedkv-trace"
VERSION = 1
_REQUEST_KEYS = {
    "type",
    "id",
    "arrival",
    "arrival_step",
    "prefix",
    "prompt",
    "prompt_len",
    "output",
    "output_len",
    "session",
    "history",
    "pause",
    "pause_steps",
    "salt",
    "lora",
    "lora_path",
}


class TraceFormatError(ValueError):
    """A trace file that does not follow the format, or goes past a limit (the
    message names the file, the line and the limit)."""


#: Longest line read (a file without newlines, ``/dev/zero``, stops here).
MAX_LINE_BYTES = 64 << 20
#: Most lines read, blank lines and comments included (a gzip of blank lines
#: stops here).
MAX_LINES = 10_000_000
#: Most bytes read from a trace, after gunzipping.
MAX_TRACE_BYTES = 2 << 30
#: Most requests in one trace.
MAX_REQUESTS = 1_000_000
#: Most tokens one request may hold (its prompt, history included, plus output).
MAX_REQUEST_TOKENS = 10_000_000
#: Most tokens all requests and prefixes of a trace may hold together.
MAX_TOTAL_TOKENS = 200_000_000
#: Latest arrival, pause or step count (2**40 steps).
MAX_STEPS = 1 << 40


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number (JSON has no {name})")


def loads(line: str) -> Any:
    """One JSON value of a trace line; ``NaN`` / ``Infinity`` and nesting deeper
    than Python's recursion limit are refused (``ValueError``)."""
    try:
        return json.loads(line, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _int_list(v: Any, what: str) -> np.ndarray:
    if not isinstance(v, list) or not all(isinstance(t, int) and 0 <= t < 2**32 for t in v):
        raise ValueError(f"{what} must be a list of token ids (0 <= id < 2**32)")
    return np.asarray(v, dtype=np.uint32).astype(np.int64)


def count(v: Any, what: str, minimum: int = 0, maximum: int = MAX_REQUEST_TOKENS) -> int:
    """An integer count in ``minimum..maximum`` (``ValueError`` naming it otherwise)."""
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {v!r}")
    if v > maximum:
        raise ValueError(f"{what} {v} is past the limit of {maximum}")
    return v


def seconds_to_steps(v: Any, what: str, step_ms: float) -> int:
    """A time in seconds as a step (``step_ms`` per step); refuses what is not a
    finite number of seconds >= 0 or lies past ``MAX_STEPS``."""
    if not isinstance(v, int | float) or isinstance(v, bool) or v < 0 or not math.isfinite(v):
        raise ValueError(f"{what} must be a number of seconds >= 0, got {v!r}")
    if v * 1000.0 / step_ms > MAX_STEPS:
        raise ValueError(f"{what} {v} is past the limit of {MAX_STEPS} steps")
    return math.floor(v * 1000.0 / step_ms + 1e-9)


def _steps(rec: dict[str, Any], seconds_key: str, steps_key: str, step_ms: float) -> int:
    if steps_key in rec:
        return count(rec[steps_key], steps_key, maximum=MAX_STEPS)
    return seconds_to_steps(rec.get(seconds_key, 0), seconds_key, step_ms)


def _seconds(rec: dict[str, Any], seconds_key: str, steps_key: str) -> float | None:
    """The record's time in seconds when given in seconds (else None: steps)."""
    if steps_key in rec or seconds_key not in rec:
        return None
    return float(rec[seconds_key])


def _open_bytes(path: str | Path) -> IO[bytes]:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return cast(IO[bytes], gzip.open(path, "rb"))
    return open(path, "rb")


def bounded_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """The file's non-blank lines, stripped, with their numbers (gunzipped, a
    UTF-8 byte-order mark dropped). Refused with :class:`TraceFormatError`: a line
    longer than ``MAX_LINE_BYTES`` (a file without newlines), more than
    ``MAX_LINES`` lines (blank ones included) or ``MAX_TRACE_BYTES`` bytes, a
    truncated or corrupt gzip stream, text that is not UTF-8."""
    lineno = 0
    read = 0
    with _open_bytes(path) as f:
        while True:
            try:
                raw = f.readline(MAX_LINE_BYTES + 1)
            except (EOFError, zlib.error, gzip.BadGzipFile) as e:
                why = "the gzip stream ends early" if isinstance(e, EOFError) else str(e)
                raise TraceFormatError(
                    f"{path}:{lineno + 1}: truncated or corrupt gzip ({why})"
                ) from None
            if not raw:
                return
            lineno += 1
            read += len(raw)
            if len(raw) > MAX_LINE_BYTES:
                raise TraceFormatError(
                    f"{path}:{lineno}: a line longer than the limit of {MAX_LINE_BYTES} bytes"
                )
            if lineno > MAX_LINES:
                raise TraceFormatError(
                    f"{path}:{lineno}: more lines than the limit of {MAX_LINES:,} "
                    "(blank lines included)"
                )
            if read > MAX_TRACE_BYTES:
                raise TraceFormatError(
                    f"{path}:{lineno}: more than the limit of {MAX_TRACE_BYTES:,} bytes "
                    "(after gunzipping)"
                )
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise TraceFormatError(f"{path}:{lineno}: not UTF-8 text ({e.reason})") from None
            if line:
                yield lineno, line


def read_trace(path: str | Path, *, step_ms: float = 50.0) -> Workload:
    """Reads a trace file into a :class:`Workload`; ``step_ms``: milliseconds per
    scheduler step, to turn seconds into steps. Raises :class:`TraceFormatError`."""
    if step_ms <= 0:
        raise ValueError("step_ms must be positive")
    seed, vocab = 0, 32000
    prefixes: dict[str, np.ndarray] = {}
    reqs: list[Request] = []
    ids: set[str] = set()
    last_turn: dict[str, Request] = {}
    total = 0
    complete: bool | None = None  # a file written by write_trace ends with a record
    for lineno, line in bounded_lines(path):
        if line.startswith("#"):
            continue
        if complete:
            raise TraceFormatError(f"{path}:{lineno}: a record after the end record")
        try:
            rec = loads(line)
            if not isinstance(rec, dict):
                raise ValueError("each line must be a JSON object")
            kind = rec.get("type", "request")
            rng = np.random.Generator(np.random.PCG64([seed, lineno]))
            if kind == "header":
                if rec.get("format", FORMAT) != FORMAT or rec.get("version", 1) != VERSION:
                    raise ValueError(f"not a {FORMAT} v{VERSION} file")
                seed = count(rec.get("seed", 0), "seed", maximum=2**63)
                vocab = count(rec.get("vocab_size", vocab), "vocab_size", 2, 2**32)
                if rec.get("end_record"):
                    complete = False
            elif kind == "end":
                if complete is None:
                    raise ValueError("an end record without a header asking for one")
                if rec.get("requests") != len(reqs):
                    raise ValueError(
                        f"the end record counts {rec.get('requests')!r} requests, "
                        f"the file has {len(reqs)}"
                    )
                complete = True
            elif kind == "prefix":
                pid = str(rec["id"])
                if "tokens" in rec:
                    prefixes[pid] = _int_list(rec["tokens"], "tokens")
                else:
                    prefixes[pid] = rng.integers(0, vocab, count(rec["len"], "len"))
                total += len(prefixes[pid])
            elif kind == "request":
                if len(reqs) >= MAX_REQUESTS:
                    raise ValueError(f"more requests than the limit of {MAX_REQUESTS:,}")
                req = _request(rec, len(reqs), rng, vocab, prefixes, last_turn, step_ms)
                if req.request_id in ids:
                    raise ValueError(f"duplicate request id {req.request_id!r}")
                ids.add(req.request_id)
                reqs.append(req)
                total += len(req.prompt) + len(req.output)
            else:
                raise ValueError(f"unknown record type {kind!r}")
            if total > MAX_TOTAL_TOKENS:
                raise ValueError(f"the trace's tokens are past the limit of {MAX_TOTAL_TOKENS}")
        except (ValueError, KeyError, TypeError) as e:
            msg = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise TraceFormatError(f"{path}:{lineno}: {msg}") from None
    if complete is False:
        raise TraceFormatError(
            f"{path}: the end record is missing (the file was cut short, e.g. an "
            "interrupted --save-trace)"
        )
    if not reqs:
        raise TraceFormatError(f"{path}: no request")
    return Workload(Path(path).name, reqs, {"trace": str(path), "step_ms": step_ms})


def _request(
    rec: dict[str, Any],
    index: int,
    rng: np.random.Generator,
    vocab: int,
    prefixes: dict[str, np.ndarray],
    last_turn: dict[str, Request],
    step_ms: float,
) -> Request:
    unknown = set(rec) - _REQUEST_KEYS
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
    session = None if rec.get("session") is None else str(rec["session"])
    parts: list[np.ndarray] = []
    if rec.get("history"):
        if session is None or session not in last_turn:
            raise ValueError("history needs an earlier turn of the same session")
        prev = last_turn[session]
        parts += [np.asarray(prev.prompt, dtype=np.int64), np.asarray(prev.output, dtype=np.int64)]
    pref = rec.get("prefix", [])
    for pid in [pref] if isinstance(pref, str) else pref:
        if str(pid) not in prefixes:
            raise ValueError(f"unknown prefix {pid!r} (declare it on an earlier line)")
        parts.append(prefixes[str(pid)])
    if "prompt" in rec:
        parts.append(_int_list(rec["prompt"], "prompt"))
    elif "prompt_len" in rec:
        parts.append(rng.integers(0, vocab, count(rec["prompt_len"], "prompt_len")))
    size = sum(len(p) for p in parts)
    if size > MAX_REQUEST_TOKENS:
        raise ValueError(
            f"a prompt of {size} tokens (history and prefixes included) is past the limit "
            f"of {MAX_REQUEST_TOKENS}"
        )
    prompt = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if len(prompt) == 0:
        raise ValueError("empty prompt (give prompt, prompt_len, prefix or history)")
    if "output" in rec:
        output = _int_list(rec["output"], "output").tolist()
        if not output:
            raise ValueError("output must hold at least one token")
    else:
        output = rng.integers(0, vocab, count(rec["output_len"], "output_len", 1)).tolist()
    if len(prompt) + len(output) > MAX_REQUEST_TOKENS:
        raise ValueError(
            f"a request of {len(prompt)} prompt and {len(output)} output tokens is past the "
            f"limit of {MAX_REQUEST_TOKENS} tokens"
        )
    lora = rec.get("lora")
    req = Request(
        request_id=str(rec.get("id", f"r{index}")),
        prompt=prompt,
        output=output,
        arrival_step=_steps(rec, "arrival", "arrival_step", step_ms),
        session=session,
        pause=_steps(rec, "pause", "pause_steps", step_ms),
        arrival_s=_seconds(rec, "arrival", "arrival_step"),
        pause_s=_seconds(rec, "pause", "pause_steps"),
        cache_salt=None if rec.get("salt") is None else str(rec["salt"]),
        lora_name=None if lora is None else str(lora),
        lora_path=None if lora is None else str(rec.get("lora_path", f"/adapters/{lora}")),
    )
    if session is not None:
        prev_turn = last_turn.get(session)
        # A later turn of a session keeps the session's adapter and salt unless
        # it names its own (its history was computed with them).
        if prev_turn is not None:
            if "lora" not in rec:
                req.lora_name, req.lora_path = prev_turn.lora_name, prev_turn.lora_path
            if "salt" not in rec:
                req.cache_salt = prev_turn.cache_salt
        last_turn[session] = req
    return req


def write_trace(workload: Workload, path: str | Path) -> None:
    """Writes ``workload`` as a trace file (steps, explicit token ids; a turn that
    extends its session's previous turn is written with ``history``)."""
    last: dict[str, Request] = {}
    trace = workload.params.get("trace")
    check_output(path, inputs=[str(trace)] if trace else [], what="trace")
    # A regular file is written beside the target and renamed over it once
    # complete: an interrupted write leaves no trace file (and a cut one, read
    # through a FIFO, fails to read: its end record is missing).
    with open_output(path) as f:
        _write_records(workload, f, last)


def _write_records(workload: Workload, f: Any, last: dict[str, Request]) -> None:
    header = {"type": "header", "format": FORMAT, "version": VERSION, "end_record": True}
    f.write(json.dumps(header) + "\n")
    for r in workload.requests:
        rec: dict[str, Any] = {"id": r.request_id}
        if r.arrival_s is not None:
            rec["arrival"] = r.arrival_s
        else:
            rec["arrival_step"] = r.arrival_step
        prompt = r.prompt
        prev = None
        if r.session is not None:
            rec["session"] = r.session
            prev = last.get(r.session)
            if prev is not None:
                head = np.concatenate([prev.prompt, np.asarray(prev.output)])
                if len(head) <= len(prompt) and np.array_equal(prompt[: len(head)], head):
                    rec["history"] = True
                    prompt = prompt[len(head) :]
                if r.pause_s is not None:
                    rec["pause"] = r.pause_s
                elif r.pause:
                    rec["pause_steps"] = r.pause
            last[r.session] = r
        rec["prompt"] = [int(t) for t in prompt]
        rec["output"] = [int(t) for t in r.output]
        # null where a later turn drops what the session's previous turn had
        # (a later turn inherits it otherwise).
        if r.cache_salt is not None or (prev is not None and prev.cache_salt is not None):
            rec["salt"] = r.cache_salt
        if r.lora_name is not None or (prev is not None and prev.lora_name is not None):
            rec["lora"] = r.lora_name
            if r.lora_path is not None:
                rec["lora_path"] = r.lora_path
        f.write(json.dumps(rec, separators=(",", ":")) + "\n")
    f.write(json.dumps({"type": "end", "requests": len(workload.requests)}) + "\n")
