"""The torch side of pagedkv: KV-cache tensors for a :class:`~pagedkv.KVCacheConfig`,
block tables and slot mappings, reference paged-attention kernels, block copies, CPU
swapping and the host store behind an offload tier, and a tiny paged transformer
that proves the mapping end to end.

Importing :mod:`pagedkv` does not import torch; importing this subpackage does.

>>> import pagedkv as pk
>>> from pagedkv.torch import TinyConfig, TinyTransformer, PagedEngine
>>> engine = PagedEngine(TinyTransformer(TinyConfig()), num_blocks=64, max_model_len=64)
>>> _ = engine.add_request("r1", [1, 2, 3, 4, 5], max_tokens=3)
>>> _ = engine.run()
>>> engine.max_logit_error("r1") < 1e-4
True
"""

from __future__ import annotations

from .block_table import BlockTable, MultiGroupBlockTable, step_positions
from .engine import EngineRequest, PagedEngine, StepOutput
from .kernels import (
    AttentionMetadata,
    copy_blocks,
    dense_attention,
    paged_attention,
    write_kv,
    write_slots,
)
from .kv_cache import (
    KVCache,
    LayerCache,
    allocate_kv_cache,
    default_device,
    layer_specs,
    torch_dtype,
)
from .model import TinyConfig, TinyTransformer
from .offload import HostCopy, HostKVStore
from .swap import KVSwapper, SwapInResult, SwappedGroup, SwappedRequest

__all__ = [
    "AttentionMetadata",
    "BlockTable",
    "EngineRequest",
    "HostCopy",
    "HostKVStore",
    "KVCache",
    "KVSwapper",
    "LayerCache",
    "MultiGroupBlockTable",
    "PagedEngine",
    "StepOutput",
    "SwapInResult",
    "SwappedGroup",
    "SwappedRequest",
    "TinyConfig",
    "TinyTransformer",
    "allocate_kv_cache",
    "copy_blocks",
    "default_device",
    "dense_attention",
    "layer_specs",
    "paged_attention",
    "step_positions",
    "torch_dtype",
    "write_kv",
    "write_slots",
]
