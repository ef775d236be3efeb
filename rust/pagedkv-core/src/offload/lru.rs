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

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rustc_hash::{FxHashMap, FxHashSet};

use super::keys::OffloadKey;
use super::policy::Protected;
use super::requests::RankSlot;
use super::slots::Chunk;

type Rank = (u64, i64);

#[derive(Clone, Debug)]
struct Entry {
    chunk: Chunk,
    rank: Rank,
    evictable: bool,
}

type HeapEntry = Reverse<(Rank, OffloadKey)>;

/// The LRU policy's state.
#[derive(Clone, Debug, Default)]
pub struct Lru {
    chunks: FxHashMap<OffloadKey, Entry>,
    /// Evictable chunks (and stale entries) by rank, then key bytes.
    heap: BinaryHeap<HeapEntry>,
    num_evictable: usize,
    next_rank: u64,
}

impl Lru {
    pub(super) fn len(&self) -> usize {
        self.chunks.len()
    }

    pub(super) fn get(&self, key: &OffloadKey) -> Option<&Chunk> {
        self.chunks.get(key).map(|e| &e.chunk)
    }

    pub(super) fn get_mut(&mut self, key: &OffloadKey) -> Option<&mut Chunk> {
        self.chunks.get_mut(key).map(|e| &mut e.chunk)
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

    fn set_rank(&mut self, key: OffloadKey, rank: Rank) {
        let entry = self.chunks.get_mut(&key).expect("resident key");
        entry.rank = rank;
        if entry.evictable {
            self.push(rank, key);
        }
    }

    fn push(&mut self, rank: Rank, key: OffloadKey) {
        self.heap.push(Reverse((rank, key)));
        self.maybe_compact();
    }

    /// Rebuilds the heap from the live entries once it holds more stale ones
    /// than live ones (and at least as many entries as resident chunks, so a
    /// rebuild's cost is spread over as many pushes).
    fn maybe_compact(&mut self) {
        let limit = 64.max(2 * self.num_evictable).max(self.chunks.len());
        if self.heap.len() < limit {
            return;
        }
        let live: Vec<HeapEntry> = self
            .chunks
            .iter()
            .filter(|(_, e)| e.evictable)
            .map(|(k, e)| Reverse((e.rank, *k)))
            .collect();
        self.heap = BinaryHeap::from(live);
    }

    fn is_current(&self, rank: Rank, key: &OffloadKey) -> bool {
        self.chunks
            .get(key)
            .is_some_and(|e| e.evictable && e.rank == rank)
    }

    pub(super) fn insert(
        &mut self,
        key: OffloadKey,
        chunk: Chunk,
        position: Option<i64>,
        slot: &mut RankSlot,
    ) {
        let rank = match position {
            None => self.fresh_rank(),
            Some(p) => (self.request_rank(slot), -p),
        };
        let evictable = chunk.ref_cnt == 0;
        self.chunks.insert(
            key,
            Entry {
                chunk,
                rank,
                evictable,
            },
        );
        if evictable {
            self.num_evictable += 1;
            self.push(rank, key);
        }
    }

    pub(super) fn remove(&mut self, key: &OffloadKey) {
        if let Some(e) = self.chunks.remove(key)
            && e.evictable
        {
            self.num_evictable -= 1;
        }
    }

    /// A fresh rank for each resident key, in the order given.
    fn update_recency<'a>(&mut self, keys: impl Iterator<Item = &'a OffloadKey>) {
        for key in keys {
            if self.chunks.contains_key(key) {
                let rank = self.fresh_rank();
                self.set_rank(*key, rank);
            }
        }
    }

    pub(super) fn touch(&mut self, keys: &[OffloadKey]) {
        self.update_recency(keys.iter().rev());
    }

    pub(super) fn on_request_access(&mut self, keys: &[(OffloadKey, i64)], slot: &mut RankSlot) {
        let major = self.request_rank(slot);
        for (key, p) in keys {
            let Some(entry) = self.chunks.get(key) else {
                continue;
            };
            let rank = (major, -p);
            if entry.rank >= rank {
                continue;
            }
            self.set_rank(*key, rank);
        }
    }

    pub(super) fn on_request_finished(&mut self, ordered: &[(OffloadKey, u8)]) {
        self.update_recency(ordered.iter().rev().map(|(k, _)| k));
    }

    pub(super) fn clear(&mut self) {
        self.chunks.clear();
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
        if n == 0 {
            return Some(Vec::new());
        }
        let mut selected: Vec<HeapEntry> = Vec::with_capacity(n);
        // a key can have two current entries (pinned and released at one rank)
        let mut picked: Option<FxHashSet<OffloadKey>> = (n > 16).then(FxHashSet::default);
        let mut deferred: Vec<HeapEntry> = Vec::new();
        while selected.len() < n {
            let Some(entry) = self.heap.pop() else { break };
            let Reverse((rank, key)) = entry;
            if !self.is_current(rank, &key) {
                continue;
            }
            let repeated = match &picked {
                Some(set) => set.contains(&key),
                None => selected.iter().any(|Reverse((_, k))| *k == key),
            };
            if repeated {
                continue;
            }
            if protected.contains(&key) {
                deferred.push(entry);
                continue;
            }
            if let Some(set) = &mut picked {
                set.insert(key);
            }
            selected.push(entry);
        }
        self.heap.extend(deferred);
        if selected.len() < n {
            self.heap.extend(selected);
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for Reverse((_, key)) in selected {
            let e = self
                .chunks
                .remove(&key)
                .expect("current entries are resident");
            self.num_evictable -= 1;
            out.push((key, e.chunk));
        }
        self.maybe_compact();
        Some(out)
    }

    pub(super) fn mark_evictable(&mut self, key: &OffloadKey) {
        let entry = self.chunks.get_mut(key).expect("resident key");
        entry.evictable = true;
        let rank = entry.rank;
        self.num_evictable += 1;
        self.push(rank, *key);
    }

    pub(super) fn mark_non_evictable(&mut self, key: &OffloadKey) {
        let entry = self.chunks.get_mut(key).expect("resident key");
        entry.evictable = false;
        self.num_evictable -= 1;
    }

    /// Resident keys with their chunks, in no order.
    pub(super) fn entries(&self) -> impl Iterator<Item = (&OffloadKey, &Chunk)> {
        self.chunks.iter().map(|(k, e)| (k, &e.chunk))
    }

    /// The heap's entries as they lie (stale ones included): `((major, minor), key)`.
    pub(super) fn heap_entries(&self) -> Vec<(Rank, OffloadKey)> {
        self.heap.iter().map(|Reverse(e)| *e).collect()
    }

    /// Evictable keys in eviction order.
    pub(super) fn eviction_order(&self) -> Vec<OffloadKey> {
        let mut live: Vec<(Rank, OffloadKey)> = self
            .chunks
            .iter()
            .filter(|(_, e)| e.evictable)
            .map(|(k, e)| (e.rank, *k))
            .collect();
        live.sort_unstable();
        live.into_iter().map(|(_, k)| k).collect()
    }

    /// Whether the evictable chunks are exactly the idle ones, each with a
    /// live heap entry.
    pub(super) fn check(&self) -> Result<(), String> {
        let mut idle = 0;
        for (key, e) in &self.chunks {
            if e.evictable != (e.chunk.ref_cnt == 0) {
                return Err(format!(
                    "LRU: {key:?} evictable={} with ref_cnt {}",
                    e.evictable, e.chunk.ref_cnt
                ));
            }
            idle += usize::from(e.evictable);
        }
        if idle != self.num_evictable {
            return Err(format!(
                "LRU: {idle} idle chunks, {} counted",
                self.num_evictable
            ));
        }
        let live: FxHashSet<OffloadKey> = self
            .heap
            .iter()
            .filter(|Reverse((rank, key))| self.is_current(*rank, key))
            .map(|Reverse((_, key))| *key)
            .collect();
        if live.len() != idle {
            return Err(format!(
                "LRU: {} idle chunks have a live heap entry of {idle}",
                live.len()
            ));
        }
        Ok(())
    }
}
