"""Runs a workload through pagedkv's manager, and searches the highest rate it serves.

The last room of a simulation's setup: the configuration
(:mod:`pagedkv.sim.config`) names the model, which :mod:`pagedkv.sim.model`
resolves; :mod:`pagedkv.sim.deployment` admits the requests and sizes the KV
cache on the GPUs; :mod:`pagedkv.sim.perf` gives the clock;
:func:`run_pagedkv` starts the serving process (:mod:`pagedkv.sim.serving`) and
drives the scheduler policy of :mod:`pagedkv.sim.policy` over it, or hands
several replicas to :func:`pagedkv.sim.cluster.run_cluster`. :func:`find_max_rate`
searches the arrival rate that meets the SLOs. vLLM's own manager runs in
:mod:`pagedkv.sim.vllm_runner`. The names of those rooms stay importable from
here.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable
from typing import Any

from .cluster import run_cluster
from .config import DEFAULT_MAX_CONTEXT, OVERLONG, SimConfig
from .deployment import (
    GIB,
    Admitted,
    OverlongRequestError,
    admit,
    build_config,
    deploy,
    gpu_kv_memory,
    kv_cache_bytes,
    kv_memory_bytes,
    kv_split_ways,
    mamba_block_size,
)
from .model import model_context
from .perf import step_time_model
from .result import ProgressFn, SimResult, config_dict
from .serving import SIM_HASH_SEED, ServingProcess, make_manager, scheduler_config
from .steptime import Latencies, summarize
from .tiers import tier_report
from .vllm_runner import (
    NOT_AVAILABLE,
    EngineUnavailableError,
    run_vllm,
    vllm_payload,
)
from .vllm_runner import _run_subprocess as _run_subprocess
from .workloads import Workload

__all__ = [
    "DEFAULT_MAX_CONTEXT",
    "GIB",
    "NOT_AVAILABLE",
    "OVERLONG",
    "SIM_HASH_SEED",
    "Admitted",
    "EngineUnavailableError",
    "OverlongRequestError",
    "ProgressFn",
    "SimConfig",
    "SimResult",
    "admit",
    "build_config",
    "config_dict",
    "find_max_rate",
    "gpu_kv_memory",
    "kv_cache_bytes",
    "kv_memory_bytes",
    "kv_split_ways",
    "make_manager",
    "mamba_block_size",
    "model_context",
    "offered_rate",
    "run_pagedkv",
    "run_vllm",
    "scaled",
    "scheduler_config",
    "step_time_model",
    "vllm_payload",
]

#: the former private name of :func:`pagedkv.sim.result.config_dict`
_config_dict = config_dict


def run_pagedkv(
    workload: Workload,
    cfg: SimConfig,
    *,
    label: str = "pagedkv",
    progress: ProgressFn | None = None,
) -> SimResult:
    """Simulates ``workload`` on pagedkv's manager (on ``cfg.replicas`` of them
    behind ``cfg.router`` when there are several)."""
    if cfg.replicas > 1:
        return run_cluster(workload, cfg, label=label, progress=progress)
    deployment = deploy(cfg, workload)
    admitted, workload = deployment.admitted, deployment.workload
    config = deployment.kv_config
    process = ServingProcess.start(cfg, config, deployment.max_model_len)
    kv, sched = process.kv, process.sched
    reqs = workload.requests
    usage, running, waiting, hit = array("d"), array("d"), array("d"), array("d")
    clock_s, preempt, step_hits, step_queries = array("d"), array("d"), array("d"), array("d")
    st = sched.stats
    model = step_time_model(cfg, deployment.model)
    lat = Latencies()
    last = [0, 0]

    def on_step(clock: float, finished: int) -> None:
        usage.append(kv.usage)
        running.append(len(sched.running))
        waiting.append(len(sched.waiting))
        q = st.first_query_tokens
        hit.append(st.first_hit_tokens / q if q else 0.0)
        clock_s.append(clock)
        preempt.append(st.preemptions)
        step_hits.append(st.first_hit_tokens - last[0])
        step_queries.append(q - last[1])
        last[0], last[1] = st.first_hit_tokens, q
        if progress is not None:
            progress(st.steps, finished)

    t0 = time.perf_counter()
    process.drive(reqs, model, latencies=lat, on_step=on_step)
    wall = time.perf_counter() - t0
    kv.check_invariants()
    per_api = {api: (st.calls[api], ns) for api, ns in st.ns.items()}
    # Logical calls, as vLLM's manager would count them: one add per request and
    # one append per sampled token besides the scheduler's calls.
    calls = st.manager_calls + len(reqs) + workload.output_tokens
    return SimResult(
        label=label,
        engine="pagedkv",
        config=deployment.report(),
        steps=st.steps,
        requests=len(reqs),
        finished=st.finished,
        prompt_tokens=workload.prompt_tokens,
        output_tokens=workload.output_tokens,
        hit_tokens=st.first_hit_tokens,
        query_tokens=st.first_query_tokens,
        hit_tokens_all=st.hit_tokens,
        query_tokens_all=st.query_tokens,
        preemptions=st.preemptions,
        admissions=st.admissions,
        peak_running=st.peak_running,
        peak_usage=max(usage, default=0.0),
        mean_usage=sum(usage) / len(usage) if usage else 0.0,
        num_blocks=config.num_blocks,
        usable_blocks=config.num_blocks - 1,
        free_blocks_at_end=kv.num_free_blocks,
        manager_ns=st.manager_ns,
        manager_calls=calls,
        per_api=per_api,
        alloc_checksum=f"{st.alloc_checksum:016x}",
        wall_s=wall,
        series={
            "usage": usage.tolist(),
            "running": running.tolist(),
            "waiting": waiting.tolist(),
            "hit_rate": hit.tolist(),
            "time_s": clock_s.tolist(),
            "preemptions": preempt.tolist(),
            "hit_tokens": step_hits.tolist(),
            "query_tokens": step_queries.tolist(),
        },
        timing=summarize(lat, slo_ttft_ms=cfg.slo_ttft_ms, slo_tpot_ms=cfg.slo_tpot_ms),
        rejected_requests=admitted.rejected_requests,
        rejected_prompt_tokens=admitted.rejected_prompt_tokens,
        extra=tier_report(cfg, [sched.backend], st.first_query_tokens),
    )


# ------------------------------------------------------------------ capacity search


def scaled(workload: Workload, time_scale: float) -> Workload:
    """A copy of ``workload`` with arrivals and pauses ``time_scale`` times faster
    (the requests' token arrays are shared, not copied)."""
    from .traces import scale_arrivals

    copy = Workload(workload.name, [r.fresh() for r in workload.requests], dict(workload.params))
    return scale_arrivals(copy, time_scale)


def offered_rate(workload: Workload, tick_s: float) -> float:
    """Requests per second the workload's arrival times offer: requests over the
    span from the first arrival to the last."""
    times = [
        r.arrival_s if r.arrival_s is not None else r.arrival_step * tick_s
        for r in workload.requests
    ]
    span = max(times) - min(times) if times else 0.0
    return len(times) / span if span > 0 else float("inf")


def find_max_rate(
    workload: Workload,
    cfg: SimConfig,
    *,
    target: float = 0.9,
    base_scale: float = 1.0,
    iterations: int = 6,
    progress: Callable[[float, float, float], None] | None = None,
) -> dict[str, Any]:
    """The highest arrival rate at which at least ``target`` of the requests meet
    ``cfg``'s SLOs: Mooncake's effective request capacity. Searches
    ``--time-scale`` from ``base_scale``: doubling (or halving) until the answer
    flips, then ``iterations`` geometric bisections. Returns ``max_rate`` (the best
    passing run's ``time_scale``, ``requests_per_s`` offered, ``slo_attainment``
    and latency figures; None when even 1/1024 of the base rate fails) and every
    run ``tried``."""
    if cfg.slo_ttft_ms is None and cfg.slo_tpot_ms is None:
        raise ValueError("find_max_rate needs an SLO (slo_ttft_ms and/or slo_tpot_ms)")
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target}")
    # The load is what reaches the server: rejected requests are answered at once.
    served = admit(workload, cfg).workload
    # Sessions and concurrency-limited clients are a closed loop (a turn waits
    # for the previous answer, a request for a free client): their rate is what
    # the run achieves, not what timestamps offer.
    has_sessions = any(r.session is not None for r in served.requests)
    closed = has_sessions or cfg.max_concurrency is not None
    base_rate = offered_rate(served, cfg.tick_s)
    # Session pauses scale with the time; a concurrency limit alone does not.
    if not has_sessions and not math.isfinite(base_rate):
        raise ValueError(
            f"all {len(served.requests)} requests arrive at the same time: no time "
            "scale changes the load, so there is no rate to find (give arrivals spread "
            "over time)"
        )
    tried: list[dict[str, Any]] = []

    def attempt(x: float) -> bool:
        scale = base_scale * x
        r = run_pagedkv(scaled(workload, scale), cfg, label=f"time-scale={scale:.4g}")
        att = r.timing["slo_attainment"]
        rate = r.timing["throughput"]["requests_per_s"] if closed else base_rate * scale
        point = {
            "time_scale": scale,
            "requests_per_s": rate,
            "slo_attainment": att,
            "ttft_ms": r.timing["ttft_ms"],
            "tpot_ms": r.timing["tpot_ms"],
            "throughput": r.timing["throughput"],
            "preemptions": r.preemptions,
            "hit_rate": round(r.hit_rate, 6),
            "meets": att >= target,
        }
        tried.append(point)
        if progress is not None:
            progress(scale, att, rate)
        return bool(point["meets"])

    lo: float | None = None
    hi: float | None = None
    if attempt(1.0):
        lo, x = 1.0, 2.0
        while x <= 1024 and attempt(x):
            lo, x = x, x * 2
        hi = x if x <= 1024 else None
    else:
        hi, x = 1.0, 0.5
        while x >= 1 / 1024 and not attempt(x):
            hi, x = x, x / 2
        lo = x if x >= 1 / 1024 else None
    if lo is not None and hi is not None:
        for _ in range(iterations):
            mid = math.sqrt(lo * hi)
            if attempt(mid):
                lo = mid
            else:
                hi = mid
    best = None
    if lo is not None:
        passing = [p for p in tried if p["meets"]]
        best = max(passing, key=lambda p: p["time_scale"])
    return {
        "target": target,
        "slo_ttft_ms": cfg.slo_ttft_ms,
        "slo_tpot_ms": cfg.slo_tpot_ms,
        "max_rate": best,
        "lowest_scale_tried": min(p["time_scale"] for p in tried),
        "tried": sorted(tried, key=lambda p: p["time_scale"]),
    }
