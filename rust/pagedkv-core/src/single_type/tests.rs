//! vLLM's `test_single_type_kv_cache_manager.py` tables.
use super::*;
use crate::pool::{BlockPool, NULL_BLOCK};

fn manager(kind: AttentionKind, block_size: u32) -> GroupManager {
    let spec = GroupSpec::new(kind, block_size);
    let p = GroupParams {
        hash_block_size: block_size,
        alignment: u64::from(block_size),
        max_in_flight_tokens: 1 << 20,
        max_model_len: 1 << 20,
        num_gpu_blocks: 2000,
        use_eagle: false,
        lookahead: 0,
        model_eagle: false,
        shared_prefix_checkpoint: false,
        zero_new_blocks: false,
        hisparse_has_resident: false,
    };
    GroupManager::new(spec, 0, &p)
}

fn hash(i: usize) -> BlockHash {
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(&(i as u64 + 1).to_le_bytes());
    BlockHash::from_slice(&b).unwrap_or_default()
}

/// Caches block `i + 10` under hash `i` for every `true` flag; returns hashes.
fn cached_pool(flags: &[bool]) -> (BlockPool, Vec<BlockHash>) {
    let mut pool = BlockPool::new(2000, true, false);
    let hashes: Vec<BlockHash> = (0..flags.len()).map(hash).collect();
    for (i, &f) in flags.iter().enumerate() {
        if f {
            pool.cache_block(
                i as u32 + 10,
                CacheKey {
                    hash: hashes[i],
                    group: 0,
                },
            );
        }
    }
    (pool, hashes)
}

fn lookup(m: &GroupManager, flags: &[bool], max_len: usize) -> Vec<BlockId> {
    let (pool, hashes) = cached_pool(flags);
    let q = Lookup {
        hashes: &hashes,
        max_len,
        drop_eagle_block: false,
        alignment: m.block_size() as usize,
    };
    let mut out = vec![Vec::new()];
    let hit = m.find_longest_cache_hit(&pool, &q, &[0], &mut out);
    assert_eq!(hit, out[0].len() * m.block_size() as usize);
    out.remove(0)
}

#[test]
fn sliding_window_hit_needs_a_contiguous_run_ending_the_prefix() {
    let m = manager(AttentionKind::SlidingWindow { window: 4 }, 2);
    let (t, f) = (true, false);
    let cases: &[(&[bool], usize)] = &[
        (&[f; 10], 0),
        (&[t], 1),
        (&[t, f], 1),
        (&[t, t], 2),
        (&[t, t, f], 2),
        (&[t, t, t], 3),
        (&[t, t, t, f], 3),
        (&[t, t, f, t, f, f, t, t, f, t, t, t], 12),
        (&[t, t, f, t, f, f, t, t, f, f, f], 8),
        (&[t, t, f, t, f, f, t, t, f, f, f, t], 8),
    ];
    for &(flags, expect) in cases {
        let got = lookup(&m, flags, flags.len() * 2);
        assert_eq!(got.len(), expect, "{flags:?}");
        // All but the last `cdiv(window - 1, bs)` = 2 entries are null.
        for (i, &b) in got.iter().enumerate() {
            if i + 2 < expect {
                assert_eq!(b, NULL_BLOCK, "{flags:?}");
            } else {
                assert_eq!(b, i as u32 + 10, "{flags:?}");
            }
        }
    }
}

/// Two groups with one sliding-window spec: a position counts only where both
/// groups have the block (vLLM's `SlidingWindowManager` asks every group of
/// the spec), so a run in group 0 that group 1 breaks restarts.
#[test]
fn sliding_window_groups_of_one_spec_hit_only_where_all_of_them_do() {
    let m = manager(AttentionKind::SlidingWindow { window: 4 }, 2);
    let (t, f) = (true, false);
    let cases: &[(&[bool], &[bool], usize)] = &[
        (&[t, t, t, t], &[t, t, t, t], 4),
        (&[t, t, t, t], &[t, t, f, t], 2),
        (&[t, t, t, t, t], &[t, f, t, t, f], 4),
        (&[t, t, t, t, t, t], &[f, t, t, f, t, t], 6),
        (&[t, t, f, t], &[t, t, t, f], 2),
        (&[f, t, t, t], &[t, t, t, f], 3),
        (&[t, t, t, t], &[f, f, f, f], 0),
    ];
    for &(g0, g1, expect) in cases {
        let mut pool = BlockPool::new(2000, true, false);
        let hashes: Vec<BlockHash> = (0..g0.len()).map(hash).collect();
        for (group, flags) in [(0u32, g0), (1, g1)] {
            for (i, _) in flags.iter().enumerate().filter(|(_, f)| **f) {
                let key = CacheKey {
                    hash: hashes[i],
                    group,
                };
                pool.cache_block(i as u32 + 10 + 100 * group, key);
            }
        }
        let q = Lookup {
            hashes: &hashes,
            max_len: g0.len() * 2,
            drop_eagle_block: false,
            alignment: 2,
        };
        let mut out = vec![Vec::new(), Vec::new()];
        let hit = m.find_longest_cache_hit(&pool, &q, &[0, 1], &mut out);
        assert_eq!(hit, expect * 2, "{g0:?} {g1:?}");
        for (group, list) in out.iter().enumerate() {
            assert_eq!(list.len(), expect, "{g0:?} {g1:?}");
            for (i, &b) in list.iter().enumerate() {
                let want = if i + 2 < expect {
                    NULL_BLOCK
                } else {
                    i as u32 + 10 + 100 * group as u32
                };
                assert_eq!(b, want, "{g0:?} {g1:?} group {group}");
            }
        }
    }
}

#[test]
fn chunked_local_hit_starts_at_the_current_chunk() {
    let m = manager(AttentionKind::ChunkedLocal { chunk: 4 }, 2);
    let (t, f) = (true, false);
    let cases: &[(&[bool], usize, usize)] = &[
        (&[t], 0, 1),
        (&[t], 1, 1),
        (&[t, f], 0, 2),
        (&[t, f], 1, 2),
        (&[t, t], 0, 2),
        (&[t, t], 1, 2),
        (&[t, t, f], 0, 2),
        (&[t, t, f], 1, 2),
        (&[t, t, t], 0, 3),
        (&[t, t, t], 1, 3),
        (&[t, t, t, f], 0, 4),
        (&[t, t, t, f], 1, 4),
        (&[f, t, f, t, f, t, f, t, t], 1, 9),
        (&[t, f, t, f, t, f, t, f, f], 1, 8),
        (&[f, f, f, f, f, f, f, f, t, t], 0, 10),
    ];
    for &(flags, tail, expect) in cases {
        let got = lookup(&m, flags, flags.len() * 2 + tail);
        assert_eq!(got.len(), expect, "{flags:?} + {tail}");
        let start = (flags.len() * 2 + tail) / 4 * 4 / 2;
        assert!(got[..start.min(got.len())].iter().all(|&b| b == NULL_BLOCK));
    }
}

fn held_blocks(pool: &mut BlockPool, ids: std::ops::Range<u32>) -> GroupBlocks {
    let blocks: Vec<BlockId> = ids.collect();
    pool.touch(&blocks);
    GroupBlocks {
        blocks,
        ..GroupBlocks::default()
    }
}

#[test]
fn sliding_window_remove_skipped_blocks_frees_deepest_first() {
    let m = manager(AttentionKind::SlidingWindow { window: 4 }, 2);
    let mut pool = BlockPool::new(2000, true, false);
    let mut gb = held_blocks(&mut pool, 1000..1011);
    let nulls = |gb: &GroupBlocks| gb.blocks.iter().take_while(|&&b| b == NULL_BLOCK).count();
    m.remove_skipped_blocks(&mut pool, &mut gb, 0);
    assert_eq!(nulls(&gb), 0);
    m.remove_skipped_blocks(&mut pool, &mut gb, 4);
    assert_eq!(nulls(&gb), 0);
    m.remove_skipped_blocks(&mut pool, &mut gb, 5);
    assert_eq!(nulls(&gb), 1);
    m.remove_skipped_blocks(&mut pool, &mut gb, 6);
    assert_eq!(nulls(&gb), 1);
    m.remove_skipped_blocks(&mut pool, &mut gb, 7);
    assert_eq!(nulls(&gb), 2);
    m.remove_skipped_blocks(&mut pool, &mut gb, 11);
    assert_eq!(nulls(&gb), 4);
    // 1003 then 1002 were freed by the last call: unhashed, so in front.
    assert_eq!(&pool.free_queue()[..4], &[1003, 1002, 1001, 1000]);
}

#[test]
fn chunked_local_remove_skipped_blocks_nulls_whole_chunks() {
    let m = manager(AttentionKind::ChunkedLocal { chunk: 4 }, 2);
    let mut pool = BlockPool::new(2000, true, false);
    let mut gb = held_blocks(&mut pool, 1000..1011);
    let nulls = |gb: &GroupBlocks| gb.blocks.iter().take_while(|&&b| b == NULL_BLOCK).count();
    for (n, expect) in [(0, 0), (4, 2), (6, 2), (12, 6)] {
        m.remove_skipped_blocks(&mut pool, &mut gb, n);
        assert_eq!(nulls(&gb), expect, "n = {n}");
    }
}

#[test]
fn blocks_to_allocate_count_evictable_hits_but_not_null_padding() {
    for kind in [
        AttentionKind::SlidingWindow { window: 4 },
        AttentionKind::ChunkedLocal { chunk: 4 },
    ] {
        let m = manager(kind, 2);
        let pool = BlockPool::new(100, true, false);
        let gb = GroupBlocks::default();
        let n = Need {
            num_tokens: 40,
            total_computed: 0,
            num_local: 0,
            prefill_end: 0,
            main_model: 40,
            cap: false,
        };
        let hits: Vec<BlockId> = (1..=10).collect();
        assert_eq!(m.num_blocks_to_allocate(&pool, &gb, &hits, &n), 20);
        let hits: Vec<BlockId> = [0, 0, 0, 0, 0, 1, 2, 3, 4, 5].to_vec();
        assert_eq!(m.num_blocks_to_allocate(&pool, &gb, &hits, &n), 15);
    }
}

#[test]
fn sliding_window_admission_cap_bounds_full_sequence_need() {
    let spec = GroupSpec::new(AttentionKind::SlidingWindow { window: 128 }, 16);
    let p = GroupParams {
        hash_block_size: 16,
        alignment: 16,
        max_in_flight_tokens: 256,
        max_model_len: 1 << 20,
        num_gpu_blocks: 2000,
        use_eagle: false,
        lookahead: 0,
        model_eagle: false,
        shared_prefix_checkpoint: false,
        zero_new_blocks: false,
        hisparse_has_resident: false,
    };
    let m = GroupManager::new(spec, 0, &p);
    let pool = BlockPool::new(100, true, false);
    let gb = GroupBlocks::default();
    let n = Need {
        num_tokens: 10_000,
        total_computed: 0,
        num_local: 0,
        prefill_end: 0,
        main_model: 10_000,
        cap: true,
    };
    // cdiv(min(128 - 1 + 256, max_model_len), 16) + 1
    assert_eq!(m.num_blocks_to_allocate(&pool, &gb, &[], &n), 24 + 1);
}

#[test]
fn mamba_keeps_only_the_rightmost_aligned_state() {
    let m = manager(
        AttentionKind::Mamba {
            mode: MambaCacheMode::Align,
            num_speculative_blocks: 0,
            prefill_checkpoint_alignment: None,
        },
        2,
    );
    let got = lookup(&m, &[true, false, true, false], 8);
    assert_eq!(got, vec![NULL_BLOCK, NULL_BLOCK, 12]);
    assert!(lookup(&m, &[false, false], 4).is_empty());
}

#[test]
fn sliding_window_retention_keeps_only_reachable_tails() {
    // Pure SWA, bs 16, window 16, 256 tokens (vLLM's test_pure_swa_retention).
    let mut m = manager(AttentionKind::SlidingWindow { window: 16 }, 16);
    let masked = |m: &GroupManager, interval: Option<u64>| -> Vec<usize> {
        match m.sliding_reachable_mask(16, 0, 16, interval, &[255]) {
            None => (0..16).collect(),
            Some(mask) => (0..16).filter(|&i| mask[i]).collect(),
        }
    };
    assert_eq!(masked(&m, Some(64)), vec![3, 7, 11, 14, 15]);
    assert_eq!(masked(&m, Some(0)), vec![14]);
    assert_eq!(masked(&m, None), (0..16).collect::<Vec<_>>());
    m.alignment = 16;
    assert_eq!(masked(&m, Some(16)).len(), 16);
}

/// Full attention on a pool whose map outgrows the caches: each read-ahead
/// window (8 blocks, then 32) is looked up staged, and the hit is the same
/// longest cached prefix, up to the first block missing in any window.
#[test]
fn full_attention_hits_on_a_large_map_match_the_cached_prefix() {
    let m = manager(AttentionKind::FullAttention, 2);
    let mut pool = BlockPool::new(60_000, true, false);
    let hashes: Vec<BlockHash> = (0..40_000).map(hash).collect();
    for (i, &h) in hashes.iter().enumerate() {
        pool.cache_block(i as u32 + 10, CacheKey { hash: h, group: 0 });
    }
    assert!(pool.reads_ahead());
    for asked in [100usize, 7, 8, 9, 41, 72] {
        let q = Lookup {
            hashes: &hashes[..asked],
            max_len: asked * 2,
            drop_eagle_block: false,
            alignment: 2,
        };
        let mut out = vec![Vec::new()];
        let hit = m.find_longest_cache_hit(&pool, &q, &[0], &mut out);
        let want: Vec<BlockId> = (0..asked as u32).map(|i| i + 10).collect();
        assert_eq!(out[0], want, "{asked} asked");
        assert_eq!(hit, asked * 2);
    }
    // A block missing inside a window ends the hit there, in every window.
    for gap in [0usize, 5, 8, 20, 39, 40, 71, 99] {
        let mut hs = hashes[..100].to_vec();
        hs[gap] = hash(1_000_000 + gap);
        let q = Lookup {
            hashes: &hs,
            max_len: 200,
            drop_eagle_block: false,
            alignment: 2,
        };
        let mut out = vec![Vec::new()];
        let hit = m.find_longest_cache_hit(&pool, &q, &[0], &mut out);
        assert_eq!(hit, gap * 2, "gap at {gap}");
        assert_eq!(out[0], (0..gap as u32).map(|i| i + 10).collect::<Vec<_>>());
    }
}
