"""``KVCacheManager`` with vLLM 0.33's constructor and calls, over pagedkv's core.

vLLM's ``Request`` keeps its own tokens and block hashes (hashed by the engine
with whatever hash function it runs); the core is built with
``external_block_hashes`` and each call first hands it what the request gained
since the last call (a slice of each list). Block objects are made once per
block id: their ``ref_cnt`` and ``block_hash`` read the core, so vLLM's types
cost no allocation per step beyond the lists ``KVCacheBlocks`` holds.

The class vLLM builds: a layout with HiSparse groups gets
:class:`HiSparseKVCacheManager` (both are this class), every other layout the
manager of :mod:`pagedkv.vllm.base`.
"""

from __future__ import annotations

from typing import Any

from pagedkv.vllm.base import PagedKVCacheManager
from pagedkv.vllm.convert import engine_managed
from pagedkv.vllm.hisparse import HiSparseManager


class KVCacheManager(PagedKVCacheManager):
    """vLLM 0.33's ``KVCacheManager``, answered by pagedkv's core."""

    # vLLM's constructor, on the class vLLM builds (what wraps or inspects
    # ``KVCacheManager.__init__`` finds it here).
    __init__ = PagedKVCacheManager.__init__

    def __new__(cls, *args: Any, **kwargs: Any) -> KVCacheManager:
        # A layout with HiSparse groups gets the manager that runs vLLM's own
        # managers for them on pagedkv's pool.
        config = kwargs.get("kv_cache_config", args[0] if args else None)
        groups = getattr(config, "kv_cache_groups", ())
        if cls is KVCacheManager and any(engine_managed(g) for g in groups):
            cls = HiSparseKVCacheManager
        return super().__new__(cls)


class HiSparseKVCacheManager(HiSparseManager, KVCacheManager):
    """``KVCacheManager`` for a layout with HiSparse groups (vLLM's
    ``hisparse_host_num_blocks``): vLLM's source manager on the host tier,
    every device group (indexer, resident, hot, regular) in the core
    (:class:`pagedkv.vllm.hisparse.HiSparseManager`)."""
