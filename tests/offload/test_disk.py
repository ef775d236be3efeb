"""The disk tier through Python: round trips, bounded bytes, checked reads,
hostile paths, a full disk."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from pagedkv.errors import InvalidArgumentError, InvalidConfigError
from pagedkv.offload import DiskTier, offload_key

CHUNK = 64
HEADER = 80  # magic, checksum, key length, key (see offload/disk.rs)


def k(i: int) -> bytes:
    return offload_key(i.to_bytes(32, "big"), 0)


def test_chunks_round_trip_and_the_least_recently_used_goes_first(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 3 * (HEADER + CHUNK), CHUNK, enable_events=True)
    assert tier.path is not None
    assert tier.num_slots == 3 and tier.path.parent == tmp_path
    for i in range(3):
        assert tier.put(k(i), bytes([i]) * CHUNK)
    assert tier.get(k(0)) == b"\x00" * CHUNK  # 0 is now the most recent
    assert tier.put(k(3), np.full(CHUNK, 3, dtype=np.uint8))
    assert k(1) not in tier and len(tier) == 3
    out = np.zeros(CHUNK, dtype=np.uint8)
    assert tier.get_into(k(3), out) == "hit" and (out == 3).all()
    assert tier.get_into(k(1), out) == "miss"
    assert tier.take_events() == [
        ([k(0), k(1), k(2)], "STORAGE", False, False),
        ([k(1)], "STORAGE", True, False),
        ([k(3)], "STORAGE", False, False),
    ]
    c = tier.counters()
    assert (c["writes"], c["hits"], c["misses"], c["evictions"]) == (4, 2, 1, 1)
    assert c["bytes_written"] == 4 * CHUNK
    tier.check_invariants()
    path = tier.path
    del tier
    assert not path.exists(), "the tier removes the file it created"


def test_a_corrupt_or_cut_slot_is_a_counted_miss(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 4 * (HEADER + CHUNK), CHUNK)
    tier.put(k(1), b"\x01" * CHUNK)
    tier.put(k(2), b"\x02" * CHUNK)
    assert tier.path is not None
    with open(tier.path, "r+b") as f:
        f.seek(HEADER + 5)
        f.write(b"\xff")
    assert tier.get(k(1)) is None
    os.truncate(tier.path, HEADER + CHUNK + HEADER + 10)
    out = np.full(CHUNK, 9, dtype=np.uint8)
    assert tier.get_into(k(2), out) == "corrupt" and not out.any()
    assert tier.counters()["corrupt"] == 2 and len(tier) == 0
    tier.check_invariants()


def test_hostile_paths_and_sizes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfigError, match="smaller than one chunk"):
        DiskTier(tmp_path, HEADER + CHUNK - 1, CHUNK)
    with pytest.raises(InvalidConfigError):
        DiskTier(tmp_path / "missing", 1 << 20, CHUNK)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(InvalidConfigError, match="not a directory"):
        DiskTier(tmp_path / "file", 1 << 20, CHUNK)
    (tmp_path / "link").symlink_to(tmp_path)
    with pytest.raises(InvalidConfigError, match="not a directory"):
        DiskTier(tmp_path / "link", 1 << 20, CHUNK)
    (tmp_path / "ro").mkdir(mode=0o500)
    if os.geteuid() != 0:  # root writes anywhere
        with pytest.raises(InvalidConfigError, match="cannot create"):
            DiskTier(tmp_path / "ro", 1 << 20, CHUNK)
    with pytest.raises(InvalidConfigError, match="chunk_bytes"):
        DiskTier(tmp_path, 1 << 20, 0)
    tier = DiskTier(tmp_path, 1 << 20, CHUNK)
    with pytest.raises(InvalidArgumentError):
        tier.put(k(1), b"short")
    with pytest.raises(TypeError):
        tier.put(k(1), "text")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        tier.get_into(k(1), np.zeros(CHUNK + 1, dtype=np.uint8))
    assert tier.path is not None
    assert len(tier) == 0 and sorted(os.listdir(tmp_path)) == sorted(
        ["file", "link", "ro", tier.path.name]
    )


def test_an_index_only_tier_keeps_no_file_and_moves_no_bytes(tmp_path: Path) -> None:
    tier = DiskTier(None, 2 * (HEADER + CHUNK), CHUNK, enable_events=True)
    assert tier.path is None and tier.num_slots == 2
    with pytest.raises(InvalidArgumentError):
        tier.put(k(1), b"\x01" * CHUNK)  # no bytes move
    assert tier.put(k(1), b"") and tier.put(k(2), b"")
    assert tier.get(k(1)) == b""
    assert tier.put(k(3), b"")  # 2 was the least recently used
    assert k(2) not in tier and k(1) in tier and k(3) in tier
    c = tier.counters()
    assert (c["writes"], c["evictions"], c["bytes_written"]) == (3, 1, 3 * CHUNK)
    tier.check_invariants()


def test_a_full_disk_refuses_the_write_and_keeps_serving(tmp_path: Path) -> None:
    # the file size limit makes the second write fail as a full disk would
    script = textwrap.dedent(
        f"""
        import resource, signal, sys
        from pagedkv.offload import DiskTier, offload_key
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({HEADER + CHUNK}, resource.RLIM_INFINITY))
        tier = DiskTier(sys.argv[1], 1 << 20, {CHUNK})
        k = lambda i: offload_key(bytes([i]) * 32, 0)
        print(tier.put(k(1), b"a" * {CHUNK}), tier.put(k(2), b"b" * {CHUNK}))
        print(tier.counters()["write_errors"], k(2) in tier, tier.get(k(1)) == b"a" * {CHUNK})
        tier.check_invariants()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["True", "False", "1", "False", "True"]


def test_disk_kv_events_use_vllms_storage_medium(tmp_path: Path) -> None:
    from pagedkv.events import BlockRemoved, BlockStored

    tier = DiskTier(tmp_path, HEADER + CHUNK, CHUNK, enable_events=True)
    tier.put(k(1), b"a" * CHUNK)
    tier.put(k(2), b"b" * CHUNK)
    h = [int.from_bytes(key[:-4][-8:], "big") for key in (k(1), k(2))]
    assert tier.take_kv_events() == [
        BlockStored([h[0]], None, [], 0, None, medium="STORAGE", group_idx=0),
        BlockRemoved([h[0]], medium="STORAGE", group_idx=0),
        BlockStored([h[1]], None, [], 0, None, medium="STORAGE", group_idx=0),
    ]
