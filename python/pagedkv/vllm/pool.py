"""The block pool views: vLLM's ``BlockPool`` as its scheduler, managers and
connectors use it (free queue, prefix map, event queue, engine references),
over a manager's handle."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id

if TYPE_CHECKING:
    from pagedkv.vllm.blocks import PagedBlock
    from pagedkv.vllm.handle import ManagerHandle


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

    def __init__(self, handle: ManagerHandle) -> None:
        self._handle = handle
        self.fake_free_list_head = _QueueEnd(self, head=True)
        self.fake_free_list_tail = _QueueEnd(self, head=False)

    def neighbor(self, block_id: int, side: int) -> Any:
        """The block before (0) or after (1) a free block, a sentinel at the ends."""
        links = self._handle.core.free_neighbors(block_id)
        if links is None:
            return None
        i = links[side]
        if i < 0:
            return self.fake_free_list_head if side == 0 else self.fake_free_list_tail
        return self._handle.blocks[i]

    def end(self, side: int) -> Any:
        """The first (0) or last (1) free block, or the other sentinel if none."""
        i = self._handle.core.free_neighbors(-1)[side]  # type: ignore[index]
        if i < 0:
            return self.fake_free_list_tail if side == 0 else self.fake_free_list_head
        return self._handle.blocks[i]

    @property
    def num_free_blocks(self) -> int:
        return self._handle.core.num_free_blocks

    @num_free_blocks.setter
    def num_free_blocks(self, value: int) -> None:
        """vLLM's tests write the count to make the pool look full (0) and
        give the blocks back (the queue's length): the core counts ``value``
        of its free blocks as free, withholding the rest, until set again."""
        self._handle.core.set_num_free_blocks(value)

    def get_all_free_blocks(self) -> list[PagedBlock]:
        blocks = self._handle.blocks
        return [blocks[i] for i in self._handle.core.free_block_ids().tolist()]


class _CachedBlocks:
    """vLLM's ``cached_block_hash_to_block``, read-only: the prefix map keyed
    by ``BlockHashWithGroupId`` (block hash + 4-byte big-endian group id)."""

    def __init__(self, handle: ManagerHandle) -> None:
        self._handle = handle

    def _ids(self, key: bytes) -> list[int]:
        digest, group = key[:-4], int.from_bytes(key[-4:], "big")
        ids: list[int] = self._handle.core.cached_blocks_for_hash(digest, group).tolist()
        return ids

    def get_one_block(self, key: bytes) -> PagedBlock | None:
        """The first block cached under the key, or None."""
        ids = self._ids(key)
        return self._handle.blocks[ids[0]] if ids else None

    def contain(self, key: bytes, block_id: int) -> bool:
        """Whether this block is cached under the key."""
        return block_id in self._ids(key)

    def __len__(self) -> int:
        return self._handle.core.num_cached_block_hashes

    @property
    def _cache(self) -> Mapping[bytes, KVCacheBlock | dict[int, KVCacheBlock]]:
        """vLLM's dict behind the map, read-only: each key's block, or a dict
        of its blocks by id when several are cached under it (vLLM also keeps
        a dict of one block once a shared key has lost the others)."""
        return _CacheEntries(self._handle)


class _CacheEntries(Mapping[bytes, "KVCacheBlock | dict[int, KVCacheBlock]"]):
    """The prefix map read whole, shaped as vLLM's ``BlockHashToBlockMap._cache``
    (keys in no particular order)."""

    def __init__(self, handle: ManagerHandle) -> None:
        self._handle = handle

    def _shape(self, ids: Sequence[int]) -> KVCacheBlock | dict[int, KVCacheBlock]:
        blocks = self._handle.blocks
        if len(ids) == 1:
            return blocks[ids[0]]
        return {i: blocks[i] for i in ids}

    def __getitem__(self, key: bytes) -> KVCacheBlock | dict[int, KVCacheBlock]:
        ids = _CachedBlocks(self._handle)._ids(key)
        if not ids:
            raise KeyError(key)
        return self._shape(ids)

    def __iter__(self) -> Iterator[bytes]:
        for digest, group, _ in self._handle.core.cached_block_hash_entries():
            yield make_block_hash_with_group_id(digest, group)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self._handle.core.num_cached_block_hashes

    def values(self) -> Any:
        return [self._shape(ids) for _, _, ids in self._handle.core.cached_block_hash_entries()]


class _ExtraHashes(Mapping[int, Set[bytes]]):
    """vLLM's ``cached_block_hashes_by_block``, read-only: by block id, the
    ``BlockHashWithGroupId`` keys a block is cached under beside its
    ``block_hash`` (partial prompt-tail entries). Blocks without any are
    absent."""

    def __init__(self, handle: ManagerHandle) -> None:
        self._handle = handle

    def _get(self, block_id: object) -> frozenset[bytes] | None:
        if type(block_id) is not int or not 0 <= block_id < len(self._handle.blocks):
            return None
        keys = self._handle.core.cached_block_extra_hashes(block_id)
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
        return iter(self._handle.core.blocks_with_extra_hashes().tolist())

    def __len__(self) -> int:
        return len(self._handle.core.blocks_with_extra_hashes())


class BlockPoolView:
    """The block pool as vLLM's scheduler and connectors use it."""

    def __init__(self, handle: ManagerHandle) -> None:
        self._handle = handle
        owner = handle.owner
        self.blocks = handle.blocks
        self.free_block_queue = _FreeQueueView(handle)
        queue = self.free_block_queue
        for b in self.blocks:
            # Slots of vLLM's block and of the view's subclass.
            setattr(b, "pool", self)  # noqa: B010
            setattr(b, "_queue", queue)  # noqa: B010
        self.metrics_collector = owner.metrics_collector
        # Callbacks for blocks released with ``unpin_blocks``, by block id.
        self._reuse_watchers: dict[int, Any] = {}
        self.null_block = handle.blocks[0]
        self.num_gpu_blocks = len(handle.blocks)
        self.enable_caching = owner.enable_caching
        self.enable_kv_cache_events = owner.enable_kv_cache_events
        self.hash_block_size = owner.hash_block_size
        self.num_hash_lookahead_tokens = owner.num_hash_lookahead_tokens
        self.cached_block_hash_to_block = _CachedBlocks(handle)
        self.cached_block_hashes_by_block = _ExtraHashes(handle)
        self.kv_event_queue = _PendingEvents(handle)
        # What this pool's KV events report (a host tier's view says "CPU").
        self.medium = "GPU"

    def get_num_free_blocks(self) -> int:
        """Free blocks (cached ones included)."""
        return self._handle.core.num_free_blocks

    def get_usage(self) -> float:
        """The fraction of the pool in use."""
        return self._handle.core.usage

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Returns blocks the caller holds (``pop_blocks_for_free``,
        ``get_new_blocks``, ``touch``), first evicted first; a block of another
        pool (a host tier's) goes back to its own pool, as vLLM routes it."""
        core = self._handle.core
        if not self._handle.engine.groups:  # every block is this pool's
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
        pins = self._handle.adoption_pins
        if pins:  # a block a resident page adopted is pinned already
            ids = [i for i in ids if not _take_pin(pins, i)]
        self._handle.core.touch_blocks(ids)
        self._handle.observe_blocks()

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: Any) -> None:
        """Returns references whose blocks stay readable until the pool reuses
        them: a released block joins the tail of the free queue (taken last,
        cached or not), and ``on_reuse(block)`` runs once the pool hands it out
        again or the cache is reset."""
        blocks = list(blocks)
        if any(b.is_null for b in blocks):
            raise AssertionError("unpin_blocks: the null block holds no reference")
        self._handle.core.unpin_blocks([b.block_id for b in blocks])
        for b in blocks:
            self._reuse_watchers[b.block_id] = on_reuse
        self._handle.hook_allocations()

    def fire_reused(self, reset: bool = False) -> None:
        """Runs the watchers of the unpinned blocks the pool reused since the
        last call: in the order it handed them out, and after a reset in the
        order they were unpinned (vLLM's order)."""
        watchers = self._reuse_watchers
        if not watchers:
            return
        ids = self._handle.core.take_reused_blocks().tolist()
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
        self._handle.owner.evict_blocks(block_ids)

    def get_new_blocks(self, num_blocks: int) -> list[PagedBlock]:
        """Takes blocks from the free queue for the caller's own use; they go
        back through ``free_blocks``."""
        ids = self._handle.core.get_new_blocks(num_blocks)
        if ids is None:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        self._handle.observe_blocks()
        self.fire_reused()
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
        handle = self._handle
        self._check_group(kv_cache_group_id, block_size)
        rid = handle.sync(request)
        handle.core.cache_detached_blocks(
            rid,
            kv_cache_group_id,
            [b.block_id for b in blocks],
            num_cached_blocks,
            num_full_blocks,
            None if block_mask is None else list(block_mask),
        )
        handle.observe_blocks()

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
        handle = self._handle
        self._check_group(kv_cache_group_id, block_size)
        key = handle.core.cache_detached_partial_block(
            handle.sync(request),
            kv_cache_group_id,
            block.block_id,
            num_tokens,
            replace_existing=replace_existing_hashes,
        )
        handle.observe_blocks()
        return None if key is None else make_block_hash_with_group_id(*key)  # type: ignore[arg-type]

    def _insert_block_hash(
        self, block_hash_with_group_id: bytes, block: KVCacheBlock, num_tokens: int | None
    ) -> None:
        """Caches a block the caller took with ``get_new_blocks`` and filled
        under the key: its primary key (ending ``num_tokens`` tokens, when
        known), or an extra one beside its primary. No event (the caller
        appends its own to ``kv_event_queue``)."""
        key = block_hash_with_group_id
        self._handle.core.insert_detached_block_hash(
            block.block_id, key[:-4], int.from_bytes(key[-4:], "big"), num_tokens
        )

    def _check_group(self, group: int, block_size: int) -> None:
        managers = self._handle.owner.coordinator.single_type_managers
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
            ids = self._handle.core.cached_blocks_for_hash(block_hash, g)
            if len(ids) == 0:
                return None
            out.append(self.blocks[int(ids[0])])
        return out

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache when no block is in use."""
        return self._handle.owner.reset_prefix_cache()

    def take_events(self) -> list[Any]:
        """The manager's events (vLLM's event objects)."""
        return self._handle.owner.take_events()


class _PendingEvents:
    """The pool's event queue as vLLM's components use it: its length (the
    events recorded and not yet taken) and ``append`` (another component's
    event, taken after the core's recorded before it)."""

    def __init__(self, handle: ManagerHandle) -> None:
        self._handle = handle

    def __len__(self) -> int:
        handle = self._handle
        return int(handle.core.num_pending_events) + handle.num_queued_events()

    def append(self, event: Any) -> None:
        self._handle.queue_event(event)


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
