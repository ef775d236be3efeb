"""The per-call cost of the host offload tier against vLLM 0.33's own
``CPUOffloadingManager``, on the same recorded calls, interleaved in one process.

A trace written by ``offload_record_vllm.py`` (vLLM's answers to a long random
serving workload) is replayed on three sides, each round in rotating order,
each side on a fresh manager:

- ``vllm``: vLLM's Python ``CPUOffloadingManager`` (its LRU or ARC policy);
- ``dropin``: ``pagedkv.vllm.CPUOffloadingManager``, the same calls with vLLM's
  request contexts and answer types (what vLLM's connector sees after
  ``pagedkv.vllm.install()``);
- ``native``: ``pagedkv.offload.OffloadTier`` called directly (int requests,
  position lists the caller already holds; the trace's ``set_positions`` are
  folded into the calls);
- ``floor``: the native side's calls made to a function that does nothing (the
  loop's own cost, in every side's figure);
- ``core`` (with ``--core-bin``): the Rust core alone, the same calls made by
  ``benches/examples/offload_replay.rs`` (built with ``cargo build --release -p
  pagedkv-benches --example offload_replay``), run as a subprocess in its turn of
  each round (its figure: the mean of 20 passes on fresh tiers).

Prints µs per manager call (min / median over the rounds) and vLLM's time over
each side's. Needs vLLM for the first two sides (run it with the vLLM
environment's python); without vLLM only ``native`` runs.

    python benches/offload_bench.py TRACE.json[.gz] [TRACE2 ...] --rounds 5
    python benches/offload_bench.py --scale 1000,10000,100000,1000000 --rounds 3
        # the cost per call on a full tier of each size (native API; the same
        # request cycle as the core's bench `offload_{lru,arc}/request/N`)
    python benches/offload_bench.py TRACE --rounds 5 \
        --core-bin target/release/examples/offload_replay   # adds the core's side
    python benches/offload_bench.py TRACE --core-ops OUT.txt   # the calls for the
        # core's replay: PAGEDKV_OFFLOAD_OPS=OUT.txt cargo bench --bench offload
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

from pagedkv.offload import OffloadTier
from pagedkv.offload_trace import load_trace

Call = tuple[Callable[..., Any], tuple[Any, ...]]
SKIP = ("state",)


def _vllm_calls(trace: dict[str, Any], cls: type) -> tuple[Callable[[], list[Call]], int]:
    """A builder of (manager, calls) for a class with vLLM's API."""
    from vllm.v1.kv_offload.base import ReqContext

    c = trace["config"]
    ops = [o for o in trace["ops"] if o["op"] not in SKIP]

    def setpos(ctx: Any, keys: list[bytes], positions: list[int]) -> None:
        for k, p in zip(keys, positions, strict=True):
            ctx.set_offload_key_position(k, p)

    def drain(mgr: Any) -> None:
        list(mgr.take_events())

    def build() -> list[Call]:
        mgr = cls(
            num_chunks=c["num_chunks"],
            cache_policy=c["policy"],
            enable_events=c["enable_events"],
            store_threshold=c["store_threshold"],
            max_tracker_size=c["max_tracker_size"],
        )
        ctxs: dict[int, Any] = {}
        calls: list[Call] = []
        for o in ops:
            req = o.get("req", 0)
            ctx = ctxs.get(req) or ctxs.setdefault(req, ReqContext(req_id=str(req)))
            keys = [bytes.fromhex(h) for h in o.get("keys", ())]
            name = o["op"]
            if name == "new_request":
                calls.append((mgr.on_new_request, (ctx,)))
            elif name == "set_positions":
                calls.append((setpos, (ctx, keys, o["positions"])))
            elif name == "lookup":
                calls.append((mgr.lookup, (bytes.fromhex(o["key"]), ctx)))
            elif name in ("prepare_load", "complete_load", "touch", "prepare_store"):
                calls.append((getattr(mgr, name), (keys, ctx)))
            elif name == "complete_store":
                calls.append((mgr.complete_store, (keys, ctx, o.get("success", True))))
            elif name == "finish":
                calls.append((mgr.on_request_finished, (ctx,)))
            elif name == "reset":
                calls.append((mgr.reset_cache, ()))
            elif name == "events":
                calls.append((drain, (mgr,)))
            elif name == "stats":
                calls.append((mgr.get_stats, ()))
        return calls

    return build, sum(o["op"] != "set_positions" for o in ops)


def _native_calls(trace: dict[str, Any]) -> tuple[Callable[[], list[Call]], int]:
    c = trace["config"]
    ops = [o for o in trace["ops"] if o["op"] not in SKIP]

    def build() -> list[Call]:
        tier = OffloadTier(
            c["num_chunks"],
            c["policy"],
            enable_events=c["enable_events"],
            store_threshold=c["store_threshold"],
            max_tracker_size=c["max_tracker_size"],
        )
        known: dict[int, dict[bytes, int]] = {}
        calls: list[Call] = []
        for o in ops:
            req = o.get("req", 0)
            keys = [bytes.fromhex(h) for h in o.get("keys", ())]
            pos = known.get(req)
            positions = [pos.get(k) for k in keys] if pos else None
            name = o["op"]
            if name == "set_positions":
                known.setdefault(req, {}).update(zip(keys, o["positions"], strict=True))
            elif name == "new_request":
                calls.append((tier.on_new_request, (req,)))
            elif name == "lookup":
                calls.append((tier.lookup, (bytes.fromhex(o["key"]),)))
            elif name in ("prepare_load", "prepare_store"):
                calls.append((getattr(tier, name), (keys, req, positions)))
            elif name in ("complete_load", "touch"):
                calls.append((getattr(tier, name), (keys,)))
            elif name == "complete_store":
                calls.append((tier.complete_store, (keys, o.get("success", True))))
            elif name == "finish":
                p = known.get(req, {})
                calls.append((tier.on_request_finished, (req, list(p), list(p.values()))))
            elif name == "reset":
                calls.append((tier.reset_cache, ()))
            elif name == "events":
                calls.append((tier.take_events, ()))
            elif name == "stats":
                calls.append((tier.stats, ()))
        return calls

    return build, sum(o["op"] != "set_positions" for o in ops)


def _noop(*args: Any) -> None:
    return None


def _floor(build: Callable[[], list[Call]]) -> Callable[[], list[Call]]:
    """The same calls, each to a function that does nothing: the harness's own cost."""
    return lambda: [(_noop, args) for _, args in build()]


def _run(calls: list[Call]) -> int:
    # The prebuilt calls hold many objects: a collection would walk them all
    # and charge the call it lands in; the sides run without one.
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        for fn, args in calls:
            fn(*args)
        return time.perf_counter_ns() - t0
    finally:
        gc.enable()


PREFIX, TAIL, CALLS = 8, 4, 7


def _key(n: int) -> bytes:
    return n.to_bytes(32, "little") + b"\x00\x00\x00\x00"


def scale(sizes: list[int], rounds: int, requests: int) -> None:
    """A steady cycle on a full tier: a request finds a recent prefix, loads its
    hits, stores a new tail (evicting), ends; seven calls a request."""
    import random

    print(f"{CALLS} calls a request ({PREFIX} chunks found, {TAIL} stored), {requests} requests")
    for policy in ("lru", "arc"):
        base = None
        for n in sizes:
            tier = OffloadTier(n, policy)
            recent = []
            for start in range(0, n, PREFIX):
                keys = [_key(i) for i in range(start, min(start + PREFIX, n))]
                tier.prepare_store(keys, 0)
                tier.complete_store(keys)
                recent.append(keys)
            recent = recent[-1024:]
            rng = random.Random(7)
            next_key, req = n, 1
            figures = []
            for _ in range(rounds):
                work = []
                for _ in range(requests):
                    pick = rng.randrange(len(recent))
                    tail = [_key(i) for i in range(next_key, next_key + TAIL)]
                    next_key += TAIL
                    positions = [16 * (PREFIX + i + 1) for i in range(TAIL)]
                    work.append((req, recent[pick], tail, positions))
                    recent[pick] = tail
                    req += 1
                gc.collect()
                gc.disable()
                t0 = time.perf_counter_ns()
                for r, prefix, tail, positions in work:
                    tier.on_new_request(r)
                    hit = tier.lookup_prefix(prefix)
                    tier.prepare_load(prefix[:hit], r)
                    tier.complete_load(prefix[:hit])
                    if tier.prepare_store(tail, r, positions) is not None:
                        tier.complete_store(tail)
                    tier.on_request_finished(r)
                    tier.forget_request(r)
                figures.append((time.perf_counter_ns() - t0) / 1000 / requests / CALLS)
                gc.enable()
            lo, med = min(figures), statistics.median(figures)
            base = base or med
            print(
                f"  {policy} {n:>9,} chunks: {lo:6.3f} / {med:6.3f} µs per call"
                f"  (x{med / base:4.2f} of the smallest, median)"
            )


def _core_side(trace: dict[str, Any], binary: str, ops_path: str) -> Callable[[], float]:
    """One round of the core's replay in a subprocess: µs per call."""
    from pagedkv.offload_trace import core_ops

    with open(ops_path, "w") as f:
        f.write(core_ops(trace))

    def measure() -> float:
        out = subprocess.run(
            [binary, ops_path, "20"], capture_output=True, text=True, check=True, timeout=600
        )
        return float(out.stdout.strip())

    return measure


def bench(path: str, rounds: int, core_bin: str | None = None) -> None:
    trace = load_trace(path)
    with tempfile.TemporaryDirectory() as tmp:
        core = _core_side(trace, core_bin, f"{tmp}/ops.txt") if core_bin else None
        _bench(path, trace, rounds, core)


def _bench(path: str, trace: dict[str, Any], rounds: int, core: Callable[[], float] | None) -> None:
    sides: dict[str, tuple[Callable[[], list[Call]], int]] = {}
    try:
        from pagedkv.vllm.offload import VLLM_CPU_OFFLOADING_MANAGER, CPUOffloadingManager

        sides["vllm"] = _vllm_calls(trace, VLLM_CPU_OFFLOADING_MANAGER)
        sides["dropin"] = _vllm_calls(trace, CPUOffloadingManager)
    except ImportError:
        pass
    sides["native"] = _native_calls(trace)
    sides["floor"] = (_floor(sides["native"][0]), sides["native"][1])
    names = list(sides) + (["core"] if core else [])
    per_call: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name == "core" and core is not None:
                per_call[name].append(core())
                continue
            build, n = sides[name]
            calls = build()
            per_call[name].append(_run(calls) / 1000 / n)
    c = trace["config"]
    print(
        f"{path}: {c['policy']}, {c['num_chunks']} chunks, store_threshold "
        f"{c['store_threshold']}, {sides['native'][1]} calls, {rounds} rounds"
    )
    base = per_call.get("vllm")
    for name in names:
        v = per_call[name]
        line = f"  {name:7} {min(v):7.3f} / {statistics.median(v):7.3f} µs per call"
        if base is not None and name not in ("vllm", "floor"):
            line += (
                f"   vLLM / this: {min(base) / min(v):5.1f}x (min) "
                f"{statistics.median(base) / statistics.median(v):5.1f}x (median)"
            )
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("traces", nargs="*")
    ap.add_argument("--scale", help="tier sizes in chunks, comma-separated (no trace needed)")
    ap.add_argument("--requests", type=int, default=20_000, help="requests a round (--scale)")
    ap.add_argument("--rounds", type=int, default=5, choices=range(1, 101), metavar="1..100")
    ap.add_argument("--core-ops", help="write the (first) trace's calls for the core's replay")
    ap.add_argument("--core-bin", help="the built offload_replay example: adds the core's side")
    args = ap.parse_args()
    if args.core_ops:
        from pagedkv.offload_trace import core_ops

        if not args.traces:
            ap.error("--core-ops needs a trace")
        try:
            text = core_ops(load_trace(args.traces[0]))
            with open(args.core_ops, "x") as f:  # a new file only
                f.write(text)
        except (OSError, ValueError) as e:
            ap.error(f"--core-ops: {e}")
        return
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}")
    if args.scale:
        try:
            sizes = [int(x) for x in args.scale.split(",")]
        except ValueError:
            ap.error(f"--scale: comma-separated integers, got {args.scale!r}")
        if not all(0 < n <= 1 << 26 for n in sizes) or not 0 < args.requests <= 10**7:
            ap.error("--scale sizes must be in 1..2**26, --requests in 1..10**7")
        scale(sizes, args.rounds, args.requests)
    for path in args.traces:
        bench(path, args.rounds, args.core_bin)


if __name__ == "__main__":
    main()
