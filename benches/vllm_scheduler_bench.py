"""vLLM 0.33's own Scheduler loop on vLLM's manager and on pagedkv's drop-in.

Runs in an environment with vLLM 0.33 and pagedkv installed (e.g. the one
``../shared/tools/vllm_tests/run.sh venv wheel`` makes). The scheduler is vLLM's
``Scheduler`` built by vLLM's test helper ``create_scheduler`` (hence
``--vllm-tests``: the ``tests/`` tree of vLLM's source distribution, and an
offline Hugging Face cache holding ``facebook/opt-125m``'s config). Rounds
alternate between the two managers in one process; each round replays the
same workload (shared system prompts, unique suffixes, arrivals spread over
steps) until every request finishes, with a fake model that samples one token
per scheduled request. Reported per side: the scheduler loop's wall time per
step and the time inside the manager's methods per step (every public method
timed the same way on both sides), min and median over the rounds, and the
time per call of ``allocate_slots`` and ``get_computed_blocks``.

    HF_HOME=$DROPIN/hf_home HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu \\
      $DROPIN/.venv/bin/python benches/vllm_scheduler_bench.py \\
      --vllm-tests $DROPIN/vllm_tests --rounds 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

MANAGER_METHODS = (
    "get_computed_blocks",
    "allocate_slots",
    "free",
    "pop_blocks_for_free",
    "get_blocks",
    "get_block_ids",
    "cache_blocks",
    "remove_skipped_blocks",
    "record_prefix_cache_stats",
    "make_prefix_cache_stats",
    "take_events",
    "new_step_starts",
    "take_new_block_ids",
    "take_kv_cache_block_copies",
    "take_boundary_state_offloads",
    "estimate_cached_tokens",
)


def workload(seed: int, n: int) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt, output tokens) per request."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 30000) for _ in range(rng.randrange(256, 1024))] for _ in range(8)]
    out = []
    for i in range(n):
        suffix = [rng.randrange(1, 30000) for _ in range(rng.randrange(16, 256))]
        prompt = rng.choice(systems) + suffix
        out.append((i // 4, prompt, rng.randrange(16, 128)))
    return out


def timed(fn: Callable[..., Any], acc: list[float]) -> Callable[..., Any]:
    """``fn``, adding its seconds to ``acc[0]`` and one call to ``acc[1]``."""
    clock = time.perf_counter

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[0] += clock() - t
            acc[1] += 1

    return wrapper


#: The methods whose time per call is reported on their own.
BROKEN_DOWN = ("allocate_slots", "get_computed_blocks")


def run_once(
    side: str, reqs: list[tuple[int, list[int], int]], args: argparse.Namespace
) -> tuple[float, float, int, dict[str, float]]:
    import pagedkv.vllm as pv
    from tests.v1.core.utils import create_scheduler
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    if side == "pagedkv":
        pv.install()
    else:
        pv.uninstall()
    sched = create_scheduler(
        enable_prefix_caching=True,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=2048,  # facebook/opt-125m's positions
    )
    mgr = sched.kv_cache_manager
    assert (type(mgr).__module__.startswith("pagedkv")) == (side == "pagedkv"), type(mgr)
    accs = {name: [0.0, 0] for name in MANAGER_METHODS}
    for name in MANAGER_METHODS:
        setattr(mgr, name, timed(getattr(mgr, name), accs[name]))
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(16, sha256_cbor)
    pending = list(enumerate(reqs))
    step = steps = 0
    t0 = time.perf_counter()
    while pending or sched.get_num_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, out) = pending.pop(0)
            sp = SamplingParams(max_tokens=out, ignore_eos=True)
            sched.add_request(Request(f"r{i}", prompt, sp, None, block_hasher=hasher))
        so = sched.schedule()
        ids = list(so.num_scheduled_tokens)
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: k for k, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        sched.update_from_output(so, mro)
        step += 1
        steps += 1 if ids else 0
    wall = time.perf_counter() - t0
    per_call = {name: accs[name][0] / max(accs[name][1], 1) for name in BROKEN_DOWN}
    in_manager = sum(a[0] for a in accs.values())
    return wall / max(steps, 1), in_manager / max(steps, 1), steps, per_call


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--vllm-tests", required=True, help="vLLM's source tree holding tests/")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    sys.path.insert(0, args.vllm_tests)
    reqs = workload(args.seed, args.requests)
    res: dict[str, list[tuple[float, float, int, dict[str, float]]]] = {
        "vllm": [],
        "pagedkv": [],
    }
    for r in range(args.rounds):
        for side in ("vllm", "pagedkv") if r % 2 == 0 else ("pagedkv", "vllm"):
            res[side].append(run_once(side, reqs, args))
    print(f"{args.requests} requests, {args.rounds} rounds per side (interleaved); µs per step")
    print(f"{'side':8} {'steps':>6} {'loop min':>9} {'loop med':>9} {'mgr min':>8} {'mgr med':>8}")
    for side, rows in res.items():
        loop = [x[0] * 1e6 for x in rows]
        mgr = [x[1] * 1e6 for x in rows]
        print(
            f"{side:8} {rows[0][2]:>6} {min(loop):>9.1f} {statistics.median(loop):>9.1f} "
            f"{min(mgr):>8.1f} {statistics.median(mgr):>8.1f}"
        )
    print("µs per call (min / median)")
    for name in BROKEN_DOWN:
        line = [f"  {name:20}"]
        for side, rows in res.items():
            calls = [x[3][name] * 1e6 for x in rows]
            line.append(f"{side} {min(calls):6.2f} / {statistics.median(calls):6.2f}")
        print("  ".join(line))
    v = statistics.median(x[1] for x in res["vllm"])
    k = statistics.median(x[1] for x in res["pagedkv"])
    print(f"manager time per step, median: vLLM / pagedkv = {v / k:.1f}x")
    steps = {side: {x[2] for x in rows} for side, rows in res.items()}
    same = steps["vllm"] == steps["pagedkv"]
    print(f"steps per run: {steps} (the same schedule on both sides: {same})")


if __name__ == "__main__":
    main()
