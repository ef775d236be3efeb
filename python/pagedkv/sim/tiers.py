"""The host and disk tiers of a simulation: the core's tier under each manager,
and its copies on the clock (``--cpu-offload``, ``--disk-offload``,
``--offload-policy``, ``--host-link``, ``--disk-link``).

Each serving process's :class:`~pagedkv.KVCacheManager` gets an
:class:`~pagedkv.offload.OffloadConfig`: ``cpu_offload_gib`` of host memory
per GPU (an instance of ``tp`` GPUs has ``tp`` times that: the sum over its
ranks, which is what vLLM's ``--kv-offloading-size`` gives), with vLLM's
write-through stores, under the ``offload_policy`` (LRU or ARC), and below it
a disk tier of ``disk_offload_gib`` per GPU whose index alone is kept (which
chunks such a disk holds and evicts; no byte is written).

:class:`TieredBackend` makes the scheduler's calls as
:class:`~pagedkv.sim.backend.ManagerBackend` does, with the tier: a lookup
answers device and host hits, an admission reserves device blocks for the host
hit, and each step's transfer plan runs on the clock:

- disk reads (disk to host), then loads (host to device) before the step's
  forward pass, which waits for them: the step lasts its compute time plus
  the loads' (``transfer_s``); the request's prefill uses the loaded blocks;
- stores (device to host) start when the step ends and take the device-to-host
  link in turn, in the background; a store's blocks stay held until it
  completes;
- disk writes (host to disk) take the disk in turn, in the background.

Each GPU moves its share of an instance's bytes (the KV heads it holds) over
its own link: a copy of B bytes on an instance of ``tp`` GPUs takes
``B / tp / bandwidth``. Transfers only add time: with no tier nothing changes.

Hits per tier count the first admissions, as the hit rate does: tokens found
on the device, in host memory, and on disk (read back through host memory).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..manager import KVCacheManager
from ..offload import OffloadConfig, TransferPlan
from ..specs import KVCacheConfig
from .backend import ManagerBackend
from .config import DEFAULT_DISK_GBPS, SimConfig
from .deployment import GIB
from .policy import Request

__all__ = [
    "DEFAULT_DISK_GBPS",
    "GPU_HOST_LINKS",
    "HOST_LINKS",
    "OFFLOAD_POLICIES",
    "OFFLOAD_WRITES",
    "TierCounters",
    "TieredBackend",
    "host_link_gbps",
    "offload_config",
    "tier_report",
]

#: One direction of each host link, GB/s: 0.8 of its peak per direction (PCIe
#: 4.0 x16 31.5, PCIe 5.0 x16 63, NVLink-C2C 450 GB/s), about what pinned
#: copies of large batches reach.
HOST_LINKS: dict[str, float] = {"pcie4": 25.2, "pcie5": 50.4, "nvlink-c2c": 360.0}

#: The host link of each GPU preset (``pagedkv.sim.deployment.GPUS``).
GPU_HOST_LINKS: dict[str, str] = {
    "H100-SXM": "pcie5",
    "H200": "pcie5",
    "B200": "pcie5",
    "A100-80GB": "pcie4",
    "L40S": "pcie4",
    "MI300X": "pcie5",
}

#: The host tier's policies (vLLM 0.33's CPU offloading).
OFFLOAD_POLICIES = ("lru", "arc")

#: When blocks are stored to the host tier: once computed (vLLM's), or as the
#: device pool is about to evict them (SGLang HiCache's ``write_back``).
OFFLOAD_WRITES = ("write-through", "write-back")


def host_link_gbps(cfg: SimConfig) -> float:
    """GB/s of one GPU's host link: ``cfg.host_link`` (a link's name or GB/s),
    else the GPU preset's link."""
    name = cfg.host_link if cfg.host_link is not None else GPU_HOST_LINKS.get(cfg.gpu, "pcie5")
    if name in HOST_LINKS:
        return HOST_LINKS[name]
    try:
        v = float(name)
    except ValueError:
        raise ValueError(f"host link {name!r}: one of {', '.join(HOST_LINKS)} or GB/s") from None
    if not (math.isfinite(v) and 0 < v <= 1e6):
        raise ValueError(f"host link {name!r}: GB/s must be in (0, 1e6]")
    return v


def offload_config(
    cfg: SimConfig, config: KVCacheConfig, ways: int, *, enable_events: bool = False
) -> OffloadConfig | None:
    """The tier under each manager of ``cfg`` (None without ``cpu_offload_gib``):
    ``ways`` GPUs' worth of host memory and disk for an instance split ``ways``
    ways, recording its events with ``enable_events``. ValueError when host
    memory holds no chunk."""
    if cfg.cpu_offload_gib <= 0:
        if cfg.disk_offload_gib > 0:
            raise ValueError(
                "a disk tier sits below host memory: --disk-offload needs --cpu-offload"
            )
        return None
    disk = int(cfg.disk_offload_gib * GIB * ways)
    off = OffloadConfig(
        cpu_bytes=int(cfg.cpu_offload_gib * GIB * ways),
        policy=cfg.offload_policy,
        write_policy=cfg.offload_write.replace("-", "_"),
        disk_bytes=disk,
        disk_index_only=disk > 0,
        enable_events=enable_events,
    )
    if off.num_chunks(config) == 0:
        raise ValueError(
            f"--cpu-offload {cfg.cpu_offload_gib:g} GiB holds no block of "
            f"{OffloadConfig.bytes_per_block(config) / ways:,.0f} bytes per GPU"
        )
    return off


@dataclass
class TierCounters:
    """The tiers' figures of one serving process."""

    #: hit tokens of first admissions, by where they were found
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    #: bytes copied (the instance's, all GPUs together)
    load_bytes: int = 0
    store_bytes: int = 0
    disk_read_bytes: int = 0
    disk_write_bytes: int = 0
    #: seconds steps waited for their loads and disk reads
    load_wait_s: float = 0.0
    #: seconds the device-to-host link and the disk were busy with stores and writes
    store_busy_s: float = 0.0
    disk_write_busy_s: float = 0.0
    loads: int = 0
    stores: int = 0
    #: the host tier's own totals at the end (``offload_stats``)
    tier: dict[str, int] = field(default_factory=dict)

    def merge(self, other: TierCounters) -> None:
        """Adds ``other``'s figures (the tiers of several replicas)."""
        for k, v in vars(other).items():
            if k == "tier":
                for kk, vv in v.items():
                    self.tier[kk] = self.tier.get(kk, 0) + vv
            else:
                setattr(self, k, getattr(self, k) + v)

    def to_dict(self, query_tokens: int) -> dict[str, Any]:
        """The figures as the run's JSON gives them, with each tier's hit rate."""
        d: dict[str, Any] = {
            k: round(v, 6) if isinstance(v, float) else v
            for k, v in vars(self).items()
            if k != "tier"
        }
        for t in ("device", "host", "disk"):
            n = getattr(self, f"{t}_hit_tokens")
            d[f"{t}_hit_rate"] = round(n / query_tokens, 6) if query_tokens else 0.0
        keep = (
            "num_chunks",
            "evictions",
            "stores_refused",
            "disk_tier_slots",
            "disk_tier_evictions",
        )
        d["host_tier"] = {k: v for k, v in self.tier.items() if k in keep}
        return d


class TieredBackend(ManagerBackend):
    """The scheduler's calls on a manager with a host tier, its copies on the
    clock (see the module docstring)."""

    def __init__(
        self,
        manager: KVCacheManager,
        *,
        ways: int,
        host_gbps: float,
        disk_gbps: float,
    ) -> None:
        super().__init__(manager)
        if not manager.has_offload:
            raise ValueError("a TieredBackend needs a manager with a host tier")
        config = manager.kv_cache_config
        self._group_bytes = [
            OffloadConfig.group_block_bytes(config, g) for g in range(len(config.kv_cache_groups))
        ]
        self._block_tokens = config.kv_cache_groups[0].kv_cache_spec.block_size
        self.ways, self.host_gbps, self.disk_gbps = ways, host_gbps, disk_gbps
        self._host_bps = host_gbps * 1e9 * ways
        self._disk_bps = disk_gbps * 1e9 * ways
        self.tiers = TierCounters()
        self._host_hit = 0
        self._first: dict[str, bool] = {}
        # copies whose time is taken when the step ends: (job, bytes)
        self._stores: list[tuple[int, int]] = []
        self._writes: list[tuple[int, int]] = []
        # in flight, by completion time: (done_s, job)
        self._store_q: deque[tuple[float, int]] = deque()
        self._write_q: deque[tuple[float, int]] = deque()
        self._link_free = 0.0
        self._disk_free = 0.0
        self._empty = np.zeros(0, dtype=np.uint8)

    # -- the clock

    def clock_to(self, t: float) -> None:
        """Completes the stores and disk writes done by ``t``."""
        done: list[int] = []
        while self._store_q and self._store_q[0][0] <= t:
            done.append(self._store_q.popleft()[1])
        if done:
            failed = self.kv.complete_transfers(done)
            if failed:
                raise RuntimeError(f"stores reported failed loads: {failed}")
        while self._write_q and self._write_q[0][0] <= t:
            self.kv.write_disk_chunk(self._write_q.popleft()[1], self._empty)

    def step_ended(self, t: float) -> None:
        """The step's stores and disk writes start at ``t``, each link in turn."""
        for job, nbytes in self._stores:
            s = nbytes / self._host_bps
            self._link_free = max(self._link_free, t) + s
            self.tiers.store_busy_s += s
            self._store_q.append((self._link_free, job))
        for job, nbytes in self._writes:
            s = nbytes / self._disk_bps
            self._disk_free = max(self._disk_free, t) + s
            self.tiers.disk_write_busy_s += s
            self._write_q.append((self._disk_free, job))
        self._stores.clear()
        self._writes.clear()

    def next_transfer_done(self) -> float | None:
        """When the next store or disk write completes (None: none in flight)."""
        times = [q[0][0] for q in (self._store_q, self._write_q) if q]
        return min(times) if times else None

    def transfers_pending(self) -> bool:
        return bool(self._store_q or self._write_q or self._stores or self._writes)

    # -- the scheduler's calls

    def lookup(self, req: Request) -> int:
        device = super().lookup(req)
        assert self._hit is not None
        self._host_hit = self._hit.num_host_tokens
        return device + self._host_hit

    def admit(
        self,
        req: Request,
        num_new_tokens: int,
        num_hit_tokens: int,
        *,
        full_sequence_must_fit: bool,
        has_scheduled_reqs: bool,
    ) -> bool:
        host = self._host_hit
        res = self._allocate_admitted(
            req,
            num_new_tokens,
            num_hit_tokens,
            host,
            full_sequence_must_fit=full_sequence_must_fit,
            has_scheduled_reqs=has_scheduled_reqs,
        )
        if res is None:
            return False
        first = req.num_preemptions == 0
        if first:
            self.tiers.device_hit_tokens += num_hit_tokens - host
            self.tiers.host_hit_tokens += host
        if host:
            self._first[req.request_id] = first
        return True

    def execute(self, scheduled: Sequence[tuple[Request, int]]) -> None:
        self.transfer_s = 0.0
        clock = self._clock
        t = clock()
        plan = self.kv.take_transfer_plan()
        self.stats.timed("take_transfer_plan", clock() - t)
        if plan:
            self._run(plan)
        self._first.clear()

    def _run(self, plan: TransferPlan) -> None:
        kv, tiers, block = self.kv, self.tiers, self._group_bytes
        disk_bytes = 0
        owner = {t.job: t.request_id for t in plan.loads}
        for r in plan.disk_reads:
            if not kv.read_disk_chunk(r.job, self._empty):
                raise RuntimeError("the disk tier's index lost a chunk it holds")
            disk_bytes += len(r.host_blocks) * block[r.group]
            rid = owner.get(r.load_job) if r.load_job is not None else None
            if r.group == 0 and rid is not None and self._first.get(rid, False):
                n = len(r.host_blocks) * self._block_tokens
                tiers.disk_hit_tokens += n
                tiers.host_hit_tokens -= n
        load_bytes = sum(len(t.device_blocks) * block[t.group] for t in plan.loads)
        if plan.loads:
            jobs = list(dict.fromkeys(t.job for t in plan.loads))
            failed = kv.complete_transfers(jobs)
            if failed:
                raise RuntimeError(f"loads from host memory failed: {failed}")
            tiers.loads += len(jobs)
        self.transfer_s = disk_bytes / self._disk_bps + load_bytes / self._host_bps
        tiers.load_wait_s += self.transfer_s
        tiers.load_bytes += load_bytes
        tiers.disk_read_bytes += disk_bytes
        sizes: dict[int, int] = {}
        for t in plan.stores:
            sizes[t.job] = sizes.get(t.job, 0) + len(t.device_blocks) * block[t.group]
        self._stores.extend(sizes.items())
        tiers.stores += len(sizes)
        tiers.store_bytes += sum(sizes.values())
        for w in plan.disk_writes:
            nbytes = len(w.host_blocks) * block[w.group]
            self._writes.append((w.job, nbytes))
            tiers.disk_write_bytes += nbytes

    def finish_counters(self) -> TierCounters:
        """The figures, with the host tier's own totals read now."""
        stats = self.kv.offload_stats() or {}
        self.tiers.tier = {k: int(v) for k, v in stats.items()}
        return self.tiers


def tier_report(cfg: SimConfig, backends: Sequence[object], query_tokens: int) -> dict[str, Any]:
    """``{"tiers": ...}``: the tiers' setup and the figures of the tiered
    ``backends`` added up, for a run's ``extra``; empty without tiers."""
    tiered = [be for be in backends if isinstance(be, TieredBackend)]
    if not tiered:
        return {}
    total = TierCounters()
    for be in tiered:
        total.merge(be.finish_counters())
    ways = tiered[0].ways
    setup = {
        "cpu_offload_gib_per_gpu": cfg.cpu_offload_gib,
        "cpu_offload_gib_per_instance": cfg.cpu_offload_gib * ways,
        "disk_offload_gib_per_gpu": cfg.disk_offload_gib,
        "offload_policy": cfg.offload_policy,
        "offload_write": cfg.offload_write,
        "host_link_gbps_per_gpu": tiered[0].host_gbps,
        "disk_gbps_per_gpu": tiered[0].disk_gbps,
    }
    return {"tiers": {**setup, **total.to_dict(query_tokens)}}
