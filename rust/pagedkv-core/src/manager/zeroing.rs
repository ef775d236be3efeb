//! Fresh blocks the worker zeroes before use (vLLM's `needs_kv_cache_zeroing`
//! layouts: Mamba hybrids, mixed-precision caches), listed per group.

use super::KvCacheManager;
use crate::error::{Result, invalid};
use crate::pool::BlockId;
use crate::spec::check_token_counts;

impl KvCacheManager {
    /// Whether each group's fresh blocks are listed for zeroing.
    #[must_use]
    pub fn records_new_block_ids(&self) -> Vec<bool> {
        self.coord
            .groups()
            .iter()
            .map(crate::single_type::GroupManager::records_new_block_ids)
            .collect()
    }

    /// Drains the blocks to zero listed since the last call: fresh blocks of the
    /// attention groups (with `zero_new_blocks`) and every copy-on-write copy, in
    /// group order; `group` drains one group only (vLLM's per-manager
    /// `take_new_block_ids`). Left undrained, each group's list stays within
    /// four entries a pool block: a block listed again then keeps its first
    /// listing only (zeroing it once at drain time is all a listing asks), so
    /// no block to zero is lost.
    ///
    /// # Errors
    /// `group` out of range.
    pub fn take_new_block_ids(&mut self, group: Option<u32>) -> Result<Vec<BlockId>> {
        let n = self.coord.groups().len();
        if let Some(g) = group.filter(|&g| g as usize >= n) {
            return Err(invalid(format!(
                "group {g} is out of range (the manager has {n} groups)"
            )));
        }
        Ok(self.coord.take_new_block_ids(group.map(|g| g as usize)))
    }

    /// Lists the request's blocks from `start_token` on for zeroing again, in
    /// every group that zeroes (blocks a failed KV load left unwritten; vLLM's
    /// `record_blocks_for_zeroing`).
    ///
    /// # Errors
    /// Unknown request, `start_token` past 2**40, or not a multiple of the block size of a
    /// group that zeroes (zeroing a partly valid block would wipe its valid
    /// prefix). Nothing is listed then.
    pub fn record_blocks_for_zeroing(&mut self, id: &str, start_token: u64) -> Result<()> {
        let slot = self.table.slot(id)?;
        check_token_counts([("start_token", start_token)])?;
        if let Some(gm) = self.coord.groups().iter().find(|gm| {
            gm.records_new_block_ids() && !start_token.is_multiple_of(u64::from(gm.block_size()))
        }) {
            return Err(invalid(format!(
                "start_token {start_token} is not a multiple of the block size {}",
                gm.block_size()
            )));
        }
        let req = self.table.get(slot);
        self.coord.record_blocks_for_zeroing(req, start_token);
        Ok(())
    }
}
