"""Stateful property tests: random scheduler-like call sequences, checked after every step.

``SingleGroupMachine`` drives one full-attention group against an independent
reference model written here in plain Python (a free queue, ref counts, the
blocks each request holds, and a prefix map keyed by *token prefixes* rather
than hashes). After every rule the manager must agree with the model exactly:
returned block ids, hit lengths, the free queue in order, every ref count, which
blocks are cached, the prefix map including duplicate entries, and the errors of
refused calls (which must leave everything unchanged).

``HybridMachine`` drives full attention + sliding window groups (where no simple
model predicts every block id) and checks model-free properties instead: the
invariant checker, block conservation (free blocks plus distinct held blocks is
every usable block, no block both free and held), the prefix map agreeing with
block hashes, shared blocks holding identical contents, hit lengths, and that
refused calls change nothing.

Both also check that removing every request returns every block, and that a
prefix-cache reset then empties the map.
"""

from __future__ import annotations

import functools
import inspect
from collections import deque
from collections.abc import Callable
from typing import Any

import pagedkv as pk
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from pagedkv._util import cdiv

from tests._util import as_lists, full, manager, snapshot, swa

BS = 4
NUM_BLOCKS = 10  # 9 usable: a request of more than 36 tokens can never fit
IDS = [f"r{i}" for i in range(6)]
# Two base prompts over a two-letter alphabet: prompts that start alike share
# cached blocks, and equal blocks at different positions must not be confused.
BASES = ([0, 1, 1, 0, 1, 0, 0, 1] * 6, [0, 1, 1, 0, 0, 0, 1, 1] * 6)

prompts = st.one_of(
    st.builds(
        lambda base, n, tail: list(BASES[base][:n]) + tail,
        st.integers(0, 1),
        st.integers(0, 40),
        st.lists(st.integers(0, 1), max_size=3),
    ).filter(lambda p: 0 < len(p) <= 44),
    # Unrelated prompts: with a one-byte hash their blocks collide with cached ones.
    st.lists(st.integers(0, 1), min_size=9, max_size=24),
)
request_ids = st.sampled_from(IDS)
chunks = st.one_of(st.none(), st.integers(1, 12))
lookaheads = st.sampled_from([0, 0, 0, 1, 5])

SETTINGS = settings(
    max_examples=250,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def drawn(**strategies: st.SearchStrategy[Any]) -> Callable[[Any], Any]:
    """A rule taking one ``data`` argument and drawing its own arguments from it.

    Hypothesis orders rules by their number of arguments and its generator
    favours the first ones, so the rules that drive requests take one argument
    each and the cheap maintenance rules take two.
    """

    def deco(f: Callable[..., None]) -> Any:
        takes_data = "data" in inspect.signature(f).parameters

        @functools.wraps(f)
        def wrapper(self: Any, data: st.DataObject) -> None:
            kwargs = {k: data.draw(v, label=k) for k, v in strategies.items()}
            if takes_data:
                kwargs["data"] = data
            f(self, **kwargs)

        del wrapper.__wrapped__  # Hypothesis must see the one-argument signature
        return rule(data=st.data())(wrapper)

    return deco


# --------------------------------------------------------------------------- model


class ModelRequest:
    def __init__(self, tokens: list[int], generation: int) -> None:
        self.tokens = list(tokens)
        self.generation = generation
        self.blocks: list[int] = []
        self.num_cached: int | None = None  # set while running
        self.computed = 0  # tokens the emulated scheduler has computed

    @property
    def running(self) -> bool:
        return bool(self.blocks)


class Refused(Exception):
    """The model's prediction that the call raises ``exc``."""

    def __init__(self, exc: type[Exception]) -> None:
        super().__init__(exc.__name__)
        self.exc = exc


class Model:
    """vLLM 0.33's block manager for one full-attention group, prefix-keyed.

    Deliberately naive: lists and dicts, O(n) everywhere, no hashes.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.n = num_blocks
        self.bs = block_size
        self.queue: deque[int] = deque(range(1, num_blocks))
        self.ref = [0] * num_blocks
        self.key: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cmap: dict[tuple[int, ...], list[int]] = {}
        self.reqs: dict[str, ModelRequest] = {}
        self.generation = 0

    # ---- pool
    def evict(self, b: int) -> None:
        k = self.key[b]
        if k is None:
            return
        self.cmap[k].remove(b)
        if not self.cmap[k]:
            del self.cmap[k]
        self.key[b] = None

    def pop(self, n: int) -> list[int]:
        out = [self.queue.popleft() for _ in range(n)]
        for b in out:
            self.evict(b)
            self.ref[b] = 1
        return out

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self.queue.remove(b)
            self.ref[b] += 1

    def release(self, r: ModelRequest) -> None:
        first: list[int] = []
        last: list[int] = []
        for b in reversed(r.blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (first if self.key[b] is None else last).append(b)
        self.queue.extendleft(reversed(first))
        self.queue.extend(last)
        r.blocks = []
        r.num_cached = None
        r.computed = 0

    def prefix(self, r: ModelRequest, i: int) -> tuple[int, ...]:
        return tuple(r.tokens[: (i + 1) * self.bs])

    def cache(self, r: ModelRequest, num_tokens: int) -> None:
        done = r.num_cached or 0
        upto = min(min(num_tokens, len(r.tokens)) // self.bs, len(r.blocks))
        for i in range(done, upto):
            b, p = r.blocks[i], self.prefix(r, i)
            if self.key[b] == p or b in self.cmap.get(p, []):
                continue
            assert self.key[b] is None, "a fresh block carries a key"
            self.key[b] = p
            self.cmap.setdefault(p, []).append(b)
        r.num_cached = max(done, upto)

    # ---- manager API
    def lookup(self, rid: str) -> list[int]:
        r = self.reqs[rid]
        hit: list[int] = []
        for i in range((len(r.tokens) - 1) // self.bs):
            blocks = self.cmap.get(self.prefix(r, i))
            if not blocks:
                break
            hit.append(blocks[0])
        return hit

    def hit_is_valid(self, rid: str, hit: list[int], generation: int) -> bool:
        r = self.reqs[rid]
        if generation != r.generation:
            return False
        return all(self.key[b] == self.prefix(r, i) for i, b in enumerate(hit))

    def allocate(
        self,
        rid: str,
        num_new: int,
        num_computed: int,
        hit: list[int] | None,
        num_new_computed: int = 0,
        lookahead: int = 0,
        delay: bool = False,
    ) -> list[int] | None:
        r = self.reqs[rid]
        if num_new == 0 and num_new_computed == 0:
            raise Refused(pk.InvalidArgumentError)
        if num_computed + num_new_computed > len(r.tokens):
            raise Refused(pk.InvalidArgumentError)
        if num_computed > len(r.blocks) * self.bs:
            raise Refused(pk.InvalidArgumentError)
        hit = hit or []
        if hit and r.running:
            raise Refused(pk.InvalidArgumentError)
        if len(hit) * self.bs < num_new_computed:
            raise Refused(pk.InvalidArgumentError)
        need_slot = num_computed + num_new_computed + num_new + lookahead
        required = cdiv(need_slot, self.bs)
        if r.num_cached is not None:
            need = max(0, required - len(r.blocks))
        else:
            fresh = max(0, required - len(hit) - len(r.blocks))
            need = fresh + sum(1 for b in hit if self.ref[b] == 0)
        if need > len(self.queue):
            shared = sum(1 for b in hit if self.ref[b] > 0)
            if need + shared > self.n - 1 - len(r.blocks):
                raise Refused(pk.CannotFitError)
            return None
        if hit and not r.running:
            self.touch(hit)
            r.blocks = list(hit)
            r.num_cached = len(hit)
        fresh_count = max(0, required - len(r.blocks))
        new = self.pop(fresh_count)
        r.blocks += new
        if r.num_cached is None:
            r.num_cached = 0
        if not delay:
            self.cache(r, num_computed + num_new_computed + num_new)
        r.computed = num_computed + num_new_computed + num_new
        return new

    def evict_blocks(self, ids: list[int]) -> None:
        if any(not 0 <= b < self.n for b in ids):
            raise Refused(pk.InvalidArgumentError)
        for b in ids:
            self.evict(b)

    def reset(self) -> bool:
        if len(self.queue) != self.n - 1:
            return False
        for b in range(self.n):
            self.key[b] = None
        self.cmap.clear()
        return True


# --------------------------------------------------------------------------- shared checks


def held_blocks(mgr: pk.KVCacheManager, ids: list[str]) -> dict[str, tuple[list[int], ...]]:
    return {rid: as_lists(mgr.get_block_ids(rid)) or () for rid in ids}


def check_conservation_and_sharing(
    mgr: pk.KVCacheManager, tokens: dict[str, list[int]], block_sizes: list[int]
) -> None:
    """Model-free: conservation of blocks and that shared blocks hold one content."""
    usable = set(range(1, mgr.num_blocks))
    free = [int(b) for b in mgr.free_block_ids()]
    assert len(free) == len(set(free)) == mgr.num_free_blocks
    assert 0 not in free
    holders: dict[int, tuple[str, int, int]] = {}
    refs: dict[int, int] = {}
    for rid, groups in held_blocks(mgr, list(tokens)).items():
        for g, blocks in enumerate(groups):
            for pos, b in enumerate(blocks):
                if b == 0:  # the null block pads skipped positions
                    continue
                refs[b] = refs.get(b, 0) + 1
                if b not in holders:
                    holders[b] = (rid, g, pos)
                    continue
                other, og, opos = holders[b]
                assert (og, opos) == (g, pos), f"block {b} at two positions or groups"
                assert other != rid, f"{rid} holds block {b} twice"
                end = (pos + 1) * block_sizes[g]
                a, c = tokens[other], tokens[rid]
                common = min(end, len(a), len(c))
                assert common > pos * block_sizes[g]
                assert a[:common] == c[:common], (
                    f"block {b} shared by {other} and {rid} with different tokens"
                )
    held = set(holders)
    assert held.isdisjoint(free), "a block is both free and held"
    assert held | set(free) == usable, "a usable block is neither free nor held (leak)"
    for b, n in refs.items():
        assert mgr.block_ref_count(b) == n
    for b in free:
        assert mgr.block_ref_count(b) == 0
    # Cached blocks (held or evictable) are listed in the map under their hash.
    for b in range(1, mgr.num_blocks):
        cached = mgr.cached_block_hash(b)
        if cached is not None:
            h, g = cached
            assert b in [int(x) for x in mgr.cached_blocks_for_hash(h, g)]


def assert_refused_unchanged(
    mgr: pk.KVCacheManager, ids: list[str], exc: type[BaseException], call: Any
) -> None:
    before = snapshot(mgr, ids)
    with pytest.raises(exc):
        call()
    assert snapshot(mgr, ids) == before
    mgr.check_invariants()


# --------------------------------------------------------------------------- single group


class SingleGroupMachine(RuleBasedStateMachine):
    """One full-attention group against the reference model."""

    @initialize(verify=st.booleans())
    def setup(self, verify: bool) -> None:
        # Collision safety (verify_cached_tokens) changes no answer with a full hash.
        self.mgr = manager(
            NUM_BLOCKS,
            [full(BS)],
            max_model_len=1024,
            hash_algo="xxh3_native",
            hash_seed="0",
            verify_cached_tokens=verify,
        )
        self.model = Model(NUM_BLOCKS, BS)
        self.kept: list[tuple[str, pk.ComputedBlocks, list[int], int]] = []
        self.hash_of: dict[tuple[int, ...], bytes] = {}
        self.prefix_of: dict[bytes, tuple[int, ...]] = {}

    # ---- helpers
    def live(self) -> list[str]:
        return sorted(self.model.reqs)

    def waiting(self) -> list[str]:
        return [r for r in self.live() if not self.model.reqs[r].running]

    def running(self) -> list[str]:
        return [r for r in self.live() if self.model.reqs[r].running]

    def learn_hashes(self, rid: str) -> None:
        """Hashes are opaque: learn the prefix <-> hash bijection from live requests."""
        r = self.model.reqs[rid]
        hashes = self.mgr.block_hashes(rid)
        assert len(hashes) == len(r.tokens) // BS
        for i, h in enumerate(hashes):
            p = self.model.prefix(r, i)
            assert self.hash_of.setdefault(p, h) == h, "one prefix, two hashes"
            assert self.prefix_of.setdefault(h, p) == p, "two prefixes, one hash"

    def expect(self, call: Any, predicted: Any) -> Any:
        """Runs ``call``; if the model predicted a refusal, checks the same error
        and an unchanged manager."""
        if isinstance(predicted, Refused):
            assert_refused_unchanged(self.mgr, self.live(), predicted.exc, call)
            return None
        return call()

    def model_call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Refused as e:
            return e

    # ---- rules
    @drawn(rid=request_ids, prompt=prompts)
    def add_request(self, rid: str, prompt: list[int]) -> None:
        if rid in self.model.reqs:
            assert_refused_unchanged(
                self.mgr,
                self.live(),
                pk.DuplicateRequestError,
                lambda: self.mgr.add_request(rid, prompt),
            )
            return
        self.mgr.add_request(rid, prompt)
        self.model.generation += 1
        self.model.reqs[rid] = ModelRequest(prompt, self.model.generation)
        self.learn_hashes(rid)

    @precondition(lambda self: bool(self.model.reqs))
    @drawn()
    def lookup_and_keep(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.live()))
        hit = self.mgr.get_computed_blocks(rid)
        expected = self.model.lookup(rid)
        assert as_lists(hit.block_ids) == (expected,)
        assert hit.num_computed_tokens == len(expected) * BS
        self.kept = [*self.kept[-3:], (rid, hit, expected, self.model.reqs[rid].generation)]

    @precondition(lambda self: bool(self.waiting()))
    @drawn(chunk=chunks, lookahead=lookaheads, delay=st.booleans())
    def admit(self, data: st.DataObject, chunk: int | None, lookahead: int, delay: bool) -> None:
        rid = data.draw(st.sampled_from(self.waiting()))
        hit = self.mgr.get_computed_blocks(rid)
        expected = self.model.lookup(rid)
        assert as_lists(hit.block_ids) == (expected,)
        r = self.model.reqs[rid]
        rest = len(r.tokens) - hit.num_computed_tokens
        num_new = rest if chunk is None else min(chunk, rest)
        predicted = self.model_call(
            self.model.allocate,
            rid,
            num_new,
            0,
            expected,
            hit.num_computed_tokens,
            lookahead,
            delay,
        )
        new = self.expect(
            lambda: self.mgr.allocate_slots(
                rid,
                num_new,
                num_computed_tokens=0,
                new_computed_blocks=hit,
                num_lookahead_tokens=lookahead,
                delay_cache_blocks=delay,
            ),
            predicted,
        )
        if not isinstance(predicted, Refused):
            assert as_lists(new) == (None if predicted is None else (predicted,))

    @precondition(lambda self: bool(self.kept) and bool(self.waiting()))
    @drawn()
    def admit_with_kept_lookup(self, data: st.DataObject) -> None:
        """A lookup from earlier: still valid, stale (blocks evicted or reused since),
        or looked up for another request (or an earlier request of the same id)."""
        kid, hit, blocks, generation = data.draw(st.sampled_from(self.kept))
        rid = data.draw(st.sampled_from(self.waiting()))
        r = self.model.reqs[rid]
        predicted: Any
        if hit.num_computed_tokens > len(r.tokens):
            # Counts are checked before the hit itself.
            predicted = Refused(pk.InvalidArgumentError)
        elif kid != rid or not self.model.hit_is_valid(rid, blocks, generation):
            predicted = Refused(pk.StaleComputedBlocksError)
        else:
            num_new = len(r.tokens) - hit.num_computed_tokens
            predicted = self.model_call(
                self.model.allocate, rid, num_new, 0, blocks, hit.num_computed_tokens
            )
        num_new = max(1, len(r.tokens) - hit.num_computed_tokens)
        new = self.expect(
            lambda: self.mgr.allocate_slots(
                rid, num_new, num_computed_tokens=0, new_computed_blocks=hit
            ),
            predicted,
        )
        if not isinstance(predicted, Refused):
            assert as_lists(new) == (None if predicted is None else (predicted,))

    @precondition(lambda self: bool(self.running()))
    @drawn(chunk=st.integers(1, 12), lookahead=lookaheads, token=st.integers(0, 1))
    def step(self, data: st.DataObject, chunk: int, lookahead: int, token: int) -> None:
        """A running request's next step: the rest of a chunked prefill, or one
        decode token (appended first, as the scheduler does after sampling)."""
        rid = data.draw(st.sampled_from(self.running()))
        r = self.model.reqs[rid]
        if r.computed >= len(r.tokens):
            if len(r.tokens) >= 60:
                return
            self.mgr.append_token_ids(rid, [token])
            r.tokens.append(token)
            self.learn_hashes(rid)
        num_new = min(chunk, len(r.tokens) - r.computed)
        computed = r.computed
        predicted = self.model_call(self.model.allocate, rid, num_new, computed, None, 0, lookahead)
        new = self.expect(
            lambda: self.mgr.allocate_slots(
                rid, num_new, num_computed_tokens=computed, num_lookahead_tokens=lookahead
            ),
            predicted,
        )
        if not isinstance(predicted, Refused):
            assert as_lists(new) == (None if predicted is None else (predicted,))

    @precondition(lambda self: bool(self.running()))
    @drawn(token=st.integers(0, 1))
    def batch_decode(self, data: st.DataObject, token: int) -> None:
        """One crossing for a decode step: same as allocating one by one until the
        first request that does not fit."""
        rids = data.draw(
            st.lists(st.sampled_from(self.running()), min_size=1, max_size=4, unique=True)
        )
        rids = [
            r
            for r in rids
            if self.model.reqs[r].computed >= len(self.model.reqs[r].tokens)
            and len(self.model.reqs[r].tokens) < 60
        ]
        if not rids:
            return
        self.mgr.append_token_ids_batch(rids, [token] * len(rids))
        for rid in rids:
            self.model.reqs[rid].tokens.append(token)
            self.learn_hashes(rid)
        computed = [self.model.reqs[r].computed for r in rids]
        # The batch validates every entry against the state before any allocation.
        free_at_start = len(self.model.queue)
        for rid in rids:
            r = self.model.reqs[rid]
            need = max(0, cdiv(r.computed + 1, BS) - len(r.blocks))
            if need > free_at_start and need > NUM_BLOCKS - 1 - len(r.blocks):
                assert_refused_unchanged(
                    self.mgr,
                    self.live(),
                    pk.CannotFitError,
                    lambda: self.mgr.allocate_slots_batch(rids, 1, computed),
                )
                return
        n_ok, groups = self.mgr.allocate_slots_batch(rids, 1, computed)
        expected_ids: list[int] = []
        offsets = [0]
        n_expected = 0
        for rid, c in zip(rids, computed, strict=True):
            new = self.model.allocate(rid, 1, c, None)
            if new is None:
                break
            n_expected += 1
            expected_ids += new
            offsets.append(len(expected_ids))
        assert n_ok == n_expected
        ids, offs = groups[0]
        assert [int(b) for b in ids] == expected_ids
        assert [int(o) for o in offs] == offsets

    @precondition(lambda self: bool(self.running()))
    @drawn()
    def publish_delayed(self, data: st.DataObject) -> None:
        """``cache_blocks`` after an asynchronous load (``delay_cache_blocks``)."""
        rid = data.draw(st.sampled_from(self.running()))
        r = self.model.reqs[rid]
        self.mgr.cache_blocks(rid, r.computed)
        self.model.cache(r, r.computed)

    @precondition(lambda self: bool(self.model.reqs))
    @drawn()
    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.live()))
        self.mgr.free(rid)
        self.model.release(self.model.reqs[rid])

    @precondition(lambda self: bool(self.model.reqs))
    @drawn()
    def remove(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.live()))
        self.mgr.remove_request(rid)
        self.model.release(self.model.reqs.pop(rid))
        assert rid not in self.mgr

    @rule(rid=request_ids, which=st.integers(0, 4))
    def calls_on_unknown_ids_are_refused(self, rid: str, which: int) -> None:
        if rid in self.model.reqs:
            return
        call = (
            lambda: self.mgr.free(rid),
            lambda: self.mgr.remove_request(rid),
            lambda: self.mgr.get_computed_blocks(rid),
            lambda: self.mgr.allocate_slots(rid, 1, num_computed_tokens=0),
            lambda: self.mgr.append_token_ids(rid, [1]),
        )[which]
        assert_refused_unchanged(self.mgr, self.live(), pk.UnknownRequestError, call)

    @rule(
        reset=st.booleans(),
        ids=st.lists(
            st.one_of(st.integers(0, NUM_BLOCKS - 1), st.sampled_from([-1, NUM_BLOCKS, 2**40])),
            max_size=3,
        ),
    )
    def evict_blocks_or_reset(self, reset: bool, ids: list[int]) -> None:
        if reset:
            assert self.mgr.reset_prefix_cache() == self.model.reset()
            return
        predicted = self.model_call(self.model.evict_blocks, ids)
        self.expect(lambda: self.mgr.evict_blocks(ids), predicted)

    # ---- after every rule
    @invariant()
    def agrees_with_model(self) -> None:
        m, mgr = self.model, self.mgr
        mgr.check_invariants()
        assert mgr.num_requests == len(m.reqs)
        assert mgr.num_free_blocks == len(m.queue)
        assert [int(b) for b in mgr.free_block_ids()] == list(m.queue)
        for b in range(NUM_BLOCKS):
            assert mgr.block_ref_count(b) == m.ref[b], f"ref count of block {b}"
            key = m.key[b]
            got = mgr.cached_block_hash(b)
            if key is None:
                assert got is None, f"block {b} should not be cached"
            else:
                assert got == (self.hash_of[key], 0), f"block {b} cached under another key"
        assert mgr.num_cached_block_hashes == len(m.cmap)
        for p, blocks in m.cmap.items():
            assert [int(b) for b in mgr.cached_blocks_for_hash(self.hash_of[p])] == blocks
        for rid, r in m.reqs.items():
            assert as_lists(mgr.get_block_ids(rid)) == (r.blocks,)
            assert mgr.num_tokens(rid) == len(r.tokens)
        check_conservation_and_sharing(mgr, {k: v.tokens for k, v in m.reqs.items()}, [BS])

    def teardown(self) -> None:
        if not hasattr(self, "mgr"):
            return
        for rid in self.live():
            self.mgr.remove_request(rid)
        assert self.mgr.num_free_blocks == NUM_BLOCKS - 1
        assert sorted(int(b) for b in self.mgr.free_block_ids()) == list(range(1, NUM_BLOCKS))
        assert self.mgr.reset_prefix_cache()
        assert self.mgr.num_cached_block_hashes == 0
        self.mgr.check_invariants()


# --------------------------------------------------------------------------- hybrid


HYBRID_LAYOUTS = {
    "full4": [full(4)],
    "full4+swa8": [full(4), swa(4, 8)],
    "full8+swa6x2": [full(8), swa(4, 6), swa(4, 6)],
}


class HybridMachine(RuleBasedStateMachine):
    """Full attention + sliding window groups: model-free properties."""

    @initialize(
        layout=st.sampled_from(sorted(HYBRID_LAYOUTS)),
        num_blocks=st.integers(6, 24),
        retention=st.sampled_from([None, 0]),
        weak_hash=st.booleans(),
    )
    def setup(self, layout: str, num_blocks: int, retention: int | None, weak_hash: bool) -> None:
        # A one-byte hash makes different prefixes collide all the time; with
        # verify_cached_tokens a collision must never hand a request a block of
        # other tokens (checked by check_conservation_and_sharing).
        specs = HYBRID_LAYOUTS[layout]
        self.mgr = manager(
            num_blocks,
            specs,
            max_model_len=1024,
            hash_algo="xxh3_native",
            hash_seed="0",
            prefix_cache_retention_interval=retention,
            verify_cached_tokens=weak_hash or retention is None,
            hash_truncate_bytes=1 if weak_hash else None,
        )
        self.block_sizes = [s.block_size for s in specs]
        self.lcm = max(self.block_sizes)  # 4 and 8 here
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.kept: list[tuple[str, pk.ComputedBlocks]] = []

    def live(self) -> list[str]:
        return sorted(self.tokens)

    def holds(self, rid: str) -> bool:
        return any(len(g) for g in self.mgr.get_block_ids(rid))

    def waiting(self) -> list[str]:
        return [r for r in self.live() if not self.holds(r)]

    def running(self) -> list[str]:
        return [r for r in self.live() if self.holds(r)]

    def allocate(self, rid: str, num_new: int, **kwargs: Any) -> None:
        """``allocate_slots``: success, "does not fit" (None), or a refusal that
        must change nothing."""
        before = snapshot(self.mgr, self.live())
        try:
            new = self.mgr.allocate_slots(rid, num_new, **kwargs)
        except (pk.CannotFitError, pk.StaleComputedBlocksError, pk.InvalidArgumentError):
            assert snapshot(self.mgr, self.live()) == before
            return
        if new is None:
            return
        assert len(new) == len(self.block_sizes)
        hit = kwargs.get("new_computed_blocks")
        done = kwargs["num_computed_tokens"] + num_new
        if hit is not None:
            done += hit.num_computed_tokens
        self.computed[rid] = done

    @drawn(rid=request_ids, prompt=prompts)
    def add_request(self, rid: str, prompt: list[int]) -> None:
        if rid in self.tokens:
            assert_refused_unchanged(
                self.mgr,
                self.live(),
                pk.DuplicateRequestError,
                lambda: self.mgr.add_request(rid, prompt),
            )
            return
        self.mgr.add_request(rid, prompt)
        self.tokens[rid] = list(prompt)
        self.computed[rid] = 0

    @precondition(lambda self: bool(self.waiting()))
    @drawn(chunk=chunks, kept=st.booleans())
    def admit(self, data: st.DataObject, chunk: int | None, kept: bool) -> None:
        rid = data.draw(st.sampled_from(self.waiting()))
        if kept and self.kept:
            _, hit = data.draw(st.sampled_from(self.kept))
        else:
            hit = self.mgr.get_computed_blocks(rid)
            n = len(self.tokens[rid])
            # A hit never covers the last token and ends on the LCM of block sizes.
            assert hit.num_computed_tokens <= n - 1
            assert hit.num_computed_tokens % self.lcm == 0
            # Full-attention hit blocks are cached under the request's own hashes.
            hashes = self.mgr.block_hashes(rid)
            for i, b in enumerate(as_lists(hit.block_ids)[0]):  # type: ignore[index]
                per_block = self.block_sizes[0] // self.mgr.hash_block_size
                cached = self.mgr.cached_block_hash(b)
                assert cached is not None
                assert cached[0] == hashes[(i + 1) * per_block - 1]
            self.kept = [*self.kept[-3:], (rid, hit)]
        rest = max(1, len(self.tokens[rid]) - hit.num_computed_tokens)
        num_new = rest if chunk is None else min(chunk, rest)
        self.allocate(rid, num_new, num_computed_tokens=0, new_computed_blocks=hit)

    @precondition(lambda self: bool(self.running()))
    @drawn(chunk=st.integers(1, 12), token=st.integers(0, 1))
    def step(self, data: st.DataObject, chunk: int, token: int) -> None:
        rid = data.draw(st.sampled_from(self.running()))
        toks, done = self.tokens[rid], self.computed[rid]
        if done >= len(toks):
            if len(toks) >= 80:
                return
            self.mgr.append_token_ids(rid, [token])
            toks.append(token)
        self.allocate(rid, min(chunk, len(toks) - done), num_computed_tokens=done)

    @precondition(lambda self: bool(self.running()))
    @drawn()
    def remove_skipped_blocks(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.running()))
        self.mgr.remove_skipped_blocks(rid, self.computed[rid])

    @precondition(lambda self: bool(self.tokens))
    @drawn()
    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.live()))
        self.mgr.free(rid)
        self.computed[rid] = 0
        assert all(len(g) == 0 for g in self.mgr.get_block_ids(rid))

    @precondition(lambda self: bool(self.tokens))
    @drawn()
    def remove(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.live()))
        self.mgr.remove_request(rid)
        del self.tokens[rid], self.computed[rid]

    @rule(
        which=st.sampled_from(["evict", "reset", "new_step"]),
        ids=st.lists(st.integers(0, 30), max_size=3),
    )
    def maintenance(self, which: str, ids: list[int]) -> None:
        if which == "new_step":
            self.mgr.new_step_starts()
        elif which == "reset":
            idle = self.mgr.num_free_blocks == self.mgr.num_blocks - 1
            assert self.mgr.reset_prefix_cache() == idle
            if idle:
                assert self.mgr.num_cached_block_hashes == 0
        elif any(b >= self.mgr.num_blocks for b in ids):
            assert_refused_unchanged(
                self.mgr, self.live(), pk.InvalidArgumentError, lambda: self.mgr.evict_blocks(ids)
            )
        else:
            self.mgr.evict_blocks(ids)

    @invariant()
    def holds_together(self) -> None:
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_invariants()
        assert self.mgr.num_requests == len(self.tokens)
        check_conservation_and_sharing(self.mgr, self.tokens, self.block_sizes)

    def teardown(self) -> None:
        if not hasattr(self, "mgr"):
            return
        for rid in self.live():
            self.mgr.remove_request(rid)
        assert self.mgr.num_free_blocks == self.mgr.num_blocks - 1
        assert self.mgr.reset_prefix_cache()
        assert self.mgr.num_cached_block_hashes == 0
        self.mgr.check_invariants()


@pytest.mark.parametrize("layout", sorted(HYBRID_LAYOUTS))
def test_colliding_hashes_never_share_blocks_of_other_tokens(layout: str) -> None:
    """A one-byte hash with collision safety on: many prefix lookups land on a block
    cached for other tokens; none may be served (every shared block holds the same
    tokens in every holder), and the collisions are counted."""
    rng = __import__("random").Random(layout)
    specs = HYBRID_LAYOUTS[layout]
    mgr = manager(
        48,
        specs,
        hash_algo="xxh3_native",
        hash_seed="0",
        verify_cached_tokens=True,
        hash_truncate_bytes=1,
    )
    tokens: dict[str, list[int]] = {}
    block_sizes = [s.block_size for s in specs]
    for i in range(300):
        rid = f"r{i}"
        prompt = [rng.randrange(2) for _ in range(rng.randrange(9, 30))]
        mgr.add_request(rid, prompt)
        tokens[rid] = prompt
        hit = mgr.get_computed_blocks(rid)
        new = mgr.allocate_slots(
            rid,
            len(prompt) - hit.num_computed_tokens,
            num_computed_tokens=0,
            new_computed_blocks=hit,
        )
        if new is None or len(tokens) > 4:
            old = min(tokens, key=lambda r: int(r[1:]))
            mgr.remove_request(old)
            del tokens[old]
        mgr.check_invariants()
        check_conservation_and_sharing(mgr, tokens, block_sizes)
    assert mgr.verification_failures > 0
    for rid in tokens:
        mgr.remove_request(rid)
    assert mgr.num_free_blocks == 47


TestSingleGroup = SingleGroupMachine.TestCase
TestSingleGroup.settings = SETTINGS
TestHybrid = HybridMachine.TestCase
TestHybrid.settings = SETTINGS
