//! The pool's free queue: an intrusive doubly linked LRU list threaded through
//! the block arena (unlink, runs linked at either end, pops from the head) and
//! its read-outs.

use super::{Block, BlockId, BlockPool, NIL, NULL_BLOCK};

/// Unlinks `id` from the list whose ends are `head` and `tail` (the lists
/// of SLRU / ARC; LRU's queue keeps its own copy of these two, above).
#[inline]
pub(super) fn unlink_in(blocks: &mut [Block], head: &mut u32, tail: &mut u32, id: u32) {
    let Block { prev, next, .. } = blocks[id as usize];
    if prev == NIL {
        *head = next;
    } else {
        blocks[prev as usize].next = next;
    }
    if next == NIL {
        *tail = prev;
    } else {
        blocks[next as usize].prev = prev;
    }
    let b = &mut blocks[id as usize];
    b.prev = NIL;
    b.next = NIL;
}

/// Links a run of blocks (in order) after `after` (NIL = at the head) of the
/// list whose ends are `head` and `tail`.
#[inline]
pub(super) fn link_run_in(
    blocks: &mut [Block],
    head: &mut u32,
    tail: &mut u32,
    run: &[BlockId],
    after: u32,
) {
    let Some((&first, _)) = run.split_first() else {
        return;
    };
    let last = run[run.len() - 1];
    for w in run.windows(2) {
        blocks[w[0] as usize].next = w[1];
        blocks[w[1] as usize].prev = w[0];
    }
    let before = if after == NIL {
        *head
    } else {
        blocks[after as usize].next
    };
    blocks[first as usize].prev = after;
    blocks[last as usize].next = before;
    if after == NIL {
        *head = first;
    } else {
        blocks[after as usize].next = first;
    }
    if before == NIL {
        *tail = last;
    } else {
        blocks[before as usize].prev = last;
    }
}

impl BlockPool {
    pub(super) fn unlink(&mut self, id: u32) {
        if self.segments.is_some() {
            self.unlink_segmented(id);
            return;
        }
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
    pub(super) fn popleft_n(&mut self, n: u32, out: &mut Vec<BlockId>) {
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
    /// at either end); `None` for a block that is not in the queue. Under SLRU
    /// the protected segment follows the probationary one; under ARC these are
    /// the neighbours in the block's own list (T1 or T2).
    #[must_use]
    pub fn free_neighbors(&self, id: BlockId) -> Option<(Option<BlockId>, Option<BlockId>)> {
        let b = self.blocks.get(id as usize)?;
        if id == NULL_BLOCK || b.ref_cnt > 0 {
            return None;
        }
        let link = |x: u32| (x != NIL).then_some(x);
        let (prev, next) = self.segment_neighbors(id);
        Some((link(prev), link(next)))
    }

    /// The first and last blocks [`Self::get_new_blocks`] would hand out
    /// (`None` when none is free): the free queue's head and tail under LRU.
    #[must_use]
    pub fn free_queue_ends(&self) -> Option<(BlockId, BlockId)> {
        if self.segments.is_none() {
            return (self.head != NIL).then_some((self.head, self.tail));
        }
        let order = self.free_queue();
        Some((*order.first()?, *order.last()?))
    }

    /// The free blocks in the order [`Self::get_new_blocks`] would hand them
    /// out: the free queue from head to tail under LRU.
    #[must_use]
    pub fn free_queue(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free as usize);
        self.hand_out_order(self.blocks.len(), &mut out);
        out
    }

    /// The first `n` blocks of [`Self::free_queue`].
    #[must_use]
    pub fn free_queue_prefix(&self, n: usize) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(n.min(self.num_free as usize));
        self.hand_out_order(n, &mut out);
        out
    }
}
