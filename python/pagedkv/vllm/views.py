"""Read-only views of pagedkv's core in the shapes vLLM's scheduler reaches for:
block objects, the block pool, the coordinator and its per-group managers."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any, overload

from vllm.v1.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    SpecGroup,
    UnitaryKVCacheCoordinator,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheGroupRole,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

if TYPE_CHECKING:
    from pagedkv import _core
    from pagedkv.vllm.manager import KVCacheManager


def core_group(
    spec: KVCacheSpec, dcp_world_size: int = 1, pcp_world_size: int = 1
) -> dict[str, Any]:
    """The core's group description of a vLLM KV-cache spec; equal specs get
    equal tags (they share hit lookups, as vLLM's coordinator groups them).

    Decode context parallelism shards each block's KV over ``dcp_world_size``
    ranks: a DCP-sharded group's blocks hold ``block_size * dcp_world_size``
    tokens (vLLM's single-type managers scale it so). Prefill context
    parallelism changes no geometry here, and vLLM refuses it for the
    recycling kinds."""
    group = _core_kind(spec)
    if getattr(spec, "dcp_sharded", False):
        group["block_size"] *= dcp_world_size
    if pcp_world_size > 1 and group["kind"] in (
        "sliding_window",
        "chunked_local_attention",
        "mamba",
    ):
        raise AssertionError(f"PCP does not support {group['kind']} groups")
    return {**group, "tag": repr(spec)}


def engine_managed(group: Any) -> bool:
    """Whether vLLM's own manager runs the group (an engine-managed core
    group): HiSparse's host source, over the host tier's own pool."""
    return getattr(group, "role", None) == KVCacheGroupRole.HISPARSE_SOURCE


def _core_kind(spec: KVCacheSpec) -> dict[str, Any]:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        inner = next(iter(spec.kv_cache_specs.values()))
        return {**_core_kind(inner), "block_size": spec.block_size}
    name = type(spec).__name__
    bs = spec.block_size
    if isinstance(spec, MambaSpec):
        # Prefill checkpoints need both the reserved block and an alignment.
        checkpoints = getattr(spec, "num_prefill_checkpoint_blocks", 0) > 0
        return {
            "kind": "mamba",
            "block_size": bs,
            "mamba_cache_mode": spec.mamba_cache_mode,
            "num_speculative_blocks": spec.num_speculative_blocks,
            "prefill_checkpoint_alignment": getattr(spec, "prefill_checkpoint_alignment", None)
            if checkpoints
            else None,
        }
    if isinstance(spec, CrossAttentionSpec):
        return {"kind": "cross_attention", "block_size": bs}
    if isinstance(spec, SlidingWindowSpec) and name in (
        "SlidingWindowSpec",
        "SlidingWindowMLASpec",
    ):
        group = {"kind": "sliding_window", "block_size": bs, "sliding_window": spec.sliding_window}
        if getattr(spec, "bounded_replay", False):
            # Never cached: after a hit the scheduler replays the window.
            group["bounded_replay"] = True
        if spec.extra_retained_tokens:
            group["extra_retained_tokens"] = spec.extra_retained_tokens
        return group
    if isinstance(spec, HiSparseResidentSpec):
        return {"kind": "hisparse_resident", "block_size": bs}
    if isinstance(spec, HiSparseHotSpec):
        return {
            "kind": "hisparse_hot",
            "block_size": bs,
            "blocks_per_request": spec.blocks_per_request,
        }
    if name == "CircularBufferSpec":
        return {"kind": "circular_buffer", "block_size": bs}
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return {
            "kind": "chunked_local_attention",
            "block_size": bs,
            "attention_chunk_size": spec.attention_chunk_size,
        }
    if isinstance(spec, SinkFullAttentionSpec):
        return {"kind": "sink_full_attention", "block_size": bs, "sink_len": spec.sink_len}
    if isinstance(spec, MLAAttentionSpec) and name == "MLAAttentionSpec":
        return {"kind": "mla_attention", "block_size": bs}
    if isinstance(spec, FullAttentionSpec) and name in ("FullAttentionSpec", "MLAAttentionSpec"):
        return {"kind": "full_attention", "block_size": bs}
    raise NotImplementedError(f"pagedkv's vLLM manager does not support {name} groups yet")


class _BlockList(Sequence[KVCacheBlock]):
    """A read-only list of block objects that a subclass's ``_list()`` makes:
    indexing, slicing, iteration, ``len``, ``+``, printed as the list."""

    __slots__ = ()

    def _list(self) -> list[KVCacheBlock]:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> KVCacheBlock: ...
    @overload
    def __getitem__(self, i: slice) -> list[KVCacheBlock]: ...
    def __getitem__(self, i: int | slice) -> KVCacheBlock | list[KVCacheBlock]:
        return self._list()[i]

    def __len__(self) -> int:
        return len(self._list())

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(self._list())

    def __reversed__(self) -> Iterator[KVCacheBlock]:
        return reversed(self._list())

    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: Iterable[KVCacheBlock]) -> list[KVCacheBlock]:
        return [*self._list(), *other]

    def __radd__(self, other: Iterable[KVCacheBlock]) -> list[KVCacheBlock]:
        return [*other, *self._list()]

    def __repr__(self) -> str:
        return repr(self._list())


class BlockRun(_BlockList):
    """One group's blocks of a lookup, named by block id; the block objects
    are fetched when first read. A hit the scheduler only hands back to
    ``allocate_slots`` (which reuses the core's own) never touches them: on
    cold caches that is a memory miss per block saved. Reads as a list
    (``==`` with a list included)."""

    __slots__ = ("_ids", "_items", "_pool")

    def __init__(self, ids: Any, pool: list[Any]) -> None:
        self._ids = ids  # an int array
        self._pool = pool
        self._items: list[KVCacheBlock] | None = None

    def _list(self) -> list[KVCacheBlock]:
        items = self._items
        if items is None:
            pool = self._pool
            items = self._items = [pool[i] for i in self._ids.tolist()]
        return items

    def __len__(self) -> int:
        return len(self._ids)

    def block_ids(self) -> list[int]:
        """The blocks' ids (no block object read)."""
        return self._ids.tolist()  # type: ignore[no-any-return]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockRun):
            other = other._list()
        if not isinstance(other, list):
            return NotImplemented
        return self._list() == other


class PagedKVCacheBlocks(KVCacheBlocks):
    """vLLM's ``KVCacheBlocks`` over ``BlockRun`` groups: block ids are read
    from the core's arrays, without fetching the block objects."""

    def get_block_ids(  # type: ignore[override]
        self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None:
        groups = self.blocks if group_ids is None else tuple(self.blocks[g] for g in group_ids)
        if allow_none and not any(map(len, groups)):
            return None
        return tuple(
            [b.block_id for b in g] if type(g) is not BlockRun else g.block_ids() for g in groups
        )


class PagedBlock(KVCacheBlock):
    """A vLLM block object whose reference count and hash are the core's."""

    __slots__ = ("_core", "_queue")

    def __init__(self, block_id: int, core: _core.KVCacheManager, is_null: bool = False) -> None:
        # vLLM's slots, minus the two the core answers (read below).
        for name, value in (
            ("block_id", block_id),
            ("pool", None),
            ("is_null", is_null),
            ("_core", core),
            ("_queue", None),
        ):
            setattr(self, name, value)

    @property  # type: ignore[override]
    def ref_cnt(self) -> int:
        """Requests (and deferred frees) holding the block."""
        return 0 if self.is_null else self._core.block_ref_count(self.block_id)

    @ref_cnt.setter
    def ref_cnt(self, value: int) -> None:
        """vLLM's managers take one more reference on a block in use by writing
        ``ref_cnt += 1`` (the destination of a pending copy): the engine's
        ``touch``, returned with the pool's ``free_blocks``. Nothing else is
        written through here."""
        current = self.ref_cnt
        if self.is_null or current == 0 or value != current + 1:
            raise AttributeError(
                f"block {self.block_id}: ref_cnt {current} -> {value}; only one more "
                "reference on a block in use is taken this way (the pool's touch and "
                "free_blocks change the rest)"
            )
        self._core.touch_blocks([self.block_id])

    @property
    def block_hash(self) -> bytes | None:
        """vLLM's ``BlockHashWithGroupId`` of the cached block, or None."""
        cached = self._core.cached_block_hash(self.block_id)
        if cached is None:
            return None
        digest, group = cached
        return make_block_hash_with_group_id(digest, group)  # type: ignore[arg-type]

    @property
    def block_hash_num_tokens(self) -> int | None:
        """Prefix tokens the cached block's hash covers, or None."""
        return self._core.cached_block_num_tokens(self.block_id)

    # vLLM's dataclass fields behind the two properties above (read by its
    # generated __eq__ and __repr__).
    _block_hash = block_hash
    _block_hash_num_tokens = block_hash_num_tokens

    @property  # type: ignore[override]
    def prev_free_block(self) -> Any:
        """The block before this one in the free queue (the queue's head
        sentinel for the first), or None when the block is not free."""
        return None if self._queue is None else self._queue.neighbor(self.block_id, 0)

    @property  # type: ignore[override]
    def next_free_block(self) -> Any:
        """The block after this one in the free queue (the queue's tail
        sentinel for the last), or None when the block is not free."""
        return None if self._queue is None else self._queue.neighbor(self.block_id, 1)

    def __repr__(self) -> str:
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


class _QueueEnd:
    """One of the free queue's sentinels (vLLM's fake head and tail)."""

    def __init__(self, queue: _FreeQueueView, head: bool) -> None:
        self._queue = queue
        self._head = head
        self.block_id = -1
        self.is_null = False

    @property
    def next_free_block(self) -> Any:
        return self._queue.end(0) if self._head else None

    @property
    def prev_free_block(self) -> Any:
        return None if self._head else self._queue.end(1)


class _FreeQueueView:
    """vLLM's ``free_block_queue``, read-only: the count, the order, and the
    links between free blocks (``fake_free_list_head`` / ``_tail``)."""

    def __init__(self, owner: KVCacheManager) -> None:
        self._owner = owner
        self.fake_free_list_head = _QueueEnd(self, head=True)
        self.fake_free_list_tail = _QueueEnd(self, head=False)

    def neighbor(self, block_id: int, side: int) -> Any:
        """The block before (0) or after (1) a free block, a sentinel at the ends."""
        links = self._owner._core.free_neighbors(block_id)
        if links is None:
            return None
        i = links[side]
        if i < 0:
            return self.fake_free_list_head if side == 0 else self.fake_free_list_tail
        return self._owner._blocks[i]

    def end(self, side: int) -> Any:
        """The first (0) or last (1) free block, or the other sentinel if none."""
        i = self._owner._core.free_neighbors(-1)[side]  # type: ignore[index]
        if i < 0:
            return self.fake_free_list_tail if side == 0 else self.fake_free_list_head
        return self._owner._blocks[i]

    @property
    def num_free_blocks(self) -> int:
        return self._owner._core.num_free_blocks

    @num_free_blocks.setter
    def num_free_blocks(self, value: int) -> None:
        """vLLM's tests write the count to make the pool look full (0) and
        give the blocks back (the queue's length): the core counts ``value``
        of its free blocks as free, withholding the rest, until set again."""
        self._owner._core.set_num_free_blocks(value)

    def get_all_free_blocks(self) -> list[PagedBlock]:
        blocks = self._owner._blocks
        return [blocks[i] for i in self._owner._core.free_block_ids().tolist()]


class _CachedBlocks:
    """vLLM's ``cached_block_hash_to_block``, read-only: the prefix map keyed
    by ``BlockHashWithGroupId`` (block hash + 4-byte big-endian group id)."""

    def __init__(self, owner: KVCacheManager) -> None:
        self._owner = owner

    def _ids(self, key: bytes) -> list[int]:
        digest, group = key[:-4], int.from_bytes(key[-4:], "big")
        ids: list[int] = self._owner._core.cached_blocks_for_hash(digest, group).tolist()
        return ids

    def get_one_block(self, key: bytes) -> PagedBlock | None:
        """The first block cached under the key, or None."""
        ids = self._ids(key)
        return self._owner._blocks[ids[0]] if ids else None

    def contain(self, key: bytes, block_id: int) -> bool:
        """Whether this block is cached under the key."""
        return block_id in self._ids(key)

    def __len__(self) -> int:
        return self._owner._core.num_cached_block_hashes

    @property
    def _cache(self) -> Mapping[bytes, KVCacheBlock | dict[int, KVCacheBlock]]:
        """vLLM's dict behind the map, read-only: each key's block, or a dict
        of its blocks by id when several are cached under it (vLLM also keeps
        a dict of one block once a shared key has lost the others)."""
        return _CacheEntries(self._owner)


class _CacheEntries(Mapping[bytes, "KVCacheBlock | dict[int, KVCacheBlock]"]):
    """The prefix map read whole, shaped as vLLM's ``BlockHashToBlockMap._cache``
    (keys in no particular order)."""

    def __init__(self, owner: KVCacheManager) -> None:
        self._owner = owner

    def _shape(self, ids: Sequence[int]) -> KVCacheBlock | dict[int, KVCacheBlock]:
        blocks = self._owner._blocks
        if len(ids) == 1:
            return blocks[ids[0]]
        return {i: blocks[i] for i in ids}

    def __getitem__(self, key: bytes) -> KVCacheBlock | dict[int, KVCacheBlock]:
        ids = _CachedBlocks(self._owner)._ids(key)
        if not ids:
            raise KeyError(key)
        return self._shape(ids)

    def __iter__(self) -> Iterator[bytes]:
        for digest, group, _ in self._owner._core.cached_block_hash_entries():
            yield make_block_hash_with_group_id(digest, group)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self._owner._core.num_cached_block_hashes

    def values(self) -> Any:
        return [self._shape(ids) for _, _, ids in self._owner._core.cached_block_hash_entries()]


class _ExtraHashes(Mapping[int, Set[bytes]]):
    """vLLM's ``cached_block_hashes_by_block``, read-only: by block id, the
    ``BlockHashWithGroupId`` keys a block is cached under beside its
    ``block_hash`` (partial prompt-tail entries). Blocks without any are
    absent."""

    def __init__(self, owner: KVCacheManager) -> None:
        self._owner = owner

    def _get(self, block_id: object) -> frozenset[bytes] | None:
        if type(block_id) is not int or not 0 <= block_id < len(self._owner._blocks):
            return None
        keys = self._owner._core.cached_block_extra_hashes(block_id)
        if not keys:
            return None
        return frozenset(make_block_hash_with_group_id(h, g) for h, g in keys)  # type: ignore[arg-type]

    def __getitem__(self, block_id: int) -> Set[bytes]:
        keys = self._get(block_id)
        if keys is None:
            raise KeyError(block_id)
        return keys

    def __contains__(self, block_id: object) -> bool:
        return self._get(block_id) is not None

    def __iter__(self) -> Iterator[int]:
        return iter(self._owner._core.blocks_with_extra_hashes().tolist())

    def __len__(self) -> int:
        return len(self._owner._core.blocks_with_extra_hashes())


class BlockPoolView:
    """The block pool as vLLM's scheduler and connectors use it."""

    def __init__(self, owner: KVCacheManager) -> None:
        self._owner = owner
        # Pins resident-page adoptions took for the touch vLLM's HiSparse
        # coordinator makes right after them (block id -> count).
        self._adoption_pins: dict[int, int] = {}
        self.blocks = owner._blocks
        self.free_block_queue = _FreeQueueView(owner)
        queue = self.free_block_queue
        for b in self.blocks:
            # Slots of vLLM's block and of the view's subclass.
            setattr(b, "pool", self)  # noqa: B010
            setattr(b, "_queue", queue)  # noqa: B010
        self.metrics_collector = owner.metrics_collector
        # Callbacks for blocks released with ``unpin_blocks``, by block id.
        self._reuse_watchers: dict[int, Any] = {}
        self.null_block = owner._blocks[0]
        self.num_gpu_blocks = len(owner._blocks)
        self.enable_caching = owner.enable_caching
        self.enable_kv_cache_events = owner.enable_kv_cache_events
        self.hash_block_size = owner.hash_block_size
        self.num_hash_lookahead_tokens = owner.num_hash_lookahead_tokens
        self.cached_block_hash_to_block = _CachedBlocks(owner)
        self.cached_block_hashes_by_block = _ExtraHashes(owner)
        self.kv_event_queue = _PendingEvents(owner)
        # What this pool's KV events report (a host tier's view says "CPU").
        self.medium = "GPU"

    def get_num_free_blocks(self) -> int:
        """Free blocks (cached ones included)."""
        return self._owner._core.num_free_blocks

    def get_usage(self) -> float:
        """The fraction of the pool in use."""
        return self._owner._core.usage

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Returns blocks the caller holds (``pop_blocks_for_free``,
        ``get_new_blocks``, ``touch``), first evicted first; a block of another
        pool (a host tier's) goes back to its own pool, as vLLM routes it."""
        core = self._owner._core
        if not self._owner._engine_groups:  # every block is this pool's
            core.free_blocks([b.block_id for b in ordered_blocks])
            return
        ids: list[int] = []
        others: dict[Any, list[KVCacheBlock]] = {}
        for b in ordered_blocks:
            pool = b.pool
            if pool is self or pool is None:
                ids.append(b.block_id)
            else:
                others.setdefault(pool, []).append(b)
        core.free_blocks(ids)
        for pool, blocks in others.items():
            pool.free_blocks(blocks)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """One more reference on each block for the caller (a free block leaves
        the free queue, keeping its cache entries); ``free_blocks`` or
        ``unpin_blocks`` returns it."""
        ids = [b.block_id for b in blocks]
        pins = self._adoption_pins
        if pins:  # a block a resident page adopted is pinned already
            ids = [i for i in ids if not _take_pin(pins, i)]
        self._owner._core.touch_blocks(ids)
        self._owner._observe_blocks()

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: Any) -> None:
        """Returns references whose blocks stay readable until the pool reuses
        them: a released block joins the tail of the free queue (taken last,
        cached or not), and ``on_reuse(block)`` runs once the pool hands it out
        again or the cache is reset."""
        blocks = list(blocks)
        if any(b.is_null for b in blocks):
            raise AssertionError("unpin_blocks: the null block holds no reference")
        self._owner._core.unpin_blocks([b.block_id for b in blocks])
        for b in blocks:
            self._reuse_watchers[b.block_id] = on_reuse
        self._owner._hook_allocations()

    def _fire_reused(self, reset: bool = False) -> None:
        """Runs the watchers of the unpinned blocks the pool reused since the
        last call: in the order it handed them out, and after a reset in the
        order they were unpinned (vLLM's order)."""
        watchers = self._reuse_watchers
        if not watchers:
            return
        ids = self._owner._core.take_reused_blocks().tolist()
        if not ids:
            return
        if reset:
            wiped = set(ids)
            ids = [i for i in watchers if i in wiped]
        for i in ids:
            watcher = watchers.pop(i, None)
            if watcher is not None:
                watcher(self.blocks[i])

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drops these blocks from the prefix cache."""
        self._owner.evict_blocks(block_ids)

    def get_new_blocks(self, num_blocks: int) -> list[PagedBlock]:
        """Takes blocks from the free queue for the caller's own use; they go
        back through ``free_blocks``."""
        ids = self._owner._core.get_new_blocks(num_blocks)
        if ids is None:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        self._owner._observe_blocks()
        self._fire_reused()
        return [self.blocks[i] for i in ids.tolist()]

    def cache_full_blocks(
        self,
        request: Any,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Caches blocks the caller took with ``get_new_blocks`` and filled with
        the request's tokens (``blocks[i]`` holds its block ``i``): blocks
        ``num_cached_blocks`` to ``num_full_blocks`` under the request's
        hashes (those ``block_mask`` keeps), with one ``BlockStored``. The
        blocks stay the caller's until ``free_blocks``."""
        owner = self._owner
        self._check_group(kv_cache_group_id, block_size)
        rid = owner._sync(request)
        owner._core.cache_detached_blocks(
            rid,
            kv_cache_group_id,
            [b.block_id for b in blocks],
            num_cached_blocks,
            num_full_blocks,
            None if block_mask is None else list(block_mask),
        )
        owner._observe_blocks()

    def cache_partial_block(
        self,
        request: Any,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> Any:
        """Makes a block the caller holds reachable from the request's prefix
        boundary of ``num_tokens`` tokens (a partial entry); returns its
        ``BlockHashWithGroupId``, None for the null block."""
        owner = self._owner
        self._check_group(kv_cache_group_id, block_size)
        key = owner._core.cache_detached_partial_block(
            owner._sync(request),
            kv_cache_group_id,
            block.block_id,
            num_tokens,
            replace_existing=replace_existing_hashes,
        )
        owner._observe_blocks()
        return None if key is None else make_block_hash_with_group_id(*key)  # type: ignore[arg-type]

    def _check_group(self, group: int, block_size: int) -> None:
        managers = self._owner.coordinator.single_type_managers
        if not 0 <= group < len(managers):
            raise ValueError(f"kv_cache_group_id {group} is out of range")
        if block_size != managers[group].block_size:
            raise ValueError(
                f"block_size {block_size} is not group {group}'s {managers[group].block_size}"
            )

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Iterable[int]
    ) -> list[PagedBlock] | None:
        """The first block cached under the hash in each group, or None when
        any group misses."""
        out = []
        for g in kv_cache_group_ids:
            ids = self._owner._core.cached_blocks_for_hash(block_hash, g)
            if len(ids) == 0:
                return None
            out.append(self.blocks[int(ids[0])])
        return out

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache when no block is in use."""
        return self._owner.reset_prefix_cache()

    def take_events(self) -> list[Any]:
        """The manager's events (vLLM's event objects)."""
        return self._owner.take_events()


class _LiveBlocks(_BlockList):
    """One request's blocks in one group, read from the core at each access (a
    list vLLM's managers keep and mutate in place, so a caller holding it sees
    later allocations). When the manager forgets the request, the list keeps
    the blocks it held then, as vLLM's popped list does."""

    def __init__(self, rows: _ReqToBlocks, request_id: str) -> None:
        self._rows = rows
        self._request_id = request_id
        self._frozen: list[KVCacheBlock] | None = None

    def _list(self) -> list[KVCacheBlock]:
        if self._frozen is not None:
            return self._frozen
        ids = self._rows._ids(self._request_id) or []
        blocks = self._rows._owner._blocks
        return [blocks[i] for i in ids]

    def _freeze(self) -> None:
        """Keeps the blocks held now (called before the request is forgotten)."""
        if self._frozen is None:
            self._frozen = self._list()

    def __eq__(self, other: object) -> bool:
        return self._list() == (list(other) if isinstance(other, Sequence) else other)


class _PendingEvents:
    """The pool's event queue as vLLM's components use it: its length (the
    events recorded and not yet taken) and ``append`` (another component's
    event, taken after the core's recorded before it)."""

    def __init__(self, owner: KVCacheManager) -> None:
        self._owner = owner

    def __len__(self) -> int:
        owner = self._owner
        return int(owner._core.num_pending_events) + len(owner._queued_events)

    def append(self, event: Any) -> None:
        self._owner._queue_event(event)


class _ReqToBlocks(Mapping[str, Sequence[PagedBlock]]):
    """``req_to_blocks`` of one group: request id -> its blocks (read-only, live)."""

    def __init__(self, owner: KVCacheManager, group: int) -> None:
        self._owner = owner
        self._group = group

    def __getitem__(self, request_id: str) -> Sequence[PagedBlock]:
        if self._ids(request_id) is None:
            raise KeyError(request_id)
        live = _LiveBlocks(self, request_id)
        self._owner._live_lists.setdefault(request_id, []).append(weakref.ref(live))
        return live

    def _ids(self, request_id: str) -> list[int] | None:
        """The request's block ids in this group; None unless it holds blocks
        (vLLM's entry appears with the first allocation)."""
        if request_id not in self._owner._live:
            return None
        ids: list[int] = self._owner._core.group_block_ids(request_id, self._group)
        return ids or None

    def __iter__(self) -> Iterator[str]:
        return iter([r for r in sorted(self._owner._live) if self._ids(r) is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _RowSnapshots(_ReqToBlocks):
    """``req_to_blocks`` of a HiSparse group: ``[]`` hands out a live list as
    for any group; ``get``, which vLLM's ``HiSparseCoordinator`` calls on every
    step for every request, a plain list of the row as it is now."""

    def get(self, request_id: str, default: Any = None) -> Any:
        ids = self._ids(request_id)
        if ids is None:
            return default
        rows = self._owner._blocks
        return [rows[i] for i in ids]

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and self._ids(request_id) is not None


class _NumCachedBlock(Mapping[str, int]):
    """``num_cached_block`` of one group: request id -> leading blocks cached."""

    def __init__(self, owner: KVCacheManager, group: int) -> None:
        self._owner = owner
        self._group = group

    def _get(self, request_id: str) -> int | None:
        if request_id not in self._owner._live:
            return None
        n: int | None = self._owner._core.num_cached_blocks(request_id)[self._group]
        return n

    def __getitem__(self, request_id: str) -> int:
        n = self._get(request_id)
        if n is None:
            raise KeyError(request_id)
        return n

    def __iter__(self) -> Iterator[str]:
        return iter([r for r in sorted(self._owner._live) if self._get(r) is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _Checkpoints(Mapping[str, tuple[int, int]]):
    """``_checkpoints`` of a Mamba group: request id -> ``(position, column)``
    of the prefill checkpoint its last allocation reserved."""

    def __init__(self, owner: KVCacheManager, group: int) -> None:
        self._owner = owner
        self._group = group

    def _get(self, request_id: str) -> tuple[int, int] | None:
        if request_id not in self._owner._live:
            return None
        return self._owner._core.mamba_checkpoint(request_id, self._group)

    def __getitem__(self, request_id: str) -> tuple[int, int]:
        c = self._get(request_id)
        if c is None:
            raise KeyError(request_id)
        return c

    def __iter__(self) -> Iterator[str]:
        return iter([r for r in sorted(self._owner._live) if self._get(r) is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _PartialHits(Mapping[str, tuple[int, PagedBlock]]):
    """``_partial_hit_reqs`` of one group: request id -> ``(index, block)`` of a
    hit ending inside that block, copied on write at the next allocation."""

    def __init__(self, owner: KVCacheManager, group: int) -> None:
        self._owner = owner
        self._group = group

    def _get(self, request_id: str) -> tuple[int, PagedBlock] | None:
        if request_id not in self._owner._live:
            return None
        hit = self._owner._core.partial_hit(request_id, self._group)
        return None if hit is None else (hit[0], self._owner._blocks[hit[1]])

    def __getitem__(self, request_id: str) -> tuple[int, PagedBlock]:
        h = self._get(request_id)
        if h is None:
            raise KeyError(request_id)
        return h

    def __iter__(self) -> Iterator[str]:
        return iter([r for r in sorted(self._owner._live) if self._get(r) is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class SingleTypeManagerView:
    """One KV-cache group's manager, as the scheduler reads it."""

    # Class attributes: they stand in front of vLLM's properties of the same
    # names on the view classes that also derive from vLLM's manager classes.
    retains_longer_hit = False

    def __init__(
        self, owner: KVCacheManager, group: int, spec: KVCacheSpec, block_size: int
    ) -> None:
        self.kv_cache_group_id = group
        self.kv_cache_spec = spec
        self.block_size = block_size
        self.dcp_world_size = block_size // spec.block_size
        self.block_pool = owner.block_pool
        self.enable_caching = owner.enable_caching
        self.req_to_blocks = _ReqToBlocks(owner, group)
        self.num_cached_block = _NumCachedBlock(owner, group)
        self._null_block = owner._blocks[0]
        core = owner._core
        self._core = core
        self.cache_hit_alignment_tokens = (
            owner.hash_block_size if core.partial_hash_hits else owner.scheduler_block_size
        )
        self._partial_hit_reqs = _PartialHits(owner, group)
        # Copies another component queues on the group, ``(source, copy)``
        # blocks it holds (vLLM's list, drained with the core's own copies).
        self._pending_cow_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        if isinstance(spec, MambaSpec):
            self.mamba_cache_mode = spec.mamba_cache_mode
            self.num_speculative_blocks = spec.num_speculative_blocks
            self._checkpoints = _Checkpoints(owner, group)
            self.drop_eagle_checkpoint_block = owner.use_eagle
            self.shared_prefix_checkpoint = core.mamba_shared_prefix_checkpoint

    @property
    def records_new_block_ids(self) -> bool:
        """Whether the worker zeroes this group's fresh blocks."""
        return self._core.records_new_block_ids[self.kv_cache_group_id]

    def take_new_block_ids(self) -> list[int]:
        return self._core.take_new_block_ids(self.kv_cache_group_id)

    def take_pending_cow_copies(self) -> list[Any]:
        """The copies queued on ``_pending_cow_copies`` since the last call (the
        core's own come from ``take_kv_cache_block_copies``)."""
        pending, self._pending_cow_copies = self._pending_cow_copies, []
        return pending

    def take_pending_boundary_state_offloads(self) -> list[Any]:
        return []

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> None:
        return None


class _HiSparseView(SingleTypeManagerView):
    """A HiSparse group in the core, as vLLM's ``HiSparseCoordinator`` (bound
    on ``coordinator``) reads it: ``req_to_blocks.get`` hands out plain lists."""

    coordinator: Any = None

    def __init__(
        self, owner: KVCacheManager, group: int, spec: KVCacheSpec, block_size: int
    ) -> None:
        super().__init__(owner, group, spec, block_size)
        self._owner = owner
        self.req_to_blocks = _RowSnapshots(owner, group)


class ResidentManagerView(_HiSparseView):
    """HiSparse's resident group in the core (vLLM's
    ``HiSparseResidentManager``): the rows, their residency overlay and their
    engine-held pages live in the core; vLLM's ``HiSparseCoordinator`` reads
    and writes them through these calls."""

    def __init__(
        self, owner: KVCacheManager, group: int, spec: KVCacheSpec, block_size: int
    ) -> None:
        super().__init__(owner, group, spec, block_size)
        self._rows = owner._blocks
        self.max_admission_blocks_per_request = spec.max_admission_blocks_per_request(  # type: ignore[attr-defined]
            max_in_flight_tokens=owner.max_in_flight_tokens or owner.max_model_len,
            max_model_len=owner.max_model_len,
        )

    def adopt_resident_page(self, request_id: str, block_idx: int, block: KVCacheBlock) -> bool:
        """Points a host-only page at a device copy of its contents. vLLM's
        coordinator pins the block right after (``block_pool.touch``); the
        core pins it in the adoption itself, so no page ever reads a block
        nobody pins, and that touch is this pin (see ``BlockPoolView.touch``)."""
        if request_id not in self._owner._live:
            return False
        adopted = bool(
            self._core.hisparse_adopt_page(
                request_id, self.kv_cache_group_id, block_idx, block.block_id, pin=True
            )
        )
        if adopted:
            pins = self._owner.block_pool._adoption_pins
            pins[block.block_id] = pins.get(block.block_id, 0) + 1
        return adopted

    def drop_resident_page(self, request_id: str, block_idx: int) -> KVCacheBlock | None:
        """The page is read from the host from now on; the block it was read from."""
        if request_id not in self._owner._live:
            return None
        b = self._core.hisparse_drop_page(request_id, self.kv_cache_group_id, block_idx)
        return None if b is None else self._rows[b]

    def get_resident_page(self, request_id: str, block_idx: int) -> KVCacheBlock | None:
        """The device block the page is read from; None when read from the host."""
        if request_id not in self._owner._live:
            return None
        b = self._core.hisparse_resident_page(request_id, self.kv_cache_group_id, block_idx)
        return None if b is None else self._rows[b]

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """Pages up to ``num_tokens`` tokens (this group alone)."""
        return _group_allocate(self, request_id, num_tokens)

    def get_residency_row(self, request_id: str, start: int = 0) -> list[KVCacheBlock]:
        """The row from ``start`` with the overlay applied (host-only pages null)."""
        if request_id not in self._owner._live:
            return []
        rows = self._rows
        ids = self._core.hisparse_residency_row(request_id, self.kv_cache_group_id, start)
        return [rows[i] for i in ids.tolist()]


def _group_allocate(view: Any, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
    """One HiSparse group's ``allocate_new_blocks``, outside a whole allocation
    (vLLM's tests call it on the group's manager)."""
    owner = view._owner
    ids = owner._core.hisparse_allocate_new_blocks(request_id, view.kv_cache_group_id, num_tokens)
    owner._observe_blocks()
    owner.block_pool._fire_reused()
    rows = owner._blocks
    return [rows[i] for i in ids.tolist()]


class _HotRequired(Set[str]):
    """``hot_required`` of a hot group: the requests that need their hot region
    (read-only, live; ``require_hot`` adds one)."""

    def __init__(self, owner: KVCacheManager, group: int) -> None:
        self._owner = owner
        self._group = group

    def __contains__(self, request_id: object) -> bool:
        owner = self._owner
        return request_id in owner._live and bool(
            owner._core.hisparse_hot_required(request_id, self._group)
        )

    def __iter__(self) -> Iterator[str]:
        return iter([r for r in sorted(self._owner._live) if r in self])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class HotManagerView(_HiSparseView):
    """HiSparse's hot group in the core (vLLM's ``HiSparseHotManager``)."""

    def __init__(
        self, owner: KVCacheManager, group: int, spec: KVCacheSpec, block_size: int
    ) -> None:
        super().__init__(owner, group, spec, block_size)
        self.blocks_per_request: int = spec.blocks_per_request  # type: ignore[attr-defined]
        self.hot_required = _HotRequired(owner, group)

    def require_hot(self, request_id: str) -> None:
        """The request takes its hot region at its next allocation."""
        owner = self._owner
        if request_id not in owner._live:
            raise KeyError(f"request {request_id!r} is not known to the KV-cache manager")
        owner._core.hisparse_require_hot(request_id, self.kv_cache_group_id)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """The hot region, once required (this group alone)."""
        return _group_allocate(self, request_id, num_tokens)

    def has_hot(self, request_id: str) -> bool:
        return len(self.req_to_blocks.get(request_id, ())) == self.blocks_per_request

    def get_num_required_blocks(self, request_id: str) -> int:
        return max(self.blocks_per_request - len(self.req_to_blocks.get(request_id, ())), 0)


_VIEW_CLASSES: dict[type, type[SingleTypeManagerView]] = {}


def _vllm_manager_class(group: Any) -> type | None:
    """The single-type manager class vLLM would build for a group."""
    cls: type | None = KVCacheSpecRegistry.get_manager_class(
        group.kv_cache_spec, getattr(group, "role", None)
    )
    return cls


def _view_class(group: Any) -> type[SingleTypeManagerView]:
    """The view's class for a group: also an instance of the single-type
    manager class vLLM would build for it (``isinstance`` checks on
    ``single_type_managers`` see the kind), with the view's state and methods
    first in line. vLLM's own ``__init__`` never runs."""
    vllm_cls = _vllm_manager_class(group)
    if vllm_cls is None:
        return SingleTypeManagerView
    cls = _VIEW_CLASSES.get(vllm_cls)
    if cls is None:
        spec = group.kv_cache_spec
        view: type[SingleTypeManagerView] = (
            ResidentManagerView
            if isinstance(spec, HiSparseResidentSpec)
            else HotManagerView
            if isinstance(spec, HiSparseHotSpec)
            else SingleTypeManagerView
        )
        cls = _named_after(vllm_cls, view)
        _VIEW_CLASSES[vllm_cls] = cls
    return cls


class CoordinatorView:
    """The coordinator, as the scheduler reads it."""

    def __init__(self, owner: KVCacheManager) -> None:
        self._owner = owner
        self.block_pool = owner.block_pool
        self.enable_caching = owner.enable_caching
        self.single_type_managers = tuple(
            _view_class(group)(owner, g, group.kv_cache_spec, owner._group_block_sizes[g])
            for g, group in enumerate(owner.kv_cache_config.kv_cache_groups)
        )
        self.num_single_type_manager = len(self.single_type_managers)
        self.enable_partial_hash_hits: bool = owner._core.partial_hash_hits
        flagged = {
            i
            for i, g in enumerate(owner.kv_cache_config.kv_cache_groups)
            if getattr(g, "is_eagle_group", False)
        }
        self.eagle_group_ids = flagged or (
            set(range(len(self.single_type_managers))) if owner.use_eagle else set()
        )
        self.num_reprefillable_tokens = max(0, owner.num_prefill_lookahead - 1)
        self.use_eagle = owner.use_eagle
        self.max_model_len = owner.max_model_len
        self.scheduler_block_size = owner.scheduler_block_size
        self.hash_block_size = owner.hash_block_size
        self.num_hash_lookahead_tokens = owner.num_hash_lookahead_tokens

    @property
    def full_attention_group_id(self) -> int | None:
        """The first full-attention group looked up (a hybrid coordinator's)."""
        group: int | None = self._owner._core.full_attention_group
        return group

    def find_longest_cache_hit_per_group(
        self, block_hashes: Sequence[Any], max_cache_hit_length: int
    ) -> tuple[tuple[list[PagedBlock], ...], tuple[int, ...]]:
        """Each lookup group's own hit, unreconciled: blocks and tokens per group."""
        owner = self._owner
        found = owner._core.find_longest_cache_hit_per_group(block_hashes, max_cache_hit_length)
        if found is None:
            raise AttributeError("per-group hits: only a hybrid coordinator has them")
        groups, hits = found
        blocks = owner._blocks
        out_blocks = [[blocks[i] for i in g.tolist()] for g in groups]
        out_hits = list(hits)
        for g, manager in owner._engine_lookup:
            out_blocks[g], out_hits[g] = engine_group_hit(
                owner, g, manager, block_hashes, max_cache_hit_length
            )
        return tuple(out_blocks), tuple(out_hits)

    @property
    def attention_groups(self) -> list[SpecGroup]:
        """The groups whose hits are looked up together, in lookup order (vLLM's
        hybrid coordinator's attribute; a single group or caching off has none)."""
        lookup = self._owner._core.lookup_groups
        if lookup is None:
            raise AttributeError("attention_groups: only a hybrid coordinator has them")
        owner = self._owner
        groups = owner.kv_cache_config.kv_cache_groups
        # The engine-managed groups looked up (a host source) come first, as
        # vLLM orders full-attention groups by group id.
        engine = [
            SpecGroup(m.kv_cache_spec, [g], type(m), g in owner._drop_eagle)
            for g, m in owner._engine_lookup
        ]
        return engine + [
            SpecGroup(
                groups[ids[0]].kv_cache_spec,
                list(ids),
                _vllm_manager_class(groups[ids[0]]) or SingleTypeManagerView,
                eagle,
            )
            for ids, eagle in lookup
        ]

    @property
    def _cache_hit_alignment_tokens(self) -> int:
        """Tokens every hit aligns to: the hash block with partial hits."""
        owner = self._owner
        return (
            owner.hash_block_size if self.enable_partial_hash_hits else owner.scheduler_block_size
        )

    @property
    def retention_interval(self) -> int | None:
        """Sparse retention of sliding-window and Mamba states (settable)."""
        interval: int | None = self._owner._core.prefix_cache_retention_interval
        return interval

    @retention_interval.setter
    def retention_interval(self, interval: int | None) -> None:
        self._owner._core.prefix_cache_retention_interval = interval

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Any,
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int | None = None,
        num_tokens_main_model: int | None = None,
        apply_admission_cap: bool = False,
        prefill_end: int | None = None,
    ) -> int:
        """Blocks a request without a new hit in the core's groups needs for
        ``num_tokens`` tokens, with what the engine-managed groups need."""
        owner = self._owner
        engine = owner._engine_groups
        if any(b for g, b in enumerate(new_computed_blocks) if g not in owner._engine_ids):
            raise NotImplementedError(
                "get_num_blocks_to_allocate with new computed blocks: use allocate_slots"
            )
        main = num_tokens if num_tokens_main_model is None else num_tokens_main_model
        local = (
            total_computed_tokens
            if num_local_computed_tokens is None
            else num_local_computed_tokens
        )
        n: int = owner._core.num_blocks_to_allocate(
            request_id if request_id in owner._live else None,
            num_tokens,
            total_computed_tokens=total_computed_tokens,
            num_tokens_main_model=main,
            num_encoder_tokens=num_encoder_tokens,
            apply_admission_cap=apply_admission_cap,
            num_local_computed_tokens=local,
        )
        n += engine_groups_need(
            engine,
            request_id,
            num_tokens,
            new_computed_blocks,
            total_computed_tokens,
            local,
            main,
            apply_admission_cap,
            prefill_end or 0,
        )
        return n

    def get_blocks(self, request_id: str) -> tuple[list[PagedBlock], ...]:
        return self._owner.get_blocks(request_id).blocks  # type: ignore[return-value]


_COORDINATOR_VIEWS: dict[type, type[CoordinatorView]] = {}


def engine_groups_need(
    engine: Sequence[tuple[int, Any]],
    request_id: str,
    num_tokens: int,
    hit_groups: Sequence[Sequence[Any]],
    total_computed_tokens: int,
    num_local_computed_tokens: int,
    num_tokens_main_model: int,
    apply_admission_cap: bool,
    prefill_end: int,
) -> int:
    """The blocks the engine-managed groups' own managers say they need (vLLM's
    coordinator adds every group's ``get_num_blocks_to_allocate``)."""
    return sum(
        manager.get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            hit_groups[g],
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap=apply_admission_cap,
            prefill_end=prefill_end,
        )
        for g, manager in engine
    )


def engine_group_hit(
    owner: KVCacheManager, group: int, manager: Any, block_hashes: Any, max_length: int
) -> tuple[list[Any], int]:
    """An engine-managed group's own hit (vLLM's manager searching its pool)."""
    blocks, n = type(manager).find_longest_cache_hit(
        block_hashes=block_hashes,
        max_length=max_length,
        kv_cache_group_ids=[group],
        block_pool=manager.block_pool,
        kv_cache_spec=manager.kv_cache_spec,
        drop_eagle_block=group in owner._drop_eagle,
        alignment_tokens=manager.cache_hit_alignment_tokens,
        dcp_world_size=manager.dcp_world_size,
        pcp_world_size=manager.pcp_world_size,
    )
    return blocks[0], n


def _named_after(vllm_cls: type, view: type) -> Any:
    """A view class that is also ``vllm_cls`` (the view's state and methods
    first in line), under ``vllm_cls``'s name in this module."""
    name = vllm_cls.__name__
    return type(name, (view, vllm_cls), {"__qualname__": name, "__module__": __name__})


def coordinator_view(owner: KVCacheManager) -> CoordinatorView:
    """The coordinator view, also an instance of the coordinator class vLLM
    would build (no prefix cache, one group, or hybrid), so ``isinstance``
    checks on ``manager.coordinator`` see the kind (under that class's name,
    in pagedkv's module). vLLM's own ``__init__`` never runs."""
    if not owner.enable_caching:
        vllm_cls: type = KVCacheCoordinatorNoPrefixCache
    elif owner._core.lookup_groups is None:
        vllm_cls = UnitaryKVCacheCoordinator
    else:
        vllm_cls = HybridKVCacheCoordinator
    cls = _COORDINATOR_VIEWS.get(vllm_cls)
    if cls is None:
        cls = _named_after(vllm_cls, CoordinatorView)
        _COORDINATOR_VIEWS[vllm_cls] = cls
    return cls(owner)


def _take_pin(pins: dict[int, int], block_id: int) -> bool:
    """Takes one of the pins resident-page adoptions made on ``block_id``."""
    n = pins.get(block_id, 0)
    if n == 0:
        return False
    if n == 1:
        del pins[block_id]
    else:
        pins[block_id] = n - 1
    return True
