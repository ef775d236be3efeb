//! Writing the tier: `prepare_store` (admission, eviction, slots) and its
//! completion.

use rustc_hash::FxHashSet;

use super::requests::{INSERTED, ReqState, STORE_MISS};
use super::{Chunk, OffloadKey, OffloadTier, ReqKey, StoreOutput, check_positions};
use crate::error::{Result, invalid};

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
        let mut offered = std::mem::take(&mut self.offered);
        offered.clear();
        offered.extend(keys.iter().copied());
        let result = self.prepare_store_offer(keys, req, positions, &offered);
        self.offered = offered;
        result
    }

    fn prepare_store_offer(
        &mut self,
        keys: &[OffloadKey],
        req: ReqKey,
        positions: &[i64],
        offered: &FxHashSet<OffloadKey>,
    ) -> Result<Option<StoreOutput>> {
        if offered.len() != keys.len() {
            return Err(invalid("prepare_store: a key is offered twice"));
        }
        // each key's residency, read once: `None` absent, else whether ready
        let resident: Vec<Option<bool>> = keys
            .iter()
            .map(|k| self.policy.get(k).map(Chunk::is_ready))
            .collect();
        let recorded: Vec<OffloadKey> = keys
            .iter()
            .zip(&resident)
            .filter(|&(k, r)| self.would_record(k, *r))
            .map(|(k, _)| *k)
            .collect();
        self.check_open(req, &recorded)?;

        self.record_positions(req, keys, positions);
        if let Some(t) = &mut self.tracker {
            t.record(keys);
        }
        let mut to_store = Vec::new();
        let mut ready_existing = Vec::new();
        for (key, r) in keys.iter().zip(&resident) {
            match r {
                None => to_store.push(*key),
                Some(true) => ready_existing.push(*key),
                Some(false) => {}
            }
        }
        if let Some(t) = &self.tracker {
            let before = to_store.len();
            to_store.retain(|k| t.count(k) >= self.config.store_threshold);
            self.stores_skipped += (before - to_store.len()) as u64;
        }
        let generation = self.generation;
        let state = self.requests.entry(req).or_insert_with(ReqState::new);
        state.refresh(generation);
        let misses: Vec<OffloadKey> = to_store
            .iter()
            .filter(|k| state.mark(**k, STORE_MISS))
            .copied()
            .collect();
        if !misses.is_empty() {
            self.policy.on_store_miss(&misses);
        }
        debug_assert_eq!(recorded.len(), to_store.len() + ready_existing.len());
        self.record_access(req, &recorded, &[], &ready_existing);

        if to_store.is_empty() {
            return Ok(Some(StoreOutput::default()));
        }
        self.allocation_sizes.push(to_store.len() as u64);
        let shortfall = (to_store.len() as u64).saturating_sub(self.slots.num_free());
        let mut evicted = Vec::new();
        if shortfall > 0 {
            let Some(victims) = self.evict_protected(shortfall as usize, offered) else {
                self.counters.stores_refused += 1;
                return Ok(None);
            };
            evicted.extend(victims.into_iter().map(|(k, _)| k));
        }
        let slots = self.slots.allocate(to_store.len());
        let state = self.requests.get_mut(&req).expect("created above");
        let slot = state.rank_slot(generation);
        let mut rank = *slot;
        for (key, &s) in to_store.iter().zip(&slots) {
            let position = state.position(key);
            self.policy
                .insert(*key, Chunk::pending(s), position, &mut rank);
        }
        state.rank = rank;
        self.num_write_pending += to_store.len() as u64;
        self.counters.stores_prepared += to_store.len() as u64;
        for key in &to_store {
            state.mark(*key, INSERTED);
        }
        Ok(Some(StoreOutput {
            keys_to_store: to_store,
            slots,
            evicted,
        }))
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
        let protected: FxHashSet<OffloadKey> = protected.iter().copied().collect();
        self.evict_protected(n, &protected)
    }

    fn evict_protected(
        &mut self,
        n: usize,
        protected: &FxHashSet<OffloadKey>,
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
