//! Full attention (also MLA and attention sinks): a hit is the longest run of
//! cached blocks from the first one; no block ever falls out of use. A block
//! spanning several hash blocks also registers the prompt's last hash boundary
//! inside it as a partial entry (hybrid models).

use super::{GroupManager, Lookup};
use crate::pool::{BlockId, BlockPool, CacheKey};
use crate::request::Request;

impl GroupManager {
    pub(super) fn find_full(
        &self,
        pool: &BlockPool,
        q: &Lookup<'_>,
        group_ids: &[u32],
        out: &mut [Vec<BlockId>],
    ) -> usize {
        let bs = self.block_size as usize;
        let mut n = 0usize;
        // Lookups read ahead in windows (8 blocks, then 32): a miss at the
        // first block reads little ahead for nothing.
        let limit = (q.max_len / bs).min(q.hashes.len() / self.scale);
        let staged = pool.reads_ahead();
        while n < limit {
            let end = (n + if n == 0 { 8 } else { 32 }).min(limit);
            let window = q.hashes[(n + 1) * self.scale - 1..end * self.scale]
                .iter()
                .step_by(self.scale);
            let found = if let &[g] = group_ids {
                if staged {
                    pool.cached_run_staged(window, g, &mut out[g as usize])
                } else {
                    pool.cached_run(window, g, &mut out[g as usize])
                }
            } else {
                pool.warm_lookups((n..end).flat_map(|j| {
                    let hash = q.hashes[(j + 1) * self.scale - 1];
                    group_ids.iter().map(move |&group| CacheKey { hash, group })
                }));
                window
                    .take_while(|&&hash| Self::lookup_into(pool, hash, group_ids, out))
                    .count()
            };
            n += found;
            if n < end {
                break;
            }
            if n == end.min(8) && end < limit {
                // The first window hit throughout: the rest of the run goes into
                // lists grown once, not once per window.
                for &g in group_ids {
                    out[g as usize].reserve(limit - n);
                }
            }
        }
        let mut hit = n * bs;
        // Fine-grained lookups (partial hits, `alignment` = the hash block) go on
        // into the first block that missed, probing its interior hash-block
        // boundaries from the highest down.
        let a = q.alignment;
        if a < bs && bs.is_multiple_of(a) {
            let scale = bs / a;
            let first = n * scale;
            let last = (first + scale - 1).min(q.max_len / a).min(q.hashes.len());
            for j in (first..last).rev() {
                if Self::lookup_into(pool, q.hashes[j], group_ids, out) {
                    hit = (j + 1) * a;
                    break;
                }
            }
        }
        if q.drop_eagle_block && hit > 0 {
            hit -= q.alignment.min(bs);
        }
        hit -= hit % q.alignment;
        Self::truncate_all(out, group_ids, hit.div_ceil(bs));
        hit
    }

    /// vLLM's `_cache_partial_tail_block` (full-attention groups whose block spans
    /// several hash blocks): registers the prompt's last hash boundary inside a
    /// block as a partial entry of that block. Returns the boundary (tokens) when
    /// the entry is new, for its `BlockStored` event.
    pub(crate) fn cache_partial_tail(
        &self,
        pool: &mut BlockPool,
        req: &Request,
        g: usize,
        num_tokens: usize,
        hash_block_size: usize,
    ) -> Option<usize> {
        if self.scale <= 1 || !self.spec.kind.is_full_attention() {
            return None;
        }
        let limit = if self.use_eagle {
            req.num_prompt_tokens
        } else {
            req.num_prompt_tokens.saturating_sub(1)
        };
        let boundary = (limit / hash_block_size).min(req.hashes().len()) * hash_block_size;
        let bs = self.block_size as usize;
        if boundary == 0 || boundary > num_tokens || boundary.is_multiple_of(bs) {
            return None;
        }
        let &block = req.groups()[g].blocks.get(boundary / bs)?;
        let key = CacheKey {
            hash: req.hashes()[boundary / hash_block_size - 1],
            group: self.group_id,
        };
        pool.cache_partial_block(block, key, boundary as u32)
            .then_some(boundary)
    }
}
