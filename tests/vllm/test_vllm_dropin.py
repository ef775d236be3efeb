"""The engine-driven calls behind ``pagedkv.vllm`` (vLLM 0.33's manager API).

Without vLLM these run the core's engine mode through pagedkv's own API, with
block hashes vLLM 0.33 computed (``vllm_request_hashes.json``) and vLLM's
expected block ids; with vLLM installed, the drop-in is also run side by side
with vLLM's own ``KVCacheManager`` on the same ``Request`` objects.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Sequence
from typing import Any

import pagedkv as pk
import pytest
from pagedkv.errors import (
    InvalidArgumentError,
    InvariantViolationError,
    StaleComputedBlocksError,
    UnknownRequestError,
)

from tests._util import load_vectors, make_manager

REQUESTS = load_vectors("vllm_request_hashes.json")


def engine_manager(block_size: int = 16, num_blocks: int = 11, **kw: Any) -> pk.KVCacheManager:
    return make_manager(
        block_size,
        num_blocks,
        external_block_hashes=True,
        record_stats_at_admission=False,
        enable_kv_cache_events=True,
        log_stats=True,
        **kw,
    )


def vllm_case(block_size: int) -> tuple[list[int], list[bytes]]:
    """A prompt and the block hashes vLLM 0.33 gave it (no extra keys)."""
    for c in REQUESTS["cases"]:
        if c["block_size"] == block_size and not c["mm_features"] and c["lora_name"] is None:
            if c["cache_salt"] is None:
                return c["token_ids"], [bytes.fromhex(b["hash"]) for b in c["blocks"]]
    raise AssertionError(f"no plain case of block size {block_size}")


def admit(m: pk.KVCacheManager, rid: str) -> tuple[list[int], int, list[int] | None]:
    hit = m.get_computed_blocks(rid)
    n = m.num_tokens(rid)
    new = m.allocate_slots(
        rid, n - hit.num_computed_tokens, num_computed_tokens=0, new_computed_blocks=hit
    )
    return (
        hit.block_ids[0].tolist() if hit.block_ids else [],
        hit.num_computed_tokens,
        None if new is None else new[0].tolist(),
    )


def test_hits_and_events_use_the_hashes_vllm_computed() -> None:
    tokens, hashes = vllm_case(4)
    m = engine_manager(block_size=4)
    for rid in ("a", "b"):
        m.add_request(rid, tokens, session_id=f"s-{rid}")
        m.sync_request(rid, tokens, hashes)
        assert m.block_hashes(rid) == hashes
    assert admit(m, "a")[1] == 0
    blocks, hit, _ = admit(m, "b")
    full = len(tokens) // 4
    # The last token is always recomputed: a prompt of whole blocks hits one less.
    expect = full - 1 if len(tokens) % 4 == 0 else full
    assert hit == expect * 4
    assert blocks == list(range(1, expect + 1))
    (stored,) = [e for e in m.take_events(raw_hashes=True) if isinstance(e, pk.BlockStored)]
    assert stored.block_hashes == hashes[:full]
    assert stored.session_id == "s-a"
    m.check_invariants()


def test_sync_request_reads_only_what_the_manager_lacks() -> None:
    m = engine_manager()
    tokens = list(range(20))
    m.add_request("r", tokens)
    h0 = bytes(range(32))
    m.sync_request("r", [*tokens, 7, -1], [h0])
    assert m.num_tokens("r") == 22
    assert m.block_hashes("r") == [h0]
    # The same lists again: nothing to add. Shorter lists are a rewrite: the
    # request is cut back to them (tests/core/test_engine_rewrite.py).
    assert m.sync_request("r", [*tokens, 7, -1], [h0]) is False
    assert m.num_tokens("r") == 22
    assert m.sync_request("r", tokens[:17], [h0]) is True
    assert m.num_tokens("r") == 17
    m.sync_request("r", [*tokens, 7, -1], [h0])
    with pytest.raises(TypeError, match="bytes"):
        m.sync_request("r", [*tokens, 7, -1], [h0, "not bytes"])
    with pytest.raises(InvalidArgumentError, match="outside"):
        m.sync_request("r", [*tokens, 7, -1, 2**31], [h0])
    assert (m.num_tokens("r"), m.block_hashes("r")) == (22, [h0])
    # A boundary past max_model_len refuses the whole sync: no token lands.
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        m.sync_request("r", [*tokens, 7, -1, 8], [h0], 10**9)
    assert m.num_tokens("r") == 22


class _ReadOnlyTokens(Sequence[int]):
    """A read-only view of a token list (as vLLM's ``ConstantList``)."""

    def __init__(self, items: list[int]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: Any) -> Any:
        return self._items[i]


@pytest.mark.parametrize("kind", [list, tuple, _ReadOnlyTokens])
def test_sync_reads_new_tokens_from_any_sequence(kind: Any) -> None:
    # A list's new tokens are read in place, anything else through a slice:
    # the same tokens either way, a placeholder (-1) among them.
    m = engine_manager(block_size=4)
    m.add_request("r", [5, 6])
    m.sync_request("r", kind([5, 6, 7, -1]), [b"\x01" * 8])
    m.sync_request("r", kind([5, 6, 7, -1]), [b"\x01" * 8])  # nothing new
    m.sync_request("r", kind([5, 6, 7, -1, 2**31 - 1]), [b"\x01" * 8])
    assert m.num_tokens("r") == 5
    with pytest.raises(InvalidArgumentError, match="outside"):
        m.sync_request("r", kind([5, 6, 7, -1, 2**31 - 1, 2**31]), [b"\x01" * 8])
    assert m.num_tokens("r") == 5
    admit(m, "r")
    (stored,) = [e for e in m.take_events() if isinstance(e, pk.BlockStored)]
    assert stored.token_ids == [5, 6, 7, -1]


@pytest.mark.parametrize("kind", [list, tuple, _ReadOnlyTokens])
def test_sync_reads_new_block_hashes_from_any_sequence(kind: Any) -> None:
    # As the tokens: a list's new hashes are read in place, anything else
    # through a slice; a non-bytes or empty hash changes nothing.
    m = engine_manager(block_size=4)
    m.add_request("r", list(range(12)))
    h = [bytes([i]) * 8 for i in range(3)]
    m.sync_request("r", list(range(12)), kind(h[:1]))
    m.sync_request("r", list(range(12)), kind(h[:1]))  # nothing new
    m.sync_request("r", list(range(12)), kind(h))
    assert m.block_hashes("r") == h
    with pytest.raises(TypeError, match="bytes"):
        m.sync_request("r", list(range(12)), kind([*h, "not bytes"]))
    with pytest.raises(InvalidArgumentError, match="block hash"):
        m.sync_request("r", list(range(12)), kind([*h, b""]))
    assert m.block_hashes("r") == h


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ([True], TypeError),
        ([None], TypeError),
        ([1.0], TypeError),
        ("abc", TypeError),
        ([-(2**31) - 1], InvalidArgumentError),
        ([2**31], InvalidArgumentError),  # past a signed 32-bit id
        ([2**32 - 1], InvalidArgumentError),  # the placeholder's unsigned code
        ([2**32], InvalidArgumentError),
        ([2**70], InvalidArgumentError),
    ],
)
def test_engine_token_ids_are_checked(bad: Any, expected: type[BaseException]) -> None:
    m = engine_manager()
    m.add_request("r", [1, 2])
    with pytest.raises(expected):
        m.sync_request("r", [1, 2, *bad] if isinstance(bad, list) else bad, [])
    with pytest.raises(expected):
        m.add_request("s", bad)
    assert m.num_tokens("r") == 2 and "s" not in m
    # An engine may register a request before any token.
    m.add_request("empty", [])
    assert m.num_tokens("empty") == 0


def test_placeholder_tokens_come_back_as_minus_one_in_events() -> None:
    m = engine_manager(block_size=4)
    prompt = [5, -1, -1, 6, 7]
    m.add_request("r", prompt)
    m.sync_request("r", prompt, [b"\x01" * 8])
    admit(m, "r")
    (stored,) = [e for e in m.take_events() if isinstance(e, pk.BlockStored)]
    assert stored.token_ids == [5, -1, -1, 6]


def test_engine_token_ids_are_signed_32_bit() -> None:
    # vLLM's token ids are Python ints; its tests use other negative ids as
    # markers. They come back in events as they went in, at both ends of the range.
    m = engine_manager(block_size=4)
    prompt = [-2, -(2**31), 2**31 - 1, 0, 9]
    m.add_request("r", prompt)
    m.sync_request("r", [*prompt, -3], [b"\x01" * 8])
    admit(m, "r")
    (stored,) = [e for e in m.take_events() if isinstance(e, pk.BlockStored)]
    assert stored.token_ids == [-2, -(2**31), 2**31 - 1, 0]


def test_a_hashing_manager_refuses_engine_hashes() -> None:
    m = make_manager()
    m.add_request("r", [1, 2, 3])
    with pytest.raises(InvalidArgumentError, match="external_block_hashes"):
        m.sync_request("r", [1, 2, 3, 4], [b"\x01" * 32])
    with pytest.raises(InvalidArgumentError):
        m.add_request("s", [1, -1])
    # Neither call changed anything: "r" keeps its tokens, "s" was not added.
    assert m.num_tokens("r") == 3 and m.block_hashes("r") == []
    assert "s" not in m and m.num_requests == 1
    m.check_invariants()


def test_deferred_free_keeps_blocks_until_free_blocks() -> None:
    # vLLM's test_prefill ids: two requests share three blocks.
    m = engine_manager()
    common = [bytes([1, i]) * 4 for i in range(3)]
    m.add_request("r0", list(range(55)))
    m.sync_request("r0", list(range(55)), common)
    admit(m, "r0")
    r1 = list(range(48)) + list(range(100, 105))
    m.add_request("r1", r1)
    m.sync_request("r1", r1, common)
    assert admit(m, "r1") == ([1, 2, 3], 48, [5])
    popped = m.pop_blocks_for_free("r0").tolist()
    assert popped == [1, 2, 3, 4]
    assert "r0" not in m
    assert m.num_free_blocks == 5
    assert m.num_detached_block_refs == 4
    assert m.block_ref_count(4) == 1
    m.check_invariants()
    with pytest.raises(InvalidArgumentError, match="engine holds only"):
        m.free_blocks([4, 4])
    assert m.num_detached_block_refs == 4
    m.free_blocks(reversed(popped))
    m.remove_request("r1")
    assert m.free_block_ids().tolist() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    m.check_invariants()


def test_capped_lookup_and_hits_named_by_block_ids() -> None:
    m = engine_manager()
    hashes = [bytes([9, i]) * 4 for i in range(3)]
    for rid in ("a", "b"):
        m.add_request(rid, list(range(55)))
        m.sync_request(rid, list(range(55)), hashes)
    admit(m, "a")
    capped = m.get_computed_blocks("b", 40)
    assert (capped.block_ids[0].tolist(), capped.num_computed_tokens) == ([1, 2], 32)
    with pytest.raises(StaleComputedBlocksError):
        m.computed_blocks_from_ids("b", [[1, 4]], 32)
    hit = m.computed_blocks_from_ids("b", [[1, 2]], 32)
    new = m.allocate_slots("b", 23, num_computed_tokens=0, new_computed_blocks=hit)
    assert new is not None and new[0].tolist() == [5, 6]
    assert m.block_ref_count(2) == 2


def test_allocate_slots_synced_syncs_then_allocates_as_vllm() -> None:
    m = engine_manager(num_blocks=5)
    tokens = list(range(40))
    m.add_request("r", tokens[:20])
    args = [0, 40, 0, 0, None, 0, 0, False, 0, False, 0, True, 0, None]
    new = m.allocate_slots_synced("r", tokens, [b"\x01" * 8], *args)
    assert new is not None and new[0].tolist() == [1, 2, 3]
    assert (m.num_tokens("r"), m.block_hashes("r")) == (40, [b"\x01" * 8])
    # A decode step inside the last block takes nothing: `()`, falsy (vLLM's
    # adapter tells it from None and from new blocks by its truth value).
    step = [1, 40, *args[2:]]
    assert m.allocate_slots_synced("r", [*tokens, 9], [b"\x01" * 8], *step) == ()
    assert m.num_tokens("r") == 41
    # A bad count is refused before anything changes.
    bad = [0, -1, *args[2:]]
    with pytest.raises(InvalidArgumentError):
        m.allocate_slots_synced("r", [*tokens, 9, 5], [b"\x01" * 8], *bad)
    assert m.num_tokens("r") == 41
    # A request that can never fit: vLLM's None, not CannotFitError.
    m.add_request("big", list(range(100)))
    assert m.allocate_slots_synced("big", list(range(100)), [], 0, 100, *args[2:]) is None


def _engine_managed_config(*groups: str) -> pk.KVCacheConfig:
    """12 blocks of 4 tokens; the groups named ``indexer`` and ``regular`` are
    full attention, the others are engine-managed."""
    attn = pk.FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float32")
    managed = pk.EngineManagedSpec(block_size=4, page_size=64)
    return pk.KVCacheConfig(
        num_blocks=12,
        kv_cache_groups=[
            pk.KVCacheGroupSpec([g], attn if g in ("indexer", "regular") else managed)
            for g in groups
        ],
    )


def test_engine_managed_groups_count_in_capacity_and_take_no_blocks() -> None:
    # vLLM's HiSparse layout [host source, indexer, resident]: the manager runs
    # the indexer; the engine's groups keep their places and their needs.
    m = pk.KVCacheManager(
        _engine_managed_config("host", "indexer", "resident"),
        max_model_len=256,
        external_block_hashes=True,
        record_stats_at_admission=False,
    )
    tokens = list(range(10))
    m.add_request("r", tokens)
    args = [0, 10, 0, 0, None, 0, 0, False, 0, False, 0, True, 0, None]
    hashes = [b"\x01" * 8, b"\x02" * 8]
    # 3 indexer blocks + 9 the engine takes > 11 free: refused, nothing taken.
    assert m.allocate_slots_synced("r", tokens, hashes, *args, engine_managed_blocks=(9, 0)) is None
    full = [*args[:9], True, *args[10:]]  # full_sequence_must_fit
    assert m.allocate_slots_synced("r", tokens, hashes, *full, engine_managed_blocks=(0, 9)) is None
    assert m.num_free_blocks == 11
    new = m.allocate_slots_synced("r", tokens, hashes, *args, engine_managed_blocks=(8, 8))
    assert new is not None and [g.tolist() for g in new] == [[], [1, 2, 3], []]
    assert m.num_free_blocks == 8
    with pytest.raises(InvalidArgumentError):
        m.allocate_slots_synced("r", tokens, hashes, *args, engine_managed_blocks=(-1, 0))
    m.check_invariants()


def test_engine_managed_blocks_through_pagedkvs_own_allocate_slots() -> None:
    # The same accounting for a manager that hashes its own prompts.
    m = pk.KVCacheManager(_engine_managed_config("indexer", "hot"), max_model_len=256)
    m.add_request("r", list(range(10)))
    hit = m.get_computed_blocks("r")

    def alloc(**kw: Any) -> Any:
        return m.allocate_slots("r", 10, num_computed_tokens=0, new_computed_blocks=hit, **kw)

    assert alloc(engine_managed_blocks=(9, 0)) is None
    assert alloc(full_sequence_must_fit=True, engine_managed_blocks=(0, 9)) is None
    assert m.num_free_blocks == 11
    new = alloc(full_sequence_must_fit=True, engine_managed_blocks=(8, 8))
    assert new is not None and [g.tolist() for g in new] == [[1, 2, 3], []]
    m.check_invariants()


def test_a_split_allocation_through_pagedkvs_own_api() -> None:
    # vLLM's production order [indexer, hot, regular]: the allocation stops
    # before the hot group, the engine takes the hot blocks, and the regular
    # group gets its blocks after them (vLLM allocates group by group).
    m = pk.KVCacheManager(_engine_managed_config("indexer", "hot", "regular"), max_model_len=256)
    m.add_request("r", list(range(10)))
    m.add_request("s", list(range(100, 110)))
    hit = m.get_computed_blocks("r")
    new = m.allocate_slots(
        "r",
        10,
        num_computed_tokens=0,
        new_computed_blocks=hit,
        engine_managed_blocks=(2, 2),
        split_at_group=1,
    )
    assert new is not None and [g.tolist() for g in new] == [[1, 2, 3], [], []]
    # Until it is finished, no other allocation runs.
    with pytest.raises(InvalidArgumentError, match="finish_allocation"):
        m.allocate_slots("s", 10, num_computed_tokens=0)
    assert m.get_new_blocks(2).tolist() == [4, 5]
    rest = m.finish_allocation("r")
    assert [g.tolist() for g in rest] == [[], [], [6, 7, 8]]
    assert [g.tolist() for g in m.get_block_ids("r")] == [[1, 2, 3], [], [6, 7, 8]]
    with pytest.raises(InvalidArgumentError):
        m.finish_allocation("r")
    m.free_blocks([4, 5])
    m.check_invariants()


def _hisparse_config(num_blocks: int = 32) -> pk.KVCacheConfig:
    """vLLM's HiSparse test layout in pagedkv's own specs: ``[indexer, resident,
    hot]`` (the host source is the engine's business), blocks of 4 tokens."""
    attn = pk.FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float32")
    return pk.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_groups=[
            pk.KVCacheGroupSpec(["indexer"], attn),
            pk.KVCacheGroupSpec(["resident"], pk.HiSparseResidentSpec(block_size=4, page_size=64)),
            pk.KVCacheGroupSpec(
                ["hot"], pk.HiSparseHotSpec(block_size=4, page_size=64, blocks_per_request=2)
            ),
        ],
    )


def test_hisparse_resident_and_hot_groups_through_pagedkvs_own_api() -> None:
    # vLLM's HiSparseResidentManager / HiSparseHotManager rules, in the core:
    # a cold admission takes resident pages (engine-held) and no hot region; a
    # prefix hit starts the row with host-only pages and takes the region; the
    # engine's residency overlay; a release stopped at the resident group.
    m = pk.KVCacheManager(_hisparse_config(), max_model_len=256)
    m.add_request("a", list(range(12)))
    new = m.allocate_slots("a", 12, num_computed_tokens=0)
    assert new is not None and [g.tolist() for g in new] == [[1, 2, 3], [4, 5, 6], []]
    assert m.num_detached_block_refs == 3
    assert not m.hisparse_hot_required("a", 2)
    m.add_request("b", list(range(12)))
    hit = m.get_computed_blocks("b")
    assert hit.num_computed_tokens == 8
    new = m.allocate_slots("b", 4, num_computed_tokens=0, new_computed_blocks=hit)
    assert new is not None and [g.tolist() for g in new] == [[7], [8], [9, 10]]
    assert [g.tolist() for g in m.get_block_ids("b")] == [[1, 2, 7], [0, 0, 8], [9, 10]]
    assert m.hisparse_hot_required("b", 2)
    # The engine pins a device copy of page 0 and reads the page from it.
    copy = int(m.get_new_blocks(1)[0])
    assert m.hisparse_adopt_page("b", 1, 0, copy)
    assert not m.hisparse_adopt_page("b", 1, 0, copy)
    assert m.hisparse_resident_page("b", 1, 0) == copy
    assert m.hisparse_residency_row("b", 1).tolist() == [copy, 0, 8]
    assert m.hisparse_drop_page("b", 1, 2) == 8
    assert m.hisparse_resident_page("b", 1, 2) is None
    m.unpin_blocks([8])
    m.check_invariants()
    # The indexer's blocks go first; the engine then lets go of its pages.
    m.free_groups_before("b", 1)
    assert [g.tolist() for g in m.get_block_ids("b")] == [[], [0, 0, 8], [9, 10]]
    popped = m.pop_blocks_for_free("b")
    assert popped.tolist() == [copy, 0, 0, 9, 10]
    m.free_blocks(popped)
    m.remove_request("a")
    assert m.num_detached_block_refs == 0
    assert m.num_free_blocks == 31
    m.check_invariants()


def test_hisparse_adopt_refuses_a_block_the_engine_does_not_pin() -> None:
    # A free block adopted as a resident page would be handed to the next
    # request while the page still reads it: two requests on one block.
    m = pk.KVCacheManager(_hisparse_config(), max_model_len=256)
    m.add_request("a", list(range(12)))
    m.allocate_slots("a", 12, num_computed_tokens=0)
    m.add_request("b", list(range(12)))
    m.allocate_slots("b", 4, num_computed_tokens=0, new_computed_blocks=m.get_computed_blocks("b"))
    row = m.hisparse_residency_row("b", 1).tolist()
    assert row == [0, 0, 8]
    free = m.num_free_blocks
    with pytest.raises(InvalidArgumentError, match="not pinned by the engine"):
        m.hisparse_adopt_page("b", 1, 0, 20)
    m.touch_blocks([1])  # a's indexer block, pinned too
    with pytest.raises(InvalidArgumentError, match="held by a request"):
        m.hisparse_adopt_page("b", 1, 0, 1)
    with pytest.raises(InvalidArgumentError, match="null block"):
        m.hisparse_adopt_page("b", 1, 0, 0)
    assert m.hisparse_residency_row("b", 1).tolist() == row
    assert m.num_free_blocks == free
    m.check_invariants()
    m.unpin_blocks([1])
    # A pinned copy is adopted; returning its pin while the page reads it is
    # caught by the invariant checker.
    copy = int(m.get_new_blocks(1)[0])
    assert m.hisparse_adopt_page("b", 1, 0, copy)
    m.check_invariants()
    m.free_blocks([copy])
    with pytest.raises(InvariantViolationError, match="reads free block"):
        m.check_invariants()


def test_hisparse_adopt_with_pin_takes_the_engine_pin_in_the_same_call() -> None:
    # vLLM's coordinator adopts first and pins right after: with pin=True the
    # core pins as it adopts, so the page never reads a free block.
    m = pk.KVCacheManager(_hisparse_config(), max_model_len=256)
    m.add_request("a", list(range(12)))
    m.allocate_slots("a", 12, num_computed_tokens=0)
    m.add_request("b", list(range(12)))
    m.allocate_slots("b", 4, num_computed_tokens=0, new_computed_blocks=m.get_computed_blocks("b"))
    free = m.num_free_blocks
    assert m.hisparse_adopt_page("b", 1, 0, 20, pin=True)
    assert m.hisparse_residency_row("b", 1).tolist() == [20, 0, 8]
    assert m.num_free_blocks == free - 1
    m.check_invariants()
    assert not m.hisparse_adopt_page("b", 1, 0, 21, pin=True)  # resident already
    assert m.num_free_blocks == free - 1
    with pytest.raises(InvalidArgumentError, match="held by a request"):
        m.hisparse_adopt_page("b", 1, 1, 1, pin=True)
    assert m.num_free_blocks == free - 1
    m.check_invariants()


def test_hisparse_needs_count_imported_tokens_apart() -> None:
    # vLLM's get_num_blocks_to_allocate with a connector's import (computed
    # tokens beyond the locally computed ones): the resident group keeps the
    # import's last page writable and the hot group needs its region; with the
    # same tokens computed locally (a host prefix), host pages stay null.
    m = pk.KVCacheManager(_hisparse_config(), max_model_len=256)
    m.add_request("r", list(range(16)))

    def need(local: int | None) -> int:
        return m.num_blocks_to_allocate(
            "r",
            16,
            total_computed_tokens=8,
            num_tokens_main_model=16,
            num_local_computed_tokens=local,
        )

    # indexer 4; resident: tail page 1 + pages 2-3 = 3; hot 2.
    assert need(0) == 4 + 3 + 2
    # indexer 4; resident: pages 2-3 = 2 (pages 0-1 on host); hot 2.
    assert need(8) == need(None) == 4 + 2 + 2
    with pytest.raises(InvalidArgumentError, match="locally computed"):
        need(9)


def test_hisparse_calls_refuse_bad_input_and_change_nothing() -> None:
    m = pk.KVCacheManager(_hisparse_config(), max_model_len=256)
    m.add_request("a", list(range(8)))
    m.allocate_slots("a", 8, num_computed_tokens=0)
    before = [g.tolist() for g in m.get_block_ids("a")]
    cases: list[tuple[Any, type[Exception]]] = [
        (lambda: m.hisparse_adopt_page("a", 0, 0, 3), InvalidArgumentError),  # not resident
        (lambda: m.hisparse_adopt_page("a", 1, 0, 99), InvalidArgumentError),  # not in the pool
        (lambda: m.hisparse_adopt_page("a", 1, -1, 3), InvalidArgumentError),
        (lambda: m.hisparse_drop_page("nope", 1, 0), UnknownRequestError),
        (lambda: m.hisparse_require_hot("a", 1), InvalidArgumentError),  # not hot
        (lambda: m.hisparse_hot_required("a", 7), InvalidArgumentError),
        (lambda: m.hisparse_allocate_new_blocks("a", 0, 8), InvalidArgumentError),
        (lambda: m.hisparse_residency_row("a", 1, -2), InvalidArgumentError),
        (lambda: m.free_groups_before("a", 4), InvalidArgumentError),
        (lambda: m.pop_blocks_before("a", -1), InvalidArgumentError),
    ]
    for call, exc in cases:
        with pytest.raises(exc):
            call()
        assert [g.tolist() for g in m.get_block_ids("a")] == before
    m.check_invariants()
    # Too few free blocks for a hot region: refused, nothing taken.
    m.hisparse_require_hot("a", 2)
    m.get_new_blocks(m.num_free_blocks - 1)
    free = m.num_free_blocks
    with pytest.raises(InvalidArgumentError, match="not enough free blocks"):
        m.hisparse_allocate_new_blocks("a", 2, 8)
    assert m.num_free_blocks == free
    m.check_invariants()


def test_unpinned_blocks_are_taken_last_and_reported_when_reused() -> None:
    # vLLM's BlockPool.unpin_blocks and its reuse watchers: a released page
    # joins the free queue's tail, cached or not, and is reported once the
    # pool hands it out again.
    m = engine_manager(num_blocks=8)
    pages = m.get_new_blocks(3).tolist()
    assert pages == [1, 2, 3]
    m.touch_blocks([pages[1]])
    m.unpin_blocks([pages[0], pages[1]])
    # Page 1 reaches 0 references and goes last; page 2 is still held once.
    assert m.free_block_ids().tolist() == [4, 5, 6, 7, 1]
    assert m.block_ref_count(pages[1]) == 1
    assert m.get_new_blocks(4).tolist() == [4, 5, 6, 7]
    assert m.take_reused_blocks().tolist() == []
    assert m.get_new_blocks(1).tolist() == [1]
    assert m.take_reused_blocks().tolist() == [1]
    # Held fewer times than listed: refused, nothing changes.
    with pytest.raises(InvalidArgumentError, match="engine holds only"):
        m.unpin_blocks([pages[2], pages[2]])
    assert m.block_ref_count(pages[2]) == 1
    m.free_blocks([1, 2, 3, 4, 5, 6, 7])
    assert m.reset_prefix_cache()
    # The reset reports the page still watched (page 2, unpinned while held).
    assert m.take_reused_blocks().tolist() == [2]
    m.check_invariants()


def test_a_manager_that_reads_no_token_ids_takes_a_prompt_by_its_length() -> None:
    # vLLM's default: its own hashes, events off. Nothing reads a token id's
    # value, so a prompt may come as its length and is never converted.
    tokens, hashes = vllm_case(4)
    quiet = make_manager(4, 11, external_block_hashes=True)
    listed = make_manager(4, 11, external_block_hashes=True)
    assert not quiet.reads_token_values
    quiet.add_request("a", len(tokens))
    listed.add_request("a", tokens)
    out = []
    for m in (quiet, listed):
        m.sync_request("a", tokens, hashes)
        # Output tokens sync as usual (only those past the prompt are read).
        m.add_request("b", len(tokens) if m is quiet else tokens)
        m.sync_request("b", [*tokens, 7], hashes)
        out.append((admit(m, "a"), admit(m, "b"), m.num_tokens("b"), m.num_free_blocks))
        m.check_invariants()
    assert out[0] == out[1]
    assert out[0][1][1] == len(tokens) // 4 * 4  # b hits a's whole blocks
    # Refused, nothing registered: a negative or too long length, and a length
    # for a manager that hashes the ids or publishes them in events.
    for bad in (-1, 8193):
        with pytest.raises(InvalidArgumentError):
            quiet.add_request("x", bad)
    for m in (engine_manager(), make_manager()):
        assert m.reads_token_values
        with pytest.raises(TypeError, match="length alone will not do"):
            m.add_request("x", 8)
        assert "x" not in m
    assert "x" not in quiet


def test_blocks_an_engine_filled_are_cached_under_a_requests_hashes() -> None:
    # vLLM's BlockPool.cache_full_blocks on blocks a connector took and filled.
    tokens, hashes = vllm_case(4)
    m = engine_manager(block_size=4)
    m.add_request("r", tokens)
    m.sync_request("r", tokens, hashes)
    mine = m.get_new_blocks(3)
    assert mine is not None
    with pytest.raises(InvalidArgumentError, match="not held"):
        m.cache_detached_blocks("r", 0, [*mine[:2], 9], 0, 3)
    with pytest.raises(InvalidArgumentError, match="mask"):
        m.cache_detached_blocks("r", 0, mine, 0, 3, [True])
    with pytest.raises(InvalidArgumentError, match="past"):
        m.cache_detached_blocks("r", 1, mine, 0, 3)
    assert m.num_pending_events == 0
    m.cache_detached_blocks("r", 0, mine, 0, 3, [True, False, True])
    (stored,) = m.take_events(raw_hashes=True)
    assert isinstance(stored, pk.BlockStored)
    assert stored.block_hashes == [hashes[0], hashes[2]]
    assert stored.token_ids == tokens[:12]
    # The cache points at them: block 1 (masked out) ends the hit.
    m.add_request("s", tokens)
    m.sync_request("s", tokens, hashes)
    assert m.get_computed_blocks("s").num_computed_tokens == 4
    m.free_blocks(mine)
    m.check_invariants()


def test_a_partial_entry_on_a_block_an_engine_filled() -> None:
    # vLLM's BlockPool.cache_partial_block: the hash of the hash block ending
    # at the boundary, in the group; None for the null block.
    tokens, hashes = vllm_case(4)
    m = engine_manager(block_size=8, hash_block_size=4, partial_hash_hits=True)
    m.add_request("r", tokens)
    m.sync_request("r", tokens, hashes)
    (block,) = m.get_new_blocks(1) or []
    assert m.cache_detached_partial_block("r", 0, int(block), 4) == (hashes[0], 0)
    assert m.cache_detached_partial_block("r", 0, 0, 4) is None
    for bad in (0, 6, 4 * len(hashes) + 4):
        with pytest.raises(InvalidArgumentError, match="hash block boundary"):
            m.cache_detached_partial_block("r", 0, int(block), bad)
    with pytest.raises(InvalidArgumentError, match="not held"):
        m.cache_detached_partial_block("r", 0, int(block) + 1, 4)
    (stored,) = m.take_events(raw_hashes=True)
    assert isinstance(stored, pk.BlockStored)
    assert (stored.block_hashes, stored.token_ids) == ([hashes[0]], tokens[:4])
    # The same entry again is no new event; replacing it drops it first.
    m.cache_detached_partial_block("r", 0, int(block), 4)
    assert m.num_pending_events == 0
    m.cache_detached_partial_block("r", 0, int(block), 4, replace_existing=True)
    assert [type(e).__name__ for e in m.take_events()] == ["BlockRemoved", "BlockStored"]
    m.free_blocks([int(block)])
    m.check_invariants()


def test_vllm_lenient_returns_none_where_pagedkv_raises() -> None:
    m = engine_manager(num_blocks=5)
    m.add_request("big", list(range(100)))
    with pytest.raises(pk.CannotFitError):
        m.allocate_slots("big", 100, num_computed_tokens=0)
    assert m.allocate_slots("big", 100, num_computed_tokens=0, vllm_lenient=True) is None
    need = m.num_blocks_to_allocate(None, 100, total_computed_tokens=0, num_tokens_main_model=100)
    assert need == 7


def test_stats_recorded_by_the_scheduler_are_readable_without_reset() -> None:
    m = engine_manager()
    m.add_request("r", list(range(20)))
    admit(m, "r")
    assert m._prefix_cache_stats() == (False, 0, 0, 0, 0, 0, 0)
    m.record_prefix_cache_stats(20, 16, False)
    assert m._prefix_cache_stats() == (False, 1, 20, 16, 0, 0, 0)
    assert m._prefix_cache_stats() == (False, 1, 20, 16, 0, 0, 0)
    assert m._make_prefix_cache_stats() == (False, 1, 20, 16, 0, 0, 0)
    assert m._prefix_cache_stats() == (False, 0, 0, 0, 0, 0, 0)


def test_lookahead_events_carry_the_tokens_each_hash_covers() -> None:
    # vLLM's test_kv_events_reconstruct_lookahead_block_hashes[2].
    m = engine_manager(block_size=2, num_hash_lookahead_tokens=2)
    tokens = list(range(6))
    m.add_request("r", tokens)
    m.sync_request("r", tokens, [b"\x01" * 8, b"\x02" * 8])
    admit(m, "r")
    (stored,) = m.take_events(raw_hashes=True)
    assert isinstance(stored, pk.BlockStored)
    assert stored.token_ids == [0, 1, 2, 3]
    assert stored.lookahead_token_ids == [[2, 3], [4, 5]]
    assert stored.extra_keys == [None, None]
    with pytest.raises(pk.InvalidConfigError, match="external_block_hashes"):
        make_manager(num_hash_lookahead_tokens=1)


def test_the_general_plugin_entry_point_is_registered() -> None:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    (ep,) = [e for e in eps if e.name == "pagedkv"]
    assert ep.value == "pagedkv.vllm.plugin:register"
    assert ep.load() is __import__("pagedkv.vllm.plugin").vllm.plugin.register


def test_the_plugin_installs_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedkv.vllm import plugin

    monkeypatch.delenv("PAGEDKV_VLLM", raising=False)
    plugin.register()  # a no-op without PAGEDKV_VLLM=1, vLLM or not
    assert not plugin.installed()
    try:
        import vllm  # noqa: F401
    except ImportError:
        monkeypatch.setenv("PAGEDKV_VLLM", "1")
        with pytest.raises(ImportError, match=r"pagedkv\[vllm\]"):
            plugin.register()


# ---- side by side with vLLM's own manager (where vLLM is installed) ---------


def _vllm_pair(
    num_blocks: int, block_size: int, events: bool = True, metrics_collector: Any = None
) -> tuple[Any, Any, Any]:
    vllm_core = pytest.importorskip("vllm.v1.core.kv_cache_manager")
    import torch
    from pagedkv.vllm import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
    )
    kw = dict(
        max_model_len=4096,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        log_stats=True,
        enable_kv_cache_events=events,
    )
    if metrics_collector is not None:
        kw["metrics_collector"] = metrics_collector
    return vllm_core.KVCacheManager(cfg, **kw), KVCacheManager(cfg, **kw), cfg


@pytest.mark.parametrize("events", [True, False])
def test_side_by_side_with_vllms_own_manager(events: bool) -> None:
    # Without events (vLLM's default) the drop-in registers prompts by length.
    ref, ours, _ = _vllm_pair(num_blocks=24, block_size=4, events=events)
    assert ours._prompt_by_length is not events
    # The coordinator is of the kind vLLM builds, under its class's name.
    assert isinstance(ours.coordinator, type(ref.coordinator))
    assert type(ours.coordinator).__name__ == type(ref.coordinator).__name__
    assert type(ours.coordinator).__module__ == "pagedkv.vllm.views"
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(4, sha256_cbor)

    def req(rid: str, tokens: list[int]) -> Any:
        return Request(rid, tokens, SamplingParams(max_tokens=8), None, block_hasher=hasher)

    prompts = {"a": list(range(30)), "b": list(range(22)) + [99] * 5, "c": list(range(30))}

    def run(mgr: Any) -> list[Any]:
        results: list[Any] = []
        reqs = {rid: req(rid, p) for rid, p in prompts.items()}
        for r in reqs.values():
            blocks, hit, _ = mgr.get_computed_blocks(r)
            new = mgr.allocate_slots(r, r.num_tokens - hit, hit, blocks)
            results.append((hit, blocks.get_block_ids(), new.get_block_ids()))
            r.num_computed_tokens = r.num_tokens
            mgr.record_prefix_cache_stats(r, hit)
        reqs["a"].append_output_token_ids([7, 8, 9])
        results.append(mgr.allocate_slots(reqs["a"], 3).get_block_ids())
        reqs["a"].num_computed_tokens += 3
        blocks = mgr.pop_blocks_for_free(reqs["b"])
        results.append([b.block_id for b in blocks])
        results.append(mgr.block_pool.get_num_free_blocks())
        mgr.block_pool.free_blocks(reversed(blocks))
        mgr.free(reqs["a"])
        results.append(mgr.block_pool.get_num_free_blocks())
        stats = mgr.make_prefix_cache_stats()
        results.append((stats.requests, stats.queries, stats.hits))
        results.append([type(e).__name__ for e in mgr.take_events()])
        return results

    assert run(ours) == run(ref)


def test_install_makes_vllm_build_pagedkv() -> None:
    pytest.importorskip("vllm")
    import vllm.v1.core.kv_cache_manager as vkm
    import vllm.v1.core.sched.scheduler as vsched
    from pagedkv.vllm import KVCacheManager, install, installed, uninstall

    original = vkm.KVCacheManager
    install()
    try:
        assert installed()
        assert vkm.KVCacheManager is KVCacheManager
        assert vsched.KVCacheManager is KVCacheManager
    finally:
        uninstall()
    assert vkm.KVCacheManager is original
    assert not installed()


def test_install_replaces_the_cpu_offloading_manager() -> None:
    pytest.importorskip("vllm")
    import vllm.v1.kv_offload.cpu.manager as vcm
    from pagedkv.vllm import CPUOffloadingManager, install, installed, uninstall
    from vllm.v1.kv_offload.base import OffloadingManager

    original = vcm.CPUOffloadingManager
    install()
    try:
        assert installed() and vcm.CPUOffloadingManager is CPUOffloadingManager
        arc = vcm.CPUOffloadingManager(num_chunks=4, cache_policy="arc")
        assert isinstance(arc, OffloadingManager) and arc.tier.policy == "arc"
        assert type(vcm.CPUOffloadingManager(num_chunks=4)) is CPUOffloadingManager
        # an out-of-tree policy gets vLLM's own class
        other = vcm.CPUOffloadingManager(
            num_chunks=4,
            cache_policy="LRUCachePolicy",
            cache_policy_module_path="vllm.v1.kv_offload.cpu.policies.lru",
        )
        assert type(other) is original
    finally:
        uninstall()
    assert vcm.CPUOffloadingManager is original and not installed()


def test_the_offloading_manager_forgets_collected_request_contexts() -> None:
    pytest.importorskip("vllm")
    import gc

    from pagedkv.vllm import CPUOffloadingManager
    from vllm.v1.kv_offload.base import ReqContext

    m = CPUOffloadingManager(num_chunks=8)
    long_lived = [ReqContext(req_id=f"long-{i}") for i in range(3)]
    for i, ctx in enumerate(long_lived):
        m.prepare_store([bytes([9, i]) * 16], ctx)
    for round_ in range(3):  # short-lived contexts come and go meanwhile
        ctxs = [ReqContext(req_id=f"{round_}-{i}") for i in range(4)]
        for i, ctx in enumerate(ctxs):
            m.prepare_store([bytes([round_, i]) * 16], ctx)
        del ctxs, ctx
        gc.collect()
    del long_lived
    gc.collect()
    m.prepare_store([b"x" * 32], ReqContext(req_id="last"))
    # every context but the newest is gone, the long-lived ones included
    assert m.tier.num_requests == 1
    m.tier.check_invariants()


def test_install_patches_every_vllm_binding_and_names_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("vllm")
    import types

    import vllm.v1.core.kv_cache_manager as vkm
    from pagedkv.vllm import KVCacheManager, install, installed, uninstall

    original = vkm.KVCacheManager

    def raising(name: str) -> Any:
        raise RuntimeError(f"lazy import of {name} failed")

    # A vLLM module whose __getattr__ raises, one binding the class under
    # another name, and a module outside vLLM that imported it first.
    lazy = types.ModuleType("vllm.lazy_for_test")
    lazy.__getattr__ = raising  # type: ignore[method-assign]
    alias = types.ModuleType("vllm.alias_for_test")
    alias.Manager = original  # type: ignore[attr-defined]
    user = types.ModuleType("user_code_for_test")
    user.KVCacheManager = original  # type: ignore[attr-defined]
    for mod in (lazy, alias, user):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    with pytest.warns(RuntimeWarning, match=r"user_code_for_test\.KVCacheManager"):
        install()
    try:
        assert installed()
        assert alias.Manager is KVCacheManager  # type: ignore[attr-defined]
        assert user.KVCacheManager is original  # type: ignore[attr-defined]
    finally:
        uninstall()
    assert not installed()
    assert vkm.KVCacheManager is original
    assert alias.Manager is original  # type: ignore[attr-defined]
    uninstall()  # twice: nothing to do


def test_free_queue_links_walk_the_queue_in_order() -> None:
    m = engine_manager(num_blocks=8)
    m.add_request("r", list(range(40)))
    m.sync_request("r", list(range(40)), [b"\x01" * 8, b"\x02" * 8])
    admit(m, "r")
    m.free("r")
    order = m.free_block_ids().tolist()
    head, tail = m.free_neighbors(-1)  # type: ignore[misc]
    walked, cur = [], head
    while cur != -1:
        walked.append(cur)
        prev, nxt = m.free_neighbors(cur)  # type: ignore[misc]
        assert prev == (walked[-2] if len(walked) > 1 else -1)
        cur = nxt
    assert walked == order and tail == order[-1]
    m.add_request("s", list(range(5)))
    m.allocate_slots("s", 5, num_computed_tokens=0)
    held = m.get_block_ids("s")[0][0]
    assert m.free_neighbors(int(held)) is None
    assert m.free_neighbors(0) is None  # the null block is never queued


def test_lookup_and_allocation_results_read_no_block_object_until_asked() -> None:
    # A hit the scheduler hands back to allocate_slots, and the ids it sends to
    # the workers, never fetch block objects (a memory miss each when cold).
    _, ours, _ = _vllm_pair(num_blocks=24, block_size=4, events=False)
    from pagedkv.vllm.views import BlockRun
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(4, sha256_cbor)

    def req(rid: str) -> Any:
        sp = SamplingParams(max_tokens=8)
        return Request(rid, list(range(30)), sp, None, block_hasher=hasher)

    a, b = req("a"), req("b")
    blocks, hit, _ = ours.get_computed_blocks(a)
    new = ours.allocate_slots(a, a.num_tokens, hit, blocks)
    (run,) = new.blocks
    assert type(run) is BlockRun and run._items is None
    assert new.get_block_ids() == ([1, 2, 3, 4, 5, 6, 7, 8],)
    assert new.get_block_ids(allow_none=True, group_ids=[0]) == ([1, 2, 3, 4, 5, 6, 7, 8],)
    assert run._items is None
    a.num_computed_tokens = a.num_tokens
    blocks, hit, _ = ours.get_computed_blocks(b)
    assert hit == 28
    assert ours.allocate_slots(b, b.num_tokens - hit, hit, blocks).get_block_ids() == ([9],)
    (run,) = blocks.blocks
    assert run._items is None  # the hit went back to the core untouched
    # Read, a run is the list of vLLM's block objects.
    objs = ours.block_pool.blocks
    assert len(run) == 7 and bool(run)
    assert run == [objs[i] for i in range(1, 8)] and [objs[i] for i in range(1, 8)] == run
    assert run[0] is objs[1] and run[-1].block_id == 7 and run[1:3] == [objs[2], objs[3]]
    assert [blk.block_id for blk in reversed(run)] == list(range(7, 0, -1))
    assert run + [objs[9]] == [*run, objs[9]]  # noqa: RUF005 (the operator is under test)
    assert [objs[9]] + run == [objs[9], *run]  # noqa: RUF005
    assert run != (objs[1],)  # a list, not a tuple
    assert (blocks + ours.empty_kv_cache_blocks).get_block_ids() == (list(range(1, 8)),)
    assert ours.get_blocks("b").get_block_ids() == ([*range(1, 8), 9],)


def test_cache_full_blocks_and_appended_events_side_by_side_with_vllm() -> None:
    ref, ours, _ = _vllm_pair(num_blocks=24, block_size=4)
    from vllm.distributed.kv_events import BlockStored
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(4, sha256_cbor)

    def run(mgr: Any) -> list[Any]:
        req = Request("r", list(range(14)), SamplingParams(max_tokens=4), None, block_hasher=hasher)
        pool = mgr.block_pool
        blocks = pool.get_new_blocks(3)
        pool.cache_full_blocks(req, blocks, 0, 1, 4, 0)
        foreign = BlockStored(
            block_hashes=[7],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4],
            block_size=4,
            lora_id=None,
            medium=None,
            lora_name=None,
            group_idx=5,
        )
        pool.kv_event_queue.append(foreign)
        pool.cache_full_blocks(req, blocks, 1, 3, 4, 0, block_mask=[False, True])
        queued = len(pool.kv_event_queue)
        events = mgr.take_events()
        out = [queued, [type(e).__name__ for e in events], events[1] is foreign]
        out += [
            (e.block_hashes, e.parent_block_hash, e.token_ids, e.group_idx, e.kv_cache_spec_kind)
            for e in events
        ]
        blocks2, hit, _ = mgr.get_computed_blocks(
            Request("s", list(range(14)), SamplingParams(max_tokens=4), None, block_hasher=hasher)
        )
        out.append((hit, blocks2.get_block_ids()))
        pool.free_blocks(blocks)
        out.append(pool.get_num_free_blocks())
        return out

    assert run(ours) == run(ref)


def test_partial_entries_on_filled_blocks_side_by_side_with_vllm() -> None:
    # vLLM's test_hybrid_partial_hash_truncates_full_attention_hit_length, then
    # a replaced entry: hits and block counts as vLLM's own manager answers.
    vllm_core = pytest.importorskip("vllm.v1.core.kv_cache_manager")
    import torch
    from pagedkv.vllm import KVCacheManager
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32)
    mamba = MambaSpec(
        block_size=4, shapes=(1, 1), dtypes=(torch.float32,), mamba_cache_mode="align"
    )
    cfg = KVCacheConfig(
        num_blocks=24,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["f"], full), KVCacheGroupSpec(["m"], mamba)],
    )

    def run(cls: Any) -> list[Any]:
        mgr = cls(cfg, max_model_len=8192, hash_block_size=2, scheduler_block_size=4)
        hasher = get_request_block_hasher(2, sha256_cbor)
        prompt = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
        req = Request("0", prompt, SamplingParams(max_tokens=4), None, block_hasher=hasher)
        pool = mgr.block_pool
        blocks = pool.get_new_blocks(3)
        pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)
        keys = [pool.cache_partial_block(req, blocks[2], 10, 0, 4)]
        (m,) = pool.get_new_blocks(1)
        keys.append(pool.cache_partial_block(req, m, 6, 1, 4))
        keys.append(pool.cache_partial_block(req, pool.null_block, 6, 1, 4))
        out: list[Any] = [keys]
        for replace in (None, 4):
            if replace is not None:
                pool.cache_partial_block(req, m, replace, 1, 4, replace_existing_hashes=True)
            hit, n, _ = mgr.get_computed_blocks(req)
            out.append((n, [len(g) for g in hit.blocks]))
        pool.free_blocks([*blocks, m])
        out.append(pool.get_num_free_blocks())
        return out

    assert run(KVCacheManager) == run(vllm_core.KVCacheManager)


def test_residency_metrics_collector_side_by_side_with_vllm() -> None:
    # vLLM's --kv-cache-metrics: its KVCacheMetricsCollector (every block
    # sampled) sees the same allocations, hits, evictions and reset from
    # pagedkv's pool as from vLLM's.
    pytest.importorskip("vllm")
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(4, sha256_cbor)

    def run(side: int) -> list[Any]:
        col = KVCacheMetricsCollector(sample_rate=1.0)
        mgr = _vllm_pair(num_blocks=12, block_size=4, metrics_collector=col)[side]
        out: list[Any] = []
        prompts = [list(range(17)), list(range(17)), [9] * 21, [8] * 30]
        for i, p in enumerate(prompts):
            r = Request(f"r{i}", p, SamplingParams(max_tokens=4), None, block_hasher=hasher)
            blocks, hit, _ = mgr.get_computed_blocks(r)
            mgr.allocate_slots(r, r.num_tokens - hit, hit, blocks)
            state = {b: len(m.access_history) for b, m in col.block_metrics.items()}
            out.append((hit, state, len(col.drain_events())))
            mgr.free(r)
        out.append(mgr.reset_prefix_cache())
        out.append((dict(col.block_metrics), col.drain_events()))
        (b,) = mgr.block_pool.get_new_blocks(1)
        out.append(sorted(col.block_metrics))
        mgr.block_pool.free_blocks([b])
        return out

    assert run(1) == run(0)


def test_an_extra_reference_written_through_ref_cnt() -> None:
    # vLLM's managers pin a copy's destination with ``block.ref_cnt += 1`` and
    # return it with ``free_blocks``; as on vLLM's own pool.
    def run(side: int) -> list[Any]:
        mgr = _vllm_pair(num_blocks=8, block_size=4)[side]
        pool = mgr.block_pool
        (b,) = pool.get_new_blocks(1)
        b.ref_cnt += 1
        out: list[Any] = [b.ref_cnt, pool.get_num_free_blocks()]
        pool.free_blocks([b])
        out += [b.ref_cnt, pool.get_num_free_blocks()]
        pool.free_blocks([b])
        out += [b.ref_cnt, pool.get_num_free_blocks()]
        return out

    assert run(1) == run(0) == [2, 6, 1, 6, 0, 7]
    ours = _vllm_pair(num_blocks=8, block_size=4)[1]
    (b,) = ours.block_pool.get_new_blocks(1)
    for bad in (0, 3, -1):
        with pytest.raises(AttributeError):
            b.ref_cnt = bad
    assert b.ref_cnt == 1
    free = ours.block_pool.free_block_queue.get_all_free_blocks()[0]
    with pytest.raises(AttributeError):
        free.ref_cnt += 1  # a free block leaves the queue through touch, not here
    assert free.ref_cnt == 0


# ---- HiSparse: vLLM's host-backed sparse residency on pagedkv's pool -----------


def _hisparse_pair(
    num_blocks: int,
    host_blocks: int,
    *,
    caching: bool = True,
    events: bool = True,
    regular: bool = False,
) -> tuple[Any, Any]:
    """vLLM's own manager and the drop-in for vLLM's HiSparse test layout
    ``[host source, indexer, resident, hot]`` (block size 16), each with its
    ``HiSparseCoordinator`` bound; ``regular``: a regular full-attention group
    after the hot one, as vLLM's production layout appends them."""
    vllm_core = pytest.importorskip("vllm.v1.core.kv_cache_manager")
    import torch
    from pagedkv.vllm import KVCacheManager
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HiSparseHotSpec,
        HiSparseResidentSpec,
        KVCacheConfig,
        KVCacheGroupRole,
        KVCacheGroupSpec,
    )

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        hisparse_host_num_blocks=host_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["source"], spec, role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True
            ),
            KVCacheGroupSpec(["indexer"], spec, role=KVCacheGroupRole.HISPARSE_INDEXER),
            KVCacheGroupSpec(["resident"], HiSparseResidentSpec(block_size=16, page_size=64)),
            KVCacheGroupSpec(
                ["hot"], HiSparseHotSpec(block_size=16, page_size=64, blocks_per_request=2)
            ),
            *(
                [
                    KVCacheGroupSpec(
                        ["regular"],
                        FullAttentionSpec(
                            block_size=16, num_kv_heads=2, head_size=1, dtype=torch.float32
                        ),
                    )
                ]
                if regular
                else []
            ),
        ],
    )
    kw = dict(
        max_model_len=128,
        scheduler_block_size=16,
        hash_block_size=16,
        enable_caching=caching,
        enable_kv_cache_events=events,
    )
    pair = vllm_core.KVCacheManager(cfg, **kw), KVCacheManager(cfg, **kw)
    for m in pair:
        get_hisparse_coordinator(m)
    return pair


def _hisparse_request(rid: str, tokens: list[int]) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=8),
        None,
        block_hasher=get_request_block_hasher(16, sha256),
    )


def _hisparse_step(mgr: Any, req: Any, n: int, **kw: Any) -> Any:
    """``allocate_slots`` and the connector's per-step residency work, then
    every planned spill acknowledged (host pages become durable)."""
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    coordinator = get_hisparse_coordinator(mgr)
    blocks = mgr.allocate_slots(req, n, **kw)
    if blocks is not None:
        done = min(
            req.num_computed_tokens
            + kw.get("num_new_computed_tokens", 0)
            + kw.get("num_external_computed_tokens", 0)
            + n,
            req.num_tokens,
        )
        coordinator.advance_scheduled([(req.request_id, done)])
        command = coordinator.build_offload_command()
        counts = {spill.transfer_id: 1 for spill in command.page_transfers}
        coordinator.update_spills(counts, counts)
    return blocks


def _ids(blocks: Any) -> list[list[int]]:
    return [[b.block_id for b in g] for g in blocks.blocks]


def test_hisparse_side_by_side_with_vllm() -> None:
    # Allocation, host publication, a prefix hit that adopts the surviving GPU
    # copies, deferred frees mixing host and device blocks, unpinned pages
    # reused by the pool, a reset and the events: as vLLM's own manager does.
    ref, ours = _hisparse_pair(num_blocks=32, host_blocks=16)
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    def run(mgr: Any) -> list[Any]:
        coordinator = get_hisparse_coordinator(mgr)
        pool = coordinator.gpu_pool
        host_pool = coordinator.get_host_block_pool()
        out: list[Any] = [
            type(mgr.coordinator).__name__,
            [type(m).__name__ for m in mgr.coordinator.single_type_managers],
            mgr.retained_hit_group_ids,
        ]
        tokens = list(range(64))
        a = _hisparse_request("a", tokens)
        out.append(_ids(_hisparse_step(mgr, a, 64)))
        a.num_computed_tokens = 64
        out.append((mgr.get_block_ids("a"), pool.get_num_free_blocks()))
        out.append(host_pool.get_num_free_blocks())
        mgr.free(a)
        out.append((pool.get_num_free_blocks(), host_pool.get_num_free_blocks()))
        # A prefix hit: the host source keeps its longer hit, the indexer is capped.
        b = _hisparse_request("b", tokens + [7] * 8)
        blocks, hit, spb = mgr.get_computed_blocks(b)
        out.append((_ids(blocks), hit, spb))
        out.append(
            mgr.coordinator.get_num_blocks_to_allocate("b", 72, ([], [], [], []), 0, 0, 0, 72)
        )
        new = _hisparse_step(
            mgr, b, b.num_tokens - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks
        )
        out.append(_ids(new))
        b.num_computed_tokens = b.num_tokens
        resident = coordinator.resident_managers[0]
        out.append([x.block_id for x in resident.get_residency_row("b")])
        out.append([x.ref_cnt for x in mgr.get_blocks("b").blocks[2]])
        out.append(sorted(coordinator.request_states["b"].valid_pages))
        out.append(mgr.estimate_cached_tokens(b))
        mgr.new_step_starts()
        out.append(mgr.take_kv_cache_block_copies()[0])
        out.append(mgr.get_block_ids_for_computed_tokens("b", 40))
        # Unpinned pages are taken last; the pool reusing one tells the coordinator.
        coordinator.update_residency("b")
        taken = pool.get_new_blocks(pool.get_num_free_blocks())
        out.append(([x.block_id for x in taken], dict(coordinator.copies).__len__()))
        out.append([x.block_id for x in resident.get_residency_row("b")])
        pool.free_blocks(taken)
        # A deferred free mixes host and device blocks; free_blocks routes them.
        popped = mgr.pop_blocks_for_free(b)
        out.append(sorted((x.block_id, x.pool is host_pool) for x in popped))
        mgr.block_pool.free_blocks(reversed(popped))
        out.append((pool.get_num_free_blocks(), host_pool.get_num_free_blocks()))
        # The host pool's own free queue (its order is its eviction order).
        out.append([x.block_id for x in host_pool.free_block_queue.get_all_free_blocks()])
        out.append((host_pool.medium, host_pool.num_gpu_blocks, host_pool.null_block.block_id))
        events_before_reset = _event_rows(mgr.take_events())
        out.append(events_before_reset)
        out.append((mgr.reset_prefix_cache(), len(coordinator.copies)))
        out.append(_event_rows(mgr.take_events()))
        return out

    want = run(ref)
    assert run(ours) == want
    # The host source's pool is pagedkv's (a core pool), its events in the
    # device pool's stream with medium CPU, in vLLM's order (compared above).
    from pagedkv.vllm.hisparse import HostBlockPool
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator as hc

    assert isinstance(hc(ours).get_host_block_pool(), HostBlockPool)
    assert any(row[2] == "CPU" for row in want[-3]), want[-3]


@pytest.mark.parametrize("regular", [False, True], ids=["test_layout", "production_layout"])
def test_hisparse_events_in_vllms_order_when_both_pools_evict(regular: bool) -> None:
    # Five distinct prompts through small pools: from the second on, an
    # allocation evicts published host pages (the source, ahead of the core's
    # groups) and cached device blocks in the same call. The stream holds
    # them in vLLM's order: the source's host evictions, the device's, then
    # the stores, group by group. With a regular group after the hot one
    # (vLLM's production order) its blocks come after the resident and hot
    # groups' (a split allocation), as vLLM allocates group by group.
    def run(mgr: Any) -> list[Any]:
        out: list[Any] = []
        for i in range(5):
            r = _hisparse_request(f"r{i}", [i * 1000 + j for j in range(64)])
            blocks, hit, _ = mgr.get_computed_blocks(r)
            new = _hisparse_step(
                mgr, r, r.num_tokens - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks
            )
            out.append(None if new is None else _ids(new))
            r.num_computed_tokens = r.num_tokens
            mgr.cache_blocks(r, r.num_tokens)
            out.append(_event_rows(mgr.take_events()))
            mgr.free(r)
            out.append(_event_rows(mgr.take_events()))
        return out

    ref, ours = _hisparse_pair(num_blocks=22 if regular else 14, host_blocks=6, regular=regular)
    want = run(ref)
    assert run(ours) == want
    if regular:
        # The regular group (4) got blocks after the resident and hot ones (2, 3).
        first = want[0]
        assert first[4] and min(first[4]) > max(first[2] + first[3]), first
    kinds = [(row[0], row[2]) for step in want for row in step if step and row]
    assert ("BlockRemoved", "CPU") in kinds and ("BlockRemoved", "GPU") in kinds


@pytest.mark.parametrize("regular", [False, True], ids=["test_layout", "production_layout"])
def test_hisparse_external_import_side_by_side(regular: bool) -> None:
    # A connector's load: every group takes its imported blocks before any
    # takes new ones, the resident row keeps only the import's last page on
    # the device (a fresh block, in group order after the indexer's imports),
    # the hot region follows; then a second request adopts a host prefix hit
    # and imports more on top of it.
    ref, ours = _hisparse_pair(num_blocks=40, host_blocks=24, regular=regular)
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

    def run(mgr: Any) -> list[Any]:
        coordinator = get_hisparse_coordinator(mgr)
        resident = coordinator.resident_managers[0]
        out: list[Any] = []
        a = _hisparse_request("a", list(range(64)))
        new = _hisparse_step(mgr, a, 16, num_external_computed_tokens=40)
        out.append(_ids(new))
        out.append(mgr.get_block_ids("a"))
        out.append([x.block_id for x in resident.get_residency_row("a")])
        a.num_computed_tokens = 56
        new = _hisparse_step(mgr, a, 8)
        out.append(_ids(new))
        a.num_computed_tokens = 64
        mgr.cache_blocks(a, 64)
        out.append(_event_rows(mgr.take_events()))
        b = _hisparse_request("b", list(range(48)) + [9] * 40)
        blocks, hit, _ = mgr.get_computed_blocks(b)
        out.append((_ids(blocks), hit))
        new = _hisparse_step(
            mgr,
            b,
            8,
            num_new_computed_tokens=hit,
            new_computed_blocks=blocks,
            num_external_computed_tokens=24,
        )
        out.append(None if new is None else _ids(new))
        out.append(mgr.get_block_ids("b"))
        out.append([x.block_id for x in resident.get_residency_row("b")])
        out.append(
            sorted(coordinator.request_states.get("b", None).valid_pages)
            if "b" in coordinator.request_states
            else None
        )
        mgr.free(a)
        mgr.free(b)
        out.append(_event_rows(mgr.take_events()))
        out.append(mgr.block_pool.get_num_free_blocks())
        out.append([x.block_id for x in mgr.block_pool.free_block_queue.get_all_free_blocks()])
        return out

    assert run(ours) == run(ref)


def _event_rows(events: list[Any]) -> list[tuple[Any, ...]]:
    """Events as comparable rows, in order: kind, group, medium, hashes, tokens."""
    return [
        (
            type(e).__name__,
            getattr(e, "group_idx", None),
            getattr(e, "medium", None),
            list(getattr(e, "block_hashes", None) or []),
            list(getattr(e, "token_ids", None) or []),
        )
        for e in events
    ]


def test_hisparse_admission_counts_every_groups_blocks() -> None:
    # vLLM adds up every group's need before any allocates: with the host
    # pool too small for the prompt, the source's sentinel refuses it; with
    # too few device blocks for the indexer plus the resident pages, too.
    for num_blocks, host_blocks in ((32, 3), (6, 16), (9, 16)):
        for caching in (False, True):
            out = []
            for mgr in _hisparse_pair(num_blocks, host_blocks, caching=caching):
                req = _hisparse_request("r", list(range(64)))
                blocks = mgr.allocate_slots(req, 64, full_sequence_must_fit=True)
                out.append(
                    (
                        None if blocks is None else _ids(blocks),
                        mgr.block_pool.get_num_free_blocks(),
                        mgr.get_block_ids("r"),
                    )
                )
            assert out[0] == out[1], (num_blocks, host_blocks, caching)
