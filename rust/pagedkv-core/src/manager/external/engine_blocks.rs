//! Blocks an engine holds outside requests: deferred frees
//! (`pop_blocks_for_free`, `free_blocks`, `get_new_blocks`), references that
//! keep blocks out of the free queue or release them to its tail while watched
//! for reuse (`touch_blocks`, `unpin_blocks`, `take_reused_blocks`), and blocks
//! the engine filled, cached under a request's hashes (`cache_detached_blocks`,
//! `cache_detached_partial_block`). The engine-held references live in the
//! pool, which `check_invariants` adds.

use crate::error::{Result, invalid};
use crate::manager::KvCacheManager;
use crate::pool::{BlockId, CacheKey, NULL_BLOCK};
use crate::single_type::GroupManager;

impl KvCacheManager {
    /// Detaches the request's blocks without returning them to the pool and
    /// forgets the request: the blocks, in allocation order (group by group,
    /// leading null blocks dropped), stay referenced until
    /// [`Self::free_blocks`] returns them (vLLM's deferred free while a step
    /// that may still write them is in flight).
    ///
    /// # Errors
    /// Unknown request.
    pub fn pop_blocks_for_free(&mut self, id: &str) -> Result<Vec<BlockId>> {
        let slot = self.table.slot(id)?;
        let req = self.table.get_mut(slot);
        let uid = req.uid;
        self.pending_split.take_if(|p| p.uid == uid);
        if req.release(false) {
            self.num_admitted -= 1;
        }
        let blocks = self.coord.pop_blocks(req);
        self.table.remove(id, slot);
        Ok(blocks)
    }

    /// Returns detached blocks ([`Self::pop_blocks_for_free`]) to the pool in
    /// eviction order: the first is evicted first. Null blocks are skipped.
    ///
    /// # Errors
    /// A block that is not detached (as often as it is listed); nothing is
    /// freed then.
    pub fn free_blocks(&mut self, ordered: &[BlockId]) -> Result<()> {
        self.coord.pool_mut().engine_release(ordered, "freed")?;
        self.coord.pool_mut().free_blocks(ordered.iter().copied());
        Ok(())
    }

    /// Takes one more reference on each block for the engine (vLLM's
    /// `BlockPool.touch`): a free block leaves the free queue and keeps its
    /// cache entries. The engine returns the reference with
    /// [`Self::free_blocks`] or [`Self::unpin_blocks`]. The null block is
    /// skipped.
    ///
    /// # Errors
    /// A block id outside the pool; nothing is touched then.
    pub fn touch_blocks(&mut self, ids: &[BlockId]) -> Result<()> {
        self.engine_touch(ids, true)
    }

    /// [`Self::touch_blocks`] for blocks held to be copied or read (host-tier
    /// stores and loads, pinned pages), not prefix hits: the device eviction
    /// policies do not count them as reused.
    pub(crate) fn hold_blocks(&mut self, ids: &[BlockId]) -> Result<()> {
        self.engine_touch(ids, false)
    }

    fn engine_touch(&mut self, ids: &[BlockId], hit: bool) -> Result<()> {
        let n = self.coord.pool().num_blocks();
        if let Some(&b) = ids.iter().find(|&&b| b >= n) {
            return Err(invalid(format!(
                "block {b} is not in the pool of {n} blocks"
            )));
        }
        if hit {
            self.coord.pool_mut().touch(ids);
        } else {
            self.coord.pool_mut().touch_for_copy(ids);
        }
        for &b in ids {
            if b != NULL_BLOCK {
                self.coord.pool_mut().engine_hold(b);
            }
        }
        Ok(())
    }

    /// Returns engine-held references whose blocks stay readable until the
    /// pool reuses them (vLLM's `BlockPool.unpin_blocks`): a block no one
    /// references any more joins the tail of the free queue, cached or not,
    /// so it is evicted last, and [`Self::take_reused_blocks`] reports it once
    /// the pool hands it out again or a reset wipes the cache.
    ///
    /// # Errors
    /// A block the engine holds fewer references on than listed; nothing
    /// changes then.
    pub fn unpin_blocks(&mut self, ids: &[BlockId]) -> Result<()> {
        self.coord.pool_mut().engine_release(ids, "unpinned")?;
        self.coord.pool_mut().unpin(ids);
        Ok(())
    }

    /// The unpinned blocks ([`Self::unpin_blocks`]) the pool handed out again
    /// since the last call, in that order (every allocation path: requests'
    /// blocks, copy-on-write copies, [`Self::get_new_blocks`]), and after a
    /// prefix-cache reset every unpinned block not reported yet. Left
    /// undrained, the list stays within four entries a pool block: a block
    /// reused again then keeps its first listing only, so no reuse goes
    /// unreported.
    pub fn take_reused_blocks(&mut self) -> Vec<BlockId> {
        self.coord.pool_mut().take_reused()
    }

    /// Takes `n` blocks from the free queue (evicting cached ones as vLLM's
    /// pool does) for the engine's own use, outside any request: they count as
    /// detached until [`Self::free_blocks`] returns them. `None` when fewer
    /// than `n` are free (nothing taken).
    pub fn get_new_blocks(&mut self, n: u32) -> Option<Vec<BlockId>> {
        let mut out = Vec::new();
        if !self.coord.pool_mut().get_new_blocks(n, &mut out) {
            return None;
        }
        for &b in &out {
            self.coord.pool_mut().engine_hold(b);
        }
        Some(out)
    }

    /// Publishes blocks the engine holds ([`Self::get_new_blocks`]) and has
    /// filled with the request's tokens into the prefix cache of group `group`:
    /// `blocks[i]` holds the request's block `i`, and blocks `num_cached_blocks`
    /// to `num_full_blocks` (those `mask` keeps: one entry per block of the
    /// range) are cached under the request's hashes, with one `BlockStored`
    /// (vLLM's `BlockPool.cache_full_blocks`; a connector that loaded KV
    /// computed elsewhere). The blocks stay the engine's until
    /// [`Self::free_blocks`], which returns them as cached, evictable blocks.
    ///
    /// # Errors
    /// Unknown request or group; a range past `blocks` or past the request's
    /// hashed tokens; a mask of another length; a block in the range the
    /// engine does not hold, or that a request holds too, or that is cached
    /// under another key (a shorter entry of the same group is promoted, as
    /// vLLM does). Nothing is cached then.
    pub fn cache_detached_blocks(
        &mut self,
        id: &str,
        group: usize,
        blocks: &[BlockId],
        (num_cached_blocks, num_full_blocks): (usize, usize),
        mask: Option<&[bool]>,
    ) -> Result<()> {
        let slot = self.table.slot(id)?;
        let gm = self.group_manager(group)?;
        let req = self.table.get(slot);
        let bs = gm.block_size() as usize;
        // A block is published only with every token it holds.
        let hashed = (req.hashes().len() * self.hash_block_size).min(req.num_tokens());
        if num_full_blocks > blocks.len() || num_full_blocks * bs > hashed {
            return Err(invalid(format!(
                "blocks {num_cached_blocks}..{num_full_blocks} are past the {} given or the \
                 {hashed} hashed tokens of request {id:?}",
                blocks.len()
            )));
        }
        let range = num_cached_blocks.min(num_full_blocks)..num_full_blocks;
        if let Some(m) = mask
            && m.len() != range.len()
        {
            return Err(invalid(format!(
                "the mask has {} entries for {} blocks",
                m.len(),
                range.len()
            )));
        }
        for (i, &b) in blocks.iter().enumerate().take(range.end).skip(range.start) {
            if b == NULL_BLOCK || mask.is_some_and(|m| !m[i - range.start]) {
                continue;
            }
            self.check_engine_only(b)?;
            // A block cached under another key holds other content (vLLM
            // asserts), except a shorter partial entry of the same group,
            // which is promoted.
            let tokens = ((i + 1) * bs) as u32;
            let key = gm.key_for(req.hashes(), i);
            let pool = self.coord.pool();
            if let (Some(k), Some(key)) = (pool.block_key(b), key)
                && k != key
                && (k.group != key.group || pool.primary_tokens(b).is_none_or(|t| t >= tokens))
            {
                return Err(invalid(format!(
                    "block {b} is cached under another hash already"
                )));
            }
        }
        if range.is_empty() {
            return Ok(());
        }
        self.coord
            .cache_blocks_held_outside(req, group, blocks, (range.start, range.end), mask);
        Ok(())
    }

    /// Makes a block the engine holds ([`Self::get_new_blocks`]) reachable from
    /// the request's prefix boundary of `num_tokens` tokens in group `group`: a
    /// partial entry under the hash of the hash block ending there (vLLM's
    /// `BlockPool.cache_partial_block`). With `replace_existing`, the block's
    /// entries are dropped first (its contents were replaced). Returns the key
    /// the entry is under; `None` for the null block (nothing cached).
    ///
    /// # Errors
    /// Unknown request or group; `num_tokens` not a positive multiple of the
    /// hash block size, or past the request's hashed tokens; a block the
    /// engine does not hold, or that a request holds too, or (unless replaced)
    /// cached in another group.
    pub fn cache_detached_partial_block(
        &mut self,
        id: &str,
        group: usize,
        block: BlockId,
        num_tokens: usize,
        replace_existing: bool,
    ) -> Result<Option<CacheKey>> {
        let slot = self.table.slot(id)?;
        let group_id = self.group_manager(group)?.group_id();
        let req = self.table.get(slot);
        let hbs = self.hash_block_size;
        let hashed = (req.hashes().len() * hbs).min(req.num_tokens());
        if num_tokens == 0 || !num_tokens.is_multiple_of(hbs) || num_tokens > hashed {
            return Err(invalid(format!(
                "a partial entry ends on a hash block boundary within the {hashed} hashed \
                 tokens of request {id:?}, not at {num_tokens}"
            )));
        }
        if block == NULL_BLOCK {
            return Ok(None);
        }
        self.check_engine_only(block)?;
        // A block holds one group's content: entries of another group's are
        // refused unless they are all replaced.
        if !replace_existing
            && let Some(k) = self.coord.pool().block_key(block)
            && k.group != group_id
        {
            return Err(invalid(format!(
                "block {block} is cached in group {} already",
                k.group
            )));
        }
        Ok(Some(self.coord.cache_partial_held_outside(
            req,
            group,
            block,
            num_tokens,
            replace_existing,
        )))
    }

    /// vLLM's `BlockPool._insert_block_hash` on a block the engine holds
    /// ([`Self::get_new_blocks`]) and filled itself: `key` becomes its primary
    /// key (ending a prefix of `num_tokens` tokens, when known) or, beside
    /// one, an extra key. No event: the caller reports its own. Whether the
    /// prefix cache changed.
    ///
    /// # Errors
    /// A group past the manager's; the null block; a block the engine does
    /// not hold, or that a request holds too. Nothing is cached then.
    pub fn insert_detached_block_hash(
        &mut self,
        block: BlockId,
        key: CacheKey,
        num_tokens: Option<u32>,
    ) -> Result<bool> {
        self.group_manager(key.group as usize)?;
        if block == NULL_BLOCK {
            return Err(invalid("the null block is never cached".to_owned()));
        }
        self.check_engine_only(block)?;
        Ok(self.coord.pool_mut().insert_key(block, key, num_tokens))
    }

    /// The manager of group `group`.
    pub(in crate::manager) fn group_manager(&self, group: usize) -> Result<&GroupManager> {
        let groups = self.coord.groups();
        groups.get(group).ok_or_else(|| {
            invalid(format!(
                "group {group} is past the manager's {}",
                groups.len()
            ))
        })
    }

    /// Refuses a block the engine does not hold, or one a request holds too
    /// (its cache entries are that request's to keep).
    fn check_engine_only(&self, b: BlockId) -> Result<()> {
        let held = self.coord.pool().engine_refs_of(b);
        if held == 0 {
            return Err(invalid(format!(
                "block {b} is not held by the engine (get_new_blocks or pop_blocks_for_free)"
            )));
        }
        if self.coord.pool().ref_cnt(b) > held {
            return Err(invalid(format!(
                "block {b} is held by a request too: its cache entries stay as they are"
            )));
        }
        Ok(())
    }
    /// Block references detached by [`Self::pop_blocks_for_free`] and not yet
    /// returned.
    #[must_use]
    pub fn num_detached_block_refs(&self) -> u64 {
        self.coord
            .pool()
            .engine_refs()
            .map(|(_, n)| u64::from(n))
            .sum()
    }
}
