"""Block hashing side by side: pagedkv against vLLM 0.33's own hash function,
interleaved round by round in one invocation. 16-token blocks, chained (each
block's parent is the previous hash).

    python benches/hash_bench.py [--vllm-python ORACLE_VENV/bin/python] [--blocks 1024] [--rounds 5]

pagedkv: per block through ``add_request`` of a ``--blocks``-block prompt (hashes
every full block; the prompt given as a uint32 array and as a list), per
algorithm, the ``sha256_cbor`` memo off; with the memo, the prompt added
before (every block found in it instead of hashed); and with a live request of
the same prompt (its hashes taken for every block, the memo a single set that
finds none). vLLM:
``hash_block_tokens(sha256_cbor, parent, tokens, None)`` per block, the
function its request block hasher calls for every block, in a subprocess
that stays up and measures one round each time this process has
measured one, so both sides see the same machine load. Each figure is min /
median over the rounds. The core alone (no Python) is ``cargo bench -p
pagedkv-benches --bench core -- hash_block``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import time

import numpy as np
import pagedkv as pk

VLLM_SNIPPET = """
import random, sys, time
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash
init_none_hash(sha256_cbor)
n = int(sys.argv[1])
rng = random.Random(0)
blocks = [tuple(rng.randrange(32000) for _ in range(16)) for _ in range(n)]
print("ready", flush=True)
for line in sys.stdin:
    best = float("inf")
    for _ in range(3):
        parent = None
        t = time.perf_counter()
        for b in blocks:
            parent = hash_block_tokens(sha256_cbor, parent, b, None)
        best = min(best, time.perf_counter() - t)
    print(best / n * 1e6, flush=True)
"""

# (label, hash algorithm, memo blocks, a live request shares the prompt):
# every block hashed (no memo: the same prompt is added again each time, the
# one before removed); sha256_cbor with its memo, the prompt seen before
# (every block looked up, found and compared in full); and with the request
# before still live (the prompt compared with its tokens, its hashes copied).
ALGOS = (
    ("sha256_cbor", "sha256_cbor", 0, False),
    ("sha256_cbor, memo", "sha256_cbor", 1 << 12, False),
    ("sha256_cbor, shared", "sha256_cbor", 1, True),
    ("xxhash_cbor", "xxhash_cbor", 0, False),
    ("xxh3_native", "xxh3_native", 0, False),
)


class PagedkvSide:
    """One round: the best of 3 ``add_request`` calls per algorithm and input form."""

    def __init__(self, n_blocks: int) -> None:
        spec = pk.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
        config = pk.KVCacheConfig(num_blocks=64, kv_cache_groups=[pk.KVCacheGroupSpec(["l"], spec)])
        rng = random.Random(0)
        self.prompt = [rng.randrange(32000) for _ in range(16 * n_blocks)]
        self.arr = np.array(self.prompt, dtype=np.uint32)
        self.n = n_blocks
        self.mgrs = {
            label: (
                pk.KVCacheManager(
                    config,
                    max_model_len=len(self.prompt) + 16,
                    hash_algo=algo,
                    hash_memo_blocks=memo,
                ),
                shared,
            )
            for label, algo, memo, shared in ALGOS
        }
        # The request the next one shares its prompt with (if any stays live).
        self.live = "r0"
        self.count = 0
        for mgr, shared in self.mgrs.values():
            mgr.add_request(self.live, self.arr)
            if not shared:
                mgr.remove_request(self.live)

    def round(self) -> dict[str, float]:
        out = {}
        for algo, (mgr, shared) in self.mgrs.items():
            for form, tokens in (("uint32 array", self.arr), ("list", self.prompt)):
                best = float("inf")
                for _ in range(3):
                    self.count += 1
                    rid = f"r{self.count}"
                    t = time.perf_counter()
                    mgr.add_request(rid, tokens)
                    best = min(best, time.perf_counter() - t)
                    if shared:
                        # The new request is the live one the next shares with.
                        mgr.remove_request(self.live)
                        self.live = rid
                    else:
                        mgr.remove_request(rid)
                out[f"{algo} ({form})"] = best / self.n * 1e6
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", help="an interpreter with vLLM 0.33 installed")
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    ours = PagedkvSide(args.blocks)
    proc = None
    if args.vllm_python:
        proc = subprocess.Popen(
            [args.vllm_python, "-c", VLLM_SNIPPET, str(args.blocks)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdin is not None and proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit("the vLLM side did not start")
    rounds: dict[str, list[float]] = {}
    vllm: list[float] = []
    try:
        for _ in range(args.rounds):
            for name, us in ours.round().items():
                rounds.setdefault(name, []).append(us)
            if proc is not None:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
                vllm.append(float(proc.stdout.readline()))
    finally:
        if proc is not None:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait()
    print(
        f"hashing a {args.blocks}-block prompt (16 tokens per block), µs per block, "
        f"min / median of {args.rounds} interleaved rounds"
    )
    for name, values in rounds.items():
        lo, med = min(values), statistics.median(values)
        line = f"  pagedkv {name:<36} {lo:7.3f} / {med:7.3f}"
        if name.startswith("xxh3_native"):
            line += f"   ({16 * 4 / (lo * 1e-6) / 1e9:.2f} GB/s of token data at the min)"
        if vllm and name.startswith("sha256_cbor"):
            line += (
                f"   vLLM / pagedkv: {min(vllm) / lo:.0f}x (min), "
                f"{statistics.median(vllm) / med:.0f}x (median)"
            )
        print(line)
    if vllm:
        print(
            f"  vLLM 0.33 sha256_cbor (hash_block_tokens)          "
            f"{min(vllm):7.3f} / {statistics.median(vllm):7.3f}"
        )


if __name__ == "__main__":
    main()
