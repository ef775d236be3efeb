"""The clock of a simulation: how long each step of a model on its GPUs takes.

The fourth room of a simulation's setup, after its configuration
(:mod:`pagedkv.sim.config`), its model (:mod:`pagedkv.sim.model`) and its
deployment (:mod:`pagedkv.sim.deployment`): :data:`CLOCKS` holds the calibrated
efficiencies and overheads of the serving engines; :func:`roofline` builds the
:class:`~pagedkv.sim.steptime.RooflineModel` of a model preset on ``tp`` GPUs;
:func:`step_time_model` gives a run's clock (``--step-time``'s linear model, else
the roofline). The GPU presets and the KV memory rule live in the deployment room
and are importable from here as before.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..presets import ModelCompute, ModelPreset
from ..specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from .config import SimConfig
from .deployment import (
    GIB,
    GPUS,
    GpuSpec,
    activation_reserve_bytes,
    gpu,
    kv_cache_memory,
    kv_split,
)
from .model import check_tensor_parallel, require_compute, resolve
from .steptime import AttentionKind, LinearModel, RooflineModel, StepTimeModel

__all__ = [
    "CLOCKS",
    "GIB",
    "GPUS",
    "ClockProfile",
    "GpuSpec",
    "activation_reserve_bytes",
    "check_tensor_parallel",
    "clock",
    "gpu",
    "kv_cache_memory",
    "kv_split",
    "roofline",
    "step_time_model",
]


@dataclass(frozen=True)
class ClockProfile:
    """How close a serving engine's kernels get to the GPU's datasheet, and what
    it spends besides them: the calibrated constants of the step-time roofline
    (:class:`~pagedkv.sim.steptime.RooflineModel` documents each). ``source``
    says what they were fitted to."""

    name: str
    compute_efficiency: float
    gemm_half_tokens: float
    attention_efficiency: float
    memory_efficiency: float
    kv_efficiency: float
    link_efficiency: float
    overhead_s: float
    seq_overhead_s: float
    layer_overhead_s: float
    allreduce_latency_s: float
    request_overhead_s: float
    source: str


_TRTLLM = ClockProfile(
    "trtllm",
    compute_efficiency=0.675,
    gemm_half_tokens=54.8,
    attention_efficiency=0.672,
    memory_efficiency=0.76,
    kv_efficiency=0.95,
    link_efficiency=0.27,
    overhead_s=0.717e-3,
    seq_overhead_s=7.38e-6,
    layer_overhead_s=2.14e-6,
    allreduce_latency_s=29.1e-6,
    request_overhead_s=7.52e-3,
    source="fitted to 156 published TensorRT-LLM figures (trtllm-bench 0.17, 0.20 and "
    "1.0 throughput tables; NIM 1.8.0 latency and throughput at concurrency 1-250) on "
    "H100-SXM and H200, Llama-3.1-8B and Llama-3.1/3.3-70B FP8, TP 1-8 "
    "(docs/simulate.md, 'Calibration')",
)

#: vLLM: TensorRT-LLM's kernel efficiencies (the published vLLM figures with fixed
#: lengths are too few to fit them), vLLM's own overheads, fitted to its published
#: batch latencies (BF16, TP 1 and 4, H100 and H200)
_VLLM = replace(
    _TRTLLM,
    name="vllm",
    overhead_s=1.65e-3,
    layer_overhead_s=1.31e-6,
    allreduce_latency_s=24.7e-6,
    source="the trtllm profile's kernel efficiencies, with per-step, per-layer and "
    "all-reduce overheads fitted to vLLM's performance-benchmark batch latencies "
    "(Llama-3.1-8B TP1 and Llama-3-70B TP4, BF16, H100-SXM and H200)",
)

CLOCKS: dict[str, ClockProfile] = {c.name: c for c in (_TRTLLM, _VLLM)}

#: the clock of ``--clock`` when none is named
DEFAULT_CLOCK = "vllm"


def clock(name: str) -> ClockProfile:
    """The clock profile called ``name``; ValueError lists them."""
    try:
        return CLOCKS[name]
    except KeyError:
        raise ValueError(f"unknown clock {name!r}; clocks: {', '.join(CLOCKS)}") from None


def _attention_kinds(
    compute: ModelCompute,
    specs: dict[str, KVCacheSpec],
    encoder_tokens: int | None,
) -> tuple[tuple[AttentionKind, ...], float]:
    """(attention patterns, Mamba state bytes per sequence) of the layer specs."""
    flops_per_pair = 2.0 * compute.num_attention_heads * (compute.qk_head_dim + compute.v_head_dim)
    kinds: dict[tuple[str, int, float], int] = {}
    state = 0.0
    for spec in specs.values():
        if isinstance(spec, MambaSpec):
            state += spec.real_page_size_bytes
            continue
        if isinstance(spec, CircularBufferSpec) or not isinstance(spec, AttentionSpec):
            continue
        per_token = spec.real_page_size_bytes / spec.block_size
        if isinstance(spec, SlidingWindowSpec):
            key = ("sliding_window", spec.sliding_window, per_token)
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            key = ("chunked_local", spec.attention_chunk_size, per_token)
        elif isinstance(spec, CrossAttentionSpec):
            key = ("cross", encoder_tokens or 0, per_token)
        else:
            key = ("full", 0, per_token)
        kinds[key] = kinds.get(key, 0) + 1
    return (
        tuple(
            AttentionKind(k, n, per_token, flops_per_pair, w)
            for (k, w, per_token), n in kinds.items()
        ),
        state,
    )


def roofline(
    preset: ModelPreset,
    gpu_spec: GpuSpec,
    *,
    tp: int = 1,
    block_size: int = 16,
    kv_dtype: str = "bfloat16",
    clock_profile: ClockProfile | None = None,
) -> RooflineModel:
    """The step-time roofline of ``preset`` on ``tp`` x ``gpu_spec``, with the
    efficiencies and overheads of ``clock_profile`` (default: ``DEFAULT_CLOCK``)."""
    prof = clock_profile or CLOCKS[DEFAULT_CLOCK]
    c = require_compute(preset)
    specs = preset.layer_specs(block_size, dtype=kv_dtype)
    attention, state = _attention_kinds(c, specs, preset.max_num_encoder_input_tokens)
    embed = c.vocab_size * c.hidden_size
    matmul_params = c.active_params - embed * (1 if c.tied_embeddings else 2)
    routed_active = c.expert_params * c.experts_per_token / c.num_experts if c.num_experts else 0.0
    expert_share = c.expert_params / c.params if c.params else 0.0
    return RooflineModel(
        matmul_flops_per_token=2.0 * max(matmul_params, routed_active),
        head_flops_per_sample=2.0 * embed,
        dense_weight_bytes=c.weight_bytes * (1 - expert_share),
        expert_weight_bytes=c.weight_bytes * expert_share,
        num_experts=c.num_experts,
        experts_per_token=c.experts_per_token,
        attention=attention,
        state_bytes_per_seq=state,
        hidden_size=c.hidden_size,
        num_layers=c.num_layers,
        peak_flops=gpu_spec.peak_flops(c.compute_dtype),
        hbm_bytes_per_s=gpu_spec.hbm_bytes_per_s,
        link_bytes_per_s=gpu_spec.link_bytes_per_s,
        tp=tp,
        kv_split=kv_split(c, tp),
        attention_peak_flops=gpu_spec.bf16_flops,
        compute_efficiency=prof.compute_efficiency,
        gemm_half_tokens=prof.gemm_half_tokens,
        attention_efficiency=prof.attention_efficiency,
        memory_efficiency=prof.memory_efficiency,
        kv_efficiency=prof.kv_efficiency,
        link_efficiency=prof.link_efficiency,
        overhead_s=prof.overhead_s,
        seq_overhead_s=prof.seq_overhead_s,
        layer_overhead_s=prof.layer_overhead_s,
        allreduce_latency_s=prof.allreduce_latency_s,
        request_overhead_s=prof.request_overhead_s,
        gpu=gpu_spec.name,
    )


def step_time_model(cfg: SimConfig, model: ModelPreset | None = None) -> StepTimeModel:
    """The clock of a run: ``step_time``'s linear model, else the roofline of the
    model (``model``: ``cfg``'s, already resolved) on ``tp`` x ``gpu``."""
    if cfg.step_time is not None:
        return LinearModel.parse(cfg.step_time)
    return roofline(
        model if model is not None else resolve(cfg),
        gpu(cfg.gpu),
        tp=cfg.tp,
        block_size=cfg.block_size,
        kv_dtype=cfg.kv_dtype,
        clock_profile=clock(cfg.clock),
    )
