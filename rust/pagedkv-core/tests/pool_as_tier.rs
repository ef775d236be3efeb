//! A manager's pool used as a tier by a component that fills blocks itself
//! (the CPU tier of vLLM 0.33's `SimpleCPUOffloadScheduler`): blocks taken
//! with `get_new_blocks`, cached under the hashes of the blocks they copy
//! (`insert_detached_block_hash`, vLLM's `BlockPool._insert_block_hash`),
//! returned with `free_blocks`, found by hashes alone (`find_longest_cache_hit`,
//! vLLM's coordinator lookup) and evicted as the pool's free queue says.
//! Expected ids follow vLLM's `BlockPool`: the free queue hands out ids in
//! order, freed blocks go to its tail.

use pagedkv_core::{BlockHash, CacheKey, Error, KvCacheManager, KvEvent, ManagerConfig};

fn ok<T>(r: Result<T, Error>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

fn tier(num_blocks: u32) -> KvCacheManager {
    let mut cfg = ManagerConfig::full_attention(num_blocks, 16, 8192);
    cfg.external_block_hashes = true;
    cfg.record_stats_at_admission = false;
    cfg.enable_kv_cache_events = true;
    ok(KvCacheManager::new(cfg))
}

fn h(i: u8) -> BlockHash {
    BlockHash::from_slice(&[7, i, 0xEE]).unwrap_or_default()
}

fn key(i: u8) -> CacheKey {
    CacheKey {
        hash: h(i),
        group: 0,
    }
}

fn removed(m: &mut KvCacheManager) -> Vec<BlockHash> {
    m.take_events()
        .into_iter()
        .flat_map(|e| match e {
            KvEvent::BlockRemoved { block_hashes, .. } => block_hashes,
            _ => Vec::new(),
        })
        .collect()
}

#[test]
fn blocks_filled_outside_requests_are_cached_found_and_evicted_as_vllms_pool_does() {
    let mut m = tier(6);
    let taken = m.get_new_blocks(2).expect("two free blocks");
    assert_eq!(taken, vec![1, 2]);
    // The first key of a block is its primary key; inserting it again is a no-op.
    assert!(ok(m.insert_detached_block_hash(1, key(0), Some(16))));
    assert!(!ok(m.insert_detached_block_hash(1, key(0), Some(16))));
    assert!(ok(m.insert_detached_block_hash(2, key(1), Some(32))));
    // A second key beside the primary one (a partial entry of the source block).
    assert!(ok(m.insert_detached_block_hash(1, key(9), None)));
    assert_eq!(m.pool().block_key(1), Some(key(0)));
    assert_eq!(m.pool().extra_keys(1), &[key(9)]);
    // The caller reports its own events: inserting emits none.
    assert!(m.take_events().is_empty());
    ok(m.free_blocks(&[1, 2]));
    assert_eq!(m.num_free_blocks(), 5);
    ok(m.check_invariants());

    // Found by hashes alone, within the cap, whole blocks only.
    let hashes = [h(0), h(1), h(2)];
    assert_eq!(
        m.find_longest_cache_hit(&hashes, 100),
        (vec![vec![1, 2]], 32, 0)
    );
    assert_eq!(
        m.find_longest_cache_hit(&hashes, 31),
        (vec![vec![1]], 16, 0)
    );
    assert_eq!(
        m.find_longest_cache_hit(&[h(5), h(1)], 100),
        (vec![vec![]], 0, 0)
    );
    // Through the extra key too.
    assert_eq!(
        m.find_longest_cache_hit(&[h(9)], 100),
        (vec![vec![1]], 16, 0)
    );

    // The free queue: 3, 4, 5, then the freed 1 and 2; taking four evicts 1
    // (both of its keys go, the primary first, one BlockRemoved each).
    assert_eq!(m.get_new_blocks(4), Some(vec![3, 4, 5, 1]));
    assert_eq!(removed(&mut m), vec![h(0), h(9)]);
    assert_eq!(m.find_longest_cache_hit(&hashes, 100), (vec![vec![]], 0, 0));
    assert_eq!(
        m.find_longest_cache_hit(&hashes[1..], 100),
        (vec![vec![2]], 16, 0)
    );
    ok(m.check_invariants());
}

#[test]
fn inserting_a_hash_is_refused_for_blocks_the_engine_does_not_hold() {
    let mut m = tier(6);
    let before = m.pool().num_cached_keys();
    // Free (not held), the null block, past the pool, another group.
    assert!(m.insert_detached_block_hash(3, key(0), Some(16)).is_err());
    assert!(m.insert_detached_block_hash(0, key(0), Some(16)).is_err());
    assert!(m.insert_detached_block_hash(99, key(0), Some(16)).is_err());
    let held = m.get_new_blocks(1).expect("a free block");
    let other_group = CacheKey {
        hash: h(0),
        group: 1,
    };
    assert!(
        m.insert_detached_block_hash(held[0], other_group, None)
            .is_err()
    );
    assert_eq!(m.pool().num_cached_keys(), before);
    assert_eq!(m.pool().block_key(held[0]), None);
    ok(m.check_invariants());
}
