"""KV-cache events with vLLM 0.33's fields (``vllm/distributed/kv_events.py``).

Block hashes are vLLM's integer form: the last 8 bytes of the digest, big-endian
(or the full digest bytes, from ``take_events(raw_hashes=True)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent"]


@dataclass(frozen=True)
class BlockStored:
    """Full blocks entered into the prefix cache by one call."""

    block_hashes: list[int] | list[bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """One block evicted from the prefix cache."""

    block_hashes: list[int] | list[bytes]
    medium: str | None = "GPU"
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def from_core(raw: tuple[Any, ...]) -> KVCacheEvent:
    """Builds an event from the core's tuple form."""
    tag = raw[0]
    if tag == "BlockStored":
        _, hashes, parent, tokens, bs, lora_id, lora_name, extra, group, kind, window = raw
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=bs,
            lora_id=lora_id,
            medium="GPU",
            lora_name=lora_name,
            extra_keys=extra,
            group_idx=group,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
        )
    if tag == "BlockRemoved":
        return BlockRemoved(block_hashes=raw[1], medium="GPU", group_idx=raw[2])
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown event tag {tag!r}")
