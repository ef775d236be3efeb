"""One run: a configuration and seed on both sides, stepped together until they differ."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .build import Unsupported, build_pair, num_blocks_for
from .cases import Case
from .compare import first_diff, short
from .drive import Side, make_request
from .workload import SCRIPTED_PROBES, FakeModel, Rng, make_workload

#: Steps with nothing scheduled, after the last input, that end a run as stalled.
STALL_STEPS = 20


@dataclass
class Result:
    case: str
    seed: int
    status: str  # identical, diverged, error, unsupported
    steps: int = 0
    detail: str = ""
    diff: dict[str, Any] | None = None
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)


#: A change made to pagedkv's side before a step: (side, step) -> None. Used
#: to check that the harness reports a difference it is given.
Perturb = Callable[[Side, int], None]
#: Sees vLLM's side of every compared observation: (step, phase, snapshot).
Observe = Callable[[int, str, dict[str, Any]], None]


def run_case(
    case: Case,
    seed: int,
    max_steps: int | None = None,
    observe: Observe | None = None,
    perturb: Perturb | None = None,
) -> Result:
    """Runs ``case`` with ``seed`` on both sides; the result says where they first differ."""
    t0 = time.perf_counter()
    res = Result(case.name, seed, "identical")
    try:
        _run(case, seed, res, max_steps or case.max_steps, observe, perturb)
    except Unsupported as e:
        res.status, res.detail = "unsupported", str(e)
    except Exception as e:
        res.status = "error"
        res.detail = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-6)}"
    res.seconds = time.perf_counter() - t0
    return res


def _run(
    case: Case,
    seed: int,
    res: Result,
    max_steps: int,
    observe: Observe | None,
    perturb: Perturb | None,
) -> None:
    model = FakeModel(case, seed)
    workload = make_workload(case, seed)
    num_blocks = num_blocks_for(case, workload)
    ref_sched, dut_sched = build_pair(case, model, num_blocks)
    sides = [Side("vllm", ref_sched, case, model), Side("pagedkv", dut_sched, case, model)]
    arrivals: dict[int, list[tuple[str, Any]]] = {}
    for spec in workload:
        arrivals.setdefault(spec.arrival, []).append(("new", spec))
        for k, (step, prompt, max_tokens) in enumerate(spec.chunks):
            arrivals.setdefault(step, []).append(("chunk", (spec, k, prompt, max_tokens)))
        if spec.abort_at is not None:
            arrivals.setdefault(spec.abort_at, []).append(("abort", spec.rid))
    if case.resets:
        rng = Rng("resets", case.name, seed)
        for _ in range(3):
            at = rng.randint(2, 30)
            arrivals.setdefault(at, []).append(("reset", rng.random() < 0.5))
    for step, rid, prompt in SCRIPTED_PROBES.get(case.script or "", []):
        arrivals.setdefault(step, []).append(("probe", (rid, prompt)))
    last_arrival = max(arrivals, default=0)
    counts = {
        "requests": len(workload),
        "steps_scheduled": 0,
        "preemptions": 0,
        "events": 0,
        "hits": 0,
    }
    step = 0
    idle = 0  # consecutive steps after the last input that scheduled nothing
    while step < max_steps:
        for kind, item in arrivals.get(step, ()):
            for side in sides:
                apply_input(side, case, kind, item, step)
        if step > last_arrival and not any(s.busy() for s in sides):
            break
        if perturb is not None:
            perturb(sides[1], step)
        observed = []
        for s in sides:
            try:
                observed.append(s.step())
            except Exception as e:
                raise RuntimeError(f"{s.name}'s side raised at step {step}: {e!r}") from e
        kinds = [[k for k, _ in o] for o in observed]
        if kinds[0] != kinds[1]:
            res.status = "diverged"
            res.steps = step
            res.detail = f"step {step}: engine phases differ: vllm {kinds[0]}, pagedkv {kinds[1]}"
            return
        for (phase, a), (_, b) in zip(observed[0], observed[1], strict=True):
            if observe is not None:
                observe(step, phase, a)
            d = first_diff(a, b)
            if d is not None:
                res.status = "diverged"
                res.steps = step
                res.detail = (
                    f"step {step} ({phase}): {d[0]}: vllm {short(d[1])} != pagedkv {short(d[2])}"
                )
                res.diff = {
                    "step": step,
                    "phase": phase,
                    "path": d[0],
                    "vllm": d[1],
                    "pagedkv": d[2],
                    "vllm_snapshot": a,
                    "pagedkv_snapshot": b,
                }
                return
            if phase == "schedule":
                idle = (
                    0 if a["total_num_scheduled_tokens"] > 0 or step <= last_arrival else idle + 1
                )
                counts["steps_scheduled"] += a["total_num_scheduled_tokens"] > 0
                counts["preemptions"] += len(a["preempted_req_ids"])
            elif phase == "update":
                counts["events"] += len(a["events"])
                pcs = a.get("stats", {}).get("prefix_cache_stats") or {}
                counts["hits"] += pcs.get("hits") or 0
        step += 1
        if idle >= STALL_STEPS and not any(s.loading for s in sides):
            waiting = sorted(sides[0].sched.requests)
            free = sides[0].sched.kv_cache_manager.block_pool.get_num_free_blocks()
            res.detail = (
                f"both schedulers stalled from step {step - idle}: {len(waiting)} requests "
                f"waiting, {free} free blocks"
            )
            break
    res.steps = step
    res.counts = counts
    if step >= max_steps and not res.detail:
        res.detail = f"stopped at the step cap ({max_steps}) with work left"


def apply_input(side: Side, case: Case, kind: str, item: Any, step: int) -> None:
    if kind == "new":
        spec = item
        side.add(
            make_request(
                case,
                spec.rid,
                spec.prompt,
                spec.max_tokens,
                float(step),
                spec,
                resumable=spec.resumable,
            )
        )
    elif kind == "chunk":
        spec, k, prompt, max_tokens = item
        if spec.rid not in side.sched.requests:
            return  # the session ended (aborted) before this chunk
        arrival = float(step) + 0.001 * (k + 1)
        if prompt is None:
            side.add(make_request(case, spec.rid, [], 1, arrival, spec, resumable=False))
        else:
            side.add(
                make_request(case, spec.rid, prompt, max_tokens, arrival, spec, resumable=True)
            )
    elif kind == "abort":
        side.abort(item)
    elif kind == "reset":
        ok = side.sched.reset_prefix_cache(reset_running_requests=item)
        side.notes.append({"reset_prefix_cache": {"reset_running_requests": item, "ok": ok}})
    elif kind == "probe":
        rid, prompt = item
        side.add(make_request(case, rid, prompt, 1, float(step)))
