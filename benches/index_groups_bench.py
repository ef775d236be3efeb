"""Cost of prefix-index events when one hash is stored under many groups.

    python benches/index_groups_bench.py [--groups 160000] [--rounds 3]

Applies ``--groups`` ``BlockStored`` events for the same hash, each with its own
``group_idx``, in batches of 1,000, and prints the seconds of each round and
their min / median. An older build is measured the same way with its package
first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedkv.events.wire import WireBlockStored
from pagedkv.index import PrefixIndex


def one_round(n: int) -> float:
    events = [
        WireBlockStored(
            block_hashes=[42],
            parent_block_hash=None,
            token_ids=[1],
            block_size=1,
            lora_id=None,
            medium=None,
            lora_name=None,
            group_idx=g,
        )
        for g in range(n)
    ]
    index = PrefixIndex()
    t0 = time.perf_counter()
    for i in range(0, n, 1000):
        index.apply("a", events[i : i + 1000])
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=160_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    times = [one_round(args.groups) for _ in range(args.rounds)]
    print(" ".join(f"{t:.3f}" for t in times))
    print(f"min {min(times):.3f} s, median {statistics.median(times):.3f} s")


if __name__ == "__main__":
    main()
