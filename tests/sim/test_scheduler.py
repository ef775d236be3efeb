"""The scheduler policy makes exactly the manager calls vLLM's scheduler makes: on
the recorded 300-request workload its allocations hash to the checksum vLLM 0.33's
own manager produced (FNV-1a over every allocate_slots result)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pagedkv as pk
from pagedkv._oracle.trace import TraceConfig, generate
from pagedkv.sim import ManagerBackend, Request, Scheduler, SchedulerConfig, drive

DUMP = Path(__file__).parents[1] / "vectors" / "ops_small.jsonl.gz"


def _drive(cfg: SchedulerConfig) -> Scheduler[Request]:
    with gzip.open(DUMP, "rt") as f:
        header = json.loads(f.readline())
    trace = generate(TraceConfig(**header["trace_config"]))
    spec = pk.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    config = pk.KVCacheConfig(num_blocks=2048, kv_cache_groups=[pk.KVCacheGroupSpec(["l"], spec)])
    kv = pk.KVCacheManager(config, max_model_len=16384, max_in_flight_tokens=8192)
    sched = Scheduler(ManagerBackend(kv), cfg)
    drive(sched, trace.scheduler_requests())
    kv.check_invariants()
    assert kv.num_free_blocks == 2047
    return sched


def test_scheduler_allocations_match_vllm_on_the_recorded_workload() -> None:
    with gzip.open(DUMP, "rt") as f:
        summary = json.loads(f.readlines()[-1])
    st = _drive(SchedulerConfig(hits_count_as_computed=False)).stats
    assert f"{st.alloc_checksum:016x}" == summary["alloc_checksum"] == "4275bb2c9fb1efb9"
    assert st.steps == summary["steps"]
    assert st.preemptions == summary["preemptions"]
    assert st.manager_calls == summary["manager_calls"]
    assert (st.hit_tokens, st.query_tokens) == (summary["hit_tokens"], summary["query_tokens"])


def test_counting_hits_as_computed_finishes_in_fewer_steps() -> None:
    # vLLM's real scheduler: a prefix hit is not computed again after admission.
    st = _drive(SchedulerConfig()).stats
    assert st.finished == 300
    assert st.steps < 1322
