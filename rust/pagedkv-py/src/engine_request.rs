//! An engine's own lists of a request (vLLM's `Request._all_token_ids` and
//! `block_hashes`) read as the core's [`EngineRequest`]: the core decides
//! what to read, this converts the items it asks for.

use pagedkv_core::{BlockHash, EngineRequest};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::convert::{
    block_hash_item, block_hashes_from, engine_tokens, engine_tokens_from, exact_int_item,
};
use crate::errors::{PkResult, PyPkError};

/// A request's token and block-hash sequences, with their lengths read once.
pub struct EngineLists<'a, 'py> {
    tokens: &'a Bound<'py, PyAny>,
    hashes: &'a Bound<'py, PyAny>,
    /// The most items one read may return (`max_model_len`).
    limit: usize,
    num_tokens: usize,
    num_hashes: usize,
}

impl<'a, 'py> EngineLists<'a, 'py> {
    /// The two sequences (anything with a length and items).
    ///
    /// # Errors
    /// An object without a length.
    pub fn new(
        tokens: &'a Bound<'py, PyAny>,
        hashes: &'a Bound<'py, PyAny>,
        limit: usize,
    ) -> PkResult<Self> {
        Ok(Self {
            num_tokens: tokens.len()?,
            num_hashes: hashes.len()?,
            tokens,
            hashes,
            limit,
        })
    }
}

impl EngineRequest for EngineLists<'_, '_> {
    type Error = PyPkError;

    fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    fn num_hashes(&self) -> usize {
        self.num_hashes
    }

    fn token(&self, i: usize) -> PkResult<u32> {
        if let Ok(list) = self.tokens.cast::<PyList>()
            && i < list.len()
            && let Some(v) = exact_int_item(list, i)
            && (0..=0x7fff_ffff).contains(&v)
        {
            return Ok(v as u32);
        }
        // Anything else (a negative id, another type) as a one-item list, so
        // it converts, or is refused, as every engine token is.
        let one = PyList::new(self.tokens.py(), [self.tokens.get_item(i)?])?;
        Ok(engine_tokens(one.as_any(), 1)?[0])
    }

    fn hash(&self, j: usize) -> PkResult<BlockHash> {
        block_hash_item(&self.hashes.get_item(j)?)
    }

    fn hash_is(&self, j: usize, held: &BlockHash) -> PkResult<bool> {
        // The bytes compared in place; anything but bytes converts (or is
        // refused) as every hash is.
        let item = match self.hashes.cast::<PyList>() {
            Ok(list) => list.get_item(j)?,
            Err(_) => self.hashes.get_item(j)?,
        };
        match item.cast::<PyBytes>() {
            Ok(b) => Ok(b.as_bytes() == held.as_bytes()),
            Err(_) => Ok(block_hash_item(&item)? == *held),
        }
    }

    fn tokens_are(&self, from: usize, held: &[u32]) -> PkResult<bool> {
        let list = self.tokens.cast::<PyList>().ok();
        for (i, &t) in held.iter().enumerate() {
            let at = from + i;
            let v = match list {
                Some(l) if at < l.len() => match exact_int_item(l, at) {
                    Some(v) if (0..=0x7fff_ffff).contains(&v) => v as u32,
                    _ => self.token(at)?,
                },
                _ => self.token(at)?,
            };
            if v != t {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn tokens_from(&self, from: usize) -> PkResult<Vec<u32>> {
        engine_tokens_from(self.tokens, from, self.limit)
    }

    fn hashes_from(&self, from: usize) -> PkResult<Vec<BlockHash>> {
        block_hashes_from(self.hashes, from, self.limit)
    }
}
