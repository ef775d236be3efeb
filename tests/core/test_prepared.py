"""Requests prepared off the scheduler's thread: ``request_preparer().prepare``
builds and hashes a request as ``add_request`` would, without the manager (on
any thread, the hashing without the GIL); ``add_prepared`` registers it. A
prepared request behaves exactly as an added one; a bad one is refused, the
manager unchanged and the prepared request still usable."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pagedkv as pk
import pytest
from pagedkv.errors import DuplicateRequestError, InvalidArgumentError

from tests._util import as_lists, make_manager, snapshot


def _prompts() -> list[tuple[str, Any, dict[str, Any]]]:
    shared = list(range(1000, 1048))
    return [
        ("a", shared + [5] * 20, {}),
        ("b", np.array(shared + [6] * 9, dtype=np.uint32), {}),
        ("c", shared + [7] * 40, {"cache_salt": "tenant-1"}),
        ("d", shared + [8] * 17, {"lora_name": "ad", "lora_id": 3}),
        ("e", [9] * 10 + [0] * 30, {"mm_features": [("img", 10, 30)]}),
    ]


def _run(m: pk.KVCacheManager, register: Any) -> list[Any]:
    """Registers each prompt, looks it up and admits it, then decodes a few steps."""
    out = []
    for rid, prompt, kw in _prompts():
        register(m, rid, prompt, kw)
        hit = m.get_computed_blocks(rid)
        n = len(prompt) - hit.num_computed_tokens
        new = m.allocate_slots(
            rid,
            n,
            num_computed_tokens=0,
            num_new_computed_tokens=hit.num_computed_tokens,
            new_computed_blocks=hit,
        )
        out.append((rid, hit.num_computed_tokens, as_lists(new), m.block_hashes(rid)))
    for step in range(20):
        for rid, prompt, _ in _prompts():
            m.append_token_ids(rid, [step])
            m.allocate_slots(rid, 1, num_computed_tokens=len(prompt) + step)
    out.append(m.take_events())
    out.append(snapshot(m, [p[0] for p in _prompts()]))
    return out


def _add(m: pk.KVCacheManager, rid: str, prompt: Any, kw: dict[str, Any]) -> None:
    m.add_request(rid, prompt, **kw)


def _prepared(m: pk.KVCacheManager, rid: str, prompt: Any, kw: dict[str, Any]) -> None:
    p = m.request_preparer().prepare(rid, prompt, **kw)
    assert (p.request_id, p.num_tokens, p.added) == (rid, len(prompt), False)
    assert p.num_block_hashes == len(prompt) // 4
    assert m.add_prepared(p) == m.request_handle(rid)
    assert p.added and "added=True" in repr(p)


@pytest.mark.parametrize("hash_algo", ["sha256_cbor", "xxhash_cbor"])
def test_a_prepared_request_behaves_as_an_added_one(hash_algo: str) -> None:
    """Hashes, hits, block ids, events and the whole state, step by step."""

    def manager() -> pk.KVCacheManager:
        return make_manager(
            4, 96, enable_kv_cache_events=True, hash_algo=hash_algo, hash_seed="fixed"
        )

    assert _run(manager(), _prepared) == _run(manager(), _add)


def test_requests_prepared_on_other_threads_are_added_on_this_one() -> None:
    """Preparers run on a thread pool (while this thread keeps calling the
    manager); what they prepare is added here, in arrival order, and behaves
    as ``add_request`` would."""
    m, ref = make_manager(16, 512), make_manager(16, 512)
    preparer = m.request_preparer()
    prompts = {f"r{i}": [i % 3] * 64 + list(range(i, i + 150)) for i in range(40)}
    with ThreadPoolExecutor(4) as pool:
        futures = {rid: pool.submit(preparer.prepare, rid, p) for rid, p in prompts.items()}
        for rid, fut in futures.items():
            m.add_prepared(fut.result())
            ref.add_request(rid, prompts[rid])
            assert m.block_hashes(rid) == ref.block_hashes(rid)
            assert m.get_computed_blocks(rid).num_computed_tokens == (
                ref.get_computed_blocks(rid).num_computed_tokens
            )
    assert m.num_requests == 40


def test_bad_prepared_requests_are_refused_and_stay_usable() -> None:
    a, b = make_manager(4, 32), make_manager(4, 32)
    other = b.request_preparer().prepare("x", list(range(12)))
    before = snapshot(a)
    with pytest.raises(InvalidArgumentError, match="another manager"):
        a.add_prepared(other)
    assert snapshot(a) == before and not other.added
    b.add_prepared(other)  # its own manager takes it
    before = snapshot(b, ["x"])
    with pytest.raises(InvalidArgumentError, match="added already"):
        b.add_prepared(other)
    assert snapshot(b, ["x"]) == before and b.num_tokens("x") == 12

    a.add_request("dup", [1, 2, 3])
    dup = a.request_preparer().prepare("dup", list(range(12)))
    before = snapshot(a, ["dup"])
    with pytest.raises(DuplicateRequestError):
        a.add_prepared(dup)
    assert snapshot(a, ["dup"]) == before and not dup.added
    a.remove_request("dup")
    a.add_prepared(dup)
    assert a.num_tokens("dup") == 12

    preparer = a.request_preparer()
    with pytest.raises(InvalidArgumentError, match="more than the 8192"):
        preparer.prepare("long", [1] * 8193)
    with pytest.raises(InvalidArgumentError, match="empty"):
        preparer.prepare("empty", [])
    with pytest.raises(InvalidArgumentError, match="outside"):
        preparer.prepare("negative", [5, -1])
    with pytest.raises(TypeError):
        preparer.prepare("floats", [1.5])
    # Preparing, refused or not, registers nothing: "dup" is still the only request.
    assert a.num_requests == 1 and "dup" in a
    a.check_invariants()


def test_an_engine_hashed_manager_has_no_preparer() -> None:
    m = make_manager(4, 32, external_block_hashes=True)
    with pytest.raises(InvalidArgumentError, match="external_block_hashes"):
        m.request_preparer()


def test_the_scheduler_on_prepared_requests_allocates_as_on_added_ones() -> None:
    """The simulator's backend with every request prepared ahead
    (``ManagerBackend.prepare``) allocates block for block as with
    ``add_request``, and registers each request with ``add_prepared``."""
    from pagedkv._oracle.trace import TraceConfig, generate
    from pagedkv.sim import ManagerBackend, Scheduler, SchedulerConfig, drive

    reqs = generate(TraceConfig(seed=3, num_requests=120)).scheduler_requests()
    stats = []
    for prepared in (False, True):
        m = make_manager(16, 1024, max_model_len=16384)
        backend = ManagerBackend(m)
        sched = Scheduler(backend, SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096))
        items = [r.fresh() for r in reqs]
        added: list[str] = []
        if prepared:
            backend.prepare(items)
            assert m.num_requests == 0
            add = m.add_prepared

            def counted(p: pk.PreparedRequest, add: Any = add, added: list[str] = added) -> int:
                added.append(p.request_id)
                return int(add(p))

            m.add_prepared = counted  # type: ignore[method-assign]
        drive(sched, items)
        stats.append(sched.stats)
        m.check_invariants()
        assert len(added) == (120 if prepared else 0)
    assert stats[0].alloc_checksum == stats[1].alloc_checksum
    assert stats[0].steps == stats[1].steps and stats[0].preemptions == stats[1].preemptions
