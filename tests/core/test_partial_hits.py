"""Fine-grained (partial) prefix hits and Mamba prefill checkpoints through the
Python API: a hybrid full-attention + Mamba "align" model. Expected block ids,
positions and columns are what vLLM 0.33's own manager answers for the same
calls (see ``rust/pagedkv-core/tests/partial_hits.rs``)."""

from __future__ import annotations

import pagedkv as pk
import pytest
from pagedkv.errors import InvalidArgumentError


def hybrid(
    hbs: int,
    full: int,
    mamba: int,
    *,
    alignment: int | None = None,
    num_blocks: int = 64,
    **options: object,
) -> pk.KVCacheManager:
    config = pk.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_groups=[
            pk.KVCacheGroupSpec(["full"], pk.FullAttentionSpec(full, 1, 1, "float32")),
            pk.KVCacheGroupSpec(
                ["mamba"],
                pk.MambaSpec(
                    mamba,
                    ((1,),),
                    ("float32",),
                    mamba_cache_mode="align",
                    prefill_checkpoint_alignment=alignment,
                ),
            ),
        ],
    )
    return pk.KVCacheManager(
        config, max_model_len=8192, hash_block_size=hbs, partial_hash_hits=True, **options
    )


def lists(groups: object) -> list[list[int]]:
    return [[int(b) for b in g] for g in groups]  # type: ignore[attr-defined]


def test_prefill_checkpoints_are_reserved_and_resumed_from() -> None:
    m = hybrid(16, 16, 32, alignment=16)
    m.add_request("r", list(range(104)))
    hit = m.get_computed_blocks("r")
    first = m.allocate_slots("r", 64, num_computed_tokens=0, new_computed_blocks=hit)
    assert lists(first) == [[1, 2, 3, 4], [5, 6]]
    assert m.mamba_checkpoint("r", 1) == (48, 0)
    m.new_step_starts()
    second = m.allocate_slots("r", 40, num_computed_tokens=64)
    assert lists(second) == [[5, 7, 8], [9, 10]]
    assert m.mamba_checkpoint("r", 1) == (96, 2)
    assert m.mamba_checkpoint("r", 0) is None
    assert m.cached_block_num_tokens(9) == 96
    m.new_step_starts()
    m.add_request("f", [*range(104), *[7] * 40])
    hit = m.get_computed_blocks("f")
    assert hit.num_computed_tokens == 96
    assert lists(hit.block_ids) == [[1, 2, 3, 4, 5, 7], [0, 0, 9]]
    m.check_invariants()


def test_a_partial_hit_is_copied_on_write_and_the_copy_drained() -> None:
    m = hybrid(2, 2, 4, num_blocks=20)
    assert m.partial_hash_hits
    m.add_request("0", [0, 0, 1, 1, 2, 2, 3])
    hit = m.get_computed_blocks("0")
    m.allocate_slots("0", 6, num_computed_tokens=0, new_computed_blocks=hit)
    m.free("0")
    m.new_step_starts()
    m.add_request("1", [0, 0, 1, 1, 2, 2, 3, 3])
    hit = m.get_computed_blocks("1")
    assert hit.num_computed_tokens == 6
    shared = int(hit.block_ids[1][-1])
    assert m.cached_block_num_tokens(shared) == 6
    new = m.allocate_slots(
        "1", 2, num_computed_tokens=0, num_new_computed_tokens=6, new_computed_blocks=hit
    )
    copy = int(lists(new)[1][0])
    assert m.partial_hit("1", 1) is None
    assert m.take_block_copies() == [(shared, copy)]
    assert m.num_detached_block_refs == 2
    m.free_blocks([shared, copy])
    assert m.num_detached_block_refs == 0
    m.check_invariants()


def test_boundary_states_are_offered_and_dropped_with_their_request() -> None:
    m = hybrid(2, 2, 4, num_blocks=20)
    m.add_request("0", list(range(16)))
    hit = m.get_computed_blocks("0")
    m.allocate_slots("0", 8, num_computed_tokens=0, new_computed_blocks=hit)
    offers = m.take_boundary_state_offloads()
    mamba = lists(m.get_block_ids("0"))[1]
    assert offers == [("0", 1, mamba[1], 8)]
    m.new_step_starts()
    m.allocate_slots("0", 8, num_computed_tokens=8)
    m.free("0")
    # Freed before the offers were drained: a connector must not claim them.
    assert m.take_boundary_state_offloads() == []
    assert m.finalize_partial_tail_offloads("0", 16, 0) == []


def test_retention_interval_is_settable_and_validated() -> None:
    m = hybrid(16, 16, 32)
    assert m.prefix_cache_retention_interval is None
    m.prefix_cache_retention_interval = 0
    assert m.prefix_cache_retention_interval == 0
    with pytest.raises(InvalidArgumentError):
        m.prefix_cache_retention_interval = 48
    assert m.prefix_cache_retention_interval == 0
