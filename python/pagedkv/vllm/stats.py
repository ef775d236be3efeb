"""vLLM's ``PrefixCacheStats`` over a core's counters: the live object
``prefix_cache_stats`` hands out, and a frozen copy."""

from __future__ import annotations

from vllm.v1.metrics.stats import PrefixCacheStats

from pagedkv import _core

_StatsTuple = tuple[bool, int, int, int, int, int, int]


def _field(i: int) -> property:
    return property(lambda self: self._read()[i])


class LiveStats(PrefixCacheStats):
    """vLLM's ``PrefixCacheStats`` whose counters read the core until the next
    ``make_prefix_cache_stats``, then keep the values it returned."""

    reset = _field(0)  # type: ignore[assignment]
    requests = _field(1)  # type: ignore[assignment]
    queries = _field(2)  # type: ignore[assignment]
    hits = _field(3)  # type: ignore[assignment]
    preempted_requests = _field(4)  # type: ignore[assignment]
    preempted_queries = _field(5)  # type: ignore[assignment]
    preempted_hits = _field(6)  # type: ignore[assignment]

    def __init__(self, core: _core.KVCacheManager) -> None:  # no dataclass init
        self.__dict__.update(_core_ref=core, _frozen=None, hits_by_source={})

    def _read(self) -> _StatsTuple:
        t = self.__dict__["_frozen"] or self.__dict__["_core_ref"]._prefix_cache_stats()
        assert t is not None
        return t  # type: ignore[no-any-return]

    def _freeze(self, t: _StatsTuple) -> None:
        self.__dict__["_frozen"] = t


def frozen_stats(t: _StatsTuple) -> PrefixCacheStats:
    s = PrefixCacheStats()
    s.reset, s.requests, s.queries, s.hits = t[0], t[1], t[2], t[3]
    s.preempted_requests, s.preempted_queries, s.preempted_hits = t[4], t[5], t[6]
    return s
