//! Binding of the router-side prefix index (`pagedkv_core::prefix_index`):
//! conversion only. Like the manager, every call converts its arguments (events
//! included) before it borrows the index.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyString};

use pagedkv_core::hash::event_int;
use pagedkv_core::prefix_index::{IndexEvent, PrefixIndex, ReplicaId, Tier};

use crate::convert::{IntSlice, int_slice};
use crate::errors::{PkResult, borrow, borrow_mut, invalid_arg, type_error};
use crate::events::{PyAllBlocksCleared, PyBlockRemoved, PyBlockStored};

/// vLLM's event form of one hash: an int in 0..2**64 as is, a digest by its
/// last 8 bytes (big-endian).
fn hash_item(item: &Bound<'_, PyAny>) -> PkResult<u64> {
    // Plain ints first: an exact type test is a pointer compare, where the
    // subclass tests below are a call each under the stable ABI.
    if item.is_exact_instance_of::<PyInt>() {
        return item
            .extract::<u64>()
            .map_err(|_| invalid_arg("block hash ints must be in 0..2**64"));
    }
    if let Ok(b) = item.cast::<PyBytes>() {
        let d = b.as_bytes();
        if d.is_empty() {
            return Err(invalid_arg("empty block hash"));
        }
        return Ok(event_int(d));
    }
    if item.is_instance_of::<PyInt>() {
        return item
            .extract::<u64>()
            .map_err(|_| invalid_arg("block hash ints must be in 0..2**64"));
    }
    Err(type_error("block hashes must be ints or bytes"))
}

/// A hash chain from a uint64 `NumPy` array or a sequence of ints / bytes.
fn hash_list(obj: &Bound<'_, PyAny>) -> PkResult<Vec<u64>> {
    let read = int_slice(obj, |items| {
        Ok(match items {
            IntSlice::U64(a) => Some(a.to_vec()),
            // Other integer arrays are read item by item, each checked.
            _ => None,
        })
    });
    if let Some(Ok(Some(hashes))) = read {
        return Ok(hashes);
    }
    if let Ok(list) = obj.cast::<PyList>() {
        // A tuple's items are read borrowed, one call each, where a list's
        // take three (the stable ABI has no borrowed list access).
        let items = list.to_tuple();
        let mut hashes = Vec::with_capacity(items.len());
        for x in items.iter_borrowed() {
            hashes.push(hash_item(&x)?);
        }
        return Ok(hashes);
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(type_error("block hashes must be a sequence"));
    }
    obj.try_iter()?.map(|x| hash_item(&x?)).collect()
}

fn opt_hash(obj: Option<&Bound<'_, PyAny>>) -> PkResult<Option<u64>> {
    match obj {
        Some(o) if !o.is_none() => hash_item(o).map(Some),
        _ => Ok(None),
    }
}

/// One event object as the index applies it: `pagedkv.events` objects are read
/// directly; other objects (the `pagedkv.events.wire` structs, vLLM's own) by
/// their fields, their kind from their msgspec tag or else their class name.
/// The tier of an event's `medium` (`None`, or an object without one: GPU).
fn tier_of(medium: Option<&Bound<'_, PyAny>>) -> PkResult<Tier> {
    let name: Option<String> = match medium {
        Some(m) if !m.is_none() => Some(
            m.extract()
                .map_err(|_| type_error("an event's medium must be a str or None"))?,
        ),
        _ => None,
    };
    Ok(Tier::from_medium(name.as_deref())?)
}

fn index_event(ev: &Bound<'_, PyAny>) -> PkResult<IndexEvent> {
    let py = ev.py();
    if let Ok(s) = ev.cast::<PyBlockStored>() {
        let s = s.get();
        return Ok(IndexEvent::Stored {
            parent: opt_hash(Some(s.parent_block_hash.bind(py)))?,
            hashes: hash_list(s.block_hashes.bind(py))?,
            group: s.group_idx.extract(py)?,
            tier: tier_of(Some(s.medium.bind(py)))?,
        });
    }
    if let Ok(r) = ev.cast::<PyBlockRemoved>() {
        let r = r.get();
        return Ok(IndexEvent::Removed {
            hashes: hash_list(r.block_hashes.bind(py))?,
            group: r.group_idx.extract(py)?,
            tier: tier_of(Some(r.medium.bind(py)))?,
        });
    }
    if ev.is_instance_of::<PyAllBlocksCleared>() {
        return Ok(IndexEvent::Cleared);
    }
    let ty = ev.get_type();
    let tag = ty
        .getattr_opt("__struct_config__")?
        .map(|c| c.getattr("tag"))
        .transpose()?
        .filter(pyo3::types::PyAnyMethods::is_instance_of::<PyString>);
    let kind = match tag {
        Some(t) => t.extract::<String>()?,
        None => ty.name()?.to_str()?.to_owned(),
    };
    match kind.as_str() {
        "BlockStored" => Ok(IndexEvent::Stored {
            parent: opt_hash(Some(&ev.getattr("parent_block_hash")?))?,
            hashes: hash_list(&ev.getattr("block_hashes")?)?,
            group: ev.getattr("group_idx")?.extract()?,
            tier: tier_of(ev.getattr_opt("medium")?.as_ref())?,
        }),
        "BlockRemoved" => Ok(IndexEvent::Removed {
            hashes: hash_list(&ev.getattr("block_hashes")?)?,
            group: ev.getattr("group_idx")?.extract()?,
            tier: tier_of(ev.getattr_opt("medium")?.as_ref())?,
        }),
        "AllBlocksCleared" => Ok(IndexEvent::Cleared),
        other => Err(type_error(format!("not a KV-cache event: {other}"))),
    }
}

/// Which replica holds which cached blocks, fed by KV events, answering
/// longest-prefix queries. Replicas are dense ints from `replica(name)`.
#[pyclass(name = "PrefixIndex", module = "pagedkv._core")]
#[derive(Debug)]
pub struct PyPrefixIndex {
    inner: PrefixIndex,
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

    #[pyo3(signature = (replica, block_hashes, parent_block_hash = None, group_idx = None,
        medium = None))]
    fn store(
        slf: &Bound<'_, Self>,
        replica: u32,
        block_hashes: &Bound<'_, PyAny>,
        parent_block_hash: Option<&Bound<'_, PyAny>>,
        group_idx: Option<u32>,
        medium: Option<&str>,
    ) -> PkResult<()> {
        let hashes = hash_list(block_hashes)?;
        let parent = opt_hash(parent_block_hash)?;
        let tier = Tier::from_medium(medium)?;
        Ok(borrow_mut(slf)?
            .inner
            .store_in(ReplicaId(replica), parent, &hashes, group_idx, tier)?)
    }

    #[pyo3(signature = (replica, block_hashes, group_idx = None, medium = None))]
    fn remove(
        slf: &Bound<'_, Self>,
        replica: u32,
        block_hashes: &Bound<'_, PyAny>,
        group_idx: Option<u32>,
        medium: Option<&str>,
    ) -> PkResult<()> {
        let hashes = hash_list(block_hashes)?;
        let tier = Tier::from_medium(medium)?;
        Ok(borrow_mut(slf)?
            .inner
            .remove_from(ReplicaId(replica), &hashes, group_idx, tier)?)
    }

    /// Per replica id, the held prefix's blocks by the fastest tier each is
    /// held in: `(device, host, disk)`.
    #[pyo3(signature = (block_hashes, group_idx = None))]
    fn match_tiers(
        slf: &Bound<'_, Self>,
        block_hashes: &Bound<'_, PyAny>,
        group_idx: Option<u32>,
    ) -> PkResult<Vec<[usize; 3]>> {
        let hashes = hash_list(block_hashes)?;
        Ok(borrow(slf)?.inner.match_tiers(&hashes, group_idx))
    }

    /// Per replica id, the held prefix weighed by tier (`weights`: device,
    /// host, disk).
    #[pyo3(signature = (block_hashes, weights, group_idx = None))]
    fn weighted_match(
        slf: &Bound<'_, Self>,
        block_hashes: &Bound<'_, PyAny>,
        weights: [f64; 3],
        group_idx: Option<u32>,
    ) -> PkResult<Vec<f64>> {
        if weights.iter().any(|w| !w.is_finite() || *w < 0.0) {
            return Err(invalid_arg("tier weights must be finite and not negative"));
        }
        let hashes = hash_list(block_hashes)?;
        Ok(borrow(slf)?
            .inner
            .weighted_match(&hashes, group_idx, weights))
    }

    fn clear(&mut self, replica: u32) -> PkResult<()> {
        Ok(self.inner.clear(ReplicaId(replica))?)
    }

    /// Applies events of one replica in order (one crossing per batch), all or
    /// nothing: a bad event refuses the whole batch before any is applied.
    /// Returns how many were applied.
    fn apply_events(
        slf: &Bound<'_, Self>,
        replica: u32,
        events: &Bound<'_, PyAny>,
    ) -> PkResult<usize> {
        let mut converted = Vec::new();
        for ev in events.try_iter()? {
            converted.push(index_event(&ev?)?);
        }
        Ok(borrow_mut(slf)?
            .inner
            .apply_all(ReplicaId(replica), &converted)?)
    }

    #[pyo3(signature = (block_hashes, group_idx = None))]
    fn match_lengths(
        slf: &Bound<'_, Self>,
        block_hashes: &Bound<'_, PyAny>,
        group_idx: Option<u32>,
    ) -> PkResult<Vec<usize>> {
        let hashes = hash_list(block_hashes)?;
        Ok(borrow(slf)?.inner.match_lengths(&hashes, group_idx))
    }

    /// `(replica, num_blocks)` of the longest held prefix, or None.
    #[pyo3(signature = (block_hashes, group_idx = None))]
    fn longest_prefix(
        slf: &Bound<'_, Self>,
        block_hashes: &Bound<'_, PyAny>,
        group_idx: Option<u32>,
    ) -> PkResult<Option<(u32, usize)>> {
        let hashes = hash_list(block_hashes)?;
        Ok(borrow(slf)?
            .inner
            .longest_prefix(&hashes, group_idx)
            .map(|m| (m.replica.0, m.num_blocks)))
    }

    #[pyo3(signature = (replica, block_hash, group_idx = None))]
    fn contains(
        slf: &Bound<'_, Self>,
        replica: u32,
        block_hash: &Bound<'_, PyAny>,
        group_idx: Option<u32>,
    ) -> PkResult<bool> {
        let h = hash_item(block_hash)?;
        Ok(borrow(slf)?
            .inner
            .contains(ReplicaId(replica), h, group_idx))
    }

    fn parent(slf: &Bound<'_, Self>, block_hash: &Bound<'_, PyAny>) -> PkResult<Option<u64>> {
        let h = hash_item(block_hash)?;
        Ok(borrow(slf)?.inner.parent(h))
    }

    fn chain(slf: &Bound<'_, Self>, block_hash: &Bound<'_, PyAny>) -> PkResult<Vec<u64>> {
        let h = hash_item(block_hash)?;
        Ok(borrow(slf)?.inner.chain(h))
    }

    /// Sorted `(hash, group_idx, count)` entries of one replica.
    fn replica_entries(&self, replica: u32) -> Vec<(u64, Option<u32>, u32)> {
        self.inner.replica_entries(ReplicaId(replica))
    }

    fn check_invariants(&self) -> PkResult<()> {
        Ok(self.inner.check_invariants()?)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPrefixIndex>()
}
