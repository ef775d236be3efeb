//! The `KVCacheManager` pyclass over [`KvCacheManager`].
//!
//! Every call converts all its arguments first, then borrows the manager only
//! for the core call (pure Rust: no Python code runs, the GIL stays held), and
//! builds its Python result after the borrow ends. Conversions may run Python
//! code (`__index__`, iterators, torch and `NumPy` scalars) that releases the GIL
//! or calls back into the manager: the manager is free then, so another thread's
//! call waits for the GIL instead of failing, and a callback works.

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList, PyTuple};

use pagedkv_core::EngineRequest;
use pagedkv_core::pool::{BlockActivityKind, BlockPoolStats};
use pagedkv_core::{
    AllocateArgs, BatchAllocation, BatchStep, CacheKey, ComputedBlocks, KvCacheManager, Lora,
    RequestRefs,
};

use crate::convert::{
    BatchIds, appended_tokens, block_hash, block_hash_list, count, counts, counts_or_one,
    engine_tokens, groups_i32, groups_tuple, ids_i32, manager_config, prompt_tokens, request_spec,
    tokens,
};
use crate::engine_request::EngineLists;
use crate::errors::{PkResult, borrow, borrow_mut, invalid_arg, type_error};
use crate::events;
use crate::prepared::{PyPreparedRequest, PyRequestPreparer};
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

    fn __repr__(&self) -> String {
        format!(
            "ComputedBlocks(num_computed_tokens={}, block_ids={:?})",
            self.inner.num_computed_tokens, self.inner.block_ids
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

/// `(kinds, block_ids)` of the block activity log.
type ActivityArrays<'py> = (Bound<'py, PyArray1<u8>>, Bound<'py, PyArray1<i32>>);

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

    // ---- configuration and state ---------------------------------------------

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

    // ---- requests --------------------------------------------------------------

    /// Registers a request and hashes its full prompt blocks. Returns the
    /// request's handle: batch calls accept handles in place of ids (no id
    /// lookup); a removed request's handle is refused, never taken for another
    /// request.
    ///
    /// ``mm_features``: ``(identifier, offset, length)`` per multimodal item (or
    /// vLLM ``MultiModalFeatureSpec`` objects). ``prompt_embeds``: a
    /// tensor/array/bytes with one row per prompt token (hashed per block, as
    /// vLLM does). ``skip_reading_prefix_cache``: prompt-logprobs requests never
    /// read the cache. ``session_id``: the client session, published on the
    /// request's events. ``prompt_token_ids`` may be the prompt's length alone
    /// (an int) when the manager does not read token ids
    /// (``reads_token_values`` false: the engine's block hashes, events off).
    #[pyo3(signature = (request_id, prompt_token_ids, *, lora_name = None, lora_path = None,
        lora_id = None, cache_salt = None, mm_features = None, prompt_embeds = None,
        skip_reading_prefix_cache = false, session_id = None))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        slf: &Bound<'_, Self>,
        request_id: &str,
        prompt_token_ids: &Bound<'_, PyAny>,
        lora_name: Option<String>,
        lora_path: Option<String>,
        lora_id: Option<i64>,
        cache_salt: Option<String>,
        mm_features: Option<&Bound<'_, PyAny>>,
        prompt_embeds: Option<&Bound<'_, PyAny>>,
        skip_reading_prefix_cache: bool,
        session_id: Option<String>,
    ) -> PkResult<u64> {
        // A prompt by its length, for a manager that does not read token ids
        // (to one that does, an int is not token ids).
        let counted = if prompt_token_ids.is_exact_instance_of::<PyInt>() {
            if borrow(slf)?.inner.reads_token_values() {
                return Err(type_error(
                    "prompt_token_ids must be a sequence of token ids: this manager reads \
                     them (it hashes them, verifies hits against them or publishes them in \
                     events), so a prompt's length alone will not do",
                ));
            }
            Some(count("prompt length", prompt_token_ids.extract::<i64>()?)?)
        } else {
            None
        };
        // An engine's own token lists may hold vLLM's -1 placeholders.
        let (external, limit) = Self::token_limit(slf)?;
        let prompt_token_ids = match counted {
            Some(_) => Vec::new(),
            None if external => engine_tokens(prompt_token_ids, limit)?,
            None => prompt_tokens(prompt_token_ids, limit)?,
        };
        let spec = request_spec(
            prompt_token_ids,
            Lora::from_parts(lora_name, lora_path, lora_id)?,
            cache_salt,
            mm_features,
            prompt_embeds,
            skip_reading_prefix_cache,
            session_id,
        )?;
        let inner = &mut borrow_mut(slf)?.inner;
        Ok(match counted {
            Some(n) => {
                let n = usize::try_from(n).unwrap_or(usize::MAX);
                inner.add_request_counted(request_id, n, spec)?
            }
            None => inner.add_request(request_id, spec)?,
        })
    }

    /// Whether the manager reads token ids' values, not only their number: it
    /// hashes them, verifies hits against them or publishes them in events.
    /// One that does not takes a prompt by its length (an int in place of
    /// the ids).
    #[getter]
    fn reads_token_values(&self) -> bool {
        self.inner.reads_token_values()
    }

    fn append_token_ids(
        slf: &Bound<'_, Self>,
        request_id: &str,
        token_ids: &Bound<'_, PyAny>,
    ) -> PkResult<()> {
        let t = tokens(token_ids, Self::token_limit(slf)?.1)?;
        Ok(borrow_mut(slf)?.inner.append_token_ids(request_id, &t)?)
    }

    /// Appends one sampled token to each request: `token_ids[i]` to
    /// `request_ids[i]` (one crossing for a whole step's outputs).
    fn append_token_ids_batch(
        slf: &Bound<'_, Self>,
        request_ids: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PkResult<()> {
        let ids = BatchIds::extract(request_ids)?;
        // One token per request (the core refuses any other count); the bound
        // only keeps a lying length from reserving memory.
        let t = tokens(token_ids, ids.len().saturating_add(1 << 10))?;
        let mut this = borrow_mut(slf)?;
        let inner = &mut this.inner;
        Ok(ids.with_refs(|r| inner.append_token_ids_batch_refs(r, &t))?)
    }

    /// Benchmark support (`benches/boundary_bench.py`): `steps` decode steps of
    /// the requests `handles` run inside the core, with no Python per step (per
    /// step one `allocate_slots_batch` of one token each at `first_computed +
    /// step` computed tokens, and one `append_token_ids_batch` of token `i` to
    /// request `i`). Returns the nanoseconds the steps took: the floor the same
    /// calls from Python are compared with, in the same process.
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

    /// A preparer of this manager's requests, for another thread: its
    /// `prepare` builds and hashes a request as `add_request` would, without
    /// the manager; `add_prepared` then registers it.
    fn request_preparer(&self) -> PkResult<PyRequestPreparer> {
        Ok(PyRequestPreparer::new(self.inner.request_preparer()?))
    }

    /// Registers a request a `RequestPreparer` of this manager built; returns
    /// its handle, as `add_request` does. Refused (nothing changes, the
    /// prepared request stays usable): one prepared for another manager, a
    /// known id, one added before.
    fn add_prepared(
        slf: &Bound<'_, Self>,
        prepared: &Bound<'_, PyPreparedRequest>,
    ) -> PkResult<u64> {
        let prepared = prepared.get();
        let mut slot = prepared.lock();
        let Some(p) = slot.as_ref() else {
            return Err(prepared.already_added());
        };
        let mut this = borrow_mut(slf)?;
        this.inner.check_prepared(p)?;
        match slot.take() {
            Some(p) => Ok(this.inner.add_prepared(p)?),
            None => Err(prepared.already_added()),
        }
    }

    /// The handle of a known request (what `add_request` returned): batch calls
    /// accept handles in place of ids and skip the id lookup.
    fn request_handle(slf: &Bound<'_, Self>, request_id: &str) -> PkResult<u64> {
        Ok(borrow(slf)?.inner.request_handle(request_id)?)
    }

    fn free(slf: &Bound<'_, Self>, request_id: &str) -> PkResult<()> {
        Ok(borrow_mut(slf)?.inner.free(request_id)?)
    }

    fn remove_request(slf: &Bound<'_, Self>, request_id: &str) -> PkResult<()> {
        Ok(borrow_mut(slf)?.inner.remove_request(request_id)?)
    }

    // ---- allocation ------------------------------------------------------------

    #[pyo3(signature = (request_id, max_cache_hit_length = None))]
    fn get_computed_blocks(
        slf: &Bound<'_, Self>,
        request_id: &str,
        max_cache_hit_length: Option<i64>,
    ) -> PkResult<PyComputedBlocks> {
        let cap = max_cache_hit_length
            .map(|v| count("max_cache_hit_length", v))
            .transpose()?;
        let inner = borrow_mut(slf)?
            .inner
            .get_computed_blocks_up_to(request_id, cap)?;
        Self::computed(slf, inner)
    }

    /// vLLM's `get_computed_blocks_for_connector`: `(hit, diverged)`. In a
    /// hybrid model with Mamba groups, the full-attention hit even where
    /// another group's own hit is shorter (`diverged`: only a connector
    /// supplying the state there makes it usable).
    #[pyo3(signature = (request_id, max_cache_hit_length = None))]
    fn get_computed_blocks_for_connector(
        slf: &Bound<'_, Self>,
        request_id: &str,
        max_cache_hit_length: Option<i64>,
    ) -> PkResult<(PyComputedBlocks, bool)> {
        let cap = max_cache_hit_length
            .map(|v| count("max_cache_hit_length", v))
            .transpose()?;
        let r = borrow_mut(slf)?
            .inner
            .get_computed_blocks_for_connector(request_id, cap)?;
        Ok((Self::computed(slf, r.hit)?, r.diverged))
    }

    /// vLLM's `find_longest_cache_hit_per_group` for these block hashes:
    /// `(block_ids per group, hit tokens per group)`, each group searched on
    /// its own; None unless several groups are looked up.
    fn find_longest_cache_hit_per_group<'py>(
        slf: &Bound<'py, Self>,
        block_hashes: &Bound<'py, PyAny>,
        max_cache_hit_length: i64,
    ) -> PkResult<Option<(Bound<'py, PyTuple>, Vec<u64>)>> {
        let hashes = block_hash_list(block_hashes, Self::token_limit(slf)?.1)?;
        let cap = count("max_cache_hit_length", max_cache_hit_length)?;
        let found = borrow(slf)?
            .inner
            .find_longest_cache_hit_per_group(&hashes, cap);
        found
            .map(|(blocks, hits)| Ok((groups_tuple(slf.py(), groups_i32(&blocks))?, hits)))
            .transpose()
    }

    /// The first full-attention group looked up, with several groups looked
    /// up; otherwise None.
    #[getter]
    fn full_attention_group(&self) -> Option<u32> {
        self.inner.full_attention_group()
    }

    /// vLLM 0.33's `allocate_slots`: the newly allocated block ids per group, or
    /// None when they do not fit. `num_new_computed_tokens` defaults to the hit's.
    #[pyo3(signature = (request_id, num_new_tokens, *, num_computed_tokens, num_new_computed_tokens = None,
        new_computed_blocks = None, num_lookahead_tokens = 0, num_external_computed_tokens = 0,
        delay_cache_blocks = false, num_encoder_tokens = 0, full_sequence_must_fit = false,
        reserved_blocks = 0, has_scheduled_reqs = true, num_in_flight_tokens = 0,
        vllm_lenient = false, skip_zeroing_group_ids = None, engine_managed_blocks = None,
        split_at_group = None))]
    #[allow(clippy::too_many_arguments, clippy::fn_params_excessive_bools)]
    fn allocate_slots(
        slf: &Bound<'_, Self>,
        request_id: &str,
        num_new_tokens: i64,
        num_computed_tokens: i64,
        num_new_computed_tokens: Option<i64>,
        new_computed_blocks: Option<PyRef<'_, PyComputedBlocks>>,
        num_lookahead_tokens: i64,
        num_external_computed_tokens: i64,
        delay_cache_blocks: bool,
        num_encoder_tokens: i64,
        full_sequence_must_fit: bool,
        reserved_blocks: i64,
        has_scheduled_reqs: bool,
        num_in_flight_tokens: i64,
        vllm_lenient: bool,
        skip_zeroing_group_ids: Option<Vec<i64>>,
        engine_managed_blocks: Option<(i64, i64)>,
        split_at_group: Option<i64>,
    ) -> PkResult<Option<Py<PyTuple>>> {
        let hit = new_computed_blocks.as_ref().map(|h| &h.inner);
        let num_new_computed_tokens = num_new_computed_tokens
            .map(|v| count("num_new_computed_tokens", v))
            .transpose()?;
        let args = Counts {
            num_new_tokens,
            num_computed_tokens,
            num_lookahead_tokens,
            num_external_computed_tokens,
            num_encoder_tokens,
            reserved_blocks,
            num_in_flight_tokens,
        }
        .args(
            AllocateArgs::num_new_computed_tokens_or_hit(num_new_computed_tokens, hit),
            Flags {
                delay_cache_blocks,
                full_sequence_must_fit,
                has_scheduled_reqs,
                vllm_lenient,
            },
            skip_zeroing_group_ids.as_deref(),
        )?
        .with_engine_managed_blocks(engine_managed_blocks)?
        .with_split_at_group(split_at_group)?;
        Self::allocate(slf, request_id, &args, hit, Nothing::EmptyGroups)
    }

    /// Completes an allocation split at a group (`split_at_group`): fresh
    /// blocks for the groups from the split on, then the caching the first
    /// call left. Returns the new block ids per group.
    fn finish_allocation<'py>(
        slf: &Bound<'py, Self>,
        request_id: &str,
    ) -> PkResult<Bound<'py, PyTuple>> {
        let groups = groups_i32(borrow_mut(slf)?.inner.finish_allocation(request_id)?);
        Ok(groups_tuple(slf.py(), groups)?)
    }

    /// vLLM's `allocate_slots` for an engine that owns its requests, in one
    /// crossing: `sync_request(request_id, token_ids, block_hashes,
    /// shared_prefix_boundary, num_prompt_tokens=num_prompt_tokens)`, then
    /// `allocate_slots` with vLLM's answers (`vllm_lenient`). Arguments are
    /// positional, in vLLM's order. Returns
    /// None when the blocks do not fit, `()` when nothing was allocated, else
    /// the new block ids per group.
    #[pyo3(signature = (request_id, token_ids, block_hashes, shared_prefix_boundary,
        num_new_tokens, num_computed_tokens, num_new_computed_tokens, new_computed_blocks,
        num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
        num_encoder_tokens, full_sequence_must_fit, reserved_blocks, has_scheduled_reqs,
        num_in_flight_tokens, skip_zeroing_group_ids, num_prompt_tokens = None, /, *,
        engine_managed_blocks = None, split_at_group = None))]
    #[allow(clippy::too_many_arguments, clippy::fn_params_excessive_bools)]
    fn allocate_slots_synced(
        slf: &Bound<'_, Self>,
        request_id: &str,
        token_ids: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        shared_prefix_boundary: i64,
        num_new_tokens: i64,
        num_computed_tokens: i64,
        num_new_computed_tokens: i64,
        new_computed_blocks: Option<PyRef<'_, PyComputedBlocks>>,
        num_lookahead_tokens: i64,
        num_external_computed_tokens: i64,
        delay_cache_blocks: bool,
        num_encoder_tokens: i64,
        full_sequence_must_fit: bool,
        reserved_blocks: i64,
        has_scheduled_reqs: bool,
        num_in_flight_tokens: i64,
        skip_zeroing_group_ids: Option<Vec<i64>>,
        num_prompt_tokens: Option<i64>,
        engine_managed_blocks: Option<(i64, i64)>,
        split_at_group: Option<i64>,
    ) -> PkResult<Option<Py<PyTuple>>> {
        let args = Counts {
            num_new_tokens,
            num_computed_tokens,
            num_lookahead_tokens,
            num_external_computed_tokens,
            num_encoder_tokens,
            reserved_blocks,
            num_in_flight_tokens,
        }
        .args(
            count("num_new_computed_tokens", num_new_computed_tokens)?,
            Flags {
                delay_cache_blocks,
                full_sequence_must_fit,
                has_scheduled_reqs,
                vllm_lenient: true,
            },
            skip_zeroing_group_ids.as_deref(),
        )?
        .with_engine_managed_blocks(engine_managed_blocks)?
        .with_split_at_group(split_at_group)?;
        let spb = count("shared_prefix_boundary", shared_prefix_boundary)?;
        Self::sync(
            slf,
            request_id,
            token_ids,
            block_hashes,
            spb,
            num_prompt_tokens,
        )?;
        let hit = new_computed_blocks.as_ref().map(|h| &h.inner);
        // Nothing allocated (most decode steps): `()`, which the caller tells
        // apart by its truth value alone.
        Self::allocate(slf, request_id, &args, hit, Nothing::Unit)
    }

    /// One step of many running requests in one call: the same result as
    /// `allocate_slots` for each in order until the first that does not fit.
    /// `num_new_tokens` is one count per request, or one for all.
    /// `num_computed_tokens` None: each request's count as the manager tracks
    /// it, what its last allocated step scheduled through (its computed tokens
    /// plus the tokens it scheduled: the engine ran them all), so a decode step
    /// `allocate_slots_batch(handles, 1)` needs no per-request list.
    /// `append_token_ids`: the token each request sampled since its last step
    /// (None or a negative value for none), appended before anything is
    /// allocated: the step's `append_token_ids_batch` in the same call.
    /// Returns `(num_allocated, ((block_ids, offsets), ...))` per group, where
    /// request `i`'s new blocks are `block_ids[offsets[i]:offsets[i+1]]`.
    #[pyo3(signature = (request_ids, num_new_tokens, num_computed_tokens = None, *, num_lookahead_tokens = 0, append_token_ids = None))]
    fn allocate_slots_batch<'py>(
        slf: &Bound<'py, Self>,
        request_ids: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
        num_computed_tokens: Option<&Bound<'py, PyAny>>,
        num_lookahead_tokens: i64,
        append_token_ids: Option<&Bound<'py, PyAny>>,
    ) -> PkResult<(usize, Bound<'py, PyTuple>)> {
        let ids = BatchIds::extract(request_ids)?;
        let n = ids.len();
        let new = counts_or_one("num_new_tokens", num_new_tokens, n)?;
        let computed = num_computed_tokens
            .filter(|c| !c.is_none())
            .map(|c| counts("num_computed_tokens", c))
            .transpose()?;
        let look = count("num_lookahead_tokens", num_lookahead_tokens)?;
        let append = append_token_ids
            .filter(|t| !t.is_none())
            .map(|t| appended_tokens(t, n))
            .transpose()?;
        let (num_allocated, per_group) = {
            let mut this = borrow_mut(slf)?;
            let this = &mut *this;
            let (inner, batch) = (&mut this.inner, &mut this.batch);
            ids.with_refs(|refs| {
                let step = BatchStep {
                    num_lookahead_tokens: look,
                    append_token_ids: append.as_deref(),
                    ..BatchStep::new(refs, &new, computed.as_deref())
                };
                inner.allocate_slots_batch_step(&step, batch)
            })?;
            let b = &this.batch;
            let per_group: Vec<(Vec<i32>, Vec<i32>)> = b
                .block_ids
                .iter()
                .zip(&b.offsets)
                .map(|(ids, off)| (ids_i32(ids), off.iter().map(|&x| x as i32).collect()))
                .collect();
            (b.num_allocated, per_group)
        };
        let py = slf.py();
        let per_group = PyTuple::new(
            py,
            per_group.into_iter().map(|(ids, off)| {
                (
                    PyArray1::from_slice(py, &ids),
                    PyArray1::from_slice(py, &off),
                )
            }),
        )?;
        Ok((num_allocated, per_group))
    }

    fn get_block_ids<'py>(
        slf: &Bound<'py, Self>,
        request_id: &str,
    ) -> PkResult<Bound<'py, PyTuple>> {
        let groups = groups_i32(&borrow(slf)?.inner.block_ids(request_id)?);
        Ok(groups_tuple(slf.py(), groups)?)
    }

    /// One group's block ids of the request, as a list (no array per group).
    fn group_block_ids<'py>(
        slf: &Bound<'py, Self>,
        request_id: &str,
        group: i64,
    ) -> PkResult<Bound<'py, PyList>> {
        let group = Self::index("group", group)?;
        let this = borrow(slf)?;
        let groups = this.inner.block_ids(request_id)?;
        let ids = groups.get(group).ok_or_else(|| {
            crate::errors::invalid_arg(format!(
                "group {group} is past the manager's {}",
                groups.len()
            ))
        })?;
        Ok(PyList::new(slf.py(), ids.iter().copied())?)
    }

    fn block_hashes<'py>(slf: &Bound<'py, Self>, request_id: &str) -> PkResult<Bound<'py, PyList>> {
        let hashes = borrow(slf)?.inner.block_hashes(request_id)?.to_vec();
        let py = slf.py();
        Ok(PyList::new(
            py,
            hashes.iter().map(|h| PyBytes::new(py, h.as_bytes())),
        )?)
    }

    fn num_tokens(slf: &Bound<'_, Self>, request_id: &str) -> PkResult<usize> {
        Ok(borrow(slf)?.inner.num_tokens(request_id)?)
    }

    fn num_prompt_tokens(slf: &Bound<'_, Self>, request_id: &str) -> PkResult<usize> {
        Ok(borrow(slf)?.inner.num_prompt_tokens(request_id)?)
    }

    fn num_preemptions(slf: &Bound<'_, Self>, request_id: &str) -> PkResult<u32> {
        Ok(borrow(slf)?.inner.num_preemptions(request_id)?)
    }

    fn cache_blocks(
        slf: &Bound<'_, Self>,
        request_id: &str,
        num_computed_tokens: i64,
    ) -> PkResult<()> {
        let n = count("num_computed_tokens", num_computed_tokens)?;
        Ok(borrow_mut(slf)?.inner.cache_blocks(request_id, n)?)
    }

    fn remove_skipped_blocks(
        slf: &Bound<'_, Self>,
        request_id: &str,
        total_computed_tokens: i64,
    ) -> PkResult<()> {
        let n = count("total_computed_tokens", total_computed_tokens)?;
        Ok(borrow_mut(slf)?
            .inner
            .remove_skipped_blocks(request_id, n)?)
    }

    fn get_num_common_prefix_blocks(slf: &Bound<'_, Self>, request_id: &str) -> PkResult<Vec<u32>> {
        Ok(borrow(slf)?
            .inner
            .get_num_common_prefix_blocks(request_id)?)
    }

    // ---- an engine that owns its requests (external_block_hashes) ---------------

    /// Brings a request up to date with the engine's view of it: `token_ids`
    /// and `block_hashes` are the request's whole lists. Where they only grew,
    /// the last hash held (and, with events on, the last block's tokens) is
    /// checked and the new items are read; where the engine rewrote them, the
    /// request is cut back to the first difference and re-read from there (a
    /// rewrite below a block the request has cached is refused). Returns
    /// whether it was cut back. `shared_prefix_boundary`: the engine's pin for
    /// sparse-retention groups; `num_prompt_tokens`: the prompt's length now
    /// (vLLM's streaming sessions grow it). vLLM's request fields both.
    #[pyo3(signature = (request_id, token_ids, block_hashes, shared_prefix_boundary = 0, *, num_prompt_tokens = None))]
    fn sync_request(
        slf: &Bound<'_, Self>,
        request_id: &str,
        token_ids: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        shared_prefix_boundary: i64,
        num_prompt_tokens: Option<i64>,
    ) -> PkResult<bool> {
        let spb = count("shared_prefix_boundary", shared_prefix_boundary)?;
        Self::sync(
            slf,
            request_id,
            token_ids,
            block_hashes,
            spb,
            num_prompt_tokens,
        )
    }

    /// Detaches the request's blocks (allocation order) and forgets the request;
    /// the blocks stay referenced until `free_blocks` returns them.
    fn pop_blocks_for_free<'py>(
        slf: &Bound<'py, Self>,
        request_id: &str,
    ) -> PkResult<Bound<'py, PyArray1<i32>>> {
        let ids = borrow_mut(slf)?.inner.pop_blocks_for_free(request_id)?;
        Ok(PyArray1::from_vec(slf.py(), ids_i32(&ids)))
    }

    /// Caches blocks the engine holds and filled with the request's tokens:
    /// `block_ids[i]` holds the request's block `i` in group `group`; blocks
    /// `num_cached_blocks` to `num_full_blocks` go into the prefix cache under
    /// the request's hashes, with one `BlockStored` (vLLM's
    /// `BlockPool.cache_full_blocks`); `mask`, one entry per block of the
    /// range, skips the blocks it marks false.
    #[pyo3(signature = (request_id, group, block_ids, num_cached_blocks, num_full_blocks, mask = None))]
    fn cache_detached_blocks(
        slf: &Bound<'_, Self>,
        request_id: &str,
        group: i64,
        block_ids: &Bound<'_, PyAny>,
        num_cached_blocks: i64,
        num_full_blocks: i64,
        mask: Option<Vec<bool>>,
    ) -> PkResult<()> {
        let ids = crate::convert::block_ids(block_ids)?;
        let group = Self::index("group", group)?;
        let from = Self::index("num_cached_blocks", num_cached_blocks)?;
        let to = Self::index("num_full_blocks", num_full_blocks)?;
        Ok(borrow_mut(slf)?.inner.cache_detached_blocks(
            request_id,
            group,
            &ids,
            (from, to),
            mask.as_deref(),
        )?)
    }

    /// Makes a block the engine holds reachable from the request's prefix
    /// boundary of `num_tokens` tokens in `group` (a partial entry, vLLM's
    /// `BlockPool.cache_partial_block`); `replace_existing` drops the block's
    /// entries first. Returns the entry's `(hash, group)`, None for the null
    /// block.
    #[pyo3(signature = (request_id, group, block_id, num_tokens, *, replace_existing = false))]
    fn cache_detached_partial_block<'py>(
        slf: &Bound<'py, Self>,
        request_id: &str,
        group: i64,
        block_id: i64,
        num_tokens: i64,
        replace_existing: bool,
    ) -> PkResult<Option<(Bound<'py, PyBytes>, u32)>> {
        let group = Self::index("group", group)?;
        let block = crate::convert::block_id(block_id)?;
        let n = Self::index("num_tokens", num_tokens)?;
        let key = borrow_mut(slf)?.inner.cache_detached_partial_block(
            request_id,
            group,
            block,
            n,
            replace_existing,
        )?;
        Ok(key.map(|k| (PyBytes::new(slf.py(), k.hash.as_bytes()), k.group)))
    }

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

    /// Returns detached blocks to the pool, the first evicted first.
    fn free_blocks(slf: &Bound<'_, Self>, block_ids: &Bound<'_, PyAny>) -> PkResult<()> {
        let ids = Self::id_list(slf, block_ids)?;
        Ok(borrow_mut(slf)?.inner.free_blocks(&ids)?)
    }

    /// Takes one more reference on each block for the engine (vLLM's
    /// `BlockPool.touch`); `free_blocks` or `unpin_blocks` returns it.
    fn touch_blocks(slf: &Bound<'_, Self>, block_ids: &Bound<'_, PyAny>) -> PkResult<()> {
        let ids = Self::id_list(slf, block_ids)?;
        Ok(borrow_mut(slf)?.inner.touch_blocks(&ids)?)
    }

    /// Returns engine-held references whose blocks stay readable until the pool
    /// reuses them (vLLM's `BlockPool.unpin_blocks`): evicted last, reported
    /// by `take_reused_blocks` once handed out again.
    fn unpin_blocks(slf: &Bound<'_, Self>, block_ids: &Bound<'_, PyAny>) -> PkResult<()> {
        let ids = Self::id_list(slf, block_ids)?;
        Ok(borrow_mut(slf)?.inner.unpin_blocks(&ids)?)
    }

    /// The unpinned blocks handed out again (or wiped by a reset) since the
    /// last call, in that order.
    fn take_reused_blocks<'py>(slf: &Bound<'py, Self>) -> PkResult<Bound<'py, PyArray1<i32>>> {
        let ids = borrow_mut(slf)?.inner.take_reused_blocks();
        Ok(PyArray1::from_vec(slf.py(), ids_i32(&ids)))
    }

    /// Takes `n` blocks from the free queue for the engine's own use (they count
    /// as detached until `free_blocks`); None when fewer are free.
    fn get_new_blocks<'py>(
        slf: &Bound<'py, Self>,
        n: i64,
    ) -> PkResult<Option<Bound<'py, PyArray1<i32>>>> {
        let n = u32::try_from(n)
            .map_err(|_| crate::errors::invalid_arg(format!("n must be in 0..2**32, got {n}")))?;
        let ids = borrow_mut(slf)?.inner.get_new_blocks(n);
        Ok(ids.map(|ids| PyArray1::from_vec(slf.py(), ids_i32(&ids))))
    }

    /// Sets how many free blocks the pool counts as free (vLLM's
    /// `free_block_queue.num_free_blocks = n`, which its tests write to make
    /// the pool look full); the rest are withheld until it is set again. At
    /// most the blocks in the free queue.
    fn set_num_free_blocks(slf: &Bound<'_, Self>, n: i64) -> PkResult<()> {
        let n = u32::try_from(n)
            .map_err(|_| crate::errors::invalid_arg(format!("n must be in 0..2**32, got {n}")))?;
        Ok(borrow_mut(slf)?.inner.set_num_free_blocks(n)?)
    }

    /// Leading blocks of the request already cached, per group (None where it
    /// has not run yet).
    fn num_cached_blocks(slf: &Bound<'_, Self>, request_id: &str) -> PkResult<Vec<Option<usize>>> {
        Ok(borrow(slf)?.inner.num_cached_blocks(request_id)?)
    }

    /// Block references detached by `pop_blocks_for_free` and not yet freed.
    #[getter]
    fn num_detached_block_refs(&self) -> u64 {
        self.inner.num_detached_block_refs()
    }

    /// A prefix hit named by block ids per group (a hit an engine kept as block
    /// objects), checked against the request's cached blocks unless
    /// `check_cached=False` (the engine vouches for them).
    #[pyo3(signature = (request_id, block_ids, num_computed_tokens, *, check_cached = true))]
    fn computed_blocks_from_ids(
        slf: &Bound<'_, Self>,
        request_id: &str,
        block_ids: &Bound<'_, PyAny>,
        num_computed_tokens: i64,
        check_cached: bool,
    ) -> PkResult<PyComputedBlocks> {
        let py = slf.py();
        let mut groups = Vec::new();
        for g in block_ids.try_iter()? {
            groups.push(crate::convert::block_ids(&g?)?);
        }
        let n = count("num_computed_tokens", num_computed_tokens)?;
        let (inner, empty) = {
            let this = borrow(slf)?;
            (
                this.inner
                    .computed_blocks_from_ids(request_id, groups, n, check_cached)?,
                this.empty.clone_ref(py),
            )
        };
        Ok(PyComputedBlocks::new(py, inner, &empty))
    }

    /// vLLM's `coordinator.get_num_blocks_to_allocate` without a new hit, for a
    /// known request or (None) one holding no blocks.
    #[pyo3(signature = (request_id, num_tokens, *, total_computed_tokens, num_tokens_main_model,
        num_encoder_tokens = 0, apply_admission_cap = false, num_local_computed_tokens = None))]
    #[allow(clippy::too_many_arguments)]
    fn num_blocks_to_allocate(
        slf: &Bound<'_, Self>,
        request_id: Option<&str>,
        num_tokens: i64,
        total_computed_tokens: i64,
        num_tokens_main_model: i64,
        num_encoder_tokens: i64,
        apply_admission_cap: bool,
        num_local_computed_tokens: Option<i64>,
    ) -> PkResult<u64> {
        let n = count("num_tokens", num_tokens)?;
        let c = count("total_computed_tokens", total_computed_tokens)?;
        let local = match num_local_computed_tokens {
            Some(v) => count("num_local_computed_tokens", v)?,
            None => c,
        };
        let m = count("num_tokens_main_model", num_tokens_main_model)?;
        let e = count("num_encoder_tokens", num_encoder_tokens)?;
        Ok(borrow(slf)?.inner.num_blocks_to_allocate(
            request_id,
            n,
            (c, local),
            m,
            e,
            apply_admission_cap,
        )?)
    }

    /// A free block's neighbours in the free queue, `(previous, next)`, -1 at
    /// either end; None for a block not in the queue. `block_id=-1`: the
    /// queue's `(head, tail)` (-1, -1 when empty).
    fn free_neighbors(slf: &Bound<'_, Self>, block_id: i64) -> PkResult<Option<(i64, i64)>> {
        let this = borrow(slf)?;
        let pool = this.inner.pool();
        let end = |x: Option<u32>| x.map_or(-1, i64::from);
        if block_id == -1 {
            return Ok(Some(
                pool.free_queue_ends()
                    .map_or((-1, -1), |(h, t)| (i64::from(h), i64::from(t))),
            ));
        }
        let id = pool.block_id(block_id)?;
        Ok(pool.free_neighbors(id).map(|(p, n)| (end(p), end(n))))
    }

    /// vLLM's `estimate_cached_tokens` for a request: the fewest, over the
    /// cacheable groups, of the most prefix tokens any of its blocks is cached
    /// for.
    fn estimate_cached_tokens(slf: &Bound<'_, Self>, request_id: &str) -> PkResult<u64> {
        Ok(borrow(slf)?.inner.estimate_cached_tokens(request_id)?)
    }

    /// Drains the block copies queued since the last call as `[(source, copy)]`;
    /// both endpoints of each stay referenced (detached) until `free_blocks`
    /// returns them once the copy has run.
    fn take_block_copies(slf: &Bound<'_, Self>) -> PkResult<Vec<(u32, u32)>> {
        Ok(borrow_mut(slf)?.inner.take_block_copies())
    }

    /// Drains the committed Mamba boundary states offered since the last call,
    /// as `[(request_id, group, block_id, boundary_tokens)]`.
    fn take_boundary_state_offloads(
        slf: &Bound<'_, Self>,
    ) -> PkResult<Vec<(String, u32, u32, u64)>> {
        Ok(borrow_mut(slf)?.inner.take_boundary_state_offloads())
    }

    /// The boundaries a finishing request registered inside its running Mamba
    /// state blocks, `[(group, block_id, boundary_tokens)]`, when nothing was
    /// forwarded past them.
    fn finalize_partial_tail_offloads(
        slf: &Bound<'_, Self>,
        request_id: &str,
        num_computed_tokens: i64,
        num_in_flight_tokens: i64,
    ) -> PkResult<Vec<(u32, u32, u64)>> {
        let (c, f) = (
            count("num_computed_tokens", num_computed_tokens)?,
            count("num_in_flight_tokens", num_in_flight_tokens)?,
        );
        Ok(borrow_mut(slf)?
            .inner
            .finalize_partial_tail_offloads(request_id, c, f)?)
    }

    /// Drains the blocks the worker must zero before use, listed since the last
    /// call (all groups in group order, or group `group` only): fresh blocks of
    /// attention groups under `zero_new_blocks`, and copy-on-write copies.
    #[pyo3(signature = (group = None))]
    fn take_new_block_ids(slf: &Bound<'_, Self>, group: Option<i64>) -> PkResult<Vec<u32>> {
        let group = group
            .map(|g| {
                u32::try_from(g).map_err(|_| invalid_arg(format!("group {g} is out of range")))
            })
            .transpose()?;
        Ok(borrow_mut(slf)?.inner.take_new_block_ids(group)?)
    }

    /// Lists the request's blocks from `start_token` (a multiple of the block
    /// size) on for zeroing again, in every group that zeroes.
    fn record_blocks_for_zeroing(
        slf: &Bound<'_, Self>,
        request_id: &str,
        start_token: i64,
    ) -> PkResult<()> {
        let start = count("start_token", start_token)?;
        Ok(borrow_mut(slf)?
            .inner
            .record_blocks_for_zeroing(request_id, start)?)
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

    /// The request's pending copy-on-write in group `group`: `(index, block)`
    /// of a prefix hit ending inside that block, or None.
    fn partial_hit(
        slf: &Bound<'_, Self>,
        request_id: &str,
        group: i64,
    ) -> PkResult<Option<(usize, u32)>> {
        Ok(borrow(slf)?
            .inner
            .partial_hit(request_id, group_index(group)?)?)
    }

    /// The prefill checkpoint the request's last allocation reserved in Mamba
    /// group `group`: `(position, block column)`, or None.
    fn mamba_checkpoint(
        slf: &Bound<'_, Self>,
        request_id: &str,
        group: i64,
    ) -> PkResult<Option<(u64, usize)>> {
        Ok(borrow(slf)?
            .inner
            .mamba_checkpoint(request_id, group_index(group)?)?)
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

    /// Prefix tokens the cached block's hash covers, or None if not cached.
    fn cached_block_num_tokens(slf: &Bound<'_, Self>, block_id: i64) -> PkResult<Option<u32>> {
        let this = borrow(slf)?;
        let pool = this.inner.pool();
        let id = pool.block_id(block_id)?;
        Ok(pool.block_key(id).and_then(|_| pool.primary_tokens(id)))
    }

    /// Records one admitted request's lookup in the prefix-cache stats.
    fn record_prefix_cache_stats(
        slf: &Bound<'_, Self>,
        num_tokens: i64,
        num_hits: i64,
        preempted: bool,
    ) -> PkResult<()> {
        let (t, h) = (
            count("num_tokens", num_tokens)?,
            count("num_hits", num_hits)?,
        );
        Ok(borrow_mut(slf)?
            .inner
            .record_prefix_cache_stats(t, h, preempted)?)
    }

    /// The stats since the last `make_prefix_cache_stats`, not reset (the tuple
    /// of `_make_prefix_cache_stats`).
    #[allow(clippy::type_complexity)]
    fn _prefix_cache_stats(
        slf: &Bound<'_, Self>,
    ) -> PkResult<Option<(bool, u64, u64, u64, u64, u64, u64)>> {
        Ok(borrow(slf)?.inner.prefix_cache_stats().map(stats_tuple))
    }

    // ---- cache maintenance -----------------------------------------------------

    fn evict_blocks(slf: &Bound<'_, Self>, block_ids: &Bound<'_, PyAny>) -> PkResult<()> {
        let items = block_ids.try_iter()?.collect::<PyResult<Vec<_>>>()?;
        let ids = crate::convert::block_ids(PyList::new(slf.py(), items)?.as_any())?;
        Ok(borrow_mut(slf)?.inner.evict_blocks(&ids)?)
    }

    fn reset_prefix_cache(slf: &Bound<'_, Self>) -> PkResult<bool> {
        Ok(borrow_mut(slf)?.inner.reset_prefix_cache())
    }

    fn new_step_starts(slf: &Bound<'_, Self>) -> PkResult<()> {
        borrow_mut(slf)?.inner.new_step_starts();
        Ok(())
    }

    // ---- events, stats, metrics ------------------------------------------------

    /// KV-cache events recorded and not yet drained.
    #[getter]
    fn num_pending_events(&self) -> usize {
        self.inner.num_pending_events()
    }

    /// Drains the recorded KV-cache events (empty when events are off). Block
    /// hashes are vLLM's 64-bit ints (the digest's last 8 bytes, big-endian), or
    /// the full digest bytes with `raw_hashes`.
    #[pyo3(signature = (*, raw_hashes = false))]
    fn take_events<'py>(slf: &Bound<'py, Self>, raw_hashes: bool) -> PkResult<Bound<'py, PyList>> {
        let mut m = borrow_mut(slf)?;
        // An engine's token ids are signed (see `engine_tokens`).
        let signed = m.inner.config().external_block_hashes;
        let evs = m.inner.take_events();
        drop(m);
        Ok(events::to_python(slf.py(), evs, raw_hashes, signed)?)
    }

    /// `(reset, requests, queries, hits, preempted_requests, preempted_queries,
    /// preempted_hits)` since the last call, or None when stats are off.
    #[allow(clippy::type_complexity)]
    fn _make_prefix_cache_stats(
        slf: &Bound<'_, Self>,
    ) -> PkResult<Option<(bool, u64, u64, u64, u64, u64, u64)>> {
        Ok(borrow_mut(slf)?
            .inner
            .make_prefix_cache_stats()
            .as_ref()
            .map(stats_tuple))
    }

    /// The pool's block counters; None unless built with `kv_cache_metrics`.
    fn block_pool_stats(&self) -> Option<PyBlockPoolStats> {
        self.inner.pool().stats().map(Into::into)
    }

    /// Drains the pool's block activity log (`kv_cache_metrics`): what vLLM's
    /// pool reports to its metrics collector, in order, as `(kinds, block_ids)`
    /// arrays; a kind is one of the `BLOCK_*` constants.
    fn take_block_activity<'py>(slf: &Bound<'py, Self>) -> PkResult<ActivityArrays<'py>> {
        let log = borrow_mut(slf)?.inner.take_block_activity();
        let kinds: Vec<u8> = log.iter().map(|a| a.kind as u8).collect();
        let ids: Vec<i32> = log.iter().map(|a| a.block as i32).collect();
        let py = slf.py();
        Ok((PyArray1::from_vec(py, kinds), PyArray1::from_vec(py, ids)))
    }

    // ---- inspection ------------------------------------------------------------

    fn check_invariants(&self) -> PkResult<()> {
        Ok(self.inner.check_invariants()?)
    }

    /// The free queue from head (allocated next) to tail.
    fn free_block_ids<'py>(slf: &Bound<'py, Self>) -> PkResult<Bound<'py, PyArray1<i32>>> {
        let ids = ids_i32(&borrow(slf)?.inner.pool().free_queue());
        Ok(PyArray1::from_vec(slf.py(), ids))
    }

    /// Reference count of a block.
    fn block_ref_count(slf: &Bound<'_, Self>, block_id: i64) -> PkResult<u32> {
        let this = borrow(slf)?;
        let pool = this.inner.pool();
        Ok(pool.ref_cnt(pool.block_id(block_id)?))
    }

    /// The hash a block is cached under (None if not cached), and its group.
    fn cached_block_hash<'py>(
        slf: &Bound<'py, Self>,
        block_id: i64,
    ) -> PkResult<Option<(Bound<'py, PyBytes>, u32)>> {
        let key = {
            let this = borrow(slf)?;
            let pool = this.inner.pool();
            pool.block_key(pool.block_id(block_id)?)
        };
        Ok(key.map(|k| (PyBytes::new(slf.py(), k.hash.as_bytes()), k.group)))
    }

    /// Blocks cached under a hash for a group, in insertion order.
    #[pyo3(signature = (block_hash, group = 0))]
    fn cached_blocks_for_hash<'py>(
        slf: &Bound<'py, Self>,
        block_hash: &[u8],
        group: u32,
    ) -> PkResult<Bound<'py, PyArray1<i32>>> {
        let key = CacheKey {
            hash: self::block_hash("hash", block_hash)?,
            group,
        };
        let ids = ids_i32(&borrow(slf)?.inner.pool().cached_blocks(&key));
        Ok(PyArray1::from_vec(slf.py(), ids))
    }

    /// The hashes (and groups) a block is cached under beside the one
    /// `cached_block_hash` gives (partial prompt-tail entries), in the order
    /// they were given; empty when none.
    fn cached_block_extra_hashes<'py>(
        slf: &Bound<'py, Self>,
        block_id: i64,
    ) -> PkResult<Vec<(Bound<'py, PyBytes>, u32)>> {
        let keys = {
            let this = borrow(slf)?;
            let pool = this.inner.pool();
            pool.extra_keys(pool.block_id(block_id)?).to_vec()
        };
        Ok(keys
            .iter()
            .map(|k| (PyBytes::new(slf.py(), k.hash.as_bytes()), k.group))
            .collect())
    }

    /// Every hash in the prefix cache, with its group and the blocks cached
    /// under it (in the order they were cached). Hashes come in no particular
    /// order.
    fn cached_block_hash_entries<'py>(slf: &Bound<'py, Self>) -> PkResult<Vec<HashEntry<'py>>> {
        let entries = borrow(slf)?.inner.pool().cached_entries();
        Ok(entries
            .into_iter()
            .map(|(k, ids)| (PyBytes::new(slf.py(), k.hash.as_bytes()), k.group, ids))
            .collect())
    }

    /// The blocks cached under more than one hash (those
    /// `cached_block_extra_hashes` answers for), in ascending id order.
    fn blocks_with_extra_hashes<'py>(
        slf: &Bound<'py, Self>,
    ) -> PkResult<Bound<'py, PyArray1<i32>>> {
        let ids = ids_i32(&borrow(slf)?.inner.pool().blocks_with_extra_keys());
        Ok(PyArray1::from_vec(slf.py(), ids))
    }
}

/// One prefix-cache key as Python reads it: hash, group, the blocks under it.
type HashEntry<'py> = (Bound<'py, PyBytes>, u32, Vec<u32>);

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

    /// Whether the engine hashes requests (its token ids are signed), and the
    /// most token ids one call may carry: `max_model_len`, which no request
    /// may pass (checked before anything is reserved for them).
    fn token_limit(slf: &Bound<'_, Self>) -> PkResult<(bool, usize)> {
        let this = borrow(slf)?;
        let cfg = this.inner.config();
        let limit = usize::try_from(cfg.max_model_len).unwrap_or(usize::MAX);
        Ok((cfg.external_block_hashes, limit))
    }

    /// A lookup result as Python sees it (the shared empty tuple for no hit).
    fn computed(slf: &Bound<'_, Self>, inner: ComputedBlocks) -> PkResult<PyComputedBlocks> {
        let py = slf.py();
        Ok(PyComputedBlocks::new(py, inner, &borrow(slf)?.empty))
    }

    /// `sync_request`'s work: the core reads the engine's lists where it
    /// needs to (see `KvCacheManager::sync_from_engine`). The manager is held
    /// only to take the anchor, to copy the request's lists when they differ,
    /// and to apply: reading the lists may run the engine's code (a sequence
    /// type of its own), which may call back into the manager or let another
    /// thread run. Another call that changed the request in between makes it
    /// start over.
    fn sync(
        slf: &Bound<'_, Self>,
        request_id: &str,
        token_ids: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        spb: u64,
        num_prompt_tokens: Option<i64>,
    ) -> PkResult<bool> {
        let prompt = num_prompt_tokens
            .map(|n| Self::index("num_prompt_tokens", n))
            .transpose()?;
        let mut anchor = borrow(slf)?.inner.sync_anchor(request_id)?;
        let src = EngineLists::new(token_ids, block_hashes, anchor.token_limit())?;
        for attempt in 0..SYNC_ATTEMPTS {
            if attempt > 0 {
                anchor = borrow(slf)?.inner.sync_anchor(request_id)?;
            }
            let keep =
                anchor.sync_point(&src, || Ok(borrow(slf)?.inner.request_lists(request_id)?))?;
            let tokens = src.tokens_from(keep.0)?;
            let hashes = src.hashes_from(keep.1)?;
            let applied = borrow_mut(slf)?.inner.apply_sync(
                request_id,
                &anchor,
                keep,
                (&tokens, &hashes),
                Some(spb),
                prompt,
            )?;
            if let Some(rewound) = applied {
                return Ok(rewound);
            }
        }
        Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
            "request {request_id:?} kept changing while it was synced (other calls on it \
             from inside the engine's sequences or from other threads)"
        ))
        .into())
    }

    /// The core's `allocate_slots` and its result as int32 arrays per group
    /// (`nothing` when nothing was allocated).
    fn allocate(
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
            match this.inner.allocate_slots(request_id, args, hit)? {
                None => return Ok(None),
                Some(g) if g.iter().all(Vec::is_empty) => {
                    return Ok(Some(match nothing {
                        Nothing::EmptyGroups => this.empty.clone_ref(py),
                        Nothing::Unit => PyTuple::empty(py).unbind(),
                    }));
                }
                Some(g) => groups_i32(g),
            }
        };
        Ok(Some(groups_tuple(py, groups)?.unbind()))
    }
}

/// Times `sync` starts over when the request changed while the engine's lists
/// were read.
const SYNC_ATTEMPTS: usize = 3;

/// What an allocation that took no block returns.
#[derive(Clone, Copy)]
enum Nothing {
    /// The shared tuple of one empty id array per group (pagedkv's API).
    EmptyGroups,
    /// `()` (vLLM's adapter tests the result's truth value).
    Unit,
}

/// `allocate_slots`' counts as Python passed them (checked by [`Counts::args`]).
struct Counts {
    num_new_tokens: i64,
    num_computed_tokens: i64,
    num_lookahead_tokens: i64,
    num_external_computed_tokens: i64,
    num_encoder_tokens: i64,
    reserved_blocks: i64,
    num_in_flight_tokens: i64,
}

/// `allocate_slots`' switches.
#[allow(clippy::struct_excessive_bools)]
struct Flags {
    delay_cache_blocks: bool,
    full_sequence_must_fit: bool,
    has_scheduled_reqs: bool,
    vllm_lenient: bool,
}

impl Counts {
    /// The core's arguments; a negative count is refused by name. Inlined
    /// (as are the two `with_` builders after it): returned through a
    /// `Result`, the arguments were stored field by field and read back 16
    /// bytes at a time, a failed store-to-load forward on every call (a
    /// running request's `allocate_slots` in the recorded-call replay: 320–330
    /// against 333–347 ns; see BENCHMARKS.md).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn args(
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
trait EngineManagedBlocks: Sized {
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

fn stats_tuple(s: &pagedkv_core::PrefixCacheStats) -> (bool, u64, u64, u64, u64, u64, u64) {
    (
        s.reset,
        s.requests,
        s.queries,
        s.hits,
        s.preempted_requests,
        s.preempted_queries,
        s.preempted_hits,
    )
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
