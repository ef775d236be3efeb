"""The ``pagedkv`` command line: its parser and the dispatch to each subcommand.

``pagedkv simulate --help`` explains the simulator. Each subcommand lives in
its own module (``simulate.py`` with ``simulate_parser.py``, ``sweeps.py`` and
``axes.py``; ``calibrate.py``; ``trace_stats.py``); the options ``simulate``
and ``calibrate`` share are in ``deployment.py``, the argument types in
``options.py``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import __version__
from ..errors import PagedKVError
from ..sim.runner import EngineUnavailableError
from ..sim.tracefile import TraceFormatError

# The workload generator ``simulate`` calls, looked up here when it runs, so
# that it can be wrapped on the package (``pagedkv.cli.generate``).
from ..sim.workloads import generate as generate
from . import calibrate, simulate, simulate_parser, trace_stats
from .options import UsageError

# Also on the package: the longest request the built-in workloads make by default.
from .simulate import _builtin_context as _builtin_context

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``pagedkv`` argument parser."""
    p = argparse.ArgumentParser(
        prog="pagedkv", description="pagedkv: a KV-cache block manager for LLM serving."
    )
    p.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    simulate_parser.add_parser(sub)
    calibrate.add_parser(sub)
    trace_stats.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pagedkv`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    prog = f"pagedkv {args.command}"
    try:
        if args.command == "calibrate":
            return calibrate.run_calibrate(args)
        if args.command == "trace-stats":
            return trace_stats.run_trace_stats(args)
        return simulate.run_simulate(args, generate)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except EngineUnavailableError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 3
    except (UsageError, TraceFormatError, PagedKVError, ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"{prog}: error: out of memory (make the workload smaller)", file=sys.stderr)
        return 2
