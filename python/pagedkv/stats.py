"""Prefix-cache statistics, counted as vLLM counts them (``vllm/v1/metrics/stats.py``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PrefixCacheStats"]


@dataclass
class PrefixCacheStats:
    """Lookups recorded at admission since the last snapshot.

    ``queries`` are tokens looked up (a request's length when admitted), ``hits``
    tokens served from the cache; requests preempted before count in the
    ``preempted_*`` fields instead. ``reset`` marks a successful
    ``reset_prefix_cache``.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` of non-preempted requests (0.0 without queries)."""
        return self.hits / self.queries if self.queries else 0.0
