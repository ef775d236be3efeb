//! The calls of an engine that owns its requests (vLLM's drop-in): syncing a
//! request with the engine's lists, detached and engine-held blocks, hits by
//! block ids, partial hits and checkpoints, blocks to zero.

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use pagedkv_core::sync::{EngineSync, ManagerTurns, SyncOutcome};
use pagedkv_core::{CacheKey, KvCacheManager, Result as CoreResult};

use crate::convert::{count, ids_i32};
use crate::engine_request::EngineLists;
use crate::errors::{PkResult, PyPkError, borrow, borrow_mut, invalid_arg};

use super::args::{Counts, EngineManagedBlocks, Flags, Nothing};
use super::{PyComputedBlocks, PyManager, group_index};

#[pymethods]
impl PyManager {
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
        num_in_flight_tokens, skip_zeroing_group_ids, num_prompt_tokens = None, /,
        engine_managed_blocks = None, *, split_at_group = None))]
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

    /// vLLM's `BlockPool._insert_block_hash` on a block the engine holds:
    /// `(block_hash, group)` becomes its primary key (ending `num_tokens`
    /// tokens, when known) or an extra one beside it. No event. Whether the
    /// prefix cache changed.
    #[pyo3(signature = (block_id, block_hash, group, num_tokens = None))]
    fn insert_detached_block_hash(
        slf: &Bound<'_, Self>,
        block_id: i64,
        block_hash: &[u8],
        group: i64,
        num_tokens: Option<i64>,
    ) -> PkResult<bool> {
        let block = crate::convert::block_id(block_id)?;
        let key = CacheKey {
            hash: crate::convert::block_hash("block_hash", block_hash)?,
            group: u32::try_from(group)
                .map_err(|_| invalid_arg(format!("group {group} is out of range")))?,
        };
        let tokens = num_tokens
            .map(|n| {
                u32::try_from(n).map_err(|_| invalid_arg(format!("num_tokens {n} is out of range")))
            })
            .transpose()?;
        Ok(borrow_mut(slf)?
            .inner
            .insert_detached_block_hash(block, key, tokens)?)
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
        let local = num_local_computed_tokens
            .map(|v| count("num_local_computed_tokens", v))
            .transpose()?;
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
}

impl PyManager {
    /// `sync_request`'s work, the core's [`EngineSync::run`]: it reads the
    /// engine's lists where it needs to, holding the manager only in short
    /// turns (reading the lists may run the engine's code, which may call
    /// back into the manager or let another thread run).
    fn sync(
        slf: &Bound<'_, Self>,
        request_id: &str,
        token_ids: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        spb: u64,
        num_prompt_tokens: Option<i64>,
    ) -> PkResult<bool> {
        let sync = EngineSync {
            id: request_id,
            shared_prefix_boundary: Some(spb),
            num_prompt_tokens: num_prompt_tokens
                .map(|n| Self::index("num_prompt_tokens", n))
                .transpose()?,
        };
        let open = |limit| EngineLists::new(token_ids, block_hashes, limit);
        match sync.run(&Turns(slf), open)? {
            SyncOutcome::Synced { rewound } => Ok(rewound),
            SyncOutcome::KeptChanging => Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
                "request {request_id:?} kept changing while it was synced (other calls on it \
                 from inside the engine's sequences or from other threads)"
            ))
            .into()),
        }
    }
}

/// The manager taken in turns by the core's sync ([`ManagerTurns`]).
struct Turns<'a, 'py>(&'a Bound<'py, PyManager>);

impl ManagerTurns for Turns<'_, '_> {
    type Error = PyPkError;

    fn read<T>(&self, f: impl FnOnce(&KvCacheManager) -> CoreResult<T>) -> PkResult<T> {
        Ok(f(&borrow(self.0)?.inner)?)
    }

    fn write<T>(&self, f: impl FnOnce(&mut KvCacheManager) -> CoreResult<T>) -> PkResult<T> {
        Ok(f(&mut borrow_mut(self.0)?.inner)?)
    }
}
