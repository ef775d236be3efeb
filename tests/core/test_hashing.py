"""Block hashes byte-identical with vLLM 0.33 (vectors recorded from vLLM itself).

- ``vllm_hashes_default.json``: PYTHONHASHSEED unset (NONE_HASH = hash_fn of vLLM's
  DEFAULT_NONE_HASH_SEED for sha256 algorithms).
- ``vllm_hashes_seed0.json``: PYTHONHASHSEED=0 (NONE_HASH = hash_fn("0")).
- ``vllm_request_hashes.json``: the request path (tagged extra keys from LoRA,
  multimodal items and cache salt), sha256_cbor, default NONE_HASH.

``sha256`` / ``xxhash`` (pickle-based) cases are not part of pagedkv.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pagedkv as pk
import pytest

from tests._util import (
    VLLM_DEFAULT_NONE_HASH_SEED,
    admit,
    chain,
    event_hash,
    load_vectors,
    make_manager,
)

CBOR_ALGOS = ("sha256_cbor", "xxhash_cbor")
DEFAULT = load_vectors("vllm_hashes_default.json")
SEED0 = load_vectors("vllm_hashes_seed0.json")
REQUESTS = load_vectors("vllm_request_hashes.json")
FILE_SEEDS = (("default", DEFAULT, VLLM_DEFAULT_NONE_HASH_SEED), ("seed0", SEED0, "0"))


def as_tuples(x: Any) -> Any:
    """JSON lists back to the tuples vLLM hashed (CBOR encodes both as arrays)."""
    return tuple(as_tuples(i) for i in x) if isinstance(x, list) else x


@pytest.fixture(autouse=True)
def _no_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    # hash_seed=None reads PYTHONHASHSEED, as vLLM does: keep the environment out.
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


# --------------------------------------------------------------------------- NONE_HASH


def _none_hash_cases() -> list[Any]:
    cases = []
    for file_id, data, file_seed in FILE_SEEDS:
        for key, digest in data["none_hash"].items():
            algo, _, seed = key.partition(":seed=")
            if algo in CBOR_ALGOS:
                cases.append(pytest.param(algo, seed or file_seed, digest, id=f"{file_id}-{key}"))
    return cases


@pytest.mark.parametrize(("algo", "seed", "digest"), _none_hash_cases())
def test_none_hash_is_hash_fn_of_the_seed(algo: str, seed: str, digest: str) -> None:
    assert pk.none_hash(algo, seed).hex() == digest


def test_manager_default_none_hash_is_vllms_deterministic_default() -> None:
    mgr = make_manager(hash_algo="sha256_cbor")
    assert mgr.none_hash.hex() == DEFAULT["none_hash"]["sha256_cbor"]
    assert mgr.none_hash.hex() == REQUESTS["none_hash"]


@pytest.mark.parametrize("algo", CBOR_ALGOS)
def test_hash_seed_behaves_like_pythonhashseed(algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = SEED0["none_hash"][algo]
    assert make_manager(hash_algo=algo, hash_seed="0").none_hash.hex() == expected
    assert make_manager(hash_algo=algo, hash_seed=0).none_hash.hex() == expected
    seeded = make_manager(hash_algo=algo, hash_seed="python hash seed").none_hash.hex()
    assert seeded == SEED0["none_hash"][f"{algo}:seed=python hash seed"]
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert make_manager(hash_algo=algo).none_hash.hex() == expected


def test_xxhash_cbor_without_a_seed_uses_a_random_none_hash() -> None:
    # vLLM keeps a random per-process NONE_HASH for non-cryptographic hashes.
    a = make_manager(hash_algo="xxhash_cbor").none_hash
    b = make_manager(hash_algo="xxhash_cbor").none_hash
    assert a != b
    assert a != pk.none_hash("xxhash_cbor", VLLM_DEFAULT_NONE_HASH_SEED)


def test_seed0_chain_through_the_manager_matches_the_seed0_vectors() -> None:
    for algo in CBOR_ALGOS:
        case = next(
            c for c in SEED0["hash_vectors"] if c["algo"] == algo and c["case"] == "tokens_0_16"
        )
        mgr = make_manager(hash_algo=algo, hash_seed="0")
        mgr.add_request("0", case["token_ids"] + case["child_token_ids"])
        assert [h.hex() for h in mgr.block_hashes("0")] == [case["hash"], case["child_hash"]]


# --------------------------------------------------------------------------- hash_block_tokens


def _hash_cases() -> list[Any]:
    cases = []
    for file_id, data, seed in FILE_SEEDS:
        for c in data["hash_vectors"]:
            if c["algo"] in CBOR_ALGOS:
                cases.append(pytest.param(c, seed, id=f"{file_id}-{c['algo']}-{c['case']}"))
    return cases


@pytest.mark.parametrize(("case", "seed"), _hash_cases())
def test_hash_block_tokens_matches_vllm(case: dict[str, Any], seed: str) -> None:
    algo = case["algo"]
    none_hash = pk.none_hash(algo, seed)
    parent = None if case["parent"] is None else bytes.fromhex(case["parent"])
    extra = as_tuples(case["extra_keys"])
    block_hash = pk.hash_block_tokens(algo, parent, case["token_ids"], extra, none_hash=none_hash)
    assert block_hash.hex() == case["hash"]
    # The child block is chained on it, without extra keys.
    child = pk.hash_block_tokens(
        algo, block_hash, case["child_token_ids"], None, none_hash=none_hash
    )
    assert child.hex() == case["child_hash"]


@pytest.mark.parametrize(("file_id", "data", "seed"), FILE_SEEDS, ids=[f[0] for f in FILE_SEEDS])
def test_salt_vector_is_untagged_while_the_request_path_tags_the_salt(
    file_id: str, data: dict[str, Any], seed: str
) -> None:
    vec = data["chain_bs4_salt_first_block_sha256_cbor"]
    tokens, bs, salt = vec["token_ids"], vec["block_size"], vec["cache_salt"]
    none_hash = pk.none_hash("sha256_cbor", seed)
    # The vector chains vLLM's hash_block_tokens with the untagged key (salt,) on
    # the first block (the function-level form, as in the event vectors).
    got = chain("sha256_cbor", none_hash, tokens, bs, [(salt,), None, None])
    assert [h.hex() for h in got] == vec["hashes"]

    # Through the manager (block size 4, cache_salt): vLLM 0.33's request path
    # tags the key as ("cache_salt", salt), so the first block -- and the chain --
    # differ from the untagged vector, while the event keeps the untagged key.
    mgr = make_manager(bs, 8, hash_algo="sha256_cbor", hash_seed=seed, enable_kv_cache_events=True)
    mgr.add_request("0", tokens, cache_salt=salt)
    tagged = chain("sha256_cbor", none_hash, tokens, bs, [(("cache_salt", salt),), None, None])
    assert mgr.block_hashes("0") == tagged
    assert tagged[0].hex() != vec["hashes"][0]
    admit(mgr, "0")
    (stored,) = mgr.take_events()
    assert stored.extra_keys == [(salt,), None, None]
    assert stored.block_hashes == [event_hash(h) for h in tagged]


def test_token_ids_at_the_u32_limits_hash_like_vllm() -> None:
    # Recorded by running vLLM 0.33's request block hasher (sha256_cbor, block
    # size 4, PYTHONHASHSEED unset) on these token ids.
    mgr = make_manager(4, 8)
    mgr.add_request("r", [2**32 - 1, 2**31, 2**32 - 256, 0, 65535, 65536, 2**24, 255])
    assert [h.hex() for h in mgr.block_hashes("r")] == [
        "b1b36d37d6c49a586657ddf2673577c17030f0e15650920841999579b0aeda49",
        "9576ed58783bcb2d86c3819809d7447f746b94f974443c770244125c4fa956bf",
    ]


# --------------------------------------------------------------------------- request path


def _event_keys(keys: list[list[Any]] | None) -> tuple[Any, ...] | None:
    """vLLM's to_event_extra_keys: mm keys lose the tag, others keep only the value."""
    if keys is None:
        return None
    return tuple(tuple(k[1:]) if k[0] == "mm" else k[1] for k in keys)


def _request_case_id(case: dict[str, Any]) -> str:
    parts = [f"bs{case['block_size']}", f"n{len(case['token_ids'])}"]
    if case["lora_name"]:
        parts.append("lora")
    if case["cache_salt"]:
        parts.append("salt")
    if case["mm_features"]:
        parts.append(f"mm{len(case['mm_features'])}")
    return "-".join(parts)


@pytest.mark.parametrize("case", REQUESTS["cases"], ids=_request_case_id)
def test_request_block_hashes_match_vllm(case: dict[str, Any]) -> None:
    assert REQUESTS["hash_algo"] == "sha256_cbor"
    bs, tokens = case["block_size"], case["token_ids"]
    mgr = make_manager(bs, len(tokens) // bs + 2, enable_kv_cache_events=True)
    assert mgr.none_hash.hex() == REQUESTS["none_hash"]
    lora = {"lora_name": case["lora_name"], "lora_path": "/x"} if case["lora_name"] else {}
    mgr.add_request(
        "r",
        tokens,
        cache_salt=case["cache_salt"],
        mm_features=[tuple(m) for m in case["mm_features"]],
        **lora,
    )

    expected = [b["hash"] for b in case["blocks"]]
    assert [h.hex() for h in mgr.block_hashes("r")] == expected
    # The recorded (tagged) extra keys reproduce the chain with hash_block_tokens.
    keys = [as_tuples(b["extra_keys"]) for b in case["blocks"]]
    got = chain("sha256_cbor", mgr.none_hash, tokens, bs, keys)
    assert [h.hex() for h in got] == expected

    # Caching the whole prompt publishes the untagged keys, one entry per block.
    mgr.allocate_slots("r", len(tokens), num_computed_tokens=0)
    (stored,) = mgr.take_events()
    assert stored.block_hashes == [event_hash(bytes.fromhex(h)) for h in expected]
    assert stored.extra_keys == [_event_keys(b["extra_keys"]) for b in case["blocks"]]
    assert stored.lora_name == case["lora_name"]


# --------------------------------------------------------------------------- xxh3_native


def test_xxh3_native_is_deterministic_given_a_seed_and_differs_from_vllm_hashes() -> None:
    tokens = list(range(64))
    hashes = {}
    for algo in ("sha256_cbor", "xxhash_cbor", "xxh3_native"):
        mgr = make_manager(hash_algo=algo, hash_seed="0")
        mgr.add_request("0", tokens)
        hashes[algo] = mgr.block_hashes("0")
        assert len(hashes[algo]) == 4
    assert hashes["xxh3_native"] != hashes["sha256_cbor"]
    assert hashes["xxh3_native"] != hashes["xxhash_cbor"]

    again = make_manager(hash_algo="xxh3_native", hash_seed="0")
    again.add_request("0", tokens)
    assert again.block_hashes("0") == hashes["xxh3_native"]
    other = make_manager(hash_algo="xxh3_native", hash_seed="1")
    other.add_request("0", tokens)
    assert other.block_hashes("0") != hashes["xxh3_native"]

    assert pk.none_hash("xxh3_native", "0") == again.none_hash
    # Prefix hits work with it like with any other algorithm.
    admit(again, "0")
    again.add_request("1", [*tokens, 1])
    assert again.get_computed_blocks("1").num_computed_tokens == 64


def test_background_hashing_gives_the_same_hashes_hits_and_events() -> None:
    from pagedkv.sim.runner import SimConfig, run_pagedkv
    from pagedkv.sim.workloads import WorkloadOptions, generate

    spec = pk.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float16")
    config = pk.KVCacheConfig(num_blocks=256, kv_cache_groups=[pk.KVCacheGroupSpec(["l"], spec)])
    prompt = list(range(1000))
    managers = [
        pk.KVCacheManager(
            config, 4096, background_hashing=bg, enable_kv_cache_events=True, log_stats=True
        )
        for bg in (False, True)
    ]
    for m in managers:
        for i in range(4):
            m.add_request(f"r{i}", prompt[: 200 + 100 * i], cache_salt="s" if i == 3 else None)
    assert managers[0].block_hashes("r2") == managers[1].block_hashes("r2")
    for i in range(4):
        hits = [m.get_computed_blocks(f"r{i}") for m in managers]
        assert hits[0].num_computed_tokens == hits[1].num_computed_tokens
        got = [
            m.allocate_slots(f"r{i}", 50, num_computed_tokens=0, new_computed_blocks=h)
            for m, h in zip(managers, hits, strict=True)
        ]
        assert [g.tolist() for g in got[0]] == [g.tolist() for g in got[1]]
    assert managers[0].take_events() == managers[1].take_events()
    # The simulator on both: the same allocations, block for block.
    w = generate("chat", WorkloadOptions(num_requests=60))
    runs = [
        run_pagedkv(w, SimConfig(memory_gib=1.0, max_model_len=4096, background_hashing=bg))
        for bg in (False, True)
    ]
    assert runs[0].alloc_checksum == runs[1].alloc_checksum
    assert runs[0].timing == runs[1].timing


def test_prompts_from_any_integer_buffer_hash_alike() -> None:
    """array.array and memoryview prompts are read through NumPy views (no
    per-item Python conversion) and hash exactly as the list does."""
    import array

    spec = pk.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float16")
    config = pk.KVCacheConfig(num_blocks=64, kv_cache_groups=[pk.KVCacheGroupSpec(["l"], spec)])
    m = pk.KVCacheManager(config, 4096)
    prompt = [t * 37 % 70_000 for t in range(200)]
    m.add_request("list", prompt)
    expected = m.block_hashes("list")
    forms: dict[str, Any] = {
        "array I": array.array("I", prompt),
        "array q": array.array("q", prompt),
        "array L": array.array("L", prompt),
        "memoryview of array I": memoryview(array.array("I", prompt)),
        "memoryview of int64 ndarray": memoryview(np.array(prompt, dtype=np.int64)),
    }
    for name, tokens in forms.items():
        m.add_request(name, tokens)
        assert m.block_hashes(name) == expected, name
    with pytest.raises(TypeError, match="must be ints"):
        m.add_request("floats", array.array("d", [1.0, 2.0]))
    with pytest.raises(pk.PagedKVError, match="outside"):
        m.add_request("negative", array.array("i", [5, -1]))
    assert m.num_requests == 1 + len(forms)


# --------------------------------------------------------------------------- memo


@pytest.mark.parametrize("memo", [None, 1, 0])
def test_request_block_hashes_through_the_memo_match_vllm(memo: int | None) -> None:
    """Every recorded request added twice to one manager: the second time its
    plain blocks come from the memo (on by default; 1: a single set, blocks
    displacing each other), and every hash is still vLLM's."""
    mgr = make_manager(16, 4, hash_memo_blocks=memo)
    for round_ in range(2):
        for i, case in enumerate(REQUESTS["cases"]):
            bs, tokens = case["block_size"], case["token_ids"]
            if bs != 16:
                continue
            lora = {"lora_name": case["lora_name"], "lora_path": "/x"} if case["lora_name"] else {}
            rid = f"{round_}-{i}"
            mgr.add_request(
                rid,
                tokens,
                cache_salt=case["cache_salt"],
                mm_features=[tuple(m) for m in case["mm_features"]],
                **lora,
            )
            assert [h.hex() for h in mgr.block_hashes(rid)] == [b["hash"] for b in case["blocks"]]
    hits, misses = mgr.hash_memo_hits, mgr.hash_memo_misses
    if memo == 0:
        assert (hits, misses) == (0, 0)
    elif memo is None:
        # The plain cases' blocks, hashed once and found the second time.
        assert hits > 0 and hits == misses
    else:
        assert misses > hits


def test_the_memo_answers_a_shared_prefix_and_only_prompt_blocks() -> None:
    system = list(range(1000, 1320))  # 20 blocks
    on, off = make_manager(16, 64), make_manager(16, 64, hash_memo_blocks=0)
    for mgr in (on, off):
        mgr.add_request("a", [*system, 1, 2, 3])
        mgr.add_request("b", np.array([*system, *range(16)], dtype=np.int64))
        # Sampled tokens filling a block: hashed, not looked up.
        mgr.append_token_ids("a", list(range(29)))
    assert on.block_hashes("a") == off.block_hashes("a")
    assert on.block_hashes("b") == off.block_hashes("b")
    # "a": 20 blocks hashed; "b": the 20 shared found, its own hashed.
    assert (on.hash_memo_hits, on.hash_memo_misses) == (20, 21)
    assert (off.hash_memo_hits, off.hash_memo_misses) == (0, 0)


def test_a_prompt_takes_the_hashes_it_shares_with_a_live_request() -> None:
    """With a memo of one set (it finds none of these blocks again), a prompt
    that begins like a live request's takes that request's hashes for the
    whole blocks they share, counted as found; a removed request lends none."""
    system = list(range(2000, 2000 + 16 * 12))
    on = make_manager(16, 64, hash_memo_blocks=1)
    off = make_manager(16, 64, hash_memo_blocks=0)
    # "b" differs from "a" at token 16 * 5 + 3: five of its seven blocks shared.
    b = np.array([*system[: 16 * 5 + 3], 1, *range(40)], dtype=np.uint32)
    for mgr in (on, off):
        mgr.add_request("a", [*system, 7, 7])
        mgr.add_request("b", b)
    assert on.block_hashes("b") == off.block_hashes("b")
    assert on.hash_memo_hits == 5
    for mgr in (on, off):
        mgr.remove_request("b")
        mgr.add_request("c", system)
    # The last request to begin so, "b", is gone: all 12 hashed again.
    assert on.block_hashes("c") == off.block_hashes("c")
    assert (on.hash_memo_hits, on.hash_memo_misses) == (5, 12 + 2 + 12)
    for mgr in (on, off):
        mgr.add_request("d", [*system, 5])
    assert on.block_hashes("d") == off.block_hashes("d") == off.block_hashes("a")[:12]
    assert on.hash_memo_hits == 5 + 12


@pytest.mark.parametrize(
    ("value", "error"),
    [(-1, ValueError), (2**22 + 1, ValueError), ("8", TypeError), (1.5, TypeError)],
)
def test_a_bad_memo_size_is_refused(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="hash_memo_blocks"):
        make_manager(16, 8, hash_memo_blocks=value)


def test_token_buffers_grown_past_a_mebibyte_keep_their_tokens() -> None:
    """A request's token and hash buffers grow from the module's small-block
    allocator into the system allocator (16 KiB and more) and past a
    mebibyte, and are freed with the request: every token survives the
    moves, as the hashes show."""
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 32000, size=300_000, dtype=np.uint32)
    whole = make_manager(16, 64, max_model_len=400_000)
    grown = make_manager(16, 64, max_model_len=400_000)
    whole.add_request("r", prompt)
    # 3 KB of tokens (200 hashes: 6.6 KB), appended past 16 KiB, then past
    # 1 MiB.
    grown.add_request("r", prompt[:800])
    for start, end in ((800, 5000), (5000, 200_000), (200_000, 300_000)):
        grown.append_token_ids("r", prompt[start:end])
    assert grown.num_tokens("r") == 300_000
    assert grown.block_hashes("r") == whole.block_hashes("r")
    grown.remove_request("r")
    grown.add_request("again", prompt[:1000])
    assert grown.block_hashes("again") == whole.block_hashes("r")[: 1000 // 16]
