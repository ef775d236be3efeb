//! Queues a caller drains stay bounded when nobody drains them: KV events and
//! the block activity log drop their oldest entries and count them; the blocks
//! to zero and the reused blocks, which must lose no block, keep each block's
//! first listing once they reach four entries a pool block.

use pagedkv_core::{
    AllocateArgs, AttentionKind, BlockId, Error, GroupSpec, KvCacheManager, KvEvent, ManagerConfig,
    RequestSpec,
};

fn ok<T>(r: Result<T, Error>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

fn mgr(events: Option<u64>, activity: Option<u64>) -> KvCacheManager {
    let mut cfg = ManagerConfig::new(
        64,
        vec![GroupSpec::new(AttentionKind::FullAttention, 4)],
        4096,
    );
    cfg.enable_kv_cache_events = true;
    cfg.kv_cache_metrics = true;
    cfg.max_pending_events = events;
    cfg.max_pending_block_activity = activity;
    ok(KvCacheManager::new(cfg))
}

/// One request of 16 distinct tokens admitted, cached and removed, then the
/// prefix cache reset: events and activity each time.
fn churn(m: &mut KvCacheManager, round: u32) {
    let id = format!("r{round}");
    let spec = RequestSpec {
        prompt_token_ids: (0..16).map(|t| round * 16 + t).collect(),
        ..Default::default()
    };
    ok(m.add_request(&id, spec));
    let hit = ok(m.get_computed_blocks(&id));
    ok(m.allocate_slots(&id, &AllocateArgs::step(16, 0), Some(&hit))).expect("fits");
    ok(m.cache_blocks(&id, 16));
    ok(m.remove_request(&id));
    if round % 5 == 4 {
        assert!(m.reset_prefix_cache());
    }
}

#[test]
fn undrained_events_and_activity_keep_the_newest_within_their_caps() {
    let mut capped = mgr(Some(8), Some(8));
    let mut full = mgr(None, None);
    for round in 0..100 {
        churn(&mut capped, round);
        churn(&mut full, round);
        assert!(capped.num_pending_events() <= 8);
        ok(capped.check_invariants());
    }
    let all = full.take_events();
    let kept = capped.take_events();
    assert_eq!(full.num_dropped_events(), 0);
    assert_eq!(
        capped.num_dropped_events() as usize + kept.len(),
        all.len(),
        "every event is kept or counted"
    );
    let newest: Vec<KvEvent> = all[all.len() - kept.len()..].to_vec();
    assert_eq!(kept, newest);
    let all = full.take_block_activity();
    let kept = capped.take_block_activity();
    assert!(kept.len() <= 8 && !kept.is_empty());
    assert_eq!(
        capped.num_dropped_block_activity() as usize + kept.len(),
        all.len()
    );
    assert_eq!(kept, all[all.len() - kept.len()..]);
    // Drained in time, nothing more is dropped.
    let dropped = capped.num_dropped_events();
    churn(&mut capped, 100);
    assert!(capped.take_events().len() <= 8);
    assert_eq!(capped.num_dropped_events(), dropped);
}

#[test]
fn a_cap_of_zero_or_past_two_to_the_thirty_is_refused() {
    for (events, activity) in [
        (Some(0), None),
        (None, Some(0)),
        (Some((1 << 30) + 1), None),
    ] {
        let mut cfg =
            ManagerConfig::new(8, vec![GroupSpec::new(AttentionKind::FullAttention, 4)], 64);
        cfg.max_pending_events = events;
        cfg.max_pending_block_activity = activity;
        assert!(matches!(
            KvCacheManager::new(cfg),
            Err(Error::InvalidConfig(_))
        ));
    }
}

/// Each block's first listing, in order.
fn first_listings(ids: &[BlockId]) -> Vec<BlockId> {
    let mut seen = std::collections::HashSet::new();
    ids.iter().copied().filter(|b| seen.insert(*b)).collect()
}

fn zeroing_mgr() -> KvCacheManager {
    let mut cfg = ManagerConfig::new(
        16,
        vec![
            GroupSpec::new(AttentionKind::FullAttention, 4),
            GroupSpec::new(AttentionKind::SlidingWindow { window: 8 }, 4),
        ],
        4096,
    );
    cfg.zero_new_blocks = true;
    ok(KvCacheManager::new(cfg))
}

/// A request of 12 distinct tokens admitted, allocated, decoded a few steps
/// and removed; on odd rounds its blocks are listed for zeroing again.
fn zeroing_round(m: &mut KvCacheManager, round: u32) {
    let id = format!("z{round}");
    let spec = RequestSpec {
        prompt_token_ids: (0..12).map(|t| round * 12 + t).collect(),
        ..Default::default()
    };
    ok(m.add_request(&id, spec));
    let hit = ok(m.get_computed_blocks(&id));
    ok(m.allocate_slots(&id, &AllocateArgs::step(12, 0), Some(&hit))).expect("fits");
    if round % 2 == 1 {
        ok(m.record_blocks_for_zeroing(&id, 0));
    }
    ok(m.remove_request(&id));
}

#[test]
fn undrained_blocks_to_zero_stay_bounded_and_lose_no_block() {
    let mut undrained = zeroing_mgr();
    let mut drained = zeroing_mgr();
    let mut listed: [Vec<BlockId>; 2] = [Vec::new(), Vec::new()];
    for round in 0..200 {
        zeroing_round(&mut undrained, round);
        zeroing_round(&mut drained, round);
        for (g, l) in listed.iter_mut().enumerate() {
            l.extend(ok(drained.take_new_block_ids(Some(g as u32))));
        }
        ok(undrained.check_invariants());
    }
    // What a caller draining every round saw, per group: far past the bound.
    assert!(listed.iter().all(|l| l.len() > 4 * 16 * 4));
    for (g, all) in listed.iter().enumerate() {
        let kept = ok(undrained.take_new_block_ids(Some(g as u32)));
        assert!(kept.len() <= 4 * 16, "group {g} kept {}", kept.len());
        // Every block listed is still listed, in order of first listing; a
        // block listed past the bound keeps only its first listing.
        assert_eq!(first_listings(&kept), first_listings(all));
    }
}

#[test]
fn blocks_to_zero_below_the_bound_are_listed_as_made() {
    // Ten rounds list about 45 blocks a group, below the bound of 64: the
    // undrained lists are exactly what a caller draining every round saw,
    // blocks listed twice included.
    let mut undrained = zeroing_mgr();
    let mut drained = zeroing_mgr();
    let mut listed: [Vec<BlockId>; 2] = [Vec::new(), Vec::new()];
    for round in 0..10 {
        zeroing_round(&mut undrained, round);
        zeroing_round(&mut drained, round);
        for (g, l) in listed.iter_mut().enumerate() {
            l.extend(ok(drained.take_new_block_ids(Some(g as u32))));
        }
    }
    for (g, all) in listed.iter().enumerate() {
        assert!(first_listings(all).len() < all.len());
        assert_eq!(&ok(undrained.take_new_block_ids(Some(g as u32))), all);
    }
}

#[test]
fn undrained_reused_blocks_stay_bounded_and_lose_no_reuse() {
    let cfg = || ManagerConfig::new(8, vec![GroupSpec::new(AttentionKind::FullAttention, 4)], 64);
    let mut undrained = ok(KvCacheManager::new(cfg()));
    let mut drained = ok(KvCacheManager::new(cfg()));
    let mut all = Vec::new();
    for round in 0..100u32 {
        // Take 3 to 5 blocks and unpin them: the next takes reach them at
        // the tail of the free queue; every tenth round takes every block
        // and resets the prefix cache, which reports the watched ones too.
        let n = 3 + round % 3;
        for m in [&mut undrained, &mut drained] {
            let got = m.get_new_blocks(n).expect("free blocks");
            ok(m.unpin_blocks(&got));
        }
        if round % 10 == 9 {
            for m in [&mut undrained, &mut drained] {
                let again = m.get_new_blocks(7).expect("all free");
                ok(m.free_blocks(&again));
                assert!(m.reset_prefix_cache());
            }
        }
        all.extend(drained.take_reused_blocks());
        ok(undrained.check_invariants());
    }
    assert!(all.len() > 4 * 8 * 2);
    let kept = undrained.take_reused_blocks();
    assert!(kept.len() <= 4 * 8, "kept {}", kept.len());
    assert_eq!(first_listings(&kept), first_listings(&all));
}
