//! A step's blocks in one group: how many it takes (`num_blocks_to_allocate`),
//! adopting a prefix hit and external tokens' blocks, fresh blocks (Mamba
//! "align" checkpoints included), the fresh blocks listed for zeroing, and the
//! copy-on-write of a hit ending inside a block.

use super::{GroupBlocks, GroupManager, Need, checkpoint_position};
use crate::pool::{BlockId, BlockPool, NULL_BLOCK};
use crate::spec::{AttentionKind, MambaCacheMode};

impl GroupManager {
    /// Blocks this step takes from the free queue: fresh blocks plus prefix-hit
    /// blocks that are eviction candidates (touching pulls them out of the queue).
    /// May be negative for Mamba "align" (vLLM's arithmetic, kept as is).
    pub(crate) fn num_blocks_to_allocate(
        &self,
        pool: &BlockPool,
        gb: &GroupBlocks,
        hit: &[BlockId],
        n: &Need,
    ) -> i64 {
        let (mut num_tokens, total_computed, num_tokens_main_model, apply_admission_cap) =
            (n.num_tokens, n.total_computed, n.main_model, n.cap);
        let bs = u64::from(self.block_size);
        let evictable =
            |blocks: &[BlockId]| blocks.iter().filter(|&&b| pool.is_evictable(b)).count() as i64;
        if self.spec.kind == AttentionKind::CircularBuffer {
            // The ring's one block, claimed once.
            return i64::from(gb.blocks.is_empty());
        }
        if self.is_engine_managed() {
            return 0;
        }
        if let Some(need) = self.hisparse_need(gb, n) {
            return need;
        }
        if let AttentionKind::Mamba {
            num_speculative_blocks,
            mode,
            ..
        } = self.spec.kind
        {
            if self.hit_cached_this_step(pool, hit) {
                // The state is written at the end of the step that cached it and
                // cannot be read yet: vLLM makes the request not fit this step.
                return i64::from(self.num_gpu_blocks) + 1;
            }
            if mode == MambaCacheMode::Align {
                let spec = u64::from(num_speculative_blocks);
                let required = num_tokens_main_model.div_ceil(bs) + spec;
                let mut new = required as i64 - hit.len() as i64 - gb.blocks.len() as i64;
                let partial =
                    self.has_partial_local_hit(hit, n.num_local) || gb.partial_hit.is_some();
                if partial {
                    new = new.max(0) + 1;
                }
                let checkpoint = u64::from(self.mamba_checkpoint(gb, n).is_some());
                if new > 0 {
                    let cap = 1
                        + u64::from(partial)
                        + checkpoint
                        + if gb.mamba_allocated { 0 } else { spec };
                    new = new.min(cap as i64);
                }
                return new + evictable(hit);
            }
            num_tokens += bs * u64::from(num_speculative_blocks);
        }
        let mut required = self.blocks_ceil(num_tokens);
        if apply_admission_cap && let Some(cap) = self.admission_cap {
            required = required.min(cap);
        }
        let have = gb.blocks.len() as u64;
        if gb.num_cached.is_some() {
            return required.saturating_sub(have) as i64;
        }
        let skipped_blocks = self.blocks_floor(self.num_skipped_tokens(total_computed));
        let local = hit.len() as u64 + have;
        let fresh = required.saturating_sub(skipped_blocks.max(local));
        let skip_hits = (skipped_blocks.saturating_sub(have) as usize).min(hit.len());
        // A hit ending inside a block takes one more block for its copy.
        let cow = i64::from(self.has_partial_local_hit(hit, n.num_local));
        fresh as i64 + cow + evictable(&hit[skip_hits..])
    }

    /// vLLM's `_has_partial_local_hit`: the local prefix hit ends inside one of
    /// this group's blocks, so its shared tail block is copied on write.
    fn has_partial_local_hit(&self, hit: &[BlockId], num_local: u64) -> bool {
        !hit.is_empty() && !num_local.is_multiple_of(u64::from(self.block_size))
    }

    /// Mamba "align": the prefill checkpoint this step reserves, `(position,
    /// column)`: the reusable boundary below the chunk end (vLLM's
    /// `get_mamba_prefill_checkpoint_position`), when the chunk reaches the end
    /// of the prefill and the kernel can export it there
    /// (`_needs_internal_checkpoint`).
    pub(crate) fn mamba_checkpoint(&self, gb: &GroupBlocks, n: &Need) -> Option<(u64, usize)> {
        let AttentionKind::Mamba {
            mode: MambaCacheMode::Align,
            num_speculative_blocks,
            prefill_checkpoint_alignment: Some(align),
        } = self.spec.kind
        else {
            return None;
        };
        let bs = i64::from(self.block_size);
        let end = n.main_model;
        let position = checkpoint_position(
            end,
            self.alignment,
            self.drop_eagle_checkpoint,
            self.lookahead,
        );
        let start = n.total_computed as i64;
        let (pos, end_i) = (position as i64, end as i64);
        let hbs = i64::from(self.hash_block_size);
        let column = (end_i + bs - 1).div_euclid(bs) - 2;
        let valid = start % hbs == 0
            && column > (start - 1).div_euclid(bs)
            && start + hbs <= pos
            && start < pos
            && pos < end_i
            && (pos - start) % i64::from(align) == 0;
        if end < n.prefill_end || !valid || column < 0 {
            return None;
        }
        let c = column as usize;
        let len = gb.blocks.len();
        let free_column = c >= len
            || gb.blocks[c] == NULL_BLOCK
            || (gb.mamba_allocated && c + num_speculative_blocks as usize >= len);
        free_column.then_some((position, c))
    }

    /// Records the checkpoint [`Self::mamba_checkpoint`] reserves (vLLM records it
    /// while counting the blocks a step needs).
    pub(crate) fn record_checkpoint(&self, gb: &mut GroupBlocks, n: &Need) {
        if self.mamba_align().is_some() {
            gb.checkpoint = self.mamba_checkpoint(gb, n);
        }
    }

    /// Adopts the prefix hit at admission: touches the hit blocks, pads skipped
    /// positions with the null block, marks them cached.
    pub(crate) fn add_local_computed_blocks(
        &self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        hit: &[BlockId],
        num_local: u64,
        num_external: u64,
    ) {
        if matches!(
            self.kind(),
            AttentionKind::CrossAttention
                | AttentionKind::CircularBuffer
                | AttentionKind::EngineManaged
        ) {
            return;
        }
        if matches!(
            self.kind(),
            AttentionKind::HiSparseResident | AttentionKind::HiSparseHot { .. }
        ) {
            self.hisparse_add_local(gb, num_local);
            return;
        }
        let bs = u64::from(self.block_size);
        // Only the blocks the adopted tokens reach: a caller may adopt fewer
        // tokens than the lookup found (the rest it computes, or a connector
        // loads into fresh blocks).
        let hit = &hit[..(num_local.div_ceil(bs) as usize).min(hit.len())];
        let skipped_blocks = (self.num_skipped_tokens(num_local + num_external) / bs) as usize;
        let hit = &hit[skipped_blocks.min(hit.len())..];
        if pool.enable_caching() {
            pool.touch(hit);
        }
        gb.blocks
            .extend(std::iter::repeat_n(NULL_BLOCK, skipped_blocks));
        gb.blocks.extend_from_slice(hit);
        gb.num_cached = Some(gb.blocks.len());
        if let Some(&last) = hit.last().filter(|_| !num_local.is_multiple_of(bs)) {
            // The hit ends inside its last block: the next allocation copies it
            // into a private block, which is cached again once full.
            let idx = (num_local / bs) as usize;
            gb.partial_hit = Some((idx, last));
            gb.num_cached = Some(idx);
        }
    }

    /// Fresh blocks for tokens whose KV an external connector supplies.
    pub(crate) fn allocate_external_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        num_local: u64,
        num_external: u64,
        record_for_zeroing: bool,
    ) {
        match self.kind() {
            AttentionKind::CrossAttention | AttentionKind::EngineManaged => return,
            AttentionKind::HiSparseResident | AttentionKind::HiSparseHot { .. } => {
                self.hisparse_add_external(pool, gb, num_local, num_external);
                return;
            }
            AttentionKind::CircularBuffer => {
                if gb.blocks.is_empty() {
                    let _ = pool.get_new_blocks(1, &mut gb.blocks);
                }
                return;
            }
            _ => {}
        }
        let total = num_local + num_external;
        let skipped = self.num_skipped_tokens(total);
        let ext = if skipped > 0 {
            (total - skipped).min(num_external)
        } else {
            num_external
        };
        if ext == 0 {
            return;
        }
        let need = total
            .div_ceil(u64::from(self.block_size))
            .saturating_sub(gb.blocks.len() as u64);
        // Capacity was checked by the caller.
        let start = gb.blocks.len();
        let _ = pool.get_new_blocks(need as u32, &mut gb.blocks);
        if self.records_new_block_ids && record_for_zeroing {
            self.new_block_ids.extend_from_slice(&gb.blocks[start..]);
            self.bound_new_block_ids();
        }
    }

    /// Grows the block list to cover `num_tokens`, returning the new ids in `out`.
    pub(crate) fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        gb: &mut GroupBlocks,
        mut num_tokens: u64,
        num_tokens_main_model: u64,
        out: &mut Vec<BlockId>,
    ) {
        let bs = u64::from(self.block_size);
        if self.spec.kind == AttentionKind::CircularBuffer {
            if gb.blocks.is_empty() {
                let start = out.len();
                let _ = pool.get_new_blocks(1, out);
                gb.blocks.extend_from_slice(&out[start..]);
            }
            return;
        }
        if self.is_engine_managed() {
            return;
        }
        if matches!(
            self.kind(),
            AttentionKind::HiSparseResident | AttentionKind::HiSparseHot { .. }
        ) {
            self.hisparse_allocate(pool, gb, num_tokens, out);
            return;
        }
        if let AttentionKind::Mamba {
            mode,
            num_speculative_blocks,
            ..
        } = self.spec.kind
        {
            if mode == MambaCacheMode::Align {
                self.allocate_mamba_align(
                    pool,
                    id,
                    gb,
                    num_tokens_main_model,
                    num_speculative_blocks,
                    out,
                );
                return;
            }
            num_tokens += bs * u64::from(num_speculative_blocks);
        }
        if let Some((idx, source)) = gb.partial_hit.take() {
            // The shared tail block of a partial hit: the request continues in a
            // private copy (capacity was checked by the caller).
            let _ = pool.get_new_blocks(1, out);
            let copy = out[out.len() - 1];
            self.apply_cow(pool, gb, idx, source, copy);
            self.new_block_ids.push(copy);
            self.bound_new_block_ids();
        }
        let required = self.blocks_ceil(num_tokens);
        let have = gb.blocks.len() as u64;
        if required <= have {
            return;
        }
        let start = out.len();
        let _ = pool.get_new_blocks((required - have) as u32, out);
        gb.extend_blocks(&out[start..]);
        if self.records_new_block_ids {
            self.new_block_ids.extend_from_slice(&out[start..]);
            self.bound_new_block_ids();
        }
    }

    /// Whether the worker zeroes this group's fresh blocks.
    #[must_use]
    pub fn records_new_block_ids(&self) -> bool {
        self.records_new_block_ids
    }

    /// Drains the blocks to zero recorded since the last call into `out`.
    pub(crate) fn take_new_block_ids(&mut self, out: &mut Vec<BlockId>) {
        out.append(&mut self.new_block_ids);
    }

    /// Records the request's blocks from block `start` on for zeroing again
    /// (blocks a failed KV load left unwritten).
    pub(crate) fn record_blocks_for_zeroing(&mut self, gb: &GroupBlocks, start: usize) {
        if self.records_new_block_ids {
            self.new_block_ids
                .extend_from_slice(gb.blocks.get(start..).unwrap_or(&[]));
            self.bound_new_block_ids();
        }
    }

    /// Keeps the undrained blocks to zero within
    /// [`crate::pool::PENDING_BLOCKS_PER_POOL_BLOCK`] entries a pool block:
    /// past that, a block listed again keeps its first listing only (zeroed
    /// once at drain time, which is all a listing asks).
    fn bound_new_block_ids(&mut self) {
        crate::pool::dedupe_past_bound(&mut self.new_block_ids, self.num_gpu_blocks as usize);
    }

    /// vLLM's `_apply_cow`: the request's block `idx` becomes `copy`; both
    /// endpoints stay referenced until the copy has run (the source keeps the
    /// hit's reference, the copy takes one more).
    pub(super) fn apply_cow(
        &mut self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        idx: usize,
        source: BlockId,
        copy: BlockId,
    ) {
        debug_assert_eq!(gb.blocks.get(idx), Some(&source));
        gb.blocks[idx] = copy;
        self.pending_cow.push((source, copy));
        pool.add_ref(copy);
    }

    /// Drains the copy-on-write pairs `(source, copy)` made since the last call;
    /// each endpoint still holds the one reference the caller now owns.
    pub(crate) fn take_pending_cow(&mut self, out: &mut Vec<(BlockId, BlockId)>) {
        out.append(&mut self.pending_cow);
    }

    /// The copy-on-write pairs not yet handed out.
    pub(crate) fn pending_cow(&self) -> &[(BlockId, BlockId)] {
        &self.pending_cow
    }
}
