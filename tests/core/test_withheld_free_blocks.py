"""A pool that counts fewer free blocks than its queue holds
(``set_num_free_blocks``: vLLM's ``free_block_queue.num_free_blocks = n``, which
its offloading connector's tests write to make the pool look full and then
give it back). With vLLM installed, the drop-in's free queue is written side by
side with vLLM's own manager."""

from __future__ import annotations

from typing import Any

import pytest
from pagedkv.errors import InvalidArgumentError

from tests._util import make_manager


def test_withheld_blocks_are_not_counted_or_handed_out() -> None:
    m = make_manager(4, 11)
    queue = m.free_block_ids().tolist()
    m.set_num_free_blocks(0)
    assert (m.num_free_blocks, m.usage) == (0, 1.0)
    assert m.get_new_blocks(1) is None
    m.add_request("r", list(range(8)))
    assert m.allocate_slots("r", 8, num_computed_tokens=0) is None
    # The queue itself is unchanged.
    assert m.free_block_ids().tolist() == queue
    m.check_invariants()
    m.set_num_free_blocks(10)
    assert m.num_free_blocks == 10
    assert m.get_new_blocks(10) is not None
    m.check_invariants()


def test_blocks_taken_and_returned_change_the_count_one_for_one() -> None:
    m = make_manager(4, 11)
    m.add_request("r", list(range(12)))
    assert m.allocate_slots("r", 12, num_computed_tokens=0) is not None
    m.cache_blocks("r", 12)
    assert m.num_free_blocks == 7
    m.set_num_free_blocks(0)
    m.free("r")  # its 3 blocks come back: 3 counted, 7 withheld
    assert m.num_free_blocks == 3
    # Its prefix hit takes its own cached blocks back out of the queue.
    m.add_request("s", list(range(12)))
    hit = m.get_computed_blocks("s")
    assert hit.num_computed_tokens == 8
    assert m.allocate_slots("s", 4, num_computed_tokens=0, new_computed_blocks=hit) is not None
    assert m.num_free_blocks == 0
    m.free("s")
    assert m.num_free_blocks == 3
    ids = m.get_new_blocks(3)
    assert ids is not None
    assert m.get_new_blocks(1) is None
    m.free_blocks(ids)
    m.check_invariants()
    # A reset is refused while blocks are withheld (the pool does not look
    # empty), and goes through once the count is the queue's length again.
    assert not m.reset_prefix_cache()
    m.set_num_free_blocks(len(m.free_block_ids()))
    assert m.num_free_blocks == 10
    assert m.reset_prefix_cache()
    m.check_invariants()


def test_more_than_the_queue_holds_is_refused() -> None:
    m = make_manager(4, 11)
    m.add_request("r", list(range(8)))
    m.allocate_slots("r", 8, num_computed_tokens=0)
    with pytest.raises(InvalidArgumentError, match="free queue holds 8"):
        m.set_num_free_blocks(9)
    for bad in (-1, 2**32):
        with pytest.raises(InvalidArgumentError):
            m.set_num_free_blocks(bad)
    assert m.num_free_blocks == 8
    m.set_num_free_blocks(8)
    assert m.num_free_blocks == 8


def test_writing_the_free_queues_count_side_by_side_with_vllm() -> None:
    # A running request that cannot grow while the pool looks full; its
    # blocks freed, then the count given back and the cache reset.
    vllm_core = pytest.importorskip("vllm.v1.core.kv_cache_manager")
    import torch
    from pagedkv.vllm import KVCacheManager
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32)
    cfg = KVCacheConfig(
        num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["f"], full)]
    )

    def run(cls: Any) -> list[Any]:
        mgr = cls(cfg, max_model_len=256, hash_block_size=4, scheduler_block_size=4)
        pool = mgr.block_pool
        queue = pool.free_block_queue
        hasher = get_request_block_hasher(4, sha256_cbor)
        req = Request("a", list(range(12)), SamplingParams(max_tokens=8), None, block_hasher=hasher)
        out: list[Any] = []
        hit, n = mgr.get_computed_blocks(req)[:2]
        out.append(mgr.allocate_slots(req, 12 - n, n, hit).get_block_ids())
        req.num_computed_tokens = 12
        empty = queue.num_free_blocks
        queue.num_free_blocks = 0
        out.append((pool.get_num_free_blocks(), mgr.usage))
        out.append(mgr.allocate_slots(req, 1))
        mgr.free(req)
        out.append((queue.num_free_blocks, pool.get_num_free_blocks(), mgr.reset_prefix_cache()))
        out.append([b.block_id for b in pool.get_new_blocks(2)])
        out.append(pool.get_num_free_blocks())
        queue.num_free_blocks = empty - 2
        out.append((pool.get_num_free_blocks(), mgr.usage, mgr.reset_prefix_cache()))
        return out

    ours, ref = run(KVCacheManager), run(vllm_core.KVCacheManager)
    assert ours == ref
    assert ours[2] is None  # the pool looked full
