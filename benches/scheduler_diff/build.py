"""Building one configuration's scheduler, on vLLM's manager or on pagedkv's drop-in."""

from __future__ import annotations

from typing import Any

from .cases import Case
from .connector import register_connector
from .workload import FakeModel, ReqSpec

MODEL = "facebook/opt-125m"
MAX_MODEL_LEN = 2048


class Unsupported(Exception):
    """This vLLM build cannot run the configuration (the reason is the message)."""


def _groups(case: Case) -> list[Any]:
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    bs = case.block_size
    f32 = torch.float32

    def full() -> Any:
        return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=f32)

    def swa() -> Any:
        return SlidingWindowSpec(
            block_size=bs, num_kv_heads=1, head_size=1, dtype=f32, sliding_window=2 * bs + 1
        )

    specs: dict[str, list[Any]] = {
        "full": [full()],
        "mla": [
            MLAAttentionSpec(
                block_size=bs, num_kv_heads=1, head_size=576, dtype=f32, max_tp_shards=1
            )
        ],
        "swa": [swa()],
        "chunked_local": [
            ChunkedLocalAttentionSpec(
                block_size=bs, num_kv_heads=1, head_size=1, dtype=f32, attention_chunk_size=4 * bs
            )
        ],
        "full+swa": [full(), swa()],
        "full+mamba": [
            full(),
            MambaSpec(block_size=bs, shapes=((1, 1),), dtypes=(f32,), mamba_cache_mode="align"),
        ],
    }
    return [KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs[case.layout])]


def num_blocks_for(case: Case, workload: list[ReqSpec]) -> int:
    bs = case.block_size
    groups = len(_groups(case))
    need = [
        (
            len(s.prompt)
            + s.max_tokens
            + sum(len(c[1] or []) + c[2] for c in s.chunks)
            + case.num_spec_tokens
            + bs
        )
        // bs
        + 1
        for s in workload
    ]
    if case.pressure is None:
        return 4 * groups * sum(need) + 64
    # A streaming session keeps its blocks while it waits for its next chunk,
    # and vLLM never preempts a waiting request: sessions parked on every
    # block stall both schedulers (the run then stops, see _run). Room for a
    # quarter of the sessions at their longest, plus one more request.
    sessions = sum(n for n, s in zip(need, workload, strict=True) if s.resumable)
    one = max(need) + 2 + sessions // 4
    return max(one, int(case.pressure * sum(need))) * groups + 1


def build_scheduler(case: Case, model: FakeModel, num_blocks: int) -> Any:
    from vllm.config import (
        CacheConfig,
        KVEventsConfig,
        KVTransferConfig,
        LoRAConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(
        model=MODEL, dtype="float16", seed=42, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=case.max_num_seqs,
        max_num_batched_tokens=case.max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        async_scheduling=case.async_sched,
        is_encoder_decoder=False,
        watermark=0.0,
        policy="priority" if case.priority else "fcfs",
    )
    cache_kwargs: dict[str, Any] = {}
    if "mamba" in case.layout:
        cache_kwargs["mamba_cache_mode"] = "align"
    cache_config = CacheConfig(
        block_size=case.block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=case.prefix_caching,
        **cache_kwargs,
    )
    kv_transfer_config = None
    if case.connector is not None:
        register_connector()
        kv_transfer_config = KVTransferConfig(
            kv_connector="PagedkvDiffConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"model": model, "is_async": case.connector == "async"},
            kv_load_failure_policy=case.load_failure_policy,
        )
    speculative_config = None
    parallel_config = ParallelConfig()
    if case.spec == "ngram":
        # vLLM runs n-gram drafting on the GPU under async scheduling.
        speculative_config = SpeculativeConfig(
            model="ngram",
            method="ngram_gpu" if case.async_sched else "ngram",
            num_speculative_tokens=case.num_spec_tokens,
        )
    elif case.spec == "draft":
        try:
            speculative_config = SpeculativeConfig(
                model=MODEL,
                method="draft_model",
                num_speculative_tokens=case.num_spec_tokens,
                target_model_config=model_config,
                target_parallel_config=parallel_config,
            )
        except Exception as e:
            raise Unsupported(f"draft-model SpeculativeConfig: {type(e).__name__}: {e}") from e
    lora_config = LoRAConfig(max_loras=2, max_lora_rank=8) if case.lora else None
    events_config = (
        KVEventsConfig(enable_kv_cache_events=True, publisher="null") if case.events else None
    )
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        parallel_config=parallel_config,
        kv_transfer_config=kv_transfer_config,
        speculative_config=speculative_config,
        lora_config=lora_config,
        kv_events_config=events_config,
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=_groups(case)
    )
    cache_config.num_gpu_blocks = num_blocks
    register_all_kvcache_specs(vllm_config)
    cls = AsyncScheduler if case.async_sched else Scheduler
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=case.block_size,
        log_stats=True,
    )


def build_pair(case: Case, model: FakeModel, num_blocks: int) -> tuple[Any, Any]:
    """(vLLM's side, pagedkv's side), each built while its manager class is in place."""
    import pagedkv.vllm as pv

    was = pv.installed()
    try:
        pv.uninstall()
        ref = build_scheduler(case, model, num_blocks)
        pv.install()
        dut = build_scheduler(case, model, num_blocks)
    finally:
        if was:
            pv.install()
        else:
            pv.uninstall()
    assert not type(ref.kv_cache_manager).__module__.startswith("pagedkv"), type(
        ref.kv_cache_manager
    )
    assert type(dut.kv_cache_manager).__module__.startswith("pagedkv"), type(dut.kv_cache_manager)
    return ref, dut
