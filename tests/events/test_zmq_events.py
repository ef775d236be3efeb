"""The ZMQ publisher and subscriber: vLLM's framing, replay, gap detection."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

import pagedkv as pk  # noqa: E402
from pagedkv.events import wire  # noqa: E402
from pagedkv.events.zmq import (  # noqa: E402
    END_SEQ,
    Received,
    ZmqEventPublisher,
    ZmqEventSubscriber,
    offset_endpoint_port,
)

from tests._util import make_manager  # noqa: E402

LOOPBACK = "tcp://127.0.0.1:*"


def _removed(i: int) -> pk.BlockRemoved:
    return pk.BlockRemoved([i], group_idx=0)


BIG_TOKENS = list(range(100_000, 102_000))  # about 10 kB per message


def _big_stored(i: int) -> pk.BlockStored:
    return pk.BlockStored([i], None, BIG_TOKENS, 2000, None, group_idx=0)


def _collect(sub: ZmqEventSubscriber, n: int, timeout: float = 20.0) -> list[Received]:
    got: list[Received] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got.extend(sub.poll(0.05))
    return got


def _publisher(**kw: object) -> ZmqEventPublisher:
    return ZmqEventPublisher(LOOPBACK, LOOPBACK, **kw)  # type: ignore[arg-type]


def test_offset_endpoint_port_follows_vllm() -> None:
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("inproc://cache", 1) == "inproc://cache_dp1"
    assert offset_endpoint_port(None, 3) is None
    with pytest.raises(ValueError):
        offset_endpoint_port("ipc:///tmp/x", 1)


def test_messages_have_vllms_three_frames() -> None:
    with _publisher(topic="kv@r0", data_parallel_rank=0) as pub:
        assert pub.bound_endpoint is not None
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.bound_endpoint)
        time.sleep(1.0)  # the subscription must reach the publisher first (slow when loaded)
        pub.publish([_removed(7)], ts=1.5)
        pub.publish([pk.AllBlocksCleared()], ts=2.5)
        assert sub.poll(5000)
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@r0" and seq == (0).to_bytes(8, "big")
        assert payload == wire.KVEventEncoder(data_parallel_rank=0).encode_events(
            [_removed(7)], ts=1.5
        )
        assert sub.recv_multipart()[1] == (1).to_bytes(8, "big")
        sub.close(0)


def test_replay_router_streams_from_the_requested_sequence() -> None:
    with _publisher(buffer_steps=5) as pub:
        for i in range(8):
            pub.publish([_removed(i)], ts=float(i))
        assert pub.flush()
        assert pub.bound_replay_endpoint is not None
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(pub.bound_replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        seqs = []
        while True:
            assert dealer.poll(5000)
            # vLLM 0.33's framing: (b"", topic, seq, payload), then
            # (b"", b"", -1, b"").
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert (topic, payload) == (b"", b"")
                break
            assert topic == b""
            seqs.append(int.from_bytes(seq, "big"))
            assert wire.decode_batch(payload).ts == float(seqs[-1])
        assert seqs == [3, 4, 5, 6, 7]  # only the last buffer_steps batches are kept
        dealer.close(0)


def test_new_subscriber_catches_up_by_replay() -> None:
    with _publisher() as pub:
        for i in range(50):
            pub.publish([_removed(i)])
        assert pub.flush()
        with ZmqEventSubscriber(pub.bound_endpoint or "", pub.bound_replay_endpoint) as sub:
            got = _collect(sub, 50)
            assert [r.seq for r in got] == list(range(50))
            assert all(r.replayed for r in got)
            pub.publish([_removed(50)])
            more = _collect(sub, 1)
            assert [r.seq for r in more] == [50]
            assert sub.num_lost == 0


def test_dropped_messages_are_detected_and_replayed() -> None:
    # Tiny high-water marks on both ends make the PUB socket drop messages for a
    # subscriber that does not read: the subscriber must see the gaps and replay.
    n = 2000
    with _publisher(hwm=10, buffer_steps=n) as pub:
        with ZmqEventSubscriber(
            pub.bound_endpoint or "", pub.bound_replay_endpoint, rcvhwm=10
        ) as sub:
            assert sub.poll(0.1) == []  # catch-up replay: nothing yet
            time.sleep(0.3)
            for i in range(n):
                pub.publish([_big_stored(i)])
            assert pub.flush()
            got = _collect(sub, n)
            assert [r.seq for r in got] == list(range(n))
            assert [r.batch.events[0].block_hashes[0] for r in got] == list(range(n))
            assert sub.num_gaps > 0 and sub.num_replayed > 0 and sub.num_lost == 0


def test_gaps_beyond_the_buffer_are_reported_lost() -> None:
    with _publisher(hwm=10, buffer_steps=100) as pub:
        with ZmqEventSubscriber(
            pub.bound_endpoint or "", pub.bound_replay_endpoint, rcvhwm=10, resync_interval=None
        ) as sub:
            time.sleep(0.3)
            pub.publish([_removed(0)])
            assert [r.seq for r in _collect(sub, 1)] == [0]
            for i in range(1, 2000):
                pub.publish([_big_stored(i)])
            assert pub.flush()
            got = _collect(sub, 100)
            # Replays answer over several polls: read until the last batch is in.
            deadline = time.monotonic() + 20
            while (not got or got[-1].seq < 1999) and time.monotonic() < deadline:
                got.extend(sub.poll(0.05))
            seqs = [r.seq for r in got]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
            assert sub.num_gaps >= 1 and sub.num_lost > 0
            lost = sum(r.lost_before for r in got)
            assert lost == sub.num_lost
            assert seqs[-1] == 1999
            assert len(seqs) + lost == 1999  # every batch 1..1999 delivered or counted lost


def test_publisher_restart_is_detected() -> None:
    pub = _publisher()
    endpoint, replay = pub.bound_endpoint or "", pub.bound_replay_endpoint or ""
    sub = ZmqEventSubscriber(endpoint, replay)
    # The first publisher gets well ahead: the restarted one probes until the
    # subscriber has reconnected, and only a sequence at or below the last live
    # one reads as a restart (a slow reconnect must not carry the probes past it).
    n = 50
    for i in range(n):
        pub.publish([_removed(i)])
    assert [r.seq for r in _collect(sub, n)] == list(range(n))
    pub.close()
    deadline = time.monotonic() + 10
    while True:  # ZeroMQ releases the closed sockets' ports asynchronously
        try:
            pub = ZmqEventPublisher(endpoint, replay, bind=True)  # sequence from 0 again
            break
        except zmq.ZMQError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    got: list[Received] = []
    while not got and time.monotonic() < deadline:
        pub.publish([_removed(100 + pub.next_seq)])
        got = sub.poll(0.1)
    pub.publish([_removed(100 + pub.next_seq)])
    got += _collect(sub, 1)
    seqs = [r.seq for r in got]
    assert sub.num_restarts == 1
    assert seqs == list(range(len(seqs))) and len(seqs) >= 2  # from 0, the gap replayed
    assert got[0].reset and not any(r.reset for r in got[1:])
    assert sub.num_lost == 0
    sub.close()
    pub.close()


def test_publish_from_manager_takes_and_sends_its_events() -> None:
    mgr = make_manager(block_size=4, num_blocks=8, enable_kv_cache_events=True)
    with _publisher() as pub:
        assert pub.publish_from(mgr) == 0 and pub.next_seq == 0  # nothing to send
        mgr.add_request("a", list(range(9)))
        hit = mgr.get_computed_blocks("a")
        mgr.allocate_slots("a", 9, num_computed_tokens=0, new_computed_blocks=hit)
        assert pub.publish_from(mgr) == 1
        assert pub.flush() and pub.next_seq == 1
        with ZmqEventSubscriber(pub.bound_endpoint or "", pub.bound_replay_endpoint) as sub:
            (r,) = _collect(sub, 1)
            (ev,) = r.batch.events
            assert isinstance(ev, wire.WireBlockStored)
            assert ev.block_hashes == [wire.hash_to_int(h) for h in mgr.block_hashes("a")]


def test_the_default_publisher_binds_loopback_only() -> None:
    from pagedkv.events.zmq import DEFAULT_ENDPOINT

    try:
        pub = ZmqEventPublisher()
    except zmq.ZMQError as e:  # the port is taken on this machine
        pytest.skip(f"{DEFAULT_ENDPOINT}: {e}")
    with pub:
        assert pub.bound_endpoint == DEFAULT_ENDPOINT == "tcp://127.0.0.1:5557"
