"""Conversions between vLLM's objects and a pagedkv core: a vLLM spec as a
core group, a vLLM request registered with and synced to a core (its token
list read once, one way), a core's events as vLLM's, and a core pool's block
activity fed to vLLM's metrics collector."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared as VllmAllBlocksCleared
from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.distributed.kv_events import KVCacheEvent
from vllm.v1.core.kv_cache_utils import KVCacheBlock, maybe_convert_block_hash
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheGroupRole,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.request import Request

from pagedkv import _core


def core_group(
    spec: KVCacheSpec, dcp_world_size: int = 1, pcp_world_size: int = 1
) -> dict[str, Any]:
    """The core's group description of a vLLM KV-cache spec; equal specs get
    equal tags (they share hit lookups, as vLLM's coordinator groups them).

    Decode context parallelism shards each block's KV over ``dcp_world_size``
    ranks: a DCP-sharded group's blocks hold ``block_size * dcp_world_size``
    tokens (vLLM's single-type managers scale it so). Prefill context
    parallelism changes no geometry here, and vLLM refuses it for the
    recycling kinds."""
    group = _core_kind(spec)
    if getattr(spec, "dcp_sharded", False):
        group["block_size"] *= dcp_world_size
    if pcp_world_size > 1 and group["kind"] in (
        "sliding_window",
        "chunked_local_attention",
        "mamba",
    ):
        raise AssertionError(f"PCP does not support {group['kind']} groups")
    return {**group, "tag": repr(spec)}


def engine_managed(group: Any) -> bool:
    """Whether vLLM's own manager runs the group (an engine-managed core
    group): HiSparse's host source, over the host tier's own pool."""
    return getattr(group, "role", None) == KVCacheGroupRole.HISPARSE_SOURCE


def engine_managed_group(group: int, spec: KVCacheSpec) -> dict[str, Any]:
    """The core's description of group ``group``, which vLLM's own manager
    runs (an engine-managed group of ``spec``'s block size)."""
    return {
        "kind": "engine_managed",
        "block_size": spec.block_size,
        "tag": f"engine-managed group {group}",
    }


def _core_kind(spec: KVCacheSpec) -> dict[str, Any]:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        inner = next(iter(spec.kv_cache_specs.values()))
        return {**_core_kind(inner), "block_size": spec.block_size}
    name = type(spec).__name__
    bs = spec.block_size
    if isinstance(spec, MambaSpec):
        # Prefill checkpoints need both the reserved block and an alignment.
        checkpoints = getattr(spec, "num_prefill_checkpoint_blocks", 0) > 0
        return {
            "kind": "mamba",
            "block_size": bs,
            "mamba_cache_mode": spec.mamba_cache_mode,
            "num_speculative_blocks": spec.num_speculative_blocks,
            "prefill_checkpoint_alignment": getattr(spec, "prefill_checkpoint_alignment", None)
            if checkpoints
            else None,
        }
    if isinstance(spec, CrossAttentionSpec):
        return {"kind": "cross_attention", "block_size": bs}
    if isinstance(spec, SlidingWindowSpec) and name in (
        "SlidingWindowSpec",
        "SlidingWindowMLASpec",
    ):
        group = {"kind": "sliding_window", "block_size": bs, "sliding_window": spec.sliding_window}
        if getattr(spec, "bounded_replay", False):
            # Never cached: after a hit the scheduler replays the window.
            group["bounded_replay"] = True
        if spec.extra_retained_tokens:
            group["extra_retained_tokens"] = spec.extra_retained_tokens
        return group
    if isinstance(spec, HiSparseResidentSpec):
        return {"kind": "hisparse_resident", "block_size": bs}
    if isinstance(spec, HiSparseHotSpec):
        return {
            "kind": "hisparse_hot",
            "block_size": bs,
            "blocks_per_request": spec.blocks_per_request,
        }
    if name == "CircularBufferSpec":
        return {"kind": "circular_buffer", "block_size": bs}
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return {
            "kind": "chunked_local_attention",
            "block_size": bs,
            "attention_chunk_size": spec.attention_chunk_size,
        }
    if isinstance(spec, SinkFullAttentionSpec):
        return {"kind": "sink_full_attention", "block_size": bs, "sink_len": spec.sink_len}
    if isinstance(spec, MLAAttentionSpec) and name == "MLAAttentionSpec":
        return {"kind": "mla_attention", "block_size": bs}
    if isinstance(spec, FullAttentionSpec) and name in ("FullAttentionSpec", "MLAAttentionSpec"):
        return {"kind": "full_attention", "block_size": bs}
    raise NotImplementedError(f"pagedkv's vLLM manager does not support {name} groups yet")


def feed_collector(col: Any, core: _core.KVCacheManager, blocks: Sequence[KVCacheBlock]) -> None:
    """Feeds vLLM's ``metrics_collector`` a core pool's block activity since the
    last call, in order, as vLLM's pool calls it: blocks allocated, cached
    blocks adopted by a hit, blocks evicted, the cache reset."""
    if col is None:
        return
    kinds, ids = core.take_block_activity()
    for kind, bid in zip(kinds.tolist(), ids.tolist(), strict=True):
        if kind == _core.BLOCK_ALLOCATED:
            col.on_block_allocated(blocks[bid])
        elif kind == _core.BLOCK_ACCESSED:
            col.on_block_accessed(blocks[bid])
        elif kind == _core.BLOCK_EVICTED:
            col.on_block_evicted(blocks[bid])
        else:
            col.reset()


def vllm_events(core: _core.KVCacheManager, medium: str | None = None) -> list[KVCacheEvent]:
    """Drains a core's events as vLLM's event objects (not annotated), each
    block event reporting ``medium`` when given (a host tier's ``"CPU"``)."""
    out: list[KVCacheEvent] = []
    for ev in core.take_events(raw_hashes=True):
        if isinstance(ev, _core.BlockStored):
            parent = ev.parent_block_hash
            out.append(
                VllmBlockStored(
                    block_hashes=[maybe_convert_block_hash(h) for h in ev.block_hashes],
                    parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
                    token_ids=ev.token_ids,
                    block_size=ev.block_size,
                    lora_id=ev.lora_id,
                    medium=ev.medium if medium is None else medium,
                    lora_name=ev.lora_name,
                    extra_keys=ev.extra_keys,
                    group_idx=ev.group_idx,
                    session_id=ev.session_id,
                    lookahead_token_ids=ev.lookahead_token_ids,
                )
            )
        elif isinstance(ev, _core.BlockRemoved):
            out.append(
                VllmBlockRemoved(
                    block_hashes=[maybe_convert_block_hash(h) for h in ev.block_hashes],
                    medium=ev.medium if medium is None else medium,
                    group_idx=ev.group_idx,
                )
            )
        else:
            out.append(VllmAllBlocksCleared())
    return out


def add_to_core(core: _core.KVCacheManager, request: Request, prompt_by_length: bool) -> None:
    """Registers a vLLM request with a core: its prompt (by length alone when
    the core reads no token value), LoRA, cache salt, multimodal items and
    session."""
    lora = request.lora_request
    n = request.num_prompt_tokens
    if prompt_by_length:
        prompt: Any = n
    else:
        tokens = token_list(request)
        prompt = tokens if len(tokens) == n else tokens[:n]
    core.add_request(
        request.request_id,
        prompt,
        lora_name=lora.lora_name if lora is not None else None,
        lora_id=lora.lora_int_id if lora is not None else None,
        cache_salt=request.cache_salt,
        mm_features=request.mm_features or None,
        session_id=request.session_id,
    )


def sync_with_core(core: _core.KVCacheManager, request: Request) -> None:
    """Brings a core's copy of a registered request up to date: the tokens and
    block hashes it gained, or, where vLLM rewrote them (a streaming session's
    next chunk), everything from the first difference on."""
    core.sync_request(
        request.request_id,
        token_list(request),
        request.block_hashes,
        request.shared_prefix_boundary,
        num_prompt_tokens=request.num_prompt_tokens,
    )


def token_list(request: Request) -> Any:
    """The request's own token list behind its read-only ``all_token_ids`` view
    when it has one (a plain list converts without Python calls)."""
    try:
        return request._all_token_ids
    except AttributeError:
        return request.all_token_ids
