"""Soak: a long randomized scheduler run over one manager, bounded in time, sampling
the process RSS and the free-block count at intervals.

    python benches/soak.py --seconds 300            # full-attention pool
    python benches/soak.py --seconds 300 --hybrid   # full attention + sliding window

The workload runs through the scheduler policy (``pagedkv.sim.policy``) over the
manager: requests arrive at random with prompts that share prefixes (so the
prefix cache hits and evicts), are admitted through ``get_computed_blocks`` +
``allocate_slots``, decode one token per step, are preempted when the pool is
full, and finish after a random output length. After every step the soak adds
what a scheduler does not: cached blocks are occasionally evicted, the prefix
cache is reset when idle, sliding-window blocks are released, events and stats
are drained. Every sample runs ``check_invariants``. At the end every request is
removed and the cache reset: all usable blocks must be free again and the map
empty. The RSS after warm-up (the second sample) is compared with the final one.

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
from pagedkv.sim import ManagerBackend, Request, Scheduler, SchedulerConfig


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
    sched = Scheduler(ManagerBackend(mgr), SchedulerConfig(max_num_seqs=max_batch))
    st = sched.stats
    prefixes = [[rng.randrange(32000) for _ in range(rng.choice([16, 64, 200]))] for _ in range(24)]
    res = SoakResult(
        num_blocks=num_blocks, hybrid=hybrid, seconds=0.0, ops=0, steps=0, finished=0, preemptions=0
    )
    next_id = 0
    start = time.perf_counter()
    next_sample = start
    other_ops = 0  # manager calls the policy does not make

    def ops() -> int:
        # the policy's calls, one per request (add_request, each batch crossing once)
        added = st.calls.get("add_request", 0) + st.calls.get("append_token_ids_batch", 0)
        return st.manager_calls + added + other_ops

    def sample() -> None:
        mgr.check_invariants()
        s = Sample(
            seconds=round(time.perf_counter() - start, 2),
            ops=ops(),
            rss_mb=round(rss_mb(), 2),
            free_blocks=mgr.num_free_blocks,
            running=len(sched.running),
            waiting=len(sched.waiting),
            cached_hashes=mgr.num_cached_block_hashes,
        )
        res.samples.append(s)
        if verbose:
            print(json.dumps(asdict(s)), flush=True)

    while True:
        now = time.perf_counter()
        if now >= next_sample or (sample_steps and st.steps % sample_steps == 0):
            sample()
            next_sample = now + interval
        if now - start >= seconds or (max_ops is not None and ops() >= max_ops):
            break
        # Arrivals.
        for _ in range(rng.randrange(4)):
            if len(sched.waiting) + len(sched.running) >= 2 * max_batch:
                break
            prompt = list(rng.choice(prefixes))[: rng.randrange(1, 220)]
            prompt += [rng.randrange(32000) for _ in range(rng.randrange(1, 100))]
            output = [rng.randrange(32000) for _ in range(rng.randrange(1, 200))]
            sched.add_request(Request(f"q{next_id}", prompt, output))
            next_id += 1
        # One scheduler step: admission, prefill, decode, preemption, finishing.
        sched.step()
        # Maintenance.
        if hybrid:
            for req in sched.running:
                mgr.remove_skipped_blocks(req.request_id, req.num_computed_tokens)
                other_ops += 1
        if rng.random() < 0.02:
            mgr.evict_blocks([rng.randrange(1, num_blocks) for _ in range(4)])
            other_ops += 1
        if not sched.running and rng.random() < 0.5:
            mgr.reset_prefix_cache()
            other_ops += 1
        mgr.take_events()
        mgr.make_prefix_cache_stats()
        other_ops += 2

    for req in [*sched.running, *sched.waiting]:
        mgr.remove_request(req.request_id)
    mgr.check_invariants()
    res.seconds = round(time.perf_counter() - start, 2)
    res.ops = ops()
    res.steps, res.finished, res.preemptions = st.steps, st.finished, st.preemptions
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
