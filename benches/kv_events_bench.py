"""Throughput of the KV events path: the manager's events, the prefix index, and
KV events over ZMQ (loopback).

python benches/kv_events_bench.py          # manager events + index + ZMQ
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
from pagedkv.events import BlockRemoved, BlockStored, KVCacheEvent

N_BATCH, PER_BATCH = 4000, 50


def bench_index() -> None:
    from pagedkv import _core
    from pagedkv.events import wire
    from pagedkv.index import PrefixIndex

    rng = np.random.default_rng(0)
    replicas, chains, depth = 8, 20_000, 32
    idx = _core.PrefixIndex()
    reps = [idx.replica(f"r{i}") for i in range(replicas)]
    table = rng.integers(0, 2**63, size=(chains, depth), dtype=np.uint64)
    calls = blocks = 0
    t = time.perf_counter()
    for c in range(chains):
        for r in range(replicas):
            if (c + r) % 3 == 0:
                idx.store(reps[r], table[c, : depth - r], None, 0)
                calls += 1
                blocks += depth - r
    dt = time.perf_counter() - t
    print(
        f"store: {calls:,} BlockStored ({blocks:,} blocks) in {dt:.3f}s = "
        f"{calls / dt / 1e3:.0f} k events/s, {blocks / dt / 1e6:.2f} M blocks/s; "
        f"{idx.num_blocks:,} hashes held"
    )
    queries = [table[i % chains] for i in range(20_000)]
    t = time.perf_counter()
    for q in queries:
        idx.longest_prefix(q, None)
    dt = time.perf_counter() - t
    print(
        f"longest_prefix ({depth}-block chain, {replicas} replicas, uint64 array): "
        f"{dt / len(queries) * 1e6:.2f} us/query"
    )
    as_lists = [q.tolist() for q in queries]
    t = time.perf_counter()
    for ql in as_lists:
        idx.longest_prefix(ql, None)
    dt = time.perf_counter() - t
    print(f"longest_prefix from a list of Python ints: {dt / len(queries) * 1e6:.2f} us/query")
    t = time.perf_counter()
    for c in range(chains):
        for r in range(replicas):
            if (c + r) % 3 == 0:
                idx.remove(reps[r], table[c, : depth - r], 0)
    dt = time.perf_counter() - t
    print(f"remove: {blocks / dt / 1e6:.2f} M blocks/s; {idx.num_blocks} hashes left")

    enc = wire.KVEventEncoder()
    events: list[KVCacheEvent] = []
    for c in range(2000):
        h = table[c].tolist()
        events.append(
            BlockStored(
                h,
                None,
                list(range(depth * 16)),
                16,
                None,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        )
        events.extend(BlockRemoved([x], group_idx=0) for x in h[-4:])
    payloads = [enc.encode_events(events[i : i + 50]) for i in range(0, len(events), 50)]
    pi = PrefixIndex()
    t = time.perf_counter()
    for p in payloads:
        pi.apply("r0", wire.decode_batch(p))
    dt = time.perf_counter() - t
    print(
        f"decode + apply: {len(events):,} events in {dt:.3f}s = "
        f"{len(events) / dt / 1e3:.0f} k events/s"
    )


def bench_manager_events() -> None:
    """``take_events`` (the binding builds one event object per core event) and the
    wire encoding of what it returns, per event, over a prefix-sharing workload."""
    import pagedkv as pk
    from pagedkv.events import wire

    spec = pk.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="float16")
    config = pk.KVCacheConfig(num_blocks=600, kv_cache_groups=[pk.KVCacheGroupSpec(["l0"], spec)])
    mgr = pk.KVCacheManager(config, max_model_len=8192, enable_kv_cache_events=True)
    rng = np.random.default_rng(0)
    enc = wire.KVEventEncoder()
    take = encode = 0.0
    n = stored = 0
    for step in range(3000):
        rid = f"r{step}"
        prompt = rng.integers(0, 50_000, 256 + (step % 7) * 16).tolist()
        mgr.add_request(rid, prompt, cache_salt="s" if step % 3 == 0 else None)
        hit = mgr.get_computed_blocks(rid)
        mgr.allocate_slots(
            rid,
            len(prompt) - hit.num_computed_tokens,
            num_computed_tokens=0,
            new_computed_blocks=hit,
        )
        mgr.remove_request(rid)
        if step % 4 == 3:
            t = time.perf_counter()
            events = mgr.take_events()
            take += time.perf_counter() - t
            t = time.perf_counter()
            enc.encode_events(events, ts=0.0)
            encode += time.perf_counter() - t
            n += len(events)
            stored += sum(isinstance(e, BlockStored) for e in events)
    print(
        f"manager events: {n:,} ({stored:,} BlockStored), take_events {take / n * 1e9:.0f} "
        f"ns/event, wire encoding {encode / n * 1e9:.0f} ns/event"
    )


def subscriber(endpoint: str, replay: str) -> None:
    from pagedkv.events.zmq import ZmqEventSubscriber

    sub = ZmqEventSubscriber(endpoint, replay)
    got = events = 0
    t0 = None
    while got < N_BATCH:
        for r in sub.poll(0.5):
            t0 = time.perf_counter() if t0 is None else t0
            got += 1
            events += len(r.batch.events)
    dt = time.perf_counter() - (t0 or 0)
    print(json.dumps({"events": events, "s": dt, "gaps": sub.num_gaps, "lost": sub.num_lost}))


def bench_zmq() -> None:
    from pagedkv.events.zmq import ZmqEventPublisher

    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=N_BATCH)
    assert pub.bound_endpoint and pub.bound_replay_endpoint
    proc = subprocess.Popen(
        [sys.executable, __file__, "sub", pub.bound_endpoint, pub.bound_replay_endpoint],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)
    half = PER_BATCH // 2
    batch: list[KVCacheEvent] = [
        BlockStored(
            list(range(i * 16, i * 16 + 16)),
            None,
            list(range(256)),
            16,
            None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
        for i in range(half)
    ]
    batch += [BlockRemoved([i], group_idx=0) for i in range(PER_BATCH - half)]
    t = time.perf_counter()
    for _ in range(N_BATCH):
        pub.publish(batch)
    enqueue = time.perf_counter() - t
    pub.flush()
    sent = time.perf_counter() - t
    out = json.loads(proc.communicate()[0])
    n = N_BATCH * PER_BATCH
    print(
        f"publish() on the caller's thread: {enqueue / N_BATCH * 1e6:.1f} us per "
        f"{PER_BATCH}-event batch; publisher thread: {n:,} events in {sent:.2f}s = "
        f"{n / sent / 1e3:.0f} k events/s"
    )
    print(f"subscriber process: {out['events']:,} events, gaps {out['gaps']}, lost {out['lost']}")
    pub.close()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "sub":
        subscriber(sys.argv[2], sys.argv[3])
    else:
        bench_manager_events()
        bench_index()
        bench_zmq()
