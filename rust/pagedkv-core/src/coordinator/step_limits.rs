//! What a step needs from the coordinator: the decode fast-path checks
//! (`holds_step`, `step_limits`, `lean_step_need`), the blocks to allocate
//! (vLLM's `get_num_blocks_to_allocate`) and the Mamba checkpoints recorded
//! while counting them.

use super::Coordinator;
use crate::pool::{BlockId, NULL_BLOCK};
use crate::request::Request;
use crate::single_type::Need;

impl Coordinator {
    /// The common decode step of a running request (one that holds blocks),
    /// decided without the general path: no group needs a block for
    /// `num_tokens` slots and none has a block to publish up to `to_cache`
    /// tokens (with caching; as far as the request is hashed). Then
    /// the step's new blocks are none and `true` is returned; `false` leaves
    /// the step to the general path, with nothing changed.
    pub(crate) fn decode_step_needs_nothing(
        &mut self,
        req: &Request,
        num_tokens: u64,
        to_cache: usize,
        caching: bool,
    ) -> bool {
        if !self.holds_step(req, num_tokens, None)
            || (caching && !self.fills_no_block(req, to_cache))
        {
            return false;
        }
        for out in &mut self.new_blocks {
            out.clear();
        }
        true
    }

    /// Whether a running request's step of `num_tokens` slots (at least one)
    /// takes no block: every group of a plain decode holds the blocks for them,
    /// without a pending copy-on-write (so the request holds blocks: it runs).
    /// With `cached_to`, every group has also cached each block full at that
    /// many tokens. Reads no hashes: the batch decides its steps with it
    /// before anything is appended (conservatively: a block full but not yet
    /// hashed counts as one to publish).
    #[allow(clippy::inline_always)] // see `KvCacheManager::batch_path`
    #[inline(always)]
    pub(crate) fn holds_step(
        &self,
        req: &Request,
        num_tokens: u64,
        cached_to: Option<u64>,
    ) -> bool {
        let (slots, cached) = req.step_limits();
        if slots != 0 {
            debug_assert_eq!((slots, cached), self.step_limits(req), "stale step limits");
            return num_tokens > 0 && num_tokens <= slots && cached_to.is_none_or(|t| t < cached);
        }
        self.plain_decode
            && num_tokens > 0
            && self.groups.iter().zip(req.groups()).all(|(gm, gb)| {
                gb.partial_hit().is_none()
                    && gm.blocks_ceil(num_tokens) <= gb.blocks().len() as u64
                    && cached_to
                        .is_none_or(|t| gm.blocks_floor(t) <= gb.num_cached().unwrap_or(0) as u64)
            })
    }

    /// What [`Self::holds_step`] decides from, for the request's groups as they
    /// are now: `(slots, cached)`, a step of at most `slots` slots and fewer
    /// than `cached` tokens to cache takes no block and publishes none in any
    /// group; `(0, 0)` when no step is that plain (not a plain decode, a
    /// pending copy-on-write, no blocks). Kept on the request
    /// ([`Request::set_step_limits`]) so a decode step reads none of its
    /// groups' state.
    pub(crate) fn step_limits(&self, req: &Request) -> (u64, u64) {
        if !self.plain_decode || self.groups.is_empty() {
            return (0, 0);
        }
        let mut lim = (u64::MAX, u64::MAX);
        for (gm, gb) in self.groups.iter().zip(req.groups()) {
            if gb.partial_hit().is_some() {
                return (0, 0);
            }
            let bs = u64::from(gm.block_size());
            lim.0 = lim.0.min(gb.blocks().len() as u64 * bs);
            lim.1 = lim.1.min((gb.num_cached().unwrap_or(0) as u64 + 1) * bs);
        }
        if lim.0 == 0 { (0, 0) } else { lim }
    }

    /// The blocks a running request's step of `num_tokens` slots takes across
    /// the groups (what [`Self::num_blocks_to_allocate`] counts for it), for a
    /// request whose step is lean: the layout allows it ([`Self::lean_steps`]),
    /// the request runs in every group and has no pending copy-on-write (its
    /// step limits are known). `None`: the general path decides.
    pub(crate) fn lean_step_need(&self, req: &Request, num_tokens: u64) -> Option<i64> {
        if !self.lean_steps || req.step_limits().0 == 0 {
            return None;
        }
        let mut need = 0;
        for (gm, gb) in self.groups.iter().zip(req.groups()) {
            gb.num_cached()?;
            need += gm
                .blocks_ceil(num_tokens)
                .saturating_sub(gb.blocks().len() as u64) as i64;
        }
        Some(need)
    }

    /// No group has a full block to publish up to `num_tokens` tokens (as far
    /// as the request is hashed) beyond what it has cached.
    pub(super) fn fills_no_block(&self, req: &Request, num_tokens: usize) -> bool {
        let (slots, cached) = req.step_limits();
        if slots != 0 && (num_tokens as u64) < cached {
            return true;
        }
        let hashed = req.hashes().len() * self.hash_block_size;
        self.groups.iter().zip(req.groups()).all(|(gm, gb)| {
            gm.blocks_floor(num_tokens.min(hashed) as u64) as usize <= gb.num_cached().unwrap_or(0)
        })
    }

    /// vLLM's `get_num_blocks_to_allocate`; the flag says a Mamba hit was cached
    /// this very step (a transient refusal, not a capacity problem).
    pub(crate) fn num_blocks_to_allocate(
        &self,
        req: &Request,
        n: &Need,
        hit: &[Vec<BlockId>],
        num_encoder_tokens: u64,
    ) -> (i64, bool) {
        let n = &self.checkpoint_need(n);
        let mut total = 0i64;
        let mut blocked = false;
        for (g, gm) in self.groups.iter().enumerate() {
            let blocks = hit.get(g).map_or(&[][..], Vec::as_slice);
            let need = if gm.is_cross_attention() {
                let enc = Need {
                    num_tokens: num_encoder_tokens,
                    total_computed: 0,
                    num_local: 0,
                    main_model: num_encoder_tokens,
                    prefill_end: 0,
                    cap: n.cap,
                };
                gm.num_blocks_to_allocate(&self.pool, &req.groups()[g], &[], &enc)
            } else {
                gm.num_blocks_to_allocate(&self.pool, &req.groups()[g], blocks, n)
            };
            blocked |= gm.hit_cached_this_step(&self.pool, blocks);
            total += need;
        }
        (total, blocked)
    }

    /// For the can-it-ever-fit check: the blocks the request keeps holding once
    /// skipped blocks are released, and the hit blocks other requests hold (not
    /// counted in the need, but this request's too once admitted).
    pub(crate) fn held_and_shared_hits(
        &self,
        req: &Request,
        hit: &[Vec<BlockId>],
        total_computed: u64,
    ) -> (i64, i64) {
        let mut held = 0i64;
        let mut shared_hits = 0i64;
        for (g, gm) in self.groups.iter().enumerate() {
            let gb = &req.groups()[g];
            let real = gb.blocks().iter().filter(|&&b| b != NULL_BLOCK).count();
            held += (real - gm.num_skippable_blocks(gb, total_computed).min(real)) as i64;
            if let Some(h) = hit.get(g) {
                let skip =
                    (gm.num_skipped_tokens(total_computed) / u64::from(gm.block_size())) as usize;
                shared_hits += h
                    .iter()
                    .skip(skip)
                    .filter(|&&b| b != NULL_BLOCK && !self.pool.is_evictable(b))
                    .count() as i64;
            }
        }
        (held, shared_hits)
    }

    /// Records each Mamba group's prefill checkpoint for this step (vLLM does so
    /// while counting the blocks the step needs).
    pub(crate) fn record_checkpoints(&self, req: &mut Request, n: &Need) {
        let n = &self.checkpoint_need(n);
        for (g, gm) in self.groups.iter().enumerate() {
            gm.record_checkpoint(&mut req.groups_mut()[g], n);
        }
    }

    /// Under dense or interval retention every prefill chunk publishes a state,
    /// so a Mamba checkpoint is reserved on every chunk (`prefill_end` 0); only
    /// with the replay boundary alone does it wait for the prefill's end.
    fn checkpoint_need(&self, n: &Need) -> Need {
        Need {
            prefill_end: if self.retention_interval == Some(0) {
                n.prefill_end
            } else {
                0
            },
            ..*n
        }
    }
}
