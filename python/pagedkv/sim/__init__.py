"""The serving simulator behind ``pagedkv simulate``.

A workload (built-in generator or JSONL trace) is replayed through a vLLM-style
continuous-batching scheduler over the real manager; the result gives the
prefix-hit rate, preemptions, KV usage over time and the manager's cost.

>>> from pagedkv.sim import SimConfig, WorkloadOptions, generate, run_pagedkv
>>> w = generate("chat", WorkloadOptions(num_requests=20))
>>> r = run_pagedkv(w, SimConfig(memory_gib=1.0))
>>> r.finished == len(w.requests)
True
"""

from __future__ import annotations

from .runner import (
    EngineUnavailableError,
    SimConfig,
    SimResult,
    build_config,
    run_pagedkv,
    run_vllm,
)
from .tracefile import TraceFormatError, read_trace, write_trace
from .workloads import ARRIVALS, WORKLOADS, Workload, WorkloadOptions, WorkloadRequest, generate

__all__ = [
    "ARRIVALS",
    "WORKLOADS",
    "EngineUnavailableError",
    "SimConfig",
    "SimResult",
    "TraceFormatError",
    "Workload",
    "WorkloadOptions",
    "WorkloadRequest",
    "build_config",
    "generate",
    "read_trace",
    "run_pagedkv",
    "run_vllm",
    "write_trace",
]
