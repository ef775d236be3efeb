//! Counts, block ids and block hashes in, a batch's requests (ids or handles);
//! block ids out as int32 arrays.

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyBytes, PyInt, PyList, PyString, PyTuple};

use pagedkv_core::sync::shorter_than_held;
use pagedkv_core::{BlockHash, BlockId, RequestRefs};

use super::tokens::suffix;
use super::{
    IntSlice, check_room, count, exact_int_item, int_slice, reserve_for, too_many, try_collect,
};
use crate::errors::{PkResult, invalid_arg, type_error};

/// Counts, one per request of a batch of `n`, or one count for all of them (an
/// int, or a `NumPy` or torch integer scalar).
pub fn counts_or_one(name: &str, obj: &Bound<'_, PyAny>, n: usize) -> PkResult<Vec<u64>> {
    // An int first: asking it for a length raises (and clears) a TypeError,
    // which cost more than the rest of a one-request batch call.
    if obj.is_instance_of::<PyInt>() || obj.len().is_err() {
        // No sequence: one count (an int too large, or no int, refused here).
        return Ok(vec![count(name, obj.extract::<i64>()?)?; n]);
    }
    counts(name, obj)
}

/// Non-negative counts from an int `NumPy` array or a sequence.
pub fn counts(name: &str, obj: &Bound<'_, PyAny>) -> PkResult<Vec<u64>> {
    if let Ok(list) = obj.cast::<PyList>() {
        // Exact ints read in place; anything else converted (or refused) by
        // the general path.
        let n = list.len();
        let mut v = Vec::with_capacity(n);
        for i in 0..n {
            match exact_int_item(list, i) {
                Some(c) if c >= 0 => v.push(c as u64),
                _ => return counts_of(name, obj),
            }
        }
        return Ok(v);
    }
    let read = int_slice(obj, |items| match items {
        IntSlice::I64(a) => non_negative(name, a.iter().copied()),
        IntSlice::I32(a) => non_negative(name, a.iter().map(|&v| i64::from(v))),
        IntSlice::U32(a) => Ok(a.iter().map(|&v| u64::from(v)).collect()),
        IntSlice::U64(a) => Ok(a.to_vec()),
    });
    if let Some(read) = read {
        return read;
    }
    counts_of(name, obj)
}

/// [`counts`] of any sequence, item by item.
fn counts_of(name: &str, obj: &Bound<'_, PyAny>) -> PkResult<Vec<u64>> {
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(type_error(format!("{name} must be a sequence of ints")));
    }
    let mut v = Vec::with_capacity(reserve_for(obj, usize::MAX, name)?);
    for item in obj.try_iter()? {
        v.push(item?.extract::<i64>()?);
    }
    non_negative(name, v.into_iter())
}

/// The values as counts, or the first negative one refused: one scan to check,
/// one tight loop to convert (a step's arrays hold hundreds of counts).
fn non_negative(name: &str, values: impl Iterator<Item = i64> + Clone) -> PkResult<Vec<u64>> {
    if let Some(bad) = values.clone().find(|&v| v < 0) {
        return Err(invalid_arg(format!(
            "{name} must be non-negative, got {bad}"
        )));
    }
    Ok(values.map(|v| v as u64).collect())
}

/// Block ids: non-negative ints below 2**32 (the pool checks its own range).
pub fn block_ids(obj: &Bound<'_, PyAny>) -> PkResult<Vec<BlockId>> {
    let counts = counts("block id", obj)?;
    try_collect(
        counts.len(),
        counts.into_iter().map(|v| block_id(i128::from(v))),
    )
}

/// One block id (`0..2**32`).
pub fn block_id(v: impl Into<i128>) -> PkResult<BlockId> {
    let v = v.into();
    BlockId::try_from(v).map_err(|_| invalid_arg(format!("block id {v} is outside 0..2**32")))
}

/// Block hashes (bytes, 1..=32 long) from a sequence, at most `limit`.
pub fn block_hash_list(obj: &Bound<'_, PyAny>, limit: usize) -> PkResult<Vec<BlockHash>> {
    let mut out = Vec::with_capacity(reserve_for(obj, limit, "block hashes")?);
    for item in obj.try_iter()? {
        check_room(out.len(), limit, "block hashes")?;
        out.push(block_hash_item(&item?)?);
    }
    Ok(out)
}

/// The block hashes of a sequence from index `from` on (an engine request's
/// new hashes): a list is read in place, anything else sliced first.
///
/// # Errors
/// As [`suffix`] and [`block_hash_list`].
pub fn block_hashes_from(
    obj: &Bound<'_, PyAny>,
    from: usize,
    limit: usize,
) -> PkResult<Vec<BlockHash>> {
    let Ok(list) = obj.cast::<PyList>() else {
        return match suffix(obj, from)? {
            Some(h) => block_hash_list(&h, limit),
            None => Ok(Vec::new()),
        };
    };
    let n = list.len();
    if n < from {
        return Err(shorter_than_held(n, from).into());
    }
    if n - from > limit {
        return Err(too_many("block hashes", n - from, limit));
    }
    try_collect(
        n - from,
        (from..n).map(|i| block_hash_item(&list.get_item(i)?)),
    )
}

/// One block hash: bytes, 1..=32 long.
pub fn block_hash_item(item: &Bound<'_, PyAny>) -> PkResult<BlockHash> {
    let b = item.cast::<PyBytes>().map_err(|_| {
        type_error(format!(
            "block hashes must be bytes, got {}",
            item.get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string())
        ))
    })?;
    block_hash("block hash", b.as_bytes())
}

/// A block-hash digest (1..=32 bytes).
pub fn block_hash(what: &str, bytes: &[u8]) -> PkResult<BlockHash> {
    BlockHash::from_slice(bytes).ok_or_else(|| invalid_arg(format!("{what} must be 1..32 bytes")))
}

/// The requests of a batch call: a sequence of ids, or handles (a list of ints
/// or an integer `NumPy` array) as `add_request` returned them.
pub enum BatchIds {
    Names(Vec<PyBackedStr>),
    Handles(Vec<u64>),
}

impl BatchIds {
    pub fn extract(obj: &Bound<'_, PyAny>) -> PkResult<Self> {
        if let Ok(list) = obj.cast::<PyList>() {
            let first_is_int = match list.len() {
                0 => false,
                _ => list.get_item(0)?.is_instance_of::<PyInt>(),
            };
            if first_is_int {
                return try_collect(
                    list.len(),
                    (0..list.len()).map(|i| match exact_int_item(list, i) {
                        Some(h) if h >= 0 => Ok(h as u64),
                        _ => list.get_item(i)?.extract::<u64>().map_err(|_| {
                            type_error("request handles must be ints returned by add_request")
                        }),
                    }),
                )
                .map(Self::Handles);
            }
        }
        let read = int_slice(obj, |items| {
            Ok(match items {
                // A negative value is no handle: it maps to one that is never live.
                IntSlice::I64(a) => a.iter().map(|&h| h as u64).collect(),
                IntSlice::U64(a) => a.to_vec(),
                IntSlice::I32(_) | IntSlice::U32(_) => {
                    return Err(type_error(
                        "request handles come as int64 or uint64 arrays (handles need 64 bits)",
                    ));
                }
            })
        });
        if let Some(read) = read {
            return read.map(Self::Handles);
        }
        if obj.is_instance_of::<PyString>() {
            return Err(type_error(
                "request_ids must be a sequence of ids, not one string",
            ));
        }
        let mut names = Vec::with_capacity(reserve_for(obj, usize::MAX, "request ids")?);
        for item in obj.try_iter()? {
            names.push(item?.extract::<PyBackedStr>()?);
        }
        Ok(Self::Names(names))
    }

    /// Requests in the batch.
    pub fn len(&self) -> usize {
        match self {
            Self::Names(v) => v.len(),
            Self::Handles(h) => h.len(),
        }
    }

    pub fn with_refs<T>(&self, f: impl FnOnce(RequestRefs<'_>) -> T) -> T {
        match self {
            Self::Names(v) => {
                let ids: Vec<&str> = v.iter().map(|s| &**s).collect();
                f(RequestRefs::Ids(&ids))
            }
            Self::Handles(h) => f(RequestRefs::Handles(h)),
        }
    }
}

/// Block ids as they leave: int32 (the binding caps pools below 2^31 blocks).
pub fn ids_i32(ids: &[BlockId]) -> Vec<i32> {
    ids.iter().map(|&x| x as i32).collect()
}

/// Per-group block ids as int32 vectors (taken while the manager is borrowed;
/// [`groups_tuple`] makes the arrays once it is released).
pub fn groups_i32<S: AsRef<[BlockId]>>(groups: &[S]) -> Vec<Vec<i32>> {
    groups.iter().map(|g| ids_i32(g.as_ref())).collect()
}

/// A tuple of int32 arrays, one per group (the vectors are moved, not copied).
pub fn groups_tuple(py: Python<'_>, groups: Vec<Vec<i32>>) -> PyResult<Bound<'_, PyTuple>> {
    PyTuple::new(py, groups.into_iter().map(|g| PyArray1::from_vec(py, g)))
}
