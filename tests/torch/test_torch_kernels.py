"""Reference kernels: K/V written through a slot mapping and read back through a
block table give dense attention's answer; blocks a query cannot see are never read
(they hold NaN here)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pagedkv.torch import (  # noqa: E402
    AttentionMetadata,
    copy_blocks,
    dense_attention,
    paged_attention,
    write_kv,
    write_slots,
)

torch.set_num_threads(1)

BS, NUM_BLOCKS, HQ, HKV, D = 4, 64, 4, 2, 8


def _case(
    window: int | None, chunk: int | None, seed: int = 0
) -> tuple[torch.Tensor, list[torch.Tensor], AttentionMetadata, list[tuple[int, int]]]:
    """Three requests (a whole prefill, a chunk after a context, a decode) written into
    a NaN-filled cache at random blocks. Returns the cache, each request's expected
    output, the metadata and (ctx, seq_len) per request."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    kv = torch.full((2, NUM_BLOCKS, BS, HKV, D), float("nan"))
    shapes = [(0, 13), (17, 22), (30, 31)]  # (context, seq_len)
    ids = rng.permutation(np.arange(1, NUM_BLOCKS))
    table = torch.zeros(3, 8, dtype=torch.int32)
    step_q, step_k, step_v, expected, slots = [], [], [], [], []
    used = 0
    for r, (ctx, seq_len) in enumerate(shapes):
        q = torch.randn(seq_len, HQ, D, generator=gen)
        k = torch.randn(seq_len, HKV, D, generator=gen)
        v = torch.randn(seq_len, HKV, D, generator=gen)
        nb = -(-seq_len // BS)
        blocks = ids[used : used + nb]
        used += nb
        table[r, :nb] = torch.from_numpy(blocks.astype(np.int32))
        # The context was written in earlier steps; the slots are computed here,
        # independently of the block-table code.
        pos = np.arange(seq_len)
        slot = blocks[pos // BS] * BS + pos % BS
        write_kv(k[:ctx], v[:ctx], kv, torch.from_numpy(slot[:ctx]))
        # Blocks wholly before the first position any query sees are released: the
        # table says null block 0 there and the memory holds NaN again.
        lo = 0
        if window is not None:
            lo = max(lo, ctx - window + 1)
        if chunk is not None:
            lo = max(lo, ctx // chunk * chunk)
        for j in range(lo // BS):
            kv[:, int(blocks[j])] = float("nan")
            table[r, j] = 0
        step_q.append(q[ctx:])
        step_k.append(k[ctx:])
        step_v.append(v[ctx:])
        slots.append(slot[ctx:])
        dense = dense_attention(q, k, v, D**-0.5, sliding_window=window, attention_chunk_size=chunk)
        expected.append(dense[ctx:])
    # A padding token at the end: slot -1, never written.
    step_k.append(torch.randn(1, HKV, D, generator=gen))
    step_v.append(torch.randn(1, HKV, D, generator=gen))
    slot_mapping = torch.from_numpy(np.concatenate([*slots, [-1]]).astype(np.int64))
    write_kv(torch.cat(step_k), torch.cat(step_v), kv, slot_mapping)
    assert torch.isnan(kv[:, 0]).all()
    qsl = np.array([0, 13, 18, 19], dtype=np.int64)
    meta = AttentionMetadata(
        block_table=table,
        slot_mapping=slot_mapping,
        query_start_loc=qsl,
        seq_lens=np.array([s for _, s in shapes], dtype=np.int64),
        rows=np.arange(3, dtype=np.int64),
        block_size=BS,
        sliding_window=window,
        attention_chunk_size=chunk,
    )
    return kv, [torch.cat(step_q), *expected], meta, shapes


@pytest.mark.parametrize(
    ("window", "chunk"), [(None, None), (6, None), (3, None), (None, 8), (None, 16)]
)
def test_paged_attention_equals_dense(window: int | None, chunk: int | None) -> None:
    kv, (step_q, *expected), meta, _ = _case(window, chunk)
    out = paged_attention(step_q, kv, meta, D**-0.5)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_padding_slots_are_not_written() -> None:
    cache = torch.zeros(4, 2, 3)
    write_slots(cache, torch.ones(3, 3), torch.tensor([5, -1, 0]))
    assert cache.sum().item() == 6
    assert cache[2, 1].tolist() == [1, 1, 1] and cache[0, 0].tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="out of range"):
        write_slots(cache, torch.ones(1, 3), torch.tensor([8]))
    with pytest.raises(ValueError, match="does not match"):
        write_slots(cache, torch.ones(2, 3), torch.tensor([1]))


def test_wrong_block_table_gives_wrong_answer() -> None:
    # The comparison is sharp: swapping two blocks of a request changes the output.
    kv, (step_q, *expected), meta, _ = _case(None, None, seed=1)
    table = meta.block_table.clone()
    table[0, [0, 1]] = table[0, [1, 0]]
    bad = AttentionMetadata(
        table, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.rows, BS
    )
    out = paged_attention(step_q, kv, bad, D**-0.5)
    assert not torch.allclose(out, torch.cat(expected), atol=1e-3)


def test_bad_shapes_raise() -> None:
    kv, (step_q, *_), meta, _ = _case(None, None)
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention(step_q[:, :3], kv, meta, 1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention(step_q[:-1], kv, meta, 1.0)
    before = kv[0].clone()
    with pytest.raises(ValueError, match="cache"):
        write_kv(step_q[:, :2], step_q[:, :2], kv[0], meta.slot_mapping[:-1])
    # Nothing was written (the cache is NaN-poisoned: NaN compares equal here).
    assert torch.allclose(kv[0], before, rtol=0, atol=0, equal_nan=True)


def test_copy_blocks_within_and_across_tensors() -> None:
    a = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    b = a.clone() * 10
    copy_blocks([a, b], [1, 4], [0, 2])
    assert a[0].tolist() == [3, 4, 5] and a[2].tolist() == [12, 13, 14]
    assert b[0].tolist() == [30, 40, 50]
    cpu = torch.zeros(3, 3)
    copy_blocks([a], [3], [1], dst_tensors=[cpu])
    assert cpu[1].tolist() == [9, 10, 11] and cpu[0].tolist() == [0, 0, 0]
    before = a.clone()
    with pytest.raises(ValueError, match="out of range"):
        copy_blocks([a], [5], [0])
    with pytest.raises(ValueError, match="one length"):
        copy_blocks([a], [1, 2], [0])
    assert torch.equal(a, before)  # the refused copies wrote nothing
