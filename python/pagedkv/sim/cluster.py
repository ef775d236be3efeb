"""Many replicas behind a router: ``--replicas N --router NAME``.

Each replica is a serving process of its own: its own pagedkv manager, its own
scheduler (:class:`~pagedkv.sim.policy.Scheduler`) and its own clock, each step
lasting what the step-time model says. A router sends every request, when it
arrives, to one replica:

``round-robin``
    the next replica in turn;
``least-loaded``
    the replica with the fewest requests running or waiting (the first among
    equals);
``prefix-aware``
    the replica of lowest cost ``uncached prompt blocks + queued prefill blocks
    + active blocks``: the blocks of the prompt the replica would have to
    compute (its cached prefix, looked up in pagedkv's router-side
    :class:`~pagedkv.index.PrefixIndex`), the prompt blocks already waiting on
    it, and the KV blocks its running requests hold (decode load). The index is
    fed by each replica's KV events after each of its steps, exactly as a
    deployment feeds it from the replicas' event streams, and the router hashes
    prompts as the replicas do. This is the cost of Dynamo's KV-aware router
    (prefill blocks + decode blocks) with weight 1, and of llm-d's
    prefix-cache scorer balanced against a load scorer. With host (and disk)
    tiers the index also learns their events (medium ``CPU``, ``STORAGE``), and
    a cached block counts by where it is held: 1 on the device, and
    ``tier_weights`` (0.75 and 0.25 by default, as Dynamo's router) in host
    memory and on disk; weights of 0 make the router blind to the tiers.

The simulation is a discrete-event loop: the next event is the earliest of the
next arrival and the end of the earliest running replica's step; a replica
with nothing to run waits for its next request. A ``max_concurrency`` limit
counts the requests in flight on all replicas together, as clients driving the
router see them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .._util import FNV_OFFSET_BASIS, fnv1a64
from ..index import PrefixIndex
from ..manager import KVCacheManager
from .config import SimConfig
from .deployment import deploy
from .perf import step_time_model
from .policy import Request, Scheduler, Timeline, timed_step
from .result import SimResult
from .serving import ServingProcess, make_manager
from .steptime import Latencies, summarize
from .tiers import tier_report
from .workloads import Workload

__all__ = ["ROUTERS", "run_cluster"]

ROUTERS = ("round-robin", "least-loaded", "prefix-aware")


@dataclass
class _Replica:
    name: str
    kv: KVCacheManager
    sched: Scheduler[Request]
    clock: float = 0.0
    routed: int = 0
    peak_usage: float = 0.0
    usage_sum: float = 0.0


class _Router:
    def __init__(
        self,
        kind: str,
        replicas: list[_Replica],
        hasher: KVCacheManager | None,
        block: int,
        tier_weights: tuple[float, float] = (0.75, 0.25),
    ) -> None:
        if kind not in ROUTERS:
            raise ValueError(f"unknown router {kind!r}; routers: {', '.join(ROUTERS)}")
        self.kind = kind
        self.replicas = replicas
        self.next = 0
        self.block = block
        self.hasher = hasher
        self.index = PrefixIndex() if kind == "prefix-aware" else None
        self.routed_hit_blocks = 0.0
        self.tier_weights = tier_weights

    def feed(self, r: _Replica) -> None:
        if self.index is None:
            return
        self.index.apply(r.name, r.kv.take_events())
        if not r.kv.has_offload:
            return
        for keys, medium, removed, metadata_only in r.kv.take_offload_events():
            if metadata_only:  # a store that failed: never announced as stored
                continue
            # A tier's key is the block hash and its group (4 bytes).
            by_group: dict[int, list[bytes]] = {}
            for k in keys:
                by_group.setdefault(int.from_bytes(k[-4:], "big"), []).append(k[:-4])
            for group, hashes in by_group.items():
                if removed:
                    self.index.remove(r.name, hashes, group, medium=medium)
                else:
                    self.index.store(r.name, hashes, None, group, medium=medium)

    def _hashes(self, req: Request) -> list[bytes]:
        assert self.hasher is not None
        rid = f"route:{req.request_id}"
        self.hasher.add_request(
            rid,
            req.prompt,
            lora_name=req.lora_name,
            lora_path=req.lora_path,
            cache_salt=req.cache_salt,
        )
        try:
            return self.hasher.block_hashes(rid)
        finally:
            self.hasher.remove_request(rid)

    def choose(self, req: Request) -> _Replica:
        reps = self.replicas
        if self.kind == "round-robin":
            r = reps[self.next % len(reps)]
            self.next += 1
            return r
        if self.kind == "least-loaded":
            return min(reps, key=lambda r: len(r.sched.running) + len(r.sched.waiting))
        assert self.index is not None
        hashes = self._hashes(req)
        weights = (1.0, *self.tier_weights)
        matched = self.index.weighted_match(hashes, weights) if hashes else {}
        prompt_blocks = -(-len(req.prompt) // self.block)
        best: tuple[float, int] | None = None
        choice = reps[0]
        for i, r in enumerate(reps):
            cached = matched.get(r.name, 0)
            queued = sum(-(-len(w.prompt) // self.block) for w in r.sched.waiting)
            active = r.kv.usage * (r.kv.num_blocks - 1)
            cost = (prompt_blocks - cached) + queued + active
            if best is None or (cost, i) < best:
                best, choice = (cost, i), r
        self.routed_hit_blocks += matched.get(choice.name, 0)
        return choice


def _cumulative_rate(hits: list[float], queries: list[float]) -> list[float]:
    out: list[float] = []
    h = q = 0.0
    for hi, qi in zip(hits, queries, strict=True):
        h += hi
        q += qi
        out.append(h / q if q else 0.0)
    return out


def run_cluster(
    workload: Workload,
    cfg: SimConfig,
    *,
    label: str = "pagedkv",
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """Simulates ``workload`` on ``cfg.replicas`` replicas behind ``cfg.router``;
    returns a ``SimResult`` whose counts add up the replicas and whose
    ``extra["replicas"]`` has each one's."""
    if cfg.replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {cfg.replicas}")
    # Requests longer than the context are rejected at the frontend, before routing.
    deployment = deploy(cfg, workload)
    admitted, workload = deployment.admitted, deployment.workload
    config, max_model_len = deployment.kv_config, deployment.max_model_len
    model = step_time_model(cfg, deployment.model)
    prefix = cfg.router == "prefix-aware"

    replicas = []
    for i in range(cfg.replicas):
        process = ServingProcess.start(
            cfg, config, max_model_len, enable_kv_cache_events=prefix, tier_events=prefix
        )
        process.sched.track_shape = True
        replicas.append(_Replica(f"replica-{i}", process.kv, process.sched))
    # The router hashes a prompt and reads the hashes back at once: in place.
    hasher = make_manager(cfg, config, max_model_len, background_hashing=False) if prefix else None
    router = _Router(
        cfg.router,
        replicas,
        hasher,
        config.kv_cache_groups[0].kv_cache_spec.block_size,
        cfg.tier_weights,
    )

    reqs = workload.requests
    items = [r.fresh() for r in reqs]
    lat = Latencies()
    lat.request_overhead_s = getattr(model, "request_overhead_s", 0.0)
    # A concurrency limit binds the clients, who send to the router: it counts
    # the requests in flight on every replica together.
    tl = Timeline(items, cfg.tick_s, lat, max_concurrency=cfg.max_concurrency)

    usage: list[float] = []
    running: list[float] = []
    waiting: list[float] = []
    clock_s: list[float] = []
    preempt: list[float] = []
    step_hits: list[float] = []
    step_queries: list[float] = []
    steps = 0
    inf = float("inf")
    t0 = time.perf_counter()
    while tl.ready or any(r.sched.has_unfinished for r in replicas):
        busy = [r for r in replicas if r.sched.has_unfinished]
        t_step = min((r.clock for r in busy), default=inf)
        if tl.next_send() <= t_step:
            t, i = tl.pop_ready()
            req = items[i]
            rep = router.choose(req)
            if not rep.sched.has_unfinished:
                rep.clock = max(rep.clock, t)
            rep.routed += 1
            lat.arrive(req.request_id, t, len(req.prompt))
            rep.sched.add_request(req)
            continue
        rep = min(busy, key=lambda r: r.clock)
        st = rep.sched.stats
        hits0, queries0 = st.first_hit_tokens, st.first_query_tokens
        start = rep.clock
        done, end = timed_step(rep.sched, model, start)
        rep.clock = end
        steps += 1
        tl.stepped(rep.sched, start, end, done)
        router.feed(rep)
        u = rep.kv.usage
        rep.peak_usage = max(rep.peak_usage, u)
        rep.usage_sum += u
        usage.append(sum(r.kv.usage for r in replicas) / len(replicas))
        running.append(sum(len(r.sched.running) for r in replicas))
        waiting.append(sum(len(r.sched.waiting) for r in replicas))
        clock_s.append(end)
        preempt.append(sum(r.sched.stats.preemptions for r in replicas))
        step_hits.append(st.first_hit_tokens - hits0)
        step_queries.append(st.first_query_tokens - queries0)
        if progress is not None:
            progress(steps, tl.finished)
    wall = time.perf_counter() - t0
    tl.check_done()
    for rep in replicas:
        rep.kv.check_invariants()
    stats = [r.sched.stats for r in replicas]
    per_api: dict[str, tuple[int, int]] = {}
    for st in stats:
        for api, ns in st.ns.items():
            c, n = per_api.get(api, (0, 0))
            per_api[api] = (c + st.calls[api], n + ns)
    checksum = FNV_OFFSET_BASIS
    for st in stats:
        checksum = fnv1a64((st.alloc_checksum,), checksum)
    total = sum
    return SimResult(
        label=label,
        engine="pagedkv",
        config=deployment.report(),
        steps=total(st.steps for st in stats),
        requests=len(items),
        finished=total(st.finished for st in stats),
        prompt_tokens=workload.prompt_tokens,
        output_tokens=workload.output_tokens,
        hit_tokens=total(st.first_hit_tokens for st in stats),
        query_tokens=total(st.first_query_tokens for st in stats),
        hit_tokens_all=total(st.hit_tokens for st in stats),
        query_tokens_all=total(st.query_tokens for st in stats),
        preemptions=total(st.preemptions for st in stats),
        admissions=total(st.admissions for st in stats),
        peak_running=max(st.peak_running for st in stats),
        peak_usage=max(r.peak_usage for r in replicas),
        mean_usage=total(usage) / len(usage) if usage else 0.0,
        num_blocks=config.num_blocks,
        usable_blocks=config.num_blocks - 1,
        free_blocks_at_end=min(r.kv.num_free_blocks for r in replicas),
        manager_ns=total(st.manager_ns for st in stats),
        manager_calls=total(st.manager_calls for st in stats) + len(items) + workload.output_tokens,
        per_api=per_api,
        alloc_checksum=f"{checksum:016x}",
        wall_s=wall,
        extra={
            "replicas": [
                {
                    "name": r.name,
                    "requests": r.routed,
                    "steps": r.sched.stats.steps,
                    "hit_rate": round(
                        r.sched.stats.first_hit_tokens / r.sched.stats.first_query_tokens, 6
                    )
                    if r.sched.stats.first_query_tokens
                    else 0.0,
                    "preemptions": r.sched.stats.preemptions,
                    "peak_usage": round(r.peak_usage, 6),
                }
                for r in replicas
            ],
            **tier_report(
                cfg,
                [r.sched.backend for r in replicas],
                total(st.first_query_tokens for st in stats),
            ),
        },
        series={
            "usage": usage,
            "running": running,
            "waiting": waiting,
            "hit_rate": _cumulative_rate(step_hits, step_queries),
            "time_s": clock_s,
            "preemptions": preempt,
            "hit_tokens": step_hits,
            "query_tokens": step_queries,
        },
        timing=summarize(lat, slo_ttft_ms=cfg.slo_ttft_ms, slo_tpot_ms=cfg.slo_tpot_ms),
        rejected_requests=admitted.rejected_requests,
        rejected_prompt_tokens=admitted.rejected_prompt_tokens,
    )
