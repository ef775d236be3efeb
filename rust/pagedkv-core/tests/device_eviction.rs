//! The manager's `eviction` option end to end: SLRU and ARC keep a reused
//! prefix cached through a scan of one-off prompts that LRU evicts it under,
//! and change nothing while no cached block is evicted.

mod support;

use pagedkv_core::{AllocateArgs, Eviction, KvCacheManager, KvEvent, ManagerConfig};
use support::{add, ids, ok};

const BLOCK: u32 = 4;

fn manager(policy: Eviction, num_blocks: u32) -> KvCacheManager {
    let mut cfg = ManagerConfig::full_attention(num_blocks, BLOCK, 1024);
    cfg.eviction = policy;
    cfg.enable_kv_cache_events = true;
    ok(KvCacheManager::new(cfg))
}

/// Admits `id` with its prefix hit and the rest of its prompt in one step,
/// then removes it: the hit's tokens and the blocks it held.
fn serve(m: &mut KvCacheManager, id: &str, tokens: Vec<u32>) -> (u64, Vec<u32>) {
    let n = tokens.len() as u64;
    add(m, id, tokens);
    let hit = ok(m.get_computed_blocks(id));
    let got = hit.num_computed_tokens;
    let args = AllocateArgs {
        num_new_computed_tokens: got,
        ..AllocateArgs::step(n - got, 0)
    };
    assert!(ok(m.allocate_slots(id, &args, Some(&hit))).is_some());
    let held = ids(m, id).remove(0);
    ok(m.remove_request(id));
    ok(m.check_invariants());
    (got, held)
}

/// A 16-token system prompt and a 4-token question of its own.
fn with_system_prompt(question: u32) -> Vec<u32> {
    (0..16)
        .chain((0..4).map(|i| 10_000 + question * 8 + i))
        .collect()
}

/// Prompt `i` of a scan: 8 tokens no other prompt shares.
fn one_off(i: u32) -> Vec<u32> {
    (0..8).map(|t| 50_000 + i * 8 + t).collect()
}

/// The system prompt's hit after it was reused once and 24 one-off prompts
/// (48 blocks) went through a pool of 32.
fn system_prompt_hit_after_scan(policy: Eviction) -> u64 {
    let mut m = manager(policy, 33);
    assert_eq!(m.pool().eviction(), policy);
    assert_eq!(serve(&mut m, "a", with_system_prompt(0)).0, 0);
    assert_eq!(serve(&mut m, "b", with_system_prompt(1)).0, 16);
    for i in 0..24 {
        assert_eq!(serve(&mut m, &format!("scan{i}"), one_off(i)).0, 0);
    }
    serve(&mut m, "c", with_system_prompt(2)).0
}

#[test]
fn a_reused_system_prompt_outlives_a_scan_under_slru_and_arc_but_not_lru() {
    assert_eq!(system_prompt_hit_after_scan(Eviction::Lru), 0);
    assert_eq!(system_prompt_hit_after_scan(Eviction::Slru), 16);
    assert_eq!(system_prompt_hit_after_scan(Eviction::Arc), 16);
}

#[test]
fn without_evictions_every_policy_hands_out_the_same_blocks_and_events() {
    let run = |policy| {
        let mut m = manager(policy, 256);
        let mut held = Vec::new();
        for i in 0..12 {
            held.push(serve(&mut m, &format!("s{i}"), with_system_prompt(i)));
            held.push(serve(&mut m, &format!("o{i}"), one_off(i)));
        }
        let events: Vec<KvEvent> = m.take_events();
        assert!(
            !events
                .iter()
                .any(|e| matches!(e, KvEvent::BlockRemoved { .. }))
        );
        (held, events)
    };
    let lru = run(Eviction::Lru);
    assert_eq!(run(Eviction::Slru), lru);
    assert_eq!(run(Eviction::Arc), lru);
}

#[test]
fn with_caching_off_the_option_is_accepted_and_changes_nothing() {
    for policy in Eviction::ALL {
        let mut cfg = ManagerConfig::full_attention(9, BLOCK, 1024);
        cfg.enable_caching = false;
        cfg.eviction = policy;
        let m = ok(KvCacheManager::new(cfg));
        assert_eq!(m.config().eviction, policy);
        assert_eq!(m.pool().eviction(), Eviction::Lru);
    }
}
