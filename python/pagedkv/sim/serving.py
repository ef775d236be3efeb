"""One simulated serving process: its manager, its scheduler, and their run on a clock.

A run's setup, once the deployment (:mod:`pagedkv.sim.deployment`) has built the
``KVCacheConfig`` and the clock (:mod:`pagedkv.sim.perf`) is known:
:meth:`ServingProcess.start` makes the manager (:func:`make_manager`) and the
scheduler policy over it (:func:`scheduler_config`); :meth:`ServingProcess.drive`
replays requests through them on the clock
(:func:`~pagedkv.sim.policy.drive_timed`). The runner, the replicas of a
cluster, the calibration rows, the step-time fit and the clock's calibration
script all start their processes here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..manager import KVCacheManager
from ..offload import OffloadConfig
from ..specs import KVCacheConfig
from .backend import ManagerBackend
from .config import SimConfig
from .deployment import kv_split_ways, mamba_block_size
from .policy import Request, Scheduler, SchedulerConfig, drive_timed
from .steptime import Latencies, StepTimeModel
from .tiers import TierCounters, TieredBackend, host_link_gbps, offload_config

__all__ = ["SIM_HASH_SEED", "ServingProcess", "make_manager", "scheduler_config"]

#: ``NONE_HASH`` seed of every manager of a simulation using a non-cryptographic
#: hash (they would otherwise each draw a random one)
SIM_HASH_SEED = "pagedkv-simulate"


def scheduler_config(cfg: SimConfig, config: KVCacheConfig) -> SchedulerConfig:
    """The policy's knobs for ``cfg`` on ``config``."""
    return SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        full_sequence_must_fit=cfg.full_sequence_must_fit,
        mamba_block_size=mamba_block_size(config),
    )


def make_manager(
    cfg: SimConfig,
    config: KVCacheConfig,
    max_model_len: int,
    *,
    enable_kv_cache_events: bool = False,
    background_hashing: bool | None = None,
    offload: OffloadConfig | None = None,
) -> KVCacheManager:
    """The manager of one simulated serving process. Every manager of a
    simulation hashes alike: the non-cryptographic algorithms, which draw a
    random seed per manager by default, share one seed (replicas and the
    router's hasher must agree on every block hash); ``sha256_cbor`` keeps
    vLLM's fixed default. ``background_hashing`` None: the configuration's.
    ``offload``: a host tier under it (:func:`~pagedkv.sim.tiers.offload_config`)."""
    return KVCacheManager(
        config,
        max_model_len,
        offload,
        enable_caching=cfg.enable_caching,
        hash_algo=cfg.hash_algo,
        hash_seed=None if cfg.hash_algo.startswith("sha256") else SIM_HASH_SEED,
        max_in_flight_tokens=cfg.max_num_batched_tokens,
        prefix_cache_retention_interval=0,
        background_hashing=(
            cfg.background_hashing if background_hashing is None else background_hashing
        ),
        enable_kv_cache_events=enable_kv_cache_events,
        eviction=cfg.eviction,
    )


@dataclass
class ServingProcess:
    """One serving process of a simulation: a manager and the scheduler over it."""

    cfg: SimConfig
    kv: KVCacheManager
    sched: Scheduler[Request]

    @classmethod
    def start(
        cls,
        cfg: SimConfig,
        config: KVCacheConfig,
        max_model_len: int,
        *,
        enable_kv_cache_events: bool = False,
        background_hashing: bool | None = None,
        tier_events: bool = False,
    ) -> ServingProcess:
        """A fresh manager of ``config`` (:func:`make_manager`) under the policy
        ``cfg`` sets (:func:`scheduler_config`), over the tiers ``cfg`` asks
        for (:mod:`pagedkv.sim.tiers`; ``tier_events``: they record their
        events, for a router's index)."""
        ways = kv_split_ways(cfg)
        offload = offload_config(cfg, config, ways, enable_events=tier_events)
        kv = make_manager(
            cfg,
            config,
            max_model_len,
            enable_kv_cache_events=enable_kv_cache_events,
            background_hashing=background_hashing,
            offload=offload,
        )
        backend: ManagerBackend = (
            ManagerBackend(kv)
            if offload is None
            else TieredBackend(
                kv, ways=ways, host_gbps=host_link_gbps(cfg), disk_gbps=cfg.disk_gbps
            )
        )
        return cls(cfg, kv, Scheduler(backend, scheduler_config(cfg, config)))

    @property
    def tiers(self) -> TierCounters | None:
        """The tiers' figures (None without a host tier)."""
        be = self.sched.backend
        return be.finish_counters() if isinstance(be, TieredBackend) else None

    def drive(
        self,
        requests: Sequence[Request],
        model: StepTimeModel,
        *,
        latencies: Latencies | None = None,
        on_step: Callable[[float, int], None] | None = None,
    ) -> float:
        """Replays fresh copies of ``requests`` on the clock ``model`` (the
        configuration's arrival tick and client concurrency) until every one has
        finished; returns the clock at the end (:func:`~pagedkv.sim.policy.drive_timed`)."""
        return drive_timed(
            self.sched,
            requests,
            model,
            tick_s=self.cfg.tick_s,
            make_request=lambda i: requests[i].fresh(),
            on_step=on_step,
            latencies=latencies,
            max_concurrency=self.cfg.max_concurrency,
        )
