//! Inspection through the coordinator: the common-prefix block count and the
//! per-request invariant checks `check_invariants` adds up.

use super::Coordinator;
use crate::error::{Error, Result};
use crate::pool::NULL_BLOCK;
use crate::request::Request;

impl Coordinator {
    // ---- inspection -------------------------------------------------------

    /// Per group, the request's leading blocks held by all `num_running`
    /// requests that hold blocks (vLLM 0.32's meaning; full attention only).
    pub(crate) fn num_common_prefix_blocks(&self, req: &Request, num_running: usize) -> Vec<u32> {
        self.groups
            .iter()
            .enumerate()
            .map(|(g, gm)| {
                if !gm.spec().kind.is_full_attention() {
                    return 0;
                }
                req.groups()[g]
                    .blocks()
                    .iter()
                    .take_while(|&&b| self.pool.ref_cnt(b) as usize == num_running)
                    .count() as u32
            })
            .collect()
    }

    /// Checks one request's blocks (range, one group per block, cached blocks
    /// under the request's own hashes) and adds them to the per-block reference
    /// counts `refs` and owners `owner_group`.
    pub(crate) fn check_request(
        &self,
        req: &Request,
        refs: &mut [u32],
        owner_group: &mut [u32],
    ) -> Result<()> {
        let n = refs.len();
        let violation = |m: String| Err(Error::InvariantViolation(m));
        for (g, gb) in req.groups().iter().enumerate() {
            if self.groups[g].is_hisparse_resident() {
                // Its references are engine-held (counted with the engine's).
                continue;
            }
            for &b in gb.blocks() {
                let i = b as usize;
                if i >= n {
                    return violation(format!("request {:?} holds out-of-range block {b}", req.id));
                }
                if b == NULL_BLOCK {
                    continue;
                }
                refs[i] += 1;
                if owner_group[i] != u32::MAX && owner_group[i] != g as u32 {
                    return violation(format!(
                        "block {b} is held by groups {} and {g}",
                        owner_group[i]
                    ));
                }
                owner_group[i] = g as u32;
            }
            let Some(c) = gb.num_cached() else {
                continue;
            };
            if c > gb.blocks().len() {
                return violation(format!(
                    "request {:?} marks {c} cached blocks of {}",
                    req.id,
                    gb.blocks().len()
                ));
            }
            let gm = &self.groups[g];
            for (i, &b) in gb.blocks()[..c].iter().enumerate() {
                if b == NULL_BLOCK || !self.pool.enable_caching() {
                    continue;
                }
                // A full block carries its own key; a partial prompt-tail entry
                // (re-registered after an eviction) is the other case. A block
                // reached under another of its entries is shared, not corrupt:
                // without verification, a colliding (weak) hash can match a
                // prompt-tail entry made at another position.
                let full_tokens = ((i + 1) * gm.block_size() as usize) as u32;
                let partial = self.pool.primary_tokens(b).is_some_and(|t| t < full_tokens);
                if let Some(k) = self.pool.block_key(b).filter(|_| !partial) {
                    let own = gm.key_for(req.hashes(), i);
                    if Some(k) != own && !own.is_some_and(|o| self.pool.map_contains(&o, b)) {
                        return violation(format!(
                            "block {b} of request {:?} is cached under another hash",
                            req.id
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}
