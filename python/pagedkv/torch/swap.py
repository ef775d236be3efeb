"""Swapping a request's KV blocks to a CPU pool and back, with the manager told.

:meth:`KVSwapper.swap_out` copies the blocks a request holds (every group, every
layer) into a CPU swap space of the same layout, then frees them in the manager
(the request stays known, holding no blocks, like a preempted request).
:meth:`KVSwapper.swap_in` has the manager allocate fresh blocks for the computed
tokens (plus the tokens about to be scheduled), copies the data back into them,
and releases sliding-window blocks that fell out of the window. Both return which
ids moved where, per KV-cache group.

The swap space is a :class:`~pagedkv.torch.KVCache` of the same config on the CPU
(pinned when CUDA is available), so layers of different groups share its buffers
exactly as on the device; a CPU block id, like a device block id, belongs to one
group at a time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .._util import cdiv
from ..errors import InvalidArgumentError
from ..manager import KVCacheManager
from .kernels import copy_blocks
from .kv_cache import KVCache, allocate_kv_cache

__all__ = ["KVSwapper", "SwapInResult", "SwappedGroup", "SwappedRequest"]

_I32 = npt.NDArray[np.int32]
_I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class SwappedGroup:
    """The blocks of one group that were swapped out: ``indices`` (positions in the
    request's block list), the device ids they had and the CPU ids now holding them.
    Positions the manager had already released (the null block) are not swapped."""

    indices: _I64
    device_ids: _I32
    cpu_ids: _I64


@dataclass(frozen=True)
class SwappedRequest:
    """A request whose KV lives in the CPU pool: ``num_computed_tokens`` tokens."""

    request_id: str
    num_computed_tokens: int
    groups: tuple[SwappedGroup, ...]

    @property
    def num_cpu_blocks(self) -> int:
        return sum(len(g.cpu_ids) for g in self.groups)


@dataclass(frozen=True)
class SwapInResult:
    """Per group, the old device ids and the new ones the data now lives in
    (``old_ids[i]`` moved to ``new_ids[i]``). Blocks that fell out of a sliding
    window while the request was swapped out are not brought back."""

    old_ids: tuple[_I32, ...]
    new_ids: tuple[_I32, ...]

    def mapping(self) -> list[dict[int, int]]:
        """Per group, old id -> new id."""
        return [
            dict(zip(o.tolist(), n.tolist(), strict=True))
            for o, n in zip(self.old_ids, self.new_ids, strict=True)
        ]


class KVSwapper:
    """Moves requests' KV blocks between ``kv_cache`` (on its device) and a CPU
    swap space of ``num_cpu_blocks`` blocks, keeping ``manager`` in step."""

    def __init__(
        self,
        manager: KVCacheManager,
        kv_cache: KVCache,
        num_cpu_blocks: int,
        *,
        pin_memory: bool | None = None,
    ) -> None:
        if manager.kv_cache_config is not kv_cache.config:
            if manager.kv_cache_config != kv_cache.config:
                raise ValueError("the manager and the KV cache have different configs")
        self.manager = manager
        self.kv_cache = kv_cache
        self.cpu_cache = allocate_kv_cache(
            kv_cache.config, "cpu", num_blocks=num_cpu_blocks, pin_memory=pin_memory
        )
        self._free: deque[int] = deque(range(num_cpu_blocks))
        self._block_sizes = [g.kv_cache_spec.block_size for g in kv_cache.config.kv_cache_groups]

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._free)

    def swap_out(self, request_id: str, num_computed_tokens: int) -> SwappedRequest | None:
        """Copies the blocks holding the request's first ``num_computed_tokens``
        tokens to the CPU pool and frees the request's blocks in the manager.
        Returns None, changing nothing, when the CPU pool lacks room."""
        if num_computed_tokens < 0 or num_computed_tokens > self.manager.num_tokens(request_id):
            raise InvalidArgumentError(
                f"num_computed_tokens {num_computed_tokens} out of range for {request_id!r}"
            )
        block_ids = self.manager.get_block_ids(request_id)
        plans: list[tuple[_I64, _I32]] = []
        for gid, ids in enumerate(block_ids):
            n = cdiv(num_computed_tokens, self._block_sizes[gid])
            if n > len(ids):
                raise InvalidArgumentError(
                    f"{request_id!r} holds {len(ids)} blocks in group {gid}, fewer than its "
                    f"{num_computed_tokens} computed tokens need"
                )
            indices = np.flatnonzero(ids[:n] != 0).astype(np.int64)
            plans.append((indices, ids[indices]))
        needed = sum(len(ix) for ix, _ in plans)
        if needed > len(self._free):
            return None
        groups = []
        for gid, (indices, dev_ids) in enumerate(plans):
            cpu_ids = np.array([self._free.popleft() for _ in range(len(indices))], dtype=np.int64)
            copy_blocks(
                self.kv_cache.group_block_tensors(gid),
                dev_ids,
                cpu_ids,
                dst_tensors=self.cpu_cache.group_block_tensors(gid),
            )
            groups.append(SwappedGroup(indices, dev_ids.copy(), cpu_ids))
        self.manager.free(request_id)
        return SwappedRequest(request_id, num_computed_tokens, tuple(groups))

    def swap_in(self, swapped: SwappedRequest, num_new_tokens: int = 0) -> SwapInResult | None:
        """Allocates device blocks for the swapped tokens plus ``num_new_tokens`` (the
        tokens scheduled next, so one call admits the request), releases the
        sliding-window blocks outside the window, copies the data back, releases the
        CPU blocks, and only then caches the full blocks of the swapped tokens.
        Returns None, changing nothing, when the device pool lacks room."""
        rid = swapped.request_id
        if any(len(g) for g in self.manager.get_block_ids(rid)):
            raise InvalidArgumentError(f"{rid!r} already holds blocks; swap it out first")
        total = swapped.num_computed_tokens + num_new_tokens
        # The new blocks are cached only once they hold the data: a block cached now
        # and released below (outside a sliding window) would be a hit on garbage.
        new = self.manager.allocate_slots(
            rid, total, num_computed_tokens=0, delay_cache_blocks=True
        )
        if new is None:
            return None
        # Blocks now outside a sliding window need no data: release them first.
        self.manager.remove_skipped_blocks(rid, swapped.num_computed_tokens)
        block_ids = self.manager.get_block_ids(rid)
        old, new_ids_per_group = [], []
        for gid, group in enumerate(swapped.groups):
            new_ids = block_ids[gid][group.indices]
            live = new_ids != 0
            copy_blocks(
                self.cpu_cache.group_block_tensors(gid),
                group.cpu_ids[live],
                new_ids[live],
                dst_tensors=self.kv_cache.group_block_tensors(gid),
            )
            self._free.extend(int(c) for c in group.cpu_ids)
            old.append(group.device_ids[live])
            new_ids_per_group.append(new_ids[live].astype(np.int32))
        self.manager.cache_blocks(rid, swapped.num_computed_tokens)
        return SwapInResult(tuple(old), tuple(new_ids_per_group))

    def discard(self, swapped: SwappedRequest) -> None:
        """Releases the CPU blocks of a swapped request that will not come back."""
        for group in swapped.groups:
            self._free.extend(int(c) for c in group.cpu_ids)
