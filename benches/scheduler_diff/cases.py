"""The scheduler configurations the harness runs, and choosing them by name or pattern."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    """One scheduler configuration and the shape of its workload."""

    name: str
    layout: str = "full"  # full, mla, swa, chunked_local, full+swa, full+mamba
    block_size: int = 16
    prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 16
    #: None: ample blocks; a float: that fraction of what the workload needs at once.
    pressure: float | None = None
    spec: str | None = None  # "ngram" or "draft"
    num_spec_tokens: int = 0
    async_sched: bool = False
    priority: bool = False
    lora: bool = False
    salts: bool = False
    events: bool = False
    connector: str | None = None  # "sync" or "async"
    connector_fail: bool = False
    load_failure_policy: str = "fail"  # vLLM's kv_load_failure_policy
    streaming: bool = False
    aborts: bool = False
    #: Prefix-cache resets (``Scheduler.reset_prefix_cache``) at random steps.
    resets: bool = False
    num_requests: int = 16
    #: A scripted workload instead of a random one (see SCRIPTS).
    script: str | None = None
    max_steps: int = 600


def _cases() -> list[Case]:
    c: list[Case] = []
    # Layouts x prefix caching, synchronous, one block size each.
    layouts = [
        ("full", 16),
        ("mla", 8),
        ("swa", 8),
        ("chunked_local", 8),
        ("full+swa", 16),
        ("full+mamba", 16),
    ]
    for layout, bs in layouts:
        for pc in (True, False):
            c.append(Case(f"{layout}-{'pc' if pc else 'nopc'}-bs{bs}", layout, bs, pc))
    # Block sizes.
    for bs in (4, 8, 32):
        c.append(Case(f"full-pc-bs{bs}", block_size=bs))
    # Chunked prefill (small token budget).
    c.append(Case("chunked-bs16", max_num_batched_tokens=48))
    c.append(Case("chunked-bs4", block_size=4, max_num_batched_tokens=20))
    c.append(Case("chunked-full+swa", "full+swa", 8, max_num_batched_tokens=40))
    c.append(Case("chunked-full+mamba", "full+mamba", 16, max_num_batched_tokens=64))
    # Memory pressure: preemption.
    c.append(Case("pressure-bs16", pressure=0.2))
    c.append(Case("pressure-bs4", block_size=4, pressure=0.2))
    c.append(Case("pressure-nopc", prefix_caching=False, pressure=0.2))
    c.append(Case("pressure-chunked", max_num_batched_tokens=40, pressure=0.2))
    c.append(Case("pressure-full+swa", "full+swa", 8, pressure=0.25))
    c.append(Case("pressure-mla", "mla", 8, pressure=0.2))
    # Longer workloads under pressure: evictions of cached blocks, repeated preemption.
    c.append(Case("pressure-long-bs8", block_size=8, pressure=0.15, num_requests=48))
    c.append(
        Case(
            "stream-async-ngram2-long",
            streaming=True,
            async_sched=True,
            spec="ngram",
            num_spec_tokens=2,
            events=True,
            pressure=0.25,
            num_requests=40,
        )
    )
    # Spec decode.
    c.append(Case("ngram2", spec="ngram", num_spec_tokens=2))
    c.append(Case("ngram3-bs4", block_size=4, spec="ngram", num_spec_tokens=3))
    c.append(Case("ngram3-pressure", spec="ngram", num_spec_tokens=3, pressure=0.2))
    c.append(Case("draft2", spec="draft", num_spec_tokens=2))
    c.append(
        Case(
            "draft3-bs8-chunked",
            block_size=8,
            spec="draft",
            num_spec_tokens=3,
            max_num_batched_tokens=40,
        )
    )
    # Async scheduling.
    c.append(Case("async", async_sched=True))
    c.append(Case("async-bs4-chunked", block_size=4, async_sched=True, max_num_batched_tokens=20))
    c.append(Case("async-pressure", async_sched=True, pressure=0.2))
    c.append(Case("async-ngram2", async_sched=True, spec="ngram", num_spec_tokens=2))
    c.append(
        Case(
            "async-draft2-pressure",
            async_sched=True,
            spec="draft",
            num_spec_tokens=2,
            pressure=0.25,
        )
    )
    c.append(Case("async-full+swa", "full+swa", 8, async_sched=True))
    # Priority, LoRA, cache salts, events, aborts.
    c.append(Case("priority-pressure", priority=True, pressure=0.2))
    c.append(Case("priority-async", priority=True, async_sched=True, pressure=0.25))
    c.append(Case("lora", lora=True))
    c.append(Case("lora-salts-events", lora=True, salts=True, events=True))
    c.append(Case("salts", salts=True))
    c.append(Case("events-bs8", block_size=8, events=True))
    c.append(Case("events-pressure", events=True, pressure=0.2))
    c.append(Case("events-full+swa", "full+swa", 8, events=True))
    c.append(Case("events-full+mamba", "full+mamba", 16, events=True))
    c.append(
        Case("events-async-ngram", events=True, async_sched=True, spec="ngram", num_spec_tokens=2)
    )
    c.append(Case("aborts-async", aborts=True, async_sched=True))
    c.append(Case("aborts-pressure", aborts=True, pressure=0.25))
    # KV connector.
    c.append(Case("connector-sync", connector="sync"))
    c.append(Case("connector-async", connector="async"))
    c.append(Case("connector-sync-fail", connector="sync", connector_fail=True))
    c.append(Case("connector-async-fail", connector="async", connector_fail=True))
    c.append(
        Case(
            "connector-sync-fail-recompute",
            connector="sync",
            connector_fail=True,
            load_failure_policy="recompute",
        )
    )
    c.append(
        Case(
            "connector-async-fail-recompute",
            connector="async",
            connector_fail=True,
            load_failure_policy="recompute",
        )
    )
    c.append(Case("connector-async-pressure", connector="async", pressure=0.25))
    c.append(Case("connector-async-sched", connector="async", async_sched=True))
    # Prefix-cache resets (with and without preempting the running requests).
    c.append(Case("resets", resets=True, events=True))
    c.append(Case("resets-async-pressure", resets=True, async_sched=True, pressure=0.25))
    # Hybrid layouts with the other features.
    c.append(Case("full+swa-ngram2", "full+swa", 8, spec="ngram", num_spec_tokens=2))
    c.append(Case("full+swa-pressure-events", "full+swa", 8, pressure=0.25, events=True))
    c.append(Case("full+mamba-pressure", "full+mamba", 16, pressure=0.25))
    c.append(Case("full+mamba-async", "full+mamba", 16, async_sched=True))
    c.append(Case("full+mamba-ngram2", "full+mamba", 16, spec="ngram", num_spec_tokens=2))
    c.append(Case("mla-async-ngram2", "mla", 8, async_sched=True, spec="ngram", num_spec_tokens=2))
    c.append(Case("swa-pressure-async", "swa", 8, pressure=0.25, async_sched=True))
    c.append(Case("chunked_local-pressure", "chunked_local", 8, pressure=0.25))
    c.append(Case("lora-pressure-priority", lora=True, pressure=0.25, priority=True))
    # Streaming-input sessions.
    c.append(Case("stream", streaming=True))
    c.append(Case("stream-bs4", block_size=4, streaming=True))
    c.append(Case("stream-async", streaming=True, async_sched=True))
    c.append(Case("stream-ngram2", streaming=True, spec="ngram", num_spec_tokens=2))
    c.append(
        Case(
            "stream-async-ngram2", streaming=True, async_sched=True, spec="ngram", num_spec_tokens=2
        )
    )
    c.append(Case("stream-events-pressure", streaming=True, events=True, pressure=0.25))
    c.append(
        Case(
            "stream-async-pressure-aborts",
            streaming=True,
            async_sched=True,
            pressure=0.25,
            aborts=True,
        )
    )
    c.append(
        Case("stream-full+swa-async", "full+swa", 8, streaming=True, async_sched=True, events=True)
    )
    c.append(
        Case(
            "stream-draft2-async",
            streaming=True,
            async_sched=True,
            spec="draft",
            num_spec_tokens=2,
            events=True,
        )
    )
    c.append(Case("stream-async-events", streaming=True, async_sched=True, events=True))
    c.append(
        Case(
            "stream-ngram2-events-bs4",
            block_size=4,
            streaming=True,
            spec="ngram",
            num_spec_tokens=2,
            events=True,
        )
    )
    c.append(
        Case(
            "stream-async-ngram2-events",
            streaming=True,
            async_sched=True,
            spec="ngram",
            num_spec_tokens=2,
            events=True,
        )
    )
    c.append(Case("stream-minimal-sync", block_size=4, events=True, script="stream-minimal"))
    c.append(
        Case(
            "stream-minimal-async",
            block_size=4,
            async_sched=True,
            events=True,
            script="stream-minimal",
        )
    )
    # The same without events: only the probes' hits tell.
    c.append(
        Case("stream-minimal-async-hits", block_size=4, async_sched=True, script="stream-minimal")
    )
    c.append(
        Case(
            "stream-minimal-ngram",
            block_size=4,
            spec="ngram",
            num_spec_tokens=1,
            events=True,
            script="stream-minimal",
        )
    )
    return c


CASES = _cases()


def select(patterns: Iterable[str]) -> list[Case]:
    out: list[Case] = []
    for pat in patterns:
        for p in pat.split(","):
            if p == "all":
                hits = CASES
            else:
                hits = [c for c in CASES if fnmatch.fnmatchcase(c.name, p)]
            if not hits:
                raise SystemExit(f"no configuration matches {p!r} (see --list)")
            out.extend(c for c in hits if c not in out)
    return out


def describe(c: Case) -> str:
    d = {
        f.name: getattr(c, f.name)
        for f in dataclasses.fields(c)
        if f.name != "name" and getattr(c, f.name) != f.default
    }
    return ", ".join(f"{k}={v}" for k, v in d.items()) or "defaults"
