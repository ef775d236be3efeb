"""Soak: a long randomized scheduler run over one manager, bounded in time, sampling
the process RSS and the free-block count at intervals.

    python benches/soak.py --seconds 300            # full-attention pool
    python benches/soak.py --seconds 300 --hybrid   # full attention + sliding window

The workload is a continuous-batching loop: requests arrive with prompts that
share prefixes (so the prefix cache hits and evicts), are admitted through
``get_computed_blocks`` + ``allocate_slots``, decode one token per step, are
preempted when the pool is full, and finish after a random output length; cached
blocks are occasionally evicted and the prefix cache reset when idle. Every
sample runs ``check_invariants``. At the end every request is removed and the
cache reset: all usable blocks must be free again and the map empty. The RSS
after warm-up (the second sample) is compared with the final one.

Exit status 1 when blocks do not come back, or when RSS grows by more than
``--max-rss-growth-mb`` after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import pagedkv as pk


def rss_mb() -> float:
    """Current resident set size of this process, in MiB (Linux)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class Sample:
    seconds: float
    ops: int
    rss_mb: float
    free_blocks: int
    running: int
    waiting: int
    cached_hashes: int


@dataclass
class SoakResult:
    num_blocks: int
    hybrid: bool
    seconds: float
    ops: int
    steps: int
    finished: int
    preemptions: int
    samples: list[Sample] = field(default_factory=list)
    final_free_blocks: int = 0
    final_cached_hashes: int = 0
    final_rss_mb: float = 0.0
    reset_ok: bool = False

    @property
    def blocks_returned(self) -> bool:
        return (
            self.final_free_blocks == self.num_blocks - 1
            and self.final_cached_hashes == 0
            and self.reset_ok
        )

    @property
    def rss_growth_mb(self) -> float:
        """Final RSS minus the RSS at the first sample after warm-up (the second)."""
        if not self.samples:
            return 0.0
        warm = self.samples[1] if len(self.samples) > 1 else self.samples[0]
        return self.final_rss_mb - warm.rss_mb


def make_manager(num_blocks: int, block_size: int, hybrid: bool) -> pk.KVCacheManager:
    def spec(kind: str) -> pk.KVCacheSpec:
        if kind == "swa":
            return pk.SlidingWindowSpec(block_size, 1, 1, "float32", sliding_window=4 * block_size)
        return pk.FullAttentionSpec(block_size, 1, 1, "float32")

    kinds = ["full", "swa"] if hybrid else ["full"]
    groups = [pk.KVCacheGroupSpec([f"layer{i}"], spec(k)) for i, k in enumerate(kinds)]
    config = pk.KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)
    return pk.KVCacheManager(
        config,
        max_model_len=4096,
        hash_algo="xxh3_native",
        hash_seed="0",
        enable_kv_cache_events=True,
        log_stats=True,
    )


def run(
    seconds: float,
    *,
    max_ops: int | None = None,
    num_blocks: int = 1024,
    block_size: int = 16,
    hybrid: bool = False,
    interval: float = 5.0,
    seed: int = 0,
    max_batch: int = 64,
    verbose: bool = False,
    sample_steps: int | None = None,
) -> SoakResult:
    """Runs the soak until ``seconds`` pass or ``max_ops`` manager calls were made,
    sampling every ``interval`` seconds (and every ``sample_steps`` scheduler steps
    when given)."""
    rng = random.Random(seed)
    mgr = make_manager(num_blocks, block_size, hybrid)
    prefixes = [[rng.randrange(32000) for _ in range(rng.choice([16, 64, 200]))] for _ in range(24)]
    waiting: list[str] = []
    running: dict[str, int] = {}  # request -> computed tokens
    budget: dict[str, int] = {}  # request -> output tokens still to generate
    res = SoakResult(
        num_blocks=num_blocks, hybrid=hybrid, seconds=0.0, ops=0, steps=0, finished=0, preemptions=0
    )
    next_id = 0
    start = time.perf_counter()
    next_sample = start
    ops = 0

    def sample() -> None:
        mgr.check_invariants()
        s = Sample(
            seconds=round(time.perf_counter() - start, 2),
            ops=ops,
            rss_mb=round(rss_mb(), 2),
            free_blocks=mgr.num_free_blocks,
            running=len(running),
            waiting=len(waiting),
            cached_hashes=mgr.num_cached_block_hashes,
        )
        res.samples.append(s)
        if verbose:
            print(json.dumps(asdict(s)), flush=True)

    while True:
        now = time.perf_counter()
        if now >= next_sample or (sample_steps and res.steps % sample_steps == 0):
            sample()
            next_sample = now + interval
        if now - start >= seconds or (max_ops is not None and ops >= max_ops):
            break
        res.steps += 1
        # Arrivals.
        for _ in range(rng.randrange(4)):
            if len(waiting) + len(running) >= 2 * max_batch:
                break
            rid = f"q{next_id}"
            next_id += 1
            prompt = list(rng.choice(prefixes))[: rng.randrange(1, 220)]
            prompt += [rng.randrange(32000) for _ in range(rng.randrange(1, 100))]
            mgr.add_request(rid, prompt)
            ops += 1
            waiting.append(rid)
            budget[rid] = rng.randrange(1, 200)
        # Admission (FCFS), chunked to the whole prompt.
        while waiting and len(running) < max_batch:
            rid = waiting[0]
            hit = mgr.get_computed_blocks(rid)
            n = mgr.num_tokens(rid)
            new = mgr.allocate_slots(
                rid, n - hit.num_computed_tokens, num_computed_tokens=0, new_computed_blocks=hit
            )
            ops += 2
            if new is None:
                break
            waiting.pop(0)
            running[rid] = n
        # Decode: one token each; preempt the newest when out of blocks.
        for rid in list(running):
            if rid not in running:
                continue
            mgr.append_token_ids(rid, [rng.randrange(32000)])
            ops += 1
            while mgr.allocate_slots(rid, 1, num_computed_tokens=running[rid]) is None:
                ops += 1
                victim = next(reversed(running))
                mgr.free(victim)
                ops += 1
                del running[victim]
                waiting.insert(0, victim)
                res.preemptions += 1
                if victim == rid:
                    break
            else:
                ops += 1
                running[rid] += 1
                budget[rid] -= 1
                if budget[rid] <= 0 or mgr.num_tokens(rid) >= 4000:
                    mgr.remove_request(rid)
                    ops += 1
                    del running[rid], budget[rid]
                    res.finished += 1
        # Maintenance.
        if hybrid:
            for rid, done in running.items():
                mgr.remove_skipped_blocks(rid, done)
                ops += 1
        if rng.random() < 0.02:
            mgr.evict_blocks([rng.randrange(1, num_blocks) for _ in range(4)])
            ops += 1
        if not running and rng.random() < 0.5:
            mgr.reset_prefix_cache()
            ops += 1
        mgr.take_events()
        mgr.make_prefix_cache_stats()
        mgr.new_step_starts()
        ops += 3

    for rid in [*running, *waiting]:
        mgr.remove_request(rid)
    mgr.check_invariants()
    res.seconds = round(time.perf_counter() - start, 2)
    res.ops = ops
    res.final_free_blocks = mgr.num_free_blocks
    res.reset_ok = mgr.reset_prefix_cache()
    res.final_cached_hashes = mgr.num_cached_block_hashes
    mgr.take_events()
    res.final_rss_mb = round(rss_mb(), 2)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="how long to run")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hybrid", action="store_true", help="full attention + sliding window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-growth-mb", type=float, default=16.0)
    p.add_argument("--json", help="write the samples and totals to this file")
    args = p.parse_args(argv)
    res = run(
        args.seconds,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        hybrid=args.hybrid,
        interval=args.interval,
        seed=args.seed,
        verbose=True,
    )
    summary: dict[str, Any] = {k: v for k, v in asdict(res).items() if k != "samples"}
    summary["rss_growth_mb_after_warmup"] = round(res.rss_growth_mb, 2)
    summary["blocks_returned"] = res.blocks_returned
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**summary, "samples": [asdict(s) for s in res.samples]}, f, indent=2)
    ok = res.blocks_returned and res.rss_growth_mb <= args.max_rss_growth_mb
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
