"""Collision safety from Python: ``verify_cached_tokens`` checks every prefix hit
against the tokens each cached block was computed for. With a deliberately weak
hash (``hash_truncate_bytes=1``) hits without it serve blocks of other prompts;
with it, never. Also ``take_events(raw_hashes=True)``."""

from __future__ import annotations

import random

import pagedkv as pk
import pytest
from _util import make_manager
from pagedkv.errors import InvalidConfigError


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
