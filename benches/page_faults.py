"""Page faults inside the manager's calls on the scheduler's critical path: the
drive trace of ``critical_path_bench.py`` run ``--rounds`` times in one
process (a fresh manager each round), prompts hashed in place, with every
manager call wrapped to read the process's minor-fault count before and after
it. Prints, per round and per API, the faults taken inside its calls, the
calls that took any, and those calls' time per step (µs). Linux only.

    python benches/page_faults.py [--rounds 3] [--mode "in place"|prepared|background]
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pagedkv as pk
from pagedkv._oracle.trace import TraceConfig, generate
from pagedkv.sim import ManagerBackend, Scheduler, SchedulerConfig, drive


class Counted:
    """The manager, each method call counted: ``faults[api] = [faults, calls
    that faulted, seconds in those calls]``."""

    def __init__(self, inner: pk.KVCacheManager) -> None:
        self._inner = inner
        self.faults: dict[str, list[float]] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr
        return self._wrap(name, attr)

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            out = method(*args, **kwargs)
            took = time.perf_counter() - t
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            if faults:
                entry = self.faults.setdefault(name, [0, 0, 0.0])
                entry[0] += faults
                entry[1] += 1
                entry[2] += took
            return out

        return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mode", default="in place", choices=["in place", "prepared", "background"])
    args = ap.parse_args()
    trace = generate(TraceConfig(seed=0, num_requests=2000, interarrival_milli=1000))
    reqs = trace.scheduler_requests()
    for r in reqs:
        r.prompt = np.asarray(r.prompt, dtype=np.uint32)
    spec = pk.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    config = pk.KVCacheConfig(
        num_blocks=4096, kv_cache_groups=[pk.KVCacheGroupSpec(["layers.0.attn"], spec)]
    )
    for rnd in range(args.rounds):
        kv = pk.KVCacheManager(
            config,
            max_model_len=16384,
            max_in_flight_tokens=8192,
            background_hashing=args.mode == "background",
        )
        counted = Counted(kv)
        backend = ManagerBackend(counted)  # type: ignore[arg-type]
        sched = Scheduler(
            backend,
            SchedulerConfig(
                max_num_seqs=256, max_num_batched_tokens=8192, hits_count_as_computed=False
            ),
        )
        items = [r.fresh() for r in reqs]
        if args.mode == "prepared":
            backend.prepare(items)
        drive(sched, items)
        steps = sched.stats.steps
        rows = ", ".join(
            f"{api}: {int(f)} faults in {int(c)} calls, {s * 1e6 / steps:.3f} µs/step"
            for api, (f, c, s) in sorted(counted.faults.items())
        )
        print(f"round {rnd}: {rows or 'no faults'}")


if __name__ == "__main__":
    main()
