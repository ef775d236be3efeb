"""The event stream of ``index_dynamo_bench.py``: a synthetic vLLM-style
workload (conversation trees of chained blocks stored and evicted by replicas)
and its encodings for pagedkv's ``PrefixIndex`` and Dynamo's ``RadixTree``.
See that script's docstring."""

from __future__ import annotations

import random
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

MIN_LEN, MAX_LEN = 16, 256
LONG_QUERY = 1024
CLEAR_BLOCKS = 20_000
STORED = 0
REMOVED = 1


# --------------------------------------------------------------------------- workload


@dataclass
class Workload:
    """One event stream, its queries and what the generator knows they match."""

    num_replicas: int
    kinds: array[int] = field(default_factory=lambda: array("b"))
    reps: array[int] = field(default_factory=lambda: array("i"))
    parents: array[int] = field(default_factory=lambda: array("Q"))  # 0: none
    lens: array[int] = field(default_factory=lambda: array("i"))
    flat: array[int] = field(default_factory=lambda: array("Q"))
    queries: list[list[int]] = field(default_factory=list)
    expected: list[list[int]] = field(default_factory=list)  # per query, per replica
    long_events: list[tuple[int, int, list[int]]] = field(default_factory=list)
    long_query: list[int] = field(default_factory=list)
    long_expected: list[int] = field(default_factory=list)
    victim_events: list[tuple[int, list[int]]] = field(default_factory=list)  # (parent, chain)
    final_pairs: int = 0
    distinct_blocks: int = 0

    @property
    def num_events(self) -> int:
        return len(self.kinds)

    @property
    def block_ops(self) -> int:
        return len(self.flat)

    def emit(self, kind: int, rep: int, parent: int, hashes: Sequence[int]) -> None:
        self.kinds.append(kind)
        self.reps.append(rep)
        self.parents.append(parent)
        self.lens.append(len(hashes))
        self.flat.extend(hashes)

    def save(self, path: Path) -> None:
        import numpy as np

        np.savez(
            path,
            num_replicas=np.array([self.num_replicas]),
            kinds=np.frombuffer(self.kinds, dtype=np.int8),
            reps=np.frombuffer(self.reps, dtype=np.int32),
            parents=np.frombuffer(self.parents, dtype=np.uint64),
            lens=np.frombuffer(self.lens, dtype=np.int32),
            flat=np.frombuffer(self.flat, dtype=np.uint64),
            final_pairs=np.array([self.final_pairs]),
        )

    @classmethod
    def load(cls, path: Path) -> Workload:
        import numpy as np

        z = np.load(path)
        w = cls(int(z["num_replicas"][0]))
        w.kinds = array("b", z["kinds"].tobytes())
        w.reps = array("i", z["reps"].tobytes())
        w.parents = array("Q", z["parents"].tobytes())
        w.lens = array("i", z["lens"].tobytes())
        w.flat = array("Q", z["flat"].tobytes())
        w.final_pairs = int(z["final_pairs"][0])
        return w


def _held_prefix(chain: Sequence[int], held: dict[int, int] | set[int]) -> int:
    """Leading blocks of a chain held (held sets are prefix-closed: binary search)."""
    lo, hi = 0, len(chain)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chain[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo


def generate(target_pairs: int, num_replicas: int, num_queries: int, seed: int) -> Workload:
    """A vLLM-style event stream leaving about ``target_pairs`` (replica, block)
    pairs indexed, after storing 1.5 times that (the rest evicted)."""
    rng = random.Random(seed)
    bits = rng.getrandbits

    def fresh(n: int) -> list[int]:
        return [bits(63) | 1 for _ in range(n)]

    w = Workload(num_replicas)
    n_trees = max(8, min(400, target_pairs // 250))
    prompts = [fresh(rng.randint(2, 64)) for _ in range(n_trees)]
    convs: list[list[list[int]]] = [[] for _ in range(n_trees)]
    homes = [((t * 7) % num_replicas, (t * 7 + 3) % num_replicas) for t in range(n_trees)]
    held: list[dict[int, int]] = [{} for _ in range(num_replicas)]  # hash -> held children
    tails: list[deque[int]] = [deque() for _ in range(num_replicas)]
    parent_of: dict[int, int] = {}
    cap = max(1, target_pairs // num_replicas)
    recent: deque[list[int]] = deque(maxlen=max(4 * num_queries, 1000))
    stored = 0
    budget = int(target_pairs * 1.5)

    def next_chain(t: int) -> list[int]:
        cs = convs[t]
        u = rng.random()
        if not cs or u < 0.3:  # a new conversation under the system prompt
            n = rng.randint(MIN_LEN, MAX_LEN)
            base = prompts[t]
            chain = base[:n] if n <= len(base) else base + fresh(n - len(base))
            if len(cs) < 64:
                cs.append(chain)
            else:
                cs[rng.randrange(64)] = chain
            return chain
        i = rng.randrange(len(cs))
        c = cs[i]
        if u < 0.85 and len(c) < MAX_LEN:  # the conversation's next turn
            chain = c + fresh(rng.randint(1, min(32, MAX_LEN - len(c))))
            cs[i] = chain
            return chain
        # a branch: an edited or regenerated turn
        k = rng.randint(1, len(c) - 1) if len(c) > 1 else 1
        n = max(MIN_LEN, k + 1, min(MAX_LEN, k + rng.randint(1, 64)))
        chain = c[:k] + fresh(n - k)
        if len(cs) < 64:
            cs.append(chain)
        else:
            cs[rng.randrange(64)] = chain
        return chain

    while stored < budget:
        t = int(rng.random() ** 2.0 * n_trees)  # skewed toward the first trees
        chain = next_chain(t)
        recent.append(chain)
        u = rng.random()
        r = homes[t][0] if u < 0.6 else homes[t][1] if u < 0.85 else rng.randrange(num_replicas)
        h_r = held[r]
        k = _held_prefix(chain, h_r)
        tails[r].append(chain[-1])
        if k == len(chain):
            continue
        new = chain[k:]
        parent = chain[k - 1] if k else 0
        if parent:
            h_r[parent] += 1
        prev = parent
        for h in new:
            h_r[h] = 1
            parent_of[h] = prev
            prev = h
        h_r[new[-1]] = 0
        stored += len(new)
        # prefill in one event, then decode-style single blocks
        d = rng.randint(0, min(8, len(new) - 1))
        w.emit(STORED, r, parent, new[: len(new) - d])
        for j in range(len(new) - d, len(new)):
            w.emit(STORED, r, new[j - 1], new[j : j + 1])
        excess = len(h_r) - cap
        if excess <= 0:
            continue
        removed: list[int] = []
        tq = tails[r]
        while excess > 0 and tq:
            h = tq.popleft()
            if h_r.get(h) != 0:  # gone, or another chain of this replica extends it
                continue
            while True:  # leaf first, up while the parent becomes a leaf
                del h_r[h]
                removed.append(h)
                excess -= 1
                p = parent_of[h]
                if not p:
                    break
                h_r[p] -= 1
                if h_r[p]:
                    break
                if excess <= 0:
                    tq.appendleft(p)
                    break
                h = p
        if removed:
            w.emit(REMOVED, r, 0, removed)

    w.final_pairs = sum(len(h) for h in held)
    w.distinct_blocks = len(set().union(*held))

    # queries: recent requests' chains cut or padded (with misses) to 16-256 blocks
    pool = list(recent)
    for _ in range(num_queries):
        n = rng.randint(MIN_LEN, MAX_LEN)
        if rng.random() < 0.05:
            q = fresh(n)
        else:
            c = pool[rng.randrange(len(pool))]
            q = c[:n] + fresh(max(0, n - len(c)))
        w.queries.append(q)
        w.expected.append([_held_prefix(q, h) for h in held])

    # a 1,024-block chain: replica 0 holds it all, replica 1 its first half
    w.long_query = fresh(LONG_QUERY)
    w.long_events = [(0, 0, w.long_query)]
    if num_replicas > 1:
        w.long_events.append((1, 0, w.long_query[: LONG_QUERY // 2]))
    w.long_expected = [0] * num_replicas
    for r, _, c in w.long_events:
        w.long_expected[r] = len(c)

    # a replica to clear: 20,000 blocks of the queries' chains (shared prefixes)
    vheld: set[int] = set()
    total = 0
    sources = iter(w.queries)
    while total < CLEAR_BLOCKS:
        q = next(sources, None)
        if q is None:
            q = fresh(MAX_LEN)
        k = _held_prefix(q, vheld)
        new = q[k : k + CLEAR_BLOCKS - total]
        if new:
            w.victim_events.append((q[k - 1] if k else 0, new))
            vheld.update(new)
            total += len(new)
    return w


# --------------------------------------------------------------------------- inputs

PkEvent = tuple[int, str, list[int], "int | None"]
DynEvent = tuple[int, int, bytes]


def _events(w: Workload) -> list[tuple[int, int, int, list[int]]]:
    flat = w.flat.tolist()
    out = []
    off = 0
    for kind, rep, parent, n in zip(w.kinds, w.reps, w.parents, w.lens, strict=True):
        out.append((kind, rep, parent, flat[off : off + n]))
        off += n
    return out


def pk_inputs(w: Workload) -> list[PkEvent]:
    return [(k, f"r{r}", hs, p or None) for k, r, p, hs in _events(w)]


def _dyn_stored(eid: int, parent: int, hashes: Sequence[int]) -> bytes:
    blocks = ",".join([f'{{"block_hash":{h},"tokens_hash":{h}}}' for h in hashes])
    ph = str(parent) if parent else "null"
    return (
        f'{{"event_id":{eid},"data":{{"stored":{{"parent_hash":{ph},"blocks":[{blocks}]}}}}}}'
    ).encode()


def _dyn_removed(eid: int, hashes: Sequence[int]) -> bytes:
    hs = ",".join(map(str, hashes))
    return f'{{"event_id":{eid},"data":{{"removed":{{"block_hashes":[{hs}]}}}}}}'.encode()


class DynEncoder:
    """Dynamo's KvCacheEvent JSON, with per-worker event ids."""

    def __init__(self) -> None:
        self.ids: dict[int, int] = {}

    def _id(self, rep: int) -> int:
        eid = self.ids.get(rep, 0) + 1
        self.ids[rep] = eid
        return eid

    def stored(self, rep: int, parent: int, hashes: Sequence[int]) -> bytes:
        return _dyn_stored(self._id(rep), parent, hashes)

    def removed(self, rep: int, hashes: Sequence[int]) -> bytes:
        return _dyn_removed(self._id(rep), hashes)


def dyn_inputs(w: Workload, enc: DynEncoder) -> list[DynEvent]:
    return [
        (k, r, enc.stored(r, p, hs) if k == STORED else enc.removed(r, hs))
        for k, r, p, hs in _events(w)
    ]
