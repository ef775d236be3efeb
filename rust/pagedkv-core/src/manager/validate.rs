//! Argument checks of `allocate_slots` and its batch form: everything is
//! checked before anything changes, so a refused call leaves the manager as
//! it was.

use super::fast_path::BatchPath;
use super::{AllocateArgs, ComputedBlocks, KvCacheManager};
use crate::error::{Error, Result, invalid};
use crate::pool::BlockId;
use crate::single_type::Need;
use crate::spec::{AttentionKind, check_token_counts};

/// An entry of a checked batch that takes the lean path
/// ([`KvCacheManager::batch_path`]); `u64::MAX` marks one taking the general
/// path, any other value the count a step taking the fast path schedules
/// through (at most `max_model_len`).
pub(super) const LEAN_STEP: u64 = u64::MAX - 1;

impl KvCacheManager {
    /// A lookup result applies to this request on this manager, fits the
    /// request's admission and is still cached.
    pub(super) fn validate_hit(
        &self,
        slot: u32,
        hit: &ComputedBlocks,
        num_new_computed: u64,
    ) -> Result<()> {
        let req = self.table.get(slot);
        if hit.manager_uid != self.uid || hit.request_uid != req.uid {
            return Err(Error::StaleComputedBlocks(format!(
                "the computed blocks were not looked up for request {:?} on this manager",
                req.id
            )));
        }
        let groups = self.coord.groups();
        if hit.block_ids.len() != groups.len() {
            return Err(invalid("computed blocks have the wrong number of groups"));
        }
        if req.holds_blocks() && !hit.is_empty() {
            return Err(invalid(format!(
                "request {:?} already holds blocks; a prefix hit only applies at admission",
                req.id
            )));
        }
        for (g, ids) in hit.block_ids.iter().enumerate() {
            if !groups[g].prefix_cacheable() || groups[g].is_mamba() {
                // Never hits; or Mamba, whose own hit may end earlier when a
                // connector supplies the state at the boundary.
                continue;
            }
            let bs = u64::from(groups[g].block_size());
            if (ids.len() as u64) * bs < num_new_computed {
                return Err(invalid(format!(
                    "num_new_computed_tokens {num_new_computed} exceeds the hit of group {g} \
                     ({} blocks of {bs} tokens)",
                    ids.len()
                )));
            }
        }
        if hit.epoch == self.coord.pool().epoch() {
            return Ok(());
        }
        // Blocks were evicted since the lookup: every hit block must still be
        // cached under the request's own hash at its position.
        match self.coord.first_stale_hit_block(req, &hit.block_ids) {
            None => Ok(()),
            Some(b) => Err(Error::StaleComputedBlocks(format!(
                "block {b} of the prefix hit was evicted or reused since \
                 get_computed_blocks; look the request up again"
            ))),
        }
    }

    /// Counts consistent with the request and the blocks it holds.
    pub(super) fn validate_args(&self, slot: u32, a: &AllocateArgs) -> Result<()> {
        self.validate_args_appending(slot, a, 0)
    }

    /// [`Self::validate_args`] for a request that gets `appending` more tokens
    /// before its allocation.
    fn validate_args_appending(&self, slot: u32, a: &AllocateArgs, appending: u64) -> Result<()> {
        let req = self.table.get(slot);
        check_token_counts([
            ("num_new_tokens", a.num_new_tokens),
            ("num_computed_tokens", a.num_computed_tokens),
            ("num_new_computed_tokens", a.num_new_computed_tokens),
            (
                "num_external_computed_tokens",
                a.num_external_computed_tokens,
            ),
            ("num_lookahead_tokens", a.num_lookahead_tokens),
        ])?;
        if a.num_new_tokens == 0
            && a.num_external_computed_tokens == 0
            && a.num_new_computed_tokens == 0
        {
            return Err(invalid(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt",
            ));
        }
        let local = a
            .num_computed_tokens
            .checked_add(a.num_new_computed_tokens)
            .ok_or_else(|| invalid("token counts overflow"))?;
        let total = local
            .checked_add(a.num_external_computed_tokens)
            .ok_or_else(|| invalid("token counts overflow"))?;
        let known = req.num_tokens() as u64 + appending;
        if total > known && !a.vllm_lenient {
            return Err(invalid(format!(
                "num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens \
                 = {total} exceeds the request's {known} tokens"
            )));
        }
        let num_groups = self.coord.groups().len();
        if a.split_at_group.is_some_and(|g| g == 0 || g > num_groups) {
            return Err(invalid(format!(
                "split_at_group must name one of groups 1..={num_groups}"
            )));
        }
        if num_groups < 64 && a.skip_zeroing_groups >> num_groups != 0 {
            return Err(invalid(format!(
                "skip_zeroing_group_ids names a group past the manager's {num_groups}"
            )));
        }
        for x in [
            a.num_new_tokens,
            a.num_lookahead_tokens,
            a.num_encoder_tokens,
            a.reserved_blocks,
            a.num_in_flight_tokens,
            a.engine_managed_blocks,
            a.engine_managed_full_blocks,
        ] {
            if x > (1 << 40) {
                return Err(invalid(format!("count {x} is out of range")));
            }
        }
        for (g, gm) in self.coord.groups().iter().enumerate() {
            if !gm.prefix_cacheable() || a.vllm_lenient {
                continue; // cross attention: its blocks cover encoder tokens
            }
            let have = req.groups()[g].blocks().len() as u64 * u64::from(gm.block_size());
            if a.num_computed_tokens > have {
                return Err(invalid(format!(
                    "num_computed_tokens {} but request {:?} holds blocks for only {have} tokens",
                    a.num_computed_tokens, req.id
                )));
            }
        }
        Ok(())
    }

    /// Refuses a request that can never be scheduled: the blocks it would hold
    /// after this call (fresh blocks plus every prefix-hit block, evictable or
    /// held by others) exceed all usable blocks minus those it keeps holding
    /// once skipped blocks are released. Only called when the need exceeds the
    /// free blocks.
    pub(super) fn check_ever_fits(
        &self,
        slot: u32,
        need: i64,
        hit: &[Vec<BlockId>],
        total_computed: u64,
    ) -> Result<()> {
        let req = self.table.get(slot);
        let (held, shared_hits) = self.coord.held_and_shared_hits(req, hit, total_computed);
        let num_blocks = self.coord.pool().num_blocks();
        let capacity = i64::from(num_blocks) - 1 - held;
        if need + shared_hits > capacity {
            return Err(Error::CannotFit(format!(
                "request {:?} needs {} more blocks but the pool can never give it more \
                 than {capacity} ({} usable blocks, {held} held by the request)",
                req.id,
                need + shared_hits,
                num_blocks - 1
            )));
        }
        Ok(())
    }

    /// Checks one entry of a batch, `[num_new_tokens, num_computed_tokens,
    /// num_lookahead_tokens]` for the request in `slot` with `appending`
    /// tokens (none or one) appended first, before anything changes (`free_at_start`:
    /// the free blocks then; `bound`: the step bound of the last token count
    /// seen, as a decode step repeats one). Returns the count its step
    /// schedules through when it takes the fast path, [`LEAN_STEP`] when it
    /// takes the lean one ([`Self::batch_path`]), `u64::MAX` when it takes the
    /// general one.
    pub(super) fn check_batch_entry(
        &self,
        slot: u32,
        [num_new_tokens, num_computed_tokens, num_lookahead_tokens]: [u64; 3],
        appending: u64,
        free_at_start: i64,
        bound: &mut Option<(u64, i64)>,
    ) -> Result<u64> {
        let max_len = self.cfg.max_model_len;
        match self.batch_path(
            slot,
            num_new_tokens,
            num_computed_tokens,
            num_lookahead_tokens,
            appending,
        ) {
            Some(BatchPath::Plain { scheduled_through }) => return Ok(scheduled_through),
            Some(BatchPath::Lean { need }) => {
                if need > free_at_start {
                    self.check_ever_fits(slot, need, &[], num_computed_tokens.min(max_len))?;
                }
                return Ok(LEAN_STEP);
            }
            None => {}
        }
        let args = AllocateArgs {
            num_lookahead_tokens,
            ..AllocateArgs::step(num_new_tokens, num_computed_tokens)
        };
        if appending != 0 {
            self.check_room(slot, 1)?;
        }
        self.validate_args_appending(slot, &args, appending)?;
        // A step that cannot need more blocks than are free cannot be one
        // that never fits: the exact count is left to the allocation.
        let tokens = num_new_tokens.saturating_add(num_lookahead_tokens);
        let max_blocks = match *bound {
            Some((t, b)) if t == tokens => b,
            _ => {
                let b = self.max_step_blocks(tokens);
                *bound = Some((tokens, b));
                b
            }
        };
        if max_blocks <= free_at_start {
            return Ok(u64::MAX);
        }
        let need_args = Need {
            num_tokens: (num_computed_tokens + num_new_tokens + num_lookahead_tokens).min(max_len),
            total_computed: num_computed_tokens,
            num_local: num_computed_tokens,
            main_model: (num_computed_tokens + num_new_tokens).min(max_len),
            prefill_end: self.table.get(slot).prefill_end_after(appending),
            cap: false,
        };
        let req = self.table.get(slot);
        let (need, blocked) = self.coord.num_blocks_to_allocate(req, &need_args, &[], 0);
        if need > free_at_start && !blocked {
            self.check_ever_fits(slot, need, &[], num_computed_tokens.min(max_len))?;
        }
        Ok(u64::MAX)
    }

    /// An upper bound of the blocks one running request's step of `tokens`
    /// tokens can take across the groups: the blocks the tokens span in each
    /// group (plus one for a partly filled block), a copy-on-write block, a
    /// prefill checkpoint and the speculative state blocks of Mamba groups.
    pub(super) fn max_step_blocks(&self, tokens: u64) -> i64 {
        self.cfg
            .groups
            .iter()
            .map(|g| {
                let spec = match g.kind {
                    AttentionKind::Mamba {
                        num_speculative_blocks,
                        ..
                    } => u64::from(num_speculative_blocks),
                    _ => 0,
                };
                let span = tokens.div_ceil(u64::from(g.block_size.max(1)));
                i64::try_from(span + 3 + spec).unwrap_or(i64::MAX)
            })
            .fold(0i64, i64::saturating_add)
    }
}
