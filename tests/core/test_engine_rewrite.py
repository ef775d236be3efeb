"""An engine that rewrites a request in place (vLLM 0.33's streaming-input
sessions: the next chunk drops the last sampled token, truncates the block
hashes and re-hashes): ``sync_request`` sees the rewrite and cuts the request
back to the first difference, so no block is ever cached under a hash, or
published with tokens, the request no longer has.

The expected hits are vLLM 0.33's on the same calls: block size 4, prompt
1..6, sampled 100 and 101, next chunk 7..11; vLLM's manager then hits 12
tokens for a request carrying the session's real content and 4 for one
carrying the discarded token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import pagedkv as pk
import pytest
from pagedkv.errors import InvalidArgumentError, StaleComputedBlocksError

from tests._util import make_manager

BS = 4


def chain(tokens: list[int]) -> list[bytes]:
    """An engine's block hashes: each full block's over every token up to it."""
    out, parent = [], b"root"
    for i in range(len(tokens) // BS):
        block = ",".join(map(str, tokens[i * BS : (i + 1) * BS])).encode()
        parent = hashlib.sha256(parent + block).digest()
        out.append(parent)
    return out


def manager(events: bool) -> pk.KVCacheManager:
    return make_manager(
        BS,
        64,
        external_block_hashes=True,
        record_stats_at_admission=False,
        enable_kv_cache_events=events,
    )


class Engine:
    """An engine's own copy of one request: its lists, synced to the manager
    before every call, as the vLLM drop-in does."""

    def __init__(self, m: pk.KVCacheManager, rid: str, prompt: list[int]) -> None:
        self.m, self.rid = m, rid
        self.tokens = list(prompt)
        self.hashes = chain(self.tokens)
        self.num_prompt = len(prompt)
        self.computed = 0
        m.add_request(rid, list(prompt))

    def sync(self) -> bool:
        return self.m.sync_request(
            self.rid, self.tokens, self.hashes, num_prompt_tokens=self.num_prompt
        )

    def append(self, *tokens: int) -> None:
        self.tokens += tokens
        self.hashes += chain(self.tokens)[len(self.hashes) :]

    def step(self, n: int, hit: Any = None) -> None:
        self.sync()
        got = 0 if hit is None else hit.num_computed_tokens
        new = self.m.allocate_slots(
            self.rid,
            n,
            num_computed_tokens=self.computed,
            num_new_computed_tokens=got,
            new_computed_blocks=hit,
        )
        assert new is not None
        self.computed += got + n

    def next_chunk(self, chunk: list[int]) -> None:
        """vLLM's ``_update_request_as_session``: the last sampled token goes."""
        keep = len(self.tokens) - 1
        assert keep >= self.computed
        del self.tokens[keep:]
        del self.hashes[keep // BS :]
        self.tokens += chunk
        self.hashes += chain(self.tokens)[len(self.hashes) :]
        self.num_prompt = len(self.tokens)


def hit_of(m: pk.KVCacheManager, rid: str, tokens: list[int]) -> int:
    m.add_request(rid, tokens)
    m.sync_request(rid, tokens, chain(tokens))
    return m.get_computed_blocks(rid).num_computed_tokens


def streaming_session(m: pk.KVCacheManager) -> Engine:
    """Prompt 1..6, sampled 100 then 101 with the step after each already
    scheduled (async scheduling: the manager has seen 101 and block 1's hash
    before the session's next chunk arrives), then the next chunk 7..11."""
    s = Engine(m, "session", [1, 2, 3, 4, 5, 6])
    s.step(6, m.get_computed_blocks("session"))
    s.append(100)
    s.step(1)  # position 6 (100) in flight
    s.append(101)
    s.sync()  # the manager holds 101 and the hash of [5, 6, 100, 101]
    assert m.num_tokens("session") == 8 and len(m.block_hashes("session")) == 2
    # The turn ends on 101: vLLM keeps the computed frontier (7) and drops 101.
    s.next_chunk([7, 8, 9, 10, 11])
    s.sync()
    assert m.block_hashes("session") == s.hashes
    s.step(len(s.tokens) - s.computed)  # the chunk's prefill caches blocks 1, 2
    return s


@pytest.mark.parametrize("events", [False, True])
def test_a_streaming_rewrite_is_seen_and_cached_under_its_own_hashes(events: bool) -> None:
    m = manager(events)
    streaming_session(m)
    real = [1, 2, 3, 4, 5, 6, 100, 7, 8, 9, 10, 11, 50]
    discarded = [1, 2, 3, 4, 5, 6, 100, 101, 60, 61, 62, 63, 64]
    assert hit_of(m, "real", real) == 12
    # Block 1 holds KV of [5, 6, 100, 7]: never served for [5, 6, 100, 101].
    assert hit_of(m, "discarded", discarded) == 4
    m.check_invariants()


def test_sync_reports_the_cut_back() -> None:
    m = manager(False)
    s = Engine(m, "session", [1, 2, 3, 4, 5, 6])
    s.step(6)
    s.append(100, 101)
    assert s.sync() is False
    s.next_chunk([7, 8, 9, 10, 11])
    assert s.sync() is True
    assert s.sync() is False
    assert (m.num_tokens("session"), m.block_hashes("session")) == (12, s.hashes)


def test_events_publish_the_tokens_the_blocks_hold_after_a_rewrite() -> None:
    m = manager(True)
    streaming_session(m)
    stored = [e for e in m.take_events(raw_hashes=True) if isinstance(e, pk.BlockStored)]
    blocks = [(tuple(e.token_ids), e.block_hashes) for e in stored]
    tokens = [1, 2, 3, 4, 5, 6, 100, 7, 8, 9, 10, 11]
    hashes = chain(tokens)
    assert blocks == [((1, 2, 3, 4), hashes[:1]), ((5, 6, 100, 7, 8, 9, 10, 11), hashes[1:3])]
    assert all(101 not in e.token_ids for e in stored)


def test_the_prompt_length_follows_the_engine() -> None:
    m = manager(False)
    s = streaming_session(m)
    assert m.num_prompt_tokens("session") == s.num_prompt == 12
    with pytest.raises(InvalidArgumentError, match="prompt of 13 tokens"):
        m.sync_request("session", s.tokens, s.hashes, num_prompt_tokens=13)
    assert m.num_prompt_tokens("session") == 12


@pytest.mark.parametrize("events", [False, True])
def test_shorter_lists_cut_the_request_back(events: bool) -> None:
    m = manager(events)
    tokens = list(range(10))
    m.add_request("r", tokens)
    assert m.sync_request("r", tokens, chain(tokens)) is False
    assert m.sync_request("r", tokens[:6], chain(tokens[:6])) is True
    assert (m.num_tokens("r"), m.block_hashes("r")) == (6, chain(tokens[:6]))
    # Growing again from there is the common path.
    assert m.sync_request("r", tokens, chain(tokens)) is False
    assert (m.num_tokens("r"), m.block_hashes("r")) == (10, chain(tokens))


def test_a_rewritten_token_is_found_where_token_values_are_read() -> None:
    # With events on the manager publishes token values: a token rewritten
    # inside the last, partial block (no hash covers it yet) is found too.
    m = manager(True)
    m.add_request("r", [1, 2, 3, 4, 5, 6])
    m.sync_request("r", [1, 2, 3, 4, 5, 6], chain([1, 2, 3, 4, 5, 6]))
    rewritten = [1, 2, 3, 4, 5, 9, 7, 8]
    assert m.sync_request("r", rewritten, chain(rewritten)) is True
    m.allocate_slots("r", 8, num_computed_tokens=0)
    stored = [e for e in m.take_events() if isinstance(e, pk.BlockStored)]
    assert [list(e.token_ids) for e in stored] == [[1, 2, 3, 4, 5, 9, 7, 8]]


def test_a_rewrite_below_a_cached_block_is_refused_and_changes_nothing() -> None:
    # vLLM rewrites only tokens past the computed frontier; a rewrite of a
    # block whose KV is cached would leave the cache naming old tokens' KV.
    m = manager(True)
    tokens = list(range(1, 13))
    m.add_request("r", tokens)
    m.sync_request("r", tokens, chain(tokens))
    m.allocate_slots("r", 12, num_computed_tokens=0)
    other = [*tokens[:5], 99, *tokens[6:]]
    with pytest.raises(InvalidArgumentError, match="cached its first 12 tokens"):
        m.sync_request("r", other, chain(other))
    assert (m.num_tokens("r"), m.block_hashes("r")) == (12, chain(tokens))
    m.check_invariants()


def test_a_block_is_published_only_with_all_its_tokens() -> None:
    # vLLM's prefill-side connectors drop a prompt's last token after it was
    # hashed: the hash of a block whose tokens are not all there is kept (as
    # vLLM keeps it) but nothing is cached or published under it.
    m = manager(True)
    tokens = list(range(1, 9))
    hashes = chain(tokens)
    m.add_request("r", tokens[:7])
    m.sync_request("r", tokens[:7], hashes)
    assert m.block_hashes("r") == hashes
    m.allocate_slots("r", 7, num_computed_tokens=0)
    stored = [e for e in m.take_events() if isinstance(e, pk.BlockStored)]
    assert [list(e.token_ids) for e in stored] == [[1, 2, 3, 4]]
    with pytest.raises(InvalidArgumentError, match="hashed tokens"):
        m.cache_detached_blocks("r", 0, [5, 6], 0, 2)
    m.check_invariants()
    # Once the token is there, the block is cached under the hash it had.
    m.sync_request("r", tokens, hashes)
    m.allocate_slots("r", 1, num_computed_tokens=7)
    stored = [e for e in m.take_events(raw_hashes=True) if isinstance(e, pk.BlockStored)]
    assert [(list(e.token_ids), e.block_hashes) for e in stored] == [([5, 6, 7, 8], hashes[1:])]


def test_a_lookup_taken_before_a_rewrite_is_checked_again() -> None:
    m = manager(False)
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert hit_of(m, "a", first) == 0
    m.allocate_slots("a", 9, num_computed_tokens=0)
    m.add_request("b", first)
    m.sync_request("b", first, chain(first))
    hit = m.get_computed_blocks("b")
    assert hit.num_computed_tokens == 8
    rewritten = [1, 2, 3, 4, 5, 6, 7, 0, 9]
    m.sync_request("b", rewritten, chain(rewritten))
    with pytest.raises(StaleComputedBlocksError):
        m.allocate_slots(
            "b", 1, num_computed_tokens=0, num_new_computed_tokens=8, new_computed_blocks=hit
        )
    assert m.get_computed_blocks("b").num_computed_tokens == 4
    m.check_invariants()


def test_bad_items_met_while_verifying_change_nothing() -> None:
    m = manager(True)
    tokens = list(range(1, 10))
    m.add_request("r", tokens)
    m.sync_request("r", tokens, chain(tokens))
    with pytest.raises(TypeError, match="bytes"):
        m.sync_request("r", [*tokens, 10], [chain(tokens)[0], "not bytes"])
    with pytest.raises(TypeError):
        m.sync_request("r", [*tokens[:8], "x", 10], chain(tokens))
    assert (m.num_tokens("r"), m.block_hashes("r")) == (9, chain(tokens))


class _Calling(Sequence[Any]):
    """An engine's own sequence type whose item access runs code: here, a
    call back into the manager the first time it is read."""

    def __init__(self, items: list[Any], on_read: Any) -> None:
        self._items, self._on_read = items, on_read

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: Any) -> Any:
        if self._on_read is not None:
            call, self._on_read = self._on_read, None
            call()
        return self._items[i]


def test_the_engines_sequences_may_call_back_into_the_manager() -> None:
    # The manager is not held while the engine's lists are read.
    m = manager(True)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    m.add_request("r", tokens)
    m.sync_request("r", tokens, chain(tokens))
    seen: list[int] = []
    grown = [*tokens, 8]
    m.sync_request("r", _Calling(grown, lambda: seen.append(m.num_tokens("r"))), chain(grown))
    assert seen == [7]
    assert m.num_tokens("r") == 8


def test_a_request_changed_while_its_lists_are_read_is_synced_again() -> None:
    # Another sync of the same request runs from inside the engine's sequence
    # (as another thread could): the outer sync starts over and wins.
    m = manager(True)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    m.add_request("r", tokens)
    m.sync_request("r", tokens, chain(tokens))
    other = [*tokens, 99]
    ours = [*tokens, 8]

    def inner() -> None:
        m.sync_request("r", other, chain(other))

    m.sync_request("r", _Calling(ours, inner), chain(ours))
    assert m.block_hashes("r") == chain(ours)
    m.allocate_slots("r", 8, num_computed_tokens=0)
    stored = [e for e in m.take_events() if isinstance(e, pk.BlockStored)]
    assert [list(e.token_ids) for e in stored] == [[1, 2, 3, 4, 5, 6, 7, 8]]
    m.check_invariants()
