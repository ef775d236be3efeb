//! Chunked local attention with chunk `c`: a token attends only to its own
//! chunk, so a hit is null blocks up to the current chunk's start followed by
//! cached blocks from there; after `n` computed tokens the first `n / c * c`
//! fall out of use.

use super::{GroupManager, Lookup};
use crate::pool::{BlockId, BlockPool, NULL_BLOCK};

impl GroupManager {
    pub(super) fn find_chunked(
        &self,
        pool: &BlockPool,
        q: &Lookup<'_>,
        chunk: u32,
        group_ids: &[u32],
        out: &mut [Vec<BlockId>],
    ) -> usize {
        let bs = self.block_size as usize;
        let chunk = chunk as usize;
        let max_blocks = q.max_len / bs;
        let start = if q.max_len > 0 {
            q.max_len / chunk * chunk
        } else {
            0
        };
        let start_block = start / bs;
        for &g in group_ids {
            out[g as usize].resize(start_block, NULL_BLOCK);
        }
        for i in start_block..max_blocks {
            let Some(hash) = self.hash_at(q.hashes, i) else {
                break;
            };
            if !Self::lookup_into(pool, hash, group_ids, out) {
                break;
            }
        }
        out[group_ids[0] as usize].len() * bs
    }
}
