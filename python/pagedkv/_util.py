"""Small integer helpers shared across the package, the tests and the benchmarks.

Standard library only: ``sim/vllm_engine.py`` loads this file by path when it runs
as a script under an interpreter without pagedkv.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import SupportsInt

__all__ = ["FNV_OFFSET_BASIS", "MASK64", "SplitMix64", "cdiv", "fnv1a64"]

MASK64 = (1 << 64) - 1
#: FNV-1a-64's initial value (the checksum of nothing).
FNV_OFFSET_BASIS = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


def cdiv(a: int, b: int) -> int:
    """Ceiling division (vLLM's ``cdiv``)."""
    return -(-a // b)


class SplitMix64:
    """SplitMix64: ``below(n) = next() % n``, ``between(lo, hi) = lo + below(hi - lo + 1)``.

    The same stream as the Rust benches' token generator (``pagedkv_benches``).
    """

    __slots__ = ("state",)

    def __init__(self, seed: int) -> None:
        self.state = seed & MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def between(self, lo: int, hi: int) -> int:
        return lo + self.below(hi - lo + 1)


def fnv1a64(words: Iterable[SupportsInt], h: int = FNV_OFFSET_BASIS) -> int:
    """FNV-1a over 64-bit words (negative words taken mod 2**64), continuing from ``h``.

    Accepts Python ints and NumPy integers alike.
    """
    for w in words:
        h = ((h ^ (int(w) & MASK64)) * _FNV_PRIME) & MASK64
    return h
