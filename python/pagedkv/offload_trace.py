"""Replaying a recorded run of vLLM's CPU offloading manager on pagedkv's tier.

A trace (``format: pagedkv-offload-trace-1``, written by
``benches/offload_record_vllm.py`` in a vLLM environment) holds every call made
to vLLM 0.33's ``CPUOffloadingManager`` and what it answered: keys stored,
slots handed out, keys evicted, events, metrics and, every few calls, the
policy's internal order (LRU's eviction order, ARC's four lists and target).
:func:`replay` makes the same calls on an :class:`~pagedkv.offload.OffloadTier`
and lists every answer that differs.
"""

from __future__ import annotations

import gzip
import io
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagedkv._core import OffloadTier

__all__ = ["FORMAT", "OPS", "Mismatch", "core_ops", "load_trace", "replay"]

FORMAT = "pagedkv-offload-trace-1"
#: Largest trace file read (bytes, after decompression).
MAX_TRACE_BYTES = 1 << 30

_LOOKUP_NAMES = ("MISS", "HIT", "HIT_PENDING")
#: The calls a trace records, in the order of the manager's interface.
OPS = (
    "new_request",
    "set_positions",
    "lookup",
    "prepare_load",
    "complete_load",
    "touch",
    "prepare_store",
    "complete_store",
    "finish",
    "reset",
    "events",
    "stats",
    "state",
)


class Mismatch(tuple[int, str, Any, Any]):
    """``(op index, op name, expected, got)``."""

    __slots__ = ()


def load_trace(path: str | Path) -> dict[str, Any]:
    """Reads a trace (``.json`` or ``.json.gz``), checking its format and size."""
    p = Path(path)
    if p.stat().st_size > MAX_TRACE_BYTES:
        raise ValueError(f"{p}: larger than {MAX_TRACE_BYTES} bytes")
    raw = p.read_bytes()
    try:
        if p.suffix == ".gz":
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as f:
                raw = f.read(MAX_TRACE_BYTES + 1)
        if len(raw) > MAX_TRACE_BYTES:
            raise ValueError(f"larger than {MAX_TRACE_BYTES} bytes")
        trace = json.loads(raw)
    except (OSError, EOFError, ValueError) as e:
        raise ValueError(f"{p}: not a readable trace: {e}") from None
    if not isinstance(trace, dict) or trace.get("format") != FORMAT:
        raise ValueError(f"{p}: not a {FORMAT} trace")
    config = trace.get("config")
    if not isinstance(config, dict) or not isinstance(trace.get("ops"), list):
        raise ValueError(f"{p}: a trace needs 'config' and 'ops'")
    for i, op in enumerate(trace["ops"]):
        if not isinstance(op, dict) or op.get("op") not in OPS:
            raise ValueError(f"{p}: op {i} is not one of {list(OPS)}")
    return trace


def _keys(hexes: list[str]) -> list[bytes]:
    return [bytes.fromhex(h) for h in hexes]


def _hexes(keys: list[bytes]) -> list[str]:
    return [k.hex() for k in keys]


def _state(tier: OffloadTier) -> dict[str, Any]:
    out: dict[str, Any] = {
        "evictable": tier.num_evictable,
        "write_pending": tier.num_write_pending,
    }
    tracked = tier.tracked_offers()
    out["tracker"] = None if tracked is None else [[k.hex(), n] for k, n in tracked]
    order = tier.lru_eviction_order()
    if order is not None:
        out["lru_order"] = _hexes(order)
    arc = tier.arc_lists()
    if arc is not None:
        target, t1, t2, b1, b2 = arc
        out["target"] = target
        out["t1"] = [[k.hex(), r, s] for k, r, s in t1]
        out["t2"] = [[k.hex(), r, s] for k, r, s in t2]
        out["b1"] = _hexes(b1)
        out["b2"] = _hexes(b2)
    return out


def _same(expected: Any, got: Any) -> bool:
    if isinstance(expected, float) or isinstance(got, float):
        return isinstance(got, (int, float)) and math.isclose(expected, got, abs_tol=1e-12)
    if isinstance(expected, dict) and isinstance(got, dict):
        return expected.keys() == got.keys() and all(_same(expected[k], got[k]) for k in expected)
    if isinstance(expected, list) and isinstance(got, list):
        return len(expected) == len(got) and all(map(_same, expected, got))
    return bool(expected == got)


def replay(
    trace: dict[str, Any],
    *,
    check_invariants: bool = True,
    on_op: Callable[[int], None] | None = None,
) -> tuple[OffloadTier, list[Mismatch]]:
    """Makes the trace's calls on a fresh tier; every answer that differs. A
    call the trace cannot make (a malformed field, a call the tier refuses)
    raises ``ValueError`` naming the call."""
    c = trace["config"]
    tier = OffloadTier(
        c["num_chunks"],
        c["policy"],
        enable_events=c.get("enable_events", False),
        store_threshold=c.get("store_threshold", 1),
        max_tracker_size=c.get("max_tracker_size", 64_000),
    )
    positions: dict[int, dict[bytes, int]] = {}
    mismatches: list[Mismatch] = []
    for i, op in enumerate(trace["ops"]):
        try:
            got = _call(tier, op, positions)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"op {i} ({op['op']}): {e!r}") from None
        if "out" in op and not _same(op["out"], got):
            mismatches.append(Mismatch((i, op["op"], op["out"], got)))
        if check_invariants:
            tier.check_invariants()
        if on_op is not None:
            on_op(i)
    return tier, mismatches


def _call(tier: OffloadTier, op: dict[str, Any], positions: dict[int, dict[bytes, int]]) -> Any:
    """Makes one recorded call; its answer in the trace's form (None without one)."""
    name = op["op"]
    req = op.get("req", 0)
    keys = _keys(op["keys"]) if "keys" in op else []
    known = positions.get(req)
    pos = [known.get(k) for k in keys] if known else None
    if name == "new_request":
        tier.on_new_request(req)
    elif name == "set_positions":
        positions.setdefault(req, {}).update(zip(keys, op["positions"], strict=True))
    elif name == "lookup":
        return _LOOKUP_NAMES[tier.lookup(bytes.fromhex(op["key"]))]
    elif name == "prepare_load":
        return tier.prepare_load(keys, req, pos).tolist()
    elif name == "complete_load":
        tier.complete_load(keys)
    elif name == "touch":
        tier.touch(keys)
    elif name == "prepare_store":
        out = tier.prepare_store(keys, req, pos)
        if out is None:
            return None
        return {
            "keys_to_store": _hexes(out[0]),
            "chunk_ids": out[1].tolist(),
            "evicted": _hexes(out[2]),
        }
    elif name == "complete_store":
        tier.complete_store(keys, op.get("success", True))
    elif name == "finish":
        tier.on_request_finished(req, None, positions.get(req, {}))
    elif name == "reset":
        tier.reset_cache()
    elif name == "events":
        return [
            {"keys": _hexes(k), "medium": m, "removed": r, "metadata_only": md}
            for k, m, r, md in tier.take_events()
        ]
    elif name == "stats":
        usage, write, read, sizes, skipped = tier.stats()
        return {
            "usage": usage,
            "write_usage": write,
            "read_usage": read,
            "allocation_sizes": sizes,
            "stores_skipped": skipped,
        }
    elif name == "state":
        return _state(tier)
    return None


def core_ops(trace: dict[str, Any]) -> str:
    """The trace's calls as the core's replay reads them (``benches/benches/
    offload.rs``): the config line, then one call per line, ``op req flag keys
    positions`` (keys as hex joined by ``,``; positions the caller holds at
    the call, ``_`` unknown; ``-`` for none). Positions are folded in as a
    caller holds them; ``state`` reads are left out."""
    c = trace["config"]
    lines = [
        f"config {c['num_chunks']} {c['policy']} {int(c.get('enable_events', False))} "
        f"{c.get('store_threshold', 1)} {c.get('max_tracker_size', 64_000)}"
    ]
    known: dict[int, dict[str, int]] = {}

    def join(items: list[str]) -> str:
        return ",".join(items) if items else "-"

    for op in trace["ops"]:
        name, req = op["op"], op.get("req", 0)
        keys: list[str] = op.get("keys", [op["key"]] if "key" in op else [])
        if name == "set_positions":
            known.setdefault(req, {}).update(zip(keys, op["positions"], strict=True))
            continue
        if name == "state":
            continue
        pos = known.get(req, {})
        if name == "finish":
            keys = list(pos)
        positions = [str(pos[k]) if k in pos else "_" for k in keys] if pos else []
        flag = int(op.get("success", True))
        lines.append(f"{name} {req} {flag} {join(keys)} {join(positions)}")
    return "\n".join(lines) + "\n"
