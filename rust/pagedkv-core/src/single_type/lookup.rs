//! The prefix-hit search every kind shares: probing the pool for a block of
//! each group under a hash (`lookup_all`, `lookup_into`, with read-ahead for a
//! large pool) and `find_longest_cache_hit`, which hands each kind its search.

use super::{GroupManager, Lookup};
use crate::hash::BlockHash;
use crate::pool::{BlockId, BlockPool, CacheKey};
use crate::spec::AttentionKind;

impl GroupManager {
    /// Blocks one cached block of every group in `group_ids` under `hash`, or
    /// `None` when any group misses.
    pub(super) fn lookup_all(
        pool: &BlockPool,
        hash: BlockHash,
        group_ids: &[u32],
        found: &mut Vec<BlockId>,
    ) -> bool {
        found.clear();
        for &g in group_ids {
            match pool.first_cached(&hash, g) {
                Some(b) => found.push(b),
                None => return false,
            }
        }
        true
    }

    /// Appends one cached block of every group in `group_ids` under `hash` to
    /// that group's list in `out`; appends nothing and returns `false` when any
    /// group misses. Inlined into the lookup loops: as a call it costs a
    /// third more instructions per block looked up.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(super) fn lookup_into(
        pool: &BlockPool,
        hash: BlockHash,
        group_ids: &[u32],
        out: &mut [Vec<BlockId>],
    ) -> bool {
        for (k, &g) in group_ids.iter().enumerate() {
            let Some(b) = pool.first_cached(&hash, g) else {
                for &done in &group_ids[..k] {
                    out[done as usize].pop();
                }
                return false;
            };
            out[g as usize].push(b);
        }
        true
    }

    /// Reads ahead the lookups of blocks `range` in every group of
    /// `group_ids` (a map larger than the caches; see `BlockPool::warm_lookups`).
    /// Callers ask [`BlockPool::reads_ahead`] first: with a small map the loop
    /// stays free of it.
    #[cold]
    pub(super) fn warm_range(
        &self,
        pool: &BlockPool,
        hashes: &[BlockHash],
        range: std::ops::Range<usize>,
        group_ids: &[u32],
    ) {
        pool.warm_lookups(
            range
                .filter_map(|j| self.hash_at(hashes, j))
                .flat_map(|hash| group_ids.iter().map(move |&group| CacheKey { hash, group })),
        );
    }

    pub(super) fn hash_at(&self, hashes: &[BlockHash], i: usize) -> Option<BlockHash> {
        hashes.get((i + 1) * self.scale - 1).copied()
    }

    /// Longest cached prefix for the groups `group_ids` (all with this spec) within
    /// `q.max_len` tokens; writes one list per group into `out` (indexed by group
    /// id, skipped positions as null blocks) and returns the hit length in tokens.
    pub(crate) fn find_longest_cache_hit(
        &self,
        pool: &BlockPool,
        q: &Lookup<'_>,
        group_ids: &[u32],
        out: &mut [Vec<BlockId>],
    ) -> usize {
        for &g in group_ids {
            out[g as usize].clear();
        }
        match *self.kind() {
            AttentionKind::FullAttention
            | AttentionKind::MlaAttention
            | AttentionKind::SinkFullAttention { .. } => self.find_full(pool, q, group_ids, out),
            AttentionKind::SlidingWindow { window } => {
                self.find_sliding(pool, q, window, group_ids, out)
            }
            AttentionKind::ChunkedLocal { chunk } => {
                self.find_chunked(pool, q, chunk, group_ids, out)
            }
            AttentionKind::Mamba { .. } => self.find_mamba(pool, q, group_ids, out),
            AttentionKind::CrossAttention
            | AttentionKind::ReplayedSlidingWindow { .. }
            | AttentionKind::CircularBuffer
            | AttentionKind::EngineManaged
            | AttentionKind::HiSparseResident
            | AttentionKind::HiSparseHot { .. } => 0,
        }
    }

    pub(super) fn truncate_all(out: &mut [Vec<BlockId>], group_ids: &[u32], n: usize) {
        for &g in group_ids {
            out[g as usize].truncate(n);
        }
    }
}
