//! The host tier's calls on the pyclass (`KVCacheManager(offload=...)`): its
//! configuration, the step's transfer plan, completions, stats and events.

use std::path::PathBuf;

use numpy::{PyArray1, PyReadwriteArray1};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use pagedkv_core::offload::{DiskConfig, PolicyKind};
use pagedkv_core::{DiskTransfer, OffloadConfig, Transfer, WritePolicy};

use crate::convert::{count, ids_i32};
use crate::errors::{PkResult, borrow, borrow_mut, invalid_arg};
use crate::offload::{counter_dict, event_tuples};
use crate::offload_disk::with_chunk_bytes;

use super::PyManager;

/// One transfer: `(job, request_id, group, device_blocks, host_blocks)`.
type TransferTuple<'py> = (
    u64,
    String,
    u32,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i64>>,
);

/// Host block ids as int64 (below 2**31 * `blocks_per_chunk` < 2**63).
fn host_array<'py>(py: Python<'py>, blocks: &[u64]) -> Bound<'py, PyArray1<i64>> {
    PyArray1::from_vec(py, blocks.iter().map(|&b| b as i64).collect())
}

fn transfer_list<'py>(py: Python<'py>, ts: Vec<Transfer>) -> PyResult<Bound<'py, PyList>> {
    let items: Vec<TransferTuple<'py>> = ts
        .into_iter()
        .map(|t| {
            (
                t.job,
                t.request_id,
                t.group,
                PyArray1::from_vec(py, ids_i32(&t.device_blocks)),
                host_array(py, &t.host_blocks),
            )
        })
        .collect();
    PyList::new(py, items)
}

/// One disk copy: `(job, group, host_blocks, load_job)`.
type DiskTuple<'py> = (u64, u32, Bound<'py, PyArray1<i64>>, Option<u64>);

fn disk_list<'py>(py: Python<'py>, ts: Vec<DiskTransfer>) -> PyResult<Bound<'py, PyList>> {
    let items: Vec<DiskTuple<'py>> = ts
        .into_iter()
        .map(|t| (t.job, t.group, host_array(py, &t.host_blocks), t.load_job))
        .collect();
    PyList::new(py, items)
}

fn job_ids(name: &str, jobs: Vec<i64>) -> PkResult<Vec<u64>> {
    jobs.into_iter().map(|j| count(name, j)).collect()
}

#[pymethods]
impl PyManager {
    /// Gives the manager a host tier of `num_chunks` chunks (before any
    /// request is added). `pagedkv.KVCacheManager(offload=OffloadConfig(...))`
    /// calls it.
    #[pyo3(signature = (num_chunks, *, blocks_per_chunk = 1, policy = "lru", store_threshold = 1,
        enable_events = false, bytes_per_block = 0, write_policy = "write_through",
        write_back_window = 256, disk_path = None, disk_bytes = 0, disk_chunk_bytes = 0))]
    #[allow(clippy::too_many_arguments)]
    fn _enable_offload(
        slf: &Bound<'_, Self>,
        num_chunks: i64,
        blocks_per_chunk: i64,
        policy: &str,
        store_threshold: i64,
        enable_events: bool,
        bytes_per_block: i64,
        write_policy: &str,
        write_back_window: i64,
        disk_path: Option<PathBuf>,
        disk_bytes: i64,
        disk_chunk_bytes: i64,
    ) -> PkResult<()> {
        let blocks_per_chunk = u32::try_from(count("blocks_per_chunk", blocks_per_chunk)?)
            .map_err(|_| invalid_arg("blocks_per_chunk is out of range"))?;
        let window = u32::try_from(count("write_back_window", write_back_window)?)
            .map_err(|_| invalid_arg("write_back_window is out of range"))?;
        let cfg = OffloadConfig {
            num_chunks: count("num_chunks", num_chunks)?,
            blocks_per_chunk,
            policy: PolicyKind::from_name(policy)?,
            store_threshold: count("store_threshold", store_threshold)?,
            enable_events,
            bytes_per_block: count("bytes_per_block", bytes_per_block)?,
            write_policy: WritePolicy::from_name(write_policy, window)?,
            // a path, or a bound without one: an index-only disk tier
            disk: (disk_path.is_some() || disk_bytes != 0)
                .then(|| -> PkResult<DiskConfig> {
                    Ok(DiskConfig {
                        dir: disk_path,
                        capacity_bytes: count("disk_bytes", disk_bytes)?,
                        chunk_bytes: count("disk_chunk_bytes", disk_chunk_bytes)?,
                        enable_events,
                    })
                })
                .transpose()?,
        };
        Ok(borrow_mut(slf)?.inner.enable_offload(cfg)?)
    }

    /// Whether the manager has a host tier.
    #[getter]
    fn has_offload(&self) -> bool {
        self.inner.offload_config().is_some()
    }

    /// The step's copies as `(disk_reads, loads, stores, disk_writes)`:
    /// loads and stores lists of `(job, request_id, group, device_blocks,
    /// host_blocks)`, disk copies of `(job, group, host_blocks, load_job)`.
    #[allow(clippy::type_complexity)]
    fn _take_transfer_plan<'py>(
        slf: &Bound<'py, Self>,
    ) -> PkResult<(
        Bound<'py, PyList>,
        Bound<'py, PyList>,
        Bound<'py, PyList>,
        Bound<'py, PyList>,
    )> {
        let plan = borrow_mut(slf)?.inner.take_transfer_plan()?;
        let py = slf.py();
        Ok((
            disk_list(py, plan.disk_reads)?,
            transfer_list(py, plan.loads)?,
            transfer_list(py, plan.stores)?,
            disk_list(py, plan.disk_writes)?,
        ))
    }

    /// Runs a planned disk read into `out` (a writable 1-D uint8 array of one
    /// chunk): True when the chunk's bytes were read and checked (copy them
    /// into the read's host blocks before its load), False when the read
    /// failed (its load fails; `out` zeroed).
    fn read_disk_chunk(
        slf: &Bound<'_, Self>,
        job: i64,
        mut out: PyReadwriteArray1<'_, u8>,
    ) -> PkResult<bool> {
        let job = count("job", job)?;
        let buf = out.as_slice_mut()?;
        Ok(borrow_mut(slf)?.inner.read_disk_chunk(job, buf)?)
    }

    /// Runs a planned disk write of `data` (`bytes` or a 1-D uint8 array: the
    /// chunk's bytes gathered from its host blocks); False when the disk
    /// refused it (full).
    fn write_disk_chunk(
        slf: &Bound<'_, Self>,
        job: i64,
        data: &Bound<'_, PyAny>,
    ) -> PkResult<bool> {
        let job = count("job", job)?;
        with_chunk_bytes(data, |bytes| {
            Ok(borrow_mut(slf)?.inner.write_disk_chunk(job, bytes)?)
        })
    }

    /// Reports jobs done and failed; returns the failed loads of requests
    /// still known as `[(request_id, num_valid_tokens), ...]`.
    #[pyo3(signature = (done = Vec::new(), failed = Vec::new()))]
    fn complete_transfers(
        slf: &Bound<'_, Self>,
        done: Vec<i64>,
        failed: Vec<i64>,
    ) -> PkResult<Vec<(String, u64)>> {
        let done = job_ids("done", done)?;
        let failed = job_ids("failed", failed)?;
        let out = borrow_mut(slf)?.inner.complete_transfers(&done, &failed)?;
        Ok(out
            .into_iter()
            .map(|f| (f.request_id, f.num_valid_tokens))
            .collect())
    }

    /// The host tier's totals (None without one): the manager's (queries,
    /// hits, loads, stores, blocks, bytes, evictions) and the tier's chunk
    /// counts.
    fn offload_stats<'py>(slf: &Bound<'py, Self>) -> PkResult<Option<Bound<'py, PyDict>>> {
        let this = borrow(slf)?;
        let (Some(s), Some(tier)) = (this.inner.offload_stats(), this.inner.offload_tier()) else {
            return Ok(None);
        };
        let mut named = s.named().to_vec();
        named.push(("num_chunks", tier.config().num_chunks));
        named.push(("resident_chunks", tier.num_resident() as u64));
        named.push(("write_pending_chunks", tier.num_write_pending()));
        named.push((
            "write_back_candidates",
            this.inner.num_write_back_candidates() as u64,
        ));
        let disk_names: Vec<(String, u64)> = this.inner.offload_disk().map_or_else(Vec::new, |d| {
            let mut v: Vec<(String, u64)> = d
                .counters()
                .named()
                .iter()
                .map(|(n, x)| (format!("disk_tier_{n}"), *x))
                .collect();
            v.push(("disk_tier_chunks".into(), d.len() as u64));
            v.push(("disk_tier_slots".into(), d.num_slots()));
            v
        });
        let dict = counter_dict(slf.py(), &named)?;
        for (n, x) in disk_names {
            dict.set_item(n, x)?;
        }
        Ok(Some(dict))
    }

    /// Transfer jobs planned or taken and not completed.
    #[getter]
    fn num_transfers_in_flight(&self) -> usize {
        self.inner.num_transfers_in_flight()
    }

    /// The host tier's events since the last call, as
    /// `[(keys, medium, removed, metadata_only), ...]` (medium `"CPU"`).
    fn _take_offload_events<'py>(slf: &Bound<'py, Self>) -> PkResult<Bound<'py, PyList>> {
        let events = borrow_mut(slf)?.inner.take_offload_events();
        Ok(event_tuples(slf.py(), &events)?)
    }

    /// Empties the host tier; False (nothing changed) while transfers are in
    /// flight or without a tier.
    fn reset_offload(slf: &Bound<'_, Self>) -> PkResult<bool> {
        Ok(borrow_mut(slf)?.inner.reset_offload())
    }
}
