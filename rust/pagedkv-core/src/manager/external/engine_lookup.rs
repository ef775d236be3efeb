//! An engine's read-outs and answers: hits named by block ids
//! (`computed_blocks_from_ids`), cached counts and tokens of a request, blocks
//! to allocate without a hit (`num_blocks_to_allocate`) and the prefix-cache
//! stats its scheduler records.

use crate::error::{Error, Result, invalid};
use crate::manager::{ComputedBlocks, KvCacheManager};
use crate::pool::{BlockId, NULL_BLOCK};
use crate::request::{GroupBlocks, Request, RequestSpec};
use crate::single_type::Need;
use crate::spec::{MAX_TOKENS, check_token_counts};
use crate::stats::PrefixCacheStats;

impl KvCacheManager {
    /// Leading blocks of the request already cached, per group (`None` in a
    /// group the request has not run in yet: vLLM's `num_cached_block` entry).
    ///
    /// # Errors
    /// Unknown request.
    pub fn num_cached_blocks(&self, id: &str) -> Result<Vec<Option<usize>>> {
        let req = self.table.get(self.table.slot(id)?);
        Ok(req.groups().iter().map(GroupBlocks::num_cached).collect())
    }

    /// vLLM's `estimate_cached_tokens`: over the prefix-cacheable groups, the
    /// fewest of (the most prefix tokens any of the request's blocks is cached
    /// for) in each group; 0 when none.
    ///
    /// # Errors
    /// Unknown request.
    pub fn estimate_cached_tokens(&self, id: &str) -> Result<u64> {
        let req = self.table.get(self.table.slot(id)?);
        let pool = self.coord.pool();
        let per_group = self
            .coord
            .groups()
            .iter()
            .zip(req.groups())
            .filter(|(gm, _)| gm.prefix_cacheable())
            .map(|(_, gb)| {
                gb.blocks()
                    .iter()
                    .filter(|&&b| b != NULL_BLOCK)
                    .filter_map(|&b| pool.primary_tokens(b))
                    .max()
                    .unwrap_or(0)
            });
        Ok(per_group.min().map_or(0, u64::from))
    }

    /// A prefix hit named by block ids per group (what an engine hands back
    /// from an earlier lookup). With `check_cached`, every block must be cached
    /// under the request's own hash at its position; without, the engine
    /// vouches for them (vLLM adopts whatever blocks its caller passes, e.g. a
    /// connector's freshly taken blocks), and each block only has to exist.
    ///
    /// # Errors
    /// Unknown request; a block out of range, or (checked) not the request's
    /// cached block there; the wrong number of groups.
    pub fn computed_blocks_from_ids(
        &self,
        id: &str,
        block_ids: Vec<Vec<BlockId>>,
        num_computed_tokens: u64,
        check_cached: bool,
    ) -> Result<ComputedBlocks> {
        let slot = self.table.slot(id)?;
        let req = self.table.get(slot);
        if num_computed_tokens > req.num_tokens() as u64 {
            return Err(invalid(format!(
                "num_computed_tokens {num_computed_tokens} exceeds the request's {} tokens",
                req.num_tokens()
            )));
        }
        if block_ids.len() != self.num_groups() {
            return Err(invalid(format!(
                "computed blocks name {} groups; the manager has {}",
                block_ids.len(),
                self.num_groups()
            )));
        }
        let n = self.coord.pool().num_blocks();
        if let Some(&b) = block_ids.iter().flatten().find(|&&b| b >= n) {
            return Err(invalid(format!("block id {b} is out of range (0..{n})")));
        }
        if let Some(b) = check_cached
            .then(|| self.coord.first_stale_hit_block(req, &block_ids))
            .flatten()
        {
            return Err(Error::StaleComputedBlocks(format!(
                "block {b} is not the request's cached block at its position"
            )));
        }
        Ok(ComputedBlocks {
            block_ids,
            num_computed_tokens,
            shared_prefix_boundary: 0,
            num_host_tokens: 0,
            request_uid: req.uid,
            manager_uid: self.uid,
            epoch: self.coord.pool().epoch(),
        })
    }

    /// Records one admitted request's lookup (vLLM 0.33's scheduler calls this
    /// itself; see `record_stats_at_admission`). No-op with stats off.
    ///
    /// # Errors
    /// More hits than tokens, or a count past `2**40`.
    pub fn record_prefix_cache_stats(
        &mut self,
        num_tokens: u64,
        num_hits: u64,
        preempted: bool,
    ) -> Result<()> {
        if num_tokens > MAX_TOKENS || num_hits > num_tokens {
            return Err(invalid(format!(
                "{num_hits} hits of {num_tokens} tokens is not a lookup (at most 2**40 tokens)"
            )));
        }
        if let Some(s) = self.stats.as_mut() {
            s.record(num_tokens, num_hits, preempted);
        }
        Ok(())
    }

    /// The stats gathered since the last [`Self::make_prefix_cache_stats`],
    /// without resetting them; `None` with stats off.
    #[must_use]
    pub fn prefix_cache_stats(&self) -> Option<&PrefixCacheStats> {
        self.stats.as_ref()
    }
    /// vLLM's `coordinator.get_num_blocks_to_allocate` without a new hit: the
    /// blocks the request (or, for `None`, a request holding none) needs to
    /// hold `num_tokens` tokens after `total_computed` computed ones, of which
    /// `num_local` were computed locally (the rest a connector imports; HiSparse
    /// groups count those apart; `None`: all of them). `apply_admission_cap` caps sliding-window,
    /// chunked-local and HiSparse resident groups at the in-flight admission
    /// bound, as vLLM's admission gate does.
    ///
    /// # Errors
    /// Unknown request; `num_local` past `total_computed`.
    pub fn num_blocks_to_allocate(
        &self,
        id: Option<&str>,
        num_tokens: u64,
        (total_computed, num_local): (u64, Option<u64>),
        num_tokens_main_model: u64,
        num_encoder_tokens: u64,
        apply_admission_cap: bool,
    ) -> Result<u64> {
        check_token_counts([
            ("num_tokens", num_tokens),
            ("total_computed_tokens", total_computed),
            ("num_tokens_main_model", num_tokens_main_model),
            ("num_encoder_tokens", num_encoder_tokens),
        ])?;
        let num_local = num_local.unwrap_or(total_computed);
        if num_local > total_computed {
            return Err(invalid(format!(
                "{num_local} locally computed tokens of only {total_computed} computed"
            )));
        }
        let max_len = self.cfg.max_model_len;
        let need = Need {
            num_tokens: num_tokens.min(max_len),
            total_computed: total_computed.min(max_len),
            num_local: num_local.min(max_len),
            main_model: num_tokens_main_model.min(max_len),
            prefill_end: 0,
            cap: apply_admission_cap,
        };
        let blank;
        let req = if let Some(id) = id {
            self.table.get(self.table.slot(id)?)
        } else {
            blank = Request::new(
                String::new(),
                0,
                RequestSpec::default(),
                self.num_groups(),
                self.hash_block_size,
                false,
            )?;
            &blank
        };
        let (n, _) = self
            .coord
            .num_blocks_to_allocate(req, &need, &[], num_encoder_tokens);
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
