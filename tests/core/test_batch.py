"""``allocate_slots_batch`` is exactly ``allocate_slots`` called for each request in
order until the first one that does not fit (vLLM's scheduler stops at the first
``None`` of its running pass): same new blocks, same final state, same events and
stats. Two identical managers are driven side by side, one per path."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pagedkv as pk
import pytest
from pagedkv.errors import InvalidArgumentError, UnknownRequestError

from tests._util import admit, make_manager, snapshot


def loop_allocate(
    mgr: pk.KVCacheManager,
    ids: Sequence[str],
    num_new: Sequence[int],
    computed: Sequence[int],
    lookahead: int = 0,
) -> tuple[int, list[list[int]]]:
    out: list[list[int]] = []
    for rid, new, comp in zip(ids, num_new, computed, strict=True):
        res = mgr.allocate_slots(
            rid, int(new), num_computed_tokens=int(comp), num_lookahead_tokens=lookahead
        )
        if res is None:
            break
        out.append([int(b) for b in res[0]])
    return len(out), out


def batch_allocate(
    mgr: pk.KVCacheManager, ids: Sequence[str], num_new: Any, computed: Any, lookahead: int = 0
) -> tuple[int, list[list[int]]]:
    n_ok, groups = mgr.allocate_slots_batch(
        list(ids), num_new, computed, num_lookahead_tokens=lookahead
    )
    assert len(groups) == 1
    block_ids, offsets = groups[0]
    assert block_ids.dtype == np.int32 and offsets.dtype == np.int32
    assert len(offsets) == n_ok + 1 and offsets[0] == 0 and offsets[-1] == len(block_ids)
    return n_ok, [[int(b) for b in block_ids[offsets[i] : offsets[i + 1]]] for i in range(n_ok)]


def twin_managers(
    setup: Callable[[pk.KVCacheManager], list[str]], **kwargs: Any
) -> tuple[pk.KVCacheManager, pk.KVCacheManager, list[str]]:
    kwargs.setdefault("log_stats", True)
    kwargs.setdefault("enable_kv_cache_events", True)
    loop_mgr, batch_mgr = make_manager(**kwargs), make_manager(**kwargs)
    ids = setup(loop_mgr)
    assert setup(batch_mgr) == ids
    assert_same_state(loop_mgr, batch_mgr, ids)
    return loop_mgr, batch_mgr, ids


def assert_same_state(a: pk.KVCacheManager, b: pk.KVCacheManager, ids: Sequence[str]) -> None:
    assert snapshot(a, ids) == snapshot(b, ids)
    assert a.take_events() == b.take_events()
    assert a.make_prefix_cache_stats() == b.make_prefix_cache_stats()
    a.check_invariants()
    b.check_invariants()


def admitted(prompts: dict[str, list[int]]) -> Callable[[pk.KVCacheManager], list[str]]:
    def setup(mgr: pk.KVCacheManager) -> list[str]:
        for rid, tokens in prompts.items():
            mgr.add_request(rid, tokens)
            _, new = admit(mgr, rid)
            assert new is not None
        return list(prompts)

    return setup


def step(
    mgrs: Sequence[pk.KVCacheManager], ids: Sequence[str], tokens: dict[str, list[int]]
) -> list[int]:
    """Appends sampled tokens to every running request; returns the computed counts."""
    computed = []
    for rid in ids:
        computed.append(mgrs[0].num_tokens(rid))
        for mgr in mgrs:
            mgr.append_token_ids(rid, tokens[rid])
    return computed


def test_batch_decode_steps_match_per_request_allocation() -> None:
    # Prompts ending at, before and after block boundaries; some share a prefix.
    prompts = {
        "a": list(range(16)),
        "b": list(range(16)) + [7] * 15,
        "c": [3] * 20,
        "d": list(range(100, 147)),
        "e": list(range(16)) + [8] * 2,
    }
    loop_mgr, batch_mgr, ids = twin_managers(admitted(prompts), block_size=16, num_blocks=40)
    for t in range(40):
        computed = step((loop_mgr, batch_mgr), ids, {rid: [1000 + t] for rid in ids})
        expected = loop_allocate(loop_mgr, ids, [1] * len(ids), computed)
        assert batch_allocate(batch_mgr, ids, 1, np.array(computed)) == expected
        assert expected[0] == len(ids)
        assert_same_state(loop_mgr, batch_mgr, ids)
    # Decode blocks filled up and were cached along the way.
    assert batch_mgr.num_cached_block_hashes > 10


@pytest.mark.parametrize(
    "one", [1, np.int64(1), np.int32(1), True], ids=["int", "int64", "int32", "bool"]
)
def test_one_count_for_every_request_is_broadcast(one: Any) -> None:
    prompts = {"a": list(range(16)), "b": [3] * 20, "c": list(range(100, 131))}
    loop_mgr, batch_mgr, ids = twin_managers(admitted(prompts), block_size=16, num_blocks=40)
    for t in range(20):
        computed = step((loop_mgr, batch_mgr), ids, {rid: [1000 + t] for rid in ids})
        expected = loop_allocate(loop_mgr, ids, [1] * len(ids), computed)
        assert batch_allocate(batch_mgr, ids, one, computed) == expected
        assert_same_state(loop_mgr, batch_mgr, ids)
    with pytest.raises(TypeError):
        batch_mgr.allocate_slots_batch(ids, 1.0, [0] * len(ids))  # type: ignore[arg-type]
    # The refused call changed nothing: the twins are still alike.
    assert_same_state(loop_mgr, batch_mgr, ids)


@pytest.mark.parametrize(
    "form",
    [list, tuple, lambda c: [np.int64(v) for v in c], lambda c: [*c[:-1], np.int32(c[-1])]],
    ids=["ints", "tuple", "numpy_ints", "one_numpy_int"],
)
def test_count_lists_of_any_int_items_read_alike(form: Callable[[list[int]], Any]) -> None:
    # A list of exact ints is read in place; any other item sends the whole
    # list through the general conversion, with the same result.
    prompts = {"a": list(range(16)), "b": [3] * 20, "c": list(range(100, 131))}
    loop_mgr, batch_mgr, ids = twin_managers(admitted(prompts), block_size=16, num_blocks=40)
    for t in range(20):
        computed = step((loop_mgr, batch_mgr), ids, {rid: [1000 + t] for rid in ids})
        expected = loop_allocate(loop_mgr, ids, [1] * len(ids), computed)
        assert batch_allocate(batch_mgr, ids, form([1] * len(ids)), form(computed)) == expected
        assert_same_state(loop_mgr, batch_mgr, ids)


@pytest.mark.parametrize(
    ("counts", "exc", "match"),
    [
        ([1, -1, 1], InvalidArgumentError, "non-negative, got -1"),
        ([1, np.int64(-2), 1], InvalidArgumentError, "non-negative, got -2"),
        ([1, 2**70, 1], OverflowError, None),
        ([1, "1", 1], TypeError, None),
        ([1, 1.0, 1], TypeError, None),
    ],
    ids=["negative", "negative_numpy", "too_large", "str", "float"],
)
def test_bad_items_in_a_count_list_are_refused_and_change_nothing(
    counts: list[Any], exc: type[BaseException], match: str | None
) -> None:
    mgr = make_manager(log_stats=True, enable_kv_cache_events=True)
    ids = admitted({"a": [1] * 20, "b": [2] * 20, "c": [3] * 20})(mgr)
    before = snapshot(mgr, ids)
    for new, computed in ((counts, [20, 20, 20]), ([1, 1, 1], counts)):
        with pytest.raises(exc, match=match):
            mgr.allocate_slots_batch(ids, new, computed)
        assert snapshot(mgr, ids) == before
    mgr.check_invariants()


def test_broadcast_count_follows_the_batch_size_and_value_from_call_to_call() -> None:
    # The broadcast array is reused between calls: a smaller batch, or another
    # count, must never see the previous call's array.
    prompts = {f"r{i}": list(range(20 * i, 20 * i + 14)) for i in range(4)}
    loop_mgr, batch_mgr, ids = twin_managers(admitted(prompts), block_size=4, num_blocks=200)
    for t, (size, count) in enumerate([(4, 1), (4, 1), (2, 1), (3, 2), (3, 2), (4, 3)]):
        sub = ids[:size]
        computed = step((loop_mgr, batch_mgr), sub, {rid: [t] * count for rid in sub})
        expected = loop_allocate(loop_mgr, sub, [count] * size, computed)
        assert batch_allocate(batch_mgr, sub, count, computed) == expected
        assert_same_state(loop_mgr, batch_mgr, ids)


def test_batch_with_per_request_token_counts_and_lookahead_matches() -> None:
    prompts = {f"r{i}": list(range(50 * i, 50 * i + 5 + 7 * i)) for i in range(6)}
    loop_mgr, batch_mgr, ids = twin_managers(admitted(prompts), block_size=4, num_blocks=200)
    for t in range(12):
        # One sampled token plus t % 4 draft tokens (slots only; drafts never cached).
        num_new = [1 + (t + i) % 4 for i in range(len(ids))]
        computed = step((loop_mgr, batch_mgr), ids, {rid: [t] for rid in ids})
        expected = loop_allocate(loop_mgr, ids, num_new, computed, lookahead=2)
        got = batch_allocate(
            batch_mgr, ids, np.array(num_new, dtype=np.int32), computed, lookahead=2
        )
        assert got == expected
        assert_same_state(loop_mgr, batch_mgr, ids)


@pytest.mark.parametrize("num_blocks", [6, 7, 8, 9, 10])
def test_batch_stops_at_the_first_request_that_does_not_fit(num_blocks: int) -> None:
    # Four 15-token requests (one block each) plus a cached, evictable prefix;
    # each decode step pushes every request into a new block, so the pool runs
    # out part-way through the batch.
    def setup(mgr: pk.KVCacheManager) -> list[str]:
        mgr.add_request("cached", [9] * 32)
        admit(mgr, "cached")
        mgr.remove_request("cached")
        return admitted({f"r{i}": [i] * 15 for i in range(4)})(mgr)

    loop_mgr, batch_mgr, ids = twin_managers(setup, block_size=16, num_blocks=num_blocks)
    computed = step((loop_mgr, batch_mgr), ids, {rid: [1] for rid in ids})
    free_before = loop_mgr.num_free_blocks
    expected = loop_allocate(loop_mgr, ids, [2] * len(ids), computed)
    got = batch_allocate(batch_mgr, ids, 2, computed)
    assert got == expected
    assert got[0] == min(free_before, len(ids))
    assert_same_state(loop_mgr, batch_mgr, ids)
    # Requests after the failure point got nothing.
    for rid in ids[got[0] :]:
        assert len(batch_mgr.get_block_ids(rid)[0]) == 1


def test_empty_batch_allocates_nothing() -> None:
    mgr = make_manager()
    before = snapshot(mgr)
    n_ok, ((block_ids, offsets),) = mgr.allocate_slots_batch([], 1, np.array([], dtype=np.int64))
    assert n_ok == 0 and len(block_ids) == 0 and list(offsets) == [0]
    assert snapshot(mgr) == before


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        (lambda m: m.allocate_slots_batch(["a", "b", "zz"], 1, [55, 53, 0]), UnknownRequestError),
        (lambda m: m.allocate_slots_batch(["a", "b"], 1, [55, 1000]), InvalidArgumentError),
        (lambda m: m.allocate_slots_batch(["a", "b"], [1, 1, 1], [55, 53]), InvalidArgumentError),
        (lambda m: m.allocate_slots_batch(["a", "b"], 1, [55]), InvalidArgumentError),
    ],
    ids=["unknown_id", "computed_past_tokens", "counts_length", "computed_length"],
)
def test_invalid_batch_raises_before_allocating_anything(
    call: Callable[..., Any], exc: type[BaseException]
) -> None:
    mgr = make_manager(log_stats=True, enable_kv_cache_events=True)
    admitted({"a": [1] * 55, "b": [2] * 53})(mgr)
    mgr.append_token_ids("a", [5] * 10)  # "a" needs a new block at the next step
    mgr.take_events()
    mgr.make_prefix_cache_stats()
    before = snapshot(mgr, ["a", "b"])
    with pytest.raises(exc):
        call(mgr)
    assert snapshot(mgr, ["a", "b"]) == before
    assert mgr.take_events() == []
    mgr.check_invariants()


def test_append_token_ids_batch_equals_appending_one_by_one() -> None:
    a, b = make_manager(block_size=4, num_blocks=64), make_manager(block_size=4, num_blocks=64)
    for m in (a, b):
        m.add_request("x", list(range(10)))
        m.add_request("y", list(range(100, 107)))
    for step in range(9):
        toks = [1000 + step, 2000 + step]
        a.append_token_ids_batch(["x", "y"], toks)
        b.append_token_ids("x", [toks[0]])
        b.append_token_ids("y", [toks[1]])
    for rid in ("x", "y"):
        assert a.block_hashes(rid) == b.block_hashes(rid)
        assert a.num_tokens(rid) == b.num_tokens(rid)
    assert len(a.block_hashes("x")) == 19 // 4


def test_append_token_ids_batch_with_an_unknown_id_appends_nothing() -> None:
    m = make_manager(block_size=4, num_blocks=64)
    m.add_request("x", list(range(10)))
    with pytest.raises(pk.UnknownRequestError):
        m.append_token_ids_batch(["x", "nope"], [1, 2])
    assert m.num_tokens("x") == 10
    with pytest.raises(pk.InvalidArgumentError):
        m.append_token_ids_batch(["x"], [1, 2])
    assert m.num_tokens("x") == 10


def test_batch_allocation_can_take_the_computed_counts_the_manager_tracks() -> None:
    """``num_computed_tokens=None``: each request's count is what its last
    allocated step scheduled through, so decode steps need no per-request list;
    the block ids are those of explicit counts."""
    spec = pk.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float16")
    config = pk.KVCacheConfig(num_blocks=200, kv_cache_groups=[pk.KVCacheGroupSpec(["l"], spec)])
    managers = [pk.KVCacheManager(config, 4096) for _ in range(2)]
    handles: list[list[int]] = [[], []]
    lengths = [40, 70, 33]
    for k, m in enumerate(managers):
        m.add_request("shared", list(range(64)))
        hit = m.get_computed_blocks("shared")
        m.allocate_slots("shared", 64, num_computed_tokens=0, new_computed_blocks=hit)
        m.remove_request("shared")
        for i, n in enumerate(lengths):
            rid = f"r{i}"
            handles[k].append(m.add_request(rid, list(range(n))))
            hit = m.get_computed_blocks(rid)
            m.allocate_slots(
                rid, n - hit.num_computed_tokens, num_computed_tokens=0, new_computed_blocks=hit
            )
    # r0 (40 tokens) and r1 hit the cached prefix; tracked counts include the hit.
    for step in range(40):
        explicit = np.array([n + step for n in lengths], dtype=np.int64)
        a = managers[0].allocate_slots_batch(handles[0], 1, explicit)
        b = managers[1].allocate_slots_batch(np.array(handles[1], dtype=np.int64), 1)
        assert a[0] == b[0] == 3
        assert [x.tolist() for g in a[1] for x in g] == [x.tolist() for g in b[1] for x in g]
        for k, m in enumerate(managers):
            m.append_token_ids_batch(handles[k], [7, 8, 9])
    # A request never allocated tracks 0 computed tokens: its first step is a prefill.
    m = managers[1]
    h = m.add_request("fresh", list(range(20)))
    n_ok, groups = m.allocate_slots_batch([h], 20)
    assert n_ok == 1 and len(groups[0][0]) == 2
    before = snapshot(m, ["fresh", "r0", "r1", "r2"])
    with pytest.raises(pk.PagedKVError):
        m.allocate_slots_batch(["nope"], 1)
    assert snapshot(m, ["fresh", "r0", "r1", "r2"]) == before
    m.check_invariants()


def test_sampled_tokens_in_the_batch_call_equal_appending_them_first() -> None:
    """``append_token_ids``: each request's sampled token (None or a negative value
    for a request that sampled none) appended in the same call as its step; the
    block ids, hashes, events and stats are those of ``append_token_ids_batch``
    followed by ``allocate_slots_batch``, whichever form the tokens take."""
    lengths = {"a": 30, "b": 47, "c": 33}

    def setup(m: pk.KVCacheManager) -> list[str]:
        return admitted({rid: [ord(rid)] * n for rid, n in lengths.items()})(m)

    forms: list[Callable[[list[int | None]], Any]] = [
        list,
        lambda t: [-1 if x is None else x for x in t],
        lambda t: np.array([-1 if x is None else x for x in t], dtype=np.int64),
        lambda t: np.array([-1 if x is None else x for x in t], dtype=np.int32),
        lambda t: tuple(t),
    ]
    for form in forms:
        split, fused, ids = twin_managers(setup, block_size=4, num_blocks=96)
        handles = [fused.request_handle(rid) for rid in ids]
        for step in range(24):
            # "c" samples nothing every third step (a chunk of a longer prefill).
            toks: list[int | None] = [
                None if rid == "c" and step % 3 == 0 else 100 + step for rid in ids
            ]
            new = [1 if t is not None else 2 for t in toks]
            computed = [split.num_tokens(rid) for rid in ids]
            sampled = [(rid, t) for rid, t in zip(ids, toks, strict=True) if t is not None]
            split.append_token_ids_batch([r for r, _ in sampled], [t for _, t in sampled])
            want = batch_allocate(split, ids, new, computed)
            n_ok, groups = fused.allocate_slots_batch(
                handles, new, computed, append_token_ids=form(toks)
            )
            ((block_ids, offsets),) = groups
            got = [[int(b) for b in block_ids[offsets[i] : offsets[i + 1]]] for i in range(n_ok)]
            assert (n_ok, got) == want, f"{form}: step {step}"
            assert_same_state(split, fused, ids)
        # A uint32 array: every request sampled a token.
        toks32 = np.array([7, 8, 9], dtype=np.uint32)
        split.append_token_ids_batch(ids, toks32)
        want = batch_allocate(split, ids, 1, [split.num_tokens(r) - 1 for r in ids])
        n_ok, groups = fused.allocate_slots_batch(
            ids, 1, [fused.num_tokens(r) for r in ids], append_token_ids=toks32
        )
        assert n_ok == want[0]
        assert_same_state(split, fused, ids)


@pytest.mark.parametrize(
    ("tokens", "exc"),
    [
        ([1], InvalidArgumentError),  # one token for two requests
        ([1, 2, 3], InvalidArgumentError),
        (5, TypeError),
        ("ab", TypeError),
        ([1, 1.0], TypeError),
        ([1, True], TypeError),
        ([1, "x"], TypeError),
        ([1, 2**32], InvalidArgumentError),
        ([1, 2**100], InvalidArgumentError),
        (np.array([1.0, 2.0]), TypeError),
        (np.array([[1, 2]]), TypeError),
        (np.array([1, 2**40], dtype=np.int64), InvalidArgumentError),
    ],
    ids=[
        "short",
        "long",
        "int",
        "str",
        "float_item",
        "bool_item",
        "str_item",
        "past_u32",
        "past_u64",
        "numpy_float",
        "numpy_2d",
        "numpy_past_u32",
    ],
)
def test_bad_sampled_tokens_change_nothing(tokens: Any, exc: type[BaseException]) -> None:
    mgr = make_manager(log_stats=True, enable_kv_cache_events=True)
    admitted({"a": [1] * 55, "b": [2] * 53})(mgr)
    mgr.take_events()
    mgr.make_prefix_cache_stats()
    before = snapshot(mgr, ["a", "b"])
    with pytest.raises(exc):
        mgr.allocate_slots_batch(["a", "b"], 1, [55, 53], append_token_ids=tokens)
    assert snapshot(mgr, ["a", "b"]) == before
    assert mgr.take_events() == []
    # Refused after the tokens were read: counts past the tokens the call appends.
    with pytest.raises(InvalidArgumentError):
        mgr.allocate_slots_batch(["a", "b"], 1, [56, 55], append_token_ids=[9, 9])
    assert snapshot(mgr, ["a", "b"]) == before
    mgr.check_invariants()


def test_the_scheduler_loop_allocates_the_same_with_tokens_in_their_own_call() -> None:
    """``ManagerBackend(tokens_with_allocation=False)`` hands each step's sampled
    tokens over in ``append_token_ids_batch``; the allocations are those of the
    default, which sends them with the next ``allocate_slots_batch``."""
    from pagedkv._oracle.trace import TraceConfig, generate
    from pagedkv.sim import ManagerBackend, Scheduler, SchedulerConfig, drive

    reqs = generate(TraceConfig(seed=3, num_requests=60)).scheduler_requests()
    checksums, calls = [], []
    for with_allocation in (True, False):
        spec = pk.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float16")
        config = pk.KVCacheConfig(
            num_blocks=512, kv_cache_groups=[pk.KVCacheGroupSpec(["l"], spec)]
        )
        backend = ManagerBackend(
            pk.KVCacheManager(config, 16384), tokens_with_allocation=with_allocation
        )
        sched = Scheduler(backend, SchedulerConfig(max_num_batched_tokens=2048))
        drive(sched, [r.fresh() for r in reqs])
        checksums.append(sched.stats.alloc_checksum)
        calls.append("append_token_ids_batch" in sched.stats.ns)
    assert checksums[0] == checksums[1]
    assert calls == [False, True]
