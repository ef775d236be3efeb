//! The decode loop run inside the core, the floor `benches/boundary_bench.py`
//! measures the Python calls against (feature `bench-core-loop`, not in the
//! release wheel).

use pyo3::prelude::*;

use pagedkv_core::RequestRefs;

use crate::errors::{PkResult, borrow_mut};

use super::PyManager;

#[pymethods]
impl PyManager {
    /// Benchmark support (`benches/boundary_bench.py`): `steps` decode steps of
    /// the requests `handles` run inside the core, with no Python per step (per
    /// step one `allocate_slots_batch` of one token each at `first_computed +
    /// step` computed tokens, and one `append_token_ids_batch` of token `i` to
    /// request `i`). Returns the nanoseconds the steps took: the floor the same
    /// calls from Python are compared with, in the same process. Built with
    /// the `bench-core-loop` feature only.
    fn _core_decode_steps(
        slf: &Bound<'_, Self>,
        handles: Vec<u64>,
        steps: u64,
        first_computed: u64,
    ) -> PkResult<u64> {
        let mut this = borrow_mut(slf)?;
        let this = &mut *this;
        let n = handles.len();
        let new = vec![1u64; n];
        let toks: Vec<u32> = (0..n).map(|i| i as u32).collect();
        let mut computed = vec![0u64; n];
        let refs = RequestRefs::Handles(&handles);
        let start = std::time::Instant::now();
        for step in 0..steps {
            computed.fill(first_computed + step);
            this.inner
                .allocate_slots_batch_refs(refs, &new, &computed, 0, &mut this.batch)?;
            this.inner.append_token_ids_batch_refs(refs, &toks)?;
        }
        Ok(u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }
}
