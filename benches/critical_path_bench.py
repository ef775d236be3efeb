"""The scheduler's critical path with prompt hashing in the background.

The oracle's synthetic shared-prefix trace driven through the scheduler policy
over pagedkv's manager (as ``drive_bench.py``), prompts given as uint32 arrays,
three ways per round, interleaved over ``--rounds`` rounds: prompts hashed in
place (``background_hashing=False``), on the manager's hash worker (``True``),
and on the worker with each step's sampled tokens in a call of their own
(``append_token_ids_batch``) instead of in the next ``allocate_slots_batch``.

    python benches/critical_path_bench.py [--rounds 3] [--num-requests 2000]

Per step: the critical path (time inside manager calls, what the scheduler
waits for: hashing included when it happens in place, the wait for the worker
when a lookup needs hashes not yet there) and the process CPU time of the whole
loop (both threads, the Python loop included). Min / median over the rounds; the
runs must allocate identically (same ``alloc_checksum``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pagedkv as pk
from pagedkv._oracle.trace import TraceConfig, generate
from pagedkv.sim import ManagerBackend, Scheduler, SchedulerConfig, drive

# (background hashing, sampled tokens with the next allocation)
MODES = {
    "in place": (False, True),
    "background": (True, True),
    "bg, separate appends": (True, False),
}


def one_run(reqs: list, mode: str, num_blocks: int) -> dict[str, float | str]:
    background, tokens_with_allocation = MODES[mode]
    kw = dict(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    groups = [pk.KVCacheGroupSpec(["layers.0.attn"], pk.FullAttentionSpec(**kw))]
    config = pk.KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)
    kv = pk.KVCacheManager(
        config, max_model_len=16384, max_in_flight_tokens=8192, background_hashing=background
    )
    sched = Scheduler(
        ManagerBackend(kv, tokens_with_allocation=tokens_with_allocation),
        SchedulerConfig(
            max_num_seqs=256, max_num_batched_tokens=8192, hits_count_as_computed=False
        ),
    )
    items = [r.fresh() for r in reqs]
    cpu0, t0 = time.process_time(), time.perf_counter()
    drive(sched, items)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    st = sched.stats
    return {
        "critical_us": st.manager_ns / 1e3 / st.steps,
        "lookup_us": st.ns.get("get_computed_blocks", 0) / 1e3 / st.steps,
        "decode_us": (st.ns.get("allocate_slots_batch", 0) + st.ns.get("append_token_ids_batch", 0))
        / 1e3
        / st.steps,
        "add_us": st.ns.get("add_request", 0) / 1e3 / st.steps,
        "cpu_us": cpu * 1e6 / st.steps,
        "wall_us": wall * 1e6 / st.steps,
        "checksum": f"{st.alloc_checksum:016x}",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--num-blocks", type=int, default=4096)
    args = ap.parse_args()
    trace = generate(TraceConfig(seed=0, num_requests=args.num_requests, interarrival_milli=1000))
    reqs = trace.scheduler_requests()
    for r in reqs:
        r.prompt = np.asarray(r.prompt, dtype=np.uint32)
    results: dict[str, list[dict[str, float | str]]] = {m: [] for m in MODES}
    for i in range(args.rounds):
        order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
        for mode in order:
            results[mode].append(one_run(reqs, mode, args.num_blocks))
    checksums = {r["checksum"] for rs in results.values() for r in rs}
    same = "identical" if len(checksums) == 1 else "DIFFERENT"
    print(
        f"drive trace, {args.num_requests} requests, µs per step, min / median of "
        f"{args.rounds} interleaved rounds (allocations {same})"
    )
    print(f"  {'':<32}" + "".join(f"{m:>24}" for m in MODES))
    for key, name in (
        ("critical_us", "critical path (manager calls)"),
        ("add_us", "  add_request"),
        ("lookup_us", "  get_computed_blocks"),
        ("decode_us", "  running requests' batch calls"),
        ("cpu_us", "process CPU, both threads"),
        ("wall_us", "loop wall time"),
    ):
        cells = []
        for mode in MODES:
            vals = [float(r[key]) for r in results[mode]]
            cells.append(f"{min(vals):10.2f} / {statistics.median(vals):8.2f}")
        print(f"  {name:<32}" + "".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
