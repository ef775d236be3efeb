//! Mamba: one state block stands for the whole prefix before it, so a hit is the
//! rightmost aligned cached state (searched right to left) and every earlier
//! block falls out of use (`n - 1` skipped tokens). In "align" mode a request
//! holds only its running state block (plus speculative blocks); the previous
//! state is released one step later.

use super::{GroupBlocks, GroupManager, Lookup};
use crate::pool::{BlockId, BlockPool, NULL_BLOCK};
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
        for i in (0..q.max_len / bs).rev() {
            let Some(hash) = self.hash_at(q.hashes, i) else {
                continue;
            };
            if !Self::lookup_all(pool, hash, group_ids, &mut found) {
                continue;
            }
            if bs != q.alignment && ((i + 1) * bs) % q.alignment != 0 {
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
    /// is released one step later (`remove_skipped_blocks`).
    pub(super) fn allocate_mamba_align(
        &self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        num_tokens: u64,
        spec: u32,
        out: &mut Vec<BlockId>,
    ) {
        let bs = u64::from(self.block_size);
        let spec = spec as usize;
        let required = num_tokens.div_ceil(bs) as usize + spec;
        if required <= gb.blocks.len() {
            gb.mamba_allocated = true;
            return;
        }
        let prev_len = gb.blocks.len();
        if gb.mamba_allocated {
            gb.mamba_last_state = Some(prev_len - 1 - spec);
        } else if prev_len > 0 {
            gb.mamba_last_state = Some(prev_len - 1);
        }
        let skipped = required - spec - 1;
        if prev_len < skipped {
            gb.blocks.resize(skipped, NULL_BLOCK);
        }
        if gb.mamba_allocated {
            // Speculative blocks move forward; their old slots become null.
            for idx in prev_len - spec..prev_len {
                if idx >= skipped {
                    break;
                }
                let b = gb.blocks[idx];
                gb.blocks.push(b);
                gb.blocks[idx] = NULL_BLOCK;
            }
        }
        let new = required.saturating_sub(gb.blocks.len());
        out.extend_from_slice(&gb.blocks[prev_len.min(gb.blocks.len())..]);
        let start = out.len();
        let _ = pool.get_new_blocks(new as u32, out);
        gb.blocks.extend_from_slice(&out[start..]);
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
}
