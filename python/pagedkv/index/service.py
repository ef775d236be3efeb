"""Feeding a :class:`~pagedkv.index.PrefixIndex` from many replicas over ZMQ.

:class:`IndexSubscriber` subscribes to the KV-event publishers of several
replicas (separate processes or hosts), replaying gaps, and :func:`serve` (``python
-m pagedkv.index``) runs that as a standalone process answering longest-prefix
queries over ZMQ. Needs the ``events`` extra (``msgspec``, ``pyzmq``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import PagedKVError
from .prefix import TIER_WEIGHTS, PrefixIndex

if TYPE_CHECKING:
    from ..events.zmq import ZmqEventSubscriber

_log = logging.getLogger(__name__)

__all__ = [
    "MAX_QUERY_BYTES",
    "MAX_QUERY_HASHES",
    "IndexSubscriber",
    "QueryError",
    "answer",
    "main",
    "serve",
]


class IndexSubscriber:
    """Feeds a :class:`PrefixIndex` from the ZMQ publishers of several replicas.

    ``replicas`` maps a replica name to ``(pub_endpoint, replay_endpoint)``. Each
    replica gets a :class:`~pagedkv.events.zmq.ZmqEventSubscriber` (sequences are
    per publisher), which replays from sequence 0 on connect and fills gaps; a
    publisher restart, or batches lost for good (a gap replay could not fill),
    clears the replica before its next events are applied (``status()`` counts
    ``cleared_after_loss``). A batch is applied all or nothing; a refused one is
    counted in ``rejected_batches`` with ``last_error``.
    """

    def __init__(
        self,
        index: PrefixIndex,
        replicas: Mapping[str, tuple[str, str | None]],
        *,
        topic: str = "",
        stale_after: float = 10.0,
        **subscriber_options: Any,
    ) -> None:
        import zmq

        from ..events.zmq import ZmqEventSubscriber

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
        self.stale_after = stale_after
        # Per replica: batches refused whole (undecodable, or an event the index
        # cannot take), and the last reason.
        self.rejected_batches: dict[str, int] = dict.fromkeys(replicas, 0)
        # Per replica: times its entries were cleared because batches were lost.
        self.cleared_after_loss: dict[str, int] = dict.fromkeys(replicas, 0)
        self.last_error: dict[str, str | None] = dict.fromkeys(replicas)

    def poll(self, timeout: float = 0.1) -> int:
        """Applies what arrived (waiting up to ``timeout`` s for something);
        returns the number of batches applied."""
        n = self._drain()
        if n == 0 and timeout > 0:
            # A replay in progress answers on its own socket: look again soon.
            replaying = any(s.replaying for s in self.subscribers.values())
            wait = min(timeout, 0.005) if replaying else timeout
            if self._poller.poll(int(wait * 1000)) or replaying:
                n = self._drain()
        return n

    def _drain(self) -> int:
        n = 0
        for name, sub in self.subscribers.items():
            for r in sub.poll(0):
                if r.reset or r.lost_before:
                    # A restart, or batches lost for good: what the index holds
                    # for this replica can no longer be trusted. It starts over
                    # from what arrives next (removals of blocks it no longer
                    # knows are counted as unknown removals).
                    self.index.clear(name)
                    if r.lost_before:
                        self.cleared_after_loss[name] += 1
                        _log.warning(
                            "replica %s: %d event batches lost before %d; its index "
                            "entries were cleared",
                            name,
                            r.lost_before,
                            r.seq,
                        )
                try:
                    # All or nothing: a bad event refuses the whole batch.
                    self.num_events += self.index.apply(name, r.batch.events)
                except (PagedKVError, TypeError, ValueError, OverflowError) as e:
                    self.rejected_batches[name] += 1
                    self.last_error[name] = f"batch {r.seq}: {type(e).__name__}: {e}"
                    continue
                n += 1
        self.num_batches += n
        return n

    def status(self) -> dict[str, dict[str, int | str | None]]:
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
                "malformed": s.num_malformed,
                "unknown_events": s.num_unknown_events,
                "rejected_batches": s.num_rejected + self.rejected_batches[name],
                "last_error": self.last_error[name] or s.last_error,
                "cleared_after_loss": self.cleared_after_loss[name],
                "replay_timeouts": s.num_replay_timeouts,
                "stale": time.monotonic() - s.last_heard > self.stale_after,
                "blocks": self.index.replica_num_blocks(name),
            }
            for name, s in self.subscribers.items()
        }

    def stale(self) -> list[str]:
        """Replicas not heard from (no live batch, no replay answer) for
        ``stale_after`` seconds: their entries are kept, and answers name them."""
        now = time.monotonic()
        return sorted(
            name for name, s in self.subscribers.items() if now - s.last_heard > self.stale_after
        )

    def close(self) -> None:
        for sub in self.subscribers.values():
            sub.close()

    def __enter__(self) -> IndexSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Largest query message the server reads (bigger ones are dropped by ZMQ).
MAX_QUERY_BYTES = 16 << 20
#: Most block hashes one ``longest_prefix`` query may carry.
MAX_QUERY_HASHES = 1 << 20


class QueryError(ValueError):
    """A query the index server refuses (answered ``{"error": ...}``)."""


def _hashes(req: dict[str, Any]) -> list[int | bytes]:
    hashes = req.get("block_hashes")
    if not isinstance(hashes, list):
        raise QueryError("block_hashes must be a list")
    if len(hashes) > MAX_QUERY_HASHES:
        raise QueryError(f"{len(hashes)} block hashes: more than {MAX_QUERY_HASHES}")
    for h in hashes:
        if isinstance(h, bool) or not isinstance(h, int | bytes):
            raise QueryError(f"a block hash must be an int or bytes, got {type(h).__name__}")
        if isinstance(h, int) and not 0 <= h < 1 << 64:
            raise QueryError(f"block hash {h} is outside 0..2**64")
        if isinstance(h, bytes) and not 1 <= len(h) <= 32:
            raise QueryError(f"a block hash of {len(h)} bytes (1..32 expected)")
    return hashes


def _group(req: dict[str, Any]) -> int | None:
    group = req.get("group_idx")
    if group is None:
        return None
    if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < 1 << 32:
        raise QueryError(f"group_idx must be None or an int in 0..2**32, got {group!r}")
    return group


def _weights(req: dict[str, Any]) -> tuple[float, float, float]:
    """A query's tier weights (device, host, disk): three finite numbers from
    0 to 1000; :data:`~pagedkv.index.prefix.TIER_WEIGHTS` when absent."""
    w = req.get("weights")
    if w is None:
        return TIER_WEIGHTS
    if (
        not isinstance(w, list | tuple)
        or len(w) != 3
        or not all(
            isinstance(x, int | float) and not isinstance(x, bool) and 0 <= x <= 1000 for x in w
        )
    ):
        raise QueryError("weights are three numbers from 0 to 1000 (device, host, disk)")
    return (float(w[0]), float(w[1]), float(w[2]))


def answer(
    index: PrefixIndex,
    feeder: IndexSubscriber | None,
    req: Any,
    counters: Mapping[str, Any] | None = None,
) -> Any:
    """The reply to one decoded query; raises :class:`QueryError` for a query
    that is not one (``stop`` is the caller's)."""
    if not isinstance(req, dict):
        raise QueryError(f"a query is a map, got {type(req).__name__}")
    op = req.get("op")
    if op == "longest_prefix":
        hashes, group = _hashes(req), _group(req)
        best = index.longest_prefix(hashes, group)
        tiers = index.match_tiers(hashes, group)
        return {
            "replica": None if best is None else best.replica,
            "num_blocks": 0 if best is None else best.num_blocks,
            "lengths": index.match_lengths(hashes, group),
            "tiers": {n: [t.device, t.host, t.disk] for n, t in tiers.items()},
            "weighted": index.weighted_match(hashes, _weights(req), group),
            "stale": [] if feeder is None else feeder.stale(),
        }
    if op == "status":
        return {
            "replicas": {} if feeder is None else feeder.status(),
            "num_blocks": index.num_blocks,
            "events": 0 if feeder is None else feeder.num_events,
            "batches": 0 if feeder is None else feeder.num_batches,
            "stats": index.stats().__dict__,
            "queries": dict(counters or {}),
        }
    if op == "entries":
        replica = req.get("replica")
        if not isinstance(replica, str):
            raise QueryError("entries needs a replica name (a string)")
        return index.entries(replica)
    raise QueryError(f"unknown op {op!r}")


def serve(
    replicas: Mapping[str, tuple[str, str | None]],
    query_endpoint: str,
    *,
    topic: str = "",
    ready: Any = None,
    allow_stop: bool = False,
    stale_after: float = 10.0,
) -> None:
    """Runs an index process: subscribes to the replicas and answers queries on a
    REP socket; with ``allow_stop``, until a ``{"op": "stop"}`` request.

    Requests and replies are msgpack maps, one frame each. ``{"op":
    "longest_prefix", "block_hashes": [...], "group_idx": None, "weights":
    [1, 0.75, 0.25]}`` (weights optional) → ``{"replica": name | None,
    "num_blocks": n, "lengths": {name: n}, "tiers": {name: [device, host,
    disk]}, "weighted": {name: w}, "stale": [name, ...]}`` (the held prefix per
    tier, and weighed by tier; replicas not heard from for ``stale_after``
    seconds: their entries are kept and may be out of date);
    ``{"op": "status"}`` → the subscriber status, index size, stats and query
    counters; ``{"op": "entries", "replica": name}`` → ``[[hash, group_idx,
    count], ...]``. A query the server cannot take (not msgpack, not a map,
    several frames, a bad hash or group, an unknown op, ``stop`` without
    ``allow_stop``) gets ``{"error": why}`` and the server keeps answering;
    messages over :data:`MAX_QUERY_BYTES` are dropped unread. ``ready`` (a text
    stream) receives one JSON line with the bound query endpoint.
    """
    import msgspec
    import zmq

    index = PrefixIndex()
    ctx: zmq.Context[Any] = zmq.Context.instance()
    rep = ctx.socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    rep.setsockopt(zmq.MAXMSGSIZE, MAX_QUERY_BYTES)
    rep.bind(query_endpoint)
    bound = rep.getsockopt_string(zmq.LAST_ENDPOINT)
    if ready is not None:
        ready.write(json.dumps({"query_endpoint": bound}) + "\n")
        ready.flush()
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    counters: dict[str, Any] = {"answered": 0, "rejected": 0, "last_error": None}
    with IndexSubscriber(index, replicas, topic=topic, stale_after=stale_after) as feeder:
        poller = zmq.Poller()
        poller.register(rep, zmq.POLLIN)
        for sub in feeder.subscribers.values():
            poller.register(sub.sub, zmq.POLLIN)
        while True:
            feeder.poll(0)
            if rep not in dict(poller.poll(50)):
                continue
            frames = rep.recv_multipart()
            stop = False
            try:
                if len(frames) != 1:
                    raise QueryError(f"a query is one frame, got {len(frames)}")
                try:
                    req = dec.decode(frames[0])
                except msgspec.DecodeError as e:
                    raise QueryError(f"not msgpack: {e}") from e
                if isinstance(req, dict) and req.get("op") == "stop":
                    if not allow_stop:
                        raise QueryError("stop is disabled (start the server with --allow-stop)")
                    reply: Any = {"ok": True}
                    stop = True
                else:
                    reply = answer(index, feeder, req, counters)
                counters["answered"] += 1
            except Exception as e:  # every query gets a reply
                counters["rejected"] += 1
                counters["last_error"] = f"{type(e).__name__}: {e}"
                reply = {"error": str(e) if isinstance(e, QueryError) else counters["last_error"]}
            rep.send(enc.encode(reply))
            if stop:
                break
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
    parser.add_argument(
        "--stale-after",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds without a message before a replica is reported stale (default 10)",
    )
    parser.add_argument(
        "--allow-stop",
        action="store_true",
        help='answer {"op": "stop"} by stopping (off: anyone who can reach the '
        "query socket could stop the index)",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    serve(
        dict(args.replica),
        args.query,
        topic=args.topic,
        ready=sys.stdout,
        allow_stop=args.allow_stop,
        stale_after=args.stale_after,
    )
    print(json.dumps({"stopped_after_s": round(time.monotonic() - started, 3)}), flush=True)
    return 0
