"""The torch engine with a host tier end to end: prefixes evicted from the device
(the prefix cache reset and every free block poisoned with NaN) come back from
host memory, and every logit equals the dense reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pagedkv as pk
import pytest

torch = pytest.importorskip("torch")

from pagedkv.torch import PagedEngine, TinyConfig, TinyTransformer  # noqa: E402

torch.set_num_threads(1)
TOL = 1e-4


def _engine(offload: pk.OffloadConfig | None, num_blocks: int = 40) -> PagedEngine:
    model = TinyTransformer(TinyConfig(layer_types=("full", "full")), seed=3)
    return PagedEngine(
        model,
        block_size=4,
        num_blocks=num_blocks,
        max_model_len=64,
        max_num_reqs=4,
        max_num_batched_tokens=32,
        poison_free_blocks=True,
        offload=offload,
    )


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, 128, size=21).tolist()
    return [shared + rng.integers(1, 128, size=int(rng.integers(2, 9))).tolist() for _ in range(6)]


def _serve(engine: PagedEngine, prompts: list[list[int]], tag: str) -> None:
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, max_tokens=4)
    engine.run()


def _check(engine: PagedEngine) -> None:
    for rid, req in engine.requests.items():
        assert req.finished and len(req.output) == req.max_tokens, rid
        err = engine.max_logit_error(rid)
        assert err < TOL, (rid, err)


@pytest.mark.parametrize(("policy", "bpc"), [("lru", 1), ("arc", 2)])
def test_prefix_comes_back_from_host_after_the_device_lost_it(policy: str, bpc: int) -> None:
    prompts = _prompts(0)
    off = pk.OffloadConfig(cpu_bytes=1 << 20, policy=policy, blocks_per_chunk=bpc)
    engine = _engine(off)
    _serve(engine, prompts[:3], "a")
    assert engine.manager.num_requests == 0 and engine.manager.num_transfers_in_flight == 0
    stats = engine.manager.offload_stats()
    assert stats is not None and stats["stores_completed"] > 0
    # The device forgets every prefix; the next forward pass poisons its blocks.
    assert engine.manager.reset_prefix_cache()
    _serve(engine, prompts[3:], "b")
    # The shared prefix (20 tokens in full blocks) came back from the host tier.
    assert engine.host_hit_tokens >= 20 - 4 * bpc
    stats = engine.manager.offload_stats()
    assert stats is not None and stats["loads_completed"] >= 1
    assert stats["loads_failed"] == 0 and stats["completions_after_free"] == 0
    _check(engine)
    engine.manager.check_invariants()


def test_small_pool_preemption_and_a_small_tier() -> None:
    # 17 blocks: requests preempt each other; 8 chunks: the tier evicts too.
    per_block = pk.OffloadConfig.bytes_per_block(_engine(None).config)
    off = pk.OffloadConfig(cpu_bytes=8 * per_block, policy="lru")
    engine = _engine(off, num_blocks=18)
    _serve(engine, _prompts(1), "a")
    _serve(engine, _prompts(2), "b")
    assert engine.manager.reset_prefix_cache()
    _serve(engine, _prompts(2), "c")
    stats = engine.manager.offload_stats()
    assert stats is not None and stats["num_chunks"] == 8
    assert stats["evictions"] > 0 and stats["loads_completed"] > 0
    assert sum(r.num_preemptions for r in engine.requests.values()) > 0
    _check(engine)
    engine.manager.check_invariants()


def test_without_the_tier_the_prefix_is_recomputed() -> None:
    engine = _engine(None)
    prompts = _prompts(0)
    _serve(engine, prompts[:3], "a")
    assert engine.manager.reset_prefix_cache()
    _serve(engine, prompts[3:], "b")
    assert engine.host_hit_tokens == 0
    _check(engine)


def test_write_back_keeps_what_the_device_evicts() -> None:
    # 18 blocks: another prefix's requests evict the first prefix from the
    # device; written back as they were evicted, it comes back from host memory.
    off = pk.OffloadConfig(cpu_bytes=1 << 20, write_policy="write_back", write_back_window=12)
    engine = _engine(off, num_blocks=18)
    first, other = _prompts(0), _prompts(5)
    _serve(engine, first[:3], "a")
    _serve(engine, other, "x")
    stats = engine.manager.offload_stats()
    assert stats is not None and stats["stores_completed"] > 0
    _serve(engine, first[3:], "b")
    assert engine.host_hit_tokens >= 16
    stats = engine.manager.offload_stats()
    assert stats is not None and stats["loads_completed"] >= 1 and stats["loads_failed"] == 0
    _check(engine)
    engine.manager.check_invariants()


def test_write_back_copies_nothing_while_the_device_has_room() -> None:
    # 40 blocks hold every prefix: write-through copies each computed chunk,
    # write-back none (no chunk came near eviction).
    stored = {}
    for policy in ("write_through", "write_back"):
        off = pk.OffloadConfig(cpu_bytes=1 << 20, write_policy=policy, write_back_window=8)
        engine = _engine(off)
        _serve(engine, _prompts(0), "a")
        stats = engine.manager.offload_stats()
        assert stats is not None
        stored[policy] = stats["blocks_stored"]
        _check(engine)
    assert stored["write_through"] >= 5 and stored["write_back"] == 0


def _disk_engine(tmp_path: Path) -> PagedEngine:
    # Host memory for 8 blocks, the disk for far more: the first prefix is
    # pushed out of host memory by the next prompts and kept on disk.
    per_block = pk.OffloadConfig.bytes_per_block(_engine(None).config)
    off = pk.OffloadConfig(cpu_bytes=8 * per_block, disk_path=tmp_path, disk_bytes=1 << 20)
    return _engine(off)


def _serve_then_forget(engine: PagedEngine) -> None:
    _serve(engine, _prompts(0)[:3], "a")
    _serve(engine, _prompts(5), "x")
    assert engine.manager.reset_prefix_cache()


def test_prefix_comes_back_from_disk_through_host_memory(tmp_path: Path) -> None:
    engine = _disk_engine(tmp_path)
    _serve_then_forget(engine)
    stats = engine.manager.offload_stats()
    assert stats is not None and stats["disk_writes_completed"] >= 5
    assert stats["evictions"] > 0  # the first prefix left host memory
    _serve(engine, _prompts(0)[3:], "b")
    stats = engine.manager.offload_stats()
    assert stats is not None and stats["disk_reads_completed"] >= 4
    assert stats["disk_reads_failed"] == 0 and stats["loads_failed"] == 0
    assert engine.host_hit_tokens >= 16
    _check(engine)
    engine.manager.check_invariants()


def test_a_corrupt_disk_is_recomputed_not_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = _disk_engine(tmp_path)
    _serve_then_forget(engine)
    (path,) = tmp_path.iterdir()
    path.write_bytes(b"\x5a" * path.stat().st_size)
    with caplog.at_level("WARNING", logger="pagedkv.torch.engine"):
        _serve(engine, _prompts(0)[3:], "b")
    assert "did not read back" in caplog.text
    stats = engine.manager.offload_stats()
    assert stats is not None and stats["disk_reads_failed"] >= 1
    assert stats["loads_failed"] >= 1 and stats["disk_tier_corrupt"] >= 1
    _check(engine)  # every logit still the dense reference's
    engine.manager.check_invariants()
