"""Block tables and slot mappings, against a per-token reference written here."""

from __future__ import annotations

import numpy as np
import pagedkv as pk
import pytest

torch = pytest.importorskip("torch")

from pagedkv.torch import BlockTable, MultiGroupBlockTable, step_positions  # noqa: E402

torch.set_num_threads(1)


def _reference_slots(
    rows: list[list[int]], block_size: int, req: list[int], pos: list[int]
) -> list[int]:
    pairs = zip(req, pos, strict=True)
    return [rows[r][p // block_size] * block_size + p % block_size for r, p in pairs]


def test_row_edits() -> None:
    t = BlockTable(
        4, max_num_reqs=4, max_num_blocks_per_req=6, max_num_batched_tokens=16, device="cpu"
    )
    assert t.np.dtype == np.int32 and t.np.shape == (4, 6)
    t.append_row(np.array([7, 3], dtype=np.int32), 0)
    t.append_row(np.array([9], dtype=np.int32), 0)
    t.add_row([5, 6, 8], 1)
    assert t.row(0).tolist() == [7, 3, 9] and t.row(1).tolist() == [5, 6, 8]
    t.add_row([2], 0)  # add replaces
    assert t.row(0).tolist() == [2]
    t.swap_row(0, 1)
    assert t.row(0).tolist() == [5, 6, 8] and t.row(1).tolist() == [2]
    t.move_row(0, 3)
    assert t.row(3).tolist() == [5, 6, 8]
    t.clear_row(0)
    assert t.row(0).tolist() == [] and t.np[0].tolist() == [0] * 6
    t.append_row(np.array([], dtype=np.int32), 2)
    assert t.row(2).tolist() == []


def test_row_errors() -> None:
    t = BlockTable(4, 2, 3, 8, device="cpu")
    with pytest.raises(ValueError, match="max_num_blocks_per_req"):
        t.append_row([1, 2, 3, 4], 0)
    t.append_row([1, 2], 0)
    with pytest.raises(ValueError, match="max_num_blocks_per_req"):
        t.append_row([3, 4], 0)
    assert t.row(0).tolist() == [1, 2]  # unchanged by the failed append
    with pytest.raises(IndexError):
        t.append_row([1], 2)
    with pytest.raises(ValueError, match="non-negative"):
        t.append_row([-1], 1)
    with pytest.raises(ValueError, match="1-D"):
        t.append_row([[1]], 1)
    with pytest.raises(TypeError):
        t.clear_row(0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        BlockTable(0, 2, 3, 8, device="cpu")


def test_commit_uploads_rows() -> None:
    t = BlockTable(4, 3, 4, 8, device="cpu")
    t.add_row([4, 5], 0)
    t.add_row([6], 1)
    dev = t.commit(2)
    assert dev.dtype == torch.int32
    assert dev.tolist() == [[4, 5, 0, 0], [6, 0, 0, 0]]
    t.append_row([9], 1)
    assert t.gpu[1].tolist() == [6, 0, 0, 0]  # mirror refreshed only by commit
    assert t.commit(3)[1].tolist() == [6, 9, 0, 0]
    with pytest.raises(ValueError):
        t.commit(4)


def test_slot_mapping_matches_per_token_reference() -> None:
    rng = np.random.default_rng(0)
    bs, reqs, cols = 8, 16, 12
    t = BlockTable(bs, reqs, cols, 512, device="cpu")
    rows: list[list[int]] = []
    for r in range(reqs):
        ids = rng.choice(np.arange(1, 500), size=cols, replace=False).astype(np.int32)
        t.add_row(ids, r)
        rows.append(ids.tolist())
    computed = rng.integers(0, 60, size=10)
    counts = rng.integers(0, 30, size=10)
    counts[3] = 0
    req_rows = rng.permutation(reqs)[:10]
    req_idx, pos = step_positions(req_rows, computed, counts)
    expected_req = [int(r) for r, n in zip(req_rows, counts, strict=True) for _ in range(n)]
    expected_pos = [int(c) + j for c, n in zip(computed, counts, strict=True) for j in range(n)]
    assert req_idx.tolist() == expected_req and pos.tolist() == expected_pos
    n = len(expected_pos)
    slots = t.compute_slot_mapping(req_idx, pos, num_padded_tokens=n + 5)
    assert slots.tolist() == _reference_slots(rows, bs, expected_req, expected_pos) + [-1] * 5
    dev = t.commit_slot_mapping(n + 5)
    assert dev.dtype == torch.int64 and dev.tolist() == slots.tolist()


def test_slot_mapping_rejects_positions_beyond_the_row() -> None:
    t = BlockTable(4, 2, 4, 16, device="cpu")
    t.add_row([3, 4], 0)
    assert t.compute_slot_mapping([0, 0], [0, 7]).tolist() == [12, 19]
    with pytest.raises(ValueError, match="beyond"):
        t.compute_slot_mapping([0], [8])
    with pytest.raises(ValueError, match="out of range"):
        t.compute_slot_mapping([2], [0])
    with pytest.raises(ValueError, match="do not fit"):
        t.compute_slot_mapping([0], [0], num_padded_tokens=17)
    with pytest.raises(ValueError):
        step_positions([0, 1], [0], [1, 1])
    with pytest.raises(ValueError, match="non-negative"):
        step_positions([0], [0], [-1])


def test_rows_from_the_manager_per_group() -> None:
    specs = {
        "full": pk.FullAttentionSpec(4, 1, 8, "float32"),
        "swa": pk.SlidingWindowSpec(4, 1, 8, "float32", sliding_window=6),
    }
    config = pk.get_kv_cache_config(specs, 0, max_model_len=64, num_gpu_blocks_override=40)
    mgr = pk.KVCacheManager(config, max_model_len=64)
    table = MultiGroupBlockTable.from_config(config, 4, 64, 64, "cpu")
    mgr.add_request("a", list(range(18)))
    hit = mgr.get_computed_blocks("a")
    mgr.allocate_slots("a", 18, num_computed_tokens=0, new_computed_blocks=hit)
    table.add_row(mgr.get_block_ids("a"), 0)
    mgr.append_token_ids("a", [99])
    new = mgr.allocate_slots("a", 1, num_computed_tokens=18)
    assert new is not None
    table.append_row(new, 0)
    ids = mgr.get_block_ids("a")
    # Full attention: the table row is the manager's list. Sliding window: the manager
    # has nulled blocks outside the window; the row keeps the old ids there, and the
    # ids the window needs are equal.
    assert table[0].row(0).tolist() == ids[0].tolist()
    swa_row, swa_ids = table[1].row(0), ids[1]
    assert len(swa_row) == len(swa_ids)
    live = swa_ids != 0
    assert swa_row[live].tolist() == swa_ids[live].tolist()
    assert not live[0] and live[-1]
    req_idx, pos = step_positions([0], [18], [1])
    slot_full, slot_swa = table.compute_slot_mappings(req_idx, pos)
    assert slot_full.tolist() == [int(ids[0][4]) * 4 + 2]
    assert slot_swa.tolist() == [int(ids[1][4]) * 4 + 2]
    with pytest.raises(ValueError, match="2 groups"):
        table.append_row([np.array([1])], 0)
