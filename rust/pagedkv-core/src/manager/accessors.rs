//! Read-only accessors of the manager: its configuration, pool and counts,
//! and one request's tokens, hashes, blocks and preemptions.

use super::{KvCacheManager, RequestHandle};
use crate::error::Result;
use crate::hash::BlockHash;
use crate::pool::{BlockId, BlockPool};
use crate::request::{GroupBlocks, Request};
use crate::spec::ManagerConfig;

impl KvCacheManager {
    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &ManagerConfig {
        &self.cfg
    }

    /// The block pool (read-only).
    #[must_use]
    pub fn pool(&self) -> &BlockPool {
        self.coord.pool()
    }

    /// Free blocks (evictable cached blocks included).
    #[must_use]
    pub fn num_free_blocks(&self) -> u32 {
        self.coord.pool().num_free_blocks()
    }

    /// Sets how many free blocks the pool counts as free (vLLM's
    /// `free_block_queue.num_free_blocks = n`): see
    /// [`BlockPool::set_num_free_blocks`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for more than the free queue holds.
    pub fn set_num_free_blocks(&mut self, n: u32) -> Result<()> {
        self.coord.pool_mut().set_num_free_blocks(n)
    }

    /// Block usage in `[0, 1]`, null block excluded.
    #[must_use]
    pub fn usage(&self) -> f64 {
        self.coord.pool().usage()
    }

    /// Number of KV-cache groups.
    #[must_use]
    pub fn num_groups(&self) -> usize {
        self.coord.groups().len()
    }

    /// Token granularity of block hashes.
    #[must_use]
    pub fn hash_block_size(&self) -> usize {
        self.hash_block_size
    }

    /// The chain seed in use.
    #[must_use]
    pub fn none_hash(&self) -> BlockHash {
        self.hasher.none_hash()
    }

    /// Number of known requests.
    #[must_use]
    pub fn num_requests(&self) -> usize {
        self.table.len()
    }

    /// The handle of a known request (the value `add_request` returned).
    ///
    /// # Errors
    /// Unknown request.
    pub fn request_handle(&self, id: &str) -> Result<RequestHandle> {
        Ok(self.table.handle_of(self.table.slot(id)?))
    }

    pub(super) fn req(&self, id: &str) -> Result<&Request> {
        Ok(self.table.get(self.table.slot(id)?))
    }

    /// Whether a request id is known.
    #[must_use]
    pub fn contains(&self, id: &str) -> bool {
        self.table.contains(id)
    }

    /// Token count of a request.
    ///
    /// # Errors
    /// Unknown request.
    pub fn num_tokens(&self, id: &str) -> Result<usize> {
        Ok(self.req(id)?.num_tokens())
    }

    /// Prompt length of a request.
    ///
    /// # Errors
    /// Unknown request.
    pub fn num_prompt_tokens(&self, id: &str) -> Result<usize> {
        Ok(self.req(id)?.num_prompt_tokens)
    }

    /// The request's block hashes at `hash_block_size` granularity.
    ///
    /// # Errors
    /// Unknown request.
    pub fn block_hashes(&self, id: &str) -> Result<&[BlockHash]> {
        Ok(self.req(id)?.hashes())
    }

    /// The request's block ids per group.
    ///
    /// # Errors
    /// Unknown request.
    pub fn block_ids(&self, id: &str) -> Result<Vec<&[BlockId]>> {
        let r = self.req(id)?;
        Ok(r.groups().iter().map(GroupBlocks::blocks).collect())
    }

    /// The request's block ids in one group.
    ///
    /// # Errors
    /// Unknown request; `group` past the manager's groups.
    pub fn group_block_ids(&self, id: &str, group: usize) -> Result<&[BlockId]> {
        let r = self.req(id)?;
        self.group_manager(group)?;
        Ok(r.groups()[group].blocks())
    }

    /// How many times the request was freed (preempted) while known.
    ///
    /// # Errors
    /// Unknown request.
    pub fn num_preemptions(&self, id: &str) -> Result<u32> {
        Ok(self.req(id)?.num_preemptions)
    }
}
