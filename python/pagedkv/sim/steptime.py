"""How long a scheduler step takes on a GPU, and what requests see in time.

A step's duration follows from what it computes (:class:`StepShape`): the prefill
chunks (new tokens and the context before them), the decode sequences (their
context lengths) and the weights read once per step. Two models turn a shape into
seconds:

- :class:`RooflineModel` (the default): ``max(compute, memory) + communication +
  overhead``, where compute is the matmul FLOPs (2 per active parameter per token,
  the LM head for sampled tokens only) plus the attention FLOPs (per query token,
  per layer, per attended context token: ``2 * heads * (qk_dim + v_dim)``) over the
  GPU's dense peak times an efficiency; memory is the weights (MoE experts by the
  expected fraction a batch routes to), the KV cache read by attention, the KV
  written and Mamba states read and written, over the HBM bandwidth times an
  efficiency; communication is two ring all-reduces of the hidden states per layer
  under tensor parallelism. Built by :func:`pagedkv.sim.perf.roofline` from a
  model preset and a GPU preset; the formulas and constants are in
  ``docs/simulate.md``.
- :class:`LinearModel`: ``ms = a + b * prefill_tokens / 1000 + c * decode_seqs +
  d * context_tokens / 1000``, coefficients fitted on the user's own hardware.

The arithmetic is plain numbers, standard library only:
``sim/vllm_engine.py`` imports it (through :mod:`pagedkv.sim.policy`) in an
interpreter that has vLLM but not pagedkv, so ``--engine vllm`` runs the same clock.
:class:`Latencies` collects per-request times and :func:`summarize` turns them
into the report's ``ttft_ms`` ... ``throughput`` figures.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "AttentionKind",
    "Latencies",
    "LinearModel",
    "RooflineModel",
    "StepShape",
    "StepTimeModel",
    "model_from_dict",
    "percentiles",
    "summarize",
]


@dataclass
class StepShape:
    """What one step computes.

    ``prefill``: ``(new tokens, computed tokens before them)`` per sequence that
    computes more than one token or has not reached its last prompt token;
    ``decode``: the context length (tokens computed after the step) of each
    sequence that computes one token past its prompt; ``sampled``: sequences that
    sample a token at the end of the step.
    """

    prefill: list[tuple[int, int]] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)
    sampled: int = 0

    @property
    def prefill_tokens(self) -> int:
        return sum(n for n, _ in self.prefill)

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + len(self.decode)

    @property
    def context_tokens(self) -> int:
        """KV tokens the step's sequences attend to (full attention): each decode
        sequence's context, each prefill chunk's context after the chunk."""
        return sum(self.decode) + sum(n + c for n, c in self.prefill)


# Cumulative attended-token counts: g(m) = sum over positions p = 1..m of the
# tokens position p attends to (itself included).


def _cum_full(m: int, _w: int) -> int:
    return m * (m + 1) // 2


def _cum_window(m: int, w: int) -> int:
    if m <= w:
        return m * (m + 1) // 2
    return w * (w + 1) // 2 + (m - w) * w


def _cum_chunked(m: int, c: int) -> int:
    q, r = divmod(m, c)
    return q * (c * (c + 1) // 2) + r * (r + 1) // 2


_CUMULATIVE = {"full": _cum_full, "sliding_window": _cum_window, "chunked_local": _cum_chunked}


@dataclass(frozen=True)
class AttentionKind:
    """Layers of one attention pattern.

    ``kind``: ``full``, ``sliding_window`` (``window`` tokens), ``chunked_local``
    (``window``-token chunks) or ``cross`` (``window`` encoder tokens, constant);
    ``layers``: how many; ``kv_bytes_per_token``: KV bytes one token takes in one
    layer (the whole model instance, before tensor parallelism);
    ``flops_per_pair``: FLOPs per (query token, attended token) in one layer.
    """

    kind: str
    layers: int
    kv_bytes_per_token: float
    flops_per_pair: float
    window: int = 0

    def pairs(self, n: int, c: int) -> int:
        """Attended (query, key) pairs of ``n`` new tokens after ``c`` computed."""
        if self.kind == "cross":
            return n * self.window
        cum = _CUMULATIVE[self.kind]
        return cum(c + n, self.window) - cum(c, self.window)

    def tokens_read(self, n: int, c: int) -> int:
        """Distinct KV tokens the chunk reads (its own included)."""
        if self.kind == "cross":
            return self.window
        if self.kind == "sliding_window":
            return min(c + n, n + self.window - 1)
        if self.kind == "chunked_local":
            return c + n - (c // self.window) * self.window
        return c + n

    def decode_tokens(self, contexts: Sequence[int], full_sum: int) -> int:
        """Tokens attended by decode tokens at positions ``contexts``
        (``full_sum``: their sum)."""
        w = self.window
        if self.kind == "full":
            return full_sum
        if self.kind == "cross":
            return w * len(contexts)
        if self.kind == "sliding_window":
            return sum(x if x < w else w for x in contexts)
        return sum((x - 1) % w + 1 for x in contexts)


class StepTimeModel:
    """A step's shape -> its duration in seconds."""

    name = "model"

    def step_seconds(self, shape: StepShape) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError


#: The largest coefficient of ``--step-time`` (milliseconds): a step's time
#: stays finite for any batch the simulator can build.
MAX_COEFFICIENT_MS = 1e6


@dataclass(frozen=True)
class LinearModel(StepTimeModel):
    """``ms = a + b * prefill_tokens / 1000 + c * decode_seqs + d * context_tokens
    / 1000`` (``context_tokens``: :attr:`StepShape.context_tokens`)."""

    a: float
    b: float
    c: float
    d: float
    name = "linear"

    def __post_init__(self) -> None:
        for k in ("a", "b", "c", "d"):
            v = getattr(self, k)
            if not (math.isfinite(v) and 0 <= v <= MAX_COEFFICIENT_MS):
                raise ValueError(
                    f"step-time coefficient {k} must be a number of ms in "
                    f"0..{MAX_COEFFICIENT_MS:g}, got {v}"
                )
        if self.a + self.b + self.c + self.d <= 0:
            raise ValueError("step-time coefficients are all 0: steps would take no time")

    @classmethod
    def parse(cls, text: str) -> LinearModel:
        """``"a,b,c,d"`` (milliseconds)."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 4:
            raise ValueError(f"--step-time takes four numbers a,b,c,d, got {text!r}")
        try:
            a, b, c, d = (float(p) for p in parts)
        except ValueError:
            raise ValueError(f"--step-time takes four numbers a,b,c,d, got {text!r}") from None
        return cls(a, b, c, d)

    def step_seconds(self, shape: StepShape) -> float:
        ms = (
            self.a
            + self.b * shape.prefill_tokens / 1000
            + self.c * len(shape.decode)
            + self.d * shape.context_tokens / 1000
        )
        return ms / 1000

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.name, "a": self.a, "b": self.b, "c": self.c, "d": self.d}


@dataclass(frozen=True)
class RooflineModel(StepTimeModel):
    """The roofline of one model instance (``tp`` GPUs); every figure is for the
    whole instance and divided by ``tp`` where the GPUs split it.

    ``matmul_flops_per_token``: 2 x active parameters outside the embedding and
    LM head; ``head_flops_per_sample``: 2 x vocab x hidden (sampled tokens only);
    ``dense_weight_bytes`` + ``expert_weight_bytes``: weights (experts: routed
    experts, ``num_experts`` of them, ``experts_per_token`` per token, read by the
    expected fraction a batch of tokens routes to); ``attention``: the attention
    patterns; ``state_bytes_per_seq``: Mamba state read and written per sequence
    per step; ``hidden_size``, ``num_layers``, ``act_bytes``: the all-reduced
    activations; ``kv_split``: how many ways tensor parallelism splits the KV
    cache (``min(tp, kv heads)``).

    A step runs its kernels one after the other, each bound by its own roofline:

    - the linear layers: ``max(FLOPs / (peak x e(tokens)), weights / (HBM x
      memory_efficiency))``, where the matmul efficiency grows with the tokens of
      the step, ``e(t) = compute_efficiency x t / (t + gemm_half_tokens)``
      (small prefills and decode batches do not fill the GPU);
    - attention, prefill and decode apart: ``max(FLOPs / (attention_peak_flops x
      attention_efficiency), KV bytes read and written / (HBM x kv_efficiency))``;
    - Mamba states at ``memory_efficiency``;
    - under tensor parallelism two all-reduces of the step's hidden states per
      layer, each ``allreduce_latency_s`` plus a ring's ``2 (tp-1) / tp`` of the
      volume over ``link_bytes_per_s x link_efficiency``;
    - ``overhead_s`` per step, ``layer_overhead_s`` per layer (kernel launches
      and synchronisation, which tensor parallelism does not divide) and
      ``seq_overhead_s`` per scheduled sequence (sampling, the scheduler, input
      preparation).

    The efficiencies and overheads are the fields of a
    :class:`~pagedkv.sim.perf.ClockProfile`, calibrated against published
    measurements (``pagedkv.sim.calibration``).
    """

    matmul_flops_per_token: float
    head_flops_per_sample: float
    dense_weight_bytes: float
    expert_weight_bytes: float
    num_experts: int
    experts_per_token: int
    attention: tuple[AttentionKind, ...]
    state_bytes_per_seq: float
    hidden_size: int
    num_layers: int
    #: GPU: dense peak FLOP/s of the matmuls' dtype, HBM bytes/s, interconnect bytes/s
    peak_flops: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    tp: int = 1
    kv_split: int = 1
    act_bytes: int = 2
    #: attention's peak FLOP/s (bfloat16; 0: ``peak_flops``)
    attention_peak_flops: float = 0.0
    compute_efficiency: float = 0.6
    gemm_half_tokens: float = 0.0
    attention_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    kv_efficiency: float = 0.8
    link_efficiency: float = 1.0
    #: per step: kernel launches, sampling, the scheduler (seconds)
    overhead_s: float = 0.001
    #: per sequence scheduled in the step (seconds)
    seq_overhead_s: float = 0.0
    #: per layer per step, whatever the GPUs (kernel launches and syncs; seconds)
    layer_overhead_s: float = 0.0
    #: per all-reduce (seconds)
    allreduce_latency_s: float = 10e-6
    #: per request, outside the GPU: the front end's share of TTFT and end-to-end
    #: latency (HTTP, tokenization, detokenization), seconds
    request_overhead_s: float = 0.0
    gpu: str = ""
    name = "roofline"

    def parts(self, shape: StepShape) -> dict[str, float]:
        """Seconds of each part of one step (per GPU): ``gemm_compute_s`` /
        ``gemm_memory_s`` (the linear layers), ``prefill_attention_compute_s`` /
        ``prefill_attention_memory_s``, ``decode_attention_compute_s`` /
        ``decode_attention_memory_s``, ``state_s``, ``comm_s``, ``overhead_s``."""
        tokens = shape.tokens
        seqs = len(shape.prefill) + len(shape.decode)
        flops = tokens * self.matmul_flops_per_token + shape.sampled * self.head_flops_per_sample
        weights = self.dense_weight_bytes
        if self.expert_weight_bytes:
            untouched = (1.0 - self.experts_per_token / self.num_experts) ** tokens
            weights += self.expert_weight_bytes * (1.0 - untouched)
        gemm_eff = self.compute_efficiency
        if self.gemm_half_tokens and tokens:
            gemm_eff *= tokens / (tokens + self.gemm_half_tokens)
        hbm = self.hbm_bytes_per_s
        attn_peak = (self.attention_peak_flops or self.peak_flops) * self.attention_efficiency
        kv_bw = hbm * self.kv_efficiency * self.kv_split
        pf_flops = pf_bytes = dec_flops = dec_bytes = 0.0
        full_sum = sum(shape.decode)
        for a in self.attention:
            pairs = read = 0
            for n, c in shape.prefill:
                pairs += a.pairs(n, c)
                read += a.tokens_read(n, c)
            per_token = a.layers * a.kv_bytes_per_token
            pf_flops += a.layers * a.flops_per_pair * pairs
            pf_bytes += per_token * (read + shape.prefill_tokens)
            # A decode token at position ctx attends to (and reads) the same tokens.
            d = a.decode_tokens(shape.decode, full_sum)
            dec_flops += a.layers * a.flops_per_pair * d
            dec_bytes += per_token * (d + len(shape.decode))
        comm = 0.0
        if self.tp > 1 and tokens:
            volume = tokens * self.hidden_size * self.act_bytes
            per = 2 * (self.tp - 1) / self.tp * volume
            per /= self.link_bytes_per_s * self.link_efficiency
            comm = 2 * self.num_layers * (per + self.allreduce_latency_s)
        return {
            "gemm_compute_s": flops / self.tp / (self.peak_flops * gemm_eff) if tokens else 0.0,
            "gemm_memory_s": weights / self.tp / (hbm * self.memory_efficiency),
            "prefill_attention_compute_s": pf_flops / self.tp / attn_peak,
            "prefill_attention_memory_s": pf_bytes / kv_bw,
            "decode_attention_compute_s": dec_flops / self.tp / attn_peak,
            "decode_attention_memory_s": dec_bytes / kv_bw,
            "state_s": 2
            * seqs
            * self.state_bytes_per_seq
            / self.tp
            / (hbm * self.memory_efficiency),
            "comm_s": comm,
            "overhead_s": self.overhead_s
            + self.layer_overhead_s * self.num_layers
            + self.seq_overhead_s * seqs,
        }

    def step_seconds(self, shape: StepShape) -> float:
        p = self.parts(shape)
        return (
            max(p["gemm_compute_s"], p["gemm_memory_s"])
            + max(p["prefill_attention_compute_s"], p["prefill_attention_memory_s"])
            + max(p["decode_attention_compute_s"], p["decode_attention_memory_s"])
            + p["state_s"]
            + p["comm_s"]
            + p["overhead_s"]
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = self.name
        d["attention"] = [asdict(a) for a in self.attention]
        return d


def model_from_dict(d: dict[str, Any]) -> StepTimeModel:
    """The inverse of ``to_dict`` (how ``--engine vllm`` receives the model)."""
    d = dict(d)
    kind = d.pop("kind")
    if kind == "linear":
        return LinearModel(**d)
    if kind == "roofline":
        d["attention"] = tuple(AttentionKind(**a) for a in d["attention"])
        return RooflineModel(**d)
    raise ValueError(f"unknown step-time model {kind!r}")


# ------------------------------------------------------------------ request times


class Latencies:
    """Per-request times of a timed run (seconds on the simulation clock)."""

    def __init__(self) -> None:
        self.arrival: dict[str, float] = {}
        self.first_scheduled: dict[str, float] = {}
        self.first_token: dict[str, float] = {}
        self.last_token: dict[str, float] = {}
        self.finish: dict[str, float] = {}
        self.num_output: dict[str, int] = {}
        self.prompt_tokens: dict[str, int] = {}
        #: every gap between two consecutive output tokens of one request
        self.itl = array("d")
        #: what the serving front end adds to each request's first token and end
        #: (HTTP, tokenization, detokenization): the clock's ``request_overhead_s``
        self.request_overhead_s = 0.0

    def arrive(self, rid: str, t: float, prompt_tokens: int) -> None:
        self.arrival[rid] = t
        self.prompt_tokens[rid] = prompt_tokens

    def scheduled(self, rid: str, t: float) -> None:
        self.first_scheduled.setdefault(rid, t)

    def token(self, rid: str, t: float) -> None:
        last = self.last_token.get(rid)
        if last is None:
            self.first_token[rid] = t
        else:
            self.itl.append(t - last)
        self.last_token[rid] = t
        self.num_output[rid] = self.num_output.get(rid, 0) + 1

    def finished(self, rid: str, t: float) -> None:
        self.finish[rid] = t


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """``{mean, p50, p90, p99}`` (linear interpolation between order statistics,
    as numpy's default); zeros when empty."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    s = sorted(values)
    out = {"mean": sum(s) / len(s)}
    for q in (50, 90, 99):
        pos = (len(s) - 1) * q / 100
        lo = math.floor(pos)
        hi = min(lo + 1, len(s) - 1)
        out[f"p{q}"] = s[lo] + (s[hi] - s[lo]) * (pos - lo)
    return out


def _ms(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v * 1000, 3) for k, v in d.items()}


def summarize(
    lat: Latencies,
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict[str, Any]:
    """The report's time figures: ``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2e_ms``,
    ``queue_ms`` (each ``{mean, p50, p90, p99}``), ``throughput``, ``duration_s``
    and, with an SLO, ``slo_attainment`` (the fraction of finished requests meeting
    every SLO given; TPOT of a one-token answer always meets it).

    TTFT: arrival to the end of the step that sampled the first token; TPOT:
    ``(e2e - ttft) / (output tokens - 1)`` per request of two or more tokens; ITL:
    every gap between consecutive tokens; e2e: arrival to the last token; queue:
    arrival to the start of the first step that scheduled the request. The
    duration runs from the first arrival to the last finish."""
    done = [r for r in lat.finish if r in lat.first_token]
    fe = lat.request_overhead_s
    ttft = [lat.first_token[r] - lat.arrival[r] + fe for r in done]
    e2e = [lat.finish[r] - lat.arrival[r] + fe for r in done]
    queue = [lat.first_scheduled[r] - lat.arrival[r] for r in done]
    tpot_by: dict[str, float] = {}
    for r in done:
        n = lat.num_output[r]
        if n > 1:
            tpot_by[r] = (lat.last_token[r] - lat.first_token[r]) / (n - 1)
    start = min(lat.arrival.values(), default=0.0)
    end = max(lat.finish.values(), default=start)
    duration = end - start
    out: dict[str, Any] = {
        "ttft_ms": _ms(percentiles(ttft)),
        "tpot_ms": _ms(percentiles(list(tpot_by.values()))),
        "itl_ms": _ms(percentiles(lat.itl)),
        "e2e_ms": _ms(percentiles(e2e)),
        "queue_ms": _ms(percentiles(queue)),
        "duration_s": round(duration, 6),
        "throughput": {
            "requests_per_s": round(len(done) / duration, 6) if duration > 0 else 0.0,
            "input_tokens_per_s": round(sum(lat.prompt_tokens[r] for r in done) / duration, 3)
            if duration > 0
            else 0.0,
            "output_tokens_per_s": round(sum(lat.num_output[r] for r in done) / duration, 3)
            if duration > 0
            else 0.0,
        },
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        met = 0
        for r in done:
            ok = (
                slo_ttft_ms is None
                or (lat.first_token[r] - lat.arrival[r] + fe) * 1000 <= slo_ttft_ms
            )
            if slo_tpot_ms is not None and r in tpot_by:
                ok = ok and tpot_by[r] * 1000 <= slo_tpot_ms
            met += ok
        out["slo_attainment"] = round(met / len(done), 6) if done else 0.0
    return out
