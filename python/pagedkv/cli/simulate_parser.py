"""The ``pagedkv simulate`` parser: its description, epilog and options.

The options of the deployment it shares with ``calibrate`` (model, GPUs,
memory, scheduler limits) come from ``deployment.py``; the rest are its own.
"""

from __future__ import annotations

import argparse
from typing import Any

from .. import presets
from ..manager import HASH_ALGOS
from ..sim import runner
from ..sim.cluster import ROUTERS
from ..sim.config import DEFAULT_DISK_GBPS, EVICTIONS
from ..sim.perf import CLOCKS, GPUS
from ..sim.tiers import HOST_LINKS, OFFLOAD_POLICIES, OFFLOAD_WRITES
from ..sim.traces import FORMATS as TRACE_FORMATS
from ..sim.workloads import ARRIVALS, WORKLOADS
from .deployment import add_options
from .options import (
    MAX_REQUESTS,
    concurrency,
    cpu_offload_gib,
    disk_offload_gib,
    fraction,
    host_link,
    link_gbps,
    positive_float,
    positive_int,
    replica_count,
    request_count,
    tier_weights,
)

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
        router ({routers}), replicas, max-concurrency, cpu-offload (GiB per GPU),
        disk-offload, offload-policy (lru, arc), offload-write (write-through,
        write-back), host-link, tier-weights (HOST:DISK),
        eviction (lru, arc, slru);
        '--compare caching' = on,off

examples:
  pagedkv simulate
  pagedkv simulate --workload agentic --memory 8 --plot agentic.png
  pagedkv simulate --workload tenants --compare workload=tenants,tenants-salted
  pagedkv simulate --compare caching --compare memory=2,4,8 --json
  pagedkv simulate --trace trace.jsonl.gz --model llama-4-scout --tp 4 --gpu H200
  pagedkv simulate --slo-ttft 500 --slo-tpot 50 --find-max-rate
  pagedkv simulate --workload agentic --sweep memory=2,4,8,16,32 --csv s.csv --plot s.png
  pagedkv simulate --replicas 4 --router prefix-aware --memory 2
  pagedkv simulate --trace mooncake.jsonl.gz --gpu H200 --sweep cpu-offload=0,256,1024
  pagedkv simulate --engine vllm --vllm-python /path/to/venv-with-vllm/bin/python

exit status: 0 ok, 2 bad arguments or input, 3 the requested engine is unavailable.
"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Adds ``simulate`` to the subcommands ``sub``."""
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
        type=positive_float,
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
        type=request_count,
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
        type=positive_float,
        metavar="R",
        help="mean arrivals per second (default: the workload's)",
    )
    g.add_argument(
        "--tenants",
        type=positive_int,
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
        type=positive_float,
        default=50.0,
        metavar="MS",
        help="milliseconds per arrival tick of the built-in workloads and of trace "
        "records timed in steps (default 50)",
    )
    g.add_argument(
        "--max-concurrency",
        type=concurrency,
        metavar="N",
        help="closed-loop clients: at most N requests in flight; a request waits "
        "client-side for one to finish and arrives when sent (benchmark_serving's "
        "--max-concurrency; default: no limit)",
    )
    g.add_argument("--save-trace", metavar="FILE", help="also write the workload as a JSONL trace")
    g = p.add_argument_group("model and memory")
    add_options(g, ("model", "gpu", "tp", "quantization", "gpu_memory_utilization"))
    add_options(g, ("memory", "num_blocks", "block_size"))
    g.add_argument(
        "--on-overlong",
        choices=runner.OVERLONG,
        default="reject",
        help="a request whose prompt + output tokens exceed --max-model-len (else the "
        "model's context): reject and count it, as vLLM's server answers it with a 400 "
        "(default), or fail before running",
    )
    add_options(g, ("kv_dtype", "max_model_len"))
    g = p.add_argument_group("manager and scheduler")
    g.add_argument("--no-caching", action="store_true", help="turn prefix caching off")
    g.add_argument(
        "--hash", choices=HASH_ALGOS, default="sha256_cbor", help="block hash (default sha256_cbor)"
    )
    add_options(g, ("max_num_seqs",))
    g.add_argument(
        "--replicas",
        type=replica_count,
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
    add_options(g, ("max_num_batched_tokens",))
    g.add_argument(
        "--tier-weights",
        type=tier_weights,
        default=(0.75, 0.25),
        metavar="HOST:DISK",
        help="what --router prefix-aware counts a cached block held in host memory and on "
        "disk for, against 1 on the device (default 0.75:0.25, as Dynamo's router; 0:0 "
        "routes blind to the tiers)",
    )
    g.add_argument(
        "--eviction",
        choices=EVICTIONS,
        default="lru",
        help="the device pool's eviction policy: lru (vLLM's, the default), arc, or slru "
        "(segmented LRU: blocks hit again outlive one-off prompts)",
    )
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
    g = p.add_argument_group("host memory and disk tiers")
    g.add_argument(
        "--cpu-offload",
        type=cpu_offload_gib,
        default=0.0,
        metavar="GiB",
        help="host memory per GPU for KV blocks evicted from GPU memory (vLLM's "
        "--kv-offloading-size is this times --tp; default 0: none)",
    )
    g.add_argument(
        "--disk-offload",
        type=disk_offload_gib,
        default=0.0,
        metavar="GiB",
        help="disk per GPU below host memory, written through from it (default 0: none)",
    )
    g.add_argument(
        "--offload-policy",
        choices=OFFLOAD_POLICIES,
        default="lru",
        help="the host tier's eviction policy (vLLM's CPU offloading: lru or arc; default lru)",
    )
    g.add_argument(
        "--offload-write",
        choices=OFFLOAD_WRITES,
        default="write-through",
        help="when blocks are stored to host memory: write-through, once computed (vLLM's, "
        "the default), or write-back, as the device pool is about to evict them (SGLang "
        "HiCache's)",
    )
    g.add_argument(
        "--host-link",
        type=host_link,
        metavar="LINK|GB/s",
        help=f"each GPU's host link, one direction: {', '.join(HOST_LINKS)} "
        f"({', '.join(f'{v:g}' for v in HOST_LINKS.values())} GB/s) or GB/s "
        "(default: the GPU's, pcie4 for A100-80GB and L40S, else pcie5)",
    )
    g.add_argument(
        "--disk-link",
        type=link_gbps,
        default=DEFAULT_DISK_GBPS,
        metavar="GB/s",
        help=f"the disk tier's GB/s per GPU, each way (default {DEFAULT_DISK_GBPS:g})",
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
    g.add_argument("--slo-ttft", type=positive_float, metavar="MS", help="TTFT SLO (ms)")
    g.add_argument("--slo-tpot", type=positive_float, metavar="MS", help="TPOT SLO (ms)")
    g.add_argument(
        "--slo-target",
        type=fraction,
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
