"""The axes of ``--compare`` and ``--sweep``: parsing them, and one value applied to a run.

A value is checked by the same argument type as the option it stands for
(``options.py``); a bad one is a ``UsageError`` naming the flag, axis and value.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import replace

from .. import presets
from ..manager import HASH_ALGOS
from ..sim.cluster import ROUTERS
from ..sim.config import EVICTIONS
from ..sim.perf import CLOCKS, GPUS
from ..sim.runner import SimConfig
from ..sim.tiers import OFFLOAD_POLICIES, OFFLOAD_WRITES
from ..sim.workloads import WORKLOADS
from .options import (
    MAX_VARIANTS,
    UsageError,
    concurrency,
    cpu_offload_gib,
    disk_offload_gib,
    host_link,
    positive_float,
    positive_int,
    replica_count,
    tier_weights,
)

AXES = (
    "caching",
    "block-size",
    "hash",
    "memory",
    "num-blocks",
    "model",
    "workload",
    "max-num-seqs",
    "gpu",
    "tp",
    "quantization",
    "clock",
    "time-scale",
    "router",
    "replicas",
    "max-concurrency",
    "cpu-offload",
    "disk-offload",
    "offload-policy",
    "offload-write",
    "host-link",
    "tier-weights",
    "eviction",
)


def parse_compare(specs: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Each ``AXIS=V1,V2,...`` as (axis, values), at most ``MAX_VARIANTS`` runs in all."""
    axes: list[tuple[str, list[str]]] = []
    for spec in specs:
        axis, _, values = spec.partition("=")
        axis = axis.strip()
        if axis not in AXES:
            raise UsageError(f"--compare: unknown axis {axis!r} (axes: {', '.join(AXES)})")
        vals = [v.strip() for v in values.split(",") if v.strip()] if values else []
        if not vals:
            if axis != "caching":
                raise UsageError(f"--compare {axis}=V1,V2,...: give the values")
            vals = ["on", "off"]
        if any(a == axis for a, _ in axes):
            raise UsageError(f"--compare: axis {axis!r} given twice")
        axes.append((axis, vals))
    variants = math.prod(len(v) for _, v in axes)
    if variants > MAX_VARIANTS:
        raise UsageError(
            f"{' x '.join(str(len(v)) for _, v in axes)} = {variants:,} variants: more than "
            f"the limit of {MAX_VARIANTS} runs"
        )
    return axes


def apply(
    axis: str, value: str, cfg: SimConfig, workload: str, scale: float, flag: str = "--compare"
) -> tuple[SimConfig, str, float]:
    """A run's (configuration, workload, time scale) with ``axis`` set to ``value``."""
    try:
        if axis == "workload":
            if value not in WORKLOADS:
                raise ValueError(f"built-in workloads: {', '.join(WORKLOADS)}")
            return cfg, value, scale
        if axis == "time-scale":
            return cfg, workload, positive_float(value)
        return _apply_config(axis, value, cfg), workload, scale
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise UsageError(f"{flag} {axis}={value}: {e}") from None


def _apply_config(axis: str, value: str, cfg: SimConfig) -> SimConfig:
    if axis == "caching":
        if value not in ("on", "off"):
            raise ValueError("caching is on or off")
        return replace(cfg, enable_caching=value == "on")
    if axis == "block-size":
        return replace(cfg, block_size=positive_int(value))
    if axis == "hash":
        if value not in HASH_ALGOS:
            raise ValueError(f"hash is one of {', '.join(HASH_ALGOS)}")
        return replace(cfg, hash_algo=value)
    if axis == "memory":
        return replace(cfg, memory_gib=positive_float(value), num_blocks=None)
    if axis == "num-blocks":
        return replace(cfg, num_blocks=positive_int(value))
    if axis == "model":
        return replace(cfg, model=value)
    if axis == "gpu":
        if value not in GPUS:
            raise ValueError(f"GPUs: {', '.join(GPUS)}")
        return replace(cfg, gpu=value)
    if axis == "tp":
        return replace(cfg, tp=positive_int(value))
    if axis == "clock":
        if value not in CLOCKS:
            raise ValueError(f"clocks: {', '.join(CLOCKS)}")
        return replace(cfg, clock=value)
    if axis == "quantization":
        if value not in presets.QUANTIZATIONS:
            raise ValueError(f"quantizations: {', '.join(presets.QUANTIZATIONS)}")
        return replace(cfg, quantization=value)
    if axis == "replicas":
        return replace(cfg, replicas=replica_count(value))
    if axis == "max-concurrency":
        return replace(cfg, max_concurrency=concurrency(value))
    if axis == "cpu-offload":
        return replace(cfg, cpu_offload_gib=cpu_offload_gib(value))
    if axis == "disk-offload":
        return replace(cfg, disk_offload_gib=disk_offload_gib(value))
    if axis == "offload-policy":
        if value not in OFFLOAD_POLICIES:
            raise ValueError(f"offload policies: {', '.join(OFFLOAD_POLICIES)}")
        return replace(cfg, offload_policy=value)
    if axis == "offload-write":
        if value not in OFFLOAD_WRITES:
            raise ValueError(f"offload writes: {', '.join(OFFLOAD_WRITES)}")
        return replace(cfg, offload_write=value)
    if axis == "host-link":
        return replace(cfg, host_link=host_link(value))
    if axis == "tier-weights":
        return replace(cfg, tier_weights=tier_weights(value))
    if axis == "eviction":
        if value not in EVICTIONS:
            raise ValueError(f"eviction policies: {', '.join(EVICTIONS)}")
        return replace(cfg, eviction=value)
    if axis == "router":
        if value not in ROUTERS:
            raise ValueError(f"routers: {', '.join(ROUTERS)}")
        return replace(cfg, router=value)
    return replace(cfg, max_num_seqs=positive_int(value))
