//! PyO3 binding of pagedkv-core: argument conversion and error mapping only.
//! Block ids leave as int32 NumPy arrays; no per-block Python objects.

use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use pagedkv_core as core;
use pagedkv_core::{
    AllocateArgs, AttentionKind, BatchAllocation, BlockHash, CborValue, Error, EventExtraKey,
    GroupSpec, HashAlgo, KvEvent, Lora, MambaCacheMode, ManagerConfig, MmFeature, RequestSpec,
};

mod index;

mod errors {
    pyo3::import_exception!(pagedkv.errors, UnknownRequestError);
    pyo3::import_exception!(pagedkv.errors, DuplicateRequestError);
    pyo3::import_exception!(pagedkv.errors, InvalidArgumentError);
    pyo3::import_exception!(pagedkv.errors, StaleComputedBlocksError);
    pyo3::import_exception!(pagedkv.errors, CannotFitError);
    pyo3::import_exception!(pagedkv.errors, InvalidConfigError);
    pyo3::import_exception!(pagedkv.errors, InvariantViolationError);
}

fn err(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::UnknownRequest(_) => errors::UnknownRequestError::new_err(msg),
        Error::DuplicateRequest(_) => errors::DuplicateRequestError::new_err(msg),
        Error::InvalidArgument(_) => errors::InvalidArgumentError::new_err(msg),
        Error::StaleComputedBlocks(_) => errors::StaleComputedBlocksError::new_err(msg),
        Error::CannotFit(_) => errors::CannotFitError::new_err(msg),
        Error::InvalidConfig(_) => errors::InvalidConfigError::new_err(msg),
        Error::InvariantViolation(_) => errors::InvariantViolationError::new_err(msg),
    }
}

fn bad_arg(msg: impl Into<String>) -> PyErr {
    errors::InvalidArgumentError::new_err(msg.into())
}

/// A non-negative count.
fn count(name: &str, v: i64) -> PyResult<u64> {
    u64::try_from(v).map_err(|_| bad_arg(format!("{name} must be non-negative, got {v}")))
}

fn token_from_i64(v: i64) -> PyResult<u32> {
    u32::try_from(v).map_err(|_| bad_arg(format!("token id {v} is outside 0..2**32")))
}

fn token_item(item: &Bound<'_, PyAny>) -> PyResult<u32> {
    match item.extract::<u32>() {
        Ok(v) if !item.is_instance_of::<pyo3::types::PyBool>() => Ok(v),
        _ => {
            if item.is_instance_of::<pyo3::types::PyBool>() {
                return Err(PyTypeError::new_err("token ids must be ints, not bools"));
            }
            let shown = item.repr().map(|r| r.to_string()).unwrap_or_default();
            if item.is_instance_of::<pyo3::types::PyInt>() {
                Err(bad_arg(format!("token id {shown} is outside 0..2**32")))
            } else {
                Err(PyTypeError::new_err(format!(
                    "token ids must be ints, got {shown}"
                )))
            }
        }
    }
}

/// Token ids from a list of Python ints. Exact ints in range take a direct path
/// (no reference counting, no error machinery); anything else goes through
/// [`token_item`], which converts or explains.
fn list_tokens(list: &Bound<'_, PyList>) -> PyResult<Vec<u32>> {
    let n = list.len();
    let mut out = Vec::with_capacity(n);
    let int_type = std::ptr::addr_of_mut!(pyo3::ffi::PyLong_Type);
    for i in 0..n {
        // SAFETY: `i < n`, the length read above; the GIL is held and nothing in
        // this loop's fast path runs Python code, so the list cannot change under
        // us. The item is a borrowed reference used only in this iteration.
        let fast = unsafe {
            let item = pyo3::ffi::PyList_GetItem(list.as_ptr(), i as pyo3::ffi::Py_ssize_t);
            if !item.is_null() && pyo3::ffi::Py_TYPE(item) == int_type {
                let v = pyo3::ffi::PyLong_AsLong(item);
                if v == -1 {
                    // -1, or an overflow error to drop: the slow path decides.
                    pyo3::ffi::PyErr_Clear();
                }
                u32::try_from(v).ok()
            } else {
                None
            }
        };
        match fast {
            Some(t) => out.push(t),
            None => out.push(token_item(&list.get_item(i)?)?),
        }
    }
    Ok(out)
}

/// Token ids from a list, an int NumPy array or any sequence of ints.
fn tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if let Ok(list) = obj.cast::<PyList>() {
        return list_tokens(list);
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return a.as_slice()?.iter().map(|&v| token_from_i64(v)).collect();
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return a
            .as_slice()?
            .iter()
            .map(|&v| token_from_i64(i64::from(v)))
            .collect();
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, u32>>() {
        return Ok(a.as_slice()?.to_vec());
    }
    if obj.is_instance_of::<pyo3::types::PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err("token ids must be a sequence of ints"));
    }
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    for item in obj.try_iter()? {
        out.push(token_item(&item?)?);
    }
    Ok(out)
}

/// Non-negative counts from an int NumPy array or a sequence.
fn counts(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return a.as_slice()?.iter().map(|&v| count(name, v)).collect();
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return a
            .as_slice()?
            .iter()
            .map(|&v| count(name, i64::from(v)))
            .collect();
    }
    let v: Vec<i64> = obj.extract()?;
    v.into_iter().map(|x| count(name, x)).collect()
}

/// The requests of a batch call: a sequence of ids, or handles (a list of ints
/// or an integer NumPy array) as `add_request` returned them.
enum BatchIds {
    Names(Vec<PyBackedStr>),
    Handles(Vec<u64>),
}

impl BatchIds {
    fn extract(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
            // A negative value is no handle: it maps to one that is never live.
            return Ok(Self::Handles(
                a.as_slice()?.iter().map(|&h| h as u64).collect(),
            ));
        }
        if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, u64>>() {
            return Ok(Self::Handles(a.as_slice()?.to_vec()));
        }
        if let Ok(list) = obj.cast::<PyList>() {
            let first_is_int = match list.len() {
                0 => false,
                _ => list.get_item(0)?.is_instance_of::<pyo3::types::PyInt>(),
            };
            if first_is_int {
                return list
                    .iter()
                    .map(|h| {
                        h.extract::<u64>().map_err(|_| {
                            PyTypeError::new_err(
                                "request handles must be ints returned by add_request",
                            )
                        })
                    })
                    .collect::<PyResult<Vec<u64>>>()
                    .map(Self::Handles);
            }
        }
        if obj.is_instance_of::<pyo3::types::PyString>() {
            return Err(PyTypeError::new_err(
                "request_ids must be a sequence of ids, not one string",
            ));
        }
        Ok(Self::Names(obj.extract()?))
    }

    fn with_refs<T>(&self, f: impl FnOnce(core::RequestRefs<'_>) -> T) -> T {
        match self {
            Self::Names(v) => {
                let ids: Vec<&str> = v.iter().map(|s| &**s).collect();
                f(core::RequestRefs::Ids(&ids))
            }
            Self::Handles(h) => f(core::RequestRefs::Handles(h)),
        }
    }
}

fn ids_array<'py>(py: Python<'py>, ids: &[u32]) -> Bound<'py, PyArray1<i32>> {
    // Block ids are < 2^31 (the pool is capped well below that).
    let v: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
    PyArray1::from_vec(py, v)
}

fn groups_tuple<'py, S: AsRef<[u32]>>(
    py: Python<'py>,
    groups: &[S],
) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(py, groups.iter().map(|g| ids_array(py, g.as_ref())))
}

fn hash_int(h: &BlockHash) -> u64 {
    h.to_event_int()
}

fn cbor_value(obj: &Bound<'_, PyAny>) -> PyResult<CborValue> {
    if obj.is_none() {
        return Ok(CborValue::Null);
    }
    if let Ok(b) = obj.cast::<pyo3::types::PyBool>() {
        return Ok(CborValue::Bool(b.is_true()));
    }
    if obj.is_instance_of::<pyo3::types::PyInt>() {
        return Ok(CborValue::Int(obj.extract()?));
    }
    if let Ok(s) = obj.extract::<String>() {
        return Ok(CborValue::Text(s));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(CborValue::Bytes(b.as_bytes().to_vec()));
    }
    if obj.is_instance_of::<PyTuple>() || obj.is_instance_of::<PyList>() {
        let items: PyResult<Vec<CborValue>> = obj.try_iter()?.map(|x| cbor_value(&x?)).collect();
        return Ok(CborValue::Array(items?));
    }
    Err(PyTypeError::new_err(format!(
        "extra keys must be None, bool, int, str, bytes, tuple or list, got {}",
        obj.get_type().name()?
    )))
}

fn cfg_err(msg: String) -> PyErr {
    errors::InvalidConfigError::new_err(msg)
}

fn positive(name: &str, v: i64) -> PyResult<u64> {
    u64::try_from(v)
        .ok()
        .filter(|&x| x > 0 && x < (1 << 40))
        .ok_or_else(|| cfg_err(format!("{name} must be a positive int, got {v}")))
}

/// One group from its spec's `core_spec()` dict (+ `tag`).
fn group_spec(d: &Bound<'_, PyDict>) -> PyResult<GroupSpec> {
    let get_u32 = |key: &str| -> PyResult<u32> {
        let v: i64 = d
            .get_item(key)?
            .ok_or_else(|| cfg_err(format!("group spec lacks {key:?}")))?
            .extract()?;
        u32::try_from(v)
            .ok()
            .filter(|&x| x > 0)
            .ok_or_else(|| cfg_err(format!("{key} must be a positive int, got {v}")))
    };
    let kind: String = d
        .get_item("kind")?
        .ok_or_else(|| cfg_err("group spec lacks \"kind\"".into()))?
        .extract()?;
    let kind =
        match kind.as_str() {
            "full_attention" => AttentionKind::FullAttention,
            "mla_attention" => AttentionKind::MlaAttention,
            "sliding_window" => AttentionKind::SlidingWindow {
                window: get_u32("sliding_window")?,
            },
            "chunked_local_attention" => AttentionKind::ChunkedLocal {
                chunk: get_u32("attention_chunk_size")?,
            },
            "cross_attention" => AttentionKind::CrossAttention,
            "sink_full_attention" => AttentionKind::SinkFullAttention {
                sink_len: get_u32("sink_len")?,
            },
            "mamba" => {
                let mode: String = match d.get_item("mamba_cache_mode")? {
                    Some(m) => m.extract()?,
                    None => "none".into(),
                };
                let num_speculative_blocks: i64 = match d.get_item("num_speculative_blocks")? {
                    Some(v) => v.extract()?,
                    None => 0,
                };
                AttentionKind::Mamba {
                mode: MambaCacheMode::from_name(&mode).ok_or_else(|| {
                    cfg_err(format!("mamba_cache_mode must be none/align/all, got {mode:?}"))
                })?,
                num_speculative_blocks: u32::try_from(num_speculative_blocks).map_err(|_| {
                    cfg_err(format!(
                        "num_speculative_blocks must be non-negative, got {num_speculative_blocks}"
                    ))
                })?,
            }
            }
            other => {
                return Err(cfg_err(format!(
                    "KV-cache spec kind {other:?} is not supported"
                )));
            }
        };
    let tag: String = match d.get_item("tag")? {
        Some(t) => t.extract()?,
        None => String::new(),
    };
    Ok(GroupSpec {
        kind,
        block_size: get_u32("block_size")?,
        tag,
    })
}

fn algo(name: &str) -> PyResult<HashAlgo> {
    HashAlgo::from_name(name).ok_or_else(|| {
        errors::InvalidConfigError::new_err(format!(
            "unknown hash_algo {name:?}; expected 'sha256_cbor', 'xxhash_cbor' or 'xxh3_native'"
        ))
    })
}

/// Result of `get_computed_blocks`.
#[pyclass(module = "pagedkv._core", name = "ComputedBlocks", frozen)]
struct PyComputedBlocks {
    inner: core::ComputedBlocks,
    block_ids: Py<PyTuple>,
}

#[pymethods]
impl PyComputedBlocks {
    /// Hit block ids per KV-cache group (int32 arrays).
    #[getter]
    fn block_ids(&self, py: Python<'_>) -> Py<PyTuple> {
        self.block_ids.clone_ref(py)
    }

    /// Tokens covered by the hit.
    #[getter]
    fn num_computed_tokens(&self) -> u64 {
        self.inner.num_computed_tokens
    }

    /// Position of a shared prefix a sparse-retention group has not cached yet.
    #[getter]
    fn shared_prefix_boundary(&self) -> u64 {
        self.inner.shared_prefix_boundary
    }

    fn __repr__(&self) -> String {
        format!(
            "ComputedBlocks(num_computed_tokens={}, block_ids={:?})",
            self.inner.num_computed_tokens, self.inner.block_ids
        )
    }
}

/// The Rust KV-cache manager. Use `pagedkv.KVCacheManager`, which builds it from a
/// `KVCacheConfig`.
/// The manager, mutably borrowed for a call whose arguments are converted.
fn borrow<'py>(slf: &Bound<'py, PyManager>) -> PyResult<PyRefMut<'py, PyManager>> {
    slf.try_borrow_mut().map_err(|_| {
        pyo3::exceptions::PyRuntimeError::new_err(
            "the KVCacheManager is in use by another call (called back from inside a call)",
        )
    })
}

#[pyclass(module = "pagedkv._core", name = "KVCacheManager", subclass)]
struct PyManager {
    inner: core::KvCacheManager,
    empty: Py<PyTuple>,
    batch: BatchAllocation,
}

#[pymethods]
impl PyManager {
    #[new]
    #[pyo3(signature = (num_blocks, groups, max_model_len, *, enable_caching = true,
        hash_algo = "sha256_cbor", hash_seed = None, hash_block_size = None, use_eagle = false,
        log_stats = false, enable_kv_cache_events = false, watermark = 0.0,
        max_in_flight_tokens = None, prefix_cache_retention_interval = None,
        verify_cached_tokens = false, hash_truncate_bytes = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: i64,
        groups: Vec<Bound<'_, PyDict>>,
        max_model_len: i64,
        enable_caching: bool,
        hash_algo: &str,
        hash_seed: Option<String>,
        hash_block_size: Option<i64>,
        use_eagle: bool,
        log_stats: bool,
        enable_kv_cache_events: bool,
        watermark: f64,
        max_in_flight_tokens: Option<i64>,
        prefix_cache_retention_interval: Option<i64>,
        verify_cached_tokens: bool,
        hash_truncate_bytes: Option<i64>,
    ) -> PyResult<Self> {
        let hash_truncate_bytes = hash_truncate_bytes
            .map(|n| {
                u8::try_from(n)
                    .ok()
                    .filter(|b| (1..=32).contains(b))
                    .ok_or_else(|| {
                        cfg_err(format!("hash_truncate_bytes must be in 1..=32, got {n}"))
                    })
            })
            .transpose()?;
        let num_blocks = u32::try_from(num_blocks)
            .ok()
            .filter(|&n| n > 0 && n < i32::MAX as u32)
            .ok_or_else(|| {
                cfg_err(format!(
                    "num_blocks must be in 1..2**31-1, got {num_blocks}"
                ))
            })?;
        let groups = groups
            .iter()
            .map(group_spec)
            .collect::<PyResult<Vec<_>>>()?;
        let max_model_len = positive("max_model_len", max_model_len)?;
        let hash_block_size = hash_block_size
            .map(|h| positive("hash_block_size", h).map(|v| v as u32))
            .transpose()?;
        let max_in_flight_tokens = max_in_flight_tokens
            .map(|v| positive("max_in_flight_tokens", v))
            .transpose()?;
        let prefix_cache_retention_interval = prefix_cache_retention_interval
            .map(|v| {
                u64::try_from(v).map_err(|_| {
                    cfg_err(format!(
                        "prefix_cache_retention_interval ({v}) must be non-negative"
                    ))
                })
            })
            .transpose()?;
        let cfg = ManagerConfig {
            num_blocks,
            groups,
            max_model_len,
            enable_caching,
            hash_algo: algo(hash_algo)?,
            hash_seed,
            hash_block_size,
            use_eagle,
            log_stats,
            enable_kv_cache_events,
            watermark,
            max_in_flight_tokens,
            prefix_cache_retention_interval,
            verify_cached_tokens,
            hash_truncate_bytes,
        };
        let inner = core::KvCacheManager::new(cfg).map_err(err)?;
        let n = inner.num_groups();
        let empty = groups_tuple(py, &vec![Vec::<u32>::new(); n])?.unbind();
        Ok(Self {
            inner,
            empty,
            batch: BatchAllocation::default(),
        })
    }

    /// Prefix hits cut short by `verify_cached_tokens`: a cached block whose
    /// tokens or context did not match the request (a hash collision caught).
    #[getter]
    fn verification_failures(&self) -> u64 {
        self.inner.verification_failures()
    }

    /// Blocks in the free queue (evictable cached blocks included).
    #[getter]
    fn num_free_blocks(&self) -> u32 {
        self.inner.num_free_blocks()
    }

    /// KV-cache usage in [0, 1] (null block excluded).
    #[getter]
    fn usage(&self) -> f64 {
        self.inner.usage()
    }

    /// Number of known requests.
    #[getter]
    fn num_requests(&self) -> usize {
        self.inner.num_requests()
    }

    /// Number of KV-cache groups.
    #[getter]
    fn num_kv_cache_groups(&self) -> usize {
        self.inner.num_groups()
    }

    /// Total blocks in the pool (the null block included).
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.pool().num_blocks()
    }

    /// Token granularity of block hashes.
    #[getter]
    fn hash_block_size(&self) -> usize {
        self.inner.hash_block_size()
    }

    /// The `NONE_HASH` every hash chain starts from.
    #[getter]
    fn none_hash<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.inner.none_hash().as_bytes())
    }

    fn __contains__(&self, request_id: &str) -> bool {
        self.inner.contains(request_id)
    }

    #[pyo3(signature = (request_id, prompt_token_ids, *, lora_name = None, lora_path = None,
        lora_id = None, cache_salt = None, mm_features = None, prompt_embeds = None,
        skip_reading_prefix_cache = false))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        slf: &Bound<'_, Self>,
        request_id: &str,
        prompt_token_ids: &Bound<'_, PyAny>,
        lora_name: Option<String>,
        lora_path: Option<String>,
        lora_id: Option<i64>,
        cache_salt: Option<String>,
        mm_features: Option<Vec<(String, i64, i64)>>,
        prompt_embeds: Option<Vec<u8>>,
        skip_reading_prefix_cache: bool,
    ) -> PyResult<u64> {
        let prompt = tokens(prompt_token_ids)?;
        let lora = match (lora_name, lora_path, lora_id) {
            (None, None, None) => None,
            (Some(name), path, id) => Some(Lora { name, path, id }),
            _ => return Err(bad_arg("lora_path / lora_id need a lora_name")),
        };
        let mm = mm_features
            .unwrap_or_default()
            .into_iter()
            .map(|(identifier, offset, length)| {
                Ok(MmFeature {
                    identifier,
                    offset: count("multimodal offset", offset)?,
                    length: count("multimodal length", length)?,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let spec = RequestSpec {
            prompt_token_ids: prompt,
            lora,
            cache_salt,
            mm_features: mm,
            prompt_embeds,
            skip_reading_prefix_cache,
        };
        // Arguments are converted before the manager is borrowed, so Python code
        // they run (an iterator calling back into the manager) finds it free. The
        // GIL stays held: calls from other threads wait instead of failing.
        borrow(slf)?
            .inner
            .add_request(request_id, spec)
            .map_err(err)
    }

    fn append_token_ids(
        slf: &Bound<'_, Self>,
        request_id: &str,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let t = tokens(token_ids)?;
        borrow(slf)?
            .inner
            .append_token_ids(request_id, &t)
            .map_err(err)
    }

    /// Appends one sampled token to each request: `token_ids[i]` to
    /// `request_ids[i]` (one crossing for a whole step's outputs).
    fn append_token_ids_batch(
        slf: &Bound<'_, Self>,
        request_ids: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ids = BatchIds::extract(request_ids)?;
        let t = tokens(token_ids)?;
        let mut this = borrow(slf)?;
        let inner = &mut this.inner;
        ids.with_refs(|r| inner.append_token_ids_batch_refs(r, &t))
            .map_err(err)
    }

    /// The handle of a known request (what `add_request` returned): batch calls
    /// accept handles in place of ids and skip the id lookup.
    fn request_handle(&self, request_id: &str) -> PyResult<u64> {
        self.inner.request_handle(request_id).map_err(err)
    }

    fn free(&mut self, request_id: &str) -> PyResult<()> {
        self.inner.free(request_id).map_err(err)
    }

    fn remove_request(&mut self, request_id: &str) -> PyResult<()> {
        self.inner.remove_request(request_id).map_err(err)
    }

    fn get_computed_blocks(
        &mut self,
        py: Python<'_>,
        request_id: &str,
    ) -> PyResult<PyComputedBlocks> {
        let inner = self.inner.get_computed_blocks(request_id).map_err(err)?;
        let block_ids = if inner.is_empty() {
            self.empty.clone_ref(py)
        } else {
            groups_tuple(py, &inner.block_ids)?.unbind()
        };
        Ok(PyComputedBlocks { inner, block_ids })
    }

    #[pyo3(signature = (request_id, num_new_tokens, *, num_computed_tokens, num_new_computed_tokens = None,
        new_computed_blocks = None, num_lookahead_tokens = 0, num_external_computed_tokens = 0,
        delay_cache_blocks = false, num_encoder_tokens = 0, full_sequence_must_fit = false,
        reserved_blocks = 0, has_scheduled_reqs = true))]
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots(
        &mut self,
        py: Python<'_>,
        request_id: &str,
        num_new_tokens: i64,
        num_computed_tokens: i64,
        num_new_computed_tokens: Option<i64>,
        new_computed_blocks: Option<PyRef<'_, PyComputedBlocks>>,
        num_lookahead_tokens: i64,
        num_external_computed_tokens: i64,
        delay_cache_blocks: bool,
        num_encoder_tokens: i64,
        full_sequence_must_fit: bool,
        reserved_blocks: i64,
        has_scheduled_reqs: bool,
    ) -> PyResult<Option<Py<PyTuple>>> {
        let hit = new_computed_blocks.as_ref().map(|h| &h.inner);
        let num_new_computed_tokens = match num_new_computed_tokens {
            Some(v) => count("num_new_computed_tokens", v)?,
            None => hit.map_or(0, |h| h.num_computed_tokens),
        };
        let args = AllocateArgs {
            num_new_tokens: count("num_new_tokens", num_new_tokens)?,
            num_computed_tokens: count("num_computed_tokens", num_computed_tokens)?,
            num_new_computed_tokens,
            num_lookahead_tokens: count("num_lookahead_tokens", num_lookahead_tokens)?,
            num_external_computed_tokens: count(
                "num_external_computed_tokens",
                num_external_computed_tokens,
            )?,
            delay_cache_blocks,
            num_encoder_tokens: count("num_encoder_tokens", num_encoder_tokens)?,
            full_sequence_must_fit,
            reserved_blocks: count("reserved_blocks", reserved_blocks)?,
            has_scheduled_reqs,
        };
        match self
            .inner
            .allocate_slots(request_id, &args, hit)
            .map_err(err)?
        {
            None => Ok(None),
            Some(groups) if groups.iter().all(Vec::is_empty) => Ok(Some(self.empty.clone_ref(py))),
            Some(groups) => Ok(Some(groups_tuple(py, groups)?.unbind())),
        }
    }

    /// One decode step of many running requests in one call. Returns
    /// `(num_allocated, ((block_ids, offsets), ...))` per group, where request
    /// `i`'s new blocks are `block_ids[offsets[i]:offsets[i+1]]`.
    #[pyo3(signature = (request_ids, num_new_tokens, num_computed_tokens, *, num_lookahead_tokens = 0))]
    fn allocate_slots_batch<'py>(
        slf: &Bound<'py, Self>,
        request_ids: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
        num_computed_tokens: &Bound<'py, PyAny>,
        num_lookahead_tokens: i64,
    ) -> PyResult<(usize, Bound<'py, PyTuple>)> {
        let ids = BatchIds::extract(request_ids)?;
        let n = match &ids {
            BatchIds::Names(v) => v.len(),
            BatchIds::Handles(v) => v.len(),
        };
        let new = if num_new_tokens.is_instance_of::<pyo3::types::PyInt>() {
            vec![count("num_new_tokens", num_new_tokens.extract::<i64>()?)?; n]
        } else {
            counts("num_new_tokens", num_new_tokens)?
        };
        let computed = counts("num_computed_tokens", num_computed_tokens)?;
        let look = count("num_lookahead_tokens", num_lookahead_tokens)?;
        let py = slf.py();
        let mut this = borrow(slf)?;
        let this = &mut *this;
        let (inner, batch) = (&mut this.inner, &mut this.batch);
        ids.with_refs(|r| inner.allocate_slots_batch_refs(r, &new, &computed, look, batch))
            .map_err(err)?;
        let b = &this.batch;
        let per_group = PyTuple::new(
            py,
            b.block_ids.iter().zip(&b.offsets).map(|(ids, off)| {
                let off: Vec<i32> = off.iter().map(|&x| x as i32).collect();
                (ids_array(py, ids), PyArray1::from_vec(py, off))
            }),
        )?;
        Ok((b.num_allocated, per_group))
    }

    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        request_id: &str,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let groups = self.inner.block_ids(request_id).map_err(err)?;
        groups_tuple(py, &groups)
    }

    fn block_hashes<'py>(&self, py: Python<'py>, request_id: &str) -> PyResult<Bound<'py, PyList>> {
        let hashes = self.inner.block_hashes(request_id).map_err(err)?;
        PyList::new(py, hashes.iter().map(|h| PyBytes::new(py, h.as_bytes())))
    }

    fn num_tokens(&self, request_id: &str) -> PyResult<usize> {
        self.inner.num_tokens(request_id).map_err(err)
    }

    fn num_prompt_tokens(&self, request_id: &str) -> PyResult<usize> {
        self.inner.num_prompt_tokens(request_id).map_err(err)
    }

    fn num_preemptions(&self, request_id: &str) -> PyResult<u32> {
        self.inner.num_preemptions(request_id).map_err(err)
    }

    fn cache_blocks(&mut self, request_id: &str, num_computed_tokens: i64) -> PyResult<()> {
        let n = count("num_computed_tokens", num_computed_tokens)?;
        self.inner.cache_blocks(request_id, n).map_err(err)
    }

    fn remove_skipped_blocks(
        &mut self,
        request_id: &str,
        total_computed_tokens: i64,
    ) -> PyResult<()> {
        let n = count("total_computed_tokens", total_computed_tokens)?;
        self.inner.remove_skipped_blocks(request_id, n).map_err(err)
    }

    fn get_num_common_prefix_blocks(&self, request_id: &str) -> PyResult<Vec<u32>> {
        self.inner
            .get_num_common_prefix_blocks(request_id)
            .map_err(err)
    }

    fn evict_blocks(slf: &Bound<'_, Self>, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = counts(
            "block id",
            &PyList::new(
                block_ids.py(),
                block_ids.try_iter()?.collect::<PyResult<Vec<_>>>()?,
            )?
            .into_any(),
        )?;
        borrow(slf)?.inner.evict_blocks(&ids).map_err(err)
    }

    fn reset_prefix_cache(&mut self) -> bool {
        self.inner.reset_prefix_cache()
    }

    fn new_step_starts(&mut self) {
        self.inner.new_step_starts();
    }

    /// Drained events as tuples: `("BlockStored", hashes, parent, token_ids,
    /// block_size, lora_id, lora_name, extra_keys, group_idx, spec_kind,
    /// sliding_window)`, `("BlockRemoved", hashes, group_idx)`, `("AllBlocksCleared",)`.
    /// Hashes are vLLM's integer form.
    /// Drains the events as tuples; hashes as vLLM's 64-bit ints, or with
    /// `raw_hashes` as the full digest bytes.
    #[pyo3(signature = (raw_hashes = false))]
    fn _take_events<'py>(
        &mut self,
        py: Python<'py>,
        raw_hashes: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let hv = |h: &BlockHash| -> PyResult<Bound<'py, PyAny>> {
            if raw_hashes {
                Ok(PyBytes::new(py, h.as_bytes()).into_any())
            } else {
                Ok(hash_int(h).into_pyobject(py)?.into_any())
            }
        };
        let evs = self.inner.take_events();
        let out = PyList::empty(py);
        for ev in evs {
            let item: Bound<'py, PyTuple> = match ev {
                KvEvent::BlockStored(s) => {
                    let extra: Option<Vec<Option<Bound<'py, PyTuple>>>> = match s.extra_keys {
                        None => None,
                        Some(blocks) => Some(
                            blocks
                                .iter()
                                .map(|b| b.as_ref().map(|keys| event_keys(py, keys)).transpose())
                                .collect::<PyResult<_>>()?,
                        ),
                    };
                    (
                        "BlockStored",
                        s.block_hashes
                            .iter()
                            .map(hv)
                            .collect::<PyResult<Vec<_>>>()?,
                        s.parent_block_hash.as_ref().map(hv).transpose()?,
                        s.token_ids,
                        s.block_size,
                        s.lora_id,
                        s.lora_name,
                        extra,
                        s.group_idx,
                        s.kv_cache_spec_kind,
                        s.kv_cache_spec_sliding_window,
                    )
                        .into_pyobject(py)?
                }
                KvEvent::BlockRemoved {
                    block_hashes,
                    group_idx,
                } => (
                    "BlockRemoved",
                    block_hashes.iter().map(hv).collect::<PyResult<Vec<_>>>()?,
                    group_idx,
                )
                    .into_pyobject(py)?,
                KvEvent::AllBlocksCleared => ("AllBlocksCleared",).into_pyobject(py)?,
            };
            out.append(item)?;
        }
        Ok(out)
    }

    /// `(reset, requests, queries, hits, preempted_requests, preempted_queries,
    /// preempted_hits)` since the last call, or None when stats are off.
    fn _make_prefix_cache_stats(&mut self) -> Option<(bool, u64, u64, u64, u64, u64, u64)> {
        self.inner.make_prefix_cache_stats().map(|s| {
            (
                s.reset,
                s.requests,
                s.queries,
                s.hits,
                s.preempted_requests,
                s.preempted_queries,
                s.preempted_hits,
            )
        })
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.inner.check_invariants().map_err(err)
    }

    /// The free queue from head (allocated next) to tail.
    fn free_block_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        ids_array(py, &self.inner.pool().free_queue())
    }

    /// Reference count of a block.
    fn block_ref_count(&self, block_id: i64) -> PyResult<u32> {
        let id = self.block_id(block_id)?;
        Ok(self.inner.pool().ref_cnt(id))
    }

    /// The hash a block is cached under (None if not cached), and its group.
    fn cached_block_hash<'py>(
        &self,
        py: Python<'py>,
        block_id: i64,
    ) -> PyResult<Option<(Bound<'py, PyBytes>, u32)>> {
        let id = self.block_id(block_id)?;
        Ok(self
            .inner
            .pool()
            .block_key(id)
            .map(|k| (PyBytes::new(py, k.hash.as_bytes()), k.group)))
    }

    /// Blocks cached under a hash for a group, in insertion order.
    #[pyo3(signature = (block_hash, group = 0))]
    fn cached_blocks_for_hash<'py>(
        &self,
        py: Python<'py>,
        block_hash: &[u8],
        group: u32,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let hash =
            BlockHash::from_slice(block_hash).ok_or_else(|| bad_arg("hash must be 1..32 bytes"))?;
        Ok(ids_array(
            py,
            &self
                .inner
                .pool()
                .cached_blocks(&core::CacheKey { hash, group }),
        ))
    }

    /// Number of distinct keys in the prefix map.
    #[getter]
    fn num_cached_block_hashes(&self) -> usize {
        self.inner.pool().num_cached_keys()
    }
}

impl PyManager {
    fn block_id(&self, block_id: i64) -> PyResult<u32> {
        u32::try_from(block_id)
            .ok()
            .filter(|&b| b < self.inner.pool().num_blocks())
            .ok_or_else(|| bad_arg(format!("block id {block_id} is outside the pool")))
    }
}

use pyo3::pybacked::PyBackedStr;

fn event_keys<'py>(py: Python<'py>, keys: &[EventExtraKey]) -> PyResult<Bound<'py, PyTuple>> {
    let items = keys
        .iter()
        .map(|k| -> PyResult<Bound<'py, PyAny>> {
            Ok(match k {
                EventExtraKey::LoraName(s) | EventExtraKey::CacheSalt(s) => {
                    s.into_pyobject(py)?.into_any()
                }
                EventExtraKey::Mm(id, off) => (id, *off).into_pyobject(py)?.into_any(),
                EventExtraKey::PromptEmbeds(d) => PyBytes::new(py, d).into_any(),
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    PyTuple::new(py, items)
}

/// `hash_fn(seed)` of an algorithm: the `NONE_HASH` a seed gives.
#[pyfunction]
fn none_hash<'py>(py: Python<'py>, hash_algo: &str, seed: &str) -> PyResult<Bound<'py, PyBytes>> {
    Ok(PyBytes::new(
        py,
        algo(hash_algo)?.none_hash(seed).as_bytes(),
    ))
}

/// vLLM's `hash_block_tokens`: the hash of one full block given its parent
/// (None = `none_hash`), token ids and extra keys (any CBOR-encodable shape).
#[pyfunction]
#[pyo3(signature = (hash_algo, parent_block_hash, token_ids, extra_keys = None, *, none_hash))]
fn hash_block_tokens<'py>(
    py: Python<'py>,
    hash_algo: &str,
    parent_block_hash: Option<&[u8]>,
    token_ids: &Bound<'py, PyAny>,
    extra_keys: Option<&Bound<'py, PyAny>>,
    none_hash: &[u8],
) -> PyResult<Bound<'py, PyBytes>> {
    let algo = algo(hash_algo)?;
    let seed =
        BlockHash::from_slice(none_hash).ok_or_else(|| bad_arg("none_hash must be 1..32 bytes"))?;
    let parent = parent_block_hash
        .map(|p| BlockHash::from_slice(p).ok_or_else(|| bad_arg("parent hash must be 1..32 bytes")))
        .transpose()?;
    let toks = tokens(token_ids)?;
    let extra = match extra_keys {
        None => None,
        Some(e) if e.is_none() => None,
        Some(e) => Some(cbor_value(e)?),
    };
    let mut h = core::BlockHasher::new(algo, seed);
    let out = h
        .hash_block_generic(parent.as_ref(), &toks, extra.as_ref())
        .map_err(bad_arg)?;
    Ok(PyBytes::new(py, out.as_bytes()))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyManager>()?;
    m.add_class::<PyComputedBlocks>()?;
    m.add_function(wrap_pyfunction!(none_hash, m)?)?;
    m.add_function(wrap_pyfunction!(hash_block_tokens, m)?)?;
    index::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
