"""``KVCacheManager``: vLLM's KV-cache manager API over the Rust core."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, TypedDict

from . import _core
from .offload import DiskTransfer, OffloadConfig, Transfer, TransferPlan
from .specs import KVCacheConfig
from .stats import PrefixCacheStats

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "ComputedBlocks",
    "KVCacheManager",
    "ManagerOptions",
    "PreparedRequest",
    "RequestPreparer",
]

ComputedBlocks = _core.ComputedBlocks
#: Builds and hashes requests off the scheduler's thread
#: (``KVCacheManager.request_preparer()``).
RequestPreparer = _core.RequestPreparer
#: A request a ``RequestPreparer`` built, for ``KVCacheManager.add_prepared``.
PreparedRequest = _core.PreparedRequest

#: The block hash algorithms, by name (the core's).
HASH_ALGOS: tuple[str, ...] = _core.HASH_ALGOS


class ManagerOptions(TypedDict, total=False):
    """The options of :class:`KVCacheManager`, as keyword arguments. Unset ones
    take the core's defaults (``ManagerConfig``), given in brackets.

    - ``enable_caching`` (True): automatic prefix caching.
    - ``eviction`` (``"lru"``): which free block the device pool hands out
      next, and so which cached block it evicts. ``"lru"`` is vLLM's single
      LRU free queue, exactly. ``"slru"`` (segmented LRU) and ``"arc"``
      (adaptive replacement) also weigh reuse: a cached block hit by a
      prefix lookup is, once freed again, kept behind blocks cached only
      once, so a shared prefix outlives a scan of one-off prompts. Under
      ``"slru"`` reused blocks form a protected segment of at most 80% of the
      free blocks (its oldest are demoted past that); blocks are handed out
      from the probationary segment first. Under ``"arc"`` the split between
      once-cached (T1) and reused (T2) free blocks adapts: a block cached
      again under a key recently evicted from T1 grows T1's target, one
      evicted from T2 shrinks it (ghost lists of at most ``num_blocks`` keys
      each). Either way free blocks that hold no cached hash go first, and
      only the eviction order changes: hits, reference counts, events and
      stats follow from it as under LRU. With caching off nothing is cached
      and every value behaves as ``"lru"``. Another value raises
      :class:`~pagedkv.errors.InvalidConfigError` (a ``ValueError``).
    - ``hash_algo`` (``"sha256_cbor"``): also ``"xxhash_cbor"`` (vLLM-compatible)
      or ``"xxh3_native"`` (pagedkv's fast hash; not shared with vLLM).
    - ``hash_seed``: seed of ``NONE_HASH``, like ``PYTHONHASHSEED`` (read from the
      environment when None). Unset: vLLM's fixed default for ``sha256_cbor``, a
      random per-manager seed for the others.
    - ``hash_block_size``: hash granularity in tokens (divides every block size;
      unset: the groups' GCD).
    - ``use_eagle`` (False): EAGLE/MTP drafting: every hit drops its last block.
    - ``eagle_groups`` (all): the KV-cache groups EAGLE's drafter runs on
      (vLLM's ``is_eagle_group``); with ``use_eagle`` only their hits drop a block.
    - ``log_stats`` (False): collect prefix-cache stats (``make_prefix_cache_stats``).
    - ``enable_kv_cache_events`` (False): record ``BlockStored`` / ``BlockRemoved``
      / ``AllBlocksCleared`` (``take_events``).
    - ``watermark`` (0.0): fraction of blocks kept free when admitting requests
      while others are scheduled.
    - ``max_in_flight_tokens``: vLLM's admission cap for sliding-window groups
      (unset: ``max_model_len``).
    - ``prefix_cache_retention_interval``: vLLM's sparse retention of
      sliding-window/Mamba checkpoints (unset: dense; 0: the replay boundary).
    - ``verify_cached_tokens`` (False): collision safety. Every cached block keeps
      the token ids it was computed for (and a SHA-256 digest of its whole
      context); every prefix hit is checked against the request's own tokens, and
      a block that does not match ends the hit there, so a weak or attacked hash
      never serves another prompt's KV (``verification_failures`` counts the hits
      cut short). Costs one SHA-256 per hashed block.
    - ``hash_truncate_bytes``: keep only this many leading bytes (1..32) of every
      block hash: a deliberately weak hash, for testing collision handling.
    - ``kv_cache_metrics`` (False): vLLM's ``--kv-cache-metrics``: the pool counts
      block allocations, hits and evictions (``block_pool_stats``) and logs them
      for a residency collector (``take_block_activity``; see
      :class:`~pagedkv.metrics.MeteredKVCacheManager`).
    - ``external_block_hashes`` (False): the engine hashes requests itself and
      hands the manager its tokens and block hashes (``sync_request``); the mode
      of :mod:`pagedkv.vllm`.
    - ``record_stats_at_admission`` (True): record prefix-cache stats when a
      looked-up request is admitted. Off: only ``record_prefix_cache_stats``
      records (vLLM 0.33's scheduler calls it itself).
    - ``num_hash_lookahead_tokens`` (0): vLLM's lookahead hashing: each engine
      block hash covers this many tokens after the block (needs
      ``external_block_hashes``); ``BlockStored`` events carry them
      (``lookahead_token_ids``).
    - ``num_prefill_lookahead`` (0): vLLM's multi-module MTP prefill lookahead:
      the last ``num_prefill_lookahead - 1`` computed tokens may be prefilled
      again and are never cached.
    - ``partial_hash_hits`` (False): vLLM's fine-grained prefix hits. In a hybrid
      model with a Mamba ``"align"`` group finer-hashed than its blocks, hits may
      end on any hash-block boundary; a hit ending inside a block continues in a
      private copy, drained with ``take_block_copies`` (both endpoints stay
      referenced until ``free_blocks`` returns them). Mamba groups with
      ``prefill_checkpoint_alignment`` then reserve prefill checkpoints.
    - ``dcp_world_size`` (1): decode context parallelism (block sizes given are
      already scaled); it only decides where partial hits apply.
    - ``mamba_shared_prefix_checkpoint`` (False): an EAGLE model's Mamba groups
      also register the state at a shared-prefix junction.
    - ``zero_new_blocks`` (False): the worker zeroes fresh attention blocks
      before use (vLLM's ``needs_kv_cache_zeroing``: Mamba hybrids and
      mixed-precision caches, where a block's bytes may be read before they are
      written). Allocations list them; ``take_new_block_ids`` drains the list.
    - ``background_hashing`` (False): prompts are hashed on a worker thread, as
      vLLM's input thread does: ``add_request`` returns once the request is
      registered, and the first call that needs the request's hashes
      (``get_computed_blocks``, an append that fills a block, ``block_hashes``)
      waits for them. Same hashes, events and results; off, ``add_request``
      hashes before it returns. The worker checks for its next prompt every
      50 µs while the scheduler is busy (so handing one over costs no thread
      wake-up) and sleeps after 20 ms without one.
    - ``max_pending_events`` (262,144): KV events kept until ``take_events``
      drains them; past it the oldest quarter is dropped and counted
      (``num_dropped_events``), so a manager whose events nobody drains stays
      bounded. 1..2**30.
    - ``max_pending_block_activity`` (1,048,576): the same for the block
      activity log of ``kv_cache_metrics`` (``num_dropped_block_activity``).
    - ``hash_memo_blocks`` (None): the ``sha256_cbor`` memo. A prompt block
      hashed before (a shared system prompt, the earlier turns of a
      conversation) is looked up by its whole input (parent hash and every
      token, compared in full) instead of hashed again: the same hash for a
      fraction of the cost (measured in docs/perf-log.md, "Prompt blocks
      found in a memo instead of hashed again"). The memo keeps this many
      recent prompt blocks (a power of two; 128 bytes each for 16-token
      blocks; at most 2**22); None: 16,384 (2 MiB, allocated zeroed when
      first written); 0: off. The hash worker and the manager's preparers
      share it. Blocks of sampled tokens, blocks with extra keys
      (LoRA, multimodal, the salted first block), other hash algorithms and
      truncated hashes are always hashed. A block not found costs about a
      tenth more than hashing alone: for prompts that share nothing, turn it
      off. A prompt hashed in place whose blocks have no extra keys and that
      begins like a live request's (the last such to begin with the same
      first block) takes that request's hashes for the whole blocks their
      tokens share, the rest through the memo; 0 turns this off too.
      ``hash_memo_hits`` / ``hash_memo_misses`` count the blocks found (taken
      from a live request included) and hashed.
    """

    enable_caching: bool
    eviction: str
    hash_algo: str
    hash_seed: str | int | None
    hash_block_size: int | None
    use_eagle: bool
    eagle_groups: list[int]
    log_stats: bool
    enable_kv_cache_events: bool
    watermark: float
    max_in_flight_tokens: int | None
    prefix_cache_retention_interval: int | None
    verify_cached_tokens: bool
    hash_truncate_bytes: int | None
    kv_cache_metrics: bool
    external_block_hashes: bool
    record_stats_at_admission: bool
    num_hash_lookahead_tokens: int
    num_prefill_lookahead: int
    partial_hash_hits: bool
    dcp_world_size: int
    mamba_shared_prefix_checkpoint: bool
    zero_new_blocks: bool
    background_hashing: bool
    hash_memo_blocks: int | None
    max_pending_events: int | None
    max_pending_block_activity: int | None


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
        offload: a host tier under the pool (:class:`~pagedkv.offload.OffloadConfig`):
            lookups report ``num_host_tokens``, :meth:`take_transfer_plan` gives
            each step's copies. Full-attention groups of one block size; caching on.
        **options: :class:`ManagerOptions` (unset ones take the core's defaults).
    """

    _kv_cache_config: KVCacheConfig

    def __new__(
        cls,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        offload: OffloadConfig | None = None,
        **options: Unpack[ManagerOptions],
    ) -> KVCacheManager:
        if not isinstance(kv_cache_config, KVCacheConfig):
            raise TypeError(f"kv_cache_config must be a KVCacheConfig, got {kv_cache_config!r}")
        # Equal specs share lookups: the tag tells specs apart by every field.
        groups = [
            {**g.kv_cache_spec.core_spec(), "tag": repr(g.kv_cache_spec)}
            for g in kv_cache_config.kv_cache_groups
        ]
        if options.get("hash_seed") is None and "PYTHONHASHSEED" in os.environ:
            options["hash_seed"] = os.environ["PYTHONHASHSEED"]  # as vLLM reads it
        if offload is not None and not isinstance(offload, OffloadConfig):
            raise TypeError(f"offload must be an OffloadConfig, got {offload!r}")
        self = super().__new__(cls, kv_cache_config.num_blocks, groups, max_model_len, **options)
        self._kv_cache_config = kv_cache_config
        if offload is not None:
            self._enable_offload(
                offload.num_chunks(kv_cache_config),
                blocks_per_chunk=offload.blocks_per_chunk,
                policy=offload.policy,
                store_threshold=offload.store_threshold,
                enable_events=offload.enable_events,
                bytes_per_block=OffloadConfig.bytes_per_block(kv_cache_config),
                write_policy=offload.write_policy,
                write_back_window=offload.write_back_window,
                disk_path=None if offload.disk_path is None else os.fspath(offload.disk_path),
                disk_bytes=offload.disk_bytes,
                disk_chunk_bytes=(
                    offload.disk_chunk_bytes(kv_cache_config) if offload.has_disk else 0
                ),
            )
        return self

    def take_transfer_plan(self) -> TransferPlan:
        """The step's copies for the host tier: the loads admitted since the last
        plan, and the stores: with ``write_through``, every full chunk a running
        request cached and did not offer yet; with ``write_back``, every
        released chunk whose blocks are within the window at the free queue's
        head (the tier keeps what its policy admits, evicting for room). Each
        job's device blocks stay held until ``complete_transfers`` reports it."""
        reads, loads, stores, writes = self._take_transfer_plan()
        return TransferPlan(
            [Transfer(*t) for t in loads],
            [Transfer(*t) for t in stores],
            [DiskTransfer(*t) for t in reads],
            [DiskTransfer(*t) for t in writes],
        )

    def take_offload_events(self) -> list[tuple[list[bytes], str, bool, bool]]:
        """The host tier's events since the last call: ``(keys, medium, removed,
        metadata_only)`` with medium ``"CPU"`` (``enable_events``)."""
        return self._take_offload_events()

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        """The configuration the manager was built from."""
        return self._kv_cache_config

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix-cache stats since the last call (and starts new ones); None
        when ``log_stats`` is off."""
        raw = self._make_prefix_cache_stats()
        return None if raw is None else PrefixCacheStats(*raw)

    def __repr__(self) -> str:
        return (
            f"KVCacheManager(num_blocks={self.num_blocks}, "
            f"groups={self.num_kv_cache_groups}, free={self.num_free_blocks}, "
            f"requests={self.num_requests})"
        )
