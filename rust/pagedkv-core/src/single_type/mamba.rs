//! Mamba: one state block stands for the whole prefix before it, so a hit is the
//! rightmost aligned cached state (searched right to left) and every earlier
//! block falls out of use (`n - 1` skipped tokens). In "align" mode a request
//! holds only its running state block (plus speculative blocks); the previous
//! state is released one step later.

use super::{GroupBlocks, GroupManager, Lookup};
use crate::pool::{BlockId, BlockPool, CacheKey, NULL_BLOCK};
use crate::request::Request;
use crate::spec::AttentionKind;

impl GroupManager {
    pub(super) fn find_mamba(
        &self,
        pool: &BlockPool,
        q: &Lookup<'_>,
        group_ids: &[u32],
        out: &mut [Vec<BlockId>],
    ) -> usize {
        let bs = self.block_size as usize;
        let mut found = Vec::with_capacity(group_ids.len());
        let a = q.alignment;
        if a < bs && bs.is_multiple_of(a) {
            // Fine-grained: the rightmost hash-block boundary with a cached state
            // (a state registered inside a block, or a full one).
            let scale = bs / a;
            for j in (0..(q.max_len / a).min(q.hashes.len())).rev() {
                if Self::lookup_all(pool, q.hashes[j], group_ids, &mut found) {
                    for (&g, &b) in group_ids.iter().zip(&found) {
                        let v = &mut out[g as usize];
                        v.resize(j / scale, NULL_BLOCK);
                        v.push(b);
                    }
                    return (j + 1) * a;
                }
            }
            return 0;
        }
        for i in (0..q.max_len / bs).rev() {
            let Some(hash) = self.hash_at(q.hashes, i) else {
                continue;
            };
            if !Self::lookup_all(pool, hash, group_ids, &mut found) {
                continue;
            }
            if bs != q.alignment && !((i + 1) * bs).is_multiple_of(q.alignment) {
                continue;
            }
            for (&g, &b) in group_ids.iter().zip(&found) {
                let v = &mut out[g as usize];
                v.resize(i, NULL_BLOCK);
                v.push(b);
            }
            return (i + 1) * bs;
        }
        0
    }

    /// Mamba: whether the hit's state block was cached during this step.
    pub(crate) fn hit_cached_this_step(&self, pool: &BlockPool, hit: &[BlockId]) -> bool {
        matches!(self.kind(), AttentionKind::Mamba { .. })
            && hit
                .last()
                .and_then(|&b| pool.block_key(b))
                .is_some_and(|k| self.cached_this_step.contains(&k))
    }

    /// Mamba "align": a request holds only the running state block (plus
    /// speculative blocks); earlier positions are null, the previous state block
    /// is released one step later (`remove_skipped_blocks`). A reserved prefill
    /// checkpoint keeps one more column; a partial hit takes a private copy of
    /// its shared state block (vLLM's `MambaManager.allocate_new_blocks`).
    pub(super) fn allocate_mamba_align(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        gb: &mut GroupBlocks,
        num_tokens: u64,
        spec: u32,
        out: &mut Vec<BlockId>,
    ) {
        let bs = u64::from(self.block_size);
        let spec = spec as usize;
        let required = num_tokens.div_ceil(bs) as usize + spec;
        let checkpoint = usize::from(gb.checkpoint.is_some());
        let partial = gb.partial_hit;
        if required <= gb.blocks.len() && partial.is_none() && checkpoint == 0 {
            gb.mamba_allocated = true;
            return;
        }
        let prev_len = gb.blocks.len();
        let allocated = gb.mamba_allocated;
        if allocated {
            // No state column yet when the row holds only speculative slots
            // (or nothing: a step that needed no block marked it allocated).
            gb.mamba_last_state = prev_len.checked_sub(1 + spec);
        } else if prev_len > 0 {
            gb.mamba_last_state = Some(prev_len - 1);
        }
        let skipped = required - spec - 1;
        if prev_len < skipped {
            // The checkpoint column is left for a block.
            let null_end = skipped.saturating_sub(checkpoint);
            if null_end > prev_len {
                gb.blocks.resize(null_end, NULL_BLOCK);
            }
        }
        // Speculative blocks move forward; their old slots become null. In a
        // checkpoint step the one at the checkpoint column stays. (A row
        // shorter than the speculative blocks has none to move.)
        if allocated && let Some(first) = prev_len.checked_sub(spec) {
            for idx in first..prev_len {
                if idx >= skipped.saturating_sub(checkpoint) {
                    break;
                }
                let b = gb.blocks[idx];
                gb.blocks.push(b);
                gb.blocks[idx] = NULL_BLOCK;
            }
        }
        let new = required.saturating_sub(gb.blocks.len()) + usize::from(partial.is_some());
        let returned = prev_len.min(gb.blocks.len());
        let start = out.len();
        // Capacity was checked by the caller.
        let _ = pool.get_new_blocks(new as u32, out);
        let mut fresh = start;
        if let Some((idx, source)) = partial {
            let copy = out[start];
            fresh += 1;
            if allocated {
                // A running request's table is append-only: it stays on the
                // source block, and the cache entry moves to the copy, which the
                // queued copy fills before the step overwrites the source.
                pool.move_block_hashes(source, copy);
                self.pending_cow.push((source, copy));
                pool.add_ref(source);
                if let Some((_, boundary)) = gb.producer_tail.take() {
                    // The copy preserves the request's own boundary state: a
                    // connector may offload it once the copy has run.
                    self.boundary_offloads.push((id.to_owned(), copy, boundary));
                }
                if let Some(k) = pool.block_key(copy) {
                    self.cached_this_step.insert(k);
                }
                // The copy is not the request's: it is not handed out.
                out.remove(start);
                fresh = start;
            } else {
                self.apply_cow(pool, gb, idx, source, copy);
            }
        }
        // What the caller gets: the copy (if the request took it), the columns
        // past the previous end (nulls and relocated blocks), then fresh blocks.
        let tail: Vec<BlockId> = gb.blocks[returned..].to_vec();
        let fresh_ids: Vec<BlockId> = out[fresh..].to_vec();
        out.truncate(fresh);
        out.extend_from_slice(&tail);
        out.extend_from_slice(&fresh_ids);
        gb.blocks.extend_from_slice(&fresh_ids);
        gb.partial_hit = None;
        gb.mamba_allocated = true;
    }

    /// Mamba: which state blocks of `[start, end)` can ever serve a hit (vLLM's
    /// `reachable_block_mask`); `None` = all of them.
    pub(super) fn mamba_reachable_mask(
        &self,
        start: usize,
        end: usize,
        interval: Option<u64>,
        boundaries: &[u64],
    ) -> Option<Vec<bool>> {
        let bs = u64::from(self.block_size);
        let align = self.alignment;
        let r = interval?;
        let mut mask = vec![false; end - start];
        if r > 0 {
            let per = (r / bs) as usize;
            if per <= 1 {
                return None;
            }
            let first = (start + per) / per * per - 1;
            let mut i = first - start;
            while i < mask.len() {
                mask[i] = true;
                i += per;
            }
        }
        for &b in boundaries {
            let aligned = b / align * align;
            let Some(block) = ((aligned / bs) as usize).checked_sub(1) else {
                continue;
            };
            if (start..end).contains(&block) {
                mask[block - start] = true;
            }
        }
        Some(mask)
    }

    /// "align": blocks `remove_skipped_blocks` would release (dry run); `n` is
    /// the number of skipped blocks.
    pub(super) fn mamba_align_num_skippable(
        &self,
        gb: &GroupBlocks,
        n: usize,
        total_computed: u64,
    ) -> usize {
        let mut count = gb.blocks[gb.mamba_retired.min(n)..n]
            .iter()
            .filter(|&&b| b != NULL_BLOCK)
            .count();
        if let Some(last) = gb.mamba_last_state {
            let limit = total_computed.div_ceil(u64::from(self.block_size)) as usize;
            if last + 1 < limit
                && last >= n
                && gb.blocks.get(last).is_some_and(|&b| b != NULL_BLOCK)
            {
                count += 1;
            }
        }
        count
    }

    /// "align": releases the states before the running one. Prefill leaves null
    /// gaps between states awaiting retirement; the state block of two steps ago
    /// goes once the step after it has read it.
    pub(super) fn mamba_align_remove_skipped(
        &self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        total_computed: u64,
    ) {
        let skipped = self.num_skipped_tokens(total_computed);
        if skipped > 0 {
            let n = ((skipped / u64::from(self.block_size)) as usize).min(gb.blocks.len());
            let mut freed = Vec::new();
            let first = gb.mamba_retired;
            if first < n {
                for i in (first..n).rev() {
                    if gb.blocks[i] != NULL_BLOCK {
                        freed.push(gb.blocks[i]);
                        gb.blocks[i] = NULL_BLOCK;
                    }
                }
                gb.mamba_retired = n;
            }
            pool.free_blocks(freed);
        }
        if let Some(last) = gb.mamba_last_state {
            let limit = total_computed.div_ceil(u64::from(self.block_size)) as usize;
            if last + 1 < limit && gb.blocks[last] != NULL_BLOCK {
                let b = gb.blocks[last];
                gb.blocks[last] = NULL_BLOCK;
                pool.free_blocks([b]);
            }
        }
    }

    /// vLLM's `MambaManager._cache_partial_tail_block` ("align"): registers the
    /// state at a boundary inside a block. With a reserved prefill checkpoint,
    /// the checkpoint block is re-keyed at the checkpoint (or, when that state
    /// is transient, dropped from the cache); otherwise the prompt's reusable
    /// boundary (or a shared-prefix junction) when this step reaches it. A
    /// boundary inside the request's running block makes the next allocation
    /// move the entry to a private copy. Returns the boundary when a
    /// `BlockStored` is due.
    pub(crate) fn cache_mamba_partial_tail(
        &mut self,
        pool: &mut BlockPool,
        req: &mut Request,
        g: usize,
        num_tokens: u64,
        interval: Option<u64>,
        num_computed: u64,
    ) -> Option<u64> {
        self.mamba_align()?;
        let hbs = u64::from(self.hash_block_size);
        let bs = u64::from(self.block_size);
        let prompt = req.num_prompt_tokens as u64;
        let shared = req.shared_prefix_boundary;
        let key_at = |n: u64| {
            let j = (n / hbs) as usize;
            (j > 0)
                .then(|| req.hashes().get(j - 1))
                .flatten()
                .map(|&hash| CacheKey {
                    hash,
                    group: self.group_id,
                })
        };
        let gb = &req.groups()[g];
        if let Some((position, column)) = gb.checkpoint {
            let block = *gb.blocks.get(column)?;
            let prompt_checkpoint = position
                == super::checkpoint_position(
                    prompt,
                    self.alignment,
                    self.drop_eagle_checkpoint,
                    self.lookahead,
                );
            let retained = position % bs == 0 && {
                let i = (position / bs) as usize - 1;
                self.mamba_reachable_mask(i, i + 1, interval, &[])
                    .is_none_or(|m| m[0])
            };
            if !prompt_checkpoint && !retained && position != shared {
                // The transient state overwrites this block: neither it nor a
                // full-block key registered earlier this step is reusable.
                if block != NULL_BLOCK {
                    pool.maybe_evict(block);
                }
                return None;
            }
            if block == NULL_BLOCK || pool.primary_tokens(block) == Some(position as u32) {
                return None;
            }
            let key = key_at(position)?;
            pool.replace_block_hashes(block, key, position as u32);
            self.cached_this_step.insert(key);
            return Some(position);
        }
        if num_tokens == 0 || !num_tokens.is_multiple_of(hbs) {
            return None;
        }
        let latest =
            super::checkpoint_position(prompt, hbs, self.drop_eagle_checkpoint, self.lookahead);
        let junction = self.shared_prefix_checkpoint
            && num_tokens == shared
            && num_computed < num_tokens
            && num_tokens <= prompt;
        if num_tokens != latest && !junction {
            return None;
        }
        let idx = (num_tokens.div_ceil(bs) - 1) as usize;
        let block = *gb.blocks.get(idx)?;
        if block == NULL_BLOCK || pool.primary_tokens(block) == Some(num_tokens as u32) {
            return None;
        }
        let key = key_at(num_tokens)?;
        let new = pool.cache_partial_block(block, key, num_tokens as u32);
        self.cached_this_step.insert(key);
        if !num_tokens.is_multiple_of(bs) {
            let gb = &mut req.groups_mut()[g];
            gb.partial_hit = Some((idx, block));
            gb.num_cached = Some(idx);
            gb.producer_tail = Some((block, num_tokens));
        }
        new.then_some(num_tokens)
    }

    /// Mamba "align": offers the boundary states of blocks `range` that are
    /// cached now, with their exact token boundaries (vLLM's boundary-state
    /// hand-off: a Mamba table is not append-only, so a connector is told the
    /// block rather than left to find it by position).
    pub(crate) fn offer_boundary_states(
        &mut self,
        pool: &BlockPool,
        req: &Request,
        g: usize,
        range: std::ops::Range<usize>,
    ) {
        if self.mamba_align().is_none() {
            return;
        }
        let blocks = req.groups()[g].blocks();
        for &b in &blocks[range.start.min(blocks.len())..range.end.min(blocks.len())] {
            if b == NULL_BLOCK {
                continue;
            }
            if let Some(tokens) = pool.block_key(b).and_then(|_| pool.primary_tokens(b)) {
                self.boundary_offloads
                    .push((req.id.clone(), b, u64::from(tokens)));
            }
        }
    }

    /// Drains the boundary states offered since the last call, `(request id,
    /// block, tokens)`.
    pub(crate) fn take_boundary_offloads(&mut self, out: &mut Vec<(String, u32, BlockId, u64)>) {
        let g = self.group_id;
        out.extend(
            self.boundary_offloads
                .drain(..)
                .map(|(r, b, t)| (r, g, b, t)),
        );
    }

    /// Forgets the offers of a request whose blocks go back to the pool: a
    /// connector must not claim a block another request may be handed.
    pub(crate) fn drop_boundary_offloads(&mut self, id: &str) {
        if !self.boundary_offloads.is_empty() {
            self.boundary_offloads.retain(|(r, _, _)| r != id);
        }
    }

    /// vLLM's `finalize_partial_tail_offload`: when a request that registered
    /// its own boundary inside its running state block finishes with nothing
    /// forwarded past it, that block is a valid source: `(block, boundary)`.
    pub(crate) fn finalize_partial_tail(
        &self,
        gb: &mut GroupBlocks,
        num_computed: u64,
        num_in_flight: u64,
    ) -> Option<(BlockId, u64)> {
        self.mamba_align()?;
        let (block, boundary) = gb.producer_tail.take()?;
        (num_in_flight == 0 && num_computed == boundary).then_some((block, boundary))
    }
}
