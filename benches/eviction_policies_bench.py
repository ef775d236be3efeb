"""The device pool's eviction policies on a real trace: hit rate and the
manager's cost per call, LRU against ARC and SLRU, interleaved in one process.

Each round runs every (capacity, policy) point once, the policies in rotating
order, on the simulator (``pagedkv.sim``: one serving process, the scheduler's
real calls on pagedkv's manager). The hit rate of a point does not change
between rounds (the run is deterministic); the manager's time per call does,
and is reported as min / median over the rounds, with each policy's over
LRU's at the same capacity.

    python benches/eviction_policies_bench.py TRACE [--memory 16,32,64]
        [--model M] [--gpu H200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

from pagedkv.sim.config import EVICTIONS, SimConfig
from pagedkv.sim.runner import run_pagedkv
from pagedkv.sim.traces import load_trace


def _floats(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"numbers separated by commas, got {text!r}") from None
    if not out or not all(0 < x <= 10_000 for x in out):
        raise argparse.ArgumentTypeError(f"GiB values in (0, 10000], got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a trace file (any format pagedkv simulate reads)")
    p.add_argument("--memory", type=_floats, default=[16.0, 32.0, 64.0], metavar="GiB,...")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--gpu", default="H200")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--policies", default=",".join(EVICTIONS))
    args = p.parse_args(argv)
    policies = [x for x in args.policies.split(",") if x]
    if not 1 <= args.rounds <= 50 or not set(policies) <= set(EVICTIONS) or "lru" not in policies:
        print(f"error: --rounds 1..50, --policies among {EVICTIONS} with lru", file=sys.stderr)
        return 2
    workload = load_trace(args.trace)
    base = SimConfig(model=args.model, gpu=args.gpu)
    hit: dict[tuple[float, str], float] = {}
    us: dict[tuple[float, str], list[float]] = {}
    for rnd in range(args.rounds):
        for mem in args.memory:
            order = policies[rnd % len(policies) :] + policies[: rnd % len(policies)]
            for pol in order:
                cfg = replace(base, memory_gib=mem, eviction=pol)
                t0 = time.perf_counter()
                r = run_pagedkv(workload, cfg)
                hit[mem, pol] = r.hit_rate
                us.setdefault((mem, pol), []).append(r.us_per_call)
                print(
                    f"round {rnd + 1} {mem:g} GiB {pol}: hit {100 * r.hit_rate:.2f} %, "
                    f"{r.us_per_call:.3f} µs/call ({time.perf_counter() - t0:.1f} s)",
                    file=sys.stderr,
                )
    print("| KV GiB | policy | hit rate | vs LRU | µs per call (min / median) | over LRU |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mem in args.memory:
        lru_min = min(us[mem, "lru"])
        for pol in policies:
            xs = us[mem, pol]
            gain = 100 * (hit[mem, pol] - hit[mem, "lru"])
            print(
                f"| {mem:g} | {pol} | {100 * hit[mem, pol]:.2f} % | {gain:+.2f} pt | "
                f"{min(xs):.3f} / {statistics.median(xs):.3f} | "
                f"{100 * (min(xs) / lru_min - 1):+.1f} % |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
