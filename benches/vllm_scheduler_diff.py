"""vLLM 0.33's own Scheduler on vLLM's manager and on pagedkv's drop-in, step by step.

Each run builds two schedulers in one process from the same configuration:
one while vLLM's ``KVCacheManager`` is in place, one after
``pagedkv.vllm.install()``. Both get the same random workload (separate
``Request`` objects with the same ids, prompts, arrival times and block
hasher) and the same fake model: a request's sampled tokens, draft tokens,
draft acceptance, KV-connector loads and load failures are functions of the
seed, the request id and the token position, so both sides see the same model
as long as their schedules agree. After every ``schedule()`` and every
``update_from_output()`` the harness compares:

- the ``SchedulerOutput``: new requests with their block ids and computed
  tokens, cached requests' new block ids, computed and output tokens and
  resumptions, ``num_scheduled_tokens``, spec tokens, preempted and finished
  ids, ``num_common_prefix_blocks``, blocks to zero and block copies, the
  connector's metadata;
- every live request's block table (``kv_cache_manager.get_block_ids``) and
  ``num_computed_tokens``, the pool's free-block count and usage;
- the engine outputs (new tokens, finish reasons) and the scheduler stats
  (prefix-cache hits, queries and requests, connector hits, running and
  waiting counts, KV-cache usage);
- every KV event the scheduler publishes (when events are on).

The first difference ends the run and is reported with its step and a diff.
Run with vLLM's environment (vLLM 0.33 on CPU, the HF config of
``facebook/opt-125m`` in an offline cache):

    HF_HOME=$DROPIN/hf_home $DROPIN/.venv/bin/python benches/vllm_scheduler_diff.py \\
        --configs all --seeds 3 [--json FILE]

``--configs`` takes ``all``, names, or shell-style patterns (``'stream*'``);
``--list`` prints the configurations.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import fnmatch
import json
import os
import sys
import time
import traceback
import zlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HOME", "/tmp/vllm_dropin/hf_home")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

#: Tokens the fake model samples from (opt-125m's vocabulary is 50272).
VOCAB = 1000
EOS_TOKEN_ID = 2
STOP_TOKEN_ID = 3
MODEL = "facebook/opt-125m"
MAX_MODEL_LEN = 2048
#: Steps with nothing scheduled, after the last input, that end a run as stalled.
STALL_STEPS = 20


# --------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------


def mix(*parts: object) -> int:
    """A stable 32-bit hash of ``parts`` (the same in every process)."""
    return zlib.crc32("/".join(map(str, parts)).encode())


class Rng:
    """A small seeded generator whose draws do not depend on Python's hash seed."""

    def __init__(self, *seed: object) -> None:
        import random

        self._r = random.Random(mix(*seed))

    def randint(self, a: int, b: int) -> int:
        return self._r.randint(a, b)

    def random(self) -> float:
        return self._r.random()

    def choice(self, seq: list[Any]) -> Any:
        return self._r.choice(seq)


@dataclass
class ReqSpec:
    """One request of the workload (or one chunk of a streaming session)."""

    rid: str
    arrival: int
    prompt: list[int]
    max_tokens: int
    priority: int = 0
    lora: int | None = None
    salt: str | None = None
    resumable: bool = False
    #: Streaming sessions: the later chunks, each (step, prompt, max_tokens);
    #: a chunk with prompt None ends the session.
    chunks: list[tuple[int, list[int] | None, int]] = field(default_factory=list)
    abort_at: int | None = None
    #: Extra stop tokens (scripted workloads).
    stop: tuple[int, ...] = ()


def make_workload(case: Case, seed: int) -> list[ReqSpec]:
    if case.script is not None:
        return SCRIPTS[case.script](case)
    rng = Rng("workload", case.name, seed)
    bs = case.block_size
    systems = [
        [rng.randint(10, VOCAB - 1) for _ in range(rng.randint(1, 5) * bs + rng.randint(0, bs - 1))]
        for _ in range(3)
    ]
    out: list[ReqSpec] = []
    prompts: list[list[int]] = []
    for i in range(case.num_requests):
        r = rng.random()
        if prompts and r < 0.15:
            prompt = list(rng.choice(prompts))  # an exact repeat: a full hit
        else:
            head = rng.choice(systems) if r < 0.7 else []
            tail = [rng.randint(10, VOCAB - 1) for _ in range(rng.randint(1, 3 * bs + 3))]
            prompt = head + tail
        prompts.append(prompt)
        spec = ReqSpec(
            rid=f"r{i}",
            arrival=rng.randint(0, 6 if case.pressure is not None else 24),
            prompt=prompt,
            max_tokens=rng.randint(1, 3 * bs),
        )
        if case.priority:
            spec.priority = rng.randint(0, 3)
        if case.lora and rng.random() < 0.6:
            spec.lora = rng.randint(1, 3)
        if case.salts and rng.random() < 0.5:
            spec.salt = rng.choice(["s1", "s2"])
        if case.streaming and rng.random() < 0.6:
            spec.resumable = True
            spec.max_tokens = rng.randint(1, bs)
            step = spec.arrival
            for _ in range(rng.randint(1, 3)):
                step += rng.randint(0, 12)
                chunk = [rng.randint(10, VOCAB - 1) for _ in range(rng.randint(1, 2 * bs))]
                spec.chunks.append((step, chunk, rng.randint(1, bs)))
            step += rng.randint(0, 12)
            spec.chunks.append((step, None, 1))
        if case.aborts and rng.random() < 0.25:
            spec.abort_at = spec.arrival + rng.randint(0, 20)
        out.append(spec)
    out.sort(key=lambda s: (s.arrival, int(s.rid[1:])))
    return out


def _stream_minimal(case: Case) -> list[ReqSpec]:
    # Prompt 1..6 samples 100, then 101, a stop token: the session stops with
    # a step in flight (async scheduling) that computes 101. The chunk 7..11
    # replaces 101 (vLLM drops a session's last sampled token), so the cache
    # must hold 1..6, 100, 7..11 and not the block that ended in 101: one
    # probe carries the real content, one the discarded token.
    session = ReqSpec("s", 0, [1, 2, 3, 4, 5, 6], 8, resumable=True, stop=(101,))
    session.chunks = [(1, [7, 8, 9, 10, 11], 1), (12, None, 1)]
    return [session]


SCRIPTS: dict[str, Callable[[Case], list[ReqSpec]]] = {"stream-minimal": _stream_minimal}

#: Scripted model outputs: (request id, output position) -> token.
SCRIPTED_TOKENS: dict[str, dict[tuple[str, int], int]] = {
    "stream-minimal": {("s", 6): 100, ("s", 7): 101},
}
#: Scripted follow-up requests: (step, request id, prompt); the probes read
#: what the cache holds after the session's rewrite.
SCRIPTED_PROBES: dict[str, list[tuple[int, str, list[int]]]] = {
    "stream-minimal": [
        (14, "probe-real", [1, 2, 3, 4, 5, 6, 100, 7, 8, 9, 10, 11, 12]),
        (14, "probe-discarded", [1, 2, 3, 4, 5, 6, 100, 101, 7, 8, 9, 10, 11]),
    ],
}


# --------------------------------------------------------------------------
# The fake model
# --------------------------------------------------------------------------


class FakeModel:
    """Sampled tokens, drafts, acceptance and connector loads, by seed, id and position."""

    def __init__(self, case: Case, seed: int) -> None:
        self.case = case
        self.seed = seed
        self.scripted = SCRIPTED_TOKENS.get(case.script or "", {})

    def token(self, rid: str, pos: int) -> int:
        t = self.scripted.get((rid, pos))
        if t is not None:
            return t
        if self.case.script is not None:
            return 200 + pos
        h = mix("tok", self.seed, rid, pos)
        if h % 29 == 0:
            return EOS_TOKEN_ID
        if h % 31 == 0:
            return STOP_TOKEN_ID
        return 10 + h % (VOCAB - 10)

    def accepted(self, rid: str, pos: int, num_drafts: int) -> int:
        return mix("acc", self.seed, rid, pos) % (num_drafts + 1)

    def drafts(self, rid: str, pos: int, n: int) -> list[int]:
        return [10 + mix("draft", self.seed, rid, pos, i) % (VOCAB - 10) for i in range(n)]

    def external_tokens(self, rid: str, num_prompt: int, num_computed: int) -> int:
        """Tokens the connector offers beyond ``num_computed`` (block-aligned)."""
        bs = self.case.block_size
        blocks = mix("ext", self.seed, rid) % 5
        n = blocks * bs
        room = (num_prompt - 1 - num_computed) // bs * bs
        return max(0, min(n, room))

    def load_fails(self, rid: str) -> bool:
        return self.case.connector_fail and mix("fail", self.seed, rid) % 2 == 0

    def load_delay(self, rid: str) -> int:
        return 1 + mix("delay", self.seed, rid) % 3


# --------------------------------------------------------------------------
# The harness's KV connector (scheduler role only)
# --------------------------------------------------------------------------


def _connector_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
    )

    class DiffMetadata(KVConnectorMetadata):
        def __init__(self, req_ids: list[str]) -> None:
            self.req_ids = req_ids

    class DiffConnector(KVConnectorBase_V1):
        """Offers a per-request number of external tokens; the harness reports the loads."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            extra = self._kv_transfer_config.kv_connector_extra_config
            self.model: FakeModel = extra["model"]
            self.is_async: bool = extra["is_async"]
            self.offered: set[str] = set()
            self.matched: dict[str, tuple[int, int]] = {}
            #: (request id, external block ids) loaded since the harness last looked.
            self.loads: list[tuple[str, list[int]]] = []

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
            rid = request.request_id
            if rid in self.offered:
                return 0, False
            n = self.model.external_tokens(rid, request.num_prompt_tokens, num_computed_tokens)
            self.matched[rid] = (num_computed_tokens, n)
            return n, self.is_async and n > 0

        def update_state_after_alloc(
            self, request: Any, blocks: Any, num_external_tokens: int
        ) -> None:
            rid = request.request_id
            if num_external_tokens <= 0:
                return
            self.offered.add(rid)
            start, _ = self.matched.get(rid, (0, 0))
            bs = self.model.case.block_size
            ids = blocks.get_block_ids()[0]
            self.loads.append((rid, list(ids[start // bs : (start + num_external_tokens) // bs])))

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return DiffMetadata([r.req_id for r in scheduler_output.scheduled_new_reqs])

        def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
            return False, None

        # Worker-side hooks: never called in the scheduler process.
        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
        def wait_for_layer_load(self, layer_name: str) -> None: ...
        def save_kv_layer(self, *args: Any, **kwargs: Any) -> None: ...
        def wait_for_save(self) -> None: ...

    return DiffConnector


_CONNECTOR: dict[str, type] = {}


def _register_connector() -> None:
    if _CONNECTOR:
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    _CONNECTOR["cls"] = _connector_class()
    mod = sys.modules[__name__]
    mod.DiffConnector = _CONNECTOR["cls"]  # type: ignore[attr-defined]
    KVConnectorFactory.register_connector("PagedkvDiffConnector", __name__, "DiffConnector")


# --------------------------------------------------------------------------
# Building a scheduler
# --------------------------------------------------------------------------


class Unsupported(Exception):
    """This vLLM build cannot run the configuration (the reason is the message)."""


def _groups(case: Case) -> list[Any]:
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    bs = case.block_size
    f32 = torch.float32

    def full() -> Any:
        return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=f32)

    def swa() -> Any:
        return SlidingWindowSpec(
            block_size=bs, num_kv_heads=1, head_size=1, dtype=f32, sliding_window=2 * bs + 1
        )

    specs: dict[str, list[Any]] = {
        "full": [full()],
        "mla": [
            MLAAttentionSpec(
                block_size=bs, num_kv_heads=1, head_size=576, dtype=f32, max_tp_shards=1
            )
        ],
        "swa": [swa()],
        "chunked_local": [
            ChunkedLocalAttentionSpec(
                block_size=bs, num_kv_heads=1, head_size=1, dtype=f32, attention_chunk_size=4 * bs
            )
        ],
        "full+swa": [full(), swa()],
        "full+mamba": [
            full(),
            MambaSpec(block_size=bs, shapes=((1, 1),), dtypes=(f32,), mamba_cache_mode="align"),
        ],
    }
    return [KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs[case.layout])]


def num_blocks_for(case: Case, workload: list[ReqSpec]) -> int:
    bs = case.block_size
    groups = len(_groups(case))
    need = [
        (
            len(s.prompt)
            + s.max_tokens
            + sum(len(c[1] or []) + c[2] for c in s.chunks)
            + case.num_spec_tokens
            + bs
        )
        // bs
        + 1
        for s in workload
    ]
    if case.pressure is None:
        return 4 * groups * sum(need) + 64
    # A streaming session keeps its blocks while it waits for its next chunk,
    # and vLLM never preempts a waiting request: sessions parked on every
    # block stall both schedulers (the run then stops, see _run). Room for a
    # quarter of the sessions at their longest, plus one more request.
    sessions = sum(n for n, s in zip(need, workload, strict=True) if s.resumable)
    one = max(need) + 2 + sessions // 4
    return max(one, int(case.pressure * sum(need))) * groups + 1


def build_scheduler(case: Case, model: FakeModel, num_blocks: int) -> Any:
    from vllm.config import (
        CacheConfig,
        KVEventsConfig,
        KVTransferConfig,
        LoRAConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(
        model=MODEL, dtype="float16", seed=42, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=case.max_num_seqs,
        max_num_batched_tokens=case.max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        async_scheduling=case.async_sched,
        is_encoder_decoder=False,
        watermark=0.0,
        policy="priority" if case.priority else "fcfs",
    )
    cache_kwargs: dict[str, Any] = {}
    if "mamba" in case.layout:
        cache_kwargs["mamba_cache_mode"] = "align"
    cache_config = CacheConfig(
        block_size=case.block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=case.prefix_caching,
        **cache_kwargs,
    )
    kv_transfer_config = None
    if case.connector is not None:
        _register_connector()
        kv_transfer_config = KVTransferConfig(
            kv_connector="PagedkvDiffConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"model": model, "is_async": case.connector == "async"},
            kv_load_failure_policy=case.load_failure_policy,
        )
    speculative_config = None
    parallel_config = ParallelConfig()
    if case.spec == "ngram":
        # vLLM runs n-gram drafting on the GPU under async scheduling.
        speculative_config = SpeculativeConfig(
            model="ngram",
            method="ngram_gpu" if case.async_sched else "ngram",
            num_speculative_tokens=case.num_spec_tokens,
        )
    elif case.spec == "draft":
        try:
            speculative_config = SpeculativeConfig(
                model=MODEL,
                method="draft_model",
                num_speculative_tokens=case.num_spec_tokens,
                target_model_config=model_config,
                target_parallel_config=parallel_config,
            )
        except Exception as e:
            raise Unsupported(f"draft-model SpeculativeConfig: {type(e).__name__}: {e}") from e
    lora_config = LoRAConfig(max_loras=2, max_lora_rank=8) if case.lora else None
    events_config = (
        KVEventsConfig(enable_kv_cache_events=True, publisher="null") if case.events else None
    )
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        parallel_config=parallel_config,
        kv_transfer_config=kv_transfer_config,
        speculative_config=speculative_config,
        lora_config=lora_config,
        kv_events_config=events_config,
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=_groups(case)
    )
    cache_config.num_gpu_blocks = num_blocks
    register_all_kvcache_specs(vllm_config)
    cls = AsyncScheduler if case.async_sched else Scheduler
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=case.block_size,
        log_stats=True,
    )


def build_pair(case: Case, model: FakeModel, num_blocks: int) -> tuple[Any, Any]:
    """(vLLM's side, pagedkv's side), each built while its manager class is in place."""
    import pagedkv.vllm as pv

    was = pv.installed()
    try:
        pv.uninstall()
        ref = build_scheduler(case, model, num_blocks)
        pv.install()
        dut = build_scheduler(case, model, num_blocks)
    finally:
        if was:
            pv.install()
        else:
            pv.uninstall()
    assert not type(ref.kv_cache_manager).__module__.startswith("pagedkv"), type(
        ref.kv_cache_manager
    )
    assert type(dut.kv_cache_manager).__module__.startswith("pagedkv"), type(dut.kv_cache_manager)
    return ref, dut


# --------------------------------------------------------------------------
# One side: a scheduler, its requests, the engine loop
# --------------------------------------------------------------------------


class RecordingPublisher:
    """Stands in for vLLM's event publisher and keeps what it was given."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []

    def publish(self, batch: Any) -> None:
        self.batches.append(list(batch.events))

    def shutdown(self) -> None:
        pass


_HASHER: dict[int, Any] = {}


def block_hasher(block_size: int) -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    if not _HASHER:
        init_none_hash(sha256)
    if block_size not in _HASHER:
        _HASHER[block_size] = get_request_block_hasher(block_size, sha256)
    return _HASHER[block_size]


def make_request(
    case: Case,
    rid: str,
    prompt: list[int] | None,
    max_tokens: int,
    arrival: float,
    spec: ReqSpec | None = None,
    resumable: bool = False,
) -> Any:
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    stop = [STOP_TOKEN_ID, *(spec.stop if spec is not None else ())]
    sp = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop)
    sp.update_from_generation_config({}, EOS_TOKEN_ID)
    lora = None
    if spec is not None and spec.lora is not None:
        lora = LoRARequest(f"lora{spec.lora}", spec.lora, f"/nonexistent/lora{spec.lora}")
    return Request(
        request_id=rid,
        prompt_token_ids=list(prompt) if prompt is not None else [],
        sampling_params=sp,
        pooling_params=None,
        arrival_time=arrival,
        lora_request=lora,
        cache_salt=spec.salt if spec is not None else None,
        priority=spec.priority if spec is not None else 0,
        block_hasher=block_hasher(case.block_size),
        resumable=resumable,
    )


class Side:
    """One scheduler driven the way vLLM's engine core drives it."""

    def __init__(self, name: str, sched: Any, case: Case, model: FakeModel) -> None:
        self.name = name
        self.sched = sched
        self.case = case
        self.model = model
        self.publisher = RecordingPublisher()
        sched.kv_event_publisher = self.publisher
        #: Async scheduling: scheduled steps whose output is not processed yet,
        #: with each request's prefill-chunk flag at scheduling time.
        self.queue: deque[tuple[Any, dict[str, bool]]] = deque()
        #: Connector loads in flight: request id -> (done at step, fails).
        self.loading: dict[str, tuple[int, bool]] = {}
        self.step_no = 0
        #: Results of inputs given between steps (compared with the next step).
        self.notes: list[dict[str, Any]] = []

    # -- inputs ---------------------------------------------------------------

    def add(self, req: Any) -> None:
        self.sched.add_request(req)

    def abort(self, rid: str) -> None:
        from vllm.v1.request import RequestStatus

        self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    # -- the model --------------------------------------------------------------

    def model_output(self, so: Any, prefill: dict[str, bool]) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in ids:
            req = self.sched.requests.get(rid)
            if req is None or prefill.get(rid, True):
                sampled.append([])
                continue
            pos = req.num_tokens
            drafts = so.scheduled_spec_decode_tokens.get(rid) or []
            n = 1 + self.model.accepted(rid, pos, len(drafts))
            sampled.append([self.model.token(rid, pos + i) for i in range(n)])
        kv_out = None
        conn = self.sched.connector
        if conn is not None:
            kv_out = KVConnectorOutput(
                finished_recving=set(), invalid_block_ids=set(), failed_recving=set()
            )
            for rid, block_ids in conn.loads:
                fails = self.model.load_fails(rid)
                if self.case.connector == "async":
                    self.loading[rid] = (self.step_no + self.model.load_delay(rid), fails)
                elif fails and block_ids:
                    kv_out.invalid_block_ids.add(block_ids[-1])
            conn.loads.clear()
            for rid, (when, fails) in sorted(self.loading.items()):
                if when <= self.step_no:
                    del self.loading[rid]
                    if rid not in self.sched.requests:
                        continue
                    # A failed load is done too: the worker reports both.
                    kv_out.finished_recving.add(rid)
                    if fails:
                        kv_out.failed_recving.add(rid)
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=kv_out,
        )

    # -- the engine loop ---------------------------------------------------------

    def step(self) -> list[tuple[str, dict[str, Any]]]:
        """One engine step; returns the observations to compare, in order."""
        obs: list[tuple[str, dict[str, Any]]] = []
        if self.notes:
            obs.append(("inputs", {"notes": self.notes}))
            self.notes = []
        sched = self.sched
        if not self.case.async_sched:
            so = sched.schedule()
            obs.append(("schedule", snap_output(so)))
            prefill = {r: sched.requests[r].is_prefill_chunk for r in so.num_scheduled_tokens}
            mro = self.model_output(so, prefill)
            outs = sched.update_from_output(so, mro)
            obs.append(("update", self.snap_after_update(outs)))
            if self.case.spec and so.total_num_scheduled_tokens > 0:
                self.propose_drafts(so)
            self.step_no += 1
            return obs
        # Async scheduling: the engine core's batch queue of two.
        if sched.has_requests():
            so = sched.schedule()
            obs.append(("schedule", snap_output(so)))
            prefill = {r: sched.requests[r].is_prefill_chunk for r in so.num_scheduled_tokens}
            self.queue.appendleft((so, prefill))
            executed = so.total_num_scheduled_tokens > 0
            if len(self.queue) < 2 and (executed or sched.has_requests()):
                self.step_no += 1
                return obs
        elif not self.queue:
            self.step_no += 1
            return obs
        so, prefill = self.queue.pop()
        mro = self.model_output(so, prefill)
        outs = sched.update_from_output(so, mro)
        obs.append(("update", self.snap_after_update(outs)))
        self.step_no += 1
        return obs

    def propose_drafts(self, so: Any) -> None:
        from vllm.v1.outputs import DraftTokenIds

        ids, drafts = [], []
        for rid in so.num_scheduled_tokens:
            req = self.sched.requests.get(rid)
            if req is None or req.is_finished():
                continue
            ids.append(rid)
            drafts.append(self.model.drafts(rid, req.num_tokens, self.case.num_spec_tokens))
        self.sched.update_draft_token_ids(DraftTokenIds(ids, drafts))

    def busy(self) -> bool:
        return bool(self.sched.has_requests() or self.queue or self.loading)

    # -- observations -------------------------------------------------------------

    def snap_after_update(self, outs: dict[int, Any]) -> dict[str, Any]:
        sched = self.sched
        mgr = sched.kv_cache_manager
        snap: dict[str, Any] = {}
        tokens: dict[str, Any] = {}
        stats = None
        for client in sorted(outs):
            eco = outs[client]
            for o in eco.outputs:
                tokens[o.request_id] = (
                    list(o.new_token_ids),
                    plain(o.finish_reason),
                    plain(o.stop_reason),
                )
            if eco.scheduler_stats is not None:
                stats = eco.scheduler_stats
        snap["outputs"] = tokens
        if stats is not None:
            snap["stats"] = {
                "num_running_reqs": stats.num_running_reqs,
                "num_waiting_reqs": stats.num_waiting_reqs,
                "num_skipped_waiting_reqs": stats.num_skipped_waiting_reqs,
                "kv_cache_usage": round(stats.kv_cache_usage, 12),
                "prefix_cache_stats": cache_stats(stats.prefix_cache_stats),
                "connector_prefix_cache_stats": cache_stats(stats.connector_prefix_cache_stats),
                "spec_decoding_stats": plain(stats.spec_decoding_stats),
                "kv_fetch": plain(stats.num_kv_fetch_reqs_by_stage),
            }
        snap["num_free_blocks"] = mgr.block_pool.get_num_free_blocks()
        snap["usage"] = round(mgr.usage, 12)
        snap["requests"] = {
            rid: {
                "status": req.status.name,
                "num_computed_tokens": req.num_computed_tokens,
                "num_tokens": req.num_tokens,
                "block_ids": [list(g) for g in mgr.get_block_ids(rid)],
            }
            for rid, req in sorted(sched.requests.items())
        }
        events = [plain(e) for batch in self.publisher.batches for e in batch]
        self.publisher.batches.clear()
        snap["events"] = events
        return snap


# --------------------------------------------------------------------------
# Plain values for comparison
# --------------------------------------------------------------------------


def cache_stats(s: Any) -> Any:
    if s is None:
        return None
    keys = (
        "reset",
        "requests",
        "queries",
        "hits",
        "preempted_requests",
        "preempted_queries",
        "preempted_hits",
    )
    d = {k: getattr(s, k, None) for k in keys}
    d["hits_by_source"] = plain(getattr(s, "hits_by_source", None))
    return d


def plain(x: Any) -> Any:
    """``x`` as JSON-like values (dicts, lists, strings, numbers)."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return round(x, 12)
    if isinstance(x, enum.Enum):
        return x.name
    if isinstance(x, bytes):
        return x.hex()
    if isinstance(x, dict):
        return {str(plain(k)): plain(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (set, frozenset)):
        return sorted((plain(v) for v in x), key=str)
    if isinstance(x, (list, tuple)) or type(x).__name__ in ("ConstantList", "BlockRun"):
        return [plain(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {
            "_type": type(x).__name__,
            **{f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)},
        }
    fields_ = getattr(type(x), "__struct_fields__", None)
    if fields_ is not None:  # msgspec.Struct (KV events)
        return {"_type": type(x).__name__, **{f: plain(getattr(x, f)) for f in fields_}}
    if hasattr(x, "tolist"):
        return x.tolist()
    return repr(x)


def snap_output(so: Any) -> dict[str, Any]:
    c = so.scheduled_cached_reqs
    cached = []
    for i, rid in enumerate(c.req_ids):
        nb = c.new_block_ids[i]
        cached.append(
            {
                "req_id": rid,
                "resumed": rid in c.resumed_req_ids,
                "new_block_ids": None if nb is None else [list(g) for g in nb],
                "num_computed_tokens": c.num_computed_tokens[i],
                "num_output_tokens": c.num_output_tokens[i],
                "new_token_ids": list(c.new_token_ids[i]) if i < len(c.new_token_ids) else None,
            }
        )
    meta = so.kv_connector_metadata
    return {
        "new_reqs": [
            {
                "req_id": r.req_id,
                "block_ids": [list(g) for g in r.block_ids],
                "num_computed_tokens": r.num_computed_tokens,
                "prompt_len": len(r.prompt_token_ids or ()),
                "replay_start": r.replay_start,
            }
            for r in so.scheduled_new_reqs
        ],
        "cached_reqs": cached,
        "num_scheduled_tokens": dict(so.num_scheduled_tokens),
        "total_num_scheduled_tokens": so.total_num_scheduled_tokens,
        "scheduled_spec_decode_tokens": plain(so.scheduled_spec_decode_tokens),
        "num_common_prefix_blocks": list(so.num_common_prefix_blocks),
        "preempted_req_ids": sorted(so.preempted_req_ids or ()),
        "finished_req_ids": sorted(so.finished_req_ids),
        "new_block_ids_to_zero": plain(so.new_block_ids_to_zero),
        "kv_cache_block_copies": plain(so.kv_cache_block_copies),
        "connector_req_ids": getattr(meta, "req_ids", None),
    }


def first_diff(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first path where ``a`` and ``b`` differ, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                return (f"{path}.{k}", a.get(k, "<missing>"), b.get(k, "<missing>"))
            d = first_diff(a[k], b[k], f"{path}.{k}")
            if d is not None:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = first_diff(x, y, f"{path}[{i}]")
            if d is not None:
                return d
        return None
    return None if a == b else (path or ".", a, b)


def short(x: Any, n: int = 400) -> str:
    s = json.dumps(x, default=str) if not isinstance(x, str) else x
    return s if len(s) <= n else s[: n - 3] + "..."


# --------------------------------------------------------------------------
# A run
# --------------------------------------------------------------------------


@dataclass
class Result:
    case: str
    seed: int
    status: str  # identical, diverged, error, unsupported
    steps: int = 0
    detail: str = ""
    diff: dict[str, Any] | None = None
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)


#: A change made to pagedkv's side before a step: (side, step) -> None. Used
#: to check that the harness reports a difference it is given.
Perturb = Callable[["Side", int], None]
#: Sees vLLM's side of every compared observation: (step, phase, snapshot).
Observe = Callable[[int, str, dict[str, Any]], None]


def run_case(
    case: Case,
    seed: int,
    max_steps: int | None = None,
    observe: Observe | None = None,
    perturb: Perturb | None = None,
) -> Result:
    """Runs ``case`` with ``seed`` on both sides; the result says where they first differ."""
    t0 = time.perf_counter()
    res = Result(case.name, seed, "identical")
    try:
        _run(case, seed, res, max_steps or case.max_steps, observe, perturb)
    except Unsupported as e:
        res.status, res.detail = "unsupported", str(e)
    except Exception as e:
        res.status = "error"
        res.detail = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-6)}"
    res.seconds = time.perf_counter() - t0
    return res


def _run(
    case: Case,
    seed: int,
    res: Result,
    max_steps: int,
    observe: Observe | None,
    perturb: Perturb | None,
) -> None:
    model = FakeModel(case, seed)
    workload = make_workload(case, seed)
    num_blocks = num_blocks_for(case, workload)
    ref_sched, dut_sched = build_pair(case, model, num_blocks)
    sides = [Side("vllm", ref_sched, case, model), Side("pagedkv", dut_sched, case, model)]
    arrivals: dict[int, list[tuple[str, Any]]] = {}
    for spec in workload:
        arrivals.setdefault(spec.arrival, []).append(("new", spec))
        for k, (step, prompt, max_tokens) in enumerate(spec.chunks):
            arrivals.setdefault(step, []).append(("chunk", (spec, k, prompt, max_tokens)))
        if spec.abort_at is not None:
            arrivals.setdefault(spec.abort_at, []).append(("abort", spec.rid))
    if case.resets:
        rng = Rng("resets", case.name, seed)
        for _ in range(3):
            at = rng.randint(2, 30)
            arrivals.setdefault(at, []).append(("reset", rng.random() < 0.5))
    for step, rid, prompt in SCRIPTED_PROBES.get(case.script or "", []):
        arrivals.setdefault(step, []).append(("probe", (rid, prompt)))
    last_arrival = max(arrivals, default=0)
    counts = {
        "requests": len(workload),
        "steps_scheduled": 0,
        "preemptions": 0,
        "events": 0,
        "hits": 0,
    }
    step = 0
    idle = 0  # consecutive steps after the last input that scheduled nothing
    while step < max_steps:
        for kind, item in arrivals.get(step, ()):
            for side in sides:
                apply_input(side, case, kind, item, step)
        if step > last_arrival and not any(s.busy() for s in sides):
            break
        if perturb is not None:
            perturb(sides[1], step)
        observed = []
        for s in sides:
            try:
                observed.append(s.step())
            except Exception as e:
                raise RuntimeError(f"{s.name}'s side raised at step {step}: {e!r}") from e
        kinds = [[k for k, _ in o] for o in observed]
        if kinds[0] != kinds[1]:
            res.status = "diverged"
            res.steps = step
            res.detail = f"step {step}: engine phases differ: vllm {kinds[0]}, pagedkv {kinds[1]}"
            return
        for (phase, a), (_, b) in zip(observed[0], observed[1], strict=True):
            if observe is not None:
                observe(step, phase, a)
            d = first_diff(a, b)
            if d is not None:
                res.status = "diverged"
                res.steps = step
                res.detail = (
                    f"step {step} ({phase}): {d[0]}: vllm {short(d[1])} != pagedkv {short(d[2])}"
                )
                res.diff = {
                    "step": step,
                    "phase": phase,
                    "path": d[0],
                    "vllm": d[1],
                    "pagedkv": d[2],
                    "vllm_snapshot": a,
                    "pagedkv_snapshot": b,
                }
                return
            if phase == "schedule":
                idle = (
                    0 if a["total_num_scheduled_tokens"] > 0 or step <= last_arrival else idle + 1
                )
                counts["steps_scheduled"] += a["total_num_scheduled_tokens"] > 0
                counts["preemptions"] += len(a["preempted_req_ids"])
            elif phase == "update":
                counts["events"] += len(a["events"])
                pcs = a.get("stats", {}).get("prefix_cache_stats") or {}
                counts["hits"] += pcs.get("hits") or 0
        step += 1
        if idle >= STALL_STEPS and not any(s.loading for s in sides):
            waiting = sorted(sides[0].sched.requests)
            free = sides[0].sched.kv_cache_manager.block_pool.get_num_free_blocks()
            res.detail = (
                f"both schedulers stalled from step {step - idle}: {len(waiting)} requests "
                f"waiting, {free} free blocks"
            )
            break
    res.steps = step
    res.counts = counts
    if step >= max_steps and not res.detail:
        res.detail = f"stopped at the step cap ({max_steps}) with work left"


def apply_input(side: Side, case: Case, kind: str, item: Any, step: int) -> None:
    if kind == "new":
        spec = item
        side.add(
            make_request(
                case,
                spec.rid,
                spec.prompt,
                spec.max_tokens,
                float(step),
                spec,
                resumable=spec.resumable,
            )
        )
    elif kind == "chunk":
        spec, k, prompt, max_tokens = item
        if spec.rid not in side.sched.requests:
            return  # the session ended (aborted) before this chunk
        arrival = float(step) + 0.001 * (k + 1)
        if prompt is None:
            side.add(make_request(case, spec.rid, [], 1, arrival, spec, resumable=False))
        else:
            side.add(
                make_request(case, spec.rid, prompt, max_tokens, arrival, spec, resumable=True)
            )
    elif kind == "abort":
        side.abort(item)
    elif kind == "reset":
        ok = side.sched.reset_prefix_cache(reset_running_requests=item)
        side.notes.append({"reset_prefix_cache": {"reset_running_requests": item, "ok": ok}})
    elif kind == "probe":
        rid, prompt = item
        side.add(make_request(case, rid, prompt, 1, float(step)))


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


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


def print_step(step: int, phase: str, snap: dict[str, Any]) -> None:
    print(f"  step {step} {phase}: {json.dumps(snap, default=str)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--configs", nargs="+", default=["all"])
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per configuration")
    p.add_argument("--seed-base", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--json", help="write every run's result (and first diff) here")
    p.add_argument("--list", action="store_true", help="print the configurations and exit")
    p.add_argument(
        "--trace",
        action="store_true",
        help="print vLLM's side of every step (one configuration and seed)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="print errors' tracebacks")
    args = p.parse_args(argv)
    cases = select(args.configs)
    if args.list:
        for c in cases:
            print(f"{c.name:28} {describe(c)}")
        return 0
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    results: list[Result] = []
    for case in cases:
        for seed in range(args.seed_base, args.seed_base + args.seeds):
            r = run_case(case, seed, args.max_steps, print_step if args.trace else None)
            results.append(r)
            line = f"{case.name:28} seed {seed}: "
            if r.status == "identical":
                line += (
                    f"identical over {r.steps} steps "
                    f"({r.counts.get('preemptions', 0)} preemptions, "
                    f"{r.counts.get('hits', 0)} hit tokens, {r.counts.get('events', 0)} events)"
                )
                if r.detail:
                    line += f"; {r.detail}"
            elif r.status == "diverged":
                line += f"DIVERGED at {r.detail}"
            elif r.status == "unsupported":
                line += f"cannot be built here: {r.detail}"
            else:
                first = r.detail.splitlines()[0] if r.detail else ""
                line += f"ERROR {first}"
                if args.verbose:
                    line += "\n" + r.detail
            print(line, flush=True)
    runnable = [r for r in results if r.status != "unsupported"]
    same = sum(r.status == "identical" for r in runnable)
    print(
        f"{same} of {len(runnable)} runs identical"
        f" ({len(results) - len(runnable)} runs could not be built;"
        f" {sum(r.status == 'error' for r in results)} errors)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1, default=str)
    return 0 if same == len(runnable) else 1


if __name__ == "__main__":
    sys.exit(main())
