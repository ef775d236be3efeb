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

``KVCacheManager(config, max_model_len, offload=OffloadConfig(cpu_bytes=...))``
puts a host tier under the manager's own pool: ``get_computed_blocks`` reports
``num_host_tokens`` past the device hit, admitting with
``num_external_computed_tokens=hit.num_host_tokens`` reserves device blocks and
schedules their load, every full chunk a request computes is offered to the
tier, and :meth:`~pagedkv.KVCacheManager.take_transfer_plan` hands the engine
each step's copies (:class:`TransferPlan`), reported back with
``complete_transfers``. With ``disk_path`` a disk tier sits below host memory:
chunks stored in host memory are written through to it (``disk_writes``), a
hit continues on disk and is read back into host memory (``disk_reads``)
before it is loaded.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt

from pagedkv._core import DiskTier, OffloadTier

if TYPE_CHECKING:
    from .specs import KVCacheConfig

__all__ = [
    "DiskTier",
    "DiskTransfer",
    "Lookup",
    "OffloadConfig",
    "OffloadTier",
    "Transfer",
    "TransferPlan",
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


@dataclass(frozen=True)
class OffloadConfig:
    """A host tier under a :class:`~pagedkv.KVCacheManager`.

    Args:
        cpu_bytes: host memory for the tier; it holds ``cpu_bytes // chunk
            bytes`` chunks, a chunk being ``blocks_per_chunk`` blocks of the
            KV cache's layout (every layer's bytes for one block id).
        policy: ``"lru"`` or ``"arc"`` (vLLM 0.33's CPU tier policies).
        blocks_per_chunk: GPU blocks per chunk (vLLM's offloaded block size
            over the GPU block size).
        store_threshold: a chunk is stored once offered this many times
            (vLLM's admission filter; 1: every chunk).
        enable_events: record the tier's ``BlockStored`` / ``BlockRemoved``
            events (medium ``"CPU"``), drained by ``take_offload_events``.
        write_policy: ``"write_through"`` (a chunk is stored as soon as its
            request computed it: vLLM's offloading connector) or
            ``"write_back"`` (stored only once its request released it and its
            blocks are among the next ``write_back_window`` blocks the pool
            evicts: SGLang HiCache's ``write_back``; chunks still used on the
            device cost no copy, chunks evicted in one burst larger than the
            window are lost, counted as ``write_backs_missed``).
        write_back_window: blocks at the head of the free queue looked at by
            each transfer plan (at least the blocks a step allocates, and at
            least ``blocks_per_chunk``).
        disk_path: an existing directory (not a symlink) for a disk tier below
            host memory: one file created there (never an existing path),
            removed with the manager. Chunks stored in host memory are written
            through to it; a prefix found there is read back into host memory,
            its checksum checked (a corrupt or truncated chunk fails its load:
            recomputed, never served). Needs ``store_threshold`` 1.
        disk_bytes: the disk tier's bound in bytes (its file, headers included).
        disk_index_only: a disk tier of ``disk_bytes`` with no ``disk_path``:
            only its index is kept (which chunks such a disk would hold, and
            what it would evict), no file and no bytes moved;
            ``read_disk_chunk`` / ``write_disk_chunk`` take empty buffers. For
            simulators.
    """

    cpu_bytes: int
    policy: str = "lru"
    blocks_per_chunk: int = 1
    store_threshold: int = 1
    enable_events: bool = False
    write_policy: str = "write_through"
    write_back_window: int = 256
    disk_path: str | os.PathLike[str] | None = None
    disk_bytes: int = 0
    disk_index_only: bool = False

    def __post_init__(self) -> None:
        if self.disk_index_only and self.disk_path is not None:
            raise ValueError("disk_index_only is a disk tier without a disk_path")
        if (self.disk_path is None and not self.disk_index_only) != (self.disk_bytes == 0):
            raise ValueError(
                "disk_path (or disk_index_only) and disk_bytes go together (a disk tier needs both)"
            )
        if not isinstance(self.disk_bytes, int) or isinstance(self.disk_bytes, bool):
            raise ValueError(f"disk_bytes must be an int, got {self.disk_bytes!r}")
        if self.disk_bytes < 0:
            raise ValueError(f"disk_bytes must be positive, got {self.disk_bytes!r}")
        for name in ("cpu_bytes", "blocks_per_chunk", "store_threshold", "write_back_window"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.policy not in ("lru", "arc"):
            raise ValueError(f"policy must be 'lru' or 'arc', got {self.policy!r}")
        if self.write_policy not in ("write_through", "write_back"):
            raise ValueError(
                f"write_policy must be 'write_through' or 'write_back', got {self.write_policy!r}"
            )

    @staticmethod
    def bytes_per_block(kv_cache_config: KVCacheConfig) -> int:
        """Host bytes one block id occupies: its share of every KV-cache tensor."""
        total = sum(t.size for t in kv_cache_config.kv_cache_tensors)
        return total // kv_cache_config.num_blocks

    @staticmethod
    def group_block_bytes(kv_cache_config: KVCacheConfig, group: int) -> int:
        """Bytes one block of group ``group`` occupies: a block-sized share of
        every KV-cache tensor one of its layers uses."""
        layers = set(kv_cache_config.kv_cache_groups[group].layer_names)
        return sum(
            t.size // kv_cache_config.num_blocks
            for t in kv_cache_config.kv_cache_tensors
            if layers.intersection(t.shared_by)
        )

    @property
    def has_disk(self) -> bool:
        """Whether there is a disk tier below host memory."""
        return self.disk_bytes > 0

    def disk_chunk_bytes(self, kv_cache_config: KVCacheConfig) -> int:
        """Bytes of one group's chunk on disk (every group's must match)."""
        sizes = {
            self.group_block_bytes(kv_cache_config, g) * self.blocks_per_chunk
            for g in range(len(kv_cache_config.kv_cache_groups))
        }
        if len(sizes) != 1:
            raise ValueError(
                f"a disk tier needs every group's chunk to be one size, got {sorted(sizes)} bytes"
            )
        (size,) = sizes
        return size

    def num_chunks(self, kv_cache_config: KVCacheConfig) -> int:
        """Chunks the tier holds for this KV cache (0 when a chunk does not fit)."""
        per_chunk = self.bytes_per_block(kv_cache_config) * self.blocks_per_chunk
        if per_chunk <= 0:
            raise ValueError(
                "the KVCacheConfig has no kv_cache_tensors: the bytes of a block are unknown"
            )
        return self.cpu_bytes // per_chunk


class Transfer(NamedTuple):
    """One copy job's blocks in one group: ``device_blocks[i]`` and
    ``host_blocks[i]`` are the ends of one block copy (host block ``b`` is block
    ``b % blocks_per_chunk`` of tier slot ``b // blocks_per_chunk``)."""

    job: int
    request_id: str
    group: int
    device_blocks: npt.NDArray[np.int32]
    host_blocks: npt.NDArray[np.int64]


class DiskTransfer(NamedTuple):
    """A copy between host memory and the disk tier: one group's chunk at
    ``host_blocks``. A read is run with ``read_disk_chunk`` (its bytes then
    copied into the host blocks) before ``load_job``, the load that copies the
    chunk on; a write with ``write_disk_chunk`` (the host blocks' bytes)."""

    job: int
    group: int
    host_blocks: npt.NDArray[np.int64]
    load_job: int | None


@dataclass(frozen=True)
class TransferPlan:
    """A step's copies: ``disk_reads`` (disk to host) before the loads that
    copy them on; ``loads`` (host to device) finish before the step's forward
    pass reads them; ``stores`` (device to host) start after it wrote them;
    ``disk_writes`` (host to disk) whenever. Every load and store is reported
    once to ``complete_transfers``; disk copies end with their own calls."""

    loads: list[Transfer]
    stores: list[Transfer]
    disk_reads: list[DiskTransfer] = field(default_factory=list)
    disk_writes: list[DiskTransfer] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.stores or self.disk_reads or self.disk_writes)

    @property
    def jobs(self) -> list[int]:
        """Every load and store job of the plan, once each, loads first."""
        return list(dict.fromkeys(t.job for t in (*self.loads, *self.stores)))
