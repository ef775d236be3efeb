//! `add_request`'s extras in: multimodal items, prompt embeddings' bytes, extra
//! keys of any CBOR-encodable shape.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyInt, PyList, PyMemoryView, PyString, PyTuple};

use pagedkv_core::{CborValue, Lora, MmFeature, RequestSpec};

use super::{count, reserve_for};
use crate::errors::{PkResult, type_error};

/// A request's prompt and the rest of `add_request`'s arguments, converted.
/// Inlined: returned through a `Result`, the spec was stored field by field and
/// read back wide by the caller (as `Counts::args` in `manager/args.rs`).
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
