//! Argument conversion: Python objects in, core types out (and block ids back
//! out as int32 `NumPy` arrays); the helpers every conversion shares here, each
//! kind of argument in its submodule. A value the core's type cannot hold is refused
//! here; what a value means, and whether it is allowed, is the core's business.

mod config;
mod ids;
mod keys;
mod request;
mod tokens;

pub use config::manager_config;
pub use ids::{
    BatchIds, block_hash, block_hash_item, block_hash_list, block_hashes_from, block_id, block_ids,
    counts, counts_or_one, groups_i32, groups_tuple, ids_i32,
};
pub use keys::{offload_key, offload_keys, position_items, positions};
pub use request::{cbor_value, request_spec};
pub use tokens::{appended_tokens, engine_tokens, engine_tokens_from, prompt_tokens, tokens};

use numpy::{
    Element, PyArray1, PyArrayDescr, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray1,
    PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::errors::{PkResult, PyPkError, invalid_arg, type_error};

/// Most items reserved ahead of converting a sequence: its `__len__` may lie,
/// so nothing beyond this is reserved from it; the vector grows as items come.
const PREALLOC: usize = 1 << 12;

/// How many items a sequence claims, refused when past `limit` before anything
/// is reserved or iterated; the capacity to reserve for it.
fn reserve_for(obj: &Bound<'_, PyAny>, limit: usize, what: &str) -> PkResult<usize> {
    match obj.len() {
        Ok(n) if n > limit => Err(too_many(what, n, limit)),
        Ok(n) => Ok(n.min(PREALLOC)),
        Err(_) => Ok(0),
    }
}

fn too_many(what: &str, n: usize, limit: usize) -> PyPkError {
    invalid_arg(format!("{n} {what}: more than the {limit} allowed here"))
}

/// Refuses the item that would make `n` items more than `limit` (an iterable
/// that yields more than it claimed).
fn check_room(n: usize, limit: usize, what: &str) -> PkResult<()> {
    if n >= limit {
        return Err(invalid_arg(format!(
            "the sequence yields more than {limit} {what}, the most allowed here"
        )));
    }
    Ok(())
}

/// A non-negative count.
pub fn count(name: &str, v: i64) -> PkResult<u64> {
    u64::try_from(v).map_err(|_| invalid_arg(format!("{name} must be non-negative, got {v}")))
}

/// Item `i` (below the list's length) of `list` when it is an exact Python int
/// that fits an `i64`: read directly (no reference counting, no error
/// machinery). `None` for anything else; the caller's slow path converts or
/// explains.
#[allow(unsafe_code)] // the one unsafe block of the workspace: see its SAFETY note
#[allow(clippy::useless_conversion)] // `c_long` is 32 bits on Windows
pub fn exact_int_item(list: &Bound<'_, PyList>, i: usize) -> Option<i64> {
    debug_assert!(i < list.len());
    let int_type = std::ptr::addr_of_mut!(pyo3::ffi::PyLong_Type);
    // SAFETY: the GIL is held (`list` is bound to it) and nothing here runs
    // Python code, so the list cannot change under us; `PyList_GetItem` checks
    // the index itself and returns a borrowed reference, used only here and
    // only after its null check; an error it or `PyLong_AsLong` sets is
    // cleared before returning.
    unsafe {
        let item = pyo3::ffi::PyList_GetItem(list.as_ptr(), i as pyo3::ffi::Py_ssize_t);
        if item.is_null() {
            pyo3::ffi::PyErr_Clear();
            return None;
        }
        if pyo3::ffi::Py_TYPE(item) != int_type {
            return None;
        }
        let v = pyo3::ffi::PyLong_AsLong(item);
        if v == -1 && !pyo3::ffi::PyErr_Occurred().is_null() {
            pyo3::ffi::PyErr_Clear();
            return None;
        }
        Some(i64::from(v))
    }
}

/// The items of `items` (`n` of them) collected into a vector reserved once:
/// collecting fallible items straight into a `PkResult<Vec<_>>` loses the
/// count and grows the vector by reallocation.
fn try_collect<T>(n: usize, items: impl Iterator<Item = PkResult<T>>) -> PkResult<Vec<T>> {
    let mut out = Vec::with_capacity(n);
    for item in items {
        out.push(item?);
    }
    Ok(out)
}

/// The items of a one-dimensional integer `NumPy` array, read in place.
pub enum IntSlice<'a> {
    I64(&'a [i64]),
    I32(&'a [i32]),
    U32(&'a [u32]),
    U64(&'a [u64]),
}

impl IntSlice<'_> {
    fn len(&self) -> usize {
        match self {
            Self::I64(a) => a.len(),
            Self::I32(a) => a.len(),
            Self::U32(a) => a.len(),
            Self::U64(a) => a.len(),
        }
    }
}

/// Arrays of at most this many items (a batch's counts or handles, a short
/// prompt) are copied out instead of borrowed: `numpy`'s borrow tracking
/// costs more than such a copy (see `docs/perf-log.md`); a longer array (a
/// prompt the caller copies anyway) is read in place.
const SMALL_ARRAY: usize = 1024;

/// `f` of the items of `obj` when it is a one-dimensional `NumPy` array of 32-
/// or 64-bit integers; None for anything else (the caller's general path reads
/// it item by item). A contiguous, aligned array in native byte order is read
/// in place (copied out first when it has at most [`SMALL_ARRAY`] items); any
/// other (a strided view, a byte-swapped or misaligned buffer: its typed read
/// refused) is first copied by `NumPy` into one that is, and one whose items
/// overlap (a broadcast view) is refused. The
/// item type is read off the array's descriptor, so only the matching typed
/// read is tried (each typed read refused asks `NumPy` whether two dtypes are
/// equivalent).
pub fn int_slice<R>(
    obj: &Bound<'_, PyAny>,
    f: impl FnOnce(IntSlice<'_>) -> PkResult<R>,
) -> Option<PkResult<R>> {
    /// `f` of the array's items of type `T`, read in place or from a copy.
    fn read<T: Element, R>(
        obj: &Bound<'_, PyAny>,
        a: &Bound<'_, PyUntypedArray>,
        d: &Bound<'_, PyArrayDescr>,
        f: impl FnOnce(&[T]) -> PkResult<R>,
    ) -> PkResult<R> {
        if a.len() <= SMALL_ARRAY {
            // `to_vec` refuses what the borrowed read would (a strided,
            // misaligned or byte-swapped array), which then takes the copy below.
            if let Ok(a) = obj.cast::<PyArray1<T>>()
                && let Ok(items) = a.to_vec()
            {
                return f(&items);
            }
        } else if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, T>>()
            && let Ok(items) = a.as_slice()
        {
            return f(items);
        }
        // A copy is no larger than the memory the array's items already take,
        // unless they overlap: a broadcast (or `as_strided`) view may name far
        // more items than it holds, and is refused rather than copied.
        if a.len() > 1 && a.strides()[0].unsigned_abs() < d.itemsize() {
            return Err(type_error(
                "an integer array whose items overlap (a broadcast view): pass a copy",
            ));
        }
        // `require` copies into a native, contiguous and aligned array.
        let py = obj.py();
        let native = py.import("numpy")?.call_method1(
            "require",
            (obj, d.call_method1("newbyteorder", ("=",))?, "CA"),
        )?;
        let a = native.extract::<PyReadonlyArray1<'_, T>>()?;
        f(a.as_slice()?)
    }
    let a = obj.cast::<PyUntypedArray>().ok()?;
    if a.ndim() != 1 {
        return None;
    }
    let d = a.dtype();
    Some(match (d.kind(), d.itemsize()) {
        // 8- and 16-bit integers are widened to int64 (a copy no larger than
        // four times the array), so their values are refused as every other
        // integer dtype's are.
        (b'i' | b'u', 1 | 2) => {
            let wide = match obj.call_method1("astype", ("int64",)) {
                Ok(w) => w,
                Err(e) => return Some(Err(e.into())),
            };
            let wa = wide.cast::<PyUntypedArray>().ok()?;
            read(&wide, wa, &wa.dtype(), |s| f(IntSlice::I64(s)))
        }
        (b'i', 8) => read(obj, a, &d, |s| f(IntSlice::I64(s))),
        (b'i', 4) => read(obj, a, &d, |s| f(IntSlice::I32(s))),
        (b'u', 4) => read(obj, a, &d, |s| f(IntSlice::U32(s))),
        (b'u', 8) => read(obj, a, &d, |s| f(IntSlice::U64(s))),
        _ => return None,
    })
}
