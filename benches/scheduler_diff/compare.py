"""What a step shows as plain values (dicts, lists, numbers), and their first difference."""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any


def cache_stats(s: Any) -> Any:
    if s is None:
        return None
    keys = (
        "reset",
        "requests",
        "queries",
        "hits",
        "preempted_requests",
        "preempted_queries",
        "preempted_hits",
    )
    d = {k: getattr(s, k, None) for k in keys}
    d["hits_by_source"] = plain(getattr(s, "hits_by_source", None))
    return d


def plain(x: Any) -> Any:
    """``x`` as JSON-like values (dicts, lists, strings, numbers)."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return round(x, 12)
    if isinstance(x, enum.Enum):
        return x.name
    if isinstance(x, bytes):
        return x.hex()
    if isinstance(x, dict):
        return {str(plain(k)): plain(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (set, frozenset)):
        return sorted((plain(v) for v in x), key=str)
    if isinstance(x, (list, tuple)) or type(x).__name__ in ("ConstantList", "BlockRun"):
        return [plain(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {
            "_type": type(x).__name__,
            **{f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)},
        }
    fields_ = getattr(type(x), "__struct_fields__", None)
    if fields_ is not None:  # msgspec.Struct (KV events)
        return {"_type": type(x).__name__, **{f: plain(getattr(x, f)) for f in fields_}}
    if hasattr(x, "tolist"):
        return x.tolist()
    return repr(x)


def snap_output(so: Any) -> dict[str, Any]:
    c = so.scheduled_cached_reqs
    cached = []
    for i, rid in enumerate(c.req_ids):
        nb = c.new_block_ids[i]
        cached.append(
            {
                "req_id": rid,
                "resumed": rid in c.resumed_req_ids,
                "new_block_ids": None if nb is None else [list(g) for g in nb],
                "num_computed_tokens": c.num_computed_tokens[i],
                "num_output_tokens": c.num_output_tokens[i],
                "new_token_ids": list(c.new_token_ids[i]) if i < len(c.new_token_ids) else None,
            }
        )
    meta = so.kv_connector_metadata
    return {
        "new_reqs": [
            {
                "req_id": r.req_id,
                "block_ids": [list(g) for g in r.block_ids],
                "num_computed_tokens": r.num_computed_tokens,
                "prompt_len": len(r.prompt_token_ids or ()),
                "replay_start": r.replay_start,
            }
            for r in so.scheduled_new_reqs
        ],
        "cached_reqs": cached,
        "num_scheduled_tokens": dict(so.num_scheduled_tokens),
        "total_num_scheduled_tokens": so.total_num_scheduled_tokens,
        "scheduled_spec_decode_tokens": plain(so.scheduled_spec_decode_tokens),
        "num_common_prefix_blocks": list(so.num_common_prefix_blocks),
        "preempted_req_ids": sorted(so.preempted_req_ids or ()),
        "finished_req_ids": sorted(so.finished_req_ids),
        "new_block_ids_to_zero": plain(so.new_block_ids_to_zero),
        "kv_cache_block_copies": plain(so.kv_cache_block_copies),
        "connector_req_ids": getattr(meta, "req_ids", None),
    }


def first_diff(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first path where ``a`` and ``b`` differ, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                return (f"{path}.{k}", a.get(k, "<missing>"), b.get(k, "<missing>"))
            d = first_diff(a[k], b[k], f"{path}.{k}")
            if d is not None:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = first_diff(x, y, f"{path}[{i}]")
            if d is not None:
                return d
        return None
    return None if a == b else (path or ".", a, b)


def short(x: Any, n: int = 400) -> str:
    s = json.dumps(x, default=str) if not isinstance(x, str) else x
    return s if len(s) <= n else s[: n - 3] + "..."
