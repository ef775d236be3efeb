"""vLLM 0.33's Scheduler on vLLM's manager and on the drop-in, step by step.

A slice of ``benches/vllm_scheduler_diff.py`` (see docs/vllm.md): each
configuration runs one seed on both sides and must stay identical. Skipped
where vLLM is not installed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))

import vllm_scheduler_diff as diff

# torch (which vLLM imports while it builds a scheduler) deprecates
# torch.jit.script_method and warns about it; pyproject makes every warning an
# error. Only that warning, only in this file.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)

SLICE = [
    "full-pc-bs16",
    "swa-pc-bs8",
    "pressure-bs4",
    "chunked-full+mamba",
    "async-ngram2",
    "draft2",
    "priority-pressure",
    "lora-salts-events",
    "full+swa-pressure-events",
    "connector-async-fail-recompute",
    "resets",
    "stream-async-ngram2-events",
    "stream-minimal-async",
]


def case(name: str) -> diff.Case:
    [c] = diff.select([name])
    return c


@pytest.mark.parametrize("name", SLICE)
def test_scheduler_runs_identical(name: str) -> None:
    r = diff.run_case(case(name), seed=0)
    assert r.status == "identical", r.detail
    assert r.steps > 0 and not r.detail, r.detail


def test_a_difference_is_reported_at_its_step() -> None:
    """One block taken from pagedkv's pool before step 3 shifts its block ids."""

    def take_a_block(side: diff.Side, step: int) -> None:
        if step == 3:
            side.sched.kv_cache_manager.block_pool.get_new_blocks(1)

    r = diff.run_case(case("full-pc-bs16"), seed=0, perturb=take_a_block)
    assert r.status == "diverged", r.detail
    assert r.diff is not None and r.diff["step"] == 3, r.detail
    assert "block_ids" in r.diff["path"] or "num_free_blocks" in r.diff["path"], r.detail


def test_streaming_session_caches_its_rewritten_tokens() -> None:
    """A session's discarded sampled token (101) never reaches the cache.

    Block size 4, prompt 1..6, sampled 100 then 101 (a stop token) with the
    next step in flight, next chunk 7..11: a request carrying the session's
    real content hits 12 tokens, one carrying the discarded token hits 4. The
    run being identical says pagedkv answers the same, events included.
    """
    hits: dict[str, int] = {}

    def observe(step: int, phase: str, snap: dict[str, Any]) -> None:
        if phase == "schedule":
            for r in snap["new_reqs"]:
                if r["req_id"].startswith("probe"):
                    hits[r["req_id"]] = r["num_computed_tokens"]

    for name in ("stream-minimal-async", "stream-minimal-async-hits", "stream-minimal-ngram"):
        hits.clear()
        r = diff.run_case(case(name), seed=0, observe=observe)
        assert r.status == "identical", f"{name}: {r.detail}"
        assert hits == {"probe-real": 12, "probe-discarded": 4}, name
