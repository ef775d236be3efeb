//! The pool's free queue: an intrusive doubly linked LRU list threaded through
//! the block arena (unlink, runs linked at either end, pops from the head) and
//! its read-outs.

use super::{Block, BlockId, BlockPool, NIL, NULL_BLOCK};

impl BlockPool {
    pub(super) fn unlink(&mut self, id: u32) {
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
}
