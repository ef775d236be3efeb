//! `os.register_at_fork` hooks for the managers' hash workers
//! ([`pagedkv_core::fork`]): before a fork the worker finishes the prompt it
//! is hashing and starts no other; the child hashes what is left itself.

use std::time::Duration;

use pyo3::prelude::*;

/// Waits, the GIL released, until no hash worker runs a job, checking for
/// signals between short waits (Ctrl-C interrupts it; the fork then goes on).
#[pyfunction]
fn _before_fork(py: Python<'_>) -> PyResult<()> {
    loop {
        if py.detach(|| pagedkv_core::fork::prepare(Duration::from_millis(50))) {
            return Ok(());
        }
        py.check_signals()?;
    }
}

/// The parent's workers go on.
#[pyfunction]
fn _after_fork_in_parent() {
    pagedkv_core::fork::parent_resumes();
}

/// The child's managers leave the parent's workers behind.
#[pyfunction]
fn _after_fork_in_child() {
    pagedkv_core::fork::child_starts();
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let before = wrap_pyfunction!(_before_fork, m)?;
    let parent = wrap_pyfunction!(_after_fork_in_parent, m)?;
    let child = wrap_pyfunction!(_after_fork_in_child, m)?;
    let os = m.py().import("os")?;
    if os.hasattr("register_at_fork")? {
        let kwargs = pyo3::types::PyDict::new(m.py());
        kwargs.set_item("before", before)?;
        kwargs.set_item("after_in_parent", parent)?;
        kwargs.set_item("after_in_child", child)?;
        os.call_method("register_at_fork", (), Some(&kwargs))?;
    }
    Ok(())
}
