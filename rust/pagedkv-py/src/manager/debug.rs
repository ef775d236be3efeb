//! Reads for tests and debugging: the invariant check, the free queue, block
//! reference counts and the prefix cache's entries.

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use pagedkv_core::CacheKey;

use crate::convert::{block_hash, ids_i32};
use crate::errors::{PkResult, borrow};

use super::PyManager;

/// One prefix-cache key as Python reads it: hash, group, the blocks under it.
type HashEntry<'py> = (Bound<'py, PyBytes>, u32, Vec<u32>);

#[pymethods]
impl PyManager {
    fn check_invariants(&self) -> PkResult<()> {
        Ok(self.inner.check_invariants()?)
    }

    /// The free queue from head (allocated next) to tail.
    fn free_block_ids<'py>(slf: &Bound<'py, Self>) -> PkResult<Bound<'py, PyArray1<i32>>> {
        let ids = ids_i32(&borrow(slf)?.inner.pool().free_queue());
        Ok(PyArray1::from_vec(slf.py(), ids))
    }

    /// Reference count of a block.
    fn block_ref_count(slf: &Bound<'_, Self>, block_id: i64) -> PkResult<u32> {
        let this = borrow(slf)?;
        let pool = this.inner.pool();
        Ok(pool.ref_cnt(pool.block_id(block_id)?))
    }

    /// The hash a block is cached under (None if not cached), and its group.
    fn cached_block_hash<'py>(
        slf: &Bound<'py, Self>,
        block_id: i64,
    ) -> PkResult<Option<(Bound<'py, PyBytes>, u32)>> {
        let key = {
            let this = borrow(slf)?;
            let pool = this.inner.pool();
            pool.block_key(pool.block_id(block_id)?)
        };
        Ok(key.map(|k| (PyBytes::new(slf.py(), k.hash.as_bytes()), k.group)))
    }

    /// Blocks cached under a hash for a group, in insertion order.
    #[pyo3(signature = (block_hash, group = 0))]
    fn cached_blocks_for_hash<'py>(
        slf: &Bound<'py, Self>,
        block_hash: &[u8],
        group: u32,
    ) -> PkResult<Bound<'py, PyArray1<i32>>> {
        let key = CacheKey {
            hash: self::block_hash("hash", block_hash)?,
            group,
        };
        let ids = ids_i32(&borrow(slf)?.inner.pool().cached_blocks(&key));
        Ok(PyArray1::from_vec(slf.py(), ids))
    }

    /// The hashes (and groups) a block is cached under beside the one
    /// `cached_block_hash` gives (partial prompt-tail entries), in the order
    /// they were given; empty when none.
    fn cached_block_extra_hashes<'py>(
        slf: &Bound<'py, Self>,
        block_id: i64,
    ) -> PkResult<Vec<(Bound<'py, PyBytes>, u32)>> {
        let keys = {
            let this = borrow(slf)?;
            let pool = this.inner.pool();
            pool.extra_keys(pool.block_id(block_id)?).to_vec()
        };
        Ok(keys
            .iter()
            .map(|k| (PyBytes::new(slf.py(), k.hash.as_bytes()), k.group))
            .collect())
    }

    /// Every hash in the prefix cache, with its group and the blocks cached
    /// under it (in the order they were cached). Hashes come in no particular
    /// order.
    fn cached_block_hash_entries<'py>(slf: &Bound<'py, Self>) -> PkResult<Vec<HashEntry<'py>>> {
        let entries = borrow(slf)?.inner.pool().cached_entries();
        Ok(entries
            .into_iter()
            .map(|(k, ids)| (PyBytes::new(slf.py(), k.hash.as_bytes()), k.group, ids))
            .collect())
    }

    /// The blocks cached under more than one hash (those
    /// `cached_block_extra_hashes` answers for), in ascending id order.
    fn blocks_with_extra_hashes<'py>(
        slf: &Bound<'py, Self>,
    ) -> PkResult<Bound<'py, PyArray1<i32>>> {
        let ids = ids_i32(&borrow(slf)?.inner.pool().blocks_with_extra_keys());
        Ok(PyArray1::from_vec(slf.py(), ids))
    }

    /// A free block's neighbours in the free queue, `(previous, next)`, -1 at
    /// either end; None for a block not in the queue. `block_id=-1`: the
    /// queue's `(head, tail)` (-1, -1 when empty).
    fn free_neighbors(slf: &Bound<'_, Self>, block_id: i64) -> PkResult<Option<(i64, i64)>> {
        let this = borrow(slf)?;
        let pool = this.inner.pool();
        let end = |x: Option<u32>| x.map_or(-1, i64::from);
        if block_id == -1 {
            return Ok(Some(
                pool.free_queue_ends()
                    .map_or((-1, -1), |(h, t)| (i64::from(h), i64::from(t))),
            ));
        }
        let id = pool.block_id(block_id)?;
        Ok(pool.free_neighbors(id).map(|(p, n)| (end(p), end(n))))
    }

    /// Prefix tokens the cached block's hash covers, or None if not cached.
    fn cached_block_num_tokens(slf: &Bound<'_, Self>, block_id: i64) -> PkResult<Option<u32>> {
        let this = borrow(slf)?;
        let pool = this.inner.pool();
        let id = pool.block_id(block_id)?;
        Ok(pool.block_key(id).and_then(|_| pool.primary_tokens(id)))
    }
}
