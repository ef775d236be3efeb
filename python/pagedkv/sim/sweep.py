"""``--sweep AXIS=V1,V2,...``: one run per value, every point reported.

A point that cannot run (the model does not fit the GPU, the KV cache cannot
hold the longest request, a request can never be admitted) is marked
``does not fit`` with the reason and the sweep goes on. A point is a compact
record: its figures and its run's ``to_dict()`` (no per-step series), a few KB
whatever the run's length. :func:`write_csv` writes the points as one flat row
each; :mod:`pagedkv.sim.parallel` runs them.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import PagedKVError
from .outputs import open_output
from .runner import SimResult

__all__ = [
    "CSV_COLUMNS",
    "capacity_tokens",
    "failed_point",
    "invalid_point",
    "line",
    "point",
    "run_point",
    "write_csv",
]

#: the CSV columns, in order (nested figures flattened with ``_``)
CSV_COLUMNS = (
    "axis",
    "value",
    "status",
    "reason",
    "num_blocks",
    "kv_cache_gib",
    "hit_rate",
    "device_hit_rate",
    "host_hit_rate",
    "disk_hit_rate",
    "capacity_tokens",
    "preemptions",
    "rejected_requests",
    "ttft_ms_mean",
    "ttft_ms_p50",
    "ttft_ms_p90",
    "ttft_ms_p99",
    "tpot_ms_mean",
    "tpot_ms_p50",
    "tpot_ms_p90",
    "tpot_ms_p99",
    "e2e_ms_p50",
    "e2e_ms_p99",
    "queue_ms_p50",
    "queue_ms_p99",
    "requests_per_s",
    "output_tokens_per_s",
    "duration_s",
    "slo_attainment",
)


def _value(text: str) -> int | float | str:
    """The swept value as a number when it is a finite one (``nan`` stays text)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        v = float(text)
    except ValueError:
        return text
    return v if math.isfinite(v) else text


def point(axis: str, value: str, result: SimResult) -> dict[str, Any]:
    """The record of one run (``axis`` ``variant`` for ``--compare`` runs, whose
    ``value`` is the variant's label): its figures, and under ``run`` the run's
    ``to_dict()``, which leaves the per-step series out."""
    t = result.timing
    tiers = result.extra.get("tiers") or {}
    hit = round(result.hit_rate, 6)
    return {
        "axis": axis,
        "value": _value(value),
        "status": "ok",
        "reason": "",
        "num_blocks": result.num_blocks,
        "kv_cache_gib": result.config["kv_cache_gib"],
        "hit_rate": hit,
        "device_hit_rate": tiers.get("device_hit_rate", hit),
        "host_hit_rate": tiers.get("host_hit_rate", 0.0),
        "disk_hit_rate": tiers.get("disk_hit_rate", 0.0),
        "capacity_tokens": capacity_tokens(result),
        "preemptions": result.preemptions,
        "rejected_requests": result.rejected_requests,
        **{k: t[k] for k in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms", "throughput")},
        "duration_s": t["duration_s"],
        "slo_attainment": t.get("slo_attainment"),
        "run": result.to_dict(),
    }


def capacity_tokens(result: SimResult) -> int:
    """Tokens the run's caches hold in all: every replica's device blocks, and
    its host and disk tiers' (the first group's block size)."""
    c = result.config
    host = (result.extra.get("tiers") or {}).get("host_tier", {})
    blocks = result.usable_blocks * c.get("replicas", 1)
    blocks += host.get("num_chunks", 0) + host.get("disk_tier_slots", 0)
    return int(blocks * (c.get("group_block_sizes") or [c["block_size"]])[0])


def run_point(axis: str, value: str, run: Callable[[], SimResult]) -> dict[str, Any]:
    """Runs one point; a configuration that cannot run becomes a ``does not fit``
    point carrying the reason instead of an exception, and any other failure of
    the point a ``failed`` one (the sweep goes on either way)."""
    try:
        return point(axis, value, run())
    except (PagedKVError, ValueError, RuntimeError) as e:
        return {"axis": axis, "value": _value(value), "status": "does not fit", "reason": str(e)}
    except Exception as e:
        return failed_point(axis, value, f"{type(e).__name__}: {e}")


def failed_point(axis: str, value: str, reason: str) -> dict[str, Any]:
    """The point of a run that failed for another reason than not fitting."""
    return {"axis": axis, "value": _value(value), "status": "failed", "reason": reason}


def invalid_point(axis: str, value: str, reason: str) -> dict[str, Any]:
    """The point of a value that is not one of the axis's values (not run)."""
    return {"axis": axis, "value": _value(value), "status": "invalid", "reason": reason}


def _flat(p: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for k, v in p.items():
        if k == "run":
            continue
        if isinstance(v, dict):
            for kk, vv in v.items():
                row[kk if k == "throughput" else f"{k}_{kk}"] = vv
        else:
            row[k] = v
    return row


def line(label: str, p: dict[str, Any]) -> str:
    """One line on a point, for a sweep's progress: the figures of the table, or
    the status and the reason."""
    if p["status"] != "ok":
        return f"{label}: {p['status']}: {p['reason'].split('. ')[0]}"
    return (
        f"{label}: hit rate {100 * p['hit_rate']:.1f} %, {p['preemptions']:,} preemptions, "
        f"TTFT p50 / p99 {p['ttft_ms']['p50']:,.1f} / {p['ttft_ms']['p99']:,.1f} ms, "
        f"{p['throughput']['requests_per_s']:,.2f} req/s ({p['run']['wall_s']:,.1f} s)"
    )


def write_csv(points: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Writes one row per point (``CSV_COLUMNS``; empty cells where a point did not run)."""
    with open_output(path, newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for p in points:
            w.writerow(_flat(p))
