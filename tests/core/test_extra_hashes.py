"""A block's keys beside its primary one (vLLM's ``cached_block_hashes_by_block``)
and the prefix map read whole (``cached_block_hash_to_block._cache``).

vLLM's CPU-offload connectors copy a device block's prefix-cache entries to
the host: its ``block_hash`` and the partial prompt-tail entries it carries
beside it. The core answers both: ``cached_block_hash`` and
``cached_block_extra_hashes`` (which blocks have any: ``blocks_with_extra_hashes``).
"""

from __future__ import annotations

from typing import Any

import pagedkv as pk
import pytest
from pagedkv.errors import InvalidArgumentError

from tests._util import load_vectors, make_manager

REQUESTS = load_vectors("vllm_request_hashes.json")


def plain_case(block_size: int) -> tuple[list[int], list[bytes]]:
    """A prompt and the block hashes vLLM 0.33 gave it (no extra keys)."""
    for c in REQUESTS["cases"]:
        if c["block_size"] == block_size and not c["mm_features"] and c["lora_name"] is None:
            if c["cache_salt"] is None:
                return c["token_ids"], [bytes.fromhex(b["hash"]) for b in c["blocks"]]
    raise AssertionError(f"no plain case of block size {block_size}")


def engine_manager(**kw: Any) -> pk.KVCacheManager:
    # Blocks of 8 tokens hashed every 4: a full block's key is the hash at its
    # end, a partial entry the one at its middle.
    return make_manager(
        8,
        11,
        hash_block_size=4,
        partial_hash_hits=True,
        external_block_hashes=True,
        record_stats_at_admission=False,
        enable_kv_cache_events=True,
        **kw,
    )


def filled_block(m: pk.KVCacheManager) -> tuple[int, list[bytes]]:
    tokens, hashes = plain_case(4)
    m.add_request("r", tokens)
    m.sync_request("r", tokens, hashes)
    (block,) = (m.get_new_blocks(1) or [None])[:1]
    assert block is not None
    return int(block), hashes


def test_a_full_block_with_a_partial_entry_carries_it_beside_its_key() -> None:
    m = engine_manager()
    block, hashes = filled_block(m)
    assert m.cached_block_extra_hashes(block) == []
    assert m.blocks_with_extra_hashes().tolist() == []
    m.cache_detached_blocks("r", 0, [block], 0, 1)
    assert m.cached_block_hash(block) == (hashes[1], 0)
    assert m.cached_block_extra_hashes(block) == []
    # The prefix boundary half way in: reachable from it, the full key kept.
    assert m.cache_detached_partial_block("r", 0, block, 4) == (hashes[0], 0)
    assert m.cached_block_hash(block) == (hashes[1], 0)
    assert m.cached_block_extra_hashes(block) == [(hashes[0], 0)]
    assert m.blocks_with_extra_hashes().tolist() == [block]
    assert m.cached_blocks_for_hash(hashes[0]).tolist() == [block]
    # The same entry again changes nothing.
    m.cache_detached_partial_block("r", 0, block, 4)
    assert m.cached_block_extra_hashes(block) == [(hashes[0], 0)]
    # Untouched blocks and the null block carry none.
    assert m.cached_block_extra_hashes(0) == []
    assert m.cached_block_extra_hashes(block + 1) == []
    m.free_blocks([block])
    m.check_invariants()
    # Eviction drops every key of the block.
    m.evict_blocks([block])
    assert m.cached_block_hash(block) is None
    assert m.cached_block_extra_hashes(block) == []
    assert m.blocks_with_extra_hashes().tolist() == []
    m.check_invariants()


def test_a_partial_entry_longer_than_the_key_replaces_it() -> None:
    # A block cached at its first hash boundary, then at a later one: the
    # shorter entry goes (vLLM's promotion), so nothing is carried beside it.
    m = engine_manager()
    block, hashes = filled_block(m)
    m.cache_detached_partial_block("r", 0, block, 4)
    assert m.cached_block_hash(block) == (hashes[0], 0)
    m.cache_detached_partial_block("r", 0, block, 8)
    assert m.cached_block_hash(block) == (hashes[1], 0)
    assert m.cached_block_extra_hashes(block) == []
    m.free_blocks([block])
    m.check_invariants()


def test_replacing_a_blocks_contents_drops_its_extra_keys() -> None:
    m = engine_manager()
    block, hashes = filled_block(m)
    m.cache_detached_blocks("r", 0, [block], 0, 1)
    m.cache_detached_partial_block("r", 0, block, 4)
    m.cache_detached_partial_block("r", 0, block, 8, replace_existing=True)
    assert m.cached_block_hash(block) == (hashes[1], 0)
    assert m.cached_block_extra_hashes(block) == []
    assert m.blocks_with_extra_hashes().tolist() == []
    m.free_blocks([block])
    # Held again and given the partial entry beside its key: a reset (every
    # block free) clears both.
    m.touch_blocks([block])
    m.cache_detached_partial_block("r", 0, block, 4)
    assert m.cached_block_extra_hashes(block) == [(hashes[0], 0)]
    m.free_blocks([block])
    assert m.reset_prefix_cache()
    assert m.cached_block_extra_hashes(block) == []
    assert m.blocks_with_extra_hashes().tolist() == []
    m.check_invariants()


def test_block_ids_out_of_range_are_refused() -> None:
    m = engine_manager()
    for bad in (11, -1):
        with pytest.raises(InvalidArgumentError):
            m.cached_block_extra_hashes(bad)
    with pytest.raises(TypeError):
        m.cached_block_extra_hashes("1")  # type: ignore[arg-type]


def test_cached_block_hashes_by_block_side_by_side_with_vllm() -> None:
    # The block pool's map as vLLM's CPU-offload connector reads it: by block
    # id, the keys beside the block's ``block_hash``, through caching, a
    # promotion, a replacement and an eviction.
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
        extra = pool.cached_block_hashes_by_block
        out: list[Any] = []

        def snap() -> None:
            out.append(
                (
                    {i: set(keys) for i, keys in extra.items()},
                    len(extra),
                    [set(extra.get(b.block_id, ())) for b in blocks],
                    [b.block_hash for b in blocks],
                )
            )

        blocks = pool.get_new_blocks(3)
        pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)
        snap()
        # Full blocks reachable from a boundary inside them: beside their key.
        pool.cache_partial_block(req, blocks[1], 6, 0, 4)
        pool.cache_partial_block(req, blocks[0], 2, 0, 4)
        snap()
        # The tail block: a partial entry, then a longer one (promotion).
        pool.cache_partial_block(req, blocks[2], 10, 0, 4)
        pool.cache_partial_block(req, blocks[2], 12, 0, 4)
        snap()
        pool.cache_partial_block(req, blocks[1], 8, 0, 4, replace_existing_hashes=True)
        snap()
        pool.free_blocks(blocks)
        pool.evict_blocks([blocks[0].block_id])
        snap()
        assert pool.reset_prefix_cache()
        snap()
        return out

    ours, ref = run(KVCacheManager), run(vllm_core.KVCacheManager)
    assert ours == ref
    assert ours[1][1] == 2  # the case exercises the map


def entries(m: pk.KVCacheManager) -> dict[tuple[bytes, int], list[int]]:
    return {(h, g): ids for h, g, ids in m.cached_block_hash_entries()}


def test_the_prefix_map_read_whole() -> None:
    # Every key with its blocks in caching order: a key cached twice (two
    # blocks an engine filled with the same tokens) lists both; a partial
    # entry beside a block's key is a key of its own.
    m = engine_manager()
    assert m.cached_block_hash_entries() == []
    block, hashes = filled_block(m)
    (other,) = (m.get_new_blocks(1) or [None])[:1]
    assert other is not None
    m.cache_detached_blocks("r", 0, [block], 0, 1)
    m.cache_detached_blocks("r", 0, [int(other)], 0, 1)
    m.cache_detached_partial_block("r", 0, block, 4)
    assert entries(m) == {(hashes[1], 0): [block, int(other)], (hashes[0], 0): [block]}
    assert len(m.cached_block_hash_entries()) == m.num_cached_block_hashes == 2
    m.free_blocks([block, int(other)])
    m.evict_blocks([block])
    assert entries(m) == {(hashes[1], 0): [int(other)]}
    m.check_invariants()


def test_the_prefix_maps_dict_side_by_side_with_vllm() -> None:
    # ``cached_block_hash_to_block._cache`` as vLLM's tests read it: a block
    # per key, or a dict of blocks by id when several share the key. (vLLM
    # keeps a dict of one block once a shared key loses a block; the view
    # gives the block itself, so the blocks are compared, not the shape.)
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

    def shape(v: Any) -> Any:
        return sorted(v) if isinstance(v, dict) else [v.block_id]

    def run(cls: Any) -> list[Any]:
        mgr = cls(cfg, max_model_len=256, hash_block_size=4, scheduler_block_size=4)
        pool = mgr.block_pool
        hasher = get_request_block_hasher(4, sha256_cbor)
        req = Request("a", list(range(10)), SamplingParams(max_tokens=8), None, block_hasher=hasher)
        out: list[Any] = []
        hit, n = mgr.get_computed_blocks(req)[:2]
        mgr.allocate_slots(req, 10 - n, n, hit)
        out.append({k: shape(v) for k, v in pool.cached_block_hash_to_block._cache.items()})
        copies = pool.get_new_blocks(2)
        pool.cache_full_blocks(req, copies, 0, 2, 4, 0)
        cache = pool.cached_block_hash_to_block._cache
        out.append({k: shape(v) for k, v in cache.items()})
        out.append(sorted(shape(v) for v in cache.values()))
        out.append(len(cache))
        pool.free_blocks(copies)
        mgr.free(req)
        pool.evict_blocks({copies[0].block_id})
        out.append({k: shape(v) for k, v in pool.cached_block_hash_to_block._cache.items()})
        return out

    ours, ref = run(KVCacheManager), run(vllm_core.KVCacheManager)
    assert ours == ref
    assert ours[3] == 2
