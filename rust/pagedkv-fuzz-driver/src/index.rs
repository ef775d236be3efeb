//! Interprets a byte string as a sequence of prefix-index events and queries
//! from a few replicas, runs it against `PrefixIndex` and checks, after every
//! call:
//!
//! - no panic;
//! - `check_invariants` holds;
//! - what the index answers (`contains`, `match_lengths`, `longest_prefix`,
//!   `replica_entries`) equals a naive model: a count per (replica, group,
//!   hash);
//! - a batch for an unregistered replica is refused whole and changes nothing.
//!
//! Hashes come from a small space (so chains share and collide), sometimes any
//! `u64`; groups are mostly a few, sometimes many (so a hash outgrows a linear
//! holder list), sometimes any `u32` (2**30 - 1 and up are refused); tiers
//! any of the three.
//!
//! Shared by the cargo-fuzz target (`fuzz/fuzz_targets/index.rs`) and the
//! regression tests that replay saved inputs.

use std::collections::BTreeMap;

use pagedkv_core::prefix_index::{IndexEvent, PrefixIndex, ReplicaId, Tier};

use crate::Bytes;

const REPLICAS: u32 = 3;

fn hash(b: &mut Bytes<'_>) -> u64 {
    match b.u8() % 16 {
        0 => u64::from_le_bytes(std::array::from_fn(|_| b.u8())),
        1 => u64::MAX,
        v => u64::from(v % 8),
    }
}

fn hashes(b: &mut Bytes<'_>) -> Vec<u64> {
    let n = b.below(6);
    (0..n).map(|_| hash(b)).collect()
}

fn group(b: &mut Bytes<'_>) -> Option<u32> {
    match b.u8() % 8 {
        0 => None,
        1 => Some(u32::from(b.u8())),
        2 => Some(u32::from_le_bytes([b.u8(), b.u8(), b.u8(), b.u8()])),
        v => Some(u32::from(v % 2)),
    }
}

/// Groups from this one up are refused; the index keys events without a
/// group as this one.
const NO_GROUP: u32 = (1 << 30) - 1;

fn key(group: Option<u32>) -> u32 {
    group.unwrap_or(NO_GROUP)
}

/// Whether the index takes the event (a group index below 2**30 - 1).
fn valid(ev: &IndexEvent) -> bool {
    match ev {
        IndexEvent::Stored { group, .. } | IndexEvent::Removed { group, .. } => {
            group.is_none_or(|g| g < NO_GROUP)
        }
        IndexEvent::Cleared => true,
    }
}

/// What the index should hold: a block count per (replica, group key, tier, hash).
#[derive(Default)]
struct Model {
    counts: BTreeMap<(u32, u32, Tier, u64), u32>,
    unknown_removals: u64,
}

impl Model {
    fn apply(&mut self, r: u32, ev: &IndexEvent) {
        match ev {
            IndexEvent::Stored {
                hashes,
                group,
                tier,
                ..
            } => {
                for &h in hashes {
                    let c = self.counts.entry((r, key(*group), *tier, h)).or_insert(0);
                    *c = c.saturating_add(1);
                }
            }
            IndexEvent::Removed {
                hashes,
                group,
                tier,
            } => {
                for &h in hashes {
                    let k = (r, key(*group), *tier, h);
                    match self.counts.get_mut(&k) {
                        Some(c) => {
                            *c -= 1;
                            if *c == 0 {
                                self.counts.remove(&k);
                            }
                        }
                        None => self.unknown_removals += 1,
                    }
                }
            }
            IndexEvent::Cleared => self
                .counts
                .retain(|&(rr, _, t, _), _| rr != r || t != Tier::Device),
        }
    }

    fn holds(&self, r: u32, h: u64, group: Option<u32>) -> bool {
        self.counts
            .keys()
            .any(|&(rr, g, _, hh)| rr == r && hh == h && group.is_none_or(|q| g == q))
    }

    /// The fastest tier replica `r` holds `h` in (any group).
    fn best_tier(&self, r: u32, h: u64) -> Option<Tier> {
        self.counts
            .keys()
            .filter(|&&(rr, _, _, hh)| rr == r && hh == h)
            .map(|&(_, _, t, _)| t)
            .min()
    }

    fn entries(&self, r: u32) -> Vec<(u64, Option<u32>, u32)> {
        let mut out: Vec<_> = self
            .counts
            .iter()
            .filter(|&(&(rr, _, _, _), _)| rr == r)
            .map(|(&(_, g, _, h), &c)| (h, (g != NO_GROUP).then_some(g), c))
            .collect();
        out.sort_unstable();
        out
    }
}

fn tier(b: &mut Bytes<'_>) -> Tier {
    Tier::ALL[b.below(3)]
}

fn event(b: &mut Bytes<'_>) -> IndexEvent {
    match b.u8() % 8 {
        0..=3 => IndexEvent::Stored {
            parent: b.bool().then(|| hash(b)),
            hashes: hashes(b),
            group: group(b),
            tier: tier(b),
        },
        4..=6 => IndexEvent::Removed {
            hashes: hashes(b),
            group: group(b),
            tier: tier(b),
        },
        _ => IndexEvent::Cleared,
    }
}

fn check(idx: &PrefixIndex, model: &Model, ids: &[ReplicaId], probe: &[u64], group: Option<u32>) {
    if let Err(e) = idx.check_invariants() {
        panic!("invariant violated: {e}");
    }
    for (i, &r) in ids.iter().enumerate() {
        let ri = i as u32;
        assert_eq!(
            idx.replica_entries(r),
            model.entries(ri),
            "entries of replica {i}"
        );
        for &h in probe {
            assert_eq!(
                idx.contains(r, h, group),
                model.holds(ri, h, group),
                "contains({i}, {h}, {group:?})"
            );
        }
    }
    // A group filter of None in match_lengths means "any group".
    let lengths = idx.match_lengths(probe, group);
    for (i, &n) in lengths.iter().enumerate() {
        let want = probe
            .iter()
            .take_while(|&&h| model.holds(i as u32, h, group))
            .count();
        assert_eq!(n, want, "match length of replica {i}");
    }
    let best = idx.longest_prefix(probe, group);
    let want = lengths
        .iter()
        .enumerate()
        .filter(|&(_, &n)| n > 0)
        .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(&a.0)))
        .map(|(i, &n)| (i as u32, n));
    assert_eq!(best.map(|m| (m.replica.0, m.num_blocks)), want);
    // Per tier: the held prefix (any group), each block by its fastest tier.
    for (i, tiers) in idx.match_tiers(probe, None).iter().enumerate() {
        let mut want = [0usize; 3];
        for &h in probe {
            match model.best_tier(i as u32, h) {
                Some(t) => want[t as usize] += 1,
                None => break,
            }
        }
        assert_eq!(*tiers, want, "tiers of replica {i}");
    }
    assert_eq!(idx.stats().unknown_removals, model.unknown_removals);
}

/// Runs one input (see the module docs for what is checked).
///
/// # Panics
/// When a property fails: the fuzzer reports it as a crash.
pub fn run_index(data: &[u8]) {
    let mut b = Bytes::new(data);
    let mut idx = PrefixIndex::new();
    let ids: Vec<ReplicaId> = (0..REPLICAS)
        .map(|i| idx.replica(&format!("r{i}")))
        .collect();
    let mut model = Model::default();
    let mut steps = 0;
    while !b.done() && steps < 400 {
        steps += 1;
        let r = b.below(REPLICAS as usize + 1) as u32;
        match b.u8() % 4 {
            0 => {
                // One event through `apply`.
                let ev = event(&mut b);
                if r < REPLICAS && !valid(&ev) {
                    assert!(idx.apply(ids[r as usize], &ev).is_err());
                } else if r < REPLICAS {
                    idx.apply(ids[r as usize], &ev)
                        .expect("a registered replica");
                    model.apply(r, &ev);
                } else {
                    assert!(idx.apply(ReplicaId(r + 7), &ev).is_err());
                }
            }
            1 | 2 => {
                // A batch: all or nothing.
                let n = b.below(5);
                let batch: Vec<IndexEvent> = (0..n).map(|_| event(&mut b)).collect();
                if r < REPLICAS && !batch.iter().all(valid) {
                    let before = idx.replica_entries(ids[r as usize]);
                    assert!(idx.apply_all(ids[r as usize], &batch).is_err());
                    assert_eq!(idx.replica_entries(ids[r as usize]), before);
                } else if r < REPLICAS {
                    let applied = idx
                        .apply_all(ids[r as usize], &batch)
                        .expect("a registered replica");
                    assert_eq!(applied, batch.len());
                    for ev in &batch {
                        model.apply(r, ev);
                    }
                } else {
                    assert!(idx.apply_all(ReplicaId(r + 7), &batch).is_err());
                }
            }
            _ => {
                let probe = hashes(&mut b);
                let g = group(&mut b);
                check(&idx, &model, &ids, &probe, g);
                continue;
            }
        }
        let probe: Vec<u64> = (0..8).collect();
        check(&idx, &model, &ids, &probe, None);
    }
    for &r in &ids {
        idx.clear(r).expect("registered");
    }
    assert_eq!(
        idx.num_blocks(),
        0,
        "every replica cleared, the index is empty"
    );
    if let Err(e) = idx.check_invariants() {
        panic!("invariant violated after clearing: {e}");
    }
}
