"""KV-cache events: what the manager reports when blocks enter or leave the prefix cache.

- this package: the domain events (``BlockStored`` / ``BlockRemoved`` /
  ``AllBlocksCleared``, vLLM 0.33's fields), what ``KVCacheManager.take_events``
  returns; defined in :mod:`.domain`;
- :mod:`pagedkv.events.wire`: vLLM's msgpack wire format (``KVEventBatch``), byte for
  byte (needs the ``events`` extra: ``msgspec``);
- :mod:`pagedkv.events.zmq`: the ZMQ publisher and subscriber speaking vLLM's
  protocol (needs the ``events`` extra: ``pyzmq``).
"""

from __future__ import annotations

from .domain import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent"]
