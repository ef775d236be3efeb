//! Offload keys (`bytes`) and their end-token positions.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use pagedkv_core::offload::OffloadKey;

use super::{check_room, reserve_for};
use crate::errors::{PkResult, invalid_arg, type_error};

/// Most keys one call takes.
const MAX_KEYS: usize = 1 << 24;

/// One key: `bytes` of at most `MAX_KEY_LEN`.
pub fn offload_key(obj: &Bound<'_, PyAny>) -> PkResult<OffloadKey> {
    let b = obj
        .cast::<PyBytes>()
        .map_err(|_| type_error("offload keys must be bytes"))?;
    Ok(OffloadKey::from_bytes(b.as_bytes())?)
}

/// A sequence of keys (a list or tuple fast, any iterable otherwise).
pub fn offload_keys(obj: &Bound<'_, PyAny>) -> PkResult<Vec<OffloadKey>> {
    if let Ok(list) = obj.cast::<PyList>() {
        if list.len() > MAX_KEYS {
            return Err(invalid_arg(format!(
                "{} keys: more than the {MAX_KEYS} allowed",
                list.len()
            )));
        }
        return list.iter().map(|k| offload_key(&k)).collect();
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return t.iter().map(|k| offload_key(&k)).collect();
    }
    if obj.is_instance_of::<PyBytes>() {
        return Err(type_error(
            "keys must be a sequence of bytes, not one bytes object",
        ));
    }
    let mut out = Vec::with_capacity(reserve_for(obj, MAX_KEYS, "keys")?);
    for k in obj.try_iter()? {
        check_room(out.len(), MAX_KEYS, "keys")?;
        out.push(offload_key(&k?)?);
    }
    Ok(out)
}

/// Positions aligned with `keys_obj`'s keys (`n` of them): `None` for none
/// known; a dict of key → position (a scheduler's own record; absent keys are
/// unknown; `keys_obj` must then be a list or tuple); or a sequence of ints
/// (`None` items unknown), each in 0..2**62.
pub fn positions(
    obj: Option<&Bound<'_, PyAny>>,
    keys_obj: &Bound<'_, PyAny>,
    n: usize,
) -> PkResult<Vec<i64>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(Vec::new());
    };
    if let Ok(known) = obj.cast::<PyDict>() {
        if known.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<Bound<'_, PyAny>> = if let Ok(l) = keys_obj.cast::<PyList>() {
            l.iter().collect()
        } else if let Ok(t) = keys_obj.cast::<PyTuple>() {
            t.iter().collect()
        } else {
            return Err(type_error(
                "positions as a dict need the keys as a list or tuple",
            ));
        };
        return keys
            .iter()
            .map(|k| position(known.get_item(k)?.as_ref()))
            .collect();
    }
    let mut out = Vec::with_capacity(n);
    for item in obj.try_iter()? {
        if out.len() >= n {
            return Err(invalid_arg(format!("more positions than the {n} keys")));
        }
        out.push(position(Some(&item?))?);
    }
    if out.len() != n {
        return Err(invalid_arg(format!("{} positions for {n} keys", out.len())));
    }
    Ok(out)
}

fn position(item: Option<&Bound<'_, PyAny>>) -> PkResult<i64> {
    let Some(item) = item.filter(|i| !i.is_none()) else {
        return Ok(-1);
    };
    let p: i64 = item.extract()?;
    if !(0..1 << 62).contains(&p) {
        return Err(invalid_arg(format!("position {p} out of range (0..2**62)")));
    }
    Ok(p)
}

/// A dict of key → position as `(keys, positions)`.
pub fn position_items(known: &Bound<'_, PyDict>) -> PkResult<(Vec<OffloadKey>, Vec<i64>)> {
    let mut keys = Vec::with_capacity(known.len());
    let mut pos = Vec::with_capacity(known.len());
    for (k, p) in known.iter() {
        keys.push(offload_key(&k)?);
        pos.push(position(Some(&p))?);
    }
    Ok((keys, pos))
}
