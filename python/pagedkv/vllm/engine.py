"""The groups vLLM's own managers run beside the core's (HiSparse's host
source): which they are, the blocks they say a step needs, and their hits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class EngineGroups:
    """The groups vLLM's own managers run, as ``(group id, manager)`` pairs;
    empty until a HiSparse manager builds them (one object, shared by the
    manager and its views)."""

    #: Every such group, in group order.
    groups: tuple[tuple[int, Any], ...] = ()
    #: Their group ids.
    ids: frozenset[int] = frozenset()
    #: Those looked up for hits (before the core's groups).
    lookup: tuple[tuple[int, Any], ...] = ()
    #: Groups whose hit drops its last block (EAGLE).
    drop_eagle: set[int] = field(default_factory=set)


def engine_groups_need(
    engine: Sequence[tuple[int, Any]],
    request_id: str,
    num_tokens: int,
    hit_groups: Sequence[Sequence[Any]],
    total_computed_tokens: int,
    num_local_computed_tokens: int,
    num_tokens_main_model: int,
    apply_admission_cap: bool,
    prefill_end: int,
) -> int:
    """The blocks the engine-managed groups' own managers say they need (vLLM's
    coordinator adds every group's ``get_num_blocks_to_allocate``)."""
    return sum(
        manager.get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            hit_groups[g],
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap=apply_admission_cap,
            prefill_end=prefill_end,
        )
        for g, manager in engine
    )


def engine_group_hit(
    group: int, manager: Any, block_hashes: Any, max_length: int, drop_eagle: bool
) -> tuple[list[Any], int]:
    """An engine-managed group's own hit (vLLM's manager searching its pool)."""
    blocks, n = type(manager).find_longest_cache_hit(
        block_hashes=block_hashes,
        max_length=max_length,
        kv_cache_group_ids=[group],
        block_pool=manager.block_pool,
        kv_cache_spec=manager.kv_cache_spec,
        drop_eagle_block=drop_eagle,
        alignment_tokens=manager.cache_hit_alignment_tokens,
        dcp_world_size=manager.dcp_world_size,
        pcp_world_size=manager.pcp_world_size,
    )
    return blocks[0], n
