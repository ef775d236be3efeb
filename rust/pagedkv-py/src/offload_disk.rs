//! Binding of the disk tier (`pagedkv_core::offload::DiskTier`): conversion only.

use std::path::PathBuf;

use numpy::{PyReadonlyArray1, PyReadwriteArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use pagedkv_core::offload::{DiskConfig, DiskRead, DiskTier};

use crate::convert::{count, offload_key};
use crate::errors::{PkResult, borrow, borrow_mut, type_error};
use crate::offload::{counter_dict, event_tuples};

fn read_name(r: DiskRead) -> &'static str {
    match r {
        DiskRead::Hit => "hit",
        DiskRead::Miss => "miss",
        DiskRead::Corrupt => "corrupt",
    }
}

/// A disk tier of offloaded KV chunks: one file of fixed-size slots in a
/// directory, bounded in bytes, LRU, every slot checked when read; with no
/// directory, the index only (reads and writes take empty buffers).
#[pyclass(name = "DiskTier", module = "pagedkv._core")]
#[derive(Debug)]
pub struct PyDiskTier {
    inner: DiskTier,
}

#[pymethods]
impl PyDiskTier {
    #[new]
    #[pyo3(signature = (path, capacity_bytes, chunk_bytes, enable_events = false))]
    fn new(
        path: Option<PathBuf>,
        capacity_bytes: i64,
        chunk_bytes: i64,
        enable_events: bool,
    ) -> PkResult<Self> {
        let config = DiskConfig {
            dir: path,
            capacity_bytes: count("capacity_bytes", capacity_bytes)?,
            chunk_bytes: count("chunk_bytes", chunk_bytes)?,
            enable_events,
        };
        Ok(Self {
            inner: DiskTier::open(config)?,
        })
    }

    /// The file holding the chunks (removed with the tier); None for an
    /// index-only tier.
    #[getter]
    fn path(&self) -> Option<PathBuf> {
        self.inner.path().map(std::path::Path::to_owned)
    }

    #[getter]
    fn num_slots(&self) -> u64 {
        self.inner.num_slots()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __contains__(slf: &Bound<'_, Self>, key: &Bound<'_, PyAny>) -> PkResult<bool> {
        let key = offload_key(key)?;
        Ok(borrow(slf)?.inner.contains(&key))
    }

    /// Writes one chunk (`bytes` or a 1-D uint8 array); `False` when the file
    /// could not be written (a full disk, counted).
    fn put(
        slf: &Bound<'_, Self>,
        key: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
    ) -> PkResult<bool> {
        let key = offload_key(key)?;
        with_chunk_bytes(data, |bytes| Ok(borrow_mut(slf)?.inner.put(&key, bytes)?))
    }

    /// The chunk's bytes, or `None` when absent or failing its checks.
    fn get<'py>(
        slf: &Bound<'py, Self>,
        key: &Bound<'py, PyAny>,
    ) -> PkResult<Option<Bound<'py, PyBytes>>> {
        let key = offload_key(key)?;
        let mut tier = borrow_mut(slf)?;
        // chunk_bytes is at most 2**34 (checked when the tier was built)
        let mut buf = vec![0u8; tier.inner.payload_bytes() as usize];
        Ok(match tier.inner.get(&key, &mut buf)? {
            DiskRead::Hit => Some(PyBytes::new(slf.py(), &buf)),
            DiskRead::Miss | DiskRead::Corrupt => None,
        })
    }

    /// Reads the chunk into `out` (a writable 1-D uint8 array of one chunk):
    /// `"hit"`, `"miss"` or `"corrupt"` (then `out` is zeroed).
    fn get_into(
        slf: &Bound<'_, Self>,
        key: &Bound<'_, PyAny>,
        mut out: PyReadwriteArray1<'_, u8>,
    ) -> PkResult<&'static str> {
        let key = offload_key(key)?;
        let buf = out.as_slice_mut()?;
        Ok(read_name(borrow_mut(slf)?.inner.get(&key, buf)?))
    }

    /// Drops a chunk; whether it was on disk.
    fn remove(slf: &Bound<'_, Self>, key: &Bound<'_, PyAny>) -> PkResult<bool> {
        let key = offload_key(key)?;
        Ok(borrow_mut(slf)?.inner.remove(&key))
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

    /// `[(keys, "STORAGE", removed, metadata_only), ...]` since the last call.
    fn take_events<'py>(slf: &Bound<'py, Self>) -> PkResult<Bound<'py, PyList>> {
        let events = borrow_mut(slf)?.inner.take_events();
        Ok(event_tuples(slf.py(), &events)?)
    }

    /// The running totals, by name.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        counter_dict(py, &self.inner.counters().named())
    }

    fn check_invariants(&self) -> PkResult<()> {
        Ok(self.inner.check_invariants()?)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDiskTier>()
}

/// Calls `f` on a chunk's bytes given as `bytes` or a 1-D uint8 array
/// (borrowed, not copied).
pub(crate) fn with_chunk_bytes<T>(
    data: &Bound<'_, PyAny>,
    f: impl FnOnce(&[u8]) -> PkResult<T>,
) -> PkResult<T> {
    if let Ok(b) = data.cast::<PyBytes>() {
        return f(b.as_bytes());
    }
    let arr: PyReadonlyArray1<'_, u8> = data
        .extract()
        .map_err(|_| type_error("chunk data must be bytes or a 1-D uint8 array"))?;
    f(arr.as_slice()?)
}
