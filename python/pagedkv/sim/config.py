"""The configuration of one simulation: model, GPUs, KV-cache memory, scheduler and clock.

:class:`SimConfig` is the first room of a simulation's setup: the model room
(:mod:`pagedkv.sim.model`) resolves its model, the deployment room
(:mod:`pagedkv.sim.deployment`) sizes the KV cache on its GPUs, the clock
(:mod:`pagedkv.sim.perf`) times its steps, and the runner
(:mod:`pagedkv.sim.runner`) runs it. It reads nothing of theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_DISK_GBPS", "DEFAULT_MAX_CONTEXT", "EVICTIONS", "OVERLONG", "SimConfig"]

#: The device pool's eviction policies (``SimConfig.eviction``): vLLM's LRU, and
#: the manager's adaptive (ARC) and segmented (SLRU) ones
EVICTIONS = ("lru", "arc", "slru")

#: GB/s of the disk tier, each way: one PCIe 4.0 NVMe drive
DEFAULT_DISK_GBPS = 6.0

#: the longest request built-in workloads make unless --max-model-len says otherwise
DEFAULT_MAX_CONTEXT = 16384

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
    #: GPU preset (``pagedkv.sim.deployment.GPUS``), tensor-parallel size, and the share
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
    #: GiB of host memory per GPU for a tier of evicted KV blocks under the
    #: device pool (0: none; an instance of ``tp`` GPUs has ``tp`` times it,
    #: vLLM's ``--kv-offloading-size``), its policy (``lru`` or ``arc``), when
    #: blocks are stored to it (``write-through``: once computed, vLLM's;
    #: ``write-back``: as the device pool is about to evict them, SGLang
    #: HiCache's), and GiB of disk per GPU below it (0: none)
    cpu_offload_gib: float = 0.0
    offload_policy: str = "lru"
    offload_write: str = "write-through"
    disk_offload_gib: float = 0.0
    #: each GPU's host link: ``pcie4``, ``pcie5``, ``nvlink-c2c`` or GB/s as
    #: text; None: the GPU preset's (:mod:`pagedkv.sim.tiers`)
    host_link: str | None = None
    #: GB/s of the disk tier per GPU, each way
    disk_gbps: float = DEFAULT_DISK_GBPS
    #: what the prefix-aware router counts a cached block held in host memory
    #: and on disk for, against 1 on the device (Dynamo's router's 0.75, 0.25;
    #: 0, 0: blind to the tiers)
    tier_weights: tuple[float, float] = (0.75, 0.25)
    #: the device pool's eviction policy: ``lru`` (vLLM's), or one of the
    #: manager's others
    eviction: str = "lru"
