//! Writing the tier: `prepare_store` (admission, eviction, slots) and its
//! completion.

use super::policy::Protected;
use super::requests::{INSERTED, ReqState, SEEN, STORE_MISS};
use super::{Chunk, OffloadKey, OffloadTier, ReqKey, StoreOutput, check_positions, commit_access};
use crate::error::{Result, invalid};

/// `prepare_store`'s working lists, kept for their capacity.
#[derive(Clone, Debug, Default)]
pub(super) struct StoreScratch {
    /// Store misses new to the request (the policy observes them).
    misses: Vec<OffloadKey>,
    /// Per key to store: whether this offer set its `INSERTED` mark.
    inserted_new: Vec<bool>,
    /// Per key to store: its recorded position.
    positions: Vec<Option<i64>>,
    /// Ready keys first seen by the request, with their positions.
    reaccessed: Vec<(OffloadKey, i64)>,
}

impl StoreScratch {
    fn clear(&mut self) {
        self.misses.clear();
        self.inserted_new.clear();
        self.positions.clear();
        self.reaccessed.clear();
    }
}

impl OffloadTier {
    /// Reserves slots for the offered keys that are absent (and admitted),
    /// evicting idle chunks not among the offered keys when the free slots fall
    /// short. `Ok(None)`: the shortfall cannot be evicted (the offer's access is
    /// still recorded, as vLLM does).
    ///
    /// # Errors
    /// `InvalidArgument` (nothing changed) for a key offered twice, positions
    /// that do not match the keys, or new keys after the request ended.
    ///
    /// # Panics
    /// Never: the request's record is created before it is read.
    pub fn prepare_store(
        &mut self,
        keys: &[OffloadKey],
        req: ReqKey,
        positions: &[i64],
    ) -> Result<Option<StoreOutput>> {
        check_positions(keys, positions)?;
        let Some(offered) = Protected::new(keys) else {
            return Err(invalid("prepare_store: a key is offered twice"));
        };
        // each key's residency, read once: `None` absent, else whether ready
        let mut resident = std::mem::take(&mut self.scratch.resident);
        resident.clear();
        resident.extend(keys.iter().map(|k| self.policy.get(k).map(Chunk::is_ready)));
        let result = self.prepare_store_offer(keys, req, positions, &offered, &resident);
        self.scratch.resident = resident;
        result
    }

    /// `prepare_store` once the offer is checked. The request's record is
    /// read and written once a key: its position, vLLM's store miss, its
    /// first sighting and reuse, and whether its store was this request's.
    fn prepare_store_offer(
        &mut self,
        keys: &[OffloadKey],
        req: ReqKey,
        positions: &[i64],
        offered: &Protected<'_>,
        resident: &[Option<bool>],
    ) -> Result<Option<StoreOutput>> {
        if self.is_finished(req) {
            let recorded: Vec<OffloadKey> = keys
                .iter()
                .zip(resident)
                .filter(|&(k, r)| self.would_record(k, *r))
                .map(|(k, _)| *k)
                .collect();
            self.check_open(req, &recorded)?;
        }
        if let Some(t) = &mut self.tracker {
            t.record(keys);
        }
        let threshold = self.config.store_threshold;
        let generation = self.generation;
        let state = self.requests.entry(req).or_insert_with(ReqState::new);
        state.refresh(generation);
        let mut sc = std::mem::take(&mut self.scratch.store);
        sc.clear();
        let mut to_store = Vec::new();
        let mut any_new = false;
        for (i, (key, r)) in keys.iter().zip(resident).enumerate() {
            let p = positions.get(i).copied().unwrap_or(-1);
            match r {
                // resident and ready: reused
                Some(true) => any_new |= state.read_ready(*key, p, &mut sc.reaccessed),
                // being written: only its position is recorded
                Some(false) => {
                    if p >= 0 {
                        state.info_mut(*key).set_position(p);
                    }
                }
                None => {
                    let admitted = self
                        .tracker
                        .as_ref()
                        .is_none_or(|t| t.count(key) >= threshold);
                    if !admitted {
                        self.stores_skipped += 1;
                        if p >= 0 {
                            state.info_mut(*key).set_position(p);
                        }
                        continue;
                    }
                    let info = state.info_mut(*key);
                    info.set_position(p);
                    let first_seen = info.set(SEEN);
                    if info.set(STORE_MISS) {
                        sc.misses.push(*key);
                    }
                    sc.inserted_new.push(info.set(INSERTED));
                    sc.positions.push(info.position());
                    to_store.push(*key);
                    if first_seen {
                        any_new = true;
                        state.push_seen(*key);
                    }
                }
            }
        }
        if !sc.misses.is_empty() {
            self.policy.on_store_miss(&sc.misses);
        }
        if any_new {
            commit_access(&mut self.policy, state, generation, &sc.reaccessed);
        }
        let result = self.reserve(req, to_store, offered, &sc);
        self.scratch.store = sc;
        Ok(result)
    }

    /// Evicts what the new chunks lack and inserts them, pending; on refusal
    /// the request's marks of those stores are taken back.
    fn reserve(
        &mut self,
        req: ReqKey,
        to_store: Vec<OffloadKey>,
        offered: &Protected<'_>,
        sc: &StoreScratch,
    ) -> Option<StoreOutput> {
        if to_store.is_empty() {
            return Some(StoreOutput::default());
        }
        self.allocation_sizes.push(to_store.len() as u64);
        let shortfall = (to_store.len() as u64).saturating_sub(self.slots.num_free());
        let mut evicted = Vec::new();
        if shortfall > 0 {
            let Some(victims) = self.evict_protected(shortfall as usize, offered) else {
                self.counters.stores_refused += 1;
                let state = self.requests.get_mut(&req).expect("created by the offer");
                for (key, &new) in to_store.iter().zip(&sc.inserted_new) {
                    if new {
                        state.info_mut(*key).clear(INSERTED);
                    }
                }
                return None;
            };
            evicted.extend(victims.into_iter().map(|(k, _)| k));
        }
        let slots = self.slots.allocate(to_store.len());
        let generation = self.generation;
        let state = self.requests.get_mut(&req).expect("created by the offer");
        let mut rank = *state.rank_slot(generation);
        for ((key, &s), &position) in to_store.iter().zip(&slots).zip(&sc.positions) {
            self.policy
                .insert(*key, Chunk::pending(s), position, &mut rank);
        }
        state.rank = rank;
        self.num_write_pending += to_store.len() as u64;
        self.counters.stores_prepared += to_store.len() as u64;
        Some(StoreOutput {
            keys_to_store: to_store,
            slots,
            evicted,
        })
    }

    /// Completes stores: on success the pending chunks become readable; on
    /// failure they are removed and their slots freed. Keys with no store in
    /// flight are ignored (and counted).
    pub fn complete_store(&mut self, keys: &[OffloadKey], success: bool) {
        let mut done = Vec::new();
        for key in keys {
            let Some(chunk) = self.policy.get_mut(key).filter(|c| !c.is_ready()) else {
                self.counters.ignored_completions += 1;
                continue;
            };
            self.num_write_pending -= 1;
            if success {
                chunk.ref_cnt = 0;
                self.num_evictable += 1;
                self.policy.mark_evictable(key);
            } else {
                let slot = chunk.slot;
                self.policy.remove(key);
                self.slots.free(slot);
            }
            done.push(*key);
        }
        if success {
            self.counters.stores_completed += done.len() as u64;
            self.push_event(done, false, false);
        } else {
            self.counters.stores_failed += done.len() as u64;
            self.push_event(done, true, true);
        }
    }

    /// Whether `prepare_store` would record `key` in the request's access
    /// (absent and admitted, or resident and ready).
    fn would_record(&self, key: &OffloadKey, resident: Option<bool>) -> bool {
        match resident {
            Some(ready) => ready,
            None => match &self.tracker {
                None => true,
                // a tracked key's count grows by one; a new one starts at 1 < threshold
                Some(t) => {
                    let n = t.count(key);
                    n > 0 && n + 1 >= self.config.store_threshold
                }
            },
        }
    }

    /// Evicts `n` idle chunks (the policy's first, none of `protected`),
    /// freeing their slots and announcing their removal; all or none.
    /// `None` when fewer than `n` can go (nothing changed).
    pub fn evict(
        &mut self,
        n: usize,
        protected: &[OffloadKey],
    ) -> Option<Vec<(OffloadKey, Chunk)>> {
        let protected = Protected::with_repeats(protected);
        self.evict_protected(n, &protected)
    }

    fn evict_protected(
        &mut self,
        n: usize,
        protected: &Protected<'_>,
    ) -> Option<Vec<(OffloadKey, Chunk)>> {
        if n as u64 > self.num_evictable {
            return None;
        }
        let victims = self.policy.evict(n, protected)?;
        self.num_evictable -= victims.len() as u64;
        self.counters.evictions += victims.len() as u64;
        for (_, chunk) in &victims {
            self.slots.free(chunk.slot);
        }
        self.push_event(victims.iter().map(|(k, _)| *k).collect(), true, false);
        Some(victims)
    }
}
