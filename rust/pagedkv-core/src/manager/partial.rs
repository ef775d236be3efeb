//! Fine-grained (partial) prefix hits and Mamba prefill checkpoints, as vLLM
//! 0.33 runs them in hybrid models: the copy-on-write pairs a step queued, the
//! per-request state an engine inspects, and the sparse-retention interval.

use super::KvCacheManager;
use crate::error::{Error, Result, invalid};
use crate::pool::{BlockId, NULL_BLOCK};
use crate::spec::MAX_TOKENS;

impl KvCacheManager {
    /// Drains the block copies the last steps queued, `(source, copy)`: a
    /// prefix hit ending inside a block continues in a private copy of it, and
    /// a running Mamba request that registered its own boundary inside its
    /// state block keeps the cache entry in a copy. Both endpoints stay
    /// referenced until the copy has run: those references are detached here
    /// and go back with [`Self::free_blocks`] (vLLM's
    /// `take_kv_cache_block_copies` and its retained blocks).
    pub fn take_block_copies(&mut self) -> Vec<(BlockId, BlockId)> {
        let pairs = self.coord.take_pending_cow();
        for &(src, dst) in &pairs {
            for b in [src, dst] {
                if b != NULL_BLOCK {
                    self.coord.pool_mut().engine_hold(b);
                }
            }
        }
        pairs
    }

    /// The blocks the queued copies hold a reference on until
    /// [`Self::take_block_copies`] hands them out (both endpoints of each),
    /// in queue order.
    #[must_use]
    pub fn pending_copy_blocks(&self) -> Vec<BlockId> {
        self.coord.pending_cow_refs().collect()
    }

    /// Drains the committed Mamba boundary states offered since the last call,
    /// `(request id, group, block, boundary tokens)`: every retained state a
    /// step cached, and the private copy of a request's own boundary inside its
    /// running block. The blocks hold no extra reference (vLLM's
    /// `take_boundary_state_offloads`).
    pub fn take_boundary_state_offloads(&mut self) -> Vec<(String, u32, BlockId, u64)> {
        self.coord.take_boundary_offloads()
    }

    /// vLLM's `finalize_partial_tail_offloads` for a finishing request: the
    /// boundaries it registered inside its running state blocks, `(group,
    /// block, tokens)`, when nothing was forwarded past them.
    ///
    /// # Errors
    /// Unknown request, or a count past 2**40.
    pub fn finalize_partial_tail_offloads(
        &mut self,
        id: &str,
        num_computed_tokens: u64,
        num_in_flight_tokens: u64,
    ) -> Result<Vec<(u32, BlockId, u64)>> {
        if let Some(n) = [num_computed_tokens, num_in_flight_tokens]
            .into_iter()
            .find(|&n| n > MAX_TOKENS)
        {
            return Err(invalid(format!(
                "count {n} is out of range (at most 2**40)"
            )));
        }
        let slot = self.table.slot(id)?;
        let req = self.table.get_mut(slot);
        Ok(self
            .coord
            .finalize_partial_tails(req, num_computed_tokens, num_in_flight_tokens))
    }

    /// With several groups and prefix caching on: the groups whose hits are
    /// looked up together (equal specs), in lookup order (full attention
    /// first), each with whether EAGLE's drop applies (vLLM's hybrid
    /// coordinator's `attention_groups`). Groups that never hit are in none.
    #[must_use]
    pub fn lookup_groups(&self) -> Option<Vec<(Vec<u32>, bool)>> {
        self.coord.lookup_groups()
    }

    /// Whether fine-grained (partial) prefix hits are on
    /// ([`crate::ManagerConfig::partial_hash_hits_enabled`]).
    #[must_use]
    pub fn partial_hash_hits(&self) -> bool {
        self.coord.partial_hits()
    }

    /// Whether Mamba groups register shared-prefix junction states (vLLM's
    /// `mamba_shared_prefix_checkpoint`: asked for, an EAGLE model, partial
    /// hits on, no prefill lookahead).
    #[must_use]
    pub fn mamba_shared_prefix_checkpoint(&self) -> bool {
        self.coord.shared_prefix_checkpoint()
    }

    /// The request's pending copy-on-write in group `g`: `(index, shared
    /// block)` of a hit that ends inside that block.
    ///
    /// # Errors
    /// Unknown request or group.
    pub fn partial_hit(&self, id: &str, g: usize) -> Result<Option<(usize, BlockId)>> {
        Ok(self.group_blocks(id, g)?.partial_hit())
    }

    /// The prefill checkpoint the request's last allocation reserved in Mamba
    /// group `g`: `(position in tokens, block column)`.
    ///
    /// # Errors
    /// Unknown request or group.
    pub fn mamba_checkpoint(&self, id: &str, g: usize) -> Result<Option<(u64, usize)>> {
        Ok(self.group_blocks(id, g)?.checkpoint())
    }

    fn group_blocks(&self, id: &str, g: usize) -> Result<&crate::request::GroupBlocks> {
        let r = self.req(id)?;
        r.groups().get(g).ok_or_else(|| {
            invalid(format!(
                "group {g} is out of range (the model has {})",
                r.groups().len()
            ))
        })
    }

    /// The sparse-retention interval of sliding-window and Mamba groups.
    #[must_use]
    pub fn prefix_cache_retention_interval(&self) -> Option<u64> {
        self.coord.retention_interval()
    }

    /// Changes the sparse-retention interval for later caching (vLLM's
    /// coordinator attribute), validated as the configuration option is.
    ///
    /// # Errors
    /// An interval that is not a multiple of the scheduler block size, or
    /// non-zero for a model without sliding-window or Mamba groups.
    pub fn set_prefix_cache_retention_interval(&mut self, interval: Option<u64>) -> Result<()> {
        let mut cfg = self.cfg.clone();
        cfg.prefix_cache_retention_interval = interval;
        cfg.validate().map_err(|e| match e {
            Error::InvalidConfig(m) => invalid(m),
            other => other,
        })?;
        self.cfg.prefix_cache_retention_interval = interval;
        self.coord.set_retention_interval(interval);
        Ok(())
    }
}
