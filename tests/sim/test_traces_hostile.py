"""Hostile trace files: one reader per format serves ``simulate`` and
``trace-stats`` alike, every refusal is one line naming the file (and line) with
exit status 2, and every limit holds whatever the file's form (gzip, blank lines,
one-token rows)."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Any

import pytest
from pagedkv import cli
from pagedkv.sim import tracefile, traces
from pagedkv.sim.tracefile import MAX_REQUEST_TOKENS, TraceFormatError
from pagedkv.sim.traces import load_trace, trace_stats

FAST = ["--memory", "1", "--max-model-len", "4096", "-q"]
MOONCAKE_OK = '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
BURST_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _refused(capsys: pytest.CaptureFixture[str], command: str, *argv: str) -> str:
    code = cli.main([command, *argv])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"pagedkv {command}: error: "), err
    return lines[0].split(": error: ", 1)[1]


def _both_refuse(capsys: pytest.CaptureFixture[str], path: Path, *extra: str) -> str:
    """``simulate`` and ``trace-stats`` refuse ``path`` with the same message."""
    sim = _refused(capsys, "simulate", "--trace", str(path), *extra, *FAST)
    stats = _refused(capsys, "trace-stats", str(path), *extra)
    assert sim == stats
    assert str(path) in sim
    return sim


def _strict(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in the JSON output")

    return json.loads(text, parse_constant=refuse)


def _stats(capsys: pytest.CaptureFixture[str], path: Path) -> dict[str, Any]:
    code = cli.main(["trace-stats", str(path), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc: dict[str, Any] = _strict(out)
    return doc


# ---------------------------------------------------------------------- gzip


def _gz(lines: str) -> bytes:
    return gzip.compress(lines.encode())


@pytest.mark.parametrize("cut", [3, 10, -9, -4, -1])
def test_a_truncated_gzip_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, cut: int
) -> None:
    data = _gz(MOONCAKE_OK * 200)
    p = tmp_path / "t.jsonl.gz"
    p.write_bytes(data[:cut])
    assert "gzip" in _both_refuse(capsys, p)


def test_a_corrupt_gzip_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = bytearray(_gz(MOONCAKE_OK * 200))
    for i in range(20, 40):
        data[i] ^= 0x5A
    p = tmp_path / "t.jsonl.gz"
    p.write_bytes(bytes(data))
    assert "gzip" in _both_refuse(capsys, p)
    # the magic bytes alone, then garbage
    p.write_bytes(b"\x1f\x8b" + b"garbage" * 10)
    assert "gzip" in _both_refuse(capsys, p)
    # a bad CRC at the end
    good = bytearray(_gz(MOONCAKE_OK * 5))
    good[-6] ^= 0xFF
    p.write_bytes(bytes(good))
    assert "gzip" in _both_refuse(capsys, p)


def test_blank_lines_count_against_the_line_limit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tracefile, "MAX_LINES", 1000)
    p = tmp_path / "blank.jsonl.gz"
    p.write_bytes(_gz(MOONCAKE_OK + "\n" * 5000 + " \t\n" * 5000 + MOONCAKE_OK))
    assert "more lines than the limit of 1,000" in _both_refuse(capsys, p)
    csv_path = tmp_path / "blank.csv"
    csv_path.write_text(BURST_HEADER + "\n" * 2000)
    assert "more lines" in _both_refuse(capsys, csv_path)


def test_the_real_line_limit_stops_a_small_gzip_of_blank_lines(tmp_path: Path) -> None:
    p = tmp_path / "bomb.jsonl.gz"
    p.write_bytes(gzip.compress(b"\n" * (tracefile.MAX_LINES + 10), 9))
    assert p.stat().st_size < 100_000
    with pytest.raises(TraceFormatError, match="more lines than the limit"):
        load_trace(p)


def test_decompressed_bytes_are_bounded(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tracefile, "MAX_TRACE_BYTES", 10_000)
    p = tmp_path / "big.jsonl.gz"
    p.write_bytes(_gz(MOONCAKE_OK * 1000))
    assert "more than the limit of 10,000 bytes" in _both_refuse(capsys, p)


def test_text_that_is_not_utf8_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    p = tmp_path / "t.jsonl"
    p.write_bytes(MOONCAKE_OK.encode() + b'{"timestamp": 1\xff\xfe}\n')
    assert ":2: not UTF-8" in _both_refuse(capsys, p)


# ------------------------------------------------------------ requests and tokens


def _rows(fmt: str, n: int) -> str:
    if fmt == "mooncake":
        return "".join(
            json.dumps({"timestamp": i, "input_length": 1, "output_length": 1, "hash_ids": [i]})
            + "\n"
            for i in range(n)
        )
    if fmt == "burstgpt":
        return BURST_HEADER + "".join(f"{i},m,1,1,2,x\n" for i in range(n))
    if fmt == "azure":
        return AZURE_HEADER + "".join(f"2023-11-16 18:00:{i % 60:02d},1,1\n" for i in range(n))
    return "".join(json.dumps({"prompt_len": 1, "output_len": 1}) + "\n" for _ in range(n))


@pytest.mark.parametrize("fmt", ["pagedkv", "mooncake", "burstgpt", "azure"])
def test_one_token_rows_count_against_the_request_limit(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fmt: str,
) -> None:
    monkeypatch.setattr(tracefile, "MAX_REQUESTS", 50)
    monkeypatch.setattr(traces, "MAX_REQUESTS", 50)
    p = tmp_path / f"t.{fmt}.gz"
    p.write_bytes(_gz(_rows(fmt, 51)))
    assert "more requests than the limit of 50" in _both_refuse(capsys, p)
    p.write_bytes(_gz(_rows(fmt, 50)))
    assert _stats(capsys, p)["requests"] == 50


@pytest.mark.parametrize(
    ("fmt", "body"),
    [
        ("pagedkv", json.dumps({"prompt_len": 6_000_000, "output_len": 6_000_000}) + "\n"),
        (
            "mooncake",
            json.dumps(
                {
                    "timestamp": 0,
                    "input_length": 6_000_000,
                    "output_length": 6_000_000,
                    "hash_ids": list(range(6_000_000 // 512 + 1)),
                }
            )
            + "\n",
        ),
        ("burstgpt", BURST_HEADER + "0,m,6000000,6000000,12000000,x\n"),
        ("azure", AZURE_HEADER + "2023-11-16 18:00:00,6000000,6000000\n"),
    ],
)
def test_a_request_past_the_limit_with_prompt_and_output_each_under_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fmt: str, body: str
) -> None:
    assert 6_000_000 < MAX_REQUEST_TOKENS < 12_000_000
    p = tmp_path / "t.txt"
    p.write_text(body)
    msg = _both_refuse(capsys, p)
    assert f"past the limit of {MAX_REQUEST_TOKENS} tokens" in msg


# ------------------------------------------------------------ field values


@pytest.mark.parametrize(
    "line",
    [
        '{"timestamp": 0, "input_length": "10", "output_length": 2, "hash_ids": [1]}',
        '{"timestamp": 0, "input_length": null, "output_length": 2, "hash_ids": [1]}',
        '{"timestamp": 0, "input_length": 10.0, "output_length": 2, "hash_ids": [1]}',
        '{"timestamp": 0, "input_length": 10, "output_length": null, "hash_ids": [1]}',
        '{"timestamp": 0, "input_length": 10, "output_length": "2", "hash_ids": [1]}',
        '{"timestamp": 0, "input_length": 10, "output_length": -1, "hash_ids": [1]}',
        '{"timestamp": 0, "input_length": 10, "output_length": true, "hash_ids": [1]}',
        '{"timestamp": null, "input_length": 10, "output_length": 2, "hash_ids": [1]}',
        '{"timestamp": "5", "input_length": 10, "output_length": 2, "hash_ids": [1]}',
        '{"timestamp": NaN, "input_length": 10, "output_length": 2, "hash_ids": [1]}',
        '{"timestamp": Infinity, "input_length": 10, "output_length": 2, "hash_ids": [1]}',
        '{"timestamp": -Infinity, "input_length": 10, "output_length": 2, "hash_ids": [1]}',
        '{"timestamp": -5, "input_length": 10, "output_length": 2, "hash_ids": [1]}',
        '{"timestamp": 1e300, "input_length": 10, "output_length": 2, "hash_ids": [1]}',
        '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [NaN]}',
        '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": null}',
        '{"timestamp": 0, "input_length": 10, "output_length": 1e400, "hash_ids": [1]}',
    ],
)
def test_trace_stats_refuses_what_simulate_refuses_in_mooncake_traces(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, line: str
) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(MOONCAKE_OK + line + "\n")
    assert f"{p}:2: " in _both_refuse(capsys, p)


@pytest.mark.parametrize(
    "row",
    [
        "0,m,,5,5,x",
        "0,m,abc,5,5,x",
        "0,m,1.5,5,5,x",
        "0,m,-3,5,5,x",
        "0,m,٣,5,5,x",
        "0,m,10,-1,5,x",
        "nan,m,10,5,15,x",
        "inf,m,10,5,15,x",
        "-inf,m,10,5,15,x",
        "1e300,m,10,5,15,x",
        "x,m,10,5,15,x",
    ],
)
def test_bad_burstgpt_fields_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, row: str
) -> None:
    p = tmp_path / "b.csv"
    p.write_text(BURST_HEADER + "0,m,10,5,15,x\n" + row + "\n")
    assert f"{p}:3: " in _both_refuse(capsys, p)


@pytest.mark.parametrize(
    "line",
    [
        '{"prompt_len": null, "output_len": 2}',
        '{"prompt_len": "12", "output_len": 2}',
        '{"prompt_len": 12, "output_len": 2.5}',
        '{"prompt_len": 12, "output_len": 2, "arrival": "1"}',
        '{"prompt_len": 12, "output_len": 2, "arrival": NaN}',
        '{"prompt_len": 12, "output_len": 2, "arrival": -Infinity}',
        '{"prompt_len": 12, "output_len": 2, "arrival": -1}',
        '{"prompt_len": 12, "output_len": 2, "pause": Infinity}',
        '{"prompt": [1, NaN], "output_len": 2}',
        '{"prompt": "1 2 3", "output_len": 2}',
        "[" * 200_000 + "]" * 200_000,
    ],
)
def test_bad_pagedkv_fields_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, line: str
) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"prompt_len": 12, "output_len": 2}\n' + line + "\n")
    assert f"{p}:2: " in _both_refuse(capsys, p)


def test_deep_nesting_on_the_first_line_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"a":' * 200_000 + "1" + "}" * 200_000 + "\n")
    assert "nested too deeply" in _both_refuse(capsys, p)


# ------------------------------------------------------------ forms that are fine


def test_a_utf8_bom_is_dropped(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bom = "\ufeff"
    for name, text, fmt in (
        ("t.jsonl", bom + '{"prompt_len": 12, "output_len": 2}\n', "pagedkv"),
        ("m.jsonl", bom + MOONCAKE_OK, "mooncake"),
        ("b.csv", bom + BURST_HEADER + "0,m,10,5,15,x\n", "burstgpt"),
        ("a.csv", bom + AZURE_HEADER + "2023-11-16 18:00:00,10,5\n", "azure"),
    ):
        p = tmp_path / name
        p.write_text(text, encoding="utf-8")
        doc = _stats(capsys, p)
        assert (doc["format"], doc["requests"]) == (fmt, 1)
        gz = tmp_path / (name + ".gz")
        gz.write_bytes(gzip.compress(text.encode()))
        assert _stats(capsys, gz)["format"] == fmt


def test_quoted_and_padded_csv_headers_are_read(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    p = tmp_path / "b.csv"
    p.write_text(
        '"Timestamp", "Model","Request tokens" ,"Response tokens","Total tokens","Log Type"\n'
        '0,"ChatGPT",10,5,15,"Conversation log"\n1.5,"GPT-4",20,0,20,"API log"\n'
    )
    doc = _stats(capsys, p)
    assert (doc["format"], doc["requests"]) == ("burstgpt", 2)
    assert doc["input_tokens"]["max"] == 20 and doc["output_tokens"]["max"] == 5
    a = tmp_path / "a.csv"
    a.write_text('"TIMESTAMP","ContextTokens","GeneratedTokens"\n"2023-11-16 18:00:00",10,5\n')
    assert _stats(capsys, a)["format"] == "azure"


def test_rows_out_of_time_order_count_from_the_earliest(tmp_path: Path) -> None:
    p = tmp_path / "b.csv"
    p.write_text(BURST_HEADER + "10,m,10,5,15,x\n5,m,20,5,25,x\n20,m,30,5,35,x\n")
    w = load_trace(p)
    assert [r.arrival_s for r in w.requests] == [0.0, 5.0, 15.0]
    assert [len(r.prompt) for r in w.requests] == [20, 10, 30]
    a = tmp_path / "a.csv"
    a.write_text(AZURE_HEADER + "2023-11-16 18:00:10,10,5\n2023-11-16 18:00:00,20,5\n")
    assert [r.arrival_s for r in load_trace(a).requests] == [0.0, 10.0]
    m = tmp_path / "m.jsonl"
    m.write_text(
        '{"timestamp": 3000, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
        '{"timestamp": 1000, "input_length": 10, "output_length": 2, "hash_ids": [2]}\n'
    )
    assert [r.arrival_s for r in load_trace(m).requests] == [1.0, 3.0]
    assert trace_stats(m)["duration_s"] == 2.0


def test_azure_timestamps_with_seven_digit_fractions_and_utc_offsets(tmp_path: Path) -> None:
    p = tmp_path / "a.csv"
    p.write_text(
        AZURE_HEADER + "2023-11-16 18:00:00.0000000+05:00,10,5\n"  # 13:00:00 UTC
        "2023-11-16 13:00:01.5000000Z,10,5\n"
        "2023-11-16T05:00:02.2500000-08:00,10,5\n"  # 13:00:02.25 UTC
        "2023-11-16 13:00:03.1234567,10,5\n"  # no offset: UTC
        "2023-11-16 14:30:04+0130,10,5\n"  # 13:00:04 UTC
        "2023-11-16 13:00:05.5" + "0" * 5000 + ",10,5\n"
    )
    w = load_trace(p)
    got = [r.arrival_s for r in w.requests]
    assert got == pytest.approx([0.0, 1.5, 2.25, 3.1234567, 4.0, 5.5], abs=1e-6)
    assert all(r.arrival_s is not None and math.isfinite(r.arrival_s) for r in w.requests)


@pytest.mark.parametrize(
    "stamp",
    ["2023-11-16", "yesterday", "2023-13-01 00:00:00", "2023-11-16 18:00:00+25:00", ""],
)
def test_bad_azure_timestamps_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, stamp: str
) -> None:
    p = tmp_path / "a.csv"
    p.write_text(AZURE_HEADER + "2023-11-16 18:00:00,10,5\n" + f"{stamp},10,5\n")
    assert f"{p}:3: TIMESTAMP" in _both_refuse(capsys, p)


def test_a_trace_of_only_blank_lines_has_no_request(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    p = tmp_path / "blank.jsonl.gz"
    p.write_bytes(_gz("\n\n\n"))
    assert "no request" in _both_refuse(capsys, p)
    p.write_bytes(_gz(""))
    assert "no request" in _both_refuse(capsys, p)
    m = tmp_path / "m.jsonl"
    m.write_text(MOONCAKE_OK)
    assert "no request" in _refused(capsys, "trace-stats", str(m), "--trace-format", "burstgpt")
