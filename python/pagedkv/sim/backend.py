"""The scheduler policy's backend over pagedkv's own :class:`~pagedkv.KVCacheManager`.

It makes the manager calls vLLM's scheduler makes, crossing the boundary as few
times as it can: one ``allocate_slots_batch`` per run of running requests that
fit, requests named by the handle ``add_request`` returned. The tokens a step
samples cross with the requests' next allocation (``append_token_ids``), not in a
call of their own: nothing reads a request's tokens in between but that
allocation, or its preemption, which hands its token over first. Every call is
timed into the policy's :class:`~pagedkv.sim.policy.StepStats`;
``manager_calls`` counts them as vLLM's scheduler would call its manager (one
per request).

>>> import pagedkv as pk
>>> from pagedkv.sim import ManagerBackend, Request, Scheduler
>>> spec = pk.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
>>> config = pk.KVCacheConfig(num_blocks=64, kv_cache_groups=[pk.KVCacheGroupSpec(["l"], spec)])
>>> sched = Scheduler(ManagerBackend(pk.KVCacheManager(config, max_model_len=1024)))
>>> sched.add_request(Request("r1", list(range(40)), [7, 8, 9]))
>>> while sched.has_unfinished:
...     done = sched.step()
>>> (sched.stats.steps, sched.stats.finished)
(3, 1)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import numpy as np

from ..manager import ComputedBlocks, KVCacheManager, PreparedRequest
from .policy import Backend, Request

__all__ = ["ManagerBackend"]


class ManagerBackend(Backend[Request]):
    """The policy's calls on one pagedkv manager (see the module docstring)."""

    def __init__(self, manager: KVCacheManager, *, tokens_with_allocation: bool = True) -> None:
        super().__init__()
        self.kv = manager
        # False: each step's sampled tokens go in a call of their own
        # (``append_token_ids_batch``) instead of with the next allocation.
        self._defer_tokens = tokens_with_allocation
        self._clock = time.perf_counter_ns
        self._hit: ComputedBlocks | None = None
        # Requests built and hashed ahead (``prepare``), until added.
        self._prepared: dict[str, PreparedRequest] = {}

    def prepare(self, reqs: Iterable[Request]) -> None:
        """Builds and hashes these requests now, with the manager's
        ``RequestPreparer`` (what an engine's input thread does as requests
        arrive, before its scheduler sees them: vLLM builds its ``Request``
        objects, block hashes included, there); ``add_request`` then only
        registers each (``add_prepared``)."""
        preparer = self.kv.request_preparer()
        for req in reqs:
            self._prepared[req.request_id] = preparer.prepare(
                req.request_id,
                req.prompt,
                lora_name=req.lora_name,
                lora_path=req.lora_path,
                cache_salt=req.cache_salt,
            )

    def add_request(self, req: Request) -> None:
        st, clock = self.stats, self._clock
        prepared = self._prepared.pop(req.request_id, None)
        t = clock()
        if prepared is not None:
            handle = self.kv.add_prepared(prepared)
        elif req.lora_name is None and req.cache_salt is None:
            handle = self.kv.add_request(req.request_id, req.prompt)
        else:
            handle = self.kv.add_request(
                req.request_id,
                req.prompt,
                lora_name=req.lora_name,
                lora_path=req.lora_path,
                cache_salt=req.cache_salt,
            )
        st.timed("add_request", clock() - t)
        req.handle = handle if isinstance(handle, int) else req.request_id

    def new_step(self) -> None:
        st, clock = self.stats, self._clock
        t = clock()
        self.kv.new_step_starts()
        st.timed("new_step_starts", clock() - t)
        st.manager_calls += 1

    def allocate(self, reqs: Sequence[Request], num_new_tokens: Sequence[int]) -> int:
        st, clock = self.stats, self._clock
        refs = [r.handle for r in reqs]  # all handles, or all ids
        new = np.asarray(num_new_tokens, dtype=np.int64)
        computed = np.asarray([r.num_computed_tokens for r in reqs], dtype=np.int64)
        # The tokens sampled since each request's last step go with this call.
        sampled: list[int] | None = None
        if self._defer_tokens:
            sampled = []
            for r in reqs:
                sampled.append(r.sampled)
                r.sampled = -1
        t = clock()
        n_ok, groups = self.kv.allocate_slots_batch(refs, new, computed, append_token_ids=sampled)
        st.timed("allocate_slots_batch", clock() - t)
        st.calls["allocate_slots"] = st.calls.get("allocate_slots", 0) + n_ok
        for i in range(n_ok):
            st.feed_allocation([blocks[offsets[i] : offsets[i + 1]] for blocks, offsets in groups])
        st.manager_calls += n_ok
        if n_ok < len(reqs):  # the call for reqs[n_ok] returned None
            st.manager_calls += 1
            st.feed_allocation(None)
        return n_ok

    def lookup(self, req: Request) -> int:
        st, clock = self.stats, self._clock
        t = clock()
        self._hit = hit = self.kv.get_computed_blocks(req.request_id)
        st.timed("get_computed_blocks", clock() - t)
        req.shared_prefix_boundary = hit.shared_prefix_boundary
        return hit.num_computed_tokens

    def admit(
        self,
        req: Request,
        num_new_tokens: int,
        num_hit_tokens: int,
        *,
        full_sequence_must_fit: bool,
        has_scheduled_reqs: bool,
    ) -> bool:
        res = self._allocate_admitted(
            req,
            num_new_tokens,
            num_hit_tokens,
            0,
            full_sequence_must_fit=full_sequence_must_fit,
            has_scheduled_reqs=has_scheduled_reqs,
        )
        return res is not None

    def _allocate_admitted(
        self,
        req: Request,
        num_new_tokens: int,
        num_hit_tokens: int,
        num_host_tokens: int,
        *,
        full_sequence_must_fit: bool,
        has_scheduled_reqs: bool,
    ) -> object:
        """The admission's ``allocate_slots`` with the looked-up hit, of which
        ``num_host_tokens`` are loaded from a host tier; its result."""
        st, clock = self.stats, self._clock
        hit, self._hit = self._hit, None
        t = clock()
        res = self.kv.allocate_slots(
            req.request_id,
            num_new_tokens,
            num_computed_tokens=0,
            num_new_computed_tokens=num_hit_tokens - num_host_tokens,
            new_computed_blocks=hit,
            num_external_computed_tokens=num_host_tokens,
            full_sequence_must_fit=full_sequence_must_fit,
            has_scheduled_reqs=has_scheduled_reqs,
        )
        st.timed("allocate_slots(admit)", clock() - t)
        st.manager_calls += 2
        st.feed_allocation(res)
        return res

    def preempt(self, req: Request) -> int:
        st, clock = self.stats, self._clock
        if req.sampled >= 0:
            # Its sampled token first: a re-admission looks up every token.
            t = clock()
            self.kv.append_token_ids(req.request_id, [req.sampled])
            st.timed("append_token_ids", clock() - t)
            req.sampled = -1
        t = clock()
        self.kv.free(req.request_id)
        st.timed("free", clock() - t)
        st.manager_calls += 1
        return 0

    def append_tokens(self, reqs: Sequence[Request], tokens: Sequence[int]) -> None:
        if not self._defer_tokens:
            st, clock = self.stats, self._clock
            refs = [r.handle for r in reqs]
            t = clock()
            self.kv.append_token_ids_batch(refs, tokens)
            st.timed("append_token_ids_batch", clock() - t)
            return
        # Kept until the request's next allocation (or its preemption) hands it
        # to the manager; a finished request's last token is never needed.
        for r, tok in zip(reqs, tokens, strict=True):
            r.sampled = tok

    def finish(self, req: Request) -> None:
        st, clock = self.stats, self._clock
        t = clock()
        self.kv.remove_request(req.request_id)
        st.timed("remove_request", clock() - t)
        st.manager_calls += 1
