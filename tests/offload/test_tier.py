"""The offload tier's Python surface: conversion, answers' shapes, bad input.

The tier's semantics are checked in the core (``offload/tests.rs``) and against
vLLM's own recorded answers (``test_vllm_traces.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
from pagedkv.errors import InvalidArgumentError, InvariantViolationError, PagedKVError
from pagedkv.offload import (
    Lookup,
    OffloadTier,
    offload_key,
    offload_key_group,
    offload_key_hash,
)


def k(i: int, group: int = 0) -> bytes:
    return offload_key(str(i).encode(), group)


def ks(ids: list[int]) -> list[bytes]:
    return [k(i) for i in ids]


def store(tier: OffloadTier, keys: Any, req: int = 0, positions: Any = None) -> Any:
    """``prepare_store`` with its slot array as a list."""
    out = tier.prepare_store(keys, req, positions)
    return None if out is None else (out[0], out[1].tolist(), out[2])


def test_key_layout_is_vllms() -> None:
    key = offload_key(b"\x01" * 32, 258)
    assert key == b"\x01" * 32 + b"\x00\x00\x01\x02"
    assert offload_key_hash(key) == b"\x01" * 32
    assert offload_key_group(key) == 258


def test_a_store_load_cycle_through_python() -> None:
    # vLLM's test_cpu_manager, first steps: fresh slots, eviction of the LRU chunk
    tier = OffloadTier(4, "lru", enable_events=True)
    assert store(tier, ks([1, 2])) == (ks([1, 2]), [0, 1], [])
    assert tier.lookup(k(1)) == Lookup.HIT_PENDING
    tier.complete_store(ks([1, 2]))
    assert tier.take_events() == [(ks([1, 2]), "CPU", False, False)]
    assert tier.lookup_prefix(ks([1, 2, 3])) == 2
    assert store(tier, ks([2, 3, 4, 5])) == (ks([3, 4, 5]), [2, 3, 0], ks([1]))
    assert tier.take_events() == [(ks([1]), "CPU", True, False)]
    tier.complete_store(ks([3, 4, 5]), success=False)
    assert tier.take_events() == [(ks([3, 4, 5]), "CPU", True, True)]
    assert tier.prepare_load(ks([2]), 9, positions=[16]).tolist() == [1]
    assert tier.chunk(k(2)) == (1, 1)
    assert tier.num_evictable == 0
    tier.complete_load(ks([2]))
    tier.on_request_finished(9, ks([2]), [16])
    usage, write, read, sizes, skipped = tier.stats()
    assert (usage, write, read, sizes, skipped) == (0.0, 0.0, 0.0, [2, 3], None)
    assert tier.counters()["stores_failed"] == 3
    assert tier.lru_eviction_order() == ks([2]) and tier.arc_lists() is None
    tier.check_invariants()


def test_arc_lists_and_tracker_read_outs() -> None:
    tier = OffloadTier(2, "arc", store_threshold=2, max_tracker_size=8)
    assert store(tier, ks([1])) == ([], [], [])
    assert tier.tracked_offers() == [(k(1), 1)]
    assert store(tier, ks([1])) == (ks([1]), [0], [])
    tier.complete_store(ks([1]))
    tier.touch(ks([1]))
    arc = tier.arc_lists()
    assert arc == (0.0, [], [(k(1), 0, 0)], [], [])
    assert tier.stats()[4] == 1


def test_any_iterable_of_keys_is_accepted() -> None:
    tier = OffloadTier(4)
    assert store(tier, iter(ks([1, 2]))) == (ks([1, 2]), [0, 1], [])
    tier.complete_store(tuple(ks([1, 2])))
    assert tier.lookup_prefix(k for k in ks([1, 2])) == 2


# (the method, a bad call of it, the exception): every method taking an argument
BAD: list[tuple[str, Any, type[BaseException]]] = [
    ("lookup", lambda t: t.lookup("abc"), TypeError),
    ("lookup", lambda t: t.lookup(b"x" * 56), InvalidArgumentError),
    ("lookup_prefix", lambda t: t.lookup_prefix([b"1", None]), TypeError),
    ("touch", lambda t: t.touch(b"abc"), TypeError),
    ("prepare_store", lambda t: t.prepare_store([1, 2], 0), TypeError),
    ("prepare_store", lambda t: t.prepare_store(ks([3, 3]), 0), InvalidArgumentError),
    ("prepare_store", lambda t: t.prepare_store(ks([3]), 0, []), InvalidArgumentError),
    ("prepare_store", lambda t: t.prepare_store(ks([3]), 0, [1, 2]), InvalidArgumentError),
    ("prepare_store", lambda t: t.prepare_store(ks([3]), -1), OverflowError),
    ("prepare_store", lambda t: t.prepare_store(ks([3]), 0, {k(3): -2}), InvalidArgumentError),
    ("prepare_load", lambda t: t.prepare_load(ks([1]), 0, [-5]), InvalidArgumentError),
    ("prepare_load", lambda t: t.prepare_load(ks([1]), 0, ["a"]), TypeError),
    ("prepare_load", lambda t: t.prepare_load(ks([1, 9]), 0), InvalidArgumentError),
    ("prepare_load", lambda t: t.prepare_load(ks([2]), 0), InvalidArgumentError),
    ("prepare_read", lambda t: t.prepare_read(ks([1, 9])), InvalidArgumentError),
    ("complete_load", lambda t: t.complete_load(ks([1])), InvalidArgumentError),
    ("complete_store", lambda t: t.complete_store(["1"]), TypeError),
    ("on_request_finished", lambda t: t.on_request_finished(0, ks([1]), []), InvalidArgumentError),
    ("on_request_finished", lambda t: t.on_request_finished(0, None, {1: 2}), TypeError),
    ("on_new_request", lambda t: t.on_new_request(-1), OverflowError),
    ("forget_request", lambda t: t.forget_request(2**64), OverflowError),
    ("chunk", lambda t: t.chunk(3), TypeError),
    ("set_arc_target_t1_size", lambda t: t.set_arc_target_t1_size(1.0), InvalidArgumentError),
    ("take_kv_events", lambda t: t.take_kv_events("yes"), TypeError),
    ("evict", lambda t: t.evict(-1, []), OverflowError),
    ("evict", lambda t: t.evict(1, [3]), TypeError),
]
#: methods with no argument that can be wrong
NO_BAD_INPUT = {
    "reset_cache",
    "take_events",
    "stats",
    "counters",
    "resident",
    "arc_lists",
    "lru_eviction_order",
    "lru_heap",
    "tracked_offers",
    "check_invariants",
}


def test_every_method_is_in_the_bad_input_matrix() -> None:
    methods = {
        n for n in dir(OffloadTier) if not n.startswith("_") and callable(getattr(OffloadTier, n))
    }
    assert methods == {b[0] for b in BAD} | NO_BAD_INPUT


@pytest.mark.parametrize(("method", "call", "expected"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_and_changes_nothing(
    method: str, call: Any, expected: type[BaseException]
) -> None:
    tier = OffloadTier(4, "lru", enable_events=True)
    tier.prepare_store(ks([1, 2]), 0)
    tier.complete_store(ks([1]))
    tier.take_events()
    before = (sorted(tier.resident()), tier.num_evictable, tier.num_write_pending)
    before_order = tier.lru_eviction_order()
    before_requests = tier.num_requests
    with pytest.raises(expected):
        call(tier)
    assert tier.num_requests == before_requests
    assert (sorted(tier.resident()), tier.num_evictable, tier.num_write_pending) == before
    assert tier.lru_eviction_order() == before_order
    assert tier.take_events() == []
    tier.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_chunks": -1}, "non-negative"),
        ({"num_chunks": 2**31}, "out of range"),
        ({"num_chunks": 4, "policy": "fifo"}, "unknown cache policy"),
        ({"num_chunks": 4, "store_threshold": 2, "max_tracker_size": 0}, "max_tracker_size"),
    ],
)
def test_bad_configuration_is_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        OffloadTier(**kwargs)


def test_positions_from_a_dict_or_a_list_give_the_same_order() -> None:
    # LRU ranks a request's chunks tail first: positions decide which goes first
    for positions in ({k(1): 16, k(2): 32, k(3): 48}, [16, 32, 48]):
        tier = OffloadTier(3)
        tier.prepare_store(ks([1, 2, 3]), 7, positions)
        tier.complete_store(ks([1, 2, 3]))
        assert tier.lru_eviction_order() == ks([3, 2, 1])
    tier = OffloadTier(3)
    tier.prepare_store(ks([1, 2, 3]), 7)
    tier.complete_store(ks([1, 2, 3]))
    tier.touch(ks([1, 2, 3]))
    assert tier.lru_eviction_order() == ks([3, 2, 1])
    # at the end, the recorded positions put 3 at the head: it is evicted last
    tier.on_request_finished(7, None, {k(1): 48, k(2): 32, k(3): 16})
    assert tier.lru_eviction_order() == ks([1, 2, 3])
    with pytest.raises(TypeError, match="list or tuple"):
        tier.prepare_store(iter(ks([4])), 8, {k(4): 16})


def test_new_keys_after_the_request_ended_are_refused() -> None:
    tier = OffloadTier(4)
    tier.prepare_store(ks([1]), 5)
    tier.on_request_finished(5)
    with pytest.raises(InvalidArgumentError, match="after the request finished"):
        tier.prepare_store(ks([2]), 5)
    assert tier.lookup(k(2)) == Lookup.MISS
    tier.prepare_store(ks([2]), 6)  # another request may


def test_errors_are_pagedkv_errors() -> None:
    assert issubclass(InvalidArgumentError, PagedKVError)
    assert issubclass(InvariantViolationError, PagedKVError)


def test_an_empty_tier_refuses_every_store_and_counts_it() -> None:
    tier = OffloadTier(0)
    assert tier.prepare_store(ks([1]), 0) is None
    assert tier.counters()["stores_refused"] == 1
    assert tier.stats()[:3] == (0.0, 0.0, 0.0)
    tier.check_invariants()


def test_the_readme_example_runs_as_written() -> None:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = text.split("## Host offload tier", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    scope: dict[str, Any] = {"chunk_hashes": [bytes([i]) * 32 for i in range(3)], "group_idx": 1}
    exec(compile(match.group(1), "README.md", "exec"), scope)
    assert scope["n"] == 3 and scope["slots"].tolist() == [0, 1, 2]
    assert scope["tier"].lookup(scope["keys"][0]) == Lookup.HIT


def test_kv_events_carry_the_tier_medium_as_vllms_connector_publishes() -> None:
    from pagedkv.events import BlockRemoved, BlockStored

    tier = OffloadTier(2, enable_events=True)
    g1 = offload_key(b"\x09" * 8, 1)
    tier.prepare_store([k(1), g1], 0)
    tier.complete_store([k(1), g1])
    tier.prepare_store(ks([2, 3]), 0)  # evicts both
    tier.complete_store(ks([2, 3]), success=False)  # a failed store is not published

    def h(key: bytes) -> int:
        return int.from_bytes(key[:-4][-8:], "big")

    def stored(key: bytes, group: int) -> BlockStored:
        return BlockStored([h(key)], None, [], 0, None, medium="CPU", group_idx=group)

    assert tier.take_kv_events() == [
        stored(k(1), 0),
        stored(g1, 1),
        BlockRemoved([h(k(1))], medium="CPU", group_idx=0),
        BlockRemoved([h(g1)], medium="CPU", group_idx=1),
    ]
    tier.prepare_store(ks([4]), 0)
    tier.complete_store(ks([4]))
    (event,) = tier.take_kv_events(raw_hashes=True)
    assert event.block_hashes == [k(4)[:-4]] and event.medium == "CPU"
