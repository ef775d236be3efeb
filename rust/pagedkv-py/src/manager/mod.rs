//! The `KVCacheManager` pyclass over [`KvCacheManager`]: the class, its constructor
//! and properties; its methods by concern in the submodules.
//!
//! Every call converts all its arguments first, then borrows the manager only
//! for the core call (pure Rust: no Python code runs, the GIL stays held), and
//! builds its Python result after the borrow ends. Conversions may run Python
//! code (`__index__`, iterators, torch and `NumPy` scalars) that releases the GIL
//! or calls back into the manager: the manager is free then, so another thread's
//! call waits for the GIL instead of failing, and a callback works.
//!
//! - [`vllm_api`]: vLLM's `KVCacheManager` calls (requests, lookups,
//!   allocation, caching, events and stats);
//! - [`args`]: `allocate_slots`' arguments in, its result out;
//! - [`engine`]: the calls of an engine that owns its requests (sync,
//!   detached and engine-held blocks, partial hits and checkpoints, zeroing);
//! - [`offload`]: the host tier (transfer plans, completions, stats);
//! - [`hisparse`]: the HiSparse resident and hot groups' calls;
//! - [`debug`]: reads for tests and debugging (invariants, the free queue,
//!   the prefix cache's entries);
//! - `bench` (feature `bench-core-loop`): the decode loop run in the core.

mod args;
#[cfg(feature = "bench-core-loop")]
mod bench;
mod debug;
mod engine;
mod hisparse;
mod offload;
mod vllm_api;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use pagedkv_core::pool::{BlockActivityKind, BlockPoolStats};
use pagedkv_core::{BatchAllocation, ComputedBlocks, KvCacheManager};

use crate::convert::{count, groups_i32, groups_tuple, manager_config};
use crate::errors::{PkResult, borrow, borrow_mut, invalid_arg};
use std::sync::OnceLock;

/// Result of `get_computed_blocks`.
#[pyclass(module = "pagedkv._core", name = "ComputedBlocks", frozen)]
#[derive(Debug)]
pub struct PyComputedBlocks {
    inner: ComputedBlocks,
    /// The arrays of `block_ids`, made when first read (a scheduler that only
    /// hands the hit back to `allocate_slots` never reads them).
    block_ids: OnceLock<Py<PyTuple>>,
}

impl PyComputedBlocks {
    /// A hit whose arrays are made when first read; an empty one shares `empty`.
    fn new(py: Python<'_>, inner: ComputedBlocks, empty: &Py<PyTuple>) -> Self {
        let block_ids = OnceLock::new();
        if inner.is_empty() {
            let _ = block_ids.set(empty.clone_ref(py));
        }
        Self { inner, block_ids }
    }
}

#[pymethods]
impl PyComputedBlocks {
    /// Hit block ids per KV-cache group (int32 arrays; the same tuple on every
    /// read).
    #[getter]
    fn block_ids(&self, py: Python<'_>) -> PkResult<Py<PyTuple>> {
        if let Some(t) = self.block_ids.get() {
            return Ok(t.clone_ref(py));
        }
        let made = groups_tuple(py, groups_i32(&self.inner.block_ids))?.unbind();
        Ok(self.block_ids.get_or_init(|| made).clone_ref(py))
    }

    /// Tokens covered by the hit.
    #[getter]
    fn num_computed_tokens(&self) -> u64 {
        self.inner.num_computed_tokens
    }

    /// Position of a shared prefix a sparse-retention group has not cached yet.
    #[getter]
    fn shared_prefix_boundary(&self) -> u64 {
        self.inner.shared_prefix_boundary
    }

    /// Tokens past the device hit whose KV the host tier holds (0 without
    /// one); taken by passing them as `num_external_computed_tokens`.
    #[getter]
    fn num_host_tokens(&self) -> u64 {
        self.inner.num_host_tokens
    }

    fn __repr__(&self) -> String {
        format!(
            "ComputedBlocks(num_computed_tokens={}, num_host_tokens={}, block_ids={:?})",
            self.inner.num_computed_tokens, self.inner.num_host_tokens, self.inner.block_ids
        )
    }
}

/// The pool's block counters (`kv_cache_metrics`).
#[pyclass(module = "pagedkv._core", name = "BlockPoolStats", frozen, get_all)]
#[derive(Debug)]
pub struct PyBlockPoolStats {
    /// Blocks popped from the free queue for requests.
    blocks_allocated: u64,
    /// Prefix-hit blocks taken by requests.
    blocks_accessed: u64,
    /// Cached blocks that lost their cache entry to an eviction.
    blocks_evicted: u64,
    /// Successful prefix-cache resets.
    cache_resets: u64,
}

impl From<BlockPoolStats> for PyBlockPoolStats {
    fn from(s: BlockPoolStats) -> Self {
        Self {
            blocks_allocated: s.blocks_allocated,
            blocks_accessed: s.blocks_accessed,
            blocks_evicted: s.blocks_evicted,
            cache_resets: s.cache_resets,
        }
    }
}

#[pymethods]
impl PyBlockPoolStats {
    fn __repr__(&self) -> String {
        format!(
            "BlockPoolStats(blocks_allocated={}, blocks_accessed={}, blocks_evicted={}, \
             cache_resets={})",
            self.blocks_allocated, self.blocks_accessed, self.blocks_evicted, self.cache_resets
        )
    }
}

/// The Rust KV-cache manager. Use `pagedkv.KVCacheManager`, which builds it from a
/// `KVCacheConfig`.
#[pyclass(module = "pagedkv._core", name = "KVCacheManager", subclass)]
#[derive(Debug)]
pub struct PyManager {
    inner: KvCacheManager,
    /// The result of an allocation without new blocks (one per manager).
    empty: Py<PyTuple>,
    /// Reused output of `allocate_slots_batch`.
    batch: BatchAllocation,
}

#[pymethods]
impl PyManager {
    /// `options` are `ManagerConfig`'s (`pagedkv.ManagerOptions`); unset ones
    /// take the core's defaults.
    #[new]
    #[pyo3(signature = (num_blocks, groups, max_model_len, **options))]
    fn new(
        py: Python<'_>,
        num_blocks: i64,
        groups: Vec<Bound<'_, PyDict>>,
        max_model_len: i64,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PkResult<Self> {
        let cfg = manager_config(num_blocks, &groups, max_model_len, options)?;
        let inner = KvCacheManager::new(cfg)?;
        let empty = groups_tuple(py, vec![Vec::new(); inner.num_groups()])?.unbind();
        Ok(Self {
            inner,
            empty,
            batch: BatchAllocation::default(),
        })
    }

    /// The longest sequence a request may reach.
    #[getter]
    fn max_model_len(&self) -> u64 {
        self.inner.config().max_model_len
    }

    /// Whether prefix caching is on.
    #[getter]
    fn enable_caching(&self) -> bool {
        self.inner.config().enable_caching
    }

    /// The device eviction policy asked for (`eviction`): `"lru"`, `"arc"`
    /// or `"slru"`.
    #[getter]
    fn eviction(&self) -> &'static str {
        self.inner.config().eviction.name()
    }

    /// Whether prefix-cache stats are collected.
    #[getter]
    fn log_stats(&self) -> bool {
        self.inner.config().log_stats
    }

    /// Whether the pool counts and logs block activity (`kv_cache_metrics`).
    #[getter]
    fn kv_cache_metrics(&self) -> bool {
        self.inner.config().kv_cache_metrics
    }

    /// Prefix hits cut short by `verify_cached_tokens`: a cached block whose
    /// tokens or context did not match the request (a hash collision caught).
    #[getter]
    fn verification_failures(&self) -> u64 {
        self.inner.verification_failures()
    }

    /// Prompt blocks whose hashes were found instead of computed: answered by
    /// the `sha256_cbor` memo (`hash_memo_blocks`; in place, on the hash
    /// worker and in the manager's preparers), or taken from a live request
    /// the prompt begins like (in place).
    #[getter]
    fn hash_memo_hits(&self) -> u64 {
        self.inner.hash_memo_counts().0
    }

    /// Prompt blocks the memo was asked for, did not hold, and were hashed.
    #[getter]
    fn hash_memo_misses(&self) -> u64 {
        self.inner.hash_memo_counts().1
    }

    /// KV events dropped, oldest first, because `max_pending_events` were
    /// left undrained.
    #[getter]
    fn num_dropped_events(&self) -> u64 {
        self.inner.num_dropped_events()
    }

    /// Block activity entries dropped, oldest first, because
    /// `max_pending_block_activity` were left undrained.
    #[getter]
    fn num_dropped_block_activity(&self) -> u64 {
        self.inner.num_dropped_block_activity()
    }

    /// Blocks in the free queue (evictable cached blocks included).
    #[getter]
    fn num_free_blocks(&self) -> u32 {
        self.inner.num_free_blocks()
    }

    /// KV-cache usage in [0, 1] (null block excluded).
    #[getter]
    fn usage(&self) -> f64 {
        self.inner.usage()
    }

    /// Number of known requests.
    #[getter]
    fn num_requests(&self) -> usize {
        self.inner.num_requests()
    }

    /// Number of KV-cache groups.
    #[getter]
    fn num_kv_cache_groups(&self) -> usize {
        self.inner.num_groups()
    }

    /// Total blocks in the pool (the null block included).
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.pool().num_blocks()
    }

    /// Token granularity of block hashes.
    #[getter]
    fn hash_block_size(&self) -> usize {
        self.inner.hash_block_size()
    }

    /// The `NONE_HASH` every hash chain starts from.
    #[getter]
    fn none_hash<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.inner.none_hash().as_bytes())
    }

    /// Number of distinct keys in the prefix map.
    #[getter]
    fn num_cached_block_hashes(&self) -> usize {
        self.inner.pool().num_cached_keys()
    }

    fn __contains__(slf: &Bound<'_, Self>, request_id: &str) -> PkResult<bool> {
        Ok(borrow(slf)?.inner.contains(request_id))
    }

    /// Whether the manager reads token ids' values, not only their number: it
    /// hashes them, verifies hits against them or publishes them in events.
    /// One that does not takes a prompt by its length (an int in place of
    /// the ids).
    #[getter]
    fn reads_token_values(&self) -> bool {
        self.inner.reads_token_values()
    }

    /// The first full-attention group looked up, with several groups looked
    /// up; otherwise None.
    #[getter]
    fn full_attention_group(&self) -> Option<u32> {
        self.inner.full_attention_group()
    }

    /// Whether each group's fresh blocks are zeroed by the worker.
    #[getter]
    fn records_new_block_ids(&self) -> Vec<bool> {
        self.inner.records_new_block_ids()
    }

    /// With several groups and prefix caching on, the groups looked up
    /// together, `[(group_ids, use_eagle)]` in lookup order; otherwise None.
    #[getter]
    fn lookup_groups(&self) -> Option<Vec<(Vec<u32>, bool)>> {
        self.inner.lookup_groups()
    }

    /// Whether fine-grained (partial) prefix hits are on.
    #[getter]
    fn partial_hash_hits(&self) -> bool {
        self.inner.partial_hash_hits()
    }

    /// Whether Mamba groups register shared-prefix junction states.
    #[getter]
    fn mamba_shared_prefix_checkpoint(&self) -> bool {
        self.inner.mamba_shared_prefix_checkpoint()
    }

    /// The sparse-retention interval (None: dense); settable.
    #[getter]
    fn prefix_cache_retention_interval(&self) -> Option<u64> {
        self.inner.prefix_cache_retention_interval()
    }

    #[setter]
    fn set_prefix_cache_retention_interval(
        slf: &Bound<'_, Self>,
        interval: Option<i64>,
    ) -> PkResult<()> {
        let interval = interval
            .map(|v| {
                u64::try_from(v).map_err(|_| {
                    pagedkv_core::Error::InvalidArgument(format!(
                        "prefix_cache_retention_interval must be non-negative, got {v}"
                    ))
                })
            })
            .transpose()?;
        Ok(borrow_mut(slf)?
            .inner
            .set_prefix_cache_retention_interval(interval)?)
    }

    /// Block references detached by `pop_blocks_for_free` and not yet freed.
    #[getter]
    fn num_detached_block_refs(&self) -> u64 {
        self.inner.num_detached_block_refs()
    }
}

impl PyManager {
    /// Block ids from any iterable of ints.
    fn id_list(
        slf: &Bound<'_, Self>,
        block_ids: &Bound<'_, PyAny>,
    ) -> PkResult<Vec<pagedkv_core::BlockId>> {
        let items = block_ids.try_iter()?.collect::<PyResult<Vec<_>>>()?;
        crate::convert::block_ids(PyList::new(slf.py(), items)?.as_any())
    }

    /// A non-negative count or index Python passed.
    fn index(name: &str, v: i64) -> PkResult<usize> {
        usize::try_from(count(name, v)?).map_err(|_| invalid_arg(format!("{name} is too large")))
    }

    /// Whether the manager's token ids are signed, and the most token ids
    /// one call may carry (the core's; checked before anything is reserved
    /// for them).
    fn token_limit(slf: &Bound<'_, Self>) -> PkResult<(bool, usize)> {
        let this = borrow(slf)?;
        let cfg = this.inner.config();
        Ok((cfg.signed_token_ids(), cfg.token_limit()))
    }

    /// A lookup result as Python sees it (the shared empty tuple for no hit).
    fn computed(slf: &Bound<'_, Self>, inner: ComputedBlocks) -> PkResult<PyComputedBlocks> {
        let py = slf.py();
        Ok(PyComputedBlocks::new(py, inner, &borrow(slf)?.empty))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyManager>()?;
    m.add_class::<PyComputedBlocks>()?;
    m.add_class::<PyBlockPoolStats>()?;
    for (name, kind) in [
        ("BLOCK_ALLOCATED", BlockActivityKind::Allocated),
        ("BLOCK_ACCESSED", BlockActivityKind::Accessed),
        ("BLOCK_EVICTED", BlockActivityKind::Evicted),
        ("BLOCK_RESET", BlockActivityKind::Reset),
    ] {
        m.add(name, kind as u8)?;
    }
    Ok(())
}

/// A KV-cache group index given from Python.
fn group_index(group: i64) -> Result<usize, pagedkv_core::Error> {
    usize::try_from(group).map_err(|_| {
        pagedkv_core::Error::InvalidArgument(format!("group must be non-negative, got {group}"))
    })
}
