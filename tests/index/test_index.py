"""The router-side prefix index fed by managers' KV events."""

from __future__ import annotations

import random
from collections import Counter

import pagedkv as pk
import pytest
from pagedkv.index import PrefixIndex, PrefixMatch, request_block_hashes

from tests._util import make_manager


def _h64(h: bytes) -> int:
    return int.from_bytes(h[-8:], "big")


def ground_truth(mgr: pk.KVCacheManager) -> list[tuple[int, int | None, int]]:
    """What the manager itself has cached: (hash as int, group, number of blocks)."""
    seen: Counter[tuple[int, int]] = Counter()
    for bid in range(mgr.num_blocks):
        key = mgr.cached_block_hash(bid)
        if key is not None:
            seen[(_h64(key[0]), key[1])] += 1
    return sorted((h, g, n) for (h, g), n in seen.items())


def run_request(mgr: pk.KVCacheManager, rid: str, prompt: list[int]) -> int:
    """Admits a prompt, allocates it, frees it; returns its prefix-cache hit in tokens."""
    mgr.add_request(rid, prompt)
    hit = mgr.get_computed_blocks(rid)
    n = hit.num_computed_tokens
    new = mgr.allocate_slots(
        rid,
        len(prompt) - n,
        num_computed_tokens=0,
        num_new_computed_tokens=n,
        new_computed_blocks=hit,
    )
    assert new is not None
    mgr.remove_request(rid)
    return n


def test_request_block_hashes_are_the_managers() -> None:
    mgr = make_manager(block_size=4, num_blocks=16)
    prompt = list(range(1000, 1014))
    mgr.add_request("r", prompt)
    assert request_block_hashes(prompt, 4) == mgr.block_hashes("r")
    with pytest.raises(ValueError, match="seed"):
        request_block_hashes(prompt, 4, hash_algo="xxhash_cbor")
    seeded = make_manager(block_size=4, num_blocks=16, hash_algo="xxhash_cbor", hash_seed=7)
    seeded.add_request("r", prompt)
    assert request_block_hashes(
        prompt, 4, hash_algo="xxhash_cbor", hash_seed=7
    ) == seeded.block_hashes("r")


def test_index_routes_to_the_replica_with_the_longest_prefix() -> None:
    system = list(range(5000, 5032))  # 8 blocks of 4
    a = make_manager(block_size=4, num_blocks=64, enable_kv_cache_events=True)
    b = make_manager(block_size=4, num_blocks=64, enable_kv_cache_events=True)
    run_request(a, "x", [*system[:12], 1, 2, 3])
    run_request(b, "y", [*system, 7, 8])
    index = PrefixIndex()
    index.apply("a", a.take_events())
    index.apply("b", b.take_events(raw_hashes=True))  # raw digests work too
    query = [*system, 9, 9, 9, 9, 9]
    assert index.longest_prefix_for_tokens(query, 4) == PrefixMatch("b", 8)
    assert index.match_lengths(request_block_hashes(query, 4)) == {"a": 3, "b": 8}
    # The answer is what the replica's own lookup then finds.
    assert run_request(b, "q", query) == 8 * 4
    assert index.longest_prefix_for_tokens([1, 2, 3, 4, 5], 4) is None
    assert index.replicas == ["a", "b"]


def test_index_view_equals_the_managers_cache_under_eviction() -> None:
    rng = random.Random(0)
    prefixes = [[rng.randrange(50_000) for _ in range(24)] for _ in range(5)]
    mgrs = {
        name: make_manager(block_size=4, num_blocks=40, enable_kv_cache_events=True)
        for name in ("a", "b")
    }
    index = PrefixIndex()
    for step in range(300):
        name = rng.choice(list(mgrs))
        prompt = rng.choice(prefixes)[: rng.randrange(4, 25)] + [
            rng.randrange(50_000) for _ in range(rng.randrange(1, 30))
        ]
        run_request(mgrs[name], f"r{step}", prompt)
        if step == 150:
            assert mgrs["a"].reset_prefix_cache()  # AllBlocksCleared
        for n, m in mgrs.items():
            index.apply(n, m.take_events())
        index.check_invariants()
    for name, mgr in mgrs.items():
        assert index.entries(name) == ground_truth(mgr)
        assert index.replica_num_blocks(name) == len({h for h, _, _ in ground_truth(mgr)})
    st = index.stats()
    assert st.blocks_removed > 0 and st.clears == 1 and st.unknown_removals == 0
    # Every query agrees with each replica's own hit.
    for p in prefixes:
        query = [*p, 1]
        lengths = index.match_lengths(request_block_hashes(query, 4))
        for name, mgr in mgrs.items():
            mgr.add_request("probe", query)
            assert lengths[name] * 4 == mgr.get_computed_blocks("probe").num_computed_tokens
            mgr.remove_request("probe")


def test_bytes_and_int_hashes_are_the_same_key() -> None:
    index = PrefixIndex()
    digest = bytes(range(32))
    index.store("a", [digest], group_idx=0)
    assert index.contains("a", _h64(digest), 0)
    assert index.longest_prefix([_h64(digest)]) == PrefixMatch("a", 1)
    index.remove("a", [_h64(digest)], group_idx=0)
    assert index.num_blocks == 0


def test_wire_batches_apply_directly() -> None:
    wire = pytest.importorskip("pagedkv.events.wire")
    mgr = make_manager(block_size=4, num_blocks=16, enable_kv_cache_events=True)
    run_request(mgr, "r", list(range(9)))
    payload = wire.KVEventEncoder().encode_events(mgr.take_events())
    index = PrefixIndex()
    assert index.apply("a", wire.decode_batch(payload)) == 1
    assert index.entries("a") == ground_truth(mgr)
    assert index.chain(index.entries("a")[0][0])  # parent links are kept


def test_bad_hashes_are_refused() -> None:
    index = PrefixIndex()
    with pytest.raises(pk.InvalidArgumentError):
        index.store("a", [-1])
    with pytest.raises(pk.InvalidArgumentError):
        index.store("a", [2**64])
    with pytest.raises(TypeError):
        index.store("a", ["abc"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        index.apply("a", [object()])
    assert index.num_blocks == 0
