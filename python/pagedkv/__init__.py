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

from . import errors, presets
from ._core import __version__, hash_block_tokens, none_hash
from .config_builder import (
    NotEnoughKVCacheMemoryError,
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    get_kv_cache_capacity,
    get_kv_cache_config,
    get_kv_cache_groups,
    get_max_concurrency_for_kv_cache_config,
)
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
from .index import PrefixIndex, PrefixMatch
from .manager import (
    ComputedBlocks,
    KVCacheManager,
    ManagerOptions,
    PreparedRequest,
    RequestPreparer,
)
from .metrics import MeteredKVCacheManager
from .offload import DiskTransfer, OffloadConfig, Transfer, TransferPlan
from .presets import ModelPreset
from .specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    EngineManagedSpec,
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    dtype_size,
)
from .stats import PrefixCacheStats

__all__ = [
    "AllBlocksCleared",
    "AttentionSpec",
    "BlockRemoved",
    "BlockStored",
    "CannotFitError",
    "ChunkedLocalAttentionSpec",
    "CircularBufferSpec",
    "ComputedBlocks",
    "CrossAttentionSpec",
    "DiskTransfer",
    "DuplicateRequestError",
    "EngineManagedSpec",
    "FullAttentionSpec",
    "HiSparseHotSpec",
    "HiSparseResidentSpec",
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
    "MambaSpec",
    "ManagerOptions",
    "MeteredKVCacheManager",
    "ModelPreset",
    "NotEnoughKVCacheMemoryError",
    "OffloadConfig",
    "PagedKVError",
    "PrefixCacheStats",
    "PrefixIndex",
    "PrefixMatch",
    "PreparedRequest",
    "RequestPreparer",
    "SinkFullAttentionSpec",
    "SlidingWindowSpec",
    "StaleComputedBlocksError",
    "Transfer",
    "TransferPlan",
    "UniformTypeKVCacheSpecs",
    "UnknownRequestError",
    "__version__",
    "check_enough_kv_cache_memory",
    "dtype_size",
    "errors",
    "estimate_max_model_len",
    "get_kv_cache_capacity",
    "get_kv_cache_config",
    "get_kv_cache_groups",
    "get_max_concurrency_for_kv_cache_config",
    "hash_block_tokens",
    "none_hash",
    "presets",
]
