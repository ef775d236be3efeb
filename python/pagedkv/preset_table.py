"""The built-in model presets: each model's KV layout and compute shape, from its config.json.

Each builder gives the per-layer specs vLLM 0.33 builds for the model at tensor
parallel size 1, keyed by layer names shaped like vLLM's module paths and in
model order; :data:`PRESETS` holds every preset by name, the FP8 checkpoints of
:data:`FP8_CHECKPOINTS` included. :mod:`pagedkv.presets` looks them up.
"""

from __future__ import annotations

import math
from dataclasses import replace

from .model_preset import LayerOptions, ModelCompute, ModelPreset
from .specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

__all__ = ["FP8_CHECKPOINTS", "PRESETS"]

#: Smallest kernel block of a FlashAttention-style backend (kernel block sizes are
#: multiples of 16 tokens); vLLM aligns hybrid attention block sizes to it.
_KERNEL_BLOCK_ALIGNMENT = 16


def _llama_3_1_8b(o: LayerOptions) -> dict[str, KVCacheSpec]:
    spec = FullAttentionSpec(o.block_size, 8, 128, o.dtype)
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(32)}


def _llama_3_1_70b(o: LayerOptions) -> dict[str, KVCacheSpec]:
    spec = FullAttentionSpec(o.block_size, 8, 128, o.dtype)
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(80)}


def _gemma_3_27b(o: LayerOptions) -> dict[str, KVCacheSpec]:
    full = FullAttentionSpec(o.block_size, 16, 128, o.dtype)
    local = SlidingWindowSpec(o.block_size, 16, 128, o.dtype, 1024)
    return {
        f"language_model.model.layers.{i}.self_attn.attn": full if (i + 1) % 6 == 0 else local
        for i in range(62)
    }


def _gpt_oss_120b(o: LayerOptions) -> dict[str, KVCacheSpec]:
    full = FullAttentionSpec(o.block_size, 8, 64, o.dtype)
    swa = SlidingWindowSpec(o.block_size, 8, 64, o.dtype, 128)
    return {f"model.layers.{i}.attn.attn": swa if i % 2 == 0 else full for i in range(36)}


def _llama_4_scout(o: LayerOptions) -> dict[str, KVCacheSpec]:
    full = FullAttentionSpec(o.block_size, 8, 128, o.dtype)
    local = ChunkedLocalAttentionSpec(o.block_size, 8, 128, o.dtype, 8192)
    return {
        f"language_model.model.layers.{i}.self_attn.attn": full if (i + 1) % 4 == 0 else local
        for i in range(48)
    }


def _jamba_1_5_mini(o: LayerOptions) -> dict[str, KVCacheSpec]:
    # Mamba-1 state of one layer (vLLM's mamba1_state_shape, TP 1, default "SD" conv
    # layout): conv state (d_conv - 1, intermediate), SSM state (intermediate, d_state),
    # intermediate = mamba_expand * hidden_size = 2 * 4096.
    intermediate = 2 * 4096
    shapes = ((4 - 1, intermediate), (intermediate, 16))
    state_dtypes = ("bfloat16", "bfloat16")
    mamba_page = sum(math.prod(s) for s in shapes) * 2
    # vLLM (Platform._align_hybrid_block_size): the attention block grows until its
    # page holds a Mamba state, in steps of the kernel block; the Mamba page is then
    # padded to the attention page.
    attn_1_token = FullAttentionSpec(1, 8, 128, o.dtype).page_size_bytes
    align = max(_KERNEL_BLOCK_ALIGNMENT, o.block_size)
    attn_block_size = align * -(-mamba_page // (align * attn_1_token))
    attn_block_size = _KERNEL_BLOCK_ALIGNMENT * -(-attn_block_size // _KERNEL_BLOCK_ALIGNMENT)
    block_size = max(o.block_size, attn_block_size)
    attn = FullAttentionSpec(block_size, 8, 128, o.dtype)
    padded = attn.page_size_bytes if attn.page_size_bytes != mamba_page else None
    mamba_block_size = block_size if o.mamba_cache_mode != "none" else o.max_model_len
    mamba = MambaSpec(
        mamba_block_size,
        shapes,
        state_dtypes,
        page_size_padded=padded,
        mamba_cache_mode=o.mamba_cache_mode,
        num_speculative_blocks=o.num_speculative_blocks,
    )
    return {
        (f"model.layers.{i}.self_attn.attn" if i % 8 == 4 else f"model.layers.{i}.mamba"): (
            attn if i % 8 == 4 else mamba
        )
        for i in range(32)
    }


def _deepseek_v3(o: LayerOptions) -> dict[str, KVCacheSpec]:
    spec = MLAAttentionSpec(o.block_size, 1, 512 + 64, o.dtype)
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(61)}


def _whisper_large_v3(o: LayerOptions) -> dict[str, KVCacheSpec]:
    self_attn = FullAttentionSpec(o.block_size, 20, 64, o.dtype)
    cross_attn = CrossAttentionSpec(o.block_size, 20, 64, o.dtype)
    specs: dict[str, KVCacheSpec] = {}
    for i in range(32):
        specs[f"model.decoder.layers.{i}.self_attn.attn"] = self_attn
        specs[f"model.decoder.layers.{i}.encoder_attn.attn"] = cross_attn
    return specs


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            name="llama-3.1-8b",
            model="meta-llama/Llama-3.1-8B",
            max_model_len=131072,
            source="num_hidden_layers 32, num_key_value_heads 8, head_dim 128 (hidden_size 4096 / "
            "32 heads), max_position_embeddings 131072: 32 full-attention layers.",
            _build=_llama_3_1_8b,
            compute=ModelCompute(
                params=8.03e9,
                active_params=8.03e9,
                hidden_size=4096,
                num_layers=32,
                num_attention_heads=32,
                num_kv_heads=8,
                qk_head_dim=128,
                v_head_dim=128,
                intermediate_size=14336,
                vocab_size=128256,
                weight_bytes=2 * 8.03e9,
            ),
        ),
        ModelPreset(
            name="llama-3.1-70b",
            model="meta-llama/Llama-3.1-70B",
            max_model_len=131072,
            source="num_hidden_layers 80, num_key_value_heads 8, head_dim 128 (hidden_size 8192 / "
            "64 heads), intermediate_size 28672, max_position_embeddings 131072: 80 "
            "full-attention layers (Llama-3.3-70B has the same shape).",
            _build=_llama_3_1_70b,
            compute=ModelCompute(
                params=70.55e9,
                active_params=70.55e9,
                hidden_size=8192,
                num_layers=80,
                num_attention_heads=64,
                num_kv_heads=8,
                qk_head_dim=128,
                v_head_dim=128,
                intermediate_size=28672,
                vocab_size=128256,
                weight_bytes=2 * 70.55e9,
            ),
        ),
        ModelPreset(
            name="gemma-3-27b",
            model="google/gemma-3-27b-it",
            max_model_len=131072,
            source="text_config: num_hidden_layers 62, num_key_value_heads 16, head_dim 128, "
            "sliding_window 1024, sliding_window_pattern 6 (layers 5, 11, ..., 59 are "
            "global), max_position_embeddings 131072: 52 sliding-window (1024) + 10 "
            "full-attention layers.",
            _build=_gemma_3_27b,
            compute=ModelCompute(
                params=27.43e9,  # 27.0e9 language model + 0.43e9 vision tower
                active_params=27.0e9,
                hidden_size=5376,
                num_layers=62,
                num_attention_heads=32,
                num_kv_heads=16,
                qk_head_dim=128,
                v_head_dim=128,
                intermediate_size=21504,
                vocab_size=262208,
                weight_bytes=2 * 27.43e9,
                tied_embeddings=True,
            ),
        ),
        ModelPreset(
            name="gpt-oss-120b",
            model="openai/gpt-oss-120b",
            max_model_len=131072,
            source="num_hidden_layers 36, num_key_value_heads 8, head_dim 64, sliding_window 128, "
            "layer_types alternating sliding_attention / full_attention (even layers "
            "slide), max_position_embeddings 131072: 18 sliding-window (128) + 18 full.",
            _build=_gpt_oss_120b,
            compute=ModelCompute(
                params=116.83e9,
                active_params=5.13e9,
                hidden_size=2880,
                num_layers=36,
                num_attention_heads=64,
                num_kv_heads=8,
                qk_head_dim=64,
                v_head_dim=64,
                intermediate_size=4 * 2880,
                vocab_size=201088,
                weight_bytes=65.3e9,  # MXFP4 experts: a 60.8 GiB checkpoint
                num_experts=128,
                experts_per_token=4,
                expert_params=115.3e9,
            ),
        ),
        ModelPreset(
            name="llama-4-scout",
            model="meta-llama/Llama-4-Scout-17B-16E-Instruct",
            max_model_len=10485760,
            source="text_config: num_hidden_layers 48, num_key_value_heads 8, head_dim 128, "
            "attention_chunk_size 8192, no_rope_layers [1, 1, 1, 0] * 12 (every 4th layer "
            "is a NoPE global layer), max_position_embeddings 10485760: 36 chunked-local "
            "(8192) + 12 full-attention layers.",
            _build=_llama_4_scout,
            compute=ModelCompute(
                params=108.6e9,
                active_params=17.17e9,
                hidden_size=5120,
                num_layers=48,
                num_attention_heads=40,
                num_kv_heads=8,
                qk_head_dim=128,
                v_head_dim=128,
                intermediate_size=16384,
                vocab_size=202048,
                weight_bytes=2 * 108.6e9,
                num_experts=16,
                experts_per_token=1,
                expert_params=97.5e9,
            ),
        ),
        ModelPreset(
            name="jamba-1.5-mini",
            model="ai21labs/AI21-Jamba-1.5-Mini",
            max_model_len=262144,
            source="num_hidden_layers 32, attn_layer_period 8, attn_layer_offset 4 (layers 4, 12, "
            "20, 28 are attention), num_key_value_heads 8, head_dim 128 (4096 / 32), "
            "hidden_size 4096, mamba_expand 2, mamba_d_state 16, mamba_d_conv 4, "
            "max_position_embeddings 262144: 28 Mamba-1 layers with states (3, 8192) + "
            "(8192, 16) in bfloat16 (311,296 bytes) + 4 full-attention layers. As vLLM "
            "does for hybrid models, the attention block size grows to a multiple of 16 "
            "whose page holds a Mamba state (80 tokens for block_size 16: 327,680 "
            "bytes) and the Mamba page is padded to it.",
            _build=_jamba_1_5_mini,
            compute=ModelCompute(
                params=51.6e9,
                active_params=12.0e9,
                hidden_size=4096,
                num_layers=32,
                num_attention_heads=32,
                num_kv_heads=8,
                qk_head_dim=128,
                v_head_dim=128,
                intermediate_size=14336,
                vocab_size=65536,
                weight_bytes=2 * 51.6e9,
                num_experts=16,
                experts_per_token=2,
                expert_params=45.26e9,
            ),
        ),
        ModelPreset(
            name="deepseek-v3",
            model="deepseek-ai/DeepSeek-V3",
            max_model_len=163840,
            source="num_hidden_layers 61, kv_lora_rank 512, qk_rope_head_dim 64, "
            "max_position_embeddings 163840: 61 MLA layers of 1 latent head of "
            "512 + 64 = 576.",
            _build=_deepseek_v3,
            compute=ModelCompute(
                params=671e9,
                active_params=37e9,
                hidden_size=7168,
                num_layers=61,
                num_attention_heads=128,
                num_kv_heads=1,
                qk_head_dim=512 + 64,
                v_head_dim=512,
                intermediate_size=18432,
                vocab_size=129280,
                weight_bytes=6.9e11,  # FP8 weights, bfloat16 norms and embeddings
                num_experts=256,
                experts_per_token=8,
                expert_params=654.5e9,
                compute_dtype="fp8",
            ),
        ),
        ModelPreset(
            name="whisper-large-v3",
            model="openai/whisper-large-v3",
            max_model_len=448,
            max_num_encoder_input_tokens=1500,
            source="decoder_layers 32, decoder_attention_heads 20, d_model 1280 (head_dim 64), "
            "max_target_positions 448, max_source_positions 1500: 32 decoder layers, each "
            "with a self-attention (full) and a cross-attention layer over the 1500 "
            "encoder outputs; encoder layers keep no KV cache.",
            _build=_whisper_large_v3,
            # The decoder only: the encoder runs once per request, outside the steps.
            compute=ModelCompute(
                params=1.55e9,
                active_params=0.907e9,
                hidden_size=1280,
                num_layers=32,
                num_attention_heads=20,
                num_kv_heads=20,
                qk_head_dim=64,
                v_head_dim=64,
                intermediate_size=5120,
                vocab_size=51866,
                weight_bytes=2 * 1.55e9,
                tied_embeddings=True,
            ),
        ),
    )
}


#: FP8 checkpoints of the presets: (preset, its base, the checkpoint). Their
#: linear layers' weights are FP8 (one byte, the FP8 peak), the embedding and LM
#: head bfloat16, as ModelOpt and compressed-tensors quantize them.
FP8_CHECKPOINTS = (
    ("llama-3.1-8b-fp8", "llama-3.1-8b", "nvidia/Llama-3.1-8B-Instruct-FP8"),
    ("llama-3.1-70b-fp8", "llama-3.1-70b", "nvidia/Llama-3.1-70B-Instruct-FP8"),
    ("llama-3.3-70b-fp8", "llama-3.1-70b", "nvidia/Llama-3.3-70B-Instruct-FP8"),
)


def _fp8_preset(name: str, base: ModelPreset, model: str) -> ModelPreset:
    assert base.compute is not None
    return replace(
        base,
        name=name,
        model=model,
        source=f"{base.source} FP8 weights ({model}): linear layers in one byte, "
        "the embedding and LM head in bfloat16.",
        compute=base.compute.quantized("fp8"),
    )


PRESETS.update(
    (name, _fp8_preset(name, PRESETS[base], model)) for name, base, model in FP8_CHECKPOINTS
)
