"""``KVCacheManager``: vLLM's KV-cache manager API over the Rust core."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from . import _core
from .events import KVCacheEvent, from_core
from .specs import KVCacheConfig
from .stats import PrefixCacheStats

__all__ = ["ComputedBlocks", "KVCacheManager"]

ComputedBlocks = _core.ComputedBlocks

HASH_ALGOS = ("sha256_cbor", "xxhash_cbor", "xxh3_native")


def _embed_bytes(prompt_embeds: Any) -> bytes:
    """Raw row-major bytes of a prompt-embedding tensor/array/buffer (what vLLM's
    ``tensor_data`` hashes)."""
    if isinstance(prompt_embeds, (bytes, bytearray, memoryview)):
        return bytes(prompt_embeds)
    if hasattr(prompt_embeds, "detach"):  # torch.Tensor, any dtype (bfloat16 included)
        import torch

        t = prompt_embeds.detach().contiguous().cpu()
        return bytes(t.view(torch.uint8).numpy().tobytes())
    import numpy as np

    return bytes(np.ascontiguousarray(prompt_embeds).tobytes())


def _mm_tuple(item: Any) -> tuple[str, int, int]:
    """``(identifier, offset, length)`` of a multimodal item: a 3-tuple, or vLLM's
    ``MultiModalFeatureSpec`` (``identifier`` + ``mm_position.offset/length``)."""
    if isinstance(item, tuple | list):
        if len(item) != 3:
            raise TypeError(
                f"a multimodal item is (identifier, offset, length), got {item!r}")
        identifier, offset, length = item
    elif hasattr(item, "identifier"):
        pos = getattr(item, "mm_position", item)
        identifier = item.identifier
        offset = getattr(pos, "offset", None)
        length = getattr(pos, "length", None)
    else:
        raise TypeError(
            "mm_features items must be (identifier, offset, length) tuples or "
            f"MultiModalFeatureSpec objects, got {item!r}")
    if not isinstance(identifier, str):
        raise TypeError(f"a multimodal identifier must be a str, got {identifier!r}")
    for name, v in (("offset", offset), ("length", length)):
        # Exact ints (NumPy integers too), not bools or floats.
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise TypeError(f"a multimodal {name} must be an int, got {v!r}")
    return identifier, offset.__index__(), length.__index__()


class KVCacheManager(_core.KVCacheManager):
    """The KV-cache block manager of one model.

    Decides every step which blocks each request holds, which prompt prefixes are
    cached and what to evict, with vLLM 0.33's exact behaviour (block ids
    included). Block ids cross the boundary as int32 NumPy arrays, one per
    KV-cache group.

    Args:
        kv_cache_config: the groups and the number of blocks (block 0 is the null
            block: a pool of N blocks has N-1 usable).
        max_model_len: the longest sequence a request may reach.
        enable_caching: automatic prefix caching.
        hash_algo: ``"sha256_cbor"`` (vLLM-compatible, default),
            ``"xxhash_cbor"`` (vLLM-compatible) or ``"xxh3_native"`` (pagedkv's
            fast hash; not shared with vLLM).
        hash_seed: seed of ``NONE_HASH``, like ``PYTHONHASHSEED`` (read from the
            environment when None). Unset: vLLM's fixed default for
            ``sha256_cbor``, a random per-manager seed for the others.
        hash_block_size: hash granularity in tokens (divides every block size).
        use_eagle: EAGLE/MTP drafting: every hit drops its last block.
        log_stats: collect prefix-cache stats (``make_prefix_cache_stats``).
        enable_kv_cache_events: record ``BlockStored``/``BlockRemoved``/
            ``AllBlocksCleared`` (``take_events``).
        watermark: fraction of blocks kept free when admitting requests while
            others are scheduled.
        max_in_flight_tokens: vLLM's admission cap for sliding-window groups.
        prefix_cache_retention_interval: vLLM's sparse retention of
            sliding-window/Mamba checkpoints (None = dense; 0 = replay boundary).
        verify_cached_tokens: collision safety. Every cached block keeps the token
            ids it was computed for (and a SHA-256 digest of its whole context);
            every prefix hit is checked against the request's own tokens, and a
            block that does not match ends the hit there, so a weak or attacked
            hash never serves another prompt's KV (``verification_failures``
            counts the hits cut short). Costs one SHA-256 per hashed block.
        hash_truncate_bytes: keep only this many leading bytes (1..32) of every
            block hash: a deliberately weak hash, for testing collision handling.
    """

    _kv_cache_config: KVCacheConfig
    _max_model_len: int
    _enable_caching: bool
    _log_stats: bool
    _max_in_flight_tokens: int

    def __new__(
        cls,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        *,
        enable_caching: bool = True,
        hash_algo: str = "sha256_cbor",
        hash_seed: str | int | None = None,
        hash_block_size: int | None = None,
        use_eagle: bool = False,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        watermark: float = 0.0,
        max_in_flight_tokens: int | None = None,
        prefix_cache_retention_interval: int | None = None,
        verify_cached_tokens: bool = False,
        hash_truncate_bytes: int | None = None,
    ) -> KVCacheManager:
        if not isinstance(kv_cache_config, KVCacheConfig):
            raise TypeError(f"kv_cache_config must be a KVCacheConfig, got {kv_cache_config!r}")
        # Equal specs share lookups: the tag tells specs apart by every field.
        groups = [{**g.kv_cache_spec.core_spec(), "tag": repr(g.kv_cache_spec)}
                  for g in kv_cache_config.kv_cache_groups]
        if hash_seed is None:
            hash_seed = os.environ.get("PYTHONHASHSEED")
        elif isinstance(hash_seed, bool) or not isinstance(hash_seed, str | int):
            raise TypeError(f"hash_seed must be a str or an int, got {hash_seed!r}")
        self = super().__new__(
            cls,
            kv_cache_config.num_blocks,
            groups,
            max_model_len,
            enable_caching=enable_caching,
            hash_algo=hash_algo,
            hash_seed=None if hash_seed is None else str(hash_seed),
            hash_block_size=hash_block_size,
            use_eagle=use_eagle,
            log_stats=log_stats,
            enable_kv_cache_events=enable_kv_cache_events,
            watermark=watermark,
            max_in_flight_tokens=max_in_flight_tokens,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
            verify_cached_tokens=verify_cached_tokens,
            hash_truncate_bytes=hash_truncate_bytes,
        )
        self._kv_cache_config = kv_cache_config
        self._max_model_len = max_model_len
        self._enable_caching = enable_caching
        self._log_stats = log_stats
        self._max_in_flight_tokens = max_in_flight_tokens or max_model_len
        return self

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        """The configuration the manager was built from."""
        return self._kv_cache_config

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def enable_caching(self) -> bool:
        return self._enable_caching

    @property
    def log_stats(self) -> bool:
        return self._log_stats

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | Any,
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
        lora_id: int | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[Any] | None = None,
        prompt_embeds: Any = None,
        skip_reading_prefix_cache: bool = False,
    ) -> int:
        """Registers a request and hashes its full prompt blocks. Returns the
        request's handle: batch calls accept handles in place of ids (no id lookup);
        a removed request's handle is refused, never taken for another request.

        ``mm_features``: ``(identifier, offset, length)`` per multimodal item (or
        vLLM ``MultiModalFeatureSpec`` objects). ``prompt_embeds``: a tensor/array
        with one row per prompt token (hashed per block, as vLLM does).
        ``skip_reading_prefix_cache``: prompt-logprobs requests never read the cache.
        """
        return super().add_request(
            request_id,
            prompt_token_ids,
            lora_name=lora_name,
            lora_path=lora_path,
            lora_id=lora_id,
            cache_salt=cache_salt,
            mm_features=None if mm_features is None else [_mm_tuple(m) for m in mm_features],
            prompt_embeds=None if prompt_embeds is None else _embed_bytes(prompt_embeds),
            skip_reading_prefix_cache=skip_reading_prefix_cache,
        )

    def take_events(self, *, raw_hashes: bool = False) -> list[KVCacheEvent]:
        """Drains the recorded KV-cache events (empty when events are off). Block
        hashes are vLLM's 64-bit ints (the digest's last 8 bytes, big-endian), or
        the full digest bytes with ``raw_hashes``."""
        return [from_core(raw) for raw in self._take_events(raw_hashes)]

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix-cache stats since the last call (and starts new ones); None
        when ``log_stats`` is off."""
        raw = self._make_prefix_cache_stats()
        return None if raw is None else PrefixCacheStats(*raw)

    def __repr__(self) -> str:
        return (f"KVCacheManager(num_blocks={self.num_blocks}, "
                f"groups={self.num_kv_cache_groups}, free={self.num_free_blocks}, "
                f"requests={self.num_requests})")
