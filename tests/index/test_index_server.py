"""The index query server (``python -m pagedkv.index``) under hostile queries:
every malformed, oversized or forged query gets an error reply and the server
keeps answering; ``stop`` needs an explicit opt-in."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from pagedkv.index import PrefixIndex  # noqa: E402
from pagedkv.index.service import MAX_QUERY_HASHES, QueryError, answer, serve  # noqa: E402


class Client:
    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def raw(self, *frames: bytes) -> Any:
        self.sock.send_multipart(list(frames))
        assert self.sock.poll(10_000), "the server did not answer"
        return msgspec.msgpack.decode(self.sock.recv())

    def ask(self, req: Any) -> Any:
        return self.raw(msgspec.msgpack.encode(req))

    def close(self) -> None:
        self.sock.close(0)


def _start(replicas: dict[str, tuple[str, str | None]]) -> tuple[threading.Thread, Client]:
    """``serve`` on a thread (stop allowed), and a client of its query socket."""
    ready: list[str] = []

    class Ready:
        def write(self, text: str) -> None:
            ready.append(text)

        def flush(self) -> None:
            pass

    t = threading.Thread(
        target=serve,
        args=(replicas, "tcp://127.0.0.1:*"),
        kwargs={"ready": Ready(), "allow_stop": True},
    )
    t.start()
    while not ready:
        t.join(0.01)
    return t, Client(json.loads(ready[0])["query_endpoint"])


def _stop(t: threading.Thread, client: Client) -> None:
    assert client.ask({"op": "stop"}) == {"ok": True}
    client.close()
    t.join(10)
    assert not t.is_alive()


@pytest.fixture
def server() -> Iterator[Client]:
    t, client = _start({})
    yield client
    _stop(t, client)


HOSTILE: dict[str, tuple[bytes, ...]] = {
    "not_msgpack": (b"\xc1",),
    "truncated": (b"\x82\xa2op",),
    "an_int": (msgspec.msgpack.encode(5),),
    "a_list": (msgspec.msgpack.encode(["longest_prefix"]),),
    "no_op": (msgspec.msgpack.encode({"block_hashes": [1]}),),
    "unknown_op": (msgspec.msgpack.encode({"op": "drop_tables"}),),
    "missing_hashes": (msgspec.msgpack.encode({"op": "longest_prefix"}),),
    "hashes_not_a_list": (msgspec.msgpack.encode({"op": "longest_prefix", "block_hashes": 7}),),
    "negative_hash": (msgspec.msgpack.encode({"op": "longest_prefix", "block_hashes": [-1]}),),
    "string_hash": (msgspec.msgpack.encode({"op": "longest_prefix", "block_hashes": ["a"]}),),
    "bool_hash": (msgspec.msgpack.encode({"op": "longest_prefix", "block_hashes": [True]}),),
    "empty_bytes_hash": (msgspec.msgpack.encode({"op": "longest_prefix", "block_hashes": [b""]}),),
    "long_bytes_hash": (
        msgspec.msgpack.encode({"op": "longest_prefix", "block_hashes": [b"x" * 33]}),
    ),
    "negative_group": (
        msgspec.msgpack.encode({"op": "longest_prefix", "block_hashes": [1], "group_idx": -1}),
    ),
    "huge_group": (
        msgspec.msgpack.encode({"op": "longest_prefix", "block_hashes": [1], "group_idx": 2**40}),
    ),
    "string_group": (
        msgspec.msgpack.encode({"op": "longest_prefix", "block_hashes": [1], "group_idx": "0"}),
    ),
    "too_many_hashes": (
        msgspec.msgpack.encode(
            {"op": "longest_prefix", "block_hashes": [1] * (MAX_QUERY_HASHES + 1)}
        ),
    ),
    "bad_weights": (
        msgspec.msgpack.encode({"op": "longest_prefix", "block_hashes": [1], "weights": [1, 2]}),
    ),
    "entries_without_replica": (msgspec.msgpack.encode({"op": "entries"}),),
    "entries_int_replica": (msgspec.msgpack.encode({"op": "entries", "replica": 3}),),
    "two_frames": (msgspec.msgpack.encode({"op": "status"}), b"more"),
}


def test_every_hostile_query_gets_an_error_and_the_server_keeps_answering(
    server: Client,
) -> None:
    for name, frames in HOSTILE.items():
        reply = server.raw(*frames)
        assert isinstance(reply, dict) and "error" in reply, name
        # Still answering good queries.
        good = server.ask({"op": "longest_prefix", "block_hashes": [1, 2]})
        assert good == {
            "replica": None,
            "num_blocks": 0,
            "lengths": {},
            "tiers": {},
            "weighted": {},
            "stale": [],
        }, name
    status = server.ask({"op": "status"})
    assert status["queries"]["rejected"] == len(HOSTILE)
    assert status["queries"]["last_error"]


def test_stop_needs_an_explicit_opt_in(tmp_path: Any) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedkv.index",
            "--replica",
            "a=tcp://127.0.0.1:1",
            "--query",
            "tcp://127.0.0.1:*",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        client = Client(json.loads(proc.stdout.readline())["query_endpoint"])
        reply = client.ask({"op": "stop"})
        assert "error" in reply and "--allow-stop" in reply["error"]
        assert client.ask({"op": "status"})["queries"]["rejected"] == 1
        assert proc.poll() is None
        client.close()
    finally:
        proc.kill()
        proc.communicate(timeout=10)


@pytest.mark.parametrize(
    "req",
    [None, [], {"op": 1}, {"op": "longest_prefix", "block_hashes": [2**64]}],
)
def test_answer_refuses_what_is_not_a_query(req: Any) -> None:
    with pytest.raises(QueryError):
        answer(PrefixIndex(), None, req)


def test_dead_replicas_do_not_slow_queries() -> None:
    import time

    # Nothing listens there: every replay (on connect, then each resync) goes
    # unanswered until its timeout.
    dead: dict[str, tuple[str, str | None]] = {
        f"dead{i}": (f"tcp://127.0.0.1:{9 + 2 * i}", f"tcp://127.0.0.1:{10 + 2 * i}")
        for i in range(3)
    }
    t, client = _start(dead)
    try:
        worst = 0.0
        end = time.monotonic() + 3.0  # past a resync interval
        while time.monotonic() < end:
            t0 = time.monotonic()
            reply = client.ask({"op": "longest_prefix", "block_hashes": [1, 2, 3]})
            worst = max(worst, time.monotonic() - t0)
            assert reply["replica"] is None
        # Blocking on the dead replicas' replays took >= 5 s per query; the
        # figure (under 100 ms) is in docs/reliability.md. Loose here: CI is loaded.
        assert worst < 1.0
        # Not heard from for stale_after (10 s by default): not flagged yet.
        assert client.ask({"op": "longest_prefix", "block_hashes": [1]})["stale"] == []
    finally:
        _stop(t, client)
