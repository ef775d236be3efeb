//! The fast paths of `allocate_slots`: a running request's decode step that
//! needs no block and publishes none (the decode fast path), and the batch's
//! lean path (a running step of a full-attention or MLA layout that takes
//! blocks or publishes one, made with the group calls without the general
//! checks). Each is decided from the request's counts and the step limits it
//! keeps; when one does not decide a step, nothing changed and the general path
//! (`allocate_general` in `manager.rs`, vLLM's stages) makes it.

use super::{AllocateArgs, ComputedBlocks, KvCacheManager};
use crate::error::Result;

impl AllocateArgs {
    /// [`Self::is_plain_step`], caching delayed or not: a step the decode fast
    /// path serves publishes no block, so delaying its caching changes nothing.
    pub(super) fn is_plain_step_if_caching(&self) -> bool {
        self.num_new_computed_tokens == 0
            && self.num_external_computed_tokens == 0
            && self.num_encoder_tokens == 0
            && !self.full_sequence_must_fit
            && self.reserved_blocks == 0
            && self.num_in_flight_tokens == 0
            && self.engine_managed_blocks == 0
            && self.split_at_group.is_none()
    }

    /// The arguments of a batch entry's step: [`Self::step`]'s with a
    /// lookahead, nothing else set.
    pub(super) fn is_batch_step(&self) -> bool {
        *self
            == Self {
                num_lookahead_tokens: self.num_lookahead_tokens,
                ..Self::step(self.num_new_tokens, self.num_computed_tokens)
            }
    }
}

impl KvCacheManager {
    /// A running request's step with a batch entry's arguments, made as the
    /// batch makes it when its counts and step limits decide it (a step that
    /// takes nothing, or a lean one: [`Self::batch_path`], which checks what
    /// `validate_args` would of such a step without reading the request's
    /// groups): `true`, done. `false`: nothing changed (the step needs the
    /// full checks and the general path, or a lean one more blocks than are
    /// free).
    pub(super) fn running_step(&mut self, slot: u32, a: &AllocateArgs) -> bool {
        let step = [
            a.num_new_tokens,
            a.num_computed_tokens,
            a.num_lookahead_tokens,
        ];
        match self.batch_path(slot, step[0], step[1], step[2], 0) {
            Some(BatchPath::Plain { .. }) => self.decode_step_needs_nothing(slot, step),
            Some(BatchPath::Lean { .. }) => self.allocate_lean(slot, step),
            None => false,
        }
    }

    /// A validated decode step of a running request that takes no block and
    /// publishes none (most steps), `step` being `[num_new_tokens,
    /// num_computed_tokens, num_lookahead_tokens]`: its counts recorded as
    /// `allocate_validated` records them, and `true`. `false`: nothing
    /// changed, the general path decides.
    pub(super) fn decode_step_needs_nothing(&mut self, slot: u32, step: [u64; 3]) -> bool {
        let caching = self.cfg.enable_caching;
        let req = self.table.get(slot);
        if !req.admitted {
            return false;
        }
        let s = self.step_counts(req.num_tokens() as u64, step);
        if !self
            .coord
            .decode_step_needs_nothing(req, s.need_slot, s.to_cache as usize, caching)
        {
            return false;
        }
        let req = self.table.get_mut(slot);
        req.num_computed_at_step = step[1];
        req.scheduled_through = s.main_model;
        true
    }

    /// A running request's step counts (`allocate_general`'s, without a hit
    /// or external tokens), for a request of `num_tokens` tokens and a step of
    /// `[num_new_tokens, num_computed_tokens, num_lookahead_tokens]`.
    fn step_counts(
        &self,
        num_tokens: u64,
        [num_new_tokens, num_computed_tokens, num_lookahead_tokens]: [u64; 3],
    ) -> StepCounts {
        let max_len = self.cfg.max_model_len;
        let total_computed = num_computed_tokens.min(max_len);
        let main_model = (total_computed + num_new_tokens).min(max_len);
        StepCounts {
            main_model,
            need_slot: (main_model + num_lookahead_tokens).min(max_len),
            to_cache: (total_computed + num_new_tokens).min(num_tokens),
        }
    }

    /// How the batch makes a running request's step, decided for every entry
    /// before anything changes, given `appending` (0 or 1) tokens appended
    /// first: [`BatchPath::Plain`] for a step the full checks would accept
    /// that needs no block and publishes none (recorded by setting the two
    /// counts, as [`Self::decode_step_needs_nothing`] does), [`BatchPath::Lean`]
    /// for one the full checks would accept whose layout and state make it
    /// lean ([`Coordinator::lean_step_need`](crate::coordinator::Coordinator::lean_step_need): it takes `need` blocks, none when
    /// it only publishes one; [`Self::allocate_lean`] makes it), `None` for
    /// the full checks and the general path. (Holding the blocks for the
    /// step's slots, at least one past the computed tokens or all
    /// `max_model_len`, covers the computed tokens too.)
    // Inlined into both callers (the batch check and a single running
    // step), with `allocate_lean` and `Coordinator::holds_step`: once a
    // second caller made the compiler keep them out of line, a 100-request
    // batch call took longer (docs/perf-log.md).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(super) fn batch_path(
        &self,
        slot: u32,
        num_new_tokens: u64,
        num_computed_tokens: u64,
        num_lookahead_tokens: u64,
        appending: u64,
    ) -> Option<BatchPath> {
        const LIMIT: u64 = 1 << 40;
        let req = self.table.get(slot);
        let known = req.num_tokens() as u64 + appending;
        // What `validate_args` checks of a step with only these counts.
        if !req.admitted
            || num_new_tokens == 0
            || num_new_tokens > LIMIT
            || num_lookahead_tokens > LIMIT
            || num_computed_tokens > known
            || known > self.cfg.max_model_len
        {
            return None;
        }
        let s = self.step_counts(
            known,
            [num_new_tokens, num_computed_tokens, num_lookahead_tokens],
        );
        let cached_to = self.cfg.enable_caching.then_some(s.to_cache);
        if self.coord.holds_step(req, s.need_slot, cached_to) {
            return Some(BatchPath::Plain {
                scheduled_through: s.main_model,
            });
        }
        // `validate_args` refuses a request holding blocks for fewer tokens
        // than it computed.
        if num_computed_tokens > req.step_limits().0 {
            return None;
        }
        self.coord
            .lean_step_need(req, s.need_slot)
            .map(|need| BatchPath::Lean { need })
    }

    /// A step [`Self::batch_path`] found lean (before the tokens were appended):
    /// what `allocate_general` does for it, without its checks and counting.
    /// `false`: fewer blocks are free than it takes, nothing changed (the
    /// general path then decides). `step` as for
    /// [`Self::decode_step_needs_nothing`].
    #[allow(clippy::inline_always)] // as `batch_path`
    #[inline(always)]
    pub(super) fn allocate_lean(&mut self, slot: u32, step: [u64; 3]) -> bool {
        let num_computed_tokens = step[1];
        let req = self.table.get(slot);
        let s = self.step_counts(req.num_tokens() as u64, step);
        let need = self.coord.lean_step_need(req, s.need_slot);
        debug_assert!(need.is_some(), "a lean step stays lean until it is made");
        if need.is_none_or(|n| n > i64::from(self.num_free_blocks())) {
            return false;
        }
        let req = self.table.get_mut(slot);
        req.num_computed_at_step = num_computed_tokens;
        self.coord
            .allocate_new_blocks_in(req, s.need_slot, s.main_model, 0, 0..usize::MAX);
        req.scheduled_through = s.main_model;
        if self.cfg.enable_caching {
            self.coord
                .cache_blocks(req, s.to_cache as usize, num_computed_tokens);
        }
        req.set_step_limits(self.coord.step_limits(req));
        true
    }

    /// `allocate_slots` once the arguments were validated.
    pub(super) fn allocate_validated(
        &mut self,
        slot: u32,
        a: &AllocateArgs,
        hit: Option<&ComputedBlocks>,
    ) -> Result<bool> {
        if hit.is_none()
            && a.is_plain_step_if_caching()
            && self.decode_step_needs_nothing(
                slot,
                [
                    a.num_new_tokens,
                    a.num_computed_tokens,
                    a.num_lookahead_tokens,
                ],
            )
        {
            return Ok(true);
        }
        self.allocate_general(slot, a, hit)
    }
}

/// How the batch call makes a running request's step
/// ([`KvCacheManager::batch_path`]).
#[derive(Clone, Copy, Debug)]
pub(super) enum BatchPath {
    /// It needs no block and publishes none: only its counts are recorded.
    Plain { scheduled_through: u64 },
    /// It takes `need` blocks or publishes one, in a layout that allows the
    /// lean path ([`KvCacheManager::allocate_lean`]).
    Lean { need: i64 },
}

/// A running request's step, as [`KvCacheManager::step_counts`] gives it.
struct StepCounts {
    /// Tokens the step schedules through (the request's `scheduled_through`).
    main_model: u64,
    /// Slots the step needs (lookahead included).
    need_slot: u64,
    /// Tokens whose full blocks the step publishes.
    to_cache: u64,
}
