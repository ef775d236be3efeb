//! The manager's own read-outs beside vLLM's: hash-memo and verification
//! counts, events and block activity dropped or pending, the block activity
//! log, and `check_invariants` over the request table and the pool.

use super::KvCacheManager;
use crate::error::{Error, Result};

impl KvCacheManager {
    /// Prompt blocks whose hashes were found instead of computed (answered
    /// by the hash memo, or taken from a live request the prompt begins like)
    /// and prompt blocks the memo was asked for and hashed: in place, on the
    /// hash worker and in the manager's preparers (`(0, 0)` with the memo
    /// off).
    #[must_use]
    pub fn hash_memo_counts(&self) -> (u64, u64) {
        let (found, hashed) = self.hasher.memo_counts();
        (found + self.shared_hash_blocks, hashed)
    }

    /// Prefix hits cut short by `verify_cached_tokens` (a cached block whose
    /// tokens or context did not match the request: a hash collision).
    #[must_use]
    pub fn verification_failures(&self) -> u64 {
        self.coord.verification_failures()
    }

    /// KV events recorded and not yet drained.
    #[must_use]
    pub fn num_pending_events(&self) -> usize {
        self.coord.pool().num_pending_events()
    }

    /// KV events dropped, oldest first, because the queue reached
    /// `max_pending_events` undrained.
    #[must_use]
    pub fn num_dropped_events(&self) -> u64 {
        self.coord.pool().num_dropped_events()
    }

    /// Block activity entries dropped, oldest first, because the log reached
    /// `max_pending_block_activity` undrained.
    #[must_use]
    pub fn num_dropped_block_activity(&self) -> u64 {
        self.coord.pool().num_dropped_block_activity()
    }

    /// Drains the pool's block activity log (`kv_cache_metrics`; empty otherwise).
    pub fn take_block_activity(&mut self) -> Vec<crate::pool::BlockActivity> {
        self.coord.pool_mut().take_block_activity()
    }

    /// Checks every invariant of the pool and the request table.
    ///
    /// # Errors
    /// [`Error::InvariantViolation`] describing the first violation.
    pub fn check_invariants(&self) -> Result<()> {
        let n = self.coord.pool().num_blocks() as usize;
        let mut refs = vec![0u32; n];
        let mut owner_group = vec![u32::MAX; n];
        let mut admitted = 0usize;
        let mut live = 0usize;
        for req in self.table.iter() {
            live += 1;
            admitted += usize::from(req.admitted);
            self.coord.check_request(req, &mut refs, &mut owner_group)?;
        }
        self.check_resident_pages(&refs)?;
        for (b, n) in self.coord.pool().engine_refs() {
            refs[b as usize] += n;
        }
        for b in self.coord.pending_cow_refs() {
            refs[b as usize] += 1;
        }
        if admitted != self.num_admitted {
            return Err(Error::InvariantViolation(
                "admitted-request count is off".into(),
            ));
        }
        if self.table.len() != live {
            return Err(Error::InvariantViolation(
                "request index is out of sync".into(),
            ));
        }
        self.coord.pool().check_invariants(Some(&refs))?;
        self.check_offload()
    }
}
