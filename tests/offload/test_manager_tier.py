"""``KVCacheManager(offload=OffloadConfig(...))``: host hits past the device hit,
loads reserved at admission and published once complete, stores of computed
chunks, requests freed mid-transfer, bad input. Block ids follow vLLM's pool and
slots vLLM's CPU tier (fresh first)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pagedkv as pk
import pytest
from pagedkv.errors import InvalidArgumentError, InvalidConfigError, StaleComputedBlocksError

BS = 4
#: bytes of one block id: K and V, 4 tokens, 1 head of size 1, float32
PAGE = 2 * BS * 4
#: bytes of a disk slot's header (magic, checksum, key length, key)
HEADER_BYTES = 80


def config(num_blocks: int = 16, groups: int = 1) -> pk.KVCacheConfig:
    spec = pk.FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype="float32")
    layers = [f"layer{g}" for g in range(groups)]
    return pk.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_groups=[pk.KVCacheGroupSpec([name], spec) for name in layers],
        kv_cache_tensors=[pk.KVCacheTensor(num_blocks * PAGE, [name]) for name in layers],
    )


def manager(chunks: int = 64, **kw: object) -> pk.KVCacheManager:
    off = pk.OffloadConfig(cpu_bytes=chunks * PAGE, **kw)  # type: ignore[arg-type]
    return pk.KVCacheManager(config(), 256, offload=off)


def prompt(seed: int, n: int) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def admit(m: pk.KVCacheManager, rid: str, *, take_host: bool = True) -> tuple[int, int, list[int]]:
    hit = m.get_computed_blocks(rid)
    n = m.num_tokens(rid)
    dev, host = hit.num_computed_tokens, hit.num_host_tokens if take_host else 0
    new = m.allocate_slots(
        rid,
        n - dev - host,
        num_computed_tokens=0,
        num_new_computed_tokens=dev,
        new_computed_blocks=hit,
        num_external_computed_tokens=host,
    )
    assert new is not None
    return dev, host, [int(b) for b in new[0]]


def complete(m: pk.KVCacheManager, plan: pk.TransferPlan) -> None:
    assert m.complete_transfers(plan.jobs, []) == []


def evicted_tail() -> pk.KVCacheManager:
    """r0's 10 blocks stored; r1 evicts r0's tail from the pool."""
    m = manager()
    m.add_request("r0", prompt(1, 40))
    assert admit(m, "r0")[2] == list(range(1, 11))
    plan = m.take_transfer_plan()
    assert plan.loads == [] and len(plan.stores) == 1
    (store,) = plan.stores
    assert store.request_id == "r0" and store.group == 0
    assert store.device_blocks.dtype == np.int32 and store.host_blocks.dtype == np.int64
    assert store.device_blocks.tolist() == list(range(1, 11))
    assert store.host_blocks.tolist() == list(range(10))
    complete(m, plan)
    m.remove_request("r0")
    m.add_request("r1", prompt(2, 40))
    assert admit(m, "r1")[2] == [11, 12, 13, 14, 15, 10, 9, 8, 7, 6]
    plan = m.take_transfer_plan()
    assert plan.stores[0].host_blocks.tolist() == list(range(10, 20))
    complete(m, plan)
    m.remove_request("r1")
    m.check_invariants()
    return m


def test_host_hit_loads_then_publishes() -> None:
    m = evicted_tail()
    m.add_request("r2", [*prompt(1, 40), 7, 7, 7, 7])
    assert admit(m, "r2") == (20, 20, [15])
    assert m.get_block_ids("r2")[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15]
    plan = m.take_transfer_plan()
    assert plan.stores == []
    (load,) = plan.loads
    assert (load.request_id, load.device_blocks.tolist(), load.host_blocks.tolist()) == (
        "r2",
        [6, 7, 8, 9, 10],
        [5, 6, 7, 8, 9],
    )
    assert m.num_transfers_in_flight == 1
    # Not published before the load completes.
    m.add_request("r3", prompt(1, 40))
    hit = m.get_computed_blocks("r3")
    assert (hit.num_computed_tokens, hit.num_host_tokens) == (20, 19)
    complete(m, plan)
    hit = m.get_computed_blocks("r3")
    assert hit.block_ids[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    stats = m.offload_stats()
    assert stats is not None
    assert (stats["loads_completed"], stats["blocks_loaded"], stats["bytes_loaded"]) == (
        1,
        5,
        5 * PAGE,
    )
    assert (stats["stores_completed"], stats["blocks_stored"]) == (2, 20)
    assert (stats["num_chunks"], stats["resident_chunks"]) == (64, 20)
    m.check_invariants()


def test_failed_load_is_recomputed_not_published() -> None:
    m = evicted_tail()
    m.add_request("r2", prompt(1, 44))
    admit(m, "r2")
    plan = m.take_transfer_plan()
    assert m.complete_transfers([], plan.jobs) == [("r2", 20)]
    m.add_request("r3", prompt(1, 40))
    assert m.get_computed_blocks("r3").num_computed_tokens == 20
    m.check_invariants()


def test_freed_mid_load_blocks_stay_held_until_completion() -> None:
    m = evicted_tail()
    m.add_request("r2", prompt(1, 44))
    admit(m, "r2")
    plan = m.take_transfer_plan()
    before = m.num_free_blocks
    m.free("r2")
    assert m.num_free_blocks == before + 11 - 5
    m.check_invariants()
    complete(m, plan)
    assert m.num_free_blocks == before + 11
    stats = m.offload_stats()
    assert stats is not None and stats["completions_after_free"] == 1
    m.check_invariants()


def test_declined_host_hit_computes_the_tokens() -> None:
    m = evicted_tail()
    m.add_request("r2", prompt(1, 44))
    assert admit(m, "r2", take_host=False) == (20, 0, [6, 7, 8, 9, 10, 15])
    assert not m.take_transfer_plan().loads


def test_events_name_the_cpu_medium() -> None:
    m = manager(enable_events=True)
    m.add_request("r0", prompt(1, 8))
    admit(m, "r0")
    complete(m, m.take_transfer_plan())
    events = m.take_offload_events()
    assert len(events) == 1
    keys, medium, removed, metadata_only = events[0]
    assert (medium, removed, metadata_only, len(keys)) == ("CPU", False, False, 2)
    hashes = m.block_hashes("r0")
    assert keys == [pk.offload.offload_key(bytes(h), 0) for h in hashes]


def test_arc_and_chunks_of_two_blocks() -> None:
    m = manager(chunks=8, policy="arc", blocks_per_chunk=2)
    m.add_request("r0", prompt(1, 20))
    admit(m, "r0")
    (store,) = m.take_transfer_plan().stores
    # five blocks cached: two chunks of two blocks are stored
    assert store.device_blocks.tolist() == [1, 2, 3, 4]
    assert store.host_blocks.tolist() == [0, 1, 2, 3]


def test_bad_input_is_refused_and_changes_nothing() -> None:
    with pytest.raises(ValueError, match="cpu_bytes"):
        pk.OffloadConfig(cpu_bytes=0)
    with pytest.raises(ValueError, match="policy"):
        pk.OffloadConfig(cpu_bytes=1 << 20, policy="fifo")
    with pytest.raises(InvalidConfigError, match="smaller than one chunk"):
        pk.KVCacheManager(config(), 256, offload=pk.OffloadConfig(cpu_bytes=PAGE - 1))
    with pytest.raises(TypeError, match="OffloadConfig"):
        pk.KVCacheManager(config(), 256, offload={"cpu_bytes": 1})  # type: ignore[arg-type]
    swa = pk.SlidingWindowSpec(
        block_size=BS, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=8
    )
    cfg = pk.KVCacheConfig(
        num_blocks=16,
        kv_cache_groups=[pk.KVCacheGroupSpec(["l"], swa)],
        kv_cache_tensors=[pk.KVCacheTensor(16 * PAGE, ["l"])],
    )
    with pytest.raises(InvalidConfigError, match="full-attention"):
        pk.KVCacheManager(cfg, 256, offload=pk.OffloadConfig(cpu_bytes=1 << 20))
    with pytest.raises(InvalidConfigError, match="prefix caching"):
        pk.KVCacheManager(
            config(), 256, offload=pk.OffloadConfig(cpu_bytes=1 << 20), enable_caching=False
        )
    plain = pk.KVCacheManager(config(), 256)
    assert plain.offload_stats() is None and not plain.has_offload
    with pytest.raises(InvalidArgumentError, match="no host tier"):
        plain.take_transfer_plan()

    m = evicted_tail()
    m.add_request("r2", prompt(1, 44))
    hit = m.get_computed_blocks("r2")
    free = m.num_free_blocks
    with pytest.raises(InvalidArgumentError, match="host hit"):
        m.allocate_slots(
            "r2",
            16,
            num_computed_tokens=0,
            num_new_computed_tokens=20,
            new_computed_blocks=hit,
            num_external_computed_tokens=8,
        )
    assert m.num_free_blocks == free and m.num_transfers_in_flight == 0
    admit(m, "r2")
    with pytest.raises(InvalidArgumentError, match="not in flight"):
        m.complete_transfers([99])
    plan = m.take_transfer_plan()
    (job,) = plan.jobs
    with pytest.raises(InvalidArgumentError, match="twice"):
        m.complete_transfers([job], [job])
    with pytest.raises(InvalidArgumentError):
        m.complete_transfers([-1])
    assert not m.reset_offload()
    complete(m, plan)
    with pytest.raises(InvalidArgumentError, match="not in flight"):
        m.complete_transfers([job])
    m.check_invariants()


def test_stale_host_hit() -> None:
    m = evicted_tail()
    m.add_request("r2", prompt(1, 44))
    hit = m.get_computed_blocks("r2")
    assert m.reset_offload()
    with pytest.raises(StaleComputedBlocksError, match="look the request up again"):
        m.allocate_slots(
            "r2",
            4,
            num_computed_tokens=0,
            num_new_computed_tokens=20,
            new_computed_blocks=hit,
            num_external_computed_tokens=20,
        )
    m.check_invariants()


def test_readme_example_runs() -> None:
    import re
    from pathlib import Path
    from typing import Any

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = text.split("### A host tier under the manager", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    scope: dict[str, Any] = {}
    exec(compile(match.group(1), "README.md", "exec"), scope)
    mgr = scope["mgr"]
    assert scope["hit"].num_host_tokens == 0
    # the prompt's six full blocks were stored
    assert [s.device_blocks.tolist() for s in scope["plan"].stores] == [[1, 2, 3, 4, 5, 6]]
    assert mgr.offload_stats()["stores_completed"] == 1
    # a block is 2 * 16 tokens * 8 heads * 128 * 2 bytes = 64 KiB
    assert mgr.offload_stats()["num_chunks"] == (1 << 30) // (64 << 10)


def test_write_back_stores_released_chunks_as_they_near_eviction() -> None:
    m = manager(write_policy="write_back", write_back_window=16)
    m.add_request("r0", prompt(1, 40))
    assert admit(m, "r0")[2] == list(range(1, 11))
    assert not m.take_transfer_plan()  # running: nothing is written
    m.remove_request("r0")
    stats = m.offload_stats()
    assert stats is not None and stats["write_back_candidates"] == 10
    # r0's blocks follow the 5 never used in the free queue, tail first: its
    # chunks are written in the order the pool would evict them.
    plan = m.take_transfer_plan()
    assert [
        (t.request_id, t.device_blocks.tolist(), t.host_blocks.tolist()) for t in plan.stores
    ] == [("r0", [10 - i], [i]) for i in range(10)]
    assert m.num_free_blocks == 5  # the copies hold their blocks
    complete(m, plan)
    assert m.num_free_blocks == 15
    m.add_request("r1", prompt(2, 40))
    assert admit(m, "r1")[2] == [11, 12, 13, 14, 15, 10, 9, 8, 7, 6]
    complete(m, m.take_transfer_plan())
    m.remove_request("r1")
    # r0's prompt again: its head on the device, its tail from the tier.
    m.add_request("r2", prompt(1, 44))
    assert admit(m, "r2")[:2] == (20, 20)
    plan = m.take_transfer_plan()
    (load,) = plan.loads
    assert load.device_blocks.tolist() == [6, 7, 8, 9, 10]
    assert load.host_blocks.tolist() == [4, 3, 2, 1, 0]
    complete(m, plan)
    m.check_invariants()


def test_write_policy_bad_input() -> None:
    with pytest.raises(ValueError, match="write_policy"):
        pk.OffloadConfig(cpu_bytes=1 << 20, write_policy="write_around")
    with pytest.raises(ValueError, match="write_back_window"):
        pk.OffloadConfig(cpu_bytes=1 << 20, write_back_window=0)
    with pytest.raises(InvalidConfigError, match="window"):
        pk.KVCacheManager(
            config(),
            256,
            offload=pk.OffloadConfig(
                cpu_bytes=1 << 20,
                blocks_per_chunk=4,
                write_policy="write_back",
                write_back_window=3,
            ),
        )
    m = pk.KVCacheManager(config(), 256)
    with pytest.raises(InvalidArgumentError, match="write policy"):
        m._enable_offload(8, write_policy="write_around")
    with pytest.raises(InvalidArgumentError):
        m._enable_offload(8, write_policy="write_back", write_back_window=-1)
    assert not m.has_offload


def disk_manager(tmp_path: Path, host_chunks: int) -> pk.KVCacheManager:
    off = pk.OffloadConfig(cpu_bytes=host_chunks * PAGE, disk_path=tmp_path, disk_bytes=1 << 16)
    return pk.KVCacheManager(config(), 256, offload=off)


def test_disk_tier_writes_through_and_reads_back(tmp_path: Path) -> None:
    m = disk_manager(tmp_path, 10)
    host: dict[int, bytes] = {}  # host block -> the bytes the engine holds there

    def run(plan: pk.TransferPlan) -> list[tuple[str, int]]:
        for r in plan.disk_reads:
            buf = np.zeros(PAGE, dtype=np.uint8)
            assert m.read_disk_chunk(r.job, buf)
            host[int(r.host_blocks[0])] = buf.tobytes()
        for t in plan.stores:
            for d, h in zip(t.device_blocks.tolist(), t.host_blocks.tolist(), strict=True):
                host[h] = d.to_bytes(4, "little") * (PAGE // 4)
        failed = m.complete_transfers(plan.jobs)
        for w in plan.disk_writes:
            assert w.load_job is None
            assert m.write_disk_chunk(w.job, host[int(w.host_blocks[0])])
        return failed

    m.add_request("r0", prompt(1, 40))
    admit(m, "r0")
    assert run(m.take_transfer_plan()) == []
    m.remove_request("r0")
    plan = m.take_transfer_plan()
    assert len(plan.disk_writes) == 10 and isinstance(plan.disk_writes[0], pk.DiskTransfer)
    run(plan)
    m.add_request("r1", prompt(2, 40))
    admit(m, "r1")
    run(m.take_transfer_plan())
    m.remove_request("r1")
    run(m.take_transfer_plan())  # r1 written through, r0 gone from host memory
    m.add_request("r2", prompt(1, 44))
    assert admit(m, "r2")[:2] == (20, 20)
    plan = m.take_transfer_plan()
    (load,) = plan.loads
    assert [int(r.host_blocks[0]) for r in plan.disk_reads] == load.host_blocks.tolist()
    assert {r.load_job for r in plan.disk_reads} == {load.job}
    run(plan)
    # The bytes read back are those r0's blocks 6..10 were stored with.
    assert [host[h] for h in load.host_blocks.tolist()] == [
        d.to_bytes(4, "little") * (PAGE // 4) for d in range(6, 11)
    ]
    stats = m.offload_stats()
    assert stats is not None
    assert (stats["disk_hits"], stats["disk_reads_completed"], stats["loads_completed"]) == (
        5,
        5,
        1,
    )
    assert stats["disk_tier_chunks"] == 20 and stats["disk_tier_corrupt"] == 0
    m.check_invariants()


def test_disk_tier_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="together"):
        pk.OffloadConfig(cpu_bytes=1 << 20, disk_path=tmp_path)
    with pytest.raises(ValueError, match="together"):
        pk.OffloadConfig(cpu_bytes=1 << 20, disk_bytes=1 << 20)
    a_file = tmp_path / "f"
    a_file.write_bytes(b"x")
    for bad in (tmp_path / "missing", a_file):
        off = pk.OffloadConfig(cpu_bytes=1 << 20, disk_path=bad, disk_bytes=1 << 20)
        with pytest.raises(InvalidConfigError, match="disk path"):
            pk.KVCacheManager(config(), 256, offload=off)
    assert a_file.read_bytes() == b"x"  # never replaced
    off = pk.OffloadConfig(cpu_bytes=1 << 20, disk_path=tmp_path, disk_bytes=10)
    with pytest.raises(InvalidConfigError, match="smaller than one chunk"):
        pk.KVCacheManager(config(), 256, offload=off)
    off = pk.OffloadConfig(
        cpu_bytes=1 << 20, disk_path=tmp_path, disk_bytes=1 << 20, store_threshold=2
    )
    with pytest.raises(InvalidConfigError, match="store_threshold"):
        pk.KVCacheManager(config(), 256, offload=off)
    m = disk_manager(tmp_path, 10)
    with pytest.raises(InvalidArgumentError, match="not in flight"):
        m.read_disk_chunk(1, np.zeros(PAGE, dtype=np.uint8))
    with pytest.raises(InvalidArgumentError, match="not in flight"):
        m.write_disk_chunk(1, b"\0" * PAGE)
    with pytest.raises(TypeError):
        m.write_disk_chunk(1, "text")  # type: ignore[arg-type]
    m.add_request("r0", prompt(1, 8))
    admit(m, "r0")
    m.complete_transfers(m.take_transfer_plan().jobs)
    (w, *_) = m.take_transfer_plan().disk_writes
    with pytest.raises(InvalidArgumentError, match="bytes"):
        m.write_disk_chunk(w.job, b"\0" * (PAGE - 1))
    assert m.num_transfers_in_flight == 2
    assert m.write_disk_chunk(w.job, np.zeros(PAGE, dtype=np.uint8))
    m.check_invariants()


def test_a_full_disk_refuses_the_write_through_and_keeps_serving(tmp_path: Path) -> None:
    # The file size limit makes the second chunk's write fail as a full disk would.
    script = textwrap.dedent(
        f"""
        import resource, signal, sys
        import numpy as np
        import pagedkv as pk
        from tests.offload.test_manager_tier import PAGE, admit, config, prompt
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        off = pk.OffloadConfig(cpu_bytes=8 * PAGE, disk_path=sys.argv[1], disk_bytes=1 << 16)
        m = pk.KVCacheManager(config(), 256, offload=off)
        m.add_request("r0", prompt(1, 8))
        admit(m, "r0")
        m.complete_transfers(m.take_transfer_plan().jobs)
        writes = m.take_transfer_plan().disk_writes
        resource.setrlimit(resource.RLIMIT_FSIZE, ({HEADER_BYTES + PAGE}, resource.RLIM_INFINITY))
        print(*(m.write_disk_chunk(w.job, np.zeros({PAGE}, np.uint8)) for w in writes))
        s = m.offload_stats()
        print(s["disk_writes_completed"], s["disk_writes_failed"], s["disk_tier_write_errors"])
        print(s["resident_chunks"], m.num_transfers_in_flight)
        m.check_invariants()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    assert out.stdout.split() == ["True", "False", "1", "1", "1", "2", "0"]


def test_an_index_only_disk_tier_hits_as_a_disk_of_its_size_would(tmp_path: Path) -> None:
    # The scenario of test_disk_tier_writes_through_and_reads_back with no file:
    # the same chunks are found on disk, and no byte is read or written.
    off = pk.OffloadConfig(cpu_bytes=10 * PAGE, disk_bytes=1 << 16, disk_index_only=True)
    m = pk.KVCacheManager(config(), 256, offload=off)
    empty = np.zeros(0, dtype=np.uint8)

    def run(plan: pk.TransferPlan) -> None:
        for r in plan.disk_reads:
            assert m.read_disk_chunk(r.job, empty)
        m.complete_transfers(plan.jobs)
        for w in plan.disk_writes:
            assert m.write_disk_chunk(w.job, b"")

    for rid, seed in (("r0", 1), ("r1", 2)):
        m.add_request(rid, prompt(seed, 40))
        admit(m, rid)
        run(m.take_transfer_plan())
        m.remove_request(rid)
        run(m.take_transfer_plan())
    m.add_request("r2", prompt(1, 44))
    assert admit(m, "r2")[:2] == (20, 20)
    plan = m.take_transfer_plan()
    assert len(plan.disk_reads) == 5
    with pytest.raises(InvalidArgumentError, match="bytes"):
        m.read_disk_chunk(plan.disk_reads[0].job, np.zeros(PAGE, dtype=np.uint8))
    run(plan)
    stats = m.offload_stats()
    assert stats is not None
    assert (stats["disk_hits"], stats["disk_reads_completed"], stats["disk_tier_chunks"]) == (
        5,
        5,
        20,
    )
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="without a disk_path"):
        pk.OffloadConfig(
            cpu_bytes=PAGE, disk_path=tmp_path, disk_bytes=1 << 16, disk_index_only=True
        )
    m.check_invariants()
