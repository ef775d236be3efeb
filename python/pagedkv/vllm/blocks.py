"""vLLM's block objects over a core: one ``PagedBlock`` per block id (its
reference count and hash read from the core), and the lazily read block lists
(``BlockRun``) and ``KVCacheBlocks`` of lookups and allocations."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id

if TYPE_CHECKING:
    from pagedkv import _core


class BlockList(Sequence[KVCacheBlock]):
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


class BlockRun(BlockList):
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
