"""Running the points of a ``--sweep``: one after the other in this process, in
worker processes on this machine (``--jobs N``), or as Ray tasks
(``--ray-address``).

However they run, :func:`run_points` returns the points in their order, as the
compact records of :func:`pagedkv.sim.sweep.run_point` (the figures and the
run's ``to_dict()``, no per-step series: a few KB each, never a
:class:`~pagedkv.sim.runner.SimResult`), and calls ``on_done`` in this process
as each one completes.

The workloads travel once: to each worker process as the argument of the pool's
initializer (the processes are spawned, never forked), to a Ray cluster once with
``ray.put``. A point whose time scale is not the workloads' (a ``time-scale``
sweep) runs on a copy with its arrivals scaled, made where the point runs and
dropped when it ends.
"""

from __future__ import annotations

import copy
import importlib
import logging
import multiprocessing
import re
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from . import runner, sweep
from .runner import SimConfig
from .traces import scale_arrivals
from .workloads import Workload

__all__ = [
    "MAX_JOBS",
    "RAY_EXTRA",
    "SweepPoint",
    "SweepWorkloads",
    "check_ray_address",
    "import_ray",
    "parse_jobs",
    "points_progress",
    "run_points",
]

#: The most worker processes ``--jobs`` starts.
MAX_JOBS = 1024

#: How to install Ray for ``--ray-address``.
RAY_EXTRA = "pip install 'pagedkv[ray]'"

#: Called in this process as each point completes: its index and its record.
DoneFn = Callable[[int, dict[str, Any]], None]


@dataclass(frozen=True)
class SweepPoint:
    """One point to run: ``axis=value`` (``label``) on ``cfg``, over the workload
    named ``workload`` with its arrivals ``time_scale`` times faster."""

    axis: str
    value: str
    label: str
    cfg: SimConfig
    workload: str
    time_scale: float


@dataclass
class SweepWorkloads:
    """The workloads of a sweep by name, their arrivals already ``time_scale``
    times faster (1 for a ``time-scale`` sweep, whose points scale a copy)."""

    by_name: dict[str, Workload]
    time_scale: float = 1.0

    def get(self, name: str, time_scale: float) -> Workload:
        """The workload ``name`` at ``time_scale``: the one held when the scales
        agree, else a copy of its requests with their arrivals scaled (the token
        arrays are shared, not copied)."""
        w = self.by_name[name]
        if time_scale == self.time_scale:
            return w
        if self.time_scale != 1.0:
            raise ValueError(
                f"workload {name!r} is held at time scale {self.time_scale:g}, not {time_scale:g}"
            )
        scaled = Workload(w.name, [copy.copy(r) for r in w.requests], dict(w.params))
        return scale_arrivals(scaled, time_scale)


def run_point(point: SweepPoint, workloads: SweepWorkloads) -> dict[str, Any]:
    """Runs one point (wherever it is called) and returns its compact record."""

    def run() -> runner.SimResult:
        w = workloads.get(point.workload, point.time_scale)
        return runner.run_pagedkv(w, point.cfg, label=point.label)

    return sweep.run_point(point.axis, point.value, run)


def parse_jobs(text: str) -> int:
    """``--jobs``: worker processes, 1 to :data:`MAX_JOBS`."""
    try:
        jobs = int(text)
    except ValueError:
        raise ValueError(f"--jobs must be 1 to {MAX_JOBS}, got {text!r}") from None
    if not 1 <= jobs <= MAX_JOBS:
        raise ValueError(f"--jobs must be 1 to {MAX_JOBS}, got {text}")
    return jobs


#: a host name, an IPv4 address or a bracketed IPv6 one
_HOST = re.compile(
    r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9-]+)*|\[[0-9A-Fa-f:.]+\]"
)


def check_ray_address(text: str) -> str:
    """``--ray-address``: ``auto`` (the cluster this machine belongs to),
    ``local`` (a Ray instance started for the sweep) or ``HOST:PORT`` (port 1 to
    65535); returned as given."""
    if text in ("auto", "local"):
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not _HOST.fullmatch(host):
        raise ValueError(f"--ray-address is auto, local or HOST:PORT, got {text!r}")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"--ray-address {text!r}: the port must be 1 to 65535")
    return text


def import_ray() -> Any:
    """The ``ray`` module; ImportError naming the extra when it is not installed."""
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise ImportError(f"--ray-address needs Ray: {RAY_EXTRA}") from None


def points_progress(console: Any, enabled: bool, description: str) -> Any:
    """A bar of the points done out of all, with the time elapsed and left."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn(description.replace("[", r"\[")),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("points"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not enabled,
    )


def run_points(
    points: Sequence[SweepPoint],
    workloads: SweepWorkloads,
    *,
    jobs: int = 1,
    ray_address: str | None = None,
    on_done: DoneFn | None = None,
) -> list[dict[str, Any]]:
    """Runs every point and returns their records in the points' order: as Ray
    tasks when ``ray_address`` is given, else in ``jobs`` worker processes (in
    this process when one is enough)."""
    records: list[dict[str, Any] | None] = [None] * len(points)

    def done(i: int, record: dict[str, Any]) -> None:
        records[i] = record
        if on_done is not None:
            on_done(i, record)

    if ray_address is not None:
        _run_ray(points, workloads, ray_address, done)
    elif min(jobs, len(points)) <= 1:
        for i, p in enumerate(points):
            done(i, run_point(p, workloads))
    else:
        _run_pool(points, workloads, min(jobs, len(points)), done)
    ran = [r for r in records if r is not None]
    if len(ran) != len(points):  # every backend reports every point, run or failed
        raise RuntimeError(f"{len(points) - len(ran)} of {len(points)} points did not report")
    return ran


# ------------------------------------------------------------- worker processes

#: A worker process's workloads, set once by the pool's initializer.
_worker_workloads: SweepWorkloads | None = None


def _init_worker(workloads: SweepWorkloads) -> None:
    global _worker_workloads
    _worker_workloads = workloads
    # Ctrl-C reaches the whole process group: the parent handles it and ends
    # the workers (else each would go on to the points already queued to it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _worker_point(point: SweepPoint) -> dict[str, Any]:
    if _worker_workloads is None:
        raise RuntimeError("the worker process has no workloads")
    return run_point(point, _worker_workloads)


def _run_pool(
    points: Sequence[SweepPoint], workloads: SweepWorkloads, jobs: int, done: DoneFn
) -> None:
    # spawn, not fork: a forked child would inherit the parent's threads (rich's
    # refresh thread, the manager's hashing thread) in whatever state they were.
    pool = ProcessPoolExecutor(
        max_workers=jobs,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(workloads,),
    )
    try:
        pending: dict[Future[dict[str, Any]], int] = {
            pool.submit(_worker_point, p): i for i, p in enumerate(points)
        }
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for f in sorted(finished, key=pending.__getitem__):
                i = pending.pop(f)
                try:
                    record = f.result()
                except BrokenProcessPool as e:
                    p = points[i]
                    record = sweep.failed_point(
                        p.axis, p.value, f"its worker process died ({e or 'BrokenProcessPool'})"
                    )
                done(i, record)
    except BaseException:  # Ctrl-C, or on_done failed: the points left are not run
        _terminate(pool)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _terminate(pool: ProcessPoolExecutor) -> None:
    """Ends the pool's worker processes at once (their points are lost)."""
    stop = getattr(pool, "terminate_workers", None)  # Python 3.14
    if stop is not None:
        stop()
        return
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.terminate()


# ------------------------------------------------------------------------- Ray


def _ray_point(workloads: SweepWorkloads, point: SweepPoint) -> dict[str, Any]:
    return run_point(point, workloads)


def _run_ray(
    points: Sequence[SweepPoint], workloads: SweepWorkloads, address: str, done: DoneFn
) -> None:
    ray = import_ray()
    # A Ray already initialised in this process (a library caller's) is used
    # and left running; one this function starts or connects to is shut down.
    owned = not ray.is_initialized()
    if owned:
        quiet: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
        try:
            if address == "local":
                ray.init(address="local", include_dashboard=False, **quiet)
            else:
                ray.init(address=address, **quiet)
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConnectionError(f"--ray-address {address}: {first}") from None
    try:
        shared = ray.put(workloads)
        task = ray.remote(_ray_point)
        pending = {task.remote(shared, p): i for i, p in enumerate(points)}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                i = pending.pop(ref)
                try:
                    record = ray.get(ref)
                except Exception as e:  # the task's worker died: run_point catches the rest
                    p = points[i]
                    record = sweep.failed_point(p.axis, p.value, f"{type(e).__name__}: {e}")
                done(i, record)
    except BaseException:  # Ctrl-C, or on_done failed: a cluster drops the points left
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
    finally:
        if owned:
            ray.shutdown()
