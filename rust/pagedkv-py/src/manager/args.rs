//! `allocate_slots`' arguments as Python passed them, checked into the core's
//! [`AllocateArgs`]; the allocation's result as Python sees it.

use pyo3::prelude::*;
use pyo3::types::PyTuple;

use pagedkv_core::outcome::Allocated;
use pagedkv_core::{AllocateArgs, ComputedBlocks};

use crate::convert::{count, groups_i32, groups_tuple};
use crate::errors::{PkResult, borrow_mut, invalid_arg};

use super::PyManager;

impl PyManager {
    /// The core's `allocate_slots` and its result as int32 arrays per group
    /// (`nothing` when the step took no new block).
    pub(super) fn allocate(
        slf: &Bound<'_, Self>,
        request_id: &str,
        args: &AllocateArgs,
        hit: Option<&ComputedBlocks>,
        nothing: Nothing,
    ) -> PkResult<Option<Py<PyTuple>>> {
        let py = slf.py();
        let groups = {
            let mut this = borrow_mut(slf)?;
            let this = &mut *this;
            match this.inner.allocate_slots_outcome(request_id, args, hit)? {
                Allocated::NoRoom => return Ok(None),
                Allocated::NoNewBlocks => {
                    return Ok(Some(match nothing {
                        Nothing::EmptyGroups => this.empty.clone_ref(py),
                        Nothing::Unit => PyTuple::empty(py).unbind(),
                    }));
                }
                Allocated::NewBlocks(g) => groups_i32(g),
            }
        };
        Ok(Some(groups_tuple(py, groups)?.unbind()))
    }
}

/// How `allocate_slots` and `allocate_slots_synced` show a step that took no
/// new block (the core's [`Allocated::NoNewBlocks`]): their Python APIs differ.
#[derive(Clone, Copy)]
pub(super) enum Nothing {
    /// The shared tuple of one empty id array per group (pagedkv's API).
    EmptyGroups,
    /// `()` (vLLM's adapter tests the result's truth value).
    Unit,
}

/// `allocate_slots`' counts as Python passed them (checked by [`Counts::args`]).
pub(super) struct Counts {
    pub(super) num_new_tokens: i64,
    pub(super) num_computed_tokens: i64,
    pub(super) num_lookahead_tokens: i64,
    pub(super) num_external_computed_tokens: i64,
    pub(super) num_encoder_tokens: i64,
    pub(super) reserved_blocks: i64,
    pub(super) num_in_flight_tokens: i64,
}

/// `allocate_slots`' switches.
#[allow(clippy::struct_excessive_bools)]
pub(super) struct Flags {
    pub(super) delay_cache_blocks: bool,
    pub(super) full_sequence_must_fit: bool,
    pub(super) has_scheduled_reqs: bool,
    pub(super) vllm_lenient: bool,
}

impl Counts {
    /// The core's arguments; a negative count is refused by name. Inlined
    /// (as are the two `with_` builders after it): returned through a
    /// `Result`, the arguments were stored field by field and read back 16
    /// bytes at a time, a failed store-to-load forward on every call (a
    /// running request's `allocate_slots` in the recorded-call replay; see
    /// `docs/perf-log.md`).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(super) fn args(
        &self,
        num_new_computed_tokens: u64,
        f: Flags,
        skip_zeroing: Option<&[i64]>,
    ) -> PkResult<AllocateArgs> {
        let mut skip_zeroing_groups = 0u64;
        for &g in skip_zeroing.unwrap_or(&[]) {
            if !(0..64).contains(&g) {
                return Err(invalid_arg(format!(
                    "skip_zeroing_group_ids: group {g} is out of range"
                )));
            }
            skip_zeroing_groups |= 1 << g;
        }
        Ok(AllocateArgs {
            num_new_tokens: count("num_new_tokens", self.num_new_tokens)?,
            num_computed_tokens: count("num_computed_tokens", self.num_computed_tokens)?,
            num_new_computed_tokens,
            num_lookahead_tokens: count("num_lookahead_tokens", self.num_lookahead_tokens)?,
            num_external_computed_tokens: count(
                "num_external_computed_tokens",
                self.num_external_computed_tokens,
            )?,
            delay_cache_blocks: f.delay_cache_blocks,
            num_encoder_tokens: count("num_encoder_tokens", self.num_encoder_tokens)?,
            full_sequence_must_fit: f.full_sequence_must_fit,
            reserved_blocks: count("reserved_blocks", self.reserved_blocks)?,
            has_scheduled_reqs: f.has_scheduled_reqs,
            num_in_flight_tokens: count("num_in_flight_tokens", self.num_in_flight_tokens)?,
            vllm_lenient: f.vllm_lenient,
            skip_zeroing_groups,
            engine_managed_blocks: 0,
            engine_managed_full_blocks: 0,
            split_at_group: None,
        })
    }
}

/// `engine_managed_blocks=(step, full)` as Python passed it.
pub(super) trait EngineManagedBlocks: Sized {
    fn with_engine_managed_blocks(self, blocks: Option<(i64, i64)>) -> PkResult<Self>;
    fn with_split_at_group(self, group: Option<i64>) -> PkResult<Self>;
}

impl EngineManagedBlocks for AllocateArgs {
    /// The blocks the engine-managed groups take this step and for the whole
    /// request; a negative count is refused by name.
    #[allow(clippy::inline_always)] // measured: see `Counts::args`
    #[inline(always)]
    fn with_engine_managed_blocks(mut self, blocks: Option<(i64, i64)>) -> PkResult<Self> {
        if let Some((step, full)) = blocks {
            self.engine_managed_blocks = count("engine_managed_blocks", step)?;
            self.engine_managed_full_blocks = count("engine_managed_blocks", full)?;
        }
        Ok(self)
    }

    /// `split_at_group` as a group index (the core checks its range).
    #[allow(clippy::inline_always)] // measured: see `Counts::args`
    #[inline(always)]
    fn with_split_at_group(mut self, group: Option<i64>) -> PkResult<Self> {
        if let Some(g) = group {
            self.split_at_group =
                Some(usize::try_from(count("split_at_group", g)?).unwrap_or(usize::MAX));
        }
        Ok(self)
    }
}
