"""Differential test: every manager call recorded from vLLM 0.33 itself (a
300-request full-attention run, 2,048 blocks of 16 tokens, sha256_cbor, caching
on) is replayed through pagedkv, and every result must be identical."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from pagedkv._oracle.replay import harness_floor, replay_dump
from pagedkv._oracle.trace import TraceConfig, generate

DUMP = Path(__file__).parents[1] / "vectors" / "ops_small.jsonl.gz"


def test_trace_generator_reproduces_the_recorded_trace() -> None:
    with gzip.open(DUMP, "rt") as f:
        header = json.loads(f.readline())
    trace = generate(TraceConfig(**header["trace_config"]))
    assert f"{trace.checksum():016x}" == header["trace_checksum"]


def test_default_trace_checksum_matches_the_published_one() -> None:
    # The checksum the trace format documents for its default configuration.
    assert f"{generate(TraceConfig()).checksum():016x}" == "e3136aa855448b38"


def test_every_recorded_vllm_call_gives_the_same_result() -> None:
    report = replay_dump(str(DUMP))
    assert report.first_mismatches == []
    assert report.mismatches == 0
    assert report.ops == report.expected_ops == 45439
    assert report.free_blocks_at_end == report.expected_free_blocks_at_end
    assert report.ok


def test_the_harness_floor_times_every_call_under_its_api() -> None:
    # The floor's rows line up with the replay's: the same calls counted
    # under the same API names, each timed once.
    report, floor = replay_dump(str(DUMP)), harness_floor(str(DUMP))
    assert floor.ops == report.ops == 45439
    assert {api: n for api, (n, _) in floor.per_api.items()} == {
        api: n for api, (n, _) in report.per_api.items()
    }
    assert floor.per_api["allocate_slots(running)"][0] == 40969
    assert 0 < floor.manager_seconds
