//! The block pool: block arena, LRU free queue, prefix-cache map, KV events.
//!
//! Invariants (checked by [`BlockPool::check_invariants`]):
//! - block 0 is the null block: never queued, never cached, ref count meaningless;
//! - every other block is in the free queue exactly once iff its ref count is 0;
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

mod metrics;
mod prefix_map;

use metrics::PoolMetrics;
pub use metrics::{BlockActivity, BlockActivityKind, BlockPoolStats};
use prefix_map::PrefixMap;

/// Most per-key entries a pool reserves room for when it is built.
const KEY_RESERVE: usize = 1 << 20;

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

    // ---- free queue -------------------------------------------------------

    fn unlink(&mut self, id: u32) {
        let Block { prev, next, .. } = self.blocks[id as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = NIL;
        self.num_free -= 1;
    }

    /// Links a run of blocks (in order) after `after` (NIL = at the head).
    fn link_run(&mut self, run: &[BlockId], after: u32) {
        let Some((&first, _)) = run.split_first() else {
            return;
        };
        let last = run[run.len() - 1];
        for w in run.windows(2) {
            self.blocks[w[0] as usize].next = w[1];
            self.blocks[w[1] as usize].prev = w[0];
        }
        let before = if after == NIL {
            self.head
        } else {
            self.blocks[after as usize].next
        };
        self.blocks[first as usize].prev = after;
        self.blocks[last as usize].next = before;
        if after == NIL {
            self.head = first;
        } else {
            self.blocks[after as usize].next = first;
        }
        if before == NIL {
            self.tail = last;
        } else {
            self.blocks[before as usize].prev = last;
        }
        self.num_free += run.len() as u32;
    }

    /// Appends blocks, in order, at the tail of the free queue.
    pub(crate) fn append_n(&mut self, run: &[BlockId]) {
        let tail = self.tail;
        self.link_run(run, tail);
    }

    /// Inserts blocks, in order, at the head: popleft then yields them in order.
    pub(crate) fn prepend_n(&mut self, run: &[BlockId]) {
        self.link_run(run, NIL);
    }

    /// Pops `n` blocks from the head into `out` (caller checked `n <= free`).
    fn popleft_n(&mut self, n: u32, out: &mut Vec<BlockId>) {
        let mut cur = self.head;
        for _ in 0..n {
            let next = self.blocks[cur as usize].next;
            let b = &mut self.blocks[cur as usize];
            b.prev = NIL;
            b.next = NIL;
            out.push(cur);
            cur = next;
        }
        self.head = cur;
        if cur == NIL {
            self.tail = NIL;
        } else {
            self.blocks[cur as usize].prev = NIL;
        }
        self.num_free -= n;
    }

    /// A free block's neighbours in the free queue, `(previous, next)` (`None`
    /// at either end); `None` for a block that is not in the queue.
    #[must_use]
    pub fn free_neighbors(&self, id: BlockId) -> Option<(Option<BlockId>, Option<BlockId>)> {
        let b = self.blocks.get(id as usize)?;
        if id == NULL_BLOCK || b.ref_cnt > 0 {
            return None;
        }
        let link = |x: u32| (x != NIL).then_some(x);
        Some((link(b.prev), link(b.next)))
    }

    /// The head and tail of the free queue (`None` when it is empty).
    #[must_use]
    pub fn free_queue_ends(&self) -> Option<(BlockId, BlockId)> {
        (self.head != NIL).then_some((self.head, self.tail))
    }

    /// The free queue from head to tail.
    #[must_use]
    pub fn free_queue(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free as usize);
        let mut cur = self.head;
        while cur != NIL && out.len() <= self.blocks.len() {
            out.push(cur);
            cur = self.blocks[cur as usize].next;
        }
        out
    }

    // ---- allocation -------------------------------------------------------

    /// Takes `n` blocks from the head of the free queue, evicting cached ones, and
    /// appends them to `out`. Returns `false` (and takes nothing) when fewer than
    /// `n` are free.
    pub fn get_new_blocks(&mut self, n: u32, out: &mut Vec<BlockId>) -> bool {
        if n > self.num_free_blocks() {
            return false;
        }
        let start = out.len();
        self.popleft_n(n, out);
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
        for &id in &out[start..] {
            if self.enable_caching {
                self.maybe_evict(id);
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
    fn prefetch_next_pops(&mut self, popped: Option<BlockId>) {
        let steady = popped.is_some_and(|b| b == self.staged_head);
        self.staged_head = NIL;
        let Some(&head) = self.blocks.get(self.head as usize) else {
            return;
        };
        if head.key != NIL {
            let entry = self.map.entry(head.key);
            if steady {
                self.map.warm_bucket(&entry.key);
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
        self.staged_head = self.head;
    }

    /// Takes references on prefix-hit blocks, pulling eviction candidates out of
    /// the free queue. The null block is skipped.
    pub fn touch(&mut self, ids: &[BlockId]) {
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

    /// Drops one reference from each block while its contents stay readable
    /// until the pool reuses it (vLLM's `unpin_blocks`): a block reaching 0
    /// joins the tail of the free queue, cached or not, so it is taken last,
    /// and the block is watched: [`Self::take_reused`] lists it once
    /// [`Self::get_new_blocks`] hands it out or a reset wipes the cache. The
    /// null block is skipped; each block must be referenced (the caller checks).
    pub fn unpin(&mut self, ids: &[BlockId]) {
        let mut last = std::mem::take(&mut self.scratch_last);
        last.clear();
        for &id in ids {
            if id == NULL_BLOCK {
                continue;
            }
            let b = &mut self.blocks[id as usize];
            debug_assert!(b.ref_cnt > 0, "unpin of a free block {id}");
            b.ref_cnt -= 1;
            self.watched.insert(id);
            if b.ref_cnt == 0 {
                last.push(id);
            }
        }
        self.append_n(&last);
        self.scratch_last = last;
    }

    /// The watched blocks ([`Self::unpin`]) reused since the last call, in the
    /// order they were handed out; a reset lists every watched block. Left
    /// undrained, the list stays within [`PENDING_BLOCKS_PER_POOL_BLOCK`]
    /// entries a block: a block reused again then keeps its first listing only
    /// (nothing is lost: its watcher learns it was reused).
    pub fn take_reused(&mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.reused)
    }

    /// One more engine-held reference on `b` (the null block is skipped).
    pub(crate) fn engine_hold(&mut self, b: BlockId) {
        if b != NULL_BLOCK {
            *self.engine_refs.entry(b).or_insert(0) += 1;
        }
    }

    /// The references the engine holds on `b`.
    #[must_use]
    pub(crate) fn engine_refs_of(&self, b: BlockId) -> u32 {
        self.engine_refs.get(&b).copied().unwrap_or(0)
    }

    /// Drops one engine-held reference on `b`; `false` (nothing changed) when
    /// the engine holds none.
    pub(crate) fn engine_release_one(&mut self, b: BlockId) -> bool {
        match self.engine_refs.get_mut(&b) {
            Some(1) => {
                self.engine_refs.remove(&b);
                true
            }
            Some(n) => {
                *n -= 1;
                true
            }
            None => false,
        }
    }

    /// Every engine-held reference, per block.
    pub(crate) fn engine_refs(&self) -> impl Iterator<Item = (BlockId, u32)> + '_ {
        self.engine_refs.iter().map(|(&b, &n)| (b, n))
    }

    /// Drops the engine's references on `ids` (as often as each is listed;
    /// null blocks skipped), or refuses with nothing changed when it holds
    /// fewer. Ref counts are the caller's to drop.
    pub(crate) fn engine_release(&mut self, ids: &[BlockId], verb: &str) -> Result<()> {
        let mut want: rustc_hash::FxHashMap<BlockId, u32> = rustc_hash::FxHashMap::default();
        for &b in ids {
            if b != NULL_BLOCK {
                *want.entry(b).or_insert(0) += 1;
            }
        }
        if let Some((&b, &n)) = want
            .iter()
            .find(|&(b, &n)| self.engine_refs.get(b).is_none_or(|&held| held < n))
        {
            return Err(invalid(format!(
                "block {b} is {verb} {n} time(s) but the engine holds only {} reference(s) \
                 (from pop_blocks_for_free, get_new_blocks or touch_blocks)",
                self.engine_refs_of(b)
            )));
        }
        for (b, n) in want {
            let held = self.engine_refs.get_mut(&b).map_or(0, |h| {
                *h -= n;
                *h
            });
            if held == 0 {
                self.engine_refs.remove(&b);
            }
        }
        Ok(())
    }

    /// Whether any block is watched or reported reused and not yet taken.
    #[must_use]
    pub fn watches_blocks(&self) -> bool {
        !self.watched.is_empty() || !self.reused.is_empty()
    }

    /// Drops one reference from each block, given in eviction order (first =
    /// evicted first). Blocks reaching 0 go back to the free queue: with caching,
    /// unhashed ones to the front (reused first) and hashed ones to the back (LRU);
    /// without caching, all to the front. The null block is skipped.
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
        self.prepend_n(&first);
        self.append_n(&last);
        self.scratch_first = first;
        self.scratch_last = last;
    }

    // ---- prefix map -------------------------------------------------------

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
            let e = self.map.insert(key, id, tokens, self.next_stamp);
            self.blocks[id as usize].key = e;
            self.next_stamp += 1;
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
    fn remove_block_hashes(&mut self, id: BlockId) -> usize {
        let slot = self.blocks[id as usize].key;
        if slot == NIL {
            // Extra keys only exist beside a primary key.
            return 0;
        }
        self.blocks[id as usize].key = NIL;
        let key = self.map.entry(slot).key;
        let mut removed = usize::from(self.pop_and_report(key, id));
        if !self.secondary.is_empty()
            && let Some(extra) = self.secondary.remove(&id)
        {
            for key in extra {
                removed += usize::from(self.pop_and_report(key, id));
            }
        }
        if removed > 0 {
            self.epoch += 1;
        }
        removed
    }

    fn pop_and_report(&mut self, key: CacheKey, id: BlockId) -> bool {
        let popped = self.map.remove(&key, id);
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

    /// Caches a block that just became full (`tokens` = the prefix it ends). A
    /// partial entry it carried is replaced (promotion, with `BlockRemoved`).
    pub fn cache_full_block(&mut self, id: BlockId, key: CacheKey, tokens: u32) -> bool {
        if id == NULL_BLOCK {
            return false;
        }
        if self.blocks[id as usize].key != NIL && self.block_key(id) != Some(key) {
            self.remove_block_hashes(id);
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
            self.remove_block_hashes(id);
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
        self.remove_block_hashes(id);
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
        let evicted = self.remove_block_hashes(id) > 0;
        if let Some(m) = self.metrics.as_deref_mut() {
            m.stats.blocks_evicted += u64::from(evicted);
            m.log(BlockActivityKind::Evicted, id);
        }
        evicted
    }

    /// Clears the prefix cache when no block is in use (only the null block);
    /// returns `false` and changes nothing otherwise.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_free_blocks() as usize != self.blocks.len() - 1 {
            return false;
        }
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

    // ---- events -----------------------------------------------------------

    /// Whether events are recorded.
    #[must_use]
    pub fn events_enabled(&self) -> bool {
        self.events_enabled
    }

    /// Records an event (no-op when events are off).
    pub fn push_event(&mut self, ev: KvEvent) {
        if self.events_enabled {
            self.record_event(ev);
        }
    }

    /// Queues an event, dropping the oldest quarter when the queue is full.
    fn record_event(&mut self, ev: KvEvent) {
        self.dropped_events += drop_oldest(&mut self.events, self.max_pending_events);
        self.events.push(ev);
    }

    /// Caps the undrained events and block activity entries (each at least 1).
    #[must_use]
    pub fn with_pending_caps(mut self, events: u64, activity: u64) -> Self {
        self.max_pending_events = usize::try_from(events).unwrap_or(usize::MAX).max(1);
        if let Some(m) = self.metrics.as_deref_mut() {
            m.cap = usize::try_from(activity).unwrap_or(usize::MAX).max(1);
        }
        self
    }

    /// Events dropped (oldest first) because they were not drained in time.
    #[must_use]
    pub fn num_dropped_events(&self) -> u64 {
        self.dropped_events
    }

    /// Block activity entries dropped (oldest first) because they were not
    /// drained in time.
    #[must_use]
    pub fn num_dropped_block_activity(&self) -> u64 {
        self.metrics.as_ref().map_or(0, |m| m.dropped)
    }

    /// Events recorded and not yet drained.
    #[must_use]
    pub fn num_pending_events(&self) -> usize {
        self.events.len()
    }

    /// Drains the recorded events.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    // ---- metrics ----------------------------------------------------------

    /// The block counters; `None` unless built [`BlockPool::with_metrics`].
    #[must_use]
    pub fn stats(&self) -> Option<BlockPoolStats> {
        self.metrics.as_ref().map(|m| m.stats)
    }

    /// Drains the block activity log, oldest first (empty without metrics). It
    /// keeps at most its cap undrained, like the event queue.
    pub fn take_block_activity(&mut self) -> Vec<BlockActivity> {
        self.metrics
            .as_deref_mut()
            .map(|m| std::mem::take(&mut m.activity))
            .unwrap_or_default()
    }

    // ---- invariants -------------------------------------------------------

    /// Checks the pool's structural invariants; `expected_refs` (if given) are the
    /// reference counts implied by the holders of blocks.
    ///
    /// # Errors
    /// A description of the first violated invariant.
    pub fn check_invariants(&self, expected_refs: Option<&[u32]>) -> Result<()> {
        self.first_violation(expected_refs)
            .map_err(Error::InvariantViolation)
    }

    fn first_violation(&self, expected_refs: Option<&[u32]>) -> std::result::Result<(), String> {
        let n = self.blocks.len();
        let mut seen = vec![false; n];
        let mut cur = self.head;
        let mut prev = NIL;
        let mut count = 0u32;
        while cur != NIL {
            let i = cur as usize;
            if i >= n {
                return Err(format!("free queue links to out-of-range block {cur}"));
            }
            if cur == NULL_BLOCK {
                return Err("null block is in the free queue".into());
            }
            if seen[i] {
                return Err(format!("block {cur} is in the free queue twice"));
            }
            seen[i] = true;
            if self.blocks[i].prev != prev {
                return Err(format!("block {cur} has a broken prev link"));
            }
            if self.blocks[i].ref_cnt != 0 {
                return Err(format!(
                    "block {cur} is free with ref_cnt {}",
                    self.blocks[i].ref_cnt
                ));
            }
            count += 1;
            prev = cur;
            cur = self.blocks[i].next;
        }
        if prev != self.tail {
            return Err("free queue tail is wrong".into());
        }
        if count != self.num_free {
            return Err(format!(
                "free count {} but queue holds {count}",
                self.num_free
            ));
        }
        for (i, b) in self.blocks.iter().enumerate().skip(1) {
            if b.ref_cnt == 0 && !seen[i] {
                return Err(format!("block {i} has ref_cnt 0 but is not free"));
            }
            if let Some(exp) = expected_refs
                && exp[i] != b.ref_cnt
            {
                return Err(format!(
                    "block {i} has ref_cnt {} but {} holders",
                    b.ref_cnt, exp[i]
                ));
            }
        }
        if self.blocks[0].key != NIL {
            return Err("null block is cached".into());
        }
        self.map.check()?;
        let mut listed = 0usize;
        for (key, ids) in self.map.iter() {
            for id in ids {
                listed += 1;
                let extra = self.secondary.get(&id).is_some_and(|v| v.contains(&key));
                if self.block_key(id) != Some(key) && !extra {
                    return Err(format!(
                        "map lists block {id} under a key it does not carry"
                    ));
                }
            }
        }
        let carrying = self.blocks.iter().filter(|b| b.key != NIL).count()
            + self.secondary.values().map(Vec::len).sum::<usize>();
        if carrying != listed {
            return Err(format!(
                "{carrying} blocks carry keys but the map lists {listed}"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
