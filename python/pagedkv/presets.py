"""KV-cache layouts of real models, from their public ``config.json`` files.

>>> from pagedkv import presets
>>> p = presets.get("gemma-3-27b")
>>> specs = p.layer_specs(block_size=16)
>>> len(specs), p.max_model_len
(62, 131072)

Each preset gives the per-layer specs vLLM 0.33 builds for the model at tensor
parallel size 1 with a ``bfloat16`` KV cache (``dtype`` changes the attention
cache dtype, e.g. ``"fp8"``), keyed by layer names shaped like vLLM's module paths
and in model order (the order matters for grouping), and the model's context
length (``max_position_embeddings``). Feed them to
:func:`pagedkv.get_kv_cache_config`.

Presets: ``llama-3.1-8b`` and ``llama-3.1-70b`` (dense; ``-fp8``: their FP8
checkpoints, and ``llama-3.3-70b-fp8``), ``gemma-3-27b`` (5 local : 1 global),
``gpt-oss-120b`` (alternating sliding / full), ``llama-4-scout`` (chunked local +
full every 4th layer), ``jamba-1.5-mini`` (Mamba hybrid), ``deepseek-v3`` (MLA),
``whisper-large-v3`` (encoder-decoder with cross-attention).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import InvalidConfigError
from .specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

__all__ = ["QUANTIZATIONS", "ModelCompute", "ModelPreset", "from_hf_config", "get", "names"]

#: Smallest kernel block of a FlashAttention-style backend (kernel block sizes are
#: multiples of 16 tokens); vLLM aligns hybrid attention block sizes to it.
_KERNEL_BLOCK_ALIGNMENT = 16


@dataclass(frozen=True)
class _Options:
    block_size: int
    dtype: Any
    mamba_cache_mode: str
    num_speculative_blocks: int
    max_model_len: int


@dataclass(frozen=True)
class ModelCompute:
    """What a step costs to compute, besides the KV cache (which the layer specs
    give): the simulator's step-time model reads it.

    ``params``: all parameters (the weights loaded); ``active_params``: those one
    token runs through (MoE: the routed experts it picks, shared experts, attention,
    embeddings); ``expert_params``, ``num_experts``, ``experts_per_token``: the
    routed experts; ``weight_bytes``: bytes of the loaded weights (quantized
    checkpoints are smaller than 2 bytes per parameter); ``qk_head_dim`` /
    ``v_head_dim``: per attention head, the dimensions of the score and value
    products (MLA: the absorbed latent form, ``kv_lora_rank + rope`` and
    ``kv_lora_rank``); ``compute_dtype``: ``bf16`` or ``fp8``, the matmul peak that
    applies; ``num_kv_heads``: KV heads, the most ways tensor parallelism splits
    the KV cache (MLA: 1, replicated).
    """

    params: float
    active_params: float
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    intermediate_size: int
    vocab_size: int
    weight_bytes: float
    tied_embeddings: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    expert_params: float = 0.0
    compute_dtype: str = "bf16"

    @property
    def embedding_params(self) -> float:
        """Parameters of the token embedding and the LM head (one matrix when tied)."""
        return float(self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2))

    def quantized(self, method: str) -> ModelCompute:
        """The same model with its weights quantized by ``method``: ``"fp8"``
        (vLLM's ``--quantization fp8``, ModelOpt and compressed-tensors FP8
        checkpoints): every linear layer's weights in one byte, the embedding and
        the LM head left in bfloat16, matmuls at the FP8 peak; ``"none"``: the
        model as it is."""
        if method == "none":
            return self
        if method != "fp8":
            raise ValueError(
                f"unknown quantization {method!r}; quantizations: {', '.join(QUANTIZATIONS)}"
            )
        embed = self.embedding_params
        return replace(self, weight_bytes=(self.params - embed) + 2 * embed, compute_dtype="fp8")


#: the weight quantizations of ``--quantization`` (``ModelCompute.quantized``)
QUANTIZATIONS = ("none", "fp8")


@dataclass(frozen=True)
class ModelPreset:
    """One model's KV-cache layout.

    ``name``: the preset's name; ``model``: the Hugging Face model it follows;
    ``max_model_len``: the model's context length (``max_position_embeddings``);
    ``max_num_encoder_input_tokens``: the encoder output length for
    encoder-decoder models (pass it to the config builder), else ``None``;
    ``source``: the config numbers used; ``compute``: the model's compute shape
    (the simulator's step-time model).
    """

    name: str
    model: str
    max_model_len: int
    source: str
    _build: Callable[[_Options], dict[str, KVCacheSpec]] = field(repr=False, compare=False)
    max_num_encoder_input_tokens: int | None = None
    compute: ModelCompute | None = None

    def layer_specs(
        self,
        block_size: int = 16,
        *,
        dtype: Any = "bfloat16",
        mamba_cache_mode: str = "align",
        num_speculative_blocks: int = 0,
        max_model_len: int | None = None,
    ) -> dict[str, KVCacheSpec]:
        """Layer name -> spec, in model order.

        ``block_size``: tokens per attention block (vLLM's ``--block-size``).
        ``dtype``: the attention KV-cache dtype. The Mamba options apply to Mamba
        layers only: ``mamba_cache_mode`` ``"align"`` (prefix caching, vLLM's
        default when prefix caching is on) or ``"none"`` (the Mamba block then spans
        ``max_model_len`` tokens, default this preset's), and
        ``num_speculative_blocks``.
        """
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise InvalidConfigError(f"block_size must be a positive int, got {block_size!r}")
        if max_model_len is None:
            max_model_len = self.max_model_len
        return self._build(
            _Options(block_size, dtype, mamba_cache_mode, num_speculative_blocks, max_model_len)
        )


# ------------------------------------------------------------------------- models


def _llama_3_1_8b(o: _Options) -> dict[str, KVCacheSpec]:
    spec = FullAttentionSpec(o.block_size, 8, 128, o.dtype)
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(32)}


def _llama_3_1_70b(o: _Options) -> dict[str, KVCacheSpec]:
    spec = FullAttentionSpec(o.block_size, 8, 128, o.dtype)
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(80)}


def _gemma_3_27b(o: _Options) -> dict[str, KVCacheSpec]:
    full = FullAttentionSpec(o.block_size, 16, 128, o.dtype)
    local = SlidingWindowSpec(o.block_size, 16, 128, o.dtype, 1024)
    return {
        f"language_model.model.layers.{i}.self_attn.attn": full if (i + 1) % 6 == 0 else local
        for i in range(62)
    }


def _gpt_oss_120b(o: _Options) -> dict[str, KVCacheSpec]:
    full = FullAttentionSpec(o.block_size, 8, 64, o.dtype)
    swa = SlidingWindowSpec(o.block_size, 8, 64, o.dtype, 128)
    return {f"model.layers.{i}.attn.attn": swa if i % 2 == 0 else full for i in range(36)}


def _llama_4_scout(o: _Options) -> dict[str, KVCacheSpec]:
    full = FullAttentionSpec(o.block_size, 8, 128, o.dtype)
    local = ChunkedLocalAttentionSpec(o.block_size, 8, 128, o.dtype, 8192)
    return {
        f"language_model.model.layers.{i}.self_attn.attn": full if (i + 1) % 4 == 0 else local
        for i in range(48)
    }


def _jamba_1_5_mini(o: _Options) -> dict[str, KVCacheSpec]:
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


def _deepseek_v3(o: _Options) -> dict[str, KVCacheSpec]:
    spec = MLAAttentionSpec(o.block_size, 1, 512 + 64, o.dtype)
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(61)}


def _whisper_large_v3(o: _Options) -> dict[str, KVCacheSpec]:
    self_attn = FullAttentionSpec(o.block_size, 20, 64, o.dtype)
    cross_attn = CrossAttentionSpec(o.block_size, 20, 64, o.dtype)
    specs: dict[str, KVCacheSpec] = {}
    for i in range(32):
        specs[f"model.decoder.layers.{i}.self_attn.attn"] = self_attn
        specs[f"model.decoder.layers.{i}.encoder_attn.attn"] = cross_attn
    return specs


_PRESETS: dict[str, ModelPreset] = {
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


_PRESETS.update(
    (name, _fp8_preset(name, _PRESETS[base], model)) for name, base, model in FP8_CHECKPOINTS
)


def names() -> list[str]:
    """The preset names."""
    return list(_PRESETS)


def get(name: str) -> ModelPreset:
    """The preset called ``name`` (case-insensitive). ``KeyError`` lists the names."""
    try:
        return _PRESETS[name.lower()]
    except (KeyError, AttributeError):
        raise KeyError(f"unknown preset {name!r}; presets: {', '.join(_PRESETS)}") from None


# ------------------------------------------------------------------ config.json

#: The largest config.json read (real ones are a few KiB).
MAX_CONFIG_BYTES = 1 << 20

#: The range each config.json field may take (the largest real models sit far
#: inside: 126 layers, hidden 16,384, 128 heads, 384 experts, 10 M tokens).
CONFIG_LIMITS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, 1024),
    "hidden_size": (1, 1 << 17),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 1024),
    "intermediate_size": (1, 1 << 20),
    "vocab_size": (1, 1 << 24),
    "max_position_embeddings": (1, 1 << 28),
    "kv_lora_rank": (1, 1 << 14),
    "q_lora_rank": (1, 1 << 17),
    "qk_rope_head_dim": (1, 1024),
    "qk_nope_head_dim": (1, 1024),
    "v_head_dim": (1, 1024),
    "num_local_experts": (0, 4096),
    "num_experts_per_tok": (1, 4096),
    "moe_intermediate_size": (1, 1 << 20),
    "n_shared_experts": (0, 64),
    "first_k_dense_replace": (0, 1024),
    "sliding_window": (1, 1 << 28),
    "sliding_window_pattern": (1, 1024),
    "attention_chunk_size": (1, 1 << 28),
}


def _field(cfg: Mapping[str, Any], where: str, *names: str, default: Any = None) -> Any:
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    if default is None:
        raise ValueError(f"{where}: missing {names[0]!r}")
    return default


def _int_field(
    cfg: Mapping[str, Any],
    where: str,
    *names: str,
    default: int | None = None,
    limit: str | None = None,
    maximum: int | None = None,
) -> int:
    """An integer field (the first of ``names`` present), in the range
    ``CONFIG_LIMITS[limit or names[0]]`` (``maximum`` lowers its top)."""
    v = _field(cfg, where, *names, default=default)
    lo, hi = CONFIG_LIMITS.get(limit or names[0], (1, 1 << 40))
    if maximum is not None:
        hi = min(hi, maximum)
    name = next((n for n in names if cfg.get(n) is not None), names[0])
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{where}: {name} must be an integer in {lo}..{hi}, got {v!r}")
    if not lo <= v <= hi:
        raise ValueError(f"{where}: {name} must be in {lo}..{hi}, got {v}")
    return v


def _bool_field(cfg: Mapping[str, Any], where: str, name: str, default: bool) -> bool:
    v = cfg.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{where}: {name} must be true or false, got {v!r}")
    return v


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _read_config(path: Path) -> Any:
    """The parsed file, read up to ``MAX_CONFIG_BYTES`` (a FIFO or device too)."""
    where = str(path)
    with open(path, "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(f"{where}: larger than {MAX_CONFIG_BYTES} bytes: not a config.json")
    try:
        return json.loads(raw.decode("utf-8-sig"), parse_constant=_no_constant)
    except RecursionError:
        raise ValueError(f"{where}: not JSON (nested too deeply)") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{where}: not JSON ({e})") from None


def _is_fp8(quant: Mapping[str, Any]) -> bool:
    """Whether a ``quantization_config`` stores FP8 weights: vLLM's ``fp8``,
    ModelOpt's ``FP8`` algorithm, or compressed-tensors groups of 8-bit float
    weights."""
    method = quant.get("quant_method")
    if method == "fp8":
        return True
    if method == "modelopt":
        return str(quant.get("quant_algo", "")).upper() == "FP8"
    if method == "compressed-tensors":
        groups = quant.get("config_groups")
        if not isinstance(groups, Mapping) or not groups:
            return False
        for g in groups.values():
            w = g.get("weights") if isinstance(g, Mapping) else None
            if not (isinstance(w, Mapping) and w.get("num_bits") == 8 and w.get("type") == "float"):
                return False
        return True
    return False


def _layer_kinds(t: Mapping[str, Any], where: str, n: int) -> list[tuple[str, int]]:
    """Per layer: ``("full", 0)``, ``("sliding", window)`` or ``("chunked", size)``."""
    chunk = t.get("attention_chunk_size")
    if chunk is not None:
        size = _int_field(t, where, "attention_chunk_size")
        no_rope = t.get("no_rope_layers")
        if no_rope is None:
            return [("chunked", size)] * n
        if (
            not isinstance(no_rope, list)
            or len(no_rope) != n
            or not all(isinstance(x, int) and x in (0, 1) for x in no_rope)
        ):
            raise ValueError(f"{where}: no_rope_layers must hold 0 or 1 for each of the {n} layers")
        return [("full", 0) if not x else ("chunked", size) for x in no_rope]
    window = t.get("sliding_window")
    if window is None or not _bool_field(t, where, "use_sliding_window", True):
        return [("full", 0)] * n
    w = _int_field(t, where, "sliding_window")
    types = t.get("layer_types")
    if types is not None:
        if (
            not isinstance(types, list)
            or len(types) != n
            or not all(isinstance(x, str) for x in types)
        ):
            raise ValueError(f"{where}: layer_types must name each of the {n} layers")
        return [("sliding", w) if "sliding" in x else ("full", 0) for x in types]
    pattern = t.get("sliding_window_pattern")
    if pattern is not None:
        p = _int_field(t, where, "sliding_window_pattern", maximum=n)
        return [("full", 0) if (i + 1) % p == 0 else ("sliding", w) for i in range(n)]
    return [("sliding", w)] * n


def from_hf_config(
    source: str | Path | Mapping[str, Any], *, name: str | None = None
) -> ModelPreset:
    """A preset from a Hugging Face ``config.json`` (a path or the parsed dict).

    Decoder-only transformers: full attention with any number of KV heads (MHA,
    GQA, MQA); sliding windows on every layer (``sliding_window``), per layer
    (``layer_types``) or every n-th layer global (``sliding_window_pattern``);
    chunked local attention (``attention_chunk_size``, global where
    ``no_rope_layers`` is 0); MLA (``kv_lora_rank``, ``qk_rope_head_dim``); routed
    experts (``num_local_experts`` / ``n_routed_experts`` / ``num_experts``,
    ``num_experts_per_tok``, ``moe_intermediate_size``, ``n_shared_experts``,
    ``first_k_dense_replace``). A ``text_config`` is read in place of the top
    level. Parameter counts are computed from the shapes (embeddings, attention
    projections, gated MLPs, experts, routers); FP8 checkpoints
    (``quantization_config``: ``fp8``, ModelOpt ``FP8``, compressed-tensors 8-bit
    float weights) weigh 1 byte per linear-layer parameter (the embedding and LM
    head 2) and compute at the FP8 peak, others 2 bytes per parameter. Mamba /
    linear-attention layers are refused (use a preset). Raises ValueError naming what is wrong."""
    where = "config"
    if isinstance(source, Mapping):
        data: Any = source
    else:
        path = Path(source)
        where = str(path)
        data = _read_config(path)
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: a config.json holds one JSON object")
    text = data.get("text_config")
    if text is not None and not isinstance(text, Mapping):
        raise ValueError(f"{where}: text_config must be a JSON object")
    t: Mapping[str, Any] = text if isinstance(text, Mapping) else data
    if any(
        k in t for k in ("mamba_d_state", "ssm_state_size", "mamba_expand", "linear_attn_config")
    ):
        raise ValueError(f"{where}: Mamba / linear-attention layers are not read from config.json")
    n = _int_field(t, where, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _int_field(t, where, "hidden_size", "d_model")
    heads = _int_field(t, where, "num_attention_heads", "n_head")
    kv_heads = _int_field(t, where, "num_key_value_heads", default=heads, maximum=heads)
    if heads % kv_heads:
        raise ValueError(
            f"{where}: num_attention_heads ({heads}) is not a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    head_dim = _int_field(t, where, "head_dim", default=min(1024, max(1, hidden // heads)))
    inter = _int_field(t, where, "intermediate_size", "ffn_dim", default=min(4 * hidden, 1 << 20))
    vocab = _int_field(t, where, "vocab_size")
    max_len = _int_field(
        t,
        where,
        "max_position_embeddings",
        "max_seq_len",
        default=4096,
        limit="max_position_embeddings",
    )
    if "tie_word_embeddings" in data:
        tied = _bool_field(data, where, "tie_word_embeddings", False)
    else:
        tied = _bool_field(t, where, "tie_word_embeddings", False)
    quant = data.get("quantization_config")
    if quant is not None and not isinstance(quant, Mapping):
        raise ValueError(f"{where}: quantization_config must be a JSON object")
    fp8 = isinstance(quant, Mapping) and _is_fp8(quant)
    mla = t.get("kv_lora_rank") is not None
    if mla:
        lora = _int_field(t, where, "kv_lora_rank")
        rope = _int_field(t, where, "qk_rope_head_dim")
        nope = _int_field(t, where, "qk_nope_head_dim", default=head_dim)
        v_dim = _int_field(t, where, "v_head_dim", default=head_dim)
        q_lora = None if t.get("q_lora_rank") is None else _int_field(t, where, "q_lora_rank")
        q_in = (
            hidden * q_lora + q_lora * heads * (nope + rope)
            if q_lora
            else hidden * heads * (nope + rope)
        )
        attn = (
            q_in + hidden * (lora + rope) + lora * heads * (nope + v_dim) + heads * v_dim * hidden
        )
        kinds = [("full", 0)] * n
        qk_dim, v_head, kv_split = lora + rope, lora, 1
    else:
        attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        kinds = _layer_kinds(t, where, n)
        qk_dim, v_head, kv_split = head_dim, head_dim, kv_heads
    experts = _int_field(
        t,
        where,
        "num_local_experts",
        "n_routed_experts",
        "num_experts",
        default=0,
        limit="num_local_experts",
    )
    mlp = 3 * hidden * inter
    expert_params = 0.0
    active_experts = 0.0
    k = 0
    if experts:
        k = _int_field(
            t,
            where,
            "num_experts_per_tok",
            "moe_topk",
            limit="num_experts_per_tok",
            maximum=experts,
        )
        moe_inter = _int_field(
            t,
            where,
            "moe_intermediate_size",
            "intermediate_size_mlp",
            default=inter,
            limit="moe_intermediate_size",
        )
        shared = _int_field(t, where, "n_shared_experts", default=0)
        dense_layers = _int_field(t, where, "first_k_dense_replace", default=0, maximum=n)
        moe_layers = n - min(dense_layers, n)
        expert = 3 * hidden * moe_inter
        expert_params = float(moe_layers * experts * expert)
        active_experts = float(moe_layers * k * expert)
        body = n * attn + dense_layers * mlp + moe_layers * (shared * expert + hidden * experts)
    else:
        body = n * (attn + mlp)
    embed = vocab * hidden * (1 if tied else 2)
    params = float(embed + body + expert_params)
    active = float(embed + body + active_experts)
    compute = ModelCompute(
        params=params,
        active_params=active,
        hidden_size=hidden,
        num_layers=n,
        num_attention_heads=heads,
        num_kv_heads=kv_split,
        qk_head_dim=qk_dim,
        v_head_dim=v_head,
        intermediate_size=inter,
        vocab_size=vocab,
        weight_bytes=params * 2,
        tied_embeddings=tied,
        num_experts=experts,
        experts_per_token=k,
        expert_params=expert_params,
    ).quantized("fp8" if fp8 else "none")

    def build(o: _Options) -> dict[str, KVCacheSpec]:
        specs: dict[str, KVCacheSpec] = {}
        for i, (kind, size) in enumerate(kinds):
            spec: KVCacheSpec
            if mla:
                spec = MLAAttentionSpec(o.block_size, 1, qk_dim, o.dtype)
            elif kind == "sliding":
                spec = SlidingWindowSpec(o.block_size, kv_heads, head_dim, o.dtype, size)
            elif kind == "chunked":
                spec = ChunkedLocalAttentionSpec(o.block_size, kv_heads, head_dim, o.dtype, size)
            else:
                spec = FullAttentionSpec(o.block_size, kv_heads, head_dim, o.dtype)
            specs[f"model.layers.{i}.self_attn.attn"] = spec
        return specs

    counts = {kk: sum(1 for x, _ in kinds if x == kk) for kk in ("full", "sliding", "chunked")}
    layout = ", ".join(f"{c} {kk}" for kk, c in counts.items() if c)
    given = data.get("_name_or_path")
    label = name or (given if isinstance(given, str) and given else None)
    label = label or Path(where).parent.name or "config.json"
    return ModelPreset(
        name=label,
        model=label,
        max_model_len=max_len,
        source=f"{where}: {n} layers ("
        + (f"MLA, latent {qk_dim}" if mla else f"{layout}; {kv_heads} KV heads x {head_dim}")
        + f"), {params / 1e9:.2f}B parameters ({active / 1e9:.2f}B active)",
        _build=build,
        compute=compute,
    )
