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

from .hf_config import CONFIG_LIMITS, MAX_CONFIG_BYTES, from_hf_config
from .model_preset import QUANTIZATIONS, LayerOptions, ModelCompute, ModelPreset
from .preset_table import FP8_CHECKPOINTS
from .preset_table import PRESETS as _PRESETS

__all__ = [
    "CONFIG_LIMITS",
    "FP8_CHECKPOINTS",
    "MAX_CONFIG_BYTES",
    "QUANTIZATIONS",
    "LayerOptions",
    "ModelCompute",
    "ModelPreset",
    "from_hf_config",
    "get",
    "names",
]


def names() -> list[str]:
    """The preset names."""
    return list(_PRESETS)


def get(name: str) -> ModelPreset:
    """The preset called ``name`` (case-insensitive). ``KeyError`` lists the names."""
    try:
        return _PRESETS[name.lower()]
    except (KeyError, AttributeError):
        raise KeyError(f"unknown preset {name!r}; presets: {', '.join(_PRESETS)}") from None
