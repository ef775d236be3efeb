//! Argument conversion: Python objects in, core types out (and block ids back
//! out as int32 `NumPy` arrays). A value the core's type cannot hold is refused
//! here; what a value means, and whether it is allowed, is the core's business.

use numpy::{
    Element, PyArray1, PyArrayDescr, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray1,
    PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyInt, PyList, PyMemoryView, PyString, PyTuple,
};

use pagedkv_core::spec::{OptionValue, SpecFields, config_int};
use pagedkv_core::sync::shorter_than_held;
use pagedkv_core::{
    BlockHash, BlockId, CborValue, GroupSpec, Lora, ManagerConfig, MmFeature, OUTPUT_ROOM,
    RequestRefs, RequestSpec,
};

use crate::errors::{PkResult, PyPkError, invalid_arg, invalid_config, type_error};

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

/// One token id (`0..2**32`).
fn token_id(v: impl Into<i128>) -> PkResult<u32> {
    let v = v.into();
    u32::try_from(v).map_err(|_| invalid_arg(format!("token id {v} is outside 0..2**32")))
}

/// `item`'s value when it is an integer of another type than `int` (a
/// `NumPy` integer scalar: `operator.index` takes it); `None` for a bool, a
/// float or anything else. Only asked on the refusal path.
fn integer_like(item: &Bound<'_, PyAny>) -> Option<String> {
    if item.is_instance_of::<PyBool>() {
        return None;
    }
    let v = item
        .py()
        .import("operator")
        .and_then(|op| op.call_method1("index", (item,)))
        .ok()?;
    Some(v.to_string())
}

fn token_item(item: &Bound<'_, PyAny>) -> PkResult<u32> {
    if item.is_instance_of::<PyBool>() {
        return Err(type_error("token ids must be ints, not bools"));
    }
    if let Ok(v) = item.extract::<u32>() {
        return Ok(v);
    }
    if let Some(v) = integer_like(item).filter(|_| !item.is_instance_of::<PyInt>()) {
        return Err(invalid_arg(format!("token id {v} is outside 0..2**32")));
    }
    let shown = item.repr().map(|r| r.to_string()).unwrap_or_default();
    if item.is_instance_of::<PyInt>() {
        Err(invalid_arg(format!("token id {shown} is outside 0..2**32")))
    } else {
        Err(type_error(format!("token ids must be ints, got {shown}")))
    }
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

/// Token ids from a list of Python ints: exact ints in range take
/// [`exact_int_item`]'s direct path, anything else goes through
/// [`token_item`], which converts or explains.
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

fn list_tokens(list: &Bound<'_, PyList>, limit: usize, room: usize) -> PkResult<Vec<u32>> {
    list_tokens_from(list, 0, limit, room)
}

/// [`list_tokens`] of the items from index `from` on (none when the list is
/// no longer), read in place; `room` more tokens reserved.
fn list_tokens_from(
    list: &Bound<'_, PyList>,
    from: usize,
    limit: usize,
    room: usize,
) -> PkResult<Vec<u32>> {
    let n = list.len();
    let from = from.min(n);
    if n - from > limit {
        return Err(too_many("token ids", n - from, limit));
    }
    let mut out = Vec::with_capacity(n - from + room);
    for i in from..n {
        match exact_int_item(list, i).and_then(|v| u32::try_from(v).ok()) {
            Some(t) => out.push(t),
            None => out.push(token_item(&list.get_item(i)?)?),
        }
    }
    Ok(out)
}

/// Whether `obj` is a buffer of integers `NumPy` can view without copying: a
/// `memoryview` or an `array.array` of an integer type code.
fn is_int_buffer(obj: &Bound<'_, PyAny>) -> PkResult<bool> {
    let (module, name) = {
        let t = obj.get_type();
        (t.module()?.to_string(), t.name()?.to_string())
    };
    Ok(match (module.as_str(), name.as_str()) {
        ("builtins", "memoryview") => true,
        ("array", "array") => {
            let code = obj.getattr("typecode")?.to_string();
            matches!(
                code.as_str(),
                "b" | "B" | "h" | "H" | "i" | "I" | "l" | "L" | "q" | "Q"
            )
        }
        _ => false,
    })
}

/// Token ids from a list, an int `NumPy` array or any sequence of ints; at most
/// `limit` of them (checked before anything is reserved).
pub fn tokens(obj: &Bound<'_, PyAny>, limit: usize) -> PkResult<Vec<u32>> {
    tokens_with_room(obj, limit, 0)
}

/// [`tokens`] of a prompt, with room for the core's [`OUTPUT_ROOM`] output
/// tokens reserved in the same allocation (the core would grow it otherwise).
pub fn prompt_tokens(obj: &Bound<'_, PyAny>, limit: usize) -> PkResult<Vec<u32>> {
    tokens_with_room(obj, limit, OUTPUT_ROOM)
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
/// costs ~60 ns an array, more than such a copy; a longer array (a prompt
/// the caller copies anyway) is read in place.
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

/// A request's prompt and the rest of `add_request`'s arguments, converted.
/// Inlined: returned through a `Result`, the spec was stored field by field and
/// read back wide by the caller (as `Counts::args` in `manager.rs`).
#[allow(clippy::inline_always)]
#[inline(always)]
pub fn request_spec(
    prompt_token_ids: Vec<u32>,
    lora: Option<Lora>,
    cache_salt: Option<String>,
    mm_features: Option<&Bound<'_, PyAny>>,
    prompt_embeds: Option<&Bound<'_, PyAny>>,
    skip_reading_prefix_cache: bool,
    session_id: Option<String>,
) -> PkResult<RequestSpec> {
    let mm_features = match mm_features.filter(|m| !m.is_none()) {
        Some(m) => self::mm_features(m)?,
        None => Vec::new(),
    };
    let prompt_embeds = prompt_embeds
        .filter(|e| !e.is_none())
        .map(embed_bytes)
        .transpose()?;
    Ok(RequestSpec {
        prompt_token_ids,
        lora,
        cache_salt,
        mm_features,
        prompt_embeds,
        skip_reading_prefix_cache,
        session_id,
    })
}

/// [`tokens`], `room` more reserved.
fn tokens_with_room(obj: &Bound<'_, PyAny>, limit: usize, room: usize) -> PkResult<Vec<u32>> {
    if let Ok(list) = obj.cast::<PyList>() {
        return list_tokens(list, limit, room);
    }
    let check = |n: usize| {
        if n > limit {
            Err(too_many("token ids", n, limit))
        } else {
            Ok(())
        }
    };
    let read = int_slice(obj, |items| {
        check(items.len())?;
        match items {
            IntSlice::U32(a) => {
                let mut out = Vec::with_capacity(a.len() + room);
                out.extend_from_slice(a);
                Ok(out)
            }
            IntSlice::I64(a) => try_collect(a.len() + room, a.iter().map(|&v| token_id(v))),
            IntSlice::I32(a) => try_collect(a.len() + room, a.iter().map(|&v| token_id(v))),
            IntSlice::U64(a) => try_collect(a.len() + room, a.iter().map(|&v| token_id(v))),
        }
    });
    if let Some(read) = read {
        return read;
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(type_error("token ids must be a sequence of ints"));
    }
    if is_int_buffer(obj)? {
        // A memoryview or array.array: viewed (not copied) as a NumPy array of
        // its own item type, then read by the typed paths above.
        let view = obj.py().import("numpy")?.call_method1("asarray", (obj,))?;
        return tokens_with_room(&view, limit, room);
    }
    let mut out = Vec::with_capacity(reserve_for(obj, limit, "token ids")? + room);
    for item in obj.try_iter()? {
        check_room(out.len(), limit, "token ids")?;
        out.push(token_item(&item?)?);
    }
    Ok(out)
}

/// The items of a sequence from index `from` on (a slice of it, so a list or
/// any sequence that slices).
pub fn suffix<'py>(obj: &Bound<'py, PyAny>, from: usize) -> PkResult<Option<Bound<'py, PyAny>>> {
    let len = obj.len()?;
    if len < from {
        return Err(shorter_than_held(len, from).into());
    }
    if len == from {
        return Ok(None);
    }
    let slice = pyo3::types::PySlice::new(obj.py(), from as isize, len as isize, 1);
    Ok(Some(obj.get_item(slice)?))
}

/// The token ids of `obj` from index `from` on (an engine request's new
/// tokens), read as [`engine_tokens`] reads them; a list of non-negative ids is
/// read in place instead of sliced first.
///
/// # Errors
/// As [`suffix`] and [`engine_tokens`].
pub fn engine_tokens_from(obj: &Bound<'_, PyAny>, from: usize, limit: usize) -> PkResult<Vec<u32>> {
    if let Some(t) = engine_list_tokens(obj, from, limit) {
        return Ok(t);
    }
    match suffix(obj, from)? {
        Some(t) => engine_tokens(&t, limit),
        None => Ok(Vec::new()),
    }
}

/// The engine token ids' fast path: the items of a list from index `from` on,
/// when all are non-negative ids in range. None for anything else (negative
/// ids, errors, not a list, a list shorter than `from`): the caller's general
/// path converts or explains.
fn engine_list_tokens(obj: &Bound<'_, PyAny>, from: usize, limit: usize) -> Option<Vec<u32>> {
    let list = obj.cast::<PyList>().ok()?;
    if list.len() < from {
        return None;
    }
    let t = list_tokens_from(list, from, limit, 0).ok()?;
    t.iter().all(|v| *v <= 0x7fff_ffff).then_some(t)
}

/// Token ids of an engine's request: signed 32-bit ints (`-2**31..2**31`),
/// stored in two's complement, so vLLM's `-1` multimodal placeholder is
/// [`pagedkv_core::PLACEHOLDER_TOKEN`] and events give every id back as it came in.
pub fn engine_tokens(obj: &Bound<'_, PyAny>, limit: usize) -> PkResult<Vec<u32>> {
    // A list of non-negative token ids takes the fast path; negative ids (and
    // every error) the item-by-item one below.
    if let Some(t) = engine_list_tokens(obj, 0, limit) {
        return Ok(t);
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(type_error("token ids must be a sequence of ints"));
    }
    if is_int_buffer(obj)? {
        // A memoryview or array.array: viewed (not copied) as a NumPy array of
        // its own item type, then read by the typed paths above.
        let view = obj.py().import("numpy")?.call_method1("asarray", (obj,))?;
        return tokens(&view, limit);
    }
    let mut out = Vec::with_capacity(reserve_for(obj, limit, "token ids")?);
    for item in obj.try_iter()? {
        check_room(out.len(), limit, "token ids")?;
        let item = item?;
        if item.is_instance_of::<PyBool>() || !item.is_instance_of::<PyInt>() {
            let shown = item.repr().map(|r| r.to_string()).unwrap_or_default();
            return Err(type_error(format!("token ids must be ints, got {shown}")));
        }
        let v = item
            .extract::<i32>()
            .map_err(|_| invalid_arg(format!("token id {item} is outside -2**31..2**31")))?;
        out.push(u32::from_ne_bytes(v.to_ne_bytes()));
    }
    Ok(out)
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

/// The token each request of a batch of `n` sampled since its last step, or
/// none (`None`, or a negative value in an int array or list): a list, an int
/// `NumPy` array or any sequence. The core refuses a length other than `n`;
/// the bound only keeps a lying length from reserving memory.
pub fn appended_tokens(obj: &Bound<'_, PyAny>, n: usize) -> PkResult<Vec<Option<u32>>> {
    let one = |v: i64| -> PkResult<Option<u32>> {
        if v < 0 {
            Ok(None)
        } else {
            token_id(v).map(Some)
        }
    };
    let item = |item: &Bound<'_, PyAny>| -> PkResult<Option<u32>> {
        if item.is_none() {
            return Ok(None);
        }
        if item.is_instance_of::<PyBool>() || !item.is_instance_of::<PyInt>() {
            return Err(type_error(
                "appended token ids must be ints (negative for none) or None",
            ));
        }
        match item.extract::<i64>() {
            Ok(v) => one(v),
            Err(_) => Err(invalid_arg(format!("token id {item} is outside 0..2**32"))),
        }
    };
    let limit = n.saturating_add(1 << 10);
    if let Ok(list) = obj.cast::<PyList>() {
        if list.len() > limit {
            return Err(too_many("appended token ids", list.len(), limit));
        }
        return try_collect(
            list.len(),
            (0..list.len()).map(|i| match exact_int_item(list, i) {
                Some(v) => one(v),
                None => item(&list.get_item(i)?),
            }),
        );
    }
    let read = int_slice(obj, |items| match items {
        IntSlice::I64(a) => try_collect(a.len(), a.iter().map(|&v| one(v))),
        IntSlice::I32(a) => try_collect(a.len(), a.iter().map(|&v| one(i64::from(v)))),
        IntSlice::U32(a) => Ok(a.iter().map(|&v| Some(v)).collect()),
        IntSlice::U64(a) => try_collect(a.len(), a.iter().map(|&v| token_id(v).map(Some))),
    });
    if let Some(read) = read {
        return read;
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(type_error(
            "appended token ids must be a sequence of ints or None",
        ));
    }
    let mut out = Vec::with_capacity(reserve_for(obj, limit, "appended token ids")?);
    for x in obj.try_iter()? {
        check_room(out.len(), limit, "appended token ids")?;
        out.push(item(&x?)?);
    }
    Ok(out)
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

/// `add_request`'s multimodal items: each a 3-tuple (or list) `(identifier,
/// offset, length)`, or an object like vLLM's `MultiModalFeatureSpec`
/// (`identifier`, and `mm_position.offset` / `.length`). Offsets and lengths
/// are exact ints (`NumPy` integers too), not bools or floats.
pub fn mm_features(obj: &Bound<'_, PyAny>) -> PkResult<Vec<MmFeature>> {
    let mut out = Vec::with_capacity(reserve_for(obj, usize::MAX, "multimodal items")?);
    for item in obj.try_iter()? {
        out.push(mm_feature(&item?)?);
    }
    Ok(out)
}

fn mm_feature(item: &Bound<'_, PyAny>) -> PkResult<MmFeature> {
    let (identifier, offset, length) =
        if item.is_instance_of::<PyTuple>() || item.is_instance_of::<PyList>() {
            if item.len()? != 3 {
                return Err(type_error(format!(
                    "a multimodal item is (identifier, offset, length), got {}",
                    item.repr()?
                )));
            }
            (item.get_item(0)?, item.get_item(1)?, item.get_item(2)?)
        } else if item.hasattr("identifier")? {
            let pos = item
                .getattr_opt("mm_position")?
                .unwrap_or_else(|| item.clone());
            let field = |name: &str| -> PyResult<Bound<'_, PyAny>> {
                Ok(pos
                    .getattr_opt(name)?
                    .unwrap_or_else(|| item.py().None().into_bound(item.py())))
            };
            (
                item.getattr("identifier")?,
                field("offset")?,
                field("length")?,
            )
        } else {
            return Err(type_error(format!(
                "mm_features items must be (identifier, offset, length) tuples or \
                 MultiModalFeatureSpec objects, got {}",
                item.repr()?
            )));
        };
    let Ok(identifier) = identifier.cast::<PyString>() else {
        return Err(type_error(format!(
            "a multimodal identifier must be a str, got {}",
            identifier.repr()?
        )));
    };
    Ok(MmFeature {
        identifier: identifier.to_str()?.to_owned(),
        offset: count("multimodal offset", mm_int("offset", &offset)?)?,
        length: count("multimodal length", mm_int("length", &length)?)?,
    })
}

/// An exact int (anything with `__index__` but a bool) of a multimodal item.
fn mm_int(name: &str, v: &Bound<'_, PyAny>) -> PkResult<i64> {
    if v.is_instance_of::<PyBool>() || !v.hasattr("__index__")? {
        return Err(type_error(format!(
            "a multimodal {name} must be an int, got {}",
            v.repr()?
        )));
    }
    Ok(v.extract::<i64>()?)
}

/// Raw row-major bytes of prompt embeddings (what vLLM's `tensor_data`
/// hashes): a bytes-like object as is, a torch tensor of any dtype (bfloat16
/// included) through its bytes, anything else as `NumPy` reads it.
pub fn embed_bytes(obj: &Bound<'_, PyAny>) -> PkResult<Vec<u8>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    let py = obj.py();
    let raw = if obj.is_instance_of::<PyByteArray>() || obj.is_instance_of::<PyMemoryView>() {
        py.get_type::<PyBytes>().call1((obj,))?
    } else if obj.hasattr("detach")? {
        let t = obj
            .call_method0("detach")?
            .call_method0("contiguous")?
            .call_method0("cpu")?;
        let u8 = py.import("torch")?.getattr("uint8")?;
        t.call_method1("view", (u8,))?
            .call_method0("numpy")?
            .call_method0("tobytes")?
    } else {
        py.import("numpy")?
            .call_method1("ascontiguousarray", (obj,))?
            .call_method0("tobytes")?
    };
    Ok(raw.cast::<PyBytes>()?.as_bytes().to_vec())
}

/// A block-hash digest (1..=32 bytes).
pub fn block_hash(what: &str, bytes: &[u8]) -> PkResult<BlockHash> {
    BlockHash::from_slice(bytes).ok_or_else(|| invalid_arg(format!("{what} must be 1..32 bytes")))
}

/// Extra keys of any CBOR-encodable shape.
pub fn cbor_value(obj: &Bound<'_, PyAny>) -> PkResult<CborValue> {
    if obj.is_none() {
        return Ok(CborValue::Null);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(CborValue::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        return Ok(CborValue::Int(obj.extract()?));
    }
    if let Ok(s) = obj.extract::<String>() {
        return Ok(CborValue::Text(s));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(CborValue::Bytes(b.as_bytes().to_vec()));
    }
    if obj.is_instance_of::<PyTuple>() || obj.is_instance_of::<PyList>() {
        let items: PkResult<Vec<CborValue>> = obj.try_iter()?.map(|x| cbor_value(&x?)).collect();
        return Ok(CborValue::Array(items?));
    }
    Err(type_error(format!(
        "extra keys must be None, bool, int, str, bytes, tuple or list, got {}",
        obj.get_type().name()?
    )))
}

// ---- configuration -----------------------------------------------------------

/// Extracts one `**options` value, naming it in the error as `PyO3` names arguments.
fn option<'py, T>(name: &str, v: &Bound<'py, PyAny>) -> PkResult<T>
where
    T: for<'a> FromPyObject<'a, 'py>,
{
    v.extract::<T>().map_err(|e| {
        let e: PyErr = e.into();
        // Python 3.11+; on 3.10 the note is simply missing.
        let _ = e
            .value(v.py())
            .call_method1("add_note", (format!("while processing '{name}'"),));
        PyPkError::Python(e)
    })
}

/// One `**options` entry, read as the core's [`ManagerConfig::set_option`]
/// asks.
struct OptionArg<'a, 'py> {
    name: &'a str,
    value: Bound<'py, PyAny>,
}

impl OptionValue for OptionArg<'_, '_> {
    type Error = PyPkError;

    fn flag(&self) -> PkResult<bool> {
        option(self.name, &self.value)
    }

    fn float(&self) -> PkResult<f64> {
        option(self.name, &self.value)
    }

    fn int(&self) -> PkResult<Option<i64>> {
        option(self.name, &self.value)
    }

    fn ints(&self) -> PkResult<Vec<u32>> {
        option(self.name, &self.value)
    }

    fn text(&self) -> PkResult<String> {
        Ok(option::<PyBackedStr>(self.name, &self.value)?.to_string())
    }

    /// A str, or an int (its decimal form, as `PYTHONHASHSEED` reads).
    fn seed(&self) -> PkResult<Option<String>> {
        let v = &self.value;
        if v.is_none() {
            return Ok(None);
        }
        if v.is_instance_of::<PyString>()
            || (v.is_instance_of::<PyInt>() && !v.is_instance_of::<PyBool>())
        {
            return Ok(Some(v.str()?.to_string()));
        }
        Err(type_error(format!(
            "hash_seed must be a str or an int, got {}",
            v.repr()?
        )))
    }
}

/// One group's spec dict (its spec's `core_spec()`, + `tag`), read as the
/// core's [`GroupSpec::from_fields`] asks.
struct SpecDict<'a, 'py>(&'a Bound<'py, PyDict>);

impl SpecFields for SpecDict<'_, '_> {
    type Error = PyPkError;

    fn text(&self, key: &str) -> PkResult<Option<String>> {
        Ok(self.0.get_item(key)?.map(|v| v.extract()).transpose()?)
    }

    fn int(&self, key: &str) -> PkResult<Option<i64>> {
        Ok(self.0.get_item(key)?.map(|v| v.extract()).transpose()?)
    }

    fn int_or_null(&self, key: &str) -> PkResult<Option<i64>> {
        match self.0.get_item(key)? {
            Some(v) if !v.is_none() => Ok(Some(v.extract()?)),
            _ => Ok(None),
        }
    }

    fn flag(&self, key: &str) -> PkResult<Option<bool>> {
        Ok(self.0.get_item(key)?.map(|v| v.extract()).transpose()?)
    }
}

/// The manager's configuration: the pool and groups, then each `**options` entry
/// over the core's defaults. The one place an option crosses the boundary.
pub fn manager_config(
    num_blocks: i64,
    groups: &[Bound<'_, PyDict>],
    max_model_len: i64,
    options: Option<&Bound<'_, PyDict>>,
) -> PkResult<ManagerConfig> {
    // Block ids leave as int32: the pool stays below 2^31 - 1 blocks.
    let num_blocks = u32::try_from(num_blocks)
        .ok()
        .filter(|&n| n < i32::MAX as u32)
        .ok_or_else(|| {
            invalid_config(format!(
                "num_blocks must be below 2**31 - 1 (block ids are int32), got {num_blocks}"
            ))
        })?;
    let groups = groups
        .iter()
        .map(|d| GroupSpec::from_fields(&SpecDict(d)))
        .collect::<PkResult<_>>()?;
    let mut cfg = ManagerConfig::new(
        num_blocks,
        groups,
        config_int("max_model_len", max_model_len)?,
    );
    for (key, value) in options.into_iter().flatten() {
        let key = key.cast_into::<PyString>()?;
        let name = key.to_str()?;
        if !cfg.set_option(name, &OptionArg { name, value })? {
            return Err(type_error(format!(
                "KVCacheManager() got an unexpected keyword argument '{name}'"
            )));
        }
    }
    Ok(cfg)
}
