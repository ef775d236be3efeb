"""``--plot FILE``: what a run looks like over time, or a sweep's curves.

:func:`plot_results` draws, against simulated time, KV usage, running and waiting
requests, cumulative preemptions and a rolling prefix-hit rate, one line per
variant; :func:`plot_sweep` draws a sweep's hit rate (with the workload's
theoretical ceiling), preemptions, TTFT p99 and throughput against the swept
value. The file's extension picks the format (``.png``, ``.svg``, ``.pdf``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .outputs import open_output
from .runner import SimResult

#: sweep axes that change how much the caches hold
CAPACITY_AXES = ("memory", "num-blocks", "cpu-offload", "disk-offload")

__all__ = [
    "CAPACITY_AXES",
    "FIGSIZE",
    "ROLLING_STEPS",
    "plot_results",
    "plot_sweep",
    "rolling_hit_rate",
]

#: inches at 100 dpi: a 1200 x 900 pixel image
FIGSIZE = (12.0, 9.0)
DPI = 100
FORMATS = ("png", "svg", "pdf")
#: steps in the window of the rolling hit rate (fewer for short runs)
ROLLING_STEPS = 200


def _format(path: str) -> str:
    ext = Path(path).suffix.lower().lstrip(".")
    if ext not in FORMATS:
        raise ValueError(f"--plot {path}: the file must end in .png, .svg or .pdf")
    return ext


@contextmanager
def _figure(path: str, rows: int, cols: int) -> Iterator[tuple[Any, Any]]:
    fmt = _format(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - the test extra installs matplotlib
        raise ImportError("--plot needs matplotlib: pip install 'pagedkv[plot]'") from e
    fig, axes = plt.subplots(rows, cols, figsize=FIGSIZE, dpi=DPI, squeeze=False)
    try:
        yield fig, axes
        # No tight bbox: the image keeps exactly FIGSIZE * DPI pixels. A regular
        # file is written beside the target and renamed over it: an interrupted
        # run leaves no half image.
        with open_output(path, "wb") as f:
            fig.savefig(f, dpi=DPI, format=fmt)
    finally:
        plt.close(fig)


def rolling_hit_rate(hits: Sequence[float], queries: Sequence[float], window: int) -> list[float]:
    """Per step: hit tokens / looked-up tokens over the last ``window`` steps (the
    previous value while the window looked nothing up)."""
    out: list[float] = []
    h = q = 0.0
    last = 0.0
    for i, (hi, qi) in enumerate(zip(hits, queries, strict=True)):
        h += hi
        q += qi
        if i >= window:
            h -= hits[i - window]
            q -= queries[i - window]
        if q > 0:
            last = h / q
        out.append(last)
    return out


def plot_results(results: Sequence[SimResult], path: str, *, title: str = "") -> None:
    """One line per result in each panel, against the simulated clock. Raises
    ImportError (with the install hint) when matplotlib is missing."""
    steps = max((len(r.series.get("usage", [])) for r in results), default=0)
    window = max(1, min(ROLLING_STEPS, steps // 20 or 1))
    with _figure(path, 4, 1) as (fig, axes):
        ax_usage, ax_queue, ax_pre, ax_hit = axes[:, 0]
        for i, r in enumerate(results):
            s = r.series
            t = s.get("time_s") or list(range(len(s.get("usage", []))))
            color = f"C{i % 10}"
            ax_usage.plot(t, [100 * u for u in s["usage"]], color=color, lw=1.0, label=r.label)
            ax_queue.plot(t, s["running"], color=color, lw=1.0)
            ax_queue.plot(t, s["waiting"], color=color, lw=1.0, ls="--")
            ax_pre.plot(t, s.get("preemptions", [0.0] * len(t)), color=color, lw=1.0)
            rolling = rolling_hit_rate(
                s.get("hit_tokens", [0.0] * len(t)), s.get("query_tokens", [0.0] * len(t)), window
            )
            ax_hit.plot(t, [100 * h for h in rolling], color=color, lw=1.0)
        ax_usage.set_ylabel("KV-cache usage (%)")
        ax_usage.set_ylim(0, 105)
        ax_queue.set_ylabel("requests\n(solid running, dashed waiting)")
        ax_pre.set_ylabel("preemptions (cumulative)")
        ax_hit.set_ylabel(f"prefix hit rate (%)\nlast {window} steps")
        ax_hit.set_ylim(0, 105)
        timed = all(r.series.get("time_s") for r in results)
        ax_hit.set_xlabel("simulated time (s)" if timed else "scheduler step")
        for ax in axes[:, 0]:
            ax.grid(True, alpha=0.3)
        if len(results) > 1:
            fig.legend(
                loc="upper center",
                ncol=min(4, len(results)),
                fontsize="small",
                bbox_to_anchor=(0.5, 0.955),
                frameon=False,
            )
        fig.suptitle(title or "pagedkv simulate")
        fig.subplots_adjust(top=0.87 if len(results) > 4 else 0.9, hspace=0.3)


def plot_sweep(
    axis: str,
    points: Sequence[dict[str, Any]],
    path: str,
    *,
    ceiling: float | None = None,
    title: str = "",
) -> None:
    """A sweep's figures against the swept value: hit rate (the theoretical
    ceiling as a dashed line), preemptions, TTFT p99 and throughput. Points that
    did not run are left out; a numeric axis spanning a decade or more is
    logarithmic. A sweep of a cache's size (``CAPACITY_AXES``) draws every
    figure against the total cache capacity in tokens (device, host and disk;
    log-scaled), the device's share of the hits beside the hit rate when tiers
    ran."""
    ran = [p for p in points if p.get("status") == "ok"]
    numeric = all(isinstance(p["value"], int | float) for p in ran)
    capacity = axis in CAPACITY_AXES and bool(ran)
    xs: list[Any]
    if capacity:
        xs = [p["capacity_tokens"] for p in ran]
        label = "cache capacity (tokens: device + host + disk)"
    else:
        xs = [p["value"] if numeric else str(p["value"]) for p in ran]
        label = axis
    wide = (capacity or numeric) and bool(ran) and min(xs) > 0 and max(xs) / min(xs) >= 10
    tiered = any(p.get("host_hit_rate") or p.get("disk_hit_rate") for p in ran)
    panels: tuple[tuple[str, Callable[[dict[str, Any]], float]], ...] = (
        ("hit rate (%)", lambda p: 100 * p["hit_rate"]),
        ("preemptions", lambda p: p["preemptions"]),
        ("TTFT p99 (ms)", lambda p: p["ttft_ms"]["p99"]),
        ("throughput (requests/s)", lambda p: p["throughput"]["requests_per_s"]),
    )
    with _figure(path, 2, 2) as (fig, axes):
        for ax, (name, get) in zip(axes.flat, panels, strict=True):
            ys = [get(p) for p in ran]
            ax.plot(xs, ys, marker="o", lw=1.2, label="all tiers" if tiered else None)
            # From zero, without an offset: a flat line reads as flat.
            ax.set_ylim(bottom=0, top=max([*ys, 0]) * 1.1 or 1)
            ax.ticklabel_format(axis="y", useOffset=False, style="plain")
            ax.set_xlabel(label)
            ax.set_ylabel(name)
            ax.grid(True, alpha=0.3)
            if wide:
                ax.set_xscale("log")
        if tiered:
            dev = [100 * p["device_hit_rate"] for p in ran]
            axes[0, 0].plot(xs, dev, marker=".", lw=1.0, ls=":", label="on the device")
            axes[0, 0].legend(loc="upper left", fontsize="small")
        if ceiling is not None:
            ax = axes[0, 0]
            ax.axhline(100 * ceiling, ls="--", color="grey", label="ceiling (unlimited cache)")
            ax.set_ylim(0, 105)
            ax.legend(loc="lower right", fontsize="small")
        fig.suptitle(title or f"pagedkv simulate: sweep of {axis}")
        fig.subplots_adjust(hspace=0.3, wspace=0.25)
