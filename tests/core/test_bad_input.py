"""The bad-input contract: a refused call raises a clear exception and leaves the manager as it was.

Every public method gets wrong types, NaN / infinite / negative / huge numbers,
token ids out of range, unknown / removed / odd request ids and stale lookups.
Each call must raise a clear exception -- a ``pagedkv.PagedKVError`` subclass,
``TypeError`` for a wrong type, or ``OverflowError`` for an int beyond 64 bits --
never a Rust panic (``pyo3_runtime.PanicException``, a ``BaseException``), and
must leave the manager exactly as it was: the full observable snapshot, no
events, no stats, ``check_invariants``.

Where vLLM has a rule (``allocate_slots`` with nothing to do is a ValueError,
``evict_blocks`` asserts ids are in the pool, a prompt never exceeds
``max_model_len``), the exception mirrors it; the rest is pagedkv's contract
(DESIGN.md section 5). A request that can never fit raises ``CannotFitError``;
one that only does not fit now gets ``None``, with nothing changed.

Threads: several threads drive one manager with their own requests (no crash,
invariants hold, no exception at all); calls made while another thread's long
``add_request`` runs wait for it, and a call made re-entrantly from inside an
argument's iteration runs first, without corrupting anything.

Deviations from the contract found here, now fixed, are the tests at the end of
the file.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pagedkv as pk
import pytest
from pagedkv.errors import (
    CannotFitError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidConfigError,
    PagedKVError,
    StaleComputedBlocksError,
    UnknownRequestError,
)

from tests._util import admit, as_lists, full, make_manager, manager, snapshot, swa

BS = 16
NUM_BLOCKS = 11
COMMON = [i for i in range(3) for _ in range(BS)]
KNOWN = ("run", "wait")
NAN, INF = math.nan, math.inf

# What a refused call may raise: the documented hierarchy, or the built-in errors
# argument conversion raises before the manager is reached.
CLEAR = (PagedKVError, TypeError, OverflowError, UnicodeEncodeError)


def busy() -> pk.KVCacheManager:
    """A running request ("run": 55 tokens, blocks 1-4), a waiting one ("wait"),
    a removed one ("old", whose blocks 5-6 stay cached and evictable)."""
    mgr = make_manager(
        BS, NUM_BLOCKS, max_model_len=1024, log_stats=True, enable_kv_cache_events=True
    )
    mgr.add_request("run", [*COMMON, *[3] * 7])
    admit(mgr, "run")
    mgr.add_request("old", [9] * 32)
    admit(mgr, "old")
    mgr.remove_request("old")
    mgr.add_request("wait", [*COMMON, *[4] * 5])
    mgr.take_events()
    mgr.make_prefix_cache_stats()
    return mgr


def check_refused(
    mgr: pk.KVCacheManager,
    call: Callable[[pk.KVCacheManager], Any],
    expected: type[BaseException] | tuple[type[BaseException], ...],
    request_ids: tuple[str, ...] = KNOWN,
) -> BaseException:
    """``call`` raises ``expected`` (a clear, non-panic exception with a message) and
    changes nothing observable."""
    before = snapshot(mgr, request_ids)
    try:
        call(mgr)
    except BaseException as e:  # a PanicException is a BaseException
        assert type(e).__name__ != "PanicException", f"a Rust panic reached Python: {e}"
        assert isinstance(e, Exception), f"{type(e).__name__} is not an Exception"
        assert isinstance(e, expected), f"expected {expected}, got {type(e).__name__}: {e}"
        assert str(e), "the exception has no message"
        err = e
    else:
        pytest.fail(f"accepted; expected {expected}")
    assert snapshot(mgr, request_ids) == before
    mgr.check_invariants()
    assert mgr.take_events() == []
    assert mgr.make_prefix_cache_stats() in (None, pk.PrefixCacheStats())
    return err


def raising_tokens() -> Iterator[int]:
    yield 1
    yield 2
    raise ZeroDivisionError("the caller's own iterator failed")


# --------------------------------------------------------------------------- the hierarchy


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

# Every method that takes a request id, called otherwise validly on "run".
ID_METHODS: dict[str, Callable[[pk.KVCacheManager, Any], Any]] = {
    "get_computed_blocks": lambda m, r: m.get_computed_blocks(r),
    "allocate_slots": lambda m, r: m.allocate_slots(r, 1, num_computed_tokens=54),
    "allocate_slots_batch": lambda m, r: m.allocate_slots_batch([r], 1, [54]),
    "append_token_ids": lambda m, r: m.append_token_ids(r, [1]),
    "append_token_ids_batch": lambda m, r: m.append_token_ids_batch([r], [1]),
    "free": lambda m, r: m.free(r),
    "finish_allocation": lambda m, r: m.finish_allocation(r),
    "remove_request": lambda m, r: m.remove_request(r),
    "cache_blocks": lambda m, r: m.cache_blocks(r, 16),
    "remove_skipped_blocks": lambda m, r: m.remove_skipped_blocks(r, 16),
    "get_block_ids": lambda m, r: m.get_block_ids(r),
    "block_hashes": lambda m, r: m.block_hashes(r),
    "num_tokens": lambda m, r: m.num_tokens(r),
    "num_prompt_tokens": lambda m, r: m.num_prompt_tokens(r),
    "num_preemptions": lambda m, r: m.num_preemptions(r),
    "get_num_common_prefix_blocks": lambda m, r: m.get_num_common_prefix_blocks(r),
    "add_request": lambda m, r: m.add_request(r, [1, 2, 3]),
    "contains": lambda m, r: r in m,
    "request_handle": lambda m, r: m.request_handle(r),
    "sync_request": lambda m, r: m.sync_request(r, [1], []),
    "pop_blocks_for_free": lambda m, r: m.pop_blocks_for_free(r),
    "computed_blocks_from_ids": lambda m, r: m.computed_blocks_from_ids(r, [[]], 0),
    "num_cached_blocks": lambda m, r: m.num_cached_blocks(r),
    "estimate_cached_tokens": lambda m, r: m.estimate_cached_tokens(r),
    "allocate_slots_synced": lambda m, r: m.allocate_slots_synced(
        r, [1], [], 0, 1, 54, 0, None, 0, 0, False, 0, False, 0, True, 0, None
    ),
    "partial_hit": lambda m, r: m.partial_hit(r, 0),
    "mamba_checkpoint": lambda m, r: m.mamba_checkpoint(r, 0),
    "finalize_partial_tail_offloads": lambda m, r: m.finalize_partial_tail_offloads(r, 0, 0),
    "record_blocks_for_zeroing": lambda m, r: m.record_blocks_for_zeroing(r, 0),
    "get_computed_blocks_for_connector": lambda m, r: m.get_computed_blocks_for_connector(r),
    "cache_detached_blocks": lambda m, r: m.cache_detached_blocks(r, 0, [], 0, 0),
    "cache_detached_partial_block": lambda m, r: m.cache_detached_partial_block(r, 0, 0, 16),
    "group_block_ids": lambda m, r: m.group_block_ids(r, 0),
    "pop_blocks_before": lambda m, r: m.pop_blocks_before(r, 0),
    "free_groups_before": lambda m, r: m.free_groups_before(r, 0),
    "hisparse_adopt_page": lambda m, r: m.hisparse_adopt_page(r, 0, 0, 1),
    "hisparse_drop_page": lambda m, r: m.hisparse_drop_page(r, 0, 0),
    "hisparse_resident_page": lambda m, r: m.hisparse_resident_page(r, 0, 0),
    "hisparse_residency_row": lambda m, r: m.hisparse_residency_row(r, 0),
    "hisparse_allocate_new_blocks": lambda m, r: m.hisparse_allocate_new_blocks(r, 0, 16),
    "hisparse_require_hot": lambda m, r: m.hisparse_require_hot(r, 0),
    "hisparse_hot_required": lambda m, r: m.hisparse_hot_required(r, 0),
    "hisparse_allocation_step": lambda m, r: m.hisparse_allocation_step(
        r, 1, 54, 0, 0, 0, False, False
    ),
}
# Batch calls also take the int handles add_request returns.
HANDLE_METHODS = ("allocate_slots_batch", "append_token_ids_batch")
BAD_IDS: dict[str, tuple[Any, type[BaseException]]] = {
    "none": (None, TypeError),
    "int": (7, TypeError),
    "bytes": (b"run", TypeError),
    "list": (["run"], TypeError),
    "unknown": ("nope", UnknownRequestError),
    "removed": ("old", UnknownRequestError),
    "empty_unknown": ("", UnknownRequestError),
    "lone_surrogate": ("\ud800", UnicodeEncodeError),
}


def id_cases() -> list[Any]:
    cases = []
    for method, call in ID_METHODS.items():
        for name, (value, exc) in BAD_IDS.items():
            if exc is UnknownRequestError and method in ("add_request", "contains"):
                continue  # a new id is valid there
            if name == "int" and method in HANDLE_METHODS:
                exc = UnknownRequestError  # an int is a handle there, and 7 is none
            cases.append(pytest.param(call, value, exc, id=f"{method}-{name}"))
    return cases


@pytest.mark.parametrize(("call", "value", "expected"), id_cases())
def test_bad_request_id(
    call: Callable[..., Any], value: Any, expected: type[BaseException]
) -> None:
    check_refused(busy(), lambda m: call(m, value), expected)


def removed_handle(m: pk.KVCacheManager) -> int:
    handle = m.request_handle("wait")
    m.remove_request("wait")
    m.add_request("wait", [*COMMON, *[4] * 5])  # the same id again: a new handle
    m.take_events()
    m.make_prefix_cache_stats()
    return handle


BAD_HANDLES: dict[str, tuple[Callable[[pk.KVCacheManager], Any], type[BaseException]]] = {
    "negative": (lambda m: -1, TypeError),
    "past_u64": (lambda m: 2**64, TypeError),
    "past_i64": (lambda m: 2**63, UnknownRequestError),
    "float": (lambda m: 1.5, TypeError),
    "removed_request": (removed_handle, UnknownRequestError),
    "other_manager": (lambda m: busy().request_handle("run") + 1000, UnknownRequestError),
}


@pytest.mark.parametrize("method", HANDLE_METHODS)
@pytest.mark.parametrize(("make", "expected"), BAD_HANDLES.values(), ids=BAD_HANDLES.keys())
def test_bad_request_handle(
    method: str, make: Callable[[pk.KVCacheManager], Any], expected: type[BaseException]
) -> None:
    mgr = busy()
    handle = make(mgr)
    check_refused(mgr, lambda m: ID_METHODS[method](m, handle), expected)


# Unknown ids in calls whose other arguments differ from ID_METHODS': a waiting
# request's counts, and a batch whose known entry's counts are themselves wrong
# (the unknown id is what is reported).
UNKNOWN_CALLS = {
    "allocate_slots": lambda m: m.allocate_slots("nope", 1, num_computed_tokens=0),
    "batch_with_one_unknown": lambda m: m.allocate_slots_batch(["run", "nope"], 1, [55, 0]),
}


@pytest.mark.parametrize("call", UNKNOWN_CALLS.values(), ids=UNKNOWN_CALLS.keys())
def test_unknown_request_id_raises_unknown_request_error(call: Callable[..., Any]) -> None:
    check_refused(busy(), call, UnknownRequestError)


def test_removed_request_id_is_unknown() -> None:
    mgr = busy()
    assert "old" not in mgr
    check_refused(mgr, lambda m: m.get_computed_blocks("old"), UnknownRequestError)
    check_refused(mgr, lambda m: m.remove_request("old"), UnknownRequestError)


@pytest.mark.parametrize("request_id", [*KNOWN])
@pytest.mark.parametrize("prompt", [[1, 2, 3], [5] * 20], ids=["less_than_a_block", "a_full_block"])
def test_duplicate_request_id_raises_and_keeps_the_original(
    request_id: str, prompt: list[int]
) -> None:
    check_refused(busy(), lambda m: m.add_request(request_id, prompt), DuplicateRequestError)


# --------------------------------------------------------------------------- counts

# (method, a call with one count replaced by ``v``); the rest of the call is valid.
COUNT_PARAMS: dict[str, Callable[[pk.KVCacheManager, Any], Any]] = {
    "allocate_slots.num_new_tokens": lambda m, v: m.allocate_slots(
        "run", v, num_computed_tokens=54
    ),
    "allocate_slots.num_computed_tokens": lambda m, v: m.allocate_slots(
        "run", 1, num_computed_tokens=v
    ),
    "allocate_slots.num_new_computed_tokens": lambda m, v: m.allocate_slots(
        "wait", 5, num_computed_tokens=0, num_new_computed_tokens=v
    ),
    "allocate_slots.num_lookahead_tokens": lambda m, v: m.allocate_slots(
        "run", 1, num_computed_tokens=54, num_lookahead_tokens=v
    ),
    "allocate_slots.num_external_computed_tokens": lambda m, v: m.allocate_slots(
        "wait", 5, num_computed_tokens=0, num_external_computed_tokens=v
    ),
    "allocate_slots.engine_managed_blocks": lambda m, v: m.allocate_slots(
        "run", 1, num_computed_tokens=54, engine_managed_blocks=(v, 0)
    ),
    "allocate_slots.engine_managed_full_blocks": lambda m, v: m.allocate_slots(
        "run", 1, num_computed_tokens=54, engine_managed_blocks=(0, v)
    ),
    "allocate_slots.split_at_group": lambda m, v: m.allocate_slots(
        "run", 1, num_computed_tokens=54, split_at_group=v
    ),
    "allocate_slots.num_encoder_tokens": lambda m, v: m.allocate_slots(
        "run", 1, num_computed_tokens=54, num_encoder_tokens=v
    ),
    "allocate_slots.reserved_blocks": lambda m, v: m.allocate_slots(
        "run", 1, num_computed_tokens=54, reserved_blocks=v
    ),
    "allocate_slots_batch.num_new_tokens_scalar": lambda m, v: m.allocate_slots_batch(
        ["run"], v, [54]
    ),
    "allocate_slots_batch.num_new_tokens_list": lambda m, v: m.allocate_slots_batch(
        ["run"], [v], [54]
    ),
    "allocate_slots_batch.num_computed_tokens": lambda m, v: m.allocate_slots_batch(
        ["run"], 1, [v]
    ),
    "allocate_slots_batch.num_lookahead_tokens": lambda m, v: m.allocate_slots_batch(
        ["run"], 1, [54], num_lookahead_tokens=v
    ),
    "hisparse_allocation_step.num_new_tokens": lambda m, v: m.hisparse_allocation_step(
        "run", v, 54, 0, 0, 0, False, False
    ),
    "hisparse_allocation_step.num_computed_tokens": lambda m, v: m.hisparse_allocation_step(
        "run", 1, v, 0, 0, 0, False, False
    ),
    "hisparse_allocation_step.num_new_computed_tokens": lambda m, v: m.hisparse_allocation_step(
        "wait", 5, 0, v, 0, 0, False, False
    ),
    "hisparse_allocation_step.num_lookahead_tokens": lambda m, v: m.hisparse_allocation_step(
        "run", 1, 54, 0, v, 0, False, False
    ),
    "hisparse_allocation_step.num_external_computed_tokens": lambda m, v: (
        m.hisparse_allocation_step("wait", 5, 0, 0, 0, v, False, False)
    ),
    "cache_blocks.num_computed_tokens": lambda m, v: m.cache_blocks("run", v),
    "remove_skipped_blocks.total_computed_tokens": lambda m, v: m.remove_skipped_blocks("run", v),
    "block_ref_count.block_id": lambda m, v: m.block_ref_count(v),
    "cached_block_hash.block_id": lambda m, v: m.cached_block_hash(v),
    "cached_block_extra_hashes.block_id": lambda m, v: m.cached_block_extra_hashes(v),
    "evict_blocks.block_id": lambda m, v: m.evict_blocks([v]),
    "evict_blocks.valid_then_bad": lambda m, v: m.evict_blocks([5, 1, v]),
    "get_computed_blocks.max_cache_hit_length": lambda m, v: m.get_computed_blocks("wait", v),
    "allocate_slots.num_in_flight_tokens": lambda m, v: m.allocate_slots(
        "run", 1, num_computed_tokens=54, num_in_flight_tokens=v
    ),
    "computed_blocks_from_ids.num_computed_tokens": lambda m, v: m.computed_blocks_from_ids(
        "wait", [[]], v
    ),
    "computed_blocks_from_ids.block_id": lambda m, v: m.computed_blocks_from_ids("wait", [[v]], 16),
    "num_blocks_to_allocate.num_tokens": lambda m, v: m.num_blocks_to_allocate(
        "run", v, total_computed_tokens=0, num_tokens_main_model=1
    ),
    "num_blocks_to_allocate.num_local_computed_tokens": lambda m, v: m.num_blocks_to_allocate(
        None, 16, total_computed_tokens=16, num_tokens_main_model=16, num_local_computed_tokens=v
    ),
    "num_blocks_to_allocate.total_computed_tokens": lambda m, v: m.num_blocks_to_allocate(
        None, 16, total_computed_tokens=v, num_tokens_main_model=16
    ),
    "record_prefix_cache_stats.num_tokens": lambda m, v: m.record_prefix_cache_stats(v, 0, False),
    "record_prefix_cache_stats.num_hits": lambda m, v: m.record_prefix_cache_stats(100, v, False),
    "free_blocks.block_id": lambda m, v: m.free_blocks([v]),
    "touch_blocks.block_id": lambda m, v: m.touch_blocks([1, v]),
    "unpin_blocks.block_id": lambda m, v: m.unpin_blocks([v]),
    "get_new_blocks.n": lambda m, v: m.get_new_blocks(v),
    "set_num_free_blocks.n": lambda m, v: m.set_num_free_blocks(v),
    "cached_block_num_tokens.block_id": lambda m, v: m.cached_block_num_tokens(v),
    "free_neighbors.block_id": lambda m, v: m.free_neighbors(v),
    "partial_hit.group": lambda m, v: m.partial_hit("run", v),
    "mamba_checkpoint.group": lambda m, v: m.mamba_checkpoint("run", v),
    "finalize_partial_tail_offloads.num_computed_tokens": lambda m, v: (
        m.finalize_partial_tail_offloads("run", v, 0)
    ),
    "finalize_partial_tail_offloads.num_in_flight_tokens": lambda m, v: (
        m.finalize_partial_tail_offloads("run", 0, v)
    ),
    "record_blocks_for_zeroing.start_token": lambda m, v: m.record_blocks_for_zeroing("run", v),
    "take_new_block_ids.group": lambda m, v: m.take_new_block_ids(v),
    "get_computed_blocks_for_connector.max_cache_hit_length": lambda m, v: (
        m.get_computed_blocks_for_connector("wait", v)
    ),
    "find_longest_cache_hit_per_group.max_cache_hit_length": lambda m, v: (
        m.find_longest_cache_hit_per_group([], v)
    ),
    "find_longest_cache_hit.max_cache_hit_length": lambda m, v: m.find_longest_cache_hit([], v),
    "prefix_cache_retention_interval.set": lambda m, v: setattr(
        m, "prefix_cache_retention_interval", v
    ),
}
BAD_COUNTS: dict[str, tuple[Any, type[BaseException]]] = {
    "negative": (-1, InvalidArgumentError),
    "nan": (NAN, TypeError),
    "inf": (INF, TypeError),
    "float": (1.5, TypeError),
    "numpy_float": (np.float64(2.0), TypeError),
    "str": ("3", TypeError),
    "none": (None, TypeError),
    "huge": (2**62, InvalidArgumentError),
    "past_i64": (2**63, OverflowError),
    "past_u64": (2**64, OverflowError),
    "below_i64": (-(2**63) - 1, OverflowError),
}
# Where a value is valid or a different documented error applies.
COUNT_EXCEPTIONS: dict[tuple[str, str], type[BaseException] | None] = {
    # None means "take the hit's count" there.
    ("allocate_slots.num_new_computed_tokens", "none"): None,
    # None: no split.
    ("allocate_slots.split_at_group", "none"): None,
    # None: every computed token was computed locally.
    ("num_blocks_to_allocate.num_local_computed_tokens", "none"): None,
    # A list of counts cannot hold None / str / float: the whole list is refused.
    ("allocate_slots_batch.num_new_tokens_list", "nan"): TypeError,
    # No cap: the request's own limit.
    ("get_computed_blocks.max_cache_hit_length", "none"): None,
    # A huge cap is only a cap.
    ("get_computed_blocks.max_cache_hit_length", "huge"): None,
    # -1 asks for the queue's ends.
    ("free_neighbors.block_id", "negative"): None,
    # No group: every group's list.
    ("take_new_block_ids.group", "none"): None,
    # As get_computed_blocks: no cap, or a huge one, is only a cap.
    ("get_computed_blocks_for_connector.max_cache_hit_length", "none"): None,
    ("get_computed_blocks_for_connector.max_cache_hit_length", "huge"): None,
    ("find_longest_cache_hit_per_group.max_cache_hit_length", "huge"): None,
    ("find_longest_cache_hit.max_cache_hit_length", "huge"): None,
    # Past 2**32 blocks: refused as a count, not answered None.
    ("get_new_blocks.n", "huge"): InvalidArgumentError,
    # None is dense retention.
    ("prefix_cache_retention_interval.set", "none"): None,
}


def count_cases() -> list[Any]:
    cases = []
    for method, call in COUNT_PARAMS.items():
        for name, (value, exc) in BAD_COUNTS.items():
            key = (method, name)
            if key in COUNT_EXCEPTIONS:
                override = COUNT_EXCEPTIONS[key]
                if override is None:
                    continue
                exc = override
            cases.append(pytest.param(call, value, exc, id=f"{method}-{name}"))
    return cases


@pytest.mark.parametrize(("call", "value", "expected"), count_cases())
def test_bad_count(call: Callable[..., Any], value: Any, expected: type[BaseException]) -> None:
    check_refused(busy(), lambda m: call(m, value), expected)


def test_counts_that_are_valid_alone_but_impossible_together() -> None:
    mgr = busy()
    cases: list[tuple[Callable[[pk.KVCacheManager], Any], type[BaseException]]] = [
        # Nothing to compute and nothing to adopt.
        (lambda m: m.allocate_slots("wait", 0, num_computed_tokens=0), InvalidArgumentError),
        # Computed tokens beyond the request, and beyond the blocks it holds.
        (lambda m: m.allocate_slots("run", 1, num_computed_tokens=56), InvalidArgumentError),
        (lambda m: m.allocate_slots("wait", 1, num_computed_tokens=16), InvalidArgumentError),
        # Sums that overflow 64 bits.
        (
            lambda m: m.allocate_slots(
                "wait",
                1,
                num_computed_tokens=0,
                num_external_computed_tokens=2**63 - 1,
                num_new_computed_tokens=2**63 - 1,
            ),
            InvalidArgumentError,
        ),
        # More tokens than the request has.
        (lambda m: m.cache_blocks("run", 56), InvalidArgumentError),
        # A batch whose lists differ in length.
        (lambda m: m.allocate_slots_batch(["run"], [1, 1], [54]), InvalidArgumentError),
        (lambda m: m.allocate_slots_batch(["run", "wait"], 1, [54]), InvalidArgumentError),
        (lambda m: m.append_token_ids_batch(["run", "wait"], [1]), InvalidArgumentError),
        # One unknown id in a batch refuses the whole batch.
        (lambda m: m.append_token_ids_batch(["run", "nope"], [1, 2]), UnknownRequestError),
        (lambda m: m.allocate_slots_batch(["run", "nope"], 1, [54, 0]), UnknownRequestError),
        # A split must name a group after the first, of this manager's.
        (
            lambda m: m.allocate_slots("run", 1, num_computed_tokens=54, split_at_group=0),
            InvalidArgumentError,
        ),
        (
            lambda m: m.allocate_slots("run", 1, num_computed_tokens=54, split_at_group=2),
            InvalidArgumentError,
        ),
        # No split allocation to finish.
        (lambda m: m.finish_allocation("run"), InvalidArgumentError),
        (lambda m: m.finish_allocation("nope"), UnknownRequestError),
        # A request that could never fit the pool.
        (lambda m: m.allocate_slots("wait", 1000, num_computed_tokens=0), CannotFitError),
        # ... in a batch, behind one that fits: the whole batch is refused.
        (lambda m: m.allocate_slots_batch(["run", "wait"], [1, 1000], [54, 0]), CannotFitError),
    ]
    for call, exc in cases:
        check_refused(mgr, call, exc)


# Negative counts in calls that differ from COUNT_PARAMS': a waiting request's
# num_new_tokens, a running one's lookahead from its full count, a hit's count
# of a whole block.
NEGATIVE_CALLS = {
    "num_new_tokens": lambda m: m.allocate_slots("wait", -1, num_computed_tokens=0),
    "num_lookahead_tokens": lambda m: m.allocate_slots(
        "run", 1, num_computed_tokens=55, num_lookahead_tokens=-1
    ),
    "num_new_computed_tokens": lambda m: m.allocate_slots(
        "wait", 5, num_computed_tokens=0, num_new_computed_tokens=-16
    ),
    "batch_num_new_tokens": lambda m: m.allocate_slots_batch(["run"], -1, [55]),
    "batch_lookahead": lambda m: m.allocate_slots_batch(["run"], 1, [55], num_lookahead_tokens=-1),
}


@pytest.mark.parametrize("call", NEGATIVE_CALLS.values(), ids=NEGATIVE_CALLS.keys())
def test_negative_counts_raise_invalid_argument(call: Callable[..., Any]) -> None:
    check_refused(busy(), call, InvalidArgumentError)


def test_zero_new_tokens_with_nothing_to_adopt_raises_invalid_argument() -> None:
    # vLLM 0.33: ValueError("num_new_tokens must be greater than 0 when there are
    # no computed tokens to adopt").
    mgr = busy()
    check_refused(
        mgr, lambda m: m.allocate_slots("wait", 0, num_computed_tokens=0), InvalidArgumentError
    )
    check_refused(
        mgr, lambda m: m.allocate_slots("run", 0, num_computed_tokens=55), InvalidArgumentError
    )


def test_computed_tokens_past_the_request_raise_invalid_argument() -> None:
    check_refused(
        busy(),
        lambda m: m.allocate_slots("run", 1, num_computed_tokens=1000),
        InvalidArgumentError,
    )


# --------------------------------------------------------------------------- token ids

TOKEN_METHODS: dict[str, Callable[[pk.KVCacheManager, Any], Any]] = {
    "add_request": lambda m, t: m.add_request("new", t),
    # Prepared off the manager, then added.
    "request_preparer": lambda m, t: m.add_prepared(m.request_preparer().prepare("new", t)),
    "append_token_ids": lambda m, t: m.append_token_ids("run", t),
    "append_token_ids_batch": lambda m, t: m.append_token_ids_batch(["run"], t),
}
BAD_TOKENS: dict[str, tuple[Callable[[], Any], type[BaseException]]] = {
    "none": (lambda: None, TypeError),
    "int": (lambda: 5, TypeError),
    "str": (lambda: "abc", TypeError),
    "none_item": (lambda: [1, None], TypeError),
    "nan_item": (lambda: [NAN], TypeError),
    "float_item": (lambda: [1.0], TypeError),
    "bool_item": (lambda: [True], TypeError),
    "negative": (lambda: [-1], InvalidArgumentError),
    "past_u32": (lambda: [2**32], InvalidArgumentError),
    "past_u64": (lambda: [2**100], InvalidArgumentError),
    "numpy_float": (lambda: np.array([1.0]), TypeError),
    "numpy_2d": (lambda: np.array([[1, 2]]), TypeError),
    "numpy_negative": (lambda: np.array([-5], dtype=np.int64), InvalidArgumentError),
    "numpy_past_u32": (lambda: np.array([2**40], dtype=np.int64), InvalidArgumentError),
    "tuple_with_nan": (lambda: (1, NAN), TypeError),
    "raising_iterator": (raising_tokens, ZeroDivisionError),
    # Every integer dtype refuses a value outside 0..2**32 the same way.
    **{
        f"numpy_negative_{dt}": (lambda dt=dt: np.array([3, -1], dtype=dt), InvalidArgumentError)
        for dt in ("int8", "int16", ">i2", "int32", ">i4", "int64", ">i8")
    },
    "numpy_uint64_past_u32": (lambda: np.array([2**32], dtype=np.uint64), InvalidArgumentError),
    "numpy_scalar_negative": (lambda: [np.int16(2), np.int8(-1)], InvalidArgumentError),
    "numpy_bool": (lambda: np.array([True, False]), TypeError),
    "numpy_float32": (lambda: np.array([1, 2], dtype=np.float32), TypeError),
    "numpy_float16": (lambda: np.array([1, 2], dtype=np.float16), TypeError),
}


def token_cases() -> list[Any]:
    return [
        pytest.param(call, make, exc, id=f"{method}-{name}")
        for method, call in TOKEN_METHODS.items()
        for name, (make, exc) in BAD_TOKENS.items()
    ]


@pytest.mark.parametrize(("call", "make", "expected"), token_cases())
def test_bad_token_ids(
    call: Callable[..., Any], make: Callable[[], Any], expected: type[BaseException]
) -> None:
    mgr = busy()
    check_refused(mgr, lambda m: call(m, make()), expected)
    assert "new" not in mgr
    assert mgr.num_tokens("run") == 55


# Values beside BAD_TOKENS', for add_request and append_token_ids.
OUT_OF_RANGE_TOKENS = {
    "minus_one": [1, -1],
    "two_pow_64": [1, 2**64],
    "numpy_minus_one": np.array([5, -1], dtype=np.int64),
    "numpy_int32_minus_one": np.array([-1], dtype=np.int32),
}
NON_INT_TOKENS = {
    "str_item": [1, "a"],
    "float_item": [1.5],
    "none_item": [None],
    "bytes": b"abc",
    "numpy_float": np.array([1.0, 2.0]),
}


@pytest.mark.parametrize("tokens", OUT_OF_RANGE_TOKENS.values(), ids=OUT_OF_RANGE_TOKENS.keys())
def test_token_ids_outside_u32_raise_invalid_argument(tokens: Any) -> None:
    mgr = busy()
    check_refused(mgr, lambda m: m.add_request("new", tokens), InvalidArgumentError)
    assert "new" not in mgr
    check_refused(mgr, lambda m: m.append_token_ids("run", tokens), InvalidArgumentError)


@pytest.mark.parametrize("tokens", NON_INT_TOKENS.values(), ids=NON_INT_TOKENS.keys())
def test_non_int_token_ids_raise_type_error(tokens: Any) -> None:
    mgr = busy()
    check_refused(mgr, lambda m: m.add_request("new", tokens), TypeError)
    assert "new" not in mgr
    check_refused(mgr, lambda m: m.append_token_ids("run", tokens), TypeError)


def test_token_ids_at_the_u32_limits_are_accepted() -> None:
    mgr = busy()
    mgr.add_request("edge", [0, 2**32 - 1] * 8)
    mgr.add_request("np", np.array([0, 2**32 - 1] * 8, dtype=np.uint32))
    assert mgr.block_hashes("edge") == mgr.block_hashes("np")
    mgr.check_invariants()


def test_prompt_longer_than_max_model_len_is_rejected() -> None:
    mgr = make_manager(BS, NUM_BLOCKS, max_model_len=32)
    mgr.add_request("ok", list(range(32)))
    check_refused(
        mgr, lambda m: m.add_request("long", list(range(33))), InvalidArgumentError, ("ok",)
    )
    assert "long" not in mgr


@pytest.mark.parametrize(
    "dtype",
    ["int8", "int16", ">i2", "int32", "int64", "uint8", "uint16", ">u2", "uint32", "uint64"],
)
def test_every_integer_dtype_gives_the_same_tokens(dtype: str) -> None:
    prompt = [i % 128 for i in range(3 * BS)]
    ref = busy()
    ref.add_request("new", prompt)
    ref.append_token_ids("new", [5] * BS)
    mgr = busy()
    mgr.add_request("new", np.array(prompt, dtype=dtype))
    mgr.append_token_ids("new", np.array([5] * BS, dtype=dtype))
    assert mgr.num_tokens("new") == 4 * BS
    assert mgr.block_hashes("new") == ref.block_hashes("new")
    mgr.check_invariants()


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda m: m.cache_detached_blocks("run", -1, [], 0, 0), InvalidArgumentError),
        (lambda m: m.cache_detached_blocks("run", 1, [], 0, 0), InvalidArgumentError),
        (lambda m: m.cache_detached_blocks("run", 0, None, 0, 1), TypeError),
        (lambda m: m.cache_detached_blocks("run", 0, [-1], 0, 1), InvalidArgumentError),
        (lambda m: m.cache_detached_blocks("run", 0, [1], -1, 1), InvalidArgumentError),
        (lambda m: m.cache_detached_blocks("run", 0, [1], 0, 1, "x"), TypeError),
        # A block the request holds is not the engine's to cache.
        (lambda m: m.cache_detached_blocks("run", 0, [1], 0, 1), InvalidArgumentError),
        (lambda m: m.cache_detached_blocks("run", 0, [1, 2, 3, 4, 9], 0, 5), InvalidArgumentError),
        (lambda m: m.cache_detached_partial_block("run", 0, 1, 16), InvalidArgumentError),
        (lambda m: m.cache_detached_partial_block("run", 0, 2**40, 16), InvalidArgumentError),
        (lambda m: m.cache_detached_partial_block("run", 0, 1, -16), InvalidArgumentError),
        (lambda m: m.cache_detached_partial_block("run", 0, 1, 15), InvalidArgumentError),
        (lambda m: m.cache_detached_partial_block("run", 2, 1, 16), InvalidArgumentError),
        (lambda m: m.cache_detached_partial_block("run", 0, None, 16), TypeError),
        # A block the request holds, the null block, one past the pool, a
        # free one, another group, a bad hash or token count.
        (lambda m: m.insert_detached_block_hash(1, b"k" * 32, 0), InvalidArgumentError),
        (lambda m: m.insert_detached_block_hash(0, b"k" * 32, 0), InvalidArgumentError),
        (lambda m: m.insert_detached_block_hash(2**40, b"k" * 32, 0), InvalidArgumentError),
        (lambda m: m.insert_detached_block_hash(-1, b"k" * 32, 0), InvalidArgumentError),
        (lambda m: m.insert_detached_block_hash(9, b"k" * 32, 0), InvalidArgumentError),
        (lambda m: m.insert_detached_block_hash(9, b"k" * 32, 1), InvalidArgumentError),
        (lambda m: m.insert_detached_block_hash(9, b"", 0), InvalidArgumentError),
        (lambda m: m.insert_detached_block_hash(9, b"k" * 32, 0, -1), InvalidArgumentError),
        (lambda m: m.insert_detached_block_hash(9, "k", 0), TypeError),
        (lambda m: m.insert_detached_block_hash(9, b"k" * 32, 0, 1.5), TypeError),
    ],
)
def test_bad_detached_block_caching(
    call: Callable[[pk.KVCacheManager], Any], expected: type[BaseException]
) -> None:
    check_refused(busy(), call, expected)


def test_empty_and_too_long_prompts_are_refused() -> None:
    mgr = busy()
    check_refused(mgr, lambda m: m.add_request("new", []), InvalidArgumentError)
    check_refused(
        mgr, lambda m: m.add_request("new", np.array([], dtype=np.int64)), InvalidArgumentError
    )
    check_refused(mgr, lambda m: m.add_request("new", [1] * 1025), InvalidArgumentError)
    assert "new" not in mgr


# --------------------------------------------------------------------------- add_request options

ADD_OPTIONS: dict[str, tuple[dict[str, Any], type[BaseException]]] = {
    "lora_name_int": ({"lora_name": 1}, TypeError),
    "lora_path_without_name": ({"lora_path": "/p"}, InvalidArgumentError),
    "lora_id_without_name": ({"lora_id": 3}, InvalidArgumentError),
    "lora_id_float": ({"lora_name": "l", "lora_id": 1.5}, TypeError),
    "lora_id_past_i64": ({"lora_name": "l", "lora_id": 2**64}, OverflowError),
    "cache_salt_bytes": ({"cache_salt": b"s"}, TypeError),
    "skip_reading_str": ({"skip_reading_prefix_cache": "yes"}, TypeError),
    "prompt_embeds_rows": ({"prompt_embeds": b"abc"}, InvalidArgumentError),
    "mm_negative_offset": ({"mm_features": [("img", -1, 2)]}, InvalidArgumentError),
    "mm_negative_length": ({"mm_features": [("img", 0, -2)]}, InvalidArgumentError),
    "mm_zero_length": ({"mm_features": [("img", 0, 0)]}, InvalidArgumentError),
    "mm_overlap": ({"mm_features": [("a", 0, 5), ("b", 4, 2)]}, InvalidArgumentError),
    "mm_offset_past_i64": ({"mm_features": [("img", 2**63, 1)]}, OverflowError),
}


@pytest.mark.parametrize(("kwargs", "expected"), ADD_OPTIONS.values(), ids=ADD_OPTIONS.keys())
def test_bad_add_request_options(kwargs: dict[str, Any], expected: type[BaseException]) -> None:
    mgr = busy()
    check_refused(mgr, lambda m: m.add_request("new", list(range(20)), **kwargs), expected)
    assert "new" not in mgr


# --------------------------------------------------------------------------- lookups


def test_stale_and_foreign_lookups_are_refused() -> None:
    mgr = busy()
    other = busy()
    foreign = other.get_computed_blocks("wait")
    assert foreign.num_computed_tokens == 48
    own = mgr.get_computed_blocks("wait")
    running_hit = mgr.get_computed_blocks("run")
    cases: list[tuple[Callable[[pk.KVCacheManager], Any], type[BaseException]]] = [
        (
            lambda m: m.allocate_slots(
                "wait", 5, num_computed_tokens=0, new_computed_blocks=foreign
            ),
            StaleComputedBlocksError,
        ),
        (
            lambda m: m.allocate_slots(
                "wait", 5, num_computed_tokens=0, new_computed_blocks=running_hit
            ),
            StaleComputedBlocksError,
        ),
        # A hit for a request that already holds blocks.
        (
            lambda m: m.allocate_slots(
                "run", 1, num_computed_tokens=0, new_computed_blocks=running_hit
            ),
            InvalidArgumentError,
        ),
        # A hit claiming more tokens than it covers.
        (
            lambda m: m.allocate_slots(
                "wait",
                5,
                num_computed_tokens=0,
                new_computed_blocks=own,
                num_new_computed_tokens=52,
            ),
            InvalidArgumentError,
        ),
        # Not a lookup result at all.
        (
            lambda m: m.allocate_slots(
                "wait", 5, num_computed_tokens=0, new_computed_blocks=(np.array([1, 2, 3]),)
            ),
            TypeError,
        ),
        (
            lambda m: m.allocate_slots("wait", 5, num_computed_tokens=0, new_computed_blocks="hit"),
            TypeError,
        ),
    ]
    for call, exc in cases:
        check_refused(mgr, call, exc)
    # The same id added again after removal is another request: its old lookup is stale.
    hit = mgr.get_computed_blocks("wait")
    mgr.remove_request("wait")
    mgr.add_request("wait", [*COMMON, *[4] * 5])
    mgr.take_events()
    mgr.make_prefix_cache_stats()
    check_refused(
        mgr,
        lambda m: m.allocate_slots("wait", 5, num_computed_tokens=0, new_computed_blocks=hit),
        StaleComputedBlocksError,
    )
    # Evicted since the lookup.
    hit = mgr.get_computed_blocks("wait")
    mgr.evict_blocks([2])
    mgr.take_events()
    mgr.make_prefix_cache_stats()
    check_refused(
        mgr,
        lambda m: m.allocate_slots("wait", 5, num_computed_tokens=0, new_computed_blocks=hit),
        StaleComputedBlocksError,
    )


def cached_prefix_manager() -> pk.KVCacheManager:
    """Blocks 1-3 cached and free (ref 0); request "r1" shares that prefix."""
    mgr = make_manager(BS, NUM_BLOCKS, log_stats=True, enable_kv_cache_events=True)
    mgr.add_request("r0", [*COMMON, *[3] * 7])
    admit(mgr, "r0")
    mgr.remove_request("r0")
    mgr.add_request("r1", [*COMMON, *[4] * 5])
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
    check_refused(
        mgr,
        lambda m: m.allocate_slots("r1", 5, num_computed_tokens=0, new_computed_blocks=hit),
        StaleComputedBlocksError,
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
    check_refused(
        mgr,
        lambda m: m.allocate_slots("r1", 5, num_computed_tokens=0, new_computed_blocks=hit),
        StaleComputedBlocksError,
        ("r1",),
    )
    hit, new = admit(mgr, "r1")
    assert hit.num_computed_tokens == 0
    assert new is not None
    mgr.check_invariants()


def test_hit_used_for_another_request_is_stale() -> None:
    mgr = cached_prefix_manager()
    mgr.add_request("twin", [*COMMON, *[4] * 5])  # same prompt as r1
    hit = mgr.get_computed_blocks("r1")
    assert hit.num_computed_tokens == 48
    check_refused(
        mgr,
        lambda m: m.allocate_slots("twin", 5, num_computed_tokens=0, new_computed_blocks=hit),
        StaleComputedBlocksError,
        ("r1", "twin"),
    )


def test_hit_from_another_manager_is_stale() -> None:
    mgr = cached_prefix_manager()
    other = cached_prefix_manager()
    hit = other.get_computed_blocks("r1")
    assert hit.num_computed_tokens == 48
    check_refused(
        mgr,
        lambda m: m.allocate_slots("r1", 5, num_computed_tokens=0, new_computed_blocks=hit),
        StaleComputedBlocksError,
        ("r1",),
    )


# --------------------------------------------------------------------------- block ids, hashes

BAD_BLOCK_LISTS: dict[str, tuple[Callable[[], Any], type[BaseException]]] = {
    "none": (lambda: None, TypeError),
    "int": (lambda: 5, TypeError),
    "str_items": (lambda: ["a"], TypeError),
    "float_items": (lambda: [1.5], TypeError),
    "nan_items": (lambda: [NAN], TypeError),
    "negative": (lambda: [-1], InvalidArgumentError),
    "num_blocks": (lambda: [NUM_BLOCKS], InvalidArgumentError),
    "past_u64": (lambda: [2**64], OverflowError),
    "numpy_negative": (lambda: np.array([3, -3]), InvalidArgumentError),
    "raising_iterator": (raising_tokens, ZeroDivisionError),
}


@pytest.mark.parametrize(("make", "expected"), BAD_BLOCK_LISTS.values(), ids=BAD_BLOCK_LISTS.keys())
def test_bad_evict_blocks(make: Callable[[], Any], expected: type[BaseException]) -> None:
    check_refused(busy(), lambda m: m.evict_blocks(make()), expected)


@pytest.mark.parametrize(
    "block_ids",
    [[1, 11], [2**40], [5, -3]],
    ids=["valid_then_bad", "huge", "valid_then_negative"],
)
def test_out_of_range_block_ids_in_evict_blocks_raise_and_evict_nothing(
    block_ids: list[int],
) -> None:
    # vLLM asserts block_id < len(blocks) (a KV-connector bug otherwise).
    mgr = busy()
    assert mgr.cached_block_hash(1) is not None and mgr.cached_block_hash(5) is not None
    check_refused(mgr, lambda m: m.evict_blocks(block_ids), InvalidArgumentError)


def test_out_of_range_block_id_in_introspection_raises_invalid_argument() -> None:
    mgr = busy()
    for call in (lambda m: m.block_ref_count(11), lambda m: m.cached_block_hash(-1)):
        check_refused(mgr, call, InvalidArgumentError)


BAD_HASH_ARGS: dict[str, tuple[Callable[[pk.KVCacheManager], Any], type[BaseException]]] = {
    "str": (lambda m: m.cached_blocks_for_hash("abc"), TypeError),
    "none": (lambda m: m.cached_blocks_for_hash(None), TypeError),
    "empty": (lambda m: m.cached_blocks_for_hash(b""), InvalidArgumentError),
    "too_long": (lambda m: m.cached_blocks_for_hash(b"x" * 33), InvalidArgumentError),
    "group_negative": (lambda m: m.cached_blocks_for_hash(b"x", -1), OverflowError),
    "group_past_u32": (lambda m: m.cached_blocks_for_hash(b"x", 2**32), OverflowError),
    "group_str": (lambda m: m.cached_blocks_for_hash(b"x", "0"), TypeError),
}


@pytest.mark.parametrize(("call", "expected"), BAD_HASH_ARGS.values(), ids=BAD_HASH_ARGS.keys())
def test_bad_hash_lookup(call: Callable[..., Any], expected: type[BaseException]) -> None:
    check_refused(busy(), call, expected)


# --------------------------------------------------------------------------- capacity


def test_request_larger_than_the_pool_raises_cannot_fit() -> None:
    mgr = busy()
    mgr.add_request("huge", list(range(161)))  # 11 blocks; the pool has 10 usable
    check_refused(mgr, lambda m: admit(m, "huge"), CannotFitError, (*KNOWN, "huge"))
    mgr.remove_request("huge")
    mgr.check_invariants()


def test_request_that_fits_an_empty_pool_but_not_now_returns_none() -> None:
    mgr = busy()  # 4 blocks held, 6 free
    mgr.add_request("big", list(range(1000, 1000 + 160)))  # exactly the 10 usable blocks
    before = snapshot(mgr, (*KNOWN, "big"))
    _, new = admit(mgr, "big")
    assert new is None
    assert snapshot(mgr, (*KNOWN, "big")) == before
    mgr.remove_request("run")
    _, new = admit(mgr, "big")
    assert new is not None and len(new[0]) == 10
    mgr.check_invariants()


# --------------------------------------------------------------------------- construction


def config(num_blocks: int = NUM_BLOCKS) -> pk.KVCacheConfig:
    return pk.KVCacheConfig(
        num_blocks=num_blocks, kv_cache_groups=[pk.KVCacheGroupSpec(["layer"], full(BS))]
    )


BAD_CONFIGS: dict[str, tuple[Callable[[], Any], type[BaseException]]] = {
    "config_none": (lambda: pk.KVCacheManager(None, max_model_len=64), TypeError),  # type: ignore[arg-type]
    "max_model_len_zero": (
        lambda: pk.KVCacheManager(config(), max_model_len=0),
        InvalidConfigError,
    ),
    "max_model_len_negative": (
        lambda: pk.KVCacheManager(config(), max_model_len=-5),
        InvalidConfigError,
    ),
    "max_model_len_nan": (lambda: pk.KVCacheManager(config(), max_model_len=NAN), TypeError),
    "max_model_len_past_i64": (
        lambda: pk.KVCacheManager(config(), max_model_len=2**64),
        OverflowError,
    ),
    "num_blocks_huge": (
        lambda: pk.KVCacheManager(config(2**40), max_model_len=64),
        InvalidConfigError,
    ),
    "hash_algo_unknown": (
        lambda: pk.KVCacheManager(config(), max_model_len=64, hash_algo="md5"),
        InvalidConfigError,
    ),
    "hash_block_size_not_dividing": (
        lambda: pk.KVCacheManager(config(), max_model_len=64, hash_block_size=3),
        InvalidConfigError,
    ),
    "hash_block_size_zero": (
        lambda: pk.KVCacheManager(config(), max_model_len=64, hash_block_size=0),
        InvalidConfigError,
    ),
    "watermark_nan": (
        lambda: pk.KVCacheManager(config(), max_model_len=64, watermark=NAN),
        InvalidConfigError,
    ),
    "watermark_inf": (
        lambda: pk.KVCacheManager(config(), max_model_len=64, watermark=INF),
        InvalidConfigError,
    ),
    "watermark_negative": (
        lambda: pk.KVCacheManager(config(), max_model_len=64, watermark=-1.0),
        InvalidConfigError,
    ),
    "watermark_str": (
        lambda: pk.KVCacheManager(config(), max_model_len=64, watermark="x"),
        TypeError,
    ),
    "max_in_flight_tokens_zero": (
        lambda: pk.KVCacheManager(config(), max_model_len=64, max_in_flight_tokens=0),
        InvalidConfigError,
    ),
    "retention_negative": (
        lambda: pk.KVCacheManager(config(), max_model_len=64, prefix_cache_retention_interval=-1),
        InvalidConfigError,
    ),
    "option_unknown": (
        lambda: pk.KVCacheManager(config(), max_model_len=64, enable_cachng=False),  # type: ignore[call-arg]
        TypeError,
    ),
    "option_bool_int": (
        lambda: pk.KVCacheManager(config(), max_model_len=64, log_stats=1),  # type: ignore[arg-type]
        TypeError,
    ),
    "hash_truncate_bytes_past_u8": (
        lambda: pk.KVCacheManager(config(), max_model_len=64, hash_truncate_bytes=300),
        InvalidConfigError,
    ),
    "num_prefill_lookahead_negative": (
        lambda: pk.KVCacheManager(config(), max_model_len=64, num_prefill_lookahead=-1),
        InvalidConfigError,
    ),
    "num_prefill_lookahead_past_block_with_eagle": (
        lambda: pk.KVCacheManager(
            config(), max_model_len=64, use_eagle=True, num_prefill_lookahead=BS + 1
        ),
        InvalidConfigError,
    ),
    "dcp_world_size_zero": (
        lambda: pk.KVCacheManager(config(), max_model_len=64, dcp_world_size=0),
        InvalidConfigError,
    ),
    "partial_hash_hits_int": (
        lambda: pk.KVCacheManager(config(), max_model_len=64, partial_hash_hits=1),  # type: ignore[arg-type]
        TypeError,
    ),
    "prefill_checkpoint_alignment_zero": (
        lambda: pk.MambaSpec(
            16, ((1,),), ("float32",), mamba_cache_mode="align", prefill_checkpoint_alignment=0
        ),
        InvalidConfigError,
    ),
    "prefill_checkpoint_alignment_without_align": (
        lambda: pk.MambaSpec(16, ((1,),), ("float32",), prefill_checkpoint_alignment=16),
        InvalidConfigError,
    ),
    "retention_without_sparse_group": (
        lambda: pk.KVCacheManager(config(), max_model_len=64, prefix_cache_retention_interval=16),
        InvalidConfigError,
    ),
}


@pytest.mark.parametrize(("build", "expected"), BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_bad_manager_config(build: Callable[[], Any], expected: type[BaseException]) -> None:
    with pytest.raises(expected) as info:
        build()
    assert type(info.value).__name__ != "PanicException"
    assert str(info.value)


def test_every_public_method_is_in_the_matrix() -> None:
    """A new public method must get bad-input cases here too."""
    covered = {m.split(".")[0] for m in (*ID_METHODS, *COUNT_PARAMS, *TOKEN_METHODS)} | {
        "evict_blocks",
        "cached_blocks_for_hash",
        # test_bad_detached_block_caching:
        "insert_detached_block_hash",
        "num_blocks_to_allocate",
        # No arguments to get wrong, or tested with an engine manager
        # (test_vllm_dropin.py):
        "_prefix_cache_stats",
        "num_detached_block_refs",
        "take_block_copies",
        "take_boundary_state_offloads",
        "allocate_slots",
        "add_request",
        # Its refusals (another manager's, a known id, added twice) in
        # test_prepared.py; its prompts through request_preparer above:
        "add_prepared",
        # The host tier's calls: their refusals (jobs not in flight, listed
        # twice, negative; no tier; buffers of another size) in
        # tests/offload/test_manager_tier.py.
        "complete_transfers",
        "take_transfer_plan",
        "read_disk_chunk",
        "write_disk_chunk",
        # No arguments to get wrong:
        "reset_offload",
        "take_offload_events",
        "offload_stats",
        "has_offload",
        "num_transfers_in_flight",
        "reset_prefix_cache",
        "new_step_starts",
        "take_events",
        "make_prefix_cache_stats",
        "check_invariants",
        "free_block_ids",
        "block_pool_stats",
        "take_block_activity",
        "take_reused_blocks",
        "blocks_with_extra_hashes",
        "cached_block_hash_entries",
        # Read-only properties.
        "num_free_blocks",
        "usage",
        "num_requests",
        "num_kv_cache_groups",
        "num_blocks",
        "hash_block_size",
        "none_hash",
        "num_cached_block_hashes",
        "kv_cache_config",
        "verification_failures",
        "hash_memo_hits",
        "hash_memo_misses",
        "max_model_len",
        "enable_caching",
        "log_stats",
        "kv_cache_metrics",
        "partial_hash_hits",
        "mamba_shared_prefix_checkpoint",
        "records_new_block_ids",
        "lookup_groups",
        "full_attention_group",
        "num_pending_events",
        "num_dropped_events",
        "num_dropped_block_activity",
        "reads_token_values",
        # set at construction: its refusals in test_eviction_policies.py
        "eviction",
    }
    public = {n for n in dir(pk.KVCacheManager) if not n.startswith("_")}
    assert public - covered == set()


# --------------------------------------------------------------------------- threads


def drive(
    mgr: pk.KVCacheManager,
    prefix: str,
    seed: int,
    steps: int,
    errors: list[BaseException],
    start: threading.Barrier | None = None,
) -> None:
    """One thread's scheduler over its own requests: add, admit (lookup +
    allocate), decode, preempt, remove. Every call is valid."""
    rng = random.Random(seed)
    tokens: dict[str, int] = {}  # request -> computed tokens (0: waiting)
    n = 0
    try:
        if start is not None:
            start.wait()
        for _ in range(steps):
            op = rng.random()
            if op < 0.25 or not tokens:
                rid = f"{prefix}-{n}"
                n += 1
                base = COMMON if rng.random() < 0.5 else [7] * 32
                mgr.add_request(rid, [*base[: rng.randint(1, len(base))], rng.randint(0, 3)])
                tokens[rid] = 0
                continue
            rid = rng.choice(sorted(tokens))
            if op < 0.55:
                if tokens[rid] == 0:
                    hit = mgr.get_computed_blocks(rid)
                    new = mgr.num_tokens(rid) - hit.num_computed_tokens
                    out = mgr.allocate_slots(
                        rid, new, num_computed_tokens=0, new_computed_blocks=hit
                    )
                    if out is not None:
                        tokens[rid] = mgr.num_tokens(rid)
                else:
                    mgr.append_token_ids(rid, [rng.randint(0, 3)])
                    out = mgr.allocate_slots(rid, 1, num_computed_tokens=tokens[rid])
                    if out is None:
                        mgr.free(rid)
                        tokens[rid] = 0
                    else:
                        tokens[rid] += 1
            elif op < 0.7:
                mgr.free(rid)
                tokens[rid] = 0
            else:
                mgr.remove_request(rid)
                del tokens[rid]
            if mgr.num_tokens(rid) > 120 if rid in tokens else False:
                mgr.remove_request(rid)
                del tokens[rid]
        for rid in tokens:
            mgr.remove_request(rid)
    except BaseException as e:  # reported by the main thread
        errors.append(e)


@pytest.fixture
def fast_switching() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


@pytest.mark.usefixtures("fast_switching")
def test_threads_hammering_one_manager_with_their_own_requests() -> None:
    mgr = make_manager(BS, 64, max_model_len=1024)
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=drive, args=(mgr, f"t{i}", i, 300, errors)) for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    mgr.check_invariants()
    assert mgr.num_requests == 0
    assert mgr.num_free_blocks == 63
    assert mgr.reset_prefix_cache()


@pytest.mark.usefixtures("fast_switching")
def test_threads_with_shared_prefixes_keep_blocks_consistent_midway() -> None:
    """Invariants and block conservation checked from another thread while four
    threads run (reads are serialised with the writers by the GIL)."""
    mgr = make_manager(BS, 40, max_model_len=1024)
    errors: list[BaseException] = []
    start = threading.Barrier(5)
    threads = [
        threading.Thread(target=drive, args=(mgr, f"t{i}", 10 + i, 400, errors, start))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    start.wait()
    while True:
        mgr.check_invariants()
        # One call, one consistent view (other threads run between two calls).
        free = [int(b) for b in mgr.free_block_ids()]
        assert 0 not in free and len(set(free)) == len(free)
        if not any(t.is_alive() for t in threads):
            break
    for t in threads:
        t.join()
    assert errors == []
    mgr.check_invariants()
    assert mgr.num_free_blocks == 39


def long_prompt_manager() -> pk.KVCacheManager:
    # Prompts over 8192 tokens are hashed with the GIL released.
    return make_manager(BS, 64, max_model_len=1_000_000)


def test_calls_during_a_long_add_request_never_corrupt_the_manager() -> None:
    mgr = long_prompt_manager()
    mgr.add_request("short", [*COMMON, 1])
    admit(mgr, "short")
    prompt = np.arange(300_000, dtype=np.int64) % 1000
    started = threading.Event()
    done: list[BaseException | None] = []

    def add_long() -> None:
        started.set()
        try:
            mgr.add_request("long", prompt)
            done.append(None)
        except BaseException as e:
            done.append(e)

    t = threading.Thread(target=add_long)
    t.start()
    started.wait()
    outcomes: dict[str, int] = {}
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("num_free_blocks", lambda: mgr.num_free_blocks),
        ("contains", lambda: "long" in mgr),
        ("get_computed_blocks", lambda: mgr.get_computed_blocks("short")),
        ("append_token_ids", lambda: mgr.append_token_ids("short", [1])),
        ("check_invariants", mgr.check_invariants),
    ]
    while t.is_alive():
        for name, call in calls:
            try:
                call()
                outcomes[f"{name}: ok"] = outcomes.get(f"{name}: ok", 0) + 1
            except BaseException as e:
                assert type(e).__name__ != "PanicException"
                # The binding's borrow check refuses the call: no waiting, no corruption.
                assert isinstance(e, RuntimeError) and "borrowed" in str(e), repr(e)
                outcomes[f"{name}: refused"] = outcomes.get(f"{name}: refused", 0) + 1
    t.join()
    assert done == [None]
    assert "long" in mgr
    assert len(mgr.block_hashes("long")) == 300_000 // BS
    mgr.check_invariants()
    # Whatever was appended while the long prompt was hashed is there exactly once.
    appended = outcomes.get("append_token_ids: ok", 0)
    assert mgr.num_tokens("short") == 49 + appended
    mgr.remove_request("long")
    mgr.remove_request("short")
    assert mgr.num_free_blocks == 63


class ReentrantTokens:
    """An argument whose iteration calls back into the manager."""

    def __init__(self, mgr: pk.KVCacheManager, call: Callable[[pk.KVCacheManager], Any]) -> None:
        self.mgr, self.call = mgr, call
        self.inner: BaseException | None = None

    def __iter__(self) -> Iterator[int]:
        try:
            self.call(self.mgr)
        except BaseException as e:
            self.inner = e
        yield from [1, 2, 3]


REENTRANT: dict[str, Callable[[pk.KVCacheManager, Any], Any]] = {
    "add_request": lambda m, it: m.add_request("new", it),
    "request_preparer": lambda m, it: m.add_prepared(m.request_preparer().prepare("new", it)),
    "append_token_ids": lambda m, it: m.append_token_ids("wait", it),
    "evict_blocks": lambda m, it: m.evict_blocks(it),
}


@pytest.mark.parametrize("outer", REENTRANT.values(), ids=REENTRANT.keys())
def test_reentrant_calls_run_first_without_corruption(outer: Callable[..., Any]) -> None:
    mgr = busy()
    free_before = mgr.num_free_blocks
    it = ReentrantTokens(mgr, lambda m: m.free("run"))
    outer(mgr, it)
    # Arguments are converted before the manager is taken: the call made from
    # inside the iteration ran, completely, before the outer call.
    assert it.inner is None
    assert as_lists(mgr.get_block_ids("run")) == ([],)
    assert mgr.num_free_blocks == free_before + 4
    mgr.check_invariants()


class CountCallingBack:
    """A count whose ``__index__`` (as torch and NumPy scalars have) calls into the
    manager first."""

    def __init__(self, mgr: pk.KVCacheManager, value: int) -> None:
        self.mgr, self.value = mgr, value
        self.seen: int | None = None

    def __index__(self) -> int:
        self.seen = self.mgr.num_free_blocks
        self.mgr.new_step_starts()
        return self.value


class CountWaiting:
    """A count whose ``__index__`` releases the GIL until the test lets it go."""

    def __init__(self, value: int) -> None:
        self.value = value
        self.entered, self.release = threading.Event(), threading.Event()

    def __index__(self) -> int:
        self.entered.set()
        assert self.release.wait(30)
        return self.value


# Calls taking a count, each given it as an object with __index__.
COUNTED: dict[str, Callable[[pk.KVCacheManager, Any], Any]] = {
    "allocate_slots": lambda m, n: m.allocate_slots("run", n, num_computed_tokens=55),
    "allocate_slots_lookahead": lambda m, n: m.allocate_slots(
        "run", 1, num_computed_tokens=55, num_lookahead_tokens=n
    ),
    "allocate_slots_batch": lambda m, n: m.allocate_slots_batch(
        ["run"], [1], [55], num_lookahead_tokens=n
    ),
    "cache_blocks": lambda m, n: m.cache_blocks("run", n),
    "remove_skipped_blocks": lambda m, n: m.remove_skipped_blocks("run", n),
    "block_ref_count": lambda m, n: m.block_ref_count(n),
    "cached_block_hash": lambda m, n: m.cached_block_hash(n),
    "cached_block_extra_hashes": lambda m, n: m.cached_block_extra_hashes(n),
}
COUNT = {"allocate_slots": 1, "allocate_slots_batch": 0, "block_ref_count": 1,
         "cached_block_hash": 1, "cached_block_extra_hashes": 1}  # fmt: skip


@pytest.mark.parametrize("name", COUNTED)
def test_a_count_calling_back_into_the_manager_runs_before_the_call(name: str) -> None:
    mgr = busy()
    free = mgr.num_free_blocks
    n = CountCallingBack(mgr, COUNT.get(name, 0))
    COUNTED[name](mgr, n)
    assert n.seen == free  # the manager was free while the argument was converted
    mgr.check_invariants()


@pytest.mark.parametrize("name", COUNTED)
def test_calls_from_another_thread_wait_while_a_count_is_converted(name: str) -> None:
    # The converting thread holds no borrow of the manager while the GIL is
    # released: another thread's calls go through instead of finding it in use.
    mgr = busy()
    n = CountWaiting(COUNT.get(name, 0))
    failed: list[BaseException] = []

    def call() -> None:
        try:
            COUNTED[name](mgr, n)
        except BaseException as e:
            failed.append(e)

    t = threading.Thread(target=call)
    t.start()
    try:
        assert n.entered.wait(30)
        assert mgr.num_free_blocks >= 0
        mgr.add_request("other", [7] * 20)
        mgr.remove_request("other")
        mgr.check_invariants()
    finally:
        n.release.set()
        t.join(30)
    assert not t.is_alive() and failed == []
    mgr.check_invariants()


# --------------------------------------------------------------------------- fixed deviations


def test_remove_skipped_blocks_past_the_request_is_refused() -> None:
    mgr = manager(20, [full(4), swa(4, 8)], max_model_len=1024)
    mgr.add_request("a", list(range(30)))
    admit(mgr, "a")
    check_refused(mgr, lambda m: m.remove_skipped_blocks("a", 10**6), InvalidArgumentError, ("a",))


MALFORMED_MM: dict[str, Any] = {
    "not_a_tuple": [1],
    "two_fields": [("img", 1)],
    "offset_str": [("img", "x", 1)],
    "offset_nan": [("img", NAN, 2)],
    "offset_float": [("img", 1.5, 2)],
    "identifier_none": [(None, 0, 2)],
}


@pytest.mark.parametrize("mm", MALFORMED_MM.values(), ids=MALFORMED_MM.keys())
def test_malformed_mm_features_raise_a_documented_error(mm: Any) -> None:
    mgr = busy()
    check_refused(
        mgr,
        lambda m: m.add_request("new", list(range(20)), mm_features=mm),
        (PagedKVError, TypeError),
    )


def test_hash_seed_of_the_wrong_type_is_refused() -> None:
    with pytest.raises((TypeError, InvalidConfigError)):
        pk.KVCacheManager(config(), max_model_len=64, hash_seed=object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.allocate_slots("run", 2**64, num_computed_tokens=54),
        lambda m: m.cache_blocks("run", 2**64),
        lambda m: m.evict_blocks([2**64]),
        lambda m: m.allocate_slots_batch(["run"], 2**64, [54]),
    ],
    ids=["allocate_slots", "cache_blocks", "evict_blocks", "allocate_slots_batch"],
)
def test_counts_beyond_64_bits_raise_overflow_error(call: Callable[..., Any]) -> None:
    # As Python raises for any C integer argument; state unchanged.
    check_refused(busy(), call, OverflowError)


def test_calls_during_a_long_add_request_wait() -> None:
    mgr = long_prompt_manager()
    usable = mgr.num_free_blocks
    prompt = np.arange(1_000_000, dtype=np.int64) % 1000
    seen: set[int] = set()  # the free counts read while a prompt was hashed
    failed: list[BaseException] = []
    # Repeated, so that some call surely lands while the prompt is being hashed.
    for i in range(20):
        started = threading.Event()

        def add(rid: str = f"long{i}", ev: threading.Event = started) -> None:
            ev.set()
            try:
                mgr.add_request(rid, prompt)
            except BaseException as e:  # reported by the main thread
                failed.append(e)

        t = threading.Thread(target=add)
        t.start()
        started.wait()
        try:
            while t.is_alive():
                try:
                    seen.add(mgr.num_free_blocks)
                except PagedKVError:
                    pass
        finally:
            t.join()
        assert failed == []
        # The prompt went in whole, and is the only request.
        assert mgr.num_requests == 1 and f"long{i}" in mgr
        assert mgr.num_tokens(f"long{i}") == len(prompt)
        assert len(mgr.block_hashes(f"long{i}")) == len(prompt) // BS
        mgr.check_invariants()
        mgr.remove_request(f"long{i}")
    # Adding a prompt takes no block: every count read on the way saw the whole pool.
    assert seen <= {usable}
    assert mgr.num_requests == 0 and mgr.num_free_blocks == usable
    mgr.check_invariants()


def test_reentrant_call_from_a_prompt_iterator_runs_first() -> None:
    mgr = busy()
    it = ReentrantTokens(mgr, lambda m: m.free("run"))
    mgr.add_request("new", it)
    assert it.inner is None
    assert mgr.num_tokens("new") == 3
    assert as_lists(mgr.get_block_ids("run")) == ([],)
    mgr.check_invariants()


MAMBA_HUGE_COUNT = """
import pagedkv as pk
full = pk.FullAttentionSpec(4, 1, 1, "float32")
mamba = pk.MambaSpec(block_size=8, shapes=((1,),), dtypes=("float32",),
                     mamba_cache_mode="align")
groups = [pk.KVCacheGroupSpec(["a"], full), pk.KVCacheGroupSpec(["m"], mamba)]
mgr = pk.KVCacheManager(pk.KVCacheConfig(num_blocks=64, kv_cache_groups=groups),
                        max_model_len=64)
mgr.add_request("r", list(range(10)))
hit = mgr.get_computed_blocks("r")
try:
    mgr.allocate_slots("r", 2**40, num_computed_tokens=0, new_computed_blocks=hit)
except pk.PagedKVError:
    pass
mgr.check_invariants()
print("survived")
"""


def test_huge_count_on_a_mamba_align_model_does_not_abort() -> None:
    # In a child process: the abort would take the test runner down with it.
    env = {**os.environ, "RUST_BACKTRACE": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", MAMBA_HUGE_COUNT],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0 and "survived" in proc.stdout, proc.stderr[:300]


class _LyingLength:
    """A sequence whose ``__len__`` claims ``claimed`` items and yields ``actual``."""

    def __init__(self, claimed: int, actual: int) -> None:
        self.claimed, self.actual = claimed, actual

    def __len__(self) -> int:
        return self.claimed

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.actual))


@pytest.mark.parametrize(
    "token_ids",
    [
        range(2**33),  # 32 GiB of token ids if reserved from len()
        _LyingLength(2**40, 5),  # claims more than any request may hold
        _LyingLength(3, 10**9),  # yields more than it claimed
        np.zeros(2000, dtype=np.int64),  # an array past max_model_len
    ],
    ids=["huge_range", "len_claims_too_many", "yields_too_many", "long_array"],
)
def test_sizes_are_checked_before_anything_is_reserved(token_ids: Any) -> None:
    mgr = busy()
    before = snapshot(mgr, ["run", "wait"])
    with pytest.raises(InvalidArgumentError, match="allowed here"):
        mgr.add_request("big", token_ids)
    with pytest.raises(InvalidArgumentError, match="allowed here"):
        mgr.append_token_ids("run", token_ids)
    assert snapshot(mgr, ["run", "wait"]) == before and "big" not in mgr
    mgr.check_invariants()


def test_a_request_cannot_grow_past_max_model_len() -> None:
    mgr = make_manager(BS, NUM_BLOCKS, max_model_len=64)
    h = mgr.add_request("r", list(range(62)))
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        mgr.append_token_ids("r", [1, 2, 3])
    assert mgr.num_tokens("r") == 62
    mgr.append_token_ids_batch([h], [7])
    mgr.append_token_ids("r", [8])
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        mgr.append_token_ids_batch([h], [9])
    assert mgr.num_tokens("r") == 64


def _memory_bytes() -> int | None:
    """RAM plus swap, from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
    except OSError:
        return None
    kib = int(fields["MemTotal"].split()[0]) + int(fields.get("SwapTotal", "0 kB").split()[0])
    return kib * 1024


def test_a_pool_larger_than_the_machine_is_refused() -> None:
    num_blocks = 2**31 - 2  # 32 GiB of block state alone
    memory = _memory_bytes()
    if memory is None or memory >= 16 * num_blocks:
        pytest.skip("this machine could hold the pool")
    spec = pk.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype="float32")
    config = pk.KVCacheConfig(
        num_blocks=num_blocks, kv_cache_groups=[pk.KVCacheGroupSpec(["l"], spec)]
    )
    with pytest.raises(InvalidConfigError, match="cannot allocate"):
        pk.KVCacheManager(config, max_model_len=1024)


def test_torch_scalars_as_counts_do_not_disturb_other_threads() -> None:
    # Converting a torch scalar runs Python code (and may release the GIL): it
    # happens before the manager is borrowed, so other threads never meet a
    # borrowed manager.
    torch = pytest.importorskip("torch")
    mgr = make_manager(BS, 200, max_model_len=1024)
    mgr.add_request("r", list(range(100)))
    admit(mgr, "r")
    errors: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                mgr.num_free_blocks  # noqa: B018 - the call under test
                mgr.num_tokens("r")
            except RuntimeError as e:
                errors.append(str(e))
                return

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(200):
            mgr.get_computed_blocks("r", torch.tensor(50))
            mgr.cached_block_num_tokens(torch.tensor(1))
            mgr.take_new_block_ids(torch.tensor(0))
            mgr.remove_skipped_blocks("r", torch.tensor(0))
            mgr.allocate_slots_batch(["r"], torch.tensor(1), [torch.tensor(99)])
    finally:
        stop.set()
        t.join(10)
    assert errors == []
    mgr.check_invariants()
