//! Prefix lookups for a scheduler with a KV connector that can restore state
//! at a boundary the local groups disagree on (vLLM's
//! `get_computed_blocks_for_connector` and per-group hits).

use super::{ComputedBlocks, KvCacheManager};
use crate::error::Result;
use crate::hash::BlockHash;
use crate::pool::BlockId;
use crate::spec::AttentionKind;

/// A connector lookup's answer ([`KvCacheManager::get_computed_blocks_for_connector`]).
#[derive(Clone, Debug)]
pub struct ConnectorHit {
    /// The hit to adopt; its token count is the full-attention hit.
    pub hit: ComputedBlocks,
    /// Some group's own hit is shorter than the full-attention one: only a
    /// connector supplying the state at that boundary makes it usable (with no
    /// external tokens, look the request up again with `get_computed_blocks`).
    pub diverged: bool,
}

impl KvCacheManager {
    /// vLLM's coordinator `find_longest_cache_hit` for these block hashes (of
    /// no request: nothing is verified against tokens): the hit blocks per
    /// group, the hit in tokens (at most `max_cache_hit_length`) and the tokens
    /// of a longer prefix some group has cached and another not (0 unless
    /// several groups are looked up).
    #[must_use]
    pub fn find_longest_cache_hit(
        &self,
        hashes: &[BlockHash],
        max_cache_hit_length: u64,
    ) -> (Vec<Vec<BlockId>>, u64, u64) {
        let max_len = usize::try_from(max_cache_hit_length).unwrap_or(usize::MAX);
        let hit = self.coord.find_longest_cache_hit_of(hashes, max_len);
        (hit.block_ids, hit.len as u64, hit.uncached as u64)
    }

    /// vLLM's `find_longest_cache_hit_per_group`: every lookup group's own hit
    /// for these block hashes within `max_cache_hit_length` tokens,
    /// unreconciled: the blocks and the hit length per group (0 for groups
    /// never looked up). `None` unless several groups are looked up with prefix
    /// caching on.
    #[must_use]
    pub fn find_longest_cache_hit_per_group(
        &self,
        hashes: &[BlockHash],
        max_cache_hit_length: u64,
    ) -> Option<(Vec<Vec<BlockId>>, Vec<u64>)> {
        let max_len = usize::try_from(max_cache_hit_length).unwrap_or(usize::MAX);
        self.coord
            .find_per_group(hashes, max_len)
            .map(|(blocks, hits)| (blocks, hits.into_iter().map(|h| h as u64).collect()))
    }

    /// The first full-attention group looked up, with several groups looked up
    /// (vLLM's `full_attention_group_id`).
    #[must_use]
    pub fn full_attention_group(&self) -> Option<u32> {
        self.coord.full_attention_group().map(|g| g as u32)
    }

    /// vLLM's `get_computed_blocks_for_connector`. In a hybrid model with Mamba
    /// groups and full attention, per-group hits can diverge under block
    /// pressure; the full-attention hit is reported as the local prefix
    /// (a connector transfers the rest, Mamba state included), flagged
    /// `diverged` when some group's own hit is shorter. When another group's
    /// hit is longer than full attention's, or the model is not such a hybrid
    /// (or hits are verified against tokens), this is `get_computed_blocks`.
    ///
    /// # Errors
    /// Unknown request.
    pub fn get_computed_blocks_for_connector(
        &mut self,
        id: &str,
        max_cache_hit_length: Option<u64>,
    ) -> Result<ConnectorHit> {
        let slot = self.table.slot(id)?;
        let req = self.table.get(slot);
        let has_mamba = self
            .cfg
            .groups
            .iter()
            .any(|g| matches!(g.kind, AttentionKind::Mamba { .. }));
        let fa = self.coord.full_attention_group();
        let per_group = match fa {
            Some(fa) if has_mamba && !req.verify && !req.skip_reading => {
                let max_len = Self::max_hit_len(req.num_tokens(), max_cache_hit_length);
                self.coord
                    .find_per_group(req.hashes(), max_len)
                    .map(|(blocks, hits)| (fa, blocks, hits))
            }
            _ => None,
        };
        let Some((fa, blocks, hits)) = per_group.filter(|(fa, _, hits)| {
            // A lagging group deeper than full attention: its full-attention
            // blocks were evicted, so take the boundary every group agrees on.
            hits.iter().all(|&h| h <= hits[*fa])
        }) else {
            let hit = self.get_computed_blocks_up_to(id, max_cache_hit_length)?;
            return Ok(ConnectorHit {
                hit,
                diverged: false,
            });
        };
        let num_local = hits[fa];
        let diverged = hits.iter().any(|&h| h < num_local);
        let own = (!self.cfg.external_block_hashes).then_some(0);
        let req = self.table.get_mut(slot);
        req.note_lookup(own);
        let hit = ComputedBlocks {
            block_ids: if num_local == 0 {
                vec![Vec::new(); blocks.len()]
            } else {
                blocks
            },
            num_computed_tokens: num_local as u64,
            // Per-group lookups do not detect an uncached shared prefix.
            shared_prefix_boundary: 0,
            num_host_tokens: 0,
            request_uid: req.uid,
            manager_uid: self.uid,
            epoch: self.coord.pool().epoch(),
        };
        Ok(ConnectorHit { hit, diverged })
    }

    /// The longest hit a lookup may return: `max_cache_hit_length`, or all
    /// but the request's last token.
    pub(super) fn max_hit_len(num_tokens: usize, max_cache_hit_length: Option<u64>) -> usize {
        max_cache_hit_length.map_or(num_tokens.saturating_sub(1), |m| {
            usize::try_from(m).unwrap_or(usize::MAX)
        })
    }
}
