"""The serving simulator behind ``pagedkv simulate``, and the one scheduler policy.

A workload (built-in generator or JSONL trace) is replayed through the
continuous-batching policy of :mod:`pagedkv.sim.policy` (FCFS, chunked prefill,
preemption of the newest request) over the real manager; the result gives the
prefix-hit rate, preemptions, KV usage over time and the manager's cost. The same
policy drives vLLM's own manager (``--engine vllm``), the torch engine
(:class:`pagedkv.torch.PagedEngine`) and the benchmarks.

>>> from pagedkv.sim import SimConfig, WorkloadOptions, generate, run_pagedkv
>>> w = generate("chat", WorkloadOptions(num_requests=20))
>>> r = run_pagedkv(w, SimConfig(memory_gib=1.0))
>>> r.finished == len(w.requests)
True
"""

from __future__ import annotations

from .backend import ManagerBackend
from .policy import Backend, Request, Scheduler, SchedulerConfig, StepStats, drive
from .runner import (
    EngineUnavailableError,
    SimConfig,
    SimResult,
    build_config,
    run_pagedkv,
    run_vllm,
)
from .tracefile import TraceFormatError, read_trace, write_trace
from .workloads import ARRIVALS, WORKLOADS, Workload, WorkloadOptions, generate

__all__ = [
    "ARRIVALS",
    "WORKLOADS",
    "Backend",
    "EngineUnavailableError",
    "ManagerBackend",
    "Request",
    "Scheduler",
    "SchedulerConfig",
    "SimConfig",
    "SimResult",
    "StepStats",
    "TraceFormatError",
    "Workload",
    "WorkloadOptions",
    "build_config",
    "drive",
    "generate",
    "read_trace",
    "run_pagedkv",
    "run_vllm",
    "write_trace",
]
