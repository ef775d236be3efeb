"""The scheduler policy: one continuous-batching loop, modelled on vLLM 0.33's
``Scheduler.schedule()`` + ``update_from_output()`` (FCFS, chunked prefill under a
token budget, preemption of the newest running request by recompute, no
speculative decoding, no KV connector), and the simulation clock that feeds it.

Each step:

1. running requests, in order, get ``min(remaining tokens, budget)`` new tokens
   (chunked prefill and decode alike); one that does not fit preempts the newest
   running request, which goes back to the front of the waiting queue, and is
   retried; if it was its own victim the running pass stops;
2. only in a step without preemption, waiting requests are admitted in FCFS order
   (prefix-cache lookup, then an allocation) while ``max_num_seqs`` and the budget
   allow, until the first that does not fit;
3. the scheduled requests execute; each whose tokens are all computed samples its
   next output token, and one with all its output tokens finishes.

The policy makes the decisions; a :class:`Backend` makes the calls: pagedkv's
manager (:class:`pagedkv.sim.backend.ManagerBackend`, batch crossings), vLLM's
own ``KVCacheManager`` (``VllmBackend`` in ``pagedkv.sim.vllm_engine``, one call
per request as vLLM's scheduler makes them), or the torch engine's manager and
model (``pagedkv.torch.PagedEngine``). Driven by the same requests, every backend
sees the same decisions, so equal ``alloc_checksum`` values mean equal block ids.
:func:`drive` is the arrival clock of every caller that replays a workload.

Where callers behave differently, the difference is an explicit option:

- ``SchedulerConfig.hits_count_as_computed=False``: the oracle's reference drive
  loop (``benches/drive_bench.py``, the vLLM checksum of
  ``tests/sim/test_scheduler.py``, and the pure-Rust floor in ``benches/src/lib.rs``)
  computes prefix hits again after admission;
- ``SchedulerConfig.full_sequence_must_fit=False``: the torch engine admits a
  request once its first chunk fits, where vLLM's default waits for the whole
  sequence;
- :meth:`Backend.preempt` returns the computed tokens a victim keeps: 0 for
  preemption by recompute, all of them when the torch engine swaps the request to
  its CPU pool; such a request's :meth:`Backend.lookup` then returns them, and
  it resumes where it stopped.

:func:`drive_timed` is the same loop on a clock in seconds, each step lasting what
a :mod:`pagedkv.sim.steptime` model says it takes.

Standard library only (besides ``pagedkv._util`` and ``sim/steptime.py``, both
standard library only):
``sim/vllm_engine.py`` imports this file in an interpreter that has vLLM but not
pagedkv.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .._util import FNV_OFFSET_BASIS, MASK64, fnv1a64
from .steptime import Latencies, StepShape, StepTimeModel

if TYPE_CHECKING:
    from numpy.typing import NDArray

__all__ = [
    "Backend",
    "Request",
    "Scheduler",
    "SchedulerConfig",
    "StepStats",
    "Timeline",
    "drive",
    "drive_timed",
    "sessions",
    "timed_step",
]


@dataclass(eq=False)
class Request:
    """A request: what a workload asks for, and where the scheduler has got with it.

    ``output`` holds the output token ids: for a replayed workload all of them up
    front (the request "samples" them one per decode step, in order), for a live
    model (the torch engine) those sampled so far.
    """

    request_id: str
    prompt: Sequence[int] | NDArray[Any]
    output: Sequence[int]
    #: the step at which the request reaches the scheduler
    arrival_step: int = 0
    #: turns of one session run one after the other, ``pause`` steps apart
    session: str | None = None
    #: steps between the end of the session's previous turn and this one
    pause: int = 0
    #: On the timed clock (:func:`drive_timed`): arrival and pause in seconds; None:
    #: ``arrival_step`` and ``pause`` ticks of the clock's ``tick_s``.
    arrival_s: float | None = None
    pause_s: float | None = None
    #: extra keys of the request's block hashes (vLLM's cache-salt and LoRA keys)
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    #: output tokens after which the request finishes (vLLM's ``max_tokens``);
    #: 0 on construction: ``len(output)``
    max_tokens: int = 0
    # Scheduler state (not constructor arguments: a fresh request has none).
    num_computed_tokens: int = field(default=0, init=False)
    num_output_tokens: int = field(default=0, init=False)
    num_preemptions: int = field(default=0, init=False)
    #: where the request's prompt leaves the longest cached prefix it shares
    #: (``get_computed_blocks``' shared-prefix junction; 0: none)
    shared_prefix_boundary: int = field(default=0, init=False)
    #: How the backend names the request: pagedkv's handle from ``add_request`` (or
    #: the id for managers without handles), vLLM's ``Request`` object.
    handle: Any = field(default=None, init=False, repr=False)
    #: The token sampled at the request's last step that the backend has not
    #: handed to the manager yet (-1: none); a backend that hands it over with
    #: the request's next allocation keeps it here.
    sampled: int = field(default=-1, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.max_tokens:
            self.max_tokens = len(self.output)

    @property
    def num_tokens(self) -> int:
        """Prompt tokens plus the output tokens sampled so far."""
        return len(self.prompt) + self.num_output_tokens

    @property
    def max_num_tokens(self) -> int:
        """Prompt tokens plus ``max_tokens``: the longest the request gets."""
        return len(self.prompt) + self.max_tokens

    def fresh(self) -> Request:
        """The same request with no scheduler state (for another run)."""
        return replace(self)


@dataclass
class SchedulerConfig:
    """The policy's knobs; the defaults are vLLM's."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    #: Admit a request only when its whole sequence fits (vLLM's default admission
    #: gate, ``scheduler_reserve_full_isl``); the torch engine admits on the first
    #: chunk (False).
    full_sequence_must_fit: bool = True
    #: After admission a request has computed its prefix hit, as in vLLM's
    #: scheduler. False reproduces the oracle's reference drive loop (and the
    #: pure-Rust floor in ``benches/src/lib.rs``), which leaves the hit tokens to
    #: be computed again in the next step.
    hits_count_as_computed: bool = True
    #: Block size of the Mamba groups of a hybrid model in ``align`` cache mode
    #: (vLLM's ``cache_config.block_size``): prefill chunks then end where a Mamba
    #: state can be cached (vLLM's ``_mamba_block_aligned_split``). None: no Mamba.
    mamba_block_size: int | None = None


@dataclass
class StepStats:
    """What the policy counts, and the backend's time and calls inside the manager."""

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
    #: manager calls as the backend counts them
    manager_calls: int = 0
    #: nanoseconds inside manager calls, per API
    ns: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    #: FNV-1a-64 over every allocation result (:meth:`feed_allocation`)
    alloc_checksum: int = FNV_OFFSET_BASIS

    def timed(self, api: str, ns: int, calls: int = 1) -> None:
        self.ns[api] = self.ns.get(api, 0) + ns
        self.calls[api] = self.calls.get(api, 0) + calls

    def feed(self, words: Sequence[int]) -> None:
        self.alloc_checksum = fnv1a64(words, self.alloc_checksum)

    def feed_allocation(self, groups: Sequence[Sequence[int] | NDArray[Any]] | None) -> None:
        """Folds one ``allocate_slots`` result into ``alloc_checksum``: ``None`` (no
        room) as one all-ones word, else the number of groups, then each group's
        length and block ids."""
        if groups is None:
            self.feed((MASK64,))
            return
        words: list[int] = [len(groups)]
        for g in groups:
            words.append(len(g))
            words.extend(g.tolist() if hasattr(g, "tolist") else g)
        self.feed(words)

    @property
    def manager_ns(self) -> int:
        return sum(self.ns.values())


R = TypeVar("R", bound=Request)


class Backend(ABC, Generic[R]):
    """The calls behind the policy's decisions. Each method is one decision's worth
    of manager calls; a backend also times them into :attr:`stats`."""

    def __init__(self) -> None:
        self.stats = StepStats()
        #: seconds the last step waited for copies before its forward pass
        #: (loads from a host tier); 0 without one
        self.transfer_s = 0.0

    @abstractmethod
    def add_request(self, req: R) -> None:
        """Registers a request that has just arrived (its prompt gets hashed)."""

    @abstractmethod
    def new_step(self) -> None:
        """A step starts."""

    @abstractmethod
    def allocate(self, reqs: Sequence[R], num_new_tokens: Sequence[int]) -> int:
        """Slots for running requests, in order, until the first that does not fit;
        returns how many fit."""

    @abstractmethod
    def lookup(self, req: R) -> int:
        """Admission, first half: the tokens a waiting request already has (its
        prefix-cache hit). The backend keeps what :meth:`admit` needs."""

    @abstractmethod
    def admit(
        self,
        req: R,
        num_new_tokens: int,
        num_hit_tokens: int,
        *,
        full_sequence_must_fit: bool,
        has_scheduled_reqs: bool,
    ) -> bool:
        """Admission, second half: slots for the looked-up request; False, touching
        nothing, when they do not fit."""

    @abstractmethod
    def preempt(self, req: R) -> int:
        """Takes a running request's blocks away; returns the computed tokens it
        keeps (0: recomputed on readmission)."""

    def execute(self, scheduled: Sequence[tuple[R, int]]) -> None:
        """Runs the step's scheduled tokens (a model does; a manager alone has
        nothing to run)."""

    def next_tokens(self, reqs: Sequence[R]) -> list[int]:
        """The next output token of each request whose tokens are all computed:
        by default the workload's next given token."""
        return [r.output[r.num_output_tokens] for r in reqs]

    @abstractmethod
    def append_tokens(self, reqs: Sequence[R], tokens: Sequence[int]) -> None:
        """Gives the sampled tokens to the manager (blocks that fill get hashed)."""

    @abstractmethod
    def finish(self, req: R) -> None:
        """A request has all its output tokens: its blocks go back."""

    def clock_to(self, t: float) -> None:
        """The clock reached ``t`` (a step starts): background copies done by
        then complete. Nothing to do without them."""

    def step_ended(self, t: float) -> None:
        """The step ended at ``t``: its background copies start."""

    def next_transfer_done(self) -> float | None:
        """When the next background copy completes; None: none in flight."""
        return None

    def transfers_pending(self) -> bool:
        """Whether copies are in flight (their blocks held until they complete)."""
        return False


class Scheduler(Generic[R]):
    """The policy (see the module docstring) over one backend."""

    def __init__(self, backend: Backend[R], config: SchedulerConfig | None = None) -> None:
        self.backend = backend
        self.cfg = config or SchedulerConfig()
        self.stats = backend.stats
        self.waiting: deque[R] = deque()
        self.running: list[R] = []
        #: the last step's scheduled ``(request, new tokens)``, the requests that
        #: sampled a token, and (with ``track_shape``) what it computed
        self.last_scheduled: list[tuple[R, int]] = []
        self.last_sampled: list[R] = []
        self.track_shape = False
        self.last_shape = StepShape()

    def add_request(self, req: R) -> None:
        """Registers the request with the backend and queues it."""
        self.backend.add_request(req)
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[R]:
        """Runs one scheduler step; returns the requests that finished."""
        be, st = self.backend, self.stats
        be.new_step()
        scheduled: list[tuple[R, int]] = []
        budget, preempted = self._schedule_running(self.cfg.max_num_batched_tokens, scheduled)
        if not preempted:
            self._admit(budget, scheduled)
        st.peak_running = max(st.peak_running, len(self.running))
        be.execute(scheduled)
        sampling: list[R] = []
        if self.track_shape:
            shape = self.last_shape = StepShape()
            for req, n in scheduled:
                c = req.num_computed_tokens
                if n == 1 and c >= len(req.prompt):
                    shape.decode.append(c + 1)
                else:
                    shape.prefill.append((n, c))
        for req, n in scheduled:
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                sampling.append(req)
        self.last_scheduled = scheduled
        self.last_sampled = sampling
        self.last_shape.sampled = len(sampling)
        done: list[R] = []
        if sampling:
            tokens = be.next_tokens(sampling)
            be.append_tokens(sampling, tokens)
            for req in sampling:
                req.num_output_tokens += 1
                if req.num_output_tokens >= req.max_tokens:
                    done.append(req)
        for req in done:
            be.finish(req)
            st.finished += 1
        if done:
            gone = set(map(id, done))
            self.running = [r for r in self.running if id(r) not in gone]
        st.steps += 1
        return done

    def _schedule_running(self, budget: int, scheduled: list[tuple[R, int]]) -> tuple[int, bool]:
        """Running requests in order; a run of them goes to the backend at once."""
        running = self.running
        mamba = self.cfg.mamba_block_size is not None
        preempted = False
        ri = 0
        while ri < len(running) and budget > 0:
            batch: list[R] = []
            new: list[int] = []
            index: list[int] = []
            b = budget
            j = ri
            while j < len(running) and b > 0:
                req = running[j]
                j += 1
                n = min(req.num_tokens - req.num_computed_tokens, b)
                if mamba:
                    n = self._mamba_split(req, n, req.num_computed_tokens)
                    if n == 0:  # mid-block, and the budget ends before the boundary
                        continue
                batch.append(req)
                new.append(n)
                index.append(j - 1)
                b -= n
            if not batch:
                break
            n_ok = self.backend.allocate(batch, new)
            for i in range(n_ok):
                scheduled.append((batch[i], new[i]))
                budget -= new[i]
            if n_ok == len(batch):
                ri = j
                continue
            # batch[n_ok] did not fit: preempt the newest running request, retry.
            ri = index[n_ok]
            victim = running.pop()
            self._preempt(victim)
            preempted = True
            if victim is batch[n_ok]:
                break
        return budget, preempted

    def _mamba_split(self, req: R, num_new_tokens: int, start: int) -> int:
        """vLLM 0.33's ``_mamba_block_aligned_split`` (no EAGLE, no lookahead, no
        partial hash hits, no prefill checkpoint blocks): a prefill chunk ends on a
        block boundary, at the last boundary whose state can be cached, or at the
        block-floored shared-prefix junction, so hybrid Mamba models cache states
        other requests can resume from."""
        bs = self.cfg.mamba_block_size
        assert bs is not None
        prefill_end = max(len(req.prompt), req.num_tokens - 1)
        if start >= prefill_end:
            return num_new_tokens
        # The last block boundary before the last token (its logits are recomputed).
        last_cache_position = max((req.num_tokens - 1) // bs * bs, 0)
        end = start + num_new_tokens
        if end < prefill_end:
            aligned_end = end // bs * bs
            if aligned_end > start or bs <= self.cfg.max_num_batched_tokens:
                end = aligned_end
        next_block_boundary = (start // bs + 1) * bs
        junction = req.shared_prefix_boundary
        junction_stop = start + (junction - start) // bs * bs
        stops = (
            next_block_boundary if start % bs != 0 else 0,
            last_cache_position,
            junction_stop if start < junction < end else 0,
        )
        end = min((x for x in stops if start < x < end), default=end)
        return max(end - start, 0)

    def _preempt(self, victim: R) -> None:
        victim.num_computed_tokens = self.backend.preempt(victim)
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        self.stats.preemptions += 1

    def _admit(self, budget: int, scheduled: list[tuple[R, int]]) -> None:
        st, be, cfg = self.stats, self.backend, self.cfg
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            num_hit = be.lookup(req)
            n = min(req.num_tokens - num_hit, budget)
            if cfg.mamba_block_size is not None:
                n = self._mamba_split(req, n, num_hit)
                if n == 0:
                    break
            if not be.admit(
                req,
                n,
                num_hit,
                full_sequence_must_fit=cfg.full_sequence_must_fit,
                has_scheduled_reqs=bool(self.running),
            ):
                # Blocks held by copies in flight come back when they complete.
                if not self.running and not be.transfers_pending():
                    raise RuntimeError(
                        f"request {req.request_id!r} ({req.num_tokens} tokens) "
                        "can never be admitted"
                    )
                break
            self.waiting.popleft()
            if cfg.hits_count_as_computed:
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


# ------------------------------------------------------------------ the clock


def drive(
    sched: Scheduler[R],
    items: Sequence[R],
    make_request: Callable[[int], R] | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> int:
    """Runs ``sched`` until every request of ``items`` has arrived and finished.

    Time is counted in scheduler steps. A request is ready at its ``arrival_step``;
    one that belongs to a session and is not the session's first turn is ready no
    earlier than ``pause`` steps after the step in which the session's previous
    turn finished (a user reading an answer, an agent waiting for a tool call).
    When nothing is running or waiting, the clock jumps to the next ready request;
    such idle steps are not scheduler steps.

    ``make_request(i)`` gives the request to add for ``items[i]`` when it becomes
    ready (default: ``items[i]`` itself; its ``request_id`` must be the item's);
    ``on_step(clock, num_finished)`` is called after every step. Returns the clock
    at the end (the step after the last one).
    """
    successor, ready = sessions(items, lambda item: item.arrival_step)
    clock = 0
    finished = 0
    while ready or sched.has_unfinished:
        if not sched.has_unfinished:
            clock = max(clock, int(ready[0][0]))
        while ready and ready[0][0] <= clock:
            _, i = heapq.heappop(ready)
            sched.add_request(items[i] if make_request is None else make_request(i))
        done = sched.step()
        finished += len(done)
        for req in done:
            j = successor.pop(req.request_id, None)
            if j is not None:
                nxt = items[j]
                heapq.heappush(ready, (float(max(nxt.arrival_step, clock + 1 + nxt.pause)), j))
        if on_step is not None:
            on_step(clock, finished)
        clock += 1
    if finished != len(items):  # pragma: no cover - a scheduler bug, not a user error
        raise RuntimeError(f"{finished} of {len(items)} requests finished")
    return clock


def sessions(
    items: Sequence[R], ready_at: Callable[[R], float]
) -> tuple[dict[str, int], list[tuple[float, int]]]:
    """(request id -> index of its session's next turn, heap of ``(ready time,
    index)`` of the requests that do not wait for an earlier turn)."""
    successor: dict[str, int] = {}
    last_of_session: dict[str, int] = {}
    ready: list[tuple[float, int]] = []
    for i, item in enumerate(items):
        s = item.session
        if s is not None and s in last_of_session:
            successor[items[last_of_session[s]].request_id] = i
        else:
            ready.append((ready_at(item), i))
        if s is not None:
            last_of_session[s] = i
    heapq.heapify(ready)
    return successor, ready


class Timeline(Generic[R]):
    """The arrivals of a timed run and what each request saw: ready times (first
    turns at their arrival, later turns of a session their pause after the
    previous turn finished), and the :class:`Latencies` of every step. Shared by
    :func:`drive_timed` and the many-replica loop of ``pagedkv.sim.cluster``."""

    def __init__(
        self,
        items: Sequence[R],
        tick_s: float,
        latencies: Latencies | None = None,
        *,
        max_concurrency: int | None = None,
    ) -> None:
        if not (tick_s > 0 and math.isfinite(tick_s)):
            raise ValueError(f"tick_s must be positive, got {tick_s}")
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.items = items
        self.tick_s = tick_s
        self.lat = latencies if latencies is not None else Latencies()
        self.successor, self.ready = sessions(items, self.arrival)
        self.finished = 0
        #: With ``max_concurrency`` (closed-loop clients, as ``benchmark_serving
        #: --max-concurrency`` drives a server): the times at which the free client
        #: slots became free (a min-heap; a slot is taken when a request is sent
        #: and given back when it finishes). None: no limit.
        self.free_slots: list[float] | None = (
            None if max_concurrency is None else [-math.inf] * max_concurrency
        )

    def arrival(self, item: R) -> float:
        return item.arrival_s if item.arrival_s is not None else item.arrival_step * self.tick_s

    def next_send(self) -> float:
        """When the next request reaches the server: the earliest ready time, no
        earlier than a free client slot (``inf``: none is ready, or every slot
        is taken until a request in flight finishes)."""
        if not self.ready:
            return math.inf
        if self.free_slots is None:
            return self.ready[0][0]
        if not self.free_slots:
            return math.inf
        return max(self.ready[0][0], self.free_slots[0])

    def pop_ready(self) -> tuple[float, int]:
        """Sends the earliest ready request: ``(send time, index)``. The send time
        is its arrival at the server (TTFT and end-to-end latency count from it):
        its ready time, or later when it waited client-side for a free slot (the
        slot that became free first)."""
        t, i = heapq.heappop(self.ready)
        if self.free_slots is not None:
            t = max(t, heapq.heappop(self.free_slots))
        return t, i

    def stepped(self, sched: Scheduler[R], start: float, end: float, done: Sequence[R]) -> None:
        """Records a step of ``sched`` that ran from ``start`` to ``end``: first
        schedules, sampled tokens, finishes; queues the next turns of the
        sessions that finished."""
        lat = self.lat
        for req, _ in sched.last_scheduled:
            lat.scheduled(req.request_id, start)
        for req in sched.last_sampled:
            lat.token(req.request_id, end)
        self.finished += len(done)
        for req in done:
            lat.finished(req.request_id, end)
            if self.free_slots is not None:
                heapq.heappush(self.free_slots, end)
            j = self.successor.pop(req.request_id, None)
            if j is not None:
                nxt = self.items[j]
                pause = nxt.pause_s if nxt.pause_s is not None else nxt.pause * self.tick_s
                heapq.heappush(self.ready, (max(self.arrival(nxt), end + pause), j))

    def check_done(self) -> None:
        if self.finished != len(self.items):  # pragma: no cover - a scheduler bug
            raise RuntimeError(f"{self.finished} of {len(self.items)} requests finished")


def timed_step(sched: Scheduler[R], model: StepTimeModel, start: float) -> tuple[list[R], float]:
    """One step of ``sched`` starting at ``start`` on the clock: returns the
    requests that finished and when the step ends. It lasts what ``model`` says
    its shape takes, plus the copies its forward pass waits for; background
    copies complete as the clock passes them, and a step that could schedule
    nothing because copies hold its blocks ends when the next one completes."""
    be = sched.backend
    be.clock_to(start)
    done = sched.step()
    end = start + max(model.step_seconds(sched.last_shape), 1e-9) + be.transfer_s
    if not sched.last_scheduled:
        nxt = be.next_transfer_done()
        if nxt is not None:
            end = max(end, nxt)
    be.step_ended(end)
    return done, end


def drive_timed(
    sched: Scheduler[R],
    items: Sequence[R],
    model: StepTimeModel,
    *,
    tick_s: float,
    make_request: Callable[[int], R] | None = None,
    on_step: Callable[[float, int], None] | None = None,
    latencies: Latencies | None = None,
    max_concurrency: int | None = None,
) -> float:
    """Runs ``sched`` until every request of ``items`` has arrived and finished,
    on a clock in seconds: each step lasts what ``model`` says its shape takes.

    A request is ready at ``arrival_s`` (else ``arrival_step * tick_s``); a later
    turn of a session ``pause_s`` (else ``pause * tick_s``) after the previous turn
    finished, and no earlier than its own arrival. With ``max_concurrency`` N, at
    most N requests are in flight (sent and not finished, session turns
    included): a ready request waits client-side for one to finish, and arrives
    when it is sent. Requests that arrive while a step runs join before the next
    step; when nothing is running or waiting the clock jumps to the next
    arrival. Tokens sampled in a step exist at its end. ``latencies`` receives
    every request's times; ``on_step(clock, finished)`` runs after every step.
    Returns the clock at the end.
    """
    tl = Timeline(items, tick_s, latencies, max_concurrency=max_concurrency)
    tl.lat.request_overhead_s = getattr(model, "request_overhead_s", 0.0)
    sched.track_shape = True
    clock = 0.0
    while tl.ready or sched.has_unfinished:
        if not sched.has_unfinished:
            clock = max(clock, tl.next_send())
        while tl.next_send() <= clock:
            t, i = tl.pop_ready()
            req = items[i] if make_request is None else make_request(i)
            tl.lat.arrive(req.request_id, t, len(req.prompt))
            sched.add_request(req)
        done, end = timed_step(sched, model, clock)
        tl.stepped(sched, clock, end, done)
        clock = end
        if on_step is not None:
            on_step(clock, tl.finished)
    tl.check_done()
    return clock
