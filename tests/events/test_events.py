"""The KV event queue and the block activity log a caller drains: bounded
when nobody drains them."""

from __future__ import annotations

import pagedkv as pk
import pytest
from pagedkv.errors import InvalidArgumentError, InvalidConfigError


def test_undrained_events_stay_within_their_cap_and_drops_are_counted() -> None:
    spec = pk.FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float32")
    config = pk.KVCacheConfig(num_blocks=64, kv_cache_groups=[pk.KVCacheGroupSpec(["l"], spec)])
    m = pk.KVCacheManager(
        config,
        max_model_len=256,
        enable_kv_cache_events=True,
        kv_cache_metrics=True,
        max_pending_events=16,
        max_pending_block_activity=16,
    )
    for i in range(200):
        m.add_request(f"r{i}", [i * 8 + t for t in range(8)])
        assert m.allocate_slots(f"r{i}", 8, num_computed_tokens=0) is not None
        m.remove_request(f"r{i}")
        assert m.num_pending_events <= 16
    assert m.num_dropped_events > 0
    assert m.num_dropped_block_activity > 0
    assert len(m.take_events()) <= 16
    m.check_invariants()
    for bad in (0, -1, 2**30 + 1):
        with pytest.raises((InvalidConfigError, InvalidArgumentError)):
            pk.KVCacheManager(config, max_model_len=256, max_pending_events=bad)


def _first_listings(ids: list[int]) -> list[int]:
    return list(dict.fromkeys(ids))


def test_undrained_blocks_to_zero_stay_bounded_and_lose_no_block() -> None:
    spec = pk.FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float32")
    config = pk.KVCacheConfig(num_blocks=16, kv_cache_groups=[pk.KVCacheGroupSpec(["l"], spec)])
    undrained = pk.KVCacheManager(config, max_model_len=256, zero_new_blocks=True)
    drained = pk.KVCacheManager(config, max_model_len=256, zero_new_blocks=True)
    listed: list[int] = []
    for i in range(200):
        for m in (undrained, drained):
            m.add_request(f"r{i}", [i * 12 + t for t in range(12)])
            assert m.allocate_slots(f"r{i}", 12, num_computed_tokens=0) is not None
            if i % 2:
                m.record_blocks_for_zeroing(f"r{i}", 0)
            m.remove_request(f"r{i}")
        listed += drained.take_new_block_ids()
    kept = undrained.take_new_block_ids()
    # Far past four entries a pool block were listed; every block is still
    # listed, once past the bound, in the order of first listing.
    assert len(listed) > 4 * 16
    assert len(kept) <= 4 * 16
    assert _first_listings(kept) == _first_listings(listed)
    undrained.check_invariants()


def test_undrained_reused_blocks_stay_bounded_and_lose_no_reuse() -> None:
    spec = pk.FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float32")
    config = pk.KVCacheConfig(num_blocks=8, kv_cache_groups=[pk.KVCacheGroupSpec(["l"], spec)])
    undrained = pk.KVCacheManager(config, max_model_len=64)
    drained = pk.KVCacheManager(config, max_model_len=64)
    reused: list[int] = []
    for i in range(100):
        for m in (undrained, drained):
            blocks = m.get_new_blocks(3 + i % 3)
            assert blocks is not None
            m.unpin_blocks(blocks.tolist())
        reused += drained.take_reused_blocks().tolist()
    kept = undrained.take_reused_blocks().tolist()
    assert len(reused) > 4 * 8
    assert len(kept) <= 4 * 8
    assert _first_listings(kept) == _first_listings(reused)
    undrained.check_invariants()
