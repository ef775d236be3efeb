"""vLLM 0.33's HiSparse layout on vLLM's own manager and on pagedkv's drop-in.

The layout of vLLM's HiSparse tests (``[host source, indexer, resident, hot]``,
16-token blocks) with prefix caching, driven as vLLM's HiSparse connector
drives it: each request is allocated, its residency planned
(``advance_scheduled``), every spill acknowledged so host pages publish, then
it decodes a few tokens and is freed; every other request repeats an earlier
prompt and starts from its host-backed prefix hit. Both sides run the same
calls, interleaved over ``--rounds`` rounds, in one process; the time is
spent inside the manager's and the coordinator's calls.

    python benches/vllm_hisparse_bench.py [--rounds 5] [--requests 200]

Needs vLLM 0.33 (``pagedkv[vllm]``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any


def run_once(side: str, prompts: list[list[int]], decode: int) -> tuple[float, list[Any]]:
    import torch
    import vllm.v1.core.kv_cache_manager as vllm_core
    from pagedkv.vllm import KVCacheManager
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HiSparseHotSpec,
        HiSparseResidentSpec,
        KVCacheConfig,
        KVCacheGroupRole,
        KVCacheGroupSpec,
    )
    from vllm.v1.request import Request

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    cfg = KVCacheConfig(
        num_blocks=512,
        hisparse_host_num_blocks=1024,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["source"], spec, role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True
            ),
            KVCacheGroupSpec(["indexer"], spec, role=KVCacheGroupRole.HISPARSE_INDEXER),
            KVCacheGroupSpec(["resident"], HiSparseResidentSpec(block_size=16, page_size=64)),
            KVCacheGroupSpec(
                ["hot"], HiSparseHotSpec(block_size=16, page_size=64, blocks_per_request=2)
            ),
        ],
    )
    cls = KVCacheManager if side == "pagedkv" else vllm_core.KVCacheManager
    mgr = cls(
        cfg, max_model_len=4096, scheduler_block_size=16, hash_block_size=16, enable_caching=True
    )
    coordinator = get_hisparse_coordinator(mgr)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    out: list[Any] = []
    spent = 0.0
    clock = time.perf_counter
    for i, prompt in enumerate(prompts):
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=decode), None, block_hasher=hasher)
        t = clock()
        blocks, hit, _ = mgr.get_computed_blocks(req)
        new = mgr.allocate_slots(
            req, req.num_tokens - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks
        )
        coordinator.advance_scheduled([(req.request_id, req.num_tokens)])
        command = coordinator.build_offload_command()
        counts = {spill.transfer_id: 1 for spill in command.page_transfers}
        coordinator.update_spills(counts, counts)
        spent += clock() - t
        out.append((hit, new is not None))
        req.num_computed_tokens = req.num_tokens
        for _ in range(decode):
            req.append_output_token_ids(7)
            t = clock()
            mgr.allocate_slots(req, 1)
            coordinator.advance_scheduled([(req.request_id, req.num_tokens)])
            spent += clock() - t
            req.num_computed_tokens += 1
        t = clock()
        mgr.free(req)
        spent += clock() - t
    return spent / len(prompts), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--decode", type=int, default=16)
    args = ap.parse_args()
    rng = random.Random(0)
    prompts: list[list[int]] = []
    for i in range(args.requests):
        if i % 2 and prompts:
            prompts.append(list(rng.choice(prompts)))
        else:
            prompts.append([rng.randrange(1, 30000) for _ in range(rng.randrange(64, 512))])
    times: dict[str, list[float]] = {"vllm": [], "pagedkv": []}
    results: dict[str, list[Any]] = {}
    for r in range(args.rounds):
        for side in ("vllm", "pagedkv") if r % 2 == 0 else ("pagedkv", "vllm"):
            t, out = run_once(side, prompts, args.decode)
            times[side].append(t)
            results.setdefault(side, out)
    print(
        f"{args.requests} requests ({args.decode} decode steps each), {args.rounds} rounds per "
        "side (interleaved); µs per request in the manager and the HiSparse coordinator"
    )
    for side, ts in times.items():
        print(f"  {side:8s} min {min(ts) * 1e6:9.1f}   median {statistics.median(ts) * 1e6:9.1f}")
    print(f"same hits and admissions on both sides: {results['vllm'] == results['pagedkv']}")


if __name__ == "__main__":
    main()
