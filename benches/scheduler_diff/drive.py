"""One side: a scheduler, its requests, and the engine loop that drives it as vLLM's does."""

from __future__ import annotations

from collections import deque
from typing import Any

from .cases import Case
from .compare import cache_stats, plain, snap_output
from .workload import EOS_TOKEN_ID, STOP_TOKEN_ID, FakeModel, ReqSpec


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
