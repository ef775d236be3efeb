"""KV events on the wire: byte-identical with vLLM 0.33's msgspec encoding."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

msgspec = pytest.importorskip("msgspec")

import pagedkv as pk  # noqa: E402
from pagedkv.events import wire  # noqa: E402

from tests._util import load_vectors, make_manager  # noqa: E402

VEC = load_vectors("vllm_hashes_default.json")
CHAIN = [bytes.fromhex(h) for h in VEC["chain_bs4_salt_first_block_sha256_cbor"]["hashes"]]


# vLLM-shaped consumer structs, declared independently of pagedkv.events.wire (what a
# router written against vLLM decodes with).
class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _Stored(_Event, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _Removed(_Event, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class _Cleared(_Event, tag="AllBlocksCleared"):
    pass


class _KVBatch(_Batch):
    events: list[_Stored | _Removed | _Cleared]


def _vector_events() -> list[Any]:
    """The events of ``event_vectors`` / ``event_batch``: domain events (what the
    manager returns) and a wire struct."""
    return [
        pk.BlockStored(
            [wire.hash_to_int(CHAIN[1])], wire.hash_to_int(CHAIN[0]), [4, 5, 6, 7], 4, None
        ),
        wire.WireBlockStored(
            block_hashes=[CHAIN[1]],
            parent_block_hash=None,
            token_ids=[0, 1, 2, 3],
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[("salt",)],
            group_idx=0,
        ),
        pk.BlockRemoved([wire.hash_to_int(CHAIN[0])]),
        pk.AllBlocksCleared(),
    ]


def test_hash_to_int_is_last_eight_bytes_big_endian() -> None:
    assert wire.hash_to_int(CHAIN[1]) == 10525283265863458072
    assert wire.hash_to_int(CHAIN[0]) == 2571993321097120154
    assert wire.hash_to_int(bytes(range(1, 33))) == int.from_bytes(bytes(range(25, 33)), "big")


@pytest.mark.parametrize("i", range(4))
def test_each_event_matches_vllm_bytes(i: int) -> None:
    enc = wire.KVEventEncoder(hash_format="bytes" if i == 1 else "int")
    event = wire.to_wire(_vector_events()[i], enc.hash_format)
    assert enc.encode(event).hex() == VEC["event_vectors"][i]["msgpack_hex"]


def test_batch_matches_vllm_bytes() -> None:
    # The vector mixes an int-hash and a bytes-hash event: build each in its form.
    events = [wire.to_wire(e, "bytes" if i == 1 else "int") for i, e in enumerate(_vector_events())]
    batch = wire.KVEventBatch(ts=1700000000.5, events=events)
    assert wire.KVEventEncoder().encode(batch).hex() == VEC["event_batch"]["msgpack_hex"]


def test_event_dataclasses_encode_like_vllm() -> None:
    stored = pk.BlockStored(
        block_hashes=[10525283265863458072],
        parent_block_hash=2571993321097120154,
        token_ids=[4, 5, 6, 7],
        block_size=4,
        lora_id=None,
    )
    removed = pk.BlockRemoved(block_hashes=[2571993321097120154])
    enc = wire.KVEventEncoder()
    assert enc.encode(wire.to_wire(stored)).hex() == VEC["event_vectors"][0]["msgpack_hex"]
    assert enc.encode(wire.to_wire(removed)).hex() == VEC["event_vectors"][2]["msgpack_hex"]
    assert (
        enc.encode(wire.to_wire(pk.AllBlocksCleared())).hex()
        == VEC["event_vectors"][3]["msgpack_hex"]
    )


def test_struct_fields_are_vllms() -> None:
    fields = VEC["struct_fields"]
    for name, struct in (
        ("BlockStored", wire.WireBlockStored),
        ("BlockRemoved", wire.WireBlockRemoved),
        ("AllBlocksCleared", wire.WireAllBlocksCleared),
        ("KVEventBatch", wire.KVEventBatch),
    ):
        assert list(struct.__struct_fields__) == fields[name]
        if struct is not wire.KVEventBatch:
            assert struct.__struct_config__.tag == name  # vLLM's class name on the wire


def test_vllm_shaped_structs_decode_the_vectors() -> None:
    batch = msgspec.msgpack.decode(bytes.fromhex(VEC["event_batch"]["msgpack_hex"]), type=_KVBatch)
    assert batch.ts == 1700000000.5 and batch.data_parallel_rank is None
    s0, s1, r, c = batch.events
    assert isinstance(s0, _Stored) and s0.block_hashes == [10525283265863458072]
    assert s0.parent_block_hash == 2571993321097120154 and s0.group_idx is None
    assert isinstance(s1, _Stored) and s1.block_hashes == [CHAIN[1]]
    assert s1.extra_keys == [("salt",)] and s1.group_idx == 0
    assert isinstance(r, _Removed) and r.block_hashes == [2571993321097120154]
    assert isinstance(c, _Cleared)
    # pagedkv's own decoder agrees.
    ours = wire.decode_batch(bytes.fromhex(VEC["event_batch"]["msgpack_hex"]))
    assert [type(e) for e in ours.events] == [
        wire.WireBlockStored,
        wire.WireBlockStored,
        wire.WireBlockRemoved,
        wire.WireAllBlocksCleared,
    ]
    assert ours.events[1].block_hashes == [CHAIN[1]]


def test_manager_events_round_trip_through_vllm_structs() -> None:
    mgr = make_manager(block_size=4, num_blocks=8, enable_kv_cache_events=True)
    mgr.add_request("a", list(range(13)), cache_salt="salt")
    hit = mgr.get_computed_blocks("a")
    assert mgr.allocate_slots("a", 13, num_computed_tokens=0, new_computed_blocks=hit) is not None
    hashes = [wire.hash_to_int(h) for h in mgr.block_hashes("a")]
    mgr.free("a")
    mgr.add_request("b", list(range(100, 125)))
    hit = mgr.get_computed_blocks("b")
    assert mgr.allocate_slots("b", 25, num_computed_tokens=0, new_computed_blocks=hit) is not None
    events = mgr.take_events()
    enc = wire.KVEventEncoder(data_parallel_rank=3)
    payload = enc.encode_events(events, ts=12.5)
    batch = msgspec.msgpack.decode(payload, type=_KVBatch)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 3
    first = batch.events[0]
    assert isinstance(first, _Stored)
    assert first.block_hashes == hashes and first.parent_block_hash is None
    assert first.token_ids == list(range(12)) and first.block_size == 4
    assert first.extra_keys == [("salt",), None, None] and first.group_idx == 0
    assert first.kv_cache_spec_kind == "full_attention" and first.medium == "GPU"
    # Allocating over the three cached blocks evicts them, tail first.
    removed = [e.block_hashes[0] for e in batch.events if isinstance(e, _Removed)]
    assert removed == hashes[::-1]
    # Events that crossed a process boundary (pickled) encode to the same bytes.
    copies = pickle.loads(pickle.dumps(events))
    assert copies == events
    assert wire.KVEventEncoder(data_parallel_rank=3).encode_events(copies, ts=12.5) == payload


def test_bytes_format_rejects_integer_hashes() -> None:
    enc = wire.KVEventEncoder(hash_format="bytes")
    with pytest.raises(ValueError, match="raw digests"):
        enc.encode_events([pk.BlockRemoved([5], group_idx=0)])
    with pytest.raises(ValueError):
        wire.KVEventEncoder(hash_format="hex")  # type: ignore[arg-type]
