//! vLLM 0.33's fine-grained (partial) prefix hits and Mamba prefill
//! checkpoints in a hybrid full-attention + Mamba "align" model. Expected ids,
//! positions and columns are what vLLM 0.33's own `KVCacheManager` answers for
//! the same calls (`tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py`
//! and the same scenarios replayed through vLLM).

use pagedkv_core::pool::CacheKey;
use pagedkv_core::{
    AllocateArgs, AttentionKind, Error, GroupSpec, KvCacheManager, MambaCacheMode, ManagerConfig,
};

mod support;
use support::{add, ids, ok};

struct Hybrid {
    hbs: u32,
    full: u32,
    mamba: u32,
    checkpoint_alignment: Option<u32>,
    retention: Option<u64>,
    eagle: bool,
    partial: bool,
    num_blocks: u32,
}

fn hybrid(h: &Hybrid) -> KvCacheManager {
    let groups = vec![
        GroupSpec::new(AttentionKind::FullAttention, h.full),
        GroupSpec::new(
            AttentionKind::Mamba {
                mode: MambaCacheMode::Align,
                num_speculative_blocks: 0,
                prefill_checkpoint_alignment: h.checkpoint_alignment,
            },
            h.mamba,
        ),
    ];
    let mut cfg = ManagerConfig::new(h.num_blocks, groups, 8192);
    cfg.hash_block_size = Some(h.hbs);
    cfg.partial_hash_hits = h.partial;
    cfg.prefix_cache_retention_interval = h.retention;
    cfg.use_eagle = h.eagle;
    ok(KvCacheManager::new(cfg))
}

/// Prefills `id` in chunks of `chunk` tokens (the first one adopting the
/// request's hit); per chunk, the new blocks and the Mamba checkpoint reserved.
type Chunk = (Vec<Vec<u32>>, Option<(u64, usize)>);

fn prefill(m: &mut KvCacheManager, id: &str, chunk: u64) -> Vec<Chunk> {
    let n = ok(m.num_tokens(id)) as u64;
    let hit = ok(m.get_computed_blocks(id));
    let mut start = hit.num_computed_tokens;
    let mut out = Vec::new();
    let mut first = Some(hit);
    while start < n {
        let end = (start + chunk).min(n);
        let new = match first.take() {
            Some(h) => {
                let args = AllocateArgs {
                    num_new_computed_tokens: h.num_computed_tokens,
                    ..AllocateArgs::step(end - h.num_computed_tokens, 0)
                };
                ok(m.allocate_slots(id, &args, Some(&h))).map(<[Vec<u32>]>::to_vec)
            }
            None => ok(m.allocate_slots(id, &AllocateArgs::step(end - start, start), None))
                .map(<[Vec<u32>]>::to_vec),
        };
        let new = new.unwrap_or_else(|| panic!("chunk ending at {end} did not fit"));
        out.push((new, ok(m.mamba_checkpoint(id, 1))));
        m.new_step_starts();
        start = end;
    }
    ok(m.check_invariants());
    out
}

/// One allocation of the request's first `n` tokens, adopting its hit.
fn first_chunk(m: &mut KvCacheManager, id: &str, n: u64) {
    let hit = ok(m.get_computed_blocks(id));
    let args = AllocateArgs {
        num_new_computed_tokens: hit.num_computed_tokens,
        ..AllocateArgs::step(n - hit.num_computed_tokens, 0)
    };
    assert!(ok(m.allocate_slots(id, &args, Some(&hit))).is_some());
}

fn seq(n: u32) -> Vec<u32> {
    (0..n).collect()
}

const CHECKPOINTS: Hybrid = Hybrid {
    hbs: 16,
    full: 16,
    mamba: 32,
    checkpoint_alignment: Some(16),
    retention: None,
    eagle: false,
    partial: true,
    num_blocks: 64,
};

#[test]
fn every_prefill_chunk_reserves_a_checkpoint_under_dense_retention() {
    let mut m = hybrid(&CHECKPOINTS);
    add(&mut m, "r", seq(104));
    let chunks = prefill(&mut m, "r", 64);
    assert_eq!(
        chunks,
        vec![
            (vec![vec![1, 2, 3, 4], vec![5, 6]], Some((48, 0))),
            (vec![vec![5, 7, 8], vec![9, 10]], Some((96, 2))),
        ]
    );
    assert_eq!(
        ids(&m, "r"),
        vec![vec![1, 2, 3, 4, 5, 7, 8], vec![0, 6, 9, 10]]
    );
    // The state after 96 tokens sits in the checkpoint block, keyed there.
    assert_eq!(m.pool().primary_tokens(9), Some(96));
    assert_eq!(m.pool().primary_tokens(6), Some(64));
    // A longer prompt resumes from it, inside the Mamba block grid.
    add(&mut m, "f", [seq(104), vec![7; 40]].concat());
    let hit = ok(m.get_computed_blocks("f"));
    assert_eq!(hit.num_computed_tokens, 96);
    assert_eq!(hit.block_ids, vec![vec![1, 2, 3, 4, 5, 7], vec![0, 0, 9]]);
}

#[test]
fn replay_boundary_retention_reserves_only_the_prefill_end_checkpoint() {
    let mut m = hybrid(&Hybrid {
        retention: Some(0),
        ..CHECKPOINTS
    });
    add(&mut m, "r", seq(240));
    let chunks = prefill(&mut m, "r", 128);
    assert_eq!(
        chunks,
        vec![
            (vec![(1..=8).collect(), vec![0, 0, 0, 9]], None),
            (
                vec![(10..=16).collect(), vec![0, 0, 17, 18]],
                Some((224, 6))
            ),
        ]
    );
    add(&mut m, "f", [seq(240), vec![7; 40]].concat());
    let hit = ok(m.get_computed_blocks("f"));
    assert_eq!(hit.num_computed_tokens, 224);
    assert_eq!(hit.block_ids[1], vec![0, 0, 0, 0, 0, 0, 17]);
}

#[test]
fn an_eagle_checkpoint_off_the_block_grid_is_transient_mid_prompt() {
    let mut m = hybrid(&Hybrid {
        eagle: true,
        ..CHECKPOINTS
    });
    add(&mut m, "r", seq(240));
    let chunks = prefill(&mut m, "r", 128);
    // EAGLE's checkpoint sits one hash block lower: 112 mid-prompt is neither a
    // block boundary nor the prompt's, so its block is dropped from the cache
    // and released; 224 (the prompt's) stays.
    assert_eq!(
        chunks,
        vec![
            (vec![(1..=8).collect(), vec![0, 0, 9, 10]], Some((112, 2))),
            (
                vec![vec![9, 11, 12, 13, 14, 15, 16], vec![0, 0, 17, 18]],
                Some((224, 6))
            ),
        ]
    );
    assert_eq!(m.pool().primary_tokens(10), Some(128));
    assert_eq!(m.pool().primary_tokens(17), Some(224));
    add(&mut m, "f", [seq(240), vec![7; 40]].concat());
    assert_eq!(ok(m.get_computed_blocks("f")).num_computed_tokens, 224);
}

const PARTIAL: Hybrid = Hybrid {
    hbs: 2,
    full: 2,
    mamba: 4,
    checkpoint_alignment: None,
    retention: None,
    eagle: false,
    partial: true,
    num_blocks: 20,
};

/// vLLM's `test_hybrid_mamba_align_partial_hash_hit`.
#[test]
fn a_hit_ending_inside_a_mamba_block_continues_in_a_private_copy() {
    let mut m = hybrid(&PARTIAL);
    add(&mut m, "0", vec![0, 0, 1, 1, 2, 2, 3]);
    first_chunk(&mut m, "0", 6);
    ok(m.free("0"));
    m.new_step_starts();
    // The prompt's boundary at 6 tokens is registered inside Mamba block 1.
    let key = CacheKey {
        hash: ok(m.block_hashes("0"))[2],
        group: 1,
    };
    let shared = m
        .pool()
        .cached_block(&key)
        .expect("the partial state is cached");
    assert_eq!(m.pool().primary_tokens(shared), Some(6));

    add(&mut m, "1", vec![0, 0, 1, 1, 2, 2, 3, 3]);
    let hit = ok(m.get_computed_blocks("1"));
    assert_eq!(hit.num_computed_tokens, 6);
    assert_eq!(
        hit.block_ids.iter().map(Vec::len).collect::<Vec<_>>(),
        vec![3, 2]
    );
    let args = AllocateArgs {
        num_new_computed_tokens: 6,
        ..AllocateArgs::step(2, 0)
    };
    let new = ok(m.allocate_slots("1", &args, Some(&hit)))
        .expect("fits")
        .to_vec();
    assert_eq!(new[1].len(), 1);
    let copy = new[1][0];
    assert_ne!(copy, shared);
    assert_eq!(ids(&m, "1")[1][1], copy);
    // The shared block keeps its entry; the copy is the request's and, full
    // now, is cached at 8 tokens.
    assert_eq!(m.pool().primary_tokens(shared), Some(6));
    assert_eq!(m.pool().primary_tokens(copy), Some(8));
    // Both endpoints stay referenced until the copy has run.
    assert_eq!(m.take_block_copies(), vec![(shared, copy)]);
    assert_eq!(m.take_block_copies(), vec![]);
    assert_eq!(m.num_detached_block_refs(), 2);
    let (ref_src, ref_dst) = (m.pool().ref_cnt(shared), m.pool().ref_cnt(copy));
    ok(m.free_blocks(&[shared, copy]));
    assert_eq!(m.pool().ref_cnt(shared), ref_src - 1);
    assert_eq!(m.pool().ref_cnt(copy), ref_dst - 1);
    assert_eq!(m.num_detached_block_refs(), 0);
    ok(m.check_invariants());
}

#[test]
fn without_partial_hits_nothing_is_copied_and_hits_stay_block_aligned() {
    let mut m = hybrid(&Hybrid {
        partial: false,
        ..PARTIAL
    });
    add(&mut m, "0", vec![0, 0, 1, 1, 2, 2, 3]);
    first_chunk(&mut m, "0", 6);
    ok(m.free("0"));
    m.new_step_starts();
    add(&mut m, "1", vec![0, 0, 1, 1, 2, 2, 3, 3]);
    let hit = ok(m.get_computed_blocks("1"));
    assert_eq!(hit.num_computed_tokens % 4, 0);
    prefill(&mut m, "1", 8);
    assert!(m.take_block_copies().is_empty());
    assert!(!m.partial_hash_hits());
}

#[test]
fn pending_copies_are_counted_by_the_invariants_and_freed_requests_drop_their_offers() {
    let mut m = hybrid(&PARTIAL);
    add(&mut m, "0", vec![0, 0, 1, 1, 2, 2, 3]);
    first_chunk(&mut m, "0", 6);
    // The state at the 4-token boundary was offered to a connector.
    let offers = m.take_boundary_state_offloads();
    assert!(offers.iter().all(|(r, g, _, _)| r == "0" && *g == 1));
    ok(m.free("0"));
    m.new_step_starts();
    add(&mut m, "1", vec![0, 0, 1, 1, 2, 2, 3, 3]);
    first_chunk(&mut m, "1", 8);
    // Copies not yet taken hold their references: the invariants count them.
    ok(m.check_invariants());
    ok(m.free("1"));
    ok(m.check_invariants());
    let pairs = m.take_block_copies();
    assert_eq!(pairs.len(), 1);
    let flat: Vec<u32> = pairs.iter().flat_map(|&(a, b)| [a, b]).collect();
    ok(m.free_blocks(&flat));
    ok(m.check_invariants());
    assert_eq!(m.num_free_blocks(), 19);
}

#[test]
fn retention_can_change_at_run_time_and_is_validated() {
    let mut m = hybrid(&CHECKPOINTS);
    assert_eq!(m.prefix_cache_retention_interval(), None);
    ok(m.set_prefix_cache_retention_interval(Some(0)));
    assert_eq!(m.prefix_cache_retention_interval(), Some(0));
    // Not a multiple of the scheduler block (32): refused, unchanged.
    assert!(m.set_prefix_cache_retention_interval(Some(48)).is_err());
    assert_eq!(m.prefix_cache_retention_interval(), Some(0));
}

#[test]
fn prefill_lookahead_needs_a_scheduler_block_at_least_as_long_with_eagle() {
    let mut cfg = ManagerConfig::full_attention(16, 4, 256);
    cfg.use_eagle = true;
    cfg.num_prefill_lookahead = 5;
    assert!(matches!(
        KvCacheManager::new(cfg.clone()),
        Err(Error::InvalidConfig(_))
    ));
    cfg.num_prefill_lookahead = 4;
    ok(KvCacheManager::new(cfg));
}

#[test]
fn reprefillable_tokens_are_never_cached() {
    // Multi-module MTP with 3 lookahead tokens: the last 2 computed tokens may be
    // prefilled again, so 16 computed tokens cache only 3 blocks of 4.
    let mut cfg = ManagerConfig::full_attention(16, 4, 256);
    cfg.num_prefill_lookahead = 3;
    let mut m = ok(KvCacheManager::new(cfg));
    add(&mut m, "a", seq(17));
    ok(m.allocate_slots("a", &AllocateArgs::step(16, 0), None));
    assert_eq!(m.pool().num_cached_keys(), 3);
}

#[test]
fn partial_entries_on_blocks_an_engine_filled_truncate_the_full_attention_hit() {
    // vLLM's test_hybrid_partial_hash_truncates_full_attention_hit_length:
    // whole blocks and partial entries put into the cache on blocks taken
    // with get_new_blocks; the Mamba entry at 6 tokens bounds the hit.
    let mut m = hybrid(&Hybrid {
        hbs: 2,
        full: 4,
        mamba: 4,
        checkpoint_alignment: None,
        retention: None,
        eagle: false,
        partial: true,
        num_blocks: 24,
    });
    add(&mut m, "0", vec![0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]);
    let Some(full) = m.get_new_blocks(3) else {
        panic!("free blocks")
    };
    ok(m.cache_detached_blocks("0", 0, &full, (0, 2), None));
    let key = ok(m.cache_detached_partial_block("0", 0, full[2], 10, false));
    assert_eq!(key.map(|k| k.group), Some(0));
    let Some(mamba) = m.get_new_blocks(1) else {
        panic!("free blocks")
    };
    ok(m.cache_detached_partial_block("0", 1, mamba[0], 6, false));
    // Refused: not on a hash block boundary, past the hashed tokens, a block
    // the engine does not hold; the null block caches nothing.
    assert!(
        m.cache_detached_partial_block("0", 1, mamba[0], 5, false)
            .is_err()
    );
    assert!(
        m.cache_detached_partial_block("0", 1, mamba[0], 14, false)
            .is_err()
    );
    assert!(
        m.cache_detached_partial_block("0", 1, 20, 6, false)
            .is_err()
    );
    assert_eq!(
        ok(m.cache_detached_partial_block("0", 1, 0, 6, false)),
        None
    );
    // One block, one group's content: another group's entry needs a replace.
    let other = m.cache_detached_partial_block("0", 1, full[2], 6, false);
    assert!(other.is_err_and(|e| e.to_string().contains("cached in group 0")));
    let hit = ok(m.get_computed_blocks("0"));
    assert_eq!(hit.num_computed_tokens, 6);
    assert_eq!(
        hit.block_ids.iter().map(Vec::len).collect::<Vec<_>>(),
        vec![2, 2]
    );
    // Replacing the Mamba block's entries with one at 4 tokens: the hit ends
    // there, one block per group (as vLLM answers).
    ok(m.cache_detached_partial_block("0", 1, mamba[0], 4, true));
    let hit = ok(m.get_computed_blocks("0"));
    assert_eq!(hit.num_computed_tokens, 4);
    assert_eq!(
        hit.block_ids.iter().map(Vec::len).collect::<Vec<_>>(),
        vec![1, 1]
    );
}

#[test]
fn undrained_copies_stay_within_the_pool_and_offers_within_the_live_requests() {
    // A loop that never drains the copy-on-write pairs or the boundary-state
    // offers: each round a producer caches a partial tail and leaves, and a
    // consumer continues it in a private copy and leaves.
    let mut m = hybrid(&PARTIAL);
    let mut fitted = 0;
    for round in 0..100u32 {
        let b = round * 10;
        let (p, c) = (format!("p{round}"), format!("c{round}"));
        add(&mut m, &p, vec![b, b, b + 1, b + 1, b + 2, b + 2, b + 3]);
        let hit = ok(m.get_computed_blocks(&p));
        let fits = ok(m.allocate_slots(&p, &AllocateArgs::step(6, 0), Some(&hit))).is_some();
        ok(m.free(&p));
        m.new_step_starts();
        add(
            &mut m,
            &c,
            vec![b, b, b + 1, b + 1, b + 2, b + 2, b + 3, b + 3],
        );
        let hit = ok(m.get_computed_blocks(&c));
        let args = AllocateArgs {
            num_new_computed_tokens: hit.num_computed_tokens,
            ..AllocateArgs::step(8 - hit.num_computed_tokens, 0)
        };
        let fits = fits && ok(m.allocate_slots(&c, &args, Some(&hit))).is_some();
        ok(m.free(&c));
        ok(m.check_invariants());
        if !fits {
            break;
        }
        fitted += 1;
    }
    // Each pending copy holds its block, so the pool runs out first: the
    // allocation that does not fit says so and nothing is lost.
    assert!(fitted < 100);
    let pairs = m.take_block_copies();
    assert_eq!(pairs.len(), fitted);
    assert!(pairs.len() < 20);
    // Every request left: none of their offers is kept.
    assert!(m.take_boundary_state_offloads().is_empty());
    let flat: Vec<u32> = pairs.iter().flat_map(|&(a, b)| [a, b]).collect();
    ok(m.free_blocks(&flat));
    ok(m.check_invariants());
    assert_eq!(m.num_free_blocks(), 19);
}

#[test]
fn undrained_offers_of_a_live_request_stay_within_its_boundaries() {
    // One request prefilled block by block, never drained: at most one offer
    // per Mamba boundary it crossed, though its old states go back to the pool.
    let mut m = hybrid(&Hybrid {
        num_blocks: 128,
        ..PARTIAL
    });
    add(&mut m, "r", seq(200));
    prefill(&mut m, "r", 4);
    let offers = m.take_boundary_state_offloads();
    assert!(!offers.is_empty());
    assert!(offers.len() <= 200 / 4, "{} offers", offers.len());
    assert!(offers.iter().all(|(r, g, _, _)| r == "r" && *g == 1));
}
