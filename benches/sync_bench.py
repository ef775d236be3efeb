"""What the engine sync costs on a decode step: ``allocate_slots_synced`` as the
vLLM drop-in calls it, for running requests that each gained one sampled token
(and, every ``block_size`` tokens, one block hash) since their last step. The
core checks the request's last block hash (and, with events on, its last
block's tokens) against the engine's lists before it reads the new items.

Each round steps ``--requests`` requests ``--steps`` times; prints ns per call,
min / median over ``--rounds`` rounds. Run it under two builds (e.g. with
``PYTHONPATH`` pointing at another build's package) in alternation to compare.

    python benches/sync_bench.py [--rounds 5] [--requests 100] [--steps 200] [--events]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import pagedkv as pk

BS = 16


def run(requests: int, steps: int, events: bool, prompt_kw: bool) -> float:
    spec = pk.FullAttentionSpec(block_size=BS, num_kv_heads=8, head_size=128, dtype="bfloat16")
    config = pk.KVCacheConfig(num_blocks=8192, kv_cache_groups=[pk.KVCacheGroupSpec(["l"], spec)])
    kv = pk.KVCacheManager(
        config,
        max_model_len=1 << 16,
        external_block_hashes=True,
        record_stats_at_admission=False,
        enable_kv_cache_events=events,
    )
    core = kv.allocate_slots_synced
    reqs = []
    for i in range(requests):
        tokens = [(i * 7919 + t) % 32000 for t in range(300)]
        hashes = [
            hashlib.sha256(bytes(j) + i.to_bytes(4, "little")).digest() for j in range(300 // BS)
        ]
        kv.add_request(f"r{i}", tokens)
        core(f"r{i}", tokens, hashes, 0, 300, 0, 0, None, 0, 0, False, 0, False, 0, True, 0, None)
        reqs.append((f"r{i}", tokens, hashes))
    kv.take_events()
    total = 0
    for step in range(steps):
        for rid, tokens, hashes in reqs:
            computed = len(tokens)
            tokens.append((computed * 31 + step) % 32000)
            if len(tokens) % BS == 0:
                hashes.append(hashlib.sha256(hashes[-1] + bytes(4)).digest())
            t0 = time.perf_counter_ns()
            if prompt_kw:
                core(rid, tokens, hashes, 0, 1, computed, 0, None, 0, 0, False, 0, False, 0,
                     True, 0, None, 300)  # fmt: skip
            else:
                core(rid, tokens, hashes, 0, 1, computed, 0, None, 0, 0, False, 0, False, 0,
                     True, 0, None)  # fmt: skip
            total += time.perf_counter_ns() - t0
        if events:
            kv.take_events()
    return total / (steps * requests)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--events", action="store_true")
    ap.add_argument(
        "--prompt-kw", action="store_true", help="pass num_prompt_tokens, as the drop-in does"
    )
    args = ap.parse_args()
    ns = [run(args.requests, args.steps, args.events, args.prompt_kw) for _ in range(args.rounds)]
    print(
        f"allocate_slots_synced, one new token: {min(ns):.1f} / {statistics.median(ns):.1f} "
        f"ns per call (min / median of {args.rounds})"
    )


if __name__ == "__main__":
    main()
