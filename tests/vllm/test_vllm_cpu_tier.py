"""A manager's pool used as a tier by a component that fills blocks itself:
the CPU tier of vLLM 0.33's ``SimpleCPUOffloadScheduler``, a coordinator and
block pool of their own (``pagedkv.vllm.get_kv_cache_coordinator``).

Without vLLM the core's calls run through pagedkv's own API, with the ids
vLLM's ``BlockPool`` gives (free queue in id order, freed blocks to its
tail); with vLLM installed, pagedkv's coordinator runs side by side with
vLLM's own on the same calls, as the offload scheduler makes them.
"""

from __future__ import annotations

from typing import Any

import pagedkv as pk
import pytest
from pagedkv.errors import InvalidArgumentError

from tests._util import make_manager


def tier(num_blocks: int = 6) -> pk.KVCacheManager:
    return make_manager(
        16,
        num_blocks,
        external_block_hashes=True,
        record_stats_at_admission=False,
        enable_kv_cache_events=True,
    )


def h(i: int) -> bytes:
    return bytes([7, i]) * 16


def hit(m: pk.KVCacheManager, hashes: list[bytes], cap: int) -> tuple[list[list[int]], int, int]:
    groups, n, uncached = m.find_longest_cache_hit(hashes, cap)
    return [g.tolist() for g in groups], n, uncached


def test_blocks_filled_outside_requests_are_cached_and_found_by_hash() -> None:
    m = tier()
    blocks = m.get_new_blocks(2)
    assert blocks is not None and blocks.tolist() == [1, 2]
    assert m.insert_detached_block_hash(1, h(0), 0, 16)
    assert not m.insert_detached_block_hash(1, h(0), 0, 16)  # already its key
    assert m.insert_detached_block_hash(2, h(1), 0, 32)
    assert m.insert_detached_block_hash(1, h(9), 0)  # beside the primary key
    assert m.cached_block_hash(1) == (h(0), 0)
    assert m.cached_block_extra_hashes(1) == [(h(9), 0)]
    assert m.take_events() == []  # the caller reports its own
    m.free_blocks([1, 2])
    assert hit(m, [h(0), h(1), h(2)], 100) == ([[1, 2]], 32, 0)
    assert hit(m, [h(0), h(1), h(2)], 31) == ([[1]], 16, 0)
    assert hit(m, [h(9)], 100) == ([[1]], 16, 0)
    assert hit(m, [h(5), h(1)], 100) == ([[]], 0, 0)
    # The free queue is 3, 4, 5, 1, 2: taking four evicts block 1.
    again = m.get_new_blocks(4)
    assert again is not None and again.tolist() == [3, 4, 5, 1]
    assert hit(m, [h(0), h(1)], 100) == ([[]], 0, 0)
    assert hit(m, [h(1)], 100) == ([[2]], 16, 0)
    m.check_invariants()


def test_inserting_a_hash_refuses_blocks_the_engine_does_not_hold() -> None:
    m = tier()
    for block, group in ((3, 0), (0, 0), (99, 0), (-1, 0)):
        with pytest.raises((InvalidArgumentError, OverflowError)):
            m.insert_detached_block_hash(block, h(0), group, 16)
    held = m.get_new_blocks(1)
    assert held is not None
    b = int(held[0])
    with pytest.raises(InvalidArgumentError):
        m.insert_detached_block_hash(b, h(0), 1)  # no group 1
    with pytest.raises(InvalidArgumentError):
        m.insert_detached_block_hash(b, h(0), -1)
    with pytest.raises(InvalidArgumentError):
        m.insert_detached_block_hash(b, h(0), 0, -5)
    with pytest.raises(InvalidArgumentError):
        m.insert_detached_block_hash(b, b"", 0)
    with pytest.raises(InvalidArgumentError):
        m.find_longest_cache_hit([h(0)], -1)
    assert m.cached_block_hash(b) is None
    m.check_invariants()


# ---- side by side with vLLM's own coordinator (where vLLM is installed) ------


def _config(hybrid: bool) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["f"], full)]
    if hybrid:
        swa = SlidingWindowSpec(
            block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=8
        )
        groups.append(KVCacheGroupSpec(["s"], swa))
    return KVCacheConfig(num_blocks=8 * len(groups), kv_cache_tensors=[], kv_cache_groups=groups)


def _tier_calls(build: Any, hybrid: bool) -> list[Any]:
    """The CPU-tier calls of vLLM's SimpleCPUOffloadScheduler: blocks taken
    for a store, cached under the copied blocks' hashes when the store
    completes, freed; a lookup pins its hit; later stores evict."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    cfg = _config(hybrid)
    groups = len(cfg.kv_cache_groups)
    coord = build(
        kv_cache_config=cfg,
        max_model_len=1024,
        max_in_flight_tokens=1024,
        use_eagle=False,
        enable_caching=True,
        enable_kv_cache_events=True,
        dcp_world_size=1,
        pcp_world_size=1,
        scheduler_block_size=4,
        hash_block_size=4,
        allow_partial_hash_hits=True,
    )
    pool = coord.block_pool
    hashes = [BlockHash(bytes([3, i]) * 16) for i in range(8)]
    out: list[Any] = [type(coord).__name__, coord.group_block_sizes]

    def snap(tag: str) -> None:
        found, n, uncached = coord.find_longest_cache_hit(hashes, 30)
        out.append(
            (
                tag,
                [[b.block_id for b in g] for g in found],
                n,
                uncached,
                pool.get_num_free_blocks(),
                [
                    [
                        getattr(
                            pool.cached_block_hash_to_block.get_one_block(
                                make_block_hash_with_group_id(x, g)
                            ),
                            "block_id",
                            None,
                        )
                        for x in hashes
                    ]
                    for g in range(groups)
                ],
            )
        )

    def store(first: int, count: int) -> None:
        taken = pool.get_new_blocks(count * groups)
        for i in range(count):
            for g in range(groups):
                blk = taken[i * groups + g]
                pos = first + i
                key = make_block_hash_with_group_id(hashes[pos], g)
                pool._insert_block_hash(key, blk, num_tokens=4 * (pos + 1))
                pool.kv_event_queue.append(
                    BlockStored(
                        block_hashes=[hashes[pos]],
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=4,
                        lora_id=None,
                        medium="CPU",
                        lora_name=None,
                    )
                )
        pool.free_blocks(taken)

    store(0, 3)
    snap("stored 3")
    store(3, 2)
    snap("stored 5")
    found = coord.find_longest_cache_hit(hashes, 30)[0]
    pins = [b for g in found for b in g[:2] if not b.is_null]
    pool.touch(pins)
    snap("pinned")
    store(5, 3)  # evicts the unpinned cached blocks first in line
    snap("stored 8")
    pool.free_blocks(pins)
    store(0, 1)
    snap("restored 1")
    out.append(
        [
            (type(e).__name__, list(e.block_hashes))
            for e in pool.take_events()
            if isinstance(e, (BlockStored, BlockRemoved))
        ]
    )
    out.append(pool.reset_prefix_cache())
    snap("reset")
    return out


@pytest.mark.parametrize("hybrid", [False, True], ids=["unitary", "hybrid"])
def test_the_cpu_tier_coordinator_side_by_side_with_vllm(hybrid: bool) -> None:
    vllm_coord = pytest.importorskip("vllm.v1.core.kv_cache_coordinator")
    from pagedkv.vllm import get_kv_cache_coordinator

    ours = _tier_calls(get_kv_cache_coordinator, hybrid)
    ref = _tier_calls(vllm_coord.get_kv_cache_coordinator, hybrid)
    assert ours == ref
    # the case reaches hits, pins, evictions and events
    assert ref[2][2] == 12 and any(kind == "BlockRemoved" for kind, _ in ref[-3])


def test_install_puts_the_cpu_tier_coordinator_in_vllms_place() -> None:
    pytest.importorskip("vllm")
    import vllm.v1.core.kv_cache_coordinator as vcoord
    import vllm.v1.simple_kv_offload.manager as simple
    from pagedkv.vllm import get_kv_cache_coordinator, install, installed, uninstall

    original = simple.get_kv_cache_coordinator
    install()
    try:
        assert installed()
        assert simple.get_kv_cache_coordinator is get_kv_cache_coordinator
        assert vcoord.get_kv_cache_coordinator is get_kv_cache_coordinator
    finally:
        uninstall()
    assert simple.get_kv_cache_coordinator is original and not installed()
