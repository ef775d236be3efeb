"""A continuous-batching scheduler loop over :class:`~pagedkv.KVCacheManager`,
modelled on vLLM 0.33's ``Scheduler.schedule()`` + ``update_from_output()`` (FCFS,
chunked prefill under a token budget, preemption by recompute, no speculative
decoding, no KV connector).

Each step: running requests get ``min(remaining, budget)`` new tokens, in order,
through one ``allocate_slots_batch`` crossing; a request that does not fit
preempts the newest running request (its blocks are freed, it goes back to the
front of the waiting queue) and is retried; if it was its own victim the running
pass stops. Only in a step without preemption, waiting requests are admitted
(``get_computed_blocks`` + ``allocate_slots`` with ``full_sequence_must_fit``)
until the first that does not fit. Then every scheduled request "executes": a
request whose prompt is fully computed samples its next output token, and one
with all its output tokens finishes.

Driven by the same workload, it makes exactly the manager calls vLLM's
scheduler makes, so ``alloc_checksum`` equals the one vLLM's own manager gives
(FNV-1a-64 over every ``allocate_slots`` result).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._util import FNV_OFFSET_BASIS, MASK64, fnv1a64
from .manager import KVCacheManager

__all__ = ["Scheduler", "SchedulerConfig", "SimRequest", "StepStats"]


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    #: vLLM's default admission gate (``scheduler_reserve_full_isl``).
    full_sequence_must_fit: bool = True
    #: After admission a request has computed its prefix hit, as in vLLM's
    #: scheduler. False reproduces the oracle's reference drive loop, which leaves
    #: the hit tokens to be computed again in the next step.
    hits_count_as_computed: bool = True


@dataclass(eq=False)
class SimRequest:
    """A request of the workload: its prompt and the tokens it will sample."""

    request_id: str
    prompt: Sequence[int] | np.ndarray
    output: Sequence[int]
    arrival_step: int = 0
    #: extra keys of the request's block hashes (vLLM's LoRA and cache-salt keys)
    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    # scheduler state
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    admitted_once: bool = False
    #: How batch calls name the request: the handle ``add_request`` returned
    #: (an int; skips the id lookup), or the id for managers without handles.
    handle: int | str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + self.num_output_tokens


@dataclass
class StepStats:
    """Counters and time inside the manager, summed over steps."""

    steps: int = 0
    admissions: int = 0
    preemptions: int = 0
    finished: int = 0
    hit_tokens: int = 0
    query_tokens: int = 0
    #: the same, for admissions of requests never preempted (vLLM's prefix-cache
    #: hit-rate metric leaves re-admissions after a preemption out)
    first_hit_tokens: int = 0
    first_query_tokens: int = 0
    peak_running: int = 0
    manager_calls: int = 0
    #: nanoseconds inside manager calls, per API
    ns: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    alloc_checksum: int = FNV_OFFSET_BASIS

    def timed(self, api: str, ns: int, calls: int = 1) -> None:
        self.ns[api] = self.ns.get(api, 0) + ns
        self.calls[api] = self.calls.get(api, 0) + calls

    def feed(self, words: Sequence[int] | np.ndarray) -> None:
        self.alloc_checksum = fnv1a64(words, self.alloc_checksum)

    @property
    def manager_ns(self) -> int:
        return sum(self.ns.values())


class Scheduler:
    """FCFS continuous batching with chunked prefill over one manager."""

    def __init__(self, manager: KVCacheManager, config: SchedulerConfig | None = None) -> None:
        self.kv = manager
        self.cfg = config or SchedulerConfig()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.stats = StepStats()
        self._groups = manager.num_kv_cache_groups
        self._clock = time.perf_counter_ns

    # -- requests -----------------------------------------------------------

    def add_request(self, req: SimRequest) -> None:
        """Registers the request with the manager (hashing its prompt) and queues it."""
        t = self._clock()
        if req.lora_name is None and req.cache_salt is None:
            handle = self.kv.add_request(req.request_id, req.prompt)
        else:
            handle = self.kv.add_request(req.request_id, req.prompt, lora_name=req.lora_name,
                                         lora_path=req.lora_path, cache_salt=req.cache_salt)
        self.stats.timed("add_request", self._clock() - t)
        req.handle = handle if isinstance(handle, int) else req.request_id
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------

    def _feed_alloc(self, groups: Sequence[np.ndarray] | None) -> None:
        st = self.stats
        if groups is None:
            st.feed((MASK64,))
        else:
            words: list[int] = [len(groups)]
            for g in groups:
                words.append(len(g))
                words.extend(g.tolist())
            st.feed(words)

    def _preempt(self, victim: SimRequest) -> None:
        t = self._clock()
        self.kv.free(victim.request_id)
        self.stats.timed("free", self._clock() - t)
        self.stats.manager_calls += 1
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        self.stats.preemptions += 1

    def _schedule_running(
        self, budget: int, scheduled: list[tuple[SimRequest, int]]
    ) -> tuple[int, bool]:
        """Running requests, one batch crossing per run of successes."""
        st, kv, clock = self.stats, self.kv, self._clock
        preempted = False
        ri = 0
        while ri < len(self.running) and budget > 0:
            ids: list[Any] = []  # all handles, or all ids
            new: list[int] = []
            computed: list[int] = []
            b = budget
            for req in self.running[ri:]:
                if b <= 0:
                    break
                n = min(req.num_tokens - req.num_computed_tokens, b)
                ids.append(req.handle)
                new.append(n)
                computed.append(req.num_computed_tokens)
                b -= n
            t = clock()
            n_ok, groups = kv.allocate_slots_batch(ids, np.asarray(new, dtype=np.int64),
                                                   np.asarray(computed, dtype=np.int64))
            st.timed("allocate_slots_batch", clock() - t)
            st.calls["allocate_slots"] = st.calls.get("allocate_slots", 0) + n_ok
            for i in range(n_ok):
                per_group = [blocks[offsets[i]:offsets[i + 1]] for blocks, offsets in groups]
                self._feed_alloc(per_group)
                scheduled.append((self.running[ri + i], new[i]))
                budget -= new[i]
            st.manager_calls += n_ok
            ri += n_ok
            if n_ok == len(ids):
                continue
            # running[ri] did not fit: preempt the newest running request, retry.
            st.manager_calls += 1
            self._feed_alloc(None)
            req = self.running[ri]
            victim = self.running.pop()
            self._preempt(victim)
            preempted = True
            if victim is req:
                break
        return budget, preempted

    def _admit(self, budget: int, scheduled: list[tuple[SimRequest, int]]) -> None:
        st, kv, clock = self.stats, self.kv, self._clock
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            t = clock()
            hit = kv.get_computed_blocks(req.request_id)
            st.timed("get_computed_blocks", clock() - t)
            num_hit = hit.num_computed_tokens
            n = min(req.num_tokens - num_hit, budget)
            t = clock()
            res = kv.allocate_slots(req.request_id, n, num_computed_tokens=0,
                                    num_new_computed_tokens=num_hit, new_computed_blocks=hit,
                                    full_sequence_must_fit=self.cfg.full_sequence_must_fit,
                                    has_scheduled_reqs=bool(self.running))
            st.timed("allocate_slots(admit)", clock() - t)
            st.manager_calls += 2
            self._feed_alloc(res)
            if res is None:
                if not self.running:
                    raise RuntimeError(f"request {req.request_id} ({req.num_tokens} tokens) "
                                       "can never be admitted")
                break
            self.waiting.popleft()
            if self.cfg.hits_count_as_computed:
                req.num_computed_tokens = num_hit
            self.running.append(req)
            st.admissions += 1
            st.hit_tokens += num_hit
            st.query_tokens += req.num_tokens
            if req.num_preemptions == 0:
                st.first_hit_tokens += num_hit
                st.first_query_tokens += req.num_tokens
            scheduled.append((req, n))
            budget -= n

    def step(self) -> list[SimRequest]:
        """Runs one scheduler step; returns the requests that finished."""
        st, kv, clock = self.stats, self.kv, self._clock
        t = clock()
        kv.new_step_starts()
        st.timed("new_step_starts", clock() - t)
        st.manager_calls += 1
        scheduled: list[tuple[SimRequest, int]] = []
        budget, preempted = self._schedule_running(self.cfg.max_num_batched_tokens, scheduled)
        if not preempted:
            self._admit(budget, scheduled)
        st.peak_running = max(st.peak_running, len(self.running))
        done: list[SimRequest] = []
        sampled_ids: list[Any] = []
        sampled: list[int] = []
        for req, n in scheduled:
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                sampled_ids.append(req.handle)
                sampled.append(req.output[req.num_output_tokens])
                req.num_output_tokens += 1
                if req.num_output_tokens >= len(req.output):
                    done.append(req)
        if sampled_ids:
            # One crossing appends every sampled token (blocks that fill get hashed).
            t = clock()
            kv.append_token_ids_batch(sampled_ids, sampled)
            st.timed("append_token_ids_batch", clock() - t)
        for req in done:
            t = clock()
            kv.remove_request(req.request_id)
            st.timed("remove_request", clock() - t)
            st.manager_calls += 1
            st.finished += 1
        if done:
            gone = set(map(id, done))
            self.running = [r for r in self.running if id(r) not in gone]
        st.steps += 1
        return done
