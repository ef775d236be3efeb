"""Tables and JSON of simulation results."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from .runner import SimResult

__all__ = ["print_summary", "to_json_obj"]


#: the value of a row that is shown only when some run has it
_OMIT = ""


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _block_sizes(c: dict[str, Any]) -> str:
    sizes = sorted(set(c.get("group_block_sizes") or [c["block_size"]]))
    return "/".join(f"{s:,}" for s in sizes)


def _kv_memory(c: dict[str, Any]) -> str:
    per_gpu = c["kv_cache_gib_per_gpu"]
    text = f"{c['kv_cache_gib']:,.2f} GiB"
    if c["tp"] > 1:
        text = f"{per_gpu:,.2f} GiB per GPU, {text} for the instance"
    if c.get("replicas", 1) > 1:
        text += f", on each of {c['replicas']} replicas"
    leaves = c.get("gpu_kv_cache_gib")
    if leaves is not None and per_gpu > leaves * 1.001:
        text += f" (over the {leaves:,.2f} GiB a {c['gpu']} leaves)"
    return text


def _rows(r: SimResult) -> list[tuple[str, str]]:
    c = r.config
    groups: dict[str, int] = {}
    for g in c["kv_cache_groups"]:
        kind, _, n = g.rpartition("x")
        groups[kind] = groups.get(kind, 0) + int(n)
    rows = [
        ("engine", r.engine),
        ("model", c["model"]),
        ("KV-cache layers", ", ".join(f"{n} {k}" for k, n in groups.items())),
        ("KV-cache blocks", f"{r.num_blocks:,} x {_block_sizes(c)} tokens"),
        (
            "GPUs",
            f"{c['tp']} x {c['gpu']}"
            + (
                f", {c.get('clock', 'vllm')} clock"
                if c.get("step_time") is None
                else " (steps timed by --step-time)"
            ),
        ),
        (
            "weights",
            f"{c['quantization']} quantization"
            if c.get("quantization", "none") != "none"
            else _OMIT,
        ),
        ("KV-cache memory", _kv_memory(c)),
        ("prefix caching", f"{'on' if c['enable_caching'] else 'off'}, {c['hash_algo']}"),
        (
            "max concurrency",
            f"{c['max_concurrency']:,} in flight"
            if c.get("max_concurrency") is not None
            else _OMIT,
        ),
        ("requests finished", f"{r.finished:,} / {r.requests:,}"),
        (
            "rejected: longer than the context",
            f"{r.rejected_requests:,} ({r.rejected_prompt_tokens:,} prompt tokens)"
            if r.rejected_requests
            else _OMIT,
        ),
        ("scheduler steps", f"{r.steps:,}"),
        ("prompt tokens", f"{r.prompt_tokens:,}"),
        ("output tokens", f"{r.output_tokens:,}"),
        ("prefix hit rate (tokens)", _pct(r.hit_rate)),
        ("  hit / looked-up tokens", f"{r.hit_tokens:,} / {r.query_tokens:,}"),
        (
            "  incl. re-admissions",
            _pct(r.hit_tokens_all / r.query_tokens_all if r.query_tokens_all else 0.0),
        ),
        *_tier_rows(r),
        ("preemptions", f"{r.preemptions:,}"),
        *_time_rows(r),
        ("peak running requests", f"{r.peak_running:,}"),
        ("KV usage peak", _pct(r.peak_usage)),
        ("KV usage mean", _pct(r.mean_usage)),
        ("manager time", f"{r.manager_ns / 1e6:,.1f} ms"),
        ("  per step", f"{r.us_per_step:,.2f} µs"),
        ("  per call", f"{r.us_per_call:,.3f} µs"),
        ("  calls", f"{r.manager_calls:,}"),
        ("simulation wall time", f"{r.wall_s:.2f} s"),
    ]
    if c.get("mamba_block_size"):
        rows.insert(
            3,
            (
                "  Mamba states",
                f"cached every {c['mamba_block_size']} tokens: hits are whole "
                f"{c['mamba_block_size']}-token blocks",
            ),
        )
    return rows


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def _tier_rows(r: SimResult) -> list[tuple[str, str]]:
    t = r.extra.get("tiers")
    if not t:
        return []
    disk = t["disk_offload_gib_per_gpu"]
    chunks = t["host_tier"].get("num_chunks", 0)
    rows = [
        (
            "  on device / host / disk",
            f"{_pct(t['device_hit_rate'])} / {_pct(t['host_hit_rate'])} / "
            f"{_pct(t['disk_hit_rate'])}",
        ),
        (
            "host tier",
            f"{t['cpu_offload_gib_per_gpu']:,g} GiB per GPU ({chunks:,} blocks), "
            f"{t['offload_policy']}, {t['offload_write']}, "
            f"{t['host_link_gbps_per_gpu']:g} GB/s link",
        ),
        (
            "disk tier",
            f"{disk:,g} GiB per GPU ({t['host_tier'].get('disk_tier_slots', 0):,} blocks), "
            f"{t['disk_gbps_per_gpu']:g} GB/s"
            if disk
            else _OMIT,
        ),
        (
            "  loads / stores",
            f"{_gb(t['load_bytes'])} / {_gb(t['store_bytes'])}; steps waited "
            f"{t['load_wait_s']:,.2f} s for loads",
        ),
        (
            "  disk reads / writes",
            f"{_gb(t['disk_read_bytes'])} / {_gb(t['disk_write_bytes'])}" if disk else _OMIT,
        ),
        (
            "  host evictions / refused stores",
            f"{t['host_tier'].get('evictions', 0):,} / {t['host_tier'].get('stores_refused', 0):,}",
        ),
    ]
    return rows


def _dist(d: dict[str, float]) -> str:
    return f"{d['mean']:,.1f} / {d['p50']:,.1f} / {d['p99']:,.1f}"


def _time_rows(r: SimResult) -> list[tuple[str, str]]:
    t = r.timing
    if not t:
        return []
    rows = [
        ("duration", f"{t['duration_s']:,.1f} s"),
        ("TTFT ms (mean / p50 / p99)", _dist(t["ttft_ms"])),
        ("TPOT ms", _dist(t["tpot_ms"])),
        ("ITL ms", _dist(t["itl_ms"])),
        ("end-to-end ms", _dist(t["e2e_ms"])),
        ("queueing ms", _dist(t["queue_ms"])),
        ("throughput requests/s", f"{t['throughput']['requests_per_s']:,.2f}"),
        (
            "  input / output tokens/s",
            (
                f"{t['throughput']['input_tokens_per_s']:,.0f} / "
                f"{t['throughput']['output_tokens_per_s']:,.0f}"
            ),
        ),
    ]
    if "slo_attainment" in t:
        rows.append(("SLO attainment", _pct(t["slo_attainment"])))
    return rows


def print_summary(
    console: Console,
    workload_summaries: Sequence[dict[str, Any]],
    results: Sequence[SimResult],
    *,
    per_api: bool = True,
    ratio: float | None = None,
) -> None:
    """One column per result; then each result's per-API times."""
    for w in {w["name"]: w for w in workload_summaries}.values():
        sessions = f", {w['sessions']:,} sessions" if w["sessions"] else ""
        console.print(
            f"[bold]workload[/bold] {w['name']}: {w['requests']:,} requests"
            f"{sessions}, "
            f"mean prompt {w['mean_prompt_tokens']:,.0f} tokens, longest request "
            f"{w['max_request_tokens']:,} tokens, last arrival at "
            f"{w['last_arrival_s']:,.1f} s"
        )
    table = Table(title="pagedkv simulate", title_justify="left")
    table.add_column("")
    for r in results:
        table.add_column(r.label, justify="right")
    columns = [_rows(r) for r in results]
    for i, (name, _) in enumerate(columns[0]):
        values = [col[i][1] for col in columns]
        if any(v != _OMIT for v in values):
            table.add_row(name, *(v or "-" for v in values))
    if len({r.alloc_checksum for r in results}) > 1 and {r.engine for r in results} == {
        "pagedkv",
        "vllm",
    }:
        table.add_row("alloc checksum", *(r.alloc_checksum for r in results))
    console.print(table)
    if ratio is not None:
        same = len({r.alloc_checksum for r in results}) == 1
        console.print(
            f"vLLM / pagedkv manager time per step: [bold]{ratio:,.1f}x[/bold]; "
            f"allocations {'identical' if same else 'DIFFERENT'} "
            f"(alloc checksum {results[0].alloc_checksum})"
        )
    for r in results:
        reps = r.extra.get("replicas")
        if not reps:
            continue
        t = Table(title=f"{r.label}: replicas ({r.config['router']})", title_justify="left")
        for col in ("replica", "requests", "steps", "hit rate", "preemptions", "KV usage peak"):
            t.add_column(col, justify="left" if col == "replica" else "right")
        for x in reps:
            t.add_row(
                x["name"],
                f"{x['requests']:,}",
                f"{x['steps']:,}",
                _pct(x["hit_rate"]),
                f"{x['preemptions']:,}",
                _pct(x["peak_usage"]),
            )
        console.print(t)
    if not per_api:
        return
    for r in results:
        t = Table(title=f"{r.label}: time inside the manager, per API", title_justify="left")
        for col in ("API", "calls", "total ms", "µs/call"):
            t.add_column(col, justify="left" if col == "API" else "right")
        for api, (calls, ns) in sorted(r.per_api.items(), key=lambda kv: -kv[1][1]):
            t.add_row(
                api, f"{calls:,}", f"{ns / 1e6:,.1f}", f"{ns / 1e3 / calls:,.2f}" if calls else "-"
            )
        console.print(t)


def to_json_obj(
    workload_summaries: Sequence[dict[str, Any]],
    results: Sequence[SimResult],
    *,
    ratio: float | None = None,
    series: bool = False,
) -> dict[str, Any]:
    """The ``--json`` document: ``workloads`` and one entry of ``runs`` per result."""
    runs = []
    for r, w in zip(results, workload_summaries, strict=True):
        d = r.to_dict()
        d["workload"] = w["name"]
        if series:
            d["series"] = r.series
        runs.append(d)
    out: dict[str, Any] = {
        "workloads": list({w["name"]: w for w in workload_summaries}.values()),
        "runs": runs,
    }
    if ratio is not None:
        out["vllm_over_pagedkv_manager_time_per_step"] = round(ratio, 3)
        out["identical_allocations"] = len({r.alloc_checksum for r in results}) == 1
    return out
