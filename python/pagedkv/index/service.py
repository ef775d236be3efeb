"""Feeding a :class:`~pagedkv.index.PrefixIndex` from many replicas over ZMQ.

:class:`IndexSubscriber` subscribes to the KV-event publishers of several
replicas (separate processes or hosts), replaying gaps, and :func:`serve` (``python
-m pagedkv.index``) runs that as a standalone process answering longest-prefix
queries over ZMQ. Needs the ``events`` extra (``msgspec``, ``pyzmq``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .prefix import PrefixIndex

if TYPE_CHECKING:
    from ..events.zmq import ZmqEventSubscriber

__all__ = ["IndexSubscriber", "main", "serve"]


class IndexSubscriber:
    """Feeds a :class:`PrefixIndex` from the ZMQ publishers of several replicas.

    ``replicas`` maps a replica name to ``(pub_endpoint, replay_endpoint)``. Each
    replica gets a :class:`~pagedkv.events.zmq.ZmqEventSubscriber` (sequences are
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
