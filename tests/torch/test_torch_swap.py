"""Swapping a request's blocks to the CPU pool and back: the manager frees and
re-allocates, the data survives, and the id mapping says where it went."""

from __future__ import annotations

import numpy as np
import pagedkv as pk
import pytest

torch = pytest.importorskip("torch")

from pagedkv.torch import KVCache, KVSwapper, TinyConfig, TinyTransformer, allocate_kv_cache  # noqa: E402

torch.set_num_threads(1)


def _setup(
    num_blocks: int = 48, num_cpu_blocks: int = 32
) -> tuple[pk.KVCacheManager, KVCache, KVSwapper]:
    model = TinyTransformer(TinyConfig(layer_types=("full", "sliding", "full", "sliding")))
    config = pk.get_kv_cache_config(
        model.kv_cache_specs(4), 0, max_model_len=32, num_gpu_blocks_override=num_blocks
    )
    mgr = pk.KVCacheManager(config, max_model_len=32)
    cache = allocate_kv_cache(config, "cpu")
    return mgr, cache, KVSwapper(mgr, cache, num_cpu_blocks)


def _run(mgr: pk.KVCacheManager, cache: KVCache, rid: str, prompt: list[int], decode: int) -> int:
    """Prefill + ``decode`` decode steps; every newly allocated block gets random data.
    Returns the tokens computed."""
    gen = torch.Generator().manual_seed(len(prompt) + decode)
    mgr.add_request(rid, prompt)
    new = mgr.allocate_slots(rid, len(prompt), num_computed_tokens=0)
    computed = len(prompt)
    for step in range(decode + 1):
        assert new is not None
        for g, ids in enumerate(new):
            for t in cache.group_block_tensors(g):
                t[torch.from_numpy(ids.astype(np.int64))] = torch.randn(
                    (len(ids), *t.shape[1:]), generator=gen
                )
        if step == decode:
            break
        mgr.append_token_ids(rid, [7])
        new = mgr.allocate_slots(rid, 1, num_computed_tokens=computed)
        computed += 1
    return computed


def _cached(mgr: pk.KVCacheManager) -> set[int]:
    return {b for b in range(1, mgr.num_blocks) if mgr.cached_block_hash(b) is not None}


def _snapshot(
    cache: KVCache, block_ids: tuple[np.ndarray, ...]
) -> list[dict[int, list[torch.Tensor]]]:
    """Per group: position in the block list -> contents of that block in every layer."""
    return [
        {
            int(i): [t[int(ids[i])].clone() for t in cache.group_block_tensors(g)]
            for i in np.flatnonzero(ids)
        }
        for g, ids in enumerate(block_ids)
    ]


def test_data_survives_swap_out_and_in() -> None:
    mgr, cache, swapper = _setup()
    computed = _run(mgr, cache, "a", list(range(1, 19)), decode=5)  # 23 tokens
    before_ids = mgr.get_block_ids("a")
    assert (before_ids[1] == 0).any(), "the sliding-window group released blocks"
    before = _snapshot(cache, before_ids)
    free_before = mgr.num_free_blocks

    swapped = swapper.swap_out("a", computed)
    assert swapped is not None
    assert [len(g) for g in mgr.get_block_ids("a")] == [0, 0]  # the manager freed them
    assert mgr.num_free_blocks == free_before + sum(int((i != 0).sum()) for i in before_ids)
    assert swapper.num_free_cpu_blocks == 32 - swapped.num_cpu_blocks
    assert swapped.groups[0].indices.tolist() == list(range(6))
    assert swapped.groups[1].indices.tolist() == [3, 4, 5]

    # Another request takes (and scribbles over) the freed blocks.
    _run(mgr, cache, "b", list(range(50, 80)), decode=0)
    for b in cache.buffers:
        b[cache.buffers[0].numel() // 2 :] = 255
    mgr.remove_request("b")

    cached_before = _cached(mgr)
    result = swapper.swap_in(swapped, num_new_tokens=1)
    assert result is not None
    after_ids = mgr.get_block_ids("a")
    # Blocks cached by the swap-in hold the copied data: they are blocks the request
    # holds, never one it allocated and released again (outside the window).
    live = {int(b) for ids in after_ids for b in ids if b != 0}
    assert _cached(mgr) - cached_before <= live
    assert _cached(mgr) - cached_before
    for g, (old, new) in enumerate(zip(result.old_ids, result.new_ids, strict=True)):
        live = after_ids[g][swapped.groups[g].indices] != 0
        assert old.tolist() == before_ids[g][swapped.groups[g].indices][live].tolist()
        assert new.tolist() == after_ids[g][swapped.groups[g].indices][live].tolist()
        assert result.mapping()[g] == dict(zip(old.tolist(), new.tolist(), strict=True))
    # The next token (position 23) sees positions 16..23: sliding-window blocks 0-3
    # are null; every other block holds the data it held before.
    assert after_ids[1][:4].tolist() == [0, 0, 0, 0]
    assert len(result.new_ids[1]) == 2
    after = _snapshot(cache, after_ids)
    for g in range(2):
        for i, contents in after[g].items():
            if i < len(before_ids[g]):
                for x, y in zip(before[g][i], contents, strict=True):
                    assert torch.equal(x, y)
    assert swapper.num_free_cpu_blocks == 32
    # One more slot was allocated for the next token; the manager is consistent.
    assert len(after_ids[0]) == -(-(computed + 1) // 4)
    mgr.check_invariants()


def test_swap_out_without_room_changes_nothing() -> None:
    mgr, cache, swapper = _setup(num_cpu_blocks=3)
    computed = _run(mgr, cache, "a", list(range(1, 19)), decode=0)
    ids = [i.tolist() for i in mgr.get_block_ids("a")]
    assert swapper.swap_out("a", computed) is None
    assert [i.tolist() for i in mgr.get_block_ids("a")] == ids
    assert swapper.num_free_cpu_blocks == 3


def test_swap_in_without_room_changes_nothing() -> None:
    mgr, cache, swapper = _setup(num_blocks=24)
    computed = _run(mgr, cache, "a", list(range(1, 25)), decode=0)
    swapped = swapper.swap_out("a", computed)
    assert swapped is not None
    _run(mgr, cache, "b", list(range(100, 124)), decode=0)
    free = mgr.num_free_blocks
    assert swapper.swap_in(swapped) is None
    assert mgr.num_free_blocks == free
    assert swapper.num_free_cpu_blocks == 32 - swapped.num_cpu_blocks
    mgr.remove_request("b")
    assert swapper.swap_in(swapped) is not None


def test_swap_misuse_raises() -> None:
    mgr, cache, swapper = _setup()
    computed = _run(mgr, cache, "a", list(range(1, 10)), decode=0)
    ids = [i.tolist() for i in mgr.get_block_ids("a")]
    with pytest.raises(pk.InvalidArgumentError):
        swapper.swap_out("a", computed + 5)
    assert [i.tolist() for i in mgr.get_block_ids("a")] == ids
    assert swapper.num_free_cpu_blocks == 32
    swapped = swapper.swap_out("a", computed)
    assert swapped is not None
    mgr.allocate_slots("a", 4, num_computed_tokens=0)
    ids = [i.tolist() for i in mgr.get_block_ids("a")]
    with pytest.raises(pk.InvalidArgumentError, match="already holds"):
        swapper.swap_in(swapped)
    with pytest.raises(pk.UnknownRequestError):
        swapper.swap_out("nope", 0)
    # The swapped copy still holds its CPU blocks; "a" keeps its new ones.
    assert swapper.num_free_cpu_blocks == 32 - swapped.num_cpu_blocks
    assert [i.tolist() for i in mgr.get_block_ids("a")] == ids
    mgr.check_invariants()
