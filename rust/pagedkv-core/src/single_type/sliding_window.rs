//! Sliding window `w`: a hit is a contiguous run of `cdiv(w - 1, bs)` cached
//! blocks ending the prefix, searched right to left; after `n` computed tokens
//! the first `n - w + 1` fall out of the window. With sparse retention only the
//! blocks that can end such a run are cached.

use super::{GroupManager, Lookup};
use crate::pool::{BlockId, BlockPool, NULL_BLOCK};

/// Blocks read ahead at a time, right to left (a map larger than the caches).
const READ_AHEAD: usize = 32;

impl GroupManager {
    pub(super) fn find_sliding(
        &self,
        pool: &BlockPool,
        q: &Lookup<'_>,
        window: u32,
        group_ids: &[u32],
        out: &mut [Vec<BlockId>],
    ) -> usize {
        let bs = self.block_size as usize;
        let need = contiguous_blocks_for_hit(window, self.block_size, q.drop_eagle_block);
        let max_blocks = q.max_len / bs;
        // The run being matched goes into `out` right to left (pushed as
        // found, dropped at a miss), then is turned round and moved behind
        // the null blocks before it.
        for &g in group_ids {
            out[g as usize].reserve(max_blocks);
        }
        let mut run = 0usize;
        let mut start = 0usize;
        for i in (0..max_blocks).rev() {
            if (max_blocks - 1 - i).is_multiple_of(READ_AHEAD) && pool.reads_ahead() {
                self.warm_range(
                    pool,
                    q.hashes,
                    i.saturating_sub(READ_AHEAD - 1)..i + 1,
                    group_ids,
                );
            }
            let hit = self.hash_at(q.hashes, i).is_some_and(|h| match *group_ids {
                [g] => pool
                    .first_cached(&h, g)
                    .map(|b| out[g as usize].push(b))
                    .is_some(),
                _ => Self::lookup_into(pool, h, group_ids, out),
            });
            let aligned = || {
                let post_pop = if q.drop_eagle_block { i } else { i + 1 };
                bs == q.alignment || (post_pop * bs).is_multiple_of(q.alignment)
            };
            if !hit || (run == 0 && !aligned()) {
                if hit || run > 0 {
                    Self::truncate_all(out, group_ids, 0);
                }
                run = 0;
                continue;
            }
            run += 1;
            if run >= need {
                start = i;
                break;
            }
        }
        // Unmatched, `run` is the run touching position 0: a hit even if
        // shorter than the window, cut back to the alignment.
        let matched = run >= need;
        for &g in group_ids {
            let list = &mut out[g as usize];
            list.reverse();
            if start > 0 {
                list.resize(start + run, NULL_BLOCK);
                list.copy_within(0..run, start);
                list[..start].fill(NULL_BLOCK);
            }
        }
        let len_of = |out: &[Vec<BlockId>]| out[group_ids[0] as usize].len();
        if !matched {
            while bs != q.alignment && !(len_of(out) * bs).is_multiple_of(q.alignment) {
                let l = len_of(out) - 1;
                Self::truncate_all(out, group_ids, l);
            }
        }
        if q.drop_eagle_block && len_of(out) > 0 {
            let l = len_of(out) - 1;
            Self::truncate_all(out, group_ids, l);
            while bs != q.alignment && !(len_of(out) * bs).is_multiple_of(q.alignment) {
                let l = len_of(out) - 1;
                Self::truncate_all(out, group_ids, l);
            }
        }
        len_of(out) * bs
    }

    /// Sliding window: which of blocks `[start, end)` can ever serve a hit
    /// (vLLM's `reachable_block_mask`); `None` = all of them.
    pub(super) fn sliding_reachable_mask(
        &self,
        window: u32,
        start: usize,
        end: usize,
        interval: Option<u64>,
        boundaries: &[u64],
    ) -> Option<Vec<bool>> {
        let bs = u64::from(self.block_size);
        let align = self.alignment;
        if !align.is_multiple_of(bs) {
            return None;
        }
        let need = contiguous_blocks_for_hit(window, self.block_size, self.use_eagle);
        let shift = usize::from(self.use_eagle);
        let mut mask = vec![false; end - start];
        let segment = match interval {
            None => Some(align),
            Some(0) => None,
            Some(r) => Some(r),
        };
        if let Some(seg) = segment {
            let per = (seg / bs) as usize;
            if need >= per {
                return None;
            }
            for i in start..end {
                if i >= shift && (i - shift) % per >= per - need {
                    mask[i - start] = true;
                }
            }
        }
        if interval.is_some() {
            for &b in boundaries {
                let aligned = b / align * align;
                let e = (aligned / bs) as usize + shift;
                for j in start.max(e.saturating_sub(need))..end.min(e) {
                    mask[j - start] = true;
                }
            }
        }
        Some(mask)
    }
}

/// Contiguous blocks a sliding-window hit needs: `cdiv(window - 1, bs)`, plus one
/// with EAGLE (the last matched block is dropped).
pub(super) fn contiguous_blocks_for_hit(window: u32, block_size: u32, use_eagle: bool) -> usize {
    ((window - 1).div_ceil(block_size) as usize) + usize::from(use_eagle)
}
