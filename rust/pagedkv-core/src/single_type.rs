//! Single-type managers: one attention type's rules for one KV-cache group — what
//! a prefix hit is, which blocks fall out of use, how many blocks a step needs.

use crate::hash::BlockHash;
use crate::pool::{BlockId, BlockPool, CacheKey, NULL_BLOCK};
use crate::request::{GroupBlocks, Request};
use crate::spec::{AttentionKind, GroupSpec};

/// The manager of one KV-cache group.
#[derive(Clone, Debug)]
pub struct GroupManager {
    spec: GroupSpec,
    group_id: u32,
    block_size: u32,
    /// Hash blocks per group block (`block_size / hash_block_size`).
    scale: usize,
}

impl GroupManager {
    pub(crate) fn new(spec: GroupSpec, group_id: u32, hash_block_size: u32) -> Self {
        let block_size = spec.block_size;
        Self {
            scale: (block_size / hash_block_size) as usize,
            spec,
            group_id,
            block_size,
        }
    }

    /// The group's spec.
    #[must_use]
    pub fn spec(&self) -> &GroupSpec {
        &self.spec
    }

    /// Tokens per block.
    #[must_use]
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Cache key of the request's `i`-th block of this group. A block spanning
    /// several hash blocks is keyed by its last hash block's hash: vLLM keys it by
    /// the concatenation of the spanned hashes, and since each hash chains over all
    /// before it, the last one identifies the concatenation. Events publish the
    /// last 8 bytes, which are the same either way.
    #[must_use]
    pub fn key_for(&self, hashes: &[BlockHash], i: usize) -> Option<CacheKey> {
        let j = (i + 1) * self.scale;
        (j <= hashes.len()).then(|| CacheKey {
            hash: hashes[j - 1],
            group: self.group_id,
        })
    }

    fn num_full_hashed_blocks(&self, hashes: &[BlockHash]) -> usize {
        hashes.len() / self.scale
    }

    /// Tokens that attention no longer reads once `num_computed` tokens are done.
    fn num_skipped_tokens(&self, _num_computed: u64) -> u64 {
        match self.spec.kind {
            AttentionKind::FullAttention | AttentionKind::MlaAttention => 0,
        }
    }

    /// Longest cached prefix for the groups `group_ids` (all with this spec),
    /// at most `max_len` tokens; writes one list per group into `out` (indexed by
    /// group id) and returns the hit length in tokens.
    pub(crate) fn find_longest_cache_hit(
        &self,
        pool: &BlockPool,
        hashes: &[BlockHash],
        max_len: usize,
        group_ids: &[u32],
        drop_eagle_block: bool,
        out: &mut [Vec<BlockId>],
    ) -> usize {
        let bs = self.block_size as usize;
        let max_blocks = (max_len / bs).min(self.num_full_hashed_blocks(hashes));
        let mut n = 0usize;
        'blocks: for i in 0..max_blocks {
            let hash = hashes[(i + 1) * self.scale - 1];
            // Every group must hit before any list grows.
            let mut found = [NULL_BLOCK; 8];
            let mut many: Vec<BlockId> = Vec::new();
            for (k, &g) in group_ids.iter().enumerate() {
                let Some(b) = pool.cached_block(&CacheKey { hash, group: g }) else {
                    break 'blocks;
                };
                if k < found.len() {
                    found[k] = b;
                } else {
                    many.push(b);
                }
            }
            for (k, &g) in group_ids.iter().enumerate() {
                let b = if k < found.len() {
                    found[k]
                } else {
                    many[k - found.len()]
                };
                out[g as usize].push(b);
            }
            n += 1;
        }
        if drop_eagle_block && n > 0 {
            n -= 1;
            for &g in group_ids {
                out[g as usize].truncate(n);
            }
        }
        n * bs
    }

    /// Blocks this step takes from the free queue: fresh blocks plus prefix-hit
    /// blocks that are eviction candidates (touching pulls them out of the queue).
    pub(crate) fn num_blocks_to_allocate(
        &self,
        pool: &BlockPool,
        gb: &GroupBlocks,
        num_tokens: u64,
        hit: &[BlockId],
        total_computed: u64,
    ) -> u64 {
        let bs = u64::from(self.block_size);
        let required = num_tokens.div_ceil(bs);
        let have = gb.blocks.len() as u64;
        if gb.num_cached.is_some() {
            return required.saturating_sub(have);
        }
        let skipped_blocks = self.num_skipped_tokens(total_computed) / bs;
        let local = hit.len() as u64 + have;
        let fresh = required.saturating_sub(skipped_blocks.max(local));
        let skip_hits = skipped_blocks.saturating_sub(have) as usize;
        let evictable = hit
            .iter()
            .skip(skip_hits)
            .filter(|&&b| pool.is_evictable(b))
            .count() as u64;
        fresh + evictable
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
        let bs = u64::from(self.block_size);
        let skipped_blocks = (self.num_skipped_tokens(num_local + num_external) / bs) as usize;
        let hit = &hit[skipped_blocks.min(hit.len())..];
        if pool.enable_caching() {
            pool.touch(hit);
        }
        gb.blocks
            .extend(std::iter::repeat_n(NULL_BLOCK, skipped_blocks));
        gb.blocks.extend_from_slice(hit);
        gb.num_cached = Some(gb.blocks.len());
    }

    /// Fresh blocks for tokens whose KV an external connector supplies.
    pub(crate) fn allocate_external_computed_blocks(
        &self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        num_local: u64,
        num_external: u64,
    ) {
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
        let _ = pool.get_new_blocks(need as u32, &mut gb.blocks);
    }

    /// Grows the block list to cover `num_tokens`, returning the new ids in `out`.
    pub(crate) fn allocate_new_blocks(
        &self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        num_tokens: u64,
        out: &mut Vec<BlockId>,
    ) {
        let required = num_tokens.div_ceil(u64::from(self.block_size));
        let have = gb.blocks.len() as u64;
        if required <= have {
            return;
        }
        // Capacity was checked by the caller.
        let _ = pool.get_new_blocks((required - have) as u32, out);
        gb.blocks.extend_from_slice(out);
    }

    /// Caches the request's newly full blocks covering `num_tokens`; returns the
    /// block range `[from, to)` that was published, if any.
    pub(crate) fn cache_blocks(
        &self,
        pool: &mut BlockPool,
        req: &mut Request,
        g: usize,
        num_tokens: usize,
        hash_block_size: usize,
    ) -> Option<(usize, usize)> {
        let gb = &mut req.groups[g];
        let cached = gb.num_cached.unwrap_or(0);
        let hashed_tokens = req.hashes.len() * hash_block_size;
        let full = (num_tokens.min(hashed_tokens) / self.block_size as usize).min(gb.blocks.len());
        if cached >= full {
            return None;
        }
        for i in cached..full {
            let b = gb.blocks[i];
            if b == NULL_BLOCK {
                continue;
            }
            if let Some(key) = self.key_for(&req.hashes, i) {
                pool.cache_block(b, key);
            }
        }
        gb.num_cached = Some(full);
        Some((cached, full))
    }

    /// Releases every block of the request, tail first.
    pub(crate) fn free(&self, pool: &mut BlockPool, gb: &mut GroupBlocks) {
        pool.free_blocks(gb.blocks.iter().rev().copied());
        gb.blocks.clear();
        gb.num_cached = None;
    }

    /// Replaces blocks outside the attention window with the null block, freeing
    /// the deeper ones first.
    pub(crate) fn remove_skipped_blocks(
        &self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        total_computed: u64,
    ) {
        let skipped = self.num_skipped_tokens(total_computed);
        if skipped == 0 {
            return;
        }
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
