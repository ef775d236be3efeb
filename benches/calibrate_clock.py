"""Fits the simulator's clock profiles to published measurements.

``python/pagedkv/sim/data/published.csv`` holds every published figure collected
(sources in ``published_sources.md``). This script turns the rows the simulator
can replay (a Llama preset, a GPU preset, fixed input / output lengths, a
concurrency, a rate or an offline run) into calibration rows with the engine's
batch limits, simulates them, and fits each engine's
:class:`pagedkv.sim.perf.ClockProfile` by coordinate descent on the mean squared
log error of the ``fit`` rows. ``--write`` stores the table with each row's
error (``python/pagedkv/sim/data/calibration.csv``).

    python benches/calibrate_clock.py --evaluate          # today's profiles
    python benches/calibrate_clock.py --fit trtllm        # fit one engine's profile
    python benches/calibrate_clock.py --write             # store the table and errors
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import math
import os
import pickle
import re
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
from pagedkv.sim import calibration as cal
from pagedkv.sim import perf
from pagedkv.sim.perf import step_time_model
from pagedkv.sim.serving import ServingProcess
from pagedkv.sim.steptime import Latencies, RooflineModel, StepShape, StepTimeModel

PUBLISHED = Path(cal.TABLE).parent / "published.csv"

#: fitting replays recorded schedules (exact for closed-loop and offline rows)
FAST = False

#: seconds each row's last simulation took; rows over SLOW_S are ``slow`` in the table
TIMES: dict[str, float] = {}
SLOW_S = 2.5

#: engine -> (max_num_seqs, max_num_batched_tokens) when the source does not say
#: (trtllm-bench's defaults: a batch of 2,048, 8,192 tokens; Triton's
#: tensorrtllm_backend and NIM: 256 / 8,192; vLLM's server on an 80 GB GPU and
#: SGLang: 256 / 8,192 and 1,024 / 8,192)
ENGINE_LIMITS = {
    "trtllm": (2048, 8192),
    "nim-trtllm": (256, 8192),
    "vllm": (256, 8192),
    "sglang": (1024, 8192),
}


def preset_of(model: str, weights: str) -> str | None:
    m = model.lower()
    if "llama-2" in m or "llama2" in m:
        return None
    if "70b" in m:
        base = "llama-3.1-70b"
    elif "8b" in m:
        base = "llama-3.1-8b"
    else:
        return None
    return base + "-fp8" if weights == "fp8" else base


def convert(rec: dict[str, str]) -> cal.Row | None:
    """A published row as a calibration row, or None when the simulator cannot
    replay it."""
    preset = preset_of(rec["model"], rec["weights"])
    if preset is None or rec["gpu"] not in perf.GPUS:
        return None
    if not rec["input_len"].strip() or not rec["output_len"].strip():
        return None
    if rec["metric"] not in cal.METRICS:
        return None
    engine = rec["engine"]
    if engine not in ENGINE_LIMITS:
        return None
    notes = rec["notes"]
    conc = rec["concurrency"].strip()
    rate = 0.0
    if not conc:
        q = re.search(r"QPS\s*=\s*([0-9.]+)", notes) or re.search(r"request rate ([0-9.]+)", notes)
        if q is None:
            return None
        rate = float(q.group(1))
    if "static batch" in notes.lower():
        return None
    num_requests = int(rec["num_requests"] or 0)
    batch = re.search(r"latency-\d+-\d+-bs(\d+)$", rec["id"])
    if batch:  # benchmark_latency: one batch sent together, its mean end-to-end time
        conc, num_requests = "max", int(batch.group(1))
    seqs, tokens = ENGINE_LIMITS[engine]
    if engine == "trtllm" and "online" in rec["id"]:
        seqs = 256
    tp = int(rec["tp"])
    return cal.Row(
        id=rec["id"],
        source=rec["source"],
        url=rec["url"],
        engine=engine,
        engine_version=rec["engine_version"],
        model=rec["model"],
        preset=preset,
        weights=rec["weights"],
        kv_dtype=rec["kv_dtype"] if rec["kv_dtype"] == "fp8" else "bf16",
        gpu=rec["gpu"],
        tp=tp,
        input_len=int(rec["input_len"]),
        output_len=int(rec["output_len"]),
        concurrency=0 if conc in ("", "max") else int(conc),
        rate=rate,
        num_requests=num_requests,
        max_num_seqs=seqs,
        max_num_batched_tokens=tokens,
        metric=rec["metric"],
        value=float(rec["value"]),
        recorded_error=float("nan"),
        role="quick",
        notes=notes,
    )


def published_rows() -> list[cal.Row]:
    with open(PUBLISHED, newline="", encoding="utf-8") as f:
        rows = [convert(r) for r in csv.DictReader(f)]
    return [r for r in rows if r is not None]


_FEATURE_NAMES = ("T", "S", "M", "pf_flops", "pf_bytes", "dec_flops", "dec_bytes")


class _Recorder(StepTimeModel):
    """Runs a row once and keeps, per step, the features the roofline reads
    (tokens, sequences, sampled rows, prefill and decode attention FLOPs and KV
    bytes): the schedule of a closed-loop or offline run does not depend on the
    clock, so any profile's figures follow from these alone."""

    def __init__(self, base: RooflineModel) -> None:
        self.base = base
        self.f: list[list[float]] = [[] for _ in _FEATURE_NAMES]

    def step_seconds(self, shape: StepShape) -> float:
        m = self.base
        pf_flops = pf_bytes = dec_flops = dec_bytes = 0.0
        full_sum = sum(shape.decode)
        for a in m.attention:
            pairs = read = 0
            for n, c in shape.prefill:
                pairs += a.pairs(n, c)
                read += a.tokens_read(n, c)
            per = a.layers * a.kv_bytes_per_token
            pf_flops += a.layers * a.flops_per_pair * pairs
            pf_bytes += per * (read + shape.prefill_tokens)
            d = a.decode_tokens(shape.decode, full_sum)
            dec_flops += a.layers * a.flops_per_pair * d
            dec_bytes += per * (d + len(shape.decode))
        row = (
            shape.tokens,
            len(shape.prefill) + len(shape.decode),
            shape.sampled,
            pf_flops,
            pf_bytes,
            dec_flops,
            dec_bytes,
        )
        for col, v in zip(self.f, row, strict=True):
            col.append(float(v))
        return m.step_seconds(shape)


class _Events(Latencies):
    """Per request: send, first token, last token and finish times, tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.per: dict[str, list[float]] = {}

    def arrive(self, rid: str, t: float, prompt_tokens: int) -> None:
        self.per[rid] = [t, -1.0, -1.0, -1.0, 0.0]

    def scheduled(self, rid: str, t: float) -> None:
        pass

    def token(self, rid: str, t: float) -> None:
        r = self.per[rid]
        if r[1] < 0:
            r[1] = t
        r[2] = t
        r[4] += 1

    def finished(self, rid: str, t: float) -> None:
        self.per[rid][3] = t


#: row id -> (features, per-request step indices and counts)
_RECORDED: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}


def _key(row: cal.Row) -> str:
    """What a recorded schedule depends on (the clock profile aside)."""
    return "v2" + repr(
        replace(
            row,
            id="",
            metric="",
            value=0.0,
            recorded_error=0.0,
            notes="",
            url="",
            source="",
            role="",
        )
    )


def _cache_path() -> Path:
    return Path(os.environ.get("CALIBRATION_CACHE", "/tmp/pagedkv_calibration_cache2"))


def _record(row: cal.Row) -> tuple[dict[str, Any], dict[str, Any]]:
    if row.id in _RECORDED:
        return _RECORDED[row.id]
    cache = _cache_path() / (hashlib.sha256(_key(row).encode()).hexdigest()[:24] + ".pkl")
    if cache.exists():
        with open(cache, "rb") as f:
            _RECORDED[row.id] = pickle.load(f)
        return _RECORDED[row.id]
    cfg = cal.row_config(row)
    kv_config, mml, wl = cal.row_setup(row, cfg)
    process = ServingProcess.start(cfg, kv_config, mml)
    base = step_time_model(cfg)
    assert isinstance(base, RooflineModel)
    assert not base.expert_weight_bytes and not base.state_bytes_per_seq
    rec = _Recorder(base)
    ev = _Events()
    index: dict[float, int] = {0.0: -1}

    def on_step(clock: float, finished: int) -> None:
        index[clock] = len(index) - 1

    process.drive(wl.requests, rec, latencies=ev, on_step=on_step)
    feats = {k: np.array(v) for k, v in zip(_FEATURE_NAMES, rec.f, strict=True)}
    rids = list(ev.per)
    a = np.array(
        [[index[t] for t in ev.per[r][:4]] + [int(ev.per[r][4])] for r in rids], dtype=np.int64
    )
    warm = {f"r{i}" for i in range(row.concurrency)} if row.concurrency > 1 else set()
    tab = {"a": a, "keep": np.array([r not in warm for r in rids])}
    _RECORDED[row.id] = (feats, tab)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache, "wb") as f:
        pickle.dump(_RECORDED[row.id], f)
    return _RECORDED[row.id]


def _step_times(row: cal.Row) -> Any:
    """RooflineModel.step_seconds over a row's recorded steps, vectorized."""
    f, _ = _record(row)
    m = step_time_model(cal.row_config(row))
    assert isinstance(m, RooflineModel)
    T = f["T"]
    flops = T * m.matmul_flops_per_token + f["M"] * m.head_flops_per_sample
    eff = m.compute_efficiency * (T / (T + m.gemm_half_tokens) if m.gemm_half_tokens else 1.0)
    gemm_c = np.where(T > 0, flops / m.tp / (m.peak_flops * np.maximum(eff, 1e-12)), 0.0)
    gemm_m = m.dense_weight_bytes / m.tp / (m.hbm_bytes_per_s * m.memory_efficiency)
    attn_peak = (m.attention_peak_flops or m.peak_flops) * m.attention_efficiency
    kv_bw = m.hbm_bytes_per_s * m.kv_efficiency * m.kv_split
    t = np.maximum(gemm_c, gemm_m)
    t += np.maximum(f["pf_flops"] / m.tp / attn_peak, f["pf_bytes"] / kv_bw)
    t += np.maximum(f["dec_flops"] / m.tp / attn_peak, f["dec_bytes"] / kv_bw)
    if m.tp > 1:
        per = 2 * (m.tp - 1) / m.tp * T * m.hidden_size * m.act_bytes
        per = per / (m.link_bytes_per_s * m.link_efficiency)
        t += np.where(T > 0, 2 * m.num_layers * (per + m.allreduce_latency_s), 0.0)
    t += m.overhead_s + m.layer_overhead_s * m.num_layers + m.seq_overhead_s * f["S"]
    return np.maximum(t, 1e-9)


def replay_metric(row: cal.Row) -> float:
    """The row's metric on today's profiles from its recorded schedule (the
    figures ``pagedkv.sim.calibration`` reads, for rows of mean metrics)."""
    _, tab = _record(row)
    a, keep = tab["a"], tab["keep"]
    model = step_time_model(cal.row_config(row))
    fe = getattr(model, "request_overhead_s", 0.0)
    ends = np.concatenate([np.cumsum(_step_times(row)), [0.0]])  # index -1 -> 0
    arrive, first, last, finish = (ends[a[:, k]] for k in range(4))
    n_out = a[:, 4]
    m = row.metric
    if m == "itl_ms_mean":  # every request's gaps (as cal._figures keeps them)
        return float((last - first).sum() / (n_out - 1).sum() * 1000)
    k = keep
    if m == "ttft_ms_mean":
        return float((first[k] - arrive[k] + fe).mean() * 1000)
    if m == "e2e_ms_mean":
        return float((finish[k] - arrive[k] + fe).mean() * 1000)
    dur = finish[k].max() - arrive[k].min()
    out = n_out[k].sum() / dur
    if m == "output_tokens_per_s":
        return float(out)
    if m == "output_tokens_per_s_per_gpu":
        return float(out / row.tp)
    raise ValueError(m)


def run(
    rows: list[cal.Row], profiles: dict[str, perf.ClockProfile], quiet: bool = False
) -> list[float]:
    errs = []
    saved = dict(perf.CLOCKS)
    perf.CLOCKS.update(profiles)
    try:
        for r in rows:
            t0 = time.perf_counter()
            try:
                sim = cal.simulate_row(r) if (r.rate or not FAST) else replay_metric(r)
                sim = round(sim, 3)
                e = cal.error(r, sim)
            except Exception as ex:  # a row that cannot run counts as far off
                sim, e = float("nan"), float("nan")
                if not quiet:
                    print(f"{r.id}: {type(ex).__name__}: {ex}", file=sys.stderr)
            errs.append(e)
            TIMES[r.id] = time.perf_counter() - t0
            if not quiet:
                print(
                    f"{r.id:<70} {r.value:>10.2f} {sim:>10.2f} {100 * e:>+7.1f}%"
                    f"  {time.perf_counter() - t0:.1f}s",
                    flush=True,
                )
    finally:
        perf.CLOCKS.clear()
        perf.CLOCKS.update(saved)
    return errs


def _group(row: cal.Row) -> str:
    """Rows weigh by group (source and metric kind), so the hundreds of
    throughput cells of one table do not drown the latency rows."""
    kind = "latency" if row.metric.startswith(("ttft", "itl", "tpot", "e2e")) else "throughput"
    return row.id.split("-")[0] + "-" + row.id.split("-")[1] + ":" + kind


def loss(errs: list[float], rows: list[cal.Row] | None = None) -> float:
    """Mean over groups of the mean squared log error, plus a penalty on every
    error beyond 12 % (the goal is every row within 15 %)."""
    groups: dict[str, list[float]] = {}
    for i, e in enumerate(errs):
        g = _group(rows[i]) if rows else ""
        if not math.isfinite(e) or e <= -1:
            v = 4.0
        else:
            x = abs(math.log1p(e))
            v = x * x + 10 * max(0.0, x - 0.12) ** 2
        groups.setdefault(g, []).append(v)
    return sum(sum(v) / len(v) for v in groups.values()) / max(1, len(groups))


FIT_FIELDS = (
    "compute_efficiency",
    "gemm_half_tokens",
    "attention_efficiency",
    "memory_efficiency",
    "kv_efficiency",
    "link_efficiency",
    "overhead_s",
    "seq_overhead_s",
    "layer_overhead_s",
    "allreduce_latency_s",
    "request_overhead_s",
)

BOUNDS = {
    "compute_efficiency": (0.2, 0.95),
    "gemm_half_tokens": (0.0, 2048.0),
    "attention_efficiency": (0.1, 0.9),
    "memory_efficiency": (0.3, 0.95),
    "kv_efficiency": (0.2, 0.95),
    "link_efficiency": (0.1, 1.0),
    "overhead_s": (0.0, 0.002),
    "seq_overhead_s": (0.0, 200e-6),
    "layer_overhead_s": (0.0, 200e-6),
    "allreduce_latency_s": (0.0, 100e-6),
    "request_overhead_s": (0.0, 0.05),
}


def fit(
    rows: list[cal.Row], clock: str, rounds: int, fields: tuple[str, ...] = FIT_FIELDS
) -> perf.ClockProfile:
    prof = perf.CLOCKS.get(clock) or replace(perf.CLOCKS["vllm"], name=clock)
    mine = [r for r in rows if r.clock == clock]
    best = loss(run(mine, {clock: prof}, quiet=True), mine)
    print(f"start loss {best:.5f} over {len(mine)} rows", flush=True)
    step = 0.25
    for _ in range(rounds):
        improved = False
        for f in fields:
            lo, hi = BOUNDS[f]
            cur = getattr(prof, f)
            for mult in (1 + step, 1 / (1 + step)):
                v = cur * mult if cur else (hi - lo) * 0.05
                v = min(hi, max(lo, v))
                if v == cur:
                    continue
                cand = replace(prof, **{f: v})
                lv = loss(run(mine, {clock: cand}, quiet=True), mine)
                if lv < best - 1e-6:
                    prof, best, improved = cand, lv, True
                    print(f"  {f} = {v:.6g}: loss {best:.5f}", flush=True)
                    break
        if not improved:
            step /= 2
            if step < 0.02:
                break
    print(asdict(prof))
    return prof


def markdown(rows: list[cal.Row]) -> str:
    """The table of docs/simulate.md: published, simulated (from the recorded
    error) and the error of every row."""
    lines = [
        "| row | engine | model | GPUs | in / out | clients | metric | published "
        "| simulated | error |",
        "| --- | --- | --- | --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        sim = r.value * (1 + r.recorded_error)
        clients = (
            str(r.concurrency) if r.concurrency else f"{r.rate:g} req/s" if r.rate else "offline"
        )
        u = "ms" if "_ms_" in r.metric else "tok/s"
        lines.append(
            f"| [{r.id}]({r.url}) | {r.engine} {r.engine_version} | {r.preset} | "
            f"{r.tp} x {r.gpu} | {r.input_len:,} / {r.output_len:,} | {clients} | "
            f"{r.metric.replace('_', ' ')} | {r.value:,.1f} {u} | {sim:,.1f} | "
            f"{100 * r.recorded_error:+.1f} % |"
        )
    return "\n".join(lines)


def _record_only(row: cal.Row) -> None:
    _record(row)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--evaluate", action="store_true")
    ap.add_argument("--fit", metavar="CLOCK")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--fields", help="the profile fields to fit (comma-separated; default all)")
    ap.add_argument("--only", help="regex on row ids")
    ap.add_argument("--table", action="store_true", help="evaluate the stored table")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="print the stored table as markdown")
    ap.add_argument("--record", type=int, metavar="JOBS", help="record schedules in JOBS processes")
    args = ap.parse_args()
    if args.markdown:
        print(markdown(cal.load_rows()))
        return 0
    rows = cal.load_rows() if args.table else published_rows()
    if args.only:
        rows = [r for r in rows if re.search(args.only, r.id)]
    print(f"{len(rows)} rows", file=sys.stderr)
    if args.record:
        from concurrent.futures import ProcessPoolExecutor

        todo = [r for r in rows if not r.rate]
        with ProcessPoolExecutor(args.record) as ex:
            for i, _ in enumerate(ex.map(_record_only, todo)):
                print(f"recorded {i + 1}/{len(todo)}", end="\r", file=sys.stderr, flush=True)
    if args.fit:
        global FAST
        FAST = True
        fit(
            rows,
            args.fit,
            args.rounds,
            tuple(args.fields.split(",")) if args.fields else FIT_FIELDS,
        )
        FAST = False
    if args.evaluate or args.write:
        errs = run(rows, {})
        ok = [e for e in errs if math.isfinite(e)]
        print(
            f"rows {len(errs)}, within 15%: {sum(abs(e) <= 0.15 for e in ok)}, "
            f"MAPE {100 * sum(abs(e) for e in ok) / max(1, len(ok)):.1f}%"
        )
        if args.write:
            cal.write_rows(
                [
                    replace(
                        r,
                        recorded_error=round(e, 4),
                        role="slow" if TIMES[r.id] > SLOW_S else "quick",
                    )
                    for r, e in zip(rows, errs, strict=True)
                ],
                cal.TABLE,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
