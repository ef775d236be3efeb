"""Runs a workload through pagedkv's manager (and, on request, vLLM's).

:func:`build_config` turns a model preset and a memory budget into a
``KVCacheConfig`` through the config builder; :func:`run_pagedkv` drives the
scheduler policy of :mod:`pagedkv.sim.policy` over it (its clock, its loop, the
:class:`~pagedkv.sim.backend.ManagerBackend`); :func:`run_vllm` does the same with
vLLM's own ``KVCacheManager`` behind the policy (in this interpreter, or in
``vllm_python`` through a subprocess).
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from .. import presets
from ..config_builder import NotEnoughKVCacheMemoryError, get_kv_cache_config
from ..errors import PagedKVError
from ..manager import KVCacheManager
from ..specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from . import perf, vllm_engine
from .backend import ManagerBackend
from .policy import Scheduler, SchedulerConfig, drive_timed
from .steptime import Latencies, LinearModel, StepTimeModel, summarize
from .workloads import Workload

__all__ = [
    "DEFAULT_MAX_CONTEXT",
    "OVERLONG",
    "Admitted",
    "EngineUnavailableError",
    "OverlongRequestError",
    "SimConfig",
    "SimResult",
    "admit",
    "build_config",
    "find_max_rate",
    "offered_rate",
    "run_pagedkv",
    "run_vllm",
    "scaled",
]

GIB = 1 << 30
#: the longest request built-in workloads make unless --max-model-len says otherwise
DEFAULT_MAX_CONTEXT = 16384

#: ``NONE_HASH`` seed of every manager of a simulation using a non-cryptographic
#: hash (they would otherwise each draw a random one)
SIM_HASH_SEED = "pagedkv-simulate"

#: ``progress(clock, num_finished)``, called after every step
ProgressFn = Callable[[int, int], None]


class EngineUnavailableError(RuntimeError):
    """The requested engine cannot run here (the message says why and what to do)."""


class OverlongRequestError(ValueError):
    """A request is longer than the context and ``on_overlong`` is ``"fail"``
    (or every request is)."""


#: What happens to a request longer than the context (``SimConfig.on_overlong``):
#: ``reject`` it and count it, as vLLM's server answers it with a 400, or ``fail``
#: the whole run.
OVERLONG = ("reject", "fail")


@dataclass(frozen=True)
class SimConfig:
    """Model, GPUs, KV-cache memory, scheduler and clock of one simulation."""

    model: str = "llama-3.1-8b"
    #: GiB of KV cache on each GPU (turned into blocks by the config builder);
    #: None: what ``gpu`` leaves after the weights and activations (as vLLM sizes it)
    memory_gib: float | None = 8.0
    #: GPU preset (``pagedkv.sim.perf.GPUS``), tensor-parallel size, and the share
    #: of GPU memory vLLM may use
    gpu: str = "H100-SXM"
    tp: int = 1
    gpu_memory_utilization: float = 0.9
    #: weight quantization applied to the model (``pagedkv.presets.QUANTIZATIONS``):
    #: ``"fp8"`` as vLLM's ``--quantization fp8``; ``"none"``: the checkpoint's own
    quantization: str = "none"
    #: the serving engine the roofline's efficiencies and overheads were
    #: calibrated on (``pagedkv.sim.perf.CLOCKS``)
    clock: str = "vllm"
    #: ``"a,b,c,d"``: the linear step-time model (ms) instead of the roofline
    step_time: str | None = None
    #: seconds per arrival tick of workloads timed in steps (built-in workloads)
    tick_s: float = 0.05
    #: serving replicas, each with its own manager and scheduler, behind a router
    #: (``pagedkv.sim.cluster.ROUTERS``)
    replicas: int = 1
    router: str = "round-robin"
    #: SLOs of ``slo_attainment`` (milliseconds)
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    #: fixed block count instead of ``memory_gib``
    num_blocks: int | None = None
    block_size: int = 16
    kv_dtype: str = "bfloat16"
    #: None: the longest request, rounded up to a multiple of 1024 (at most the model's)
    max_model_len: int | None = None
    enable_caching: bool = True
    hash_algo: str = "sha256_cbor"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    full_sequence_must_fit: bool = True
    #: prompts hashed on the manager's worker thread (as vLLM's input thread
    #: does); the manager times then show the scheduler's critical path
    background_hashing: bool = True
    #: closed-loop clients: at most this many requests in flight (sent and not
    #: finished) at once, as ``benchmark_serving --max-concurrency``; a ready
    #: request waits client-side and arrives when it is sent. None: no limit
    max_concurrency: int | None = None
    #: a request whose prompt + output tokens exceed ``max_model_len`` (else the
    #: model's context) is rejected and counted (``"reject"``), or fails the run
    #: (``"fail"``): :func:`admit`
    on_overlong: str = "reject"


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


@dataclass(frozen=True)
class Admitted:
    """The requests a server accepts (:func:`admit`)."""

    #: the accepted requests (the same request objects), in order
    workload: Workload
    rejected_requests: int
    rejected_prompt_tokens: int
    #: the context the requests were checked against
    context: int


def admit(workload: Workload, cfg: SimConfig) -> Admitted:
    """The requests a vLLM server accepts, as its OpenAI server checks them: one
    whose prompt plus ``max_tokens`` exceed ``max_model_len`` (``cfg.max_model_len``,
    else the model's context) is answered with a 400 ("This model's maximum
    context length is ..."), a prompt of ``max_model_len`` tokens or more
    included. A request's output length is its ``max_tokens``. With
    ``on_overlong="reject"`` such requests are left out and counted; with
    ``"fail"`` the first raises :class:`OverlongRequestError`, as does a workload
    that has no request left."""
    if cfg.on_overlong not in OVERLONG:
        raise ValueError(f"on_overlong is one of {', '.join(OVERLONG)}, got {cfg.on_overlong!r}")
    preset = _preset(cfg)
    if cfg.max_model_len is not None:
        context, what = cfg.max_model_len, f"--max-model-len {cfg.max_model_len}"
    else:
        context, what = preset.max_model_len, f"{preset.name}'s context ({preset.max_model_len})"
    reqs = workload.requests
    keep = [r for r in reqs if r.max_num_tokens <= context]
    if len(keep) == len(reqs):
        return Admitted(workload, 0, 0, context)
    if cfg.on_overlong == "fail":
        longest = max(reqs, key=lambda r: r.max_num_tokens)
        raise OverlongRequestError(
            f"the workload has a request of {longest.max_num_tokens} tokens (prompt + "
            f"output), longer than {what} (--on-overlong reject: reject such requests)"
        )
    if not keep:
        raise OverlongRequestError(
            f"all {len(reqs)} requests of the workload are longer than {what}"
        )
    rejected = [r for r in reqs if r.max_num_tokens > context]
    return Admitted(
        Workload(workload.name, keep, dict(workload.params)),
        len(rejected),
        sum(len(r.prompt) for r in rejected),
        context,
    )


def _max_model_len(cfg: SimConfig, admitted: Workload, preset: presets.ModelPreset) -> int:
    """``cfg.max_model_len``, else the longest accepted request rounded up to a
    multiple of 1024, at most the model's context."""
    if cfg.max_model_len is not None:
        return cfg.max_model_len
    longest = admitted.max_request_tokens
    return min(preset.max_model_len, max(1024, -(-longest // 1024) * 1024))


def model_context(cfg: SimConfig) -> int | None:
    """The model's context length (None: the model cannot be resolved)."""
    try:
        return _preset(cfg).max_model_len
    except (ValueError, OSError, PagedKVError):
        return None


def _preset(cfg: SimConfig) -> presets.ModelPreset:
    """The model: a preset name, or the path of a Hugging Face ``config.json``."""
    if cfg.model in presets.names():
        preset = presets.get(cfg.model)
    elif os.path.isfile(cfg.model):
        preset = _config_preset(cfg.model)
    else:
        raise ValueError(
            f"unknown model {cfg.model!r}: give a preset ({', '.join(presets.names())}) "
            "or the path of a Hugging Face config.json"
        )
    if cfg.quantization not in presets.QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization {cfg.quantization!r}; quantizations: "
            f"{', '.join(presets.QUANTIZATIONS)}"
        )
    if preset.compute is not None:
        perf.check_tensor_parallel(preset.compute, cfg.tp, preset.name)
        if cfg.quantization != "none":
            preset = replace(preset, compute=preset.compute.quantized(cfg.quantization))
    return preset


@functools.lru_cache(maxsize=16)
def _config_preset(path: str) -> presets.ModelPreset:
    return presets.from_hf_config(
        path, name=os.path.basename(os.path.dirname(os.path.abspath(path)))
    )


def gpu_kv_memory(cfg: SimConfig, preset: presets.ModelPreset) -> int:
    """Bytes of KV cache vLLM's rule leaves on each GPU of ``cfg`` for ``preset``."""
    return perf.kv_cache_memory(
        preset,
        perf.gpu(cfg.gpu),
        tp=cfg.tp,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
    )


def kv_memory_bytes(cfg: SimConfig, preset: presets.ModelPreset) -> int:
    """KV-cache bytes of the whole model instance: ``memory_gib`` (or what the GPU
    leaves) on each GPU, times the ways tensor parallelism splits the cache."""
    if cfg.tp < 1:
        raise ValueError(f"tp must be >= 1, got {cfg.tp}")
    split = perf.kv_split(preset.compute, cfg.tp) if preset.compute is not None else cfg.tp
    if cfg.memory_gib is not None:
        if not cfg.memory_gib > 0:
            raise ValueError(f"memory must be positive, got {cfg.memory_gib} GiB")
        return int(cfg.memory_gib * GIB) * split
    return gpu_kv_memory(cfg, preset) * split


def step_time_model(cfg: SimConfig) -> StepTimeModel:
    """The clock of a run: ``step_time``'s linear model, else the roofline of the
    model on ``tp`` x ``gpu``."""
    if cfg.step_time is not None:
        return LinearModel.parse(cfg.step_time)
    return perf.roofline(
        _preset(cfg),
        perf.gpu(cfg.gpu),
        tp=cfg.tp,
        block_size=cfg.block_size,
        kv_dtype=cfg.kv_dtype,
        clock_profile=perf.clock(cfg.clock),
    )


def mamba_block_size(config: KVCacheConfig) -> int | None:
    """The block size of a hybrid model's Mamba groups in ``align`` cache mode
    (where vLLM's scheduler aligns prefill chunks), else None."""
    for g in config.kv_cache_groups:
        s = g.kv_cache_spec
        if isinstance(s, MambaSpec) and s.mamba_cache_mode == "align":
            return s.block_size
    return None


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
) -> KVCacheManager:
    """The manager of one simulated serving process. Every manager of a
    simulation hashes alike: the non-cryptographic algorithms, which draw a
    random seed per manager by default, share one seed (replicas and the
    router's hasher must agree on every block hash); ``sha256_cbor`` keeps
    vLLM's fixed default. ``background_hashing`` None: the configuration's."""
    return KVCacheManager(
        config,
        max_model_len,
        enable_caching=cfg.enable_caching,
        hash_algo=cfg.hash_algo,
        hash_seed=None if cfg.hash_algo.startswith("sha256") else SIM_HASH_SEED,
        max_in_flight_tokens=cfg.max_num_batched_tokens,
        prefix_cache_retention_interval=0,
        background_hashing=(
            cfg.background_hashing if background_hashing is None else background_hashing
        ),
        enable_kv_cache_events=enable_kv_cache_events,
    )


def build_config(cfg: SimConfig, workload: Workload) -> tuple[KVCacheConfig, int]:
    """(KV-cache config, max_model_len) of the model preset in the memory budget,
    for the requests :func:`admit` accepts. Raises ValueError for unknown
    presets, :class:`OverlongRequestError` as :func:`admit` does, and
    ``NotEnoughKVCacheMemoryError`` when the memory cannot hold one request."""
    preset = _preset(cfg)
    workload = admit(workload, cfg).workload
    max_model_len = _max_model_len(cfg, workload, preset)
    memory = 0 if cfg.num_blocks is not None else kv_memory_bytes(cfg, preset)

    def config_for(length: int) -> KVCacheConfig:
        return get_kv_cache_config(
            preset.layer_specs(cfg.block_size, dtype=cfg.kv_dtype, max_model_len=length),
            memory,
            max_model_len=length,
            max_in_flight_tokens=cfg.max_num_batched_tokens,
            max_num_encoder_input_tokens=preset.max_num_encoder_input_tokens,
            num_gpu_blocks_override=cfg.num_blocks,
        )

    try:
        return config_for(max_model_len), max_model_len
    except NotEnoughKVCacheMemoryError:
        # The automatic length (the longest request rounded up to 1024) must not
        # refuse a workload whose longest request fits as it is.
        longest = workload.max_request_tokens
        if cfg.max_model_len is not None or not 0 < longest < max_model_len:
            raise
        return config_for(longest), longest


def kv_cache_bytes(config: KVCacheConfig) -> int:
    """Bytes of GPU memory the config's tensors take."""
    return sum(t.size for t in config.kv_cache_tensors)


def kv_split_ways(cfg: SimConfig) -> int:
    """How many ways the ``tp`` GPUs split the instance's KV cache (KV heads
    divided up to one per GPU, replicated beyond; MLA's latent: 1)."""
    compute = _preset(cfg).compute
    return perf.kv_split(compute, cfg.tp) if compute is not None else cfg.tp


def _config_dict(cfg: SimConfig, config: KVCacheConfig, max_model_len: int) -> dict[str, Any]:
    d = asdict(cfg)
    d["max_model_len"] = max_model_len
    # The instance's cache: num_blocks x (every tensor's bytes per block), as the
    # config builder sizes the tensors for --memory, --num-blocks or vLLM's rule
    # alike (the clock, roofline or --step-time, plays no part); each GPU holds
    # its share of the KV heads.
    total = kv_cache_bytes(config)
    d["kv_cache_gib"] = round(total / GIB, 3)
    d["kv_cache_gib_per_gpu"] = round(total / kv_split_ways(cfg) / GIB, 3)
    # What the GPU would leave for KV cache by vLLM's rule: --num-blocks and
    # --memory are taken as given, but a cache past it would not fit.
    preset = _preset(cfg)
    try:
        leaves = gpu_kv_memory(cfg, preset)
    except ValueError:
        leaves = 0
    d["gpu_kv_cache_gib"] = round(leaves / GIB, 3) if preset.compute is not None else None
    d["kv_cache_groups"] = [
        f"{type(g.kv_cache_spec).__name__}x{len(g.layer_names)}" for g in config.kv_cache_groups
    ]
    d["group_block_sizes"] = [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
    d["mamba_block_size"] = mamba_block_size(config)
    return d


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
        from .cluster import run_cluster

        return run_cluster(workload, cfg, label=label, progress=progress)  # type: ignore[no-any-return]
    admitted = admit(workload, cfg)
    workload = admitted.workload
    config, max_model_len = build_config(cfg, workload)
    kv = make_manager(cfg, config, max_model_len)
    sched = Scheduler(ManagerBackend(kv), scheduler_config(cfg, config))
    reqs = workload.requests
    usage, running, waiting, hit = array("d"), array("d"), array("d"), array("d")
    clock_s, preempt, step_hits, step_queries = array("d"), array("d"), array("d"), array("d")
    st = sched.stats
    model = step_time_model(cfg)
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
    drive_timed(
        sched,
        reqs,
        model,
        tick_s=cfg.tick_s,
        make_request=lambda i: reqs[i].fresh(),
        on_step=on_step,
        latencies=lat,
        max_concurrency=cfg.max_concurrency,
    )
    wall = time.perf_counter() - t0
    kv.check_invariants()
    per_api = {api: (st.calls[api], ns) for api, ns in st.ns.items()}
    # Logical calls, as vLLM's manager would count them: one add per request and
    # one append per sampled token besides the scheduler's calls.
    calls = st.manager_calls + len(reqs) + workload.output_tokens
    return SimResult(
        label=label,
        engine="pagedkv",
        config=_config_dict(cfg, config, max_model_len),
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
    )


# ------------------------------------------------------------------------ vLLM engine


def _vllm_groups(config: KVCacheConfig) -> list[dict[str, Any]]:
    groups = []
    for g in config.kv_cache_groups:
        s = g.kv_cache_spec
        kind = getattr(s, "kind", type(s).__name__)
        if isinstance(s, MambaSpec):
            groups.append(
                {
                    "kind": "mamba",
                    "layer_names": list(g.layer_names),
                    "block_size": s.block_size,
                    "shapes": [list(x) for x in s.shapes],
                    "dtypes": [str(d).split(".")[-1] for d in s.dtypes],
                    "page_size_padded": s.page_size_padded,
                    "mamba_cache_mode": s.mamba_cache_mode,
                    "num_speculative_blocks": s.num_speculative_blocks,
                }
            )
            continue
        if (
            not isinstance(s, FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec)
            or kind not in vllm_engine.SUPPORTED_SPECS
        ):
            raise EngineUnavailableError(
                f"--engine vllm supports full, MLA, sliding-window, chunked-local attention "
                f"and Mamba groups; this model has a {type(s).__name__} group"
            )
        d: dict[str, Any] = {
            "kind": kind,
            "layer_names": list(g.layer_names),
            "block_size": s.block_size,
            "num_kv_heads": s.num_kv_heads,
            "head_size": s.head_size,
            "dtype": str(s.dtype).split(".")[-1],
        }
        if isinstance(s, SlidingWindowSpec):
            d["sliding_window"] = s.sliding_window
        if isinstance(s, ChunkedLocalAttentionSpec):
            d["attention_chunk_size"] = s.attention_chunk_size
        if isinstance(s, MLAAttentionSpec):
            d["kind"] = "mla_attention"
        groups.append(d)
    if len({g["block_size"] for g in groups}) != 1:
        raise EngineUnavailableError("--engine vllm needs one block size across groups")
    return groups


def vllm_payload(workload: Workload, cfg: SimConfig) -> dict[str, Any]:
    """The JSON-able input of :func:`pagedkv.sim.vllm_engine.run` (the requests
    :func:`admit` accepts)."""
    workload = admit(workload, cfg).workload
    config, max_model_len = build_config(cfg, workload)
    if cfg.hash_algo not in ("sha256_cbor", "xxhash_cbor"):
        raise EngineUnavailableError(
            f"--engine vllm: vLLM has no {cfg.hash_algo!r} hash (use sha256_cbor or xxhash_cbor)"
        )
    groups = _vllm_groups(config)
    loras: dict[str, int] = {}
    reqs = []
    for r in workload.requests:
        rec: dict[str, Any] = {
            "id": r.request_id,
            "prompt": np.asarray(r.prompt).tolist(),
            "output": list(r.output),
            "arrival_step": r.arrival_step,
            "arrival_s": r.arrival_s,
            "session": r.session,
            "pause": r.pause,
            "pause_s": r.pause_s,
            "salt": r.cache_salt,
        }
        if r.lora_name is not None:
            lora_id = loras.setdefault(r.lora_name, len(loras) + 1)
            rec["lora"] = [r.lora_name, lora_id, r.lora_path or ""]
        reqs.append(rec)
    return {
        "manager": {
            "num_blocks": config.num_blocks,
            "max_model_len": max_model_len,
            "block_size": groups[0]["block_size"],
            "groups": groups,
            "enable_caching": cfg.enable_caching,
            "hash_algo": cfg.hash_algo,
            "max_in_flight_tokens": cfg.max_num_batched_tokens,
            "prefix_cache_retention_interval": 0,
        },
        "scheduler": asdict(scheduler_config(cfg, config)),
        "requests": reqs,
        "clock": {
            "model": step_time_model(cfg).to_dict(),
            "tick_s": cfg.tick_s,
            "max_concurrency": cfg.max_concurrency,
            "slo": {"slo_ttft_ms": cfg.slo_ttft_ms, "slo_tpot_ms": cfg.slo_tpot_ms},
        },
    }


NOT_AVAILABLE = (
    "--engine vllm runs vLLM's own KVCacheManager, but vLLM is not importable in this "
    "Python ({python}). Install vllm here, or pass --vllm-python PATH: a Python that has "
    "vllm installed (for instance the venv made by tools/vllm_oracle/setup.sh)."
)


def run_vllm(
    workload: Workload,
    cfg: SimConfig,
    *,
    vllm_python: str | None = None,
    label: str = "vllm",
    progress: ProgressFn | None = None,
) -> SimResult:
    """Simulates ``workload`` on vLLM's manager: in this interpreter when vLLM is
    importable here and ``vllm_python`` is None, else as a subprocess of
    ``vllm_python``. Raises :class:`EngineUnavailableError` when neither works."""
    admitted = admit(workload, cfg)
    workload = admitted.workload
    payload = vllm_payload(workload, cfg)
    if vllm_python is None:
        if not vllm_engine.vllm_available():
            raise EngineUnavailableError(NOT_AVAILABLE.format(python=sys.executable))
        out = vllm_engine.run(payload, progress)
    else:
        out = _run_subprocess(payload, vllm_python, progress)
    try:
        out = vllm_engine.check_result(out)
    except ValueError as e:
        raise EngineUnavailableError(
            f"the vLLM engine's result is not what pagedkv expects "
            f"({vllm_python or sys.executable}): {e}"
        ) from None
    config, max_model_len = build_config(cfg, workload)
    per_api = {k: (int(v[0]), int(v[1])) for k, v in out["per_api"].items()}
    return SimResult(
        label=label,
        engine="vllm",
        config=_config_dict(cfg, config, max_model_len),
        steps=out["steps"],
        requests=len(workload.requests),
        finished=out["finished"],
        prompt_tokens=workload.prompt_tokens,
        output_tokens=workload.output_tokens,
        hit_tokens=out["first_hit_tokens"],
        query_tokens=out["first_query_tokens"],
        hit_tokens_all=out["hit_tokens"],
        query_tokens_all=out["query_tokens"],
        preemptions=out["preemptions"],
        admissions=out["admissions"],
        peak_running=out["peak_running"],
        peak_usage=out["peak_usage"],
        mean_usage=out["mean_usage"],
        num_blocks=config.num_blocks,
        usable_blocks=out["usable_blocks"],
        free_blocks_at_end=out["free_blocks_at_end"],
        manager_ns=out["manager_ns"],
        manager_calls=out["manager_calls"],
        per_api=per_api,
        alloc_checksum=out["alloc_checksum"],
        wall_s=out["wall_s"],
        extra={"vllm_version": out["version"], "vllm_import_s": out["import_s"]},
        timing=out["timing"],
        rejected_requests=admitted.rejected_requests,
        rejected_prompt_tokens=admitted.rejected_prompt_tokens,
    )


def _run_subprocess(
    payload: dict[str, Any], vllm_python: str, progress: ProgressFn | None = None
) -> dict[str, Any]:
    if not (os.path.isfile(vllm_python) and os.access(vllm_python, os.X_OK)):
        raise EngineUnavailableError(f"--vllm-python {vllm_python}: not an executable file")
    script = vllm_engine.__file__
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="pagedkv-sim-") as tmp:
        path = os.path.join(tmp, "payload.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(payload, f)
        out_path = os.path.join(tmp, "out.txt")
        with open(out_path, "w+", encoding="utf-8") as out_f:
            with subprocess.Popen(
                [vllm_python, script, path],
                stdout=out_f,
                stderr=subprocess.PIPE,
                text=True,
                cwd=tmp,
            ) as proc:
                assert proc.stderr is not None
                # The script's progress lines move the bar; the rest is kept for errors.
                for line in proc.stderr:
                    parts = line.split()
                    if (
                        len(parts) == 3
                        and parts[0] == vllm_engine.PROGRESS_PREFIX
                        and parts[1].isdigit()
                        and parts[2].isdigit()
                    ):
                        if progress is not None:
                            progress(int(parts[1]), int(parts[2]))
                    else:
                        # Anything else (a malformed progress line too) is
                        # kept for the error message.
                        errors.append(line.rstrip("\n"))
                        del errors[:-200]
            returncode = proc.returncode
            out_f.seek(0)
            stdout = out_f.read()
    stderr = "\n".join(errors)
    if returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-8:])
        if "No module named 'vllm'" in stderr:
            raise EngineUnavailableError(
                f"--vllm-python {vllm_python}: that Python cannot import vllm"
            )
        raise EngineUnavailableError(f"the vLLM engine failed ({vllm_python}):\n{tail}")
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise EngineUnavailableError(f"the vLLM engine printed no result ({vllm_python})")
    try:
        result = json.loads(lines[-1], parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise EngineUnavailableError(
            f"the vLLM engine printed a result that is not JSON ({vllm_python}): "
            f"{str(e).splitlines()[0] if str(e) else 'nested too deeply'}"
        ) from None
    if not isinstance(result, dict):
        raise EngineUnavailableError(
            f"the vLLM engine printed {type(result).__name__}, not a result ({vllm_python})"
        )
    return result


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


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
