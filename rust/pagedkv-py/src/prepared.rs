//! `RequestPreparer` and `PreparedRequest`: requests built and hashed off the
//! scheduler's thread (an engine's input thread), then registered by
//! `KVCacheManager.add_prepared`. Conversion only: the work is the core's
//! [`RequestPreparer`].

use std::sync::{Mutex, MutexGuard};

use pyo3::prelude::*;

use pagedkv_core::{Lora, PreparedRequest, RequestPreparer};

use crate::convert::{prompt_tokens, request_spec};
use crate::errors::{PkResult, invalid_arg};

/// Builds and hashes requests for one manager, on any thread.
#[pyclass(module = "pagedkv._core", name = "RequestPreparer", frozen)]
#[derive(Debug)]
pub struct PyRequestPreparer {
    inner: RequestPreparer,
}

impl PyRequestPreparer {
    pub fn new(inner: RequestPreparer) -> Self {
        Self { inner }
    }
}

#[pymethods]
impl PyRequestPreparer {
    /// The request as `add_request` would register it (same arguments), built
    /// and hashed without the manager; the hashing runs without the GIL.
    #[pyo3(signature = (request_id, prompt_token_ids, *, lora_name = None, lora_path = None,
        lora_id = None, cache_salt = None, mm_features = None, prompt_embeds = None,
        skip_reading_prefix_cache = false, session_id = None))]
    #[allow(clippy::too_many_arguments)]
    fn prepare(
        &self,
        py: Python<'_>,
        request_id: &str,
        prompt_token_ids: &Bound<'_, PyAny>,
        lora_name: Option<String>,
        lora_path: Option<String>,
        lora_id: Option<i64>,
        cache_salt: Option<String>,
        mm_features: Option<&Bound<'_, PyAny>>,
        prompt_embeds: Option<&Bound<'_, PyAny>>,
        skip_reading_prefix_cache: bool,
        session_id: Option<String>,
    ) -> PkResult<PyPreparedRequest> {
        let limit = self.inner.token_limit();
        let spec = request_spec(
            prompt_tokens(prompt_token_ids, limit)?,
            Lora::from_parts(lora_name, lora_path, lora_id)?,
            cache_salt,
            mm_features,
            prompt_embeds,
            skip_reading_prefix_cache,
            session_id,
        )?;
        let prepared = py.detach(|| self.inner.prepare(request_id, spec))?;
        Ok(PyPreparedRequest {
            request_id: request_id.to_owned(),
            num_tokens: prepared.num_tokens(),
            num_block_hashes: prepared.num_block_hashes(),
            inner: Mutex::new(Some(prepared)),
        })
    }
}

/// A request built by a `RequestPreparer`, until its manager's `add_prepared`
/// takes it.
#[pyclass(module = "pagedkv._core", name = "PreparedRequest", frozen)]
#[derive(Debug)]
pub struct PyPreparedRequest {
    request_id: String,
    num_tokens: usize,
    num_block_hashes: usize,
    inner: Mutex<Option<PreparedRequest>>,
}

impl PyPreparedRequest {
    /// The prepared request, `None` once added.
    pub fn lock(&self) -> MutexGuard<'_, Option<PreparedRequest>> {
        // Nothing panics while the lock is held; a poisoned lock's value is
        // whole.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The refusal of a request added before.
    pub fn already_added(&self) -> crate::errors::PyPkError {
        invalid_arg(format!(
            "prepared request {:?} was added already",
            self.request_id
        ))
    }
}

#[pymethods]
impl PyPreparedRequest {
    #[getter]
    fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The prompt's length in tokens.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// The block hashes the preparation computed.
    #[getter]
    fn num_block_hashes(&self) -> usize {
        self.num_block_hashes
    }

    /// Whether a manager took it (`add_prepared`).
    #[getter]
    fn added(&self) -> bool {
        self.lock().is_none()
    }

    fn __repr__(&self) -> String {
        format!(
            "PreparedRequest(request_id={:?}, num_tokens={}, added={})",
            self.request_id,
            self.num_tokens,
            if self.added() { "True" } else { "False" }
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRequestPreparer>()?;
    m.add_class::<PyPreparedRequest>()?;
    Ok(())
}
