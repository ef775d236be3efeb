"""What a batch call costs beyond its requests' work: ``allocate_slots_batch`` of
one running request whose step needs nothing, with its arguments in each form
the API takes (handles as a list or an int64 array, the new-token count as one
int, a list or an array, the computed counts as a list, an array, or left to
the manager), beside ``new_step_starts`` (a call that does next to nothing).
The forms are timed in turn within each round (``timeit``, best of five
repeats of ``--number`` calls), over ``--rounds`` rounds; prints ns per call,
min / median over the rounds.

    python benches/call_overhead_bench.py [--rounds 5] [--number 100000]
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from collections.abc import Callable

import numpy as np
import pagedkv as pk


def forms() -> dict[str, Callable[[], object]]:
    spec = pk.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    config = pk.KVCacheConfig(num_blocks=4096, kv_cache_groups=[pk.KVCacheGroupSpec(["l"], spec)])
    kv = pk.KVCacheManager(config, max_model_len=1 << 20)
    h = kv.add_request("r", list(range(20)))
    kv.allocate_slots("r", 20, num_computed_tokens=0)
    # The same step every call: 20 tokens computed, one more scheduled (it
    # fits the request's second block, which publishes nothing).
    hl, ha = [h], np.array([h], dtype=np.int64)
    nl, na = [1], np.array([1], dtype=np.int64)
    cl, ca = [20], np.array([20], dtype=np.int64)
    return {
        "new_step_starts()": kv.new_step_starts,
        "handles list, 1, computed list": lambda: kv.allocate_slots_batch(hl, 1, cl),
        "handles list, lists": lambda: kv.allocate_slots_batch(hl, nl, cl),
        "handles list, 1, computed array": lambda: kv.allocate_slots_batch(hl, 1, ca),
        "handles list, arrays": lambda: kv.allocate_slots_batch(hl, na, ca),
        "handles array, arrays": lambda: kv.allocate_slots_batch(ha, na, ca),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--number", type=int, default=100_000)
    args = ap.parse_args()
    calls = forms()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            best = min(timeit.repeat(call, number=args.number, repeat=5))
            times[name].append(best / args.number * 1e9)
    print(f"ns per call, min / median of {args.rounds} rounds")
    for name, ts in times.items():
        print(f"  {name:<34}{min(ts):8.1f} / {statistics.median(ts):8.1f}")


if __name__ == "__main__":
    main()
