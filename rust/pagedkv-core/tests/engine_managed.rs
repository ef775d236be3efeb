//! Groups and blocks an engine manages itself next to the manager's own
//! (vLLM 0.33's HiSparse host source; these tests also let the engine run
//! HiSparse's other groups itself): engine-managed groups
//! keep their place in the group order and take nothing from the manager, their
//! needs count in the manager's capacity checks, and the pool's engine calls
//! `touch_blocks`, `unpin_blocks` and `take_reused_blocks` behave as vLLM's
//! `BlockPool.touch`, `unpin_blocks` and its reuse watchers
//! (`vllm/v1/core/block_pool.py`; `tests/v1/core/test_prefix_caching.py`'s
//! `test_hisparse_*`).

use pagedkv_core::{
    AllocateArgs, AttentionKind, BlockHash, Error, GroupSpec, KvCacheManager, ManagerConfig,
    RequestSpec,
};

fn ok<T>(r: Result<T, Error>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

/// vLLM's `HiSparse` test layout: `[host source, indexer, resident, hot]`, the
/// indexer the only group the manager runs.
fn hisparse_mgr(num_blocks: u32, block_size: u32) -> KvCacheManager {
    let managed = GroupSpec::new(AttentionKind::EngineManaged, block_size);
    let mut cfg = ManagerConfig::new(
        num_blocks,
        vec![
            managed.clone(),
            GroupSpec::new(AttentionKind::FullAttention, block_size),
            managed.clone(),
            managed,
        ],
        8192,
    );
    cfg.external_block_hashes = true;
    cfg.record_stats_at_admission = false;
    ok(KvCacheManager::new(cfg))
}

fn engine_mgr(num_blocks: u32, block_size: u32) -> KvCacheManager {
    let mut cfg = ManagerConfig::full_attention(num_blocks, block_size, 8192);
    cfg.external_block_hashes = true;
    cfg.record_stats_at_admission = false;
    ok(KvCacheManager::new(cfg))
}

fn h(family: u8, i: usize) -> BlockHash {
    BlockHash::from_slice(&[family, i as u8, 0x5A]).unwrap_or_default()
}

fn add(m: &mut KvCacheManager, id: &str, n: usize, family: u8, block_size: usize) {
    let hashes: Vec<BlockHash> = (0..n / block_size).map(|i| h(family, i)).collect();
    ok(m.add_request(
        id,
        RequestSpec {
            prompt_token_ids: (0..n as u32).collect(),
            ..Default::default()
        },
    ));
    ok(m.extend_request(id, (n, 0), &[], &hashes));
}

fn admit(m: &mut KvCacheManager, id: &str, args: AllocateArgs) -> Option<Vec<Vec<u32>>> {
    let hit = ok(m.get_computed_blocks(id));
    let args = AllocateArgs {
        num_new_computed_tokens: hit.num_computed_tokens,
        num_new_tokens: args.num_new_tokens - hit.num_computed_tokens,
        ..args
    };
    ok(m.allocate_slots(id, &args, Some(&hit))).map(<[Vec<u32>]>::to_vec)
}

#[test]
fn engine_managed_groups_take_nothing_and_keep_the_group_order() {
    let mut m = hisparse_mgr(16, 4);
    add(&mut m, "a", 10, 1, 4);
    let new = admit(&mut m, "a", AllocateArgs::step(10, 0)).expect("fits");
    // Only the indexer (group 1) gets blocks, in vLLM's order.
    assert_eq!(new, vec![vec![], vec![1, 2, 3], vec![], vec![]]);
    let held: Vec<Vec<u32>> = ok(m.block_ids("a")).iter().map(|g| g.to_vec()).collect();
    assert_eq!(held, vec![vec![], vec![1, 2, 3], vec![], vec![]]);
    // Its two full blocks are cached under group 1 and hit by the next request.
    add(&mut m, "b", 10, 1, 4);
    let hit = ok(m.get_computed_blocks("b"));
    assert_eq!(hit.num_computed_tokens, 8);
    assert_eq!(hit.block_ids, vec![vec![], vec![1, 2], vec![], vec![]]);
    ok(m.check_invariants());
}

#[test]
fn engine_managed_needs_count_in_both_capacity_checks() {
    // 15 free blocks; the indexer needs 3 for a 10-token prompt.
    let mut m = hisparse_mgr(16, 4);
    add(&mut m, "a", 10, 1, 4);
    let step = |extra: u64| AllocateArgs {
        engine_managed_blocks: extra,
        ..AllocateArgs::step(10, 0)
    };
    // 3 + 13 > 15: refused, nothing taken.
    assert_eq!(admit(&mut m, "a", step(13)), None);
    assert_eq!(m.num_free_blocks(), 15);
    // The full-sequence check counts the whole-request figure.
    let full = AllocateArgs {
        full_sequence_must_fit: true,
        engine_managed_full_blocks: 13,
        ..step(0)
    };
    assert_eq!(admit(&mut m, "a", full), None);
    assert_eq!(m.num_free_blocks(), 15);
    // 3 + 12 = 15 fits, and the manager itself takes only its 3.
    let new = admit(&mut m, "a", step(12)).expect("fits");
    assert_eq!(new[1], vec![1, 2, 3]);
    assert_eq!(m.num_free_blocks(), 12);
    ok(m.check_invariants());
}

#[test]
fn unpinned_blocks_go_to_the_tail_and_are_reported_when_handed_out() {
    // vLLM's test_hisparse_residency_update_sends_only_changed_pages: an
    // unpinned page is taken only after every never-used block.
    let mut m = engine_mgr(8, 4);
    let pages = m.get_new_blocks(2).expect("free");
    assert_eq!(pages, vec![1, 2]);
    ok(m.unpin_blocks(&[1]));
    assert_eq!(m.num_free_blocks(), 6);
    assert_eq!(m.pool().free_queue(), vec![3, 4, 5, 6, 7, 1]);
    assert_eq!(m.get_new_blocks(5).expect("free"), vec![3, 4, 5, 6, 7]);
    assert!(m.take_reused_blocks().is_empty());
    assert_eq!(m.get_new_blocks(1).expect("free"), vec![1]);
    assert_eq!(m.take_reused_blocks(), vec![1]);
    // Reported once: the watch ends when the block is handed out.
    ok(m.free_blocks(&[1]));
    assert_eq!(m.get_new_blocks(1).expect("free"), vec![1]);
    assert!(m.take_reused_blocks().is_empty());
    ok(m.check_invariants());
}

#[test]
fn a_still_referenced_unpinned_block_is_watched_until_reused() {
    // vLLM registers the watcher on every unpinned block, even one another
    // reference keeps out of the free queue.
    let mut m = engine_mgr(6, 4);
    let b = m.get_new_blocks(1).expect("free")[0];
    ok(m.touch_blocks(&[b]));
    assert_eq!(m.pool().ref_cnt(b), 2);
    ok(m.unpin_blocks(&[b]));
    assert_eq!(m.pool().ref_cnt(b), 1);
    assert!(!m.pool().free_queue().contains(&b));
    ok(m.free_blocks(&[b]));
    // Unhashed: to the head, so the next allocation reuses it at once.
    assert_eq!(m.get_new_blocks(1).expect("free"), vec![b]);
    assert_eq!(m.take_reused_blocks(), vec![b]);
    ok(m.check_invariants());
}

#[test]
fn request_allocations_report_reused_blocks_too() {
    let mut m = engine_mgr(6, 4);
    let pages = m.get_new_blocks(5).expect("free");
    ok(m.unpin_blocks(&pages[..2]));
    add(&mut m, "a", 8, 1, 4);
    let new = admit(&mut m, "a", AllocateArgs::step(8, 0)).expect("fits");
    assert_eq!(new, vec![vec![1, 2]]);
    assert_eq!(m.take_reused_blocks(), vec![1, 2]);
    ok(m.check_invariants());
}

#[test]
fn touch_keeps_a_cached_block_and_free_returns_it_to_the_lru_tail() {
    let mut m = engine_mgr(8, 4);
    add(&mut m, "a", 8, 1, 4);
    admit(&mut m, "a", AllocateArgs::step(8, 0)).expect("fits");
    ok(m.remove_request("a"));
    assert_eq!(m.num_free_blocks(), 7);
    // A cached free block leaves the free queue and stays cached.
    ok(m.touch_blocks(&[2]));
    assert_eq!(m.num_free_blocks(), 6);
    assert_eq!(m.pool().ref_cnt(2), 1);
    assert!(m.pool().block_key(2).is_some());
    ok(m.free_blocks(&[2]));
    assert_eq!(m.pool().free_queue().last(), Some(&2));
    ok(m.check_invariants());
}

#[test]
fn a_reset_reports_every_watched_block() {
    let mut m = engine_mgr(8, 4);
    let pages = m.get_new_blocks(3).expect("free");
    ok(m.unpin_blocks(&[pages[2], pages[0]]));
    ok(m.free_blocks(&[pages[1]]));
    assert!(m.reset_prefix_cache());
    let mut reused = m.take_reused_blocks();
    reused.sort_unstable();
    assert_eq!(reused, vec![1, 3]);
    assert!(m.take_reused_blocks().is_empty());
}

#[test]
fn engine_calls_refuse_blocks_and_change_nothing() {
    let mut m = engine_mgr(8, 4);
    let b = m.get_new_blocks(1).expect("free")[0];
    // Unpinned twice, held once.
    assert!(matches!(
        m.unpin_blocks(&[b, b]),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(m.pool().ref_cnt(b), 1);
    // A block the engine does not hold.
    assert!(matches!(
        m.unpin_blocks(&[5]),
        Err(Error::InvalidArgument(_))
    ));
    // Outside the pool.
    assert!(matches!(
        m.touch_blocks(&[3, 8]),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(m.pool().ref_cnt(3), 0);
    assert_eq!(m.num_free_blocks(), 6);
    assert!(m.take_reused_blocks().is_empty());
    ok(m.check_invariants());
}

/// vLLM's production `HiSparse` layout appends regular groups after the hot
/// ones: `[host source, indexer, resident, hot, regular]`.
fn production_mgr(num_blocks: u32, block_size: u32) -> KvCacheManager {
    let managed = GroupSpec::new(AttentionKind::EngineManaged, block_size);
    let full = GroupSpec::new(AttentionKind::FullAttention, block_size);
    let mut cfg = ManagerConfig::new(
        num_blocks,
        vec![
            managed.clone(),
            full.clone(),
            managed.clone(),
            managed,
            full,
        ],
        8192,
    );
    cfg.external_block_hashes = true;
    cfg.record_stats_at_admission = false;
    ok(KvCacheManager::new(cfg))
}

/// An allocation split at the first engine-managed group after the indexer:
/// the indexer's blocks, then the engine's (resident and hot, taken from the
/// pool), then the regular group's with `finish_allocation`, which also caches
/// every group: the block ids vLLM's group-by-group allocation gives.
#[test]
fn a_split_allocation_gives_core_groups_after_engine_groups_their_blocks_last() {
    let mut m = production_mgr(32, 4);
    add(&mut m, "a", 8, 1, 4);
    let args = AllocateArgs {
        split_at_group: Some(2),
        engine_managed_blocks: 3,
        ..AllocateArgs::step(8, 0)
    };
    let first = admit(&mut m, "a", args).expect("fits");
    assert_eq!(first, vec![vec![], vec![1, 2], vec![], vec![], vec![]]);
    // Nothing cached yet: the regular group has no blocks to cache.
    assert_eq!(m.pool().num_cached_keys(), 0);
    let engine = m.get_new_blocks(3).expect("free blocks");
    assert_eq!(engine, vec![3, 4, 5]);
    let rest: Vec<Vec<u32>> = ok(m.finish_allocation("a")).to_vec();
    assert_eq!(rest, vec![vec![], vec![], vec![], vec![], vec![6, 7]]);
    let held: Vec<Vec<u32>> = ok(m.block_ids("a")).iter().map(|g| g.to_vec()).collect();
    assert_eq!(held, vec![vec![], vec![1, 2], vec![], vec![], vec![6, 7]]);
    // Both core groups' full blocks are cached now (two each).
    assert_eq!(m.pool().num_cached_keys(), 4);
    // Nothing is left to finish.
    assert!(m.finish_allocation("a").is_err());
}

/// While a split allocation awaits `finish_allocation`, no other allocation
/// runs (block counts are not final); freeing the request drops it; a split
/// must name a group after the first.
#[test]
fn a_pending_split_blocks_other_allocations_until_finished_or_freed() {
    let mut m = production_mgr(32, 4);
    add(&mut m, "a", 8, 1, 4);
    add(&mut m, "b", 8, 2, 4);
    let split = AllocateArgs {
        split_at_group: Some(2),
        ..AllocateArgs::step(8, 0)
    };
    assert!(admit(&mut m, "a", split).is_some());
    let err = m
        .allocate_slots("b", &AllocateArgs::step(8, 0), None)
        .expect_err("pending");
    assert!(err.to_string().contains("finish_allocation"), "{err}");
    assert!(m.finish_allocation("b").is_err(), "b has nothing pending");
    ok(m.free("a"));
    assert!(
        m.finish_allocation("a").is_err(),
        "freed: nothing to finish"
    );
    let free_before = m.num_free_blocks();
    assert!(
        ok(m.allocate_slots("b", &AllocateArgs::step(8, 0), None)).is_some(),
        "allocations run again"
    );
    assert_eq!(m.num_free_blocks(), free_before - 4);
    for bad in [0, 6] {
        let args = AllocateArgs {
            split_at_group: Some(bad),
            ..AllocateArgs::step(1, 8)
        };
        let err = m.allocate_slots("b", &args, None).expect_err("bad split");
        assert!(err.to_string().contains("split_at_group"), "{err}");
    }
}
