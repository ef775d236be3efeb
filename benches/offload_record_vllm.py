"""Record vLLM 0.33's CPU offloading manager on a long random workload, for parity replay.

This drives vLLM's own ``CPUOffloadingManager`` (LRU or ARC) through a random
but *valid* sequence of calls and writes every call, with vLLM's answer, to a
JSON trace. Another program replays the same calls on a different
implementation of the manager and compares the answers op by op: lookups,
chunk ids of loads and stores, evictions, KV events, stats and, every ~25
ops, vLLM's internal state (evictable and write-pending counts, the admission
tracker, the LRU eviction order or the ARC lists and target).

The workload imitates a serving scheduler: a pool of shared prefixes (chains
of random 32-byte block hashes) and requests whose chains are a prefix (or an
earlier request's chain, like a conversation turn) plus a private tail. A
request arrives, looks up its chain from the head until the first non-HIT,
touches the part a GPU prefix cache would hold, loads the rest of the HIT
prefix, offers the remaining chunks for storing in batches (sometimes out of
order, like a backfill, sometimes re-offering resident chunks), and finishes;
loads and stores complete some ops later, interleaved across requests, and
~10% of stores fail. Request 0 is one shared context, used without positions
and never finished (like ``_EMPTY_REQ_CTX`` in vLLM's tests), for plain
store/load/touch traffic. The tier is kept under pressure so evictions,
failed allocations (``None`` from ``prepare_store``) and ARC ghost hits occur.
The manager is never called against its contract (loads only of HIT keys,
completions only of transfers in flight, nothing new for a finished request,
no transfer of a reset cache ever completed).

Run it with vLLM's environment; the output is deterministic for a seed:

    /tmp/vllm_dropin/.venv/bin/python benches/offload_record_vllm.py \\
        --out F.json --seed 3 --policy lru --ops 4000

Trace format ``pagedkv-offload-trace-1``: ``{"format", "vllm_version", "seed",
"config", "workload", "ops"}``; keys are lowercase hex of the key bytes,
requests are small ints (0 is the shared context). See ``Recorder`` for the
ops and their ``out`` fields. A name ending in ``.gz`` writes gzip.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import vllm
from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

FORMAT = "pagedkv-offload-trace-1"
TOKENS_PER_CHUNK = 16
NUM_PREFIXES = 30
ZERO_POOL_SIZE = 80
Op = dict[str, Any]


class _Full(Exception):
    """Raised once the trace holds its planned number of operations."""


def _hex(keys: list[OffloadKey]) -> list[str]:
    return [key.hex() for key in keys]


class Recorder:
    """Calls the manager and records each call, with vLLM's answer in ``out``.

    Ops: new_request, set_positions, lookup, prepare_load, complete_load,
    touch, prepare_store, complete_store, finish, reset, events, stats, state.
    """

    def __init__(self, args: argparse.Namespace, limit: int) -> None:
        self.manager = CPUOffloadingManager(
            num_chunks=args.num_chunks,
            cache_policy=args.policy,
            enable_events=True,
            store_threshold=args.store_threshold,
            max_tracker_size=args.max_tracker_size,
        )
        self.ops: list[Op] = []
        self.limit = limit
        self.ctxs: dict[int, ReqContext] = {0: ReqContext(req_id="")}
        self.ghost_hits = 0
        policy = self.manager._policy
        if isinstance(policy, ARCCachePolicy):
            # Count ARC's ghost-list hits without changing what it does.
            adapt = policy._adapt_to_ghost_hit

            def counted(key: OffloadKey) -> bool:
                hit = adapt(key)
                self.ghost_hits += hit
                return hit

            policy._adapt_to_ghost_hit = counted  # type: ignore[method-assign]

    def _emit(self, op: Op, final: bool = False) -> None:
        self.ops.append(op)
        if not final and len(self.ops) >= self.limit:
            raise _Full

    def new_request(self, req: int) -> None:
        self.ctxs[req] = ctx = ReqContext(req_id=f"req-{req}")
        self.manager.on_new_request(ctx)
        self._emit({"op": "new_request", "req": req})

    def set_positions(self, req: int, keys: list[OffloadKey], positions: list[int]) -> None:
        ctx = self.ctxs[req]
        for key, pos in zip(keys, positions, strict=True):
            ctx.set_offload_key_position(key, pos)
        self._emit({"op": "set_positions", "req": req, "keys": _hex(keys), "positions": positions})

    def lookup(self, req: int, key: OffloadKey) -> str:
        out = self.manager.lookup(key, self.ctxs[req]).name
        self._emit({"op": "lookup", "req": req, "key": key.hex(), "out": out})
        return out

    def prepare_load(self, req: int, keys: list[OffloadKey]) -> None:
        spec = self.manager.prepare_load(keys, self.ctxs[req])
        out = [int(c) for c in spec.block_ids.tolist()]  # type: ignore[attr-defined]
        self._emit({"op": "prepare_load", "req": req, "keys": _hex(keys), "out": out})

    def complete_load(self, req: int, keys: list[OffloadKey]) -> None:
        self.manager.complete_load(keys, self.ctxs[req])
        self._emit({"op": "complete_load", "req": req, "keys": _hex(keys)})

    def touch(self, req: int, keys: list[OffloadKey]) -> None:
        self.manager.touch(keys, self.ctxs[req])
        self._emit({"op": "touch", "req": req, "keys": _hex(keys)})

    def prepare_store(self, req: int, keys: list[OffloadKey]) -> list[OffloadKey] | None:
        """Returns the keys vLLM allocated (None when it could not evict enough)."""
        result = self.manager.prepare_store(keys, self.ctxs[req])
        out: dict[str, list[Any]] | None = None
        if result is not None:
            chunk_ids = result.store_spec.block_ids.tolist()  # type: ignore[attr-defined]
            out = {
                "keys_to_store": _hex(result.keys_to_store),
                "chunk_ids": [int(c) for c in chunk_ids],
                "evicted": _hex(result.evicted_keys),
            }
        self._emit({"op": "prepare_store", "req": req, "keys": _hex(keys), "out": out})
        return None if result is None else list(result.keys_to_store)

    def complete_store(self, req: int, keys: list[OffloadKey], success: bool) -> None:
        self.manager.complete_store(keys, self.ctxs[req], success=success)
        self._emit({"op": "complete_store", "req": req, "keys": _hex(keys), "success": success})

    def finish(self, req: int) -> None:
        self.manager.on_request_finished(self.ctxs[req])
        self._emit({"op": "finish", "req": req})

    def reset(self) -> None:
        self.manager.reset_cache()
        self._emit({"op": "reset"})

    def events(self, final: bool = False) -> None:
        out = [
            {
                "keys": _hex(list(ev.keys)),
                "medium": ev.medium.value,
                "removed": ev.removed,
                "metadata_only": ev.metadata_only,
            }
            for ev in self.manager.take_events()
        ]
        self._emit({"op": "events", "out": out}, final)

    def stats(self, final: bool = False) -> None:
        stats = self.manager.get_stats()
        assert stats is not None
        # Gauges and counters hold one value, histograms the list of observations,
        # each under the empty label tuple (the manager's metrics have no labels).
        _, values = stats.metric_sections()
        m = CPUOffloadingMetrics
        sizes = list(values.get(m.CPU_ALLOCATION_SIZE, {}).get((), []))
        skipped = values.get(m.STORES_SKIPPED, {}).get(())
        reduced = stats.reduce()
        assert reduced.get(f"{m.CPU_ALLOCATION_SIZE}_count", 0) == len(sizes)
        assert reduced.get(m.STORES_SKIPPED) == skipped
        out = {
            "usage": float(values[m.CPU_CACHE_USAGE_PERC][()]),
            "write_usage": float(values[m.CPU_CACHE_WRITE_USAGE_PERC][()]),
            "read_usage": float(values[m.CPU_CACHE_READ_USAGE_PERC][()]),
            "allocation_sizes": [int(s) for s in sizes],
            "stores_skipped": None if skipped is None else int(skipped),
        }
        self._emit({"op": "stats", "out": out}, final)

    def state(self, final: bool = False) -> None:
        mgr = self.manager
        counts = mgr.counts
        out: dict[str, Any] = {
            "evictable": mgr._num_evictable_cache_chunks,
            "write_pending": mgr._num_write_pending_chunks,
            "tracker": None if counts is None else [[k.hex(), c] for k, c in counts.items()],
        }
        policy = mgr._policy
        if isinstance(policy, LRUCachePolicy):
            order = sorted(policy._evictable, key=lambda k: (policy._ranks[k], k))
            out["lru_order"] = _hex(order)
        elif isinstance(policy, ARCCachePolicy):
            for name in ("t1", "t2"):
                entries = getattr(policy, name).items()
                out[name] = [[k.hex(), int(c.ref_cnt), int(c.chunk_id)] for k, c in entries]
            out["b1"] = _hex(list(policy.b1))
            out["b2"] = _hex(list(policy.b2))
            out["target"] = float(policy.target_t1_size)
        self._emit({"op": "state", "out": out}, final)


@dataclass
class Request:
    """One simulated request: its chain of block hashes and its progress."""

    rid: int
    blocks: list[bytes]
    pos: dict[OffloadKey, int]
    unset: set[OffloadKey]
    positioned: set[OffloadKey] = field(default_factory=set)
    batches: list[tuple[list[int], list[int]]] = field(default_factory=list)
    looked_up: bool = False


class Workload:
    """A serving-scheduler-like generator of valid manager calls."""

    def __init__(self, rec: Recorder, rng: random.Random, groups: int) -> None:
        self.rec = rec
        self.rng = rng
        self.groups = list(range(groups))
        self.prefixes = [self._chain(rng.randint(2, 20)) for _ in range(NUM_PREFIXES)]
        self.prefix_weights = [1.0 / (i + 1) ** 1.2 for i in range(NUM_PREFIXES)]
        self.zero_pool = self._chain(ZERO_POOL_SIZE)
        self.past_chains: list[list[bytes]] = []
        self.active: list[Request] = []
        self.load_jobs: list[tuple[int, list[OffloadKey]]] = []
        self.store_jobs: list[tuple[int, list[OffloadKey]]] = []
        self.pending_store: set[OffloadKey] = set()  # membership only, never iterated
        self.next_rid = 1
        self.target_active = 6
        self.resets = 0
        self.next_state = rng.randint(20, 30)

    def _chain(self, n: int) -> list[bytes]:
        return [self.rng.randbytes(32) for _ in range(n)]

    def _keys(self, blocks: list[bytes], groups: list[int]) -> list[OffloadKey]:
        return [make_offload_key(h, g) for g in groups for h in blocks]

    # --- requests ---

    def arrive(self) -> None:
        rng = self.rng
        if rng.random() < 0.08:  # prefix churn: a new system prompt replaces an old one
            self.prefixes[rng.randrange(NUM_PREFIXES)] = self._chain(rng.randint(2, 20))
        if self.past_chains and rng.random() < 0.25:  # next turn of a conversation
            blocks = list(rng.choice(self.past_chains)) + self._chain(rng.randint(1, 6))
        else:
            prefix = rng.choices(self.prefixes, weights=self.prefix_weights)[0]
            blocks = list(prefix) + self._chain(rng.randint(0, 10))
        blocks = blocks[:40]
        pos = {
            make_offload_key(h, g): (i + 1) * TOKENS_PER_CHUNK
            for g in self.groups
            for i, h in enumerate(blocks)
        }
        unset: set[OffloadKey] = set()
        if rng.random() < 0.2:  # some positions never set: vLLM's unordered fallback
            keys = list(pos)
            unset = {k for k in keys if rng.random() < 0.3} or {rng.choice(keys)}
        req = Request(self.next_rid, blocks, pos, unset)
        self.next_rid += 1
        self.rec.new_request(req.rid)
        self.active.append(req)
        self.target_active = rng.randint(4, 10)

    def use_keys(self, req: Request, keys: list[OffloadKey]) -> None:
        """Sets the positions of ``keys`` not yet set (and not meant to stay unset)."""
        new = [k for k in keys if k not in req.positioned and k not in req.unset]
        if new:
            req.positioned.update(new)
            self.rec.set_positions(req.rid, new, [req.pos[k] for k in new])

    def look_up(self, req: Request) -> None:
        rng = self.rng
        if rng.random() < 0.5:  # the scheduler hashed the whole prompt up front
            self.use_keys(req, self._keys(req.blocks, self.groups))
        hit = 0
        for h in req.blocks:
            if any(self.rec.lookup(req.rid, make_offload_key(h, g)) != "HIT" for g in self.groups):
                break
            hit += 1
        req.looked_up = True
        # Blocks [0, gpu) sit in the GPU prefix cache (touched); [gpu, hit) are loaded.
        gpu = rng.choice([0, 0, rng.randint(0, hit)])
        start = hit
        if hit > gpu:
            keys = self._keys(req.blocks[gpu:hit], self.groups)
            if rng.random() < 0.8:
                self.use_keys(req, keys)
                self.rec.prepare_load(req.rid, keys)
                self.load_jobs.append((req.rid, keys))
            else:
                start = gpu  # recomputed instead: the store re-offers resident chunks
        if gpu > 0:
            keys = self._keys(req.blocks[:gpu], self.groups)
            self.use_keys(req, keys)
            self.rec.touch(req.rid, keys)
        self.plan_stores(req, start)

    def plan_stores(self, req: Request, start: int) -> None:
        rng = self.rng
        if start > 0 and rng.random() < 0.1:
            start = max(0, start - rng.randint(1, 2))  # overlap: re-offer resident chunks
        batches: list[tuple[list[int], list[int]]] = []
        i = start
        while i < len(req.blocks):
            n = rng.randint(1, 8)
            groups = self.groups
            if len(groups) > 1 and rng.random() < 0.2:
                groups = sorted(rng.sample(groups, rng.randint(1, len(groups) - 1)))
            batches.append((list(range(i, min(i + n, len(req.blocks)))), groups))
            i += n
        r = rng.random()
        if r < 0.1:
            batches.reverse()  # backfill: tail first
        elif r < 0.15:
            rng.shuffle(batches)
        req.batches = batches

    def store_batch(self, req: Request) -> None:
        idxs, groups = req.batches.pop(0)
        keys = self._keys([req.blocks[i] for i in idxs], groups)
        self.use_keys(req, keys)
        stored = self.rec.prepare_store(req.rid, keys)
        if stored:
            self.store_jobs.append((req.rid, stored))
            self.pending_store.update(stored)
        # Offer the batch again later: after a failed allocation, or when some
        # chunks were not stored (resident, pending or held back by the admission
        # filter, which admits them on a repeated offer).
        retry = 0.4 if stored is None else 0.3 if len(stored) < len(keys) else 0.0
        if self.rng.random() < retry:
            req.batches.insert(0, (idxs, groups))

    def advance(self) -> None:
        rng = self.rng
        req = rng.choice(self.active)
        if not req.looked_up:
            self.look_up(req)
        elif req.batches and rng.random() < 0.97:
            if rng.random() < 0.12:
                done = req.blocks[: rng.randint(1, len(req.blocks))]
                keys = self._keys(done, self.groups)
                self.use_keys(req, keys)
                self.rec.touch(req.rid, keys)
            else:
                self.store_batch(req)
        else:  # done, or aborted early
            self.active.remove(req)
            self.rec.finish(req.rid)
            self.past_chains.append(req.blocks)
            del self.past_chains[:-20]

    # --- transfers ---

    def complete_load(self) -> None:
        rng = self.rng
        rid, keys = self.load_jobs.pop(rng.randrange(min(3, len(self.load_jobs))))
        if len(keys) > 1 and rng.random() < 0.2:  # the load completes in two parts
            cut = rng.randint(1, len(keys) - 1)
            self.load_jobs.append((rid, keys[cut:]))
            keys = keys[:cut]
        self.rec.complete_load(rid, keys)

    def complete_store(self) -> None:
        rng = self.rng
        rid, keys = self.store_jobs.pop(rng.randrange(min(4, len(self.store_jobs))))
        self.pending_store.difference_update(keys)
        keys = list(keys)
        if rng.random() < 0.15:  # keys without a store in flight: vLLM ignores them
            for _ in range(rng.randint(1, 3)):
                extra = make_offload_key(rng.choice(self.zero_pool), rng.choice(self.groups))
                if extra not in self.pending_store and extra not in keys:
                    keys.insert(rng.randint(0, len(keys)), extra)
        self.rec.complete_store(rid, keys, success=rng.random() >= 0.1)

    # --- request 0: plain traffic without positions ---

    def zero_keys(self, n: int) -> list[OffloadKey]:
        rng = self.rng
        if rng.random() < 0.05:
            self.zero_pool[rng.randrange(ZERO_POOL_SIZE)] = rng.randbytes(32)
        keys: dict[OffloadKey, None] = {}
        for _ in range(n):
            if rng.random() < 0.7:
                h = rng.choice(self.zero_pool)
            else:
                h = rng.choice(rng.choices(self.prefixes, weights=self.prefix_weights)[0])
            keys[make_offload_key(h, rng.choice(self.groups))] = None
        return list(keys)

    def zero_traffic(self) -> None:
        rng = self.rng
        r = rng.random()
        if r < 0.5:
            stored = self.rec.prepare_store(0, self.zero_keys(rng.randint(1, 6)))
            if stored:
                self.store_jobs.append((0, stored))
                self.pending_store.update(stored)
        elif r < 0.75:
            keys = self.zero_keys(rng.randint(1, 4))
            hits = [k for k in keys if self.rec.lookup(0, k) == "HIT"]
            if hits:
                self.rec.prepare_load(0, hits)
                self.load_jobs.append((0, hits))
        else:
            self.rec.touch(0, self.zero_keys(rng.randint(1, 6)))

    # --- driver ---

    def reset(self) -> None:
        self.rec.reset()
        self.resets += 1
        # Transfers prepared before a reset never complete.
        self.load_jobs.clear()
        self.store_jobs.clear()
        self.pending_store.clear()

    def step(self) -> None:
        rng = self.rng
        rec = self.rec
        if self.resets == 0 and len(rec.ops) * 2 >= rec.limit:
            self.reset()  # at least one reset per trace
        actions = ["arrive", "advance", "load", "store", "zero", "events", "stats", "reset"]
        weights = [
            4.0 if len(self.active) < self.target_active else 0.0,
            30.0 if self.active else 0.0,
            5.0 if self.load_jobs else 0.0,
            18.0 if self.store_jobs else 0.0,
            8.0,
            5.0,
            3.0,
            0.2,
        ]
        action = rng.choices(actions, weights=weights)[0]
        if action == "arrive":
            self.arrive()
        elif action == "advance":
            self.advance()
        elif action == "load":
            self.complete_load()
        elif action == "store":
            self.complete_store()
        elif action == "zero":
            self.zero_traffic()
        elif action == "events":
            rec.events()
        elif action == "stats":
            rec.stats()
        else:
            self.reset()
        if len(rec.ops) >= self.next_state:
            rec.state()
            self.next_state = len(rec.ops) + rng.randint(20, 30)


def summarize(ops: list[Op], rec: Recorder, policy: str, seconds: float) -> str:
    counts = Counter(op["op"] for op in ops)
    lookups = Counter(op["out"] for op in ops if op["op"] == "lookup")
    stores = [op for op in ops if op["op"] == "prepare_store"]
    nones = sum(op["out"] is None for op in stores)
    evicted = sum(len(op["out"]["evicted"]) for op in stores if op["out"] is not None)
    evicting = sum(bool(op["out"] and op["out"]["evicted"]) for op in stores)
    failed = sum(op["op"] == "complete_store" and not op["success"] for op in ops)
    parts = [f"{name}={counts[name]}" for name in sorted(counts)]
    parts += [f"lookup_{k}={lookups[k]}" for k in ("HIT", "HIT_PENDING", "MISS")]
    parts += [f"store_none={nones}", f"evicted_keys={evicted}", f"evicting_stores={evicting}"]
    parts.append(f"failed_stores={failed}")
    if policy == "arc":
        parts.append(f"ghost_hits={rec.ghost_hits}")
    missing = [name for name in OP_NAMES if counts[name] == 0]
    if missing:
        parts.append(f"MISSING={','.join(missing)}")
    return f"offload_record_vllm: ops={len(ops)} {' '.join(parts)} time={seconds:.2f}s"


OP_NAMES = (
    "new_request", "set_positions", "lookup", "prepare_load", "complete_load", "touch",
    "prepare_store", "complete_store", "finish", "reset", "events", "stats", "state",
)  # fmt: skip


def _bounded(lo: int, hi: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is outside [{lo}, {hi}]")
        return value

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--out", required=True, help="trace file (.json, or .json.gz for gzip)")
    p.add_argument("--seed", type=_bounded(0, 2**63 - 1), default=0)
    p.add_argument("--policy", choices=("lru", "arc"), default="lru")
    p.add_argument("--ops", type=_bounded(50, 10_000_000), default=3000,
                   help="number of recorded operations")  # fmt: skip
    p.add_argument("--num-chunks", type=_bounded(1, 1_000_000), default=48)
    p.add_argument("--store-threshold", type=_bounded(0, 16), default=1,
                   help="2 or more turns vLLM's admission filter on")  # fmt: skip
    p.add_argument("--max-tracker-size", type=_bounded(1, 10_000_000), default=64_000)
    p.add_argument("--groups", type=_bounded(1, 8), default=1, help="KV-cache group count")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    # Three final ops (events, stats, state) close every trace.
    rec = Recorder(args, limit=args.ops - 3)
    work = Workload(rec, random.Random(args.seed), args.groups)
    try:
        while True:
            work.step()
    except _Full:
        pass
    rec.events(final=True)
    rec.stats(final=True)
    rec.state(final=True)
    assert len(rec.ops) == args.ops
    trace = {
        "format": FORMAT,
        "vllm_version": vllm.__version__,
        "seed": args.seed,
        "config": {
            "num_chunks": args.num_chunks,
            "policy": args.policy,
            "enable_events": True,
            "store_threshold": args.store_threshold,
            "max_tracker_size": args.max_tracker_size,
        },
        "workload": {"ops": args.ops, "groups": args.groups},
        "ops": rec.ops,
    }
    data = json.dumps(trace, separators=(",", ":")).encode()
    if args.out.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    try:
        # a new file only: never an existing one (nor through a symlink)
        with open(args.out, "xb") as f:
            f.write(data)
    except OSError as e:
        print(f"offload_record_vllm: cannot write {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    print(summarize(rec.ops, rec, args.policy, time.perf_counter() - start), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
