"""The host store behind an offload tier: device blocks copied into the tier's
slots and back, and attention over blocks loaded back from host memory equal to
the dense reference, the device copy poisoned in between."""

from __future__ import annotations

import numpy as np
import pagedkv as pk
import pytest

torch = pytest.importorskip("torch")

from pagedkv.offload import OffloadTier, offload_key  # noqa: E402
from pagedkv.torch import (  # noqa: E402
    AttentionMetadata,
    HostKVStore,
    KVCache,
    TinyConfig,
    TinyTransformer,
    allocate_kv_cache,
    dense_attention,
    paged_attention,
    write_kv,
)

torch.set_num_threads(1)
BS, BPC = 4, 2


def _cache(layer_types: tuple[str, ...], num_blocks: int = 32) -> KVCache:
    model = TinyTransformer(TinyConfig(layer_types=layer_types))
    config = pk.get_kv_cache_config(
        model.kv_cache_specs(BS), 0, max_model_len=32, num_gpu_blocks_override=num_blocks
    )
    return allocate_kv_cache(config, "cpu")


def _fill(cache: KVCache, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for g in range(len(cache.config.kv_cache_groups)):
        for t in cache.group_block_tensors(g):
            t.copy_(torch.randn(t.shape, generator=gen))


def _blocks(cache: KVCache, g: int, ids: list[int]) -> list[torch.Tensor]:
    return [t[ids].clone() for t in cache.group_block_tensors(g)]


def test_blocks_round_trip_through_the_tier_slots_into_other_blocks() -> None:
    cache = _cache(("full", "sliding"))
    _fill(cache, 1)
    store = HostKVStore(cache, num_chunks=4, blocks_per_chunk=BPC)
    tier = OffloadTier(4)
    # two chunks of each group: a key, and so a slot, names one group's chunk
    keys = [[offload_key(bytes([i]) * 32, g) for i in range(2)] for g in range(2)]
    src = [[3, 4, 9, 10], [5, 6, 11, 12]]  # per group, two blocks a chunk
    before = [_blocks(cache, g, src[g]) for g in range(2)]
    for g in range(2):
        _, slots, _ = tier.prepare_store(keys[g], 0)  # type: ignore[misc]
        copy = store.store(g, slots, src[g])
        assert copy.done() and copy.nbytes == 2 * store.chunk_nbytes(g)
        tier.complete_store(keys[g])
    _fill(cache, 2)  # the device copy is overwritten
    dst = [[20, 21, 22, 23], [24, 25, 26, 27]]
    for g in range(2):
        slots = tier.prepare_load(keys[g], 1)
        store.load(g, slots, dst[g]).wait()
        tier.complete_load(keys[g])
    for g in range(2):
        for a, b in zip(before[g], _blocks(cache, g, dst[g]), strict=True):
            assert torch.equal(a, b)
    # slot order is respected: loading the slots reversed swaps the chunks
    store.load(0, tier.prepare_read(keys[0])[::-1], dst[0])
    assert torch.equal(_blocks(cache, 0, [20, 21])[0], before[0][0][2:])


def test_attention_over_blocks_loaded_back_equals_the_dense_reference() -> None:
    cache = _cache(("full",))
    (layer,) = cache.group_layers(0)
    kv = layer.kv
    assert isinstance(kv, torch.Tensor)
    heads, size = kv.shape[3], kv.shape[4]
    n = 4 * BS  # four blocks: two chunks
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(n, heads, size, generator=gen) for _ in range(2))
    q = torch.randn(n, 2 * heads, size, generator=gen)
    first = [1, 2, 3, 4]
    slot_mapping = torch.tensor([first[t // BS] * BS + t % BS for t in range(n)])
    write_kv(k, v, kv, slot_mapping)

    store = HostKVStore(cache, num_chunks=2, blocks_per_chunk=BPC)
    tier = OffloadTier(2)
    keys = [offload_key(bytes([i + 1]) * 32, 0) for i in range(2)]
    _, slots, _ = tier.prepare_store(keys, 0)  # type: ignore[misc]
    store.store(0, slots, first).wait()
    tier.complete_store(keys)
    kv[:, first] = float("nan")  # the device blocks are reused and overwritten

    second = [9, 7, 12, 5]
    store.load(0, tier.prepare_load(keys, 1), second).wait()
    tier.complete_load(keys)

    def attend(blocks: list[int]) -> torch.Tensor:
        meta = AttentionMetadata(
            block_table=torch.tensor([blocks], dtype=torch.int32),
            slot_mapping=torch.tensor([blocks[t // BS] * BS + t % BS for t in range(n)]),
            query_start_loc=np.array([0, n], dtype=np.int64),
            seq_lens=np.array([n], dtype=np.int64),
            rows=np.array([0], dtype=np.int64),
            block_size=BS,
        )
        return paged_attention(q, kv, meta, size**-0.5)

    expected = dense_attention(q, k, v, size**-0.5)
    assert torch.allclose(attend(second), expected, atol=1e-5)
    assert torch.isnan(attend(first)).all()  # the poisoned blocks would not do


@pytest.mark.parametrize(
    ("group", "slots", "ids", "match"),
    [
        (0, [4], [1, 2], "slot out of range"),
        (2, [0], [1, 2], "group must be"),
        (0, [0, 0], [1, 2, 3, 4], "listed twice"),
        (0, [0], [1, 2, 3], "holds 3 ids"),
        (0, [0], [1, 99], "block id out of range"),
        (0, [[0]], [1, 2], "1-D"),
    ],
)
def test_bad_copies_are_refused_before_anything_moves(
    group: int, slots: list[int], ids: list[int], match: str
) -> None:
    cache = _cache(("full", "sliding"))
    _fill(cache, 4)
    store = HostKVStore(cache, num_chunks=4, blocks_per_chunk=BPC)
    snapshot = [t.clone() for t in store.host.group_block_tensors(0)]
    with pytest.raises(ValueError, match=match):
        store.store(group, slots, ids)
    assert all(
        torch.equal(a, b) for a, b in zip(snapshot, store.host.group_block_tensors(0), strict=True)
    )
    with pytest.raises(ValueError, match="positive int"):
        HostKVStore(cache, num_chunks=0, blocks_per_chunk=BPC)


def test_chunk_bytes_round_trip_between_host_blocks() -> None:
    # A disk chunk's bytes: gathered from host blocks, scattered into others.
    cache = _cache(("full", "sliding"))
    _fill(cache, 3)
    store = HostKVStore(cache, num_chunks=4, blocks_per_chunk=BPC)
    store.store_blocks(1, [3, 4], [0, 1]).wait()
    data = store.chunk_bytes(1, [0, 1])
    assert data.dtype == np.uint8 and len(data) == store.chunk_nbytes(1)
    reused = np.zeros_like(data)
    assert store.chunk_bytes(1, [0, 1], out=reused) is reused
    assert np.array_equal(reused, data)
    store.set_chunk_bytes(1, [6, 7], data)
    store.load_blocks(1, [20, 21], [6, 7]).wait()
    for a, b in zip(_blocks(cache, 1, [3, 4]), _blocks(cache, 1, [20, 21]), strict=True):
        assert torch.equal(a, b)
    for bad in (data[:-1], data.astype(np.int16), np.zeros((2, len(data) // 2), np.uint8)):
        with pytest.raises(ValueError):
            store.set_chunk_bytes(1, [6, 7], bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out of range"):
        store.chunk_bytes(1, [0, 8])
    with pytest.raises(ValueError, match="group"):
        store.chunk_bytes(2, [0, 1])
