//! The tier's invariants: slots, counts, the policy's own structure.

use rustc_hash::FxHashSet;

use super::OffloadTier;
use crate::error::{Error, Result};

impl OffloadTier {
    /// Checks every invariant of the tier.
    ///
    /// # Errors
    /// `InvariantViolation` naming the first violation found.
    pub fn check_invariants(&self) -> Result<()> {
        self.check().map_err(Error::InvariantViolation)
    }

    fn check(&self) -> std::result::Result<(), String> {
        let allocated = self.slots.num_allocated();
        let freed: FxHashSet<u64> = self.slots.freed().iter().copied().collect();
        if freed.len() != self.slots.freed().len() {
            return Err("a slot is on the free list twice".into());
        }
        if let Some(s) = freed.iter().find(|&&s| s >= allocated) {
            return Err(format!("free slot {s} was never handed out"));
        }
        let resident = self.policy.len() as u64;
        if resident + freed.len() as u64 != allocated {
            return Err(format!(
                "{resident} resident + {} free slots != {allocated} handed out",
                freed.len()
            ));
        }
        let (mut idle, mut pending) = (0u64, 0u64);
        let mut seen = FxHashSet::default();
        for (key, chunk) in self.policy.entries() {
            if chunk.ref_cnt < -1 {
                return Err(format!("{key:?} has ref_cnt {}", chunk.ref_cnt));
            }
            idle += u64::from(chunk.ref_cnt == 0);
            pending += u64::from(chunk.ref_cnt == -1);
            if chunk.slot >= allocated || freed.contains(&chunk.slot) || !seen.insert(chunk.slot) {
                return Err(format!(
                    "{key:?} holds slot {} that is not its own",
                    chunk.slot
                ));
            }
        }
        if idle != self.num_evictable || pending != self.num_write_pending {
            return Err(format!(
                "counted {} evictable / {} pending, found {idle} / {pending}",
                self.num_evictable, self.num_write_pending
            ));
        }
        if let Some(t) = &self.tracker
            && t.len() > self.config.max_tracker_size
        {
            return Err(format!(
                "tracker holds {} > {}",
                t.len(),
                self.config.max_tracker_size
            ));
        }
        self.policy.check()
    }
}
