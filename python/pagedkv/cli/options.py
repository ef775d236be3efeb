"""Argument types and limits of the ``pagedkv`` command line, and its usage error.

Each type turns one command-line string into a value within its limit, or
raises ``argparse.ArgumentTypeError`` with the message argparse prints. The
same types check the values of ``--compare`` and ``--sweep`` (``axes.py``).
"""

from __future__ import annotations

import argparse
from typing import Any


class UsageError(Exception):
    """A bad combination of options or values: printed as an error, exit status 2."""


#: The most runs one --compare grid or --sweep makes.
MAX_VARIANTS = 256

#: The largest value any count or amount on the command line may take.
MAX_ARG = 10**9

#: The most replicas one simulation runs.
MAX_REPLICAS = 256

#: The largest --max-concurrency.
MAX_CONCURRENCY = 10**6

#: The most requests a built-in workload may generate.
MAX_REQUESTS = 10_000_000


def number(s: str, kind: type[int] | type[float], what: str) -> Any:
    try:
        return kind(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}, got {s!r}") from None


def positive_float(s: str) -> float:
    v: float = number(s, float, f"must be a positive finite number up to {MAX_ARG}")
    if not 0 < v <= MAX_ARG:
        raise argparse.ArgumentTypeError(
            f"must be a positive finite number up to {MAX_ARG}, got {s}"
        )
    return v


def replica_count(s: str) -> int:
    v: int = number(s, int, f"must be 1 to {MAX_REPLICAS}")
    if not 0 < v <= MAX_REPLICAS:
        raise argparse.ArgumentTypeError(f"must be 1 to {MAX_REPLICAS}, got {s}")
    return v


def concurrency(s: str) -> int:
    v: int = number(s, int, f"must be an integer from 1 to {MAX_CONCURRENCY}")
    if not 0 < v <= MAX_CONCURRENCY:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to {MAX_CONCURRENCY}, got {s}")
    return v


def fraction(s: str) -> float:
    v: float = number(s, float, "must be in (0, 1]")
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {s}")
    return v


def positive_int(s: str) -> int:
    v: int = number(s, int, f"must be a positive integer up to {MAX_ARG}")
    if not 0 < v <= MAX_ARG:
        raise argparse.ArgumentTypeError(f"must be a positive integer up to {MAX_ARG}, got {s}")
    return v


def request_count(s: str) -> int:
    v: int = number(s, int, f"must be a positive integer up to {MAX_REQUESTS}")
    if not 0 < v <= MAX_REQUESTS:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer up to {MAX_REQUESTS}, got {s}"
        )
    return v


#: The most host memory (--cpu-offload) and disk (--disk-offload) per GPU, GiB.
MAX_CPU_OFFLOAD_GIB = 65_536
MAX_DISK_OFFLOAD_GIB = 1_048_576

#: The fastest link --host-link and --disk-link take, GB/s.
MAX_LINK_GBPS = 10_000


def _gib(s: str, limit: int) -> float:
    what = f"must be a number of GiB from 0 to {limit:,}"
    v: float = number(s, float, what)
    if not 0 <= v <= limit:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{what}, got {s}")
    return v


def cpu_offload_gib(s: str) -> float:
    return _gib(s, MAX_CPU_OFFLOAD_GIB)


def disk_offload_gib(s: str) -> float:
    return _gib(s, MAX_DISK_OFFLOAD_GIB)


def link_gbps(s: str) -> float:
    what = f"must be GB/s in (0, {MAX_LINK_GBPS:,}]"
    v: float = number(s, float, what)
    if not 0 < v <= MAX_LINK_GBPS:
        raise argparse.ArgumentTypeError(f"{what}, got {s}")
    return v


def host_link(s: str) -> str:
    """A host link's name (``pagedkv.sim.tiers.HOST_LINKS``) or GB/s, as text."""
    from ..sim.tiers import HOST_LINKS

    if s in HOST_LINKS:
        return s
    try:
        link_gbps(s)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(HOST_LINKS)} or GB/s in (0, {MAX_LINK_GBPS:,}], got {s}"
        ) from None
    return s


def tier_weights(s: str) -> tuple[float, float]:
    """``HOST:DISK``: what a prefix-aware router counts a block held in host
    memory and on disk for, against 1 on the device (each from 0 to 1)."""
    what = "must be HOST:DISK, two numbers from 0 to 1 (e.g. 0.75:0.25)"
    parts = s.split(":")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{what}, got {s}")
    host, disk = (number(p, float, what) for p in parts)
    if not (0 <= host <= 1 and 0 <= disk <= 1):
        raise argparse.ArgumentTypeError(f"{what}, got {s}")
    return (host, disk)
