"""vLLM 0.33's hybrid coordinator: several KV-cache groups of different attention
types sharing one block pool, block id for block id.

Scenarios follow vLLM's ``tests/v1/core/test_prefix_caching.py`` (hybrid, EAGLE,
different block sizes, admission cap, sparse retention, shared-prefix pins); every
expected value was read from vLLM 0.33 itself (its ``KVCacheManager`` driven through
pagedkv's API, with ``scheduler_block_size`` = LCM and ``hash_block_size`` = GCD of
the group block sizes, as vLLM's engine resolves them). Where vLLM's tests pop keys
out of ``block_pool.cached_block_hash_to_block``, these call ``evict_blocks`` on a
fresh manager per case.

Where vLLM returns ``None`` for a request that can never fit, pagedkv raises
``CannotFitError`` (its documented contract): ``refused`` accepts either.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pagedkv as pk
import pytest

from tests._util import admit, as_lists, chain, full, manager, refused, swa

DUMP = Path(__file__).parents[1] / "vectors" / "ops_hybrid.jsonl.gz"


def cached_positions(mgr: pk.KVCacheManager, block_ids: Sequence[int]) -> list[int]:
    """Indices of a block table whose blocks carry a cache key."""
    return [i for i, b in enumerate(block_ids) if b and mgr.cached_block_hash(b) is not None]


# --------------------------------------------------------------------------- full + 2 x SWA

BS = 16
COMMON3 = [i for i in range(3) for _ in range(BS)]  # 3 full blocks


def hybrid_3groups(num_blocks: int, window_blocks: int, **kwargs: Any) -> pk.KVCacheManager:
    """vLLM's ``make_kv_cache_config_hybrid_model``: full + SWA + SWA (equal SWA specs)."""
    window = swa(BS, window_blocks * BS)
    return manager(num_blocks, [full(BS), window, window], **kwargs)


def prefill_two_requests(mgr: pk.KVCacheManager) -> None:
    mgr.add_request("0", COMMON3 + [3] * 7)
    mgr.add_request("1", COMMON3 + [3] * 5)
    admit(mgr, "0")
    admit(mgr, "1")


def test_prefill_hybrid_model() -> None:
    mgr = hybrid_3groups(21, 2)
    tokens0 = COMMON3 + [3] * 7
    mgr.add_request("0", tokens0)
    assert len(mgr.block_hashes("0")) == 3
    hit, new = admit(mgr, "0")
    assert as_lists(hit.block_ids) == ([], [], [])
    assert hit.num_computed_tokens == 0
    assert new == ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])

    # Full blocks are cached in every group under the same chain, with their group id.
    hashes = chain("sha256_cbor", mgr.none_hash, tokens0, BS)
    for i, ids in enumerate(((1, 5, 9), (2, 6, 10), (3, 7, 11))):
        for group, block_id in enumerate(ids):
            assert mgr.cached_block_hash(block_id) == (hashes[i], group)
    for block_id in (4, 8, 12):
        assert mgr.cached_block_hash(block_id) is None
        assert mgr.block_ref_count(block_id) == 1

    # Cache hit in the common prefix: SWA groups get a null block outside the window.
    mgr.add_request("1", COMMON3 + [3] * 5)
    hit, new = admit(mgr, "1")
    assert as_lists(hit.block_ids) == ([1, 2, 3], [0, 6, 7], [0, 10, 11])
    assert hit.num_computed_tokens == 48
    assert hit.shared_prefix_boundary == 0
    assert new == ([13], [14], [15])
    assert [mgr.block_ref_count(b) for b in range(1, 16)] == [
        2,
        2,
        2,
        1,
        1,
        2,
        2,
        1,
        1,
        2,
        2,
        1,
        1,
        1,
        1,
    ]

    mgr.free("0")
    mgr.free("1")
    assert [int(b) for b in mgr.free_block_ids()] == [
        15,
        14,
        13,
        12,
        8,
        4,
        16,
        17,
        18,
        19,
        20,
        5,
        9,
        3,
        2,
        1,
        7,
        6,
        11,
        10,
    ]
    mgr.check_invariants()


# Block ids of hash i in group g after ``prefill_two_requests``: group 0 -> 1..3,
# group 1 -> 5..7, group 2 -> 9..11.
def _ids(*pairs: tuple[int, int]) -> list[int]:
    first = (1, 5, 9)
    return [first[g] + i for g, i in pairs]


@pytest.mark.parametrize(
    ("evicted", "expect_blocks"),
    [
        # Blocks outside the sliding window do not matter.
        pytest.param(_ids((1, 0), (2, 0)), 3, id="swa-outside-window"),
        # The first full-attention block: total miss.
        pytest.param(_ids((0, 0)), 0, id="full-first"),
        # The last block of every group / of one group shortens the hit to 2 blocks.
        pytest.param(_ids((0, 2), (1, 2), (2, 2)), 2, id="all-last"),
        pytest.param(_ids((0, 2)), 2, id="full-last"),
        pytest.param(_ids((1, 2)), 2, id="swa1-last"),
        pytest.param(_ids((2, 2)), 2, id="swa2-last"),
        # Full attention hits 2 blocks, the windows only reach 3: no common length.
        pytest.param(_ids((0, 2), (1, 0), (2, 0)), 0, id="disagree"),
    ],
)
def test_prefill_hybrid_model_partial_hits(evicted: list[int], expect_blocks: int) -> None:
    mgr = hybrid_3groups(21, 2)
    prefill_two_requests(mgr)
    mgr.free("0")
    mgr.free("1")
    mgr.evict_blocks(evicted)
    mgr.add_request("x", COMMON3 + [3] * 5)
    hit = mgr.get_computed_blocks("x")
    assert len(mgr.block_hashes("x")) == 3
    assert hit.num_computed_tokens == expect_blocks * BS
    for group in hit.block_ids:
        assert len(group) == expect_blocks


COMMON6 = [i for i in range(6) for _ in range(BS)]  # 6 full blocks


def eagle_setup() -> tuple[pk.KVCacheManager, tuple[list[int], ...]]:
    mgr = hybrid_3groups(31, 3, use_eagle=True)
    mgr.add_request("0", COMMON6 + [6] * 7)
    _, new = admit(mgr, "0")
    assert new is not None
    return mgr, new


def test_prefill_hybrid_model_eagle() -> None:
    mgr, new = eagle_setup()
    assert new == ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19, 20, 21])
    assert [b for b in range(31) if mgr.cached_block_hash(b) is not None] == [
        1,
        2,
        3,
        4,
        5,
        6,
        8,
        9,
        10,
        11,
        12,
        13,
        15,
        16,
        17,
        18,
        19,
        20,
    ]

    # EAGLE drops the last matched block: 6 cached blocks give 5 (80 tokens); the
    # windows (3 blocks) need 3 + 1 contiguous blocks.
    mgr.add_request("1", COMMON6 + [6] * 5)
    hit, new1 = admit(mgr, "1")
    assert as_lists(hit.block_ids) == ([1, 2, 3, 4, 5], [0, 0, 10, 11, 12], [0, 0, 17, 18, 19])
    assert hit.num_computed_tokens == 80
    assert new1 == ([22, 23], [24, 25], [26, 27])
    mgr.free("0")
    mgr.free("1")
    assert [int(b) for b in mgr.free_block_ids()] == [
        27,
        25,
        23,
        21,
        14,
        7,
        28,
        29,
        30,
        6,
        13,
        9,
        8,
        20,
        16,
        15,
        22,
        5,
        4,
        3,
        2,
        1,
        24,
        12,
        11,
        10,
        26,
        19,
        18,
        17,
    ]
    mgr.check_invariants()


@pytest.mark.parametrize(
    ("evicted", "expect"),
    [
        pytest.param(
            [(1, 0), (2, 0)],
            ([1, 2, 3, 4, 5], [0, 0, 10, 11, 12], [0, 0, 17, 18, 19]),
            id="swa-outside-window",
        ),
        pytest.param([(0, 0)], ([], [], []), id="full-first"),
        pytest.param(
            [(0, 5), (1, 5), (2, 5)], ([1, 2, 3, 4], [0, 9, 10, 11], [0, 16, 17, 18]), id="all-last"
        ),
        pytest.param([(0, 5)], ([1, 2, 3, 4], [0, 9, 10, 11], [0, 16, 17, 18]), id="full-last"),
        pytest.param([(1, 5)], ([1, 2, 3, 4], [0, 9, 10, 11], [0, 16, 17, 18]), id="swa1-last"),
        pytest.param([(2, 5)], ([1, 2, 3, 4], [0, 9, 10, 11], [0, 16, 17, 18]), id="swa2-last"),
        pytest.param([(1, 3)], ([1, 2], [8, 9], [15, 16]), id="swa-middle"),
        pytest.param([(1, 4)], ([1, 2, 3], [8, 9, 10], [15, 16, 17]), id="swa-middle-2"),
        pytest.param([(0, 5), (1, 2), (2, 2)], ([1], [8], [15]), id="mixed"),
        pytest.param([(0, 4), (1, 1)], ([], [], []), id="mixed-miss"),
    ],
)
def test_prefill_hybrid_model_eagle_partial_hits(
    evicted: list[tuple[int, int]], expect: tuple[list[int], ...]
) -> None:
    mgr, new = eagle_setup()
    mgr.free("0")
    mgr.evict_blocks([new[g][i] for g, i in evicted])
    mgr.add_request("x", COMMON6 + [6] * 5)
    hit = mgr.get_computed_blocks("x")
    assert as_lists(hit.block_ids) == expect
    assert hit.num_computed_tokens == len(expect[0]) * BS


# --------------------------------------------------------------------------- block sizes


def test_different_block_size() -> None:
    # Full attention bs 32 + SWA bs 16 (window 32): hashes every 16 tokens, hits
    # in multiples of 32.
    mgr = manager(100, [pk.FullAttentionSpec(32, 1, 1, "float16"), swa(16, 32)], hash_block_size=16)
    assert mgr.hash_block_size == 16
    common = [i for i in range(7) for _ in range(16)]  # 112 tokens
    mgr.add_request("0", common)
    _, new = admit(mgr, "0")
    assert new == ([1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11])
    # Caching is clamped to the 32-token LCM: 96 tokens -> 3 full, 6 SWA blocks.
    assert cached_positions(mgr, [1, 2, 3, 4]) == [0, 1, 2]
    assert cached_positions(mgr, list(range(5, 12))) == [0, 1, 2, 3, 4, 5]
    mgr.free("0")

    for rid, tokens in (("1", [*common, 7]), ("2", common[:97])):
        mgr.add_request(rid, tokens)
        hit = mgr.get_computed_blocks(rid)
        assert as_lists(hit.block_ids) == ([1, 2, 3], [0, 0, 0, 0, 9, 10])
        assert hit.num_computed_tokens == 96

    # Without the SWA blocks of hashes 6 and 5 the window run ends at 64 tokens.
    mgr.evict_blocks([11, 10])
    mgr.add_request("3", [*common, 7])
    hit = mgr.get_computed_blocks("3")
    assert as_lists(hit.block_ids) == ([1, 2], [0, 0, 7, 8])
    assert hit.num_computed_tokens == 64


def test_full_attention_partial_tail_block_is_cached_with_eagle() -> None:
    # Full attention bs 32 + SWA bs 16 (window 32), hash_block_size 16, EAGLE: vLLM
    # 0.33 keys the block holding the prompt's last hash boundary under that prefix.
    mgr = manager(20, [full(32), swa(16, 32)], use_eagle=True)
    mgr.add_request("a", list(range(50)))
    _, new = admit(mgr, "a")
    assert new == ([1, 2], [3, 4, 5, 6])
    hashes = mgr.block_hashes("a")
    assert len(hashes) == 3
    # vLLM 0.33: the last hash boundary of the prompt (48 tokens) lies inside block 2.
    assert mgr.cached_block_hash(2) == (hashes[2], 0)
    assert mgr.num_cached_block_hashes == 5


def test_full_attention_partial_tail_key_is_added_when_the_block_fills() -> None:
    # Once computed past it, the block carries its full hash and the 48-token one.
    mgr = manager(20, [full(32), swa(16, 32)])
    mgr.add_request("a", list(range(50)))
    _, new = admit(mgr, "a")
    assert new == ([1, 2], [3, 4, 5, 6])
    assert mgr.num_cached_block_hashes == 3
    n = 50
    for i in range(16):
        mgr.append_token_ids("a", [900 + i])
        mgr.allocate_slots("a", 1, num_computed_tokens=n)
        n += 1
    hashes = mgr.block_hashes("a")
    assert mgr.cached_block_hash(2) == (hashes[3], 0)
    assert mgr.num_cached_block_hashes == 7


# --------------------------------------------------------------------------- admission cap


def cap_manager(num_blocks: int) -> pk.KVCacheManager:
    # Full attention needs cdiv(1024, 16) = 64 blocks at most; the SWA group holds
    # at most cdiv(64 - 1 + 128, 16) + 1 = 13 (the startup pool minimum is 77 + null).
    return manager(
        num_blocks, [full(16), swa(16, 64)], max_model_len=1024, max_in_flight_tokens=128
    )


@pytest.mark.parametrize("prompt_len", [512, 1000, 1024])
def test_can_fit_full_sequence_swa_cap_admits_long_prompt(prompt_len: int) -> None:
    mgr = cap_manager(78)
    mgr.add_request("long", list(range(prompt_len)))
    hit = mgr.get_computed_blocks("long")
    new = mgr.allocate_slots(
        "long", 16, num_computed_tokens=0, new_computed_blocks=hit, full_sequence_must_fit=True
    )
    assert as_lists(new) == ([1], [2])
    assert mgr.num_free_blocks == 75


@pytest.mark.parametrize("prompt_len", [256, 48])
def test_can_fit_full_sequence_full_attention_still_gates_oversized(prompt_len: int) -> None:
    mgr = cap_manager(5)
    mgr.add_request("oversized", list(range(prompt_len)))
    hit = mgr.get_computed_blocks("oversized")
    assert refused(
        lambda: mgr.allocate_slots(
            "oversized",
            16,
            num_computed_tokens=0,
            new_computed_blocks=hit,
            full_sequence_must_fit=True,
        )
    )
    assert mgr.num_free_blocks == 4
    # Without the full-sequence gate only the first chunk has to fit.
    new = mgr.allocate_slots("oversized", 16, num_computed_tokens=0, new_computed_blocks=hit)
    assert as_lists(new) == ([1], [2])


@pytest.mark.parametrize(("num_blocks", "admitted"), [(14, True), (13, False)])
def test_swa_admission_cap_alone(num_blocks: int, admitted: bool) -> None:
    mgr = manager(num_blocks, [swa(16, 64)], max_model_len=1024, max_in_flight_tokens=128)
    mgr.add_request("r", list(range(1000)))

    def call() -> Any:
        return mgr.allocate_slots("r", 128, num_computed_tokens=0, full_sequence_must_fit=True)

    if admitted:
        assert as_lists(call()) == ([1, 2, 3, 4, 5, 6, 7, 8],)
    else:
        assert refused(call)


# --------------------------------------------------------------------------- sparse retention


def prefill(mgr: pk.KVCacheManager, rid: str, tokens: list[int]) -> tuple[list[int], ...]:
    mgr.add_request(rid, tokens)
    admit(mgr, rid)
    return as_lists(mgr.get_block_ids(rid)) or ()


@pytest.mark.parametrize(
    ("interval", "cached"),
    [
        (64, [3, 7, 11, 14, 15]),
        (0, [14]),
        (None, list(range(16))),
    ],
)
def test_pure_swa_retention(interval: int | None, cached: list[int]) -> None:
    mgr = manager(40, [swa(16, 16)], prefix_cache_retention_interval=interval)
    ids = prefill(mgr, "a", list(range(256)))
    assert ids == (list(range(1, 17)),)
    assert cached_positions(mgr, ids[0]) == cached
    mgr.free("a")
    # The replay of the same prompt hits up to the last block (its last token is
    # recomputed): the replay boundary (block 14) is always kept.
    mgr.add_request("b", list(range(256)))
    hit = mgr.get_computed_blocks("b")
    assert hit.num_computed_tokens == 240
    assert as_lists(hit.block_ids) == ([0] * 14 + [15],)


def full32_swa8(interval: int | None, num_blocks: int = 100) -> pk.KVCacheManager:
    return manager(num_blocks, [full(32), swa(8, 8)], prefix_cache_retention_interval=interval)


@pytest.mark.parametrize(
    ("prompt_len", "interval", "swa_cached", "replay_hit", "prefix96_hit"),
    [
        # Dense retention still keeps only the window tail of each 32-token segment.
        (65, None, [3, 7], 64, 64),
        (65, 64, [7], 64, 64),
        (65, 0, [7], 64, 64),
        (128, None, [3, 7, 11, 15], 96, 64),
        (128, 64, [7, 11, 15], 96, 64),
        # Retention 0 keeps only the replay boundary (96 tokens -> SWA block 11): the
        # 96-token prefix alone (hits at most 64) finds no window tail.
        (128, 0, [11], 96, 0),
    ],
)
def test_hybrid_retention(
    prompt_len: int, interval: int | None, swa_cached: list[int], replay_hit: int, prefix96_hit: int
) -> None:
    mgr = full32_swa8(interval)
    assert mgr.hash_block_size == 8
    ids = prefill(mgr, "a", list(range(prompt_len)))
    assert cached_positions(mgr, ids[0]) == list(range(prompt_len // 32))
    assert cached_positions(mgr, ids[1]) == swa_cached
    mgr.free("a")
    mgr.add_request("replay", list(range(prompt_len)))
    assert mgr.get_computed_blocks("replay").num_computed_tokens == replay_hit
    mgr.add_request("prefix96", list(range(96)))
    hit = mgr.get_computed_blocks("prefix96")
    assert hit.num_computed_tokens == prefix96_hit
    # Full attention alone would hit 64 tokens: that is the uncached shared prefix.
    assert hit.shared_prefix_boundary == (64 if prefix96_hit == 0 else 0)


def test_hybrid_cache_blocks_clamped_to_lcm() -> None:
    mgr = manager(80, [full(32), swa(16, 32)])
    ids = prefill(mgr, "a", list(range(112)))
    assert ids == ([1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11])
    assert cached_positions(mgr, ids[0]) == [0, 1, 2]
    assert cached_positions(mgr, ids[1]) == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("interval", "message"),
    [
        (33, "multiple of scheduler_block_size"),
        (-32, "non-negative"),
    ],
)
def test_invalid_retention_interval(interval: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        full32_swa8(interval)


def test_retention_interval_needs_a_sparse_group() -> None:
    with pytest.raises(ValueError, match="no sliding-window or Mamba"):
        manager(20, [full(16)], prefix_cache_retention_interval=32)
    manager(20, [full(16)], prefix_cache_retention_interval=0)  # 0 is accepted


PREFIX = list(range(64))


def suffix(base: int) -> list[int]:
    return [base + i for i in range(64)]


@pytest.mark.parametrize("interval", [0, None, 64])
def test_shared_prefix_boundary_pins_the_junction(interval: int | None) -> None:
    mgr = full32_swa8(interval)
    ids = prefill(mgr, "a", PREFIX + suffix(1000))
    sparse = interval == 0
    assert cached_positions(mgr, ids[1]) == (
        [11] if sparse else [3, 7, 11, 15] if interval is None else [7, 11, 15]
    )

    # "d" shares the 64-token prefix with "a". Full attention has it; at retention 0
    # the SWA group lacks the window tail at 64, so the hit is 0 and the boundary
    # reports the uncached shared prefix.
    mgr.add_request("d", PREFIX + suffix(3000))
    hit = mgr.get_computed_blocks("d")
    assert (hit.num_computed_tokens, hit.shared_prefix_boundary) == ((0, 64) if sparse else (64, 0))

    mgr.add_request("b", PREFIX + suffix(2000))
    hit = mgr.get_computed_blocks("b")
    if sparse:
        assert (hit.num_computed_tokens, hit.shared_prefix_boundary) == (0, 64)
        assert as_lists(hit.block_ids) == ([], [])
    else:
        assert (hit.num_computed_tokens, hit.shared_prefix_boundary) == (64, 0)
        assert as_lists(hit.block_ids) == ([1, 2], [0] * 7 + [12])
    new = mgr.allocate_slots(
        "b", 128 - hit.num_computed_tokens, num_computed_tokens=0, new_computed_blocks=hit
    )
    if sparse:
        assert as_lists(new) == ([21, 22, 23, 24], list(range(25, 41)))
        # "b" keeps the junction's window tail (block 7) besides its replay boundary.
        assert cached_positions(mgr, [int(b) for b in mgr.get_block_ids("b")[1]]) == [7, 11]
    else:
        assert as_lists(new) == ([21, 22], list(range(23, 31)))

    # Later siblings now hit the shared prefix.
    for rid, base in (("c", 4000), ("e", 5000)):
        mgr.add_request(rid, PREFIX + suffix(base))
        hit = mgr.get_computed_blocks(rid)
        assert (hit.num_computed_tokens, hit.shared_prefix_boundary) == (64, 0)
        assert as_lists(hit.block_ids) == ([1, 2], [0] * 7 + ([32] if sparse else [12]))
    mgr.check_invariants()


# --------------------------------------------------------------------------- differential


def test_every_recorded_hybrid_vllm_call_gives_the_same_result() -> None:
    from pagedkv._oracle.replay import replay_dump

    with gzip.open(DUMP, "rt") as f:
        header = json.loads(f.readline())
    assert header["manager"]["groups"] == ["FullAttentionSpec", "SlidingWindowSpec"]
    assert header["manager"]["prefix_cache_retention_interval"] == 0
    report = replay_dump(str(DUMP))
    assert report.first_mismatches == []
    assert report.mismatches == 0
    assert report.ops == report.expected_ops == 64456
    assert report.free_blocks_at_end == report.expected_free_blocks_at_end == 4095
    assert report.ok
