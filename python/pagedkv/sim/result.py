"""The figures of one simulated run (:class:`SimResult`) and the configuration it reports.

Every run builds one: pagedkv's manager on one replica
(:func:`pagedkv.sim.runner.run_pagedkv`) or several
(:func:`pagedkv.sim.cluster.run_cluster`), and vLLM's own manager
(:func:`pagedkv.sim.vllm_runner.run_vllm`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..specs import KVCacheConfig
from .config import SimConfig
from .deployment import config_report
from .model import resolve

__all__ = ["ProgressFn", "SimResult", "config_dict"]

#: ``progress(clock, num_finished)``, called after every step
ProgressFn = Callable[[int, int], None]


@dataclass
class SimResult:
    """Figures of one run (``to_dict`` for JSON; ``series`` for plots)."""

    label: str
    engine: str
    config: dict[str, Any]
    steps: int
    requests: int
    finished: int
    prompt_tokens: int
    output_tokens: int
    #: prefix-cache hits and lookups of first admissions (vLLM's hit-rate metric)
    hit_tokens: int
    query_tokens: int
    #: the same including re-admissions after a preemption
    hit_tokens_all: int
    query_tokens_all: int
    preemptions: int
    admissions: int
    peak_running: int
    peak_usage: float
    mean_usage: float
    num_blocks: int
    usable_blocks: int
    free_blocks_at_end: int
    manager_ns: int
    manager_calls: int
    per_api: dict[str, tuple[int, int]]
    alloc_checksum: str
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    #: per step: KV usage, running requests, waiting requests, cumulative hit rate,
    #: the clock at its end (s), cumulative preemptions, hit and looked-up tokens
    series: dict[str, list[float]] = field(default_factory=dict)
    #: time figures (:func:`pagedkv.sim.steptime.summarize`)
    timing: dict[str, Any] = field(default_factory=dict)
    #: requests longer than the context, rejected before the scheduler (not in
    #: ``requests`` nor in any other figure), and their prompt tokens
    rejected_requests: int = 0
    rejected_prompt_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def us_per_step(self) -> float:
        return self.manager_ns / 1e3 / self.steps if self.steps else 0.0

    @property
    def us_per_call(self) -> float:
        return self.manager_ns / 1e3 / self.manager_calls if self.manager_calls else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = {
            k: v
            for k, v in asdict(self).items()
            if k not in ("series", "per_api", "extra", "timing")
        }
        d.update(self.extra)
        d.update(self.timing)
        d["hit_rate"] = round(self.hit_rate, 6)
        d["hit_rate_all"] = round(
            self.hit_tokens_all / self.query_tokens_all if self.query_tokens_all else 0.0, 6
        )
        d["peak_usage"] = round(self.peak_usage, 6)
        d["mean_usage"] = round(self.mean_usage, 6)
        d["manager_ms"] = round(self.manager_ns / 1e6, 3)
        d["manager_us_per_step"] = round(self.us_per_step, 3)
        d["manager_us_per_call"] = round(self.us_per_call, 3)
        d["wall_s"] = round(self.wall_s, 3)
        d["per_api"] = {
            api: {
                "calls": c,
                "ms": round(ns / 1e6, 3),
                "us_per_call": round(ns / 1e3 / c, 3) if c else 0.0,
            }
            for api, (c, ns) in sorted(self.per_api.items())
        }
        return d


def config_dict(cfg: SimConfig, config: KVCacheConfig, max_model_len: int) -> dict[str, Any]:
    """The run's configuration as its JSON shows it: ``cfg`` with the context
    used and the KV cache it got (:func:`~pagedkv.sim.deployment.config_report`)."""
    return config_report(cfg, resolve(cfg), config, max_model_len)
