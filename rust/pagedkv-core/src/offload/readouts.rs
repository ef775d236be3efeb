//! Read-only views of the tier's structure, for debugging, drop-in views and
//! parity checks against vLLM's policy objects.

use super::arc::List;
use super::keys::OffloadKey;
use super::policy::Policy;
use super::slots::Chunk;
use super::{OffloadTier, TierConfig, TierCounters, TierStats};
use crate::error::{Result, invalid};

/// ARC's lists, each least recently used first.
#[derive(Clone, Debug, PartialEq)]
pub struct ArcLists {
    /// The adaptive target size of T1.
    pub target_t1_size: f64,
    /// Chunks seen once.
    pub t1: Vec<(OffloadKey, Chunk)>,
    /// Chunks reused.
    pub t2: Vec<(OffloadKey, Chunk)>,
    /// Ghosts of chunks evicted from T1.
    pub b1: Vec<OffloadKey>,
    /// Ghosts of chunks evicted from T2.
    pub b2: Vec<OffloadKey>,
}

impl OffloadTier {
    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &TierConfig {
        &self.config
    }

    /// Resident chunks (pending ones included).
    #[must_use]
    pub fn num_resident(&self) -> usize {
        self.policy.len()
    }

    /// Resident chunks that nothing pins (eviction candidates).
    #[must_use]
    pub fn num_evictable(&self) -> u64 {
        self.num_evictable
    }

    /// Chunks whose store is in flight.
    #[must_use]
    pub fn num_write_pending(&self) -> u64 {
        self.num_write_pending
    }

    /// Slots handed out fresh since the last reset (vLLM's
    /// `_num_allocated_chunks`; freed ones count until the reset).
    #[must_use]
    pub fn num_slots_used(&self) -> u64 {
        self.slots.num_allocated()
    }

    /// Freed slots waiting for reuse, the next one last (vLLM's `_free_list`).
    #[must_use]
    pub fn freed_slots(&self) -> &[u64] {
        self.slots.freed()
    }

    /// Slots that can be handed out without evicting.
    #[must_use]
    pub fn num_free_slots(&self) -> u64 {
        self.slots.num_free()
    }

    /// The running totals.
    #[must_use]
    pub fn counters(&self) -> TierCounters {
        self.counters
    }

    /// Requests the tier holds state for.
    #[must_use]
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// A resident chunk's state.
    #[must_use]
    pub fn chunk(&self, key: &OffloadKey) -> Option<Chunk> {
        self.policy.get(key).copied()
    }

    /// New chunks the admission filter skipped since the last [`Self::stats`].
    #[must_use]
    pub fn pending_stores_skipped(&self) -> u64 {
        self.stores_skipped
    }

    /// Allocation sizes since the last [`Self::stats`].
    #[must_use]
    pub fn pending_allocation_sizes(&self) -> &[u64] {
        &self.allocation_sizes
    }

    /// vLLM's metrics of the step; drains the allocation sizes and skip count.
    pub fn stats(&mut self) -> TierStats {
        let cap = self.slots.capacity();
        let used = self.slots.num_allocated() - self.slots.num_freed() as u64 - self.num_evictable;
        let share = |n: u64| if cap > 0 { n as f64 / cap as f64 } else { 0.0 };
        let usage = share(used);
        let write_usage = share(self.num_write_pending);
        let stores_skipped = self
            .tracker
            .is_some()
            .then(|| std::mem::take(&mut self.stores_skipped));
        TierStats {
            usage,
            write_usage,
            read_usage: (usage - write_usage).max(0.0),
            allocation_sizes: std::mem::take(&mut self.allocation_sizes),
            stores_skipped,
        }
    }

    /// ARC's lists (`None` under LRU).
    #[must_use]
    pub fn arc_lists(&self) -> Option<ArcLists> {
        let Policy::Arc(a) = &self.policy else {
            return None;
        };
        Some(ArcLists {
            target_t1_size: a.target_t1_size,
            t1: a.chunks_of(List::T1).map(|(k, c)| (*k, *c)).collect(),
            t2: a.chunks_of(List::T2).map(|(k, c)| (*k, *c)).collect(),
            b1: a.keys_of(List::B1).copied().collect(),
            b2: a.keys_of(List::B2).copied().collect(),
        })
    }

    /// Sets ARC's adaptive target size of T1 (a warm start, or a test's setup).
    ///
    /// # Errors
    /// `InvalidArgument` under LRU or for a value outside `0..=num_chunks`.
    pub fn set_arc_target_t1_size(&mut self, target: f64) -> Result<()> {
        let cap = self.config.num_chunks as f64;
        let Policy::Arc(a) = &mut self.policy else {
            return Err(invalid(
                "the target size of T1 is ARC's; this tier evicts by LRU",
            ));
        };
        if !(0.0..=cap).contains(&target) {
            return Err(invalid(format!(
                "target_t1_size {target} outside 0..={cap}"
            )));
        }
        a.target_t1_size = target;
        Ok(())
    }

    /// LRU: the evictable chunks in the order they would be evicted (`None`
    /// under ARC).
    #[must_use]
    pub fn lru_eviction_order(&self) -> Option<Vec<OffloadKey>> {
        let Policy::Lru(l) = &self.policy else {
            return None;
        };
        Some(l.eviction_order())
    }

    /// LRU: the eviction heap's entries as they lie, stale ones included
    /// (`((major, minor), key)`); `None` under ARC.
    #[must_use]
    pub fn lru_heap(&self) -> Option<Vec<((u64, i64), OffloadKey)>> {
        let Policy::Lru(l) = &self.policy else {
            return None;
        };
        Some(l.heap_entries())
    }

    /// The admission filter's counts, least recently offered first (`None`
    /// without the filter).
    #[must_use]
    pub fn tracked_offers(&self) -> Option<Vec<(OffloadKey, u64)>> {
        Some(
            self.tracker
                .as_ref()?
                .iter()
                .map(|(k, n)| (*k, *n))
                .collect(),
        )
    }

    /// Every resident chunk (LRU: in no particular order; ARC: T1 then T2).
    #[must_use]
    pub fn resident(&self) -> Vec<(OffloadKey, Chunk)> {
        self.policy.entries().map(|(k, c)| (*k, *c)).collect()
    }
}
