//! The coordinator's caching: publishing a request's full blocks and partial
//! prompt tails (vLLM's `cache_blocks`), blocks an engine filled, and the
//! `BlockStored` events built for them.

use super::{Coordinator, Mode};
use crate::events::{BlockStored, KvEvent};
use crate::pool::{BlockId, CacheKey, NULL_BLOCK};
use crate::request::Request;
use crate::single_type::{GroupManager, Retention};

impl Coordinator {
    /// Publishes the request's full blocks covering `num_tokens` into the prefix
    /// cache, with their `BlockStored` events and provenance records.
    pub(crate) fn cache_blocks(&mut self, req: &mut Request, num_tokens: usize, num_computed: u64) {
        let hbs = self.hash_block_size;
        let hybrid = matches!(self.mode, Mode::Hybrid { .. });
        let cacheable = Cacheable {
            hybrid,
            partial_hits: self.partial_hits,
            sbs: self.scheduler_block_size as usize,
            reprefillable: self.reprefillable as usize,
        };
        // Most decode steps fill no block: nothing new to publish in any group.
        if !hybrid && self.fills_no_block(req, num_tokens) {
            return;
        }
        let (boundaries, nb) = replay_boundaries(
            req.num_prompt_tokens as u64,
            self.scheduler_block_size,
            self.use_eagle,
        );
        let retention = Retention {
            interval: self.retention_interval,
            boundaries: &boundaries[..nb],
        };
        for (g, gm) in self.groups.iter_mut().enumerate() {
            let cached_before = req.groups()[g].num_cached().unwrap_or(0);
            let n = cacheable.tokens(gm, num_tokens);
            let published = gm.cache_blocks(&mut self.pool, req, g, n, hbs, &retention);
            if let Some((from, to, mask)) = &published
                && self.pool.events_enabled()
            {
                let blocks = req.groups()[g].blocks();
                let ev = stored_event(
                    gm,
                    req,
                    g,
                    blocks,
                    (*from, *to),
                    mask.as_deref(),
                    self.lookahead,
                );
                self.pool.push_event(KvEvent::BlockStored(ev));
            }
            // Partial prompt-tail entries exist where vLLM allows a hash block
            // below the group block size: hybrid models. (A single group with a
            // finer hash is pagedkv's extension; it caches whole blocks only.)
            let partial = if !hybrid {
                None
            } else if gm.spec().kind.is_full_attention() {
                gm.cache_partial_tail(&mut self.pool, req, g, n, hbs)
            } else {
                gm.cache_mamba_partial_tail(
                    &mut self.pool,
                    req,
                    g,
                    n as u64,
                    self.retention_interval,
                    num_computed,
                )
                .map(|b| b as usize)
            };
            if let Some(boundary) = partial
                && self.pool.events_enabled()
            {
                let ev = partial_stored_event(req, g, boundary, hbs, self.lookahead);
                self.pool.push_event(KvEvent::BlockStored(ev));
            }
            if let Some((from, to, _)) = published {
                gm.offer_boundary_states(&self.pool, req, g, from..to);
            }
            if req.verify {
                let bs = gm.block_size() as usize;
                let cached_after = req.groups()[g].num_cached().unwrap_or(0);
                // The block before may have been cached partially (a prompt
                // tail); the one after may carry a partial entry now.
                let from = cached_before.saturating_sub(1);
                let to = (cached_after + 1).min(req.groups()[g].blocks().len());
                for i in from..to {
                    self.verifier.record(&self.pool, req, g, i, bs, hbs);
                }
            }
        }
    }

    /// Caches blocks `[from, to)` of `blocks` (those `mask` keeps), the
    /// request's blocks in group `g` held outside it (an engine filled them),
    /// under the request's hashes, as vLLM's `BlockPool.cache_full_blocks`:
    /// one `BlockStored` for the run. The caller checked the range, the mask,
    /// the hashes and the blocks.
    pub(crate) fn cache_blocks_held_outside(
        &mut self,
        req: &Request,
        g: usize,
        blocks: &[BlockId],
        (from, to): (usize, usize),
        mask: Option<&[bool]>,
    ) {
        let gm = &self.groups[g];
        let bs = gm.block_size() as usize;
        for (i, &b) in blocks.iter().enumerate().take(to).skip(from) {
            if mask.is_some_and(|m| !m[i - from]) {
                continue;
            }
            if let Some(key) = gm.key_for(req.hashes(), i) {
                self.pool.cache_full_block(b, key, ((i + 1) * bs) as u32);
            }
        }
        if self.pool.events_enabled() {
            let ev = stored_event(gm, req, g, blocks, (from, to), mask, self.lookahead);
            self.pool.push_event(KvEvent::BlockStored(ev));
        }
    }

    /// Makes `block`, held outside the request (an engine filled it), reachable
    /// from the prefix boundary of `boundary` tokens of the request in group
    /// `g` (a partial entry, vLLM's `BlockPool.cache_partial_block`); with
    /// `replace`, the block's entries are dropped first. A new entry gets its
    /// `BlockStored`. The caller checked the boundary and the block.
    pub(crate) fn cache_partial_held_outside(
        &mut self,
        req: &Request,
        g: usize,
        block: BlockId,
        boundary: usize,
        replace: bool,
    ) -> CacheKey {
        let hbs = self.hash_block_size;
        let key = CacheKey {
            hash: req.hashes()[boundary / hbs - 1],
            group: self.groups[g].group_id(),
        };
        if replace {
            self.pool.maybe_evict(block);
        }
        if self.pool.cache_partial_block(block, key, boundary as u32) && self.pool.events_enabled()
        {
            let ev = partial_stored_event(req, g, boundary, hbs, self.lookahead);
            self.pool.push_event(KvEvent::BlockStored(ev));
        }
        key
    }

    /// Drains the pool's KV events, annotated with each group's spec kind.
    pub(crate) fn take_events(&mut self) -> Vec<KvEvent> {
        let mut evs = self.pool.take_events();
        for ev in &mut evs {
            if let KvEvent::BlockStored(s) = ev
                && let Some(gm) = self.groups.get(s.group_idx as usize)
            {
                s.kv_cache_spec_kind = Some(gm.spec().kind.spec_kind());
                s.kv_cache_spec_sliding_window = gm.spec().kind.sliding_window();
            }
        }
        evs
    }
}

/// vLLM's `get_num_cacheable_tokens`: the prefix of a step's tokens a group may
/// cache. Tokens that may be prefilled again never are; in a hybrid model
/// nothing past the last aligned boundary can ever be hit (EAGLE groups keep one
/// block past it; partial hits need no rounding).
struct Cacheable {
    hybrid: bool,
    partial_hits: bool,
    sbs: usize,
    reprefillable: usize,
}

impl Cacheable {
    fn tokens(&self, gm: &GroupManager, num_tokens: usize) -> usize {
        let finalized = num_tokens.saturating_sub(self.reprefillable);
        if !self.hybrid {
            return finalized;
        }
        let align = |n: usize| {
            if self.partial_hits {
                n
            } else {
                n / self.sbs * self.sbs
            }
        };
        let aligned = align(num_tokens);
        if gm.use_eagle() && aligned > 0 {
            finalized.min(align(finalized) + gm.block_size() as usize)
        } else {
            aligned
        }
    }
}

/// Tokens a later request replaying this prompt can resume at (vLLM's
/// `replay_boundaries`): the resend cap `P - 1`, or with EAGLE the aligned
/// positions one block below the resend and the extension. Returns the
/// positions and how many of the two slots are used.
fn replay_boundaries(num_prompt_tokens: u64, sbs: u64, use_eagle: bool) -> ([u64; 2], usize) {
    if !use_eagle {
        return ([num_prompt_tokens.saturating_sub(1), 0], 1);
    }
    let resend = num_prompt_tokens.saturating_sub(1) / sbs * sbs;
    let extension = num_prompt_tokens / sbs * sbs;
    let (a, b) = (resend.saturating_sub(sbs), extension.saturating_sub(sbs));
    if a == b {
        ([a, 0], 1)
    } else {
        ([a.min(b), a.max(b)], 2)
    }
}

/// The `lookahead` tokens after position `end` that a block's hash covers.
fn lookahead_tokens(req: &Request, end: usize, lookahead: usize) -> Vec<u32> {
    let n = req.tokens().len();
    req.tokens()[end.min(n)..(end + lookahead).min(n)].to_vec()
}

/// The `BlockStored` of a partial prompt-tail entry: the one hash block ending at
/// `boundary`.
fn partial_stored_event(
    req: &Request,
    g: usize,
    boundary: usize,
    hbs: usize,
    lookahead: usize,
) -> BlockStored {
    let n = boundary / hbs;
    let start = boundary - hbs;
    BlockStored {
        block_hashes: vec![req.hashes()[n - 1]],
        parent_block_hash: (n > 1).then(|| req.hashes()[n - 2]),
        token_ids: req.tokens()[start..boundary].to_vec(),
        block_size: hbs as u32,
        lora_id: req.lora.as_ref().and_then(|l| l.id),
        lora_name: req.lora.as_ref().map(|l| l.name.clone()),
        extra_keys: Some(vec![req.event_extra_keys(start, boundary + lookahead)]),
        lookahead_token_ids: (lookahead > 0)
            .then(|| vec![lookahead_tokens(req, boundary, lookahead)]),
        group_idx: g as u32,
        kv_cache_spec_kind: None,
        kv_cache_spec_sliding_window: None,
        session_id: req.session_id.clone(),
    }
}

/// The `BlockStored` of blocks `[from, to)` of group `g` (those `mask` keeps),
/// the request's `blocks` in that group.
fn stored_event(
    gm: &GroupManager,
    req: &Request,
    g: usize,
    blocks: &[BlockId],
    (from, to): (usize, usize),
    mask: Option<&[bool]>,
    lookahead: usize,
) -> BlockStored {
    let bs = gm.block_size() as usize;
    let mut hashes = Vec::new();
    let mut extra = Vec::new();
    let mut ahead = Vec::new();
    for (i, &b) in blocks.iter().enumerate().take(to).skip(from) {
        if b == NULL_BLOCK || mask.is_some_and(|m| !m[i - from]) {
            continue;
        }
        if let Some(k) = gm.key_for(req.hashes(), i) {
            hashes.push(k.hash);
        }
        // With lookahead hashing the keys cover the widened window.
        extra.push(req.event_extra_keys(i * bs, (i + 1) * bs + lookahead));
        if lookahead > 0 {
            ahead.push(lookahead_tokens(req, (i + 1) * bs, lookahead));
        }
    }
    let parent = if from == 0 {
        None
    } else {
        gm.key_for(req.hashes(), from - 1).map(|k| k.hash)
    };
    BlockStored {
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids: req.tokens()[from * bs..to * bs].to_vec(),
        block_size: bs as u32,
        lora_id: req.lora.as_ref().and_then(|l| l.id),
        lora_name: req.lora.as_ref().map(|l| l.name.clone()),
        // vLLM publishes one entry per stored block (None entries included) and
        // None only when no block was stored.
        extra_keys: (!extra.is_empty()).then_some(extra),
        lookahead_token_ids: (lookahead > 0).then_some(ahead),
        group_idx: g as u32,
        kv_cache_spec_kind: None,
        kv_cache_spec_sliding_window: None,
        session_id: req.session_id.clone(),
    }
}
