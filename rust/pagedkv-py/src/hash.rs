//! Block hashing functions: the core's hash chain, for routers and tests that
//! hash a request without a manager.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use pagedkv_core::hash::{DEFAULT_NONE_HASH_SEED, event_int};
use pagedkv_core::{BlockHasher, HashAlgo};

use crate::convert::{block_hash, cbor_value, tokens};
use crate::errors::PkResult;

/// Most token ids one block may hold.
const MAX_BLOCK_TOKENS: usize = 1 << 24;

/// `hash_fn(seed)` of an algorithm: the `NONE_HASH` a seed gives.
#[pyfunction]
fn none_hash<'py>(py: Python<'py>, hash_algo: &str, seed: &str) -> PkResult<Bound<'py, PyBytes>> {
    Ok(PyBytes::new(
        py,
        HashAlgo::parse(hash_algo)?.none_hash(seed).as_bytes(),
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
) -> PkResult<Bound<'py, PyBytes>> {
    let algo = HashAlgo::parse(hash_algo)?;
    let seed = block_hash("none_hash", none_hash)?;
    let parent = parent_block_hash
        .map(|p| block_hash("parent hash", p))
        .transpose()?;
    let toks = tokens(token_ids, MAX_BLOCK_TOKENS)?;
    let extra = match extra_keys {
        Some(e) if !e.is_none() => Some(cbor_value(e)?),
        _ => None,
    };
    let out =
        BlockHasher::new(algo, seed).hash_block_generic(parent.as_ref(), &toks, extra.as_ref())?;
    Ok(PyBytes::new(py, out.as_bytes()))
}

/// vLLM's integer form of a block-hash digest (KV events, routers): its last 8
/// bytes, big-endian.
#[pyfunction]
fn hash_to_int(digest: &[u8]) -> u64 {
    event_int(digest)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(none_hash, m)?)?;
    m.add_function(wrap_pyfunction!(hash_block_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(hash_to_int, m)?)?;
    // vLLM's seed of NONE_HASH for the cryptographic algorithms when
    // PYTHONHASHSEED is unset.
    m.add("DEFAULT_NONE_HASH_SEED", DEFAULT_NONE_HASH_SEED)?;
    let names = HashAlgo::ALL.map(HashAlgo::name);
    m.add("HASH_ALGOS", PyTuple::new(m.py(), names)?)
}
