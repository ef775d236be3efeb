//! The block pool (vLLM's `BlockPool`): the type, its block arena, and taking
//! blocks from and returning them to the free queue.
//!
//! Beside it: `free_queue` (the intrusive LRU queue's links), `eviction`
//! (the policies beyond LRU: SLRU and ARC's second list, ARC's `ghosts`), `cache` (the
//! prefix-cache side: lookups, keys given and dropped, eviction, reset),
//! `engine_refs` (references the engine holds outside requests, blocks it
//! unpins and watches for reuse), `events` (KV events and metrics read-outs),
//! `check` (the invariants), `prefix_map` and `metrics`.
//!
//! Invariants (checked by [`BlockPool::check_invariants`]):
//! - block 0 is the null block: never queued, never cached, ref count meaningless;
//! - every other block is in the free queue exactly once iff its ref count is 0
//!   (under SLRU / ARC: in exactly one of the two free lists, as its tag says);
//! - a block has a cache key iff the prefix map lists it under that key;
//! - `num_free` equals the queue length.

use crate::error::{Error, Result, invalid};
use crate::events::KvEvent;
use crate::hash::BlockHash;
use pagedkv_arch::prefetch;

/// A physical block id. Block 0 is the null block.
pub type BlockId = u32;

/// The null block's id.
pub const NULL_BLOCK: BlockId = 0;

const NIL: u32 = u32::MAX;

/// Per-block metadata: 16 bytes.
#[derive(Clone, Copy, Debug)]
struct Block {
    ref_cnt: u32,
    prev: u32,
    next: u32,
    /// The prefix map's entry for the block's primary key, `NIL` when the
    /// block is not cached.
    key: u32,
}

/// Prefix-map key: a block hash plus the KV-cache group id (vLLM's
/// `BlockHashWithGroupId`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheKey {
    /// The block's hash.
    pub hash: BlockHash,
    /// Its KV-cache group.
    pub group: u32,
}

impl std::hash::Hash for CacheKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // Digests are uniform already: one word is enough to bucket.
        state.write_u64(self.hash.fingerprint() ^ u64::from(self.group));
    }
}

mod cache;
mod check;
mod engine_refs;
mod events;
mod eviction;
mod free_queue;
mod ghosts;
mod metrics;
mod prefix_map;

pub use eviction::Eviction;
use eviction::GHOSTS_AHEAD;
use metrics::PoolMetrics;
pub use metrics::{BlockActivity, BlockActivityKind, BlockPoolStats};
use prefix_map::PrefixMap;

/// Most per-key entries a pool reserves room for when it is built.
pub(super) const KEY_RESERVE: usize = 1 << 20;

/// Block arena, free queue and prefix map of one KV cache.
#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    head: u32,
    tail: u32,
    num_free: u32,
    /// Free blocks the pool does not count as free ([`Self::set_num_free_blocks`]):
    /// it reports `num_free - withheld` and allocates against that.
    withheld: u32,
    enable_caching: bool,
    /// Cache key -> blocks. Each entry also holds the tokens its key covers
    /// (full block, or a partial prefix) and when the key was given (a fresh
    /// number per caching, so state recorded about a cached block can tell
    /// whether it is still current).
    map: PrefixMap,
    next_stamp: u64,
    /// Extra keys of blocks reachable from more than one prefix boundary (a
    /// full block that also carries a partial prompt-tail entry).
    secondary: rustc_hash::FxHashMap<BlockId, Vec<CacheKey>>,
    events_enabled: bool,
    events: Vec<KvEvent>,
    /// Bumped whenever a cached block loses its key: lookup results taken before
    /// a bump must be re-validated.
    epoch: u64,
    /// The free-queue head whose next pops were prefetched
    /// ([`Self::prefetch_next_pops`]), `NIL` when none.
    staged_head: u32,
    /// Scratch runs of `free_blocks` (kept to avoid allocating per call).
    scratch_first: Vec<BlockId>,
    scratch_last: Vec<BlockId>,
    /// `Some` when built [`BlockPool::with_metrics`].
    metrics: Option<Box<PoolMetrics>>,
    /// Blocks released with [`Self::unpin`] whose contents someone still reads
    /// until the pool hands them out again.
    watched: rustc_hash::FxHashSet<BlockId>,
    /// Watched blocks handed out (or wiped by a reset) since the last
    /// [`Self::take_reused`], in that order; a block listed again past
    /// [`PENDING_BLOCKS_PER_POOL_BLOCK`] entries a block keeps its first
    /// listing only ([`dedupe_past_bound`]).
    reused: Vec<BlockId>,
    /// References the engine holds outside any request's table, per block:
    /// detached by `pop_blocks_for_free`, taken with `get_new_blocks` or
    /// `touch_blocks`, and those of HiSparse resident rows (which the engine
    /// pins and unpins page by page).
    engine_refs: rustc_hash::FxHashMap<BlockId, u32>,
    /// The most events `events` keeps undrained.
    max_pending_events: usize,
    /// The second free list and per-block marks of SLRU / ARC; `None` under
    /// LRU ([`Self::with_eviction`]).
    segments: Option<Box<eviction::Segments>>,
    /// Events dropped, oldest first, to keep `events` under its cap.
    dropped_events: u64,
}

/// Makes room for one more item in a queue of at most `cap` items that its
/// caller has not drained: drops the oldest quarter (at least one) once it is
/// full, so a queue never drained costs amortised O(1) a push. Returns how
/// many were dropped.
pub(crate) fn drop_oldest<T>(queue: &mut Vec<T>, cap: usize) -> u64 {
    if queue.len() < cap.max(1) {
        return 0;
    }
    let k = (cap / 4).clamp(1, queue.len());
    queue.drain(..k);
    k as u64
}

/// Undrained lists of block ids that must lose no block (blocks to zero,
/// reused blocks) keep at most this many entries per block of the pool.
pub(crate) const PENDING_BLOCKS_PER_POOL_BLOCK: usize = 4;

/// Keeps an undrained list of block ids of a pool of `num_blocks` blocks within
/// [`PENDING_BLOCKS_PER_POOL_BLOCK`] entries a block without losing a block:
/// once it reaches that bound, each block's later listings are removed, its
/// first kept, in order. Below the bound the list is untouched, so a caller
/// that drains it in time sees every listing; past it, the caller still sees
/// every block listed, once, where it was first listed. What is left is at
/// most `num_blocks` long, so a list never drained costs amortised O(1) a
/// push.
pub(crate) fn dedupe_past_bound(queue: &mut Vec<BlockId>, num_blocks: usize) {
    if queue.len() < num_blocks.max(1) * PENDING_BLOCKS_PER_POOL_BLOCK {
        return;
    }
    let mut seen = vec![false; num_blocks];
    queue.retain(|&b| {
        seen.get_mut(b as usize)
            .is_none_or(|s| !std::mem::replace(s, true))
    });
}

/// The refusal of a pool too large to allocate.
pub(crate) fn cannot_allocate(num_blocks: u32, bytes_per_block: usize) -> String {
    format!(
        "cannot allocate the manager's state for {num_blocks} blocks ({} bytes); \
         num_blocks is larger than this machine can hold",
        u64::from(num_blocks) * bytes_per_block as u64
    )
}

impl BlockPool {
    /// A pool of `num_blocks` blocks (ids `0..num_blocks`), block 0 taken as the
    /// null block, the rest free in id order.
    ///
    /// # Panics
    /// When the block arena cannot be allocated ([`Self::try_new`] says so
    /// instead).
    #[must_use]
    pub fn new(num_blocks: u32, enable_caching: bool, events_enabled: bool) -> Self {
        match Self::try_new(num_blocks, enable_caching, events_enabled) {
            Ok(p) => p,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`Self::new`], or an error when the block arena cannot be allocated.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the blocks and bytes asked for.
    pub fn try_new(num_blocks: u32, enable_caching: bool, events_enabled: bool) -> Result<Self> {
        let n = num_blocks.max(1);
        let mut blocks = Vec::new();
        blocks
            .try_reserve_exact(n as usize)
            .map_err(|_| Error::InvalidConfig(cannot_allocate(n, size_of::<Block>())))?;
        for id in 0..n {
            blocks.push(Block {
                ref_cnt: 0,
                prev: if id <= 1 { NIL } else { id - 1 },
                next: if id + 1 < n { id + 1 } else { NIL },
                key: NIL,
            });
        }
        blocks[0] = Block {
            ref_cnt: 0,
            prev: NIL,
            next: NIL,
            key: NIL,
        };
        let (head, tail) = if n > 1 { (1, n - 1) } else { (NIL, NIL) };
        // About one key per block: the table is sized for all of them (zeroed
        // pages, backed as they fill), so it never rehashes while the cache
        // fills; the entry arena reserves up to 2^20 entries (64 MiB) and
        // grows by doubling beyond.
        let keys = if enable_caching { n as usize } else { 0 };
        let map = PrefixMap::try_with_capacity(keys, keys.min(KEY_RESERVE)).ok_or_else(|| {
            // About 14 bytes of table per block beside its 16 bytes of state.
            Error::InvalidConfig(cannot_allocate(n, size_of::<Block>() + 14))
        })?;
        Ok(Self {
            blocks,
            head,
            tail,
            num_free: n - 1,
            withheld: 0,
            enable_caching,
            map,
            next_stamp: 0,
            secondary: rustc_hash::FxHashMap::default(),
            events_enabled,
            events: Vec::new(),
            epoch: 0,
            staged_head: NIL,
            scratch_first: Vec::new(),
            scratch_last: Vec::new(),
            metrics: None,
            watched: rustc_hash::FxHashSet::default(),
            reused: Vec::new(),
            engine_refs: rustc_hash::FxHashMap::default(),
            max_pending_events: crate::spec::PENDING_EVENTS_DEFAULT as usize,
            dropped_events: 0,
            segments: None,
        })
    }

    /// The pool with block metrics on or off: counters ([`BlockPool::stats`]) and
    /// an activity log ([`BlockPool::take_block_activity`]) recording what vLLM's
    /// pool reports to its metrics collector. Off costs one branch per block.
    #[must_use]
    pub fn with_metrics(mut self, on: bool) -> Self {
        self.metrics = on.then(Box::default);
        self
    }

    /// Total blocks, the null block included.
    #[must_use]
    pub fn num_blocks(&self) -> u32 {
        self.blocks.len() as u32
    }

    /// Blocks in the free queue (evictable cached blocks included) that the pool
    /// counts as free: all of them unless [`Self::set_num_free_blocks`] withheld
    /// some.
    #[must_use]
    pub fn num_free_blocks(&self) -> u32 {
        self.num_free.saturating_sub(self.withheld)
    }

    /// Sets how many blocks the pool counts as free (at most the blocks in its
    /// free queue): vLLM's `free_block_queue.num_free_blocks = n`, with which its
    /// tests make the pool look full. The difference is withheld from here on:
    /// blocks taken and returned change the count one for one, allocations are
    /// checked against it, and a prefix-cache reset is refused while any is
    /// withheld (the pool does not look empty). The queue, its order and the
    /// blocks in it are unchanged; setting the count to the queue's length ends
    /// it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for more than the free queue holds.
    pub fn set_num_free_blocks(&mut self, n: u32) -> Result<()> {
        if n > self.num_free {
            return Err(invalid(format!(
                "cannot count {n} blocks as free: the free queue holds {}",
                self.num_free
            )));
        }
        self.withheld = self.num_free - n;
        Ok(())
    }

    /// `1 - free / (num_blocks - 1)`, 0 for a pool holding only the null block.
    #[must_use]
    pub fn usage(&self) -> f64 {
        let total = self.blocks.len() - 1;
        if total == 0 {
            return 0.0;
        }
        1.0 - f64::from(self.num_free_blocks()) / total as f64
    }

    /// Whether prefix caching is on.
    #[must_use]
    pub fn enable_caching(&self) -> bool {
        self.enable_caching
    }

    /// Makes every lookup result taken so far be checked again before it is
    /// adopted (a request's hashes changed under it).
    pub(crate) fn invalidate_lookups(&mut self) {
        self.epoch += 1;
    }

    /// The eviction epoch (see field docs).
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// A block id given from outside (a binding, a test), checked against the pool.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an id outside the pool.
    pub fn block_id(&self, id: i64) -> Result<BlockId> {
        u32::try_from(id)
            .ok()
            .filter(|&b| b < self.num_blocks())
            .ok_or_else(|| invalid(format!("block id {id} is outside the pool")))
    }

    /// Reference count of a block.
    #[must_use]
    pub fn ref_cnt(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].ref_cnt
    }

    /// The cache key of a block, if it is cached.
    #[must_use]
    pub fn block_key(&self, id: BlockId) -> Option<CacheKey> {
        let k = self.blocks[id as usize].key;
        (k != NIL).then(|| self.map.entry(k).key)
    }

    /// The keys a block is cached under beside its primary key (vLLM's
    /// `cached_block_hashes_by_block[id]`: partial prompt-tail entries of a
    /// block that already had a key), in the order they were given. Empty when
    /// it has none.
    #[must_use]
    pub fn extra_keys(&self, id: BlockId) -> &[CacheKey] {
        if self.secondary.is_empty() {
            return &[];
        }
        self.secondary.get(&id).map_or(&[], Vec::as_slice)
    }

    /// The blocks that carry keys beside their primary key (the keys of
    /// vLLM's `cached_block_hashes_by_block`), in ascending id order.
    #[must_use]
    pub fn blocks_with_extra_keys(&self) -> Vec<BlockId> {
        let mut ids: Vec<BlockId> = self
            .secondary
            .iter()
            .filter(|(_, keys)| !keys.is_empty())
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Number of keys in the prefix map.
    #[must_use]
    pub fn num_cached_keys(&self) -> usize {
        self.map.len()
    }

    /// Every key of the prefix map with the blocks cached under it, in
    /// insertion order per key (vLLM's `cached_block_hash_to_block._cache`,
    /// read whole). Keys come in the map's own order, sorted by nothing a
    /// caller can rely on.
    #[must_use]
    pub fn cached_entries(&self) -> Vec<(CacheKey, Vec<BlockId>)> {
        self.map.iter().collect()
    }

    /// Whether a block is an eviction candidate (free but still cached) or plain
    /// free: ref 0 and not the null block.
    #[must_use]
    pub fn is_evictable(&self, id: BlockId) -> bool {
        id != NULL_BLOCK && self.blocks[id as usize].ref_cnt == 0
    }

    // ---- allocation -------------------------------------------------------

    /// Takes `n` blocks from the head of the free queue (under SLRU / ARC, the
    /// next ones the policy picks), evicting cached ones, and appends them to
    /// `out`. Returns `false` (and takes nothing) when fewer than `n` are free.
    pub fn get_new_blocks(&mut self, n: u32, out: &mut Vec<BlockId>) -> bool {
        if n > self.num_free_blocks() {
            return false;
        }
        let start = out.len();
        let from_second = if self.segments.is_some() {
            self.pop_segmented(n, out)
        } else {
            self.popleft_n(n, out);
            0..0
        };
        if !self.watched.is_empty() {
            for &id in &out[start..] {
                if self.watched.remove(&id) {
                    self.reused.push(id);
                }
            }
            dedupe_past_bound(&mut self.reused, self.blocks.len());
        }
        if self.enable_caching && n > 1 {
            // The evictions' entries, then their buckets, prefetched (the
            // blocks themselves were read by the pop), whatever the map's
            // size: between two calls the scheduler's own work leaves even a
            // small map out of the caches.
            let keyed = || {
                out[start..]
                    .iter()
                    .map(|&id| self.blocks[id as usize].key)
                    .filter(|&k| k != NIL)
            };
            keyed().for_each(|k| prefetch(self.map.entry(k)));
            keyed().for_each(|k| self.map.warm_bucket(&self.map.entry(k).key));
        }
        // The ring positions of the next ghosts to prefetch, per list.
        let mut ahead = self.ghost_positions();
        if self.segments.is_some() && self.enable_caching {
            for (i, &id) in out.iter().enumerate().skip(start).take(GHOSTS_AHEAD) {
                self.prefetch_ghost_of(id, from_second.contains(&i), &mut ahead);
            }
        }
        for (i, &id) in out.iter().enumerate().skip(start) {
            if self.enable_caching {
                if self.segments.is_some() {
                    if let Some(&id_ahead) = out.get(i + GHOSTS_AHEAD) {
                        let second = from_second.contains(&(i + GHOSTS_AHEAD));
                        self.prefetch_ghost_of(id_ahead, second, &mut ahead);
                    }
                    let ghost = self.ghost_for(from_second.contains(&i));
                    self.evict_recording(id, ghost);
                } else {
                    self.maybe_evict(id);
                }
            }
            self.blocks[id as usize].ref_cnt = 1;
            if let Some(m) = self.metrics.as_deref_mut() {
                m.stats.blocks_allocated += 1;
                m.log(BlockActivityKind::Allocated, id);
            }
        }
        if self.enable_caching {
            let single = (n == 1).then(|| out[start]);
            self.prefetch_next_pops(single);
        }
        true
    }

    /// Prefetches, one call ahead, what the next pops from the free queue
    /// touch: evicting the head reads its block (cached: the pop that made it
    /// the head wrote it), its prefix-map entry, then the bucket that entry's
    /// key lives in, and the pop rewrites the next block's link. Each line
    /// needs the one before it, so they are staged over two calls: a call
    /// that took the one block staged last time (`popped`, the common decode
    /// step) finds the head's entry and the next block cached, reads them
    /// and prefetches the head's bucket, the next block's entry and the
    /// block after it. A call that took several blocks only starts the
    /// stages that need no read (an admission never waits here); the first
    /// single pop after it reads the next block once, waiting for it.
    /// Under SLRU / ARC the head is that of the list the policy takes next
    /// ([`Self::next_out`]), and the block after it its successor there.
    fn prefetch_next_pops(&mut self, popped: Option<BlockId>) {
        let steady = popped.is_some_and(|b| b == self.staged_head);
        self.staged_head = NIL;
        let (next_out, second) = self.next_out();
        let Some(&head) = self.blocks.get(next_out as usize) else {
            return;
        };
        if head.key != NIL {
            let entry = self.map.entry(head.key);
            if steady {
                self.map.warm_bucket(&entry.key);
                self.prefetch_ghost_of(next_out, second, &mut self.ghost_positions());
            } else {
                prefetch(entry);
            }
        }
        let Some(next) = self.blocks.get(head.next as usize) else {
            return;
        };
        if popped.is_none() {
            prefetch(next);
            return;
        }
        let next = *next;
        if next.key != NIL {
            prefetch(self.map.entry(next.key));
        }
        if let Some(after) = self.blocks.get(next.next as usize) {
            prefetch(after);
        }
        self.staged_head = next_out;
    }

    /// Takes references on prefix-hit blocks, pulling eviction candidates out of
    /// the free queue. The null block is skipped. Under SLRU / ARC the cached
    /// ones count as reused.
    pub fn touch(&mut self, ids: &[BlockId]) {
        self.touch_for_copy(ids);
        if self.segments.is_some() {
            self.note_hits(ids);
        }
    }

    /// [`Self::touch`] for blocks held to be read or copied (a store to the
    /// host tier, a pinned page), not hit by a lookup: under SLRU / ARC they
    /// do not count as reused.
    pub fn touch_for_copy(&mut self, ids: &[BlockId]) {
        if ids.len() > 1 && self.blocks.len() * size_of::<Block>() > (2 << 20) {
            // The blocks, then the free-queue neighbours an unlink rewrites,
            // prefetched.
            for &id in ids {
                if let Some(b) = self.blocks.get(id as usize) {
                    prefetch(b);
                }
            }
            for &id in ids {
                let b = self.blocks[id as usize];
                if b.ref_cnt == 0 && id != NULL_BLOCK {
                    for x in [b.prev, b.next] {
                        if let Some(n) = self.blocks.get(x as usize) {
                            prefetch(n);
                        }
                    }
                }
            }
        }
        for &id in ids {
            if id == NULL_BLOCK {
                continue;
            }
            if self.blocks[id as usize].ref_cnt == 0 {
                self.unlink(id);
            }
            self.blocks[id as usize].ref_cnt += 1;
            if let Some(m) = self.metrics.as_deref_mut() {
                m.stats.blocks_accessed += 1;
                m.log(BlockActivityKind::Accessed, id);
            }
        }
    }

    /// One more reference to a block (a copy-on-write endpoint held until the
    /// copy has run); a free block leaves the free queue.
    pub fn add_ref(&mut self, id: BlockId) {
        if id == NULL_BLOCK {
            return;
        }
        if self.blocks[id as usize].ref_cnt == 0 {
            self.unlink(id);
        }
        self.blocks[id as usize].ref_cnt += 1;
    }

    /// Drops one reference from each block, given in eviction order (first =
    /// evicted first). Blocks reaching 0 go back to the free queue: with caching,
    /// unhashed ones to the front (reused first) and hashed ones to the back (LRU;
    /// SLRU / ARC: the back of their segment); without caching, all to the
    /// front. The null block is skipped.
    pub fn free_blocks(&mut self, ordered: impl IntoIterator<Item = BlockId>) {
        let mut first = std::mem::take(&mut self.scratch_first);
        let mut last = std::mem::take(&mut self.scratch_last);
        first.clear();
        last.clear();
        for id in ordered {
            if id == NULL_BLOCK {
                continue;
            }
            let b = &mut self.blocks[id as usize];
            b.ref_cnt -= 1;
            if b.ref_cnt == 0 {
                if b.key == NIL || !self.enable_caching {
                    first.push(id);
                } else {
                    last.push(id);
                }
            }
        }
        if self.segments.is_some() {
            self.free_segmented(&first, &last);
        } else {
            self.prepend_n(&first);
            self.append_n(&last);
        }
        self.scratch_first = first;
        self.scratch_last = last;
    }
}

#[cfg(test)]
mod tests;
