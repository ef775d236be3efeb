//! The pool's prefix-cache side: lookups in the prefix map, keys given to
//! blocks (full, partial prompt-tail, moved), eviction and the cache reset.

use super::{BlockActivityKind, BlockId, BlockPool, CacheKey, NIL, NULL_BLOCK, dedupe_past_bound};
use crate::events::KvEvent;
use crate::hash::BlockHash;

impl BlockPool {
    /// The first block cached under `key`.
    #[must_use]
    pub fn cached_block(&self, key: &CacheKey) -> Option<BlockId> {
        self.map.head(key).map(|e| self.map.entry(e).block)
    }

    /// The first block cached under `(hash, group)` ([`Self::cached_block`]
    /// for a lookup loop: no key built).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn first_cached(&self, hash: &BlockHash, group: u32) -> Option<BlockId> {
        self.map.first_block(hash, group)
    }

    /// Appends the first block cached under each of `hashes` in `group` to
    /// `out`, stopping at the first miss; returns how many it appended.
    pub(crate) fn cached_run<'a>(
        &self,
        hashes: impl ExactSizeIterator<Item = &'a BlockHash>,
        group: u32,
        out: &mut Vec<BlockId>,
    ) -> usize {
        self.map.first_blocks_run(hashes, group, out)
    }

    /// [`Self::cached_run`] over at most 32 hashes of a map larger than the
    /// caches, their misses staged to be in flight together.
    pub(crate) fn cached_run_staged<'a>(
        &self,
        hashes: impl ExactSizeIterator<Item = &'a BlockHash> + Clone,
        group: u32,
        out: &mut Vec<BlockId>,
    ) -> usize {
        self.map.first_blocks_run_staged(hashes, group, out)
    }

    /// Whether lookups read ahead ([`Self::warm_lookups`] does nothing
    /// otherwise): the map is larger than the caches.
    #[inline]
    pub(crate) fn reads_ahead(&self) -> bool {
        self.map.is_large()
    }

    /// Reads ahead what lookups of `keys` will need (the buckets, then the
    /// entries they point to), so their cache misses overlap instead of
    /// queueing one behind the other. Only a map larger than the caches
    /// bothers; the lookups' results do not depend on it.
    pub fn warm_lookups<I: Iterator<Item = CacheKey> + Clone>(&self, keys: I) {
        if !self.map.is_large() {
            return;
        }
        for key in keys.clone() {
            self.map.warm_bucket(&key);
        }
        for key in keys {
            self.map.warm_candidate(&key);
        }
    }

    /// All blocks cached under `key`, in insertion order.
    #[must_use]
    pub fn cached_blocks(&self, key: &CacheKey) -> Vec<BlockId> {
        self.map
            .chain(key)
            .map(|e| self.map.entry(e).block)
            .collect()
    }

    /// Whether block `id` is reachable under `key` (its primary key or another
    /// entry, such as a partial prompt-tail one).
    pub(crate) fn map_contains(&self, key: &CacheKey, id: BlockId) -> bool {
        self.map.chain(key).any(|e| self.map.entry(e).block == id)
    }

    /// Tokens covered by a block's primary key (a full block, or a partial
    /// prompt-tail boundary inside it).
    #[must_use]
    pub fn primary_tokens(&self, id: BlockId) -> Option<u32> {
        let k = self.blocks[id as usize].key;
        (k != NIL).then(|| self.map.entry(k).tokens)
    }

    /// A number that changes whenever the block is cached afresh (`None` while it
    /// is not cached). Unique over the pool's life.
    #[must_use]
    pub fn cache_stamp(&self, id: BlockId) -> Option<u64> {
        let k = self.blocks[id as usize].key;
        (k != NIL).then(|| self.map.entry(k).stamp)
    }

    /// vLLM's `_insert_block_hash`: the key becomes the block's primary key, or an
    /// extra one when it already has a primary. Whether the map changed.
    fn insert_block_hash(&mut self, id: BlockId, key: CacheKey, tokens: u32) -> bool {
        let primary = self.blocks[id as usize].key;
        if primary == NIL {
            // A block without a primary key carries no key at all.
            let (e, ghost) = self
                .map
                .insert_taking_ghost(key, id, tokens, self.next_stamp);
            self.blocks[id as usize].key = e;
            self.next_stamp += 1;
            if let Some(second) = ghost {
                self.on_ghost_hit(id, usize::from(second));
            }
            return true;
        }
        if self.map.entry(primary).key == key || self.map_contains(&key, id) {
            return false;
        }
        self.secondary.entry(id).or_default().push(key);
        self.map.insert(key, id, tokens, 0);
        true
    }

    /// Drops every key of a block from the map (vLLM's
    /// `_remove_cached_block_hashes`), emitting one `BlockRemoved` per key that
    /// was there. Returns how many were.
    ///
    /// `ghost` (ARC, a block handed out): the list and ring slot its primary
    /// key is recorded in when that takes the key out of the cache.
    fn remove_block_hashes(&mut self, id: BlockId, ghost: Option<(usize, usize)>) -> usize {
        let slot = self.blocks[id as usize].key;
        if slot == NIL {
            // Extra keys only exist beside a primary key.
            return 0;
        }
        self.blocks[id as usize].key = NIL;
        if self.segments.is_some() {
            self.on_key_dropped(id);
        }
        let key = self.map.entry(slot).key;
        let mut removed = usize::from(self.pop_and_report(key, id, ghost));
        if !self.secondary.is_empty()
            && let Some(extra) = self.secondary.remove(&id)
        {
            for key in extra {
                removed += usize::from(self.pop_and_report(key, id, None));
            }
        }
        if removed > 0 {
            self.epoch += 1;
        }
        removed
    }

    fn pop_and_report(
        &mut self,
        key: CacheKey,
        id: BlockId,
        ghost: Option<(usize, usize)>,
    ) -> bool {
        let (popped, record) = self.map.remove_leaving_ghost(&key, id, ghost);
        if let (Some((list, _)), Some(r)) = (ghost, record) {
            self.push_ghost(list, r);
        }
        if popped && self.events_enabled {
            self.record_event(KvEvent::BlockRemoved {
                block_hashes: vec![key.hash],
                group_idx: key.group,
            });
        }
        popped
    }

    /// Caches a block under `key` as its only key. A block that already carries a
    /// key keeps it (returns `false`); the null block is never cached.
    pub fn cache_block(&mut self, id: BlockId, key: CacheKey) -> bool {
        if id == NULL_BLOCK || self.blocks[id as usize].key != NIL {
            return false;
        }
        self.insert_block_hash(id, key, u32::MAX)
    }

    /// vLLM's `BlockPool._insert_block_hash` for a caller that fills blocks
    /// itself: `key` becomes the block's primary key (ending a prefix of
    /// `tokens` tokens, when known) or, beside one, an extra key. No event (the
    /// caller reports its own); the null block is never cached. Whether the
    /// map changed.
    pub fn insert_key(&mut self, id: BlockId, key: CacheKey, tokens: Option<u32>) -> bool {
        if id == NULL_BLOCK {
            return false;
        }
        self.insert_block_hash(id, key, tokens.unwrap_or(u32::MAX))
    }

    /// Caches a block that just became full (`tokens` = the prefix it ends). A
    /// partial entry it carried is replaced (promotion, with `BlockRemoved`).
    pub fn cache_full_block(&mut self, id: BlockId, key: CacheKey, tokens: u32) -> bool {
        if id == NULL_BLOCK {
            return false;
        }
        if self.blocks[id as usize].key != NIL && self.block_key(id) != Some(key) {
            self.remove_block_hashes(id, None);
        }
        self.insert_block_hash(id, key, tokens)
    }

    /// vLLM's `cache_partial_block`: makes a block reachable from a prefix
    /// boundary of `tokens` tokens inside it. A shorter primary entry is replaced;
    /// otherwise the key is added beside the block's primary key. Returns whether
    /// the entry is new (an event is due).
    pub fn cache_partial_block(&mut self, id: BlockId, key: CacheKey, tokens: u32) -> bool {
        if id == NULL_BLOCK {
            return false;
        }
        let already = self.block_key(id) == Some(key) || self.map_contains(&key, id);
        if !already && self.primary_tokens(id).is_some_and(|t| t < tokens) {
            self.remove_block_hashes(id, None);
        }
        self.insert_block_hash(id, key, tokens);
        !already
    }

    /// `cache_partial_block` with `replace_existing_hashes`: the block's data
    /// was replaced, so every key it carried goes (`BlockRemoved`) before `key`
    /// becomes its only one. The null block is never cached.
    pub fn replace_block_hashes(&mut self, id: BlockId, key: CacheKey, tokens: u32) -> bool {
        if id == NULL_BLOCK {
            return false;
        }
        self.remove_block_hashes(id, None);
        self.insert_block_hash(id, key, tokens)
    }

    /// vLLM's `move_block_hashes`: every key of `src` now points to `dst` (which
    /// carries none), the primary one first with its token count. The entries
    /// stay live: no events.
    pub fn move_block_hashes(&mut self, src: BlockId, dst: BlockId) {
        let slot = self.blocks[src as usize].key;
        if slot == NIL || src == dst || dst == NULL_BLOCK {
            return;
        }
        let tokens = self.map.entry(slot).tokens;
        let mut keys = vec![self.map.entry(slot).key];
        if let Some(extra) = self.secondary.remove(&src) {
            keys.extend(extra);
        }
        self.blocks[src as usize].key = NIL;
        if self.segments.is_some() {
            self.on_key_dropped(src);
        }
        let mut moved = Vec::with_capacity(keys.len());
        for key in keys {
            if self.map.remove(&key, src) {
                moved.push(key);
            }
        }
        self.epoch += 1;
        for key in moved {
            self.insert_block_hash(dst, key, tokens);
        }
    }

    /// Drops a block's keys from the map (vLLM's `_maybe_evict_cached_block`),
    /// emitting `BlockRemoved`. Returns whether it was cached.
    pub fn maybe_evict(&mut self, id: BlockId) -> bool {
        let evicted = self.remove_block_hashes(id, None) > 0;
        self.count_eviction(id, evicted);
        evicted
    }

    /// [`Self::maybe_evict`]; under ARC (`ghost`: the list and ring slot,
    /// [`Self::ghost_for`]) the key that leaves the cache stays as a ghost.
    pub(super) fn evict_recording(&mut self, id: BlockId, ghost: Option<(usize, usize)>) -> bool {
        let evicted = self.remove_block_hashes(id, ghost) > 0;
        self.count_eviction(id, evicted);
        evicted
    }

    #[inline]
    fn count_eviction(&mut self, id: BlockId, evicted: bool) {
        if let Some(m) = self.metrics.as_deref_mut() {
            m.stats.blocks_evicted += u64::from(evicted);
            m.log(BlockActivityKind::Evicted, id);
        }
    }

    /// Clears the prefix cache when no block is in use (only the null block);
    /// returns `false` and changes nothing otherwise.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_free_blocks() as usize != self.blocks.len() - 1 {
            return false;
        }
        self.reset_segments();
        self.map.clear();
        self.secondary.clear();
        for b in &mut self.blocks {
            b.key = NIL;
        }
        if !self.watched.is_empty() {
            let mut wiped: Vec<BlockId> = self.watched.drain().collect();
            wiped.sort_unstable();
            self.reused.extend(wiped);
            dedupe_past_bound(&mut self.reused, self.blocks.len());
        }
        self.epoch += 1;
        if self.events_enabled {
            self.record_event(KvEvent::AllBlocksCleared);
        }
        if let Some(m) = self.metrics.as_deref_mut() {
            m.stats.cache_resets += 1;
            m.log(BlockActivityKind::Reset, NULL_BLOCK);
        }
        true
    }
}
