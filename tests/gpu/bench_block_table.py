"""Host cost of a step's block-table inputs: the slot mapping of the scheduled
tokens (vectorised NumPy, against a per-token Python loop for scale) and the
upload of the block table to the device mirror. Runs on CUDA when available,
otherwise on the CPU (where the "upload" is a copy into the mirror tensor).

    python tests/gpu/bench_block_table.py [--reqs 256] [--block-size 16] [--max-model-len 4096]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

try:
    import torch
except ImportError:  # a script, not a pytest module: say so and stop, as without CUDA
    if __name__ == "__main__":
        print("torch not installed: skipped")
        raise SystemExit(0) from None
    raise

from pagedkv.torch import BlockTable, step_positions


def _time(fn: object, repeat: int, sync: bool) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs."""
    assert callable(fn)
    samples = []
    for _ in range(repeat):
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t)
    return float(np.median(samples))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reqs", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = device == "cuda"
    bs, reqs = args.block_size, args.reqs
    cols = -(-args.max_model_len // bs)
    rng = np.random.default_rng(0)
    table = BlockTable(bs, reqs, cols, 8192, device)
    lens = rng.integers(64, args.max_model_len - 64, size=reqs)
    for r in range(reqs):
        table.add_row(rng.integers(1, 1 << 20, size=-(-int(lens[r]) // bs)).astype(np.int32), r)
    rows = np.arange(reqs)

    print(
        f"device={device} reqs={reqs} block_size={bs} max_blocks_per_req={cols} "
        f"table={reqs * cols * 4 / 1024:.0f} KiB pinned={table.cpu.is_pinned()}"
    )
    for label, counts in (
        ("decode (1 token each)", np.ones(reqs, dtype=np.int64)),
        ("mixed (8192 tokens)", np.full(reqs, 8192 // reqs, dtype=np.int64)),
    ):
        computed = lens - counts

        def vectorised(counts: np.ndarray = counts, computed: np.ndarray = computed) -> None:
            idx, pos = step_positions(rows, computed, counts)
            table.compute_slot_mapping(idx, pos)

        def per_token(counts: np.ndarray = counts, computed: np.ndarray = computed) -> None:
            out = []
            for r in range(reqs):
                for p in range(int(computed[r]), int(computed[r] + counts[r])):
                    out.append(int(table.np[r, p // bs]) * bs + p % bs)

        t_vec = _time(vectorised, args.repeat, False)
        t_loop = _time(per_token, max(args.repeat // 10, 3), False)
        print(
            f"slot mapping, {label}: {t_vec * 1e6:.1f} us vectorised, "
            f"{t_loop * 1e6:.1f} us per-token Python loop"
        )

    t_up = _time(lambda: table.commit(reqs), args.repeat, sync)
    print(f"block-table upload ({reqs} rows): {t_up * 1e6:.1f} us per step")
    t_slots = _time(lambda: table.commit_slot_mapping(reqs), args.repeat, sync)
    print(f"slot-mapping upload ({reqs} tokens): {t_slots * 1e6:.1f} us per step")


if __name__ == "__main__":
    main()
