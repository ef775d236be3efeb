"""The simulator's clock: step-time models, request latencies, KV sizing from a
GPU, SLO attainment and the capacity search."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pagedkv import cli, presets
from pagedkv.sim import perf, runner
from pagedkv.sim.policy import Request
from pagedkv.sim.runner import SimConfig, find_max_rate, run_pagedkv
from pagedkv.sim.steptime import (
    AttentionKind,
    Latencies,
    LinearModel,
    StepShape,
    model_from_dict,
    percentiles,
    summarize,
)
from pagedkv.sim.workloads import Workload, WorkloadOptions, generate

GIB = 1 << 30
#: every step takes 10 ms
TEN_MS = SimConfig(memory_gib=1.0, max_model_len=1024, step_time="10,0,0,0")


def _req(rid: str, first: int, prompt: int, output: int, at: float) -> Request:
    return Request(rid, list(range(first, first + prompt)), [7] * output, arrival_s=at)


def _two_requests(second_at: float) -> Workload:
    return Workload("two", [_req("r0", 0, 32, 3, 0.0), _req("r1", 1000, 32, 2, second_at)])


# ------------------------------------------------------------------ request times


def test_latencies_of_two_requests_on_a_fixed_step_time() -> None:
    # r0: prefill in step [0, 10] ms (first token at 10), decodes at 20 and 30.
    # r1 arrives at 15 ms, joins the step starting at 20 (queue 5 ms): first token
    # at 30 (TTFT 15 ms), second at 40.
    r = run_pagedkv(_two_requests(0.015), TEN_MS)
    t = r.timing
    assert r.steps == 4
    assert t["ttft_ms"] == {"mean": 12.5, "p50": 12.5, "p90": 14.5, "p99": 14.95}
    assert t["tpot_ms"] == {"mean": 10.0, "p50": 10.0, "p90": 10.0, "p99": 10.0}
    assert t["itl_ms"]["mean"] == 10.0 and t["itl_ms"]["p99"] == 10.0
    assert t["e2e_ms"] == {"mean": 27.5, "p50": 27.5, "p90": 29.5, "p99": 29.95}
    assert t["queue_ms"] == {"mean": 2.5, "p50": 2.5, "p90": 4.5, "p99": 4.95}
    assert t["duration_s"] == pytest.approx(0.04)
    assert t["throughput"] == {
        "requests_per_s": 50.0,
        "input_tokens_per_s": 1600.0,
        "output_tokens_per_s": 125.0,
    }
    assert r.series["time_s"] == pytest.approx([0.01, 0.02, 0.03, 0.04])


def test_an_idle_clock_jumps_to_the_next_arrival() -> None:
    r = run_pagedkv(_two_requests(100.0), TEN_MS)
    assert r.steps == 5  # three for r0, two for r1: no step while idle
    assert r.timing["duration_s"] == pytest.approx(100.02)
    assert r.timing["ttft_ms"]["p50"] == 10.0
    assert r.timing["queue_ms"]["mean"] == 0.0


def test_slo_attainment_counts_requests_meeting_every_slo() -> None:
    base = _two_requests(0.015)
    r = run_pagedkv(base, SimConfig(**{**TEN_MS.__dict__, "slo_ttft_ms": 12.0}))
    assert r.timing["slo_attainment"] == 0.5  # r0 (10 ms) meets it, r1 (15 ms) not
    r = run_pagedkv(
        _two_requests(0.015),
        SimConfig(**{**TEN_MS.__dict__, "slo_ttft_ms": 20.0, "slo_tpot_ms": 9.0}),
    )
    assert r.timing["slo_attainment"] == 0.0
    assert "slo_attainment" not in run_pagedkv(_two_requests(0.015), TEN_MS).timing


def test_session_turn_waits_its_pause_in_seconds() -> None:
    a = Request("a", list(range(32)), [7, 7], arrival_s=0.0, session="s")
    b = Request("b", list(range(40)), [7], arrival_s=0.0, session="s", pause_s=1.0)
    r = run_pagedkv(Workload("s", [a, b]), TEN_MS)
    # a finishes at 20 ms; b arrives a second later and takes one step.
    assert r.timing["duration_s"] == pytest.approx(1.03)
    assert r.hit_tokens == 32  # b's prompt starts with a's 32 tokens (2 blocks)


def test_percentiles_interpolate_as_numpy() -> None:
    rng = np.random.default_rng(5)
    v = rng.exponential(3.0, 101).tolist()
    p = percentiles(v)
    assert p["mean"] == pytest.approx(float(np.mean(v)))
    for q in (50, 90, 99):
        assert p[f"p{q}"] == pytest.approx(float(np.percentile(v, q)))
    assert percentiles([]) == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}


def test_summary_of_one_token_answers_has_no_tpot_but_meets_the_tpot_slo() -> None:
    lat = Latencies()
    lat.arrive("x", 0.0, 10)
    lat.scheduled("x", 0.0)
    lat.token("x", 0.05)
    lat.finished("x", 0.05)
    s = summarize(lat, slo_tpot_ms=1.0)
    assert s["tpot_ms"]["mean"] == 0.0 and s["slo_attainment"] == 1.0
    assert s["ttft_ms"]["p50"] == 50.0 and s["e2e_ms"]["p50"] == 50.0


# ------------------------------------------------------------------ step-time models


def test_linear_model_is_the_documented_formula() -> None:
    m = LinearModel(2.0, 30.0, 0.5, 0.01)
    shape = StepShape(prefill=[(1000, 3000), (500, 0)], decode=[100, 200, 300], sampled=4)
    # ms = 2 + 30 * 1.5 + 0.5 * 3 + 0.01 * (600 + 4000 + 500) / 1000
    assert m.step_seconds(shape) * 1000 == pytest.approx(2 + 45 + 1.5 + 0.051)
    assert LinearModel.parse("2, 30, 0.5, 0.01") == m
    for bad in ("1,2,3", "a,b,c,d", "1,2,3,-1", "0,0,0,0", "nan,1,1,1"):
        with pytest.raises(ValueError):
            LinearModel.parse(bad)


def _llama() -> Any:
    return perf.roofline(presets.get("llama-3.1-8b"), perf.GPUS["H100-SXM"])


def test_roofline_decode_is_bound_by_weights_and_kv_reads() -> None:
    m = _llama()
    kv_per_token = 32 * 2 * 8 * 128 * 2  # 32 layers of K and V, 8 heads x 128, bf16
    weights = 2 * 8.03e9
    hbm = 3.35e12
    shape = StepShape(decode=[1000], sampled=1)
    p = m.parts(shape)
    assert p["gemm_memory_s"] == pytest.approx(weights / (hbm * m.memory_efficiency))
    # The token attends to 1,000 tokens (its own included) and writes its own KV.
    assert p["decode_attention_memory_s"] == pytest.approx(
        kv_per_token * 1001 / (hbm * m.kv_efficiency)
    )
    assert p["gemm_compute_s"] < p["gemm_memory_s"]
    assert p["decode_attention_compute_s"] < p["decode_attention_memory_s"]
    assert m.step_seconds(shape) == pytest.approx(
        p["gemm_memory_s"] + p["decode_attention_memory_s"] + p["overhead_s"]
    )
    assert p["overhead_s"] == pytest.approx(
        m.overhead_s + 32 * m.layer_overhead_s + m.seq_overhead_s
    )
    # Twice the batch at the same context: the weights are read once.
    two = StepShape(decode=[1000, 1000], sampled=2)
    assert m.step_seconds(two) < 1.2 * m.step_seconds(shape)


def test_roofline_prefill_is_bound_by_flops_at_an_efficiency_growing_with_tokens() -> None:
    m = _llama()
    n = 8192
    embed = 128256 * 4096
    flops = 2 * (8.03e9 - 2 * embed) * n + 2 * embed  # one sampled row
    pairs = n * (n + 1) // 2  # causal attention
    shape = StepShape(prefill=[(n, 0)], sampled=1)
    p = m.parts(shape)
    eff = m.compute_efficiency * n / (n + m.gemm_half_tokens)
    assert p["gemm_compute_s"] == pytest.approx(flops / (989e12 * eff))
    assert p["prefill_attention_compute_s"] == pytest.approx(
        32 * (2 * 32 * (128 + 128)) * pairs / (989e12 * m.attention_efficiency)
    )
    assert p["gemm_compute_s"] > p["gemm_memory_s"]
    assert m.step_seconds(shape) == pytest.approx(
        p["gemm_compute_s"] + p["prefill_attention_compute_s"] + p["overhead_s"]
    )
    # Small prefills run the matmuls below the peak: per token, 64 tokens cost more
    # than 8,192 do.
    small = m.parts(StepShape(prefill=[(64, 0)], sampled=1))["gemm_compute_s"]
    assert small / 64 > p["gemm_compute_s"] / n


def test_fp8_weights_halve_the_reads_and_run_at_the_fp8_peak() -> None:
    bf16 = _llama()
    fp8 = perf.roofline(presets.get("llama-3.1-8b-fp8"), perf.GPUS["H100-SXM"])
    embed = 128256 * 4096
    assert fp8.dense_weight_bytes == pytest.approx((8.03e9 - 2 * embed) + 2 * 2 * embed)
    assert fp8.peak_flops == 1979e12 and bf16.peak_flops == 989e12
    # Attention stays at the bfloat16 peak.
    assert fp8.attention_peak_flops == 989e12
    shape = StepShape(prefill=[(4096, 0)], sampled=0)  # a chunk that samples nothing
    assert fp8.parts(shape)["gemm_compute_s"] == pytest.approx(
        bf16.parts(shape)["gemm_compute_s"] * 989 / 1979
    )


def test_tensor_parallelism_splits_work_and_adds_all_reduces() -> None:
    p = presets.get("llama-3.1-8b")
    one = perf.roofline(p, perf.GPUS["H100-SXM"])
    two = perf.roofline(p, perf.GPUS["H100-SXM"], tp=2)
    shape = StepShape(decode=[2000] * 32, sampled=32)
    for part in ("gemm_memory_s", "decode_attention_memory_s"):
        assert two.parts(shape)[part] == pytest.approx(one.parts(shape)[part] / 2)
    # 2 all-reduces per layer of 32 tokens x 4096 bf16 values over NVLink (900 GB/s
    # at the clock's link efficiency), each with its latency.
    per = 2 * 1 / 2 * 32 * 4096 * 2 / (900e9 * two.link_efficiency) + two.allreduce_latency_s
    assert two.parts(shape)["comm_s"] == pytest.approx(2 * 32 * per)
    assert one.parts(shape)["comm_s"] == 0.0
    # MLA's single latent head is replicated: TP does not split its KV reads.
    ds = perf.roofline(presets.get("deepseek-v3"), perf.GPUS["H200"], tp=8)
    assert ds.kv_split == 1 and two.kv_split == 2


def test_sliding_windows_cap_attention_and_moe_reads_only_routed_experts() -> None:
    gemma = perf.roofline(presets.get("gemma-3-27b"), perf.GPUS["H100-SXM"])
    kinds = {a.kind: a for a in gemma.attention}
    assert kinds["sliding_window"].layers == 52 and kinds["full"].layers == 10
    assert kinds["sliding_window"].pairs(1, 29999) == 1024
    assert kinds["full"].pairs(1, 29999) == 30000
    oss = perf.roofline(presets.get("gpt-oss-120b"), perf.GPUS["H100-SXM"])
    one = oss.parts(StepShape(decode=[10], sampled=1))["gemm_memory_s"]
    many = oss.parts(StepShape(prefill=[(4096, 0)], sampled=1))["gemm_memory_s"]
    # One token routes to 4 of 128 experts; 4096 tokens touch nearly all of them.
    assert many > 10 * one
    expert_bytes = oss.expert_weight_bytes
    assert oss.dense_weight_bytes + expert_bytes == pytest.approx(65.3e9)


@given(
    kind=st.sampled_from(["full", "sliding_window", "chunked_local"]),
    window=st.integers(1, 64),
    n=st.integers(1, 200),
    c=st.integers(0, 300),
)
def test_attended_pairs_match_counting_position_by_position(
    kind: str, window: int, n: int, c: int
) -> None:
    a = AttentionKind(kind, 1, 1.0, 1.0, window)

    def attended(p: int) -> int:  # tokens position p (1-based) attends to
        if kind == "full":
            return p
        if kind == "sliding_window":
            return min(p, window)
        return (p - 1) % window + 1

    positions = range(c + 1, c + n + 1)
    assert a.pairs(n, c) == sum(attended(p) for p in positions)
    # The union of the attended ranges [p - attended(p) + 1, p].
    lowest = min(p - attended(p) + 1 for p in positions)
    assert a.tokens_read(n, c) == c + n - lowest + 1
    assert a.decode_tokens([c + 1], c + 1) == attended(c + 1)


def test_models_travel_as_dicts() -> None:
    m = perf.roofline(presets.get("jamba-1.5-mini"), perf.GPUS["MI300X"], tp=2)
    assert model_from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert m.state_bytes_per_seq == 28 * 311296  # the Mamba layers' real state size
    lin = LinearModel(1, 2, 3, 4)
    assert model_from_dict(lin.to_dict()) == lin
    with pytest.raises(ValueError):
        model_from_dict({"kind": "magic"})


# ------------------------------------------------------------------ KV memory


def test_kv_memory_follows_the_gpu_and_tensor_parallelism() -> None:
    p = presets.get("gemma-3-27b")
    g = perf.GPUS["H200"]
    reserve = 2 * 8192 * (4 * 5376 + 2 * 21504 // 2) + 256 * 262208 * 4 + GIB
    per_gpu = int(143771 * (1 << 20) * 0.85 - 2 * 27.43e9 / 2 - reserve)
    assert perf.kv_cache_memory(p, g, tp=2, gpu_memory_utilization=0.85) == per_gpu
    # 16 KV heads over 2 GPUs: each holds half of every page, so the cache of the
    # whole instance is twice the memory of one GPU.
    cfg = SimConfig(model="gemma-3-27b", memory_gib=10.0, tp=2, max_model_len=4096)
    w = generate("tenants", WorkloadOptions(num_requests=5, max_context=4096))
    config, _ = runner.build_config(cfg, w)
    one, _ = runner.build_config(
        SimConfig(model="gemma-3-27b", memory_gib=20.0, max_model_len=4096), w
    )
    assert config.num_blocks == one.num_blocks


def test_a_model_that_does_not_fit_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="does not fit on 1 x H100-SXM"):
        perf.kv_cache_memory(presets.get("deepseek-v3"), perf.GPUS["H100-SXM"])
    code = cli.main(["simulate", "-m", "deepseek-v3", "-n", "5", "-q"])
    assert code == 2 and "does not fit" in capsys.readouterr().err
    assert perf.kv_cache_memory(presets.get("deepseek-v3"), perf.GPUS["H200"], tp=8) > 10 * GIB


# ------------------------------------------------------------------ the command line


def _simulate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["simulate", "-q", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_reports_the_time_figures(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _simulate(
        capsys, "-n", "40", "--gpu", "A100-80GB", "--slo-ttft", "500", "--slo-tpot", "50", "--json"
    )
    assert code == 0, err
    (run,) = json.loads(out)["runs"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_ms"):
        assert set(run[key]) == {"mean", "p50", "p90", "p99"}
        assert 0 < run[key]["p50"] <= run[key]["p90"] <= run[key]["p99"] or key == "queue_ms"
    assert set(run["throughput"]) == {"requests_per_s", "input_tokens_per_s", "output_tokens_per_s"}
    assert run["duration_s"] > 0 and 0 <= run["slo_attainment"] <= 1
    assert run["config"]["gpu"] == "A100-80GB"
    # The same workload on a faster GPU decodes faster.
    code, out, _ = _simulate(capsys, "-n", "40", "--gpu", "B200", "--json")
    assert json.loads(out)["runs"][0]["tpot_ms"]["p50"] < run["tpot_ms"]["p50"]


def test_step_time_coefficients_set_the_clock(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _simulate(
        capsys,
        "-n",
        "20",
        "--memory",
        "1",
        "--max-model-len",
        "4096",
        "--step-time",
        "20,0,0,0",
        "--json",
    )
    assert code == 0, err
    run = json.loads(out)["runs"][0]
    assert run["itl_ms"]["p50"] == 20.0 and run["tpot_ms"]["p99"] == 20.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--step-time", "1,2"], "four numbers"),
        (["--step-time", "0,0,0,0"], "all 0"),
        (["--find-max-rate"], "needs --slo-ttft"),
        (["--compare", "gpu=H100-SXM,nope"], "GPUs"),
        (["--compare", "tp=0"], "positive integer"),
    ],
)
def test_bad_time_options_are_refused(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _, err = _simulate(capsys, "-n", "5", *argv)
    assert code == 2 and message in err


@pytest.mark.parametrize(
    "argv", [["--gpu-memory-utilization", "1.5"], ["--gpu", "TPU"], ["--tp", "0"]]
)
def test_bad_gpu_arguments_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["simulate", *argv])
    assert e.value.code == 2


def test_compare_gpus_and_time_scales(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _simulate(
        capsys,
        "-n",
        "40",
        "-w",
        "tenants",
        "--compare",
        "gpu=L40S,H200",
        "--compare",
        "time-scale=1,4",
        "--json",
    )
    assert code == 0, err
    runs = {r["label"]: r for r in json.loads(out)["runs"]}
    assert set(runs) == {
        "gpu=L40S, time-scale=1",
        "gpu=L40S, time-scale=4",
        "gpu=H200, time-scale=1",
        "gpu=H200, time-scale=4",
    }
    # Four times the arrival rate on the slow GPU queues requests longer.
    assert (
        runs["gpu=L40S, time-scale=4"]["queue_ms"]["mean"]
        > runs["gpu=L40S, time-scale=1"]["queue_ms"]["mean"]
    )


# ------------------------------------------------------------------ capacity


def test_find_max_rate_brackets_the_slo_boundary() -> None:
    w = generate("tenants", WorkloadOptions(num_requests=120, seed=2))
    cfg = SimConfig(memory_gib=4.0, max_model_len=4096, slo_ttft_ms=300.0, slo_tpot_ms=40.0)
    found = find_max_rate(w, cfg, target=0.9, iterations=4)
    best = found["max_rate"]
    assert best is not None and best["slo_attainment"] >= 0.9
    failing = [p for p in found["tried"] if not p["meets"]]
    assert failing and min(p["time_scale"] for p in failing) > best["time_scale"]
    # The rate offered at the best scale: requests over their arrival span.
    arrivals = [r.arrival_step * cfg.tick_s for r in w.requests]
    offered = len(arrivals) / (max(arrivals) - min(arrivals))
    assert best["requests_per_s"] == pytest.approx(offered * best["time_scale"])
    with pytest.raises(ValueError, match="needs an SLO"):
        find_max_rate(w, SimConfig())


def test_find_max_rate_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _simulate(
        capsys,
        "-w",
        "tenants",
        "-n",
        "60",
        "--memory",
        "4",
        "--max-model-len",
        "4096",
        "--slo-ttft",
        "300",
        "--find-max-rate",
        "--json",
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["target"] == 0.9 and doc["max_rate"]["slo_attainment"] >= 0.9


# ------------------------------------------------------------------ config.json

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}


def test_config_json_of_a_dense_gqa_model_matches_its_preset() -> None:
    p = presets.from_hf_config(LLAMA_8B, name="llama")
    assert p.layer_specs(16) == presets.get("llama-3.1-8b").layer_specs(16)
    assert p.compute is not None
    assert p.compute.params == pytest.approx(8.03e9, rel=1e-3)  # the model card's 8.03B
    assert p.max_model_len == 131072


def test_config_json_of_sliding_window_chunked_mla_and_moe_models() -> None:
    gemma = presets.from_hf_config(
        {
            "text_config": {
                "hidden_size": 5376,
                "intermediate_size": 21504,
                "num_attention_heads": 32,
                "num_hidden_layers": 62,
                "num_key_value_heads": 16,
                "head_dim": 128,
                "sliding_window": 1024,
                "sliding_window_pattern": 6,
                "vocab_size": 262208,
            },
            "tie_word_embeddings": True,
        }
    )
    assert list(gemma.layer_specs(16).values()) == list(
        presets.get("gemma-3-27b").layer_specs(16).values()
    )
    scout = presets.from_hf_config(
        {
            "text_config": {
                "hidden_size": 5120,
                "num_attention_heads": 40,
                "num_hidden_layers": 48,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "attention_chunk_size": 8192,
                "no_rope_layers": [1, 1, 1, 0] * 12,
                "vocab_size": 202048,
                "num_local_experts": 16,
                "num_experts_per_tok": 1,
            }
        }
    )
    assert list(scout.layer_specs(16).values()) == list(
        presets.get("llama-4-scout").layer_specs(16).values()
    )
    ds = presets.from_hf_config(
        {
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_attention_heads": 128,
            "num_hidden_layers": 61,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 3,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
            "vocab_size": 129280,
            "quantization_config": {"quant_method": "fp8"},
        }
    )
    assert list(ds.layer_specs(16).values()) == list(
        presets.get("deepseek-v3").layer_specs(16).values()
    )
    assert ds.compute is not None and ds.compute.compute_dtype == "fp8"
    # DeepSeek-V3's model card: 671B parameters, 37B activated per token.
    assert ds.compute.params == pytest.approx(671e9, rel=2e-3)
    assert ds.compute.active_params == pytest.approx(37e9, rel=0.02)
    mixtral = presets.from_hf_config(
        {**LLAMA_8B, "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2}
    )
    # Mixtral 8x7B: 46.7B parameters, 12.9B active.
    assert mixtral.compute is not None
    assert mixtral.compute.params == pytest.approx(46.7e9, rel=2e-3)
    assert mixtral.compute.active_params == pytest.approx(12.9e9, rel=2e-3)


def test_config_json_on_the_command_line(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    d = tmp_path / "my-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA_8B))
    code, out, err = _simulate(capsys, "-n", "20", "-m", str(d / "config.json"), "--json")
    assert code == 0, err
    from_file = json.loads(out)["runs"][0]
    code, out, _ = _simulate(capsys, "-n", "20", "--json")
    preset = json.loads(out)["runs"][0]
    assert from_file["num_blocks"] == preset["num_blocks"]
    # The same shapes; the preset rounds the parameter count (8.03e9).
    for k, v in preset["ttft_ms"].items():
        assert from_file["ttft_ms"][k] == pytest.approx(v, rel=1e-3)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "one JSON object"),
        (json.dumps({"hidden_size": 8}), "missing 'num_hidden_layers'"),
        (
            json.dumps({**LLAMA_8B, "num_hidden_layers": -1}),
            r"num_hidden_layers must be in 1\.\.1024",
        ),
        (json.dumps({**LLAMA_8B, "mamba_d_state": 16}), "Mamba"),
        (json.dumps({**LLAMA_8B, "sliding_window": 64, "layer_types": ["x"]}), "layer_types"),
        ("x" * (presets.MAX_CONFIG_BYTES + 1), "larger than"),
    ],
)
def test_bad_config_json_is_refused(tmp_path: Any, content: str, message: str) -> None:
    f = tmp_path / "config.json"
    f.write_text(content)
    with pytest.raises(ValueError, match=message):
        presets.from_hf_config(f)


# ------------------------------------------------------------------ hybrid Mamba


def _split(prompt: int, start: int, n: int, junction: int = 0, budget: int = 8192) -> int:
    from pagedkv.sim.policy import Scheduler, SchedulerConfig

    sched = Scheduler.__new__(Scheduler)
    sched.cfg = SchedulerConfig(mamba_block_size=80, max_num_batched_tokens=budget)
    req = Request("r", list(range(prompt)), [1, 2])
    req.shared_prefix_boundary = junction
    return sched._mamba_split(req, n, start)


def test_mamba_prefill_chunks_end_where_vllm_ends_them() -> None:
    # vLLM 0.33's _mamba_block_aligned_split with 80-token Mamba blocks: a
    # 1,000-token prompt stops at the last boundary before its last token (960),
    # then finishes; a budget-cut chunk ends on a boundary; a mid-block start
    # stops at the next boundary; a shared-prefix junction (block-floored) stops.
    assert _split(1000, 0, 1000) == 960
    assert _split(1000, 960, 40) == 40
    assert _split(1000, 0, 500) == 480
    assert _split(1000, 480, 520) == 480
    assert _split(1000, 100, 900) == 60
    assert _split(1000, 0, 1000, junction=300) == 240
    assert _split(1000, 100, 30) == 0  # mid-block and short of the boundary: wait
    assert _split(1000, 1000, 1) == 1  # decode


def test_hybrid_mamba_model_gets_prefix_hits() -> None:
    w = generate("tenants", WorkloadOptions(num_requests=60, max_context=8192))
    cfg = SimConfig(model="jamba-1.5-mini", memory_gib=16.0, max_model_len=8192)
    r = run_pagedkv(w, cfg)
    # Without chunks ending on Mamba block boundaries no state is cacheable: 0 %.
    assert r.hit_rate > 0.8
    assert r.config["mamba_block_size"] == 80
    payload = runner.vllm_payload(w, cfg)
    assert payload["scheduler"]["mamba_block_size"] == 80
    assert {g["kind"] for g in payload["manager"]["groups"]} == {"mamba", "full_attention"}


# Chunked local attention (llama-4-scout) is left out on purpose: a token past a
# chunk boundary attends to fewer tokens than the one before it.
_MODELS = {
    name: perf.roofline(presets.get(name), perf.GPUS[gpu], tp=tp)
    for name, gpu, tp in (
        ("llama-3.1-8b", "H100-SXM", 1),
        ("gemma-3-27b", "H200", 2),
        ("gpt-oss-120b", "B200", 1),
        ("jamba-1.5-mini", "MI300X", 1),
        ("deepseek-v3", "H200", 8),
    )
}


@given(
    name=st.sampled_from(sorted(_MODELS)),
    decode=st.lists(st.integers(1, 200_000), max_size=64),
    prefill=st.lists(st.tuples(st.integers(1, 8192), st.integers(0, 100_000)), max_size=4),
    extra_ctx=st.integers(1, 50_000),
    extra_tokens=st.integers(1, 4096),
)
def test_step_time_never_falls_as_load_grows(
    name: str,
    decode: list[int],
    prefill: list[tuple[int, int]],
    extra_ctx: int,
    extra_tokens: int,
) -> None:
    m = _MODELS[name]
    base = StepShape(prefill=list(prefill), decode=list(decode), sampled=len(decode))
    t = m.step_seconds(base)
    assert t > 0
    # One more decode sequence, a longer context, a longer chunk: never faster.
    more_seqs = StepShape(prefill=list(prefill), decode=[*decode, 1000], sampled=len(decode) + 1)
    assert m.step_seconds(more_seqs) >= t
    if decode:
        longer = StepShape(
            prefill=list(prefill), decode=[decode[0] + extra_ctx, *decode[1:]], sampled=len(decode)
        )
        assert m.step_seconds(longer) >= t
    chunk = StepShape(
        prefill=[*prefill, (extra_tokens, 0)], decode=list(decode), sampled=len(decode)
    )
    assert m.step_seconds(chunk) >= t
