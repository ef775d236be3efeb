"""Block tables and slot mappings (vLLM's ``BlockTable`` / ``MultiGroupBlockTable``).

A :class:`BlockTable` holds, for one KV-cache group, one row of block ids per
running request: a CPU ``int32`` tensor ``[max_num_reqs, max_num_blocks_per_req]``
(pinned when CUDA is available, so uploads are asynchronous) with a NumPy view for
cheap edits, and a mirror on the device that :meth:`BlockTable.commit` refreshes
with one non-blocking copy. Rows are filled from the manager's answers:
:meth:`~BlockTable.add_row` with ``get_block_ids`` when a request is (re)admitted
(skipped sliding-window blocks appear as the null block 0), and
:meth:`~BlockTable.append_row` with each ``allocate_slots`` result afterwards.

The slot of a token is ``block_id * block_size + position % block_size``; the slot
mapping of a step is computed for every scheduled token at once with NumPy (no
per-token Python), padded with ``-1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .._util import cdiv
from ..specs import KVCacheConfig

__all__ = ["BlockTable", "MultiGroupBlockTable", "step_positions"]

_I32 = npt.NDArray[np.int32]
_I64 = npt.NDArray[np.int64]


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def step_positions(
    rows: npt.ArrayLike, num_computed_tokens: npt.ArrayLike, num_scheduled_tokens: npt.ArrayLike
) -> tuple[_I64, _I64]:
    """``(row of each token, position of each token)`` for a step that schedules
    ``num_scheduled_tokens[i]`` tokens of the request in block-table row ``rows[i]``,
    starting at position ``num_computed_tokens[i]``. Vectorised: no per-token loop."""
    r = np.asarray(rows, dtype=np.int64)
    c = np.asarray(num_computed_tokens, dtype=np.int64)
    n = np.asarray(num_scheduled_tokens, dtype=np.int64)
    if not (r.ndim == c.ndim == n.ndim == 1) or not (len(r) == len(c) == len(n)):
        raise ValueError(
            "rows, num_computed_tokens and num_scheduled_tokens must be 1-D arrays of one length"
        )
    if len(n) and (n.min() < 0 or c.min() < 0):
        raise ValueError("token counts must be non-negative")
    total = int(n.sum())
    starts = np.cumsum(n) - n
    offsets = np.arange(total, dtype=np.int64) - np.repeat(starts, n)
    return np.repeat(r, n), np.repeat(c, n) + offsets


class BlockTable:
    """The block table of one KV-cache group.

    Args:
        block_size: tokens per block of the group.
        max_num_reqs: rows (requests in a batch).
        max_num_blocks_per_req: columns (``cdiv(max_model_len, block_size)``).
        max_num_batched_tokens: size of the slot-mapping buffer.
        device: where the mirror lives (default: CUDA when available, else CPU).
        pin_memory: pin the CPU buffers (default: when CUDA is available).
    """

    def __init__(
        self,
        block_size: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        max_num_batched_tokens: int,
        device: torch.device | str | None = None,
        *,
        pin_memory: bool | None = None,
    ) -> None:
        self.block_size = _positive("block_size", block_size)
        self.max_num_reqs = _positive("max_num_reqs", max_num_reqs)
        self.max_num_blocks_per_req = _positive("max_num_blocks_per_req", max_num_blocks_per_req)
        self.max_num_batched_tokens = _positive("max_num_batched_tokens", max_num_batched_tokens)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        pin = bool(pin_memory)
        shape = (max_num_reqs, max_num_blocks_per_req)
        self.cpu = torch.zeros(shape, dtype=torch.int32, pin_memory=pin)
        self.np: _I32 = self.cpu.numpy()
        self.gpu = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.num_blocks_per_row: _I32 = np.zeros(max_num_reqs, dtype=np.int32)
        self.slot_mapping_cpu = torch.full(
            (max_num_batched_tokens,), -1, dtype=torch.int64, pin_memory=pin
        )
        self.slot_mapping_np: _I64 = self.slot_mapping_cpu.numpy()
        self.slot_mapping = torch.full(
            (max_num_batched_tokens,), -1, dtype=torch.int64, device=self.device
        )
        # A non-blocking upload from pinned memory may still be reading the CPU
        # buffers; edits wait for it (a no-op on the CPU).
        self._upload_done: torch.cuda.Event | None = None

    def _wait_upload(self) -> None:
        if self._upload_done is not None:
            self._upload_done.synchronize()
            self._upload_done = None

    def _mark_upload(self) -> None:
        if self.device.type == "cuda" and self.cpu.is_pinned():
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            self._upload_done = event

    def _row(self, row_idx: int) -> int:
        if not isinstance(row_idx, (int, np.integer)) or isinstance(row_idx, bool):
            raise TypeError(f"row index must be an int, got {row_idx!r}")
        if not 0 <= row_idx < self.max_num_reqs:
            raise IndexError(f"row {row_idx} out of range [0, {self.max_num_reqs})")
        return int(row_idx)

    # ---------------------------------------------------------------- row edits

    def append_row(self, block_ids: npt.ArrayLike, row_idx: int) -> None:
        """Appends ``block_ids`` (an ``allocate_slots`` result of this group) to a row."""
        self._wait_upload()
        row = self._row(row_idx)
        ids = np.asarray(block_ids)
        if ids.ndim != 1:
            raise ValueError(f"block ids must be 1-D, got shape {ids.shape}")
        n = len(ids)
        if n == 0:
            return
        start = int(self.num_blocks_per_row[row])
        if start + n > self.max_num_blocks_per_req:
            raise ValueError(
                f"row {row} would hold {start + n} blocks, more than "
                f"max_num_blocks_per_req={self.max_num_blocks_per_req}"
            )
        if ids.min() < 0:
            raise ValueError("block ids must be non-negative")
        self.np[row, start : start + n] = ids
        self.num_blocks_per_row[row] = start + n

    def add_row(self, block_ids: npt.ArrayLike, row_idx: int) -> None:
        """Sets a row to ``block_ids`` (all the blocks of a request)."""
        row = self._row(row_idx)
        self.num_blocks_per_row[row] = 0
        self.append_row(block_ids, row)

    def move_row(self, src: int, tgt: int) -> None:
        """Copies row ``src`` onto row ``tgt`` (condensing the batch)."""
        self._wait_upload()
        s, t = self._row(src), self._row(tgt)
        n = int(self.num_blocks_per_row[s])
        self.np[t, :n] = self.np[s, :n]
        self.num_blocks_per_row[t] = n

    def swap_row(self, a: int, b: int) -> None:
        """Exchanges rows ``a`` and ``b``."""
        self._wait_upload()
        a, b = self._row(a), self._row(b)
        self.num_blocks_per_row[[a, b]] = self.num_blocks_per_row[[b, a]]
        self.np[[a, b]] = self.np[[b, a]]

    def clear_row(self, row_idx: int) -> None:
        """Empties a row (its entries become the null block)."""
        self._wait_upload()
        row = self._row(row_idx)
        self.np[row, : int(self.num_blocks_per_row[row])] = 0
        self.num_blocks_per_row[row] = 0

    def clear(self) -> None:
        self._wait_upload()
        self.np.fill(0)
        self.num_blocks_per_row.fill(0)
        self.gpu.fill_(0)

    def row(self, row_idx: int) -> _I32:
        """The block ids of a row (a view)."""
        row = self._row(row_idx)
        return self.np[row, : int(self.num_blocks_per_row[row])]

    # ------------------------------------------------------------ device side

    def commit(self, num_reqs: int) -> torch.Tensor:
        """Uploads rows ``[0, num_reqs)`` to the device mirror (non-blocking from
        pinned memory) and returns that slice of the mirror. The next edit of the
        table waits until the copy has read the CPU buffer."""
        if not 0 <= num_reqs <= self.max_num_reqs:
            raise ValueError(f"num_reqs {num_reqs} out of range [0, {self.max_num_reqs}]")
        self.gpu[:num_reqs].copy_(self.cpu[:num_reqs], non_blocking=True)
        self._mark_upload()
        return self.gpu[:num_reqs]

    def compute_slot_mapping(
        self,
        req_indices: npt.ArrayLike,
        positions: npt.ArrayLike,
        num_padded_tokens: int | None = None,
    ) -> _I64:
        """Slot of each scheduled token, ``block_id * block_size + position % block_size``,
        written into the slot-mapping buffer; entries ``[len, num_padded_tokens)`` are
        ``-1`` (padding). Returns the buffer's first ``num_padded_tokens`` entries.

        Raises ``ValueError`` for a position beyond the blocks its row holds."""
        rows = np.asarray(req_indices, dtype=np.int64)
        pos = np.asarray(positions, dtype=np.int64)
        if rows.shape != pos.shape or rows.ndim != 1:
            raise ValueError("req_indices and positions must be 1-D arrays of one length")
        n = len(pos)
        padded = n if num_padded_tokens is None else num_padded_tokens
        if not n <= padded <= self.max_num_batched_tokens:
            raise ValueError(
                f"{n} tokens padded to {padded} do not fit max_num_batched_tokens="
                f"{self.max_num_batched_tokens}"
            )
        self._wait_upload()
        out = self.slot_mapping_np
        if n:
            if rows.min() < 0 or rows.max() >= self.max_num_reqs or pos.min() < 0:
                raise ValueError("row index or position out of range")
            block_idx = pos // self.block_size
            if np.any(block_idx >= self.num_blocks_per_row[rows]):
                raise ValueError("a position lies beyond the blocks of its row")
            flat = self.np.reshape(-1)
            block_ids = flat[rows * self.max_num_blocks_per_req + block_idx]
            np.multiply(block_ids, self.block_size, out=out[:n])
            out[:n] += pos % self.block_size
        out[n:padded] = -1
        return out[:padded]

    def commit_slot_mapping(self, num_tokens: int) -> torch.Tensor:
        """Uploads the first ``num_tokens`` slots; returns them on the device."""
        self.slot_mapping[:num_tokens].copy_(self.slot_mapping_cpu[:num_tokens], non_blocking=True)
        self._mark_upload()
        return self.slot_mapping[:num_tokens]


class MultiGroupBlockTable:
    """One :class:`BlockTable` per KV-cache group; row edits take one id array per
    group (the manager's per-group tuples)."""

    def __init__(
        self,
        block_sizes: Sequence[int],
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device | str | None = None,
        *,
        pin_memory: bool | None = None,
    ) -> None:
        _positive("max_model_len", max_model_len)
        if not block_sizes:
            raise ValueError("a block table needs at least one group")
        self.tables = [
            BlockTable(
                bs,
                max_num_reqs,
                cdiv(max_model_len, bs),
                max_num_batched_tokens,
                device,
                pin_memory=pin_memory,
            )
            for bs in block_sizes
        ]

    @classmethod
    def from_config(
        cls,
        config: KVCacheConfig,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device | str | None = None,
        *,
        pin_memory: bool | None = None,
    ) -> MultiGroupBlockTable:
        return cls(
            [g.kv_cache_spec.block_size for g in config.kv_cache_groups],
            max_num_reqs,
            max_model_len,
            max_num_batched_tokens,
            device,
            pin_memory=pin_memory,
        )

    def __len__(self) -> int:
        return len(self.tables)

    def __getitem__(self, group_id: int) -> BlockTable:
        return self.tables[group_id]

    def _per_group(self, block_ids: Sequence[npt.ArrayLike]) -> Sequence[npt.ArrayLike]:
        if len(block_ids) != len(self.tables):
            raise ValueError(
                f"expected block ids for {len(self.tables)} groups, got {len(block_ids)}"
            )
        return block_ids

    def append_row(self, block_ids: Sequence[npt.ArrayLike], row_idx: int) -> None:
        for table, ids in zip(self.tables, self._per_group(block_ids), strict=True):
            table.append_row(ids, row_idx)

    def add_row(self, block_ids: Sequence[npt.ArrayLike], row_idx: int) -> None:
        for table, ids in zip(self.tables, self._per_group(block_ids), strict=True):
            table.add_row(ids, row_idx)

    def move_row(self, src: int, tgt: int) -> None:
        for table in self.tables:
            table.move_row(src, tgt)

    def swap_row(self, a: int, b: int) -> None:
        for table in self.tables:
            table.swap_row(a, b)

    def clear_row(self, row_idx: int) -> None:
        for table in self.tables:
            table.clear_row(row_idx)

    def clear(self) -> None:
        for table in self.tables:
            table.clear()

    def commit(self, num_reqs: int) -> list[torch.Tensor]:
        return [table.commit(num_reqs) for table in self.tables]

    def compute_slot_mappings(
        self,
        req_indices: npt.ArrayLike,
        positions: npt.ArrayLike,
        num_padded_tokens: int | None = None,
    ) -> list[_I64]:
        rows = np.asarray(req_indices, dtype=np.int64)
        pos = np.asarray(positions, dtype=np.int64)
        return [t.compute_slot_mapping(rows, pos, num_padded_tokens) for t in self.tables]

    def commit_slot_mappings(self, num_tokens: int) -> list[torch.Tensor]:
        return [table.commit_slot_mapping(num_tokens) for table in self.tables]
