"""``pagedkv simulate --engine vllm``: the same simulation over vLLM's own
``KVCacheManager`` (vLLM 0.33, ``vllm.v1.core.kv_cache_manager``).

The scheduler is the one policy of :mod:`pagedkv.sim.policy`; :class:`VllmBackend`
adapts it to vLLM's manager API: one manager call per request, on vLLM's own
``Request`` objects, as vLLM's scheduler calls its manager. ``alloc_checksum``
(FNV-1a-64 over every ``allocate_slots`` result) is computed the same way as for
pagedkv's manager, so equal checksums mean both managers handed out the same
block ids.

This module imports only the standard library, the policy (itself standard
library only) and, when it runs, vLLM. It runs either in the current interpreter
(when vLLM is importable there) or as a script under another interpreter that
has vLLM but need not have pagedkv (``--vllm-python PATH``): it then reads a JSON
payload (manager, scheduler, requests) from the file named on its command line
and prints one JSON result on stdout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

__all__ = ["VllmBackend", "check_result", "run", "vllm_available"]

#: how the script reports progress on stderr: ``PREFIX STEP FINISHED``
PROGRESS_PREFIX = "pagedkv-progress"

SUPPORTED_SPECS = (
    "full_attention",
    "sliding_window",
    "chunked_local_attention",
    "mla_attention",
    "mamba",
)


#: What a result must hold: key -> kind (``count``: an int >= 0, ``number``: a
#: finite int or float >= 0, ``text``: a string).
RESULT_FIELDS = {
    "version": "text",
    "import_s": "number",
    "steps": "count",
    "finished": "count",
    "preemptions": "count",
    "admissions": "count",
    "hit_tokens": "count",
    "query_tokens": "count",
    "first_hit_tokens": "count",
    "first_query_tokens": "count",
    "peak_running": "count",
    "peak_usage": "number",
    "mean_usage": "number",
    "free_blocks_at_end": "count",
    "usable_blocks": "count",
    "manager_ns": "count",
    "manager_calls": "count",
    "alloc_checksum": "text",
    "wall_s": "number",
}
_TIMING_FIGURES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_ms", "throughput")


def _finite_tree(v: Any, where: str, depth: int = 0) -> None:
    """Numbers (finite), None, strings, lists and objects of them, 8 levels deep."""
    if depth > 8:
        raise ValueError(f"{where}: nested too deeply")
    if v is None or isinstance(v, str | bool):
        return
    if isinstance(v, int | float):
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError(f"{where}: {v} is not a finite number")
        return
    if isinstance(v, list):
        for i, x in enumerate(v):
            _finite_tree(x, f"{where}[{i}]", depth + 1)
        return
    if isinstance(v, dict):
        for k, x in v.items():
            _finite_tree(x, f"{where}.{k}", depth + 1)
        return
    raise ValueError(f"{where}: unexpected {type(v).__name__}")


def check_result(out: Any) -> dict[str, Any]:
    """``out`` if it is a result of :func:`run` (every field of
    ``RESULT_FIELDS`` of its kind, ``per_api`` of ``[calls, ns]`` pairs, a
    16-digit hex ``alloc_checksum``, ``timing`` with its figures, all finite);
    ``ValueError`` naming the first field that is not."""
    if not isinstance(out, dict):
        raise ValueError(f"a JSON object was expected, got {type(out).__name__}")
    for key, kind in RESULT_FIELDS.items():
        if key not in out:
            raise ValueError(f"missing {key!r}")
        v = out[key]
        ok = (
            isinstance(v, str)
            if kind == "text"
            else not isinstance(v, bool)
            and isinstance(v, int if kind == "count" else int | float)
            and 0 <= v < float("inf")
        )
        if not ok:
            raise ValueError(
                f"{key!r} must be {'a string' if kind == 'text' else f'a {kind} >= 0'}, got {v!r}"
            )
    checksum = out["alloc_checksum"]
    if len(checksum) != 16 or any(c not in "0123456789abcdef" for c in checksum):
        raise ValueError(f"'alloc_checksum' must be 16 hex digits, got {checksum!r}")
    per_api = out.get("per_api")
    if not isinstance(per_api, dict) or not all(
        isinstance(k, str)
        and isinstance(v, list)
        and len(v) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
        for k, v in per_api.items()
    ):
        raise ValueError("'per_api' must map each API to [calls, ns]")
    timing = out.get("timing")
    if not isinstance(timing, dict) or any(k not in timing for k in _TIMING_FIGURES):
        raise ValueError(f"'timing' must hold {', '.join(_TIMING_FIGURES)}")
    _finite_tree(timing, "timing")
    return out


def vllm_available() -> bool:
    """Whether ``import vllm`` would find vLLM in this interpreter."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # pragma: no cover - broken installs
        return False


def _import_policy() -> ModuleType:
    """:mod:`pagedkv.sim.policy`. Run as a script, in an interpreter that need not
    have pagedkv, the same file is imported from the files around this one under a
    private package name (the package ``__init__`` files, which need pagedkv's
    compiled core, do not run, and an installed pagedkv is left alone)."""
    if __package__:
        from . import policy

        return policy
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name, path in (("_pagedkv_src", root), ("_pagedkv_src.sim", os.path.join(root, "sim"))):
        if name not in sys.modules:
            pkg = ModuleType(name)
            pkg.__path__ = [path]
            sys.modules[name] = pkg
    return importlib.import_module("_pagedkv_src.sim.policy")


if TYPE_CHECKING:
    from . import policy, steptime
else:
    policy = _import_policy()
    steptime = sys.modules[policy.__name__.rpartition(".")[0] + ".steptime"]


class VllmBackend(policy.Backend[policy.Request]):
    """The policy's calls on vLLM's ``KVCacheManager``.

    Each policy request's ``handle`` is the vLLM ``Request`` that ``make_request``
    builds when it arrives (vLLM hashes its prompt blocks then). The adapter keeps
    vLLM's request in step with the policy's: ``num_computed_tokens`` before each
    manager call, the sampled output tokens, ``status`` and ``num_preemptions``.
    ``status`` is vLLM's ``RequestStatus``.
    """

    def __init__(self, kv: Any, make_request: Callable[[policy.Request], Any], status: Any) -> None:
        super().__init__()
        self.kv = kv
        self.make_request = make_request
        self.status = status
        self._clock = time.perf_counter_ns
        self._hit: Any = None

    def _timed_free(self, req: policy.Request, api: str) -> None:
        t = self._clock()
        self.kv.free(req.handle)
        self.stats.timed(api, self._clock() - t)

    def _feed(self, res: Any) -> None:
        self.stats.feed_allocation(None if res is None else res.get_block_ids())

    def add_request(self, req: policy.Request) -> None:
        req.handle = self.make_request(req)

    def new_step(self) -> None:
        t = self._clock()
        self.kv.new_step_starts()
        self.stats.timed("new_step_starts", self._clock() - t)

    def allocate(self, reqs: Sequence[policy.Request], num_new_tokens: Sequence[int]) -> int:
        st, kv, clock = self.stats, self.kv, self._clock
        for i, (r, n) in enumerate(zip(reqs, num_new_tokens, strict=True)):
            vreq = r.handle
            vreq.num_computed_tokens = r.num_computed_tokens
            t = clock()
            res = kv.allocate_slots(vreq, n)
            st.timed("allocate_slots", clock() - t)
            self._feed(res)
            if res is None:
                return i
        return len(reqs)

    def lookup(self, req: policy.Request) -> int:
        vreq = req.handle
        t = self._clock()
        self._hit, num_hit, vreq.shared_prefix_boundary = self.kv.get_computed_blocks(vreq)
        self.stats.timed("get_computed_blocks", self._clock() - t)
        req.shared_prefix_boundary = int(vreq.shared_prefix_boundary)
        return int(num_hit)

    def admit(
        self,
        req: policy.Request,
        num_new_tokens: int,
        num_hit_tokens: int,
        *,
        full_sequence_must_fit: bool,
        has_scheduled_reqs: bool,
    ) -> bool:
        vreq = req.handle
        blocks, self._hit = self._hit, None
        t = self._clock()
        res = self.kv.allocate_slots(
            vreq,
            num_new_tokens,
            num_hit_tokens,
            blocks,
            full_sequence_must_fit=full_sequence_must_fit,
            has_scheduled_reqs=has_scheduled_reqs,
        )
        self.stats.timed("allocate_slots(admit)", self._clock() - t)
        self._feed(res)
        if res is None:
            return False
        vreq.status = self.status.RUNNING
        return True

    def preempt(self, req: policy.Request) -> int:
        self._timed_free(req, "free(preempt)")
        vreq = req.handle
        vreq.status = self.status.PREEMPTED
        vreq.num_computed_tokens = 0
        vreq.num_preemptions += 1
        return 0

    def append_tokens(self, reqs: Sequence[policy.Request], tokens: Sequence[int]) -> None:
        for r, token in zip(reqs, tokens, strict=True):
            vreq = r.handle
            vreq.num_computed_tokens = r.num_computed_tokens
            vreq.append_output_token_ids(token)

    def finish(self, req: policy.Request) -> None:
        req.handle.status = self.status.FINISHED_LENGTH_CAPPED
        self._timed_free(req, "free(finished)")


def _request(rec: dict[str, Any]) -> policy.Request:
    """A payload record (see ``pagedkv.sim.runner.vllm_payload``) as a policy request."""
    lora = rec.get("lora")
    return policy.Request(
        rec["id"],
        rec["prompt"],
        rec["output"],
        arrival_step=rec["arrival_step"],
        session=rec.get("session"),
        pause=rec.get("pause", 0),
        arrival_s=rec.get("arrival_s"),
        pause_s=rec.get("pause_s"),
        cache_salt=rec.get("salt"),
        lora_name=None if lora is None else str(lora[0]),
        lora_path=None if lora is None else str(lora[2]),
    )


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
    from vllm.v1.request import Request as VllmRequest  # type: ignore[import-not-found, unused-ignore]
    from vllm.v1.request import RequestStatus  # type: ignore[import-not-found, unused-ignore]

    import_s = time.perf_counter() - t_import
    m = payload["manager"]
    groups = []
    for g in m["groups"]:
        if g["kind"] == "mamba":
            mamba = ki.MambaSpec(
                block_size=g["block_size"],
                shapes=tuple(tuple(x) for x in g["shapes"]),
                dtypes=tuple(_dtype(torch, d) for d in g["dtypes"]),
                page_size_padded=g["page_size_padded"],
                mamba_cache_mode=g["mamba_cache_mode"],
                num_speculative_blocks=g["num_speculative_blocks"],
            )
            groups.append(ki.KVCacheGroupSpec(g["layer_names"], mamba))
            continue
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
    items = [_request(rec) for rec in payload["requests"]]
    lora_ids = {
        str(rec["lora"][0]): int(rec["lora"][1])
        for rec in payload["requests"]
        if rec.get("lora") is not None
    }
    params: dict[int, Any] = {}
    clock = time.perf_counter_ns

    def hasher(req: Any) -> Any:
        t = clock()
        out = base_hasher(req)
        st.timed("block_hashing", clock() - t)
        return out

    def make(req: policy.Request) -> Any:
        """vLLM's request for a policy request (its prompt blocks get hashed)."""
        sp = params.get(req.max_tokens)
        if sp is None:
            sp = params[req.max_tokens] = SamplingParams(max_tokens=req.max_tokens)
        lora = None
        if req.lora_name is not None:
            lora = LoRARequest(req.lora_name, lora_ids[req.lora_name], req.lora_path or "")
        return VllmRequest(
            req.request_id,
            list(req.prompt),
            sp,
            None,
            lora_request=lora,
            cache_salt=req.cache_salt,
            block_hasher=hasher,
        )

    sched = policy.Scheduler(
        VllmBackend(kv, make, RequestStatus), policy.SchedulerConfig(**payload["scheduler"])
    )
    st = sched.stats

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
    timed: dict[str, Any] | None = payload.get("clock")
    timing: dict[str, Any] = {}
    if timed is None:
        policy.drive(sched, items, on_step=step_hook)
    else:
        lat = steptime.Latencies()
        policy.drive_timed(
            sched,
            items,
            steptime.model_from_dict(timed["model"]),
            tick_s=timed["tick_s"],
            on_step=lambda t, n: step_hook(sched.stats.steps, n),
            latencies=lat,
            max_concurrency=timed.get("max_concurrency"),
        )
        timing = steptime.summarize(lat, **timed.get("slo", {}))
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
        "timing": timing,
    }


def main(argv: list[str] | None = None) -> int:
    """``python vllm_engine.py PAYLOAD.json``: prints the result as one JSON line."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: vllm_engine.py PAYLOAD.json", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as f:
        payload = json.load(f)
    last = [0.0]

    def report(step: int, finished: int) -> None:
        # At most ten lines a second, read by the parent's progress bar.
        now = time.monotonic()
        if now - last[0] >= 0.1:
            last[0] = now
            print(f"{PROGRESS_PREFIX} {step} {finished}", file=sys.stderr, flush=True)

    result = run(payload, report)
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
