"""Public trace formats: Mooncake's FAST'25 JSONL, BurstGPT's and Azure's CSVs,
pagedkv's JSONL (gzip accepted), detected from content; ``pagedkv trace-stats``."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pagedkv import cli
from pagedkv.sim.tracefile import TraceFormatError
from pagedkv.sim.traces import (
    MOONCAKE_BLOCK,
    detect_format,
    load_trace,
    scale_arrivals,
    trace_stats,
)

MOONCAKE = Path(__file__).parents[3] / "shared" / "data" / "mooncake" / "synthetic_trace.jsonl.gz"


def _mooncake(tmp_path: Path) -> Path:
    rows = [
        {"timestamp": 0, "input_length": 700, "output_length": 3, "hash_ids": [1, 2]},
        {"timestamp": 120, "input_length": 1024, "output_length": 0, "hash_ids": [1, 2]},
        {"timestamp": 90, "input_length": 300, "output_length": 5, "hash_ids": [9]},
    ]
    p = tmp_path / "mc.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_mooncake_ids_become_shared_token_blocks(tmp_path: Path) -> None:
    p = _mooncake(tmp_path)
    assert detect_format(p) == "mooncake"
    w = load_trace(p, step_ms=50.0)
    by_len = {len(r.prompt): r for r in w.requests}
    a, b, c = by_len[700], by_len[1024], by_len[300]
    # Equal ids, equal blocks; the last block may be partial (a prefix of it).
    assert np.array_equal(a.prompt[:700], b.prompt[:700])
    assert not np.array_equal(a.prompt[:300], c.prompt)
    assert (len(a.output), len(b.output), len(c.output)) == (3, 1, 5)  # at least one token
    # Milliseconds to steps, in arrival order.
    assert [r.arrival_step for r in w.requests] == [0, 1, 2]


def test_csv_formats_and_gzip_are_detected(tmp_path: Path) -> None:
    burst = tmp_path / "burst.csv"
    burst.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5.0,ChatGPT,120,40,160,Conversation log\n"
        "5.5,GPT-4,300,0,300,API log\n"
    )
    azure = tmp_path / "azure.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
    )
    own = tmp_path / "own.jsonl.gz"
    with gzip.open(own, "wt") as f:
        f.write('{"prompt_len": 10, "output_len": 2}\n')
    assert [detect_format(p) for p in (burst, azure, own)] == ["burstgpt", "azure", "pagedkv"]
    wb = load_trace(burst, step_ms=100.0)
    assert [(len(r.prompt), len(r.output), r.arrival_step) for r in wb.requests] == [
        (120, 40, 0),
        (300, 1, 5),
    ]
    wa = load_trace(azure, step_ms=1000.0)
    assert [(len(r.prompt), len(r.output), r.arrival_step) for r in wa.requests] == [
        (374, 44, 0),
        (396, 109, 4),
    ]
    assert len(load_trace(own).requests) == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}\n',
            "do not make",
        ),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}\n',
            "non-negative",
        ),
        (
            '{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n',
            "missing field 'output_length'",
        ),
        (
            '{"timestamp": 1e308, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n',
            "outside",
        ),
    ],
)
def test_bad_mooncake_lines_are_refused_naming_the_line(
    tmp_path: Path, text: str, message: str
) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n' + text
    )
    with pytest.raises(TraceFormatError, match=message) as e:
        load_trace(p, "mooncake")
    assert "bad.jsonl:2" in str(e.value)


@pytest.mark.skipif(
    not MOONCAKE.exists(), reason="the shared Mooncake trace is not beside the checkout"
)
def test_trace_stats_of_the_mooncake_synthetic_trace(capsys: pytest.CaptureFixture[str]) -> None:
    # The figures the data's README gives: 3,993 requests, mean input 15,325
    # (max 191,378), mean output 149, ceiling 65.1 % with an unlimited cache.
    st = trace_stats(MOONCAKE)
    assert st["format"] == "mooncake" and st["requests"] == 3993
    assert int(st["input_tokens"]["mean"]) == 15325 and st["input_tokens"]["max"] == 191378
    assert round(st["output_tokens"]["mean"]) == 149
    assert round(100 * st["max_prefix_hit_rate"], 1) == 65.1
    assert cli.main(["trace-stats", str(MOONCAKE)]) == 0
    assert "prefix-hit ceiling 65.1 %" in capsys.readouterr().out


def test_trace_stats_ceiling_of_token_traces(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"type": "prefix", "id": "sys", "len": 64}\n'
        '{"prefix": "sys", "prompt_len": 16, "output_len": 2}\n'
        '{"prefix": "sys", "prompt_len": 16, "output_len": 2}\n'
    )
    st = trace_stats(p, block_size=16)
    # The second request finds the 64-token prefix: 64 of 160 input tokens.
    assert st["requests"] == 2 and st["max_prefix_hit_rate"] == round(64 / 160, 4)


def test_simulate_replays_a_mooncake_trace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    p = _mooncake(tmp_path)
    code = cli.main(
        ["simulate", "--trace", str(p), "--memory", "1", "--max-model-len", "4096", "-q", "--json"]
    )
    out: Any = json.loads(capsys.readouterr().out)
    assert code == 0
    run = out["runs"][0]
    assert run["finished"] == 3
    # The second request finds the first's two blocks (its first 1,024 tokens
    # include the 700 the first computed, block by block).
    assert run["hit_tokens"] > 0
    assert MOONCAKE_BLOCK == 512


def test_time_scale_replays_arrivals_faster(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"arrival": 0, "prompt_len": 20, "output_len": 2}\n'
        '{"arrival": 1.0, "prompt_len": 20, "output_len": 2}\n'
        '{"arrival": 3.0, "prompt_len": 20, "output_len": 2, "session": "s"}\n'
        '{"session": "s", "history": true, "pause": 1.0, "prompt_len": 5, "output_len": 2}\n'
    )
    w = scale_arrivals(load_trace(p, step_ms=100.0), 4.0)
    assert [r.arrival_step for r in w.requests] == [0, 2, 7, 0]
    assert w.requests[3].pause == 2
    with pytest.raises(ValueError):
        scale_arrivals(w, 0.0)
    base = ["simulate", "--trace", str(p), "--memory", "1", "--max-model-len", "4096", "-q"]
    assert cli.main([*base, "--json"]) == 0
    slow = json.loads(capsys.readouterr().out)["runs"][0]
    assert cli.main([*base, "--json", "--time-scale", "1000"]) == 0
    fast = json.loads(capsys.readouterr().out)["runs"][0]
    # The same requests arrive together instead of one after the other.
    assert fast["finished"] == slow["finished"] == 4
    assert fast["peak_running"] > slow["peak_running"] == 1


@pytest.mark.parametrize(
    "row",
    ['"' + "x" * 200_000 + '",1,1', "1,2\x003,4", '"unclosed,1,1'],
    ids=["oversized_field", "nul_byte", "broken_quote"],
)
def test_broken_csv_rows_are_refused_naming_the_row(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, row: str
) -> None:
    p = tmp_path / "b.csv"
    p.write_text("Timestamp,Request tokens,Response tokens\n" + row + "\n")
    code = cli.main(["simulate", "--trace", str(p), "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "b.csv:2:" in err and err.count("\n") == 1
