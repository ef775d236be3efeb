"""The Python-boundary cost of one decode step for 256 running requests: the batch
calls from Python against the same calls made in Rust (``decode_batch`` example:
same manager, same 256 requests of 1,000 prompt tokens; per step one
``allocate_slots_batch`` — a new block every 16 steps per request — and one
``append_token_ids_batch``; 2,000 steps per round;
the best round counts on both sides, since the machine may be shared).

    python benches/boundary_bench.py [--rounds 5] [--no-rust]

Prints µs per call from Python (requests named by id and by handle), the core's
figure and the difference: the cost of crossing the boundary (argument conversion,
the result arrays, the call itself).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pagedkv as pk
from pagedkv._util import SplitMix64

ROOT = Path(__file__).resolve().parent.parent
REQS, STEPS = 256, 2000


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    """The same token stream as ``pagedkv_benches::tokens`` (SplitMix64)."""
    rng = SplitMix64(seed)
    return [rng.below(vocab) for _ in range(n)]


def _setup() -> tuple[pk.KVCacheManager, list[str], list[int]]:
    spec = pk.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    config = pk.KVCacheConfig(
        num_blocks=1 << 16, kv_cache_groups=[pk.KVCacheGroupSpec(["layer"], spec)]
    )
    mgr = pk.KVCacheManager(config, max_model_len=1 << 20)
    ids = [f"req-{i}" for i in range(REQS)]
    handles = []
    for i, rid in enumerate(ids):
        handles.append(mgr.add_request(rid, tokens(i, 1000, 32000)))
        hit = mgr.get_computed_blocks(rid)
        mgr.allocate_slots(
            rid, 1000 - hit.num_computed_tokens, num_computed_tokens=0, new_computed_blocks=hit
        )
    return mgr, ids, handles


def python_side(rounds: int) -> dict[str, float]:
    out = {}
    toks = list(range(REQS))
    for name in ["ids", "handles (list)", "handles (int64 array)"]:
        best = float("inf")
        for _ in range(rounds):
            mgr, ids, handles = _setup()
            refs: Any = {
                "ids": ids,
                "handles (list)": handles,
                "handles (int64 array)": np.array(handles, dtype=np.int64),
            }[name]
            computed = [np.full(REQS, 999 + s, dtype=np.int64) for s in range(STEPS)]
            alloc, append = mgr.allocate_slots_batch, mgr.append_token_ids_batch
            t = time.perf_counter()
            for step in range(STEPS):
                n_ok, _ = alloc(refs, 1, computed[step])
                append(refs, toks)
            best = min(best, time.perf_counter() - t)
            assert n_ok == REQS
        out[name] = best / STEPS * 1e6
    return out


def rust_side() -> dict[str, float]:
    res = subprocess.run(
        ["cargo", "run", "--release", "-q", "-p", "pagedkv-benches", "--example", "decode_batch"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    out = {}
    for line in res.stdout.splitlines():
        m = re.match(r"([\d.]+)(µs|ns) per 256-request decode step by (\w+)", line)
        if m:
            v = float(m.group(1)) / (1000 if m.group(2) == "ns" else 1)
            out[m.group(3)] = v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-rust", action="store_true", help="skip the core figure")
    args = ap.parse_args()
    py = python_side(args.rounds)
    core = {} if args.no_rust else rust_side()
    print(
        "decode step, 256 running requests: allocate_slots_batch + append_token_ids_batch"
        " (µs per step)"
    )
    for name, us in py.items():
        key = "ids" if name == "ids" else "handles"
        if key in core:
            print(
                f"  python by {name:<22} {us:7.2f}   core {core[key]:6.2f}   "
                f"boundary {us - core[key]:6.2f}"
            )
        else:
            print(f"  python by {name:<22} {us:7.2f}")


if __name__ == "__main__":
    main()
