"""The host-memory offload tier: KV chunks evicted from GPU memory kept one tier
down, with vLLM 0.33's offloading semantics (``vllm/v1/kv_offload/cpu``).

``OffloadTier(num_chunks, policy="lru"|"arc", enable_events=False,
store_threshold=1, max_tracker_size=64000)`` is the core's tier: keys are
``bytes`` (a chunk's last block hash followed by its KV-cache group index, 4
bytes big-endian: :func:`offload_key`), requests are ints the caller picks
(one per request context), slots are ints. A store is prepared (slots
reserved, the chunk pending), then completed or failed; a load pins its chunks
until it completes::

    tier = OffloadTier(4, policy="arc", enable_events=True)
    keys = [offload_key(h, 0) for h in hashes]
    stored = tier.prepare_store(keys, req=1)        # None: no room, nothing evictable
    ...                                             # copy device -> host slots
    tier.complete_store(keys)
    tier.lookup(keys[0]) == Lookup.HIT

``DiskTier(path, capacity_bytes, chunk_bytes)`` is the tier below: one file of
fixed-size slots created in the directory ``path`` (removed with the tier),
bounded in bytes, least recently used out first; ``put(key, data)`` writes a
chunk through from host memory, ``get(key)`` / ``get_into(key, out)`` read it
back after checking its slot (a corrupt or truncated slot is a counted miss,
never wrong KV).
"""

from __future__ import annotations

import enum

from pagedkv._core import DiskTier, OffloadTier

__all__ = [
    "DiskTier",
    "Lookup",
    "OffloadTier",
    "offload_key",
    "offload_key_group",
    "offload_key_hash",
]


class Lookup(enum.IntEnum):
    """``OffloadTier.lookup``'s answers."""

    MISS = 0
    HIT = 1
    #: stored, its write not yet complete
    HIT_PENDING = 2


def offload_key(block_hash: bytes, group_idx: int) -> bytes:
    """A chunk's key: its last block hash, then the group index (4 bytes, big-endian)."""
    return block_hash + group_idx.to_bytes(4, "big", signed=False)


def offload_key_hash(key: bytes) -> bytes:
    """The block hash of a key."""
    return key[:-4]


def offload_key_group(key: bytes) -> int:
    """The KV-cache group index of a key."""
    return int.from_bytes(key[-4:], "big", signed=False)
