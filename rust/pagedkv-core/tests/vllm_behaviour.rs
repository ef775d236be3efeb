//! vLLM 0.33's single-group behaviours (`tests/v1/core/test_prefix_caching.py`),
//! with vLLM's expected block ids.

use pagedkv_core::{
    AllocateArgs, Error, HashAlgo, KvCacheManager, KvEvent, ManagerConfig, RequestSpec,
};

fn mgr(num_blocks: u32, block_size: u32) -> KvCacheManager {
    let mut cfg = ManagerConfig::full_attention(num_blocks, block_size, 8192);
    cfg.enable_kv_cache_events = true;
    cfg.log_stats = true;
    KvCacheManager::new(cfg).unwrap_or_else(|e| panic!("{e}"))
}

fn add(m: &mut KvCacheManager, id: &str, tokens: Vec<u32>) {
    m.add_request(
        id,
        RequestSpec {
            prompt_token_ids: tokens,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
}

/// Lookup + admission; returns (hit ids, hit tokens, new ids).
fn admit(m: &mut KvCacheManager, id: &str) -> (Vec<u32>, u64, Option<Vec<u32>>) {
    let hit = m.get_computed_blocks(id).unwrap_or_else(|e| panic!("{e}"));
    let n = m.num_tokens(id).unwrap_or(0) as u64;
    let args = AllocateArgs {
        num_new_computed_tokens: hit.num_computed_tokens,
        ..AllocateArgs::step(n - hit.num_computed_tokens, 0)
    };
    let new = m
        .allocate_slots(id, &args, Some(&hit))
        .unwrap_or_else(|e| panic!("{e}"))
        .map(|g| g[0].clone());
    (hit.block_ids[0].clone(), hit.num_computed_tokens, new)
}

fn seq(a: u32, b: u32) -> Vec<u32> {
    (a..b).collect()
}

#[test]
fn prefill_shares_prefix_and_frees_unhashed_blocks_to_the_front() {
    let mut m = mgr(11, 16);
    let common = seq(0, 48);
    add(&mut m, "r0", [common.clone(), seq(48, 55)].concat());
    assert_eq!(admit(&mut m, "r0"), (vec![], 0, Some(vec![1, 2, 3, 4])));
    add(&mut m, "r1", [common.clone(), seq(100, 105)].concat());
    assert_eq!(admit(&mut m, "r1"), (vec![1, 2, 3], 48, Some(vec![5])));
    for b in 1..=3 {
        assert_eq!(m.pool().ref_cnt(b), 2);
    }
    assert_eq!(m.num_free_blocks(), 5);
    m.remove_request("r0").unwrap_or(());
    m.remove_request("r1").unwrap_or(());
    assert_eq!(m.pool().free_queue(), vec![5, 4, 6, 7, 8, 9, 10, 3, 2, 1]);
    add(&mut m, "r2", [common, seq(200, 206)].concat());
    assert_eq!(admit(&mut m, "r2"), (vec![1, 2, 3], 48, Some(vec![5])));
    assert_eq!(m.num_free_blocks(), 6);
    m.remove_request("r2").unwrap_or(());
    add(&mut m, "r3", seq(1000, 1160));
    assert_eq!(
        admit(&mut m, "r3").2,
        Some(vec![5, 4, 6, 7, 8, 9, 10, 3, 2, 1])
    );
    assert_eq!(m.num_free_blocks(), 0);
    m.check_invariants().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn evict_takes_least_recently_freed_deepest_block_first() {
    let mut m = mgr(11, 16);
    add(&mut m, "r0", seq(0, 87));
    assert_eq!(admit(&mut m, "r0").2, Some(vec![1, 2, 3, 4, 5, 6]));
    add(&mut m, "r1", seq(100, 148));
    assert_eq!(admit(&mut m, "r1").2, Some(vec![7, 8, 9]));
    assert_eq!(m.num_free_blocks(), 1);
    m.remove_request("r0").unwrap_or(());
    assert_eq!(m.pool().free_queue(), vec![6, 10, 5, 4, 3, 2, 1]);
    m.remove_request("r1").unwrap_or(());
    assert_eq!(m.pool().free_queue(), vec![6, 10, 5, 4, 3, 2, 1, 9, 8, 7]);
    add(&mut m, "r2", seq(0, 35));
    assert_eq!(admit(&mut m, "r2"), (vec![1, 2], 32, Some(vec![6])));
    assert_eq!(m.num_free_blocks(), 7);
}

#[test]
fn caching_disabled_never_hits_and_fails_when_full() {
    let mut cfg = ManagerConfig::full_attention(5, 4, 8192);
    cfg.enable_caching = false;
    let mut m = KvCacheManager::new(cfg).unwrap_or_else(|e| panic!("{e}"));
    add(&mut m, "r0", seq(0, 10));
    assert_eq!(admit(&mut m, "r0").2, Some(vec![1, 2, 3]));
    m.remove_request("r0").unwrap_or(());
    add(&mut m, "r1", seq(0, 16));
    let (hit, n, new) = admit(&mut m, "r1");
    assert!(hit.is_empty() && n == 0);
    assert_eq!(new.map(|v| v.len()), Some(4));
    add(&mut m, "r2", seq(0, 4));
    assert_eq!(admit(&mut m, "r2").2, None);
}

#[test]
fn not_enough_free_blocks_with_hits_changes_nothing() {
    let mut m = mgr(11, 16);
    add(&mut m, "r0", seq(0, 48));
    admit(&mut m, "r0");
    add(&mut m, "r1", seq(0, 96));
    assert_eq!(
        admit(&mut m, "r1"),
        (vec![1, 2, 3], 48, Some(vec![4, 5, 6]))
    );
    m.remove_request("r1").unwrap_or(());
    add(&mut m, "r2", seq(500, 532));
    admit(&mut m, "r2");
    assert_eq!(m.num_free_blocks(), 5);
    add(&mut m, "r3", seq(0, 144));
    let queue = m.pool().free_queue();
    let (hit, n, new) = admit(&mut m, "r3");
    assert_eq!((hit, n, new), (vec![1, 2, 3, 4, 5, 6], 96, None));
    assert_eq!(m.pool().free_queue(), queue);
    for (b, r) in [(1, 1), (2, 1), (3, 1), (4, 0), (5, 0), (6, 0)] {
        assert_eq!(m.pool().ref_cnt(b), r);
    }
}

#[test]
fn coarse_blocks_hash_at_a_finer_granularity() {
    let mut cfg = ManagerConfig::full_attention(20, 32, 8192);
    cfg.hash_block_size = Some(16);
    let mut m = KvCacheManager::new(cfg).unwrap_or_else(|e| panic!("{e}"));
    add(&mut m, "r0", seq(0, 100));
    assert_eq!(m.block_hashes("r0").map_or(0, <[_]>::len), 6);
    assert_eq!(admit(&mut m, "r0").2, Some(vec![1, 2, 3, 4]));
    add(&mut m, "r1", [seq(0, 96), vec![7, 7, 7]].concat());
    assert_eq!(admit(&mut m, "r1").0, vec![1, 2, 3]);
    add(&mut m, "r2", [seq(0, 80), vec![7; 20]].concat());
    assert_eq!(admit(&mut m, "r2").1, 64);
    m.check_invariants().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn stale_hit_is_refused_without_changes() {
    let mut m = mgr(6, 4);
    add(&mut m, "r0", seq(0, 8));
    admit(&mut m, "r0");
    m.remove_request("r0").unwrap_or(());
    add(&mut m, "r1", seq(0, 9));
    let hit = m
        .get_computed_blocks("r1")
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(hit.block_ids[0], vec![1, 2]);
    m.evict_blocks(&[2]).unwrap_or(());
    let before = m.pool().free_queue();
    let args = AllocateArgs {
        num_new_computed_tokens: 8,
        ..AllocateArgs::step(1, 0)
    };
    assert!(matches!(
        m.allocate_slots("r1", &args, Some(&hit)),
        Err(Error::StaleComputedBlocks(_))
    ));
    assert_eq!(m.pool().free_queue(), before);
    // Unrelated evictions do not invalidate a hit.
    let hit = m
        .get_computed_blocks("r1")
        .unwrap_or_else(|e| panic!("{e}"));
    m.evict_blocks(&[3]).unwrap_or(());
    let args = AllocateArgs {
        num_new_computed_tokens: hit.num_computed_tokens,
        ..AllocateArgs::step(5, 0)
    };
    assert!(m.allocate_slots("r1", &args, Some(&hit)).is_ok());
}

#[test]
fn a_request_larger_than_the_pool_cannot_fit() {
    let mut m = mgr(4, 4);
    add(&mut m, "big", seq(0, 13));
    let hit = m
        .get_computed_blocks("big")
        .unwrap_or_else(|e| panic!("{e}"));
    let free = m.num_free_blocks();
    assert!(matches!(
        m.allocate_slots("big", &AllocateArgs::step(13, 0), Some(&hit)),
        Err(Error::CannotFit(_))
    ));
    assert_eq!(m.num_free_blocks(), free);
}

#[test]
fn events_report_stores_then_removals_in_order() {
    let mut m = mgr(4, 4);
    add(&mut m, "r0", seq(0, 8));
    admit(&mut m, "r0");
    let evs = m.take_events();
    assert_eq!(evs.len(), 1);
    let KvEvent::BlockStored(s) = &evs[0] else {
        panic!("expected BlockStored")
    };
    assert_eq!(
        (s.block_hashes.len(), s.token_ids.len(), s.parent_block_hash),
        (2, 8, None)
    );
    m.remove_request("r0").unwrap_or(());
    add(&mut m, "r1", seq(100, 112));
    m.allocate_slots("r1", &AllocateArgs::step(12, 0), None)
        .unwrap_or(None);
    let evs = m.take_events();
    assert_eq!(evs.len(), 3);
    assert!(matches!(evs[0], KvEvent::BlockRemoved { .. }));
    assert!(matches!(evs[1], KvEvent::BlockRemoved { .. }));
    assert!(matches!(evs[2], KvEvent::BlockStored(_)));
}

#[test]
fn stats_count_admissions_and_preempted_requests_apart() {
    let mut m = mgr(11, 16);
    add(&mut m, "r0", seq(0, 40));
    admit(&mut m, "r0");
    m.free("r0").unwrap_or(());
    admit(&mut m, "r0");
    let s = m.make_prefix_cache_stats().unwrap_or_default();
    assert_eq!((s.requests, s.queries, s.hits), (1, 40, 0));
    assert_eq!(
        (s.preempted_requests, s.preempted_queries, s.preempted_hits),
        (1, 40, 32)
    );
    assert_eq!(m.make_prefix_cache_stats().unwrap_or_default().requests, 0);
}

#[test]
fn common_prefix_counts_blocks_shared_by_every_running_request() {
    let mut m = mgr(20, 4);
    add(&mut m, "a", seq(0, 12));
    add(&mut m, "b", [seq(0, 8), vec![99; 5]].concat());
    admit(&mut m, "a");
    admit(&mut m, "b");
    assert_eq!(
        m.get_num_common_prefix_blocks("a").unwrap_or_default(),
        vec![2]
    );
    add(&mut m, "c", seq(50, 60));
    admit(&mut m, "c");
    assert_eq!(
        m.get_num_common_prefix_blocks("a").unwrap_or_default(),
        vec![0]
    );
}

#[test]
fn xxhash_cbor_without_seed_is_random_per_manager() {
    let mut cfg = ManagerConfig::full_attention(4, 4, 64);
    cfg.hash_algo = HashAlgo::XxhashCbor;
    let a = KvCacheManager::new(cfg.clone()).unwrap_or_else(|e| panic!("{e}"));
    let b = KvCacheManager::new(cfg.clone()).unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(a.none_hash(), b.none_hash());
    cfg.hash_seed = Some("0".into());
    let c = KvCacheManager::new(cfg).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        format!("{:?}", c.none_hash()),
        "1ebe36576dcb573f26b99533a20aaeca"
    );
}
