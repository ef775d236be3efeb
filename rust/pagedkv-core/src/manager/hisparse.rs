//! The engine's calls on HiSparse resident and hot groups
//! ([`crate::AttentionKind::HiSparseResident`],
//! [`crate::AttentionKind::HiSparseHot`]): what vLLM's `HiSparseCoordinator`
//! asks of those groups' managers (the residency overlay, the hot region's
//! requirement), and a request's release stopped before a group, so the
//! coordinator can let go of the pages it pins at that group's place in the
//! group order; and the counts an allocation step hands the engine's own
//! managers of its engine-managed groups (vLLM's HiSparse source).

use super::{AllocateArgs, KvCacheManager};
use crate::error::{Error, Result, invalid};
use crate::pool::{BlockId, NULL_BLOCK};
use crate::single_type::GroupBlocks;
use crate::spec::AttentionKind;

/// What one `allocate_slots` step hands the engine's own managers of its
/// engine-managed groups ([`crate::AttentionKind::EngineManaged`]: vLLM's
/// HiSparse source), as vLLM's `KVCacheManager.allocate_slots` computes it for
/// every group's manager ([`KvCacheManager::hisparse_allocation_step`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HiSparseStep {
    /// Computed tokens held or adopted from the local hit
    /// (`num_computed_tokens + num_new_computed_tokens`).
    pub num_local_computed_tokens: u64,
    /// The local and external computed tokens, capped at `max_model_len`.
    pub total_computed_tokens: u64,
    /// Tokens of the main model after this step: `total_computed_tokens +
    /// num_new_tokens`, not capped (vLLM's value, which its managers get; the
    /// core's own groups take it capped at `max_model_len`).
    pub num_tokens_main_model: u64,
    /// Tokens that need a slot (the lookahead included), capped at
    /// `max_model_len`.
    pub num_tokens_need_slot: u64,
    /// The whole request's tokens, capped at `max_model_len` (the
    /// `full_sequence_must_fit` need).
    pub full_num_tokens: u64,
    /// The scheduler's prefill boundary (`max(num_prompt_tokens, num_tokens - 1)`).
    pub prefill_end: u64,
    /// Tokens to cache once every group allocated: the computed and new
    /// tokens, at most the request's (draft tokens are not cached).
    pub num_tokens_to_cache: u64,
    /// Whether the step adopts its hit (or external tokens) into the groups:
    /// only for a request no group runs yet, core or engine-managed (vLLM's
    /// `allocate_new_computed_blocks` is a no-op otherwise).
    pub adopts: bool,
}

impl KvCacheManager {
    /// The counts of an `allocate_slots` step for the engine's own managers
    /// of its engine-managed groups ([`HiSparseStep`]), for a request synced
    /// with the engine's lists first: `a` the step's arguments (checked as
    /// `allocate_slots` checks them), `has_hit` whether the step hands a
    /// prefix hit (vLLM: a block list other than its shared empty one),
    /// `engine_runs` whether an engine-managed group's manager already runs
    /// the request (it holds a cached-block count for it).
    ///
    /// # Errors
    /// Unknown request; arguments `allocate_slots` refuses (no new tokens and
    /// nothing to adopt, counts out of range).
    pub fn hisparse_allocation_step(
        &self,
        id: &str,
        a: &AllocateArgs,
        has_hit: bool,
        engine_runs: bool,
    ) -> Result<HiSparseStep> {
        let slot = self.table.slot(id)?;
        self.validate_args(slot, a)?;
        let req = self.table.get(slot);
        let max_len = self.cfg.max_model_len;
        let local = a.num_computed_tokens + a.num_new_computed_tokens;
        let total = (local + a.num_external_computed_tokens).min(max_len);
        let main = total + a.num_new_tokens;
        let num_tokens = req.num_tokens() as u64;
        Ok(HiSparseStep {
            num_local_computed_tokens: local,
            total_computed_tokens: total,
            num_tokens_main_model: main,
            num_tokens_need_slot: (main + a.num_lookahead_tokens).min(max_len),
            full_num_tokens: num_tokens.min(max_len),
            prefill_end: req.prefill_end(),
            num_tokens_to_cache: main.min(num_tokens),
            adopts: (has_hit || a.num_external_computed_tokens > 0)
                && !engine_runs
                && !req.is_running(),
        })
    }

    /// The request's slot, once `group` is a HiSparse resident (or hot) group.
    fn hisparse_slot(&self, id: &str, group: usize, resident: bool) -> Result<u32> {
        let slot = self.table.slot(id)?;
        let kind = &self.group_manager(group)?.spec().kind;
        let ok = if resident {
            *kind == AttentionKind::HiSparseResident
        } else {
            matches!(kind, AttentionKind::HiSparseHot { .. })
        };
        if !ok {
            return Err(invalid(format!(
                "group {group} is not a HiSparse {} group",
                if resident { "resident" } else { "hot" }
            )));
        }
        Ok(slot)
    }

    /// The request's blocks of HiSparse group `group`, to read.
    fn hisparse_row(&self, id: &str, group: usize, resident: bool) -> Result<&GroupBlocks> {
        let slot = self.hisparse_slot(id, group, resident)?;
        Ok(&self.table.get(slot).groups()[group])
    }

    /// The request's blocks of HiSparse group `group`, to change.
    fn hisparse_row_mut(
        &mut self,
        id: &str,
        group: usize,
        resident: bool,
    ) -> Result<&mut GroupBlocks> {
        let slot = self.hisparse_slot(id, group, resident)?;
        Ok(&mut self.table.get_mut(slot).groups_mut()[group])
    }

    /// Points host-only page `page` of the request's resident row in `group`
    /// at `block`, a device copy of its contents the engine pins (vLLM's
    /// `adopt_resident_page`). `false`, with nothing changed, past the row or
    /// where the page is resident already.
    ///
    /// The page takes over one of the engine's references on `block` (taken
    /// with [`Self::get_new_blocks`] or [`Self::touch_blocks`]): the row
    /// returns it when the request is freed, or [`Self::hisparse_drop_page`]
    /// hands it back. A block nobody pins (a free one) would go to the next
    /// allocation while the page still reads it.
    ///
    /// # Errors
    /// Unknown request; `group` not a resident group; a block outside the
    /// pool, the null block, a block the engine holds no reference on, one a
    /// request or a pending copy also holds, or one another page of the
    /// request's resident rows already reads. Nothing changes then.
    pub fn hisparse_adopt_page(
        &mut self,
        id: &str,
        group: usize,
        page: usize,
        block: BlockId,
    ) -> Result<bool> {
        self.adopt_resident_page(id, group, page, block, false)
    }

    /// [`Self::hisparse_adopt_page`] for an engine that adopts first and pins
    /// right after (vLLM's HiSparse coordinator: `adopt_resident_page`, then
    /// `block_pool.touch`): the block is pinned here, as
    /// [`Self::touch_blocks`] pins it, only when the page adopts it, so at no
    /// point does a page read a block nobody pins. The engine's pin that
    /// follows is this one (the caller does not pin again).
    ///
    /// # Errors
    /// As [`Self::hisparse_adopt_page`], the missing pin aside.
    pub fn hisparse_pin_and_adopt_page(
        &mut self,
        id: &str,
        group: usize,
        page: usize,
        block: BlockId,
    ) -> Result<bool> {
        self.adopt_resident_page(id, group, page, block, true)
    }

    fn adopt_resident_page(
        &mut self,
        id: &str,
        group: usize,
        page: usize,
        block: BlockId,
        pin: bool,
    ) -> Result<bool> {
        let pool = self.coord.pool();
        let n = pool.num_blocks();
        if block >= n {
            return Err(invalid(format!(
                "block {block} is not in the pool of {n} blocks"
            )));
        }
        let slot = self.hisparse_slot(id, group, true)?;
        if block == NULL_BLOCK {
            return Err(invalid(
                "block 0 is the null block; a resident page reads a block the engine pins",
            ));
        }
        let held = pool.engine_refs_of(block);
        let engine = held + u32::from(pin);
        if engine == 0 {
            return Err(invalid(format!(
                "block {block} is not pinned by the engine (ref count {}); take it with \
                 get_new_blocks or touch_blocks before a resident page reads it",
                pool.ref_cnt(block)
            )));
        }
        let others = pool.ref_cnt(block) - held;
        if others > 0 {
            return Err(invalid(format!(
                "block {block} is held by a request or a pending copy ({others} reference(s) \
                 besides the engine's); a resident page reads a block only the engine pins"
            )));
        }
        let row = &self.table.get(slot).groups()[group];
        if page >= row.blocks().len() || row.resident_page(page).is_some() {
            return Ok(false);
        }
        let claimed = self.resident_claims(slot, block);
        if claimed >= engine {
            return Err(invalid(format!(
                "block {block} is read by {claimed} resident page(s) of request {id:?} and \
                 pinned {engine} time(s); each resident page needs its own reference"
            )));
        }
        if pin {
            self.hold_blocks(&[block])?;
        }
        Ok(self.table.get_mut(slot).groups_mut()[group].adopt_page(page, block))
    }

    /// How many pages of the resident rows of the request at `slot` read
    /// `block`, the overlay applied.
    fn resident_claims(&self, slot: u32, block: BlockId) -> u32 {
        let req = self.table.get(slot);
        let groups = self.coord.groups();
        let mut n = 0u32;
        for (g, gb) in req.groups().iter().enumerate() {
            if groups[g].is_hisparse_resident() {
                n += gb.residency_row(0).iter().filter(|&&b| b == block).count() as u32;
            }
        }
        n
    }

    /// The invariant of resident rows, given `request_refs` (the references of
    /// requests' own tables, resident rows left out): every page a resident
    /// row reads, the overlay applied, is a block the engine pins once per
    /// reading page, and no request's table holds it.
    pub(super) fn check_resident_pages(&self, request_refs: &[u32]) -> Result<()> {
        let groups = self.coord.groups();
        if !groups
            .iter()
            .any(crate::single_type::GroupManager::is_hisparse_resident)
        {
            return Ok(());
        }
        let pool = self.coord.pool();
        let n = pool.num_blocks() as usize;
        let mut claims: rustc_hash::FxHashMap<BlockId, u32> = rustc_hash::FxHashMap::default();
        let violation = |m: String| Err(Error::InvariantViolation(m));
        for req in self.table.iter() {
            for (g, gb) in req.groups().iter().enumerate() {
                if !groups[g].is_hisparse_resident() {
                    continue;
                }
                for (page, b) in gb.residency_row(0).into_iter().enumerate() {
                    if b == NULL_BLOCK {
                        continue;
                    }
                    if b as usize >= n {
                        return violation(format!(
                            "resident page {page} of request {:?} reads out-of-range block {b}",
                            req.id
                        ));
                    }
                    if pool.ref_cnt(b) == 0 {
                        return violation(format!(
                            "resident page {page} of request {:?} reads free block {b}",
                            req.id
                        ));
                    }
                    if request_refs[b as usize] > 0 {
                        return violation(format!(
                            "resident page {page} of request {:?} reads block {b}, which a \
                             request holds",
                            req.id
                        ));
                    }
                    *claims.entry(b).or_insert(0) += 1;
                }
            }
        }
        for (b, c) in claims {
            let engine = pool.engine_refs_of(b);
            if c > engine {
                return violation(format!(
                    "resident pages read block {b} {c} time(s) but the engine pins it {engine} \
                     time(s)"
                ));
            }
        }
        Ok(())
    }

    /// Page `page` of the request's resident row in `group` is read from the
    /// host from now on (vLLM's `drop_resident_page`); the block it was read
    /// from, if any. The engine keeps whatever reference it holds on it.
    ///
    /// # Errors
    /// Unknown request; `group` not a resident group.
    pub fn hisparse_drop_page(
        &mut self,
        id: &str,
        group: usize,
        page: usize,
    ) -> Result<Option<BlockId>> {
        Ok(self.hisparse_row_mut(id, group, true)?.drop_page(page))
    }

    /// The device block page `page` of the request's resident row is read
    /// from; `None` when it is read from the host or past the row (vLLM's
    /// `get_resident_page`).
    ///
    /// # Errors
    /// Unknown request; `group` not a resident group.
    pub fn hisparse_resident_page(
        &self,
        id: &str,
        group: usize,
        page: usize,
    ) -> Result<Option<BlockId>> {
        Ok(self.hisparse_row(id, group, true)?.resident_page(page))
    }

    /// The request's resident row from page `start` on, the overlay applied;
    /// host-only pages are the null block (vLLM's `get_residency_row`).
    ///
    /// # Errors
    /// Unknown request; `group` not a resident group.
    pub fn hisparse_residency_row(
        &self,
        id: &str,
        group: usize,
        start: usize,
    ) -> Result<Vec<BlockId>> {
        Ok(self.hisparse_row(id, group, true)?.residency_row(start))
    }

    /// The request takes its hot region in `group` at its next allocation
    /// (vLLM's `require_hot`); until it is freed.
    ///
    /// # Errors
    /// Unknown request; `group` not a hot group.
    pub fn hisparse_require_hot(&mut self, id: &str, group: usize) -> Result<()> {
        self.hisparse_row_mut(id, group, false)?.require_hot();
        Ok(())
    }

    /// Whether the request needs its hot region in `group` (vLLM's
    /// `hot_required`).
    ///
    /// # Errors
    /// Unknown request; `group` not a hot group.
    pub fn hisparse_hot_required(&self, id: &str, group: usize) -> Result<bool> {
        Ok(self.hisparse_row(id, group, false)?.hot_required())
    }

    /// One HiSparse group's fresh blocks for the request, outside a whole
    /// allocation (vLLM's `allocate_new_blocks` called on that group's
    /// manager): a resident row grows to cover `num_tokens` tokens, a hot group
    /// takes its region if required. Returns the new blocks.
    ///
    /// # Errors
    /// Unknown request; `group` not a HiSparse group; fewer free blocks than
    /// needed (nothing taken then).
    pub fn hisparse_allocate_new_blocks(
        &mut self,
        id: &str,
        group: usize,
        num_tokens: u64,
    ) -> Result<Vec<BlockId>> {
        let slot = self.table.slot(id)?;
        let gm = self.group_manager(group)?;
        if !matches!(
            gm.spec().kind,
            AttentionKind::HiSparseResident | AttentionKind::HiSparseHot { .. }
        ) {
            return Err(invalid(format!("group {group} is not a HiSparse group")));
        }
        let req = self.table.get_mut(slot);
        self.coord
            .hisparse_allocate(req, group, num_tokens)
            .ok_or_else(|| {
                invalid(format!(
                    "not enough free blocks for request {id:?} in group {group}"
                ))
            })
    }

    /// Frees the request's blocks in the groups before `until` only (as
    /// [`Self::free`] frees them); a later `free`, `remove_request` or
    /// `pop_blocks_for_free` releases the rest. For an engine that acts at a
    /// group's place in the group order (vLLM's HiSparse coordinator lets go of
    /// the resident pages it pins when the resident group is freed).
    ///
    /// # Errors
    /// Unknown request; `until` past the group count.
    pub fn free_groups_before(&mut self, id: &str, until: usize) -> Result<()> {
        self.check_until(until)?;
        let slot = self.table.slot(id)?;
        let req = self.table.get_mut(slot);
        self.coord.free_groups(req, until);
        Ok(())
    }

    /// [`Self::pop_blocks_for_free`] of the groups before `until` only: their
    /// blocks are detached (the engine returns them with
    /// [`Self::free_blocks`]), the request keeps the rest.
    ///
    /// # Errors
    /// Unknown request; `until` past the group count.
    pub fn pop_blocks_before(&mut self, id: &str, until: usize) -> Result<Vec<BlockId>> {
        self.check_until(until)?;
        let slot = self.table.slot(id)?;
        let req = self.table.get_mut(slot);
        Ok(self.coord.pop_groups(req, until))
    }

    fn check_until(&self, until: usize) -> Result<()> {
        let n = self.coord.groups().len();
        if until > n {
            return Err(invalid(format!("group {until} is past the manager's {n}")));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::BlockHash;
    use crate::request::RequestSpec;
    use crate::spec::{GroupSpec, ManagerConfig};

    /// `[host source (engine-managed), indexer]`, `max_model_len` 32.
    fn mgr() -> KvCacheManager {
        let mut cfg = ManagerConfig::new(
            16,
            vec![
                GroupSpec::new(AttentionKind::EngineManaged, 4),
                GroupSpec::new(AttentionKind::FullAttention, 4),
            ],
            32,
        );
        cfg.external_block_hashes = true;
        cfg.record_stats_at_admission = false;
        let mut m = KvCacheManager::new(cfg).expect("config");
        let spec = RequestSpec {
            prompt_token_ids: (0..10).collect(),
            ..Default::default()
        };
        m.add_request("r", spec).expect("added");
        let hashes: Vec<BlockHash> = (0..2u8)
            .map(|i| BlockHash::from_slice(&[i, 7]).unwrap_or_default())
            .collect();
        m.extend_request("r", (10, 0), &[], &hashes)
            .expect("synced");
        m
    }

    fn lenient(a: AllocateArgs) -> AllocateArgs {
        AllocateArgs {
            vllm_lenient: true,
            ..a
        }
    }

    #[test]
    fn the_step_counts_are_vllms() {
        let m = mgr();
        let a = lenient(AllocateArgs {
            num_new_computed_tokens: 4,
            num_external_computed_tokens: 4,
            num_lookahead_tokens: 30,
            ..AllocateArgs::step(30, 2)
        });
        let s = m
            .hisparse_allocation_step("r", &a, true, false)
            .expect("step");
        assert_eq!(
            s,
            HiSparseStep {
                num_local_computed_tokens: 6,
                total_computed_tokens: 10,
                // vLLM's main-model count is not capped; the slots are.
                num_tokens_main_model: 40,
                num_tokens_need_slot: 32,
                full_num_tokens: 10,
                prefill_end: 10,
                num_tokens_to_cache: 10,
                adopts: true,
            }
        );
        // A group that runs the request already adopts nothing.
        let s = m
            .hisparse_allocation_step("r", &a, true, true)
            .expect("step");
        assert!(!s.adopts);
        let plain = lenient(AllocateArgs::step(3, 0));
        assert!(
            !m.hisparse_allocation_step("r", &plain, false, false)
                .expect("step")
                .adopts
        );
    }

    #[test]
    fn a_step_with_nothing_to_compute_or_adopt_is_refused() {
        let m = mgr();
        let a = lenient(AllocateArgs::step(0, 4));
        let e = m
            .hisparse_allocation_step("r", &a, false, false)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("num_new_tokens must be greater than 0"),
            "{e}"
        );
        assert!(m.hisparse_allocation_step("x", &a, false, false).is_err());
    }
}
