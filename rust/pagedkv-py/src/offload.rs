//! Binding of the host offload tier (`pagedkv_core::offload`): conversion only.
//! Keys are `bytes`; requests are ints the caller chooses; slots are ints.

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use pagedkv_core::offload::{
    Chunk, LookupResult, OffloadEvent, OffloadKey, OffloadTier, PolicyKind, TierConfig,
};

use crate::convert::{count, offload_key, offload_keys, position_items, positions};
use crate::errors::{PkResult, borrow, borrow_mut};

/// `prepare_store`'s answer: `(keys_to_store, slots, evicted_keys)`.
type StoreAnswer<'py> = (
    Bound<'py, PyList>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyList>,
);
/// One event: `(keys, medium, removed, metadata_only)`.
type EventTuple<'py> = (Bound<'py, PyList>, &'static str, bool, bool);
/// ARC's `(target_t1_size, t1, t2, b1, b2)`.
type ArcTuple<'py> = (
    f64,
    Bound<'py, PyList>,
    Bound<'py, PyList>,
    Bound<'py, PyList>,
    Bound<'py, PyList>,
);

/// Events as `[(keys, medium, removed, metadata_only), ...]`.
pub fn event_tuples<'py>(py: Python<'py>, events: &[OffloadEvent]) -> PyResult<Bound<'py, PyList>> {
    let items = events
        .iter()
        .map(|e| {
            Ok((
                key_list(py, &e.keys)?,
                e.medium.name(),
                e.removed,
                e.metadata_only,
            ))
        })
        .collect::<PyResult<Vec<EventTuple<'py>>>>()?;
    PyList::new(py, items)
}

/// Named totals as a dict.
pub fn counter_dict<'py>(py: Python<'py>, named: &[(&str, u64)]) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (name, v) in named {
        d.set_item(*name, *v)?;
    }
    Ok(d)
}

/// Slots as vLLM keeps them: an int32 array (the tier holds fewer than 2**31).
fn slot_array(py: Python<'_>, slots: Vec<u64>) -> Bound<'_, PyArray1<i32>> {
    PyArray1::from_vec(py, slots.into_iter().map(|s| s as i32).collect())
}

fn key_list<'py>(py: Python<'py>, keys: &[OffloadKey]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k.as_bytes())))
}

fn chunk_list<'py>(
    py: Python<'py>,
    chunks: &[(OffloadKey, Chunk)],
) -> PyResult<Bound<'py, PyList>> {
    PyList::new(
        py,
        chunks
            .iter()
            .map(|(k, c)| (PyBytes::new(py, k.as_bytes()), c.ref_cnt, c.slot)),
    )
}

/// A host-memory tier of offloaded KV chunks with vLLM 0.33's semantics.
#[pyclass(name = "OffloadTier", module = "pagedkv._core")]
#[derive(Debug)]
pub struct PyOffloadTier {
    inner: OffloadTier,
}

#[pymethods]
impl PyOffloadTier {
    #[new]
    #[pyo3(signature = (num_chunks, policy = "lru", enable_events = false, store_threshold = 1, max_tracker_size = 64_000))]
    fn new(
        num_chunks: i64,
        policy: &str,
        enable_events: bool,
        store_threshold: i64,
        max_tracker_size: i64,
    ) -> PkResult<Self> {
        let config = TierConfig {
            num_chunks: count("num_chunks", num_chunks)?,
            policy: PolicyKind::from_name(policy)?,
            enable_events,
            store_threshold: count("store_threshold", store_threshold)?,
            max_tracker_size: count("max_tracker_size", max_tracker_size)? as usize,
            ..TierConfig::new(0)
        };
        Ok(Self {
            inner: OffloadTier::new(config)?,
        })
    }

    #[getter]
    fn num_chunks(&self) -> u64 {
        self.inner.config().num_chunks
    }

    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.config().policy.name()
    }

    #[getter]
    fn store_threshold(&self) -> u64 {
        self.inner.config().store_threshold
    }

    #[getter]
    fn max_tracker_size(&self) -> usize {
        self.inner.config().max_tracker_size
    }

    #[getter]
    fn events_enabled(&self) -> bool {
        self.inner.config().enable_events
    }

    #[getter]
    fn num_resident(&self) -> usize {
        self.inner.num_resident()
    }

    #[getter]
    fn num_evictable(&self) -> u64 {
        self.inner.num_evictable()
    }

    #[getter]
    fn num_write_pending(&self) -> u64 {
        self.inner.num_write_pending()
    }

    #[getter]
    fn num_slots_used(&self) -> u64 {
        self.inner.num_slots_used()
    }

    /// Freed slots waiting for reuse, the next one last.
    #[getter]
    fn freed_slots(&self) -> Vec<u64> {
        self.inner.freed_slots().to_vec()
    }

    #[getter]
    fn num_free_slots(&self) -> u64 {
        self.inner.num_free_slots()
    }

    #[getter]
    fn num_requests(&self) -> usize {
        self.inner.num_requests()
    }

    /// New chunks the admission filter skipped since the last `stats()`.
    #[getter]
    fn stores_skipped_in_current_batch(&self) -> u64 {
        self.inner.pending_stores_skipped()
    }

    /// Allocation sizes since the last `stats()`.
    #[getter]
    fn allocation_sizes_in_current_batch(&self) -> Vec<u64> {
        self.inner.pending_allocation_sizes().to_vec()
    }

    /// 0: miss, 1: hit, 2: stored but not yet readable.
    fn lookup(slf: &Bound<'_, Self>, key: &Bound<'_, PyAny>) -> PkResult<u8> {
        let key = offload_key(key)?;
        Ok(match borrow_mut(slf)?.inner.lookup(&key) {
            LookupResult::Miss => 0,
            LookupResult::Hit => 1,
            LookupResult::HitPending => 2,
        })
    }

    /// How many leading keys are readable.
    fn lookup_prefix(slf: &Bound<'_, Self>, keys: &Bound<'_, PyAny>) -> PkResult<usize> {
        let keys = offload_keys(keys)?;
        Ok(borrow_mut(slf)?.inner.lookup_prefix(&keys))
    }

    fn on_new_request(&mut self, req: u64) {
        self.inner.on_new_request(req);
    }

    fn forget_request(&mut self, req: u64) {
        self.inner.forget_request(req);
    }

    fn touch(slf: &Bound<'_, Self>, keys: &Bound<'_, PyAny>) -> PkResult<()> {
        let keys = offload_keys(keys)?;
        borrow_mut(slf)?.inner.touch(&keys);
        Ok(())
    }

    /// Pins readable chunks for loading; their slots.
    #[pyo3(signature = (keys, req, positions = None))]
    fn prepare_load<'py>(
        slf: &Bound<'py, Self>,
        keys: &Bound<'py, PyAny>,
        req: u64,
        positions: Option<&Bound<'py, PyAny>>,
    ) -> PkResult<Bound<'py, PyArray1<i32>>> {
        let keys_v = offload_keys(keys)?;
        let pos = self::positions(positions, keys, keys_v.len())?;
        let slots = borrow_mut(slf)?.inner.prepare_load(&keys_v, req, &pos)?;
        Ok(slot_array(slf.py(), slots))
    }

    /// Pins readable chunks for a copy that is not a request's access (a lower
    /// tier reading this one); their slots.
    fn prepare_read<'py>(
        slf: &Bound<'py, Self>,
        keys: &Bound<'py, PyAny>,
    ) -> PkResult<Bound<'py, PyArray1<i32>>> {
        let keys = offload_keys(keys)?;
        let slots = borrow_mut(slf)?.inner.prepare_read(&keys)?;
        Ok(slot_array(slf.py(), slots))
    }

    fn complete_load(slf: &Bound<'_, Self>, keys: &Bound<'_, PyAny>) -> PkResult<()> {
        let keys = offload_keys(keys)?;
        Ok(borrow_mut(slf)?.inner.complete_load(&keys)?)
    }

    /// `None` when the shortfall cannot be evicted, else
    /// `(keys_to_store, slots, evicted_keys)`.
    #[pyo3(signature = (keys, req, positions = None))]
    fn prepare_store<'py>(
        slf: &Bound<'py, Self>,
        keys: &Bound<'py, PyAny>,
        req: u64,
        positions: Option<&Bound<'py, PyAny>>,
    ) -> PkResult<Option<StoreAnswer<'py>>> {
        let py = slf.py();
        let keys_v = offload_keys(keys)?;
        let pos = self::positions(positions, keys, keys_v.len())?;
        let out = borrow_mut(slf)?.inner.prepare_store(&keys_v, req, &pos)?;
        let Some(out) = out else { return Ok(None) };
        Ok(Some((
            key_list(py, &out.keys_to_store)?,
            slot_array(py, out.slots),
            key_list(py, &out.evicted)?,
        )))
    }

    #[pyo3(signature = (keys, success = true))]
    fn complete_store(
        slf: &Bound<'_, Self>,
        keys: &Bound<'_, PyAny>,
        success: bool,
    ) -> PkResult<()> {
        let keys = offload_keys(keys)?;
        borrow_mut(slf)?.inner.complete_store(&keys, success);
        Ok(())
    }

    /// The request ended; `keys` / `positions`: every position recorded for
    /// it (or `positions` alone as a dict of key → position).
    #[pyo3(signature = (req, keys = None, positions = None))]
    fn on_request_finished(
        slf: &Bound<'_, Self>,
        req: u64,
        keys: Option<&Bound<'_, PyAny>>,
        positions: Option<&Bound<'_, PyAny>>,
    ) -> PkResult<()> {
        let keys = keys.filter(|k| !k.is_none());
        let known = positions.and_then(|p| p.cast::<PyDict>().ok());
        let (keys_v, pos) = match (keys, known) {
            (None, Some(known)) => position_items(known)?,
            (None, None) => (Vec::new(), self::positions(positions, slf.as_any(), 0)?),
            (Some(k), _) => {
                let keys_v = offload_keys(k)?;
                let pos = self::positions(positions, k, keys_v.len())?;
                (keys_v, pos)
            }
        };
        Ok(borrow_mut(slf)?
            .inner
            .on_request_finished(req, &keys_v, &pos)?)
    }

    fn reset_cache(&mut self) {
        self.inner.reset_cache();
    }

    /// The events since the last call as the KV events vLLM's offloading
    /// connector publishes (`BlockStored` / `BlockRemoved` with this tier's
    /// medium; a failed store's removal is not published).
    #[pyo3(signature = (raw_hashes = false))]
    fn take_kv_events<'py>(
        slf: &Bound<'py, Self>,
        raw_hashes: bool,
    ) -> PkResult<Bound<'py, PyList>> {
        let events = borrow_mut(slf)?.inner.take_events();
        Ok(crate::events::tier_to_python(
            slf.py(),
            &events,
            raw_hashes,
        )?)
    }

    /// `[(keys, medium, removed, metadata_only), ...]` since the last call.
    fn take_events<'py>(slf: &Bound<'py, Self>) -> PkResult<Bound<'py, PyList>> {
        let events = borrow_mut(slf)?.inner.take_events();
        Ok(event_tuples(slf.py(), &events)?)
    }

    /// `(usage, write_usage, read_usage, allocation_sizes, stores_skipped)`;
    /// drains the sizes and the skip count.
    fn stats(&mut self) -> (f64, f64, f64, Vec<u64>, Option<u64>) {
        let s = self.inner.stats();
        (
            s.usage,
            s.write_usage,
            s.read_usage,
            s.allocation_sizes,
            s.stores_skipped,
        )
    }

    /// The running totals, by name.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        counter_dict(py, &self.inner.counters().named())
    }

    /// `(ref_cnt, slot)` of a resident chunk, else `None`.
    fn chunk(slf: &Bound<'_, Self>, key: &Bound<'_, PyAny>) -> PkResult<Option<(i32, u64)>> {
        let key = offload_key(key)?;
        Ok(borrow(slf)?.inner.chunk(&key).map(|c| (c.ref_cnt, c.slot)))
    }

    /// Every resident chunk as `(key, ref_cnt, slot)`.
    fn resident<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        chunk_list(py, &self.inner.resident())
    }

    /// ARC's `(target_t1_size, t1, t2, b1, b2)`, lists oldest first, T1 / T2 as
    /// `(key, ref_cnt, slot)`; `None` under LRU.
    fn arc_lists<'py>(&self, py: Python<'py>) -> PyResult<Option<ArcTuple<'py>>> {
        let Some(a) = self.inner.arc_lists() else {
            return Ok(None);
        };
        Ok(Some((
            a.target_t1_size,
            chunk_list(py, &a.t1)?,
            chunk_list(py, &a.t2)?,
            key_list(py, &a.b1)?,
            key_list(py, &a.b2)?,
        )))
    }

    fn set_arc_target_t1_size(&mut self, target: f64) -> PkResult<()> {
        Ok(self.inner.set_arc_target_t1_size(target)?)
    }

    /// LRU: the eviction heap's `((major, minor), key)` entries as they lie,
    /// stale ones included; `None` under ARC.
    #[allow(clippy::type_complexity)]
    fn lru_heap<'py>(&self, py: Python<'py>) -> Option<Vec<((u64, i64), Bound<'py, PyBytes>)>> {
        self.inner.lru_heap().map(|h| {
            h.iter()
                .map(|(r, k)| (*r, PyBytes::new(py, k.as_bytes())))
                .collect()
        })
    }

    /// Evicts `n` idle chunks not in `protected` (slots freed, removal
    /// announced): `[(key, ref_cnt, slot)]`, or `None` (nothing changed) when
    /// fewer than `n` can go.
    fn evict<'py>(
        slf: &Bound<'py, Self>,
        n: usize,
        protected: &Bound<'py, PyAny>,
    ) -> PkResult<Option<Bound<'py, PyList>>> {
        let protected = offload_keys(protected)?;
        let out = borrow_mut(slf)?.inner.evict(n, &protected);
        Ok(out.map(|v| chunk_list(slf.py(), &v)).transpose()?)
    }

    /// LRU: evictable keys in eviction order; `None` under ARC.
    fn lru_eviction_order<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        self.inner
            .lru_eviction_order()
            .map(|o| key_list(py, &o))
            .transpose()
    }

    /// The admission filter's `[(key, count)]`, least recently offered first.
    fn tracked_offers<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        let Some(t) = self.inner.tracked_offers() else {
            return Ok(None);
        };
        Ok(Some(PyList::new(
            py,
            t.iter().map(|(k, n)| (PyBytes::new(py, k.as_bytes()), *n)),
        )?))
    }

    fn check_invariants(&self) -> PkResult<()> {
        Ok(self.inner.check_invariants()?)
    }

    fn __repr__(&self) -> String {
        format!(
            "OffloadTier(num_chunks={}, policy={:?}, resident={}, evictable={}, pending={})",
            self.inner.config().num_chunks,
            self.inner.config().policy.name(),
            self.inner.num_resident(),
            self.inner.num_evictable(),
            self.inner.num_write_pending()
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyOffloadTier>()
}
