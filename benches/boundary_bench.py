"""The Python-boundary cost of one decode step for 256 running requests: the batch
calls from Python against the same calls made inside the core, in one process,
round by round (256 requests of 1,000 prompt tokens; per step one
``allocate_slots_batch`` — a new block every 16 steps per request — and one
``append_token_ids_batch``; 2,000 steps per round on a fresh manager).

    python benches/boundary_bench.py [--rounds 7]

Each round runs the Python loop (requests named by id, by a list of handles, by
an int64 array of handles, and by an int64 array with the computed counts left
to the manager and the sampled tokens as a uint32 array: no per-step Python
list; and the same with the tokens in the allocation call, one crossing a step)
and the core loop (``KVCacheManager._core_decode_steps``: the same calls
from Rust, no Python per step; built only with the extension's
``bench-core-loop`` feature: ``maturin develop --release --features
bench-core-loop``) on identical managers, one after the other, so
both see the same machine load. Prints µs per step, min / median
over the rounds, and the difference: the cost of crossing the boundary
(argument conversion, the result arrays, the call itself).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import pagedkv as pk
from pagedkv._util import SplitMix64

REQS, STEPS = 256, 2000
# Built only with the extension's `bench-core-loop` feature (not in the wheel).
CORE_LOOP = "_core_decode_steps"


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


FORMS = (
    "ids",
    "handles (list)",
    "handles (int64 array)",
    "int64 handles, tracked counts",
    "one call, tokens in it",
)


def python_steps(form: str) -> float:
    """µs per step of the Python loop on a fresh manager."""
    mgr, ids, handles = _setup()
    refs: Any = {
        "ids": ids,
        "handles (list)": handles,
        "handles (int64 array)": np.array(handles, dtype=np.int64),
        "int64 handles, tracked counts": np.array(handles, dtype=np.int64),
        "one call, tokens in it": np.array(handles, dtype=np.int64),
    }[form]
    toks = list(range(REQS))
    computed = [np.full(REQS, 999 + s, dtype=np.int64) for s in range(STEPS)]
    alloc, append = mgr.allocate_slots_batch, mgr.append_token_ids_batch
    n_ok = 0
    t = time.perf_counter()
    if form == "int64 handles, tracked counts":
        # No per-step counts: the manager tracks what each request computed.
        tok_arr = np.array(toks, dtype=np.uint32)
        for _ in range(STEPS):
            n_ok, _ = alloc(refs, 1)
            append(refs, tok_arr)
    elif form == "one call, tokens in it":
        # The same, the sampled tokens handed over by the next step's call.
        tok_arr = np.array(toks, dtype=np.uint32)
        for _ in range(STEPS):
            n_ok, _ = alloc(refs, 1, append_token_ids=tok_arr)
    else:
        for step in range(STEPS):
            n_ok, _ = alloc(refs, 1, computed[step])
            append(refs, toks)
    elapsed = time.perf_counter() - t
    assert n_ok == REQS
    return elapsed / STEPS * 1e6


def core_steps() -> float:
    """µs per step of the same calls made inside the core, on a fresh manager."""
    mgr, _, handles = _setup()
    ns: int = getattr(mgr, CORE_LOOP)(handles, STEPS, 999)
    return ns / STEPS / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if not hasattr(pk.KVCacheManager, CORE_LOOP):
        raise SystemExit(
            "boundary_bench.py needs pagedkv built with the bench-core-loop feature: "
            "maturin develop --release --features bench-core-loop"
        )
    py: dict[str, list[float]] = {f: [] for f in FORMS}
    core: list[float] = []
    for r in range(args.rounds):
        # Alternate which side goes first.
        sides = [*FORMS, "core"] if r % 2 == 0 else ["core", *FORMS]
        for side in sides:
            if side == "core":
                core.append(core_steps())
            else:
                py[side].append(python_steps(side))
    print(
        "decode step, 256 running requests: allocate_slots_batch + append_token_ids_batch"
        f" (µs per step, min / median of {args.rounds} interleaved rounds)"
    )
    c_min, c_med = min(core), statistics.median(core)
    print(f"  core (no Python per step)                {c_min:7.2f} / {c_med:7.2f}")
    for form, values in py.items():
        lo, med = min(values), statistics.median(values)
        print(
            f"  python by {form:<30} {lo:7.2f} / {med:7.2f}   "
            f"boundary {lo - c_min:6.2f} / {med - c_med:6.2f}"
        )


if __name__ == "__main__":
    main()
