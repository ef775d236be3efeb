//! Publishing a request's newly full blocks of one group into the prefix
//! cache (`cache_blocks`, with the sparse-retention mask of the blocks kept),
//! and the per-step reset of what Mamba cached this step.

use super::{GroupManager, Retention};
use crate::pool::{BlockPool, NULL_BLOCK};
use crate::request::Request;
use crate::spec::AttentionKind;

impl GroupManager {
    /// Caches the request's newly full blocks covering `num_tokens`; returns the
    /// block range `[from, to)` that was published, if any, with the mask of
    /// blocks kept (`None` = all).
    pub(crate) fn cache_blocks(
        &mut self,
        pool: &mut BlockPool,
        req: &mut Request,
        g: usize,
        num_tokens: usize,
        hash_block_size: usize,
        retention: &Retention<'_>,
    ) -> Option<(usize, usize, Option<Vec<bool>>)> {
        if !self.prefix_cacheable() {
            return None;
        }
        let shared = req.shared_prefix_boundary;
        let (hashes, gb) = req.hashes_and_group_mut(g);
        let cached = gb.num_cached.unwrap_or(0);
        let hashed_tokens = hashes.len() * hash_block_size;
        let full =
            (self.blocks_floor(num_tokens.min(hashed_tokens) as u64) as usize).min(gb.blocks.len());
        if cached >= full {
            return None;
        }
        let mask = if self.spec.kind.is_sparse_retention() {
            // The replay boundaries plus a pinned shared-prefix junction.
            let mut b = [0u64; 4];
            let mut nb = retention.boundaries.len().min(2);
            b[..nb].copy_from_slice(&retention.boundaries[..nb]);
            if shared > 0 {
                b[nb] = shared;
                nb += 1;
                if self.use_eagle {
                    b[nb] = shared.saturating_sub(u64::from(self.block_size));
                    nb += 1;
                }
            }
            match *self.kind() {
                AttentionKind::SlidingWindow { window } => {
                    self.sliding_reachable_mask(window, cached, full, retention.interval, &b[..nb])
                }
                AttentionKind::Mamba { .. } => {
                    self.mamba_reachable_mask(cached, full, retention.interval, &b[..nb])
                }
                _ => None,
            }
        } else {
            None
        };
        if full - cached > 1 {
            pool.warm_lookups((cached..full).filter_map(|i| self.key_for(hashes, i)));
        }
        for i in cached..full {
            let b = gb.blocks[i];
            if b == NULL_BLOCK || mask.as_ref().is_some_and(|m| !m[i - cached]) {
                continue;
            }
            if let Some(key) = self.key_for(hashes, i) {
                pool.cache_full_block(b, key, ((i + 1) * self.block_size as usize) as u32);
                if matches!(self.kind(), AttentionKind::Mamba { .. }) {
                    self.cached_this_step.insert(key);
                }
            }
        }
        gb.num_cached = Some(full);
        Some((cached, full, mask))
    }

    /// Per-step reset (Mamba forgets which states were cached this step).
    pub(crate) fn new_step_starts(&mut self) {
        self.cached_this_step.clear();
    }
}
