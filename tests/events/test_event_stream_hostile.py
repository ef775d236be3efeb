"""The event stream under hostile input: malformed frames, undecodable or forged
batches, event types this version does not know, a bad event in one replica's
batch. Each is refused and counted; nothing raises out of ``poll``, a bad batch is
applied all or nothing, and other replicas are unaffected."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from pagedkv.events import wire  # noqa: E402
from pagedkv.events.zmq import ZmqEventSubscriber  # noqa: E402
from pagedkv.index import IndexSubscriber, PrefixIndex  # noqa: E402


def _stored(h: int, group: Any = 0) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": [h],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": None,
        "lora_name": None,
        "group_idx": group,
    }


def _batch(events: list[Any], ts: float = 1.0) -> bytes:
    return msgspec.msgpack.encode([ts, events, None])


class FakePublisher:
    """A bare PUB socket sending whatever frames a test gives it."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def batch(self, payload: bytes) -> None:
        self.send(b"", self.seq.to_bytes(8, "big"), payload)
        self.seq += 1

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def pub() -> Iterator[FakePublisher]:
    p = FakePublisher()
    yield p
    p.close()


def _connected(sub: ZmqEventSubscriber, pub: FakePublisher) -> None:
    """Waits until the subscription is live (PUB drops what no one receives)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pub.batch(_batch([]))
        if sub.poll(0.05):
            return
    raise AssertionError("the subscription never connected")


def test_decode_skips_unknown_event_types_and_refuses_malformed_batches() -> None:
    newer = {"type": "BlockPinned", "block_hashes": [9], "pin": True}
    batch, skipped = wire.decode_batch_lenient(_batch([_stored(1), newer, _stored(2)]))
    assert skipped == 1
    assert [e.block_hashes for e in batch.events] == [[1], [2]]
    for bad in [
        b"\xc1",
        msgspec.msgpack.encode(5),
        _batch([{"type": "BlockStored", "block_hashes": "x"}]),
        _batch([7]),
    ]:
        with pytest.raises(msgspec.DecodeError):
            wire.decode_batch_lenient(bad)


def test_a_subscriber_refuses_bad_frames_and_batches_without_raising(pub: FakePublisher) -> None:
    with ZmqEventSubscriber(pub.endpoint, None, start_seq=None, resync_interval=None) as sub:
        _connected(sub, pub)
        seq = pub.seq
        pub.send(b"", b"\x00" * 3, _batch([]))  # a short sequence frame
        pub.send(b"", (2**64 - 1).to_bytes(8, "big"), _batch([]))  # forged, past int64
        pub.send(b"", b"x")  # two frames
        pub.batch(b"\xc1")  # not msgpack
        pub.batch(_batch([_stored(5), {"type": "FutureEvent"}]))
        got: list[Any] = []
        deadline = time.monotonic() + 10
        while len(got) < 1 and time.monotonic() < deadline:
            got.extend(sub.poll(0.05))
        assert [r.seq for r in got] == [seq + 1]
        assert [e.block_hashes for e in got[0].batch.events] == [[5]]
        assert (sub.num_malformed, sub.num_rejected, sub.num_unknown_events) == (3, 1, 1)
        assert sub.last_error is not None and sub.next_seq == seq + 2


def test_a_bad_batch_is_refused_whole_and_other_replicas_carry_on() -> None:
    a, b = FakePublisher(), FakePublisher()
    try:
        index = PrefixIndex()
        replicas = {"a": (a.endpoint, None), "b": (b.endpoint, None)}
        with IndexSubscriber(index, replicas, start_seq=None, resync_interval=None) as feeder:
            for p in (a, b):
                _connected(feeder.subscribers["a" if p is a else "b"], p)
            # The second event is bad (a negative group): the first is not applied.
            a.batch(_batch([_stored(11), _stored(12, group=-1)]))
            b.batch(_batch([_stored(21)]))
            a.batch(_batch([_stored(13)]))
            deadline = time.monotonic() + 10
            while index.num_blocks < 2 and time.monotonic() < deadline:
                feeder.poll(0.05)
            assert not index.contains("a", 11) and not index.contains("a", 12)
            assert index.contains("a", 13) and index.contains("b", 21)
            status = feeder.status()
            assert status["a"]["rejected_batches"] == 1 and status["a"]["last_error"]
            assert status["b"]["rejected_batches"] == 0
    finally:
        a.close()
        b.close()


def _drain(sub: ZmqEventSubscriber, n: int) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + 10
    while len(got) < n and time.monotonic() < deadline:
        got.extend(sub.poll(0.05))
    return got


def test_sequences_not_timestamps_decide_duplicates_and_restarts(pub: FakePublisher) -> None:
    with ZmqEventSubscriber(pub.endpoint, None, start_seq=None, resync_interval=None) as sub:
        _connected(sub, pub)
        first = pub.seq
        # A batch stamped far in the future does not make later ones duplicates.
        pub.batch(_batch([_stored(1)], ts=1e18))
        pub.batch(_batch([_stored(2)], ts=2.0))
        pub.batch(_batch([_stored(3)], ts=3.0))
        got = _drain(sub, 3)
        assert [r.seq for r in got] == [first, first + 1, first + 2]
        assert sub.num_duplicates == 0
        # A restarted publisher (sequence back to 0) with its clock behind.
        pub.seq = 0
        pub.batch(_batch([_stored(4)], ts=0.5))
        got = _drain(sub, 1)
        assert [(r.seq, r.reset) for r in got] == [(0, True)]
        assert sub.num_restarts == 1


def test_lost_batches_clear_what_the_index_holds_for_that_replica() -> None:
    a = FakePublisher()
    try:
        index = PrefixIndex()
        with IndexSubscriber(
            index, {"a": (a.endpoint, None)}, start_seq=None, resync_interval=None
        ) as feeder:
            _connected(feeder.subscribers["a"], a)
            a.batch(_batch([_stored(1)]))
            deadline = time.monotonic() + 10
            while not index.contains("a", 1) and time.monotonic() < deadline:
                feeder.poll(0.05)
            assert index.contains("a", 1)
            a.seq += 2  # two batches never arrive, and no replay can fill them
            a.batch(_batch([_stored(2)]))
            while not index.contains("a", 2) and time.monotonic() < deadline:
                feeder.poll(0.05)
            # Block 1 may have been evicted in the lost batches: not trusted.
            assert index.contains("a", 2) and not index.contains("a", 1)
            status = feeder.status()["a"]
            assert status["cleared_after_loss"] == 1 and status["lost"] == 2
    finally:
        a.close()


def _publisher(**kw: Any) -> Any:
    from pagedkv.events.zmq import ZmqEventPublisher

    return ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", **kw)


def test_an_encoding_error_surfaces_and_the_publisher_keeps_going() -> None:
    import pagedkv as pk

    with _publisher() as pub:
        pub.publish([object()])
        with pytest.raises(RuntimeError, match="could not be published"):
            pub.flush()
        assert pub.num_failed == 1 and isinstance(pub.error, TypeError)
        # Raised once; the thread is alive and the failed batch took no sequence.
        pub.publish([pk.BlockRemoved([1], group_idx=0)])
        assert pub.flush() and pub.next_seq == 1
    with _publisher(hash_format="bytes") as pub:
        pub.publish([pk.BlockRemoved([5], group_idx=0)])  # int hashes: no raw digest
        with pytest.raises(RuntimeError):
            pub.flush()
        pub.publish([pk.BlockRemoved([b"\x01" * 32], group_idx=0)])
        assert pub.flush() and pub.next_seq == 1


def test_a_full_queue_drops_the_batch_and_leaves_a_visible_gap() -> None:
    import pagedkv as pk

    big = [pk.BlockStored([i], None, list(range(2_000_000)), 16, None) for i in range(2)]
    with _publisher(max_queue_size=1, publish_timeout=0.001) as pub:
        pub.publish([big[0]])  # the thread encodes it
        pub.publish([big[1]])  # waits in the queue
        # Batches offered faster than the thread takes them: a full queue
        # (one slot) turns some away after 1 ms instead of blocking. However
        # fast this machine encodes, a tight loop finds the slot taken soon.
        t0 = time.monotonic()
        for i in range(500):
            pub.publish([pk.BlockRemoved([i], group_idx=0)])
            if pub.num_dropped:
                break
        assert time.monotonic() - t0 < 2  # bounded: no waiting for room
        assert pub.flush(30)
        assert pub.num_dropped >= 1
        # The dropped batch's sequence was skipped.
        assert pub.next_seq == pub.num_published + pub.num_dropped


def test_replay_clients_that_never_read_do_not_stall_live_publishing() -> None:
    import pagedkv as pk

    tokens = list(range(2_000))  # about 10 kB per batch: replays outgrow socket buffers
    with _publisher(hwm=10, buffer_steps=2_000, replay_send_timeout=0.2) as pub:
        for i in range(2_000):
            pub.publish([pk.BlockStored([i], None, tokens, 2_000, None)])
        assert pub.flush(30)
        clients = []
        for _ in range(20):
            c = zmq.Context.instance().socket(zmq.DEALER)
            c.setsockopt(zmq.LINGER, 0)
            c.setsockopt(zmq.RCVHWM, 10)
            c.connect(pub.bound_replay_endpoint)
            c.send_multipart((b"", (0).to_bytes(8, "big")))
            clients.append(c)
        time.sleep(0.5)
        t0 = time.monotonic()
        for i in range(100):
            pub.publish([pk.BlockRemoved([i], group_idx=0)])
        assert pub.flush(10)
        assert time.monotonic() - t0 < 5  # stalled streams once held it for 55 s
        deadline = time.monotonic() + 10
        while pub.num_replay_abandoned < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        # Every stream stalled and was abandoned; live batches kept flowing.
        assert pub.num_replay_abandoned == 20 and pub.num_published == 2_100
        for c in clients:
            c.close(0)


def test_a_silent_replica_is_flagged_stale_and_keeps_its_entries() -> None:
    a, b = FakePublisher(), FakePublisher()
    try:
        index = PrefixIndex()
        replicas = {"a": (a.endpoint, None), "b": (b.endpoint, None)}
        with IndexSubscriber(
            index, replicas, start_seq=None, resync_interval=None, stale_after=0.5
        ) as feeder:
            for name, p in (("a", a), ("b", b)):
                _connected(feeder.subscribers[name], p)
            a.batch(_batch([_stored(1)]))
            deadline = time.monotonic() + 10
            while not index.contains("a", 1) and time.monotonic() < deadline:
                feeder.poll(0.05)
            # b goes silent, a keeps publishing.
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                a.batch(_batch([]))
                feeder.poll(0.05)
            assert feeder.stale() == ["b"]
            assert feeder.status()["b"]["stale"] and not feeder.status()["a"]["stale"]
            assert index.contains("a", 1)
    finally:
        a.close()
        b.close()
