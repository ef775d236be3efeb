"""Request handles: ``add_request`` returns an int that batch calls accept in place
of the request id (skipping the id lookup). Calls by handle and by id give the same
results; a removed request's handle is refused (never taken for the request that
reuses its slot) and leaves the manager unchanged. Also the token-list fast path:
exact ints take it, everything else still converts or is refused as before."""

from __future__ import annotations

import enum
from typing import Any

import numpy as np
import pagedkv as pk
import pytest
from pagedkv.errors import InvalidArgumentError, UnknownRequestError

from tests._util import admit, as_lists, make_manager, snapshot


def _admit_all(mgr: pk.KVCacheManager, n: int, prompt_len: int) -> list[int]:
    handles = []
    for i in range(n):
        h = mgr.add_request(f"r{i}", [i * 1000 + t for t in range(prompt_len)])
        assert isinstance(h, int)
        assert mgr.request_handle(f"r{i}") == h
        hit = mgr.get_computed_blocks(f"r{i}")
        assert (
            mgr.allocate_slots(
                f"r{i}",
                prompt_len - hit.num_computed_tokens,
                num_computed_tokens=0,
                new_computed_blocks=hit,
            )
            is not None
        )
        handles.append(h)
    return handles


@pytest.mark.parametrize("form", ["list", "int64", "uint64"])
def test_batch_by_handle_equals_batch_by_id(form: str) -> None:
    by_id, by_handle = make_manager(4, 64), make_manager(4, 64)
    ids = [f"r{i}" for i in range(5)]
    _admit_all(by_id, 5, 6)
    handles = _admit_all(by_handle, 5, 6)
    refs: Any = {
        "list": handles,
        "int64": np.array(handles, dtype=np.int64),
        "uint64": np.array(handles, dtype=np.uint64),
    }[form]
    for step in range(9):
        computed = np.full(5, 6 + step, dtype=np.int64)
        a = by_id.allocate_slots_batch(ids, 1, computed)
        b = by_handle.allocate_slots_batch(refs, 1, computed)
        assert a[0] == b[0]
        for (ia, oa), (ib, ob) in zip(a[1], b[1], strict=True):
            assert ia.tolist() == ib.tolist() and oa.tolist() == ob.tolist()
        toks = [7 * step + i for i in range(5)]
        by_id.append_token_ids_batch(ids, toks)
        by_handle.append_token_ids_batch(refs, toks)
    assert snapshot(by_id, ids) == snapshot(by_handle, ids)
    by_handle.check_invariants()


def test_removed_handle_is_refused_even_when_its_slot_is_reused() -> None:
    mgr = make_manager(4, 64)
    (old,) = _admit_all(mgr, 1, 6)
    mgr.remove_request("r0")
    new = mgr.add_request("n", list(range(6)))
    assert new != old
    assert new & 0xFFFFFFFF == old & 0xFFFFFFFF  # the slot is reused, the handle is not
    mgr.allocate_slots("n", 6, num_computed_tokens=0)
    before = snapshot(mgr, ["n"])
    for bad in ([new, old], np.array([new, -1], dtype=np.int64), [new, 2**63]):
        with pytest.raises(UnknownRequestError):
            mgr.allocate_slots_batch(bad, 1, [6, 6])
        with pytest.raises(UnknownRequestError):
            mgr.append_token_ids_batch(bad, [1, 2])
    assert snapshot(mgr, ["n"]) == before
    with pytest.raises(UnknownRequestError):
        mgr.request_handle("r0")
    with pytest.raises(TypeError):
        mgr.allocate_slots_batch([new, -1], 1, [6, 6])
    with pytest.raises(TypeError):
        mgr.allocate_slots_batch("n", 1, [6])
    assert snapshot(mgr, ["n"]) == before
    mgr.check_invariants()


def test_another_managers_handle_is_refused() -> None:
    # Two managers with the same history issue handles for the same slot; each
    # handle names its manager, so the other one refuses it and changes nothing.
    a, b = make_manager(4, 64), make_manager(4, 64)
    (ha,) = _admit_all(a, 1, 6)
    (hb,) = _admit_all(b, 1, 6)
    assert ha != hb
    before = snapshot(b, ["r0"])
    with pytest.raises(UnknownRequestError, match="another manager"):
        b.allocate_slots_batch([ha], 1, [6])
    with pytest.raises(UnknownRequestError, match="another manager"):
        b.append_token_ids_batch(np.array([ha], dtype=np.int64), [1])
    assert snapshot(b, ["r0"]) == before
    assert b.allocate_slots_batch([hb], 1, [6]) is not None
    b.check_invariants()


class _Tok(enum.IntEnum):
    A = 5


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        ([0, 1, 2**32 - 1, 17], [0, 1, 2**32 - 1, 17]),
        ([_Tok.A, np.int64(9), np.uint32(3)], [5, 9, 3]),  # not exact ints: the slow path
    ],
)
def test_token_list_conversion(tokens: list[Any], expected: list[int]) -> None:
    a, b = make_manager(2, 16), make_manager(2, 16)
    a.add_request("r", tokens)
    b.add_request("r", np.array(expected, dtype=np.uint32))
    assert a.block_hashes("r") == b.block_hashes("r")
    assert a.num_tokens("r") == len(expected)


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ([1, -1], InvalidArgumentError),
        ([1, 2**32], InvalidArgumentError),
        ([1, 2**64], InvalidArgumentError),
        ([1, -(2**70)], InvalidArgumentError),
        ([1, True], TypeError),
        ([1, 2.0], TypeError),
        ([1, "2"], TypeError),
        ([1, None], TypeError),
    ],
)
def test_bad_token_in_list_is_refused_without_change(bad: list[Any], error: type) -> None:
    mgr = make_manager(2, 16)
    mgr.add_request("ok", [1, 2, 3])
    before = snapshot(mgr, ["ok"])
    with pytest.raises(error):
        mgr.add_request("r", bad)
    with pytest.raises(error):
        mgr.append_token_ids("ok", bad)
    with pytest.raises(error):
        mgr.append_token_ids_batch(["ok", "ok"], bad)
    assert snapshot(mgr, ["ok"]) == before
    assert as_lists(mgr.get_block_ids("ok")) == ([],)
    mgr.check_invariants()


def _layouts(values: list[int], dtype: Any) -> dict[str, np.ndarray]:
    """The same integers as NumPy arrays laid out every way an array can be:
    contiguous, a strided view, byte-swapped, and misaligned in its buffer."""
    a = np.array(values, dtype=dtype)
    wide = np.repeat(a, 2)
    raw = b"\0" + a.tobytes()
    return {
        "contiguous": a,
        "strided": wide[::2],
        "byte-swapped": a.astype(a.dtype.newbyteorder()),
        "misaligned": np.frombuffer(raw, dtype=a.dtype, offset=1),
    }


@pytest.mark.parametrize("dtype", [np.uint32, np.int32, np.int64, np.uint64])
def test_integer_arrays_of_any_layout_read_as_their_values(dtype: Any) -> None:
    """A prompt, a batch's handles, computed counts and sampled tokens read the
    same from a NumPy array of any integer type and any layout (a strided view
    or a misaligned buffer is read item by item) as from a list."""
    prompt = [t * 37 % 60_000 for t in range(70)]
    ref = make_manager(16, 64)
    ref.add_request("list", prompt)
    for name, arr in _layouts(prompt, dtype).items():
        m = make_manager(16, 64)
        m.add_request("r", arr)
        assert m.block_hashes("r") == ref.block_hashes("list"), name

    def run(form: Any) -> list[Any]:
        m = make_manager(4, 64)
        handles = _admit_all(m, 3, 6)
        out = []
        for step in range(6):
            refs = form(handles, np.int64)
            computed = form([6 + step] * 3, dtype)
            tokens = form([50 + step, 60 + step, 70 + step], dtype)
            n, groups = m.allocate_slots_batch(refs, 1, computed, append_token_ids=tokens)
            out.append((n, [(i.tolist(), o.tolist()) for i, o in groups]))
        return [*out, snapshot(m, [f"r{i}" for i in range(3)])]

    expected = run(lambda v, _dt: list(v))
    for layout in ("contiguous", "strided", "byte-swapped", "misaligned"):
        assert run(lambda v, dt, layout=layout: _layouts(v, dt)[layout]) == expected, layout


@pytest.mark.parametrize("length", [1023, 1024, 1025, 4000])
@pytest.mark.parametrize("dtype", [np.uint32, np.int64])
def test_arrays_either_side_of_the_copied_size_read_alike(length: int, dtype: Any) -> None:
    """Arrays of up to 1,024 items are copied out, longer ones read in place:
    prompts and count arrays of either size, in every layout, read as lists."""
    prompt = [t * 37 % 60_000 for t in range(length)]
    ref = make_manager(16, 512, max_model_len=8192)
    ref.add_request("list", prompt)
    for name, arr in _layouts(prompt, dtype).items():
        m = make_manager(16, 512, max_model_len=8192)
        m.add_request("r", arr)
        assert m.block_hashes("r") == ref.block_hashes("list"), name
        assert m.num_tokens("r") == length, name
    # Up to 1,100 requests of one full block, each taking a second one:
    # handles and counts of about that length.
    n = min(length, 1100)
    for name, form in [("list", list), *[(k, k) for k in _layouts([0], np.int64)]]:
        m = make_manager(4, 2 * n + 8, max_model_len=64)
        handles = [m.add_request(f"r{i}", [i, i + 1, i + 2, i + 3]) for i in range(n)]
        for i in range(n):
            admit(m, f"r{i}")

        def arr(v: list[int], dt: Any, form: Any = form) -> Any:
            return list(v) if form is list else _layouts(v, dt)[form]

        got = m.allocate_slots_batch(
            arr(handles, np.int64), arr([1] * n, dtype), arr([4] * n, dtype)
        )
        assert got[0] == n, name
        assert got[1][0][1].tolist() == list(range(n + 1)), name


@pytest.mark.parametrize("dtype", [np.uint32, np.int64])
def test_a_broadcast_array_is_refused_not_copied(dtype: Any) -> None:
    """A view whose items overlap (``np.broadcast_to``: a trillion items in a
    few bytes) is refused with a TypeError before anything is copied, as a
    prompt, a batch's handles or counts, or sampled tokens; the manager is
    unchanged and keeps serving."""
    m = make_manager(4, 64)
    handles = _admit_all(m, 3, 6)
    before = snapshot(m, ["r0", "r1", "r2"])
    huge = np.broadcast_to(np.array([7], dtype=dtype), (10**12,))
    with pytest.raises(TypeError, match="overlap"):
        m.add_request("new", huge)
    three = np.broadcast_to(np.array([1], dtype=np.int64), (3,))
    calls = [
        lambda: m.allocate_slots_batch(np.broadcast_to(np.int64(handles[0]), (3,)), 1, [6, 6, 6]),
        lambda: m.allocate_slots_batch(handles, three, [6, 6, 6]),
        lambda: m.allocate_slots_batch(handles, 1, np.broadcast_to(np.array([6]), (3,))),
        lambda: m.allocate_slots_batch(handles, 1, [6, 6, 6], append_token_ids=huge),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="overlap"):
            call()
    assert snapshot(m, ["r0", "r1", "r2"]) == before and "new" not in m
    # A strided view of the same values is read (copied) as before.
    ok = m.allocate_slots_batch(handles, np.repeat(three, 2)[::2], [6, 6, 6])
    assert ok[0] == 3
