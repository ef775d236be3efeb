"""The scheduler-step benchmark: the oracle's synthetic shared-prefix trace driven
through the one scheduler policy (pagedkv.sim.policy) over pagedkv's manager, timing every
manager call, hashing included (``add_request`` / ``append_token_ids`` hash the new
blocks). With ``--vllm-python`` the oracle's ``drive.py`` runs vLLM 0.33's own
manager on the same trace in the same invocation; the two ``alloc_checksum`` values
must be equal (same block ids for every ``allocate_slots`` call) and the ratio of
manager time per step is printed.

    python benches/drive_bench.py [--num-blocks 4096] [--num-requests 2000]
        [--vllm-python ORACLE_VENV/bin/python --oracle-dir ../shared/tools/vllm_oracle]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

import pagedkv as pk
from pagedkv._oracle.trace import TraceConfig, generate
from pagedkv.sim import ManagerBackend, Scheduler, SchedulerConfig, drive


def run_pagedkv(args: argparse.Namespace) -> dict:
    trace = generate(
        TraceConfig(
            seed=args.seed,
            num_requests=args.num_requests,
            interarrival_milli=args.interarrival_milli,
        )
    )
    kw = dict(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    groups = [pk.KVCacheGroupSpec(["layers.0.attn"], pk.FullAttentionSpec(**kw))]
    if args.hybrid:
        groups.append(
            pk.KVCacheGroupSpec(["layers.1.attn"], pk.SlidingWindowSpec(sliding_window=1024, **kw))
        )
    config = pk.KVCacheConfig(num_blocks=args.num_blocks, kv_cache_groups=groups)
    kv = pk.KVCacheManager(
        config,
        max_model_len=16384,
        hash_algo=args.hash,
        max_in_flight_tokens=8192,
        prefix_cache_retention_interval=0 if args.hybrid else None,
        hash_memo_blocks=args.hash_memo_blocks,
    )
    # The reference drive loop does not count prefix hits as computed (see
    # SchedulerConfig.hits_count_as_computed): reproduce it so both do the same work.
    sched = Scheduler(
        ManagerBackend(kv),
        SchedulerConfig(
            max_num_seqs=256, max_num_batched_tokens=8192, hits_count_as_computed=False
        ),
    )
    reqs = trace.scheduler_requests()
    t0 = time.perf_counter()
    drive(sched, reqs)
    wall = time.perf_counter() - t0
    st = sched.stats
    hashing = st.ns.get("add_request", 0) + st.ns.get("append_token_ids_batch", 0)
    return {
        "steps": st.steps,
        "preemptions": st.preemptions,
        "admissions": st.admissions,
        "hit_rate": round(st.hit_tokens / st.query_tokens, 4) if st.query_tokens else 0.0,
        "alloc_checksum": f"{st.alloc_checksum:016x}",
        "manager_calls": st.manager_calls,
        "manager_ms": (st.manager_ns - hashing) / 1e6,
        "hashing_ms": hashing / 1e6,
        "per_api": {k: (st.calls[k], st.ns[k]) for k in st.ns},
        "loop_wall_s": wall,
    }


def run_vllm(args: argparse.Namespace) -> dict:
    cmd = [
        args.vllm_python,
        os.path.join(os.path.abspath(args.oracle_dir), "drive.py"),
        "--quiet",
        "--json",
        "-",
        "--num-blocks",
        str(args.num_blocks),
        "--num-requests",
        str(args.num_requests),
        "--seed",
        str(args.seed),
        "--interarrival-milli",
        str(args.interarrival_milli),
        "--hash",
        args.hash,
    ]
    if args.hybrid:
        cmd.append("--hybrid")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=args.oracle_dir)
    return json.loads(out.stdout[out.stdout.index("{") :])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interarrival-milli", type=int, default=1000)
    ap.add_argument("--hash", default="sha256_cbor")
    ap.add_argument("--hybrid", action="store_true", help="full attention + sliding window 1024")
    ap.add_argument(
        "--hash-memo-blocks",
        type=int,
        help="the sha256_cbor memo's size (default: the manager's; 0: off)",
    )
    ap.add_argument("--vllm-python")
    ap.add_argument(
        "--oracle-dir",
        default=os.path.join(
            os.path.dirname(__file__), "..", "..", "shared", "tools", "vllm_oracle"
        ),
    )
    args = ap.parse_args()
    v = run_vllm(args) if args.vllm_python else None
    p = run_pagedkv(args)
    print(
        f"trace: {args.num_requests} requests, {args.num_blocks} blocks, hash {args.hash}"
        f"{', hybrid' if args.hybrid else ''}; python {platform.python_version()}"
    )
    print(
        f"pagedkv: steps {p['steps']}, preemptions {p['preemptions']}, hit rate {p['hit_rate']}, "
        f"alloc_checksum {p['alloc_checksum']}"
    )
    for api, (calls, ns) in sorted(p["per_api"].items()):
        print(f"  {api:<24}{calls:>9} calls {ns / 1e6:>9.1f} ms {ns / calls / 1e3:>9.2f} µs/call")
    steps = p["steps"]
    p_us = (p["manager_ms"] + p["hashing_ms"]) * 1e3 / steps
    print(
        f"pagedkv manager {p['manager_ms']:.0f} ms + hashing {p['hashing_ms']:.0f} ms = "
        f"{p_us:.1f} µs/step (loop wall {p['loop_wall_s']:.2f} s)"
    )
    if v:
        tm = v["timing"]
        v_us = tm["us_per_step_manager_plus_hashing"]
        same = v["alloc_checksum"] == p["alloc_checksum"] and v["steps"] == steps
        print(
            f"vLLM 0.33: steps {v['steps']}, preemptions {v['preemptions']}, alloc_checksum "
            f"{v['alloc_checksum']} ({'identical' if same else 'DIFFERENT'})"
        )
        print(
            f"vLLM manager {tm['manager_total_ms']:.0f} ms + hashing "
            f"{tm['block_hashing']['total_ms']:.0f} ms = {v_us:.1f} µs/step"
        )
        print(f"ratio (manager + hashing per step): {v_us / p_us:.0f}x")
        if not same:
            raise SystemExit("pagedkv and vLLM made different allocations")


if __name__ == "__main__":
    main()
