"""The vLLM side without vLLM: a missing vLLM is an ``ImportError`` with the
install hint, ``PAGEDKV_VLLM`` takes the usual spellings of yes and no (and warns
on anything else), and a ``--vllm-python`` that prints an unexpected result is
refused with one line (exit status 3, the engine's), never a traceback. Nothing
here imports vLLM."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from pagedkv import cli
from pagedkv.sim import runner, vllm_engine
from pagedkv.vllm import plugin

SMALL = ["-n", "3", "--memory", "1", "--max-model-len", "4096", "-q"]


def test_a_missing_vllm_is_an_import_error_with_the_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "pagedkv.vllm.manager", raising=False)
    import pagedkv.vllm

    with pytest.raises(ImportError, match=r'pip install "pagedkv\[vllm\]"') as e:
        pagedkv.vllm.KVCacheManager  # noqa: B018
    assert e.value.name == "vllm"
    with pytest.raises(ImportError, match="pagedkv"):
        from pagedkv.vllm import KVCacheManager  # noqa: F401
    with pytest.raises(AttributeError):
        pagedkv.vllm.NoSuchThing  # noqa: B018


@pytest.mark.parametrize("value", ["1", "true", "True", "YES", "yes", "on", " On "])
def test_pagedkv_vllm_yes_installs(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    calls: list[int] = []
    monkeypatch.setattr(plugin, "install", lambda: calls.append(1))
    monkeypatch.setenv("PAGEDKV_VLLM", value)
    plugin.register()
    assert calls == [1]


@pytest.mark.parametrize("value", ["", "0", "false", "FALSE", "no", "off"])
def test_pagedkv_vllm_no_leaves_vllm_alone(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    calls: list[int] = []
    monkeypatch.setattr(plugin, "install", lambda: calls.append(1))
    monkeypatch.setenv("PAGEDKV_VLLM", value)
    plugin.register()
    monkeypatch.delenv("PAGEDKV_VLLM")
    plugin.register()
    assert calls == []


@pytest.mark.parametrize("value", ["2", "ture", "enable", "y e s", "1.0", "-1"])
def test_an_unrecognised_pagedkv_vllm_warns_and_does_not_install(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(plugin, "install", lambda: calls.append(1))
    monkeypatch.setenv("PAGEDKV_VLLM", value)
    with pytest.warns(RuntimeWarning, match="PAGEDKV_VLLM=.* is not understood"):
        plugin.register()
    assert calls == []


# ------------------------------------------------------------- --vllm-python


def _valid() -> dict[str, Any]:
    ms = {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0}
    return {
        "engine": "vllm",
        "version": "0.33.0",
        "import_s": 1.5,
        "steps": 10,
        "finished": 3,
        "preemptions": 0,
        "admissions": 3,
        "hit_tokens": 0,
        "query_tokens": 100,
        "first_hit_tokens": 0,
        "first_query_tokens": 100,
        "peak_running": 3,
        "peak_usage": 0.5,
        "mean_usage": 0.25,
        "free_blocks_at_end": 511,
        "usable_blocks": 511,
        "manager_ns": 1000,
        "manager_calls": 40,
        "per_api": {"allocate_slots": [10, 500]},
        "alloc_checksum": "761bd2bb09372862",
        "wall_s": 0.1,
        "timing": {
            "ttft_ms": ms,
            "tpot_ms": ms,
            "itl_ms": ms,
            "e2e_ms": ms,
            "queue_ms": ms,
            "duration_s": 1.0,
            "throughput": {"requests_per_s": 3.0},
            "slo_attainment": None,
        },
    }


def test_a_result_of_the_expected_shape_passes() -> None:
    assert vllm_engine.check_result(_valid()) == _valid()


def _broken(path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(_valid())
    *parents, last = path.split(".")
    d = out
    for p in parents:
        d = d[p]
    if value is KeyError:
        del d[last]
    else:
        d[last] = value
    return out


BROKEN = [
    ("steps", KeyError),
    ("steps", "10"),
    ("steps", -1),
    ("steps", 1.5),
    ("steps", True),
    ("finished", None),
    ("peak_usage", float("nan")),
    ("mean_usage", float("inf")),
    ("version", 33),
    ("alloc_checksum", "xyz"),
    ("alloc_checksum", "761BD2BB0937286Z"),
    ("per_api", [1, 2]),
    ("per_api.allocate_slots", [1]),
    ("per_api.allocate_slots", ["1", 2]),
    ("timing", KeyError),
    ("timing", "fast"),
    ("timing.ttft_ms", KeyError),
    ("timing.ttft_ms.p99", float("nan")),
    ("timing.throughput.requests_per_s", float("-inf")),
]


@pytest.mark.parametrize(("path", "value"), BROKEN, ids=[f"{p}={v!r}" for p, v in BROKEN])
def test_a_result_of_another_shape_is_refused(path: str, value: Any) -> None:
    names = "|".join(path.split(".")) + ("|must hold" if value is KeyError else "")
    with pytest.raises(ValueError, match=names):
        vllm_engine.check_result(_broken(path, value))


def _fake(tmp_path: Path, printed: str) -> Path:
    out = tmp_path / "result.txt"
    out.write_text(printed)
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ncat {out}\n")
    fake.chmod(0o755)
    return fake


def _engine_refused(capsys: pytest.CaptureFixture[str], fake: Path) -> str:
    code = cli.main(["simulate", *SMALL, "--engine", "vllm", "--vllm-python", str(fake)])
    out, err = capsys.readouterr()
    assert code == 3, (out, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedkv simulate: "), err
    return lines[0]


@pytest.mark.parametrize(
    ("printed", "match"),
    [
        ('{"steps": 1}\n', "missing 'version'"),
        ("{}\n", "missing"),
        ('{"oops"\n', "not JSON"),
        ("{" + '"a":' * 100_000 + "1" + "}" * 100_000 + "\n", "not JSON"),
        (json.dumps(_broken("steps", "ten")) + "\n", "'steps' must be a count"),
        (json.dumps(_broken("peak_usage", float("nan"))) + "\n", "NaN is not a number"),
        (json.dumps(_broken("timing.e2e_ms", KeyError)) + "\n", "'timing' must hold"),
        (json.dumps(_broken("per_api", {"x": "y"})) + "\n", "per_api"),
    ],
)
def test_unexpected_output_of_vllm_python_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, printed: str, match: str
) -> None:
    msg = _engine_refused(capsys, _fake(tmp_path, printed))
    assert match in msg


def test_json_that_is_not_an_object_is_refused(tmp_path: Path) -> None:
    # only lines that start with "{" are read as the result
    with pytest.raises(runner.EngineUnavailableError, match="printed no result"):
        runner._run_subprocess({}, str(_fake(tmp_path, "[1, 2]\n")))
