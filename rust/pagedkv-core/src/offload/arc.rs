//! ARC (vLLM 0.33 `cpu/policies/arc.py`): T1 (seen once) and T2 (reused), their
//! ghost lists B1 / B2, and the adaptive target size of T1.
//!
//! New chunks enter T1; a request's reuse of a ready chunk moves it to T2 once,
//! when the request ends; storing is not reuse. A store miss or touch of a ghost
//! adapts the target (B1 grows it, B2 shrinks it). Eviction takes from T1 while
//! T1 is at or above the target, from T2 otherwise, and falls back to T1.
//!
//! Layout, for a tier of millions of chunks: every key the policy knows
//! (resident or ghost) is one node of a slab, found through a table of 4-byte
//! node numbers hashed by the key's digest, and linked into one of the four
//! lists; a key moving between lists (T1 → T2, evicted to a ghost list, a ghost
//! stored again) keeps its node and its table entry.

use super::keys::OffloadKey;
use super::policy::Protected;
use super::requests::{INSERTED, REUSED};
use super::slab::{Keyed, Slab};
use super::slots::Chunk;

/// One of ARC's lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum List {
    /// Resident, seen once.
    T1 = 0,
    /// Resident, reused.
    T2 = 1,
    /// Evicted from T1 (a ghost).
    B1 = 2,
    /// Evicted from T2 (a ghost).
    B2 = 3,
}

const NIL: u32 = u32::MAX;

#[derive(Clone, Debug)]
struct Node {
    key: OffloadKey,
    /// The chunk (resident lists only).
    chunk: Chunk,
    prev: u32,
    next: u32,
    list: List,
}

impl Keyed for Node {
    fn key(&self) -> &OffloadKey {
        &self.key
    }
}

#[derive(Clone, Copy, Debug)]
struct Ends {
    head: u32,
    tail: u32,
    len: usize,
}

const EMPTY: Ends = Ends {
    head: NIL,
    tail: NIL,
    len: 0,
};

/// The ARC policy's state.
#[derive(Clone, Debug)]
pub struct Arc {
    capacity: u64,
    pub(super) target_t1_size: f64,
    /// Every key in a list.
    slab: Slab<Node>,
    lists: [Ends; 4],
}

impl Arc {
    pub(super) fn new(capacity: u64) -> Self {
        Self {
            capacity,
            target_t1_size: 0.0,
            slab: Slab::default(),
            lists: [EMPTY; 4],
        }
    }

    fn find(&self, key: &OffloadKey) -> Option<usize> {
        self.slab.find(key)
    }

    fn len_of(&self, list: List) -> usize {
        self.lists[list as usize].len
    }

    pub(super) fn len(&self) -> usize {
        self.len_of(List::T1) + self.len_of(List::T2)
    }

    /// The list holding `key`, if any.
    #[cfg(test)]
    pub(super) fn list_of(&self, key: &OffloadKey) -> Option<List> {
        self.find(key).map(|i| self.slab.nodes[i].list)
    }

    fn resident(&self, key: &OffloadKey) -> Option<usize> {
        self.find(key)
            .filter(|&i| matches!(self.slab.nodes[i].list, List::T1 | List::T2))
    }

    pub(super) fn get(&self, key: &OffloadKey) -> Option<&Chunk> {
        self.resident(key).map(|i| &self.slab.nodes[i].chunk)
    }

    pub(super) fn get_mut(&mut self, key: &OffloadKey) -> Option<&mut Chunk> {
        self.resident(key).map(|i| &mut self.slab.nodes[i].chunk)
    }

    fn detach(&mut self, i: usize) {
        let (prev, next, list) = {
            let n = &self.slab.nodes[i];
            (n.prev, n.next, n.list as usize)
        };
        match prev {
            NIL => self.lists[list].head = next,
            p => self.slab.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.lists[list].tail = prev,
            n => self.slab.nodes[n as usize].prev = prev,
        }
        self.lists[list].len -= 1;
    }

    fn attach_back(&mut self, i: usize, list: List) {
        let ends = &mut self.lists[list as usize];
        let tail = ends.tail;
        ends.tail = i as u32;
        if tail == NIL {
            ends.head = i as u32;
        }
        ends.len += 1;
        if tail != NIL {
            self.slab.nodes[tail as usize].next = i as u32;
        }
        let n = &mut self.slab.nodes[i];
        n.prev = tail;
        n.next = NIL;
        n.list = list;
    }

    /// Moves a node to the back of `list` (its own list or another).
    fn move_back(&mut self, i: usize, list: List) {
        self.detach(i);
        self.attach_back(i, list);
    }

    /// Drops a node from its list and the index; the node is reused.
    fn drop_node(&mut self, i: usize) {
        self.detach(i);
        self.slab.unindex(i);
        self.slab.release(i);
    }

    pub(super) fn insert(&mut self, key: OffloadKey, chunk: Chunk) {
        if let Some(i) = self.find(&key) {
            // a ghost stored again (a resident key is never offered for storing)
            self.slab.nodes[i].chunk = chunk;
            self.move_back(i, List::T1);
            return;
        }
        let node = Node {
            key,
            chunk,
            prev: NIL,
            next: NIL,
            list: List::T1,
        };
        let i = self.slab.insert(node);
        self.attach_back(i, List::T1);
    }

    pub(super) fn remove(&mut self, key: &OffloadKey) {
        if let Some(i) = self.resident(key) {
            self.drop_node(i);
        }
    }

    /// A ghost hit moves the target (B1 up, B2 down) and refreshes the ghost.
    fn adapt_to_ghost_hit(&mut self, i: usize) {
        let (b1, b2) = (self.len_of(List::B1) as f64, self.len_of(List::B2) as f64);
        match self.slab.nodes[i].list {
            List::B1 => {
                let delta = (b2 / b1).max(1.0);
                self.target_t1_size = (self.target_t1_size + delta).min(self.capacity as f64);
                self.move_back(i, List::B1);
            }
            List::B2 => {
                let delta = (b1 / b2).max(1.0);
                self.target_t1_size = (self.target_t1_size - delta).max(0.0);
                self.move_back(i, List::B2);
            }
            List::T1 | List::T2 => {}
        }
    }

    pub(super) fn on_store_miss(&mut self, keys: &[OffloadKey]) {
        for key in keys.iter().rev() {
            if let Some(i) = self.find(key) {
                self.adapt_to_ghost_hit(i);
            }
        }
    }

    pub(super) fn touch(&mut self, keys: &[OffloadKey]) {
        for key in keys.iter().rev() {
            let Some(i) = self.find(key) else { continue };
            match self.slab.nodes[i].list {
                // only just prepared for storing: not a second use
                List::T1 if !self.slab.nodes[i].chunk.is_ready() => self.move_back(i, List::T1),
                List::T1 | List::T2 => self.move_back(i, List::T2),
                List::B1 | List::B2 => self.adapt_to_ghost_hit(i),
            }
        }
    }

    pub(super) fn on_request_finished(&mut self, ordered: &[(OffloadKey, u8)]) {
        for (key, flags) in ordered.iter().rev() {
            let reused = flags & REUSED != 0;
            let Some(i) = self.resident(key) else {
                continue;
            };
            if flags & INSERTED != 0 && !reused {
                // a store is not a frequency hit: T1 membership kept, recency restored
                let list = self.slab.nodes[i].list;
                self.move_back(i, list);
            } else if reused {
                self.move_back(i, List::T2);
            }
        }
    }

    pub(super) fn clear(&mut self) {
        self.slab.clear();
        self.lists = [EMPTY; 4];
        self.target_t1_size = 0.0;
    }

    /// The nodes of `list`, front (oldest) first.
    fn walk(&self, list: List) -> impl Iterator<Item = usize> + '_ {
        let mut at = self.lists[list as usize].head;
        std::iter::from_fn(move || {
            if at == NIL {
                return None;
            }
            let i = at as usize;
            at = self.slab.nodes[i].next;
            Some(i)
        })
    }

    /// ARC's choice of `n` idle chunks not in `protected` as (node, from
    /// T1), each list scanned once; `None` when fewer than `n` can go.
    fn select(&self, n: usize, protected: &Protected<'_>) -> Option<Vec<(usize, bool)>> {
        let idle = |&i: &usize| {
            let node = &self.slab.nodes[i];
            node.chunk.ref_cnt == 0 && !protected.contains(&node.key)
        };
        let mut t1 = self.walk(List::T1).filter(idle);
        let mut t2 = self.walk(List::T2).filter(idle);
        let mut picked: Vec<(usize, bool)> = Vec::with_capacity(n);
        let mut virtual_t1 = self.len_of(List::T1);
        // Python's int() of the non-negative target
        let target = self.target_t1_size.trunc() as usize;
        for _ in 0..n {
            let mut pick = None;
            if virtual_t1 >= target
                && let Some(i) = t1.next()
            {
                pick = Some((i, true));
                virtual_t1 -= 1;
            }
            if pick.is_none()
                && let Some(i) = t2.next()
            {
                pick = Some((i, false));
            }
            if pick.is_none() {
                let i = t1.next()?;
                pick = Some((i, true));
                virtual_t1 -= 1;
            }
            picked.push(pick.expect("set above"));
        }
        Some(picked)
    }

    pub(super) fn evict(
        &mut self,
        n: usize,
        protected: &Protected<'_>,
    ) -> Option<Vec<(OffloadKey, Chunk)>> {
        let picked = self.select(n, protected)?;
        let mut out = Vec::with_capacity(n);
        for (i, from_t1) in picked {
            let node = &self.slab.nodes[i];
            out.push((node.key, node.chunk));
            self.move_back(i, if from_t1 { List::B1 } else { List::B2 });
        }
        for ghost in [List::B1, List::B2] {
            while self.len_of(ghost) as u64 > self.capacity {
                let front = self.lists[ghost as usize].head as usize;
                self.drop_node(front);
            }
        }
        Some(out)
    }

    /// The resident keys of `list` (T1 or T2) with their chunks, oldest first.
    pub(super) fn chunks_of(&self, list: List) -> impl Iterator<Item = (&OffloadKey, &Chunk)> {
        self.walk(list)
            .map(|i| (&self.slab.nodes[i].key, &self.slab.nodes[i].chunk))
    }

    /// The keys of `list`, oldest first.
    pub(super) fn keys_of(&self, list: List) -> impl Iterator<Item = &OffloadKey> {
        self.walk(list).map(|i| &self.slab.nodes[i].key)
    }

    /// Resident keys with their chunks, T1 then T2, each oldest first.
    pub(super) fn entries(&self) -> impl Iterator<Item = (&OffloadKey, &Chunk)> {
        self.chunks_of(List::T1).chain(self.chunks_of(List::T2))
    }

    pub(super) fn check(&self) -> Result<(), String> {
        let mut linked = 0;
        for list in [List::T1, List::T2, List::B1, List::B2] {
            let mut prev = NIL;
            let mut count = 0;
            for i in self.walk(list) {
                let node = &self.slab.nodes[i];
                if node.list != list || node.prev != prev {
                    return Err(format!("ARC: {:?} is mislinked in {list:?}", node.key));
                }
                if self.find(&node.key) != Some(i) {
                    return Err(format!("ARC: {:?} is not indexed", node.key));
                }
                prev = i as u32;
                count += 1;
                if count > self.slab.nodes.len() {
                    return Err(format!("ARC: {list:?} loops"));
                }
            }
            if count != self.len_of(list) || prev != self.lists[list as usize].tail {
                return Err(format!(
                    "ARC: {list:?} links {count} nodes, counts {}",
                    self.len_of(list)
                ));
            }
            if matches!(list, List::B1 | List::B2) && count as u64 > self.capacity {
                return Err(format!(
                    "ARC: {list:?} holds {count} > capacity {}",
                    self.capacity
                ));
            }
            linked += count;
        }
        let free = self.slab.free().len();
        if linked != self.slab.len() || linked + free != self.slab.nodes.len() {
            return Err(format!(
                "ARC: {linked} linked, {} indexed, {free} free of {} nodes",
                self.slab.len(),
                self.slab.nodes.len()
            ));
        }
        if !(0.0..=self.capacity as f64).contains(&self.target_t1_size) {
            return Err(format!(
                "ARC: target {} outside 0..={}",
                self.target_t1_size, self.capacity
            ));
        }
        Ok(())
    }
}
