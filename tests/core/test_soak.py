"""A short, bounded soak (``benches/soak.py`` with a fixed operation budget): after a
randomized scheduler run with prefix hits, evictions, preemptions and resets,
removing every request and resetting the cache returns every block and empties
the prefix map. ``check_invariants`` runs at every sample. The long version, which
also tracks RSS, is ``python benches/soak.py --seconds N``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SOAK = Path(__file__).resolve().parents[2] / "benches" / "soak.py"


def load_soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pagedkv_soak", SOAK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "full+sliding_window"])
def test_free_blocks_return_to_baseline_after_a_soak(hybrid: bool) -> None:
    soak = load_soak()
    # A small pool so that preemption and eviction happen; the operation budget
    # (not the clock) bounds the run, so it is the same run on any machine.
    res = soak.run(
        30.0,
        max_ops=60_000,
        num_blocks=96,
        hybrid=hybrid,
        interval=3600.0,
        sample_steps=50,
        seed=7,
        max_batch=16,
    )
    assert res.ops >= 60_000, "the time cap cut the run short"
    assert res.finished > 50
    assert res.preemptions > 0
    assert min(s.free_blocks for s in res.samples) < 96 - 1  # the pool was in use
    assert res.final_free_blocks == 96 - 1
    assert res.reset_ok
    assert res.final_cached_hashes == 0
    assert res.blocks_returned


def test_soak_script_reports_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    soak = load_soak()
    assert (
        soak.main(
            [
                "--seconds",
                "0.5",
                "--interval",
                "0.1",
                "--num-blocks",
                "64",
                "--max-rss-growth-mb",
                "64",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert '"blocks_returned": true' in out
