//! vLLM 0.33's HiSparse resident and hot groups run by the manager
//! (`HiSparseResidentManager`, `HiSparseHotManager` in
//! `vllm/v1/core/single_type_kv_cache_manager.py`): what each takes at
//! admission, on a prefix hit, on a connector's import and while decoding; the
//! residency overlay the engine writes; engine-held resident pages; and a
//! release stopped at a group.

use pagedkv_core::{
    AllocateArgs, AttentionKind, BlockHash, Error, GroupSpec, KvCacheManager, ManagerConfig,
    RequestSpec,
};

const NULL: u32 = 0;

fn ok<T>(r: Result<T, Error>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

/// `[host source, indexer, resident, hot]` (vLLM's HiSparse test layout), the
/// host source the engine's.
fn mgr(num_blocks: u32, hot: u32) -> KvCacheManager {
    let mut cfg = ManagerConfig::new(
        num_blocks,
        vec![
            GroupSpec::new(AttentionKind::EngineManaged, 4),
            GroupSpec::new(AttentionKind::FullAttention, 4),
            GroupSpec::new(AttentionKind::HiSparseResident, 4),
            GroupSpec::new(
                AttentionKind::HiSparseHot {
                    blocks_per_request: hot,
                },
                4,
            ),
        ],
        8192,
    );
    cfg.external_block_hashes = true;
    cfg.record_stats_at_admission = false;
    ok(KvCacheManager::new(cfg))
}

fn add(m: &mut KvCacheManager, id: &str, n: usize, family: u8) {
    let hashes: Vec<BlockHash> = (0..n / 4)
        .map(|i| BlockHash::from_slice(&[family, i as u8, 0x5A]).unwrap_or_default())
        .collect();
    ok(m.add_request(
        id,
        RequestSpec {
            prompt_token_ids: (0..n as u32).collect(),
            ..Default::default()
        },
    ));
    ok(m.extend_request(id, (n, 0), &[], &hashes));
}

fn admit(m: &mut KvCacheManager, id: &str, n: u64) -> Vec<Vec<u32>> {
    let hit = ok(m.get_computed_blocks(id));
    let args = AllocateArgs {
        num_new_computed_tokens: hit.num_computed_tokens,
        ..AllocateArgs::step(n - hit.num_computed_tokens, 0)
    };
    ok(m.allocate_slots(id, &args, Some(&hit)))
        .expect("fits")
        .to_vec()
}

fn ids(m: &KvCacheManager, id: &str) -> Vec<Vec<u32>> {
    ok(m.block_ids(id)).iter().map(|g| g.to_vec()).collect()
}

#[test]
fn a_cold_admission_takes_resident_pages_and_no_hot_region() {
    let mut m = mgr(32, 2);
    add(&mut m, "a", 16, 1);
    // Groups in order: the indexer's 3, then the resident row's 3; the hot
    // region only once the request reads host-backed history.
    let args = AllocateArgs::step(10, 0);
    let new = ok(m.allocate_slots("a", &args, None))
        .expect("fits")
        .to_vec();
    assert_eq!(new, vec![vec![], vec![1, 2, 3], vec![4, 5, 6], vec![]]);
    assert!(!ok(m.hisparse_hot_required("a", 3)));
    // The resident pages are engine-held references, not the request's.
    assert_eq!(m.num_detached_block_refs(), 3);
    ok(m.check_invariants());
    // Decoding into a fifth block grows both rows by one page.
    let args = AllocateArgs::step(3, 10);
    let new = ok(m.allocate_slots("a", &args, None))
        .expect("fits")
        .to_vec();
    assert_eq!(new, vec![vec![], vec![7], vec![8], vec![]]);
    // Asked for (vLLM's require_hot), the next step takes the region.
    ok(m.hisparse_require_hot("a", 3));
    let new = ok(m.allocate_slots("a", &AllocateArgs::step(1, 13), None))
        .expect("fits")
        .to_vec();
    assert_eq!(new, vec![vec![], vec![], vec![], vec![9, 10]]);
    ok(m.check_invariants());
    // Freed: indexer tail first, then the resident row tail first, then hot.
    ok(m.remove_request("a"));
    assert_eq!(m.num_detached_block_refs(), 0);
    assert_eq!(m.num_free_blocks(), 31);
    ok(m.check_invariants());
}

#[test]
fn a_host_prefix_hit_starts_the_row_with_host_pages_and_needs_the_hot_region() {
    let mut m = mgr(32, 2);
    add(&mut m, "a", 12, 1);
    admit(&mut m, "a", 12);
    ok(m.cache_blocks("a", 12));
    add(&mut m, "b", 12, 1);
    let hit = ok(m.get_computed_blocks("b"));
    // The indexer hits 2 blocks (the last token is recomputed: 11 -> 8).
    assert_eq!(hit.num_computed_tokens, 8);
    assert_eq!(hit.block_ids, vec![vec![], vec![1, 2], vec![], vec![]]);
    let args = AllocateArgs {
        num_new_computed_tokens: 8,
        ..AllocateArgs::step(4, 0)
    };
    let free_before = m.num_free_blocks();
    let new = ok(m.allocate_slots("b", &args, Some(&hit)))
        .expect("fits")
        .to_vec();
    // Resident: two host-only pages for the hit, one page for the rest; the
    // hot region because the request resumes a host prefix.
    assert_eq!(new, vec![vec![], vec![7], vec![8], vec![9, 10]]);
    assert_eq!(
        ids(&m, "b"),
        vec![vec![], vec![1, 2, 7], vec![NULL, NULL, 8], vec![9, 10]]
    );
    assert_eq!(free_before - m.num_free_blocks(), 4);
    assert!(ok(m.hisparse_hot_required("b", 3)));
    ok(m.check_invariants());
}

#[test]
fn the_residency_overlay_reads_pages_from_device_copies_and_back() {
    let mut m = mgr(32, 2);
    add(&mut m, "a", 12, 1);
    admit(&mut m, "a", 12);
    ok(m.cache_blocks("a", 12));
    add(&mut m, "b", 12, 1);
    admit(&mut m, "b", 12);
    assert_eq!(ids(&m, "b")[2], vec![NULL, NULL, 8]);
    assert_eq!(ok(m.hisparse_resident_page("b", 2, 0)), None);
    assert_eq!(ok(m.hisparse_resident_page("b", 2, 2)), Some(8));
    // The engine pins a device copy of page 0 and points the page at it.
    let copy = m.get_new_blocks(1).expect("free")[0];
    assert!(ok(m.hisparse_adopt_page("b", 2, 0, copy)));
    // A resident page, or one past the row, is not adopted again.
    assert!(!ok(m.hisparse_adopt_page("b", 2, 0, copy)));
    assert!(!ok(m.hisparse_adopt_page("b", 2, 2, copy)));
    assert!(!ok(m.hisparse_adopt_page("b", 2, 3, copy)));
    assert_eq!(ok(m.hisparse_resident_page("b", 2, 0)), Some(copy));
    assert_eq!(ok(m.hisparse_residency_row("b", 2, 0)), vec![copy, NULL, 8]);
    assert_eq!(ok(m.hisparse_residency_row("b", 2, 1)), vec![NULL, 8]);
    // The table stays append-only: the overlay is not in it.
    assert_eq!(ids(&m, "b")[2], vec![NULL, NULL, 8]);
    // Dropping page 2: read from the host; the engine unpins the block itself.
    assert_eq!(ok(m.hisparse_drop_page("b", 2, 2)), Some(8));
    assert_eq!(ok(m.hisparse_drop_page("b", 2, 2)), None);
    assert_eq!(
        ok(m.hisparse_residency_row("b", 2, 0)),
        vec![copy, NULL, NULL]
    );
    ok(m.unpin_blocks(&[8]));
    ok(m.check_invariants());
    // Freeing returns the overlaid row's pages: the copy, not page 2's block.
    let free_before = m.num_free_blocks();
    ok(m.remove_request("b"));
    // The indexer's fresh block 7, the copy and the hot region (2).
    assert_eq!(m.num_free_blocks() - free_before, 4);
    assert_eq!(m.num_detached_block_refs(), 3);
    ok(m.check_invariants());
}

#[test]
fn an_import_keeps_only_its_last_page_writable() {
    let mut m = mgr(32, 2);
    add(&mut m, "a", 14, 1);
    // A connector loads 9 tokens; the step computes the remaining 5.
    let args = AllocateArgs {
        num_external_computed_tokens: 9,
        ..AllocateArgs::step(5, 0)
    };
    let new = ok(m.allocate_slots("a", &args, None))
        .expect("fits")
        .to_vec();
    // Every group takes its imported blocks before any takes new ones. Indexer:
    // 3 imported blocks. Resident: pages 0-1 stay on host, page 2 (the
    // import's last) is writable. Then the new blocks: the indexer's fourth,
    // resident page 3, and the hot region, needed to read an import.
    assert_eq!(new, vec![vec![], vec![5], vec![6], vec![7, 8]]);
    assert_eq!(
        ids(&m, "a"),
        vec![vec![], vec![1, 2, 3, 5], vec![NULL, NULL, 4, 6], vec![7, 8]]
    );
    assert_eq!(m.num_detached_block_refs(), 2);
    ok(m.check_invariants());
}

#[test]
fn the_admission_cap_and_the_need_count_the_resident_rule() {
    // 19 free blocks: a 40-token prompt needs 10 indexer blocks and 10
    // resident pages (no hot region), so it does not fit now.
    let mut m = mgr(32, 2);
    let taken = m.get_new_blocks(12).expect("free");
    add(&mut m, "a", 40, 1);
    let out = ok(m.allocate_slots("a", &AllocateArgs::step(40, 0), None));
    assert!(out.is_none());
    assert_eq!(m.num_free_blocks(), 19);
    ok(m.check_invariants());
    // With one block more it does.
    ok(m.free_blocks(&taken[..1]));
    let new = ok(m.allocate_slots("a", &AllocateArgs::step(40, 0), None)).expect("fits");
    assert_eq!((new[1].len(), new[2].len(), new[3].len()), (10, 10, 0));
    assert_eq!(m.num_free_blocks(), 0);
    ok(m.check_invariants());
}

#[test]
fn a_release_stopped_at_a_group_frees_the_groups_before_it_first() {
    let mut m = mgr(32, 2);
    add(&mut m, "a", 8, 1);
    admit(&mut m, "a", 8);
    ok(m.hisparse_require_hot("a", 3));
    ok(m.allocate_slots("a", &AllocateArgs::step(1, 8), None)).expect("fits");
    assert_eq!(
        ids(&m, "a"),
        vec![vec![], vec![1, 2, 5], vec![3, 4, 6], vec![7, 8]]
    );
    ok(m.free_groups_before("a", 2));
    assert_eq!(
        ids(&m, "a"),
        vec![vec![], vec![], vec![3, 4, 6], vec![7, 8]]
    );
    // The engine unpins page 1 (it stays readable) and drops it.
    ok(m.unpin_blocks(&[4]));
    assert_eq!(ok(m.hisparse_drop_page("a", 2, 1)), Some(4));
    let popped = ok(m.pop_blocks_for_free("a"));
    // Resident row with the overlay (page 1 dropped), then the hot region.
    assert_eq!(popped, vec![3, NULL, 6, 7, 8]);
    ok(m.free_blocks(&popped));
    assert_eq!(m.num_detached_block_refs(), 0);
    assert_eq!(m.num_free_blocks(), 31);
    ok(m.check_invariants());
}

#[test]
fn hisparse_calls_refuse_other_groups_and_unknown_requests() {
    let mut m = mgr(16, 2);
    add(&mut m, "a", 8, 1);
    admit(&mut m, "a", 8);
    assert!(m.hisparse_adopt_page("a", 1, 0, 3).is_err());
    assert!(m.hisparse_adopt_page("a", 2, 0, 99).is_err());
    assert!(m.hisparse_require_hot("a", 2).is_err());
    assert!(m.hisparse_residency_row("zz", 2, 0).is_err());
    assert!(m.free_groups_before("a", 5).is_err());
    assert_eq!(ids(&m, "a"), vec![vec![], vec![1, 2], vec![3, 4], vec![]]);
    ok(m.check_invariants());
}

/// `a` cached, `b` admitted on its hit: `b`'s resident row is `[NULL, NULL, 8]`.
fn two_on_one_prefix() -> KvCacheManager {
    let mut m = mgr(32, 2);
    add(&mut m, "a", 12, 1);
    admit(&mut m, "a", 12);
    ok(m.cache_blocks("a", 12));
    add(&mut m, "b", 12, 1);
    admit(&mut m, "b", 12);
    assert_eq!(ids(&m, "b")[2], vec![NULL, NULL, 8]);
    m
}

#[test]
fn a_resident_page_adopts_only_a_block_the_engine_pins_alone() {
    let mut m = two_on_one_prefix();
    let refused = |m: &mut KvCacheManager, page: usize, block: u32, what: &str| {
        let before = ok(m.hisparse_residency_row("b", 2, 0));
        let free = m.num_free_blocks();
        match m.hisparse_adopt_page("b", 2, page, block) {
            Err(Error::InvalidArgument(msg)) => assert!(msg.contains(what), "{msg}"),
            other => panic!("adopting block {block}: {other:?}"),
        }
        assert_eq!(ok(m.hisparse_residency_row("b", 2, 0)), before);
        assert_eq!(m.num_free_blocks(), free);
        ok(m.check_invariants());
    };
    // A free block: the next allocation would hand it to another request.
    assert_eq!(m.pool().ref_cnt(20), 0);
    refused(&mut m, 0, 20, "not pinned by the engine");
    refused(&mut m, 0, NULL, "null block");
    // A block a request holds (a's indexer block), even with an engine pin.
    refused(&mut m, 0, 1, "not pinned by the engine");
    ok(m.touch_blocks(&[1]));
    refused(&mut m, 0, 1, "held by a request");
    ok(m.unpin_blocks(&[1]));
    // One pin, one page: a second page of the row cannot read the same copy.
    let copy = m.get_new_blocks(1).expect("free")[0];
    assert!(ok(m.hisparse_adopt_page("b", 2, 0, copy)));
    refused(&mut m, 1, copy, "needs its own reference");
    ok(m.touch_blocks(&[copy]));
    assert!(ok(m.hisparse_adopt_page("b", 2, 1, copy)));
    assert_eq!(ok(m.hisparse_residency_row("b", 2, 0)), vec![copy, copy, 8]);
    ok(m.check_invariants());
    // Freeing returns both references.
    let popped = ok(m.pop_blocks_for_free("b"));
    ok(m.free_blocks(&popped));
    assert_eq!(m.pool().ref_cnt(copy), 0);
    ok(m.check_invariants());
}

fn violation(m: &KvCacheManager) -> String {
    match m.check_invariants() {
        Err(Error::InvariantViolation(msg)) => msg,
        other => panic!("expected a violation, got {other:?}"),
    }
}

#[test]
fn the_invariant_checker_catches_a_resident_page_on_a_free_or_held_block() {
    let mut m = two_on_one_prefix();
    let copy = m.get_new_blocks(1).expect("free")[0];
    assert!(ok(m.hisparse_adopt_page("b", 2, 0, copy)));
    ok(m.check_invariants());
    // The engine returns the pin while the page still reads the block.
    ok(m.free_blocks(&[copy]));
    assert_eq!(m.pool().ref_cnt(copy), 0);
    assert!(violation(&m).contains("reads free block"));
    // The pool hands it to another request.
    let n = m.num_free_blocks() as usize;
    add(&mut m, "c", 4 * n, 2);
    admit(&mut m, "c", 4);
    assert!(ids(&m, "c")[1].contains(&copy), "{:?}", ids(&m, "c"));
    assert!(violation(&m).contains("which a request holds"));
}

#[test]
fn the_invariant_checker_catches_two_rows_reading_one_pin() {
    let mut m = two_on_one_prefix();
    add(&mut m, "c", 12, 1);
    admit(&mut m, "c", 12);
    let copy = m.get_new_blocks(1).expect("free")[0];
    assert!(ok(m.hisparse_adopt_page("b", 2, 0, copy)));
    assert!(ok(m.hisparse_adopt_page("c", 2, 0, copy)));
    assert!(violation(&m).contains("pins it 1 time(s)"));
}

#[test]
fn an_adoption_that_pins_takes_a_free_block_out_of_the_pool_at_once() {
    // vLLM's coordinator adopts a cached copy first and pins it right after;
    // the core pins it in the adoption, so no page ever reads a free block.
    let mut m = two_on_one_prefix();
    let free = m.num_free_blocks();
    assert_eq!(m.pool().ref_cnt(20), 0);
    assert!(ok(m.hisparse_pin_and_adopt_page("b", 2, 0, 20)));
    assert_eq!(m.pool().ref_cnt(20), 1);
    assert_eq!(m.num_free_blocks(), free - 1);
    assert_eq!(ok(m.hisparse_residency_row("b", 2, 0)), vec![20, NULL, 8]);
    ok(m.check_invariants());
    // A page already resident, or past the row: false, and no pin taken.
    assert!(!ok(m.hisparse_pin_and_adopt_page("b", 2, 0, 21)));
    assert!(!ok(m.hisparse_pin_and_adopt_page("b", 2, 9, 21)));
    assert_eq!(m.pool().ref_cnt(21), 0);
    // A block a request holds: refused, no pin taken.
    let held = m.pool().ref_cnt(1);
    assert!(matches!(
        m.hisparse_pin_and_adopt_page("b", 2, 1, 1),
        Err(Error::InvalidArgument(ref s)) if s.contains("held by a request")
    ));
    assert_eq!(m.pool().ref_cnt(1), held);
    ok(m.check_invariants());
    // The free returns the page's pin with the rest.
    let popped = ok(m.pop_blocks_for_free("b"));
    ok(m.free_blocks(&popped));
    assert_eq!(m.pool().ref_cnt(20), 0);
    ok(m.check_invariants());
}
