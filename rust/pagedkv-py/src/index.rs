//! Binding of the router-side prefix index (`pagedkv_core::prefix_index`):
//! conversion and error mapping only.

use numpy::PyReadonlyArray1;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyString, PyTuple};

use pagedkv_core::Error;
use pagedkv_core::prefix_index::{PrefixIndex, ReplicaId};

mod errors {
    pyo3::import_exception!(pagedkv.errors, InvalidArgumentError);
    pyo3::import_exception!(pagedkv.errors, InvariantViolationError);
}

fn err(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::InvariantViolation(_) => errors::InvariantViolationError::new_err(msg),
        _ => errors::InvalidArgumentError::new_err(msg),
    }
}

/// vLLM's event form of one hash: an int in 0..2**64 as is, a digest by its
/// last 8 bytes (big-endian).
fn hash_item(item: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(b) = item.cast::<PyBytes>() {
        let d = b.as_bytes();
        if d.is_empty() {
            return Err(errors::InvalidArgumentError::new_err("empty block hash"));
        }
        let mut out = 0u64;
        for &x in &d[d.len().saturating_sub(8)..] {
            out = (out << 8) | u64::from(x);
        }
        return Ok(out);
    }
    if item.is_instance_of::<PyInt>() {
        return item.extract::<u64>().map_err(|_| {
            errors::InvalidArgumentError::new_err("block hash ints must be in 0..2**64")
        });
    }
    Err(PyTypeError::new_err("block hashes must be ints or bytes"))
}

/// A hash chain from a uint64 NumPy array or a sequence of ints / bytes.
fn hash_list(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, u64>>() {
        return Ok(a.as_slice()?.to_vec());
    }
    if let Ok(list) = obj.cast::<PyList>() {
        return list.iter().map(|x| hash_item(&x)).collect();
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err("block hashes must be a sequence"));
    }
    obj.try_iter()?.map(|x| hash_item(&x?)).collect()
}

fn opt_hash(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
    match obj {
        Some(o) if !o.is_none() => hash_item(o).map(Some),
        _ => Ok(None),
    }
}

/// Which replica holds which cached blocks, fed by KV events, answering
/// longest-prefix queries. Replicas are dense ints from `replica(name)`.
#[pyclass(name = "PrefixIndex", module = "pagedkv._core")]
pub struct PyPrefixIndex {
    inner: PrefixIndex,
}

impl PyPrefixIndex {
    fn id(&self, replica: u32) -> PyResult<ReplicaId> {
        if (replica as usize) < self.inner.num_replicas() {
            Ok(ReplicaId(replica))
        } else {
            Err(errors::InvalidArgumentError::new_err(format!(
                "replica id {replica} is not registered"
            )))
        }
    }

    fn apply_one(&mut self, r: ReplicaId, ev: &Bound<'_, PyAny>) -> PyResult<()> {
        // The core's tuple form: ("BlockStored", hashes, parent, tokens, block_size,
        // lora_id, lora_name, extra_keys, group_idx, ...), ("BlockRemoved", hashes,
        // group_idx), ("AllBlocksCleared",).
        if let Ok(t) = ev.cast::<PyTuple>() {
            let tag: String = t.get_item(0)?.extract()?;
            return match tag.as_str() {
                "BlockStored" => {
                    let hashes = hash_list(&t.get_item(1)?)?;
                    let parent = opt_hash(Some(&t.get_item(2)?))?;
                    let group: Option<u32> = t.get_item(8)?.extract()?;
                    self.inner.store(r, parent, &hashes, group).map_err(err)
                }
                "BlockRemoved" => {
                    let hashes = hash_list(&t.get_item(1)?)?;
                    let group: Option<u32> = t.get_item(2)?.extract()?;
                    self.inner.remove(r, &hashes, group).map_err(err)
                }
                "AllBlocksCleared" => self.inner.clear(r).map_err(err),
                other => Err(errors::InvalidArgumentError::new_err(format!(
                    "unknown event {other:?}"
                ))),
            };
        }
        // Event objects (pagedkv.wire structs, pagedkv.events dataclasses, vLLM's own).
        let ty = ev.get_type().name()?;
        match ty.to_str()? {
            "BlockStored" => {
                let hashes = hash_list(&ev.getattr("block_hashes")?)?;
                let parent = opt_hash(Some(&ev.getattr("parent_block_hash")?))?;
                let group: Option<u32> = ev.getattr("group_idx")?.extract()?;
                self.inner.store(r, parent, &hashes, group).map_err(err)
            }
            "BlockRemoved" => {
                let hashes = hash_list(&ev.getattr("block_hashes")?)?;
                let group: Option<u32> = ev.getattr("group_idx")?.extract()?;
                self.inner.remove(r, &hashes, group).map_err(err)
            }
            "AllBlocksCleared" => self.inner.clear(r).map_err(err),
            other => Err(PyTypeError::new_err(format!(
                "not a KV-cache event: {other}"
            ))),
        }
    }
}

#[pymethods]
impl PyPrefixIndex {
    #[new]
    fn new() -> Self {
        Self {
            inner: PrefixIndex::new(),
        }
    }

    /// The id of a replica, registering it on first use.
    fn replica(&mut self, name: &str) -> u32 {
        self.inner.replica(name).0
    }

    fn replica_id(&self, name: &str) -> Option<u32> {
        self.inner.replica_id(name).map(|r| r.0)
    }

    fn replica_name(&self, replica: u32) -> Option<String> {
        self.inner
            .replica_name(ReplicaId(replica))
            .map(str::to_owned)
    }

    #[getter]
    fn num_replicas(&self) -> usize {
        self.inner.num_replicas()
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }

    fn replica_num_blocks(&self, replica: u32) -> usize {
        self.inner.replica_num_blocks(ReplicaId(replica))
    }

    /// `(blocks_stored, blocks_removed, unknown_removals, clears)`.
    fn stats(&self) -> (u64, u64, u64, u64) {
        let s = self.inner.stats();
        (
            s.blocks_stored,
            s.blocks_removed,
            s.unknown_removals,
            s.clears,
        )
    }

    #[pyo3(signature = (replica, block_hashes, parent_block_hash = None, group_idx = None))]
    fn store(
        &mut self,
        replica: u32,
        block_hashes: &Bound<'_, PyAny>,
        parent_block_hash: Option<&Bound<'_, PyAny>>,
        group_idx: Option<u32>,
    ) -> PyResult<()> {
        let r = self.id(replica)?;
        let hashes = hash_list(block_hashes)?;
        let parent = opt_hash(parent_block_hash)?;
        self.inner.store(r, parent, &hashes, group_idx).map_err(err)
    }

    #[pyo3(signature = (replica, block_hashes, group_idx = None))]
    fn remove(
        &mut self,
        replica: u32,
        block_hashes: &Bound<'_, PyAny>,
        group_idx: Option<u32>,
    ) -> PyResult<()> {
        let r = self.id(replica)?;
        let hashes = hash_list(block_hashes)?;
        self.inner.remove(r, &hashes, group_idx).map_err(err)
    }

    fn clear(&mut self, replica: u32) -> PyResult<()> {
        let r = self.id(replica)?;
        self.inner.clear(r).map_err(err)
    }

    /// Applies events of one replica in order (one crossing per batch). Returns
    /// how many were applied; on a bad event, those before it stay applied.
    fn apply_events(&mut self, replica: u32, events: &Bound<'_, PyAny>) -> PyResult<usize> {
        let r = self.id(replica)?;
        let mut n = 0;
        for ev in events.try_iter()? {
            self.apply_one(r, &ev?)?;
            n += 1;
        }
        Ok(n)
    }

    #[pyo3(signature = (block_hashes, group_idx = None))]
    fn match_lengths(
        &self,
        block_hashes: &Bound<'_, PyAny>,
        group_idx: Option<u32>,
    ) -> PyResult<Vec<usize>> {
        Ok(self
            .inner
            .match_lengths(&hash_list(block_hashes)?, group_idx))
    }

    /// `(replica, num_blocks)` of the longest held prefix, or None.
    #[pyo3(signature = (block_hashes, group_idx = None))]
    fn longest_prefix(
        &self,
        block_hashes: &Bound<'_, PyAny>,
        group_idx: Option<u32>,
    ) -> PyResult<Option<(u32, usize)>> {
        Ok(self
            .inner
            .longest_prefix(&hash_list(block_hashes)?, group_idx)
            .map(|m| (m.replica.0, m.num_blocks)))
    }

    #[pyo3(signature = (replica, block_hash, group_idx = None))]
    fn contains(
        &self,
        replica: u32,
        block_hash: &Bound<'_, PyAny>,
        group_idx: Option<u32>,
    ) -> PyResult<bool> {
        Ok(self
            .inner
            .contains(ReplicaId(replica), hash_item(block_hash)?, group_idx))
    }

    fn parent(&self, block_hash: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
        Ok(self.inner.parent(hash_item(block_hash)?))
    }

    fn chain(&self, block_hash: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        Ok(self.inner.chain(hash_item(block_hash)?))
    }

    /// Sorted `(hash, group_idx, count)` entries of one replica.
    fn replica_entries(&self, replica: u32) -> Vec<(u64, Option<u32>, u32)> {
        self.inner.replica_entries(ReplicaId(replica))
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.inner.check_invariants().map_err(err)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPrefixIndex>()
}
