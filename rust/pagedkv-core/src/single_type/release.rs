//! Releasing a request's blocks of one group: freed tail first, popped for an
//! engine's deferred free, or nulled once they fall out of the attention
//! window (`remove_skipped_blocks` and its dry run).

use super::{GroupBlocks, GroupManager};
use crate::pool::{BlockId, BlockPool, NULL_BLOCK};

impl GroupManager {
    /// Releases every block of the request, tail first.
    pub(crate) fn free(pool: &mut BlockPool, gb: &mut GroupBlocks) {
        pool.free_blocks(gb.blocks.iter().rev().copied());
        Self::forget(gb);
    }

    /// Moves the request's blocks to `out` without freeing them (allocation
    /// order, leading null blocks dropped) and forgets them.
    pub(crate) fn pop_blocks(gb: &mut GroupBlocks, out: &mut Vec<BlockId>) {
        let first = gb.blocks.iter().position(|&b| b != NULL_BLOCK);
        out.extend_from_slice(first.map_or(&[][..], |i| &gb.blocks[i..]));
        Self::forget(gb);
    }

    pub(super) fn forget(gb: &mut GroupBlocks) {
        gb.blocks.clear();
        gb.num_cached = None;
        gb.mamba_allocated = false;
        gb.mamba_last_state = None;
        gb.mamba_retired = 0;
        gb.partial_hit = None;
        gb.checkpoint = None;
        gb.producer_tail = None;
        gb.overlay = None;
        gb.hot_required = false;
    }

    /// Blocks `remove_skipped_blocks(total_computed)` would release (dry run).
    pub(crate) fn num_skippable_blocks(&self, gb: &GroupBlocks, total_computed: u64) -> usize {
        let skipped = self.num_skipped_tokens(total_computed);
        if skipped == 0 {
            return 0;
        }
        let n = ((skipped / u64::from(self.block_size)) as usize).min(gb.blocks.len());
        if self.mamba_align().is_some() {
            return self.mamba_align_num_skippable(gb, n, total_computed);
        }
        gb.blocks[..n]
            .iter()
            .rev()
            .take_while(|&&b| b != NULL_BLOCK)
            .count()
    }

    /// Replaces blocks outside the attention window with the null block, freeing
    /// the deeper ones first.
    pub(crate) fn remove_skipped_blocks(
        &self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        total_computed: u64,
    ) {
        if self.mamba_align().is_some() {
            self.mamba_align_remove_skipped(pool, gb, total_computed);
            return;
        }
        let skipped = self.num_skipped_tokens(total_computed);
        if skipped > 0 {
            let n = ((skipped / u64::from(self.block_size)) as usize).min(gb.blocks.len());
            let mut freed = Vec::new();
            for i in (0..n).rev() {
                if gb.blocks[i] == NULL_BLOCK {
                    break;
                }
                freed.push(gb.blocks[i]);
                gb.blocks[i] = NULL_BLOCK;
            }
            pool.free_blocks(freed);
        }
    }
}
