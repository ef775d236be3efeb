use super::*;

fn key(b: u8) -> CacheKey {
    CacheKey {
        hash: BlockHash::from_slice(&[b; 32]).unwrap_or_default(),
        group: 0,
    }
}

#[test]
fn fresh_pool_reserves_null_block() {
    let p = BlockPool::new(5, true, false);
    assert_eq!(p.num_free_blocks(), 4);
    assert_eq!(p.free_queue(), vec![1, 2, 3, 4]);
    assert!(p.check_invariants(None).is_ok());
}

#[test]
fn prepend_puts_run_in_front_in_order() {
    let mut p = BlockPool::new(6, true, false);
    let mut out = Vec::new();
    assert!(p.get_new_blocks(5, &mut out));
    p.free_blocks([1]);
    p.free_blocks([4, 5]);
    assert_eq!(p.free_queue(), vec![4, 5, 1]);
    p.free_blocks([2, 3]);
    assert_eq!(p.free_queue(), vec![2, 3, 4, 5, 1]);
    assert!(p.check_invariants(None).is_ok());
}

#[test]
fn freed_hashed_blocks_go_to_the_back() {
    let mut p = BlockPool::new(6, true, false);
    let mut out = Vec::new();
    assert!(p.get_new_blocks(3, &mut out));
    assert!(p.cache_block(2, key(2)));
    p.free_blocks([3, 2, 1]);
    assert_eq!(p.free_queue(), vec![3, 1, 4, 5, 2]);
}

#[test]
fn popleft_n_takes_from_head_and_evicts_lazily() {
    let mut p = BlockPool::new(4, true, true);
    let mut out = Vec::new();
    assert!(p.get_new_blocks(1, &mut out));
    assert!(p.cache_block(1, key(1)));
    p.free_blocks([1]);
    assert_eq!(p.cached_block(&key(1)), Some(1));
    out.clear();
    assert!(p.get_new_blocks(3, &mut out));
    assert_eq!(out, vec![2, 3, 1]);
    assert_eq!(p.cached_block(&key(1)), None);
    assert_eq!(p.take_events().len(), 1);
    assert!(!p.get_new_blocks(1, &mut out));
}

#[test]
fn duplicate_keys_keep_insertion_order_and_pop_by_id() {
    let mut p = BlockPool::new(5, true, false);
    let mut out = Vec::new();
    assert!(p.get_new_blocks(4, &mut out));
    assert!(p.cache_block(1, key(0)));
    assert!(p.cache_block(2, key(1)));
    assert!(p.cache_block(3, key(2)));
    assert!(p.cache_block(4, key(0)));
    assert_eq!(p.cached_blocks(&key(0)), vec![1, 4]);
    assert!(p.maybe_evict(2));
    assert_eq!(p.cached_block(&key(1)), None);
    assert!(p.maybe_evict(1));
    assert_eq!(p.cached_blocks(&key(0)), vec![4]);
    assert!(p.maybe_evict(3));
    assert!(p.maybe_evict(4));
    assert_eq!(p.num_cached_keys(), 0);
    assert!(!p.maybe_evict(4));
    assert!(p.check_invariants(None).is_ok());
}

#[test]
fn reset_fails_while_blocks_are_held() {
    let mut p = BlockPool::new(3, true, true);
    let mut out = Vec::new();
    assert!(p.get_new_blocks(1, &mut out));
    assert!(p.cache_block(1, key(1)));
    assert!(!p.reset_prefix_cache());
    p.free_blocks([1]);
    assert!(p.reset_prefix_cache());
    assert_eq!(p.num_cached_keys(), 0);
    assert_eq!(p.block_key(1), None);
    assert!(matches!(
        p.take_events().last(),
        Some(KvEvent::AllBlocksCleared)
    ));
}

#[test]
fn pool_without_metrics_logs_nothing() {
    let mut p = BlockPool::new(4, true, false);
    let mut out = Vec::new();
    assert!(p.get_new_blocks(2, &mut out));
    assert_eq!(p.stats(), None);
    assert!(p.take_block_activity().is_empty());
}

#[test]
fn metrics_log_what_vllms_pool_reports_to_its_collector() {
    use BlockActivityKind::{Accessed, Allocated, Evicted, Reset};
    let act = |kind, block| BlockActivity { kind, block };
    let mut p = BlockPool::new(4, true, false).with_metrics(true);
    let mut out = Vec::new();
    assert!(p.get_new_blocks(2, &mut out));
    assert!(p.cache_block(1, key(1)));
    p.free_blocks([2, 1]);
    // Each popped block is evicted (cached or not) before it is allocated.
    assert_eq!(
        p.take_block_activity(),
        vec![
            act(Evicted, 1),
            act(Allocated, 1),
            act(Evicted, 2),
            act(Allocated, 2)
        ]
    );
    p.touch(&[0, 1]);
    assert_eq!(p.take_block_activity(), vec![act(Accessed, 1)]);
    p.free_blocks([1]);
    out.clear();
    assert!(p.get_new_blocks(3, &mut out)); // 2, 3, then cached 1
    assert_eq!(out, vec![2, 3, 1]);
    assert_eq!(p.take_block_activity().len(), 6);
    p.free_blocks([1, 2, 3]);
    assert!(!p.maybe_evict(3));
    assert!(p.reset_prefix_cache());
    assert_eq!(
        p.take_block_activity(),
        vec![act(Evicted, 3), act(Reset, NULL_BLOCK)]
    );
    assert!(p.take_block_activity().is_empty());
    let stats = p.stats().unwrap_or_default();
    assert_eq!(
        stats,
        BlockPoolStats {
            blocks_allocated: 5,
            blocks_accessed: 1,
            blocks_evicted: 1,
            cache_resets: 1
        }
    );
}

#[test]
fn touch_removes_from_middle_of_queue() {
    let mut p = BlockPool::new(5, true, false);
    p.touch(&[2, 0]);
    assert_eq!(p.free_queue(), vec![1, 3, 4]);
    assert_eq!(p.ref_cnt(2), 1);
    p.touch(&[2]);
    assert_eq!(p.ref_cnt(2), 2);
    assert!(p.check_invariants(None).is_ok());
}

fn numbered(i: u32) -> CacheKey {
    let mut b = [0u8; 32];
    b[..4].copy_from_slice(&i.wrapping_mul(0x9E37_79B1).to_le_bytes());
    b[28..].copy_from_slice(&i.to_le_bytes());
    CacheKey {
        hash: BlockHash::from_slice(&b).unwrap_or_default(),
        group: i % 3,
    }
}

/// Blocks of a pool whose prefix map outgrows the caches.
const LARGE: u32 = 60_000;

/// A pool of `LARGE` blocks, each cached under `numbered(id)` and free again,
/// in id order.
fn large_cached_pool(events: bool) -> BlockPool {
    let mut p = BlockPool::new(LARGE, true, events);
    let mut out = Vec::new();
    assert!(p.get_new_blocks(LARGE - 1, &mut out));
    for &id in &out {
        assert!(p.cache_block(id, numbered(id)));
    }
    p.free_blocks(out.iter().copied());
    assert!(p.map.is_large());
    p
}

/// A pool whose prefix map outgrows the caches reads ahead for its lookups,
/// evictions and touches: the answers are those of an unstaged pool.
#[test]
fn a_large_pool_evicts_looks_up_and_touches_as_a_small_one_does() {
    const N: u32 = LARGE;
    let mut p = large_cached_pool(true);
    let mut out = Vec::new();
    // Lookups read ahead, then answer exactly.
    let keys: Vec<CacheKey> = (1..=64).map(numbered).collect();
    p.warm_lookups(keys.iter().copied());
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(p.cached_block(k), Some(i as u32 + 1));
    }
    // A touch of cached free blocks spread over the queue.
    let hit: Vec<BlockId> = (0..32).map(|i| 1 + i * 1_500).collect();
    p.touch(&hit);
    assert!(hit.iter().all(|&b| p.ref_cnt(b) == 1));
    // 1,000 blocks taken from the head evict exactly their keys (LRU order:
    // the untouched blocks in id order).
    let _ = p.take_events();
    out.clear();
    assert!(p.get_new_blocks(1_000, &mut out));
    let expected: Vec<BlockId> = (1..N).filter(|b| !hit.contains(b)).take(1_000).collect();
    assert_eq!(out, expected);
    assert_eq!(p.take_events().len(), 1_000);
    assert!(out.iter().all(|&b| p.cached_block(&numbered(b)).is_none()));
    assert_eq!(p.cached_block(&numbered(1)), Some(1));
    assert_eq!(p.num_cached_keys(), (N - 1 - 1_000) as usize);
    assert!(p.check_invariants(None).is_ok());
}

/// Single-block pops from a large pool are prefetched one call ahead; each
/// still takes the free queue's head, whatever moved the head in between (an
/// uncached block freed to the front, a touch of the head, several blocks
/// taken at once), and evicts exactly that block's key.
#[test]
fn staged_single_pops_take_the_head_whatever_moved_it() {
    const N: u32 = LARGE;
    let mut p = large_cached_pool(false);
    let mut out = Vec::new();
    let mut queue: std::collections::VecDeque<BlockId> = (1..N).collect();
    let mut uncached = Vec::new();
    for step in 0..400u32 {
        match step % 10 {
            3 if !uncached.is_empty() => {
                // Freed without a key: to the front of the queue.
                let id = uncached.pop().unwrap_or(NULL_BLOCK);
                p.free_blocks([id]);
                queue.push_front(id);
            }
            7 => {
                let head = queue.pop_front().unwrap_or(NULL_BLOCK);
                p.touch(&[head]);
                assert_eq!(p.ref_cnt(head), 1);
            }
            9 => {
                out.clear();
                assert!(p.get_new_blocks(5, &mut out));
                let want: Vec<BlockId> = queue.drain(..5).collect();
                assert_eq!(out, want);
                uncached.extend_from_slice(&out);
            }
            _ => {}
        }
        out.clear();
        assert!(p.get_new_blocks(1, &mut out));
        assert_eq!(
            out,
            [queue.pop_front().unwrap_or(NULL_BLOCK)],
            "step {step}"
        );
        assert!(p.cached_block(&numbered(out[0])).is_none());
        uncached.push(out[0]);
    }
    assert!(p.check_invariants(None).is_ok());
}
