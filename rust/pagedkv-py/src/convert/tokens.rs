//! Token ids in: a list, an int `NumPy` array or any sequence of ints; an
//! engine's signed ids and the suffix of its lists the core asks for; a batch's
//! sampled tokens.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PyString};

use pagedkv_core::OUTPUT_ROOM;
use pagedkv_core::sync::shorter_than_held;

use super::{IntSlice, check_room, exact_int_item, int_slice, reserve_for, too_many, try_collect};
use crate::errors::{PkResult, invalid_arg, type_error};

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

/// Token ids from a list of Python ints: exact ints in range take
/// [`exact_int_item`]'s direct path, anything else goes through
/// [`token_item`], which converts or explains.
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
