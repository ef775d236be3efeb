//! Expected values from vLLM 0.33's `tests/v1/kv_offload/cpu/test_manager.py`.

use super::arc::List;
use super::*;

fn k(i: u32) -> OffloadKey {
    OffloadKey::new(i.to_string().as_bytes(), 0).unwrap()
}

fn ks(ids: &[u32]) -> Vec<OffloadKey> {
    ids.iter().map(|&i| k(i)).collect()
}

fn tier(num_chunks: u64, policy: PolicyKind) -> OffloadTier {
    OffloadTier::new(TierConfig {
        policy,
        enable_events: true,
        ..TierConfig::new(num_chunks)
    })
    .unwrap()
}

fn store(
    t: &mut OffloadTier,
    ids: &[u32],
    req: ReqKey,
) -> Option<(Vec<OffloadKey>, Vec<u64>, Vec<OffloadKey>)> {
    let out = t.prepare_store(&ks(ids), req, &[]).unwrap()?;
    t.check_invariants().unwrap();
    Some((out.keys_to_store, out.slots, out.evicted))
}

/// (removed, key set) per event, in order.
fn events(t: &mut OffloadTier) -> Vec<(bool, Vec<OffloadKey>)> {
    t.take_events()
        .into_iter()
        .map(|e| {
            assert_eq!(e.medium, Medium::Cpu);
            let mut keys = e.keys;
            keys.sort();
            (e.removed, keys)
        })
        .collect()
}

fn set(ids: &[u32]) -> Vec<OffloadKey> {
    let mut v = ks(ids);
    v.sort();
    v
}

#[test]
fn lru_walkthrough() {
    // test_cpu_manager
    let mut t = tier(4, PolicyKind::Lru);
    assert_eq!(
        store(&mut t, &[1, 2], 0),
        Some((ks(&[1, 2]), vec![0, 1], vec![]))
    );
    assert_eq!(t.lookup(&k(1)), LookupResult::HitPending);
    assert!(events(&mut t).is_empty());
    t.complete_store(&ks(&[1, 2]), true);
    assert_eq!(events(&mut t), vec![(false, set(&[1, 2]))]);
    assert_eq!(t.lookup(&k(2)), LookupResult::Hit);
    assert_eq!(t.lookup(&k(3)), LookupResult::Miss);
    assert_eq!(
        store(&mut t, &[2, 3, 4, 5], 0),
        Some((ks(&[3, 4, 5]), vec![2, 3, 0], ks(&[1])))
    );
    assert_eq!(events(&mut t), vec![(true, set(&[1]))]);
    assert_eq!(store(&mut t, &[1, 6], 0), None);
    t.complete_store(&ks(&[2, 3, 4, 5]), true);
    assert_eq!(t.lookup(&k(1)), LookupResult::Miss);
    assert_eq!(t.lookup_prefix(&ks(&[2, 3, 4, 5, 0])), 4);
    assert_eq!(t.prepare_load(&ks(&[2, 3]), 7, &[]).unwrap(), vec![1, 2]);
    assert_eq!(store(&mut t, &[6, 7, 8], 0), None);
    t.complete_load(&ks(&[2, 3])).unwrap();
    t.on_request_finished(7, &[], &[]).unwrap();
    // the accessed prefix [2, 3]: its tail goes before its head
    assert_eq!(
        store(&mut t, &[6, 7, 8], 0),
        Some((ks(&[6, 7, 8]), vec![2, 0, 3], ks(&[4, 5, 3])))
    );
    t.complete_store(&ks(&[6, 7, 8]), true);
    t.touch(&ks(&[2, 6, 7]));
    assert_eq!(store(&mut t, &[9], 0), Some((ks(&[9]), vec![3], ks(&[8]))));
    t.complete_store(&ks(&[7, 9]), false);
    assert_eq!(t.lookup(&k(7)), LookupResult::Hit);
    assert_eq!(t.lookup(&k(9)), LookupResult::Miss);
    assert_eq!(
        events(&mut t),
        vec![
            (false, set(&[3, 4, 5])),
            (true, set(&[4, 5, 3])),
            (false, set(&[6, 7, 8])),
            (true, set(&[8])),
            (true, set(&[9])),
        ]
    );
    t.check_invariants().unwrap();
    assert_eq!(t.counters().ignored_completions, 2); // 2 and 7 had no store in flight
}

#[test]
fn already_stored_chunk_is_not_evicted_by_its_own_offer() {
    for policy in [PolicyKind::Lru, PolicyKind::Arc] {
        let mut t = tier(4, policy);
        store(&mut t, &[1, 2], 0).unwrap();
        t.complete_store(&ks(&[1, 2]), true);
        t.touch(&ks(&[1]));
        let expected_evicted = ks(&[1]);
        assert_eq!(
            store(&mut t, &[2, 3, 4, 5], 0),
            Some((ks(&[3, 4, 5]), vec![2, 3, 0], expected_evicted)),
            "{policy:?}"
        );
        t.complete_store(&ks(&[2, 3, 4, 5]), true);
        assert_eq!(t.lookup(&k(2)), LookupResult::Hit);
    }
}

#[test]
fn reset_discards_stale_request_access() {
    let mut t = tier(1, PolicyKind::Arc);
    let key = ks(&[1]);
    assert!(t.prepare_store(&key, 1, &[]).unwrap().is_some());
    t.complete_store(&key, true);
    t.reset_cache();
    assert!(t.prepare_store(&key, 2, &[]).unwrap().is_some());
    t.complete_store(&key, true);
    t.on_request_finished(2, &[], &[]).unwrap();
    let Policy::Arc(arc) = &t.policy else {
        unreachable!()
    };
    assert_eq!(arc.list_of(&key[0]), Some(List::T1));
    t.prepare_load(&key, 1, &[]).unwrap();
    t.complete_load(&key).unwrap();
    t.on_request_finished(1, &[], &[]).unwrap();
    let Policy::Arc(arc) = &t.policy else {
        unreachable!()
    };
    assert_eq!(arc.list_of(&key[0]), Some(List::T2));
    t.check_invariants().unwrap();
}

#[test]
fn arc_touch_promotes_ready_chunks_only() {
    let mut t = tier(4, PolicyKind::Arc);
    store(&mut t, &[1], 0).unwrap();
    t.touch(&ks(&[1])); // pending: stays in T1
    let Policy::Arc(arc) = &t.policy else {
        unreachable!()
    };
    assert_eq!(arc.list_of(&k(1)), Some(List::T1));
    t.complete_store(&ks(&[1]), true);
    t.touch(&ks(&[1]));
    let Policy::Arc(arc) = &t.policy else {
        unreachable!()
    };
    assert_eq!(arc.list_of(&k(1)), Some(List::T2));
}

#[test]
fn bad_calls_change_nothing() {
    let mut t = tier(2, PolicyKind::Lru);
    store(&mut t, &[1], 0).unwrap();
    let before = format!("{:?}", t.chunk(&k(1)));
    // pending chunk: not loadable
    assert!(t.prepare_load(&ks(&[1]), 0, &[]).is_err());
    t.complete_store(&ks(&[1]), true);
    // absent key among present ones: nothing pinned
    assert!(t.prepare_load(&ks(&[1, 5]), 0, &[]).is_err());
    assert_eq!(t.chunk(&k(1)).unwrap().ref_cnt, 0);
    // a double complete_load
    t.prepare_load(&ks(&[1]), 0, &[]).unwrap();
    assert!(t.complete_load(&ks(&[1, 1])).is_err());
    assert_eq!(t.chunk(&k(1)).unwrap().ref_cnt, 1);
    t.complete_load(&ks(&[1])).unwrap();
    assert!(t.complete_load(&ks(&[1])).is_err());
    // a key offered twice; positions of the wrong length
    assert!(t.prepare_store(&ks(&[2, 2]), 0, &[]).is_err());
    assert!(t.prepare_store(&ks(&[2]), 0, &[1, 2]).is_err());
    assert_eq!(t.lookup(&k(2)), LookupResult::Miss);
    // new keys after the request ended
    t.on_request_finished(0, &[], &[]).unwrap();
    assert!(t.prepare_store(&ks(&[3]), 0, &[]).is_err());
    assert_eq!(t.lookup(&k(3)), LookupResult::Miss);
    t.check_invariants().unwrap();
    assert_ne!(before, "");
}

#[test]
fn store_threshold_admits_on_the_second_offer() {
    let mut t = OffloadTier::new(TierConfig {
        store_threshold: 2,
        ..TierConfig::new(4)
    })
    .unwrap();
    let out = t.prepare_store(&ks(&[1, 2]), 0, &[]).unwrap().unwrap();
    assert!(out.keys_to_store.is_empty());
    let out = t.prepare_store(&ks(&[1, 3]), 0, &[]).unwrap().unwrap();
    assert_eq!(out.keys_to_store, ks(&[1]));
    assert_eq!(t.stats().stores_skipped, Some(3));
    assert_eq!(t.stats().stores_skipped, Some(0));
}

#[test]
fn stats_split_write_and_read_usage() {
    let mut t = tier(4, PolicyKind::Lru);
    store(&mut t, &[1, 2], 0).unwrap();
    let s = t.stats();
    assert_eq!((s.usage, s.write_usage, s.read_usage), (0.5, 0.5, 0.0));
    assert_eq!(s.allocation_sizes, vec![2]);
    t.complete_store(&ks(&[1, 2]), true);
    t.prepare_load(&ks(&[1]), 0, &[]).unwrap();
    let s = t.stats();
    assert_eq!((s.usage, s.write_usage, s.read_usage), (0.25, 0.0, 0.25));
    assert!(s.allocation_sizes.is_empty() && s.stores_skipped.is_none());
}

#[test]
fn a_read_for_a_lower_tier_pins_without_an_access() {
    // vLLM's prepare_read (`_prepare_load(record_access=False)`): reused-by-read
    // is not reuse, so ARC keeps the chunk in T1 when the request ends
    let mut t = tier(4, PolicyKind::Arc);
    store(&mut t, &[1], 3).unwrap();
    t.complete_store(&ks(&[1]), true);
    assert_eq!(t.prepare_read(&ks(&[1])).unwrap(), vec![0]);
    assert_eq!(t.num_evictable(), 0);
    t.complete_load(&ks(&[1])).unwrap();
    t.on_request_finished(3, &[], &[]).unwrap();
    let Policy::Arc(arc) = &t.policy else {
        unreachable!()
    };
    assert_eq!(arc.list_of(&k(1)), Some(List::T1));
    assert!(t.prepare_read(&ks(&[2])).is_err());
    t.check_invariants().unwrap();
}

#[test]
fn kv_events_as_vllms_connector_publishes_them() {
    let mut t = tier(2, PolicyKind::Lru);
    let g1 = OffloadKey::new(b"9", 1).unwrap();
    t.prepare_store(&[k(1), g1], 0, &[]).unwrap().unwrap();
    t.complete_store(&[k(1), g1], true);
    t.prepare_store(&ks(&[2, 3]), 0, &[]).unwrap().unwrap(); // evicts 1 and g1
    t.complete_store(&ks(&[2, 3]), false); // a failed store: not published
    let events = t.take_events();
    let kv = kv_events(&events);
    let stored = |h: &'static [u8], g| events::TierKvEvent::Stored {
        hash: h,
        group_idx: g,
        medium: Medium::Cpu,
    };
    assert_eq!(
        kv,
        vec![
            stored(b"1", 0),
            stored(b"9", 1),
            events::TierKvEvent::Removed {
                hashes: vec![b"1"],
                group_idx: 0,
                medium: Medium::Cpu
            },
            events::TierKvEvent::Removed {
                hashes: vec![b"9"],
                group_idx: 1,
                medium: Medium::Cpu
            },
        ]
    );
}

#[test]
fn evict_by_hand_is_all_or_nothing() {
    // vLLM's test_lru_batch_eviction_failure_is_atomic, through the tier
    let mut t = tier(4, PolicyKind::Lru);
    store(&mut t, &[1, 2, 3, 4], 0).unwrap();
    t.complete_store(&ks(&[1, 2, 3, 4]), true);
    t.take_events();
    assert!(t.evict(2, &ks(&[2, 3, 4])).is_none());
    assert_eq!(t.lookup_prefix(&ks(&[1, 2, 3, 4])), 4);
    let out = t.evict(1, &ks(&[2, 3, 4])).unwrap();
    assert_eq!(
        out,
        vec![(
            k(1),
            Chunk {
                ref_cnt: 0,
                slot: 0
            }
        )]
    );
    assert_eq!((t.num_free_slots(), t.num_evictable()), (1, 3));
    assert_eq!(events(&mut t), vec![(true, set(&[1]))]);
    t.check_invariants().unwrap();
}

#[test]
fn lru_equal_ranks_go_in_key_byte_order() {
    // one request, two groups, one position: equal ranks, so vLLM's heap of
    // (rank, key) tuples takes the smaller key bytes first
    let mut t = tier(8, PolicyKind::Lru);
    let g1 = OffloadKey::new(b"h", 1).unwrap();
    let g0 = OffloadKey::new(b"h", 0).unwrap();
    t.prepare_store(&[g1, g0], 5, &[16, 16]).unwrap().unwrap();
    t.complete_store(&[g1, g0], true);
    assert_eq!(t.lru_eviction_order().unwrap(), vec![g0, g1]);
    let out = t.evict(1, &[]).unwrap();
    assert_eq!(out[0].0, g0);
    t.check_invariants().unwrap();
}

#[test]
fn lru_heap_pops_in_rank_order_under_churn() {
    // stores, pins, touches, request ends and evictions at random on a small
    // tier: every eviction takes the first idle unprotected chunks of the
    // sorted order, whatever stale entries and reused nodes the heap holds
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut rnd = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let mut t = tier(16, PolicyKind::Lru);
    let mut pinned: Vec<OffloadKey> = Vec::new();
    for step in 0..4000u64 {
        let req = rnd(6);
        let key = |i: u64| OffloadKey::new(&i.to_be_bytes(), (i % 2) as u32).unwrap();
        match rnd(6) {
            0 | 1 => {
                let first = rnd(60);
                let keys: Vec<_> = (first..first + 1 + rnd(4)).map(key).collect();
                let positions: Vec<i64> = keys.iter().map(|_| 16 * (1 + rnd(3) as i64)).collect();
                if let Some(out) = t.prepare_store(&keys, req, &positions).unwrap() {
                    t.complete_store(&out.keys_to_store, rnd(8) != 0);
                }
            }
            2 => {
                let k = key(rnd(60));
                if t.prepare_load(&[k], req, &[]).is_ok() {
                    pinned.push(k);
                }
            }
            3 => {
                if !pinned.is_empty() {
                    let k = pinned.swap_remove(rnd(pinned.len() as u64) as usize);
                    t.complete_load(&[k]).unwrap();
                    // pinned and released again: a second entry at one rank
                    for _ in 0..rnd(3) {
                        t.prepare_read(&[k]).unwrap();
                        t.complete_load(&[k]).unwrap();
                    }
                }
            }
            4 => {
                let keys: Vec<_> = (0..3).map(|_| key(rnd(60))).collect();
                t.touch(&keys);
                t.on_request_finished(req, &[], &[]).unwrap();
                t.forget_request(req);
            }
            _ => {
                let protected: Vec<_> = (0..rnd(3)).map(|_| key(rnd(60))).collect();
                let n = 1 + rnd(3) as usize;
                let expected: Vec<OffloadKey> = t
                    .lru_eviction_order()
                    .unwrap()
                    .into_iter()
                    .filter(|k| !protected.contains(k))
                    .take(n)
                    .collect();
                let out = t.evict(n, &protected);
                if expected.len() < n {
                    assert!(out.is_none(), "step {step}");
                } else {
                    let got: Vec<_> = out.unwrap().into_iter().map(|(k, _)| k).collect();
                    assert_eq!(got, expected, "step {step}");
                }
            }
        }
        t.check_invariants().unwrap();
    }
    assert!(t.counters().evictions > 100);
}
