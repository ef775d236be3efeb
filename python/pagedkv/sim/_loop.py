"""The simulation clock: when each request of a workload reaches the scheduler.

Standard library only, so that the vLLM engine driver can load it by path in
another interpreter (one that has vLLM but not pagedkv) and feed vLLM's manager
exactly the arrivals pagedkv's manager gets.

Time is counted in scheduler steps. A request is ready at its ``arrival_step``;
a request that belongs to a session and is not the session's first turn is
ready no earlier than ``pause`` steps after the step in which the previous turn
of that session finished (a user reading an answer, an agent waiting for a
tool call). When nothing is running or waiting, the clock jumps to the next
ready request; such idle steps are not scheduler steps.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["ArrivalItem", "EngineScheduler", "drive"]


class ArrivalItem(Protocol):
    """What the clock needs to know about a request."""

    @property
    def request_id(self) -> str: ...
    @property
    def arrival_step(self) -> int: ...
    @property
    def session(self) -> str | None: ...
    @property
    def pause(self) -> int: ...


class EngineScheduler(Protocol):
    """A scheduler loop over one KV-cache manager."""

    @property
    def has_unfinished(self) -> bool: ...
    def add_request(self, req: Any) -> None: ...
    def step(self) -> Sequence[Any]: ...


def drive(
    sched: EngineScheduler,
    items: Sequence[ArrivalItem],
    make_request: Callable[[int], Any],
    on_step: Callable[[int, int], None] | None = None,
) -> int:
    """Runs ``sched`` until every item has been added and has finished.

    ``make_request(i)`` builds the scheduler's request for ``items[i]`` when it
    becomes ready (its ``request_id`` must be ``items[i].request_id``);
    ``on_step(clock, num_finished)`` is called after every step. Returns the
    simulation clock at the end (the step after the last one).
    """
    successor: dict[str, int] = {}
    last_of_session: dict[str, int] = {}
    ready: list[tuple[int, int]] = []
    for i, item in enumerate(items):
        s = item.session
        if s is not None and s in last_of_session:
            successor[items[last_of_session[s]].request_id] = i
        else:
            ready.append((item.arrival_step, i))
        if s is not None:
            last_of_session[s] = i
    heapq.heapify(ready)
    clock = 0
    finished = 0
    while ready or sched.has_unfinished:
        if not sched.has_unfinished:
            clock = max(clock, ready[0][0])
        while ready and ready[0][0] <= clock:
            _, i = heapq.heappop(ready)
            sched.add_request(make_request(i))
        done = sched.step()
        finished += len(done)
        for req in done:
            j = successor.pop(req.request_id, None)
            if j is not None:
                nxt = items[j]
                heapq.heappush(ready, (max(nxt.arrival_step, clock + 1 + nxt.pause), j))
        if on_step is not None:
            on_step(clock, finished)
        clock += 1
    if finished != len(items):  # pragma: no cover - a scheduler bug, not a user error
        raise RuntimeError(f"{finished} of {len(items)} requests finished")
    return clock
