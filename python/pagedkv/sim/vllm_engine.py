"""``pagedkv simulate --engine vllm``: the same simulation over vLLM's own
``KVCacheManager`` (vLLM 0.33, ``vllm.v1.core.kv_cache_manager``).

This module imports only the standard library and, when it runs, vLLM. It runs
either in the current interpreter (when vLLM is importable there) or as a script
under another interpreter that has vLLM (``--vllm-python PATH``): it then reads a
JSON payload (manager, scheduler, requests) from the file named on its command
line and prints one JSON result on stdout. Its scheduler makes the same
decisions as :class:`pagedkv.scheduler.Scheduler` (FCFS, chunked prefill under a
token budget, preemption by recompute), one manager call per request, as vLLM's
scheduler calls its manager; ``alloc_checksum`` (FNV-1a-64 over every
``allocate_slots`` result) is computed the same way, so equal checksums mean
both managers handed out the same block ids.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["run", "vllm_available"]

SUPPORTED_SPECS = ("full_attention", "sliding_window", "chunked_local_attention", "mla_attention")


def vllm_available() -> bool:
    """Whether ``import vllm`` would find vLLM in this interpreter."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # pragma: no cover - broken installs
        return False


def _load_by_path(name: str, *relpath: str) -> ModuleType:
    """Loads a pagedkv file relative to this one, when this runs as a script."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), *relpath)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _load_loop() -> ModuleType:
    try:
        from . import _loop

        return _loop
    except ImportError:  # run as a script: load the sibling file by path
        return _load_by_path("pagedkv_sim_loop", "_loop.py")


try:
    from .._util import FNV_OFFSET_BASIS, MASK64, fnv1a64
except ImportError:  # run as a script: load pagedkv/_util.py by path
    _util = _load_by_path("pagedkv_util", os.pardir, "_util.py")
    FNV_OFFSET_BASIS, MASK64, fnv1a64 = _util.FNV_OFFSET_BASIS, _util.MASK64, _util.fnv1a64


class _Item:
    __slots__ = (
        "arrival_step",
        "cache_salt",
        "lora",
        "output",
        "pause",
        "prompt",
        "request_id",
        "session",
    )

    def __init__(self, rec: dict[str, Any]) -> None:
        self.request_id: str = rec["id"]
        self.prompt: list[int] = rec["prompt"]
        self.output: list[int] = rec["output"]
        self.arrival_step: int = rec["arrival_step"]
        self.session: str | None = rec.get("session")
        self.pause: int = rec.get("pause", 0)
        self.cache_salt: str | None = rec.get("salt")
        lora = rec.get("lora")
        self.lora: tuple[str, int, str] | None = (
            None if lora is None else (str(lora[0]), int(lora[1]), str(lora[2]))
        )


class _Req:
    """A vLLM ``Request`` plus the output tokens it will sample."""

    __slots__ = ("output", "req", "request_id")

    def __init__(self, req: Any, output: list[int]) -> None:
        self.req = req
        self.request_id: str = req.request_id
        self.output = output


class _Stats:
    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.alloc_checksum = FNV_OFFSET_BASIS
        self.steps = self.preemptions = self.admissions = self.finished = 0
        self.hit_tokens = self.query_tokens = self.peak_running = 0
        self.first_hit_tokens = self.first_query_tokens = 0

    def timed(self, api: str, ns: int) -> None:
        self.ns[api] = self.ns.get(api, 0) + ns
        self.calls[api] = self.calls.get(api, 0) + 1

    def feed(self, words: list[int]) -> None:
        self.alloc_checksum = fnv1a64(words, self.alloc_checksum)


class _VllmScheduler:
    """pagedkv.scheduler.Scheduler's loop, calling vLLM's manager per request."""

    def __init__(self, kv: Any, sched: dict[str, Any], status: Any) -> None:
        self.kv = kv
        self.max_num_seqs: int = sched["max_num_seqs"]
        self.budget0: int = sched["max_num_batched_tokens"]
        self.must_fit: bool = sched["full_sequence_must_fit"]
        self.hits_computed: bool = sched.get("hits_count_as_computed", True)
        self.status = status
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.st = _Stats()
        self.clock = time.perf_counter_ns

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, r: _Req) -> None:
        self.waiting.append(r)

    def _feed(self, res: Any) -> None:
        if res is None:
            self.st.feed([MASK64])
            return
        ids = res.get_block_ids()
        words = [len(ids)]
        for g in ids:
            words.append(len(g))
            words.extend(g)
        self.st.feed(words)

    def _free(self, r: _Req, api: str) -> None:
        t = self.clock()
        self.kv.free(r.req)
        self.st.timed(api, self.clock() - t)

    def step(self) -> list[_Req]:
        st, kv, clock = self.st, self.kv, self.clock
        t = clock()
        kv.new_step_starts()
        st.timed("new_step_starts", clock() - t)
        budget = self.budget0
        scheduled: list[tuple[_Req, int]] = []
        preempted = False
        ri = 0
        while ri < len(self.running) and budget > 0:
            r = self.running[ri]
            n = min(r.req.num_tokens - r.req.num_computed_tokens, budget)
            while True:
                t = clock()
                res = kv.allocate_slots(r.req, n)
                st.timed("allocate_slots", clock() - t)
                self._feed(res)
                if res is not None:
                    break
                victim = self.running.pop()
                self._free(victim, "free(preempt)")
                victim.req.status = self.status.PREEMPTED
                victim.req.num_computed_tokens = 0
                victim.req.num_preemptions += 1
                self.waiting.appendleft(victim)
                st.preemptions += 1
                preempted = True
                if victim is r:
                    break
            if res is None:
                break
            scheduled.append((r, n))
            budget -= n
            ri += 1
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                r = self.waiting[0]
                t = clock()
                blocks, num_hit, r.req.shared_prefix_boundary = kv.get_computed_blocks(r.req)
                st.timed("get_computed_blocks", clock() - t)
                n = min(r.req.num_tokens - num_hit, budget)
                t = clock()
                res = kv.allocate_slots(
                    r.req,
                    n,
                    num_hit,
                    blocks,
                    full_sequence_must_fit=self.must_fit,
                    has_scheduled_reqs=bool(self.running),
                )
                st.timed("allocate_slots(admit)", clock() - t)
                self._feed(res)
                if res is None:
                    if not self.running:
                        raise RuntimeError(f"request {r.request_id} can never be admitted")
                    break
                self.waiting.popleft()
                r.req.status = self.status.RUNNING
                if self.hits_computed:
                    r.req.num_computed_tokens = num_hit
                self.running.append(r)
                st.admissions += 1
                st.hit_tokens += num_hit
                st.query_tokens += r.req.num_tokens
                if r.req.num_preemptions == 0:
                    st.first_hit_tokens += num_hit
                    st.first_query_tokens += r.req.num_tokens
                scheduled.append((r, n))
                budget -= n
        st.peak_running = max(st.peak_running, len(self.running))
        done: list[_Req] = []
        for r, n in scheduled:
            req = r.req
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token_ids(r.output[req.num_output_tokens])
                if req.num_output_tokens >= len(r.output):
                    done.append(r)
        for r in done:
            r.req.status = self.status.FINISHED_LENGTH_CAPPED
            self._free(r, "free(finished)")
            st.finished += 1
        if done:
            gone = set(map(id, done))
            self.running = [r for r in self.running if id(r) not in gone]
        st.steps += 1
        return done


def _dtype(torch: Any, name: str) -> Any:
    return {
        "fp8": torch.float8_e4m3fn,
        "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2,
    }.get(name) or getattr(torch, name, torch.bfloat16)


def run(
    payload: dict[str, Any], on_step: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """Runs the payload's requests through vLLM's manager; returns the figures."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    t_import = time.perf_counter()
    import torch  # type: ignore[import-not-found, unused-ignore]
    import vllm  # type: ignore[import-not-found, unused-ignore]
    from vllm.lora.request import LoRARequest  # type: ignore[import-not-found, unused-ignore]
    from vllm.sampling_params import SamplingParams  # type: ignore[import-not-found, unused-ignore]
    from vllm.utils.hashing import get_hash_fn_by_name  # type: ignore[import-not-found, unused-ignore]
    from vllm.v1 import kv_cache_interface as ki  # type: ignore[import-not-found, unused-ignore]
    from vllm.v1.core.kv_cache_manager import KVCacheManager  # type: ignore[import-not-found, unused-ignore]
    from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found, unused-ignore]
        get_request_block_hasher,
        init_none_hash,
    )
    from vllm.v1.request import Request, RequestStatus  # type: ignore[import-not-found, unused-ignore]

    import_s = time.perf_counter() - t_import
    m = payload["manager"]
    groups = []
    for g in m["groups"]:
        kw = {
            "block_size": g["block_size"],
            "num_kv_heads": g["num_kv_heads"],
            "head_size": g["head_size"],
            "dtype": _dtype(torch, g["dtype"]),
        }
        kind = g["kind"]
        if kind == "full_attention":
            spec = ki.FullAttentionSpec(**kw)
        elif kind == "mla_attention":
            spec = ki.MLAAttentionSpec(**kw)
        elif kind == "sliding_window":
            spec = ki.SlidingWindowSpec(sliding_window=g["sliding_window"], **kw)
        elif kind == "chunked_local_attention":
            spec = ki.ChunkedLocalAttentionSpec(
                attention_chunk_size=g["attention_chunk_size"], **kw
            )
        else:
            raise ValueError(f"vLLM engine: unsupported KV-cache spec {kind!r}")
        groups.append(ki.KVCacheGroupSpec(g["layer_names"], spec))
    bs = m["block_size"]
    config = ki.KVCacheConfig(
        num_blocks=m["num_blocks"],
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=m["prefix_cache_retention_interval"],
        hash_block_size=bs,
        cache_hit_alignment_tokens=bs,
    )
    kv = KVCacheManager(
        config,
        max_model_len=m["max_model_len"],
        scheduler_block_size=bs,
        hash_block_size=bs,
        max_in_flight_tokens=m["max_in_flight_tokens"],
        enable_caching=m["enable_caching"],
    )
    hash_fn = get_hash_fn_by_name(m["hash_algo"])
    init_none_hash(hash_fn)
    base_hasher = get_request_block_hasher(bs, hash_fn)
    sched = _VllmScheduler(kv, payload["scheduler"], RequestStatus)
    st, clock = sched.st, time.perf_counter_ns

    def hasher(req: Any) -> Any:
        t = clock()
        out = base_hasher(req)
        st.timed("block_hashing", clock() - t)
        return out

    items = [_Item(rec) for rec in payload["requests"]]
    params: dict[int, Any] = {}

    def make(i: int) -> _Req:
        it = items[i]
        sp = params.get(len(it.output))
        if sp is None:
            sp = params[len(it.output)] = SamplingParams(max_tokens=len(it.output))
        lora = None if it.lora is None else LoRARequest(it.lora[0], it.lora[1], it.lora[2])
        req = Request(
            it.request_id,
            it.prompt,
            sp,
            None,
            lora_request=lora,
            cache_salt=it.cache_salt,
            block_hasher=hasher,
        )
        return _Req(req, it.output)

    usage_sum = 0.0
    peak_usage = 0.0

    def step_hook(clock_now: int, finished: int) -> None:
        nonlocal usage_sum, peak_usage
        u = kv.usage
        usage_sum += u
        peak_usage = max(peak_usage, u)
        if on_step is not None:
            on_step(clock_now, finished)

    t0 = time.perf_counter()
    _load_loop().drive(sched, items, make, step_hook)
    wall = time.perf_counter() - t0
    usable = m["num_blocks"] - 1
    free_end = kv.block_pool.get_num_free_blocks()
    appended = sum(len(it.output) for it in items)
    calls = sum(v for k, v in st.calls.items() if k != "block_hashing") + len(items) + appended
    return {
        "engine": "vllm",
        "version": vllm.__version__,
        "import_s": round(import_s, 2),
        "steps": st.steps,
        "finished": st.finished,
        "preemptions": st.preemptions,
        "admissions": st.admissions,
        "hit_tokens": st.hit_tokens,
        "query_tokens": st.query_tokens,
        "first_hit_tokens": st.first_hit_tokens,
        "first_query_tokens": st.first_query_tokens,
        "peak_running": st.peak_running,
        "peak_usage": peak_usage,
        "mean_usage": usage_sum / st.steps if st.steps else 0.0,
        "free_blocks_at_end": free_end,
        "usable_blocks": usable,
        "manager_ns": sum(st.ns.values()),
        "manager_calls": calls,
        "per_api": {k: [st.calls[k], st.ns[k]] for k in sorted(st.ns)},
        "alloc_checksum": f"{st.alloc_checksum:016x}",
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    """``python vllm_engine.py PAYLOAD.json``: prints the result as one JSON line."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: vllm_engine.py PAYLOAD.json", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as f:
        payload = json.load(f)
    result = run(payload)
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
