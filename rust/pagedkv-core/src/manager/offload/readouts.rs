//! The host tier's readouts on the manager: totals, jobs in flight, events,
//! the reset and the invariants covering the tier and its copies.

use super::{DiskSide, OffloadStats, WriteBack};
use crate::error::{Error, Result};
use crate::manager::KvCacheManager;
use crate::offload::OffloadEvent;

impl KvCacheManager {
    /// The host tier's totals (`None` without one).
    #[must_use]
    pub fn offload_stats(&self) -> Option<OffloadStats> {
        self.offload.as_ref().map(|o| o.stats)
    }

    /// Freed chunks waiting to be written back (0 unless write-back).
    #[must_use]
    pub fn num_write_back_candidates(&self) -> usize {
        self.offload
            .as_ref()
            .and_then(|o| o.write_back.as_ref())
            .map_or(0, WriteBack::len)
    }

    /// Jobs planned or taken and not completed.
    #[must_use]
    pub fn num_transfers_in_flight(&self) -> usize {
        self.offload.as_ref().map_or(0, |o| {
            o.jobs.len() + o.disk.as_ref().map_or(0, DiskSide::num_jobs)
        })
    }

    /// The host tier's events since the last call (medium `CPU`).
    pub fn take_offload_events(&mut self) -> Vec<OffloadEvent> {
        self.offload.as_mut().map_or_else(Vec::new, |o| {
            let mut events = o.tier.take_events();
            if let Some(d) = o.disk.as_mut() {
                events.extend(d.tier.take_events());
            }
            events
        })
    }

    /// Empties the host tier; `false` (and no change) while transfers are in
    /// flight or without a tier.
    pub fn reset_offload(&mut self) -> bool {
        match self.offload.as_deref_mut() {
            Some(off)
                if off.jobs.is_empty() && off.disk.as_ref().is_none_or(|d| d.num_jobs() == 0) =>
            {
                off.tier.reset_cache();
                for s in off.reqs.values_mut() {
                    s.next_chunk = 0;
                }
                let uids: Vec<u64> = off.reqs.keys().copied().collect();
                for uid in uids {
                    off.tier.on_new_request(uid);
                }
                true
            }
            _ => false,
        }
    }

    /// The host tier's own invariants, and every job's blocks held.
    pub(in crate::manager) fn check_offload(&self) -> Result<()> {
        let Some(off) = self.offload.as_deref() else {
            return Ok(());
        };
        off.tier.check_invariants()?;
        if let Some(wb) = &off.write_back {
            wb.check(self.coord.pool().num_blocks())?;
        }
        off.check_disk()?;
        let pending_loads = off.jobs.values().filter(|j| !j.taken).count();
        if pending_loads != off.planned_loads.len() {
            return Err(Error::InvariantViolation(format!(
                "{pending_loads} loads not taken, {} planned",
                off.planned_loads.len()
            )));
        }
        let held: usize = off
            .jobs
            .values()
            .flat_map(|j| &j.groups)
            .map(|(_, d, _)| d.len())
            .sum();
        if (held as u64) > self.num_detached_block_refs() {
            return Err(Error::InvariantViolation(format!(
                "transfers hold {held} device blocks, the engine {}",
                self.num_detached_block_refs()
            )));
        }
        Ok(())
    }
}
