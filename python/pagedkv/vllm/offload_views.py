"""Read-only views of pagedkv's host tier shaped as vLLM's CPU policy objects.

vLLM's ``CPUOffloadingManager`` exposes its policy (``_policy``: an
``LRUCachePolicy`` or ``ARCCachePolicy``) and admission tracker (``counts``);
tools and tests read them. These views answer the same reads from the core,
live: ARC's ``t1`` / ``t2`` / ``b1`` / ``b2`` as ordered dicts (least recent
first) of chunk views, ``target_t1_size`` (settable), ``cache_capacity``;
LRU's resident ``chunks``; ``get(key)``. The policy's changing calls belong to
the manager and raise here, but ``evict``, which evicts through the tier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

from pagedkv._core import OffloadTier

__all__ = ["ARCPolicyView", "ChunkView", "LRUPolicyView", "TrackerView", "policy_view"]


class ChunkView:
    """One chunk as vLLM's ``ChunkStatus`` reads, live: ``ref_cnt`` (-1 while
    its store is in flight), ``chunk_id``, ``is_ready``; once the chunk has left
    the tier, the values it last had."""

    __slots__ = ("_chunk_id", "_key", "_ref_cnt", "_tier")

    def __init__(self, tier: OffloadTier, key: bytes, ref_cnt: int, chunk_id: int) -> None:
        self._tier = tier
        self._key = key
        self._ref_cnt = ref_cnt
        self._chunk_id = chunk_id

    def _read(self) -> None:
        now = self._tier.chunk(self._key)
        if now is not None and now[1] == self._chunk_id:
            self._ref_cnt = now[0]

    @property
    def ref_cnt(self) -> int:
        self._read()
        return self._ref_cnt

    @property
    def chunk_id(self) -> int:
        return self._chunk_id

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ChunkView):
            return NotImplemented
        return (self.ref_cnt, self.chunk_id) == (other.ref_cnt, other.chunk_id)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ChunkView(ref_cnt={self.ref_cnt}, chunk_id={self.chunk_id})"


def _chunks(
    tier: OffloadTier, entries: Iterable[tuple[bytes, int, int]]
) -> OrderedDict[OffloadKey, ChunkView]:
    return OrderedDict((OffloadKey(k), ChunkView(tier, k, r, s)) for k, r, s in entries)


def _read_only(what: str) -> NoReturn:
    raise TypeError(
        f"{what}: pagedkv's policy view is read-only; the manager's calls change the tier"
    )


class _PolicyCalls:
    """The changing calls of vLLM's ``CachePolicy``, refused on a view."""

    _tier: OffloadTier

    def get(self, key: OffloadKey) -> ChunkView | None:
        chunk = self._tier.chunk(key)
        return None if chunk is None else ChunkView(self._tier, key, *chunk)

    def insert(self, key: OffloadKey, chunk: Any, req_context: ReqContext) -> None:
        _read_only("insert")

    def remove(self, key: OffloadKey) -> None:
        _read_only("remove")

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        _read_only("touch")

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkView]] | None:
        """Evicts ``n`` idle chunks outside ``protected`` through the tier (their
        slots freed, their removal announced), all or none."""
        out = self._tier.evict(n, list(protected))
        if out is None:
            return None
        return [(OffloadKey(k), ChunkView(self._tier, k, r, s)) for k, r, s in out]

    def clear(self) -> None:
        _read_only("clear")

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        _read_only("on_request_finished")


class ARCPolicyView(_PolicyCalls, ARCCachePolicy):
    """ARC's lists and target, read from the tier."""

    def __init__(self, tier: OffloadTier) -> None:  # no super(): state lives in the core
        self._tier = tier

    def _lists(self) -> Any:
        lists = self._tier.arc_lists()
        assert lists is not None, "an ARC view over an LRU tier"
        return lists

    @property  # type: ignore[override]
    def cache_capacity(self) -> int:
        return self._tier.num_chunks

    @property  # type: ignore[override]
    def target_t1_size(self) -> float:
        return float(self._lists()[0])

    @target_t1_size.setter
    def target_t1_size(self, value: float) -> None:
        self._tier.set_arc_target_t1_size(float(value))

    @property  # type: ignore[override]
    def t1(self) -> OrderedDict[OffloadKey, ChunkView]:
        return _chunks(self._tier, self._lists()[1])

    @property  # type: ignore[override]
    def t2(self) -> OrderedDict[OffloadKey, ChunkView]:
        return _chunks(self._tier, self._lists()[2])

    @property  # type: ignore[override]
    def b1(self) -> OrderedDict[OffloadKey, None]:
        return OrderedDict((OffloadKey(k), None) for k in self._lists()[3])

    @property  # type: ignore[override]
    def b2(self) -> OrderedDict[OffloadKey, None]:
        return OrderedDict((OffloadKey(k), None) for k in self._lists()[4])


class LRUPolicyView(_PolicyCalls, LRUCachePolicy):
    """LRU's resident chunks and eviction order, read from the tier."""

    def __init__(self, tier: OffloadTier) -> None:  # no super(): state lives in the core
        self._tier = tier

    @property  # type: ignore[override]
    def cache_capacity(self) -> int:
        return self._tier.num_chunks

    @property  # type: ignore[override]
    def chunks(self) -> dict[OffloadKey, ChunkView]:
        return dict(_chunks(self._tier, self._tier.resident()))

    @property  # type: ignore[override]
    def _heap(self) -> list[tuple[tuple[int, int], OffloadKey]]:
        """The core's eviction heap as it lies (stale entries included)."""
        return [(rank, OffloadKey(k)) for rank, k in self._tier.lru_heap() or []]

    def eviction_order(self) -> list[OffloadKey]:
        """The idle chunks, first to be evicted first."""
        return [OffloadKey(k) for k in self._tier.lru_eviction_order() or []]


def policy_view(tier: OffloadTier) -> ARCPolicyView | LRUPolicyView:
    """The view matching the tier's policy."""
    return ARCPolicyView(tier) if tier.policy == "arc" else LRUPolicyView(tier)


class TrackerView(Mapping[OffloadKey, int]):
    """The admission filter's offer counts (vLLM's ``counts``), least recently
    offered first."""

    __slots__ = ("_tier",)

    def __init__(self, tier: OffloadTier) -> None:
        self._tier = tier

    def _items(self) -> dict[OffloadKey, int]:
        return {OffloadKey(k): n for k, n in self._tier.tracked_offers() or []}

    def __getitem__(self, key: OffloadKey) -> int:
        return self._items()[key]

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._tier.tracked_offers() or [])
