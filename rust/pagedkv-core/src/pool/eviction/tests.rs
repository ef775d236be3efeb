use super::*;
use crate::error::Error;
use crate::hash::BlockHash;
use crate::pool::CacheKey;

fn key(h: u8) -> CacheKey {
    CacheKey {
        hash: BlockHash::from_slice(&[h, 0x77, h ^ 0x5a, 1]).expect("valid digest"),
        group: 0,
    }
}

fn pool(n: u32, policy: Eviction) -> BlockPool {
    BlockPool::new(n, true, true).with_eviction(policy)
}

fn get(p: &mut BlockPool, n: u32) -> Vec<BlockId> {
    let mut out = Vec::new();
    assert!(p.get_new_blocks(n, &mut out));
    out
}

fn ok(p: &BlockPool) {
    if let Err(e) = p.check_invariants(None) {
        panic!("{e}");
    }
}

/// One request of `keys.len()` blocks: takes fresh blocks, caches them under
/// `keys`, frees them tail first.
fn one_off(p: &mut BlockPool, keys: &[CacheKey]) {
    let ids = get(p, keys.len() as u32);
    for (&b, &k) in ids.iter().zip(keys) {
        assert!(p.cache_block(b, k));
    }
    p.free_blocks(ids.iter().rev().copied());
    ok(p);
}

/// A request hitting the cached blocks of `keys` (taken, then freed tail
/// first).
fn hit(p: &mut BlockPool, keys: &[CacheKey]) {
    let ids: Vec<BlockId> = keys
        .iter()
        .map(|k| p.cached_block(k).expect("cached"))
        .collect();
    p.touch(&ids);
    ok(p);
    p.free_blocks(ids.iter().rev().copied());
    ok(p);
}

/// A prefix cached, reused once, then a scan of one-off two-block prompts
/// through an eight-block pool: whether the prefix is still cached.
fn prefix_survives_scan(policy: Eviction) -> bool {
    let mut p = pool(9, policy);
    let prefix = [key(1), key(2)];
    one_off(&mut p, &prefix);
    hit(&mut p, &prefix);
    for i in 0..8u8 {
        one_off(&mut p, &[key(10 + 2 * i), key(11 + 2 * i)]);
    }
    prefix.iter().all(|k| p.cached_block(k).is_some())
}

#[test]
fn a_reused_prefix_survives_a_scan_of_one_off_prompts_under_slru_and_arc_not_lru() {
    assert!(!prefix_survives_scan(Eviction::Lru));
    assert!(prefix_survives_scan(Eviction::Slru));
    assert!(prefix_survives_scan(Eviction::Arc));
}

#[test]
fn a_hit_block_freed_again_joins_the_protected_segment() {
    let mut p = pool(6, Eviction::Slru);
    one_off(&mut p, &[key(1), key(2)]);
    assert_eq!(p.segment_lens(), (5, 0));
    hit(&mut p, &[key(1)]);
    let b = p.cached_block(&key(1)).expect("cached");
    assert!(p.is_reused(b));
    assert_eq!(p.segment_lens(), (4, 1));
    // The protected block is handed out last.
    assert_eq!(p.free_queue().last(), Some(&b));
    let all = get(&mut p, 5);
    assert_eq!(all.last(), Some(&b));
    ok(&p);
}

#[test]
fn slru_demotes_the_protected_head_past_four_fifths_of_the_free_blocks() {
    let mut p = pool(7, Eviction::Slru);
    let ids = get(&mut p, 5);
    for (i, &b) in ids.iter().enumerate() {
        assert!(p.cache_block(b, key(i as u8)));
    }
    // Every block hit while held, then both references dropped.
    p.touch(&ids);
    p.free_blocks(ids.iter().rev().copied());
    p.free_blocks(ids.iter().rev().copied());
    ok(&p);
    // Six free blocks: at most four protected; the oldest protected (the
    // request's tail, freed first) went to the probationary tail.
    assert_eq!(p.segment_lens(), (2, 4));
    assert_eq!(p.free_queue(), vec![6, 5, 4, 3, 2, 1]);
    // Taking free blocks shrinks the protected share with them.
    let got = get(&mut p, 3);
    assert_eq!(got, vec![6, 5, 4]);
    assert_eq!(p.segment_lens(), (1, 2));
    ok(&p);
}

#[test]
fn free_blocks_without_a_key_are_handed_out_before_cached_ones() {
    for policy in Eviction::ALL {
        let mut p = pool(6, policy);
        one_off(&mut p, &[key(1), key(2)]);
        hit(&mut p, &[key(1), key(2)]);
        let ids = get(&mut p, 3);
        // Fresh blocks first, cached ones kept.
        assert_eq!(ids, vec![3, 4, 5], "{policy:?}");
        p.free_blocks(ids.iter().rev().copied());
        assert_eq!(p.free_queue()[..3], [5, 4, 3], "{policy:?}");
        // A free cached block that loses its key moves ahead of the cached
        // ones too (under LRU it keeps its place).
        assert!(p.maybe_evict(2));
        let order = p.free_queue();
        if policy == Eviction::Lru {
            assert_eq!(order, vec![5, 4, 3, 2, 1]);
        } else {
            assert_eq!(order, vec![2, 5, 4, 3, 1], "{policy:?}");
            assert!(!p.is_reused(2));
        }
        ok(&p);
    }
}

#[test]
fn arc_takes_t1_while_it_is_longer_than_its_target_then_t2() {
    let mut p = pool(5, Eviction::Arc);
    // T2: block 1 (hit); T1: blocks 2, 3 (cached once); free: block 4.
    one_off(&mut p, &[key(1)]);
    hit(&mut p, &[key(1)]);
    let ids = get(&mut p, 3);
    assert_eq!(ids, vec![2, 3, 4]);
    assert!(p.cache_block(2, key(2)));
    assert!(p.cache_block(3, key(3)));
    p.free_blocks([2, 3, 4]);
    assert_eq!(p.segment_lens(), (3, 1));
    assert_eq!(p.arc_target(), Some(0));
    // Target 0: all of T1 before T2 (the unkeyed block first).
    assert_eq!(p.free_queue(), vec![4, 2, 3, 1]);
    // A B1 ghost hit: evict key 2 from T1, then cache it again.
    let got = get(&mut p, 2);
    assert_eq!(got, vec![4, 2]);
    assert_eq!(p.ghost_lens(), [1, 0]);
    assert!(p.cache_block(2, key(2)));
    assert_eq!(p.arc_target(), Some(1));
    assert_eq!(p.ghost_lens(), [0, 0]);
    assert!(p.is_reused(2));
    assert!(!p.is_reused(4));
    assert!(p.cache_block(4, key(4)));
    // Key 2 was recognised: block 2 joins T2. T1 = [4, 3], T2 = [1, 2].
    p.free_blocks([4, 2]);
    assert_eq!(p.segment_lens(), (2, 2));
    // Target 1: T1's head while T1 holds 2, then T2, then the rest of T1.
    assert_eq!(p.free_queue(), vec![3, 1, 2, 4]);
    assert_eq!(get(&mut p, 4), vec![3, 1, 2, 4]);
    assert_eq!(p.ghost_lens(), [2, 2]);
    ok(&p);
}

#[test]
fn arc_ghost_hit_in_b2_shrinks_the_target() {
    let mut p = pool(4, Eviction::Arc);
    // Target 1 from a B1 hit.
    one_off(&mut p, &[key(1)]);
    let all = get(&mut p, 3);
    assert_eq!(p.ghost_lens(), [1, 0]);
    assert!(p.cache_block(all[0], key(1)));
    assert_eq!(p.arc_target(), Some(1));
    p.free_blocks(all.iter().rev().copied());
    // Key 1's block is in T2; taking every block evicts it into B2.
    assert_eq!(p.segment_lens(), (2, 1));
    let all = get(&mut p, 3);
    assert_eq!(p.ghost_lens(), [0, 1]);
    assert!(p.cache_block(all[0], key(1)));
    assert_eq!(p.arc_target(), Some(0));
    assert_eq!(p.ghost_lens(), [0, 0]);
    assert!(p.is_reused(all[0]));
    p.free_blocks(all.iter().rev().copied());
    ok(&p);
}

#[test]
fn arc_ghost_lists_stay_within_the_pool_size() {
    let mut p = pool(5, Eviction::Arc);
    for i in 0..50u8 {
        one_off(&mut p, &[key(i)]);
        let _ = get(&mut p, 4);
        let [b1, b2] = p.ghost_lens();
        assert!(b1 <= 4 && b2 <= 4);
        p.free_blocks([1, 2, 3, 4]);
        ok(&p);
    }
    assert_eq!(p.ghost_lens()[0], 4);
}

#[test]
fn reset_merges_the_lists_and_forgets_targets_ghosts_and_marks() {
    for policy in [Eviction::Arc, Eviction::Slru] {
        let mut p = pool(6, policy);
        one_off(&mut p, &[key(1), key(2)]);
        hit(&mut p, &[key(1), key(2)]);
        one_off(&mut p, &[key(3), key(4), key(5)]);
        one_off(&mut p, &[key(6)]);
        if policy == Eviction::Arc {
            assert_eq!(p.segment_lens(), (3, 2));
            assert_eq!(p.ghost_lens(), [1, 0]);
        } else {
            // Taking three of five free blocks demoted one protected block.
            assert_eq!(p.segment_lens(), (4, 1));
        }
        let before = p.free_queue();
        assert!(p.reset_prefix_cache());
        ok(&p);
        assert_eq!(p.free_queue(), before, "{policy:?}");
        assert_eq!(p.segment_lens(), (5, 0));
        assert_eq!(p.ghost_lens(), [0, 0]);
        assert!((1..6).all(|b| !p.is_reused(b)));
        assert_eq!(p.arc_target(), (policy == Eviction::Arc).then_some(0));
    }
}

#[test]
fn caching_off_keeps_lru_whatever_the_policy() {
    for policy in Eviction::ALL {
        let p = BlockPool::new(4, false, false).with_eviction(policy);
        assert_eq!(p.eviction(), Eviction::Lru);
        assert_eq!(p.segment_lens(), (3, 0));
    }
    assert_eq!(pool(4, Eviction::Slru).eviction(), Eviction::Slru);
}

#[test]
fn unpinned_blocks_join_a_tail_under_every_policy() {
    for policy in Eviction::ALL {
        let mut p = pool(5, policy);
        let ids = get(&mut p, 2);
        p.unpin(&ids);
        assert_eq!(p.free_queue(), vec![3, 4, 1, 2], "{policy:?}");
        assert_eq!(get(&mut p, 3), vec![3, 4, 1], "{policy:?}");
        ok(&p);
    }
}

#[test]
fn eviction_names_round_trip_and_a_bad_one_is_a_config_error() {
    for e in Eviction::ALL {
        assert_eq!(Eviction::parse(e.name()).ok(), Some(e));
    }
    assert_eq!(Eviction::default(), Eviction::Lru);
    let err = Eviction::parse("lfu").expect_err("unknown");
    assert!(matches!(err, Error::InvalidConfig(_)), "{err}");
    assert!(err.to_string().contains("'lru', 'arc' or 'slru'"), "{err}");
}
