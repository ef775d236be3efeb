//! The coordinator's prefix-hit search: none without caching, one group's
//! lookup, or vLLM's fixed point across several groups (full attention first),
//! then hit verification; per-group hits and stale-hit detection.

use super::{AttnGroup, Coordinator, Hit, Mode};
use crate::hash::BlockHash;
use crate::pool::{BlockId, NULL_BLOCK};
use crate::request::Request;
use crate::single_type::{GroupManager, Lookup};

impl Coordinator {
    /// The request's longest cached prefix of at most `max_len` tokens; with
    /// verification, cut at the first block that does not match the request.
    pub(crate) fn find_longest_cache_hit(&mut self, req: &Request, max_len: usize) -> Hit {
        let mut hit = self.search(req.hashes(), max_len);
        if req.verify {
            // A block that does not match the request ends the hit at its start;
            // search again below it (each round lowers the limit).
            let hbs = self.hash_block_size;
            while let Some(p) = self.verifier.first_unverified(
                &self.pool,
                req,
                &hit.block_ids,
                |g| self.groups[g].block_size() as usize,
                hit.len,
                hbs,
            ) {
                self.verifier.count_failure();
                hit = self.search(req.hashes(), p);
            }
        }
        hit
    }

    /// The longest cached prefix of `hashes` (no request, so no verification
    /// against tokens): vLLM's coordinator `find_longest_cache_hit`.
    pub(crate) fn find_longest_cache_hit_of(&self, hashes: &[BlockHash], max_len: usize) -> Hit {
        self.search(hashes, max_len)
    }

    fn search(&self, hashes: &[BlockHash], max_len: usize) -> Hit {
        let mut out = vec![Vec::new(); self.groups.len()];
        match &self.mode {
            Mode::NoPrefixCache => Hit {
                block_ids: out,
                len: 0,
                uncached: 0,
            },
            Mode::Unitary => {
                let gm = &self.groups[0];
                let q = Lookup {
                    hashes,
                    max_len,
                    drop_eagle_block: gm.use_eagle(),
                    alignment: gm.block_size() as usize,
                };
                let len = gm.find_longest_cache_hit(&self.pool, &q, &[0], &mut out);
                Hit {
                    block_ids: out,
                    len,
                    uncached: 0,
                }
            }
            Mode::Hybrid { attn, simple } => self.find_hybrid(attn, *simple, hashes, max_len, out),
        }
    }

    /// EAGLE: how far past a candidate length a group matches before dropping
    /// the last unit (a hash block for fine-grained lookups, else a block).
    fn eagle_margin(&self, gm: &GroupManager) -> usize {
        let bs = gm.block_size() as usize;
        let hbs = self.hash_block_size;
        if self.partial_hits && gm.spec().kind.supports_fine_grained_lookup() && bs > hbs {
            hbs
        } else {
            bs
        }
    }

    /// vLLM's `find_longest_cache_hit_per_group`: each lookup group searched on
    /// its own up to `max_len`, with no reconciliation; the blocks and the hit
    /// length of every group (0 for groups never looked up). `None` unless
    /// several groups are looked up (vLLM's hybrid coordinator).
    pub(crate) fn find_per_group(
        &self,
        hashes: &[BlockHash],
        max_len: usize,
    ) -> Option<(Vec<Vec<BlockId>>, Vec<usize>)> {
        let Mode::Hybrid { attn, .. } = &self.mode else {
            return None;
        };
        let mut out = vec![Vec::new(); self.groups.len()];
        let mut hits = vec![0usize; self.groups.len()];
        for ag in attn {
            let gm = &self.groups[ag.group_ids[0] as usize];
            let max_length = if ag.use_eagle && !ag.is_mamba {
                (max_len + self.eagle_margin(gm)).min(hashes.len() * self.hash_block_size)
            } else {
                max_len
            };
            let q = Lookup {
                hashes,
                max_len: max_length,
                drop_eagle_block: ag.use_eagle,
                alignment: self.alignment as usize,
            };
            let n = gm.find_longest_cache_hit(&self.pool, &q, &ag.group_ids, &mut out);
            for &g in &ag.group_ids {
                hits[g as usize] = n;
            }
        }
        Some((out, hits))
    }

    /// The first full-attention group looked up (vLLM's
    /// `full_attention_group_id`), with several groups looked up.
    pub(crate) fn full_attention_group(&self) -> Option<usize> {
        match &self.mode {
            Mode::Hybrid { attn, .. } => attn
                .first()
                .filter(|a| a.is_full)
                .map(|a| a.group_ids[0] as usize),
            _ => None,
        }
    }

    /// vLLM's fixed-point search: each attention group accepts the candidate
    /// length or lowers it; repeat until no group lowers it (one pass for a
    /// simple full-attention + one-other-type hybrid).
    fn find_hybrid(
        &self,
        attn: &[AttnGroup],
        simple: bool,
        hashes: &[BlockHash],
        max_len: usize,
        mut out: Vec<Vec<BlockId>>,
    ) -> Hit {
        let n = self.groups.len();
        let align = self.alignment as usize;
        let hbs = self.hash_block_size;
        let mut hit_length = max_len;
        let mut longest = 0usize;
        let mut searched = vec![false; n];
        let mut hit_by_group = vec![0usize; n];
        let mut eagle_verified = vec![false; attn.len()];
        loop {
            let mut curr = hit_length;
            for (idx, ag) in attn.iter().enumerate() {
                let first = ag.group_ids[0] as usize;
                if ag.is_full && searched[first] {
                    // Full attention is downward closed: just trim.
                    curr = curr.min(hit_by_group[first]);
                    continue;
                }
                let gm = &self.groups[first];
                let drop = ag.use_eagle && !eagle_verified[idx];
                let mut max_length = curr;
                if drop && !ag.is_mamba {
                    max_length = (curr + self.eagle_margin(gm)).min(hashes.len() * hbs);
                }
                let q = Lookup {
                    hashes,
                    max_len: max_length,
                    drop_eagle_block: drop,
                    alignment: align,
                };
                let new_hit = gm.find_longest_cache_hit(&self.pool, &q, &ag.group_ids, &mut out);
                if drop {
                    eagle_verified[idx] = true;
                } else if new_hit < curr {
                    eagle_verified.fill(false);
                }
                curr = new_hit;
                for &g in &ag.group_ids {
                    searched[g as usize] = true;
                    hit_by_group[g as usize] = new_hit;
                }
                longest = longest.max(curr);
            }
            if curr >= hit_length {
                break;
            }
            hit_length = curr;
            if simple {
                break;
            }
        }
        for ag in attn.iter().filter(|a| a.is_full) {
            for &g in &ag.group_ids {
                let bs = self.groups[g as usize].block_size() as usize;
                out[g as usize].truncate(hit_length.div_ceil(bs));
            }
        }
        Hit {
            block_ids: out,
            len: hit_length,
            uncached: longest.saturating_sub(hit_length),
        }
    }

    /// The first hit block no longer cached under the request's own hash at its
    /// position (it was evicted or reused since the lookup), if any.
    pub(crate) fn first_stale_hit_block(
        &self,
        req: &Request,
        hit: &[Vec<BlockId>],
    ) -> Option<BlockId> {
        for (g, ids) in hit.iter().enumerate() {
            let gm = &self.groups[g];
            for (i, &b) in ids.iter().enumerate() {
                if b == NULL_BLOCK {
                    continue;
                }
                let expect = gm.key_for(req.hashes(), i);
                if expect.is_none() || self.pool.block_key(b) != expect {
                    return Some(b);
                }
            }
        }
        None
    }

    /// Prefix hits cut short by hit verification.
    pub(crate) fn verification_failures(&self) -> u64 {
        self.verifier.failures()
    }
}
