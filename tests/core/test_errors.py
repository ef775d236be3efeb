"""Misuse raises a specific pagedkv exception and leaves the manager exactly as it was.

Where vLLM has a rule (``allocate_slots`` with nothing to do is a ValueError,
``evict_blocks`` asserts ids are in the pool, a prompt never exceeds
``max_model_len``), the exception mirrors it; the rest is pagedkv's contract
(DESIGN.md section 5). Every test compares a full snapshot of the observable
state before and after, and runs ``check_invariants``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pagedkv as pk
import pytest
from pagedkv.errors import (
    CannotFitError,
    DuplicateRequestError,
    InvalidArgumentError,
    PagedKVError,
    StaleComputedBlocksError,
    UnknownRequestError,
)

from tests._util import admit, as_lists, make_manager, snapshot

BS = 16
COMMON = [i for i in range(3) for _ in range(BS)]
KNOWN = ("run", "wait")


def busy_manager() -> pk.KVCacheManager:
    """A manager with a running request, a waiting one and evictable cached blocks."""
    mgr = make_manager(BS, 11, log_stats=True, enable_kv_cache_events=True)
    mgr.add_request("run", COMMON + [3] * 7)
    admit(mgr, "run")  # blocks 1-4
    mgr.add_request("old", [9] * 32)
    admit(mgr, "old")  # blocks 5-6, cached
    mgr.remove_request("old")
    mgr.add_request("wait", COMMON + [4] * 5)
    mgr.take_events()
    mgr.make_prefix_cache_stats()
    return mgr


def assert_raises_unchanged(
    mgr: pk.KVCacheManager,
    exc: type[BaseException],
    call: Callable[[pk.KVCacheManager], Any],
    request_ids: tuple[str, ...] = KNOWN,
) -> None:
    before = snapshot(mgr, request_ids)
    with pytest.raises(exc):
        call(mgr)
    assert snapshot(mgr, request_ids) == before
    mgr.check_invariants()
    # Nothing was recorded either.
    assert mgr.take_events() == []
    assert mgr.make_prefix_cache_stats() in (None, pk.PrefixCacheStats())


def test_every_error_is_a_pagedkv_error_and_a_builtin_error() -> None:
    assert issubclass(UnknownRequestError, KeyError)
    for cls in (
        DuplicateRequestError,
        InvalidArgumentError,
        StaleComputedBlocksError,
        CannotFitError,
        pk.InvalidConfigError,
    ):
        assert issubclass(cls, ValueError)
    for cls in (
        UnknownRequestError,
        DuplicateRequestError,
        InvalidArgumentError,
        StaleComputedBlocksError,
        CannotFitError,
        pk.InvalidConfigError,
    ):
        assert issubclass(cls, PagedKVError)


# --------------------------------------------------------------------------- request ids


UNKNOWN_CALLS = {
    "get_computed_blocks": lambda m: m.get_computed_blocks("nope"),
    "allocate_slots": lambda m: m.allocate_slots("nope", 1, num_computed_tokens=0),
    "append_token_ids": lambda m: m.append_token_ids("nope", [1]),
    "free": lambda m: m.free("nope"),
    "remove_request": lambda m: m.remove_request("nope"),
    "cache_blocks": lambda m: m.cache_blocks("nope", 16),
    "get_block_ids": lambda m: m.get_block_ids("nope"),
    "block_hashes": lambda m: m.block_hashes("nope"),
    "num_tokens": lambda m: m.num_tokens("nope"),
    "num_preemptions": lambda m: m.num_preemptions("nope"),
    "get_num_common_prefix_blocks": lambda m: m.get_num_common_prefix_blocks("nope"),
    "batch_with_one_unknown": lambda m: m.allocate_slots_batch(["run", "nope"], 1, [55, 0]),
}


@pytest.mark.parametrize("call", UNKNOWN_CALLS.values(), ids=UNKNOWN_CALLS.keys())
def test_unknown_request_id_raises_unknown_request_error(call: Callable[..., Any]) -> None:
    assert_raises_unchanged(busy_manager(), UnknownRequestError, call)


def test_removed_request_id_is_unknown() -> None:
    mgr = busy_manager()
    assert "old" not in mgr
    assert_raises_unchanged(mgr, UnknownRequestError, lambda m: m.get_computed_blocks("old"))
    assert_raises_unchanged(mgr, UnknownRequestError, lambda m: m.remove_request("old"))


@pytest.mark.parametrize("request_id", KNOWN)
def test_duplicate_request_id_raises_and_keeps_the_original(request_id: str) -> None:
    assert_raises_unchanged(
        busy_manager(), DuplicateRequestError, lambda m: m.add_request(request_id, [1, 2, 3])
    )


# --------------------------------------------------------------------------- counts


NEGATIVE_CALLS = {
    "num_new_tokens": lambda m: m.allocate_slots("wait", -1, num_computed_tokens=0),
    "num_computed_tokens": lambda m: m.allocate_slots("run", 1, num_computed_tokens=-1),
    "num_lookahead_tokens": lambda m: m.allocate_slots(
        "run", 1, num_computed_tokens=55, num_lookahead_tokens=-1
    ),
    "num_new_computed_tokens": lambda m: m.allocate_slots(
        "wait", 5, num_computed_tokens=0, num_new_computed_tokens=-16
    ),
    "num_external_computed_tokens": lambda m: m.allocate_slots(
        "wait", 5, num_computed_tokens=0, num_external_computed_tokens=-1
    ),
    "cache_blocks": lambda m: m.cache_blocks("run", -1),
    "batch_num_new_tokens": lambda m: m.allocate_slots_batch(["run"], -1, [55]),
    "batch_num_computed_tokens": lambda m: m.allocate_slots_batch(["run"], 1, [-1]),
    "batch_lookahead": lambda m: m.allocate_slots_batch(["run"], 1, [55], num_lookahead_tokens=-1),
}


@pytest.mark.parametrize("call", NEGATIVE_CALLS.values(), ids=NEGATIVE_CALLS.keys())
def test_negative_counts_raise_invalid_argument(call: Callable[..., Any]) -> None:
    assert_raises_unchanged(busy_manager(), InvalidArgumentError, call)


def test_zero_new_tokens_with_nothing_to_adopt_raises_invalid_argument() -> None:
    # vLLM 0.33: ValueError("num_new_tokens must be greater than 0 when there are
    # no computed tokens to adopt").
    mgr = busy_manager()
    assert_raises_unchanged(
        mgr, InvalidArgumentError, lambda m: m.allocate_slots("wait", 0, num_computed_tokens=0)
    )
    assert_raises_unchanged(
        mgr, InvalidArgumentError, lambda m: m.allocate_slots("run", 0, num_computed_tokens=55)
    )


def test_computed_tokens_past_the_request_raise_invalid_argument() -> None:
    assert_raises_unchanged(
        busy_manager(),
        InvalidArgumentError,
        lambda m: m.allocate_slots("run", 1, num_computed_tokens=1000),
    )


# --------------------------------------------------------------------------- token ids


OUT_OF_RANGE_TOKENS = {
    "minus_one": [1, -1],
    "two_pow_32": [2**32],
    "two_pow_64": [1, 2**64],
    "numpy_minus_one": np.array([5, -1], dtype=np.int64),
    "numpy_int32_minus_one": np.array([-1], dtype=np.int32),
}
NON_INT_TOKENS = {
    "str_item": [1, "a"],
    "float_item": [1.5],
    "none_item": [None],
    "bool_item": [True],
    "str": "abc",
    "bytes": b"abc",
    "numpy_float": np.array([1.0, 2.0]),
}


@pytest.mark.parametrize("tokens", OUT_OF_RANGE_TOKENS.values(), ids=OUT_OF_RANGE_TOKENS.keys())
def test_token_ids_outside_u32_raise_invalid_argument(tokens: Any) -> None:
    mgr = busy_manager()
    assert_raises_unchanged(mgr, InvalidArgumentError, lambda m: m.add_request("new", tokens))
    assert "new" not in mgr
    assert_raises_unchanged(mgr, InvalidArgumentError, lambda m: m.append_token_ids("run", tokens))


@pytest.mark.parametrize("tokens", NON_INT_TOKENS.values(), ids=NON_INT_TOKENS.keys())
def test_non_int_token_ids_raise_type_error(tokens: Any) -> None:
    mgr = busy_manager()
    assert_raises_unchanged(mgr, TypeError, lambda m: m.add_request("new", tokens))
    assert "new" not in mgr
    assert_raises_unchanged(mgr, TypeError, lambda m: m.append_token_ids("run", tokens))


def test_token_ids_at_the_u32_limits_are_accepted() -> None:
    mgr = busy_manager()
    mgr.add_request("edge", [0, 2**32 - 1] * 8)
    mgr.add_request("np", np.array([0, 2**32 - 1] * 8, dtype=np.uint32))
    assert mgr.block_hashes("edge") == mgr.block_hashes("np")
    mgr.check_invariants()


def test_prompt_longer_than_max_model_len_is_rejected() -> None:
    mgr = make_manager(BS, 11, max_model_len=32)
    mgr.add_request("ok", list(range(32)))
    assert_raises_unchanged(
        mgr, InvalidArgumentError, lambda m: m.add_request("long", list(range(33))), ("ok",)
    )
    assert "long" not in mgr


# --------------------------------------------------------------------------- stale hits


def cached_prefix_manager() -> pk.KVCacheManager:
    """Blocks 1-3 cached and free (ref 0); request "r1" shares that prefix."""
    mgr = make_manager(BS, 11, log_stats=True, enable_kv_cache_events=True)
    mgr.add_request("r0", COMMON + [3] * 7)
    admit(mgr, "r0")
    mgr.remove_request("r0")
    mgr.add_request("r1", COMMON + [4] * 5)
    mgr.take_events()
    mgr.make_prefix_cache_stats()
    return mgr


def test_hit_invalidated_by_evict_blocks_is_stale() -> None:
    mgr = cached_prefix_manager()
    hit = mgr.get_computed_blocks("r1")
    assert as_lists(hit.block_ids) == ([1, 2, 3],)
    mgr.evict_blocks([2])
    mgr.take_events()
    mgr.make_prefix_cache_stats()
    assert_raises_unchanged(
        mgr,
        StaleComputedBlocksError,
        lambda m: m.allocate_slots("r1", 5, num_computed_tokens=0, new_computed_blocks=hit),
        ("r1",),
    )
    # Looking up again sees the chain broken at block 2.
    hit, new = admit(mgr, "r1")
    assert as_lists(hit.block_ids) == ([1],)
    assert new is not None
    mgr.check_invariants()


def test_hit_whose_blocks_were_reallocated_is_stale() -> None:
    mgr = cached_prefix_manager()
    hit = mgr.get_computed_blocks("r1")
    assert as_lists(hit.block_ids) == ([1, 2, 3],)
    # Allocation pressure: a 160-token miss takes (and evicts) every block.
    mgr.add_request("big", [99] * 160)
    admit(mgr, "big")
    mgr.remove_request("big")
    mgr.take_events()
    mgr.make_prefix_cache_stats()
    assert_raises_unchanged(
        mgr,
        StaleComputedBlocksError,
        lambda m: m.allocate_slots("r1", 5, num_computed_tokens=0, new_computed_blocks=hit),
        ("r1",),
    )
    hit, new = admit(mgr, "r1")
    assert hit.num_computed_tokens == 0
    assert new is not None
    mgr.check_invariants()


def test_hit_used_for_another_request_is_stale() -> None:
    mgr = cached_prefix_manager()
    mgr.add_request("twin", COMMON + [4] * 5)  # same prompt as r1
    hit = mgr.get_computed_blocks("r1")
    assert hit.num_computed_tokens == 48
    assert_raises_unchanged(
        mgr,
        StaleComputedBlocksError,
        lambda m: m.allocate_slots("twin", 5, num_computed_tokens=0, new_computed_blocks=hit),
        ("r1", "twin"),
    )


def test_hit_from_another_manager_is_stale() -> None:
    mgr = cached_prefix_manager()
    other = cached_prefix_manager()
    hit = other.get_computed_blocks("r1")
    assert hit.num_computed_tokens == 48
    assert_raises_unchanged(
        mgr,
        StaleComputedBlocksError,
        lambda m: m.allocate_slots("r1", 5, num_computed_tokens=0, new_computed_blocks=hit),
        ("r1",),
    )


# --------------------------------------------------------------------------- block ids


@pytest.mark.parametrize(
    "block_ids",
    [[11], [-1], [1, 11], [2**40], [5, -3]],
    ids=["num_blocks", "negative", "valid_then_bad", "huge", "valid_then_negative"],
)
def test_out_of_range_block_ids_in_evict_blocks_raise_and_evict_nothing(
    block_ids: list[int],
) -> None:
    # vLLM asserts block_id < len(blocks) (a KV-connector bug otherwise).
    mgr = busy_manager()
    assert mgr.cached_block_hash(1) is not None and mgr.cached_block_hash(5) is not None
    assert_raises_unchanged(mgr, InvalidArgumentError, lambda m: m.evict_blocks(block_ids))


def test_out_of_range_block_id_in_introspection_raises_invalid_argument() -> None:
    mgr = busy_manager()
    for call in (lambda m: m.block_ref_count(11), lambda m: m.cached_block_hash(-1)):
        assert_raises_unchanged(mgr, InvalidArgumentError, call)


# --------------------------------------------------------------------------- capacity


def test_request_larger_than_the_pool_raises_cannot_fit() -> None:
    mgr = busy_manager()
    mgr.add_request("huge", list(range(161)))  # 11 blocks; the pool has 10 usable
    assert_raises_unchanged(mgr, CannotFitError, lambda m: admit(m, "huge"), (*KNOWN, "huge"))
    mgr.remove_request("huge")
    mgr.check_invariants()


def test_request_that_fits_an_empty_pool_but_not_now_returns_none() -> None:
    mgr = busy_manager()  # 4 blocks held, 6 free
    mgr.add_request("big", list(range(1000, 1000 + 160)))  # exactly the 10 usable blocks
    before = snapshot(mgr, (*KNOWN, "big"))
    _, new = admit(mgr, "big")
    assert new is None
    assert snapshot(mgr, (*KNOWN, "big")) == before
    mgr.remove_request("run")
    _, new = admit(mgr, "big")
    assert new is not None and len(new[0]) == 10
    mgr.check_invariants()
