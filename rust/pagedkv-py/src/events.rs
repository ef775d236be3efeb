//! KV-cache events as Python objects: `BlockStored`, `BlockRemoved` and
//! `AllBlocksCleared` with vLLM 0.33's fields, what `pagedkv.events` exports and
//! `take_events` returns. Frozen value objects: built here once per event from
//! the core's [`KvEvent`]s, compared, hashed, printed and pickled like the
//! frozen dataclasses vLLM's consumers know; read back without Python code by the
//! prefix index.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PyString, PyTuple, PyType};
use pyo3::{Borrowed, intern};

use pagedkv_core::hash::event_int;
use pagedkv_core::offload::{OffloadEvent, TierKvEvent, kv_events};
use pagedkv_core::{BlockHash, EventExtraKey, KvEvent};

/// Field tuple, repr, equality, hash and pickling of an event class, from its
/// field names (the order of its constructor's arguments).
macro_rules! value_object {
    ($ty:ident, $name:literal, [$($field:ident),*], $($new:tt)*) => {
        impl $ty {
            const FIELDS: &'static [&'static str] = &[$(stringify!($field)),*];

            fn values<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
                PyTuple::new(py, [$(self.$field.bind(py)),*] as [&Bound<'py, PyAny>; Self::FIELDS.len()])
            }
        }

        #[pymethods]
        impl $ty {
            $($new)*

            #[classattr]
            fn __match_args__(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
                PyTuple::new(py, Self::FIELDS)
            }

            fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
                let mut out = String::from(concat!($name, "("));
                for (i, (name, v)) in Self::FIELDS.iter().zip(self.values(py)?.iter()).enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    out.push_str(name);
                    out.push('=');
                    out.push_str(v.repr()?.to_str()?);
                }
                out.push(')');
                Ok(out)
            }

            /// Equal when of the same class with equal fields (a dataclass's `==`).
            fn __eq__(&self, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
                let py = other.py();
                match other.cast::<Self>() {
                    Ok(o) => {
                        let eq = self.values(py)?.eq(o.get().values(py)?)?;
                        Ok(PyBool::new(py, eq).to_owned().into_any().unbind())
                    }
                    Err(_) => Ok(py.NotImplemented()),
                }
            }

            fn __hash__(&self, py: Python<'_>) -> PyResult<isize> {
                self.values(py)?.hash()
            }

            fn __reduce__<'py>(
                slf: &Bound<'py, Self>,
            ) -> PyResult<(Bound<'py, PyType>, Bound<'py, PyTuple>)> {
                Ok((slf.get_type(), slf.get().values(slf.py())?))
            }
        }
    };
}

/// `medium` defaults to `"GPU"`; an explicit `None` stays `None`.
pub enum Medium<'py> {
    Gpu,
    Given(Bound<'py, PyAny>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Medium<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Self::Given(obj.to_owned()))
    }
}

impl Medium<'_> {
    fn resolve(self, py: Python<'_>) -> Py<PyAny> {
        match self {
            Self::Gpu => gpu(py),
            Self::Given(v) => v.unbind(),
        }
    }
}

fn gpu(py: Python<'_>) -> Py<PyAny> {
    intern!(py, "GPU").clone().into_any().unbind()
}

/// Event token ids. An engine's ids are signed 32-bit values stored in two's
/// complement, so vLLM's `-1` placeholder ([`pagedkv_core::PLACEHOLDER_TOKEN`]) and any other
/// negative id go back out as they came in; pagedkv's own ids are unsigned.
fn event_tokens(tokens: &[u32], signed: bool) -> Vec<i64> {
    if signed {
        tokens
            .iter()
            .map(|&t| i64::from(i32::from_ne_bytes(t.to_ne_bytes())))
            .collect()
    } else {
        tokens.iter().map(|&t| i64::from(t)).collect()
    }
}

fn none_or(py: Python<'_>, v: Option<Py<PyAny>>) -> Py<PyAny> {
    v.unwrap_or_else(|| py.None())
}

/// Full blocks entered into the prefix cache by one call.
#[pyclass(
    module = "pagedkv._core",
    name = "BlockStored",
    frozen,
    get_all,
    freelist = 1024
)]
#[derive(Debug)]
pub struct PyBlockStored {
    pub block_hashes: Py<PyAny>,
    pub parent_block_hash: Py<PyAny>,
    pub token_ids: Py<PyAny>,
    pub block_size: Py<PyAny>,
    pub lora_id: Py<PyAny>,
    pub medium: Py<PyAny>,
    pub lora_name: Py<PyAny>,
    pub extra_keys: Py<PyAny>,
    pub group_idx: Py<PyAny>,
    pub kv_cache_spec_kind: Py<PyAny>,
    pub kv_cache_spec_sliding_window: Py<PyAny>,
    pub session_id: Py<PyAny>,
    pub lookahead_token_ids: Py<PyAny>,
}

value_object!(
    PyBlockStored,
    "BlockStored",
    [
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        lora_id,
        medium,
        lora_name,
        extra_keys,
        group_idx,
        kv_cache_spec_kind,
        kv_cache_spec_sliding_window,
        session_id,
        lookahead_token_ids
    ],
    #[new]
    #[pyo3(signature = (block_hashes, parent_block_hash, token_ids, block_size, lora_id,
        medium = Medium::Gpu, lora_name = None, extra_keys = None, group_idx = None,
        kv_cache_spec_kind = None, kv_cache_spec_sliding_window = None, session_id = None,
        lookahead_token_ids = None),
        text_signature = "(block_hashes, parent_block_hash, token_ids, block_size, lora_id, \
            medium='GPU', lora_name=None, extra_keys=None, group_idx=None, \
            kv_cache_spec_kind=None, kv_cache_spec_sliding_window=None, session_id=None, \
            lookahead_token_ids=None)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        block_hashes: Py<PyAny>,
        parent_block_hash: Py<PyAny>,
        token_ids: Py<PyAny>,
        block_size: Py<PyAny>,
        lora_id: Py<PyAny>,
        medium: Medium<'_>,
        lora_name: Option<Py<PyAny>>,
        extra_keys: Option<Py<PyAny>>,
        group_idx: Option<Py<PyAny>>,
        kv_cache_spec_kind: Option<Py<PyAny>>,
        kv_cache_spec_sliding_window: Option<Py<PyAny>>,
        session_id: Option<Py<PyAny>>,
        lookahead_token_ids: Option<Py<PyAny>>,
    ) -> Self {
        Self {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium: medium.resolve(py),
            lora_name: none_or(py, lora_name),
            extra_keys: none_or(py, extra_keys),
            group_idx: none_or(py, group_idx),
            kv_cache_spec_kind: none_or(py, kv_cache_spec_kind),
            kv_cache_spec_sliding_window: none_or(py, kv_cache_spec_sliding_window),
            session_id: none_or(py, session_id),
            lookahead_token_ids: none_or(py, lookahead_token_ids),
        }
    }
);

/// Blocks evicted from the prefix cache (vLLM emits one event per block).
#[pyclass(
    module = "pagedkv._core",
    name = "BlockRemoved",
    frozen,
    get_all,
    freelist = 1024
)]
#[derive(Debug)]
pub struct PyBlockRemoved {
    pub block_hashes: Py<PyAny>,
    pub medium: Py<PyAny>,
    pub group_idx: Py<PyAny>,
}

value_object!(
    PyBlockRemoved,
    "BlockRemoved",
    [block_hashes, medium, group_idx],
    #[new]
    #[pyo3(signature = (block_hashes, medium = Medium::Gpu, group_idx = None),
        text_signature = "(block_hashes, medium='GPU', group_idx=None)")]
    fn new(
        py: Python<'_>,
        block_hashes: Py<PyAny>,
        medium: Medium<'_>,
        group_idx: Option<Py<PyAny>>,
    ) -> Self {
        Self {
            block_hashes,
            medium: medium.resolve(py),
            group_idx: none_or(py, group_idx),
        }
    }
);

/// The prefix cache was reset.
#[pyclass(module = "pagedkv._core", name = "AllBlocksCleared", frozen)]
#[derive(Debug)]
pub struct PyAllBlocksCleared {}

value_object!(
    PyAllBlocksCleared,
    "AllBlocksCleared",
    [],
    #[new]
    fn new() -> Self {
        Self {}
    }
);

/// A hash as events carry it: vLLM's 64-bit int, or the raw digest.
fn hash_obj<'py>(py: Python<'py>, h: &BlockHash, raw: bool) -> Bound<'py, PyAny> {
    if raw {
        PyBytes::new(py, h.as_bytes()).into_any()
    } else {
        PyInt::new(py, h.to_event_int()).into_any()
    }
}

fn hash_list<'py>(
    py: Python<'py>,
    hashes: &[BlockHash],
    raw: bool,
) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, hashes.iter().map(|h| hash_obj(py, h, raw)))
}

/// vLLM publishes the hashing keys untagged: a bare `LoRA` name, `(identifier,
/// offset)` per multimodal item, a bare salt, a bare digest.
fn extra_keys<'py>(py: Python<'py>, keys: &[EventExtraKey]) -> PyResult<Bound<'py, PyTuple>> {
    let items = keys
        .iter()
        .map(|k| -> PyResult<Bound<'py, PyAny>> {
            Ok(match k {
                EventExtraKey::LoraName(s) | EventExtraKey::CacheSalt(s) => {
                    PyString::new(py, s).into_any()
                }
                EventExtraKey::Mm(id, off) => (id, *off).into_pyobject(py)?.into_any(),
                EventExtraKey::PromptEmbeds(d) => PyBytes::new(py, d).into_any(),
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    PyTuple::new(py, items)
}

/// One Python event object per core event, in order; hashes as vLLM's 64-bit
/// ints, or with `raw_hashes` as the full digests.
pub fn to_python(
    py: Python<'_>,
    events: Vec<KvEvent>,
    raw_hashes: bool,
    signed_tokens: bool,
) -> PyResult<Bound<'_, PyList>> {
    let mut out = Vec::with_capacity(events.len());
    for ev in events {
        let obj = match ev {
            KvEvent::BlockStored(s) => {
                let extra = match s.extra_keys {
                    None => py.None(),
                    Some(blocks) => {
                        let items = blocks
                            .iter()
                            .map(|b| match b {
                                None => Ok(py.None().into_bound(py)),
                                Some(keys) => extra_keys(py, keys).map(Bound::into_any),
                            })
                            .collect::<PyResult<Vec<_>>>()?;
                        PyList::new(py, items)?.into_any().unbind()
                    }
                };
                Bound::new(
                    py,
                    PyBlockStored {
                        block_hashes: hash_list(py, &s.block_hashes, raw_hashes)?
                            .into_any()
                            .unbind(),
                        parent_block_hash: s
                            .parent_block_hash
                            .map_or_else(|| py.None(), |h| hash_obj(py, &h, raw_hashes).unbind()),
                        token_ids: event_tokens(&s.token_ids, signed_tokens)
                            .into_pyobject(py)?
                            .into_any()
                            .unbind(),
                        block_size: s.block_size.into_pyobject(py)?.into_any().unbind(),
                        lora_id: s.lora_id.into_pyobject(py)?.into_any().unbind(),
                        medium: gpu(py),
                        lora_name: s.lora_name.into_pyobject(py)?.into_any().unbind(),
                        extra_keys: extra,
                        group_idx: s.group_idx.into_pyobject(py)?.into_any().unbind(),
                        kv_cache_spec_kind: s
                            .kv_cache_spec_kind
                            .into_pyobject(py)?
                            .into_any()
                            .unbind(),
                        kv_cache_spec_sliding_window: s
                            .kv_cache_spec_sliding_window
                            .into_pyobject(py)?
                            .into_any()
                            .unbind(),
                        session_id: s.session_id.into_pyobject(py)?.into_any().unbind(),
                        lookahead_token_ids: s
                            .lookahead_token_ids
                            .map(|l| {
                                l.iter()
                                    .map(|t| event_tokens(t, signed_tokens))
                                    .collect::<Vec<_>>()
                            })
                            .into_pyobject(py)?
                            .into_any()
                            .unbind(),
                    },
                )?
                .into_any()
            }
            KvEvent::BlockRemoved {
                block_hashes,
                group_idx,
            } => Bound::new(
                py,
                PyBlockRemoved {
                    block_hashes: hash_list(py, &block_hashes, raw_hashes)?
                        .into_any()
                        .unbind(),
                    medium: gpu(py),
                    group_idx: group_idx.into_pyobject(py)?.into_any().unbind(),
                },
            )?
            .into_any(),
            KvEvent::AllBlocksCleared => Bound::new(py, PyAllBlocksCleared {})?.into_any(),
        };
        out.push(obj);
    }
    PyList::new(py, out)
}

fn digest_obj<'py>(py: Python<'py>, digest: &[u8], raw: bool) -> PyResult<Bound<'py, PyAny>> {
    if raw {
        Ok(PyBytes::new(py, digest).into_any())
    } else {
        Ok(event_int(digest).into_pyobject(py)?.into_any())
    }
}

/// An offload tier's events as the KV events vLLM's offloading connector
/// publishes (`BlockStored` per stored chunk, `BlockRemoved` per group), with
/// the tier's medium; hashes as vLLM's 64-bit ints, or raw with `raw_hashes`.
pub fn tier_to_python<'py>(
    py: Python<'py>,
    events: &[OffloadEvent],
    raw_hashes: bool,
) -> PyResult<Bound<'py, PyList>> {
    let mut out = Vec::new();
    for ev in kv_events(events) {
        let obj = match ev {
            TierKvEvent::Stored {
                hash,
                group_idx,
                medium,
            } => Bound::new(
                py,
                PyBlockStored {
                    block_hashes: PyList::new(py, [digest_obj(py, hash, raw_hashes)?])?
                        .into_any()
                        .unbind(),
                    parent_block_hash: py.None(),
                    token_ids: PyList::empty(py).into_any().unbind(),
                    block_size: 0u32.into_pyobject(py)?.into_any().unbind(),
                    lora_id: py.None(),
                    medium: PyString::new(py, medium.name()).into_any().unbind(),
                    lora_name: py.None(),
                    extra_keys: py.None(),
                    group_idx: group_idx.into_pyobject(py)?.into_any().unbind(),
                    kv_cache_spec_kind: py.None(),
                    kv_cache_spec_sliding_window: py.None(),
                    session_id: py.None(),
                    lookahead_token_ids: py.None(),
                },
            )?
            .into_any(),
            TierKvEvent::Removed {
                hashes,
                group_idx,
                medium,
            } => {
                let hashes = hashes
                    .iter()
                    .map(|h| digest_obj(py, h, raw_hashes))
                    .collect::<PyResult<Vec<_>>>()?;
                Bound::new(
                    py,
                    PyBlockRemoved {
                        block_hashes: PyList::new(py, hashes)?.into_any().unbind(),
                        medium: PyString::new(py, medium.name()).into_any().unbind(),
                        group_idx: group_idx.into_pyobject(py)?.into_any().unbind(),
                    },
                )?
                .into_any()
            }
        };
        out.push(obj);
    }
    PyList::new(py, out)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBlockStored>()?;
    m.add_class::<PyBlockRemoved>()?;
    m.add_class::<PyAllBlocksCleared>()
}
