"""vLLM 0.33's single-group prefix-caching behaviour, block id for block id.

Scenarios and expected values follow vLLM's ``tests/v1/core/test_prefix_caching.py``
and ``test_kv_cache_utils.py`` (the 2026 expectations, which are vLLM 0.33's: freed
blocks without a hash are prepended to the free queue, hashed ones appended) and
vLLM 0.33's source (``vllm/v1/core``). Where vLLM's tests poke internals
(``block_pool.blocks[i].block_hash``, ``req_to_blocks``), these use the manager's
introspection API (``cached_block_hash``, ``block_ref_count``, ``get_block_ids``).
"""

from __future__ import annotations

import pagedkv as pk
import pytest

from tests._util import admit, as_lists, chain, event_hash, make_manager

BS = 16
# Three full blocks: [0]*16 + [1]*16 + [2]*16, as in vLLM's tests.
COMMON = [i for i in range(3) for _ in range(BS)]


def free_queue(mgr: pk.KVCacheManager) -> list[int]:
    return [int(b) for b in mgr.free_block_ids()]


# --------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("hash_algo", ["sha256_cbor", "xxhash_cbor"])
def test_prefill_hits_shared_prefix_and_reuses_unhashed_blocks_first(hash_algo: str) -> None:
    mgr = make_manager(BS, 11, hash_algo=hash_algo, hash_seed="0")
    assert mgr.none_hash == pk.none_hash(hash_algo, "0")

    # req0: fully missing, 3 full blocks + 7 tokens.
    tokens0 = COMMON + [3] * 7
    mgr.add_request("0", tokens0)
    assert len(mgr.block_hashes("0")) == 3
    hit, new = admit(mgr, "0")
    assert as_lists(hit.block_ids) == ([],)
    assert hit.num_computed_tokens == 0
    assert new == ([1, 2, 3, 4],)

    # Full blocks are cached under the hash chain (group 0), ref 1.
    expected = chain(hash_algo, mgr.none_hash, tokens0, BS)
    assert mgr.block_hashes("0") == expected
    for block_id, block_hash in zip((1, 2, 3), expected, strict=True):
        assert mgr.cached_block_hash(block_id) == (block_hash, 0)
        assert mgr.block_ref_count(block_id) == 1
    # The partial block is not cached.
    assert mgr.cached_block_hash(4) is None
    assert mgr.block_ref_count(4) == 1

    # req1 hits the common prefix while req0 still holds it.
    mgr.add_request("1", COMMON + [3] * 5)
    hit, new = admit(mgr, "1")
    assert as_lists(hit.block_ids) == ([1, 2, 3],)
    assert hit.num_computed_tokens == 48
    assert new == ([5],)
    assert [mgr.block_ref_count(b) for b in (1, 2, 3)] == [2, 2, 2]
    assert mgr.num_free_blocks == 5

    mgr.remove_request("0")
    mgr.remove_request("1")
    assert mgr.num_free_blocks == 10
    # Unhashed partial blocks (5 then 4) are prepended for immediate reuse, the
    # never-used ones follow, hashed blocks go to the tail deepest-first.
    assert free_queue(mgr) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    # req2 hits the now-free cached prefix; its new block is the reused partial 5.
    mgr.add_request("2", COMMON + [3] * 6)
    hit, new = admit(mgr, "2")
    assert as_lists(hit.block_ids) == ([1, 2, 3],)
    assert hit.num_computed_tokens == 48
    assert new == ([5],)
    assert mgr.num_free_blocks == 6
    assert len(free_queue(mgr)) == 6
    assert all(mgr.block_ref_count(b) == 0 for b in free_queue(mgr))

    mgr.remove_request("2")
    # A 160-token miss takes every block, in free-queue order (evicting the cache).
    mgr.add_request("3", [99] * 160)
    hit, new = admit(mgr, "3")
    assert hit.num_computed_tokens == 0
    assert new == ([5, 4, 6, 7, 8, 9, 10, 3, 2, 1],)
    assert mgr.num_free_blocks == 0
    assert free_queue(mgr) == []
    mgr.check_invariants()


def test_prompt_logprobs_requests_never_read_the_cache_but_still_write_it() -> None:
    mgr = make_manager(BS, 11)

    tokens0 = COMMON + [3] * 7
    mgr.add_request("0", tokens0, skip_reading_prefix_cache=True)
    hit, new = admit(mgr, "0")
    assert hit.num_computed_tokens == 0
    assert new == ([1, 2, 3, 4],)
    req0_hashes = [mgr.cached_block_hash(b) for b in (1, 2, 3, 4)]
    expected = chain("sha256_cbor", mgr.none_hash, tokens0, BS)
    assert req0_hashes == [(h, 0) for h in expected] + [None]

    # A normal request hits what the prompt-logprobs request cached.
    mgr.add_request("1", COMMON + [3] * 5)
    hit, new = admit(mgr, "1")
    assert as_lists(hit.block_ids) == ([1, 2, 3],)
    assert hit.num_computed_tokens == 48
    assert new == ([5],)
    assert [mgr.block_ref_count(b) for b in (1, 2, 3)] == [2, 2, 2]
    assert mgr.num_free_blocks == 5

    mgr.remove_request("0")
    mgr.remove_request("1")
    assert free_queue(mgr) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    # Another prompt-logprobs request with the same prefix gets no hit and
    # computes duplicates: new ids, same hashes as req0's blocks.
    mgr.add_request("2", COMMON + [3] * 6, skip_reading_prefix_cache=True)
    hit, new = admit(mgr, "2")
    assert as_lists(hit.block_ids) == ([],)
    assert hit.num_computed_tokens == 0
    assert new == ([5, 4, 6, 7],)
    assert [mgr.cached_block_hash(b) for b in (5, 4, 6, 7)] == req0_hashes
    assert all(mgr.block_ref_count(b) == 1 for b in (5, 4, 6, 7))
    # One hash now maps to two blocks, in insertion order; the map has 3 keys.
    for old, dup, block_hash in zip((1, 2, 3), (5, 4, 6), expected, strict=True):
        assert [int(b) for b in mgr.cached_blocks_for_hash(block_hash)] == [old, dup]
    assert mgr.num_cached_block_hashes == 3
    mgr.check_invariants()


# --------------------------------------------------------------------------- decode


def test_decode_allocates_a_block_only_when_the_last_one_fills_and_hashes_it_when_full() -> None:
    mgr = make_manager(BS, 11)
    tokens = COMMON + [3] * 7
    mgr.add_request("0", tokens)
    _, new = admit(mgr, "0")
    assert new == ([1, 2, 3, 4],)

    # 4 decode tokens fit in block 4: nothing new, block 4 still unhashed.
    mgr.append_token_ids("0", [8] * 4)
    new = mgr.allocate_slots("0", 4, num_computed_tokens=55)
    assert new is not None and as_lists(new) == ([],)
    assert mgr.cached_block_hash(4) is None
    assert len(mgr.block_hashes("0")) == 3

    # 19 more tokens: 9 fill block 4, 10 go into one new block.
    mgr.append_token_ids("0", [7] * 19)
    new = mgr.allocate_slots("0", 19, num_computed_tokens=59)
    assert new is not None and as_lists(new) == ([5],)
    all_tokens = tokens + [8] * 4 + [7] * 19
    expected = chain("sha256_cbor", mgr.none_hash, all_tokens, BS)
    assert len(expected) == 4
    assert mgr.block_hashes("0") == expected
    assert mgr.cached_block_hash(4) == (expected[3], 0)  # second-to-last: hashed
    assert mgr.cached_block_hash(5) is None  # last: partial
    assert as_lists(mgr.get_block_ids("0")) == ([1, 2, 3, 4, 5],)
    mgr.check_invariants()


def test_draft_tokens_get_slots_but_are_never_cached() -> None:
    # num_new_tokens may include unverified draft tokens past request.num_tokens:
    # vLLM allocates their slots but caches only min(computed + new, num_tokens).
    mgr = make_manager(4, 10)
    mgr.add_request("0", [1, 2, 3, 4, 5, 6])
    _, new = admit(mgr, "0")
    assert new == ([1, 2],)
    assert mgr.num_cached_block_hashes == 1
    mgr.append_token_ids("0", [7])  # 7 tokens; 1 sampled + 3 drafts scheduled
    new = mgr.allocate_slots("0", 4, num_computed_tokens=6)
    assert as_lists(new) == ([3],)  # slots for 10 tokens
    assert mgr.num_cached_block_hashes == 1  # block 2 holds 3 real tokens only
    assert mgr.cached_block_hash(2) is None
    mgr.check_invariants()


# --------------------------------------------------------------------------- eviction


def test_evict_frees_unhashed_blocks_to_the_front_and_hashed_ones_lru() -> None:
    mgr = make_manager(BS, 11)
    mgr.add_request("0", list(range(87)))  # 5 full + 1 partial
    _, new = admit(mgr, "0")
    assert new == ([1, 2, 3, 4, 5, 6],)
    mgr.add_request("1", list(range(87, 87 + 48)))  # 3 full
    _, new = admit(mgr, "1")
    assert new == ([7, 8, 9],)
    assert mgr.num_free_blocks == 1

    mgr.remove_request("0")
    assert free_queue(mgr) == [6, 10, 5, 4, 3, 2, 1]
    mgr.remove_request("1")
    assert mgr.num_free_blocks == 10
    assert free_queue(mgr) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]

    # Touch the first two blocks: they leave the queue, the new block is the head.
    mgr.add_request("2", list(range(2 * 16 + 3)))
    hit, new = admit(mgr, "2")
    assert as_lists(hit.block_ids) == ([1, 2],)
    assert hit.num_computed_tokens == 32
    assert new == ([6],)
    assert mgr.num_free_blocks == 7
    mgr.check_invariants()


def test_reused_cached_block_loses_its_hash() -> None:
    mgr = make_manager(BS, 2)  # one usable block
    mgr.add_request("0", list(range(16)))
    _, new = admit(mgr, "0")
    assert new == ([1],)
    assert mgr.cached_block_hash(1) is not None
    mgr.remove_request("0")

    mgr.add_request("1", list(range(15)))
    hit, new = admit(mgr, "1")
    assert hit.num_computed_tokens == 0
    assert new == ([1],)
    assert mgr.cached_block_hash(1) is None
    assert mgr.num_cached_block_hashes == 0
    mgr.check_invariants()


def test_hit_blocks_are_not_evicted_to_make_room_for_the_same_request() -> None:
    mgr = make_manager(BS, 3)
    mgr.add_request("0", list(range(16)))
    assert admit(mgr, "0")[1] == ([1],)
    mgr.add_request("1", list(range(16, 32)))
    assert admit(mgr, "1")[1] == ([2],)
    mgr.remove_request("0")
    mgr.remove_request("1")

    # A hit on block 1: the new block must evict cached block 2, not the hit.
    mgr.add_request("2", list(range(32)))
    hit, new = admit(mgr, "2")
    assert as_lists(hit.block_ids) == ([1],)
    assert hit.num_computed_tokens == 16
    assert new == ([2],)
    mgr.check_invariants()


def test_without_caching_nothing_hits_and_freed_blocks_are_reused_lifo() -> None:
    mgr = make_manager(4, 5, enable_caching=False)
    mgr.add_request("1", list(range(10)))
    hit, new = admit(mgr, "1")
    assert hit.num_computed_tokens == 0
    assert new == ([1, 2, 3],)
    mgr.remove_request("1")
    # Caching off: every freed block is prepended (tail-first order).
    assert free_queue(mgr) == [3, 2, 1, 4]

    mgr.add_request("2", list(range(16)))  # shares req1's prefix
    hit, new = admit(mgr, "2")
    assert as_lists(hit.block_ids) == ([],)
    assert hit.num_computed_tokens == 0
    assert new == ([3, 2, 1, 4],)
    assert mgr.num_cached_block_hashes == 0

    mgr.add_request("3", list(range(4)))
    hit, new = admit(mgr, "3")
    assert hit.num_computed_tokens == 0
    assert new is None  # no free block left
    mgr.check_invariants()


def test_not_enough_free_blocks_with_a_hit_touches_nothing() -> None:
    mgr = make_manager(BS, 11)
    mgr.add_request("0", COMMON)
    assert admit(mgr, "0")[1] == ([1, 2, 3],)

    mgr.add_request("1", COMMON * 2)
    hit, new = admit(mgr, "1")
    assert as_lists(hit.block_ids) == ([1, 2, 3],)
    assert hit.num_computed_tokens == 48
    assert new == ([4, 5, 6],)
    mgr.free("1")  # preempted: blocks 4-6 become evictable cache entries
    assert [mgr.block_ref_count(b) for b in (1, 2, 3)] == [1, 1, 1]
    assert [mgr.block_ref_count(b) for b in (4, 5, 6)] == [0, 0, 0]

    mgr.add_request("2", [7] * 32)
    assert admit(mgr, "2")[1] is not None
    assert mgr.num_free_blocks == 5

    # req3 hits 6 blocks (96 tokens) but needs 3 new + 3 evictable = 6 > 5.
    mgr.add_request("3", COMMON * 3)
    queue_before = free_queue(mgr)
    hit, new = admit(mgr, "3")
    assert as_lists(hit.block_ids) == ([1, 2, 3, 4, 5, 6],)
    assert hit.num_computed_tokens == 96
    assert new is None
    assert [mgr.block_ref_count(b) for b in (1, 2, 3)] == [1, 1, 1]
    assert [mgr.block_ref_count(b) for b in (4, 5, 6)] == [0, 0, 0]
    assert mgr.num_free_blocks == 5
    assert free_queue(mgr) == queue_before
    assert as_lists(mgr.get_block_ids("3")) == ([],)
    mgr.check_invariants()


def test_a_hit_can_be_adopted_with_zero_new_tokens() -> None:
    # vLLM 0.33 allows num_new_tokens == 0 when computed tokens are adopted.
    mgr = make_manager(BS, 11)
    mgr.add_request("0", COMMON + [3] * 7)
    admit(mgr, "0")
    mgr.add_request("1", COMMON + [4] * 5)
    hit = mgr.get_computed_blocks("1")
    new = mgr.allocate_slots("1", 0, num_computed_tokens=0, new_computed_blocks=hit)
    assert new is not None and as_lists(new) == ([],)
    assert as_lists(mgr.get_block_ids("1")) == ([1, 2, 3],)
    assert [mgr.block_ref_count(b) for b in (1, 2, 3)] == [2, 2, 2]
    # The request is now running from token 48.
    assert as_lists(mgr.allocate_slots("1", 5, num_computed_tokens=48)) == ([5],)
    mgr.check_invariants()


def test_a_hit_read_after_it_was_adopted_still_names_its_blocks() -> None:
    # The arrays of a hit are made when first read: reading them after the hit
    # was adopted (and twice) gives the blocks the lookup found, as one tuple.
    mgr = make_manager(BS, 11)
    mgr.add_request("0", COMMON + [3] * 7)
    admit(mgr, "0")
    mgr.add_request("1", COMMON + [4] * 5)
    hit = mgr.get_computed_blocks("1")
    assert mgr.allocate_slots("1", 5, num_computed_tokens=0, new_computed_blocks=hit) is not None
    mgr.free("1")
    mgr.remove_request("0")
    first = hit.block_ids
    assert first is hit.block_ids
    assert [a.tolist() for a in first] == [[1, 2, 3]]
    assert str(first[0].dtype) == "int32"
    # A miss shares the manager's one empty tuple of empty arrays.
    mgr.add_request("2", [9] * 20)
    miss = mgr.get_computed_blocks("2")
    assert miss.block_ids is mgr.get_computed_blocks("2").block_ids
    assert [a.tolist() for a in miss.block_ids] == [[]]


# --------------------------------------------------------------------------- delayed caching


def test_delayed_blocks_are_cached_only_by_cache_blocks() -> None:
    mgr = make_manager(4, 5, enable_kv_cache_events=True)
    tokens = list(range(14))  # blocks [0-3] [4-7] [8-11] [12,13]
    mgr.add_request("0", tokens)
    _, new = admit(mgr, "0", delay_cache_blocks=True)
    assert new == ([1, 2, 3, 4],)
    assert mgr.num_cached_block_hashes == 0
    assert mgr.take_events() == []

    hashes = mgr.block_hashes("0")
    assert hashes == chain("sha256_cbor", mgr.none_hash, tokens, 4)
    mgr.cache_blocks("0", 8)
    assert mgr.num_cached_block_hashes == 2
    assert [mgr.cached_block_hash(b) for b in (1, 2, 3)] == [(hashes[0], 0), (hashes[1], 0), None]
    mgr.cache_blocks("0", 12)
    assert mgr.num_cached_block_hashes == 3
    assert mgr.cached_block_hash(3) == (hashes[2], 0)
    mgr.cache_blocks("0", 12)  # nothing new
    assert mgr.num_cached_block_hashes == 3

    first, second = mgr.take_events()
    assert first.block_hashes == [event_hash(h) for h in hashes[:2]]
    assert first.parent_block_hash is None
    assert first.token_ids == tokens[:8]
    # A later call chains on the logical hash of the previous block.
    assert second.block_hashes == [event_hash(hashes[2])]
    assert second.parent_block_hash == event_hash(hashes[1])
    assert second.token_ids == tokens[8:12]
    assert second.extra_keys == [None]
    mgr.check_invariants()


# --------------------------------------------------------------------------- extra keys


P = 32000  # image placeholder token (vLLM's test uses -1; token ids here are u32)


def test_mm_prefix_caching_hashes_items_with_block_relative_offsets() -> None:
    mgr = make_manager(BS, 11, enable_kv_cache_events=True)
    # [T*10, P0*6] [P0*4, T*10, P1*2] [P1*16] [P1*7 ...
    common = list(range(10)) + [P] * 6
    common += [P] * 4 + list(range(10, 20)) + [P] * 2
    common += [P] * 16
    mm_common = [("aaa", 11, 10), ("bbb", 30, 18)]
    tokens0 = common + [P] * 7 + [100] * 4
    mm0 = [*mm_common, ("ccc", 48, 7)]
    mgr.add_request("0", tokens0, mm_features=mm0)

    keys = [
        (("mm", "aaa", 11),),
        (("mm", "aaa", -5), ("mm", "bbb", 14)),
        (("mm", "bbb", -2),),
    ]
    hashes = mgr.block_hashes("0")
    assert hashes == chain("sha256_cbor", mgr.none_hash, tokens0, BS, keys)

    hit, new = admit(mgr, "0")
    assert hit.num_computed_tokens == 0
    assert new == ([1, 2, 3, 4],)
    (stored,) = mgr.take_events()
    # Events carry the untagged keys: (identifier, offset) pairs.
    assert stored.extra_keys == [(("aaa", 11),), (("aaa", -5), ("bbb", 14)), (("bbb", -2),)]

    # 5 decode tokens complete block 3, which holds image ccc at offset 0.
    mgr.append_token_ids("0", [8] * 5)
    new = mgr.allocate_slots("0", 5, num_computed_tokens=59)
    assert as_lists(new) == ([],)
    hashes = mgr.block_hashes("0")
    assert len(hashes) == 4
    assert hashes[3] == pk.hash_block_tokens(
        "sha256_cbor",
        hashes[2],
        tokens0[48:] + [8] * 5,
        (("mm", "ccc", 0),),
        none_hash=mgr.none_hash,
    )

    # Same images, different text after them: the 3-block prefix hits.
    mgr.add_request("1", common + [P] * 7 + [200] * 5, mm_features=mm0)
    hit = mgr.get_computed_blocks("1")
    assert as_lists(hit.block_ids) == ([1, 2, 3],)
    assert hit.num_computed_tokens == 48


def test_mm_items_as_feature_objects_hash_as_their_tuples() -> None:
    # vLLM hands MultiModalFeatureSpec objects (identifier, mm_position.offset /
    # .length); NumPy integers count as ints.
    from types import SimpleNamespace

    import numpy as np

    mgr = make_manager(BS, 20)
    tokens = list(range(10)) + [P] * 20 + list(range(10))
    mgr.add_request("tuples", tokens, mm_features=[("aaa", 10, 12), ("bbb", 22, 8)])
    specs = [
        SimpleNamespace(identifier="aaa", mm_position=SimpleNamespace(offset=10, length=12)),
        SimpleNamespace(
            identifier="bbb", mm_position=SimpleNamespace(offset=np.int64(22), length=8)
        ),
    ]
    mgr.add_request("specs", tokens, mm_features=specs)
    mgr.add_request("lists", tokens, mm_features=[["aaa", 10, 12], ["bbb", 22, 8]])
    assert mgr.block_hashes("specs") == mgr.block_hashes("tuples") == mgr.block_hashes("lists")
    mgr.add_request("other", tokens, mm_features=[("aaa", 10, 12), ("ccc", 22, 8)])
    assert mgr.block_hashes("other")[1] != mgr.block_hashes("tuples")[1]


@pytest.mark.parametrize(
    "item",
    [("img", True, 2), ("img", 0, False), ("img", 0.0, 2), (b"img", 0, 2)],
    ids=["bool_offset", "bool_length", "float_offset", "bytes_identifier"],
)
def test_mm_items_that_are_not_exact_ints_and_str_are_refused(item: tuple) -> None:
    mgr = make_manager(BS, 20)
    with pytest.raises(TypeError):
        mgr.add_request("a", list(range(30)), mm_features=[item])
    assert "a" not in mgr


def test_prompt_embeds_of_any_buffer_hash_as_their_raw_bytes() -> None:
    import numpy as np
    import torch

    mgr = make_manager(4, 20)
    tokens = list(range(10))
    emb = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3).to(torch.bfloat16)
    raw = emb.view(torch.uint8).numpy().tobytes()
    mgr.add_request("bytes", tokens, prompt_embeds=raw)
    mgr.add_request("tensor", tokens, prompt_embeds=emb)
    mgr.add_request("strided", tokens, prompt_embeds=emb.t().contiguous().t())
    mgr.add_request("bytearray", tokens, prompt_embeds=bytearray(raw))
    mgr.add_request("memoryview", tokens, prompt_embeds=memoryview(raw))
    as_array = np.frombuffer(raw, dtype=np.uint16).reshape(10, 3)
    mgr.add_request("numpy", tokens, prompt_embeds=as_array)
    expected = mgr.block_hashes("bytes")
    for rid in ("tensor", "strided", "bytearray", "memoryview", "numpy"):
        assert mgr.block_hashes(rid) == expected, rid
    mgr.add_request("none", tokens)
    assert mgr.block_hashes("none") != expected


def test_add_request_is_the_core_call_itself() -> None:
    # No Python frame between the scheduler and the core on a request's arrival.
    assert pk.KVCacheManager.add_request is pk._core.KVCacheManager.add_request


def test_cache_salt_keys_only_the_first_block_and_separates_caches() -> None:
    mgr = make_manager(BS, 11)
    tokens = COMMON + [3] * 11
    mgr.add_request("0", tokens, cache_salt="salt1")
    salted = [(("cache_salt", "salt1"),), None, None]
    hashes = mgr.block_hashes("0")
    assert hashes == chain("sha256_cbor", mgr.none_hash, tokens, BS, salted)

    _, new = admit(mgr, "0")
    assert new == ([1, 2, 3, 4],)
    mgr.append_token_ids("0", [8] * 5)
    assert as_lists(mgr.allocate_slots("0", 5, num_computed_tokens=59)) == ([],)
    hashes = mgr.block_hashes("0")
    assert len(hashes) == 4
    assert hashes[3] == pk.hash_block_tokens(
        "sha256_cbor", hashes[2], tokens[48:] + [8] * 5, None, none_hash=mgr.none_hash
    )

    # Same salt: the 3-block prefix hits.
    mgr.add_request("1", COMMON + [4] * 11, cache_salt="salt1")
    hit = mgr.get_computed_blocks("1")
    assert len(hit.block_ids[0]) == 3
    assert hit.num_computed_tokens == 48

    # Same tokens, another salt: a miss, and a different chain.
    tokens2 = COMMON + [4] * 11
    mgr.add_request("2", tokens2, cache_salt="salt2")
    hit = mgr.get_computed_blocks("2")
    assert len(hit.block_ids[0]) == 0
    assert hit.num_computed_tokens == 0
    assert mgr.block_hashes("2") == chain(
        "sha256_cbor", mgr.none_hash, tokens2, BS, [(("cache_salt", "salt2"),), None, None]
    )
    assert mgr.block_hashes("2")[0] != mgr.block_hashes("1")[0]


# --------------------------------------------------------------------------- reset


def test_reset_prefix_cache_fails_while_blocks_are_held_and_clears_everything_after() -> None:
    mgr = make_manager(BS, 11, log_stats=True, enable_kv_cache_events=True)
    mgr.add_request("0", COMMON + [3] * 7)
    new = mgr.allocate_slots("0", 55, num_computed_tokens=0)
    assert as_lists(new) == ([1, 2, 3, 4],)
    mgr.add_request("1", COMMON + [4] * 7)
    hit, new = admit(mgr, "1")
    assert len(hit.block_ids[0]) == 3
    assert new == ([5],)
    mgr.make_prefix_cache_stats()
    mgr.take_events()

    assert mgr.reset_prefix_cache() is False
    assert mgr.num_cached_block_hashes == 3
    stats = mgr.make_prefix_cache_stats()
    assert stats is not None and stats.reset is False
    assert mgr.take_events() == []

    mgr.remove_request("0")
    mgr.remove_request("1")
    assert mgr.reset_prefix_cache() is True
    assert mgr.num_cached_block_hashes == 0
    assert all(mgr.cached_block_hash(b) is None for b in range(mgr.num_blocks))
    stats = mgr.make_prefix_cache_stats()
    assert stats is not None and stats.reset is True
    assert mgr.take_events() == [pk.AllBlocksCleared()]

    # Nothing hits after the reset.
    mgr.add_request("2", COMMON + [3] * 7)
    assert mgr.get_computed_blocks("2").num_computed_tokens == 0
    mgr.check_invariants()


# --------------------------------------------------------------------------- stats


def test_prefix_cache_stats_are_none_when_log_stats_is_off() -> None:
    mgr = make_manager(BS, 11, log_stats=False)
    assert mgr.make_prefix_cache_stats() is None
    mgr.add_request("0", list(range(16)))
    hit, _ = admit(mgr, "0")
    assert hit.num_computed_tokens == 0
    mgr.reset_prefix_cache()
    assert mgr.make_prefix_cache_stats() is None


def test_prefix_cache_stats_count_admissions_and_preempted_requests_separately() -> None:
    mgr = make_manager(BS, 11, log_stats=True)
    assert mgr.make_prefix_cache_stats() == pk.PrefixCacheStats()

    mgr.add_request("0", COMMON + [3] * 7)  # 55 tokens, miss
    admit(mgr, "0")
    mgr.add_request("1", COMMON + [3] * 5)  # 53 tokens, 48 hit
    admit(mgr, "1")
    stats = mgr.make_prefix_cache_stats()
    assert stats == pk.PrefixCacheStats(requests=2, queries=108, hits=48)
    assert stats.hit_rate == pytest.approx(48 / 108)
    # make_prefix_cache_stats starts a fresh window.
    assert mgr.make_prefix_cache_stats() == pk.PrefixCacheStats()

    # A lookup that is not followed by a successful allocation is not counted.
    mgr.add_request("big", [5] * 100)  # needs 7 blocks, 5 free
    hit, new = admit(mgr, "big")
    assert new is None
    # Prompt-logprobs requests skip the lookup and are not counted either.
    mgr.add_request("plp", [*COMMON, 9], skip_reading_prefix_cache=True)
    admit(mgr, "plp")
    assert mgr.make_prefix_cache_stats() == pk.PrefixCacheStats()

    # A preempted request re-admitted counts in the preempted_* fields, with its
    # current length (prompt + outputs).
    mgr.append_token_ids("1", [6])  # 54 tokens
    mgr.free("1")
    assert mgr.num_preemptions("1") == 1
    hit, new = admit(mgr, "1")
    assert hit.num_computed_tokens == 48
    assert new is not None
    assert mgr.make_prefix_cache_stats() == pk.PrefixCacheStats(
        preempted_requests=1, preempted_queries=54, preempted_hits=48
    )


def test_a_request_looked_up_several_times_is_counted_once_at_admission() -> None:
    mgr = make_manager(BS, 11, log_stats=True)
    mgr.add_request("x", list(range(96)))  # 6 blocks
    admit(mgr, "x")
    mgr.make_prefix_cache_stats()
    mgr.add_request("big", [5] * 100)  # 7 blocks, 4 free
    for _ in range(3):
        assert admit(mgr, "big")[1] is None
    mgr.remove_request("x")
    assert admit(mgr, "big")[1] is not None
    assert mgr.make_prefix_cache_stats() == pk.PrefixCacheStats(requests=1, queries=100, hits=0)


# --------------------------------------------------------------------------- events


@pytest.mark.parametrize("blocks_to_cache", [2, 3, 10])
def test_kv_cache_events_store_evict_and_clear(blocks_to_cache: int) -> None:
    n = blocks_to_cache
    mgr = make_manager(BS, n + 1, enable_kv_cache_events=True)
    tokens = list(range(BS * n))
    mgr.add_request("0", tokens)
    mgr.allocate_slots("0", BS * n, num_computed_tokens=0)
    events = mgr.take_events()
    stored = events[-1]
    assert isinstance(stored, pk.BlockStored)
    hashes = [event_hash(h) for h in mgr.block_hashes("0")]
    assert stored.block_hashes == hashes
    assert len(stored.block_hashes) == n == mgr.num_cached_block_hashes
    assert stored.parent_block_hash is None
    assert stored.token_ids == tokens
    assert len(stored.token_ids) == stored.block_size * n
    assert stored.block_size == BS
    assert stored.lora_id is None and stored.lora_name is None
    assert stored.medium == "GPU"
    assert stored.extra_keys == [None] * n
    assert stored.group_idx == 0
    assert stored.kv_cache_spec_kind == "full_attention"
    assert stored.kv_cache_spec_sliding_window is None
    assert mgr.take_events() == []  # drained

    # Free, then allocate the same tokens without a lookup: every cached block
    # is evicted (one BlockRemoved each, deepest first) and stored again.
    mgr.remove_request("0")
    mgr.add_request("1", tokens)
    mgr.allocate_slots("1", BS * n, num_computed_tokens=0)
    events = mgr.take_events()
    assert len(events) == n + 1
    assert events[:-1] == [
        pk.BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0) for h in reversed(hashes)
    ]
    assert isinstance(events[-1], pk.BlockStored)
    assert events[-1].block_hashes == hashes
    assert mgr.num_cached_block_hashes == n

    mgr.remove_request("1")
    assert mgr.reset_prefix_cache()
    events = mgr.take_events()
    assert isinstance(events[-1], pk.AllBlocksCleared)
    assert mgr.num_cached_block_hashes == 0


@pytest.mark.parametrize("blocks_to_cache", [2, 3, 10])
def test_kv_cache_events_carry_lora_id_and_name(blocks_to_cache: int) -> None:
    n = blocks_to_cache
    mgr = make_manager(BS, n + 1, enable_kv_cache_events=True)
    tokens = list(range(BS * n))
    mgr.add_request("lora", tokens, lora_name="test_lora", lora_id=42, lora_path="/test/path")
    mgr.allocate_slots("lora", BS * n, num_computed_tokens=0)
    stored = mgr.take_events()[-1]
    assert isinstance(stored, pk.BlockStored)
    assert stored.lora_id == 42
    assert stored.lora_name == "test_lora"
    assert len(stored.block_hashes) == n
    assert stored.block_size == BS
    # Untagged event keys: the bare LoRA name per block.
    assert stored.extra_keys == [("test_lora",)] * n
    mgr.remove_request("lora")

    mgr.add_request("plain", tokens)
    mgr.allocate_slots("plain", BS * n, num_computed_tokens=0)
    stored = mgr.take_events()[-1]
    assert isinstance(stored, pk.BlockStored)
    assert stored.lora_id is None
    assert stored.lora_name is None
    assert len(stored.block_hashes) == n
    assert stored.block_size == BS


def test_block_stored_event_of_a_decode_block_has_the_logical_parent_hash() -> None:
    mgr = make_manager(BS, 11, enable_kv_cache_events=True)
    tokens = list(range(32))
    mgr.add_request("0", tokens, cache_salt="s")
    admit(mgr, "0")
    (first,) = mgr.take_events()
    assert first.parent_block_hash is None
    assert first.extra_keys == [("s",), None]

    mgr.append_token_ids("0", list(range(32, 48)))
    mgr.allocate_slots("0", 16, num_computed_tokens=32)
    (second,) = mgr.take_events()
    hashes = mgr.block_hashes("0")
    assert second.block_hashes == [event_hash(hashes[2])]
    assert second.parent_block_hash == event_hash(hashes[1])
    assert second.token_ids == list(range(32, 48))
    assert second.extra_keys == [None]


def test_events_are_empty_when_disabled() -> None:
    mgr = make_manager(BS, 11, enable_kv_cache_events=False)
    mgr.add_request("0", list(range(40)))
    admit(mgr, "0")
    mgr.remove_request("0")
    mgr.reset_prefix_cache()
    assert mgr.take_events() == []


# --------------------------------------------------------------------------- eagle


@pytest.mark.parametrize(
    ("num_tokens", "use_eagle", "expected_blocks"),
    [
        (48, True, 1),  # 47 lookable tokens -> 2 blocks -> EAGLE drops 1
        (37, True, 1),  # 2 full blocks -> EAGLE drops 1
        (48, False, 2),
        (37, False, 2),
    ],
)
def test_eagle_drops_the_last_hit_block(
    num_tokens: int, use_eagle: bool, expected_blocks: int
) -> None:
    mgr = make_manager(BS, 10, use_eagle=use_eagle)
    tokens = [0] * num_tokens
    mgr.add_request("prime", tokens)
    admit(mgr, "prime")
    mgr.remove_request("prime")

    mgr.add_request("again", tokens)
    hit = mgr.get_computed_blocks("again")
    assert len(hit.block_ids[0]) == expected_blocks
    assert hit.num_computed_tokens == expected_blocks * BS


# --------------------------------------------------------------------------- lookahead


@pytest.mark.parametrize(
    ("num_new_tokens", "num_lookahead_tokens", "expected_blocks"), [(3, 2, 2), (3, 4, 2)]
)
def test_lookahead_tokens_get_slots(
    num_new_tokens: int, num_lookahead_tokens: int, expected_blocks: int
) -> None:
    # vLLM's test_allocate_with_lookahead (block size 4, 10 blocks, max_model_len 100)
    # uses an empty prompt; a 3-token prompt schedules the same 3 tokens.
    mgr = make_manager(4, 10, max_model_len=100)
    mgr.add_request("0", [1, 2, 3])
    new = mgr.allocate_slots(
        "0", num_new_tokens, num_computed_tokens=0, num_lookahead_tokens=num_lookahead_tokens
    )
    assert new is not None
    assert len(new[0]) == expected_blocks


def test_lookahead_slots_are_capped_at_max_model_len() -> None:
    # num_tokens_need_slot = min(computed + new + lookahead, max_model_len).
    mgr = make_manager(4, 10, max_model_len=8)
    mgr.add_request("0", [1, 2, 3, 4, 5, 6])
    new = mgr.allocate_slots("0", 6, num_computed_tokens=0, num_lookahead_tokens=10)
    assert new is not None and len(new[0]) == 2


# --------------------------------------------------------------------------- misc


def test_usage_is_the_used_fraction_of_usable_blocks() -> None:
    mgr = make_manager(BS, 11)
    assert mgr.usage == 0.0
    mgr.add_request("0", COMMON + [3] * 7)
    admit(mgr, "0")
    assert mgr.usage == pytest.approx(1.0 - 6 / 10)


def test_num_common_prefix_blocks_counts_blocks_held_by_every_request() -> None:
    # pagedkv keeps vLLM <= 0.32's meaning (DESIGN.md section 4; reference
    # section 2.3): leading blocks whose ref count equals the number of requests
    # holding blocks. vLLM 0.33 dropped cascade attention and returns zeros.
    mgr = make_manager(BS, 11)
    mgr.add_request("0", COMMON + [3] * 7)
    admit(mgr, "0")
    assert mgr.get_num_common_prefix_blocks("0") == [4]
    mgr.add_request("1", COMMON + [3] * 5)
    admit(mgr, "1")
    assert mgr.get_num_common_prefix_blocks("0") == [3]
    assert mgr.get_num_common_prefix_blocks("1") == [3]
    mgr.add_request("2", [7] * 20)
    admit(mgr, "2")
    assert mgr.get_num_common_prefix_blocks("0") == [0]


# --------------------------------------------------------------------------- more vLLM 0.33 rules


def test_evicting_a_held_block_drops_only_its_cache_entry() -> None:
    # evict_blocks (KV-connector load failure) removes the hash without touching
    # ref counts; freed later, the block is unhashed and goes to the queue front.
    mgr = make_manager(BS, 11, enable_kv_cache_events=True)
    mgr.add_request("a", COMMON + [3] * 7)
    admit(mgr, "a")
    hashes = mgr.block_hashes("a")
    mgr.take_events()
    mgr.evict_blocks([2])
    assert mgr.take_events() == [pk.BlockRemoved([event_hash(hashes[1])], "GPU", 0)]
    assert mgr.cached_block_hash(2) is None
    assert mgr.block_ref_count(2) == 1
    assert mgr.num_cached_block_hashes == 2
    mgr.remove_request("a")
    assert free_queue(mgr) == [4, 2, 5, 6, 7, 8, 9, 10, 3, 1]

    # The chain is broken at block 2: only block 1 hits; the 2nd and 3rd blocks
    # are recomputed into blocks 4 and 2 and cached again (block 3's entry stays,
    # so that hash now has two blocks).
    mgr.add_request("b", COMMON + [3] * 7)
    hit, new = admit(mgr, "b")
    assert as_lists(hit.block_ids) == ([1],)
    assert new == ([4, 2, 5],)
    (stored,) = mgr.take_events()
    assert stored.block_hashes == [event_hash(h) for h in hashes[1:]]
    assert stored.parent_block_hash == event_hash(hashes[0])
    assert [int(b) for b in mgr.cached_blocks_for_hash(hashes[2])] == [3, 2]
    mgr.check_invariants()


def test_evicting_a_free_cached_block_keeps_its_queue_position() -> None:
    mgr = make_manager(BS, 11, enable_kv_cache_events=True)
    mgr.add_request("a", COMMON + [3] * 7)
    admit(mgr, "a")
    mgr.remove_request("a")
    queue = free_queue(mgr)
    assert queue == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    mgr.take_events()
    mgr.evict_blocks([2, 4, 0])  # cached, unhashed, null: only block 2 has an entry
    assert free_queue(mgr) == queue
    assert len(mgr.take_events()) == 1
    mgr.add_request("b", list(range(500, 660)))
    assert admit(mgr, "b")[1] == (queue,)
    # Two entries were left to evict (blocks 3 and 1), in queue order.
    removed = [e for e in mgr.take_events() if isinstance(e, pk.BlockRemoved)]
    assert len(removed) == 2


def test_evict_blocks_emits_removals_in_iteration_order() -> None:
    # vLLM passes a set and evicts in its iteration order.
    mgr = make_manager(4, 20, enable_kv_cache_events=True)
    mgr.add_request("a", list(range(40)))
    admit(mgr, "a")
    mgr.take_events()
    hashes = mgr.block_hashes("a")  # block i+1 holds hashes[i]
    for block_ids in ({3, 1}, {9, 2, 5}, {10, 8}):
        mgr.evict_blocks(block_ids)
        removed = [e.block_hashes[0] for e in mgr.take_events()]
        assert removed == [event_hash(hashes[b - 1]) for b in block_ids]


def test_duplicate_cache_entries_serve_the_first_inserted_block() -> None:
    mgr = make_manager(BS, 11)
    for rid in ("a", "b"):  # both skip reading: two copies of the same prefix
        mgr.add_request(rid, COMMON + [3] * 7, skip_reading_prefix_cache=True)
        admit(mgr, rid)
    assert as_lists(mgr.get_block_ids("b")) == ([5, 6, 7, 8],)
    first = mgr.block_hashes("a")[0]
    assert [int(b) for b in mgr.cached_blocks_for_hash(first)] == [1, 5]
    mgr.add_request("c", COMMON + [4] * 5)
    assert as_lists(mgr.get_computed_blocks("c").block_ids) == ([1, 2, 3],)
    mgr.evict_blocks([1])
    assert [int(b) for b in mgr.cached_blocks_for_hash(first)] == [5]
    assert as_lists(mgr.get_computed_blocks("c").block_ids) == ([5, 2, 3],)


def test_identical_prompts_in_one_step_share_blocks_cached_at_allocation() -> None:
    # Blocks are published when allocated, so a twin admitted right after the
    # first one hits 96 of its 100 tokens (vLLM's prefill dedup test).
    mgr = make_manager(BS, 20)
    mgr.add_request("a", [5] * 100)
    mgr.add_request("b", [5] * 100)
    assert admit(mgr, "a")[1] == ([1, 2, 3, 4, 5, 6, 7],)
    hit, new = admit(mgr, "b")
    assert hit.num_computed_tokens == 96
    assert new == ([8],)


def test_chunked_prefill_caches_full_blocks_chunk_by_chunk() -> None:
    mgr = make_manager(BS, 20, enable_kv_cache_events=True)
    mgr.add_request("a", list(range(100)))
    hashes = mgr.block_hashes("a")
    hit = mgr.get_computed_blocks("a")
    new = mgr.allocate_slots("a", 40, num_computed_tokens=0, new_computed_blocks=hit)
    assert as_lists(new) == ([1, 2, 3],)
    assert mgr.num_cached_block_hashes == 2
    assert as_lists(mgr.allocate_slots("a", 40, num_computed_tokens=40)) == ([4, 5],)
    assert mgr.num_cached_block_hashes == 5
    assert as_lists(mgr.allocate_slots("a", 20, num_computed_tokens=80)) == ([6, 7],)
    assert mgr.num_cached_block_hashes == 6
    events = mgr.take_events()
    assert [e.block_hashes for e in events] == [
        [event_hash(h) for h in hashes[0:2]],
        [event_hash(h) for h in hashes[2:5]],
        [event_hash(hashes[5])],
    ]
    assert [e.parent_block_hash for e in events] == [
        None,
        event_hash(hashes[1]),
        event_hash(hashes[4]),
    ]


def test_preempted_request_rehits_its_own_prompt_and_output_blocks() -> None:
    mgr = make_manager(BS, 11, log_stats=True)
    mgr.add_request("a", list(range(40)))
    admit(mgr, "a")
    news = []
    for t in range(30):  # 30 decode steps: blocks fill at 48 and 64 tokens
        mgr.append_token_ids("a", [t])
        news.append(as_lists(mgr.allocate_slots("a", 1, num_computed_tokens=40 + t)))
    assert [i for i, n in enumerate(news) if n != ([],)] == [8, 24]
    assert news[8] == ([4],) and news[24] == ([5],)
    assert len(mgr.block_hashes("a")) == 4
    assert mgr.num_cached_block_hashes == 4
    mgr.free("a")
    assert free_queue(mgr) == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]
    hit, new = admit(mgr, "a")  # 70 tokens now
    assert as_lists(hit.block_ids) == ([1, 2, 3, 4],)
    assert hit.num_computed_tokens == 64
    assert new == ([5],)
    assert mgr.make_prefix_cache_stats() == pk.PrefixCacheStats(
        requests=1,
        queries=40,
        hits=0,
        preempted_requests=1,
        preempted_queries=70,
        preempted_hits=64,
    )


def test_external_computed_tokens_get_fresh_blocks_after_the_local_hit() -> None:
    mgr = make_manager(BS, 11)
    mgr.add_request("a", COMMON + [3] * 7)
    admit(mgr, "a")
    mgr.remove_request("a")
    mgr.add_request("b", COMMON + list(range(100, 132)) + [5] * 3)  # 83 tokens
    hit = mgr.get_computed_blocks("b")
    assert hit.num_computed_tokens == 48
    new = mgr.allocate_slots(
        "b", 3, num_computed_tokens=0, new_computed_blocks=hit, num_external_computed_tokens=32
    )
    # Blocks for the 32 external tokens come first, then the new tokens' block.
    assert as_lists(new) == ([6],)
    assert as_lists(mgr.get_block_ids("b")) == ([1, 2, 3, 4, 5, 6],)
    assert mgr.num_cached_block_hashes == 5
    assert free_queue(mgr) == [7, 8, 9, 10]

    # An async load: zero new tokens, delayed caching, published by cache_blocks.
    mgr.add_request("c", list(range(300, 340)))
    new = mgr.allocate_slots(
        "c", 0, num_computed_tokens=0, num_external_computed_tokens=32, delay_cache_blocks=True
    )
    assert as_lists(new) == ([],)
    assert as_lists(mgr.get_block_ids("c")) == ([7, 8],)
    assert mgr.num_cached_block_hashes == 5
    mgr.cache_blocks("c", 32)
    assert mgr.num_cached_block_hashes == 7
    mgr.check_invariants()


@pytest.mark.parametrize(
    ("has_scheduled_reqs", "expected"), [(True, None), (False, ([1, 2, 3, 4, 5, 6, 7, 8, 9],))]
)
def test_watermark_applies_to_admissions_while_others_are_scheduled(
    has_scheduled_reqs: bool, expected: tuple[list[int], ...] | None
) -> None:
    # watermark_blocks = int(0.2 * 11) = 2: 9 needed + 2 > 10 free.
    mgr = make_manager(BS, 11, watermark=0.2)
    mgr.add_request("a", list(range(16 * 9)))
    new = mgr.allocate_slots("a", 144, num_computed_tokens=0, has_scheduled_reqs=has_scheduled_reqs)
    assert as_lists(new) == expected


def test_watermark_does_not_apply_to_running_requests() -> None:
    mgr = make_manager(BS, 11, watermark=0.2)
    mgr.add_request("a", list(range(16 * 7)))
    assert as_lists(mgr.allocate_slots("a", 112, num_computed_tokens=0)) == ([1, 2, 3, 4, 5, 6, 7],)
    mgr.append_token_ids("a", [1] * 20)
    # 2 more blocks leave 1 free, below the watermark: fine for a running request.
    assert as_lists(mgr.allocate_slots("a", 20, num_computed_tokens=112)) == ([8, 9],)


def test_full_sequence_must_fit_and_reserved_blocks_gate_admission() -> None:
    mgr = make_manager(BS, 11)
    mgr.add_request("x", list(range(80)))
    admit(mgr, "x")  # 5 blocks, 5 free
    mgr.add_request("a", list(range(1000, 1100)))  # 7 blocks in all
    assert mgr.allocate_slots("a", 16, num_computed_tokens=0, full_sequence_must_fit=True) is None
    assert as_lists(mgr.allocate_slots("a", 16, num_computed_tokens=0)) == ([6],)
    mgr.add_request("b", list(range(2000, 2064)))  # 4 blocks in all, 4 free
    assert as_lists(
        mgr.allocate_slots("b", 16, num_computed_tokens=0, full_sequence_must_fit=True)
    ) == ([7],)
    mgr.add_request("c", list(range(3000, 3064)))  # 1 block now, 3 free, 2 reserved
    assert as_lists(mgr.allocate_slots("c", 16, num_computed_tokens=0, reserved_blocks=2)) == ([8],)
    mgr.add_request("d", list(range(4000, 4064)))  # 2 free, 2 reserved
    assert mgr.allocate_slots("d", 16, num_computed_tokens=0, reserved_blocks=2) is None


def test_prompt_embeds_add_a_per_block_digest_key() -> None:
    # vLLM 0.33: ("prompt_embeds", sha256(raw bytes of the block's embeddings)),
    # after the LoRA and cache-salt keys; events carry the bare digest.
    import hashlib

    import numpy as np

    mgr = make_manager(4, 20, enable_kv_cache_events=True)
    emb = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
    tokens = list(range(10))
    mgr.add_request("a", tokens, prompt_embeds=emb, cache_salt="s", lora_name="L", lora_path="/p")
    digests = [hashlib.sha256(emb[i * 4 : (i + 1) * 4].tobytes()).digest() for i in range(2)]
    keys = [
        (("lora", "L", "/p"), ("cache_salt", "s"), ("prompt_embeds", digests[0])),
        (("lora", "L", "/p"), ("prompt_embeds", digests[1])),
    ]
    assert mgr.block_hashes("a") == chain("sha256_cbor", mgr.none_hash, tokens, 4, keys)
    admit(mgr, "a")
    (stored,) = mgr.take_events()
    assert stored.extra_keys == [("L", "s", digests[0]), ("L", digests[1])]
    # Other embeddings, other hashes.
    mgr.add_request("b", tokens, prompt_embeds=emb + 1)
    assert mgr.block_hashes("b")[0] != mgr.block_hashes("a")[0]


def test_empty_cache_salt_adds_no_key() -> None:
    # vLLM only adds the salt key when request.cache_salt is truthy.
    mgr = make_manager(4, 20)
    mgr.add_request("salted", list(range(8)), cache_salt="")
    mgr.add_request("plain", list(range(8)))
    assert mgr.block_hashes("salted") == mgr.block_hashes("plain")


def test_freeing_a_request_that_holds_no_blocks_is_not_a_preemption() -> None:
    # vLLM's scheduler only preempts running requests; freeing a waiting request
    # (nothing allocated yet) must not move its stats to the preempted_* fields.
    mgr = make_manager(num_blocks=11, block_size=16, log_stats=True)
    mgr.add_request("w", list(range(20)))
    mgr.free("w")
    assert mgr.num_preemptions("w") == 0
    hit = mgr.get_computed_blocks("w")
    assert mgr.allocate_slots("w", 20, num_computed_tokens=0, new_computed_blocks=hit) is not None
    stats = mgr.make_prefix_cache_stats()
    assert stats is not None
    assert (stats.requests, stats.preempted_requests) == (1, 0)
