"""A small serving loop that runs a model over a paged KV cache managed by
pagedkv: continuous batching with chunked prefill, prefix caching, preemption by
recompute or by swapping to a CPU pool, and request forks that copy the partly
filled last block (copy-on-write).

Each step is the one scheduler policy of :mod:`pagedkv.sim.policy` (vLLM 0.33's
scheduler: running requests first, a request that does not fit preempts the
newest running one, then, in a step without preemption, waiting requests are
admitted with a prefix-cache lookup), with the engine as its backend: it keeps
the block-table rows (from ``get_block_ids`` on admission, each
``allocate_slots`` result afterwards), swaps instead of freeing when asked to,
runs the model and samples. The slot mappings are computed for the whole batch
at once, and the model writes and reads K/V only through them. The engine
admits a request once its first chunk fits (``full_sequence_must_fit=False``).

It exists to prove the mapping end to end (every logit it computes can be
compared with :meth:`TinyTransformer.forward_dense`), not to be fast.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from .._util import cdiv
from ..config_builder import get_kv_cache_config
from ..errors import DuplicateRequestError, InvalidArgumentError, UnknownRequestError
from ..manager import ComputedBlocks, KVCacheManager
from ..offload import OffloadConfig, TransferPlan
from ..sim.policy import Backend, Request, Scheduler, SchedulerConfig
from ..specs import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from .block_table import MultiGroupBlockTable, step_positions
from .kernels import AttentionMetadata, copy_blocks
from .kv_cache import KVCache, allocate_kv_cache
from .model import TinyTransformer
from .offload import HostKVStore
from .swap import KVSwapper, SwapInResult, SwappedRequest

_log = logging.getLogger(__name__)

__all__ = ["EngineRequest", "PagedEngine", "StepOutput"]

_PREEMPTION_MODES = ("recompute", "swap")


@dataclass(eq=False)
class EngineRequest(Request):
    """A request and what the engine did with it. ``output`` holds the tokens
    sampled so far; the request finishes after ``max_tokens`` of them."""

    prompt: list[int]
    output: list[int] = field(default_factory=list)
    seed: int | None = None
    row: int = -1
    #: tokens run through the model for this request (recomputation included)
    num_model_tokens: int = 0
    #: prefix-cache hit tokens, summed over admissions
    num_hit_tokens: int = 0
    num_swaps: int = 0
    #: blocks copied from the parent when the request was forked, per group
    copied_blocks: tuple[int, ...] = ()
    swapped: SwappedRequest | None = None
    finished: bool = False
    #: (first position, logits of the positions computed from there), in order
    logit_chunks: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def computed_logits(self) -> dict[int, torch.Tensor]:
        """Position -> the logits last computed there."""
        out: dict[int, torch.Tensor] = {}
        for start, chunk in self.logit_chunks:
            for j in range(chunk.shape[0]):
                out[start + j] = chunk[j]
        return out


@dataclass
class StepOutput:
    """What one step did; ``*_ns``: host time to build and upload the step's inputs."""

    scheduled: list[tuple[str, int]]
    preempted: list[str]
    finished: list[str]
    slot_mapping_ns: int = 0
    upload_ns: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


def _window(spec: KVCacheSpec) -> tuple[int | None, int | None]:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = spec.first_spec
    if isinstance(spec, SlidingWindowSpec):
        return spec.sliding_window, None
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return None, spec.attention_chunk_size
    return None, None


class PagedEngine:
    """Serves requests with ``model`` over a pagedkv-managed paged KV cache.

    Args:
        model: the model; the cache is allocated on its device.
        block_size: tokens per block (ignored when ``kv_cache_config`` is given).
        num_blocks: blocks in the pool, the null block included.
        kv_cache_config: a ready config (default: :func:`pagedkv.get_kv_cache_config`
            over ``model.kv_cache_specs(block_size)``).
        preemption_mode: ``"recompute"`` (free, recompute later) or ``"swap"`` (copy
            to a CPU pool of ``num_cpu_blocks`` blocks; recompute when it is full).
        poison_free_blocks: before every forward pass, fill the free blocks that hold
            no cached data, and the null block, with NaN: any read of them would show.
        record_logits: keep every computed logit row (for comparisons).
        offload: a host tier under the pool (:class:`~pagedkv.offload.OffloadConfig`):
            full chunks are copied to host memory after a step's forward pass (with
            ``write_through``, every chunk the step computed; with ``write_back``,
            released chunks about to be evicted from the device); a prefix found
            there is loaded back into the request's blocks before the forward pass
            that reads it (``host_hit_tokens`` counts them).
    """

    def __init__(
        self,
        model: TinyTransformer,
        *,
        block_size: int = 4,
        num_blocks: int = 256,
        kv_cache_config: KVCacheConfig | None = None,
        max_model_len: int = 256,
        max_num_reqs: int = 8,
        max_num_batched_tokens: int = 64,
        enable_caching: bool = True,
        hash_algo: str = "sha256_cbor",
        preemption_mode: str = "recompute",
        num_cpu_blocks: int = 0,
        poison_free_blocks: bool = False,
        record_logits: bool = True,
        offload: OffloadConfig | None = None,
    ) -> None:
        if preemption_mode not in _PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {_PREEMPTION_MODES}, got {preemption_mode!r}"
            )
        if preemption_mode == "swap" and num_cpu_blocks <= 0:
            raise ValueError("swap preemption needs num_cpu_blocks > 0")
        self.model = model
        if kv_cache_config is None:
            kv_cache_config = get_kv_cache_config(
                model.kv_cache_specs(block_size),
                0,
                max_model_len=max_model_len,
                num_gpu_blocks_override=num_blocks,
            )
        self.config = kv_cache_config
        self.device = model.embed.device
        self.manager = KVCacheManager(
            kv_cache_config,
            max_model_len,
            offload=offload,
            enable_caching=enable_caching,
            hash_algo=hash_algo,
        )
        self.kv_cache: KVCache = allocate_kv_cache(kv_cache_config, self.device)
        self.host_kv: HostKVStore | None = None
        if offload is not None:
            self.host_kv = HostKVStore(
                self.kv_cache, offload.num_chunks(kv_cache_config), offload.blocks_per_chunk
            )
        #: tokens whose KV was loaded back from the host tier
        self.host_hit_tokens = 0
        self._chunk_buffers: dict[int, npt.NDArray[np.uint8]] = {}
        self.block_tables = MultiGroupBlockTable.from_config(
            kv_cache_config, max_num_reqs, max_model_len, max_num_batched_tokens, self.device
        )
        self.max_model_len = max_model_len
        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.swapper = (
            KVSwapper(self.manager, self.kv_cache, num_cpu_blocks) if num_cpu_blocks > 0 else None
        )
        self.poison_free_blocks = poison_free_blocks
        self.record_logits = record_logits
        self.requests: dict[str, EngineRequest] = {}
        self._backend = _EngineBackend(self)
        self._sched = Scheduler(
            self._backend,
            SchedulerConfig(
                max_num_seqs=max_num_reqs,
                max_num_batched_tokens=max_num_batched_tokens,
                full_sequence_must_fit=False,
            ),
        )
        self._row_owner: list[EngineRequest] = []
        self._windows = [_window(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups]
        self._block_sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
        self.swap_ins: list[SwapInResult] = []
        self.num_steps = 0

    # ------------------------------------------------------------------ requests

    def add_request(
        self, request_id: str, prompt: Sequence[int], max_tokens: int, *, seed: int | None = None
    ) -> EngineRequest:
        """Queues a request that samples ``max_tokens`` tokens (greedy, or from the
        softmax with ``seed``)."""
        if request_id in self.requests:
            raise DuplicateRequestError(f"request {request_id!r} already exists")
        if max_tokens <= 0:
            raise InvalidArgumentError(f"max_tokens must be positive, got {max_tokens}")
        if len(prompt) + max_tokens > self.max_model_len:
            raise InvalidArgumentError(
                f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceed max_model_len "
                f"({self.max_model_len})"
            )
        req = EngineRequest(request_id, [int(t) for t in prompt], max_tokens=max_tokens, seed=seed)
        self._sched.add_request(req)
        self.requests[request_id] = req
        return req

    @property
    def waiting(self) -> deque[EngineRequest]:
        """Requests waiting for admission (preempted ones first), in order."""
        return self._sched.waiting

    @property
    def running(self) -> list[EngineRequest]:
        """Running requests, oldest admission first."""
        return self._sched.running

    @property
    def has_unfinished(self) -> bool:
        return self._sched.has_unfinished

    def run(self, max_steps: int = 100_000) -> list[StepOutput]:
        """Steps until every request has finished."""
        outs: list[StepOutput] = []
        while self.has_unfinished:
            if len(outs) >= max_steps:
                raise RuntimeError(f"requests still unfinished after {max_steps} steps")
            outs.append(self.step())
        return outs

    # ------------------------------------------------------------------ rows

    def _acquire_row(self, req: EngineRequest) -> None:
        req.row = len(self._row_owner)
        self._row_owner.append(req)

    def _release_row(self, req: EngineRequest) -> None:
        """Frees the request's row, moving the last row into it (rows stay dense)."""
        row = req.row
        last = self._row_owner.pop()
        if last is not req:
            self.block_tables.move_row(last.row, row)
            self._row_owner[row] = last
            self.block_tables.clear_row(last.row)
            last.row = row
        else:
            self.block_tables.clear_row(row)
        req.row = -1

    # ------------------------------------------------------------------ steps

    def step(self) -> StepOutput:
        """Schedules, runs the model on the scheduled tokens and samples."""
        out = self._backend.out = StepOutput([], [], [])
        self._sched.step()
        return out

    def _poison(self) -> None:
        mgr = self.manager
        ids = [0] + [int(b) for b in mgr.free_block_ids() if mgr.cached_block_hash(int(b)) is None]
        index = torch.tensor(ids, dtype=torch.long, device=self.device)
        for layer in self.kv_cache.layers.values():
            for t in layer.block_tensors:
                t[index] = float("nan")

    def _execute(self, scheduled: Sequence[tuple[EngineRequest, int]], out: StepOutput) -> None:
        """Runs the model over the scheduled tokens; returns nothing, but records each
        request's logits (when asked to) and keeps the last position's logits of
        every request that completes its tokens, for sampling."""
        # The host tier's reads and loads first: a request whose load failed
        # (a disk chunk that did not read back) computes from its valid
        # tokens on (this step's tokens, then the next steps').
        plan = self.manager.take_transfer_plan() if self.host_kv is not None else None
        if plan is not None:
            self._run_loads(plan)
        reqs = [r for r, _ in scheduled]
        ns = np.fromiter((n for _, n in scheduled), dtype=np.int64, count=len(scheduled))
        computed = np.fromiter(
            (r.num_computed_tokens for r in reqs), dtype=np.int64, count=len(reqs)
        )
        rows = np.fromiter((r.row for r in reqs), dtype=np.int64, count=len(reqs))
        total = int(ns.sum())

        t0 = time.perf_counter_ns()
        req_idx, positions = step_positions(rows, computed, ns)
        self.block_tables.compute_slot_mappings(req_idx, positions)
        t1 = time.perf_counter_ns()
        tables = self.block_tables.commit(len(self._row_owner))
        slots = self.block_tables.commit_slot_mappings(total)
        t2 = time.perf_counter_ns()
        out.slot_mapping_ns, out.upload_ns = t1 - t0, t2 - t1

        tokens = np.concatenate(
            [
                np.asarray(r.tokens[c : c + n], dtype=np.int64)
                for r, c, n in zip(reqs, computed.tolist(), ns.tolist(), strict=True)
            ]
        )
        qsl = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(ns, out=qsl[1:])
        seq_lens = computed + ns
        metadata = [
            AttentionMetadata(
                tables[g], slots[g], qsl, seq_lens, rows, self._block_sizes[g], *self._windows[g]
            )
            for g in range(len(self._block_sizes))
        ]
        if self.poison_free_blocks:
            self._poison()
        logits = self.model.forward_paged(
            torch.from_numpy(tokens).to(self.device),
            torch.from_numpy(positions).to(self.device),
            self.kv_cache,
            metadata,
        )

        if plan is not None:
            self._run_stores(plan)
        last = self._backend.last_logits
        for i, req in enumerate(reqs):
            qs, qe = int(qsl[i]), int(qsl[i + 1])
            if self.record_logits:
                req.logit_chunks.append((req.num_computed_tokens, logits[qs:qe].cpu()))
            req.num_model_tokens += qe - qs
            if req.num_computed_tokens + (qe - qs) == req.num_tokens:
                last[req.request_id] = logits[qe - 1]

    def _run_loads(self, plan: TransferPlan) -> None:
        """Runs a plan's disk reads, then its loads (host to device), waits for
        them and reports them; a request whose load failed (its disk read did
        not read back) goes back to the tokens it still holds."""
        host = self.host_kv
        assert host is not None
        unread: set[int] = set()
        for r in plan.disk_reads:
            buf = self._chunk_buffer(r.group)
            if self.manager.read_disk_chunk(r.job, buf):
                host.set_chunk_bytes(r.group, r.host_blocks, buf)
            elif r.load_job is not None:
                _log.warning(
                    "disk chunk of group %d did not read back (corrupt, truncated or gone): "
                    "its tokens are recomputed",
                    r.group,
                )
                unread.add(r.load_job)
        copies = [
            host.load_blocks(t.group, t.device_blocks, t.host_blocks)
            for t in plan.loads
            if t.job not in unread
        ]
        for c in copies:
            c.wait()
        jobs = list(dict.fromkeys(t.job for t in plan.loads))
        failed = self.manager.complete_transfers(
            [j for j in jobs if j not in unread], [j for j in jobs if j in unread]
        )
        for rid, n in failed:
            req = self.requests[rid]
            self.host_hit_tokens -= req.num_computed_tokens - n
            req.num_computed_tokens = n

    def _run_stores(self, plan: TransferPlan) -> None:
        """Runs a plan's stores (device to host) and its disk writes (host to
        disk), waits for them and reports them."""
        host = self.host_kv
        assert host is not None
        copies = [host.store_blocks(t.group, t.device_blocks, t.host_blocks) for t in plan.stores]
        for c in copies:
            c.wait()
        if plan.stores:
            failed = self.manager.complete_transfers(
                list(dict.fromkeys(t.job for t in plan.stores))
            )
            assert not failed
        for w in plan.disk_writes:
            data = host.chunk_bytes(w.group, w.host_blocks, out=self._chunk_buffer(w.group))
            self.manager.write_disk_chunk(w.job, data)

    def _chunk_buffer(self, group: int) -> npt.NDArray[np.uint8]:
        """A reused buffer of one chunk of ``group`` (disk reads and writes)."""
        buf = self._chunk_buffers.get(group)
        if buf is None:
            assert self.host_kv is not None
            buf = self._chunk_buffers[group] = np.empty(
                self.host_kv.chunk_nbytes(group), dtype=np.uint8
            )
        return buf

    def _sample(self, req: EngineRequest, logits: torch.Tensor) -> int:
        if req.seed is None:
            return int(torch.argmax(logits))
        p = torch.softmax(logits.double(), -1).cpu().numpy()
        rng = np.random.default_rng([req.seed, req.num_tokens])
        return int(rng.choice(len(p), p=p / p.sum()))

    # ------------------------------------------------------------------ forks

    def fork_request(
        self, parent_id: str, child_id: str, max_tokens: int, *, seed: int | None = None
    ) -> EngineRequest | None:
        """Starts ``child_id`` as a copy of running request ``parent_id`` (its tokens
        so far become the child's prompt), without recomputing them: full blocks the
        prefix cache holds are shared, the others (the partly filled last block
        among them) are copied into the child's own blocks. Call between steps.
        Returns None, adding nothing, when the pool lacks room."""
        parent = self.requests.get(parent_id)
        if parent is None:
            raise UnknownRequestError(f"unknown request {parent_id!r}")
        if parent.row < 0:
            raise InvalidArgumentError(f"request {parent_id!r} is not running")
        if child_id in self.requests:
            raise DuplicateRequestError(f"request {child_id!r} already exists")
        if len(self.running) >= self.max_num_reqs:
            return None
        mgr = self.manager
        tokens = parent.tokens
        if len(tokens) + max_tokens > self.max_model_len:
            raise InvalidArgumentError("the fork would exceed max_model_len")
        mgr.add_request(child_id, tokens)
        hit = mgr.get_computed_blocks(child_id)
        num_hit = hit.num_computed_tokens
        computed = max(num_hit, parent.num_computed_tokens)
        # Blocks are cached once they hold the data (see KVSwapper.swap_in).
        new = mgr.allocate_slots(
            child_id,
            computed - num_hit,
            num_computed_tokens=0,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hit,
            delay_cache_blocks=True,
        )
        if new is None:
            mgr.remove_request(child_id)
            return None
        mgr.remove_skipped_blocks(child_id, computed)
        child = EngineRequest(
            child_id, tokens, max_tokens=max_tokens, seed=seed, num_hit_tokens=num_hit
        )
        child.num_computed_tokens = computed
        parent_ids = mgr.get_block_ids(parent_id)
        child_ids = mgr.get_block_ids(child_id)
        copied = []
        for g, bs in enumerate(self._block_sizes):
            n = cdiv(parent.num_computed_tokens, bs)
            p, c = parent_ids[g][:n], child_ids[g][:n]
            move = (p != c) & (p != 0) & (c != 0)
            copy_blocks(self.kv_cache.group_block_tensors(g), p[move], c[move])
            copied.append(int(move.sum()))
        mgr.cache_blocks(child_id, computed)
        child.copied_blocks = tuple(copied)
        self.requests[child_id] = child
        self._acquire_row(child)
        self.block_tables.add_row(child_ids, child.row)
        self.running.append(child)
        return child

    # ------------------------------------------------------------------ checks

    def max_logit_error(self, request_id: str) -> float:
        """Largest absolute difference between the logits the engine computed for a
        request and the dense reference over its tokens (no paging, no cache); ``inf``
        when a computed logit is NaN."""
        req = self.requests[request_id]
        computed = req.computed_logits()
        if not computed:
            raise InvalidArgumentError(f"no logits recorded for {request_id!r}")
        dense = self.model.forward_dense(req.tokens[: max(computed) + 1]).cpu()
        positions = sorted(computed)
        paged = torch.stack([computed[p] for p in positions])
        diff = (paged - dense[positions]).abs()
        # A NaN (a read of a poisoned block) counts as an infinite error.
        return float(torch.nan_to_num(diff, nan=float("inf")).max())


class _EngineBackend(Backend[EngineRequest]):
    """The policy's calls for :class:`PagedEngine`: its manager, one call per
    request; its block-table rows; swapping; its model and sampler."""

    def __init__(self, engine: PagedEngine) -> None:
        super().__init__()
        self.engine = engine
        self.out = StepOutput([], [], [])
        #: request id -> logits of its last position, for those that sample this step
        self.last_logits: dict[str, torch.Tensor] = {}
        self._hit: ComputedBlocks | None = None

    def add_request(self, req: EngineRequest) -> None:
        self.engine.manager.add_request(req.request_id, req.prompt)

    def new_step(self) -> None:
        self.engine.manager.new_step_starts()
        self.engine.num_steps += 1

    def allocate(self, reqs: Sequence[EngineRequest], num_new_tokens: Sequence[int]) -> int:
        eng = self.engine
        for i, (req, n) in enumerate(zip(reqs, num_new_tokens, strict=True)):
            new = eng.manager.allocate_slots(
                req.request_id, n, num_computed_tokens=req.num_computed_tokens
            )
            if new is None:
                return i
            eng.block_tables.append_row(new, req.row)
        return len(reqs)

    def lookup(self, req: EngineRequest) -> int:
        if req.swapped is not None:
            return req.swapped.num_computed_tokens
        self._hit = hit = self.engine.manager.get_computed_blocks(req.request_id)
        return hit.num_computed_tokens + hit.num_host_tokens

    def admit(
        self,
        req: EngineRequest,
        num_new_tokens: int,
        num_hit_tokens: int,
        *,
        full_sequence_must_fit: bool,
        has_scheduled_reqs: bool,
    ) -> bool:
        eng = self.engine
        if req.swapped is not None:
            assert eng.swapper is not None
            res = eng.swapper.swap_in(req.swapped, num_new_tokens)
            if res is None:
                return False
            eng.swap_ins.append(res)
            req.swapped = None
        else:
            hit, self._hit = self._hit, None
            host = 0 if hit is None else hit.num_host_tokens
            new = eng.manager.allocate_slots(
                req.request_id,
                num_new_tokens,
                num_computed_tokens=0,
                num_new_computed_tokens=num_hit_tokens - host,
                new_computed_blocks=hit,
                num_external_computed_tokens=host,
                full_sequence_must_fit=full_sequence_must_fit,
                has_scheduled_reqs=has_scheduled_reqs,
            )
            if new is None:
                return False
            req.num_hit_tokens += num_hit_tokens
            eng.host_hit_tokens += host
        eng._acquire_row(req)
        eng.block_tables.add_row(eng.manager.get_block_ids(req.request_id), req.row)
        return True

    def preempt(self, req: EngineRequest) -> int:
        """Swaps the request out in swap mode while the CPU pool has room (it keeps
        its computed tokens), else frees its blocks (it is recomputed)."""
        eng = self.engine
        if eng.preemption_mode == "swap" and eng.swapper is not None:
            req.swapped = eng.swapper.swap_out(req.request_id, req.num_computed_tokens)
        kept = 0
        if req.swapped is not None:
            req.num_swaps += 1
            kept = req.num_computed_tokens
        else:
            eng.manager.free(req.request_id)
        eng._release_row(req)
        self.out.preempted.append(req.request_id)
        return kept

    def execute(self, scheduled: Sequence[tuple[EngineRequest, int]]) -> None:
        self.out.scheduled.extend((r.request_id, n) for r, n in scheduled)
        if scheduled:
            self.engine._execute(scheduled, self.out)

    def next_tokens(self, reqs: Sequence[EngineRequest]) -> list[int]:
        tokens = []
        for req in reqs:
            token = self.engine._sample(req, self.last_logits.pop(req.request_id))
            req.output.append(token)
            tokens.append(token)
        return tokens

    def append_tokens(self, reqs: Sequence[EngineRequest], tokens: Sequence[int]) -> None:
        for req, token in zip(reqs, tokens, strict=True):
            self.engine.manager.append_token_ids(req.request_id, [token])

    def finish(self, req: EngineRequest) -> None:
        req.finished = True
        self.engine.manager.remove_request(req.request_id)
        self.engine._release_row(req)
        self.out.finished.append(req.request_id)
