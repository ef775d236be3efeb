"""``--quantization``, the FP8 presets and ``--clock``: what each changes in a run."""

from __future__ import annotations

import json

import pytest
from pagedkv import cli, presets
from pagedkv.sim import perf
from pagedkv.sim.runner import SimConfig, run_pagedkv, step_time_model
from pagedkv.sim.workloads import WorkloadOptions, generate

GIB = 1 << 30


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    assert cli.main(["simulate", "-n", "20", "--max-model-len", "4096", "-q", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)["runs"][0]  # type: ignore[no-any-return]


def test_fp8_quantization_frees_memory_for_kv_and_speeds_decode(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bf16 = _run(capsys)
    fp8 = _run(capsys, "--quantization", "fp8")
    preset = _run(capsys, "--model", "llama-3.1-8b-fp8")
    assert fp8["config"]["quantization"] == "fp8" and bf16["config"]["quantization"] == "none"
    # The weights shrink from 16.06 GB to 6.98 GB of FP8 linear layers plus 2.10 GB
    # of bfloat16 embedding and head: the KV cache gains the difference.
    embed = 128256 * 4096
    saved = 2 * 8.03e9 - ((8.03e9 - 2 * embed) + 2 * 2 * embed)
    gib = fp8["config"]["kv_cache_gib"] - bf16["config"]["kv_cache_gib"]
    assert gib == pytest.approx(saved / GIB, abs=0.01)
    assert fp8["tpot_ms"]["mean"] < 0.8 * bf16["tpot_ms"]["mean"]
    # The FP8 checkpoint preset is the same model as --quantization fp8.
    assert preset["config"]["kv_cache_gib"] == fp8["config"]["kv_cache_gib"]
    assert preset["tpot_ms"] == fp8["tpot_ms"]


def test_the_clock_profile_reaches_the_roofline() -> None:
    for name, prof in perf.CLOCKS.items():
        m = step_time_model(SimConfig(clock=name))
        assert m.overhead_s == prof.overhead_s  # type: ignore[attr-defined]
        assert m.memory_efficiency == prof.memory_efficiency  # type: ignore[attr-defined]
        assert m.request_overhead_s == prof.request_overhead_s  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown clock"):
        step_time_model(SimConfig(clock="sglang"))
    with pytest.raises(ValueError, match="unknown quantization"):
        step_time_model(SimConfig(quantization="int4"))


def test_the_front_end_adds_to_ttft_and_end_to_end_latency_only() -> None:
    w = generate("tenants", WorkloadOptions(num_requests=10, max_context=2048))
    cfg = SimConfig(memory_gib=2.0, max_model_len=2048, clock="vllm")
    r = run_pagedkv(w, cfg)
    fe = perf.CLOCKS["vllm"].request_overhead_s * 1000
    assert fe > 0
    # Every TTFT holds at least the front end's share; ITL none of it.
    assert r.timing["ttft_ms"]["p50"] > fe
    assert r.timing["itl_ms"]["p50"] < r.timing["ttft_ms"]["p50"] - fe + 50


def test_fp8_presets_read_from_a_config_json(tmp_path: object) -> None:
    base = {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
    }
    plain = presets.from_hf_config(base).compute
    assert plain is not None and plain.compute_dtype == "bf16"
    for quant in (
        {"quant_method": "fp8"},
        {"quant_method": "modelopt", "quant_algo": "FP8"},
        {
            "quant_method": "compressed-tensors",
            "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float"}}},
        },
    ):
        c = presets.from_hf_config({**base, "quantization_config": quant}).compute
        assert c is not None and c.compute_dtype == "fp8", quant
        assert c.weight_bytes == pytest.approx(plain.quantized("fp8").weight_bytes)
        assert c.weight_bytes == pytest.approx(plain.params + plain.embedding_params)
    for quant in (
        {"quant_method": "awq"},
        {"quant_method": "modelopt", "quant_algo": "NVFP4"},
        {
            "quant_method": "compressed-tensors",
            "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
        },
    ):
        c = presets.from_hf_config({**base, "quantization_config": quant}).compute
        assert c is not None and c.compute_dtype == "bf16", quant


def test_llama_70b_preset_matches_its_config() -> None:
    p = presets.get("llama-3.1-70b")
    specs = p.layer_specs(16)
    assert len(specs) == 80
    spec = next(iter(specs.values()))
    assert spec.real_page_size_bytes == 16 * 2 * 8 * 128 * 2  # K and V, 8 heads x 128, bf16
    c = p.compute
    assert c is not None
    # Embedding + head + 80 x (attention + gated MLP), norms aside.
    shapes = 2 * 128256 * 8192 + 80 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672)
    assert c.params == pytest.approx(shapes, rel=0.001)
    fp8 = presets.get("llama-3.3-70b-fp8").compute
    assert fp8 is not None and fp8.compute_dtype == "fp8"
    assert fp8.weight_bytes == pytest.approx(c.params + 2 * 128256 * 8192)


def test_clock_and_quantization_are_compare_axes(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "-n", "20", "--max-model-len", "4096", "-q", "--json"]
    assert (
        cli.main([*argv, "--compare", "clock=vllm,trtllm", "--compare", "quantization=none,fp8"])
        == 0
    )
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [(r["config"]["clock"], r["config"]["quantization"]) for r in runs] == [
        ("vllm", "none"),
        ("vllm", "fp8"),
        ("trtllm", "none"),
        ("trtllm", "fp8"),
    ]
    # TensorRT-LLM's lower per-step overhead: faster decode on the same GPU.
    assert runs[2]["tpot_ms"]["mean"] < runs[0]["tpot_ms"]["mean"]
