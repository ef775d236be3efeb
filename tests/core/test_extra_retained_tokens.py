"""Sliding-window groups that keep tokens below their window
(``SlidingWindowSpec(extra_retained_tokens=...)``, vLLM's field for multi-module
speculative decoding): blocks fall out that many tokens later, the admission
cap counts them, hits still need only the window. With vLLM installed, the
drop-in is run side by side with vLLM's own manager."""

from __future__ import annotations

from typing import Any

import pagedkv as pk
import pytest
from pagedkv.errors import InvalidConfigError

from tests._util import admit, as_lists, manager, refused


def kept(bs: int, window: int, extra: int) -> pk.SlidingWindowSpec:
    return pk.SlidingWindowSpec(
        bs, 1, 1, "float32", sliding_window=window, extra_retained_tokens=extra
    )


def nulled_after(mgr: pk.KVCacheManager, steps: list[int]) -> list[int]:
    """Leading null blocks after ``remove_skipped_blocks(n)`` for each ``n``."""
    mgr.add_request("a", list(range(21)))
    assert mgr.allocate_slots("a", 21, num_computed_tokens=0) is not None
    out = []
    for n in steps:
        mgr.remove_skipped_blocks("a", n)
        (row,) = as_lists(mgr.get_block_ids("a")) or ([],)
        out.append(next((i for i, b in enumerate(row) if b), len(row)))
        mgr.check_invariants()
    return out


def test_the_spec_carries_the_kept_tokens() -> None:
    spec = kept(16, 64, 16)
    assert spec.num_retained_tokens == 79
    assert spec.core_spec()["extra_retained_tokens"] == 16
    assert "extra_retained_tokens" not in kept(16, 64, 0).core_spec()
    # cdiv(min(63 + 16 + 128, 1024), 16) + 1
    assert spec.max_admission_blocks_per_request(128, 1024) == 14
    assert kept(16, 64, 0).max_admission_blocks_per_request(128, 1024) == 13
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidConfigError, match="extra_retained_tokens"):
            kept(16, 64, bad)  # type: ignore[arg-type]


def test_blocks_fall_out_of_the_window_that_many_tokens_later() -> None:
    # Block size 2, window 4, 3 kept tokens: n - 4 + 1 - 3 tokens skipped.
    steps = [0, 6, 7, 8, 9, 12, 21]
    assert nulled_after(manager(30, [kept(2, 4, 3)]), steps) == [0, 0, 0, 1, 1, 3, 7]
    assert nulled_after(manager(30, [kept(2, 4, 0)]), steps) == [0, 1, 2, 2, 3, 4, 9]


@pytest.mark.parametrize(
    ("extra", "num_blocks", "admitted"), [(16, 15, True), (16, 14, False), (0, 14, True)]
)
def test_the_admission_cap_counts_the_kept_tokens(
    extra: int, num_blocks: int, admitted: bool
) -> None:
    mgr = manager(num_blocks, [kept(16, 64, extra)], max_model_len=1024, max_in_flight_tokens=128)
    mgr.add_request("r", list(range(1000)))

    def call() -> Any:
        return mgr.allocate_slots("r", 128, num_computed_tokens=0, full_sequence_must_fit=True)

    if admitted:
        assert call() is not None
    else:
        assert refused(call)


@pytest.mark.parametrize("extra", [0, 3])
def test_hits_still_need_only_the_window(extra: int) -> None:
    mgr = manager(30, [kept(2, 4, extra)])
    mgr.add_request("a", list(range(20)))
    admit(mgr, "a")
    mgr.free("a")
    mgr.add_request("b", [*range(20), 999])
    hit = mgr.get_computed_blocks("b")
    assert hit.num_computed_tokens == 20
    # The hit's window: the last 2 blocks (the 3 kept tokens are not attended).
    assert as_lists(hit.block_ids) == ([0] * 8 + [9, 10],)


def test_kept_tokens_side_by_side_with_vllm() -> None:
    # Full attention beside a window of 8 keeping 3 tokens (vLLM's MTP
    # layout): block ids and free counts as vLLM's own manager answers, as
    # the window slides, at admission with a hit and at the cap.
    vllm_core = pytest.importorskip("vllm.v1.core.kv_cache_manager")
    import torch
    from pagedkv.vllm import KVCacheManager
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    window = SlidingWindowSpec(
        block_size=4,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        sliding_window=8,
        extra_retained_tokens=3,
    )
    cfg = KVCacheConfig(
        num_blocks=60,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["f"], full), KVCacheGroupSpec(["w"], window)],
    )

    def run(cls: Any) -> list[Any]:
        mgr = cls(
            cfg,
            max_model_len=256,
            hash_block_size=4,
            scheduler_block_size=16,
            max_in_flight_tokens=32,
        )
        hasher = get_request_block_hasher(4, sha256_cbor)
        out: list[Any] = []
        a = Request("a", list(range(33)), SamplingParams(max_tokens=8), None, block_hasher=hasher)
        hit, n = mgr.get_computed_blocks(a)[:2]
        mgr.allocate_slots(a, 33 - n, n, hit)
        a.num_computed_tokens = 33
        for processed in (9, 12, 16, 20, 33):
            mgr.remove_skipped_blocks("a", processed)
            out.append((mgr.get_block_ids("a"), mgr.block_pool.get_num_free_blocks()))
        mgr.free(a)
        b = Request("b", [*range(33), 1], SamplingParams(max_tokens=8), None, block_hasher=hasher)
        hit, n = mgr.get_computed_blocks(b)[:2]
        out.append((n, hit.get_block_ids()))
        new = mgr.allocate_slots(b, 34 - n, n, hit, full_sequence_must_fit=True)
        out.append((None if new is None else new.get_block_ids(), mgr.get_block_ids("b")))
        return out

    ours, ref = run(KVCacheManager), run(vllm_core.KVCacheManager)
    assert ours == ref
    assert ours[0] != ours[-3]  # the window slid
