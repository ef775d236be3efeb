//! `PyO3` binding of pagedkv-core (`pagedkv._core`): conversion and error mapping
//! only. Block ids leave as int32 `NumPy` arrays; no per-block Python objects.
//!
//! - [`alloc`]: the module's allocator (mimalloc for blocks below 16 KiB);
//! - [`convert`]: Python arguments to core types, block ids back to arrays
//!   (`convert/`: tokens, ids and hashes, `add_request`'s extras, the
//!   configuration);
//! - [`engine_request`]: an engine's request lists as the core reads them;
//! - [`errors`]: the core's errors to the `pagedkv.errors` exceptions;
//! - [`manager`]: the `KVCacheManager` and `ComputedBlocks` classes (`manager/`:
//!   vLLM's API, `allocate_slots`' arguments, engine calls, HiSparse,
//!   debugging reads, and with the `bench-core-loop` feature the core's decode
//!   loop);
//! - [`events`]: the KV-cache event classes;
//! - [`fork`]: the hash workers across `os.fork`;
//! - [`hash`]: block hashing functions;
//! - [`index`]: the router-side `PrefixIndex`;
//! - [`offload`]: the host-memory offload tier (`OffloadTier`); [`offload_disk`]:
//!   the disk tier below it (`DiskTier`);
//! - [`prepared`]: requests built and hashed off the scheduler's thread.

// PyO3 extracts arguments as owned values (`Vec<Bound<..>>`, `PyRef<..>`).
#![allow(clippy::needless_pass_by_value)]

use pyo3::prelude::*;

mod alloc;
mod convert;
mod engine_request;
mod errors;
mod events;
mod fork;
mod hash;
mod index;
mod manager;
mod offload;
mod offload_disk;
mod prepared;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    manager::register(m)?;
    events::register(m)?;
    hash::register(m)?;
    index::register(m)?;
    prepared::register(m)?;
    offload::register(m)?;
    offload_disk::register(m)?;
    fork::register(m)?;
    alloc::keep_freed_pages();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

#[global_allocator]
static GLOBAL: alloc::ModuleAlloc = alloc::ModuleAlloc;
