"""Router-side prefix index: which replica holds the longest cached prefix.

Routers that place a request on the replica already holding its prompt prefix
(llm-d, Dynamo, SGLang's router) learn what every replica caches from its KV
events. :class:`PrefixIndex` does that bookkeeping in the Rust core: fed
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` per replica, it answers
for a request's block-hash chain (or its tokens) which replica holds the longest
prefix and how many blocks long it is. Hashes are keyed in vLLM's event form
(64-bit ints; raw digests are reduced to their last 8 bytes).

:class:`IndexSubscriber` feeds an index from the ZMQ publishers of many
replicas (separate processes or hosts), replaying gaps, and ``python -m
pagedkv.index`` runs that as a standalone process answering queries over ZMQ.
Those two need the ``events`` extra (``msgspec``, ``pyzmq``); the index itself
does not.

>>> index = PrefixIndex()
>>> index.store("replica-a", [11, 12, 13])
>>> index.store("replica-b", [11, 12])
>>> index.longest_prefix([11, 12, 13, 14])
PrefixMatch(replica='replica-a', num_blocks=3)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _core

if TYPE_CHECKING:
    from .zmq_events import ZmqEventSubscriber

__all__ = [
    "VLLM_DEFAULT_NONE_HASH_SEED",
    "IndexStats",
    "IndexSubscriber",
    "PrefixIndex",
    "PrefixMatch",
    "request_block_hashes",
    "serve",
]

# vLLM's seed of NONE_HASH for the sha256 algorithms when PYTHONHASHSEED is unset.
VLLM_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


@dataclass(frozen=True)
class PrefixMatch:
    """The replica holding the longest prefix, and its length in blocks."""

    replica: str
    num_blocks: int


@dataclass(frozen=True)
class IndexStats:
    """What an index has been fed. ``unknown_removals``: removals of blocks the
    replica was not known to hold (missed events, or blocks stored before the
    index started listening)."""

    blocks_stored: int
    blocks_removed: int
    unknown_removals: int
    clears: int


def request_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    hash_algo: str = "sha256_cbor",
    hash_seed: str | int | None = None,
    none_hash: bytes | None = None,
    extra_keys: Sequence[Any] | None = None,
) -> list[bytes]:
    """The block-hash chain of a request's full blocks, as a manager computes it.

    ``hash_seed`` is the replicas' ``PYTHONHASHSEED``/``hash_seed`` (unset: vLLM's
    fixed default, only defined for the sha256 algorithms); ``none_hash`` overrides
    it. ``extra_keys``: one entry per block (vLLM's tagged tuples, or None).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if none_hash is None:
        if hash_seed is None:
            if not hash_algo.startswith("sha256"):
                raise ValueError(f"{hash_algo} has no fixed default seed: pass hash_seed")
            hash_seed = VLLM_DEFAULT_NONE_HASH_SEED
        none_hash = _core.none_hash(hash_algo, str(hash_seed))
    out: list[bytes] = []
    parent: bytes | None = None
    for i in range(len(token_ids) // block_size):
        extra = None if extra_keys is None or i >= len(extra_keys) else extra_keys[i]
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = _core.hash_block_tokens(hash_algo, parent, block, extra, none_hash=none_hash)
        out.append(parent)
    return out


class PrefixIndex:
    """Which replica holds which cached blocks (see the module docs).

    Replicas are named; a name is registered on first use. ``group_idx``
    selects one KV-cache group's blocks (None: a block counts whichever group
    holds it). Not thread-safe: feed and query it from one thread (concurrent
    calls raise rather than corrupt it).
    """

    def __init__(self) -> None:
        self._index = _core.PrefixIndex()
        self._names: list[str] = []

    def _id(self, replica: str) -> int:
        rid = self._index.replica(replica)
        if rid == len(self._names):
            self._names.append(replica)
        return rid

    @property
    def replicas(self) -> list[str]:
        """Registered replica names, by id."""
        return list(self._names)

    @property
    def num_blocks(self) -> int:
        """Distinct block hashes held by any replica."""
        return self._index.num_blocks

    def replica_num_blocks(self, replica: str) -> int:
        """Distinct block hashes held by one replica."""
        rid = self._index.replica_id(replica)
        return 0 if rid is None else self._index.replica_num_blocks(rid)

    def stats(self) -> IndexStats:
        return IndexStats(*self._index.stats())

    def store(
        self,
        replica: str,
        block_hashes: Sequence[int | bytes],
        parent_block_hash: int | bytes | None = None,
        group_idx: int | None = None,
    ) -> None:
        """``BlockStored``: the replica cached this chain (child of the parent)."""
        self._index.store(self._id(replica), block_hashes, parent_block_hash, group_idx)

    def remove(
        self, replica: str, block_hashes: Sequence[int | bytes], group_idx: int | None = None
    ) -> None:
        """``BlockRemoved``: one block per hash was evicted."""
        self._index.remove(self._id(replica), block_hashes, group_idx)

    def clear(self, replica: str) -> None:
        """``AllBlocksCleared`` (or the replica restarted): it holds nothing."""
        self._index.clear(self._id(replica))

    def apply(self, replica: str, events: Iterable[Any]) -> int:
        """Applies one replica's events in order: a ``KVEventBatch``, or event
        objects (``pagedkv.wire`` structs, ``pagedkv.events`` dataclasses) or the
        core's tuples. Returns the number applied."""
        batch_events = getattr(events, "events", events)
        return self._index.apply_events(self._id(replica), batch_events)

    def match_lengths(
        self, block_hashes: Sequence[int | bytes], group_idx: int | None = None
    ) -> dict[str, int]:
        """Per replica, the number of leading blocks of the chain it holds."""
        lengths = self._index.match_lengths(block_hashes, group_idx)
        return dict(zip(self._names, lengths, strict=True))

    def longest_prefix(
        self, block_hashes: Sequence[int | bytes], group_idx: int | None = None
    ) -> PrefixMatch | None:
        """The replica holding the longest prefix of the chain (the first
        registered among equals), or None when none holds its first block."""
        best = self._index.longest_prefix(block_hashes, group_idx)
        return None if best is None else PrefixMatch(self._names[best[0]], best[1])

    def longest_prefix_for_tokens(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        hash_algo: str = "sha256_cbor",
        hash_seed: str | int | None = None,
        extra_keys: Sequence[Any] | None = None,
        group_idx: int | None = None,
    ) -> PrefixMatch | None:
        """:meth:`longest_prefix` of a request given by its tokens (hashed as the
        replicas hash them: same algorithm, seed and block size)."""
        hashes = request_block_hashes(
            token_ids, block_size, hash_algo=hash_algo, hash_seed=hash_seed, extra_keys=extra_keys
        )
        return self.longest_prefix(hashes, group_idx)

    def contains(self, replica: str, block_hash: int | bytes, group_idx: int | None = None) -> bool:
        rid = self._index.replica_id(replica)
        return rid is not None and self._index.contains(rid, block_hash, group_idx)

    def chain(self, block_hash: int | bytes) -> list[int]:
        """The held chain ending at a hash, first block first (parent links)."""
        return self._index.chain(block_hash)

    def entries(self, replica: str) -> list[tuple[int, int | None, int]]:
        """Sorted ``(hash, group_idx, count)`` of what the replica holds."""
        rid = self._index.replica_id(replica)
        return [] if rid is None else self._index.replica_entries(rid)

    def check_invariants(self) -> None:
        self._index.check_invariants()


class IndexSubscriber:
    """Feeds a :class:`PrefixIndex` from the ZMQ publishers of several replicas.

    ``replicas`` maps a replica name to ``(pub_endpoint, replay_endpoint)``. Each
    replica gets a :class:`~pagedkv.zmq_events.ZmqEventSubscriber` (sequences are
    per publisher), which replays from sequence 0 on connect and fills gaps; a
    publisher restart clears the replica before its new events are applied.
    """

    def __init__(
        self,
        index: PrefixIndex,
        replicas: Mapping[str, tuple[str, str | None]],
        *,
        topic: str = "",
        **subscriber_options: Any,
    ) -> None:
        import zmq

        from .zmq_events import ZmqEventSubscriber

        self.index = index
        self.subscribers: dict[str, ZmqEventSubscriber] = {}
        self._poller = zmq.Poller()
        for name, (endpoint, replay) in replicas.items():
            index._id(name)
            sub = ZmqEventSubscriber(endpoint, replay, topic=topic, **subscriber_options)
            self.subscribers[name] = sub
            self._poller.register(sub.sub, zmq.POLLIN)
        self.num_batches = 0
        self.num_events = 0

    def poll(self, timeout: float = 0.1) -> int:
        """Applies what arrived (waiting up to ``timeout`` s for something);
        returns the number of batches applied."""
        n = self._drain()
        if n == 0 and timeout > 0 and self._poller.poll(int(timeout * 1000)):
            n = self._drain()
        return n

    def _drain(self) -> int:
        n = 0
        for name, sub in self.subscribers.items():
            for r in sub.poll(0):
                if r.reset:
                    self.index.clear(name)
                self.num_events += self.index.apply(name, r.batch.events)
                n += 1
        self.num_batches += n
        return n

    def status(self) -> dict[str, dict[str, int | None]]:
        """Per replica: next sequence expected and the subscriber's counters."""
        return {
            name: {
                "next_seq": s.next_seq,
                "received": s.num_received,
                "replayed": s.num_replayed,
                "duplicates": s.num_duplicates,
                "gaps": s.num_gaps,
                "lost": s.num_lost,
                "restarts": s.num_restarts,
                "blocks": self.index.replica_num_blocks(name),
            }
            for name, s in self.subscribers.items()
        }

    def close(self) -> None:
        for sub in self.subscribers.values():
            sub.close()

    def __enter__(self) -> IndexSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(
    replicas: Mapping[str, tuple[str, str | None]],
    query_endpoint: str,
    *,
    topic: str = "",
    ready: Any = None,
) -> None:
    """Runs an index process: subscribes to the replicas and answers queries on a
    REP socket until a ``{"op": "stop"}`` request.

    Requests and replies are msgpack maps. ``{"op": "longest_prefix",
    "block_hashes": [...], "group_idx": None}`` → ``{"replica": name | None,
    "num_blocks": n, "lengths": {name: n}}``; ``{"op": "status"}`` → the
    subscriber status, index size and stats; ``{"op": "entries", "replica":
    name}`` → ``[[hash, group_idx, count], ...]``. ``ready`` (a text stream)
    receives one JSON line with the bound query endpoint.
    """
    import msgspec
    import zmq

    index = PrefixIndex()
    ctx: zmq.Context[Any] = zmq.Context.instance()
    rep = ctx.socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    rep.bind(query_endpoint)
    bound = rep.getsockopt_string(zmq.LAST_ENDPOINT)
    if ready is not None:
        ready.write(json.dumps({"query_endpoint": bound}) + "\n")
        ready.flush()
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    with IndexSubscriber(index, replicas, topic=topic) as feeder:
        poller = zmq.Poller()
        poller.register(rep, zmq.POLLIN)
        for sub in feeder.subscribers.values():
            poller.register(sub.sub, zmq.POLLIN)
        while True:
            feeder.poll(0)
            if rep not in dict(poller.poll(50)):
                continue
            req = dec.decode(rep.recv())
            op = req.get("op")
            reply: Any
            if op == "longest_prefix":
                hashes = req["block_hashes"]
                group = req.get("group_idx")
                best = index.longest_prefix(hashes, group)
                reply = {
                    "replica": None if best is None else best.replica,
                    "num_blocks": 0 if best is None else best.num_blocks,
                    "lengths": index.match_lengths(hashes, group),
                }
            elif op == "status":
                st = index.stats()
                reply = {
                    "replicas": feeder.status(),
                    "num_blocks": index.num_blocks,
                    "events": feeder.num_events,
                    "batches": feeder.num_batches,
                    "stats": st.__dict__,
                }
            elif op == "entries":
                reply = index.entries(req["replica"])
            elif op == "stop":
                rep.send(enc.encode({"ok": True}))
                break
            else:
                reply = {"error": f"unknown op {op!r}"}
            rep.send(enc.encode(reply))
    rep.close(0)


def _replica_arg(text: str) -> tuple[str, tuple[str, str | None]]:
    name, sep, endpoints = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError("expected NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT]")
    pub, _, replay = endpoints.partition(",")
    return name, (pub, replay or None)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv.index",
        description="Prefix index over the KV events of several replicas, answering "
        "longest-prefix queries over ZMQ.",
    )
    parser.add_argument(
        "--replica",
        action="append",
        type=_replica_arg,
        required=True,
        help="NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT] (repeat per replica)",
    )
    parser.add_argument("--query", default="tcp://127.0.0.1:5560", help="REP endpoint to bind")
    parser.add_argument("--topic", default="")
    args = parser.parse_args(argv)
    started = time.monotonic()
    serve(dict(args.replica), args.query, topic=args.topic, ready=sys.stdout)
    print(json.dumps({"stopped_after_s": round(time.monotonic() - started, 3)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
