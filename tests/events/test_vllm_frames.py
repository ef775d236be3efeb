"""Interop with vLLM 0.33's own KV-event publisher, from frames it sent
(``tests/vectors/vllm_kv_event_frames.json``, recorded from
``vllm.distributed.kv_events.ZmqEventPublisher``): its payloads decode, re-encode
byte for byte, and pagedkv's subscriber follows its live stream and replays
from its replay socket's framing."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from pagedkv.events import wire  # noqa: E402
from pagedkv.events.zmq import END_SEQ, ZmqEventPublisher, ZmqEventSubscriber  # noqa: E402

FRAMES = json.loads(
    (Path(__file__).parents[1] / "vectors" / "vllm_kv_event_frames.json").read_text()
)
LIVE = [[bytes.fromhex(f) for f in m] for m in FRAMES["live"]]
REPLAY = [[bytes.fromhex(f) for f in m] for m in FRAMES["replay_from_1"]]


def test_vllm_payloads_decode_with_every_field_and_re_encode_byte_for_byte() -> None:
    batches = [wire.decode_batch(m[2]) for m in LIVE]
    stored = batches[0].events[0]
    assert isinstance(stored, wire.WireBlockStored)
    assert stored.block_hashes == [11, 12] and stored.medium == "GPU"
    assert stored.session_id == "sess-1" and stored.lookahead_token_ids == [[5], [6]]
    second = batches[1].events[0]
    assert second.block_hashes == [b"\x01" * 32] and second.lora_name == "ad"
    assert second.extra_keys == [("ad", ["img", 0], "salt")]  # inner tuples decode as lists
    assert second.kv_cache_spec_sliding_window == 8
    assert isinstance(batches[1].events[1], wire.WireBlockRemoved)
    assert isinstance(batches[2].events[0], wire.WireAllBlocksCleared)
    enc = msgspec.msgpack.Encoder()
    for m, batch in zip(LIVE, batches, strict=True):
        assert enc.encode(batch) == m[2]


def test_the_framing_is_vllms() -> None:
    # Live: (topic, 8-byte sequence, payload); replay: (b"", topic, seq,
    # payload) and the end marker (b"", b"", -1, b"").
    assert [(m[0], int.from_bytes(m[1], "big")) for m in LIVE] == [(b"kv", i) for i in range(3)]
    assert [len(m) for m in REPLAY] == [4, 4, 4]
    assert REPLAY[-1] == [b"", b"", END_SEQ, b""]
    assert [m[3] for m in REPLAY[:-1]] == [m[2] for m in LIVE[1:]]
    # pagedkv's publisher answers a replay in the same frames.
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv") as pub:
        for m in LIVE:
            pub.publish(wire.decode_batch(m[2]))
        assert pub.flush()
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.bound_replay_endpoint)
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        got = []
        while not got or got[-1][2] != END_SEQ:
            assert dealer.poll(5000)
            got.append(dealer.recv_multipart())
        dealer.close(0)
    assert got == REPLAY


def _vllm_replay_server(router: Any, stop: threading.Event) -> None:
    """Answers every replay request with vLLM's recorded replay stream."""
    while not stop.is_set():
        if not router.poll(50):
            continue
        client, _, _start = router.recv_multipart()
        for m in REPLAY:
            router.send_multipart([client, *m])


def test_pagedkv_subscribes_to_vllms_stream_and_fills_a_gap_from_its_replay() -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    stop = threading.Event()
    t = threading.Thread(target=_vllm_replay_server, args=(router, stop))
    t.start()
    try:
        with ZmqEventSubscriber(
            pub.getsockopt_string(zmq.LAST_ENDPOINT),
            router.getsockopt_string(zmq.LAST_ENDPOINT),
            topic="kv",
            start_seq=None,
            resync_interval=None,
        ) as sub:
            got: list[Any] = []
            deadline = time.monotonic() + 10
            while not got and time.monotonic() < deadline:
                pub.send_multipart(LIVE[0])  # until the subscription is live
                got += sub.poll(0.05)
            got = got[:1]
            pub.send_multipart(LIVE[2])  # batch 1 never arrives live
            while len(got) < 3 and time.monotonic() < deadline:
                got += sub.poll(0.05)
            assert [(r.seq, r.replayed) for r in got] == [(0, False), (1, True), (2, True)]
            assert sub.num_gaps == 1 and sub.num_lost == 0
            assert isinstance(got[1].batch.events[1], wire.WireBlockRemoved)
    finally:
        stop.set()
        t.join(5)
        pub.close(0)
        router.close(0)


def test_live_interop_with_vllm_when_it_is_installed() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    import pagedkv as pk

    # vLLM's publisher -> pagedkv's subscriber (replay from 0 on connect).
    vpub = kv_events.ZmqEventPublisher(
        0, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv"
    )
    try:
        endpoint = vpub._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        replay = vpub._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        for i in range(5):
            vpub.publish(
                kv_events.KVEventBatch(
                    ts=float(i),
                    events=[kv_events.BlockRemoved(block_hashes=[i], medium="GPU", group_idx=0)],
                )
            )
        time.sleep(0.5)
        with ZmqEventSubscriber(endpoint, replay, topic="kv") as sub:
            got: list[Any] = []
            deadline = time.monotonic() + 10
            while len(got) < 5 and time.monotonic() < deadline:
                got += sub.poll(0.05)
            assert [r.seq for r in got] == list(range(5))
            assert [r.batch.events[0].block_hashes for r in got] == [[i] for i in range(5)]
    finally:
        vpub.shutdown()
    # pagedkv's publisher -> vLLM's decoder.
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    with ZmqEventPublisher("tcp://127.0.0.1:*", None) as pub:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.bound_endpoint)
        frames = None
        deadline = time.monotonic() + 10
        while frames is None and time.monotonic() < deadline:
            pub.publish([pk.BlockStored([7], None, [1, 2], 2, None, group_idx=0)])
            if sub.poll(50):
                frames = sub.recv_multipart()
        sub.close(0)
    assert frames is not None
    batch = decoder.decode(frames[2])
    assert isinstance(batch.events[0], kv_events.BlockStored)
    assert batch.events[0].block_hashes == [7]
