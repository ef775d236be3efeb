"""``--plot FILE.png``: KV usage, running requests and cumulative hit rate over steps."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .runner import SimResult

__all__ = ["FIGSIZE", "plot_results"]

#: inches at 100 dpi: a 1200 x 900 pixel image
FIGSIZE = (12.0, 9.0)
DPI = 100


def plot_results(results: Sequence[SimResult], path: str, *, title: str = "") -> None:
    """Writes a PNG with one line per result in each of three panels. Raises
    ImportError (with the install hint) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - the test extra installs matplotlib
        raise ImportError("--plot needs matplotlib: pip install 'pagedkv[plot]'") from e
    fig, axes = plt.subplots(3, 1, figsize=FIGSIZE, dpi=DPI, sharex=True)
    panels = (
        ("usage", "KV-cache usage", 100.0, "%"),
        ("running", "running requests", 1.0, ""),
        ("hit_rate", "cumulative prefix hit rate", 100.0, "%"),
    )
    for ax, (key, name, scale, unit) in zip(axes, panels, strict=True):
        for r in results:
            ys = r.series.get(key, [])
            ax.plot(range(len(ys)), [y * scale for y in ys], label=r.label, linewidth=1.0)
        ax.set_ylabel(f"{name}{' (' + unit + ')' if unit else ''}")
        ax.grid(True, alpha=0.3)
        if scale == 100.0:
            ax.set_ylim(0, 105)
    axes[-1].set_xlabel("scheduler step")
    if len(results) > 1:
        axes[0].legend(loc="lower right")
    fig.suptitle(title or "pagedkv simulate")
    # No tight bbox: the image keeps exactly FIGSIZE * DPI pixels. Written
    # beside the target and renamed over it: an interrupted run leaves no half
    # image.
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        fig.savefig(tmp, dpi=DPI, format="png")
        os.replace(tmp, target)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
