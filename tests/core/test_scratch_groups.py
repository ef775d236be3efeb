"""Groups that never enter the prefix cache (a bounded-replay sliding window, a
circular buffer) and the fresh-block zeroing lists, through pagedkv's Python
API. Expected ids are what vLLM 0.33's own manager answers for the same calls
(full attention float32 + the scratch group in bfloat16, a mixed-precision
layout that vLLM zeroes)."""

from __future__ import annotations

from typing import Any

import pagedkv as pk
import pytest
from pagedkv.errors import InvalidArgumentError

from tests._util import admit, as_lists


def manager(second: pk.KVCacheSpec, num_blocks: int, **kw: Any) -> pk.KVCacheManager:
    full = pk.FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float32")
    config = pk.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_groups=[pk.KVCacheGroupSpec(["full"], full), pk.KVCacheGroupSpec(["x"], second)],
    )
    return pk.KVCacheManager(config, max_model_len=256, enable_caching=True, **kw)


def replayed(**kw: Any) -> pk.KVCacheManager:
    swa = pk.SlidingWindowSpec(
        block_size=4,
        num_kv_heads=1,
        head_size=64,
        dtype="bfloat16",
        sliding_window=8,
        bounded_replay=True,
    )
    return manager(swa, 30, **kw)


def ring(**kw: Any) -> pk.KVCacheManager:
    spec = pk.CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=1, dtype="bfloat16")
    return manager(spec, 20, **kw)


def test_replayed_window_hits_through_full_attention_only() -> None:
    m = replayed(zero_new_blocks=True, enable_kv_cache_events=True)
    m.add_request("r0", list(range(20)))
    _, new = admit(m, "r0")
    assert new == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    assert m.take_new_block_ids() == list(range(1, 11))
    stored = [e for e in m.take_events() if isinstance(e, pk.BlockStored)]
    assert [(e.group_idx, len(e.block_hashes)) for e in stored] == [(0, 5)]

    m.add_request("r1", [*range(20), 100, 101, 102, 103])
    hit, new = admit(m, "r1")
    assert (as_lists(hit.block_ids), hit.num_computed_tokens) == (([1, 2, 3, 4, 5], []), 20)
    assert new == ([11], [12, 13, 14])
    assert as_lists(m.get_block_ids("r1")) == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 12, 13, 14])
    assert m.take_new_block_ids() == [11, 12, 13, 14]
    m.record_blocks_for_zeroing("r1", 16)
    assert m.take_new_block_ids() == [5, 11, 13, 14]


def test_circular_buffer_holds_one_block_for_the_request_lifetime() -> None:
    m = ring(zero_new_blocks=True)
    assert m.records_new_block_ids == [True, False]
    m.add_request("r0", list(range(10)))
    _, new = admit(m, "r0")
    assert new == ([1, 2, 3], [4])
    m.append_token_ids("r0", [7])
    assert as_lists(m.allocate_slots("r0", 1, num_computed_tokens=10)) == ([], [])
    assert m.take_new_block_ids() == [1, 2, 3]
    m.add_request("r1", list(range(10)))
    hit, new = admit(m, "r1")
    assert hit.num_computed_tokens == 8 and new == ([5], [6])
    assert m.num_free_blocks == 13
    m.remove_request("r0")
    assert m.num_free_blocks == 15


def test_skip_zeroing_groups_of_an_async_load() -> None:
    m = replayed(zero_new_blocks=True)
    m.add_request("r", list(range(200, 224)))
    hit = m.get_computed_blocks("r")
    new = m.allocate_slots(
        "r",
        8,
        num_computed_tokens=0,
        new_computed_blocks=hit,
        num_external_computed_tokens=16,
        skip_zeroing_group_ids=[0],
    )
    # Every group's external blocks are taken before any fresh one; group 0's
    # are written by the load, so only its fresh blocks are listed.
    assert as_lists(new) == ([7, 8], [9, 10])
    assert as_lists(m.get_block_ids("r")) == ([1, 2, 3, 4, 7, 8], [0, 0, 5, 6, 9, 10])
    assert m.take_new_block_ids() == [7, 8, 5, 6, 9, 10]


def test_without_zeroing_nothing_is_listed() -> None:
    m = replayed()
    assert m.records_new_block_ids == [False, False]
    m.add_request("r0", list(range(20)))
    admit(m, "r0")
    assert m.take_new_block_ids() == []


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda m: m.take_new_block_ids(2), InvalidArgumentError),
        (lambda m: m.take_new_block_ids(-1), InvalidArgumentError),
        (lambda m: m.record_blocks_for_zeroing("r0", 6), InvalidArgumentError),
        (lambda m: m.record_blocks_for_zeroing("r0", -4), InvalidArgumentError),
        (lambda m: m.record_blocks_for_zeroing("nope", 0), pk.UnknownRequestError),
        (
            lambda m: m.allocate_slots("r1", 4, num_computed_tokens=0, skip_zeroing_group_ids=[5]),
            InvalidArgumentError,
        ),
        (
            lambda m: m.allocate_slots("r1", 4, num_computed_tokens=0, skip_zeroing_group_ids=[-1]),
            InvalidArgumentError,
        ),
    ],
)
def test_zeroing_calls_refuse_bad_input_and_change_nothing(
    call: Any, expected: type[BaseException]
) -> None:
    m = replayed(zero_new_blocks=True)
    m.add_request("r0", list(range(20)))
    admit(m, "r0")
    m.add_request("r1", list(range(50, 70)))
    free = m.num_free_blocks
    with pytest.raises(expected):
        call(m)
    assert m.num_free_blocks == free
    assert m.take_new_block_ids() == list(range(1, 11))
    m.check_invariants()


def test_bounded_replay_is_part_of_the_group_type() -> None:
    a = pk.SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=8
    )
    b = pk.SlidingWindowSpec(
        block_size=4,
        num_kv_heads=1,
        head_size=8,
        dtype="float16",
        sliding_window=8,
        bounded_replay=True,
    )
    assert "bounded_replay" not in a.core_spec()
    assert b.core_spec()["bounded_replay"] is True
    with pytest.raises(pk.InvalidConfigError):
        pk.SlidingWindowSpec.merge([a, b])
    ring_spec = pk.CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=4, dtype="float16")
    # One page per request, whatever its length.
    assert ring_spec.max_memory_usage_bytes(8192) == ring_spec.page_size_bytes


def seeded_hybrid() -> tuple[pk.KVCacheManager, list[int], list[int]]:
    """Full attention + Mamba "align" (16-token blocks), a 4-block prompt
    prefilled one block per step so both groups cache every boundary."""
    full = pk.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype="float32")
    mamba = pk.MambaSpec(16, ((1, 1),), ("float32",), mamba_cache_mode="align")
    config = pk.KVCacheConfig(
        num_blocks=24,
        kv_cache_groups=[pk.KVCacheGroupSpec(["fa"], full), pk.KVCacheGroupSpec(["m"], mamba)],
    )
    m = pk.KVCacheManager(config, max_model_len=8192, enable_caching=True)
    m.add_request("fill", list(range(64)))
    hit = m.get_computed_blocks("fill")
    states = []
    for i in range(4):
        m.allocate_slots(
            "fill", 16, num_computed_tokens=16 * i, new_computed_blocks=hit if i == 0 else None
        )
        states.append(int(m.get_block_ids("fill")[1][i]))
    fa = [int(b) for b in m.get_block_ids("fill")[0]]
    m.remove_request("fill")
    return m, fa, states


def test_connector_lookup_reports_a_deeper_full_attention_hit() -> None:
    m, fa, states = seeded_hybrid()
    assert (fa, states) == ([1, 3, 5, 7], [2, 4, 6, 8])
    m.evict_blocks(states[1:])
    m.new_step_starts()
    m.add_request("rep", [*range(64), *range(500, 532)])
    blocks, hits = m.find_longest_cache_hit_per_group(m.block_hashes("rep"), 95) or ((), [])
    assert (as_lists(blocks), hits) == (([1, 3, 5, 7], [2]), [64, 16])
    hit, diverged = m.get_computed_blocks_for_connector("rep")
    assert diverged and hit.num_computed_tokens == 64
    new = m.allocate_slots(
        "rep",
        16,
        num_computed_tokens=0,
        new_computed_blocks=hit,
        num_external_computed_tokens=16,
    )
    assert as_lists(new) == ([11], [12])
    assert as_lists(m.get_block_ids("rep")) == ([1, 3, 5, 7, 9, 11], [0, 0, 0, 0, 10, 12])
    m.check_invariants()


def test_connector_lookup_falls_back_when_mamba_runs_deeper() -> None:
    m, fa, states = seeded_hybrid()
    m.evict_blocks([fa[2], fa[3], states[1], states[2]])
    m.add_request("rep", list(range(80)))
    hit, diverged = m.get_computed_blocks_for_connector("rep")
    assert not diverged
    assert (as_lists(hit.block_ids), hit.num_computed_tokens) == (([1], [2]), 16)
    assert hit.shared_prefix_boundary == 32
    assert m.full_attention_group == 0
