"""What a model preset is: its KV-cache layout per layer and its compute shape.

:class:`ModelPreset` gives the per-layer specs vLLM builds for a model
(:meth:`ModelPreset.layer_specs`, from a builder of :class:`LayerOptions`) and
its context length; :class:`ModelCompute` what a step costs to compute besides
the KV cache (the simulator's step-time model reads it), with the weight
quantizations of :data:`QUANTIZATIONS`. The built-in presets
(:mod:`pagedkv.preset_table`) and those read from a Hugging Face ``config.json``
(:mod:`pagedkv.hf_config`) are both of this shape; :mod:`pagedkv.presets` looks
them up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .errors import InvalidConfigError
from .specs import KVCacheSpec

__all__ = ["QUANTIZATIONS", "LayerOptions", "ModelCompute", "ModelPreset"]


@dataclass(frozen=True)
class LayerOptions:
    """What a preset's layer builder is given: :meth:`ModelPreset.layer_specs`'s
    arguments."""

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
    _build: Callable[[LayerOptions], dict[str, KVCacheSpec]] = field(repr=False, compare=False)
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
            LayerOptions(block_size, dtype, mamba_cache_mode, num_speculative_blocks, max_model_len)
        )
