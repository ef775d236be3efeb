"""Deploys a resolved model: GPUs, tensor parallelism, memory, the requests served, the KV cache.

The third room of a simulation's setup, after its configuration
(:mod:`pagedkv.sim.config`) and its model (:mod:`pagedkv.sim.model`):
:data:`GPUS` holds the vendor datasheet figures of the GPUs a planner compares;
:func:`kv_cache_memory` sizes the KV cache as vLLM does (GPU memory x
``gpu_memory_utilization``, less the weights on one GPU, less the activations of
a profile run and what lives outside PyTorch); :func:`admit` keeps the requests
a server accepts; :func:`build_config` turns the model and the memory budget
into a ``KVCacheConfig`` through the config builder. The clock
(:mod:`pagedkv.sim.perf`) and the runs read what it gives.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..config_builder import NotEnoughKVCacheMemoryError, get_kv_cache_config
from ..presets import ModelCompute, ModelPreset
from ..specs import KVCacheConfig, MambaSpec
from .config import OVERLONG, SimConfig
from .model import require_compute, resolve
from .workloads import Workload

__all__ = [
    "GPUS",
    "Admitted",
    "Deployment",
    "GpuSpec",
    "OverlongRequestError",
    "activation_reserve_bytes",
    "admit",
    "build_config",
    "config_report",
    "deploy",
    "gpu",
    "gpu_kv_memory",
    "kv_cache_bytes",
    "kv_cache_memory",
    "kv_memory_bytes",
    "kv_split",
    "kv_split_ways",
    "mamba_block_size",
]

GIB = 1 << 30


@dataclass(frozen=True)
class GpuSpec:
    """One GPU: ``memory_bytes`` (what the driver reports), dense peak FLOP/s per
    compute dtype (no sparsity), HBM bandwidth and the per-GPU interconnect
    bandwidth of tensor parallelism, bytes/s."""

    name: str
    memory_bytes: int
    bf16_flops: float
    fp8_flops: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    source: str

    def peak_flops(self, dtype: str) -> float:
        return self.fp8_flops if dtype == "fp8" else self.bf16_flops


_MIB = 1 << 20

GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec(
            "H100-SXM",
            81559 * _MIB,
            989e12,
            1979e12,
            3.35e12,
            900e9,
            "NVIDIA H100 datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, BF16 989 TFLOPS and FP8 "
            "1,979 TFLOPS dense, NVLink 900 GB/s",
        ),
        GpuSpec(
            "H200",
            143771 * _MIB,
            989e12,
            1979e12,
            4.8e12,
            900e9,
            "NVIDIA H200 datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, BF16 989 TFLOPS and FP8 "
            "1,979 TFLOPS dense, NVLink 900 GB/s",
        ),
        GpuSpec(
            "B200",
            183359 * _MIB,
            2.25e15,
            4.5e15,
            8.0e12,
            1800e9,
            "NVIDIA HGX B200 datasheet, per GPU: 180 GB HBM3e, 8 TB/s, BF16 2.25 PFLOPS "
            "and FP8 4.5 PFLOPS dense, NVLink 1.8 TB/s",
        ),
        GpuSpec(
            "A100-80GB",
            81920 * _MIB,
            312e12,
            312e12,
            2.039e12,
            600e9,
            "NVIDIA A100 datasheet (SXM 80GB): HBM2e 2,039 GB/s, BF16 312 TFLOPS dense (no "
            "FP8: FP8 models run at the BF16 rate), NVLink 600 GB/s",
        ),
        GpuSpec(
            "L40S",
            46068 * _MIB,
            362.05e12,
            733e12,
            864e9,
            64e9,
            "NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, BF16 362 TFLOPS and FP8 733 "
            "TFLOPS dense, PCIe Gen4 x16 64 GB/s (no NVLink)",
        ),
        GpuSpec(
            "MI300X",
            196592 * _MIB,
            1307.4e12,
            2614.9e12,
            5.3e12,
            896e9,
            "AMD Instinct MI300X datasheet: 192 GB HBM3, 5.3 TB/s, BF16 1,307.4 TFLOPS and "
            "FP8 2,614.9 TFLOPS dense, Infinity Fabric 896 GB/s (7 x 128 GB/s)",
        ),
    )
}


def gpu(name: str) -> GpuSpec:
    """The GPU preset called ``name`` (case-insensitive); ValueError lists them."""
    for k, g in GPUS.items():
        if k.lower() == name.lower():
            return g
    raise ValueError(f"unknown GPU {name!r}; GPUs: {', '.join(GPUS)}")


def kv_split(compute: ModelCompute, tp: int) -> int:
    """How many ways ``tp`` GPUs split the KV cache: KV heads are divided up to
    one per GPU and replicated beyond."""
    return max(1, min(tp, compute.num_kv_heads))


def activation_reserve_bytes(
    compute: ModelCompute, tp: int, max_num_batched_tokens: int, max_num_seqs: int
) -> int:
    """What vLLM's memory profile finds besides weights and KV cache, estimated:
    the activations of one layer over a full token budget (residual, attention
    and MLP inputs and outputs: ``tokens x (4 x hidden + 2 x intermediate / tp)``
    in bfloat16), float32 logits of ``max_num_seqs`` sampled rows, and 1 GiB of
    CUDA graphs, NCCL buffers and the CUDA context outside PyTorch."""
    act = max_num_batched_tokens * (4 * compute.hidden_size + 2 * compute.intermediate_size // tp)
    logits = max_num_seqs * compute.vocab_size * 4
    return 2 * act + logits + GIB


def kv_cache_memory(
    preset: ModelPreset,
    gpu_spec: GpuSpec,
    *,
    tp: int = 1,
    gpu_memory_utilization: float = 0.9,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
) -> int:
    """Bytes of KV cache on each of the ``tp`` GPUs, as vLLM sizes it. Raises
    ValueError (the numbers in the message) when the weights leave none."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    c = require_compute(preset)
    budget = gpu_spec.memory_bytes * gpu_memory_utilization
    weights = c.weight_bytes / tp
    reserve = activation_reserve_bytes(c, tp, max_num_batched_tokens, max_num_seqs)
    left = int(budget - weights - reserve)
    if left <= 0:
        raise ValueError(
            f"{preset.name} does not fit on {tp} x {gpu_spec.name}: "
            f"{budget / GIB:.1f} GiB usable per GPU, weights {weights / GIB:.1f} GiB, "
            f"activations and runtime {reserve / GIB:.1f} GiB"
        )
    return left


# ------------------------------------------------------------- one simulation's deployment


class OverlongRequestError(ValueError):
    """A request is longer than the context and ``on_overlong`` is ``"fail"``
    (or every request is)."""


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
    _check_on_overlong(cfg)
    return _admit(workload, cfg, resolve(cfg))


def _check_on_overlong(cfg: SimConfig) -> None:
    if cfg.on_overlong not in OVERLONG:
        raise ValueError(f"on_overlong is one of {', '.join(OVERLONG)}, got {cfg.on_overlong!r}")


def _admit(workload: Workload, cfg: SimConfig, preset: ModelPreset) -> Admitted:
    """:func:`admit` with the model resolved."""
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


def _max_model_len(cfg: SimConfig, admitted: Workload, preset: ModelPreset) -> int:
    """``cfg.max_model_len``, else the longest accepted request rounded up to a
    multiple of 1024, at most the model's context."""
    if cfg.max_model_len is not None:
        return cfg.max_model_len
    longest = admitted.max_request_tokens
    return min(preset.max_model_len, max(1024, -(-longest // 1024) * 1024))


def gpu_kv_memory(cfg: SimConfig, preset: ModelPreset) -> int:
    """Bytes of KV cache vLLM's rule leaves on each GPU of ``cfg`` for ``preset``."""
    return kv_cache_memory(
        preset,
        gpu(cfg.gpu),
        tp=cfg.tp,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
    )


def kv_memory_bytes(cfg: SimConfig, preset: ModelPreset) -> int:
    """KV-cache bytes of the whole model instance: ``memory_gib`` (or what the GPU
    leaves) on each GPU, times the ways tensor parallelism splits the cache."""
    if cfg.tp < 1:
        raise ValueError(f"tp must be >= 1, got {cfg.tp}")
    split = _kv_split_ways(cfg, preset)
    if cfg.memory_gib is not None:
        if not cfg.memory_gib > 0:
            raise ValueError(f"memory must be positive, got {cfg.memory_gib} GiB")
        return int(cfg.memory_gib * GIB) * split
    return gpu_kv_memory(cfg, preset) * split


def mamba_block_size(config: KVCacheConfig) -> int | None:
    """The block size of a hybrid model's Mamba groups in ``align`` cache mode
    (where vLLM's scheduler aligns prefill chunks), else None."""
    for g in config.kv_cache_groups:
        s = g.kv_cache_spec
        if isinstance(s, MambaSpec) and s.mamba_cache_mode == "align":
            return s.block_size
    return None


def build_config(cfg: SimConfig, workload: Workload) -> tuple[KVCacheConfig, int]:
    """(KV-cache config, max_model_len) of the model preset in the memory budget,
    for the requests :func:`admit` accepts. Raises ValueError for unknown
    presets, :class:`OverlongRequestError` as :func:`admit` does, and
    ``NotEnoughKVCacheMemoryError`` when the memory cannot hold one request."""
    preset = resolve(cfg)
    return _build_config(cfg, admit(workload, cfg).workload, preset)


def _build_config(
    cfg: SimConfig, workload: Workload, preset: ModelPreset
) -> tuple[KVCacheConfig, int]:
    """:func:`build_config` for requests already admitted, the model resolved."""
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
    return _kv_split_ways(cfg, resolve(cfg))


def _kv_split_ways(cfg: SimConfig, preset: ModelPreset) -> int:
    compute = preset.compute
    return kv_split(compute, cfg.tp) if compute is not None else cfg.tp


# ------------------------------------------------------------------ the deployment


@dataclass(frozen=True)
class Deployment:
    """A simulation's model deployed on its GPUs (:func:`deploy`): the model
    resolved once, the requests a server accepts and the KV cache they run on."""

    cfg: SimConfig
    #: the model (:func:`pagedkv.sim.model.resolve`), quantized as ``cfg`` says
    model: ModelPreset
    admitted: Admitted
    kv_config: KVCacheConfig
    max_model_len: int

    @property
    def workload(self) -> Workload:
        """The accepted requests."""
        return self.admitted.workload

    def report(self) -> dict[str, Any]:
        """The configuration a run's JSON shows (:func:`config_report`)."""
        return config_report(self.cfg, self.model, self.kv_config, self.max_model_len)


def deploy(cfg: SimConfig, workload: Workload) -> Deployment:
    """``cfg``'s model resolved once, the requests of ``workload`` it accepts
    (:func:`admit`) and the KV cache they run on (:func:`build_config`); raises as
    those do."""
    _check_on_overlong(cfg)
    model = resolve(cfg)
    admitted = _admit(workload, cfg, model)
    kv_config, max_model_len = _build_config(cfg, admitted.workload, model)
    return Deployment(cfg, model, admitted, kv_config, max_model_len)


def config_report(
    cfg: SimConfig, model: ModelPreset, config: KVCacheConfig, max_model_len: int
) -> dict[str, Any]:
    """The configuration a run's JSON shows: ``cfg`` with the context used and
    the KV cache it got."""
    d = asdict(cfg)
    d["max_model_len"] = max_model_len
    # The instance's cache: num_blocks x (every tensor's bytes per block), as the
    # config builder sizes the tensors for --memory, --num-blocks or vLLM's rule
    # alike (the clock, roofline or --step-time, plays no part); each GPU holds
    # its share of the KV heads.
    total = kv_cache_bytes(config)
    d["kv_cache_gib"] = round(total / GIB, 3)
    d["kv_cache_gib_per_gpu"] = round(total / _kv_split_ways(cfg, model) / GIB, 3)
    # What the GPU would leave for KV cache by vLLM's rule: --num-blocks and
    # --memory are taken as given, but a cache past it would not fit.
    try:
        leaves = gpu_kv_memory(cfg, model)
    except ValueError:
        leaves = 0
    d["gpu_kv_cache_gib"] = round(leaves / GIB, 3) if model.compute is not None else None
    d["kv_cache_groups"] = [
        f"{type(g.kv_cache_spec).__name__}x{len(g.layer_names)}" for g in config.kv_cache_groups
    ]
    d["group_block_sizes"] = [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
    d["mamba_block_size"] = mamba_block_size(config)
    return d
