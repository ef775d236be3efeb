"""The prefix index's media: blocks held on the device, in host memory and on
disk (the events' ``medium``), answered per tier and weighed by tier."""

from __future__ import annotations

from typing import Any

import numpy as np
import pagedkv as pk
import pytest
from pagedkv.errors import InvalidArgumentError
from pagedkv.index import TIER_WEIGHTS, PrefixIndex, TierMatch
from pagedkv.offload import offload_key_group, offload_key_hash

from tests.offload.test_manager_tier import PAGE, admit, config, prompt


def test_events_of_each_medium_are_kept_apart_and_answered_per_tier() -> None:
    idx = PrefixIndex()
    idx.apply(
        "a",
        [
            pk.BlockStored([1, 2], None, [0] * 32, 16, None, medium="GPU", group_idx=0),
            pk.BlockStored([1, 2, 3], None, [0] * 48, 16, None, medium="CPU", group_idx=0),
            pk.BlockStored([1, 2, 3, 4], None, [0] * 64, 16, None, medium="DISK", group_idx=0),
        ],
    )
    idx.store("b", [1, 2, 3])
    q = [1, 2, 3, 4, 5]
    assert idx.match_tiers(q) == {"a": TierMatch(2, 1, 1), "b": TierMatch(3, 0, 0)}
    assert idx.match_tiers(q)["a"].num_blocks == idx.match_lengths(q)["a"] == 4
    assert TIER_WEIGHTS == (1.0, 0.75, 0.25)
    assert idx.weighted_match(q) == {"a": 3.0, "b": 3.0}
    assert idx.weighted_match(q, (1, 0, 0)) == {"a": 2.0, "b": 3.0}
    # The device forgets block 2 (evicted) and then everything (a reset): host
    # memory and disk keep theirs.
    idx.apply("a", [pk.BlockRemoved([2], medium="GPU", group_idx=0)])
    assert idx.match_tiers(q)["a"] == TierMatch(1, 2, 1)
    idx.apply("a", [pk.AllBlocksCleared()])
    assert idx.match_tiers(q)["a"] == TierMatch(0, 3, 1)
    idx.remove("a", [3], 0, medium="CPU")
    assert idx.match_tiers(q)["a"] == TierMatch(0, 2, 2)  # 3 is still on disk
    idx.check_invariants()
    idx.clear("a")
    assert idx.match_tiers(q)["a"] == TierMatch(0, 0, 0)


def test_bad_media_and_weights_are_refused_and_change_nothing() -> None:
    idx = PrefixIndex()
    idx.store("a", [1])
    with pytest.raises(InvalidArgumentError, match="medium"):
        idx.store("a", [2], medium="TAPE")
    bad = pk.BlockStored([3], None, [0] * 16, 16, None, medium="NVME", group_idx=0)
    with pytest.raises(InvalidArgumentError, match="medium"):
        idx.apply("a", [pk.BlockStored([4], None, [0] * 16, 16, None), bad])
    assert idx.match_lengths([1, 2, 3, 4]) == {"a": 1}  # the batch refused whole
    for w in ((1.0, 0.5), (1.0, float("nan"), 0.0), (1.0, -1.0, 0.0)):
        with pytest.raises((ValueError, InvalidArgumentError)):
            idx.weighted_match([1], w)
    with pytest.raises(InvalidArgumentError, match="group"):
        idx.store("a", [5], None, 2**30)
    idx.check_invariants()


def test_a_managers_host_tier_events_feed_the_index_with_their_medium() -> None:
    """Chunks a manager's host tier stores and evicts reach the index as its
    blocks in host memory: a prefix the device evicted is still a host hit."""
    off = pk.OffloadConfig(cpu_bytes=10 * PAGE, enable_events=True)
    m = pk.KVCacheManager(config(), 256, offload=off, enable_kv_cache_events=True)
    idx = PrefixIndex()

    def feed() -> None:
        idx.apply("r", m.take_events())
        for keys, medium, removed, metadata_only in m.take_offload_events():
            assert medium == "CPU" and not metadata_only
            hashes = [offload_key_hash(k) for k in keys]
            group = offload_key_group(keys[0])
            if removed:
                idx.remove("r", hashes, group, medium=medium)
            else:
                idx.store("r", hashes, None, group, medium=medium)

    m.add_request("a", prompt(1, 40))
    admit(m, "a")
    m.complete_transfers(m.take_transfer_plan().jobs)
    hashes = m.block_hashes("a")
    m.remove_request("a")
    feed()
    assert idx.match_tiers(hashes)["r"] == TierMatch(len(hashes), 0, 0)
    assert m.reset_prefix_cache()
    feed()
    assert idx.match_tiers(hashes)["r"] == TierMatch(0, len(hashes), 0)
    m.add_request("b", prompt(1, 44))
    hit = m.get_computed_blocks("b")
    block = m.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    assert hit.num_computed_tokens == 0 and hit.num_host_tokens == block * len(hashes)
    idx.check_invariants()


def test_the_index_server_answers_tiers_and_weights() -> None:
    from pagedkv.index.service import QueryError, answer

    idx = PrefixIndex()
    idx.store("a", [1, 2], medium="GPU")
    idx.store("a", [1, 2, 3], medium="CPU")
    idx.store("b", [1, 2, 3])
    rep: dict[str, Any] = answer(idx, None, {"op": "longest_prefix", "block_hashes": [1, 2, 3]})
    assert rep["tiers"] == {"a": [2, 1, 0], "b": [3, 0, 0]}
    assert rep["weighted"] == {"a": 2.75, "b": 3.0}
    rep = answer(
        idx, None, {"op": "longest_prefix", "block_hashes": [1, 2, 3], "weights": [1, 1, 0]}
    )
    assert rep["weighted"] == {"a": 3.0, "b": 3.0}
    for w in ([1, 2], [1, "x", 0], [1, True, 0], [1, 1e9, 0], "abc"):
        with pytest.raises(QueryError, match="weights"):
            answer(idx, None, {"op": "longest_prefix", "block_hashes": [1], "weights": w})
    assert np.isfinite(rep["weighted"]["a"])
