"""Resolves a simulation's model: a preset name or a Hugging Face ``config.json``.

The second room of a simulation's setup, after its configuration
(:mod:`pagedkv.sim.config`): :func:`resolve` turns ``SimConfig.model`` into a
:class:`~pagedkv.presets.ModelPreset` (the KV layout and the compute shape),
with ``SimConfig.quantization`` applied and the tensor-parallel size checked
against the model's heads. The deployment (:mod:`pagedkv.sim.deployment`) and
the clock (:mod:`pagedkv.sim.perf`) read what it gives.
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace

from .. import presets
from ..errors import PagedKVError
from ..presets import ModelCompute, ModelPreset
from .config import SimConfig

__all__ = ["check_tensor_parallel", "model_context", "require_compute", "resolve"]


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


def require_compute(preset: ModelPreset) -> ModelCompute:
    """The preset's compute shape; ValueError when it has none (a layout-only preset)."""
    if preset.compute is None:
        raise ValueError(f"model {preset.name!r} has no compute shape for the step-time model")
    return preset.compute


def resolve(cfg: SimConfig) -> ModelPreset:
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
        check_tensor_parallel(preset.compute, cfg.tp, preset.name)
        if cfg.quantization != "none":
            preset = replace(preset, compute=preset.compute.quantized(cfg.quantization))
    return preset


@functools.lru_cache(maxsize=16)
def _config_preset(path: str) -> ModelPreset:
    return presets.from_hf_config(
        path, name=os.path.basename(os.path.dirname(os.path.abspath(path)))
    )


def model_context(cfg: SimConfig) -> int | None:
    """The model's context length (None: the model cannot be resolved)."""
    try:
        return resolve(cfg).max_model_len
    except (ValueError, OSError, PagedKVError):
        return None
