"""Replays an operation dump recorded from vLLM's own KV-cache manager and checks
every result against pagedkv (format "vllm-oracle-ops" v1: one JSON object per
manager call, with the result vLLM returned).

>>> report = replay_dump("ops_small.jsonl.gz")   # doctest: +SKIP
>>> report.mismatches
0
"""

from __future__ import annotations

import gzip
import json
import time
from dataclasses import dataclass, field
from typing import Any

from ..manager import KVCacheManager
from ..specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from .trace import TraceConfig, generate

__all__ = ["ReplayReport", "harness_floor", "manager_for_dump", "replay_dump"]


@dataclass
class ReplayReport:
    ops: int = 0
    mismatches: int = 0
    free_blocks_at_end: int = 0
    expected_ops: int | None = None
    expected_free_blocks_at_end: int | None = None
    manager_seconds: float = 0.0
    first_mismatches: list[str] = field(default_factory=list)
    #: per manager API: [calls, nanoseconds inside the call]
    per_api: dict[str, list[int]] = field(default_factory=dict)

    def _time(self, api: str, ns: int) -> None:
        entry = self.per_api.setdefault(api, [0, 0])
        entry[0] += 1
        entry[1] += ns

    @property
    def ok(self) -> bool:
        return (
            self.mismatches == 0
            and self.ops == self.expected_ops
            and self.free_blocks_at_end == self.expected_free_blocks_at_end
        )


def manager_for_dump(header: dict[str, Any]) -> KVCacheManager:
    """A manager configured like the one the dump was recorded from."""
    m, s = header["manager"], header["scheduler"]
    kw: dict[str, Any] = dict(
        block_size=m["block_size"], num_kv_heads=8, head_size=128, dtype="bfloat16"
    )
    groups = [KVCacheGroupSpec(["layers.0.attn"], FullAttentionSpec(**kw))]
    if m.get("hybrid"):
        groups.append(
            KVCacheGroupSpec(
                ["layers.1.attn"], SlidingWindowSpec(sliding_window=m["sliding_window"], **kw)
            )
        )
    config = KVCacheConfig(num_blocks=m["num_blocks"], kv_cache_groups=groups)
    return KVCacheManager(
        config,
        max_model_len=m["max_model_len"],
        enable_caching=m["enable_caching"],
        hash_algo=m["hash"],
        watermark=s["watermark"],
        max_in_flight_tokens=s["max_num_batched_tokens"],
        prefix_cache_retention_interval=m["prefix_cache_retention_interval"],
    )


def _ids(groups: Any) -> list[list[int]]:
    return [[int(b) for b in g] for g in groups]


def replay_dump(path: str, max_reported: int = 5) -> ReplayReport:
    """Re-issues every call of the dump against a fresh pagedkv manager and counts
    results that differ from vLLM's."""
    opener: Any = gzip.open if path.endswith(".gz") else open
    rep = ReplayReport()
    with opener(path, "rt") as f:
        header = json.loads(f.readline())
        trace = generate(TraceConfig(**header["trace_config"]))
        kv = manager_for_dump(header)
        known: dict[int, int] = {}
        last_hit: dict[int, Any] = {}
        clock = time.perf_counter_ns

        def ensure(i: int, num_tokens: int) -> str:
            r = trace.requests[i]
            if i not in known:
                kv.add_request(r.req_id, trace.prompt(i))
                known[i] = r.prompt_len
            if known[i] < num_tokens:
                kv.append_token_ids(
                    r.req_id, r.output[known[i] - r.prompt_len : num_tokens - r.prompt_len]
                )
                known[i] = num_tokens
            return r.req_id

        def check(rec: dict[str, Any], got: Any) -> None:
            if got != rec["result"]:
                rep.mismatches += 1
                if len(rep.first_mismatches) < max_reported:
                    rep.first_mismatches.append(
                        f"op #{rep.ops}: {json.dumps(rec)[:200]} -> got {json.dumps(got)[:200]}"
                    )

        for line in f:
            rec = json.loads(line)
            op = rec["op"]
            if op == "summary":
                rep.expected_ops = rec["manager_calls"]
                rep.expected_free_blocks_at_end = rec["free_blocks_at_end"]
                break
            rep.ops += 1
            api = _api(rec)
            if op == "new_step":
                t = clock()
                kv.new_step_starts()
                rep._time(api, clock() - t)
            elif op == "get_computed_blocks":
                rid = ensure(rec["req"], rec["num_tokens"])
                t = clock()
                hit = kv.get_computed_blocks(rid)
                rep._time(api, clock() - t)
                last_hit[rec["req"]] = hit
                check(
                    rec,
                    {
                        "num_computed_tokens": hit.num_computed_tokens,
                        "shared_prefix_boundary": hit.shared_prefix_boundary,
                        "block_ids": _ids(hit.block_ids),
                    },
                )
            elif op == "allocate_slots":
                rid = ensure(rec["req"], rec["num_tokens"])
                t = clock()
                if "num_new_computed_tokens" in rec:
                    res = kv.allocate_slots(
                        rid,
                        rec["num_new_tokens"],
                        num_computed_tokens=rec["num_computed_tokens"],
                        num_new_computed_tokens=rec["num_new_computed_tokens"],
                        new_computed_blocks=last_hit.pop(rec["req"]),
                        full_sequence_must_fit=rec["full_sequence_must_fit"],
                        has_scheduled_reqs=rec["has_scheduled_reqs"],
                    )
                else:
                    res = kv.allocate_slots(
                        rid, rec["num_new_tokens"], num_computed_tokens=rec["num_computed_tokens"]
                    )
                rep._time(api, clock() - t)
                check(rec, None if res is None else _ids(res))
            elif op == "free":
                rid = trace.requests[rec["req"]].req_id
                t = clock()
                if api == "free":
                    kv.free(rid)
                else:
                    kv.remove_request(rid)
                rep._time(api, clock() - t)
                if api == "remove_request":
                    known.pop(rec["req"], None)
            else:
                raise ValueError(f"unknown op {op!r} in {path}")
        rep.free_blocks_at_end = kv.num_free_blocks
        rep.manager_seconds = sum(v[1] for v in rep.per_api.values()) / 1e9
        kv.check_invariants()
    return rep


def _api(rec: dict[str, Any]) -> str:
    """The `ReplayReport.per_api` key `replay_dump` times a recorded call under."""
    op = rec["op"]
    if op == "new_step":
        return "new_step_starts"
    if op == "allocate_slots":
        admit = "num_new_computed_tokens" in rec
        return "allocate_slots(admit)" if admit else "allocate_slots(running)"
    if op == "free":
        return "free" if rec["reason"] == "preempted" else "remove_request"
    return str(op)


def harness_floor(path: str) -> ReplayReport:
    """What `replay_dump` measures for calls that cost nothing: the dump read
    the same way, and in place of each recorded call, under its API, the
    cheapest call the manager has (`new_step_starts`, no arguments, next to
    no work) in the same timed window (the clock read on either side, the
    method looked up on the manager). A replay of this dump cannot show
    less time than this, whatever the implementation; results are not
    checked, and the calls' own arguments (read inside the window by
    `replay_dump`) are left out, so the floor is a lower bound."""
    opener: Any = gzip.open if path.endswith(".gz") else open
    rep = ReplayReport()
    with opener(path, "rt") as f:
        kv = manager_for_dump(json.loads(f.readline()))
        clock = time.perf_counter_ns
        for line in f:
            rec = json.loads(line)
            if rec["op"] == "summary":
                break
            rep.ops += 1
            api = _api(rec)
            t = clock()
            kv.new_step_starts()
            rep._time(api, clock() - t)
        rep.manager_seconds = sum(v[1] for v in rep.per_api.values()) / 1e9
    return rep
