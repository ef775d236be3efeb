"""vLLM 0.33's own Scheduler on vLLM's manager and on pagedkv's drop-in, step by step.

Each run builds two schedulers in one process from the same configuration:
one while vLLM's ``KVCacheManager`` is in place, one after
``pagedkv.vllm.install()``. Both get the same random workload (separate
``Request`` objects with the same ids, prompts, arrival times and block
hasher) and the same fake model: a request's sampled tokens, draft tokens,
draft acceptance, KV-connector loads and load failures are functions of the
seed, the request id and the token position, so both sides see the same model
as long as their schedules agree. After every ``schedule()`` and every
``update_from_output()`` the harness compares:

- the ``SchedulerOutput``: new requests with their block ids and computed
  tokens, cached requests' new block ids, computed and output tokens and
  resumptions, ``num_scheduled_tokens``, spec tokens, preempted and finished
  ids, ``num_common_prefix_blocks``, blocks to zero and block copies, the
  connector's metadata;
- every live request's block table (``kv_cache_manager.get_block_ids``) and
  ``num_computed_tokens``, the pool's free-block count and usage;
- the engine outputs (new tokens, finish reasons) and the scheduler stats
  (prefix-cache hits, queries and requests, connector hits, running and
  waiting counts, KV-cache usage);
- every KV event the scheduler publishes (when events are on).

The first difference ends the run and is reported with its step and a diff.
Run with vLLM's environment (vLLM 0.33 on CPU, the HF config of
``facebook/opt-125m`` in an offline cache):

    HF_HOME=$DROPIN/hf_home $DROPIN/.venv/bin/python benches/vllm_scheduler_diff.py \\
        --configs all --seeds 3 [--json FILE]

``--configs`` takes ``all``, names, or shell-style patterns (``'stream*'``);
``--list`` prints the configurations.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from scheduler_diff.cases import CASES, Case, describe, select
from scheduler_diff.drive import Side
from scheduler_diff.run import Result, run_case

# The harness's names a caller (tests/vllm/test_vllm_scheduler_diff.py) uses from here.
__all__ = ["CASES", "Case", "Result", "Side", "describe", "main", "run_case", "select"]


def print_step(step: int, phase: str, snap: dict[str, Any]) -> None:
    print(f"  step {step} {phase}: {json.dumps(snap, default=str)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--configs", nargs="+", default=["all"])
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per configuration")
    p.add_argument("--seed-base", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--json", help="write every run's result (and first diff) here")
    p.add_argument("--list", action="store_true", help="print the configurations and exit")
    p.add_argument(
        "--trace",
        action="store_true",
        help="print vLLM's side of every step (one configuration and seed)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="print errors' tracebacks")
    args = p.parse_args(argv)
    cases = select(args.configs)
    if args.list:
        for c in cases:
            print(f"{c.name:28} {describe(c)}")
        return 0
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    results: list[Result] = []
    for case in cases:
        for seed in range(args.seed_base, args.seed_base + args.seeds):
            r = run_case(case, seed, args.max_steps, print_step if args.trace else None)
            results.append(r)
            line = f"{case.name:28} seed {seed}: "
            if r.status == "identical":
                line += (
                    f"identical over {r.steps} steps "
                    f"({r.counts.get('preemptions', 0)} preemptions, "
                    f"{r.counts.get('hits', 0)} hit tokens, {r.counts.get('events', 0)} events)"
                )
                if r.detail:
                    line += f"; {r.detail}"
            elif r.status == "diverged":
                line += f"DIVERGED at {r.detail}"
            elif r.status == "unsupported":
                line += f"cannot be built here: {r.detail}"
            else:
                first = r.detail.splitlines()[0] if r.detail else ""
                line += f"ERROR {first}"
                if args.verbose:
                    line += "\n" + r.detail
            print(line, flush=True)
    runnable = [r for r in results if r.status != "unsupported"]
    same = sum(r.status == "identical" for r in runnable)
    print(
        f"{same} of {len(runnable)} runs identical"
        f" ({len(results) - len(runnable)} runs could not be built;"
        f" {sum(r.status == 'error' for r in results)} errors)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1, default=str)
    return 0 if same == len(runnable) else 1


if __name__ == "__main__":
    sys.exit(main())
