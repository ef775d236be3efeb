"""Helpers shared by the manager tests (not a test module).

The managers built here mirror vLLM's own test fixtures
(``tests/v1/core/test_prefix_caching.py``: ``make_kv_cache_config`` builds one
full-attention group with ``num_kv_heads=1, head_size=1, float32``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pagedkv as pk

VECTORS = Path(__file__).parent / "vectors"

# vLLM 0.33's DEFAULT_NONE_HASH_SEED (vllm/v1/core/kv_cache_utils.py): the seed of
# NONE_HASH for sha256 algorithms when PYTHONHASHSEED is unset.
VLLM_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def load_vectors(name: str) -> dict[str, Any]:
    with open(VECTORS / name) as f:
        return json.load(f)


def make_manager(
    block_size: int = 16, num_blocks: int = 11, *, max_model_len: int = 8192, **kwargs: Any
) -> pk.KVCacheManager:
    spec = pk.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32")
    config = pk.KVCacheConfig(
        num_blocks=num_blocks, kv_cache_groups=[pk.KVCacheGroupSpec(["layer"], spec)]
    )
    return pk.KVCacheManager(config, max_model_len=max_model_len, **kwargs)


def as_lists(groups: Any) -> tuple[list[int], ...] | None:
    """A per-group tuple of int32 arrays as a tuple of plain lists (None stays None)."""
    if groups is None:
        return None
    return tuple([int(b) for b in g] for g in groups)


def admit(
    mgr: pk.KVCacheManager, request_id: str, num_new_tokens: int | None = None, **kwargs: Any
) -> tuple[pk.ComputedBlocks, tuple[list[int], ...] | None]:
    """What vLLM's scheduler does for a waiting request: look the prefix cache up,
    then allocate slots for the rest of the prompt (or ``num_new_tokens``)."""
    hit = mgr.get_computed_blocks(request_id)
    if num_new_tokens is None:
        num_new_tokens = mgr.num_tokens(request_id) - hit.num_computed_tokens
    new = mgr.allocate_slots(
        request_id, num_new_tokens, num_computed_tokens=0, new_computed_blocks=hit, **kwargs
    )
    return hit, as_lists(new)


def event_hash(block_hash: bytes) -> int:
    """vLLM's ``maybe_convert_block_hash``: the digest as a big-endian int, low 64 bits."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def chain(
    algo: str,
    none_hash: bytes,
    token_ids: list[int],
    block_size: int,
    extra_keys: list[Any] | None = None,
) -> list[bytes]:
    """vLLM's hash chain over the full blocks of ``token_ids`` (``extra_keys[i]`` for
    block ``i``), computed with the function-level ``hash_block_tokens``."""
    out: list[bytes] = []
    parent: bytes | None = None
    for i in range(len(token_ids) // block_size):
        keys = extra_keys[i] if extra_keys is not None else None
        parent = pk.hash_block_tokens(
            algo,
            parent,
            token_ids[i * block_size : (i + 1) * block_size],
            keys,
            none_hash=none_hash,
        )
        out.append(parent)
    return out


def snapshot(mgr: pk.KVCacheManager, request_ids: Sequence[str] = ()) -> dict[str, Any]:
    """Everything observable about a manager's state, for "left unchanged" checks."""
    n = mgr.num_blocks
    state: dict[str, Any] = {
        "num_free_blocks": mgr.num_free_blocks,
        "free_block_ids": [int(b) for b in mgr.free_block_ids()],
        "ref_counts": [mgr.block_ref_count(b) for b in range(n)],
        "cached": [mgr.cached_block_hash(b) for b in range(n)],
        "num_cached_block_hashes": mgr.num_cached_block_hashes,
        "num_requests": mgr.num_requests,
        "usage": mgr.usage,
    }
    for rid in request_ids:
        state[f"req:{rid}"] = (
            as_lists(mgr.get_block_ids(rid)),
            mgr.block_hashes(rid),
            mgr.num_tokens(rid),
            mgr.num_preemptions(rid),
        )
    return state


def full(bs: int) -> pk.FullAttentionSpec:
    return pk.FullAttentionSpec(bs, 1, 1, "float32")


def swa(bs: int, window: int) -> pk.SlidingWindowSpec:
    return pk.SlidingWindowSpec(bs, 1, 1, "float32", sliding_window=window)


def manager(
    num_blocks: int, specs: Sequence[pk.KVCacheSpec], *, max_model_len: int = 8192, **kwargs: Any
) -> pk.KVCacheManager:
    """A manager with one group per spec (layers named ``layer<i>``)."""
    groups = [pk.KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)]
    config = pk.KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)
    return pk.KVCacheManager(config, max_model_len=max_model_len, **kwargs)


def refused(call: Callable[[], Any]) -> bool:
    """vLLM's ``None``, or pagedkv's ``CannotFitError`` for a request that can never fit."""
    try:
        return call() is None
    except pk.CannotFitError:
        return True
