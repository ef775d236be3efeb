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
