"""Reference kernels in plain torch (CPU or CUDA): writing K/V through a slot
mapping, paged attention through a block table, block copies, and dense attention
without paging (the independent reference the tests compare against).

They favour clarity over speed: paged attention loops over the requests of a batch
(never over tokens) and gathers, per request, only the blocks its queries can see,
so blocks the manager has freed (sliding-window and chunked-local blocks outside
the window, the null block 0) are never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

__all__ = [
    "AttentionMetadata",
    "copy_blocks",
    "dense_attention",
    "paged_attention",
    "write_kv",
    "write_slots",
]


@dataclass(frozen=True)
class AttentionMetadata:
    """What one KV-cache group's attention needs for a step.

    ``query_start_loc`` (``[num_reqs + 1]``) and ``seq_lens`` (``[num_reqs]``, tokens
    after this step) and ``rows`` (block-table row of each request) live on the CPU:
    the reference kernel loops over requests with them. ``block_table`` and
    ``slot_mapping`` are device tensors.
    """

    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: npt.NDArray[np.int64]
    seq_lens: npt.NDArray[np.int64]
    rows: npt.NDArray[np.int64]
    block_size: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)


def _check_slots(values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != values.shape[0]:
        raise ValueError(
            f"slot_mapping of shape {tuple(slot_mapping.shape)} does not match "
            f"{values.shape[0]} tokens"
        )


def write_slots(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``cache[slot // block_size, slot % block_size] = values`` for every token whose
    slot is not ``-1``. ``cache``: ``(num_blocks, block_size, ...)``; ``values``:
    ``(num_tokens, ...)``."""
    _check_slots(values, slot_mapping)
    block_size = cache.shape[1]
    slots = slot_mapping.to(device=cache.device, dtype=torch.long)
    valid = slots >= 0
    slots = slots[valid]
    if slots.numel() and int(slots.max()) >= cache.shape[0] * block_size:
        raise ValueError("slot out of range of the cache")
    cache[slots // block_size, slots % block_size] = values[valid].to(cache.dtype)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """vLLM's ``reshape_and_cache``: ``key``/``value`` ``(num_tokens, num_kv_heads,
    head_size)`` into ``kv_cache`` ``(2, num_blocks, block_size, num_kv_heads,
    head_size)`` at ``slot_mapping`` (``-1``: padding, skipped)."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"expected a (2, num_blocks, block_size, heads, head_size) cache, got "
            f"shape {tuple(kv_cache.shape)}"
        )
    if key.shape != value.shape or key.shape[1:] != kv_cache.shape[3:]:
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match the "
            f"cache's (heads, head_size) {tuple(kv_cache.shape[3:])}"
        )
    write_slots(kv_cache[0], key, slot_mapping)
    write_slots(kv_cache[1], value, slot_mapping)


def _mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    sliding_window: int | None,
    attention_chunk_size: int | None,
) -> torch.Tensor:
    """``[num_queries, num_keys]``: True where the query sees the key."""
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0
    if sliding_window is not None:
        mask &= diff < sliding_window
    if attention_chunk_size is not None:
        mask &= (q_pos[:, None] // attention_chunk_size) == (k_pos[None, :] // attention_chunk_size)
    return mask


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of ``query`` (``(num_tokens, num_heads, head_size)``, the
    step's tokens, request after request) over the keys and values held in the
    request's blocks. Grouped-query attention when ``num_heads`` is a multiple of the
    cache's ``num_kv_heads``. ``meta.sliding_window``: a query at position ``p`` sees
    ``(p - sliding_window, p]``; ``meta.attention_chunk_size``: only its own chunk.
    Computed in float32, returned in ``query``'s dtype."""
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    if query.dim() != 3 or query.shape[2] != head_size or query.shape[1] % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit a cache of {num_kv_heads} "
            f"heads of size {head_size}"
        )
    qsl, seq_lens, rows = meta.query_start_loc, meta.seq_lens, meta.rows
    if len(qsl) != len(seq_lens) + 1 or len(rows) != len(seq_lens):
        raise ValueError("query_start_loc, seq_lens and rows disagree on the number of requests")
    if int(qsl[-1]) != query.shape[0]:
        raise ValueError(
            f"query_start_loc ends at {int(qsl[-1])}, query has {query.shape[0]} tokens"
        )
    bs = meta.block_size
    group = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    for i in range(len(seq_lens)):
        qs, qe, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
        q_len = qe - qs
        if q_len == 0:
            continue
        ctx = seq_len - q_len
        if ctx < 0:
            raise ValueError(f"request {i}: {q_len} queries but seq_len {seq_len}")
        lo = 0
        if meta.sliding_window is not None:
            lo = max(lo, ctx - meta.sliding_window + 1)
        if meta.attention_chunk_size is not None:
            lo = max(lo, ctx // meta.attention_chunk_size * meta.attention_chunk_size)
        first, last = lo // bs, (seq_len - 1) // bs
        if last >= meta.block_table.shape[1]:
            raise ValueError(f"request {i}: seq_len {seq_len} exceeds the block table")
        ids = meta.block_table[int(rows[i]), first : last + 1].to(torch.long)
        k = k_cache[ids].reshape(-1, num_kv_heads, head_size)[
            lo - first * bs : seq_len - first * bs
        ]
        v = v_cache[ids].reshape(-1, num_kv_heads, head_size)[
            lo - first * bs : seq_len - first * bs
        ]
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        q = query[qs:qe].float()
        dev = query.device
        q_pos = torch.arange(ctx, seq_len, device=dev)
        k_pos = torch.arange(lo, seq_len, device=dev)
        mask = _mask(q_pos, k_pos, meta.sliding_window, meta.attention_chunk_size)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
) -> torch.Tensor:
    """Attention over a whole sequence without a cache or paging (the reference):
    ``query`` ``(seq_len, num_heads, head_size)``, ``key``/``value`` ``(seq_len,
    num_kv_heads, head_size)``; same masks as :func:`paged_attention`, computed by
    ``torch.nn.functional.scaled_dot_product_attention``."""
    n = query.shape[0]
    group = query.shape[1] // key.shape[1]
    pos = torch.arange(n, device=query.device)
    mask = _mask(pos, pos, sliding_window, attention_chunk_size)
    q = query.float().transpose(0, 1)
    k = key.float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = value.float().repeat_interleave(group, dim=1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).to(query.dtype)


def copy_blocks(
    tensors: Sequence[torch.Tensor],
    src: npt.ArrayLike,
    dst: npt.ArrayLike,
    *,
    dst_tensors: Sequence[torch.Tensor] | None = None,
) -> None:
    """Copies block ``src[i]`` onto block ``dst[i]`` in every tensor (dim 0 is the block
    id, as in :attr:`~pagedkv.torch.LayerCache.block_tensors`). With ``dst_tensors``
    the copies go into those instead (another device: swapping)."""
    s = torch.as_tensor(np.asarray(src, dtype=np.int64))
    d = torch.as_tensor(np.asarray(dst, dtype=np.int64))
    if s.shape != d.shape or s.dim() != 1:
        raise ValueError("src and dst must be 1-D and of one length")
    targets = tensors if dst_tensors is None else dst_tensors
    if len(targets) != len(tensors):
        raise ValueError("dst_tensors must match tensors one to one")
    if s.numel() == 0:
        return
    for t_src, t_dst in zip(tensors, targets, strict=True):
        if t_src.shape[1:] != t_dst.shape[1:] or t_src.dtype != t_dst.dtype:
            raise ValueError("source and destination block tensors differ in shape or dtype")
        if (
            int(s.max()) >= t_src.shape[0]
            or int(d.max()) >= t_dst.shape[0]
            or min(int(s.min()), int(d.min())) < 0
        ):
            raise ValueError("block id out of range")
        # Blocking copies: a non-blocking device-to-host copy may still be in flight
        # when the host reads it.
        data = t_src[s.to(t_src.device)]
        t_dst[d.to(t_dst.device)] = data.to(t_dst.device)
