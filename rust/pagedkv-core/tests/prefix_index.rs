//! `PrefixIndex`: behaviour tests and a property test against a naive model.
//!
//! The model keeps a count per (replica, group, hash) and answers a query by
//! walking the chain for every replica. Random operation sequences are applied
//! to both; every query and the per-replica contents must agree.
// A group filter: `None` = any group, `Some(None)` = the default group.
#![allow(clippy::option_option)]

use std::collections::BTreeMap;

use pagedkv_core::prefix_index::{
    IndexEvent, IndexStats, PrefixIndex, PrefixMatch, ReplicaId, Tier,
};
use proptest::prelude::*;

fn index_with(names: &[&str]) -> (PrefixIndex, Vec<ReplicaId>) {
    let mut index = PrefixIndex::new();
    let ids = names.iter().map(|n| index.replica(n)).collect();
    (index, ids)
}

#[test]
fn replicas_are_interned_densely() {
    let mut index = PrefixIndex::new();
    assert_eq!(index.replica("a"), ReplicaId(0));
    assert_eq!(index.replica("b"), ReplicaId(1));
    assert_eq!(index.replica("a"), ReplicaId(0));
    assert_eq!(index.replica_id("b"), Some(ReplicaId(1)));
    assert_eq!(index.replica_id("c"), None);
    assert_eq!(index.replica_name(ReplicaId(1)), Some("b"));
    assert_eq!(index.num_replicas(), 2);
}

#[test]
fn longest_prefix_picks_the_replica_with_the_most_leading_blocks() {
    let (mut index, r) = index_with(&["a", "b", "c"]);
    index.store(r[0], None, &[1, 2], Some(0)).unwrap();
    index.store(r[1], None, &[1, 2, 3, 4], Some(0)).unwrap();
    index.store(r[2], None, &[9, 2, 3, 4, 5], Some(0)).unwrap(); // other first block
    assert_eq!(index.match_lengths(&[1, 2, 3, 4, 5], None), vec![2, 4, 0]);
    assert_eq!(
        index.longest_prefix(&[1, 2, 3, 4, 5], None),
        Some(PrefixMatch {
            replica: r[1],
            num_blocks: 4
        })
    );
    assert_eq!(index.longest_prefix(&[7], None), None);
    assert_eq!(index.longest_prefix(&[], None), None);
}

#[test]
fn a_hole_in_the_chain_ends_the_prefix() {
    let (mut index, r) = index_with(&["a"]);
    index.store(r[0], None, &[1, 2, 3], Some(0)).unwrap();
    index.remove(r[0], &[2], Some(0)).unwrap();
    assert_eq!(index.match_lengths(&[1, 2, 3], None), vec![1]);
    assert!(index.contains(r[0], 3, Some(0)));
}

#[test]
fn ties_go_to_the_lowest_replica_id() {
    let (mut index, r) = index_with(&["a", "b"]);
    index.store(r[1], None, &[1, 2], Some(0)).unwrap();
    index.store(r[0], None, &[1, 2], Some(0)).unwrap();
    assert_eq!(index.longest_prefix(&[1, 2], None).unwrap().replica, r[0]);
}

#[test]
fn duplicate_blocks_need_as_many_removals() {
    // vLLM caches identical content twice without de-duplicating: two stores,
    // and the hash stays cached until both blocks are evicted.
    let (mut index, r) = index_with(&["a"]);
    index.store(r[0], None, &[5], Some(0)).unwrap();
    index.store(r[0], None, &[5], Some(0)).unwrap();
    index.remove(r[0], &[5], Some(0)).unwrap();
    assert!(index.contains(r[0], 5, Some(0)));
    index.remove(r[0], &[5], Some(0)).unwrap();
    assert!(!index.contains(r[0], 5, None));
    assert_eq!(index.num_blocks(), 0);
    index.check_invariants().unwrap();
}

#[test]
fn groups_are_kept_apart() {
    // A sliding-window group dropping a block must not read as the full group
    // dropping it.
    let (mut index, r) = index_with(&["a"]);
    index.store(r[0], None, &[1, 2], Some(0)).unwrap();
    index.store(r[0], None, &[1, 2], Some(1)).unwrap();
    index.remove(r[0], &[1], Some(1)).unwrap();
    assert_eq!(index.match_lengths(&[1, 2], Some(0)), vec![2]);
    assert_eq!(index.match_lengths(&[1, 2], Some(1)), vec![0]);
    assert_eq!(index.match_lengths(&[1, 2], None), vec![2]);
    assert_eq!(index.replica_num_blocks(r[0]), 2);
    // Events without group_idx form their own group.
    index.store(r[0], None, &[7], None).unwrap();
    assert!(index.contains(r[0], 7, None) && !index.contains(r[0], 7, Some(0)));
    index.remove(r[0], &[7], Some(0)).unwrap();
    assert!(index.contains(r[0], 7, None));
    index.remove(r[0], &[7], None).unwrap();
    assert!(!index.contains(r[0], 7, None));
    assert_eq!(index.stats().unknown_removals, 1);
}

#[test]
fn clear_forgets_one_replica_only() {
    let (mut index, r) = index_with(&["a", "b"]);
    index.store(r[0], None, &[1, 2, 3], Some(0)).unwrap();
    index.store(r[1], None, &[1, 2], Some(0)).unwrap();
    index.clear(r[0]).unwrap();
    assert_eq!(index.match_lengths(&[1, 2, 3], None), vec![0, 2]);
    assert_eq!(index.num_blocks(), 2);
    assert_eq!(index.replica_num_blocks(r[0]), 0);
    index.check_invariants().unwrap();
    assert_eq!(
        index.stats(),
        IndexStats {
            blocks_stored: 5,
            blocks_removed: 0,
            unknown_removals: 0,
            clears: 1
        }
    );
}

#[test]
fn parent_links_rebuild_the_chain() {
    let (mut index, r) = index_with(&["a"]);
    index.store(r[0], None, &[1, 2], Some(0)).unwrap();
    index.store(r[0], Some(2), &[3, 4], Some(0)).unwrap();
    index.store(r[0], Some(2), &[8], Some(0)).unwrap();
    assert_eq!(index.parent(1), None);
    assert_eq!(index.parent(3), Some(2));
    assert_eq!(index.chain(4), vec![1, 2, 3, 4]);
    assert_eq!(index.chain(8), vec![1, 2, 8]);
    // A chain stops where a parent is no longer held.
    index.remove(r[0], &[2], Some(0)).unwrap();
    assert_eq!(index.chain(4), vec![3, 4]);
    assert_eq!(index.chain(99), Vec::<u64>::new());
}

#[test]
fn unregistered_replicas_are_refused_without_change() {
    let (mut index, _) = index_with(&["a"]);
    assert!(index.store(ReplicaId(3), None, &[1], Some(0)).is_err());
    assert!(index.remove(ReplicaId(3), &[1], Some(0)).is_err());
    assert!(index.clear(ReplicaId(3)).is_err());
    assert_eq!(index.num_blocks(), 0);
    assert_eq!(index.stats(), IndexStats::default());
}

// ---- property test against a naive model ----------------------------------------

const REPLICAS: u32 = 3;
const HASHES: u64 = 12;

#[derive(Clone, Debug)]
enum Op {
    Store(u32, Option<u64>, Vec<u64>, Option<u32>),
    Remove(u32, Vec<u64>, Option<u32>),
    Clear(u32),
    Query(Vec<u64>, Option<u32>),
}

fn group() -> impl Strategy<Value = Option<u32>> {
    // Mostly a few groups; sometimes many, so a hash outgrows a linear holder
    // list and the index keeps its holder map.
    prop_oneof![
        3 => Just(None),
        3 => Just(Some(0)),
        3 => Just(Some(1)),
        2 => (2u32..40).prop_map(Some),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let hashes = || prop::collection::vec(0..HASHES, 0..6);
    prop_oneof![
        4 => (0..REPLICAS, prop::option::of(0..HASHES), hashes(), group())
            .prop_map(|(r, p, h, g)| Op::Store(r, p, h, g)),
        3 => (0..REPLICAS, hashes(), group()).prop_map(|(r, h, g)| Op::Remove(r, h, g)),
        1 => (0..REPLICAS).prop_map(Op::Clear),
        3 => (hashes(), group()).prop_map(|(h, g)| Op::Query(h, g)),
    ]
}

#[derive(Default)]
struct Model {
    counts: BTreeMap<(u32, Option<u32>, u64), u32>,
}

impl Model {
    fn holds(&self, r: u32, h: u64, g: Option<Option<u32>>) -> bool {
        self.counts
            .iter()
            .any(|(&(rr, gg, hh), &c)| rr == r && hh == h && c > 0 && g.is_none_or(|g| g == gg))
    }

    fn lengths(&self, hashes: &[u64], g: Option<Option<u32>>) -> Vec<usize> {
        (0..REPLICAS)
            .map(|r| hashes.iter().take_while(|&&h| self.holds(r, h, g)).count())
            .collect()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn index_agrees_with_the_model(ops in prop::collection::vec(op(), 1..60)) {
        let mut index = PrefixIndex::new();
        let ids: Vec<ReplicaId> = (0..REPLICAS).map(|r| index.replica(&format!("r{r}"))).collect();
        let mut model = Model::default();
        for op in ops {
            match op {
                Op::Store(r, p, hs, g) => {
                    index.store(ids[r as usize], p, &hs, g).unwrap();
                    for h in hs {
                        *model.counts.entry((r, g, h)).or_default() += 1;
                    }
                }
                Op::Remove(r, hs, g) => {
                    index.remove(ids[r as usize], &hs, g).unwrap();
                    for h in hs {
                        if let Some(c) = model.counts.get_mut(&(r, g, h)) {
                            *c -= 1;
                            if *c == 0 {
                                model.counts.remove(&(r, g, h));
                            }
                        }
                    }
                }
                Op::Clear(r) => {
                    index.clear(ids[r as usize]).unwrap();
                    model.counts.retain(|&(rr, _, _), _| rr != r);
                }
                Op::Query(hs, g) => {
                    // `Some(g)` asks one group; the model's `Some(None)` is the None group,
                    // which `match_lengths` reaches only through "any group" (None).
                    let any = index.match_lengths(&hs, None);
                    prop_assert_eq!(&any, &model.lengths(&hs, None));
                    if let Some(g) = g {
                        prop_assert_eq!(
                            index.match_lengths(&hs, Some(g)),
                            model.lengths(&hs, Some(Some(g)))
                        );
                    }
                    let best = index.longest_prefix(&hs, None);
                    let max = any.iter().copied().max().unwrap_or(0);
                    if max == 0 {
                        prop_assert_eq!(best, None);
                    } else {
                        let first = any.iter().position(|&n| n == max).unwrap();
                        prop_assert_eq!(best, Some(PrefixMatch {
                            replica: ids[first], num_blocks: max }));
                    }
                }
            }
            index.check_invariants().unwrap();
        }
        for r in 0..REPLICAS {
            let want: Vec<(u64, Option<u32>, u32)> = {
                let mut v: Vec<_> = model.counts.iter()
                    .filter(|&(&(rr, _, _), _)| rr == r)
                    .map(|(&(_, g, h), &c)| (h, g, c))
                    .collect();
                v.sort_unstable();
                v
            };
            prop_assert_eq!(index.replica_entries(ids[r as usize]), want);
        }
    }
}

#[test]
fn a_batch_for_an_unregistered_replica_changes_nothing() {
    let (mut idx, r) = index_with(&["a"]);
    let batch = [
        IndexEvent::Stored {
            parent: None,
            hashes: vec![1, 2],
            group: None,
            tier: Tier::Device,
        },
        IndexEvent::Cleared,
    ];
    assert!(idx.apply_all(ReplicaId(7), &batch).is_err());
    assert_eq!(idx.num_blocks(), 0);
    assert_eq!(idx.apply_all(r[0], &batch[..1]).expect("registered"), 1);
    assert_eq!(idx.num_blocks(), 2);
}

#[test]
fn a_hash_under_many_groups_keeps_exact_counts() {
    let (mut idx, r) = index_with(&["a", "b"]);
    for round in 0..2 {
        for g in 0..300u32 {
            for &rep in &r {
                idx.store(rep, None, &[42], Some(g)).expect("registered");
            }
        }
        idx.check_invariants().expect("invariants");
        // Remove group by group, one replica first: the other keeps the hash.
        for g in (0..300u32).rev() {
            idx.remove(r[0], &[42], Some(g)).expect("registered");
            assert_eq!(idx.contains(r[0], 42, None), g > 0);
            assert!(idx.contains(r[1], 42, Some(g)));
        }
        idx.check_invariants().expect("invariants");
        assert_eq!(idx.stats().unknown_removals, 0);
        if round == 0 {
            idx.clear(r[1]).expect("registered");
            assert!(!idx.contains(r[1], 42, None));
            assert_eq!(idx.num_blocks(), 0);
        }
    }
}

#[test]
fn a_prefix_is_counted_by_the_fastest_tier_holding_each_block() {
    let (mut idx, ids) = index_with(&["a", "b"]);
    let (a, b) = (ids[0], ids[1]);
    // a: blocks 1-2 on the device, 1-3 in host memory, 1-4 on disk; b: 1-3 on the device.
    idx.store_in(a, None, &[1, 2], Some(0), Tier::Device)
        .unwrap();
    idx.store_in(a, None, &[1, 2, 3], Some(0), Tier::Host)
        .unwrap();
    idx.store_in(a, None, &[1, 2, 3, 4], Some(0), Tier::Disk)
        .unwrap();
    idx.store(b, None, &[1, 2, 3], Some(0)).unwrap();
    let q = [1, 2, 3, 4, 5];
    assert_eq!(idx.match_tiers(&q, None), vec![[2, 1, 1], [3, 0, 0]]);
    assert_eq!(idx.match_lengths(&q, None), vec![4, 3]);
    // Dynamo's weights: a = 2 + 0.75 + 0.25 = 3 = b's 3 device blocks.
    assert_eq!(
        idx.weighted_match(&q, None, [1.0, 0.75, 0.25]),
        vec![3.0, 3.0]
    );
    assert_eq!(
        idx.weighted_match(&q, Some(1), [1.0, 0.75, 0.25]),
        vec![0.0, 0.0]
    );
    // A device eviction leaves the host copy: block 2 is now a host hit.
    idx.remove(a, &[2], Some(0)).unwrap();
    assert_eq!(idx.match_tiers(&q, None)[0], [1, 2, 1]);
    // A removal in the wrong tier is unknown.
    idx.remove_from(b, &[3], Some(0), Tier::Host).unwrap();
    assert_eq!(idx.stats().unknown_removals, 1);
    // AllBlocksCleared resets the device cache only.
    idx.apply(a, &IndexEvent::Cleared).unwrap();
    assert_eq!(idx.match_tiers(&q, None)[0], [0, 3, 1]);
    idx.check_invariants().unwrap();
    // clear: the replica holds nothing anywhere.
    idx.clear(a).unwrap();
    assert_eq!(idx.match_tiers(&q, None)[0], [0, 0, 0]);
    assert_eq!(idx.replica_num_blocks(a), 0);
    idx.check_invariants().unwrap();
}

#[test]
fn media_and_groups_out_of_range_are_refused_whole() {
    let (mut idx, ids) = index_with(&["a"]);
    assert_eq!(Tier::from_medium(Some("CPU")).unwrap(), Tier::Host);
    assert_eq!(Tier::from_medium(Some("STORAGE")).unwrap(), Tier::Disk);
    assert_eq!(Tier::from_medium(None).unwrap(), Tier::Device);
    assert!(Tier::from_medium(Some("TAPE")).is_err());
    assert!(idx.store(ids[0], None, &[1], Some(1 << 30)).is_err());
    let batch = [
        IndexEvent::Stored {
            parent: None,
            hashes: vec![1],
            group: Some(0),
            tier: Tier::Host,
        },
        IndexEvent::Removed {
            hashes: vec![1],
            group: Some(u32::MAX),
            tier: Tier::Device,
        },
    ];
    assert!(idx.apply_all(ids[0], &batch).is_err());
    assert_eq!(idx.num_blocks(), 0, "nothing of the refused batch applied");
    idx.check_invariants().unwrap();
}

#[test]
fn a_cleared_replica_starts_over_with_exact_counts() {
    // Four replicas over 500 blocks: some held by one replica, some by two,
    // some by all four (a list of holders), a few in several groups and tiers.
    let (mut idx, r) = index_with(&["a", "b", "c", "d"]);
    let chain: Vec<u64> = (1..=500).collect();
    idx.store(r[0], None, &chain, Some(0)).unwrap();
    idx.store_in(r[0], None, &chain[..100], Some(0), Tier::Host)
        .unwrap();
    idx.store(r[0], None, &chain[..50], Some(1)).unwrap();
    idx.store(r[1], None, &chain[..300], Some(0)).unwrap();
    for &x in &r[2..] {
        idx.store(x, None, &chain[..120], Some(0)).unwrap();
    }
    idx.store(r[1], Some(300), &[1000, 1001], Some(0)).unwrap();
    idx.check_invariants().unwrap();
    assert_eq!(idx.num_blocks(), 502);

    // The device reset keeps a's host copies of blocks 1-100.
    idx.apply(r[0], &IndexEvent::Cleared).unwrap();
    idx.check_invariants().unwrap();
    assert_eq!(idx.replica_num_blocks(r[0]), 100);
    assert_eq!(idx.num_blocks(), 302);
    assert_eq!(idx.match_tiers(&chain, None)[0], [0, 100, 0]);
    assert_eq!(idx.chain(300), chain[..300].to_vec());
    assert_eq!(idx.chain(301), Vec::<u64>::new());
    assert_eq!(idx.parent(301), None);

    // A full clear: the blocks only a held go, the rest keep their chain.
    idx.clear(r[0]).unwrap();
    idx.check_invariants().unwrap();
    assert_eq!(idx.replica_num_blocks(r[0]), 0);
    assert_eq!(idx.num_blocks(), 302);
    assert_eq!(idx.match_lengths(&chain, None), vec![0, 300, 120, 120]);
    assert_eq!(idx.chain(1001), [&chain[..300], &[1000, 1001]].concat());

    // Blocks 301-500 come back under a new parent: the old one is forgotten.
    idx.store(r[0], Some(7000), &chain[300..], Some(0)).unwrap();
    assert_eq!(idx.parent(301), Some(7000));
    assert_eq!(idx.chain(302), vec![301, 302]);
    // Re-stores of the blocks the others still hold.
    idx.store(r[0], None, &chain[..300], Some(0)).unwrap();
    idx.check_invariants().unwrap();
    assert_eq!(idx.replica_num_blocks(r[0]), 500);
    assert_eq!(idx.num_blocks(), 502);
    assert_eq!(idx.match_lengths(&chain, None), vec![500, 300, 120, 120]);
    assert_eq!(
        idx.replica_entries(r[0]).iter().map(|e| e.2).sum::<u32>(),
        500
    );
    // Removals count exactly: none of the cleared copies is left to remove.
    idx.remove(r[0], &chain[..50], Some(1)).unwrap();
    assert_eq!(idx.stats().unknown_removals, 50);
    idx.remove(r[0], &chain[400..], Some(0)).unwrap();
    assert_eq!(idx.num_blocks(), 402);
    idx.check_invariants().unwrap();

    // Clearing everyone leaves nothing, and the index fills again.
    for &x in &r {
        idx.clear(x).unwrap();
    }
    assert_eq!(idx.num_blocks(), 0);
    assert_eq!(idx.longest_prefix(&chain, None), None);
    idx.check_invariants().unwrap();
    idx.store(r[3], None, &chain[..10], Some(0)).unwrap();
    assert_eq!(idx.num_blocks(), 10);
    assert_eq!(idx.match_lengths(&chain, None), vec![0, 0, 0, 10]);
    assert_eq!(idx.stats().clears, 6);
    idx.check_invariants().unwrap();
}
