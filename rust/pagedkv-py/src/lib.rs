//! `PyO3` binding of pagedkv-core (`pagedkv._core`): conversion and error mapping
//! only. Block ids leave as int32 `NumPy` arrays; no per-block Python objects.
//!
//! - [`convert`]: Python arguments to core types, block ids back to arrays;
//! - [`errors`]: the core's errors to the `pagedkv.errors` exceptions;
//! - [`manager`]: the `KVCacheManager` and `ComputedBlocks` classes;
//! - [`events`]: the KV-cache event classes;
//! - [`hash`]: block hashing functions;
//! - [`index`]: the router-side `PrefixIndex`;
//! - [`prepared`]: requests built and hashed off the scheduler's thread.

// PyO3 extracts arguments as owned values (`Vec<Bound<..>>`, `PyRef<..>`).
#![allow(clippy::needless_pass_by_value)]

use pyo3::prelude::*;

mod convert;
mod errors;
mod events;
mod hash;
mod index;
mod manager;
mod prepared;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    manager::register(m)?;
    events::register(m)?;
    hash::register(m)?;
    index::register(m)?;
    prepared::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

/// The module's own heap: the manager's requests (their tokens and block
/// hashes), block lists and result buffers are allocated and freed by
/// mimalloc, not the process's malloc. Its size-class pages keep a request's
/// buffers and its neighbours' close together, so a step that reads a hundred
/// requests' state after the Python scheduler has evicted it from the caches
/// touches fewer lines and pages (the drive trace's critical path ~5 % lower
/// with prompts hashed in place, ~10 % with requests prepared ahead; see
/// BENCHMARKS.md). Only memory Rust allocates goes through it; Python's
/// objects and `NumPy`'s arrays stay on their own allocators. Thread-local
/// state is the dynamic model's, for a module loaded by `dlopen`.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
