"""``pagedkv simulate --sweep``: its points run in order, here or on Ray, then its table.

Every value of the swept axis gets a point, a value that is not valid
included (reported with its reason); the points run one after the other, in
``--jobs`` worker processes or as Ray tasks (``pagedkv.sim.parallel``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..sim.runner import SimConfig
from ..sim.workloads import Workload
from .options import UsageError
from .output import json_text, write_outputs


def check_sweep_backend(args: argparse.Namespace) -> None:
    """Refuses a bad --jobs or --ray-address before anything runs; leaves
    ``args.jobs`` an int."""
    from ..sim import parallel

    given = [
        f for f, v in (("--jobs", args.jobs), ("--ray-address", args.ray_address)) if v is not None
    ]
    if given and not args.sweep:
        raise UsageError(f"{' and '.join(given)} run the points of a --sweep: give --sweep")
    if len(given) == 2:
        raise UsageError("--jobs runs the points on this machine, --ray-address on Ray: give one")
    try:
        args.jobs = parallel.parse_jobs(args.jobs) if args.jobs is not None else 1
        if args.ray_address is not None:
            parallel.check_ray_address(args.ray_address)
            parallel.import_ray()
    except (ValueError, ImportError) as e:
        raise UsageError(str(e)) from None


def run_sweep(
    args: argparse.Namespace,
    out: Any,
    err: Any,
    axis: str,
    order: Sequence[tuple[str, tuple[str, SimConfig, str, float] | str]],
    workload_for: Callable[[str, float], Workload],
) -> int:
    from rich.table import Table

    from ..sim import parallel, plot, sweep
    from ..sim.traces import prefix_hit_ceiling

    runs = [(i, variant) for i, (_, variant) in enumerate(order) if not isinstance(variant, str)]
    assert runs  # _simulate refuses a sweep without a valid value
    # The workloads at the scale every point shares; a time-scale sweep's points
    # scale a copy where they run.
    scale = 1.0 if axis == "time-scale" else args.time_scale
    workloads = parallel.SweepWorkloads(
        {v[2]: workload_for(v[2], scale) for _, v in runs}, time_scale=scale
    )
    todo = [
        parallel.SweepPoint(axis, label.partition("=")[2], label, cfg, wname, s)
        for _, (label, cfg, wname, s) in runs
    ]
    lines = not args.quiet and not args.json
    with parallel.points_progress(err, lines and err.is_terminal, f"sweep of {axis}") as bar:
        task = bar.add_task("", total=len(todo))
        completed = [0]

        def done(i: int, p: dict[str, Any]) -> None:
            bar.advance(task)
            completed[0] += 1
            if lines:
                text = f"[{completed[0]}/{len(todo)}] {sweep.line(todo[i].label, p)}"
                err.print(text, markup=False, highlight=False, soft_wrap=True)

        records = iter(
            parallel.run_points(
                todo, workloads, jobs=args.jobs, ray_address=args.ray_address, on_done=done
            )
        )
    points = [
        sweep.invalid_point(axis, label.partition("=")[2], variant)
        if isinstance(variant, str)
        else next(records)
        for label, variant in order
    ]
    first = runs[0][1]
    w0 = workloads.get(first[2], first[3])
    ceiling = round(prefix_hit_ceiling(w0, first[1].block_size), 6)
    summary = w0.summary(first[1].tick_s)
    del w0, workloads
    outputs: list[tuple[str, str, Callable[[], None]]] = []
    if args.csv:
        outputs.append(("CSV", args.csv, lambda: sweep.write_csv(points, args.csv)))
    if args.plot:
        outputs.append(
            (
                "plot",
                args.plot,
                lambda: plot.plot_sweep(
                    axis,
                    points,
                    args.plot,
                    ceiling=ceiling if axis != "workload" else None,
                    title=f"pagedkv simulate: {summary['name']} on {args.model}, sweep of {axis}",
                ),
            )
        )
    if args.json:
        doc = {
            "axis": axis,
            "workload": summary,
            "prefix_hit_ceiling": ceiling,
            "points": points,
        }
        sys.stdout.write(json_text(doc))
        return write_outputs(out, True, outputs)
    t = Table(title=f"pagedkv simulate: sweep of {axis}", title_justify="left")
    tiered = any(p.get("host_hit_rate") or p.get("disk_hit_rate") for p in points)
    cols = [axis, "capacity tokens", "hit rate"]
    if tiered:
        cols.append("device / host / disk")
    cols += ["preemptions", "TTFT p50 / p99 ms", "TPOT p99 ms", "req/s"]
    for col in cols:
        t.add_column(col, justify="right")
    for p in points:
        if p["status"] != "ok":
            reason = p["reason"].split(". ")[0]
            t.add_row(str(p["value"]), "", f"{p['status']}: {reason}", *[""] * (len(cols) - 3))
            continue
        tiers = (
            [
                f"{100 * p['device_hit_rate']:.1f} / {100 * p['host_hit_rate']:.1f} / "
                f"{100 * p['disk_hit_rate']:.1f}%"
            ]
            if tiered
            else []
        )
        t.add_row(
            str(p["value"]),
            f"{p['capacity_tokens']:,}",
            f"{100 * p['hit_rate']:.1f}%",
            *tiers,
            f"{p['preemptions']:,}",
            f"{p['ttft_ms']['p50']:,.1f} / {p['ttft_ms']['p99']:,.1f}",
            f"{p['tpot_ms']['p99']:,.1f}",
            f"{p['throughput']['requests_per_s']:,.2f}",
        )
    out.print(t)
    out.print(f"prefix-hit ceiling of the workload (unlimited cache): {100 * ceiling:.1f}%")
    return write_outputs(out, False, outputs)
