//! The HiSparse resident and hot groups' calls on the pyclass (vLLM's
//! `HiSparseCoordinator` behind `pagedkv.vllm`), and a release stopped at a group.

use numpy::PyArray1;
use pagedkv_core::AllocateArgs;
use pyo3::prelude::*;

use crate::convert::{count, ids_i32};
use crate::errors::{PkResult, borrow, borrow_mut};

use super::PyManager;

#[pymethods]
impl PyManager {
    /// Detaches the request's blocks in the groups before `until` only (the
    /// request keeps the rest); `free_blocks` returns them.
    fn pop_blocks_before<'py>(
        slf: &Bound<'py, Self>,
        request_id: &str,
        until: i64,
    ) -> PkResult<Bound<'py, PyArray1<i32>>> {
        let until = Self::index("until", until)?;
        let ids = borrow_mut(slf)?
            .inner
            .pop_blocks_before(request_id, until)?;
        Ok(PyArray1::from_vec(slf.py(), ids_i32(&ids)))
    }

    /// Frees the request's blocks in the groups before `until` only; a later
    /// `free`, `remove_request` or `pop_blocks_for_free` releases the rest.
    fn free_groups_before(slf: &Bound<'_, Self>, request_id: &str, until: i64) -> PkResult<()> {
        let until = Self::index("until", until)?;
        Ok(borrow_mut(slf)?
            .inner
            .free_groups_before(request_id, until)?)
    }

    /// HiSparse resident group: points host-only page `page` of the request's
    /// row at `block_id` (a device copy the engine pins); False, with nothing
    /// changed, past the row or where the page is resident already. `pin`:
    /// the block is pinned in the same call, when the page adopts it (an
    /// engine that adopts first and pins right after).
    #[pyo3(signature = (request_id, group, page, block_id, *, pin = false))]
    fn hisparse_adopt_page(
        slf: &Bound<'_, Self>,
        request_id: &str,
        group: i64,
        page: i64,
        block_id: i64,
        pin: bool,
    ) -> PkResult<bool> {
        let group = Self::index("group", group)?;
        let page = Self::index("page", page)?;
        let block = crate::convert::block_id(block_id)?;
        let mut this = borrow_mut(slf)?;
        Ok(if pin {
            this.inner
                .hisparse_pin_and_adopt_page(request_id, group, page, block)?
        } else {
            this.inner
                .hisparse_adopt_page(request_id, group, page, block)?
        })
    }

    /// HiSparse resident group: page `page` is read from the host from now
    /// on; the block it was read from, None if none.
    fn hisparse_drop_page(
        slf: &Bound<'_, Self>,
        request_id: &str,
        group: i64,
        page: i64,
    ) -> PkResult<Option<u32>> {
        let group = Self::index("group", group)?;
        let page = Self::index("page", page)?;
        Ok(borrow_mut(slf)?
            .inner
            .hisparse_drop_page(request_id, group, page)?)
    }

    /// HiSparse resident group: the device block page `page` is read from;
    /// None when it is read from the host or past the row.
    fn hisparse_resident_page(
        slf: &Bound<'_, Self>,
        request_id: &str,
        group: i64,
        page: i64,
    ) -> PkResult<Option<u32>> {
        let group = Self::index("group", group)?;
        let page = Self::index("page", page)?;
        Ok(borrow(slf)?
            .inner
            .hisparse_resident_page(request_id, group, page)?)
    }

    /// HiSparse resident group: the request's row from page `start` on, the
    /// residency overlay applied (host-only pages are block 0).
    #[pyo3(signature = (request_id, group, start = 0))]
    fn hisparse_residency_row<'py>(
        slf: &Bound<'py, Self>,
        request_id: &str,
        group: i64,
        start: i64,
    ) -> PkResult<Bound<'py, PyArray1<i32>>> {
        let group = Self::index("group", group)?;
        let start = Self::index("start", start)?;
        let ids = borrow(slf)?
            .inner
            .hisparse_residency_row(request_id, group, start)?;
        Ok(PyArray1::from_vec(slf.py(), ids_i32(&ids)))
    }

    /// HiSparse resident or hot group: the request's fresh blocks in that
    /// group alone (a resident row grows to cover `num_tokens`, a hot group
    /// takes its region if required).
    fn hisparse_allocate_new_blocks<'py>(
        slf: &Bound<'py, Self>,
        request_id: &str,
        group: i64,
        num_tokens: i64,
    ) -> PkResult<Bound<'py, PyArray1<i32>>> {
        let group = Self::index("group", group)?;
        let n = count("num_tokens", num_tokens)?;
        let ids = borrow_mut(slf)?
            .inner
            .hisparse_allocate_new_blocks(request_id, group, n)?;
        Ok(PyArray1::from_vec(slf.py(), ids_i32(&ids)))
    }

    /// HiSparse hot group: the request takes its hot region at its next
    /// allocation.
    fn hisparse_require_hot(slf: &Bound<'_, Self>, request_id: &str, group: i64) -> PkResult<()> {
        let group = Self::index("group", group)?;
        Ok(borrow_mut(slf)?
            .inner
            .hisparse_require_hot(request_id, group)?)
    }

    /// HiSparse hot group: whether the request needs its hot region.
    fn hisparse_hot_required(
        slf: &Bound<'_, Self>,
        request_id: &str,
        group: i64,
    ) -> PkResult<bool> {
        let group = Self::index("group", group)?;
        Ok(borrow(slf)?
            .inner
            .hisparse_hot_required(request_id, group)?)
    }

    /// HiSparse allocation: what one `allocate_slots` step hands vLLM's own
    /// managers of the engine-managed groups, for a request synced first:
    /// `(num_local_computed_tokens, total_computed_tokens,
    /// num_tokens_main_model, num_tokens_need_slot, full_num_tokens,
    /// prefill_end, num_tokens_to_cache, adopts)`. `has_hit`: the step hands
    /// a prefix hit; `engine_runs`: an engine-managed group already runs the
    /// request. Refuses what `allocate_slots_synced` refuses of the counts.
    #[pyo3(signature = (request_id, num_new_tokens, num_computed_tokens,
        num_new_computed_tokens, num_lookahead_tokens, num_external_computed_tokens,
        has_hit, engine_runs))]
    #[allow(
        clippy::too_many_arguments,
        clippy::fn_params_excessive_bools,
        clippy::type_complexity
    )]
    fn hisparse_allocation_step(
        slf: &Bound<'_, Self>,
        request_id: &str,
        num_new_tokens: i64,
        num_computed_tokens: i64,
        num_new_computed_tokens: i64,
        num_lookahead_tokens: i64,
        num_external_computed_tokens: i64,
        has_hit: bool,
        engine_runs: bool,
    ) -> PkResult<(u64, u64, u64, u64, u64, u64, u64, bool)> {
        let args = AllocateArgs {
            num_new_computed_tokens: count("num_new_computed_tokens", num_new_computed_tokens)?,
            num_lookahead_tokens: count("num_lookahead_tokens", num_lookahead_tokens)?,
            num_external_computed_tokens: count(
                "num_external_computed_tokens",
                num_external_computed_tokens,
            )?,
            vllm_lenient: true,
            ..AllocateArgs::step(
                count("num_new_tokens", num_new_tokens)?,
                count("num_computed_tokens", num_computed_tokens)?,
            )
        };
        let s =
            borrow(slf)?
                .inner
                .hisparse_allocation_step(request_id, &args, has_hit, engine_runs)?;
        Ok((
            s.num_local_computed_tokens,
            s.total_computed_tokens,
            s.num_tokens_main_model,
            s.num_tokens_need_slot,
            s.full_num_tokens,
            s.prefill_end,
            s.num_tokens_to_cache,
            s.adopts,
        ))
    }
}
