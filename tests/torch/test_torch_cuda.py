"""The end-to-end scenarios of ``tests/gpu/check_cuda.py`` on CUDA (skipped without
a GPU), and on the CPU so the script itself stays correct."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

torch = pytest.importorskip("torch")


torch.set_num_threads(1)


def _script() -> ModuleType:
    path = Path(__file__).parents[1] / "gpu" / "check_cuda.py"
    spec = importlib.util.spec_from_file_location("check_cuda", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_cuda"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ),
    ],
)
def test_scenarios_match_dense(device: str) -> None:
    results = _script().scenarios(device)
    for r in results:
        assert r.ok(), (r.name, r.max_error)
    by_name = {r.name: r for r in results}
    assert by_name["pressure, recompute"].preemptions > 0
    assert by_name["pressure, swap"].swaps > 0
    assert by_name["caching on"].hit_tokens > 0 and by_name["caching off"].hit_tokens == 0
