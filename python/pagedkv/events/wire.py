"""KV-cache events on the wire, byte for byte as vLLM 0.33 writes them.

vLLM publishes ``KVEventBatch`` objects encoded by ``msgspec.msgpack.Encoder``:
the batch is a msgpack array ``[ts, [events...], data_parallel_rank]`` and each
event a msgpack map tagged with ``"type"`` (the class name) holding only the
fields that differ from their defaults. The structs below have vLLM's tags
(its class names), field order and options, so ``msgspec`` encodes them exactly
as vLLM does and a consumer written against vLLM (llm-d, Dynamo, SGLang's router)
decodes them unchanged. Their Python names carry a ``Wire`` prefix
(``WireBlockStored`` is vLLM's ``BlockStored`` on the wire) to keep them apart
from the domain events of :mod:`pagedkv.events`.

Block hashes travel as vLLM's ``ExternalBlockHash``: by default the 64-bit
integer form (the last 8 bytes of the digest, big-endian), or the raw digest
bytes with ``hash_format="bytes"``.

Requires the ``events`` extra (``msgspec``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Literal

import msgspec

from .. import _core
from . import domain

__all__ = [
    "MEDIUM_GPU",
    "EventBatch",
    "ExternalBlockHash",
    "HashFormat",
    "KVEventBatch",
    "KVEventEncoder",
    "WireAllBlocksCleared",
    "WireBlockRemoved",
    "WireBlockStored",
    "WireEvent",
    "WireKVCacheEvent",
    "decode_batch",
    "decode_batch_lenient",
    "hash_to_int",
    "to_wire",
]

ExternalBlockHash = bytes | int
HashFormat = Literal["int", "bytes"]
MEDIUM_GPU = "GPU"
_MASK64 = (1 << 64) - 1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A timestamped batch of events (one scheduler step), encoded as an array."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class WireKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event union (``{"type": "<vLLM class name>", ...}``).

    vLLM's ``KVCacheEvent``. The subclasses carry vLLM's class names as explicit
    tags, so the bytes are vLLM's while the Python names stay apart from the domain
    events in :mod:`pagedkv.events`.
    """


class WireBlockStored(WireKVCacheEvent, tag="BlockStored"):
    """Full blocks entered into the prefix cache (vLLM's ``BlockStored``)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class WireBlockRemoved(WireKVCacheEvent, tag="BlockRemoved"):
    """Blocks evicted from the prefix cache, hashes without the group id (vLLM's
    ``BlockRemoved``)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class WireAllBlocksCleared(WireKVCacheEvent, tag="AllBlocksCleared"):
    """The prefix cache was reset (vLLM's ``AllBlocksCleared``)."""


class KVEventBatch(EventBatch):
    """``EventBatch`` with the event union, what publishers send."""

    events: list[WireBlockStored | WireBlockRemoved | WireAllBlocksCleared]


WireEvent = WireBlockStored | WireBlockRemoved | WireAllBlocksCleared


def hash_to_int(h: ExternalBlockHash) -> int:
    """vLLM's integer form of a block hash: the last 8 bytes, big-endian (the
    core's conversion); an int is taken modulo 2**64."""
    if isinstance(h, int):
        return h & _MASK64
    return _core.hash_to_int(h if isinstance(h, bytes) else bytes(h))


def _hash(h: ExternalBlockHash, fmt: HashFormat) -> ExternalBlockHash:
    if fmt == "int":
        return hash_to_int(h)
    if isinstance(h, int):
        raise ValueError(
            "hash_format='bytes' needs events carrying raw digests "
            "(KVCacheManager.take_events(raw_hashes=True))"
        )
    return bytes(h)


def _hashes(hs: Iterable[ExternalBlockHash], fmt: HashFormat) -> list[ExternalBlockHash]:
    if fmt == "int":
        return [h if isinstance(h, int) else hash_to_int(h) for h in hs]
    return [_hash(h, fmt) for h in hs]


def to_wire(event: Any, hash_format: HashFormat = "int") -> WireEvent:
    """Converts one event to its wire struct.

    Accepts :mod:`pagedkv.events` objects (what ``KVCacheManager.take_events``
    returns) and wire structs (re-encoded with ``hash_format``).
    """
    if isinstance(event, domain.BlockStored | WireBlockStored):
        parent = event.parent_block_hash
        return WireBlockStored(
            block_hashes=_hashes(event.block_hashes, hash_format),
            parent_block_hash=None if parent is None else _hash(parent, hash_format),
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
            session_id=getattr(event, "session_id", None),
            lookahead_token_ids=getattr(event, "lookahead_token_ids", None),
        )
    if isinstance(event, domain.BlockRemoved | WireBlockRemoved):
        return WireBlockRemoved(
            block_hashes=_hashes(event.block_hashes, hash_format),
            medium=event.medium,
            group_idx=event.group_idx,
        )
    if isinstance(event, domain.AllBlocksCleared | WireAllBlocksCleared):
        return WireAllBlocksCleared()
    raise TypeError(f"not a KV-cache event: {event!r}")


class KVEventEncoder:
    """Encodes event batches as vLLM's publisher does.

    ``hash_format``: ``"int"`` (vLLM's default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``)
    or ``"bytes"`` (raw digests). ``data_parallel_rank`` stamps batches that carry none.
    """

    def __init__(
        self, *, hash_format: HashFormat = "int", data_parallel_rank: int | None = None
    ) -> None:
        if hash_format not in ("int", "bytes"):
            raise ValueError(f"hash_format must be 'int' or 'bytes', got {hash_format!r}")
        self.hash_format: HashFormat = hash_format
        self.data_parallel_rank = data_parallel_rank
        self._encoder = msgspec.msgpack.Encoder()

    def batch(self, events: Iterable[Any], ts: float | None = None) -> KVEventBatch:
        """A ``KVEventBatch`` of ``events`` (any form :func:`to_wire` accepts)."""
        fmt = self.hash_format
        return KVEventBatch(
            ts=time.time() if ts is None else ts,
            events=[to_wire(e, fmt) for e in events],
            data_parallel_rank=self.data_parallel_rank,
        )

    def encode(self, obj: KVEventBatch | WireEvent) -> bytes:
        """msgpack bytes of a batch or a single event."""
        return self._encoder.encode(obj)

    def encode_events(self, events: Iterable[Any], ts: float | None = None) -> bytes:
        """msgpack bytes of a batch built from ``events``."""
        return self._encoder.encode(self.batch(events, ts))


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    """A batch whose events are left undecoded (each checked on its own)."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _Tagged(msgspec.Struct, gc=False):
    """Just an event's tag."""

    type: str = ""


_raw_batch_decoder = msgspec.msgpack.Decoder(_RawBatch)
_event_decoder = msgspec.msgpack.Decoder(WireEvent)
_tag_decoder = msgspec.msgpack.Decoder(_Tagged)
_KNOWN_TYPES = frozenset(("BlockStored", "BlockRemoved", "AllBlocksCleared"))


def decode_batch(payload: bytes | memoryview) -> KVEventBatch:
    """Decodes one published payload (strictly: an unknown event type is an error)."""
    return _decoder.decode(payload)


def decode_batch_lenient(payload: bytes | memoryview) -> tuple[KVEventBatch, int]:
    """Decodes one published payload, skipping events of types this version does
    not know (a newer publisher's); returns the batch and how many were skipped.
    Raises ``msgspec.DecodeError`` (``ValidationError`` included) for a payload
    that is not a batch or a known event that is malformed: the whole batch is
    refused then."""
    try:
        return _decoder.decode(payload), 0
    except msgspec.ValidationError:
        pass  # an event of an unknown type, or a malformed one: look closer
    raw = _raw_batch_decoder.decode(payload)
    events: list[WireEvent] = []
    skipped = 0
    for ev in raw.events:
        if _tag_decoder.decode(ev).type not in _KNOWN_TYPES:
            skipped += 1
            continue
        events.append(_event_decoder.decode(ev))
    return KVEventBatch(
        ts=raw.ts, events=events, data_parallel_rank=raw.data_parallel_rank
    ), skipped
