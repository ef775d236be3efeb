"""``pagedkv trace-stats``: what a trace holds and its prefix-hit ceiling, printed.

The figures are ``pagedkv.sim.traces.trace_stats``'s; this module parses the
command, checks ``--capacity`` and lays the figures out as text or JSON.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from ..sim.traces import FORMATS as TRACE_FORMATS
from ..sim.traces import trace_stats
from .options import UsageError, positive_float, positive_int
from .output import json_text


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Adds ``trace-stats`` to the subcommands ``sub``."""
    ts: argparse.ArgumentParser = sub.add_parser(
        "trace-stats",
        help="what a trace holds, and its prefix-hit ceiling",
        description="Requests, rates, length percentiles and the theoretical maximum "
        "prefix-hit rate with an unlimited cache (each request's longest prefix already "
        "seen), before any simulation.",
    )
    ts.add_argument("file", metavar="FILE")
    ts.add_argument("--trace-format", choices=("auto", *TRACE_FORMATS), default="auto")
    ts.add_argument(
        "--block-size",
        type=positive_int,
        default=16,
        help="block of the prefix-hit ceiling for token traces (default 16; Mooncake: 512)",
    )
    ts.add_argument("--step-ms", type=positive_float, default=50.0, help=argparse.SUPPRESS)
    ts.add_argument(
        "--capacity",
        metavar="C1,C2,...",
        help="also the hit rate of one LRU cache of each size (tokens, e.g. 1e5,1e6,1e7), "
        "replaying the requests in order with no serving constraints (Mooncake's Figure 9)",
    )
    ts.add_argument("--json", action="store_true", help="print the figures as JSON")
    return ts


#: The most --capacity values, and the largest.
MAX_CAPACITIES = 64
MAX_CAPACITY = 10**12


def _capacities(text: str) -> list[float]:
    """``--capacity``'s values: tokens, positive finite numbers up to 10^12
    (integers or scientific notation), each once, at most 64."""
    values: list[float] = []
    for part in text.split(","):
        part = part.strip()
        try:
            v = float(part)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and 0 < v <= MAX_CAPACITY):
            raise UsageError(
                f"--capacity: {part!r} is not a number of tokens (a positive finite number "
                f"up to {MAX_CAPACITY:.0e})"
            )
        if v in values:
            raise UsageError(f"--capacity: {part} given twice")
        values.append(v)
    if len(values) > MAX_CAPACITIES:
        raise UsageError(f"--capacity: {len(values)} values, more than {MAX_CAPACITIES}")
    return values


def _tokens(c: float) -> str:
    return f"{c:,.0f}" if c == int(c) else f"{c:,.1f}"


def run_trace_stats(args: argparse.Namespace) -> int:
    """Runs ``pagedkv trace-stats`` with parsed ``args``; the exit status."""
    capacities = _capacities(args.capacity) if args.capacity is not None else []
    st = trace_stats(
        args.file,
        None if args.trace_format == "auto" else args.trace_format,
        block_size=args.block_size,
        step_ms=args.step_ms,
        capacities=capacities,
    )
    if args.json:
        sys.stdout.write(json_text(st))
        return 0
    rate = st["requests_per_s"]
    lines = [
        f"{st['trace']} ({st['format']})",
        f"requests           {st['requests']:,} over {st['duration_s']:,.1f} s"
        + (f" ({rate:,.2f} per s)" if rate else ""),
    ]
    for key, name in (("input_tokens", "input tokens"), ("output_tokens", "output tokens")):
        q = st[key]
        lines.append(
            f"{name:<18} mean {q['mean']:,.0f}  p50 {q['p50']:,.0f}  p90 {q['p90']:,.0f}  "
            f"p99 {q['p99']:,.0f}  max {q['max']:,.0f}"
        )
    lines.append(
        f"prefix-hit ceiling {100 * st['max_prefix_hit_rate']:.1f} % of "
        f"{st['total_input_tokens']:,} input tokens (unlimited cache)"
    )
    if capacities:
        lines.append(f"LRU prefix-hit rate by cache size ({st['block_size']}-token blocks):")
        rows = [
            (
                f"{_tokens(p['capacity_tokens'])} tokens",
                f"{p['capacity_blocks']:,} blocks",
                f"{100 * p['hit_rate']:.1f} %",
            )
            for p in st["lru_hit_rate"]
        ]
        rows.append(("unlimited", "", f"{100 * st['max_prefix_hit_rate']:.1f} %"))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines.extend(f"  {a:>{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}" for a, b, c in rows)
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
