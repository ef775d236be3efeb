"""vLLM's ``get_kv_cache_coordinator`` answered by pagedkv: a coordinator over
pagedkv's core for components that build one beside the manager (the CPU
tier of vLLM's ``SimpleCPUOffloadScheduler``)."""

from __future__ import annotations

from typing import Any

from pagedkv.vllm.manager import KVCacheManager
from pagedkv.vllm.views import CoordinatorView

__all__ = ["get_kv_cache_coordinator"]


def get_kv_cache_coordinator(
    kv_cache_config: Any,
    max_model_len: int,
    max_in_flight_tokens: int,
    use_eagle: bool,
    enable_caching: bool,
    enable_kv_cache_events: bool,
    dcp_world_size: int,
    pcp_world_size: int,
    scheduler_block_size: int,
    hash_block_size: int,
    metrics_collector: Any = None,
    num_hash_lookahead_tokens: int = 0,
    num_prefill_lookahead: int = 0,
    allow_partial_hash_hits: bool = True,
) -> CoordinatorView:
    """vLLM 0.33's ``get_kv_cache_coordinator``: the coordinator (of the kind
    vLLM would build: no prefix cache, one lookup group, or hybrid) of a
    pagedkv manager over ``kv_cache_config``, its ``block_pool`` that
    manager's pool. Blocks are taken and returned through the pool
    (``get_new_blocks``, ``touch``, ``free_blocks``), cached with
    ``_insert_block_hash`` and found with ``find_longest_cache_hit``."""
    manager = KVCacheManager(
        kv_cache_config,
        max_model_len,
        scheduler_block_size,
        hash_block_size,
        max_in_flight_tokens=max_in_flight_tokens,
        enable_caching=enable_caching,
        use_eagle=use_eagle,
        num_hash_lookahead_tokens=num_hash_lookahead_tokens,
        num_prefill_lookahead=num_prefill_lookahead,
        enable_kv_cache_events=enable_kv_cache_events,
        dcp_world_size=dcp_world_size,
        pcp_world_size=pcp_world_size,
        metrics_collector=metrics_collector,
        allow_partial_hash_hits=allow_partial_hash_hits,
    )
    return manager.coordinator
