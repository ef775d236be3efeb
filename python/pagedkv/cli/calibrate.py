"""``pagedkv calibrate``: fits ``--step-time`` to benchmark results and prints the fit.

The deployment options are ``simulate``'s (``deployment.py``); the fit is
``pagedkv.sim.stepfit``'s.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..sim.runner import SimConfig
from .deployment import add_options, config_fields
from .options import UsageError
from .output import json_text

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

#: The deployment options it takes (``deployment.py``), in the order its help lists them.
OPTIONS = (
    "model",
    "gpu",
    "tp",
    "quantization",
    "gpu_memory_utilization",
    "memory",
    "num_blocks",
    "block_size",
    "kv_dtype",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
)

#: Where its help words a shared option its own way.
HELPS = {
    "gpu": "GPU preset",
    "quantization": "weight quantization, as vLLM's --quantization (default none)",
    "memory": "KV-cache memory per GPU, GiB (default: what the GPU leaves)",
    "num_blocks": "a fixed block count",
    "max_model_len": "default: the longest request, rounded up to 1024",
}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Adds ``calibrate`` to the subcommands ``sub``."""
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
    add_options(g, OPTIONS, helps=HELPS)
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


def run_calibrate(args: argparse.Namespace) -> int:
    """Runs ``pagedkv calibrate`` with parsed ``args``; the exit status."""
    from ..sim import stepfit

    if len(args.files) > MAX_CALIBRATE_FILES:
        raise UsageError(f"at most {MAX_CALIBRATE_FILES} benchmark files, got {len(args.files)}")
    if not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed must be 0 to 2^63 - 1, got {args.seed}")
    cfg = SimConfig(
        **config_fields(args),
        enable_caching=False,
        hash_algo="xxh3_native",
        background_hashing=False,
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
        sys.stdout.write(json_text(doc))
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
