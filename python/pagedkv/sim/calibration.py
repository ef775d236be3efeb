"""The clock against published measurements of real serving engines.

``data/calibration.csv`` holds one published figure per row (its source, engine
and version, model, precision, GPUs, input / output lengths, concurrency, the
metric and its value, the engine's batch limits) and the error the simulator had
on it when the clock profiles of :data:`pagedkv.sim.perf.CLOCKS` were last
fitted. :func:`simulate_row` replays the benchmark a row describes: requests of
random tokens (no prefix shared) with its lengths, sent as its client sent them
(``concurrency`` closed-loop clients, or all at once for an offline / infinite-
rate run), on the engine's clock profile, and reads the same metric.
``tests/sim/test_calibration.py`` runs every row and fails when one leaves its
recorded error; ``docs/simulate.md`` shows the table.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from .. import presets
from ..specs import KVCacheConfig
from . import deployment
from .config import SimConfig
from .deployment import build_config
from .perf import step_time_model
from .policy import Request
from .serving import ServingProcess
from .steptime import Latencies, summarize
from .workloads import Workload

__all__ = [
    "METRICS",
    "TABLE",
    "Row",
    "load_rows",
    "row_config",
    "row_workload",
    "simulate_row",
]

#: the calibration table shipped with the package
TABLE = Path(__file__).parent / "data" / "calibration.csv"

#: metric -> (where in the run's figures, unit)
METRICS = {
    "ttft_ms_mean": ("ttft_ms", "mean"),
    "ttft_ms_median": ("ttft_ms", "p50"),
    "itl_ms_mean": ("itl_ms", "mean"),
    "itl_ms_median": ("itl_ms", "p50"),
    "tpot_ms_mean": ("tpot_ms", "mean"),
    "tpot_ms_median": ("tpot_ms", "p50"),
    "e2e_ms_mean": ("e2e_ms", "mean"),
    "output_tokens_per_s": ("throughput", "output_tokens_per_s"),
    "output_tokens_per_s_per_gpu": ("throughput", "output_tokens_per_s"),
    "total_tokens_per_s": ("throughput", "total"),
    "requests_per_s": ("throughput", "requests_per_s"),
}

#: the engine of a row -> the clock profile it runs on
_ENGINE_CLOCK = {
    "vllm": "vllm",
    "nim-vllm": "vllm",
    "trtllm": "trtllm",
    "nim-trtllm": "trtllm",
    "sglang": "sglang",
}

#: the largest number of requests one row simulates
MAX_ROW_REQUESTS = 20_000


@dataclass(frozen=True)
class Row:
    """One published figure and how it was measured (the CSV's columns)."""

    id: str
    source: str
    url: str
    engine: str
    engine_version: str
    model: str
    preset: str
    weights: str
    kv_dtype: str
    gpu: str
    tp: int
    input_len: int
    output_len: int
    #: closed-loop clients; 0: open loop (``rate``), or every request sent at once
    concurrency: int
    #: Poisson arrivals per second (open loop); 0: none
    rate: float
    num_requests: int
    max_num_seqs: int
    max_num_batched_tokens: int
    metric: str
    value: float
    #: the simulator's relative error on the row when the clock was fitted
    recorded_error: float
    #: ``quick``: replayed in a few seconds; ``slow``: 5 to 25 s (tests run them under CI)
    role: str
    notes: str

    @property
    def clock(self) -> str:
        return _ENGINE_CLOCK.get(self.engine, self.engine)


def _row(rec: dict[str, str], where: str) -> Row:
    kw: dict[str, Any] = {}
    for f in fields(Row):
        text = (rec.get(f.name) or "").strip()
        if f.type == "int":
            if f.name == "concurrency" and text in ("max", "inf", ""):
                kw[f.name] = 0
                continue
            try:
                kw[f.name] = int(text)
            except ValueError:
                raise ValueError(f"{where}: {f.name} must be an integer, got {text!r}") from None
        elif f.type == "float":
            try:
                v = float(text or "nan")
            except ValueError:
                raise ValueError(f"{where}: {f.name} must be a number, got {text!r}") from None
            kw[f.name] = 0.0 if f.name == "rate" and not text else v
        else:
            kw[f.name] = text
    row = Row(**kw)
    if row.metric not in METRICS:
        raise ValueError(f"{where}: unknown metric {row.metric!r}")
    if not (row.value > 0 and math.isfinite(row.value)):
        raise ValueError(f"{where}: value must be a positive number, got {row.value}")
    if row.input_len < 1 or row.output_len < 1 or row.tp < 1 or row.concurrency < 0:
        raise ValueError(f"{where}: lengths and tp must be positive, concurrency >= 0")
    if not (math.isfinite(row.rate) and row.rate >= 0) or (row.rate and row.concurrency):
        raise ValueError(f"{where}: rate must be >= 0, and not with a concurrency")
    return row


def load_rows(path: str | Path = TABLE) -> list[Row]:
    """The rows of a calibration table (``TABLE`` by default)."""
    with open(path, newline="", encoding="utf-8") as f:
        return [_row(rec, f"{path}:{i + 2}") for i, rec in enumerate(csv.DictReader(f))]


def _num_requests(row: Row, batch: int) -> int:
    """Requests a row replays: the published count where given, else enough for
    a steady state (five per client; two engine batches offline), at most
    ``MAX_ROW_REQUESTS`` and, offline, at most two batches: requests of one
    length sent together run in waves of a full batch, and every wave after the
    first runs as the one before it."""
    if row.concurrency:
        n = row.num_requests or 5 * row.concurrency
        return min(max(n, 2 * row.concurrency, 4), 10 * row.concurrency, MAX_ROW_REQUESTS)
    if row.rate:
        return min(row.num_requests or 500, max(50, int(60 * row.rate)), MAX_ROW_REQUESTS)
    n = row.num_requests or 2 * batch
    return min(n, 2 * batch, MAX_ROW_REQUESTS)


def row_workload(row: Row, num_requests: int, *, seed: int = 0) -> Workload:
    """The benchmark's requests: random prompts of ``input_len`` tokens (no two
    share a block), ``output_len`` tokens each, ready at time 0 (closed loop,
    offline) or at Poisson arrivals of ``rate``."""
    rng = np.random.default_rng(seed)
    out = [1] * row.output_len
    times = np.zeros(num_requests)
    if row.rate:
        times = np.cumsum(rng.exponential(1.0 / row.rate, size=num_requests))
    reqs = [
        Request(
            f"r{i}",
            rng.integers(1, 120_000, size=row.input_len, dtype=np.int64),
            out,
            arrival_s=float(times[i]),
        )
        for i in range(num_requests)
    ]
    return Workload(f"calibration:{row.id}", reqs, {"row": row.id})


#: ``trtllm-bench``'s KV cache: this share of the memory the weights,
#: activations and runtime leave free (``kv_cache_free_gpu_mem_fraction``, 0.95
#: in the published runs), where vLLM takes 0.9 of the whole GPU (NIM's runs
#: are sized as vLLM's: their KV budget is not published)
TRTLLM_FREE_MEMORY_FRACTION = 0.95


def _memory_utilization(row: Row) -> float:
    """The ``gpu_memory_utilization`` that gives the row's engine its KV cache."""
    if row.engine != "trtllm":
        return 0.9
    compute = presets.get(row.preset).compute
    assert compute is not None
    total = deployment.gpu(row.gpu).memory_bytes
    used = compute.weight_bytes / row.tp + deployment.activation_reserve_bytes(
        compute, row.tp, row.max_num_batched_tokens, row.max_num_seqs
    )
    return min(1.0, (used + TRTLLM_FREE_MEMORY_FRACTION * max(0.0, total - used)) / total)


def row_config(row: Row, *, clock: str | None = None) -> SimConfig:
    """The simulation of a row: its model, GPUs, KV dtype, batch limits and
    clients, the KV cache sized as the row's engine sizes it."""
    return SimConfig(
        gpu_memory_utilization=_memory_utilization(row),
        model=row.preset,
        memory_gib=None,
        gpu=row.gpu,
        tp=row.tp,
        kv_dtype="fp8" if row.kv_dtype == "fp8" else "bfloat16",
        clock=clock or row.clock,
        max_num_seqs=row.max_num_seqs,
        max_num_batched_tokens=row.max_num_batched_tokens,
        max_concurrency=row.concurrency or None,
        max_model_len=None,
        enable_caching=False,
        background_hashing=False,
        hash_algo="xxh3_native",
    )


def _figures(row: Row, lat: Latencies) -> dict[str, Any]:
    """The run's figures; with closed-loop clients over the steady state only:
    the first wave (every client's first request, sent together) is left out,
    as a benchmark's warm-up is."""
    if row.concurrency > 1:
        warm = {f"r{i}" for i in range(row.concurrency)}
        kept = Latencies()
        for name in ("arrival", "first_scheduled", "first_token", "last_token", "finish"):
            src: dict[str, float] = getattr(lat, name)
            setattr(kept, name, {k: v for k, v in src.items() if k not in warm})
        kept.num_output = {k: v for k, v in lat.num_output.items() if k not in warm}
        kept.prompt_tokens = {k: v for k, v in lat.prompt_tokens.items() if k not in warm}
        kept.itl = lat.itl
        kept.request_overhead_s = lat.request_overhead_s
        lat = kept
    return summarize(lat)


def metric_of(row: Row, figures: dict[str, Any]) -> float:
    """The row's metric read from a run's figures (``summarize``)."""
    section, key = METRICS[row.metric]
    if key == "total":
        tp = figures["throughput"]
        v = float(tp["input_tokens_per_s"] + tp["output_tokens_per_s"])
    else:
        v = float(figures[section][key])
    if row.metric.endswith("_per_gpu"):
        v /= row.tp
    return v


def row_setup(row: Row, config: SimConfig) -> tuple[KVCacheConfig, int, Workload]:
    """The KV-cache config, ``max_model_len`` and requests of a row's run: as
    many requests as :func:`_num_requests` gives for the batch the engine holds
    (its batch limit, or the sequences its KV cache fits)."""
    kv_config, max_model_len = build_config(config, row_workload(row, 1))
    fits = (kv_config.num_blocks - 1) * config.block_size // (row.input_len + row.output_len)
    workload = row_workload(row, _num_requests(row, max(1, min(row.max_num_seqs, fits))))
    return kv_config, max_model_len, workload


def simulate_row(row: Row, *, clock: str | None = None, cfg: SimConfig | None = None) -> float:
    """The row's metric as the simulator has it."""
    config = cfg or row_config(row, clock=clock)
    kv_config, max_model_len, workload = row_setup(row, config)
    lat = Latencies()
    process = ServingProcess.start(config, kv_config, max_model_len)
    process.drive(workload.requests, step_time_model(config), latencies=lat)
    return metric_of(row, _figures(row, lat))


def error(row: Row, simulated: float) -> float:
    """Relative error of ``simulated`` against the published value."""
    return simulated / row.value - 1.0


def evaluate(rows: Iterable[Row], *, clock: str | None = None) -> list[dict[str, Any]]:
    """Every row simulated: ``{id, published, simulated, error, recorded_error}``."""
    out = []
    for row in rows:
        sim = simulate_row(row, clock=clock)
        out.append(
            {
                "id": row.id,
                "published": row.value,
                "simulated": sim,
                "error": error(row, sim),
                "recorded_error": row.recorded_error,
            }
        )
    return out


def with_errors(rows: Sequence[Row], results: Sequence[dict[str, Any]]) -> list[Row]:
    """The rows with ``recorded_error`` set to the errors of ``results``."""
    by_id = {r["id"]: r["error"] for r in results}
    return [replace(r, recorded_error=round(by_id[r.id], 4)) for r in rows]


def write_rows(rows: Sequence[Row], path: str | Path) -> None:
    """Writes a calibration table."""
    names = [f.name for f in fields(Row)]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(names)
        for r in rows:
            w.writerow(
                [
                    "max" if n == "concurrency" and not r.concurrency else getattr(r, n)
                    for n in names
                ]
            )
