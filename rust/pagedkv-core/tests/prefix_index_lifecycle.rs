//! `PrefixIndex` through clears: a property test against a model that keeps
//! tiers and parents, so that what a clear empties (and a later store brings
//! back) is checked by every read-out: counts, parents, chains, tier matches.

use std::collections::BTreeMap;

use pagedkv_core::prefix_index::{IndexEvent, PrefixIndex, ReplicaId, Tier};
use proptest::prelude::*;

const REPLICAS: u32 = 3;
const HASHES: u64 = 40;

#[derive(Clone, Debug)]
enum Op {
    Store(u32, Option<u64>, Vec<u64>, Option<u32>, Tier),
    Remove(u32, Vec<u64>, Option<u32>, Tier),
    /// `clear`: every tier.
    Clear(u32),
    /// `AllBlocksCleared`: the device tier.
    ClearDevice(u32),
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![3 => Just(Tier::Device), 1 => Just(Tier::Host), 1 => Just(Tier::Disk)]
}

fn group() -> impl Strategy<Value = Option<u32>> {
    prop_oneof![Just(None), Just(Some(0)), Just(Some(1))]
}

fn op() -> impl Strategy<Value = Op> {
    // Long chains, so that a clear empties more nodes than it reads ahead.
    let hashes = || prop::collection::vec(0..HASHES, 0..30);
    prop_oneof![
        5 => (0..REPLICAS, prop::option::of(0..HASHES), hashes(), group(), tier())
            .prop_map(|(r, p, h, g, t)| Op::Store(r, p, h, g, t)),
        3 => (0..REPLICAS, hashes(), group(), tier())
            .prop_map(|(r, h, g, t)| Op::Remove(r, h, g, t)),
        1 => (0..REPLICAS).prop_map(Op::Clear),
        1 => (0..REPLICAS).prop_map(Op::ClearDevice),
    ]
}

/// Counts per (replica, tier, group, hash); the parent of each held hash.
#[derive(Default)]
struct Model {
    counts: BTreeMap<(u32, Tier, Option<u32>, u64), u32>,
    parents: BTreeMap<u64, Option<u64>>,
}

impl Model {
    fn held(&self, h: u64) -> bool {
        self.counts.keys().any(|k| k.3 == h)
    }

    /// Forgets the parents of hashes nobody holds any more.
    fn settle(&mut self) {
        let held: Vec<u64> = self.counts.keys().map(|k| k.3).collect();
        self.parents.retain(|h, _| held.contains(h));
    }

    fn store(&mut self, r: u32, parent: Option<u64>, hashes: &[u64], g: Option<u32>, t: Tier) {
        let mut parent = parent;
        for &h in hashes {
            if self.held(h) {
                let p = self.parents.entry(h).or_default();
                if p.is_none() {
                    *p = parent;
                }
            } else {
                self.parents.insert(h, parent);
            }
            *self.counts.entry((r, t, g, h)).or_default() += 1;
            parent = Some(h);
        }
    }

    fn remove(&mut self, r: u32, hashes: &[u64], g: Option<u32>, t: Tier) -> u64 {
        let mut unknown = 0;
        for &h in hashes {
            match self.counts.get_mut(&(r, t, g, h)) {
                Some(c) if *c > 1 => *c -= 1,
                Some(_) => {
                    self.counts.remove(&(r, t, g, h));
                }
                None => unknown += 1,
            }
        }
        self.settle();
        unknown
    }

    fn clear(&mut self, r: u32, only: Option<Tier>) {
        self.counts
            .retain(|k, _| k.0 != r || only.is_some_and(|t| t != k.1));
        self.settle();
    }

    fn chain(&self, h: u64) -> Vec<u64> {
        let mut out = Vec::new();
        let mut cur = Some(h);
        while let Some(x) = cur {
            let Some(&p) = self.parents.get(&x) else {
                break;
            };
            out.push(x);
            if out.len() > self.parents.len() {
                break;
            }
            cur = p;
        }
        out.reverse();
        out
    }

    fn tiers(&self, hashes: &[u64]) -> Vec<[usize; 3]> {
        (0..REPLICAS)
            .map(|r| {
                let mut n = [0; 3];
                for &h in hashes {
                    let best = self
                        .counts
                        .keys()
                        .filter(|k| k.0 == r && k.3 == h)
                        .map(|k| k.1)
                        .min();
                    let Some(t) = best else {
                        break;
                    };
                    n[t as usize] += 1;
                }
                n
            })
            .collect()
    }
}

fn check(idx: &PrefixIndex, model: &Model, ids: &[ReplicaId]) -> Result<(), TestCaseError> {
    idx.check_invariants()
        .map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
    prop_assert_eq!(idx.num_blocks(), model.parents.len());
    for (r, &id) in ids.iter().enumerate() {
        let mut held: Vec<u64> = model
            .counts
            .keys()
            .filter(|k| k.0 as usize == r)
            .map(|k| k.3)
            .collect();
        held.dedup();
        held.sort_unstable();
        held.dedup();
        prop_assert_eq!(idx.replica_num_blocks(id), held.len());
    }
    for h in 0..HASHES {
        prop_assert_eq!(idx.parent(h), model.parents.get(&h).copied().flatten());
        prop_assert_eq!(idx.chain(h), model.chain(h));
        let chain = model.chain(h);
        prop_assert_eq!(idx.match_tiers(&chain, None), model.tiers(&chain));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn clears_keep_every_read_out_exact(ops in prop::collection::vec(op(), 1..80)) {
        let mut idx = PrefixIndex::new();
        let ids: Vec<ReplicaId> = (0..REPLICAS).map(|r| idx.replica(&format!("r{r}"))).collect();
        let mut model = Model::default();
        let mut unknown = 0;
        for op in ops {
            match op {
                Op::Store(r, p, hs, g, t) => {
                    idx.store_in(ids[r as usize], p, &hs, g, t).unwrap();
                    model.store(r, p, &hs, g, t);
                }
                Op::Remove(r, hs, g, t) => {
                    idx.remove_from(ids[r as usize], &hs, g, t).unwrap();
                    unknown += model.remove(r, &hs, g, t);
                }
                Op::Clear(r) => {
                    idx.clear(ids[r as usize]).unwrap();
                    model.clear(r, None);
                }
                Op::ClearDevice(r) => {
                    idx.apply(ids[r as usize], &IndexEvent::Cleared).unwrap();
                    model.clear(r, Some(Tier::Device));
                }
            }
            prop_assert_eq!(idx.stats().unknown_removals, unknown);
            check(&idx, &model, &ids)?;
        }
    }
}
