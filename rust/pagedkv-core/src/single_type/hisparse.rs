//! vLLM 0.33's HiSparse resident and hot groups (`HiSparseResidentManager`,
//! `HiSparseHotManager`): device pages for KV whose home is the host tier.
//!
//! - **Resident**: a row of pages per request. The pages of a host-backed
//!   prefix start as the null block; the engine points them at pinned device
//!   copies and back through the residency overlay (`adopt_page`, `drop_page`),
//!   and pins and unpins the blocks itself, so the references of a row are
//!   engine-held (the pool's `engine_refs`), never a request's. A connector's
//!   import keeps only its last page writable on the device.
//! - **Hot**: `blocks_per_request` blocks a request takes once it reads
//!   host-backed history (an import, a resumed host prefix, or the engine's
//!   `require_hot`); ordinary request-held blocks.
//!
//! Neither group is cached or looked up: the host source owns prefix caching.

use rustc_hash::FxHashMap;

use super::{GroupBlocks, GroupManager, Need};
use crate::pool::{BlockId, BlockPool, NULL_BLOCK};
use crate::spec::AttentionKind;

/// A resident row's overlay: page -> the block it is read from now (the null
/// block: read from the host).
pub(crate) type Overlay = FxHashMap<usize, BlockId>;

impl GroupBlocks {
    /// The block page `idx` is read from, the overlay applied (the null block
    /// for a host-only page; `None` past the row).
    fn overlaid(&self, idx: usize) -> Option<BlockId> {
        let b = *self.blocks.get(idx)?;
        Some(
            self.overlay
                .as_ref()
                .and_then(|o| o.get(&idx).copied())
                .unwrap_or(b),
        )
    }

    /// Resident: the device block page `idx` is read from, `None` when it is
    /// read from the host or past the row (vLLM's `get_resident_page`).
    pub(crate) fn resident_page(&self, idx: usize) -> Option<BlockId> {
        self.overlaid(idx).filter(|&b| b != NULL_BLOCK)
    }

    /// Resident: the row from page `start` on with the overlay applied; host-only
    /// pages stay the null block (vLLM's `get_residency_row`).
    pub(crate) fn residency_row(&self, start: usize) -> Vec<BlockId> {
        (start..self.blocks.len())
            .filter_map(|i| self.overlaid(i))
            .collect()
    }

    /// Resident: points host-only page `idx` at `block`; `false` (nothing
    /// changed) past the row or where the page is already resident.
    pub(crate) fn adopt_page(&mut self, idx: usize, block: BlockId) -> bool {
        if idx >= self.blocks.len() || self.resident_page(idx).is_some() {
            return false;
        }
        self.overlay.get_or_insert_default().insert(idx, block);
        true
    }

    /// Resident: page `idx` is read from the host from now on; the block it
    /// was read from, if any.
    pub(crate) fn drop_page(&mut self, idx: usize) -> Option<BlockId> {
        let b = self.resident_page(idx)?;
        self.overlay.get_or_insert_default().insert(idx, NULL_BLOCK);
        Some(b)
    }

    /// Hot: whether the request needs its hot region.
    pub(crate) fn hot_required(&self) -> bool {
        self.hot_required
    }

    /// Hot: the request needs its hot region from its next allocation on.
    pub(crate) fn require_hot(&mut self) {
        self.hot_required = true;
    }
}

impl GroupManager {
    /// A HiSparse resident group.
    pub(crate) fn is_hisparse_resident(&self) -> bool {
        self.spec.kind == AttentionKind::HiSparseResident
    }

    /// A HiSparse hot group's blocks per request.
    pub(crate) fn hot_blocks(&self) -> Option<u64> {
        match self.spec.kind {
            AttentionKind::HiSparseHot { blocks_per_request } => {
                Some(u64::from(blocks_per_request))
            }
            _ => None,
        }
    }

    /// vLLM's `get_num_blocks_to_allocate` of the two HiSparse groups; `None`
    /// for any other group.
    pub(crate) fn hisparse_need(&self, gb: &GroupBlocks, n: &Need) -> Option<i64> {
        let have = gb.blocks.len() as u64;
        if let Some(per_request) = self.hot_blocks() {
            let host_import = n.total_computed > n.num_local;
            let resumes_host_prefix = n.num_local > 0 && gb.num_cached.is_none();
            let needed = host_import || resumes_host_prefix || gb.hot_required;
            return Some(if needed {
                per_request.saturating_sub(have) as i64
            } else {
                0
            });
        }
        if !self.is_hisparse_resident() {
            return None;
        }
        let required = self.blocks_ceil(n.num_tokens);
        if n.total_computed > n.num_local {
            // The last imported page stays writable on the device (also for a
            // full-prompt hit's last-token replay); earlier ones stay on host.
            let imported = self.blocks_ceil(n.total_computed);
            let tail_missing = imported
                .checked_sub(1)
                .is_none_or(|t| gb.resident_page(t as usize).is_none());
            let grow = required.saturating_sub(imported.max(have));
            return Some(i64::from(tail_missing) + grow as i64);
        }
        let host_pages = self.blocks_ceil(n.num_local);
        let mut required = required;
        if n.cap
            && let Some(cap) = self.admission_cap
        {
            required = required.min(cap);
        }
        Some(required.saturating_sub(have.max(host_pages)) as i64)
    }

    /// Admission of a prefix hit (vLLM's `add_local_computed_blocks`): a
    /// resident row starts with one host-only page per hit page; a hot group
    /// needs its region for a host-backed prefix (or always, in a layout
    /// without resident groups).
    pub(crate) fn hisparse_add_local(&self, gb: &mut GroupBlocks, num_local: u64) {
        gb.num_cached = Some(0);
        if self.is_hisparse_resident() {
            debug_assert!(gb.blocks.is_empty());
            let pages = self.blocks_ceil(num_local) as usize;
            gb.blocks.extend(std::iter::repeat_n(NULL_BLOCK, pages));
        } else if num_local > 0 || !self.hisparse_has_resident {
            gb.hot_required = true;
        }
    }

    /// A connector's import (vLLM's `allocate_external_computed_blocks`): a
    /// resident row gets a writable device page for the import's last page
    /// (earlier imported pages stay on host); a hot group needs its region.
    pub(crate) fn hisparse_add_external(
        &self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        num_local: u64,
        num_external: u64,
    ) {
        if !self.is_hisparse_resident() {
            gb.hot_required = true;
            return;
        }
        let total = num_local + num_external;
        let Some(tail) = total.checked_sub(1).map(|t| self.blocks_floor(t) as usize) else {
            return;
        };
        if gb.blocks.len() <= tail {
            gb.blocks.resize(tail + 1, NULL_BLOCK);
        }
        if gb.resident_page(tail).is_none() {
            let mut new = Vec::with_capacity(1);
            // Capacity was checked by the caller.
            if pool.get_new_blocks(1, &mut new) {
                gb.blocks[tail] = new[0];
                pool.engine_hold(new[0]);
            }
        }
    }

    /// The blocks [`Self::hisparse_allocate`] takes for `num_tokens` tokens.
    pub(crate) fn hisparse_new_blocks(&self, gb: &GroupBlocks, num_tokens: u64) -> u64 {
        let have = gb.blocks.len() as u64;
        match self.hot_blocks() {
            Some(per_request) if gb.hot_required => per_request.saturating_sub(have),
            Some(_) => 0,
            None => self.blocks_ceil(num_tokens).saturating_sub(have),
        }
    }

    /// vLLM's `allocate_new_blocks` of the two HiSparse groups: a resident row
    /// grows to cover `num_tokens` (engine-held pages), a hot group takes its
    /// region once required.
    pub(crate) fn hisparse_allocate(
        &self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        num_tokens: u64,
        out: &mut Vec<BlockId>,
    ) {
        if self.hot_blocks().is_some() {
            // (a cold admission may not have adopted anything)
            gb.num_cached = Some(0);
        }
        let new = self.hisparse_new_blocks(gb, num_tokens);
        if new == 0 {
            return;
        }
        let start = out.len();
        let _ = pool.get_new_blocks(new as u32, out);
        gb.extend_blocks(&out[start..]);
        if self.is_hisparse_resident() {
            for &b in &out[start..] {
                pool.engine_hold(b);
            }
        }
    }

    /// A resident row's release (vLLM's `pop_blocks_for_free` of the group,
    /// after its coordinator let go of the pages it pins): the row with the
    /// overlay applied, leading host-only pages dropped. The engine-held
    /// references go with them: `free` returns them to the pool, a deferred
    /// free hands them to the engine as they are.
    pub(crate) fn resident_release(gb: &mut GroupBlocks) -> Vec<BlockId> {
        let row = gb.residency_row(0);
        let first = row
            .iter()
            .position(|&b| b != NULL_BLOCK)
            .unwrap_or(row.len());
        Self::forget(gb);
        row[first..].to_vec()
    }
}
