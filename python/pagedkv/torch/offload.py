"""Host-memory KV for an offload tier's slots, and the copies both ways.

:class:`HostKVStore` holds, for a device :class:`~pagedkv.torch.KVCache`, a host
cache of the same layout with ``num_chunks * blocks_per_chunk`` blocks (pinned
when CUDA is available): slot ``s`` of a :class:`~pagedkv.offload.OffloadTier`
is host blocks ``s * blocks_per_chunk ...`` of the group its key names (a key is
one group's chunk; groups sharing a KV-cache tensor share host pages as they
share device pages). :meth:`store` copies a group's device blocks into slots and
:meth:`load` copies slots back into device blocks, one batch for every layer of
the group. On CUDA the copies run on a side
stream, ordered after the work already queued on the current stream, and the
returned :class:`HostCopy` carries an event: :meth:`HostCopy.done` polls it,
:meth:`HostCopy.wait` makes a stream (or the host) wait for it. On the CPU they
are plain copies, done on return.

A store's slots are the ones ``OffloadTier.prepare_store`` handed out (its
``complete_store`` follows the copy's completion); a load's are those of
``prepare_load`` (``complete_load`` after the copy).
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import numpy.typing as npt
import torch

from .kv_cache import KVCache, allocate_kv_cache

__all__ = ["HostCopy", "HostKVStore"]


class HostCopy:
    """One batch of copies: done at once on the CPU; on CUDA, when its event is."""

    __slots__ = ("_event", "nbytes")

    def __init__(self, event: torch.cuda.Event | None, nbytes: int) -> None:
        self._event = event
        self.nbytes = nbytes

    def done(self) -> bool:
        """Whether the copies finished (never blocks)."""
        return self._event is None or bool(self._event.query())  # type: ignore[no-untyped-call]

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Makes ``stream`` wait for the copies (the host, without one)."""
        if self._event is None:
            return
        if stream is None:
            self._event.synchronize()
        else:
            stream.wait_event(self._event)


def _ids(values: npt.ArrayLike, name: str) -> npt.NDArray[np.int64]:
    a = np.asarray(values, dtype=np.int64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D")
    return a


class HostKVStore:
    """``num_chunks`` chunks of ``blocks_per_chunk`` blocks in host memory, in
    ``kv_cache``'s layout, and batched copies to and from ``kv_cache``."""

    def __init__(
        self,
        kv_cache: KVCache,
        num_chunks: int,
        blocks_per_chunk: int,
        *,
        pin_memory: bool | None = None,
    ) -> None:
        for name, v in (("num_chunks", num_chunks), ("blocks_per_chunk", blocks_per_chunk)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.kv_cache = kv_cache
        self.num_chunks = num_chunks
        self.blocks_per_chunk = blocks_per_chunk
        self.host = allocate_kv_cache(
            kv_cache.config, "cpu", num_blocks=num_chunks * blocks_per_chunk, pin_memory=pin_memory
        )
        dev = kv_cache.device
        self._stream = (
            torch.cuda.Stream(dev) if dev.type == "cuda" else None  # type: ignore[no-untyped-call]
        )
        self._groups = range(len(kv_cache.config.kv_cache_groups))

    def chunk_nbytes(self, group: int) -> int:
        """Bytes of one chunk of group ``group`` (every layer of the group)."""
        per_block = sum(
            t[0].numel() * t.element_size() for t in self.kv_cache.group_block_tensors(group)
        )
        return per_block * self.blocks_per_chunk

    def _plan(
        self, group: int, slots: npt.ArrayLike, block_ids: npt.ArrayLike
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        if not isinstance(group, int) or group not in self._groups:
            raise ValueError(f"group must be one of {list(self._groups)}, got {group!r}")
        s = _ids(slots, "slots")
        if len(s) and (s.min() < 0 or s.max() >= self.num_chunks):
            raise ValueError(f"slot out of range (0..{self.num_chunks})")
        if len(set(s.tolist())) != len(s):
            raise ValueError("a slot is listed twice")
        b = _ids(block_ids, "block_ids")
        if len(b) != len(s) * self.blocks_per_chunk:
            raise ValueError(
                f"block_ids holds {len(b)} ids for {len(s)} slots of {self.blocks_per_chunk} blocks"
            )
        if len(b) and (b.min() < 0 or b.max() >= self.kv_cache.num_blocks):
            raise ValueError(f"block id out of range (0..{self.kv_cache.num_blocks})")
        return s, b

    def store(self, group: int, slots: npt.ArrayLike, block_ids: npt.ArrayLike) -> HostCopy:
        """Copies group ``group``'s device blocks into host slots (a slot holds one
        group's chunk, as a tier key names one group): ``block_ids`` lists
        ``blocks_per_chunk`` device ids a slot, chunk after chunk."""
        s, b = self._plan(group, slots, block_ids)
        return self._copy(group, s, b, to_host=True)

    def load(self, group: int, slots: npt.ArrayLike, block_ids: npt.ArrayLike) -> HostCopy:
        """Copies host slots into group ``group``'s device blocks (the layout of
        :meth:`store`)."""
        s, b = self._plan(group, slots, block_ids)
        return self._copy(group, s, b, to_host=False)

    def store_blocks(
        self, group: int, device_blocks: npt.ArrayLike, host_blocks: npt.ArrayLike
    ) -> HostCopy:
        """Copies device blocks into host blocks one for one (host block ``b`` is
        block ``b % blocks_per_chunk`` of slot ``b // blocks_per_chunk``): a
        :class:`~pagedkv.offload.Transfer` of a store."""
        d, h = self._pairs(group, device_blocks, host_blocks)
        return self._copy_blocks(group, h, d, to_host=True)

    def load_blocks(
        self, group: int, device_blocks: npt.ArrayLike, host_blocks: npt.ArrayLike
    ) -> HostCopy:
        """Copies host blocks into device blocks one for one (a load's transfer)."""
        d, h = self._pairs(group, device_blocks, host_blocks)
        return self._copy_blocks(group, h, d, to_host=False)

    def _host_ids(self, group: int, host_blocks: npt.ArrayLike) -> torch.Tensor:
        if not isinstance(group, int) or group not in self._groups:
            raise ValueError(f"group must be one of {list(self._groups)}, got {group!r}")
        h = _ids(host_blocks, "host_blocks")
        n_host = self.num_chunks * self.blocks_per_chunk
        if len(h) and (h.min() < 0 or h.max() >= n_host):
            raise ValueError(f"host block out of range (0..{n_host})")
        return torch.as_tensor(h)

    def _views(
        self, group: int, index: torch.Tensor, buf: npt.NDArray[np.uint8]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each of the group's host tensors with the rows of ``buf`` that hold
        its blocks ``index`` (layer tensor after layer tensor)."""
        tensors = self.host.group_block_tensors(group)
        sizes = [len(index) * t[0].numel() * t.element_size() for t in tensors]
        if buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous:
            raise ValueError("the chunk buffer must be a contiguous 1-D uint8 array")
        if sum(sizes) != len(buf):
            raise ValueError(f"{len(buf)} bytes for {sum(sizes)} bytes of host blocks")
        raw = torch.from_numpy(buf)
        out, at = [], 0
        for t, n in zip(tensors, sizes, strict=True):
            # Every tensor's bytes are a multiple of its element size.
            rows = raw[at : at + n].view(t.dtype).view(len(index), *t.shape[1:])
            out.append((t, rows))
            at += n
        return out

    def chunk_bytes(
        self,
        group: int,
        host_blocks: npt.ArrayLike,
        out: npt.NDArray[np.uint8] | None = None,
    ) -> npt.NDArray[np.uint8]:
        """The bytes of host blocks ``host_blocks`` of group ``group``, layer
        tensor after layer tensor (a chunk as the disk tier keeps it), into
        ``out`` when given (a reused buffer spares a fresh allocation)."""
        index = self._host_ids(group, host_blocks)
        if out is None:
            n = sum(
                len(index) * t[0].numel() * t.element_size()
                for t in self.host.group_block_tensors(group)
            )
            out = np.empty(n, dtype=np.uint8)
        for t, rows in self._views(group, index, out):
            torch.index_select(t, 0, index, out=rows)
        return out

    def set_chunk_bytes(
        self, group: int, host_blocks: npt.ArrayLike, data: npt.NDArray[np.uint8]
    ) -> None:
        """Writes bytes laid out as :meth:`chunk_bytes` gives them into host
        blocks ``host_blocks`` of group ``group``."""
        index = self._host_ids(group, host_blocks)
        for t, rows in self._views(group, index, np.ascontiguousarray(data)):
            t.index_copy_(0, index, rows)

    def _pairs(
        self, group: int, device_blocks: npt.ArrayLike, host_blocks: npt.ArrayLike
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        if not isinstance(group, int) or group not in self._groups:
            raise ValueError(f"group must be one of {list(self._groups)}, got {group!r}")
        d = _ids(device_blocks, "device_blocks")
        h = _ids(host_blocks, "host_blocks")
        if len(d) != len(h):
            raise ValueError(f"{len(d)} device blocks for {len(h)} host blocks")
        if len(d) and (d.min() < 0 or d.max() >= self.kv_cache.num_blocks):
            raise ValueError(f"device block out of range (0..{self.kv_cache.num_blocks})")
        n_host = self.num_chunks * self.blocks_per_chunk
        if len(h) and (h.min() < 0 or h.max() >= n_host):
            raise ValueError(f"host block out of range (0..{n_host})")
        if len(set(h.tolist())) != len(h):
            raise ValueError("a host block is listed twice")
        return d, h

    def _copy(
        self,
        group: int,
        slots: npt.NDArray[np.int64],
        blocks: npt.NDArray[np.int64],
        *,
        to_host: bool,
    ) -> HostCopy:
        bpc = self.blocks_per_chunk
        host = (slots[:, None] * bpc + np.arange(bpc, dtype=np.int64)[None, :]).reshape(-1)
        return self._copy_blocks(group, host, blocks, to_host=to_host)

    def _copy_blocks(
        self,
        group: int,
        host_blocks: npt.NDArray[np.int64],
        device_blocks: npt.NDArray[np.int64],
        *,
        to_host: bool,
    ) -> HostCopy:
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
        nbytes = 0
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            dev = torch.as_tensor(device_blocks).to(self.kv_cache.device, non_blocking=True)
            host = torch.as_tensor(host_blocks)
            pairs = zip(
                self.kv_cache.group_block_tensors(group),
                self.host.group_block_tensors(group),
                strict=True,
            )
            for dev_t, host_t in pairs:
                if to_host:
                    host_t.index_copy_(0, host, dev_t.index_select(0, dev).to("cpu"))
                else:
                    data = host_t.index_select(0, host).to(dev_t.device, non_blocking=True)
                    dev_t.index_copy_(0, dev, data)
                nbytes += len(host_blocks) * host_t[0].numel() * host_t.element_size()
        if stream is None:
            return HostCopy(None, nbytes)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        return HostCopy(event, nbytes)
