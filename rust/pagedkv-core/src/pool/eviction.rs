//! Device eviction beyond LRU: which free block [`BlockPool::get_new_blocks`]
//! hands out next, and so which cached key it evicts.
//!
//! [`Eviction::Lru`] (the default) is vLLM 0.33's single free queue, exactly.
//! The other policies change the order in which free blocks are handed out
//! and nothing else: hits on what is cached, reference counts, events,
//! stats and the pool's invariants are those of LRU.
//!
//! Both keep the free blocks in two intrusive lists threaded through the
//! same block links: the first is the pool's own queue (`head` / `tail`),
//! the second lives here. One bit per block marks it *reused*: hit by a
//! lookup ([`BlockPool::touch`], not [`BlockPool::touch_for_copy`]: host-tier
//! copies and pins are no hits) while cached, or (ARC) cached while held
//! under a key found in a ghost list. Only cached blocks carry the mark (a block
//! loses it with its cache key), and a free block is in the second list
//! exactly when it carries it, so the bit is also the block's list.
//!
//! - Freed blocks without a cache key go to the head of the first list, as
//!   one run in the order given (as vLLM puts them at the head of its
//!   queue): they are handed out before any cached block, since using them
//!   loses nothing. A free block that loses its key (`evict_blocks`, a
//!   reset) moves there too. Freed cached blocks go to the tail of the
//!   first list, or of the second once reused, each run keeping vLLM's
//!   order (a request's tail first). Blocks [`BlockPool::unpin`] releases
//!   go to a tail, keyed or not, as under LRU.
//! - [`Eviction::Slru`], segmented LRU: the first list is the probationary
//!   segment, the second the protected one. Blocks are handed out from the
//!   probationary head. The protected segment holds at most 80% of the free
//!   blocks: whenever it would hold more (blocks freed into it, free blocks
//!   taken), its oldest blocks are demoted to the probationary tail and lose
//!   their mark (a new hit brings it back). The hand-out order is therefore
//!   the probationary list, then the protected list. A reused prefix
//!   outlives a scan of one-off prompts while the scan's blocks fit in the
//!   probationary share (at least 1/5 of the free blocks).
//! - [`Eviction::Arc`], adaptive replacement over the free cached blocks:
//!   T1 (the first list: cached blocks not reused since cached) and T2 (the
//!   second: reused ones), a target `p` for T1's length in `0..=c` (`c`
//!   the pool's usable blocks), and ghost lists B1 / B2 of the keys last
//!   evicted from T1 / T2 (at most `c` each, in FIFO order; `ghosts`). A key
//!   becomes a ghost when an eviction takes it out of the cache (its last
//!   block), and the ghost stays in the prefix map's table, in the key's home
//!   bucket (`prefix_map::ghost_lanes`): recording it and finding it again
//!   read no line the eviction and the caching do not read already. A ghost
//!   is known by 31 bits of its key's hash, and is dropped early when its
//!   bucket has no lane for it or a key needs its lane. A block handed out
//!   comes from T1's head while T1 holds
//!   more than `p` blocks (or its head holds no key, or T2 is empty), else
//!   from T2's head. A key given to a block that B1 remembers grows `p` by
//!   `max(1, |B2| / |B1|)`; one B2 remembers shrinks it by
//!   `max(1, |B1| / |B2|)`; either way the block (if held, as it is when a
//!   request caches it) counts as reused. A reset forgets the ghosts and
//!   sets `p` to 0.
//!
//! With prefix caching off nothing is cached, so every policy hands blocks
//! out as LRU does: the pool keeps no segments then.
//!
//! Costs: O(1) per block taken, touched or freed (a demotion is paid for by
//! the promotion before it); blocks are taken in at most three runs, each
//! walked like LRU's; nothing is allocated per call (the ghost rings grow
//! to their bound once). Memory: one bit per block, and under ARC 8 bytes
//! per ghost in its ring and a prefix-map table sized for eight keys a
//! block (107 bytes a block, against 13). LRU pays one branch per call.

use std::ops::Range;

use super::free_queue::{link_run_in, unlink_in};
use super::ghosts::Ghosts;
use super::prefix_map::{GhostRecord, PrefixMap};
use super::{Block, BlockId, BlockPool, KEY_RESERVE, NIL, NULL_BLOCK};
pub use crate::spec::Eviction;

/// How many blocks ahead `get_new_blocks` prefetches the buckets of the
/// ghosts ARC forgets.
pub(super) const GHOSTS_AHEAD: usize = 8;

/// How many records ahead of the ghosts it prefetches it reads the rings.
const RING_AHEAD: usize = 32;

/// The protected segment's most share of the free blocks: 4/5.
const PROTECTED_NUM: u64 = 4;
const PROTECTED_DEN: u64 = 5;

/// The second list and the per-block marks of a policy other than LRU.
#[derive(Debug)]
pub(super) struct Segments {
    policy: Eviction,
    /// One bit per block: reused (a free block: in the second list).
    reused: Vec<u64>,
    head: u32,
    tail: u32,
    /// Blocks in the second list.
    len: u32,
    /// ARC's target length of T1.
    target: u32,
    /// The pool's usable blocks (`c`).
    capacity: u32,
    /// ARC's ghost lists (empty under SLRU).
    ghosts: Ghosts,
}

impl Segments {
    #[inline]
    fn is_reused(&self, id: BlockId) -> bool {
        self.reused[(id >> 6) as usize] >> (id & 63) & 1 != 0
    }

    #[inline]
    fn mark(&mut self, id: BlockId) {
        self.reused[(id >> 6) as usize] |= 1 << (id & 63);
    }

    #[inline]
    fn unmark(&mut self, id: BlockId) {
        self.reused[(id >> 6) as usize] &= !(1 << (id & 63));
    }

    /// The protected segment (SLRU) holds more than its share of `free`.
    #[inline]
    fn over_share(&self, free: u32) -> bool {
        self.len > 0
            && self.policy == Eviction::Slru
            && u64::from(self.len) * PROTECTED_DEN > u64::from(free) * PROTECTED_NUM
    }
}

/// Whether the next block comes from the second list, given the lists'
/// lengths, whether the first list's head holds no key (read only when it
/// decides), and ARC's target.
#[inline]
fn take_second(
    policy: Eviction,
    len0: u32,
    len1: u32,
    head_unkeyed: impl FnOnce() -> bool,
    target: u32,
) -> bool {
    if len1 == 0 {
        return false;
    }
    if len0 == 0 {
        return true;
    }
    policy == Eviction::Arc && len0 <= target && !head_unkeyed()
}

/// Pops blocks from the front of a list into `out`, at most `max`, while
/// `take(block, popped so far)` says so; how many it popped.
#[inline]
fn pop_front_while(
    blocks: &mut [Block],
    (head, tail): (&mut u32, &mut u32),
    max: u32,
    mut take: impl FnMut(&Block, u32) -> bool,
    out: &mut Vec<BlockId>,
) -> u32 {
    let mut cur = *head;
    let mut k = 0;
    while k < max && cur != NIL {
        let b = &mut blocks[cur as usize];
        if !take(b, k) {
            break;
        }
        let next = b.next;
        b.prev = NIL;
        b.next = NIL;
        out.push(cur);
        cur = next;
        k += 1;
    }
    if k > 0 {
        *head = cur;
        if cur == NIL {
            *tail = NIL;
        } else {
            blocks[cur as usize].prev = NIL;
        }
    }
    k
}

impl BlockPool {
    /// The pool handing out free blocks by `policy` (a pool built with
    /// caching off keeps LRU: nothing is cached). Call it on a fresh pool.
    ///
    /// - [`Eviction::Lru`]: vLLM's single free queue.
    /// - [`Eviction::Slru`]: cached blocks freed after a prefix hit
    ///   ([`Self::touch`]) join a protected segment of at most 4/5 of the free
    ///   blocks (its oldest demoted past that); blocks are handed out from the
    ///   probationary segment (the rest) first.
    /// - [`Eviction::Arc`]: T1 (free blocks cached once) and T2 (reused
    ///   ones); T1's head is handed out while T1 holds more than a target
    ///   `p`, else T2's; ghost lists of evicted keys move `p` when a key is
    ///   cached again.
    ///
    /// Under both, freed blocks holding no key are handed out first, runs keep
    /// vLLM's order within a list, and only the hand-out order differs from
    /// LRU.
    #[must_use]
    pub fn with_eviction(mut self, policy: Eviction) -> Self {
        if policy == Eviction::Lru || !self.enable_caching {
            self.segments = None;
            return self;
        }
        let n = self.blocks.len();
        let capacity = (n as u32).saturating_sub(1).max(1);
        if policy == Eviction::Arc && self.map.len() == 0 {
            // ARC's ghosts live in the map's table (up to two per block
            // beside the keys), sized so that they rarely find their bucket
            // full: a ghost dropped early changes ARC's course. On the
            // Mooncake trace, a table for three keys a block dropped 2.8 % of
            // the ghosts and cost 13 % of ARC's hits at 64 GiB; for eight,
            // its hits are within 2 % of exact ghost lists.
            if let Some(map) = PrefixMap::try_with_capacity(n.saturating_mul(8), n.min(KEY_RESERVE))
            {
                self.map = map;
            }
        }
        self.segments = Some(Box::new(Segments {
            policy,
            reused: vec![0; n.div_ceil(64)],
            head: NIL,
            tail: NIL,
            len: 0,
            target: 0,
            capacity,
            ghosts: if policy == Eviction::Arc {
                Ghosts::new(capacity)
            } else {
                Ghosts::default()
            },
        }));
        self
    }

    /// The policy in effect ([`Eviction::Lru`] with caching off).
    #[must_use]
    pub fn eviction(&self) -> Eviction {
        self.segments.as_ref().map_or(Eviction::Lru, |s| s.policy)
    }

    /// Free blocks in the first list (LRU's queue, SLRU's probationary
    /// segment, ARC's T1) and in the second (protected, T2; 0 under LRU).
    #[must_use]
    pub fn segment_lens(&self) -> (u32, u32) {
        let second = self.segments.as_ref().map_or(0, |s| s.len);
        (self.num_free - second, second)
    }

    /// ARC's target length of T1 (`None` under another policy).
    #[must_use]
    pub fn arc_target(&self) -> Option<u32> {
        self.segments
            .as_ref()
            .filter(|s| s.policy == Eviction::Arc)
            .map(|s| s.target)
    }

    /// Keys in ARC's ghost lists B1 and B2 (`[0, 0]` under another policy).
    #[must_use]
    pub fn ghost_lens(&self) -> [u32; 2] {
        self.map.ghost_lens()
    }

    /// Whether the block carries the reused mark (always `false` under LRU).
    #[must_use]
    pub fn is_reused(&self, id: BlockId) -> bool {
        self.segments
            .as_ref()
            .is_some_and(|s| (id as usize) < self.blocks.len() && s.is_reused(id))
    }

    /// Unlinks a free block from its list.
    pub(super) fn unlink_segmented(&mut self, id: BlockId) {
        let Some(seg) = self.segments.as_deref_mut() else {
            return;
        };
        if seg.is_reused(id) {
            unlink_in(&mut self.blocks, &mut seg.head, &mut seg.tail, id);
            seg.len -= 1;
        } else {
            unlink_in(&mut self.blocks, &mut self.head, &mut self.tail, id);
        }
        self.num_free -= 1;
        if seg.over_share(self.num_free) {
            self.demote();
        }
    }

    /// Marks the cached blocks among prefix hits (all held now) as reused.
    pub(super) fn note_hits(&mut self, ids: &[BlockId]) {
        let Some(seg) = self.segments.as_deref_mut() else {
            return;
        };
        for &id in ids {
            if id != NULL_BLOCK && self.blocks[id as usize].key != NIL {
                seg.mark(id);
            }
        }
    }

    /// Returns blocks that reached ref 0: `first` (no key) to the first
    /// list's head as one run, each of `last` to the tail of its list.
    pub(super) fn free_segmented(&mut self, first: &[BlockId], last: &[BlockId]) {
        let Some(seg) = self.segments.as_deref_mut() else {
            return;
        };
        if !first.is_empty() {
            link_run_in(&mut self.blocks, &mut self.head, &mut self.tail, first, NIL);
        }
        // Each block to the tail of its list, the links written as it goes.
        let (mut tail0, mut tail1) = (self.tail, seg.tail);
        for &id in last {
            let second = seg.is_reused(id);
            let tail = if second { &mut tail1 } else { &mut tail0 };
            self.blocks[id as usize].prev = *tail;
            if *tail == NIL {
                if second {
                    seg.head = id;
                } else {
                    self.head = id;
                }
            } else {
                self.blocks[*tail as usize].next = id;
            }
            *tail = id;
            seg.len += u32::from(second);
        }
        for t in [tail0, tail1] {
            if t != NIL {
                self.blocks[t as usize].next = NIL;
            }
        }
        self.tail = tail0;
        seg.tail = tail1;
        self.num_free += (first.len() + last.len()) as u32;
        if seg.over_share(self.num_free) {
            self.demote();
        }
    }

    /// Pops `n` blocks by the policy into `out` (caller checked `n <= free`):
    /// a run from the first list, one from the second, the rest from the
    /// first. Returns the positions in `out` of the blocks the second list
    /// gave (for ARC's ghosts, [`Self::record_ghost`]).
    pub(super) fn pop_segmented(&mut self, n: u32, out: &mut Vec<BlockId>) -> Range<usize> {
        let Some(seg) = self.segments.as_deref_mut() else {
            return 0..0;
        };
        let start = out.len();
        let (len0, len1) = (self.num_free - seg.len, seg.len);
        let first = if seg.policy == Eviction::Arc && len1 > 0 {
            let target = seg.target;
            pop_front_while(
                &mut self.blocks,
                (&mut self.head, &mut self.tail),
                n,
                |b, k| b.key == NIL || len0 - k > target,
                out,
            )
        } else {
            pop_front_while(
                &mut self.blocks,
                (&mut self.head, &mut self.tail),
                n,
                |_, _| true,
                out,
            )
        };
        let mut second = 0;
        if first < n {
            second = pop_front_while(
                &mut self.blocks,
                (&mut seg.head, &mut seg.tail),
                n - first,
                |_, _| true,
                out,
            );
            seg.len -= second;
            pop_front_while(
                &mut self.blocks,
                (&mut self.head, &mut self.tail),
                n - first - second,
                |_, _| true,
                out,
            );
        }
        self.num_free -= n;
        let from_t2 = start + first as usize..start + (first + second) as usize;
        if second > 0 {
            for &id in &out[from_t2.clone()] {
                seg.unmark(id);
            }
        }
        if seg.over_share(self.num_free) {
            self.demote();
        }
        from_t2
    }

    /// ARC: the list a block handed out (from T2 when `second`) records its
    /// key in when the eviction takes the key out of the cache, and the ring
    /// slot the record takes (`None` under another policy).
    #[inline]
    pub(super) fn ghost_for(&self, second: bool) -> Option<(usize, usize)> {
        let seg = self.segments.as_deref()?;
        let list = usize::from(second);
        (seg.policy == Eviction::Arc).then(|| (list, seg.ghosts.next_slot(list)))
    }

    /// ARC: a ghost was left in the map; its record joins its list's ring,
    /// and the ghost the ring forgets for it leaves the map.
    pub(super) fn push_ghost(&mut self, list: usize, r: GhostRecord) {
        if let Some(seg) = self.segments.as_deref_mut()
            && let Some(old) = seg.ghosts.push(list, r)
        {
            self.map.forget_ghost(old);
        }
    }

    /// ARC: the ring positions the next ghosts will be recorded at, per list
    /// (for [`Self::prefetch_ghost_of`]).
    pub(super) fn ghost_positions(&self) -> [usize; 2] {
        self.segments
            .as_deref()
            .map_or([0, 0], |seg| seg.ghosts.positions())
    }

    /// ARC: starts reading the bucket of the ghost that evicting block `id`
    /// (from the second list when `second`) will make its list forget, the
    /// one at ring position `at[list]` (counted up here, keyed blocks only).
    #[inline]
    pub(super) fn prefetch_ghost_of(&self, id: BlockId, second: bool, at: &mut [usize; 2]) {
        if self.blocks[id as usize].key == NIL {
            return;
        }
        if let Some(seg) = self.segments.as_deref()
            && seg.policy == Eviction::Arc
        {
            let list = usize::from(second);
            if let Some(r) = seg.ghosts.at_position(list, at[list]) {
                self.map.prefetch_ghost(r);
            }
            seg.ghosts.prefetch_position(list, at[list] + RING_AHEAD);
            at[list] += 1;
        }
    }

    /// The block the next one-block pop would hand out (`NIL` when none is
    /// free): the first list's head unless the policy takes the second's;
    /// and whether it is the second's.
    #[inline]
    pub(super) fn next_out(&self) -> (u32, bool) {
        let Some(seg) = self.segments.as_deref() else {
            return (self.head, false);
        };
        let (len0, len1) = (self.num_free - seg.len, seg.len);
        let unkeyed = || {
            self.blocks
                .get(self.head as usize)
                .is_none_or(|b| b.key == NIL)
        };
        if take_second(seg.policy, len0, len1, unkeyed, seg.target) {
            (seg.head, true)
        } else {
            (self.head, false)
        }
    }

    /// SLRU, the protected segment over its share of the free blocks:
    /// demotes its oldest blocks (unmarked, as one run to the probationary
    /// tail) until it is within it.
    #[inline(never)]
    fn demote(&mut self) {
        let Some(seg) = self.segments.as_deref_mut() else {
            return;
        };
        if !seg.over_share(self.num_free) {
            return;
        }
        let keep = (u64::from(self.num_free) * PROTECTED_NUM / PROTECTED_DEN) as u32;
        let first = seg.head;
        let mut last = first;
        seg.unmark(first);
        for _ in 1..seg.len - keep {
            last = self.blocks[last as usize].next;
            seg.unmark(last);
        }
        let rest = self.blocks[last as usize].next;
        seg.head = rest;
        if rest == NIL {
            seg.tail = NIL;
        } else {
            self.blocks[rest as usize].prev = NIL;
        }
        seg.len = keep;
        self.blocks[first as usize].prev = self.tail;
        self.blocks[last as usize].next = NIL;
        if self.tail == NIL {
            self.head = first;
        } else {
            self.blocks[self.tail as usize].next = first;
        }
        self.tail = last;
    }

    /// A block lost its (primary) key: it is no longer reused, and a free
    /// one moves to the first list's head (handed out before cached blocks).
    #[allow(clippy::inline_always)] // on every eviction: its fast path is a few loads
    #[inline(always)]
    pub(super) fn on_key_dropped(&mut self, id: BlockId) {
        let Some(seg) = self.segments.as_deref() else {
            return;
        };
        let b = &self.blocks[id as usize];
        // Blocks being handed out are free but in no list (and unmarked).
        let queued =
            b.ref_cnt == 0 && (b.prev != NIL || b.next != NIL || self.head == id || seg.head == id);
        if queued || seg.is_reused(id) {
            self.unmark_and_requeue(id, queued);
        }
    }

    fn unmark_and_requeue(&mut self, id: BlockId, queued: bool) {
        let Some(seg) = self.segments.as_deref_mut() else {
            return;
        };
        let second = seg.is_reused(id);
        seg.unmark(id);
        if !queued {
            return;
        }
        if second {
            unlink_in(&mut self.blocks, &mut seg.head, &mut seg.tail, id);
            seg.len -= 1;
        } else {
            unlink_in(&mut self.blocks, &mut self.head, &mut self.tail, id);
        }
        link_run_in(&mut self.blocks, &mut self.head, &mut self.tail, &[id], NIL);
    }

    /// A block got a primary key that was a ghost of `list` (its insertion
    /// took the ghost): ARC adapts its target and marks the block reused (a
    /// held block; a free one stays where it is, unmarked).
    #[inline]
    pub(super) fn on_ghost_hit(&mut self, id: BlockId, list: usize) {
        let Some(seg) = self.segments.as_deref_mut() else {
            return;
        };
        if seg.policy != Eviction::Arc {
            return;
        }
        // The lists' lengths after the hit: the hit list held one more.
        let [b1, b2] = self.map.ghost_lens();
        if list == 0 {
            let delta = (b2 / (b1 + 1)).max(1);
            seg.target = seg.target.saturating_add(delta).min(seg.capacity);
        } else {
            let delta = (b1 / (b2 + 1)).max(1);
            seg.target = seg.target.saturating_sub(delta);
        }
        if self.blocks[id as usize].ref_cnt > 0 {
            seg.mark(id);
        }
    }

    /// The cache was reset (every block free, none keyed): one list in the
    /// current hand-out order, no marks, no ghosts, ARC's target 0.
    pub(super) fn reset_segments(&mut self) {
        if self.segments.is_none() {
            return;
        }
        let order = self.free_queue();
        let Some(seg) = self.segments.as_deref_mut() else {
            return;
        };
        seg.reused.iter_mut().for_each(|w| *w = 0);
        seg.head = NIL;
        seg.tail = NIL;
        seg.len = 0;
        seg.target = 0;
        seg.ghosts.clear();
        self.head = NIL;
        self.tail = NIL;
        link_run_in(
            &mut self.blocks,
            &mut self.head,
            &mut self.tail,
            &order,
            NIL,
        );
    }

    /// Appends up to `limit` free blocks to `out` in the order
    /// [`Self::get_new_blocks`] would hand them out.
    pub(super) fn hand_out_order(&self, limit: usize, out: &mut Vec<BlockId>) {
        let Some(seg) = self.segments.as_deref() else {
            let mut cur = self.head;
            while cur != NIL && out.len() < limit {
                out.push(cur);
                cur = self.blocks[cur as usize].next;
            }
            return;
        };
        let (mut a, mut b) = (self.head, seg.head);
        let (mut len0, mut len1) = (self.num_free - seg.len, seg.len);
        while len0 + len1 > 0 && out.len() < limit {
            let unkeyed = || self.blocks.get(a as usize).is_none_or(|x| x.key == NIL);
            if take_second(seg.policy, len0, len1, unkeyed, seg.target) {
                out.push(b);
                b = self.blocks[b as usize].next;
                len1 -= 1;
            } else {
                out.push(a);
                a = self.blocks[a as usize].next;
                len0 -= 1;
            }
        }
    }

    /// A free block's neighbours in its list, the protected segment read as
    /// following the probationary one (SLRU's hand-out order).
    pub(super) fn segment_neighbors(&self, id: BlockId) -> (u32, u32) {
        let b = self.blocks[id as usize];
        let Some(seg) = self.segments.as_deref() else {
            return (b.prev, b.next);
        };
        if seg.policy != Eviction::Slru {
            return (b.prev, b.next);
        }
        let second = seg.is_reused(id);
        let prev = if second && b.prev == NIL {
            self.tail
        } else {
            b.prev
        };
        let next = if !second && b.next == NIL {
            seg.head
        } else {
            b.next
        };
        (prev, next)
    }

    /// The segments' invariants, given the blocks the first list's walk saw
    /// (marked in `seen`); how many blocks the second list holds.
    pub(super) fn check_segments(&self, seen: &mut [bool]) -> std::result::Result<u32, String> {
        let Some(seg) = self.segments.as_deref() else {
            return Ok(0);
        };
        for (i, &s) in seen.iter().enumerate() {
            if s && seg.is_reused(i as u32) {
                return Err(format!("block {i} is in the first list but marked reused"));
            }
        }
        let mut cur = seg.head;
        let mut prev = NIL;
        let mut count = 0u32;
        while cur != NIL {
            let i = cur as usize;
            if i >= seen.len() || cur == NULL_BLOCK {
                return Err(format!("second list links to block {cur}"));
            }
            if seen[i] {
                return Err(format!("block {cur} is in the free lists twice"));
            }
            seen[i] = true;
            if self.blocks[i].prev != prev {
                return Err(format!("block {cur} has a broken prev link"));
            }
            if !seg.is_reused(cur) {
                return Err(format!(
                    "block {i} is in the second list but not marked reused"
                ));
            }
            count += 1;
            prev = cur;
            cur = self.blocks[i].next;
        }
        if prev != seg.tail {
            return Err("second list tail is wrong".into());
        }
        if count != seg.len {
            return Err(format!("second list counts {} but holds {count}", seg.len));
        }
        if let Some(i) = (0..self.blocks.len() as u32)
            .find(|&i| seg.is_reused(i) && self.blocks[i as usize].key == NIL)
        {
            return Err(format!("block {i} is marked reused but holds no key"));
        }
        if seg.over_share(self.num_free) {
            return Err(format!(
                "protected segment holds {} of {} free blocks, past 4/5",
                seg.len, self.num_free
            ));
        }
        if seg.target > seg.capacity {
            return Err(format!("ARC target {} past {}", seg.target, seg.capacity));
        }
        if seg.policy != Eviction::Arc && self.map.ghost_lens() != [0, 0] {
            return Err("ghost keys outside ARC".into());
        }
        seg.ghosts.check(self.map.ghost_lens())?;
        Ok(count)
    }
}

#[cfg(test)]
mod tests;
