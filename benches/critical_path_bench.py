"""The scheduler's critical path with prompt hashing off it.

The oracle's synthetic shared-prefix trace driven through the scheduler policy
over pagedkv's manager (as ``drive_bench.py``), prompts given as uint32 arrays,
several ways per round, interleaved over ``--rounds`` rounds: prompts hashed
in place (``background_hashing=False``; with the ``sha256_cbor`` memo, on by
default, and without it), on the manager's hash worker (``True``),
and with the requests built and hashed before the loop
(``request_preparer().prepare``: what an engine's input thread does as
requests arrive; vLLM's engine builds its ``Request`` objects, block hashes
included, in its input thread, and the oracle's ``drive.py`` builds them before
its loop), the loop only registering them (``add_prepared``); each with the
step's sampled tokens in the next ``allocate_slots_batch`` and in a call of
their own (``append_token_ids_batch``).

    python benches/critical_path_bench.py [--rounds 3] [--num-requests 2000]
        [--hash-memo-blocks N] [--mode "in place" --mode "in place, no memo" ...]
        [--vllm-python ORACLE_VENV/bin/python --oracle-dir ../shared/tools/vllm_oracle]

Per step: the critical path (time inside manager calls, what the scheduler
waits for: hashing included when it happens in place, the wait for the worker
when a lookup needs hashes not yet there) and the process CPU time of the whole
loop (all threads, the Python loop included; the preparation before the loop
left out, as vLLM's request building is). Min / median over the rounds; the
runs must allocate identically (same ``alloc_checksum``). With ``--vllm-python``,
each round also runs vLLM 0.33's own manager on the same trace (the oracle's
``drive.py``, as ``drive_bench.py`` does), first or last in turn, and the bench
prints vLLM's manager time per step (its prompt hashing, done when requests are
built, apart) and its ratio to each critical path; vLLM must allocate the same
block ids. vLLM appends each sampled token to its ``Request`` (hashing the
blocks it fills there), outside its manager's calls: the modes with a call of
their own for the appends also print the critical path without that call,
the calls vLLM's manager time covers. The modes hashing in place are also
set against vLLM's manager time with its hashing added (the prompts' and the
sampled tokens' blocks, in ``Request``): both then hash on the critical path.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import pagedkv as pk
from pagedkv._oracle.trace import TraceConfig, generate
from pagedkv.sim import ManagerBackend, Scheduler, SchedulerConfig, drive

# (background hashing, sampled tokens with the next allocation, prepared ahead,
# hash memo off)
MODES = {
    "in place": (False, True, False, False),
    "in place, no memo": (False, True, False, True),
    "background": (True, True, False, False),
    "prepared": (False, True, True, False),
    "prepared, sep. appends": (False, False, True, False),
    "bg, separate appends": (True, False, False, False),
    "in place, sep. appends": (False, False, False, False),
}


def one_run(
    reqs: list, mode: str, num_blocks: int, memo_blocks: int | None
) -> dict[str, float | str]:
    background, tokens_with_allocation, prepared, no_memo = MODES[mode]
    kw = dict(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    groups = [pk.KVCacheGroupSpec(["layers.0.attn"], pk.FullAttentionSpec(**kw))]
    config = pk.KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)
    kv = pk.KVCacheManager(
        config,
        max_model_len=16384,
        max_in_flight_tokens=8192,
        background_hashing=background,
        hash_memo_blocks=0 if no_memo else memo_blocks,
    )
    backend = ManagerBackend(kv, tokens_with_allocation=tokens_with_allocation)
    sched = Scheduler(
        backend,
        SchedulerConfig(
            max_num_seqs=256, max_num_batched_tokens=8192, hits_count_as_computed=False
        ),
    )
    items = [r.fresh() for r in reqs]
    if prepared:
        backend.prepare(items)
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
        "admit_us": st.ns.get("allocate_slots(admit)", 0) / 1e3 / st.steps,
        "remove_us": st.ns.get("remove_request", 0) / 1e3 / st.steps,
        # The calls vLLM's manager makes: the sampled tokens' appends apart (a
        # mode that appends in a call of its own); vLLM appends them, and
        # hashes the blocks they fill, in `Request`, outside its manager.
        "no_append_us": (st.manager_ns - st.ns.get("append_token_ids_batch", 0)) / 1e3 / st.steps
        if not tokens_with_allocation
        else float("nan"),
        "cpu_us": cpu * 1e6 / st.steps,
        "wall_us": wall * 1e6 / st.steps,
        "checksum": f"{st.alloc_checksum:016x}",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument(
        "--hash-memo-blocks",
        type=int,
        help="the sha256_cbor memo's size (default: the manager's; 0: off)",
    )
    ap.add_argument("--mode", action="append", help="a mode to run (repeatable; default: all)")
    ap.add_argument("--vllm-python", help="the oracle venv's python: run vLLM alongside")
    ap.add_argument(
        "--oracle-dir",
        default=os.path.join(
            os.path.dirname(__file__), "..", "..", "shared", "tools", "vllm_oracle"
        ),
    )
    args = ap.parse_args()
    if args.mode:
        chosen = args.mode
        unknown = [m for m in chosen if m not in MODES]
        if unknown:
            raise SystemExit(f"unknown modes {unknown}; modes: {', '.join(MODES)}")
        for m in list(MODES):
            if m not in chosen:
                del MODES[m]
    trace = generate(TraceConfig(seed=0, num_requests=args.num_requests, interarrival_milli=1000))
    reqs = trace.scheduler_requests()
    for r in reqs:
        r.prompt = np.asarray(r.prompt, dtype=np.uint32)
    results: dict[str, list[dict[str, float | str]]] = {m: [] for m in MODES}
    vllm_us: list[float] = []
    vllm_hashing_us: list[float] = []

    def run_vllm_once() -> None:
        manager, with_hashing = vllm_manager_us(args, results)
        vllm_us.append(manager)
        vllm_hashing_us.append(with_hashing)

    for i in range(args.rounds):
        order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
        if args.vllm_python and i % 2 == 0:
            run_vllm_once()
        for mode in order:
            results[mode].append(one_run(reqs, mode, args.num_blocks, args.hash_memo_blocks))
        if args.vllm_python and i % 2 == 1:
            run_vllm_once()
    checksums = {r["checksum"] for rs in results.values() for r in rs}
    same = "identical" if len(checksums) == 1 else "DIFFERENT"
    print(
        f"drive trace, {args.num_requests} requests, µs per step, min / median of "
        f"{args.rounds} interleaved rounds (allocations {same})"
    )
    print(f"  {'':<32}" + "".join(f"{m:>23}" for m in MODES))
    for key, name in (
        ("critical_us", "critical path (manager calls)"),
        ("no_append_us", "  without the appends call"),
        ("add_us", "  add_request"),
        ("lookup_us", "  get_computed_blocks"),
        ("admit_us", "  allocate_slots (admission)"),
        ("decode_us", "  running requests' batch calls"),
        ("remove_us", "  remove_request"),
        ("cpu_us", "process CPU, all threads"),
        ("wall_us", "loop wall time"),
    ):
        cells = row(results, key, lambda lo, mid: f"{lo:9.2f} / {mid:8.2f}")
        print(f"  {name:<32}" + "".join(f"{c:>23}" for c in cells))
    if vllm_us:
        ratios(results, "vLLM 0.33 manager time", "vLLM", vllm_us)
        # Hashing in place on both sides: vLLM's prompt and decode-block
        # hashing added to its manager time.
        ratios(results, "vLLM 0.33 manager + hashing", "vLLM + hashing", vllm_hashing_us)


def ratios(results: dict, label: str, short: str, vllm: list[float]) -> None:
    """vLLM's figure (min / median over its runs) and its ratio to each mode's
    critical path, with and without the appends call."""
    lo, mid = min(vllm), statistics.median(vllm)
    print(f"  {label:<32}{lo:10.2f} / {mid:8.2f}")
    for key, name in (
        ("critical_us", f"{short} / critical path"),
        ("no_append_us", "  / without the appends"),
    ):
        cells = row(results, key, lambda c, m: f"{lo / c:9.1f}x / {mid / m:6.1f}x")
        print(f"  {name:<32}" + "".join(f"{c:>23}" for c in cells))


def row(results: dict, key: str, cell: Callable[[float, float], str]) -> list[str]:
    """One cell per mode: `cell(min, median)` of the key's values over the
    rounds, "-" for a figure the mode does not have."""
    cells = []
    for mode in MODES:
        vals = [float(r[key]) for r in results[mode]]
        if any(math.isnan(v) for v in vals):
            cells.append("-")
        else:
            cells.append(cell(min(vals), statistics.median(vals)))
    return cells


def vllm_manager_us(args: argparse.Namespace, results: dict) -> tuple[float, float]:
    """One run of vLLM's manager on the trace: its manager time per step (its
    block hashing, done as requests are built and tokens appended, apart), and
    with that hashing. Refuses a run whose allocations differ from
    pagedkv's."""
    from drive_bench import run_vllm

    v = run_vllm(
        argparse.Namespace(
            vllm_python=args.vllm_python,
            oracle_dir=args.oracle_dir,
            num_blocks=args.num_blocks,
            num_requests=args.num_requests,
            seed=0,
            interarrival_milli=1000,
            hash="sha256_cbor",
            hybrid=False,
        )
    )
    ours = {r["checksum"] for rs in results.values() for r in rs}
    if ours and f"{int(v['alloc_checksum'], 16):016x}" not in ours:
        raise SystemExit(f"vLLM allocated differently: {v['alloc_checksum']} vs {ours}")
    tm = v["timing"]
    return float(tm["manager_total_ms"]) * 1e3 / v["steps"], float(
        tm["us_per_step_manager_plus_hashing"]
    )


if __name__ == "__main__":
    main()
