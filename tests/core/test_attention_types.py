"""vLLM 0.33's single-type managers other than full attention, driven through the
manager: sliding window, chunked local attention, Mamba ("align"), cross attention,
attention sinks and MLA.

Scenarios follow vLLM's ``tests/v1/core/test_single_type_kv_cache_manager.py`` and
``test_prefix_caching.py``; every expected value was read from vLLM 0.33 itself (its
``KVCacheManager`` driven through pagedkv's API). Cached/uncached block patterns that
vLLM's unit tests build by hand are built here by caching a prompt, freeing it and
dropping the unwanted blocks' keys with ``evict_blocks``.

Where vLLM returns ``None`` for a request that can never fit, pagedkv raises
``CannotFitError`` (its documented contract): ``refused`` accepts either.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pagedkv as pk
import pytest

from tests._util import admit, as_lists, full, manager, refused, swa


def free_queue(mgr: pk.KVCacheManager) -> list[int]:
    return [int(b) for b in mgr.free_block_ids()]


def cached_ids(mgr: pk.KVCacheManager) -> list[int]:
    return [b for b in range(mgr.num_blocks) if mgr.cached_block_hash(b) is not None]


def local(bs: int, chunk: int) -> pk.ChunkedLocalAttentionSpec:
    return pk.ChunkedLocalAttentionSpec(bs, 1, 1, "float32", attention_chunk_size=chunk)


def cache_pattern(mgr: pk.KVCacheManager, flags: Sequence[bool]) -> list[int]:
    """Caches ``len(flags)`` full blocks of 2 tokens (ids 1..n) and keeps the keys of
    the blocks whose flag is set. Returns the prompt's tokens."""
    tokens = list(range(2 * len(flags)))
    mgr.add_request("src", tokens)
    # No lookup: every block is a real block (a chunked-local lookup of a fresh
    # prompt is all null blocks).
    new = mgr.allocate_slots("src", len(tokens), num_computed_tokens=0)
    assert as_lists(new) == (list(range(1, len(flags) + 1)),)
    mgr.remove_request("src")
    mgr.evict_blocks([i + 1 for i, keep in enumerate(flags) if not keep])
    return tokens


# --------------------------------------------------------------------------- sliding window

T, F = True, False
_MIXED = [T, T, F, T, F, F, T, T, F]


@pytest.mark.parametrize(
    ("flags", "expect_blocks"),
    [
        ([F] * 10, 0),
        ([T], 1),
        ([T, F], 1),
        ([T, T], 2),
        ([T, T, F], 2),
        ([T, T, T], 3),
        ([T, T, T, F], 3),
        ([*_MIXED, T, T, T], 12),
        ([*_MIXED, F, F], 8),
        ([*_MIXED, F, F, T], 8),
    ],
)
def test_sliding_window_possible_cached_prefix(flags: list[bool], expect_blocks: int) -> None:
    # bs 2, window 4: a hit needs a run of 2 cached blocks ending the prefix (or a
    # shorter run starting at token 0).
    mgr = manager(len(flags) + 10, [swa(2, 4)])
    tokens = cache_pattern(mgr, flags)
    mgr.add_request("q", [*tokens, 999])  # hits at most len(tokens) tokens
    hit = mgr.get_computed_blocks("q")
    assert hit.num_computed_tokens == 2 * expect_blocks
    ids = as_lists(hit.block_ids)
    assert ids is not None
    keep = min(expect_blocks, 2)
    assert ids[0] == [0] * (expect_blocks - keep) + list(
        range(expect_blocks - keep + 1, expect_blocks + 1)
    )


def test_sliding_window_remove_skipped_blocks_nulls_and_frees_deepest_first() -> None:
    mgr = manager(30, [swa(2, 4)])
    mgr.add_request("a", list(range(21)))
    assert as_lists(mgr.allocate_slots("a", 21, num_computed_tokens=0)) == (list(range(1, 12)),)
    assert mgr.num_free_blocks == 18
    steps = [
        (0, 0, []),
        (4, 0, []),
        (5, 1, [1]),
        (6, 1, [1]),
        (7, 2, [1, 2]),
        (11, 4, [1, 2, 4, 3]),
        (12, 4, [1, 2, 4, 3]),
        (16, 6, [1, 2, 4, 3, 6, 5]),
        (21, 9, [1, 2, 4, 3, 6, 5, 9, 8, 7]),
    ]
    for n, nulled, freed_tail in steps:
        mgr.remove_skipped_blocks("a", n)
        assert as_lists(mgr.get_block_ids("a")) == ([0] * nulled + list(range(nulled + 1, 12)),)
        # Skipped blocks go to the queue's tail (they are cached), deeper ones first.
        assert free_queue(mgr) == list(range(12, 30)) + freed_tail
        mgr.check_invariants()
    mgr.free("a")
    # Freeing releases the live blocks tail first; the unhashed last block goes to the front.
    assert free_queue(mgr) == [11, *range(12, 30), 1, 2, 4, 3, 6, 5, 9, 8, 7, 10]


@pytest.mark.parametrize(("num_blocks", "admitted"), [(13, True), (12, False)])
def test_sliding_window_admission_counts_evictable_hits_not_null_padding(
    num_blocks: int, admitted: bool
) -> None:
    # bs 2, window 4. 40 tokens whose first 20 are cached: the hit is 8 null blocks
    # and 2 evictable blocks; the rest needs 10 fresh blocks -> 12 blocks, not 20.
    mgr = manager(num_blocks, [swa(2, 4)])
    mgr.add_request("a", list(range(21)))
    _, new = admit(mgr, "a")
    assert new == (list(range(1, 12)),)
    mgr.free("a")
    mgr.add_request("b", list(range(20)) + [999] * 20)
    hit = mgr.get_computed_blocks("b")
    assert hit.num_computed_tokens == 20
    assert as_lists(hit.block_ids) == ([0] * 8 + [9, 10],)

    def call() -> Any:
        return mgr.allocate_slots("b", 20, num_computed_tokens=0, new_computed_blocks=hit)

    if admitted:
        assert as_lists(call()) == ([11, 12, 8, 7, 6, 5, 4, 3, 2, 1],)
        assert as_lists(mgr.get_block_ids("b")) == (
            [0] * 8 + [9, 10, 11, 12, 8, 7, 6, 5, 4, 3, 2, 1],
        )
        assert mgr.num_free_blocks == 0
    else:
        assert refused(call)
        assert mgr.num_free_blocks == 11
    mgr.check_invariants()


def test_sliding_window_decode_releases_blocks_behind_the_window() -> None:
    mgr = manager(20, [swa(4, 8)])
    mgr.add_request("a", list(range(10)))
    _, new = admit(mgr, "a")
    assert new == ([1, 2, 3],)
    n, seen = 10, []
    for step in range(12):
        mgr.append_token_ids("a", [100 + step])
        new_ids = as_lists(mgr.allocate_slots("a", 1, num_computed_tokens=n))
        n += 1
        seen.append((n, new_ids, as_lists(mgr.get_block_ids("a")), mgr.num_free_blocks))
    # The window (8 tokens, 2-3 blocks) moves: the block behind it is released in the
    # step that computes the token after it, before a new block is taken.
    assert seen[:4] == [
        (11, ([],), ([1, 2, 3],), 16),
        (12, ([],), ([0, 2, 3],), 17),
        (13, ([4],), ([0, 2, 3, 4],), 16),
        (14, ([],), ([0, 2, 3, 4],), 16),
    ]
    assert seen[5:7] == [(16, ([],), ([0, 0, 3, 4],), 17), (17, ([5],), ([0, 0, 3, 4, 5],), 16)]
    assert seen[9:11] == [
        (20, ([],), ([0, 0, 0, 4, 5],), 17),
        (21, ([6],), ([0, 0, 0, 4, 5, 6],), 16),
    ]
    assert seen[-1] == (22, ([],), ([0, 0, 0, 4, 5, 6],), 16)
    mgr.check_invariants()


@pytest.mark.parametrize(
    ("block_size", "hit", "after_evict"),
    [
        (16, [1], []),
        (4, [0, 0, 0, 0, 5, 6, 7, 8], [0, 0, 0, 0, 5, 6, 7, 8]),
    ],
)
def test_eagle_with_sliding_window(block_size: int, hit: list[int], after_evict: list[int]) -> None:
    # Window 16 with EAGLE: one more contiguous block is needed, then dropped.
    mgr = manager(20, [swa(block_size, 16)], use_eagle=True)
    mgr.add_request("a", list(range(37)))
    admit(mgr, "a")
    mgr.free("a")
    mgr.add_request("b", list(range(37)))
    got = mgr.get_computed_blocks("b")
    assert as_lists(got.block_ids) == (hit,)
    assert got.num_computed_tokens == len(hit) * block_size
    mgr.evict_blocks([1])
    mgr.add_request("c", list(range(37)))
    got = mgr.get_computed_blocks("c")
    assert as_lists(got.block_ids) == (after_evict,)


# --------------------------------------------------------------------------- chunked local

_RANDOM8 = [random.Random(0).random() < 0.5 for _ in range(8)]


@pytest.mark.parametrize(
    ("flags", "tail", "expect_blocks"),
    [
        ([T], 0, 1),
        ([T], 1, 1),
        ([T, F], 0, 2),
        ([T, F], 1, 2),
        ([T, T], 0, 2),
        ([T, T], 1, 2),
        ([T, T, F], 0, 2),
        ([T, T, F], 1, 2),
        ([T, T, T], 0, 3),
        ([T, T, T], 1, 3),
        ([T, T, T, F], 0, 4),
        ([T, T, T, F], 1, 4),
        ([*_RANDOM8, T], 1, 9),
        ([*_RANDOM8, F], 1, 8),
        ([*_RANDOM8, T, F], 0, 10),
        ([*_RANDOM8, F, T], 1, 10),
    ],
)
def test_chunked_local_attention_possible_cached_prefix(
    flags: list[bool], tail: int, expect_blocks: int
) -> None:
    # bs 2, chunk 4: everything before the chunk of the next token counts as computed
    # (null blocks); inside the chunk, cached blocks from left to right.
    mgr = manager(len(flags) + 10, [local(2, 4)])
    tokens = cache_pattern(mgr, flags)
    mgr.add_request("q", tokens + [900 + i for i in range(tail + 1)])
    hit = mgr.get_computed_blocks("q")
    max_len = len(tokens) + tail
    start = max_len // 4 * 4 // 2
    ids = as_lists(hit.block_ids)
    assert ids == ([0] * start + list(range(start + 1, expect_blocks + 1)),)
    assert hit.num_computed_tokens == 2 * expect_blocks


def test_chunked_local_attention_fresh_prompt_counts_earlier_chunks_as_computed() -> None:
    mgr = manager(30, [local(2, 4)])
    mgr.add_request("fresh", list(range(100, 140)))
    hit = mgr.get_computed_blocks("fresh")
    assert hit.num_computed_tokens == 36
    assert as_lists(hit.block_ids) == ([0] * 18,)
    assert as_lists(
        mgr.allocate_slots("fresh", 4, num_computed_tokens=0, new_computed_blocks=hit)
    ) == ([1, 2],)
    assert mgr.num_free_blocks == 27


def test_chunked_local_attention_remove_skipped_blocks() -> None:
    mgr = manager(30, [local(2, 4)])
    mgr.add_request("a", list(range(22)))
    assert as_lists(mgr.allocate_slots("a", 22, num_computed_tokens=0)) == (list(range(1, 12)),)
    steps = [(0, 0, []), (4, 2, [2, 1]), (6, 2, [2, 1]), (12, 6, [2, 1, 6, 5, 4, 3])]
    for n, nulled, freed_tail in steps:
        mgr.remove_skipped_blocks("a", n)
        assert as_lists(mgr.get_block_ids("a")) == ([0] * nulled + list(range(nulled + 1, 12)),)
        assert free_queue(mgr) == list(range(12, 30)) + freed_tail
    mgr.check_invariants()


def test_chunked_local_admission_counts_neither_null_padding_nor_held_hits() -> None:
    # bs 2, chunk 4: a 27-token prompt whose first 26 tokens are held by a running
    # request hits 26 tokens (12 null blocks + block 13, referenced) and needs just
    # one fresh block.
    mgr = manager(17, [local(2, 4)])
    tokens = list(range(26))
    mgr.add_request("src", tokens)
    assert as_lists(mgr.allocate_slots("src", 26, num_computed_tokens=0)) == (list(range(1, 14)),)
    mgr.add_request("filler", [500 + i for i in range(4)])
    assert as_lists(mgr.allocate_slots("filler", 4, num_computed_tokens=0)) == ([14, 15],)
    assert mgr.num_free_blocks == 1
    mgr.add_request("b", [*tokens, 999])
    hit = mgr.get_computed_blocks("b")
    assert as_lists(hit.block_ids) == ([0] * 12 + [13],)
    assert hit.num_computed_tokens == 26
    new = mgr.allocate_slots("b", 1, num_computed_tokens=0, new_computed_blocks=hit)
    assert as_lists(new) == ([16],)
    assert as_lists(mgr.get_block_ids("b")) == ([0] * 12 + [13, 16],)
    assert mgr.block_ref_count(13) == 2
    assert mgr.num_free_blocks == 0
    mgr.check_invariants()


# --------------------------------------------------------------------------- Mamba "align"


def mamba(bs: int, num_speculative_blocks: int = 0) -> pk.MambaSpec:
    return pk.MambaSpec(
        bs,
        ((1, 1),),
        ("float32",),
        mamba_cache_mode="align",
        num_speculative_blocks=num_speculative_blocks,
    )


# Per number of speculative blocks: the observable states of vLLM 0.33 along
# ``test_mamba_align_prefill_hit_and_same_step_refusal``.
MAMBA_PREFILL = {
    0: dict(
        chunk1=([1, 2, 3], [0, 0, 4]),
        chunk2=([5, 6, 7], [0, 0, 8]),
        table2=([1, 2, 3, 5, 6, 7], [0, 0, 4, 0, 0, 8]),
        cached2=[(1, 0), (2, 0), (3, 0), (4, 1), (5, 0), (6, 0), (7, 0), (8, 1)],
        hit=([1, 2, 3, 5, 6, 7], [0, 0, 0, 0, 0, 8]),
        chunk3=([9], [10]),
        table3=([1, 2, 3, 5, 6, 7, 9], [0, 0, 0, 0, 0, 8, 10]),
        new_c=([11, 12], [0, 13]),
        table_c=([1, 2, 3, 5, 6, 7, 11, 12], [0, 0, 0, 0, 0, 8, 0, 13]),
        free_c=27,
        refs=[0, 2, 2, 2, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1],
    ),
    1: dict(
        chunk1=([1, 2, 3], [0, 0, 4, 5]),
        chunk2=([6, 7, 8], [0, 5, 9]),
        table2=([1, 2, 3, 6, 7, 8], [0, 0, 4, 0, 0, 5, 9]),
        cached2=[(1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (6, 0), (7, 0), (8, 0)],
        hit=([1, 2, 3, 6, 7, 8], [0, 0, 0, 0, 0, 5]),
        chunk3=([10], [11]),
        table3=([1, 2, 3, 6, 7, 8, 10], [0, 0, 0, 0, 0, 5, 9, 11]),
        new_c=([12, 13], [0, 14, 15]),
        table_c=([1, 2, 3, 6, 7, 8, 12, 13], [0, 0, 0, 0, 0, 5, 0, 14, 15]),
        free_c=25,
        refs=[0, 2, 2, 2, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1],
    ),
}


@pytest.mark.parametrize("spec_blocks", [0, 1])
def test_mamba_align_prefill_hit_and_same_step_refusal(spec_blocks: int) -> None:
    exp: dict[str, Any] = MAMBA_PREFILL[spec_blocks]
    mgr = manager(40, [full(16), mamba(16, spec_blocks)])
    prompt = list(range(100))
    mgr.add_request("a", prompt)
    hit = mgr.get_computed_blocks("a")
    # Chunked prefill in block-aligned chunks: one state block per chunk (plus the
    # speculative blocks), null padding before it.
    new = mgr.allocate_slots("a", 48, num_computed_tokens=0, new_computed_blocks=hit)
    assert as_lists(new) == exp["chunk1"]
    mgr.new_step_starts()
    assert as_lists(mgr.allocate_slots("a", 48, num_computed_tokens=48)) == exp["chunk2"]
    assert as_lists(mgr.get_block_ids("a")) == exp["table2"]
    assert [(b, h[1]) for b in cached_ids(mgr) if (h := mgr.cached_block_hash(b))] == exp["cached2"]

    # A sibling looked up in the same step hits the state cached this step: vLLM
    # refuses to schedule it until the next step.
    mgr.add_request("b", [*prompt, *[7] * 20])
    hit = mgr.get_computed_blocks("b")
    assert as_lists(hit.block_ids) == exp["hit"]
    assert hit.num_computed_tokens == 96
    free_before = mgr.num_free_blocks
    assert mgr.allocate_slots("b", 24, num_computed_tokens=0, new_computed_blocks=hit) is None
    assert mgr.num_free_blocks == free_before

    # The next step: the last chunk releases the state of two chunks ago.
    mgr.new_step_starts()
    assert as_lists(mgr.allocate_slots("a", 4, num_computed_tokens=96)) == exp["chunk3"]
    assert as_lists(mgr.get_block_ids("a")) == exp["table3"]

    mgr.new_step_starts()
    mgr.add_request("c", [*prompt, *[9] * 20])
    hit = mgr.get_computed_blocks("c")
    assert as_lists(hit.block_ids) == exp["hit"]
    assert hit.num_computed_tokens == 96
    assert (
        as_lists(mgr.allocate_slots("c", 24, num_computed_tokens=0, new_computed_blocks=hit))
        == exp["new_c"]
    )
    assert as_lists(mgr.get_block_ids("c")) == exp["table_c"]
    assert mgr.num_free_blocks == exp["free_c"]
    assert [mgr.block_ref_count(b) for b in range(14)] == exp["refs"]
    mgr.check_invariants()
    mgr.free("a")
    mgr.free("c")
    assert mgr.num_free_blocks == 39


MAMBA_DECODE = {
    0: dict(
        prefill=([1, 2], [0, 3]),
        trace=[
            (32, ([], []), ([1, 2], [0, 3]), 16),
            (33, ([4], [5]), ([1, 2, 4], [0, 3, 5]), 14),
            (34, ([], []), ([1, 2, 4], [0, 0, 5]), 15),
            (49, ([6], [7]), ([1, 2, 4, 6], [0, 0, 5, 7]), 13),
            (50, ([], []), ([1, 2, 4, 6], [0, 0, 0, 7]), 14),
            (65, ([8], [9]), ([1, 2, 4, 6, 8], [0, 0, 0, 7, 9]), 12),
        ],
        cached=[1, 2, 3, 4, 5, 6, 7],
        free_end=[9, 8, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 3, 5, 6, 4, 2, 1, 7],
    ),
    2: dict(
        prefill=([1, 2], [0, 3, 4, 5]),
        trace=[
            (32, ([], []), ([1, 2], [0, 3, 4, 5]), 14),
            (33, ([6], [7]), ([1, 2, 6], [0, 3, 4, 5, 7]), 12),
            (34, ([], []), ([1, 2, 6], [0, 0, 4, 5, 7]), 13),
            (49, ([8], [9]), ([1, 2, 6, 8], [0, 0, 4, 5, 7, 9]), 11),
            (50, ([], []), ([1, 2, 6, 8], [0, 0, 0, 5, 7, 9]), 12),
            (65, ([10], [11]), ([1, 2, 6, 8, 10], [0, 0, 0, 5, 7, 9, 11]), 10),
        ],
        cached=[1, 2, 3, 4, 5, 6, 8],
        free_end=[11, 9, 7, 10, 12, 13, 14, 15, 16, 17, 18, 19, 3, 4, 8, 6, 2, 1, 5],
    ),
}


@pytest.mark.parametrize("spec_blocks", [0, 2])
def test_mamba_align_decode_releases_old_states(spec_blocks: int) -> None:
    exp: dict[str, Any] = MAMBA_DECODE[spec_blocks]
    mgr = manager(20, [full(16), mamba(16, spec_blocks)])
    mgr.add_request("a", list(range(30)))
    _, new = admit(mgr, "a")
    assert new == exp["prefill"]
    n, trace = 30, []
    for step in range(35):
        mgr.new_step_starts()
        mgr.append_token_ids("a", [1000 + step])
        got = as_lists(mgr.allocate_slots("a", 1, num_computed_tokens=n))
        n += 1
        if n in (32, 33, 34, 49, 50, 65):
            trace.append((n, got, as_lists(mgr.get_block_ids("a")), mgr.num_free_blocks))
    assert trace == exp["trace"]
    assert cached_ids(mgr) == exp["cached"]
    mgr.check_invariants()
    mgr.remove_request("a")
    assert free_queue(mgr) == exp["free_end"]


@pytest.mark.xfail(
    strict=True,
    reason=(
        "pagedkv lacks vLLM 0.33's fine-grained (partial hash) hits for Mamba 'align' "
        "groups whose block size exceeds hash_block_size: vLLM then caches full-attention "
        "blocks up to the last hashed block instead of rounding down to the LCM, and "
        "reports the longer shared prefix"
    ),
)
def test_mamba_align_larger_than_hash_block_caches_past_the_lcm() -> None:
    # Full attention bs 16 + Mamba "align" bs 64: hash_block_size 16 (the GCD).
    mgr = manager(40, [full(16), mamba(64)])
    assert mgr.hash_block_size == 16
    mgr.add_request("a", list(range(100)))
    hit = mgr.get_computed_blocks("a")
    assert as_lists(
        mgr.allocate_slots("a", 64, num_computed_tokens=0, new_computed_blocks=hit)
    ) == ([1, 2, 3, 4], [5])
    mgr.new_step_starts()
    assert as_lists(mgr.allocate_slots("a", 36, num_computed_tokens=64)) == ([6, 7, 8], [9])
    mgr.new_step_starts()
    mgr.add_request("c", [*range(100), *[9] * 20])
    hit = mgr.get_computed_blocks("c")
    assert as_lists(hit.block_ids) == ([1, 2, 3, 4], [5])
    assert hit.num_computed_tokens == 64
    # vLLM 0.33: the full-attention blocks of tokens 64..96 are cached too, and the
    # full-attention hit (96 tokens) is reported as the shared prefix boundary.
    assert [(b, h[1]) for b in cached_ids(mgr) if (h := mgr.cached_block_hash(b))] == [
        (1, 0),
        (2, 0),
        (3, 0),
        (4, 0),
        (5, 1),
        (6, 0),
        (7, 0),
    ]
    assert hit.shared_prefix_boundary == 96


def test_mamba_align_prompt_boundary_state_is_rekeyed_after_evict() -> None:
    mgr = manager(20, [full(16), mamba(16)])
    mgr.add_request("a", list(range(40)))
    hit = mgr.get_computed_blocks("a")
    assert as_lists(
        mgr.allocate_slots("a", 32, num_computed_tokens=0, new_computed_blocks=hit)
    ) == ([1, 2], [0, 3])
    assert cached_ids(mgr) == [1, 2, 3]
    mgr.evict_blocks([3])  # the state after 32 tokens, still held by "a"
    assert cached_ids(mgr) == [1, 2]
    mgr.new_step_starts()
    assert as_lists(mgr.allocate_slots("a", 8, num_computed_tokens=32)) == ([4], [5])
    # vLLM 0.33: 32 is the prompt's last hash boundary (39 // 16 * 16): block 3 is
    # keyed again.
    assert cached_ids(mgr) == [1, 2, 3]
    assert mgr.num_cached_block_hashes == 3


# --------------------------------------------------------------------------- cross attention


def test_cross_attention_blocks_come_from_the_encoder_tokens_once() -> None:
    # Encoder-decoder models run without prefix caching in vLLM 0.33 (its
    # CrossAttentionManager refuses lookups and caching).
    specs = [full(16), pk.CrossAttentionSpec(16, 1, 1, "float32")]
    mgr = manager(30, specs, enable_caching=False)
    mgr.add_request("a", list(range(20)))
    hit, new = admit(mgr, "a", num_encoder_tokens=50)
    assert as_lists(hit.block_ids) == ([], [])
    assert hit.num_computed_tokens == 0
    # cdiv(50, 16) = 4 cross blocks, allocated once.
    assert new == ([1, 2], [3, 4, 5, 6])
    assert mgr.num_free_blocks == 23
    n, grown = 20, []
    for _ in range(14):
        mgr.append_token_ids("a", [7])
        got = as_lists(mgr.allocate_slots("a", 1, num_computed_tokens=n, num_encoder_tokens=50))
        n += 1
        if got != ([], []):
            grown.append((n, got))
    assert grown == [(33, ([7], []))]
    assert as_lists(mgr.get_block_ids("a")) == ([1, 2, 7], [3, 4, 5, 6])
    assert cached_ids(mgr) == []

    # Another request without encoder tokens gets no cross blocks.
    mgr.add_request("b", list(range(20)))
    hit, new = admit(mgr, "b")
    assert hit.num_computed_tokens == 0
    assert new == ([8, 9], [])
    # Freed with the request, tail first.
    mgr.free("a")
    assert mgr.num_free_blocks == 27
    assert free_queue(mgr) == [6, 5, 4, 3, 7, 2, 1, *range(10, 30)]
    mgr.check_invariants()


# --------------------------------------------------------------------------- sinks and MLA


def full_attention_script(mgr: pk.KVCacheManager) -> list[Any]:
    out: list[Any] = [mgr.num_free_blocks]
    mgr.add_request("a", list(range(55)))
    out.append(admit(mgr, "a")[1])
    mgr.add_request("b", [*range(50), *[9] * 10])
    hit, new = admit(mgr, "b")
    out += [hit.num_computed_tokens, as_lists(hit.block_ids), new]
    mgr.free("a")
    mgr.free("b")
    out.append(free_queue(mgr))
    return out


@pytest.mark.parametrize(
    "spec",
    [
        pk.SinkFullAttentionSpec(16, 1, 1, "float32", sink_len=32),
        pk.MLAAttentionSpec(16, 1, 1, "float32"),
    ],
    ids=["sink", "mla"],
)
def test_sink_and_mla_behave_like_full_attention(spec: pk.KVCacheSpec) -> None:
    # vLLM 0.33's SinkFullAttentionManager only checks sink_len at construction; it
    # takes no blocks out of the pool: all 10 usable blocks stay free.
    got = full_attention_script(manager(11, [spec]))
    assert got == full_attention_script(manager(11, [full(16)]))
    assert got == [10, ([1, 2, 3, 4],), 48, ([1, 2, 3],), ([5],), [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]]


def test_sink_len_must_be_a_multiple_of_the_block_size() -> None:
    with pytest.raises((AssertionError, ValueError)):
        manager(11, [pk.SinkFullAttentionSpec(16, 1, 1, "float32", sink_len=8)])


def test_encoder_decoder_with_caching_admits_a_prefix_hit() -> None:
    # Cross attention never hits; the self-attention hit must still be usable.
    kw = dict(block_size=16, num_kv_heads=1, head_size=1, dtype="float32")
    config = pk.KVCacheConfig(
        num_blocks=40,
        kv_cache_groups=[
            pk.KVCacheGroupSpec(["self"], pk.FullAttentionSpec(**kw)),
            pk.KVCacheGroupSpec(["cross"], pk.CrossAttentionSpec(**kw)),
        ],
    )
    mgr = pk.KVCacheManager(config, max_model_len=1024)
    for rid in ("a", "b"):
        mgr.add_request(rid, list(range(20)))
        hit = mgr.get_computed_blocks(rid)
        new = mgr.allocate_slots(
            rid,
            20 - hit.num_computed_tokens,
            num_computed_tokens=0,
            new_computed_blocks=hit,
            num_encoder_tokens=50,
        )
        assert new is not None
    assert [len(g) for g in mgr.get_block_ids("b")] == [2, 4]
    assert mgr.get_block_ids("b")[0][0] == mgr.get_block_ids("a")[0][0]
    mgr.check_invariants()
