//! What the tier remembers per request (vLLM 0.33 `_RequestCacheAccess` and the
//! LRU's `_RequestRank`) and the `store_threshold` admission tracker.
//!
//! A request's state belongs to the tier's current generation: after
//! `reset_cache` it reads as fresh, as vLLM's generation check makes it.

use hashlink::LinkedHashMap;
use rustc_hash::{FxBuildHasher, FxHashMap};

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

/// What a request did with a key (bits of [`KeyInfo::flags`]).
pub(super) const SEEN: u8 = 1;
/// The request's store created the chunk.
pub(super) const INSERTED: u8 = 2;
/// The request read (or re-offered) a ready chunk it did not create.
pub(super) const REUSED: u8 = 4;
/// The key was a store miss the policy already observed for this request.
pub(super) const STORE_MISS: u8 = 8;

/// One key of a request: its access flags (this generation) and its end-token
/// position (`-1`: not known), which outlives generations as the scheduler's
/// record does.
#[derive(Clone, Copy, Debug)]
pub(super) struct KeyInfo {
    flags: u8,
    position: i64,
}

impl KeyInfo {
    /// Sets `flag`; whether it was not set.
    pub(super) fn set(&mut self, flag: u8) -> bool {
        let new = self.flags & flag == 0;
        self.flags |= flag;
        new
    }

    /// Clears `flag`.
    pub(super) fn clear(&mut self, flag: u8) {
        self.flags &= !flag;
    }

    /// Whether `flag` is set.
    pub(super) fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }

    /// The recorded end-token position.
    pub(super) fn position(&self) -> Option<i64> {
        (self.position >= 0).then_some(self.position)
    }

    /// Records a position (negative: not known, the recorded one kept).
    pub(super) fn set_position(&mut self, p: i64) {
        if p >= 0 {
            self.position = p;
        }
    }
}

/// One request's state in the tier (vLLM's `_RequestCacheAccess`, the
/// scheduler's key positions and the LRU's request rank), in one map.
#[derive(Clone, Debug)]
pub struct ReqState {
    generation: u64,
    finished: bool,
    keys: FxHashMap<OffloadKey, KeyInfo>,
    /// Keys in the order the request first accessed them.
    order: Vec<OffloadKey>,
    pub(super) rank: RankSlot,
}

impl ReqState {
    /// A request with no access record yet.
    pub(super) fn new() -> Self {
        let mut keys = FxHashMap::default();
        keys.reserve(32);
        Self {
            generation: u64::MAX,
            finished: false,
            keys,
            order: Vec::with_capacity(32),
            rank: RankSlot::default(),
        }
    }

    /// Starts this generation's access record (a stale one is dropped; the
    /// positions stay).
    pub(super) fn refresh(&mut self, generation: u64) {
        if self.generation != generation {
            self.generation = generation;
            self.finished = false;
            self.order.clear();
            for info in self.keys.values_mut() {
                info.flags = 0;
            }
        }
    }

    /// Whether the access record is of the current generation.
    pub(super) fn is_current(&self, generation: u64) -> bool {
        self.generation == generation
    }

    pub(super) fn finished(&self) -> bool {
        self.finished
    }

    pub(super) fn set_finished(&mut self) {
        self.finished = true;
    }

    /// Whether `key` carries `flag` (in the current record).
    pub(super) fn has(&self, key: &OffloadKey, flag: u8) -> bool {
        self.keys.get(key).is_some_and(|i| i.flags & flag != 0)
    }

    /// The key's record, created empty when absent.
    pub(super) fn info_mut(&mut self, key: OffloadKey) -> &mut KeyInfo {
        self.keys.entry(key).or_insert(KeyInfo {
            flags: 0,
            position: -1,
        })
    }

    /// Appends a key first seen (its `SEEN` flag just set) to the access order.
    pub(super) fn push_seen(&mut self, key: OffloadKey) {
        self.order.push(key);
    }

    /// The request read a ready chunk (loaded it, or offered it again):
    /// records the position (negative: not known), the sighting, and reuse
    /// unless the request stored it. A first sighting with a known position
    /// goes to `reaccessed` (the policy ranks it). Whether it was first seen.
    pub(super) fn read_ready(
        &mut self,
        key: OffloadKey,
        position: i64,
        reaccessed: &mut Vec<(OffloadKey, i64)>,
    ) -> bool {
        let info = self.info_mut(key);
        info.set_position(position);
        let first_seen = info.set(SEEN);
        if !info.has(INSERTED) {
            info.set(REUSED);
        }
        let position = info.position();
        if first_seen {
            self.push_seen(key);
            if let Some(p) = position {
                reaccessed.push((key, p));
            }
        }
        first_seen
    }

    /// Records positions (negative: not known) for `keys`.
    pub(super) fn record_positions(&mut self, keys: &[OffloadKey], positions: &[i64]) {
        for (k, &p) in keys.iter().zip(positions) {
            if p >= 0 {
                self.keys
                    .entry(*k)
                    .or_insert(KeyInfo {
                        flags: 0,
                        position: -1,
                    })
                    .position = p;
            }
        }
    }

    /// Points the rank slot at the current generation.
    pub(super) fn rank_slot(&mut self, generation: u64) -> &mut RankSlot {
        self.rank.current = generation;
        &mut self.rank
    }

    /// The request's keys head to tail (vLLM's order at a request's end):
    /// grouped by KV-cache group in group order, each group in position order
    /// when all its keys have one (else first-seen order), then all of them in
    /// position order when every key has one.
    pub(super) fn ordered_keys(&self) -> Vec<(OffloadKey, u8)> {
        // (group, position, key, flags): each key's record read once
        let mut keys: Vec<(u32, i64, OffloadKey, u8)> = self
            .order
            .iter()
            .map(|k| {
                let info = self.keys.get(k).copied().unwrap_or(KeyInfo {
                    flags: 0,
                    position: -1,
                });
                (k.group_idx(), info.position, *k, info.flags)
            })
            .collect();
        keys.sort_by_key(|e| e.0);
        let mut start = 0;
        while start < keys.len() {
            let g = keys[start].0;
            let end = start + keys[start..].iter().take_while(|e| e.0 == g).count();
            order_by_position(&mut keys[start..end]);
            start = end;
        }
        order_by_position(&mut keys);
        keys.into_iter().map(|(_, _, k, f)| (k, f)).collect()
    }
}

/// Sorts keys by position (stable) when every one has a position.
fn order_by_position(keys: &mut [(u32, i64, OffloadKey, u8)]) {
    if keys.iter().all(|e| e.1 >= 0) {
        keys.sort_by_key(|e| e.1);
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
