"""A tiny decoder-only transformer with random weights that runs two ways: densely
over a whole sequence (no cache, no paging: the reference) and step by step over a
paged KV cache addressed through pagedkv's block tables and slot mappings.

Layers mix full, sliding-window and chunked-local attention (``layer_types``), with
rotary position embeddings, grouped-query attention, RMSNorm and a gated MLP, so a
wrong position, slot or block shows up in the logits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from .kernels import AttentionMetadata, dense_attention, paged_attention, write_kv
from .kv_cache import KVCache

__all__ = ["TinyConfig", "TinyTransformer"]

_LAYER_TYPES = ("full", "sliding", "chunked")


@dataclass(frozen=True)
class TinyConfig:
    """Shape of a :class:`TinyTransformer`. ``layer_types[i]`` is ``"full"``,
    ``"sliding"`` (window ``sliding_window``) or ``"chunked"``
    (``attention_chunk_size``)."""

    vocab_size: int = 128
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    layer_types: tuple[str, ...] = ("full", "sliding", "full", "sliding")
    sliding_window: int = 8
    attention_chunk_size: int = 16
    rope_theta: float = 10000.0
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for t in self.layer_types:
            if t not in _LAYER_TYPES:
                raise ValueError(f"layer type must be one of {_LAYER_TYPES}, got {t!r}")
        if not self.layer_types:
            raise ValueError("a model needs at least one layer")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, num_heads by num_kv_heads")
        if self.head_size % 2:
            raise ValueError("rotary embeddings need an even head size")

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class _Layer(nn.Module):
    def __init__(self, cfg: TinyConfig, layer_type: str, gen: torch.Generator) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_size

        def w(rows: int, cols: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(rows, cols, generator=gen) * cols**-0.5)

        self.layer_type = layer_type
        self.wq = w(cfg.num_heads * d, h)
        self.wk = w(cfg.num_kv_heads * d, h)
        self.wv = w(cfg.num_kv_heads * d, h)
        self.wo = w(h, cfg.num_heads * d)
        self.w_gate = w(cfg.intermediate_size, h)
        self.w_up = w(cfg.intermediate_size, h)
        self.w_down = w(h, cfg.intermediate_size)
        self.norm1 = nn.Parameter(torch.ones(h))
        self.norm2 = nn.Parameter(torch.ones(h))


class TinyTransformer(nn.Module):
    """Random-weight transformer (seeded, so two instances with one seed are equal).

    ``forward_dense(token_ids)`` gives the logits of every position of one sequence;
    ``forward_paged(token_ids, positions, kv_cache, metadata)`` runs a batch of
    scheduled tokens, writing their K/V through each layer's group slot mapping and
    attending through its block table.
    """

    def __init__(self, cfg: TinyConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen))
        self.layers = nn.ModuleList(_Layer(cfg, t, gen) for t in cfg.layer_types)
        self.final_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Parameter(
            torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * cfg.hidden_size**-0.5
        )
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_size, 2).float() / cfg.head_size)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.to(cfg.dtype)
        self.inv_freq: torch.Tensor = inv
        self.scale = cfg.head_size**-0.5

    @property
    def layer_names(self) -> list[str]:
        return [f"layers.{i}.attn" for i in range(self.cfg.num_layers)]

    def kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        """Layer name -> spec, for :func:`pagedkv.get_kv_cache_config`."""
        cfg = self.cfg
        dtype = str(cfg.dtype).removeprefix("torch.")
        specs: dict[str, KVCacheSpec] = {}
        for name, t in zip(self.layer_names, cfg.layer_types, strict=True):
            args = (block_size, cfg.num_kv_heads, cfg.head_size, dtype)
            if t == "sliding":
                specs[name] = SlidingWindowSpec(*args, sliding_window=cfg.sliding_window)
            elif t == "chunked":
                specs[name] = ChunkedLocalAttentionSpec(
                    *args, attention_chunk_size=cfg.attention_chunk_size
                )
            else:
                specs[name] = FullAttentionSpec(*args)
        return specs

    def _window(self, layer: _Layer) -> tuple[int | None, int | None]:
        if layer.layer_type == "sliding":
            return self.cfg.sliding_window, None
        if layer.layer_type == "chunked":
            return None, self.cfg.attention_chunk_size
        return None, None

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.float()[:, None] * self.inv_freq.to(x.device)[None, :]
        cos = torch.cat([freqs.cos(), freqs.cos()], -1)[:, None, :]
        sin = torch.cat([freqs.sin(), freqs.sin()], -1)[:, None, :]
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], -1)
        return (xf * cos + rotated * sin).to(x.dtype)

    def _qkv(
        self, layer: _Layer, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        n, d = x.shape[0], cfg.head_size
        h = _rms_norm(x, layer.norm1)
        q = (h @ layer.wq.T).view(n, cfg.num_heads, d)
        k = (h @ layer.wk.T).view(n, cfg.num_kv_heads, d)
        v = (h @ layer.wv.T).view(n, cfg.num_kv_heads, d)
        return self._rope(q, positions), self._rope(k, positions), v

    def _finish_layer(self, layer: _Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + attn.reshape(x.shape[0], -1) @ layer.wo.T
        h = _rms_norm(x, layer.norm2)
        return (
            x + (torch.nn.functional.silu(h @ layer.w_gate.T) * (h @ layer.w_up.T)) @ layer.w_down.T
        )

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return (_rms_norm(x, self.final_norm) @ self.lm_head.T).float()

    @torch.no_grad()
    def forward_dense(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Logits ``(seq_len, vocab_size)`` (float32) of one whole sequence, without any
        cache: the reference."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.embed.device)
        x = self.embed[ids]
        positions = torch.arange(ids.shape[0], device=ids.device)
        for layer in self.layers:
            assert isinstance(layer, _Layer)
            q, k, v = self._qkv(layer, x, positions)
            window, chunk = self._window(layer)
            attn = dense_attention(
                q, k, v, self.scale, sliding_window=window, attention_chunk_size=chunk
            )
            x = self._finish_layer(layer, x, attn)
        return self._logits(x)

    @torch.no_grad()
    def forward_paged(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        metadata: Mapping[int, AttentionMetadata] | Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        """Logits ``(num_tokens, vocab_size)`` of a step's scheduled tokens.
        ``metadata[g]`` is the attention metadata of KV-cache group ``g``."""
        x = self.embed[token_ids.to(torch.long)]
        for name, layer in zip(self.layer_names, self.layers, strict=True):
            assert isinstance(layer, _Layer)
            cache = kv_cache.layers[name]
            meta = metadata[cache.group_id]
            kv = cache.kv
            if not isinstance(kv, torch.Tensor):
                raise TypeError(f"layer {name!r} has no attention cache")
            window, chunk = self._window(layer)
            if (window, chunk) != (meta.sliding_window, meta.attention_chunk_size):
                raise ValueError(
                    f"layer {name!r}: metadata window ({meta.sliding_window}, "
                    f"{meta.attention_chunk_size}) != the layer's ({window}, {chunk})"
                )
            q, k, v = self._qkv(layer, x, positions)
            write_kv(k, v, kv, meta.slot_mapping)
            attn = paged_attention(q, kv, meta, self.scale)
            x = self._finish_layer(layer, x, attn)
        return self._logits(x)
