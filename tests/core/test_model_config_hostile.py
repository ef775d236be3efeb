"""Hostile Hugging Face ``config.json`` files for ``--model``: every field read is
range-checked, the file's size is bounded, and a parallel layout vLLM would
refuse is refused; ``from_hf_config`` raises one ``ValueError`` naming the field,
the CLI exits 2 with one line."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from pagedkv import cli, presets
from pagedkv.presets import MAX_CONFIG_BYTES, from_hf_config

FAST = ["-n", "4", "--memory", "1", "--max-model-len", "4096", "-q"]

LLAMA: dict[str, Any] = {
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
}
MOE: dict[str, Any] = LLAMA | {
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 2048,
}
MLA: dict[str, Any] = LLAMA | {
    "num_key_value_heads": 32,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "q_lora_rank": 1536,
}


def _write(tmp_path: Path, cfg: Any) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    p = d / "config.json"
    p.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return p


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = cli.main(["simulate", *argv])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedkv simulate: error: "), err
    return lines[0]


def _one_line_error(cfg: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        from_hf_config(cfg)
    assert "\n" not in str(e.value)


BAD_VALUES = [-1, 0, 2**30, 10**6 + 0.5, 1.0, "32", [32], {"n": 32}, True, float("nan")]


@pytest.mark.parametrize(
    "field",
    [
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
    ],
)
@pytest.mark.parametrize("value", BAD_VALUES, ids=repr)
def test_a_bad_dense_field_is_refused(field: str, value: Any) -> None:
    _one_line_error(LLAMA | {field: value}, field)


@pytest.mark.parametrize(
    "field",
    ["num_local_experts", "num_experts_per_tok", "moe_intermediate_size"],
)
@pytest.mark.parametrize("value", [-1, 2**30, 2.0, "8", [8], {"a": 1}, False], ids=repr)
def test_a_bad_expert_field_is_refused(field: str, value: Any) -> None:
    _one_line_error(MOE | {field: value}, field)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok must be in 1..8"),
        ({"n_routed_experts": -4, "num_local_experts": None}, "n_routed_experts"),
        ({"num_experts": "many", "num_local_experts": None}, "num_experts"),
        ({"n_shared_experts": -1}, "n_shared_experts"),
        ({"n_shared_experts": 1e9}, "n_shared_experts"),
        ({"first_k_dense_replace": 33}, "first_k_dense_replace must be in 0..32"),
        ({"first_k_dense_replace": "3"}, "first_k_dense_replace"),
        ({"moe_topk": 0, "num_experts_per_tok": None}, "moe_topk"),
    ],
)
def test_inconsistent_experts_are_refused(extra: dict[str, Any], match: str) -> None:
    _one_line_error(MOE | extra, match)


@pytest.mark.parametrize(
    "field", ["kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"]
)
@pytest.mark.parametrize("value", [-1, 2**30, 64.0, "abc", [1], {"x": 1}], ids=repr)
def test_a_bad_mla_field_is_refused(field: str, value: Any) -> None:
    _one_line_error(MLA | {field: value}, field)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"sliding_window": -1}, "sliding_window"),
        ({"sliding_window": "4096"}, "sliding_window"),
        ({"sliding_window": 4096, "use_sliding_window": "yes"}, "use_sliding_window"),
        ({"sliding_window": 4096, "sliding_window_pattern": 0}, "sliding_window_pattern"),
        ({"sliding_window": 4096, "sliding_window_pattern": 99}, "sliding_window_pattern"),
        ({"sliding_window": 4096, "layer_types": "sliding"}, "layer_types"),
        ({"sliding_window": 4096, "layer_types": ["sliding"] * 3}, "layer_types"),
        ({"attention_chunk_size": 0}, "attention_chunk_size"),
        ({"attention_chunk_size": 8192, "no_rope_layers": [2] * 32}, "no_rope_layers"),
        ({"attention_chunk_size": 8192, "no_rope_layers": [1] * 5}, "no_rope_layers"),
        ({"attention_chunk_size": 8192, "no_rope_layers": "all"}, "no_rope_layers"),
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings"),
        ({"quantization_config": "fp8"}, "quantization_config"),
        ({"text_config": [1, 2]}, "text_config"),
        ({"num_attention_heads": 32, "num_key_value_heads": 12}, "not a multiple"),
        ({"num_attention_heads": 32, "num_key_value_heads": 64}, "num_key_value_heads"),
    ],
)
def test_bad_layouts_are_refused(extra: dict[str, Any], match: str) -> None:
    _one_line_error(LLAMA | extra, match)


def test_valid_configs_give_positive_finite_figures() -> None:
    for cfg in (LLAMA, MOE, MLA, LLAMA | {"sliding_window": 4096, "sliding_window_pattern": 6}):
        p = from_hf_config(cfg)
        c = p.compute
        assert c is not None
        assert 0 < c.active_params <= c.params and math.isfinite(c.params)
        assert c.weight_bytes > 0


@pytest.mark.parametrize("layers", [10**6, 2**30])
def test_a_huge_layer_count_is_refused_at_once(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, layers: int
) -> None:
    p = _write(tmp_path, LLAMA | {"num_hidden_layers": layers})
    assert "num_hidden_layers must be in 1..1024" in _refused(capsys, "-m", str(p), *FAST)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[" * 200_000 + "]" * 200_000, "nested too deeply"),
        ('{"a":' * 150_000 + "1" + "}" * 150_000, "nested too deeply"),
        ("{not json", "not JSON"),
        ("[1, 2]", "one JSON object"),
        ('{"num_hidden_layers": NaN}', "NaN"),
        ('{"num_hidden_layers": Infinity}', "Infinity"),
        ("\udcff", "not JSON"),
        ("", "not JSON"),
    ],
)
def test_a_file_that_is_no_config_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, match: str
) -> None:
    p = tmp_path / "model" / "config.json"
    p.parent.mkdir()
    p.write_bytes(text.encode("utf-8", "surrogateescape"))
    assert match in _refused(capsys, "-m", str(p), *FAST)


def test_the_file_size_is_bounded_whatever_the_file_claims(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    p = _write(tmp_path, json.dumps(LLAMA) + " " * MAX_CONFIG_BYTES)
    assert "larger than" in _refused(capsys, "-m", str(p), *FAST)
    # a FIFO reports no size: what is read is bounded all the same
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    import threading

    def feed() -> None:
        with open(fifo, "wb") as f:
            try:
                f.write(b" " * (MAX_CONFIG_BYTES + 10))
            except BrokenPipeError:
                pass

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    with pytest.raises(ValueError, match="larger than"):
        from_hf_config(fifo)
    t.join(10)


@pytest.mark.parametrize(
    ("cfg", "tp", "match"),
    [
        (LLAMA, "3", "32 attention heads do not split over --tp 3"),
        (LLAMA, "64", "32 attention heads"),
        (LLAMA | {"num_attention_heads": 48, "num_key_value_heads": 12}, "8", "12 KV heads"),
        (LLAMA | {"num_attention_heads": 24, "num_key_value_heads": 6}, "4", "6 KV heads"),
    ],
)
def test_tensor_parallel_layouts_vllm_refuses_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, cfg: dict[str, Any], tp: str, match: str
) -> None:
    p = _write(tmp_path, cfg)
    assert match in _refused(capsys, "-m", str(p), "--tp", tp, *FAST)


def test_tensor_parallel_layouts_of_presets_are_checked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert "do not split" in _refused(capsys, "--tp", "3", *FAST)
    assert "do not split" in _refused(capsys, "-m", "llama-4-scout", "--tp", "16", *FAST)
    # replicated KV heads are fine: 8 KV heads over 16 GPUs, 32 heads over 2, MLA over 8
    p = LLAMA | {"num_attention_heads": 64}
    assert presets.get("deepseek-v3").compute is not None
    for model, tp in (("llama-3.1-8b", "2"), ("gpt-oss-120b", "16")):
        code = cli.main(["simulate", "-m", model, "--tp", tp, *FAST])
        _, err = capsys.readouterr()
        assert code == 0, err
    assert from_hf_config(p).compute is not None


def test_a_sweep_over_a_bad_tp_reports_the_point(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["simulate", *FAST, "--sweep", "tp=1,3,2", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    points = json.loads(out)["points"]
    assert [p["status"] for p in points] == ["ok", "does not fit", "ok"]
    assert "do not split over --tp 3" in points[1]["reason"]
