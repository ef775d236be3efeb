"""Reads a Hugging Face ``config.json`` into a model preset (:func:`from_hf_config`).

Every field read is range-checked (:data:`CONFIG_LIMITS`) and the file read
up to :data:`MAX_CONFIG_BYTES`; the layer kinds, the parameter counts and the
weights' bytes follow from the shapes. :mod:`pagedkv.presets` re-exports it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .model_preset import LayerOptions, ModelCompute, ModelPreset
from .specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

__all__ = ["CONFIG_LIMITS", "MAX_CONFIG_BYTES", "from_hf_config"]


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

    def build(o: LayerOptions) -> dict[str, KVCacheSpec]:
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
