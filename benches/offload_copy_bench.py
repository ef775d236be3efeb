"""Bandwidth of the host store's copies (device blocks <-> offload tier slots).

Builds a full-attention KV cache (``--layers`` layers of ``--kv-heads`` x
``--head-size`` in ``--dtype``, ``--block-size`` tokens a block) on ``--device``
and a :class:`~pagedkv.torch.HostKVStore` of ``--chunks`` chunks, then times
storing every chunk and loading every chunk back, ``--rounds`` times; prints
GB/s (min / median). On CUDA the host buffers are pinned and each batch is
timed to its completion event; on the CPU the copies are plain memory copies.

With ``--disk DIR`` it also times the disk tier below host memory, as the torch
engine runs it: every chunk's bytes gathered from its host blocks and written
to a :class:`~pagedkv.offload.DiskTier` file in ``DIR`` (checksummed), then
read back (checked) and scattered into the host blocks. The OS page cache sits
between the file and the device: the figures are the tier's path, not the
disk's.

    python benches/offload_copy_bench.py --device cpu --rounds 5
    python benches/offload_copy_bench.py --device cuda --chunks 64 --rounds 5
    python benches/offload_copy_bench.py --disk /tmp --rounds 5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np
import pagedkv as pk
import torch
from pagedkv.offload import DiskTier, offload_key
from pagedkv.torch import HostKVStore, allocate_kv_cache


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--layers", type=int, default=8, choices=range(1, 257), metavar="1..256")
    ap.add_argument("--kv-heads", type=int, default=8, choices=range(1, 129), metavar="1..128")
    ap.add_argument("--head-size", type=int, default=128, choices=(64, 80, 96, 128, 256))
    ap.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32, 64))
    ap.add_argument(
        "--blocks-per-chunk", type=int, default=16, choices=range(1, 257), metavar="1..256"
    )
    ap.add_argument("--chunks", type=int, default=16, choices=range(1, 4097), metavar="1..4096")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--rounds", type=int, default=5, choices=range(1, 101), metavar="1..100")
    ap.add_argument("--disk", default=None, help="a directory: time the disk tier there too")
    args = ap.parse_args()
    if args.disk is not None and not os.path.isdir(args.disk):
        ap.error(f"--disk {args.disk!r}: not a directory")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available here")

    specs = {
        f"layer.{i}": pk.FullAttentionSpec(
            args.block_size, args.kv_heads, args.head_size, args.dtype
        )
        for i in range(args.layers)
    }
    num_blocks = args.chunks * args.blocks_per_chunk + 1
    page = next(iter(specs.values())).page_size_bytes
    config = pk.get_kv_cache_config(
        specs,
        page * num_blocks * args.layers,
        max_model_len=args.block_size,
        num_gpu_blocks_override=num_blocks,
    )
    cache = allocate_kv_cache(config, args.device)
    store = HostKVStore(cache, args.chunks, args.blocks_per_chunk)
    slots = np.arange(args.chunks)
    blocks = np.arange(1, num_blocks)
    nbytes = store.chunk_nbytes(0) * args.chunks
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rates: dict[str, list[float]] = {"store": [], "load": []}
    for _ in range(args.rounds):
        for name in ("store", "load"):
            sync()
            t0 = time.perf_counter()
            getattr(store, name)(0, slots, blocks).wait()
            rates[name].append(nbytes / (time.perf_counter() - t0) / 1e9)
    if args.disk is not None:
        rates.update(_disk_rates(store, args.disk, args.chunks, args.rounds))
    dev = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    print(
        f"{dev}: {args.chunks} chunks of {store.chunk_nbytes(0) / 2**20:.1f} MiB "
        f"({args.layers} layers, {args.blocks_per_chunk} blocks of {args.block_size} tokens), "
        f"{nbytes / 2**20:.0f} MiB a batch, {args.rounds} rounds"
    )
    directions = {
        "store": "device -> host",
        "load": "host -> device",
        "disk write": "host -> disk",
        "disk read": "disk -> host",
    }
    for name, r in rates.items():
        print(f"  {name} ({directions[name]}): {min(r):6.2f} / {statistics.median(r):6.2f} GB/s")


def _disk_rates(
    store: HostKVStore, directory: str, chunks: int, rounds: int
) -> dict[str, list[float]]:
    """Every chunk gathered and written to a disk tier, then read back and
    scattered, ``rounds`` times (GB/s of chunk bytes)."""
    size = store.chunk_nbytes(0)
    disk = DiskTier(directory, chunks * (size + 4096), size)
    bpc = store.blocks_per_chunk
    host = [np.arange(c * bpc, (c + 1) * bpc) for c in range(chunks)]
    keys = [offload_key(c.to_bytes(32, "big"), 0) for c in range(chunks)]
    buf = np.empty(size, dtype=np.uint8)
    out: dict[str, list[float]] = {"disk write": [], "disk read": []}
    for _ in range(rounds):
        t0 = time.perf_counter()
        for k, h in zip(keys, host, strict=True):
            if not disk.put(k, store.chunk_bytes(0, h, out=buf)):
                raise SystemExit(f"the disk refused a write in {directory}")
        out["disk write"].append(size * chunks / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        for k, h in zip(keys, host, strict=True):
            if disk.get_into(k, buf) != "hit":
                raise SystemExit("a chunk did not read back")
            store.set_chunk_bytes(0, h, buf)
        out["disk read"].append(size * chunks / (time.perf_counter() - t0) / 1e9)
    return out


if __name__ == "__main__":
    main()
