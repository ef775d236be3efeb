"""The prefix-hit rate of a trace against the size of one LRU cache, with no
serving constraints (Mooncake's FAST'25 paper, Figure 9): ``pagedkv trace-stats
--capacity``.

The requests are replayed in arrival order through one LRU cache of C blocks.
Each request first looks its blocks up: its hit is its longest prefix of blocks
present in the cache. Then its blocks are accessed in order, each becoming the
most recently used, the least recently used block leaving when a new one
arrives in a full cache. A request of more than C blocks therefore evicts its
own first blocks as it goes, and leaves its last C blocks cached.

LRU has the inclusion property (the cache of C blocks holds the C most recently
used distinct blocks), so one pass serves every capacity (Mattson et al.,
"Evaluation techniques for storage hierarchies", 1970): a block is present in a
cache of C blocks iff its rank in the recency stack is at most C; a request's
prefix of k blocks hits iff the largest rank among them is at most C. The
ranks come from a Fenwick tree over access times holding a 1 at the last
access of every block: O(log n) per lookup and per access.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["BlockRequest", "LruCurve", "lru_hit_curve"]


@dataclass(frozen=True)
class BlockRequest:
    """A request as the cache sees it."""

    #: the blocks it leaves cached, in order (each names the whole prefix up to
    #: it: equal keys are equal prefixes)
    blocks: Sequence[Hashable]
    #: the tokens each of its first ``len(hit_tokens)`` blocks counts when it
    #: hits (the prompt's blocks; a last partial block counts its tokens)
    hit_tokens: Sequence[int]
    #: its prompt tokens (the denominator of the hit rate)
    prompt_tokens: int


class _Fenwick:
    """Prefix sums over positions 1, 2, ... that grow by appending."""

    def __init__(self) -> None:
        self.tree = [0]

    def prefix(self, i: int) -> int:
        t, s = self.tree, 0
        while i > 0:
            s += t[i]
            i &= i - 1
        return s

    def add(self, i: int, delta: int) -> None:
        t = self.tree
        n = len(t) - 1
        while i <= n:
            t[i] += delta
            i += i & -i

    def append(self, value: int) -> None:
        i = len(self.tree)
        self.tree.append(value + self.prefix(i - 1) - self.prefix(i - (i & -i)))


@dataclass(frozen=True)
class LruCurve:
    """The hit tokens of every capacity, from one pass (:func:`lru_hit_curve`)."""

    #: the prefix-max rank of each hit block (sorted) and the cumulative tokens
    ranks: np.ndarray
    cumulative_tokens: np.ndarray
    prompt_tokens: int

    def hit_tokens(self, blocks: int) -> int:
        """Hit tokens with a cache of ``blocks`` blocks."""
        k = int(np.searchsorted(self.ranks, blocks, side="right"))
        return int(self.cumulative_tokens[k - 1]) if k else 0

    def hit_rate(self, blocks: int) -> float:
        return self.hit_tokens(blocks) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def unlimited_hit_rate(self) -> float:
        """The hit rate of a cache that never evicts (the prefix-hit ceiling)."""
        total = int(self.cumulative_tokens[-1]) if len(self.cumulative_tokens) else 0
        return total / self.prompt_tokens if self.prompt_tokens else 0.0


def lru_hit_curve(requests: Iterable[BlockRequest]) -> LruCurve:
    """One pass over ``requests`` in order (see the module docstring)."""
    last: dict[Hashable, int] = {}  # block -> the time of its last access (1, 2, ...)
    marks = _Fenwick()
    ranks: list[int] = []
    tokens: list[int] = []
    prompt_tokens = 0
    for req in requests:
        prompt_tokens += req.prompt_tokens
        top = 0
        distinct = len(last)
        for key, n in zip(req.blocks, req.hit_tokens, strict=False):
            t = last.get(key)
            if t is None:
                break
            # The block's rank in the recency stack: the blocks accessed at or
            # after its last access.
            top = max(top, distinct - marks.prefix(t - 1))
            ranks.append(top)
            tokens.append(n)
        for key in req.blocks:
            t = last.get(key)
            if t is not None:
                marks.add(t, -1)
            marks.append(1)
            last[key] = len(marks.tree) - 1
    order = np.argsort(np.asarray(ranks, dtype=np.int64), kind="stable")
    return LruCurve(
        np.asarray(ranks, dtype=np.int64)[order],
        np.cumsum(np.asarray(tokens, dtype=np.int64)[order]),
        prompt_tokens,
    )
