//! Queues a caller drains (KV events, the block activity log) stay bounded
//! when nobody drains them: the oldest entries are dropped and counted.

use pagedkv_core::{
    AllocateArgs, AttentionKind, Error, GroupSpec, KvCacheManager, KvEvent, ManagerConfig,
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
