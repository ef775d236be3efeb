"""The base of the per-layer KV-cache specs: dtype sizes, argument checks and :class:`KVCacheSpec`.

The attention specs (:mod:`pagedkv.spec_attention`), the page and state specs
(:mod:`pagedkv.spec_pages`) and the groups and configs (:mod:`pagedkv.specs`,
which re-exports every spec) build on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from ._util import cdiv
from .errors import InvalidConfigError

__all__ = ["KVCacheSpec", "dtype_size"]

_DTYPE_SIZES = {
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float32": 4,
    "float": 4,
    "float64": 8,
    "double": 8,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
}

_SpecT = TypeVar("_SpecT", bound="KVCacheSpec")


def dtype_size(dtype: Any) -> int:
    """Bytes per element of ``dtype``: a name ("float16", "bfloat16", "float32", "fp8")
    or anything with an ``itemsize`` (``torch.dtype``, ``numpy.dtype``)."""
    if isinstance(dtype, str):
        try:
            return _DTYPE_SIZES[dtype.removeprefix("torch.")]
        except KeyError:
            raise InvalidConfigError(f"unknown dtype {dtype!r}") from None
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int) and not isinstance(itemsize, bool) and itemsize > 0:
        return itemsize
    raise InvalidConfigError(f"unknown dtype {dtype!r}")


def _canonical_dtype(dtype: Any) -> Any:
    """The dtype as stored in a spec: a known name stays a name, ``torch.float16`` /
    ``numpy.dtype("float16")`` become ``"float16"``; anything else with an
    ``itemsize`` is kept as given. Raises ``InvalidConfigError`` (a ``ValueError``)
    for an unknown dtype."""
    dtype_size(dtype)
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    name = str(dtype).removeprefix("torch.")
    return name if name in _DTYPE_SIZES else dtype


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidConfigError(f"{name} must be a positive int, got {value!r}")


def _check_non_negative_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidConfigError(f"{name} must be a non-negative int, got {value!r}")


def _check_sizing(max_model_len: int, max_in_flight_tokens: int | None) -> int:
    """Validates the sizing arguments; returns ``max_in_flight_tokens`` resolved."""
    _check_positive_int("max_model_len", max_model_len)
    if max_in_flight_tokens is None:
        return max_model_len
    _check_positive_int("max_in_flight_tokens", max_in_flight_tokens)
    return max_in_flight_tokens


@dataclass(frozen=True)
class KVCacheSpec:
    """Base class of the per-layer KV-cache specs."""

    block_size: int

    #: vLLM's ``KVCacheSpecKind`` value; the manager picks its rules by it.
    kind: ClassVar[str] = "unknown"

    def __post_init__(self) -> None:
        _check_positive_int("block_size", self.block_size)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer."""
        raise NotImplementedError

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        *,
        max_num_encoder_input_tokens: int | None = None,
    ) -> int:
        """Bytes one request of ``max_model_len`` tokens can need in one layer."""
        _check_sizing(max_model_len, max_in_flight_tokens)
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes

    def core_spec(self) -> dict[str, Any]:
        """What the Rust manager needs: ``kind``, ``block_size`` and the fields that
        change its rules."""
        return {"kind": self.kind, "block_size": self.block_size}

    def copy_with_new_block_size(self: _SpecT, block_size: int) -> _SpecT:
        """This spec with another block size (vLLM's name)."""
        return dataclasses.replace(self, block_size=block_size)

    @classmethod
    def merge(cls: type[_SpecT], specs: Sequence[_SpecT]) -> _SpecT:
        """The spec of a group holding layers of ``specs`` (vLLM's ``merge``): they
        must all be equal. Raises ``InvalidConfigError`` when they cannot share a group."""
        if not specs:
            raise InvalidConfigError("merge needs at least one spec")
        if not all(spec == specs[0] for spec in specs[1:]):
            raise InvalidConfigError("All layers in the same KV cache group must be the same.")
        return specs[0]
