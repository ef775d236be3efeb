"""GPUs, and what a model on them costs: the step-time roofline and the KV memory.

:data:`GPUS` holds the vendor datasheet figures of the GPUs a planner compares;
:func:`roofline` builds the :class:`~pagedkv.sim.steptime.RooflineModel` of a model
preset on ``tp`` of them; :func:`kv_cache_memory` sizes the KV cache as vLLM
does: GPU memory x ``gpu_memory_utilization``, less the weights on one GPU, less
the activations of a profile run and what lives outside PyTorch.
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
from .steptime import AttentionKind, RooflineModel

__all__ = ["CLOCKS", "GPUS", "ClockProfile", "GpuSpec", "clock", "kv_cache_memory", "roofline"]

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


def gpu(name: str) -> GpuSpec:
    """The GPU preset called ``name`` (case-insensitive); ValueError lists them."""
    for k, g in GPUS.items():
        if k.lower() == name.lower():
            return g
    raise ValueError(f"unknown GPU {name!r}; GPUs: {', '.join(GPUS)}")


def _compute(preset: ModelPreset) -> ModelCompute:
    if preset.compute is None:
        raise ValueError(f"model {preset.name!r} has no compute shape for the step-time model")
    return preset.compute


def check_tensor_parallel(compute: ModelCompute, tp: int, model: str) -> None:
    """Refuses (``ValueError``) a tensor-parallel size vLLM refuses for the model:
    the attention heads must split evenly over the GPUs, and the KV heads either
    split evenly (``kv_heads % tp == 0``) or replicate evenly (``tp % kv_heads
    == 0``)."""
    heads, kv = compute.num_attention_heads, compute.num_kv_heads
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if heads % tp:
        raise ValueError(
            f"{model}: {heads} attention heads do not split over --tp {tp} (the heads "
            "must be a multiple of the tensor-parallel size)"
        )
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ValueError(f"{model}: {kv} KV heads do not split or replicate evenly over --tp {tp}")


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
    c = _compute(preset)
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
    c = _compute(preset)
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
