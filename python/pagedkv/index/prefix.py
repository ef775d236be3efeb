"""The prefix index itself: which replica holds the longest cached prefix.

:class:`PrefixIndex` keeps, in the Rust core, the blocks every replica caches as
its ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events report them,
and answers for a request's block-hash chain (or its tokens) which replica holds
the longest prefix and how many blocks long it is. Hashes are keyed in vLLM's
event form (64-bit ints; raw digests are reduced to their last 8 bytes). Needs no
optional dependency.

Each block is kept with the media it is held on, from the events' ``medium``:
``"GPU"`` (the device), ``"CPU"`` (a host tier) and ``"DISK"`` / ``"STORAGE"``
(a disk tier). :meth:`PrefixIndex.match_tiers` answers a replica's held prefix
per tier (each block by the fastest medium holding it), and
:meth:`PrefixIndex.weighted_match` weighs them: by default a host hit is worth
0.75 of a device hit and a disk hit 0.25 (:data:`TIER_WEIGHTS`, Dynamo's
router's). ``AllBlocksCleared`` resets a replica's device cache; its host and
disk tiers keep what they hold.

>>> index = PrefixIndex()
>>> index.store("replica-a", [11, 12, 13])
>>> index.store("replica-b", [11, 12])
>>> index.longest_prefix([11, 12, 13, 14])
PrefixMatch(replica='replica-a', num_blocks=3)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import _core

__all__ = [
    "TIER_WEIGHTS",
    "VLLM_DEFAULT_NONE_HASH_SEED",
    "IndexStats",
    "PrefixIndex",
    "PrefixMatch",
    "TierMatch",
    "request_block_hashes",
]

# vLLM's seed of NONE_HASH for the sha256 algorithms when PYTHONHASHSEED is unset
# (the core's).
VLLM_DEFAULT_NONE_HASH_SEED: str = _core.DEFAULT_NONE_HASH_SEED


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The replica holding the longest prefix, and its length in blocks."""

    replica: str
    num_blocks: int


#: What a held block is worth to a request, by where it is held: on the device,
#: in host memory (loaded first), on disk (read, then loaded).
TIER_WEIGHTS: tuple[float, float, float] = (1.0, 0.75, 0.25)


@dataclass(frozen=True, slots=True)
class TierMatch:
    """A replica's held prefix, its blocks counted by the fastest medium
    holding each."""

    device: int
    host: int
    disk: int

    @property
    def num_blocks(self) -> int:
        return self.device + self.host + self.disk


@dataclass(frozen=True)
class IndexStats:
    """What an index has been fed. ``unknown_removals``: removals of blocks the
    replica was not known to hold (missed events, or blocks stored before the
    index started listening)."""

    blocks_stored: int
    blocks_removed: int
    unknown_removals: int
    clears: int


def request_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    hash_algo: str = "sha256_cbor",
    hash_seed: str | int | None = None,
    none_hash: bytes | None = None,
    extra_keys: Sequence[Any] | None = None,
) -> list[bytes]:
    """The block-hash chain of a request's full blocks, as a manager computes it.

    ``hash_seed`` is the replicas' ``PYTHONHASHSEED``/``hash_seed`` (unset: vLLM's
    fixed default, only defined for the sha256 algorithms); ``none_hash`` overrides
    it. ``extra_keys``: one entry per block (vLLM's tagged tuples, or None).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if none_hash is None:
        if hash_seed is None:
            if not hash_algo.startswith("sha256"):
                raise ValueError(f"{hash_algo} has no fixed default seed: pass hash_seed")
            hash_seed = VLLM_DEFAULT_NONE_HASH_SEED
        none_hash = _core.none_hash(hash_algo, str(hash_seed))
    out: list[bytes] = []
    parent: bytes | None = None
    for i in range(len(token_ids) // block_size):
        extra = None if extra_keys is None or i >= len(extra_keys) else extra_keys[i]
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = _core.hash_block_tokens(hash_algo, parent, block, extra, none_hash=none_hash)
        out.append(parent)
    return out


class PrefixIndex:
    """Which replica holds which cached blocks (see the module docs).

    Replicas are named; a name is registered on first use. ``group_idx``
    selects one KV-cache group's blocks (None: a block counts whichever group
    holds it). Not thread-safe: feed and query it from one thread (concurrent
    calls raise rather than corrupt it).
    """

    def __init__(self) -> None:
        self._index = _core.PrefixIndex()
        self._names: list[str] = []

    def _id(self, replica: str) -> int:
        rid = self._index.replica(replica)
        if rid == len(self._names):
            self._names.append(replica)
        return rid

    @property
    def replicas(self) -> list[str]:
        """Registered replica names, by id."""
        return list(self._names)

    @property
    def num_blocks(self) -> int:
        """Distinct block hashes held by any replica."""
        return self._index.num_blocks

    def replica_num_blocks(self, replica: str) -> int:
        """Distinct block hashes held by one replica."""
        rid = self._index.replica_id(replica)
        return 0 if rid is None else self._index.replica_num_blocks(rid)

    def stats(self) -> IndexStats:
        return IndexStats(*self._index.stats())

    def store(
        self,
        replica: str,
        block_hashes: Sequence[int | bytes],
        parent_block_hash: int | bytes | None = None,
        group_idx: int | None = None,
        medium: str = "GPU",
    ) -> None:
        """``BlockStored``: the replica cached this chain (child of the parent)
        on ``medium`` (``"GPU"``, ``"CPU"``, ``"DISK"``)."""
        self._index.store(self._id(replica), block_hashes, parent_block_hash, group_idx, medium)

    def remove(
        self,
        replica: str,
        block_hashes: Sequence[int | bytes],
        group_idx: int | None = None,
        medium: str = "GPU",
    ) -> None:
        """``BlockRemoved``: one block per hash was evicted from ``medium``."""
        self._index.remove(self._id(replica), block_hashes, group_idx, medium)

    def clear(self, replica: str) -> None:
        """The replica restarted: it holds nothing, on any medium."""
        self._index.clear(self._id(replica))

    def apply(self, replica: str, events: Iterable[Any]) -> int:
        """Applies one replica's events in order: a ``KVEventBatch``, or event
        objects (``pagedkv.events`` objects, ``pagedkv.events.wire`` structs,
        vLLM's own). Returns the number applied."""
        batch_events: Iterable[Any] = getattr(events, "events", events)
        return self._index.apply_events(self._id(replica), batch_events)

    def match_lengths(
        self, block_hashes: Sequence[int | bytes], group_idx: int | None = None
    ) -> dict[str, int]:
        """Per replica, the number of leading blocks of the chain it holds."""
        lengths = self._index.match_lengths(block_hashes, group_idx)
        return dict(zip(self._names, lengths, strict=True))

    def match_tiers(
        self, block_hashes: Sequence[int | bytes], group_idx: int | None = None
    ) -> dict[str, TierMatch]:
        """Per replica, its held prefix of the chain by tier (each block by the
        fastest medium holding it)."""
        tiers = self._index.match_tiers(block_hashes, group_idx)
        return {n: TierMatch(*t) for n, t in zip(self._names, tiers, strict=True)}

    def weighted_match(
        self,
        block_hashes: Sequence[int | bytes],
        weights: Sequence[float] = TIER_WEIGHTS,
        group_idx: int | None = None,
    ) -> dict[str, float]:
        """Per replica, its held prefix weighed by tier: ``weights`` (device,
        host, disk) per block, :data:`TIER_WEIGHTS` by default."""
        if len(weights) != 3:
            raise ValueError(f"weights are (device, host, disk), got {weights!r}")
        w = self._index.weighted_match(block_hashes, tuple(weights), group_idx)
        return dict(zip(self._names, w, strict=True))

    def longest_prefix(
        self, block_hashes: Sequence[int | bytes], group_idx: int | None = None
    ) -> PrefixMatch | None:
        """The replica holding the longest prefix of the chain (the first
        registered among equals), or None when none holds its first block."""
        best = self._index.longest_prefix(block_hashes, group_idx)
        return None if best is None else PrefixMatch(self._names[best[0]], best[1])

    def longest_prefix_for_tokens(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        hash_algo: str = "sha256_cbor",
        hash_seed: str | int | None = None,
        extra_keys: Sequence[Any] | None = None,
        group_idx: int | None = None,
    ) -> PrefixMatch | None:
        """:meth:`longest_prefix` of a request given by its tokens (hashed as the
        replicas hash them: same algorithm, seed and block size)."""
        hashes = request_block_hashes(
            token_ids, block_size, hash_algo=hash_algo, hash_seed=hash_seed, extra_keys=extra_keys
        )
        return self.longest_prefix(hashes, group_idx)

    def contains(self, replica: str, block_hash: int | bytes, group_idx: int | None = None) -> bool:
        rid = self._index.replica_id(replica)
        return rid is not None and self._index.contains(rid, block_hash, group_idx)

    def chain(self, block_hash: int | bytes) -> list[int]:
        """The held chain ending at a hash, first block first (parent links)."""
        return self._index.chain(block_hash)

    def entries(self, replica: str) -> list[tuple[int, int | None, int]]:
        """Sorted ``(hash, group_idx, count)`` of what the replica holds."""
        rid = self._index.replica_id(replica)
        return [] if rid is None else self._index.replica_entries(rid)

    def check_invariants(self) -> None:
        self._index.check_invariants()
