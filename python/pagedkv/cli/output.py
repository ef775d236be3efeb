"""What the commands print and write: JSON text, and simulate's output files.

``simulate``'s files (``--plot``, ``--csv``, ``--save-trace``) are checked
before any simulation and written after the results were printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..sim.outputs import OutputPathError, check_output
from ..sim.runner import SimConfig
from .options import UsageError


def json_text(doc: Any) -> str:
    """``doc`` as JSON text; JSON has no NaN or Infinity, and none is ever printed."""
    try:
        return json.dumps(doc, indent=2, allow_nan=False) + "\n"
    except ValueError:
        raise ValueError(
            "a figure of the results is not a finite number: nothing printed"
        ) from None


def check_outputs(args: argparse.Namespace) -> None:
    """Refuses, before any simulation, an output that cannot be written or that
    would overwrite an input (the trace, the model's config.json) or another
    output (``pagedkv.sim.outputs``)."""
    inputs = [p for p in (args.trace, args.model) if p and os.path.exists(p)]
    given = [
        (option, path)
        for option, path in (
            ("--plot", args.plot),
            ("--csv", args.csv),
            ("--save-trace", args.save_trace),
        )
        if path is not None
    ]
    for i, (option, path) in enumerate(given):
        try:
            check_output(path, inputs=inputs, others=[p for _, p in given[:i]], what=option)
        except OutputPathError as e:
            raise UsageError(str(e)) from None


def write_outputs(
    out: Any, quiet: bool, outputs: Sequence[tuple[str, str, Callable[[], None]]]
) -> int:
    """Writes each output after the results were printed: one that fails is
    reported (exit status 2) without losing the others or the printed results."""
    code = 0
    for what, path, write in outputs:
        try:
            write()
        except (OSError, ValueError, ImportError) as e:
            print(f"pagedkv simulate: error: {what} {path}: {e}", file=sys.stderr)
            code = 2
            continue
        if not quiet:
            out.print(f"{what} written to {path}")
    return code


def title(workload: dict[str, Any], cfg: SimConfig, varied: Sequence[str] = ()) -> str:
    """A plot's title: the workload, and the model, GPUs and memory no axis varies."""
    parts = [f"pagedkv simulate: {workload['name']}"]
    if "model" not in varied:
        parts.append(cfg.model)
    if not {"gpu", "tp"} & set(varied):
        parts.append("--step-time" if cfg.step_time else f"{cfg.tp} x {cfg.gpu}")
    if not {"memory", "num-blocks"} & set(varied):
        parts.append(
            f"{cfg.memory_gib:g} GiB KV/GPU" if cfg.memory_gib else "KV sized by vLLM's rule"
        )
    return ", ".join(parts)
