//! LRU with request-scoped recency (vLLM 0.33 `cpu/policies/lru.py`).
//!
//! Every chunk has a rank `(major, minor)`; the evictable chunks are taken in
//! rank order (ties by key bytes). A chunk stored or touched outside a request's
//! positions gets a fresh major rank; a request shares one major rank across its
//! batches and orders its chunks by `-position`, so a request's tail is evicted
//! before its head; `touch` and the request's end commit recency, the last key
//! of the list first. The evictable chunks sit in a min-heap invalidated
//! lazily, as vLLM keeps them: a new rank pushes a new entry, an entry whose
//! rank is no longer its chunk's (or whose chunk is pinned) is skipped, and the
//! heap is rebuilt once stale entries outnumber live ones.
//!
//! Layout, for a tier of millions of chunks: each chunk is a node of a slab,
//! found through a table of 4-byte node numbers hashed by the key's digest; the
//! heap is 4-ary and holds 24-byte entries (a rank and a node number), so a pop
//! walks half the levels of a binary heap and reads a third of the bytes a
//! level. A heap entry compares by rank, then by its node's key: a node whose
//! chunk left is reused only once no heap entry names it, so an entry's key
//! never changes under it.

use rustc_hash::FxHashSet;

use super::keys::OffloadKey;
use super::policy::Protected;
use super::requests::RankSlot;
use super::slab::{Keyed, Slab};
use super::slots::Chunk;

type Rank = (u64, i64);

/// Children of a heap node.
const ARITY: usize = 4;

#[derive(Clone, Debug)]
struct Node {
    key: OffloadKey,
    chunk: Chunk,
    rank: Rank,
    evictable: bool,
    /// Whether the node holds a resident chunk.
    live: bool,
    /// Heap entries naming the node.
    refs: u32,
}

impl Keyed for Node {
    fn key(&self) -> &OffloadKey {
        &self.key
    }
}

#[derive(Clone, Copy, Debug)]
struct HeapEntry {
    rank: Rank,
    node: u32,
}

/// The LRU policy's state.
#[derive(Clone, Debug, Default)]
pub struct Lru {
    /// Resident chunks (indexed) and left ones still named by heap entries;
    /// a node is free once neither.
    slab: Slab<Node>,
    /// Evictable chunks (and stale entries), a 4-ary min-heap by rank, then key.
    heap: Vec<HeapEntry>,
    num_evictable: usize,
    next_rank: u64,
}

fn less(nodes: &[Node], a: &HeapEntry, b: &HeapEntry) -> bool {
    match a.rank.cmp(&b.rank) {
        std::cmp::Ordering::Equal => nodes[a.node as usize].key < nodes[b.node as usize].key,
        o => o.is_lt(),
    }
}

fn sift_up(heap: &mut [HeapEntry], nodes: &[Node], mut i: usize) {
    let e = heap[i];
    while i > 0 {
        let parent = (i - 1) / ARITY;
        if !less(nodes, &e, &heap[parent]) {
            break;
        }
        heap[i] = heap[parent];
        i = parent;
    }
    heap[i] = e;
}

fn sift_down(heap: &mut [HeapEntry], nodes: &[Node], mut i: usize) {
    let e = heap[i];
    let n = heap.len();
    loop {
        let first = ARITY * i + 1;
        if first >= n {
            break;
        }
        let mut min = first;
        for c in first + 1..(first + ARITY).min(n) {
            if less(nodes, &heap[c], &heap[min]) {
                min = c;
            }
        }
        if !less(nodes, &heap[min], &e) {
            break;
        }
        heap[i] = heap[min];
        i = min;
    }
    heap[i] = e;
}

impl Lru {
    pub(super) fn len(&self) -> usize {
        self.slab.len()
    }

    fn find(&self, key: &OffloadKey) -> Option<usize> {
        self.slab.find(key)
    }

    pub(super) fn get(&self, key: &OffloadKey) -> Option<&Chunk> {
        self.find(key).map(|i| &self.slab.nodes[i].chunk)
    }

    pub(super) fn get_mut(&mut self, key: &OffloadKey) -> Option<&mut Chunk> {
        self.find(key).map(|i| &mut self.slab.nodes[i].chunk)
    }

    fn fresh_rank(&mut self) -> Rank {
        self.next_rank += 1;
        (self.next_rank, 0)
    }

    /// The request's shared major rank, drawn the first time it is needed.
    fn request_rank(&mut self, slot: &mut RankSlot) -> u64 {
        if let Some(rank) = slot.get() {
            return rank;
        }
        self.next_rank += 1;
        slot.set(self.next_rank);
        self.next_rank
    }

    fn set_rank(&mut self, node: usize, rank: Rank) {
        let n = &mut self.slab.nodes[node];
        n.rank = rank;
        if n.evictable {
            self.push(rank, node);
        }
    }

    fn push(&mut self, rank: Rank, node: usize) {
        self.slab.nodes[node].refs += 1;
        self.heap.push(HeapEntry {
            rank,
            node: node as u32,
        });
        let last = self.heap.len() - 1;
        sift_up(&mut self.heap, &self.slab.nodes, last);
        self.maybe_compact();
    }

    fn pop(&mut self) -> Option<HeapEntry> {
        let last = self.heap.pop()?;
        let top = if self.heap.is_empty() {
            last
        } else {
            let top = std::mem::replace(&mut self.heap[0], last);
            sift_down(&mut self.heap, &self.slab.nodes, 0);
            top
        };
        self.release_entry(top.node as usize);
        Some(top)
    }

    /// An entry naming `node` left the heap: a node whose chunk left is free
    /// once no entry names it.
    fn release_entry(&mut self, node: usize) {
        let n = &mut self.slab.nodes[node];
        n.refs -= 1;
        if n.refs == 0 && !n.live {
            self.slab.release(node);
        }
    }

    /// Puts back entries popped and not taken.
    fn restore(&mut self, entries: Vec<HeapEntry>) {
        for e in entries {
            self.slab.nodes[e.node as usize].refs += 1;
            self.heap.push(e);
            let last = self.heap.len() - 1;
            sift_up(&mut self.heap, &self.slab.nodes, last);
        }
    }

    /// Rebuilds the heap from the live entries once it holds more stale ones
    /// than live ones (and at least as many entries as resident chunks, so a
    /// rebuild's cost is spread over as many pushes).
    fn maybe_compact(&mut self) {
        let limit = 64.max(2 * self.num_evictable).max(self.len());
        if self.heap.len() < limit {
            return;
        }
        self.heap.clear();
        let mut released = Vec::new();
        for (i, n) in self.slab.nodes.iter_mut().enumerate() {
            if !n.live && n.refs > 0 {
                released.push(i);
            }
            n.refs = u32::from(n.live && n.evictable);
            if n.refs == 1 {
                self.heap.push(HeapEntry {
                    rank: n.rank,
                    node: i as u32,
                });
            }
        }
        for i in released {
            self.slab.release(i);
        }
        for i in (0..=self.heap.len() / ARITY).rev() {
            if i < self.heap.len() {
                sift_down(&mut self.heap, &self.slab.nodes, i);
            }
        }
    }

    fn is_current(&self, e: &HeapEntry) -> bool {
        let n = &self.slab.nodes[e.node as usize];
        n.live && n.evictable && n.rank == e.rank
    }

    pub(super) fn insert(
        &mut self,
        key: OffloadKey,
        chunk: Chunk,
        position: Option<i64>,
        slot: &mut RankSlot,
    ) {
        debug_assert!(self.find(&key).is_none(), "inserting a resident key");
        let rank = match position {
            None => self.fresh_rank(),
            Some(p) => (self.request_rank(slot), -p),
        };
        let evictable = chunk.ref_cnt == 0;
        let node = Node {
            key,
            chunk,
            rank,
            evictable,
            live: true,
            refs: 0,
        };
        let i = self.slab.insert(node);
        if evictable {
            self.num_evictable += 1;
            self.push(rank, i);
        }
    }

    /// Drops a resident chunk's node from the index; its slot in the slab is
    /// reused once no heap entry names it.
    fn unlink(&mut self, node: usize) -> Chunk {
        self.slab.unindex(node);
        let n = &mut self.slab.nodes[node];
        n.live = false;
        if n.evictable {
            self.num_evictable -= 1;
        }
        let (refs, chunk) = (n.refs, n.chunk);
        if refs == 0 {
            self.slab.release(node);
        }
        chunk
    }

    pub(super) fn remove(&mut self, key: &OffloadKey) {
        if let Some(i) = self.find(key) {
            self.unlink(i);
        }
    }

    /// A fresh rank for each resident key, in the order given.
    fn update_recency<'a>(&mut self, keys: impl Iterator<Item = &'a OffloadKey>) {
        for key in keys {
            if let Some(i) = self.find(key) {
                let rank = self.fresh_rank();
                self.set_rank(i, rank);
            }
        }
    }

    pub(super) fn touch(&mut self, keys: &[OffloadKey]) {
        self.update_recency(keys.iter().rev());
    }

    pub(super) fn on_request_access(&mut self, keys: &[(OffloadKey, i64)], slot: &mut RankSlot) {
        let major = self.request_rank(slot);
        for (key, p) in keys {
            let Some(i) = self.find(key) else {
                continue;
            };
            let rank = (major, -p);
            if self.slab.nodes[i].rank >= rank {
                continue;
            }
            self.set_rank(i, rank);
        }
    }

    pub(super) fn on_request_finished(&mut self, ordered: &[(OffloadKey, u8)]) {
        self.update_recency(ordered.iter().rev().map(|(k, _)| k));
    }

    pub(super) fn clear(&mut self) {
        self.slab.clear();
        self.heap.clear();
        self.num_evictable = 0;
        self.next_rank = 0;
    }

    /// The `n` first idle chunks not in `protected`, all or none (vLLM's pops
    /// with protected entries deferred and the selection undone on shortfall).
    pub(super) fn evict(
        &mut self,
        n: usize,
        protected: &Protected<'_>,
    ) -> Option<Vec<(OffloadKey, Chunk)>> {
        let mut selected: Vec<HeapEntry> = Vec::with_capacity(n);
        // a node can have two current entries (pinned and released at one rank)
        let mut picked: Option<FxHashSet<u32>> = (n > 16).then(FxHashSet::default);
        let mut deferred: Vec<HeapEntry> = Vec::new();
        while selected.len() < n {
            let Some(entry) = self.pop() else { break };
            if !self.is_current(&entry) {
                continue;
            }
            let repeated = match &picked {
                Some(set) => set.contains(&entry.node),
                None => selected.iter().any(|e| e.node == entry.node),
            };
            if repeated {
                continue;
            }
            if protected.contains(&self.slab.nodes[entry.node as usize].key) {
                deferred.push(entry);
                continue;
            }
            if let Some(set) = &mut picked {
                set.insert(entry.node);
            }
            selected.push(entry);
        }
        self.restore(deferred);
        if selected.len() < n {
            self.restore(selected);
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for e in selected {
            let node = e.node as usize;
            let key = self.slab.nodes[node].key;
            out.push((key, self.unlink(node)));
        }
        self.maybe_compact();
        Some(out)
    }

    pub(super) fn mark_evictable(&mut self, key: &OffloadKey) {
        let i = self.find(key).expect("resident key");
        let n = &mut self.slab.nodes[i];
        n.evictable = true;
        let rank = n.rank;
        self.num_evictable += 1;
        self.push(rank, i);
    }

    pub(super) fn mark_non_evictable(&mut self, key: &OffloadKey) {
        let i = self.find(key).expect("resident key");
        self.slab.nodes[i].evictable = false;
        self.num_evictable -= 1;
    }

    /// Resident keys with their chunks, in no order.
    pub(super) fn entries(&self) -> impl Iterator<Item = (&OffloadKey, &Chunk)> {
        self.slab
            .nodes
            .iter()
            .filter(|n| n.live)
            .map(|n| (&n.key, &n.chunk))
    }

    /// The heap's entries as they lie (stale ones included): `((major, minor), key)`.
    pub(super) fn heap_entries(&self) -> Vec<(Rank, OffloadKey)> {
        self.heap
            .iter()
            .map(|e| (e.rank, self.slab.nodes[e.node as usize].key))
            .collect()
    }

    /// Evictable keys in eviction order.
    pub(super) fn eviction_order(&self) -> Vec<OffloadKey> {
        let mut live: Vec<(Rank, OffloadKey)> = self
            .slab
            .nodes
            .iter()
            .filter(|n| n.live && n.evictable)
            .map(|n| (n.rank, n.key))
            .collect();
        live.sort_unstable();
        live.into_iter().map(|(_, k)| k).collect()
    }

    /// Whether the evictable chunks are exactly the idle ones, each with a
    /// live heap entry, every node counted by the entries naming it, free
    /// nodes unnamed, and the heap ordered.
    pub(super) fn check(&self) -> Result<(), String> {
        let mut idle = 0;
        let mut live = 0;
        for n in self.slab.nodes.iter().filter(|n| n.live) {
            live += 1;
            if n.evictable != (n.chunk.ref_cnt == 0) {
                return Err(format!(
                    "LRU: {:?} evictable={} with ref_cnt {}",
                    n.key, n.evictable, n.chunk.ref_cnt
                ));
            }
            if self.find(&n.key).is_none() {
                return Err(format!("LRU: {:?} is not indexed", n.key));
            }
            idle += usize::from(n.evictable);
        }
        if live != self.slab.len() {
            return Err(format!(
                "LRU: {live} resident chunks, {} indexed",
                self.slab.len()
            ));
        }
        if idle != self.num_evictable {
            return Err(format!(
                "LRU: {idle} idle chunks, {} counted",
                self.num_evictable
            ));
        }
        let mut refs = vec![0u32; self.slab.nodes.len()];
        for (i, e) in self.heap.iter().enumerate() {
            refs[e.node as usize] += 1;
            if i > 0 && less(&self.slab.nodes, e, &self.heap[(i - 1) / ARITY]) {
                return Err(format!("LRU: heap entry {i} is below its parent"));
            }
        }
        if let Some(i) = (0..self.slab.nodes.len()).find(|&i| refs[i] != self.slab.nodes[i].refs) {
            return Err(format!(
                "LRU: node {i} counts {} heap entries, {} name it",
                self.slab.nodes[i].refs, refs[i]
            ));
        }
        let mut free = FxHashSet::default();
        for &i in self.slab.free() {
            let n = &self.slab.nodes[i as usize];
            if n.live || n.refs > 0 || !free.insert(i) {
                return Err(format!("LRU: node {i} is free while in use"));
            }
        }
        let current: FxHashSet<u32> = self
            .heap
            .iter()
            .filter(|e| self.is_current(e))
            .map(|e| e.node)
            .collect();
        if current.len() != idle {
            return Err(format!(
                "LRU: {} idle chunks have a live heap entry of {idle}",
                current.len()
            ));
        }
        Ok(())
    }
}
