"""KV-cache events with vLLM 0.33's fields (``vllm/distributed/kv_events.py``).

``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` are frozen value objects
of the compiled core: ``KVCacheManager.take_events`` builds one per event in Rust,
and they are constructed, compared, hashed, printed and pickled like frozen
dataclasses with the same fields and defaults (``medium="GPU"``, the rest None).

Block hashes are vLLM's integer form: the last 8 bytes of the digest, big-endian
(or the full digest bytes, from ``take_events(raw_hashes=True)``).
"""

from __future__ import annotations

from .._core import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent"]

KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
