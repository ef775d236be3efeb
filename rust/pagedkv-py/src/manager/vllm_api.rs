//! vLLM's `KVCacheManager` calls on the pyclass: requests, lookups,
//! allocation, caching, cache maintenance, events and stats.

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyTuple};

use pagedkv_core::{AllocateArgs, BatchStep, Lora};

use crate::convert::{
    BatchIds, appended_tokens, block_hash_list, count, counts, counts_or_one, engine_tokens,
    groups_i32, groups_tuple, ids_i32, prompt_tokens, request_spec, tokens,
};
use crate::errors::{PkResult, borrow, borrow_mut, type_error};
use crate::events;
use crate::prepared::{PyPreparedRequest, PyRequestPreparer};

use super::args::{Counts, EngineManagedBlocks, Flags, Nothing};
use super::{PyBlockPoolStats, PyComputedBlocks, PyManager};

/// `(kinds, block_ids)` of the block activity log.
type ActivityArrays<'py> = (Bound<'py, PyArray1<u8>>, Bound<'py, PyArray1<i32>>);

#[pymethods]
impl PyManager {
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
        // Signed token ids: an engine's own lists, with vLLM's -1 placeholders.
        let (signed, limit) = Self::token_limit(slf)?;
        let prompt_token_ids = match counted {
            Some(_) => Vec::new(),
            None if signed => engine_tokens(prompt_token_ids, limit)?,
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

    /// vLLM's coordinator `find_longest_cache_hit` for these block hashes (of
    /// no request): `(block_ids per group, hit tokens, uncached common prefix
    /// tokens)`.
    fn find_longest_cache_hit<'py>(
        slf: &Bound<'py, Self>,
        block_hashes: &Bound<'py, PyAny>,
        max_cache_hit_length: i64,
    ) -> PkResult<(Bound<'py, PyTuple>, u64, u64)> {
        let hashes = block_hash_list(block_hashes, Self::token_limit(slf)?.1)?;
        let cap = count("max_cache_hit_length", max_cache_hit_length)?;
        let (blocks, hit, uncached) = borrow(slf)?.inner.find_longest_cache_hit(&hashes, cap);
        Ok((groups_tuple(slf.py(), groups_i32(&blocks))?, hit, uncached))
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
        let ids = this.inner.group_block_ids(request_id, group)?;
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
        // Signed token ids leave as they came in (see `engine_tokens`).
        let signed = m.inner.config().signed_token_ids();
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

    /// vLLM's `estimate_cached_tokens` for a request: the fewest, over the
    /// cacheable groups, of the most prefix tokens any of its blocks is cached
    /// for.
    fn estimate_cached_tokens(slf: &Bound<'_, Self>, request_id: &str) -> PkResult<u64> {
        Ok(borrow(slf)?.inner.estimate_cached_tokens(request_id)?)
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
