"""pagedkv's host tier against vLLM 0.33's own ``CPUOffloadingManager``.

Each trace in ``tests/vectors/offload`` was recorded by running vLLM's manager
(``benches/offload_record_vllm.py``, LRU and ARC, with failed stores, resets,
the ``store_threshold`` filter and two KV-cache groups) through a random
serving workload: every call with vLLM's answer, and every few calls the
policy's internal order. Replayed on pagedkv's tier, every answer must match.
"""

from __future__ import annotations

import collections
import copy
from pathlib import Path

import pytest
from pagedkv.offload_trace import OPS, load_trace, replay

TRACES = sorted((Path(__file__).parent.parent / "vectors" / "offload").glob("*.json.gz"))


def test_the_traces_cover_both_policies_and_every_call() -> None:
    assert len(TRACES) >= 6
    policies: collections.Counter[str] = collections.Counter()
    refused = evicted = failed = 0
    for path in TRACES:
        trace = load_trace(path)
        policies[trace["config"]["policy"]] += 1
        assert trace["vllm_version"].startswith("0.33")
        kinds = collections.Counter(op["op"] for op in trace["ops"])
        assert all(kinds[k] > 0 for k in OPS), (path.name, kinds)
        for op in trace["ops"]:
            if op["op"] == "prepare_store":
                refused += op["out"] is None
                evicted += len(op["out"]["evicted"]) if op["out"] else 0
            failed += op["op"] == "complete_store" and not op["success"]
    assert policies["lru"] >= 3 and policies["arc"] >= 3
    assert refused > 0 and evicted > 100 and failed > 10


@pytest.mark.parametrize("path", TRACES, ids=[p.name for p in TRACES])
def test_every_answer_matches_vllm(path: Path) -> None:
    tier, mismatches = replay(load_trace(path))
    assert mismatches == []
    tier.check_invariants()


def test_a_changed_answer_is_reported() -> None:
    trace = load_trace(TRACES[0])
    changed = copy.deepcopy(trace)
    store = next(
        op
        for op in changed["ops"]
        if op["op"] == "prepare_store" and op["out"] and op["out"]["evicted"]
    )
    store["out"]["chunk_ids"][-1] += 1
    state = next(op for op in changed["ops"] if op["op"] == "state" and op["out"]["evictable"])
    state["out"]["evictable"] += 1
    _, mismatches = replay(changed)
    assert {m[1] for m in mismatches} == {"prepare_store", "state"}


def test_a_broken_trace_is_refused_in_one_line(tmp_path: Path) -> None:
    import gzip

    raw = TRACES[0].read_bytes()
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match="not a readable trace"):
        load_trace(cut)
    other = tmp_path / "other.json.gz"
    other.write_bytes(gzip.compress(b'{"format": "something else"}'))
    with pytest.raises(ValueError, match="not a pagedkv-offload-trace-1 trace"):
        load_trace(other)
    trace = load_trace(TRACES[0])
    bad = copy.deepcopy(trace)
    store = next(i for i, op in enumerate(bad["ops"]) if op["op"] == "prepare_store")
    bad["ops"][store]["keys"] = ["not hex"]
    with pytest.raises(ValueError, match=rf"op {store} \(prepare_store\)"):
        replay(bad)
