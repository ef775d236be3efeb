"""The device pool's ``eviction`` option through Python: SLRU and ARC keep a
prefix that was reused cached through a scan of one-off prompts that evicts it
under LRU (vLLM's order, the default), and change nothing else."""

from __future__ import annotations

import pagedkv as pk
import pytest
from pagedkv.errors import InvalidConfigError

from tests._util import admit, make_manager


def serve(m: pk.KVCacheManager, rid: str, tokens: list[int]) -> int:
    """Admits the request with its hit, computes the rest, removes it; its hit."""
    m.add_request(rid, tokens)
    hit, new = admit(m, rid)
    assert new is not None
    m.remove_request(rid)
    m.check_invariants()
    return hit.num_computed_tokens


def system_prompt(question: int) -> list[int]:
    """A 16-token prompt shared by every question, then 4 tokens of its own."""
    return list(range(16)) + [10_000 + question * 8 + i for i in range(4)]


def hit_after_scan(policy: str) -> int:
    # 4-token blocks, 32 usable: the system prompt (4 blocks) is computed, then
    # hit once (reused), then 24 one-off prompts of 2 blocks each pass through.
    m = make_manager(block_size=4, num_blocks=33, eviction=policy)
    assert m.eviction == policy
    assert serve(m, "a", system_prompt(0)) == 0
    assert serve(m, "b", system_prompt(1)) == 16
    for i in range(24):
        assert serve(m, f"scan{i}", [50_000 + i * 8 + t for t in range(8)]) == 0
    return serve(m, "c", system_prompt(2))


def test_a_reused_prefix_outlives_a_scan_under_slru_and_arc_but_not_lru() -> None:
    assert hit_after_scan("lru") == 0
    assert hit_after_scan("slru") == 16
    assert hit_after_scan("arc") == 16


def test_the_default_is_vllms_lru() -> None:
    assert make_manager().eviction == "lru"


@pytest.mark.parametrize(
    ("value", "error"), [("fifo", InvalidConfigError), ("LRU ", InvalidConfigError), (1, TypeError)]
)
def test_an_unknown_policy_is_refused(value: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        make_manager(eviction=value)
