"""The ``pagedkv`` command line. ``pagedkv simulate --help`` explains the simulator."""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from . import __version__, presets
from .errors import PagedKVError
from .manager import HASH_ALGOS
from .sim import runner
from .sim.cluster import ROUTERS
from .sim.outputs import OutputPathError, check_output
from .sim.perf import CLOCKS, GPUS
from .sim.runner import EngineUnavailableError, SimConfig, SimResult
from .sim.steptime import LinearModel
from .sim.tracefile import TraceFormatError, write_trace
from .sim.traces import FORMATS as TRACE_FORMATS
from .sim.traces import load_trace, scale_arrivals, trace_stats
from .sim.workloads import ARRIVALS, WORKLOADS, Workload, WorkloadOptions, generate

__all__ = ["main"]

SIMULATE_HELP = """\
Replay a serving workload through a vLLM-style continuous-batching scheduler
(FCFS admission with get_computed_blocks + allocate_slots, chunked prefill under a
token budget, batched decode, preemption by recompute) over pagedkv's real
KV-cache manager, on a clock where each step lasts what it computes on the GPU
(a roofline of the model on --gpu x --tp, or --step-time), and report what a
deployment would see: TTFT, TPOT, ITL, end-to-end and queueing latency,
throughput, prefix-hit rate, preemptions, KV-cache usage over time and the
manager's own cost per step.

With no arguments: the 'chat' workload on llama-3.1-8b on one H100-SXM, the KV
cache sized as vLLM sizes it (GPU memory x 0.9 less weights and activations).
"""

SIMULATE_EPILOG = """\
workloads (--workload, deterministic from --seed):
{workloads}
  or --trace FILE: pagedkv JSONL, Mooncake, BurstGPT or Azure (docs/simulate.md)

model presets (--model): {models}
GPUs (--gpu): {gpus}

--compare AXIS=V1,V2,... runs one simulation per value (repeat for a grid);
--sweep AXIS=V1,V2,... runs one per value of one axis and draws curves.
  axes: caching (on,off), block-size, hash ({hashes}), memory (GiB per GPU),
        num-blocks, model, workload, max-num-seqs, gpu, tp, quantization, clock, time-scale,
        router ({routers}), replicas, max-concurrency; '--compare caching' = on,off

examples:
  pagedkv simulate
  pagedkv simulate --workload agentic --memory 8 --plot agentic.png
  pagedkv simulate --workload tenants --compare workload=tenants,tenants-salted
  pagedkv simulate --compare caching --compare memory=2,4,8 --json
  pagedkv simulate --trace trace.jsonl.gz --model llama-4-scout --tp 4 --gpu H200
  pagedkv simulate --slo-ttft 500 --slo-tpot 50 --find-max-rate
  pagedkv simulate --workload agentic --sweep memory=2,4,8,16,32 --csv s.csv --plot s.png
  pagedkv simulate --replicas 4 --router prefix-aware --memory 2
  pagedkv simulate --engine vllm --vllm-python /path/to/venv-with-vllm/bin/python

exit status: 0 ok, 2 bad arguments or input, 3 the requested engine is unavailable.
"""

_AXES = (
    "caching",
    "block-size",
    "hash",
    "memory",
    "num-blocks",
    "model",
    "workload",
    "max-num-seqs",
    "gpu",
    "tp",
    "quantization",
    "clock",
    "time-scale",
    "router",
    "replicas",
    "max-concurrency",
)


class _UsageError(Exception):
    pass


#: The most runs one --compare grid or --sweep makes.
MAX_VARIANTS = 256


#: The largest value any count or amount on the command line may take.
MAX_ARG = 10**9


def _number(s: str, kind: type[int] | type[float], what: str) -> Any:
    try:
        return kind(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}, got {s!r}") from None


def _positive_float(s: str) -> float:
    v: float = _number(s, float, f"must be a positive finite number up to {MAX_ARG}")
    if not 0 < v <= MAX_ARG:
        raise argparse.ArgumentTypeError(
            f"must be a positive finite number up to {MAX_ARG}, got {s}"
        )
    return v


#: The most replicas one simulation runs.
MAX_REPLICAS = 256


def _replica_count(s: str) -> int:
    v: int = _number(s, int, f"must be 1 to {MAX_REPLICAS}")
    if not 0 < v <= MAX_REPLICAS:
        raise argparse.ArgumentTypeError(f"must be 1 to {MAX_REPLICAS}, got {s}")
    return v


#: The largest --max-concurrency.
MAX_CONCURRENCY = 10**6


def _concurrency(s: str) -> int:
    v: int = _number(s, int, f"must be an integer from 1 to {MAX_CONCURRENCY}")
    if not 0 < v <= MAX_CONCURRENCY:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to {MAX_CONCURRENCY}, got {s}")
    return v


def _fraction(s: str) -> float:
    v: float = _number(s, float, "must be in (0, 1]")
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {s}")
    return v


def _positive_int(s: str) -> int:
    v: int = _number(s, int, f"must be a positive integer up to {MAX_ARG}")
    if not 0 < v <= MAX_ARG:
        raise argparse.ArgumentTypeError(f"must be a positive integer up to {MAX_ARG}, got {s}")
    return v


#: The most requests a built-in workload may generate.
MAX_REQUESTS = 10_000_000


def _request_count(s: str) -> int:
    v: int = _number(s, int, f"must be a positive integer up to {MAX_REQUESTS}")
    if not 0 < v <= MAX_REQUESTS:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer up to {MAX_REQUESTS}, got {s}"
        )
    return v


def _simulate_parser(sub: Any) -> argparse.ArgumentParser:
    workloads = "\n".join(f"  {n:<16}{d}" for n, (_, d) in WORKLOADS.items())
    p: argparse.ArgumentParser = sub.add_parser(
        "simulate",
        help="simulate a serving workload over the manager",
        description=SIMULATE_HELP,
        epilog=SIMULATE_EPILOG.format(
            workloads=workloads,
            models=", ".join(presets.names()),
            hashes=", ".join(HASH_ALGOS),
            gpus=", ".join(GPUS),
            routers=", ".join(ROUTERS),
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("workload")
    src = g.add_mutually_exclusive_group()
    src.add_argument(
        "--workload",
        "-w",
        default="chat",
        choices=list(WORKLOADS),
        metavar="NAME",
        help="built-in workload (default: chat)",
    )
    src.add_argument(
        "--trace",
        metavar="FILE",
        help="replay a trace instead (pagedkv JSONL, Mooncake, BurstGPT or Azure; gzip ok)",
    )
    g.add_argument(
        "--time-scale",
        type=_positive_float,
        default=1.0,
        metavar="X",
        help="arrivals X times faster (X > 1: more load; default 1)",
    )
    g.add_argument(
        "--trace-format",
        choices=("auto", *TRACE_FORMATS),
        default="auto",
        help="the --trace file's format (default: detected from its content)",
    )
    g.add_argument(
        "--requests",
        "-n",
        type=_request_count,
        metavar="N",
        help=f"number of requests, up to {MAX_REQUESTS:,} (default: the workload's, 500-1000)",
    )
    g.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    g.add_argument(
        "--arrival",
        choices=ARRIVALS,
        default=None,
        help="arrival process of requests / session starts (default poisson)",
    )
    g.add_argument(
        "--rate",
        type=_positive_float,
        metavar="R",
        help="mean arrivals per second (default: the workload's)",
    )
    g.add_argument(
        "--tenants",
        type=_positive_int,
        default=None,
        metavar="N",
        help="tenants behind the requests (default 8)",
    )
    g.add_argument("--cache-salt", action="store_true", help="give each tenant its own cache salt")
    g.add_argument(
        "--loras",
        type=int,
        default=None,
        metavar="N",
        help="LoRA adapters, tenant t uses adapter t %% N (default 0: none)",
    )
    g.add_argument(
        "--step-ms",
        type=_positive_float,
        default=50.0,
        metavar="MS",
        help="milliseconds per arrival tick of the built-in workloads and of trace "
        "records timed in steps (default 50)",
    )
    g.add_argument(
        "--max-concurrency",
        type=_concurrency,
        metavar="N",
        help="closed-loop clients: at most N requests in flight; a request waits "
        "client-side for one to finish and arrives when sent (benchmark_serving's "
        "--max-concurrency; default: no limit)",
    )
    g.add_argument("--save-trace", metavar="FILE", help="also write the workload as a JSONL trace")
    g = p.add_argument_group("model and memory")
    g.add_argument(
        "--model",
        "-m",
        default="llama-3.1-8b",
        metavar="PRESET|CONFIG",
        help="model preset, or the path of a Hugging Face config.json (default llama-3.1-8b)",
    )
    g.add_argument(
        "--gpu",
        default="H100-SXM",
        choices=list(GPUS),
        metavar="NAME",
        help="GPU preset: step times and memory (default H100-SXM)",
    )
    g.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel GPUs (default 1)")
    g.add_argument(
        "--quantization",
        choices=presets.QUANTIZATIONS,
        default="none",
        help="weight quantization, as vLLM's --quantization: fp8 stores the linear layers' "
        "weights in one byte and runs them at the FP8 peak (default none: the checkpoint's "
        "own; the -fp8 presets are FP8 checkpoints)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=0.9,
        metavar="F",
        help="share of GPU memory vLLM may use (default 0.9)",
    )
    mem = g.add_mutually_exclusive_group()
    mem.add_argument(
        "--memory",
        type=_positive_float,
        metavar="GIB",
        help="KV-cache memory per GPU, GiB (default: what the GPU leaves after the "
        "weights and activations)",
    )
    mem.add_argument(
        "--num-blocks",
        type=_positive_int,
        metavar="N",
        help="a fixed number of blocks instead of --memory",
    )
    g.add_argument("--block-size", type=_positive_int, default=16, help="tokens per block")
    g.add_argument(
        "--on-overlong",
        choices=runner.OVERLONG,
        default="reject",
        help="a request whose prompt + output tokens exceed --max-model-len (else the "
        "model's context): reject and count it, as vLLM's server answers it with a 400 "
        "(default), or fail before running",
    )
    g.add_argument("--kv-dtype", default="bfloat16", help="KV-cache dtype (default bfloat16)")
    g.add_argument(
        "--max-model-len",
        type=_positive_int,
        metavar="N",
        help="default: the longest request the model's context accepts, rounded up to "
        "1024; also caps the built-in workloads' requests (default 16384, or the model's "
        "context if shorter)",
    )
    g = p.add_argument_group("manager and scheduler")
    g.add_argument("--no-caching", action="store_true", help="turn prefix caching off")
    g.add_argument(
        "--hash", choices=HASH_ALGOS, default="sha256_cbor", help="block hash (default sha256_cbor)"
    )
    g.add_argument("--max-num-seqs", type=_positive_int, default=256)
    g.add_argument(
        "--replicas",
        type=_replica_count,
        default=1,
        metavar="N",
        help="serving replicas, each with its own manager and scheduler (default 1)",
    )
    g.add_argument(
        "--router",
        choices=ROUTERS,
        default="round-robin",
        help="how requests reach the replicas (default round-robin; docs/simulate.md)",
    )
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192)
    g.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="AXIS=V1,V2",
        help="run variants side by side (see below)",
    )
    g.add_argument(
        "--sweep",
        metavar="AXIS=V1,V2",
        help="one run per value of a --compare axis, every point reported even when it "
        "does not fit (table, --json, --csv, --plot curves)",
    )
    g.add_argument(
        "--engine",
        choices=("pagedkv", "vllm"),
        default="pagedkv",
        help="vllm: also run vLLM's own KVCacheManager and compare",
    )
    g.add_argument(
        "--vllm-python", metavar="PATH", help="a Python with vllm installed, for --engine vllm"
    )
    g = p.add_argument_group("time and SLOs")
    g.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="vllm",
        help="the serving engine the roofline's efficiencies and overheads were calibrated "
        "on (docs/simulate.md, 'Calibration'; default vllm)",
    )
    g.add_argument(
        "--step-time",
        metavar="A,B,C,D",
        help="linear step-time model instead of the roofline: ms = A + B*prefill tokens/1000 "
        "+ C*decode sequences + D*context tokens/1000",
    )
    g.add_argument("--slo-ttft", type=_positive_float, metavar="MS", help="TTFT SLO (ms)")
    g.add_argument("--slo-tpot", type=_positive_float, metavar="MS", help="TPOT SLO (ms)")
    g.add_argument(
        "--slo-target",
        type=_fraction,
        default=0.9,
        metavar="F",
        help="share of requests that must meet the SLOs, for --find-max-rate (default 0.9)",
    )
    g.add_argument(
        "--find-max-rate",
        action="store_true",
        help="search --time-scale for the highest arrival rate meeting the SLOs",
    )
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print the results as JSON only")
    g.add_argument("--series", action="store_true", help="with --json: include the per-step series")
    g.add_argument(
        "--plot",
        metavar="FILE",
        help="over time: KV usage, running/waiting requests, preemptions, rolling hit rate; "
        "with --sweep: hit rate (and its ceiling), preemptions, TTFT p99 and throughput "
        "against the swept value (.png, .svg or .pdf)",
    )
    g.add_argument(
        "--csv",
        metavar="FILE",
        help="one CSV row per run (sweep point or variant): wide comparisons stay readable",
    )
    g.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    g = p.add_argument_group("sweeps")
    g.add_argument(
        "--jobs",
        metavar="N",
        help="run the --sweep points in N worker processes on this machine (default 1: "
        "one after the other)",
    )
    g.add_argument(
        "--ray-address",
        metavar="auto|local|HOST:PORT",
        help="run each --sweep point as a Ray task: on the cluster at HOST:PORT or the one "
        "this machine belongs to (auto), or on a Ray instance started for the sweep (local); "
        "pip install 'pagedkv[ray]'",
    )
    return p


def _parse_compare(specs: Sequence[str]) -> list[tuple[str, list[str]]]:
    axes: list[tuple[str, list[str]]] = []
    for spec in specs:
        axis, _, values = spec.partition("=")
        axis = axis.strip()
        if axis not in _AXES:
            raise _UsageError(f"--compare: unknown axis {axis!r} (axes: {', '.join(_AXES)})")
        vals = [v.strip() for v in values.split(",") if v.strip()] if values else []
        if not vals:
            if axis != "caching":
                raise _UsageError(f"--compare {axis}=V1,V2,...: give the values")
            vals = ["on", "off"]
        if any(a == axis for a, _ in axes):
            raise _UsageError(f"--compare: axis {axis!r} given twice")
        axes.append((axis, vals))
    variants = math.prod(len(v) for _, v in axes)
    if variants > MAX_VARIANTS:
        raise _UsageError(
            f"{' x '.join(str(len(v)) for _, v in axes)} = {variants:,} variants: more than "
            f"the limit of {MAX_VARIANTS} runs"
        )
    return axes


def _apply(
    axis: str, value: str, cfg: SimConfig, workload: str, scale: float, flag: str = "--compare"
) -> tuple[SimConfig, str, float]:
    try:
        if axis == "workload":
            if value not in WORKLOADS:
                raise ValueError(f"built-in workloads: {', '.join(WORKLOADS)}")
            return cfg, value, scale
        if axis == "time-scale":
            return cfg, workload, _positive_float(value)
        return _apply_config(axis, value, cfg), workload, scale
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise _UsageError(f"{flag} {axis}={value}: {e}") from None


def _apply_config(axis: str, value: str, cfg: SimConfig) -> SimConfig:
    if axis == "caching":
        if value not in ("on", "off"):
            raise ValueError("caching is on or off")
        return replace(cfg, enable_caching=value == "on")
    if axis == "block-size":
        return replace(cfg, block_size=_positive_int(value))
    if axis == "hash":
        if value not in HASH_ALGOS:
            raise ValueError(f"hash is one of {', '.join(HASH_ALGOS)}")
        return replace(cfg, hash_algo=value)
    if axis == "memory":
        return replace(cfg, memory_gib=_positive_float(value), num_blocks=None)
    if axis == "num-blocks":
        return replace(cfg, num_blocks=_positive_int(value))
    if axis == "model":
        return replace(cfg, model=value)
    if axis == "gpu":
        if value not in GPUS:
            raise ValueError(f"GPUs: {', '.join(GPUS)}")
        return replace(cfg, gpu=value)
    if axis == "tp":
        return replace(cfg, tp=_positive_int(value))
    if axis == "clock":
        if value not in CLOCKS:
            raise ValueError(f"clocks: {', '.join(CLOCKS)}")
        return replace(cfg, clock=value)
    if axis == "quantization":
        if value not in presets.QUANTIZATIONS:
            raise ValueError(f"quantizations: {', '.join(presets.QUANTIZATIONS)}")
        return replace(cfg, quantization=value)
    if axis == "replicas":
        return replace(cfg, replicas=_replica_count(value))
    if axis == "max-concurrency":
        return replace(cfg, max_concurrency=_concurrency(value))
    if axis == "router":
        if value not in ROUTERS:
            raise ValueError(f"routers: {', '.join(ROUTERS)}")
        return replace(cfg, router=value)
    return replace(cfg, max_num_seqs=_positive_int(value))


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


def _simulate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .sim import plot, report

    out = Console(soft_wrap=True)
    if not out.is_terminal:  # files and pipes: room for a few variants side by side
        out.width = max(out.width, 120)
    err = Console(stderr=True)
    if args.sweep and (args.compare or args.engine == "vllm" or args.find_max_rate):
        raise _UsageError("--sweep runs alone: drop --compare, --engine vllm, --find-max-rate")
    _check_sweep_backend(args)
    if args.plot:
        try:
            plot._format(args.plot)
        except ValueError as e:
            raise _UsageError(str(e)) from None
    _check_outputs(args)
    axes = _parse_compare([args.sweep] if args.sweep else args.compare)
    if args.save_trace and any(a == "workload" for a, _ in axes):
        raise _UsageError(
            "--save-trace writes one workload: drop --compare/--sweep workload=..., or save "
            "each workload in its own run"
        )
    if args.engine == "vllm" and axes:
        raise _UsageError(
            "--engine vllm compares the two managers on one configuration; drop --compare"
        )
    if args.engine == "vllm" and (
        args.replicas > 1 or any(a in ("replicas", "router") for a, _ in axes)
    ):
        raise _UsageError("--engine vllm runs one replica")
    if args.vllm_python and args.engine != "vllm":
        raise _UsageError("--vllm-python goes with --engine vllm")
    if args.trace and any(a == "workload" for a, _ in axes):
        raise _UsageError("--compare workload=... uses built-in workloads, not --trace")
    if args.series and not args.json:
        raise _UsageError("--series goes with --json")
    if args.loras is not None and not 0 <= args.loras <= MAX_ARG:
        raise _UsageError(f"--loras must be 0 to {MAX_ARG}, got {args.loras}")
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
            raise _UsageError(
                f"{', '.join(shaping)} shape the built-in workloads; --trace replays the "
                "trace's own requests (drop them, or cut the trace)"
            )

    if args.find_max_rate and args.slo_ttft is None and args.slo_tpot is None:
        raise _UsageError("--find-max-rate needs --slo-ttft and/or --slo-tpot")
    if args.find_max_rate and (axes or args.engine == "vllm"):
        raise _UsageError("--find-max-rate searches one configuration: drop --compare/--engine")
    if args.step_time is not None:
        try:
            LinearModel.parse(args.step_time)
        except ValueError as e:
            raise _UsageError(str(e)) from None
    base = SimConfig(
        model=args.model,
        memory_gib=args.memory,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        kv_dtype=args.kv_dtype,
        max_model_len=args.max_model_len,
        enable_caching=not args.no_caching,
        hash_algo=args.hash,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu=args.gpu,
        tp=args.tp,
        quantization=args.quantization,
        replicas=args.replicas,
        router=args.router,
        gpu_memory_utilization=args.gpu_memory_utilization,
        step_time=args.step_time,
        clock=args.clock,
        tick_s=args.step_ms / 1000,
        slo_ttft_ms=args.slo_ttft,
        slo_tpot_ms=args.slo_tpot,
        max_concurrency=args.max_concurrency,
        on_overlong=args.on_overlong,
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
                cfg, wname, scale = _apply(axis, value, cfg, wname, scale, flag)
        except _UsageError as e:
            if not args.sweep:
                raise
            order.append((label, str(e)))
            continue
        same = next((v[0] for v in variants if v[1:] == (cfg, wname, scale)), None)
        if same is not None:
            raise _UsageError(f"{flag}: {label} repeats {same} (give each value once)")
        variants.append((label, cfg, wname, scale))
        order.append((label, variants[-1]))
    if not variants:
        raise _UsageError(str(order[0][1]))

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
                raise _UsageError(str(e)) from None
            except ValueError:
                pass  # another refusal (an unknown model): the run reports it
    if args.save_trace:
        write_trace(workload_for(variants[0][2], variants[0][3]), args.save_trace)
    if args.find_max_rate:
        return _find_max_rate(args, out, err, base, workload_for(args.workload, 1.0))

    if args.sweep:
        return _sweep(args, out, err, axes[0][0], order, workload_for)

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
        sys.stdout.write(_json_text(doc))
    else:
        report.print_summary(out, summaries, results, ratio=ratio)
        if args.save_trace:
            out.print(f"trace written to {args.save_trace}")
    outputs: list[tuple[str, str, Callable[[], None]]] = []
    if args.csv:
        from .sim import sweep

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
                    title=_title(summaries[0], base, [a for a, _ in axes]),
                ),
            )
        )
    return _write_outputs(out, args.json, outputs)


def _json_text(doc: Any) -> str:
    """``doc`` as JSON text; JSON has no NaN or Infinity, and none is ever printed."""
    try:
        return json.dumps(doc, indent=2, allow_nan=False) + "\n"
    except ValueError:
        raise ValueError(
            "a figure of the results is not a finite number: nothing printed"
        ) from None


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuses, before any simulation, an output that cannot be written or that
    would overwrite an input (the trace, the model's config.json) or another
    output (``pagedkv.sim.outputs``)."""
    inputs = [p for p in (args.trace, args.model) if p and os.path.exists(p)]
    given = [
        (option, path)
        for option, path in (
            ("--plot", args.plot),
            ("--csv", args.csv),
            ("--save-trace", args.save_trace),
        )
        if path is not None
    ]
    for i, (option, path) in enumerate(given):
        try:
            check_output(path, inputs=inputs, others=[p for _, p in given[:i]], what=option)
        except OutputPathError as e:
            raise _UsageError(str(e)) from None


def _write_outputs(
    out: Any, quiet: bool, outputs: Sequence[tuple[str, str, Callable[[], None]]]
) -> int:
    """Writes each output after the results were printed: one that fails is
    reported (exit status 2) without losing the others or the printed results."""
    code = 0
    for what, path, write in outputs:
        try:
            write()
        except (OSError, ValueError, ImportError) as e:
            print(f"pagedkv simulate: error: {what} {path}: {e}", file=sys.stderr)
            code = 2
            continue
        if not quiet:
            out.print(f"{what} written to {path}")
    return code


def _title(workload: dict[str, Any], cfg: SimConfig, varied: Sequence[str] = ()) -> str:
    parts = [f"pagedkv simulate: {workload['name']}"]
    if "model" not in varied:
        parts.append(cfg.model)
    if not {"gpu", "tp"} & set(varied):
        parts.append("--step-time" if cfg.step_time else f"{cfg.tp} x {cfg.gpu}")
    if not {"memory", "num-blocks"} & set(varied):
        parts.append(
            f"{cfg.memory_gib:g} GiB KV/GPU" if cfg.memory_gib else "KV sized by vLLM's rule"
        )
    return ", ".join(parts)


def _check_sweep_backend(args: argparse.Namespace) -> None:
    """Refuses a bad --jobs or --ray-address before anything runs; leaves
    ``args.jobs`` an int."""
    from .sim import parallel

    given = [
        f for f, v in (("--jobs", args.jobs), ("--ray-address", args.ray_address)) if v is not None
    ]
    if given and not args.sweep:
        raise _UsageError(f"{' and '.join(given)} run the points of a --sweep: give --sweep")
    if len(given) == 2:
        raise _UsageError("--jobs runs the points on this machine, --ray-address on Ray: give one")
    try:
        args.jobs = parallel.parse_jobs(args.jobs) if args.jobs is not None else 1
        if args.ray_address is not None:
            parallel.check_ray_address(args.ray_address)
            parallel.import_ray()
    except (ValueError, ImportError) as e:
        raise _UsageError(str(e)) from None


def _sweep(
    args: argparse.Namespace,
    out: Any,
    err: Any,
    axis: str,
    order: Sequence[tuple[str, tuple[str, SimConfig, str, float] | str]],
    workload_for: Callable[[str, float], Workload],
) -> int:
    from rich.table import Table

    from .sim import parallel, plot, sweep
    from .sim.traces import prefix_hit_ceiling

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
        sys.stdout.write(_json_text(doc))
        return _write_outputs(out, True, outputs)
    t = Table(title=f"pagedkv simulate: sweep of {axis}", title_justify="left")
    for col in (axis, "hit rate", "preemptions", "TTFT p50 / p99 ms", "TPOT p99 ms", "req/s"):
        t.add_column(col, justify="right")
    for p in points:
        if p["status"] != "ok":
            reason = p["reason"].split(". ")[0]
            t.add_row(str(p["value"]), f"{p['status']}: {reason}", "", "", "", "")
            continue
        t.add_row(
            str(p["value"]),
            f"{100 * p['hit_rate']:.1f}%",
            f"{p['preemptions']:,}",
            f"{p['ttft_ms']['p50']:,.1f} / {p['ttft_ms']['p99']:,.1f}",
            f"{p['tpot_ms']['p99']:,.1f}",
            f"{p['throughput']['requests_per_s']:,.2f}",
        )
    out.print(t)
    out.print(f"prefix-hit ceiling of the workload (unlimited cache): {100 * ceiling:.1f}%")
    return _write_outputs(out, False, outputs)


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
        sys.stdout.write(_json_text(found))
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


def build_parser() -> argparse.ArgumentParser:
    """The ``pagedkv`` argument parser."""
    p = argparse.ArgumentParser(
        prog="pagedkv", description="pagedkv: a KV-cache block manager for LLM serving."
    )
    p.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    _simulate_parser(sub)
    _calibrate_parser(sub)
    ts = sub.add_parser(
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
        type=_positive_int,
        default=16,
        help="block of the prefix-hit ceiling for token traces (default 16; Mooncake: 512)",
    )
    ts.add_argument("--step-ms", type=_positive_float, default=50.0, help=argparse.SUPPRESS)
    ts.add_argument(
        "--capacity",
        metavar="C1,C2,...",
        help="also the hit rate of one LRU cache of each size (tokens, e.g. 1e5,1e6,1e7), "
        "replaying the requests in order with no serving constraints (Mooncake's Figure 9)",
    )
    ts.add_argument("--json", action="store_true", help="print the figures as JSON")
    return p


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
            raise _UsageError(
                f"--capacity: {part!r} is not a number of tokens (a positive finite number "
                f"up to {MAX_CAPACITY:.0e})"
            )
        if v in values:
            raise _UsageError(f"--capacity: {part} given twice")
        values.append(v)
    if len(values) > MAX_CAPACITIES:
        raise _UsageError(f"--capacity: {len(values)} values, more than {MAX_CAPACITIES}")
    return values


def _tokens(c: float) -> str:
    return f"{c:,.0f}" if c == int(c) else f"{c:,.1f}"


def _trace_stats(args: argparse.Namespace) -> int:
    capacities = _capacities(args.capacity) if args.capacity is not None else []
    st = trace_stats(
        args.file,
        None if args.trace_format == "auto" else args.trace_format,
        block_size=args.block_size,
        step_ms=args.step_ms,
        capacities=capacities,
    )
    if args.json:
        sys.stdout.write(_json_text(st))
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


CALIBRATE_HELP = """\
Fit the simulator's linear step-time model (--step-time A,B,C,D: ms = A + B x
prefill tokens/1000 + C x decode sequences + D x context tokens/1000) to your own
benchmark results: the JSON files vLLM's benchmark_serving.py / 'vllm bench serve
--save-result' writes (--save-detailed ones give per-request lengths). Each file
is replayed on the model, GPUs and scheduler limits given here, the way its client
sent it (--max-concurrency clients, --request-rate arrivals, or all at once), and
the coefficients are fitted to the files' mean TTFT, mean TPOT (else ITL) and
duration by non-negative least squares, re-simulating until they settle.
"""

CALIBRATE_EPILOG = """\
give benchmarks at two or more concurrencies and several lengths: one concurrency
cannot tell the per-step coefficient A from the per-sequence one C.

examples:
  vllm bench serve ... --max-concurrency 1  --save-result --result-filename c1.json
  vllm bench serve ... --max-concurrency 32 --save-result --result-filename c32.json
  pagedkv calibrate c1.json c8.json c32.json --model llama-3.1-8b --gpu H100-SXM
  pagedkv simulate --step-time 4.1,24,0.081,0.015 ...

exit status: 0 ok, 2 bad arguments or input (or too few figures to fit).
"""

#: The most benchmark files one calibration reads.
MAX_CALIBRATE_FILES = 256


def _calibrate_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "calibrate",
        help="fit --step-time to benchmark_serving results",
        description=CALIBRATE_HELP,
        epilog=CALIBRATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help="benchmark_serving / vllm bench serve result JSON (one run each, or several "
        "appended with --append-result)",
    )
    g = p.add_argument_group("the deployment that was benchmarked")
    g.add_argument(
        "--model",
        "-m",
        default="llama-3.1-8b",
        metavar="PRESET|CONFIG",
        help="model preset, or the path of a Hugging Face config.json (default llama-3.1-8b)",
    )
    g.add_argument(
        "--gpu", default="H100-SXM", choices=list(GPUS), metavar="NAME", help="GPU preset"
    )
    g.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel GPUs (default 1)")
    g.add_argument(
        "--quantization",
        choices=presets.QUANTIZATIONS,
        default="none",
        help="weight quantization, as vLLM's --quantization (default none)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=0.9,
        metavar="F",
        help="share of GPU memory vLLM may use (default 0.9)",
    )
    mem = g.add_mutually_exclusive_group()
    mem.add_argument(
        "--memory",
        type=_positive_float,
        metavar="GIB",
        help="KV-cache memory per GPU, GiB (default: what the GPU leaves)",
    )
    mem.add_argument("--num-blocks", type=_positive_int, metavar="N", help="a fixed block count")
    g.add_argument("--block-size", type=_positive_int, default=16, help="tokens per block")
    g.add_argument("--kv-dtype", default="bfloat16", help="KV-cache dtype (default bfloat16)")
    g.add_argument(
        "--max-model-len",
        type=_positive_int,
        metavar="N",
        help="default: the longest request, rounded up to 1024",
    )
    g.add_argument("--max-num-seqs", type=_positive_int, default=256)
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192)
    g = p.add_argument_group("fit and output")
    g.add_argument(
        "--seed", type=int, default=0, help="seed of the replayed arrival times (default 0)"
    )
    g.add_argument("--json", action="store_true", help="print the fit as JSON only")
    return p


_CALIBRATE_FIGURES = (
    ("mean_ttft_ms", "TTFT mean (ms)"),
    ("mean_tpot_ms", "TPOT mean (ms)"),
    ("mean_itl_ms", "ITL mean (ms)"),
    ("output_throughput", "output tok/s"),
    ("duration", "duration (s)"),
)


def _calibrate(args: argparse.Namespace) -> int:
    from .sim import stepfit

    if len(args.files) > MAX_CALIBRATE_FILES:
        raise _UsageError(f"at most {MAX_CALIBRATE_FILES} benchmark files, got {len(args.files)}")
    if not 0 <= args.seed < 2**63:
        raise _UsageError(f"--seed must be 0 to 2^63 - 1, got {args.seed}")
    cfg = SimConfig(
        model=args.model,
        memory_gib=args.memory,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        kv_dtype=args.kv_dtype,
        max_model_len=args.max_model_len,
        enable_caching=False,
        hash_algo="xxh3_native",
        background_hashing=False,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu=args.gpu,
        tp=args.tp,
        quantization=args.quantization,
        gpu_memory_utilization=args.gpu_memory_utilization,
        on_overlong="fail",
    )
    benchmarks = stepfit.load_all(args.files)
    result = stepfit.fit(benchmarks, cfg, seed=args.seed)
    for w in result.warnings:
        print(f"pagedkv calibrate: warning: {w}", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    for b, run in zip(benchmarks, result.runs, strict=True):
        fitted = b.fitted()
        keys = [k for k, _ in _CALIBRATE_FIGURES if k in b.measured]
        rows.append(
            {
                "file": b.name,
                "requests": b.num_requests,
                "mean_input_tokens": sum(b.input_lens) / b.num_requests,
                "mean_output_tokens": b.output_tokens / b.num_requests,
                "client": b.client(),
                "per_request_lengths": b.detailed,
                "fitted": fitted,
                "measured": {k: b.measured[k] for k in keys},
                "simulated": {k: run.figures[k] for k in keys},
                "error": {
                    k: run.figures[k] / b.measured[k] - 1.0 for k in keys if b.measured[k] > 0
                },
            }
        )
    m = result.model
    if args.json:
        doc = {
            "step_time": result.step_time,
            "coefficients_ms": {"a": m.a, "b": m.b, "c": m.c, "d": m.d},
            "rounds": result.rounds,
            "settled": result.settled,
            "warnings": result.warnings,
            "config": {
                "model": cfg.model,
                "gpu": cfg.gpu,
                "tp": cfg.tp,
                "max_num_seqs": cfg.max_num_seqs,
                "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "block_size": cfg.block_size,
                "kv_dtype": cfg.kv_dtype,
                "seed": args.seed,
            },
            "benchmarks": rows,
        }
        sys.stdout.write(_json_text(doc))
        return 0
    how = "settled" if result.settled else "stopped"
    lines = [
        f"pagedkv calibrate: {cfg.model} on {cfg.tp} x {cfg.gpu}, {len(benchmarks)} "
        f"benchmark(s), {how} after {result.rounds} round(s)",
        f"--step-time {result.step_time}",
        f"  ms = {m.a:.4g} + {m.b:.4g} x prefill tokens/1000 + {m.c:.4g} x decode sequences "
        f"+ {m.d:.4g} x context tokens/1000",
    ]
    for row in rows:
        lines.append("")
        lines.append(
            f"{row['file']}: {row['requests']:,} requests of {row['mean_input_tokens']:,.0f} "
            f"in / {row['mean_output_tokens']:,.0f} out tokens (mean), {row['client']}"
        )
        lines.append(f"  {'figure':<16} {'measured':>12} {'simulated':>12} {'error':>9}")
        for key, label in _CALIBRATE_FIGURES:
            if key not in row["measured"]:
                continue
            err = row["error"].get(key)
            lines.append(
                f"  {label:<16} {row['measured'][key]:>12,.3f} {row['simulated'][key]:>12,.3f} "
                + (f"{100 * err:>+8.1f}%" if err is not None else f"{'':>9}")
                + ("  fitted" if key in row["fitted"] else "")
            )
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pagedkv`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    prog = f"pagedkv {args.command}"
    try:
        if args.command == "calibrate":
            return _calibrate(args)
        return _trace_stats(args) if args.command == "trace-stats" else _simulate(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except EngineUnavailableError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 3
    except (_UsageError, TraceFormatError, PagedKVError, ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"{prog}: error: out of memory (make the workload smaller)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
