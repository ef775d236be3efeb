"""Router-side prefix index: which replica holds the longest cached prefix.

Routers that place a request on the replica already holding its prompt prefix
(llm-d, Dynamo, SGLang's router) learn what every replica caches from its KV
events. :class:`PrefixIndex` (:mod:`.prefix`) does that bookkeeping in the Rust
core; :class:`IndexSubscriber` and :func:`serve` (:mod:`.service`, ``python -m
pagedkv.index``) feed it from the ZMQ publishers of many replicas and answer
queries over ZMQ. The service needs the ``events`` extra (``msgspec``, ``pyzmq``);
the index itself does not.
"""

from __future__ import annotations

from .prefix import (
    TIER_WEIGHTS,
    VLLM_DEFAULT_NONE_HASH_SEED,
    IndexStats,
    PrefixIndex,
    PrefixMatch,
    TierMatch,
    request_block_hashes,
)
from .service import IndexSubscriber, serve

__all__ = [
    "TIER_WEIGHTS",
    "VLLM_DEFAULT_NONE_HASH_SEED",
    "IndexStats",
    "IndexSubscriber",
    "PrefixIndex",
    "PrefixMatch",
    "TierMatch",
    "request_block_hashes",
    "serve",
]
