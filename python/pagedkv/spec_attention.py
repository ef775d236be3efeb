"""Attention layers' KV-cache specs: full, MLA, sinks, sliding window, chunked local, cross, ring.

Each gives its page size, what one request can need at most and what the
manager reads (``core_spec``); vLLM's merge rules for a group of full-attention
layers live here. :mod:`pagedkv.specs` re-exports them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

from ._util import cdiv
from .errors import InvalidConfigError
from .spec_base import (
    KVCacheSpec,
    _canonical_dtype,
    _check_non_negative_int,
    _check_positive_int,
    _check_sizing,
    _SpecT,
    dtype_size,
)

__all__ = [
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "CircularBufferSpec",
    "CrossAttentionSpec",
    "FullAttentionSpec",
    "MLAAttentionSpec",
    "SinkFullAttentionSpec",
    "SlidingWindowSpec",
]


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """Attention layers: K and V pages of ``num_kv_heads`` x ``head_size``.

    ``head_size_v`` (V head size, default ``head_size``) and ``page_size_padded``
    (a page enlarged to share a pool with bigger pages, at least the real page)
    are keyword-only, as in vLLM.
    """

    num_kv_heads: int
    head_size: int
    dtype: Any
    head_size_v: int | None = field(default=None, kw_only=True)
    page_size_padded: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int("num_kv_heads", self.num_kv_heads)
        _check_positive_int("head_size", self.head_size)
        object.__setattr__(self, "dtype", _canonical_dtype(self.dtype))
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self._default_head_size_v())
        _check_non_negative_int("head_size_v", self.head_size_v)
        if self.page_size_padded is not None:
            _check_positive_int("page_size_padded", self.page_size_padded)
            if self.page_size_padded < self.real_page_size_bytes:
                raise InvalidConfigError(
                    f"page_size_padded ({self.page_size_padded}) is smaller than the real "
                    f"page size ({self.real_page_size_bytes} bytes)"
                )

    def _default_head_size_v(self) -> int:
        return self.head_size

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one block without padding:
        ``block_size * num_kv_heads * (head_size + head_size_v) * dtype_size``."""
        head_size_v = self.head_size if self.head_size_v is None else self.head_size_v
        return (
            self.block_size
            * self.num_kv_heads
            * (self.head_size + head_size_v)
            * dtype_size(self.dtype)
        )

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    @classmethod
    def _attention_fields_equal(cls, specs: Sequence[KVCacheSpec]) -> bool:
        """Whether ``specs`` agree on every field ``AttentionSpec`` declares (vLLM
        compares ``fields(AttentionSpec)`` when merging)."""
        names = [f.name for f in dataclasses.fields(AttentionSpec)]
        first = specs[0]
        return all(getattr(s, n) == getattr(first, n) for s in specs[1:] for n in names)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Full (causal) attention: a request keeps every block until it finishes."""

    kind: ClassVar[str] = "full_attention"

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        *,
        max_num_encoder_input_tokens: int | None = None,
    ) -> int:
        """``cdiv(max_model_len, block_size) * page_size_bytes``."""
        _check_sizing(max_model_len, max_in_flight_tokens)
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes

    @classmethod
    def merge(cls: type[_SpecT], specs: Sequence[_SpecT]) -> _SpecT:
        """vLLM's ``FullAttentionSpec.merge``: every spec is a ``FullAttentionSpec``
        (sinks included, MLA excluded) with equal attention fields; the result is
        a ``cls`` built from the first spec's attention fields."""
        if not specs:
            raise InvalidConfigError("merge needs at least one spec")
        if not all(isinstance(s, FullAttentionSpec) for s in specs):
            raise InvalidConfigError(
                "All attention layers in the same KV cache group must be FullAttentionSpec."
            )
        if any(isinstance(s, MLAAttentionSpec) for s in specs):
            raise InvalidConfigError(
                "MLAAttentionSpec layers merge only with MLAAttentionSpec layers."
            )
        if not AttentionSpec._attention_fields_equal(specs):
            raise InvalidConfigError(
                "All attention layers in the same KV cache group must have the same attention spec."
            )
        return cls(**cast("type[FullAttentionSpec]", cls)._merged_fields(specs))

    @classmethod
    def _merged_fields(cls, specs: Sequence[KVCacheSpec]) -> dict[str, Any]:
        first = specs[0]
        return {f.name: getattr(first, f.name) for f in dataclasses.fields(AttentionSpec)}


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek): one latent vector per token and head
    slot, no separate V (``head_size_v`` = 0); managed like full attention.
    ``head_size`` is ``kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek-V3)."""

    kind: ClassVar[str] = "mla_attention"

    def _default_head_size_v(self) -> int:
        return 0

    @classmethod
    def merge(cls: type[_SpecT], specs: Sequence[_SpecT]) -> _SpecT:
        if not specs:
            raise InvalidConfigError("merge needs at least one spec")
        if not all(isinstance(s, MLAAttentionSpec) for s in specs):
            raise InvalidConfigError(
                "All attention layers in the same KV cache group must be MLAAttentionSpec."
            )
        if not AttentionSpec._attention_fields_equal(specs):
            raise InvalidConfigError(
                "All attention layers in the same KV cache group must have the same attention spec."
            )
        return specs[0]


@dataclass(frozen=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with ``sink_len`` attention-sink tokens. Managed like full
    attention (vLLM 0.33's manager takes no blocks for the sinks); the manager
    requires ``sink_len`` to be a multiple of ``block_size`` (checked there, as in
    vLLM: the config builder may still enlarge a hybrid model's block sizes)."""

    sink_len: int

    kind: ClassVar[str] = "sink_full_attention"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int("sink_len", self.sink_len)

    def core_spec(self) -> dict[str, Any]:
        return {**super().core_spec(), "sink_len": self.sink_len}

    @classmethod
    def _merged_fields(cls, specs: Sequence[KVCacheSpec]) -> dict[str, Any]:
        fields = super()._merged_fields(specs)
        sink_len = getattr(specs[0], "sink_len", None)
        if sink_len is None:
            raise InvalidConfigError("a SinkFullAttentionSpec group needs a sink_len")
        fields["sink_len"] = sink_len
        return fields


@dataclass(frozen=True)
class _RecyclingAttentionSpec(AttentionSpec):
    """Attention whose requests recycle blocks (sliding window, chunked local): a
    request holds at most ``max_admission_blocks_per_request`` blocks, which also
    sizes the pool (vLLM's single source of truth for both)."""

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        raise NotImplementedError

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        *,
        max_num_encoder_input_tokens: int | None = None,
    ) -> int:
        in_flight = _check_sizing(max_model_len, max_in_flight_tokens)
        return (
            self.max_admission_blocks_per_request(in_flight, max_model_len) * self.page_size_bytes
        )


@dataclass(frozen=True)
class SlidingWindowSpec(_RecyclingAttentionSpec):
    """Sliding-window attention: the next token sees the last ``sliding_window``
    tokens; blocks entirely before the window are freed (replaced by the null
    block).

    ``bounded_replay`` (keyword-only; vLLM's ``SlidingWindowMLASpec`` field):
    the group's KV is never cached. Prefix hits come from the other groups; after
    one, the engine recomputes the hit's last ``sliding_window`` tokens for this
    group, which holds null blocks below them and fresh blocks from there on.

    ``extra_retained_tokens`` (keyword-only; vLLM's field of the same name): a
    request keeps that many more tokens below the window, not attended (an
    engine whose multi-module speculative decoding prefills them again). Their
    blocks are freed that much later and count in the admission cap."""

    sliding_window: int
    bounded_replay: bool = field(default=False, kw_only=True)
    extra_retained_tokens: int = field(default=0, kw_only=True)

    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int("sliding_window", self.sliding_window)
        _check_non_negative_int("extra_retained_tokens", self.extra_retained_tokens)

    @property
    def num_retained_tokens(self) -> int:
        """Tokens below a request's next position that stay readable:
        ``sliding_window - 1 + extra_retained_tokens``."""
        return self.sliding_window - 1 + self.extra_retained_tokens

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        """Most blocks one request holds:
        ``cdiv(min(num_retained_tokens + max_in_flight_tokens, max_model_len), block_size)
        + 1`` (+1: the window may start inside a block)."""
        _check_positive_int("max_in_flight_tokens", max_in_flight_tokens)
        _check_positive_int("max_model_len", max_model_len)
        num_tokens = min(self.num_retained_tokens + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) + 1

    def core_spec(self) -> dict[str, Any]:
        spec = {**super().core_spec(), "sliding_window": self.sliding_window}
        if self.bounded_replay:
            spec["bounded_replay"] = True
        if self.extra_retained_tokens:
            spec["extra_retained_tokens"] = self.extra_retained_tokens
        return spec


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(_RecyclingAttentionSpec):
    """Chunked local attention (Llama 4): a token sees only its own
    ``attention_chunk_size``-token chunk; blocks of earlier chunks are freed."""

    attention_chunk_size: int

    kind: ClassVar[str] = "chunked_local_attention"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int("attention_chunk_size", self.attention_chunk_size)

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        """Most blocks one request holds:
        ``cdiv(min(attention_chunk_size + max_in_flight_tokens, max_model_len),
        block_size)``."""
        _check_positive_int("max_in_flight_tokens", max_in_flight_tokens)
        _check_positive_int("max_model_len", max_model_len)
        num_tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size)

    def core_spec(self) -> dict[str, Any]:
        return {**super().core_spec(), "attention_chunk_size": self.attention_chunk_size}


@dataclass(frozen=True)
class CrossAttentionSpec(AttentionSpec):
    """Cross-attention of an encoder-decoder model (Whisper): K/V of the encoder
    output, allocated once per request and never prefix-cached. Sized by
    ``max_num_encoder_input_tokens``, not by ``max_model_len``."""

    kind: ClassVar[str] = "cross_attention"

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        *,
        max_num_encoder_input_tokens: int | None = None,
    ) -> int:
        """``cdiv(max_num_encoder_input_tokens, block_size) * page_size_bytes``."""
        _check_sizing(max_model_len, max_in_flight_tokens)
        if max_num_encoder_input_tokens is None:
            raise InvalidConfigError(
                "a cross-attention layer is sized by the encoder output length: pass "
                "max_num_encoder_input_tokens (e.g. 1500 for Whisper)"
            )
        _check_positive_int("max_num_encoder_input_tokens", max_num_encoder_input_tokens)
        return cdiv(max_num_encoder_input_tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class CircularBufferSpec(AttentionSpec):
    """One block per request for its whole life (vLLM's ``CircularBufferSpec``:
    a ring of the raw keys of the token group still being compressed,
    ``block_size`` rows). Claimed at the request's first allocation, never
    prefix-cached, never freed before the request ends."""

    kind: ClassVar[str] = "circular_buffer"

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        *,
        max_num_encoder_input_tokens: int | None = None,
    ) -> int:
        """One page: the ring holds one block whatever the request's length."""
        _check_sizing(max_model_len, max_in_flight_tokens)
        return self.page_size_bytes
