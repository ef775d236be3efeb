"""Block hashing side by side: pagedkv against vLLM 0.33's own hash function, in one
invocation. 16-token blocks, chained (each block's parent is the previous hash).

    python benches/hash_bench.py [--vllm-python ORACLE_VENV/bin/python] [--blocks 1024]

pagedkv: per block through ``add_request`` of a ``--blocks``-block prompt (hashes
every full block; the prompt given as a uint32 array and as a list), per
algorithm. vLLM: ``hash_block_tokens(sha256_cbor, parent, tokens, None)`` per
block, the function its request block hasher calls for every block. The core alone
(no Python) is ``cargo bench -p pagedkv-benches --bench core -- hash_block``.
"""

from __future__ import annotations

import argparse
import random
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
best = float("inf")
for _ in range(5):
    parent = None
    t = time.perf_counter()
    for b in blocks:
        parent = hash_block_tokens(sha256_cbor, parent, b, None)
    best = min(best, time.perf_counter() - t)
print(best / n * 1e6)
"""


def pagedkv_side(n_blocks: int) -> dict[str, float]:
    spec = pk.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    config = pk.KVCacheConfig(num_blocks=64, kv_cache_groups=[pk.KVCacheGroupSpec(["l"], spec)])
    rng = random.Random(0)
    prompt = [rng.randrange(32000) for _ in range(16 * n_blocks)]
    arr = np.array(prompt, dtype=np.uint32)
    out = {}
    for algo in ("sha256_cbor", "xxhash_cbor", "xxh3_native"):
        mgr = pk.KVCacheManager(config, max_model_len=len(prompt) + 16, hash_algo=algo)
        for form, tokens in (("uint32 array", arr), ("list", prompt)):
            best = float("inf")
            for _ in range(7):
                t = time.perf_counter()
                mgr.add_request("r", tokens)
                best = min(best, time.perf_counter() - t)
                mgr.remove_request("r")
            out[f"{algo} ({form})"] = best / n_blocks * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", help="an interpreter with vLLM 0.33 installed")
    ap.add_argument("--blocks", type=int, default=1024)
    args = ap.parse_args()
    ours = pagedkv_side(args.blocks)
    vllm = None
    if args.vllm_python:
        res = subprocess.run(
            [args.vllm_python, "-c", VLLM_SNIPPET, str(args.blocks)],
            check=True,
            capture_output=True,
            text=True,
        )
        vllm = float(res.stdout.strip().splitlines()[-1])
    print(f"hashing a {args.blocks}-block prompt (16 tokens per block), µs per block")
    for name, us in ours.items():
        line = f"  pagedkv {name:<28} {us:8.3f}"
        if name.startswith("xxh3_native"):
            line += f"   ({16 * 4 / (us * 1e-6) / 1e9:.2f} GB/s of token data)"
        if vllm is not None and name.startswith("sha256_cbor"):
            line += f"   vLLM / pagedkv: {vllm / us:.0f}x"
        print(line)
    if vllm is not None:
        print(f"  vLLM 0.33 sha256_cbor (hash_block_tokens)  {vllm:8.3f}")


if __name__ == "__main__":
    main()
