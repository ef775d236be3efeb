"""The handle a manager gives its views: what they read and call of it (its
core, block objects and live requests, the calls that keep its own state),
in place of the manager's private attributes."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pagedkv import _core
    from pagedkv.vllm.blocks import PagedBlock
    from pagedkv.vllm.engine import EngineGroups


class PoolOwner(Protocol):
    """What a pool view reads of the manager (or host tier) it shows."""

    enable_caching: bool
    enable_kv_cache_events: bool
    hash_block_size: int
    num_hash_lookahead_tokens: int
    metrics_collector: Any
    coordinator: Any

    def evict_blocks(self, block_ids: Iterable[int]) -> None: ...
    def reset_prefix_cache(self) -> bool: ...
    def take_events(self) -> list[Any]: ...


class ViewedManager(PoolOwner, Protocol):
    """What the coordinator and group views read of the manager they show
    (its public face)."""

    kv_cache_config: Any
    max_model_len: int
    max_in_flight_tokens: int | None
    scheduler_block_size: int
    num_prefill_lookahead: int
    use_eagle: bool
    block_pool: Any

    def get_blocks(self, request_id: str) -> Any: ...


@dataclass(eq=False)
class ManagerHandle:
    """One manager's state and calls as its views use them. The containers are
    the manager's own (shared, not copied): the views see every change."""

    #: The manager (or host tier) the views show, by its public face.
    owner: PoolOwner
    core: _core.KVCacheManager
    #: One block object per block id.
    blocks: list[PagedBlock]
    #: Requests the core holds, by id (vLLM's ``Request`` objects).
    live: dict[str, Any]
    #: ``req_to_blocks`` lists handed out per request, frozen when it is forgotten.
    live_lists: dict[str, list[weakref.ref[Any]]]
    #: The groups vLLM's own managers run (HiSparse's host source).
    engine: EngineGroups
    #: Registers a vLLM request on first sight and syncs it; returns its id.
    sync: Callable[[Any], str]
    #: After a pool call: the block activity to the metrics collector.
    observe_blocks: Callable[[], None]
    #: Once blocks are watched for reuse: every allocation fires their watchers.
    hook_allocations: Callable[[], None]
    #: ``kv_event_queue.append``: another component's event, after the core's.
    queue_event: Callable[[Any], None]
    #: Events appended that way and not yet taken.
    num_queued_events: Callable[[], int]
    #: Pins resident-page adoptions took for the touch vLLM's HiSparse
    #: coordinator makes right after them (block id -> count).
    adoption_pins: dict[int, int] = field(default_factory=dict)
