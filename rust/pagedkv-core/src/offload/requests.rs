//! What the tier remembers per request (vLLM 0.33 `_RequestCacheAccess` and the
//! LRU's `_RequestRank`) and the `store_threshold` admission tracker.
//!
//! A request's state belongs to the tier's current generation: after
//! `reset_cache` it reads as fresh, as vLLM's generation check makes it.

use std::collections::BTreeMap;

use hashlink::LinkedHashMap;
use rustc_hash::{FxBuildHasher, FxHashMap, FxHashSet};

use super::keys::OffloadKey;

/// The LRU's shared rank of one request, valid for one generation.
#[derive(Clone, Copy, Debug, Default)]
pub struct RankSlot {
    generation: u64,
    current: u64,
    rank: Option<u64>,
}

impl RankSlot {
    pub(super) fn get(&self) -> Option<u64> {
        if self.generation == self.current {
            self.rank
        } else {
            None
        }
    }

    pub(super) fn set(&mut self, rank: u64) {
        self.generation = self.current;
        self.rank = Some(rank);
    }
}

/// The keys one request offered or read, by group in first-seen order, and how.
#[derive(Clone, Debug, Default)]
pub struct Access {
    pub(super) key_groups: BTreeMap<u32, Vec<OffloadKey>>,
    pub(super) seen: FxHashSet<OffloadKey>,
    pub(super) inserted: FxHashSet<OffloadKey>,
    pub(super) reused: FxHashSet<OffloadKey>,
    pub(super) store_miss: FxHashSet<OffloadKey>,
    pub(super) finished: bool,
}

/// One request's state in the tier.
#[derive(Clone, Debug)]
pub struct ReqState {
    access_generation: u64,
    access: Access,
    pub(super) rank: RankSlot,
    /// End-token position of each key, as the scheduler recorded it.
    pub(super) positions: FxHashMap<OffloadKey, i64>,
}

impl ReqState {
    /// A request with no access record yet.
    pub(super) fn new() -> Self {
        Self {
            access_generation: u64::MAX,
            access: Access::default(),
            rank: RankSlot::default(),
            positions: FxHashMap::default(),
        }
    }

    /// The access record as it stands (current or not).
    pub(super) fn access_ref(&self) -> &Access {
        &self.access
    }

    /// The access record of the current generation (a stale one starts over).
    pub(super) fn access(&mut self, generation: u64) -> &mut Access {
        if self.access_generation != generation {
            self.access_generation = generation;
            self.access = Access::default();
        }
        &mut self.access
    }

    /// Whether the access record is of the current generation.
    pub(super) fn access_is_current(&self, generation: u64) -> bool {
        self.access_generation == generation
    }

    /// Points the rank slot at the current generation.
    pub(super) fn rank_slot(&mut self, generation: u64) -> &mut RankSlot {
        self.rank.current = generation;
        &mut self.rank
    }

    /// Records positions (negative: not known) for `keys`.
    pub(super) fn record_positions(&mut self, keys: &[OffloadKey], positions: &[i64]) {
        for (k, &p) in keys.iter().zip(positions) {
            if p >= 0 {
                self.positions.insert(*k, p);
            }
        }
    }

    /// Keys in position order when every key has one, else as given (stable).
    pub(super) fn order_by_position(&self, keys: &mut [OffloadKey]) {
        if keys.iter().all(|k| self.positions.contains_key(k)) {
            keys.sort_by_key(|k| self.positions[k]);
        }
    }
}

/// Offer counts for the `store_threshold` filter: most recently offered last,
/// at most `max_size` keys, keys of the current offer never pushed out by it.
#[derive(Clone, Debug)]
pub struct Tracker {
    counts: LinkedHashMap<OffloadKey, u64, FxBuildHasher>,
    max_size: usize,
}

impl Tracker {
    pub(super) fn new(max_size: usize) -> Self {
        Self {
            counts: LinkedHashMap::with_hasher(FxBuildHasher),
            max_size,
        }
    }

    pub(super) fn count(&self, key: &OffloadKey) -> u64 {
        self.counts.get(key).copied().unwrap_or(0)
    }

    pub(super) fn len(&self) -> usize {
        self.counts.len()
    }

    /// The tracked keys with their counts, least recently offered first.
    pub(super) fn iter(&self) -> impl Iterator<Item = (&OffloadKey, &u64)> {
        self.counts.iter()
    }

    /// Counts one offer (vLLM `_record_accesses`).
    pub(super) fn record(&mut self, keys: &[OffloadKey]) {
        let mut protected = 0usize;
        for key in keys {
            if let Some(c) = self.counts.to_back(key) {
                *c += 1;
                protected += 1;
            }
        }
        let mut unprotected = self.counts.len() - protected;
        for key in keys {
            if self.counts.contains_key(key) {
                continue;
            }
            if self.counts.len() >= self.max_size {
                if unprotected == 0 {
                    continue;
                }
                self.counts.pop_front();
                unprotected -= 1;
            }
            self.counts.insert(*key, 1);
        }
    }
}
