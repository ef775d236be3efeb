"""pagedkv: the KV-cache block manager of an LLM serving engine.

A Rust core with vLLM 0.33's exact behaviour (block ids, hit lengths, events),
exposed to Python through PyO3. Block ids cross the boundary as int32 NumPy
arrays; Python keeps the KV tensors and maps block ids onto them.

>>> import pagedkv as pk
>>> spec = pk.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="float16")
>>> config = pk.KVCacheConfig(num_blocks=1024, kv_cache_groups=[pk.KVCacheGroupSpec(["l0"], spec)])
>>> mgr = pk.KVCacheManager(config, max_model_len=8192)
"""

from __future__ import annotations

from . import errors
from ._core import __version__, hash_block_tokens, none_hash
from .errors import (
    CannotFitError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidConfigError,
    InvariantViolationError,
    PagedKVError,
    StaleComputedBlocksError,
    UnknownRequestError,
)
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from .manager import ComputedBlocks, KVCacheManager
from .specs import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    dtype_size,
)
from .stats import PrefixCacheStats

__all__ = [
    "AllBlocksCleared",
    "AttentionSpec",
    "BlockRemoved",
    "BlockStored",
    "CannotFitError",
    "ComputedBlocks",
    "DuplicateRequestError",
    "FullAttentionSpec",
    "InvalidArgumentError",
    "InvalidConfigError",
    "InvariantViolationError",
    "KVCacheConfig",
    "KVCacheEvent",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "PagedKVError",
    "PrefixCacheStats",
    "StaleComputedBlocksError",
    "UnknownRequestError",
    "__version__",
    "dtype_size",
    "errors",
    "hash_block_tokens",
    "none_hash",
]
