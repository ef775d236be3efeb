"""Collision safety from Python: ``verify_cached_tokens`` checks every prefix hit
against the tokens each cached block was computed for. With a deliberately weak
hash (``hash_truncate_bytes=1``) hits without it serve blocks of other prompts;
with it, never. Also ``take_events(raw_hashes=True)``."""

from __future__ import annotations

import random

import pagedkv as pk
import pytest
from pagedkv.errors import InvalidConfigError

from tests._util import make_manager


def _drive(mgr: pk.KVCacheManager, seed: int, n: int = 400) -> int:
    """Admits prompts sharing a few stems (real hits happen too), keeping three
    running; returns how many hits covered a block computed for other tokens."""
    rng = random.Random(seed)
    written: dict[int, list[int]] = {}  # block id -> the prefix it was computed for
    live: list[str] = []
    bad = 0
    for r in range(n):
        stem = rng.randrange(4)
        prompt = [stem * 100 + i % 3 for i in range(rng.randrange(24))]
        prompt += [rng.randrange(3) for _ in range(1 + rng.randrange(20))]
        rid = f"r{r}"
        mgr.add_request(rid, prompt)
        hit = mgr.get_computed_blocks(rid)
        h = hit.num_computed_tokens
        for i, b in enumerate(hit.block_ids[0].tolist()):
            end = min((i + 1) * 4, h)
            if written.get(b, [])[:end] != prompt[:end] or len(written.get(b, [])) < end:
                bad += 1
                break
        while (
            mgr.allocate_slots(rid, len(prompt) - h, num_computed_tokens=0, new_computed_blocks=hit)
            is None
        ):
            mgr.remove_request(live.pop(0))
        for i, b in enumerate(mgr.get_block_ids(rid)[0].tolist()):
            if i * 4 >= h:
                written[b] = prompt[: (i + 1) * 4]
        live.append(rid)
        if len(live) > 3:
            mgr.remove_request(live.pop(0))
        mgr.check_invariants()
    return bad


def test_a_weak_hash_serves_foreign_blocks_without_verification() -> None:
    mgr = make_manager(4, 96, hash_truncate_bytes=1)
    assert _drive(mgr, 1) > 0
    assert mgr.verification_failures == 0


def test_verification_catches_every_collision() -> None:
    mgr = make_manager(4, 96, hash_truncate_bytes=1, verify_cached_tokens=True)
    assert _drive(mgr, 1) == 0
    assert mgr.verification_failures > 0


def test_verification_keeps_every_honest_hit() -> None:
    plain = make_manager(4, 96)
    checked = make_manager(4, 96, verify_cached_tokens=True)
    rng_a, rng_b = random.Random(5), random.Random(5)
    for r in range(200):
        prompt = [rng_a.randrange(2) for _ in range(rng_a.randrange(1, 40))]
        assert prompt == [rng_b.randrange(2) for _ in range(rng_b.randrange(1, 40))]
        hits = []
        for mgr in (plain, checked):
            mgr.add_request(f"r{r}", prompt)
            hit = mgr.get_computed_blocks(f"r{r}")
            hits.append((hit.num_computed_tokens, hit.block_ids[0].tolist()))
            if (
                mgr.allocate_slots(
                    f"r{r}",
                    len(prompt) - hit.num_computed_tokens,
                    num_computed_tokens=0,
                    new_computed_blocks=hit,
                )
                is None
            ):
                mgr.remove_request(f"r{r}")
            elif r % 2:
                mgr.remove_request(f"r{r}")
        assert hits[0] == hits[1]
    assert checked.verification_failures == 0


@pytest.mark.parametrize("n", [0, 33, -1])
def test_bad_truncation_is_refused(n: int) -> None:
    with pytest.raises(InvalidConfigError):
        make_manager(4, 16, hash_truncate_bytes=n)


def test_raw_hash_events_carry_the_full_digest() -> None:
    mgr = make_manager(4, 16, enable_kv_cache_events=True)
    mgr.add_request("a", list(range(9)))
    mgr.allocate_slots("a", 9, num_computed_tokens=0)
    digests = mgr.block_hashes("a")
    (stored,) = mgr.take_events(raw_hashes=True)
    assert isinstance(stored, pk.BlockStored)
    assert stored.block_hashes == digests and stored.parent_block_hash is None
    mgr.remove_request("a")
    mgr.evict_blocks(range(1, 16))
    removed = mgr.take_events()
    assert sorted(h for ev in removed for h in ev.block_hashes) == sorted(
        int.from_bytes(d[-8:], "big") for d in digests
    )


def _churn_hybrid(seed: int, steps: int = 400) -> None:
    """Admissions, decode steps, preemptions and removals of short prompts over
    a three-token vocabulary on full attention (8-token blocks) + a sliding
    window (4-token blocks) with a one-byte hash and no verification;
    ``check_invariants`` after every call, every block free once all are removed."""
    rng = random.Random(seed)
    full = pk.FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=1, dtype="float32")
    swa = pk.SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=8
    )
    config = pk.KVCacheConfig(
        num_blocks=40,
        kv_cache_groups=[pk.KVCacheGroupSpec(["f"], full), pk.KVCacheGroupSpec(["s"], swa)],
    )
    mgr = pk.KVCacheManager(
        config,
        max_model_len=256,
        enable_caching=True,
        hash_truncate_bytes=1,
        hash_algo="xxh3_native",
        hash_seed="0",
    )
    computed: dict[str, int] = {}
    for step in range(steps):
        op = rng.random()
        if op < 0.3 or not computed:
            rid = f"r{step}"
            mgr.add_request(rid, [rng.randrange(3) for _ in range(rng.randrange(1, 40))])
            computed[rid] = 0
        elif op < 0.6:
            rid = rng.choice(sorted(computed))
            if computed[rid] == 0:
                hit = mgr.get_computed_blocks(rid)
                num_new = mgr.num_tokens(rid) - hit.num_computed_tokens
                new = mgr.allocate_slots(
                    rid, num_new, num_computed_tokens=0, new_computed_blocks=hit
                )
                if new is not None:
                    computed[rid] = mgr.num_tokens(rid)
            else:
                if computed[rid] >= mgr.num_tokens(rid):
                    mgr.append_token_ids(rid, [rng.randrange(3)])
                if mgr.allocate_slots(rid, 1, num_computed_tokens=computed[rid]) is not None:
                    computed[rid] += 1
        elif op < 0.75:
            rid = rng.choice(sorted(computed))
            mgr.free(rid)
            computed[rid] = 0
        else:
            rid = rng.choice(sorted(computed))
            mgr.remove_request(rid)
            del computed[rid]
        mgr.check_invariants()
    # Removing what is left returns every block, shared or not, to the free queue.
    for rid in computed:
        mgr.remove_request(rid)
    assert mgr.num_requests == 0 and mgr.num_free_blocks == mgr.num_blocks - 1
    mgr.check_invariants()


@pytest.mark.parametrize("seed", [0, 1, 2, 43, 63, 90, 128, 175])
def test_a_weak_hash_keeps_hybrid_state_consistent(seed: int) -> None:
    # A colliding hash can match a prompt-tail entry registered at another
    # position (seeds 43, 63, 90, 128 and 175 do): the block is shared, its
    # reference counts and keys stay consistent, and the invariants accept a
    # block reached under any of its entries.
    _churn_hybrid(seed)
