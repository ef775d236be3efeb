"""``pagedkv simulate``: checks the options, builds the runs, prints their results.

A plain run or a ``--compare`` grid runs here, one variant after the other;
``--sweep`` hands its points to ``sweeps.py``, ``--find-max-rate`` its search
to ``pagedkv.sim.runner``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from collections.abc import Callable, Iterable
from typing import Any

from ..sim import runner
from ..sim.runner import SimConfig, SimResult
from ..sim.steptime import LinearModel
from ..sim.tracefile import write_trace
from ..sim.traces import load_trace, scale_arrivals
from ..sim.workloads import Workload, WorkloadOptions
from .axes import apply, parse_compare
from .deployment import config_fields
from .options import MAX_ARG, UsageError
from .output import check_outputs, json_text, title, write_outputs
from .sweeps import check_sweep_backend, run_sweep

#: Makes a built-in workload by name: ``pagedkv.sim.workloads.generate``, which
#: ``pagedkv.cli.main`` passes as the package's ``generate`` (so it can be wrapped there).
Generate = Callable[[str, WorkloadOptions], Workload]


def _builtin_context(configs: Iterable[SimConfig]) -> int:
    """The longest request the built-in workloads make without --max-model-len:
    ``DEFAULT_MAX_CONTEXT``, or less for a model of a shorter context (the
    shortest of the runs' models), so that they make no request a model rejects."""
    contexts = [c for c in map(runner.model_context, configs) if c is not None]
    return min([runner.DEFAULT_MAX_CONTEXT, *contexts])


def _progress(console: Any, enabled: bool) -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("step {task.fields[step]:,}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not enabled,
    )


def run_simulate(args: argparse.Namespace, generate: Generate) -> int:
    """Runs ``pagedkv simulate`` with parsed ``args``; the exit status."""
    from rich.console import Console

    from ..sim import plot, report

    out = Console(soft_wrap=True)
    if not out.is_terminal:  # files and pipes: room for a few variants side by side
        out.width = max(out.width, 120)
    err = Console(stderr=True)
    if args.sweep and (args.compare or args.engine == "vllm" or args.find_max_rate):
        raise UsageError("--sweep runs alone: drop --compare, --engine vllm, --find-max-rate")
    check_sweep_backend(args)
    if args.plot:
        try:
            plot._format(args.plot)
        except ValueError as e:
            raise UsageError(str(e)) from None
    check_outputs(args)
    axes = parse_compare([args.sweep] if args.sweep else args.compare)
    if args.save_trace and any(a == "workload" for a, _ in axes):
        raise UsageError(
            "--save-trace writes one workload: drop --compare/--sweep workload=..., or save "
            "each workload in its own run"
        )
    if args.engine == "vllm" and axes:
        raise UsageError(
            "--engine vllm compares the two managers on one configuration; drop --compare"
        )
    if args.engine == "vllm" and (
        args.replicas > 1 or any(a in ("replicas", "router") for a, _ in axes)
    ):
        raise UsageError("--engine vllm runs one replica")
    tiered = (
        args.cpu_offload > 0
        or args.eviction != "lru"
        or any(a in ("cpu-offload", "disk-offload", "eviction") for a, _ in axes)
    )
    if args.engine == "vllm" and tiered:
        raise UsageError(
            "--engine vllm runs vLLM's device manager alone: drop --cpu-offload and --eviction"
        )
    if args.vllm_python and args.engine != "vllm":
        raise UsageError("--vllm-python goes with --engine vllm")
    if args.trace and any(a == "workload" for a, _ in axes):
        raise UsageError("--compare workload=... uses built-in workloads, not --trace")
    if args.series and not args.json:
        raise UsageError("--series goes with --json")
    if args.loras is not None and not 0 <= args.loras <= MAX_ARG:
        raise UsageError(f"--loras must be 0 to {MAX_ARG}, got {args.loras}")
    if args.trace:
        shaping = [
            option
            for option, value in (
                ("--requests/-n", args.requests),
                ("--rate", args.rate),
                ("--arrival", args.arrival),
                ("--tenants", args.tenants),
                ("--loras", args.loras),
                ("--cache-salt", args.cache_salt or None),
            )
            if value is not None
        ]
        if shaping:
            raise UsageError(
                f"{', '.join(shaping)} shape the built-in workloads; --trace replays the "
                "trace's own requests (drop them, or cut the trace)"
            )

    if args.find_max_rate and args.slo_ttft is None and args.slo_tpot is None:
        raise UsageError("--find-max-rate needs --slo-ttft and/or --slo-tpot")
    if args.find_max_rate and (axes or args.engine == "vllm"):
        raise UsageError("--find-max-rate searches one configuration: drop --compare/--engine")
    if args.step_time is not None:
        try:
            LinearModel.parse(args.step_time)
        except ValueError as e:
            raise UsageError(str(e)) from None
    base = SimConfig(
        **config_fields(args),
        enable_caching=not args.no_caching,
        hash_algo=args.hash,
        replicas=args.replicas,
        router=args.router,
        step_time=args.step_time,
        clock=args.clock,
        tick_s=args.step_ms / 1000,
        slo_ttft_ms=args.slo_ttft,
        slo_tpot_ms=args.slo_tpot,
        max_concurrency=args.max_concurrency,
        on_overlong=args.on_overlong,
        cpu_offload_gib=args.cpu_offload,
        disk_offload_gib=args.disk_offload,
        offload_policy=args.offload_policy,
        offload_write=args.offload_write,
        host_link=args.host_link,
        disk_gbps=args.disk_link,
        eviction=args.eviction,
        tier_weights=args.tier_weights,
    )
    variants: list[tuple[str, SimConfig, str, float]] = []
    # --sweep: every value gets a point, in order; one that is not a valid
    # value is reported with its reason (the others run).
    order: list[tuple[str, tuple[str, SimConfig, str, float] | str]] = []
    flag = "--sweep" if args.sweep else "--compare"
    for combo in itertools.product(*[[(a, v) for v in vals] for a, vals in axes]):
        label = ", ".join(f"{a}={v}" for a, v in combo) or "pagedkv"
        cfg, wname, scale = base, args.workload, args.time_scale
        try:
            for axis, value in combo:
                cfg, wname, scale = apply(axis, value, cfg, wname, scale, flag)
        except UsageError as e:
            if not args.sweep:
                raise
            order.append((label, str(e)))
            continue
        if cfg.disk_offload_gib > 0 and cfg.cpu_offload_gib == 0:
            bad = UsageError(
                f"{label}: a disk tier sits below host memory: --disk-offload needs --cpu-offload"
            )
            if not args.sweep:
                raise bad
            order.append((label, str(bad)))
            continue
        same = next((v[0] for v in variants if v[1:] == (cfg, wname, scale)), None)
        if same is not None:
            raise UsageError(f"{flag}: {label} repeats {same} (give each value once)")
        variants.append((label, cfg, wname, scale))
        order.append((label, variants[-1]))
    if not variants:
        raise UsageError(str(order[0][1]))

    opts = WorkloadOptions(
        seed=args.seed,
        num_requests=args.requests,
        rate=None if args.rate is None else args.rate * base.tick_s,
        arrival=args.arrival or "poisson",
        num_tenants=args.tenants or 8,
        cache_salt=args.cache_salt,
        num_loras=args.loras or 0,
        max_context=args.max_model_len or _builtin_context(v[1] for v in variants),
    )
    cache: dict[tuple[str, float], Workload] = {}

    def workload_for(name: str, scale: float) -> Workload:
        if (name, scale) not in cache:
            cache[name, scale] = scale_arrivals(
                load_trace(
                    args.trace,
                    None if args.trace_format == "auto" else args.trace_format,
                    step_ms=args.step_ms,
                    seed=args.seed,
                )
                if args.trace
                else generate(name, opts),
                scale,
            )
        return cache[name, scale]

    if args.on_overlong == "fail":
        # Refused before anything runs, as a server that fails on them would be.
        for _, cfg, wname, scale in variants:
            try:
                runner.admit(workload_for(wname, scale), cfg)
            except runner.OverlongRequestError as e:
                raise UsageError(str(e)) from None
            except ValueError:
                pass  # another refusal (an unknown model): the run reports it
    if args.save_trace:
        write_trace(workload_for(variants[0][2], variants[0][3]), args.save_trace)
    if args.find_max_rate:
        return _find_max_rate(args, out, err, base, workload_for(args.workload, 1.0))

    if args.sweep:
        return run_sweep(args, out, err, axes[0][0], order, workload_for)

    results: list[SimResult] = []
    summaries: list[dict[str, Any]] = []
    show = not args.quiet and err.is_terminal
    with _progress(err, show) as bar:
        for label, cfg, wname, scale in variants:
            loading = bar.add_task(
                f"reading {args.trace}" if args.trace else f"generating {wname}", total=None, step=0
            )
            w = workload_for(wname, scale)
            bar.remove_task(loading)
            task = bar.add_task(label, total=len(w.requests), step=0)

            def tick(clock: int, finished: int, task: Any = task) -> None:
                bar.update(task, completed=finished, step=clock)

            runs: list[Callable[[], SimResult]] = [
                functools.partial(runner.run_pagedkv, w, cfg, label=label, progress=tick)
            ]
            if args.engine == "vllm":
                runs.append(
                    functools.partial(
                        runner.run_vllm,
                        w,
                        cfg,
                        label="vllm",
                        vllm_python=args.vllm_python,
                        progress=tick,
                    )
                )
            for i, run in enumerate(runs):
                if i:
                    bar.reset(task, description="vLLM (its import takes ~10 s)", step=0)
                results.append(run())
                summaries.append(w.summary(base.tick_s))
            bar.remove_task(task)

    ratio = None
    if args.engine == "vllm" and results[0].us_per_step > 0:
        ratio = results[1].us_per_step / results[0].us_per_step
    if args.json:
        doc = report.to_json_obj(summaries, results, ratio=ratio, series=args.series)
        sys.stdout.write(json_text(doc))
    else:
        report.print_summary(out, summaries, results, ratio=ratio)
        if args.save_trace:
            out.print(f"trace written to {args.save_trace}")
    outputs: list[tuple[str, str, Callable[[], None]]] = []
    if args.csv:
        from ..sim import sweep

        rows = [sweep.point("variant", r.label, r) for r in results]
        outputs.append(("CSV", args.csv, lambda: sweep.write_csv(rows, args.csv)))
    if args.plot:
        outputs.append(
            (
                "plot",
                args.plot,
                lambda: plot.plot_results(
                    [r for r in results if r.series],
                    args.plot,
                    title=title(summaries[0], base, [a for a, _ in axes]),
                ),
            )
        )
    return write_outputs(out, args.json, outputs)


def _find_max_rate(
    args: argparse.Namespace,
    out: Any,
    err: Any,
    cfg: SimConfig,
    workload: Workload,
) -> int:
    def progress(x: float, att: float, rate: float) -> None:
        if not args.quiet and not args.json:
            err.print(f"time-scale {x:.4g}: {rate:,.3f} req/s, {100 * att:.1f} % meet the SLOs")

    found = runner.find_max_rate(
        workload, cfg, target=args.slo_target, base_scale=args.time_scale, progress=progress
    )
    if args.json:
        sys.stdout.write(json_text(found))
        return 0
    slo = " and ".join(
        f"{k} <= {v:g} ms"
        for k, v in (("TTFT", args.slo_ttft), ("TPOT", args.slo_tpot))
        if v is not None
    )
    best = found["max_rate"]
    if best is None:
        out.print(
            f"no arrival rate tried meets {slo} for {100 * args.slo_target:g} % of requests "
            f"(down to time-scale {found['lowest_scale_tried']:.4g})"
        )
    else:
        out.print(
            f"highest arrival rate with {100 * args.slo_target:g} % of requests meeting {slo}: "
            f"[bold]{best['requests_per_s']:,.3f} requests/s[/bold] (time-scale "
            f"{best['time_scale']:.4g}, {100 * best['slo_attainment']:.1f} % meet them, "
            f"TTFT p99 {best['ttft_ms']['p99']:,.0f} ms, TPOT p99 {best['tpot_ms']['p99']:,.1f} ms)"
        )
    return 0
