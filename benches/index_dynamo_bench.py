"""pagedkv's prefix index against NVIDIA Dynamo's RadixTree, side by side.

    python benches/index_dynamo_bench.py [--quick] [--sizes 1e5,1e6] [--replicas 8,64]
        [--queries 2000] [--rounds 3] [--seed 0] [--no-memory] [--no-pin]

Needs ``ai-dynamo-runtime`` (``dynamo.llm.RadixTree``) and numpy next to pagedkv;
exits 2 with one line when either is missing (not part of the tests).

One synthetic vLLM-style event stream per (index size, replica count), fed to
both indexes: a few hundred "system prompts" each growing conversation trees
(chains of 16-256 blocks, continued, branched), each request routed to one of
its tree's two home replicas (or at random), which stores the blocks it lacks
as ``BlockStored`` (prefill chunk, then decode-style single blocks, each with
its parent) and, over its share of the target size, evicts leaf-first
(``BlockRemoved``). The same stream goes to ``pagedkv.index.PrefixIndex``
(``store``/``remove`` with Python lists of ints) and to Dynamo's
``RadixTree.apply_event`` (one JSON ``KvCacheEvent`` per event, encoded before
the clock starts; ``tokens_hash`` = ``block_hash`` = the chained hash, so both
trees are keyed alike and queried with the same list).

Figures, each side in one process, rounds alternating A/B then B/A:
apply time (per block and per event) building a fresh index; best-replica and
all-replica query latency over ``--queries`` chains of 16-256 blocks and a
1,024-block chain (median and p99 per round); clearing a replica holding
20,000 blocks; and, in a fresh subprocess per side and size, the RSS growth per
indexed (replica, block) pair. Both sides' answers are checked against each
other and against the generator's own record for every query.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHUNKS = 20  # turns per side while building an index (at least 1,000 events each)
# --------------------------------------------------------------------------- imports


def _import_sides() -> tuple[Any, Any]:
    """pagedkv's PrefixIndex and Dynamo's RadixTree, or exit 2 with one line."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        print("index_dynamo_bench: numpy is not installed (pip install numpy)", file=sys.stderr)
        sys.exit(2)
    try:
        from pagedkv.index import PrefixIndex
    except ImportError as e:
        print(f"index_dynamo_bench: pagedkv is not importable ({e})", file=sys.stderr)
        sys.exit(2)
    try:
        from dynamo.llm import RadixTree
    except ImportError:
        print(
            "index_dynamo_bench: Dynamo is not installed (pip install ai-dynamo-runtime "
            "for dynamo.llm.RadixTree); nothing to compare against",
            file=sys.stderr,
        )
        sys.exit(2)
    return PrefixIndex, RadixTree


# --------------------------------------------------------------------------- workload

# The stream and its encodings live beside this script (run as a script, its
# directory is on sys.path).
from index_dynamo_workload import (  # noqa: E402
    CLEAR_BLOCKS,
    LONG_QUERY,
    MAX_LEN,
    MIN_LEN,
    REMOVED,
    STORED,
    DynEncoder,
    DynEvent,
    PkEvent,
    Workload,
    dyn_inputs,
    generate,
    pk_inputs,
)

# --------------------------------------------------------------------------- sides


def register(index: Any, num_replicas: int) -> None:
    """Names the replicas in id order, so that pagedkv breaks ties between
    equally long matches as Dynamo does (the lowest worker id)."""
    for r in range(num_replicas):
        index.store(f"r{r}", [])


def apply_pk(index: Any, events: list[PkEvent]) -> tuple[float, float]:
    """Seconds spent in ``BlockStored`` and in ``BlockRemoved`` calls."""
    store, remove = index.store, index.remove
    clock = time.perf_counter
    spent = [0.0, 0.0]
    gc.disable()
    for kind, name, hashes, parent in events:
        t0 = clock()
        if kind == STORED:
            store(name, hashes, parent)
        else:
            remove(name, hashes)
        spent[kind] += clock() - t0
    gc.enable()
    return spent[STORED], spent[REMOVED]


def apply_dyn(tree: Any, events: list[DynEvent]) -> tuple[float, float]:
    """Seconds spent in stored and in removed ``apply_event`` calls."""
    apply_event = tree.apply_event
    clock = time.perf_counter
    spent = [0.0, 0.0]
    gc.disable()
    for kind, rep, data in events:
        t0 = clock()
        apply_event(rep, data)
        spent[kind] += clock() - t0
    gc.enable()
    return spent[STORED], spent[REMOVED]


def pk_best(index: Any) -> Callable[[list[int]], Any]:
    return index.longest_prefix  # type: ignore[no-any-return]


def pk_lengths(index: Any) -> Callable[[list[int]], Any]:
    return index.match_lengths  # type: ignore[no-any-return]


def dyn_lengths(tree: Any) -> Callable[[list[int]], Any]:
    find = tree.find_matches

    def run(q: list[int]) -> Any:
        return find(q).scores

    return run


def dyn_best(tree: Any) -> Callable[[list[int]], Any]:
    find = tree.find_matches

    def run(q: list[int]) -> Any:
        s = find(q).scores
        # the longest, the lowest worker id among equals (as pagedkv breaks ties)
        return min(s.items(), key=lambda kv: (-kv[1], kv[0])) if s else None

    return run


def _median_p99_us(ns: list[int]) -> tuple[float, float]:
    ns.sort()
    return statistics.median(ns) / 1e3, ns[min(len(ns) - 1, int(len(ns) * 0.99))] / 1e3


def latencies_us(
    fa: Callable[[list[int]], Any],
    fb: Callable[[list[int]], Any],
    queries: list[list[int]],
    rnd: int,
) -> tuple[tuple[float, float], tuple[float, float]]:
    """Median and p99 (microseconds) of one call per query on each side, the
    two sides alternating first query by query."""
    clock = time.perf_counter_ns
    ta: list[int] = []
    tb: list[int] = []
    gc.disable()
    for i, q in enumerate(queries):
        for fn, out in ((fa, ta), (fb, tb)) if (i + rnd) % 2 == 0 else ((fb, tb), (fa, ta)):
            t0 = clock()
            fn(q)
            out.append(clock() - t0)
    gc.enable()
    return _median_p99_us(ta), _median_p99_us(tb)


# --------------------------------------------------------------------------- memory


def settle(timeout_s: float = 120.0) -> None:
    """Waits until the process is idle: a dropped RadixTree is freed by its own
    background thread, which must not run into the next timed section."""
    end = time.monotonic() + timeout_s

    def cpu() -> float:
        t = os.times()
        return t.user + t.system

    prev = cpu()
    while time.monotonic() < end:
        time.sleep(0.1)
        now = cpu()
        if now - prev < 0.005:
            return
        prev = now


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def memory_worker(side: str, path: Path) -> None:
    """Subprocess: RSS growth of one side's index built from a saved stream."""
    prefix_index, radix_tree = _import_sides()
    w = Workload.load(path)
    if side == "pagedkv":
        pk_events = pk_inputs(w)
        gc.collect()
        index = prefix_index()
        register(index, w.num_replicas)
        before = rss_bytes()
        apply_pk(index, pk_events)
    else:
        dyn_events = dyn_inputs(w, DynEncoder())
        gc.collect()
        index = radix_tree()
        index.find_matches([1])  # the background thread is up
        before = rss_bytes()
        apply_dyn(index, dyn_events)
        index.find_matches([1])
    gc.collect()
    settle()
    after = rss_bytes()
    print(json.dumps({"before": before, "after": after, "pairs": w.final_pairs}))


def measure_memory(side: str, path: Path) -> float | None:
    """Bytes of RSS growth per indexed pair, measured in a fresh process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_memory-worker", side, str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(f"  memory worker ({side}) failed: {proc.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    d = json.loads(proc.stdout.strip().splitlines()[-1])
    return (d["after"] - d["before"]) / max(1, d["pairs"])


# --------------------------------------------------------------------------- rows


@dataclass
class Row:
    name: str
    unit: str
    pk: list[float]
    dyn: list[float]

    @staticmethod
    def _fmt(xs: list[float]) -> str:
        if not xs:
            return "n/a"
        if len(xs) == 1:
            return f"{xs[0]:.3g}"
        return f"{min(xs):.3g} / {statistics.median(xs):.3g}"

    def markdown(self) -> str:
        ratio = "n/a"
        if self.pk and self.dyn and min(self.dyn) > 0:
            ratio = f"{min(self.pk) / min(self.dyn):.2f}"
            if len(self.pk) > 1 or len(self.dyn) > 1:
                ratio += f" / {statistics.median(self.pk) / statistics.median(self.dyn):.2f}"
        return (
            f"| {self.name} | {self.unit} | {self._fmt(self.pk)} | {self._fmt(self.dyn)} "
            f"| {ratio} |"
        )


def check_answers(index: Any, tree: Any, w: Workload) -> list[str]:
    """Where pagedkv, Dynamo and the generator disagree on a query."""
    names = [f"r{r}" for r in range(w.num_replicas)]
    problems: list[str] = []
    cases = [*zip(w.queries, w.expected, strict=True), (w.long_query, w.long_expected)]
    for i, (q, exp) in enumerate(cases):
        pk = index.match_lengths(q)
        pk_l = [pk.get(n, 0) for n in names]
        s = tree.find_matches(q).scores
        dyn_l = [s.get((r, 0), 0) for r in range(w.num_replicas)]
        extra = sorted(k for k in s if k[1] != 0 or k[0] >= w.num_replicas)
        best = index.longest_prefix(q)
        pk_best_t = None if best is None else (int(best.replica[1:]), best.num_blocks)
        dyn_best_t = dyn_best(tree)(q)
        dyn_best_t = None if dyn_best_t is None else (dyn_best_t[0][0], dyn_best_t[1])
        if pk_l != exp or dyn_l != exp or extra or pk_best_t != dyn_best_t:
            problems.append(
                f"query {i} ({len(q)} blocks): expected {exp}, pagedkv {pk_l} best {pk_best_t}, "
                f"dynamo {dyn_l} best {dyn_best_t} extra {extra}"
            )
    return problems


def run_config(
    size: int, reps: int, args: argparse.Namespace, prefix_index: Any, radix_tree: Any
) -> list[Row]:
    t0 = time.perf_counter()
    w = generate(size, reps, args.queries, args.seed + size + reps)
    gen_s = time.perf_counter() - t0
    n_ev, n_ops = w.num_events, w.block_ops
    n_removed = sum(n for k, n in zip(w.kinds, w.lens, strict=True) if k == REMOVED)
    print(
        f"\n## {size:,} pairs target, {reps} replicas: {n_ev:,} events, {n_ops:,} block ops "
        f"({n_removed:,} removals), {w.final_pairs:,} pairs indexed, "
        f"{w.distinct_blocks:,} distinct blocks (generated in {gen_s:.1f} s)",
        flush=True,
    )
    t0 = time.perf_counter()
    pk_events = pk_inputs(w)
    pk_prep = time.perf_counter() - t0
    enc = DynEncoder()
    t0 = time.perf_counter()
    dyn_events = dyn_inputs(w, enc)
    dyn_prep = time.perf_counter() - t0

    rows: list[Row] = []
    pk_t: list[tuple[float, float]] = []  # (stored, removed) seconds per round
    dyn_t: list[tuple[float, float]] = []
    index: Any = None
    tree: Any = None
    # both indexes built in the same pass, chunk by chunk, the first side alternating
    chunk = max(1_000, -(-n_ev // CHUNKS))
    pk_chunks = [pk_events[i : i + chunk] for i in range(0, n_ev, chunk)]
    dyn_chunks = [dyn_events[i : i + chunk] for i in range(0, n_ev, chunk)]
    for rnd in range(args.rounds):
        index = tree = None
        gc.collect()
        settle()
        index = prefix_index()
        register(index, reps)
        tree = radix_tree()
        tree.find_matches([1])  # its background thread is up
        spent = [0.0, 0.0, 0.0, 0.0]
        for ci, (pc, dc) in enumerate(zip(pk_chunks, dyn_chunks, strict=True)):
            for side in (0, 1) if (ci + rnd) % 2 == 0 else (1, 0):
                st, rm = apply_pk(index, pc) if side == 0 else apply_dyn(tree, dc)
                spent[2 * side] += st
                spent[2 * side + 1] += rm
        pk_t.append((spent[0], spent[1]))
        dyn_t.append((spent[2], spent[3]))
        print(
            f"  round {rnd}: apply pagedkv {sum(pk_t[-1]):.2f} s, dynamo {sum(dyn_t[-1]):.2f} s",
            flush=True,
        )
    del pk_events, dyn_events, pk_chunks, dyn_chunks
    tag = f"{size:.0e} x{reps}"
    n_stored = n_ops - n_removed
    n_ev_removed = sum(1 for k in w.kinds if k == REMOVED)

    def per(ts: list[tuple[float, float]], which: int | None, n: int, scale: float) -> list[float]:
        return [(sum(t) if which is None else t[which]) / max(1, n) * scale for t in ts]

    for label, which, n, unit, scale in (
        ("apply, all events", None, n_ops, "ns/block op", 1e9),
        ("apply, all events", None, n_ev, "us/event", 1e6),
        ("apply, BlockStored only", STORED, n_stored, "ns/block", 1e9),
        ("apply, BlockRemoved only", REMOVED, n_removed, "ns/block", 1e9),
        ("apply, BlockStored only", STORED, n_ev - n_ev_removed, "us/event", 1e6),
    ):
        rows.append(
            Row(f"{tag}: {label}", unit, per(pk_t, which, n, scale), per(dyn_t, which, n, scale))
        )
    rows.append(
        Row(
            f"{tag}: input prep (lists / JSON), once",
            "ns/block op",
            [pk_prep / n_ops * 1e9],
            [dyn_prep / n_ops * 1e9],
        )
    )

    settle()
    # the 1,024-block chain, then the answers
    for r, p, c in w.long_events:
        index.store(f"r{r}", c, p or None)
        tree.apply_event(r, enc.stored(r, p, c))
    problems = check_answers(index, tree, w)
    print(f"  answers: {len(w.queries) + 1} queries checked, {len(problems)} disagreements")
    for line in problems[:5]:
        print(f"    {line}")

    queries = w.queries
    lat: dict[str, list[tuple[float, float]]] = {}
    long_queries = [w.long_query] * max(100, len(queries) // 4)
    fns = {
        "best": (pk_best(index), dyn_best(tree), queries),
        "lengths": (pk_lengths(index), dyn_lengths(tree), queries),
        "long": (pk_best(index), dyn_best(tree), long_queries),
        # pagedkv's core without the Python wrapper (a (replica id, length) tuple)
        "best_core": (index._index.longest_prefix, dyn_best(tree), queries),
        "long_core": (index._index.longest_prefix, dyn_best(tree), long_queries),
    }
    for rnd in range(args.rounds):
        for key, (fa, fb, qs) in fns.items():
            la, lb = latencies_us(fa, fb, qs, rnd)
            lat.setdefault(f"{key}/pk", []).append(la)
            lat.setdefault(f"{key}/dyn", []).append(lb)
    labels = {
        "best": f"best replica, {len(queries)} queries {MIN_LEN}-{MAX_LEN} blocks",
        "lengths": "all replicas' match lengths, same queries",
        "long": f"best replica, {LONG_QUERY}-block query",
        "best_core": "best replica, 16-256 blocks, pagedkv._core directly",
        "long_core": f"best replica, {LONG_QUERY} blocks, pagedkv._core directly",
    }
    for key, label in labels.items():
        for j, stat in enumerate(("median", "p99")):
            rows.append(
                Row(
                    f"{tag}: {label}, {stat}",
                    "us",
                    [x[j] for x in lat[f"{key}/pk"]],
                    [x[j] for x in lat[f"{key}/dyn"]],
                )
            )

    # clearing a replica holding 20,000 blocks
    victim = reps
    clear_pk: list[float] = []
    clear_dyn: list[float] = []
    remove_dyn: list[float] = []
    for rnd in range(args.rounds):
        order = ["pk", "dyn_clear", "dyn_remove"]
        for side in order if rnd % 2 == 0 else order[::-1]:
            if side == "pk":
                for p, c in w.victim_events:
                    index.store(f"r{victim}", c, p or None)
                assert index.match_lengths(w.victim_events[0][1]).get(f"r{victim}")
                assert index.replica_num_blocks(f"r{victim}") == CLEAR_BLOCKS
                t0 = time.perf_counter()
                index.clear(f"r{victim}")
                clear_pk.append(time.perf_counter() - t0)
                assert index.replica_num_blocks(f"r{victim}") == 0
            else:
                for p, c in w.victim_events:
                    tree.apply_event(victim, enc.stored(victim, p, c))
                assert tree.find_matches(w.victim_events[0][1]).scores.get((victim, 0))
                t0 = time.perf_counter()
                if side == "dyn_clear":
                    tree.clear_all_blocks(victim)
                else:
                    tree.remove_worker(victim)
                (clear_dyn if side == "dyn_clear" else remove_dyn).append(time.perf_counter() - t0)
                assert not any(k[0] == victim for k in tree.find_matches(w.queries[0]).scores)
    rows.append(
        Row(
            f"{tag}: clear 20k-block replica (Dynamo clear_all_blocks)",
            "ms",
            [t * 1e3 for t in clear_pk],
            [t * 1e3 for t in clear_dyn],
        )
    )
    rows.append(
        Row(
            f"{tag}: clear 20k-block replica (Dynamo remove_worker)",
            "ms",
            [t * 1e3 for t in clear_pk],
            [t * 1e3 for t in remove_dyn],
        )
    )
    del index, tree
    gc.collect()
    settle()

    if not args.no_memory:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "workload.npz"
            w.save(path)
            pk_mem = measure_memory("pagedkv", path)
            dyn_mem = measure_memory("dynamo", path)
        rows.append(
            Row(
                f"{tag}: RSS growth per indexed pair, fresh process",
                "bytes",
                [] if pk_mem is None else [pk_mem],
                [] if dyn_mem is None else [dyn_mem],
            )
        )
    return rows


# --------------------------------------------------------------------------- main


def _count(text: str) -> int:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(v) or v != int(v):
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(v)


def _int_list(lo: int, hi: int) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        out = [_count(x) for x in text.split(",") if x.strip()]
        if not out:
            raise argparse.ArgumentTypeError("empty list")
        for v in out:
            if not lo <= v <= hi:
                raise argparse.ArgumentTypeError(f"{v} is outside {lo:,}..{hi:,}")
        return out

    return parse


def _bounded(lo: int, hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        v = _count(text)
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is outside {lo:,}..{hi:,}")
        return v

    return parse


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _pin_to_one_cpu() -> str:
    """Pins this process (and the memory subprocesses it starts) to one CPU;
    a note for the header, empty where the platform cannot.

    Dynamo's ``RadixTree`` runs in a thread of its own and every call from
    Python waits for it. With a free CPU the call wakes that thread across
    CPUs, which on a small VM costs several microseconds per call (its apply and
    query times came out 3-5x those pinned); on one CPU it is a switch between
    two threads. pagedkv's index runs in the caller's thread either way.
    """
    if not hasattr(os, "sched_setaffinity"):
        return ""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return ""
    os.sched_setaffinity(0, {cpus[0]})
    return f", pinned to CPU {cpus[0]} (--no-pin to run on all)"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small run: 2e4 pairs, 8 replicas")
    p.add_argument(
        "--sizes",
        type=_int_list(1_000, 50_000_000),
        default=None,
        help="indexed (replica, block) pairs, comma-separated (default 1e5,1e6)",
    )
    p.add_argument(
        "--replicas",
        type=_int_list(1, 4096),
        default=None,
        help="replica counts, comma-separated (default 8,64)",
    )
    p.add_argument("--queries", type=_bounded(10, 1_000_000), default=None)
    p.add_argument("--rounds", type=_bounded(3, 50), default=3, help="interleaved rounds (>= 3)")
    p.add_argument("--seed", type=_bounded(0, 2**31), default=0)
    p.add_argument("--no-memory", action="store_true", help="skip the RSS subprocesses")
    p.add_argument(
        "--no-pin",
        action="store_true",
        help="run on every CPU instead of one (Dynamo then pays a cross-CPU wake-up per call)",
    )
    p.add_argument("--_memory-worker", nargs=2, metavar=("SIDE", "PATH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._memory_worker:
        side, path = args._memory_worker
        if side not in ("pagedkv", "dynamo"):
            p.error(f"unknown side {side!r}")
        memory_worker(side, Path(path))
        return 0

    if args.quick:
        args.sizes = args.sizes or [20_000]
        args.replicas = args.replicas or [8]
        args.queries = args.queries or 200
    args.sizes = args.sizes or [100_000, 1_000_000]
    args.replicas = args.replicas or [8, 64]
    args.queries = args.queries or 2_000
    for size in args.sizes:
        for reps in args.replicas:
            if size < 16 * reps:
                p.error(f"--sizes {size:,} is too small for {reps} replicas (< 16 per replica)")

    pinned = "" if args.no_pin else _pin_to_one_cpu()
    prefix_index, radix_tree = _import_sides()
    from importlib.metadata import PackageNotFoundError, version

    import pagedkv

    try:
        dyn_version = version("ai-dynamo-runtime")
    except PackageNotFoundError:
        dyn_version = "?"
    print(
        f"# pagedkv {getattr(pagedkv, '__version__', '?')} vs ai-dynamo-runtime {dyn_version}; "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs ({_cpu_model()}), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"load average {os.getloadavg()[0]:.2f}{pinned}"
    )
    print(
        f"# sizes {args.sizes}, replicas {args.replicas}, {args.queries} queries, "
        f"{args.rounds} rounds, seed {args.seed}"
    )
    rows: list[Row] = []
    for size in args.sizes:
        for reps in args.replicas:
            rows += run_config(size, reps, args, prefix_index, radix_tree)

    print(
        "\nmin / median over rounds (one figure: measured once); "
        "ratio = pagedkv / Dynamo, of the minima / of the medians (< 1: pagedkv faster or "
        f"smaller); load average at the end {os.getloadavg()[0]:.2f}\n"
    )
    print("| row | unit | pagedkv | Dynamo RadixTree | ratio |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(row.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
