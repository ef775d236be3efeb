"""End to end: a tiny transformer whose KV cache pagedkv manages generates, and every
logit it computes equals the dense reference (no paging, no cache) — with prefix
caching on and off, shared prefixes, preemption by recompute and by swapping,
eviction, forks, and free blocks poisoned with NaN so a read of a released block
would show."""

from __future__ import annotations

import numpy as np
import pagedkv as pk
import pytest

torch = pytest.importorskip("torch")

from pagedkv.torch import PagedEngine, TinyConfig, TinyTransformer  # noqa: E402

torch.set_num_threads(1)

TOL = 1e-4
HYBRID = TinyConfig(layer_types=("full", "sliding", "full", "sliding"), sliding_window=8)


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(HYBRID, seed=0)


def _prompts(
    seed: int, n: int, shared: int = 13, tail: tuple[int, int] = (3, 12)
) -> list[list[int]]:
    """``n`` prompts: a shared prefix, then a few groups of their own, then a tail."""
    rng = np.random.default_rng(seed)
    base = rng.integers(1, 128, size=shared).tolist()
    other = rng.integers(1, 128, size=shared + 5).tolist()
    out = []
    for i in range(n):
        prefix = base if i % 3 else other[: shared + i % 5]
        out.append(prefix + rng.integers(1, 128, size=int(rng.integers(*tail))).tolist())
    return out


def _check_all(engine: PagedEngine) -> float:
    worst = 0.0
    for rid, req in engine.requests.items():
        assert req.finished, rid
        assert len(req.output) == req.max_tokens
        err = engine.max_logit_error(rid)
        assert err < TOL, (rid, err)
        worst = max(worst, err)
    return worst


def _engine(model: TinyTransformer, **kwargs: object) -> PagedEngine:
    defaults: dict[str, object] = {
        "block_size": 4,
        "num_blocks": 128,
        "max_model_len": 48,
        "max_num_reqs": 6,
        "max_num_batched_tokens": 24,
        "poison_free_blocks": True,
    }
    defaults.update(kwargs)
    return PagedEngine(model, **defaults)  # type: ignore[arg-type]


@pytest.mark.parametrize("enable_caching", [True, False])
def test_shared_prefixes_match_dense(model: TinyTransformer, enable_caching: bool) -> None:
    engine = _engine(model, enable_caching=enable_caching)
    assert len(engine.config.kv_cache_groups) == 2
    for i, p in enumerate(_prompts(0, 8)):
        engine.add_request(f"r{i}", p, max_tokens=6, seed=i if i % 2 else None)
    engine.run()
    _check_all(engine)
    hits = sum(r.num_hit_tokens for r in engine.requests.values())
    assert (hits > 0) == enable_caching
    engine.manager.check_invariants()
    assert engine.manager.num_requests == 0


def test_prefix_hit_skips_recomputation_with_identical_logits(model: TinyTransformer) -> None:
    prompt_a = list(range(1, 23))  # 22 tokens: 5 full blocks
    prompt_b = [*prompt_a[:18], 90, 91, 92, 93, 94]
    results = {}
    for caching in (True, False):
        engine = _engine(model, enable_caching=caching)
        engine.add_request("a", prompt_a, max_tokens=4)
        engine.run()
        engine.add_request("b", prompt_b, max_tokens=4)
        engine.run()
        _check_all(engine)
        results[caching] = engine.requests["b"]
    hit, miss = results[True], results[False]
    assert hit.num_hit_tokens == 16 and miss.num_hit_tokens == 0
    # Tokens through the model: the prompt less the hit, then one per decode step.
    assert hit.num_model_tokens == len(prompt_b) - 16 + 3
    assert miss.num_model_tokens == len(prompt_b) + 3
    assert hit.output == miss.output
    last = len(prompt_b) - 1
    torch.testing.assert_close(
        hit.computed_logits()[last], miss.computed_logits()[last], rtol=0, atol=1e-5
    )
    assert 0 not in hit.computed_logits()  # position 0 really was not recomputed


@pytest.mark.parametrize("enable_caching", [True, False])
def test_memory_pressure_preempts_and_recomputes(
    model: TinyTransformer, enable_caching: bool
) -> None:
    engine = _engine(model, num_blocks=34, enable_caching=enable_caching)
    for i, p in enumerate(_prompts(1, 6, tail=(8, 16))):
        engine.add_request(f"r{i}", p, max_tokens=12)
    engine.run()
    assert sum(r.num_preemptions for r in engine.requests.values()) > 0
    _check_all(engine)
    engine.manager.check_invariants()


def test_swap_preemption_keeps_the_data(model: TinyTransformer) -> None:
    # Later requests hit the prefix of swapped-in ones: a block cached before its
    # data was copied back would show.
    prompts = _prompts(1, 8, tail=(8, 16))
    model_tokens = {}
    for mode in ("recompute", "swap"):
        engine = _engine(model, num_blocks=34, preemption_mode=mode, num_cpu_blocks=64)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, max_tokens=12, seed=i if i % 2 else None)
        engine.run()
        _check_all(engine)
        model_tokens[mode] = sum(r.num_model_tokens for r in engine.requests.values())
        if mode == "swap":
            assert sum(r.num_swaps for r in engine.requests.values()) > 0
            assert engine.swap_ins and engine.swapper is not None
            assert engine.swapper.num_free_cpu_blocks == 64
            moved = [m for res in engine.swap_ins for m in res.mapping() if m]
            assert moved, "swap-ins moved blocks to new ids"
    assert model_tokens["swap"] < model_tokens["recompute"]


def test_eviction_then_reuse_of_a_prefix(model: TinyTransformer) -> None:
    engine = _engine(model, num_blocks=40)
    prefix = list(range(30, 50))
    engine.add_request("first", [*prefix, 1, 2], max_tokens=3)
    engine.run()
    # Many other requests cycle the free queue: the prefix's cached blocks are evicted.
    rng = np.random.default_rng(5)
    for i in range(8):
        engine.add_request(f"flood{i}", rng.integers(60, 128, size=24).tolist(), max_tokens=4)
    engine.run()
    engine.add_request("again", [*prefix, 3, 4], max_tokens=3)
    engine.run()
    assert engine.requests["again"].num_hit_tokens < 20
    # And with the cache reset explicitly, nothing hits at all.
    engine.add_request("warm", [*prefix, 5], max_tokens=2)
    engine.run()
    assert engine.manager.reset_prefix_cache()
    engine.add_request("cold", [*prefix, 6], max_tokens=2)
    engine.run()
    assert engine.requests["warm"].num_hit_tokens > 0
    assert engine.requests["cold"].num_hit_tokens == 0
    _check_all(engine)


@pytest.mark.parametrize("enable_caching", [True, False])
def test_fork_copies_the_partial_last_block(model: TinyTransformer, enable_caching: bool) -> None:
    engine = _engine(model, enable_caching=enable_caching)
    engine.add_request("parent", list(range(3, 17)), max_tokens=8)  # 14 prompt tokens
    while engine.requests["parent"].num_computed_tokens < 17:
        engine.step()
    parent = engine.requests["parent"]
    assert parent.num_computed_tokens == 17 and parent.num_tokens == 18
    mgr = engine.manager
    cached_before = {b for b in range(1, 128) if mgr.cached_block_hash(b) is not None}
    child = engine.fork_request("parent", "child", max_tokens=5, seed=3)
    assert child is not None
    # Blocks the fork cached hold copied data (no released block was cached).
    cached_after = {b for b in range(1, 128) if mgr.cached_block_hash(b) is not None}
    live = {int(b) for ids in mgr.get_block_ids("child") for b in ids if b != 0}
    assert cached_after - cached_before <= live
    assert child.num_computed_tokens == 17
    bs = 4
    if enable_caching:
        # 4 full blocks shared through the cache; the partial 5th is copied in each
        # group (sliding-window blocks out of the window are neither).
        assert child.num_hit_tokens == 16
        assert child.copied_blocks == (1, 1)
    else:
        assert child.num_hit_tokens == 0
        assert child.copied_blocks == (-(-17 // bs), 3)  # the window needs blocks 2-4
    engine.run()
    _check_all(engine)
    assert child.num_model_tokens == 5  # the copied tokens were not recomputed
    assert child.output != parent.output[4:]


def test_chunked_local_attention_model() -> None:
    cfg = TinyConfig(layer_types=("chunked", "full", "chunked"), attention_chunk_size=8)
    model = TinyTransformer(cfg, seed=1)
    engine = _engine(model, num_blocks=96)
    for i, p in enumerate(_prompts(2, 5, tail=(6, 20))):
        engine.add_request(f"r{i}", p, max_tokens=10)
    engine.run()
    _check_all(engine)


def test_comparison_catches_a_wrong_block(model: TinyTransformer) -> None:
    engine = _engine(model, poison_free_blocks=False)
    engine.add_request("a", list(range(1, 20)), max_tokens=6)
    engine.step()
    # Point the request's second full-attention block at another block.
    table = engine.block_tables[0]
    row = engine.requests["a"].row
    table.np[row, 1] = table.np[row, 1] + 20
    engine.run()
    assert engine.max_logit_error("a") > 1e-2


def test_bad_input_raises(model: TinyTransformer) -> None:
    engine = _engine(model)
    engine.add_request("a", [1, 2, 3], max_tokens=2)
    with pytest.raises(pk.DuplicateRequestError):
        engine.add_request("a", [1], max_tokens=1)
    with pytest.raises(pk.InvalidArgumentError):
        engine.add_request("b", [1] * 40, max_tokens=10)
    with pytest.raises(pk.InvalidArgumentError):
        engine.add_request("c", [1], max_tokens=0)
    with pytest.raises(pk.InvalidArgumentError, match="not running"):
        engine.fork_request("a", "d", max_tokens=1)
    with pytest.raises(pk.UnknownRequestError):
        engine.fork_request("zzz", "d", max_tokens=1)
    # Only "a" was added; the refused calls left the engine and its manager alone.
    assert list(engine.requests) == ["a"]
    assert engine.requests["a"].prompt == [1, 2, 3]
    assert engine.manager.num_requests == 1
    engine.manager.check_invariants()
    with pytest.raises(ValueError, match="preemption_mode"):
        _engine(model, preemption_mode="drop")
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        _engine(model, preemption_mode="swap")
