//! LRU with request-scoped recency (vLLM 0.33 `cpu/policies/lru.py`).
//!
//! Every chunk has a rank `(major, minor)`; the evictable chunks are taken in
//! rank order (ties by key bytes). A chunk stored or touched outside a request's
//! positions gets a fresh major rank; a request shares one major rank across its
//! batches and orders its chunks by `-position`, so a request's tail is evicted
//! before its head; `touch` and the request's end commit recency, the last key
//! of the list first. vLLM keeps the evictable chunks in a lazily invalidated
//! heap; an ordered set gives the same order without stale entries.

use std::collections::BTreeSet;

use rustc_hash::{FxHashMap, FxHashSet};

use super::keys::OffloadKey;
use super::requests::RankSlot;
use super::slots::Chunk;

type Rank = (u64, i64);

#[derive(Clone, Debug)]
struct Entry {
    chunk: Chunk,
    rank: Rank,
    evictable: bool,
}

/// The LRU policy's state.
#[derive(Clone, Debug, Default)]
pub struct Lru {
    chunks: FxHashMap<OffloadKey, Entry>,
    evictable: BTreeSet<(Rank, OffloadKey)>,
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
        if entry.evictable {
            self.evictable.remove(&(entry.rank, key));
            self.evictable.insert((rank, key));
        }
        entry.rank = rank;
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
        if evictable {
            self.evictable.insert((rank, key));
        }
        self.chunks.insert(
            key,
            Entry {
                chunk,
                rank,
                evictable,
            },
        );
    }

    pub(super) fn remove(&mut self, key: &OffloadKey) {
        if let Some(e) = self.chunks.remove(key)
            && e.evictable
        {
            self.evictable.remove(&(e.rank, *key));
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

    pub(super) fn on_request_access(
        &mut self,
        keys: &[OffloadKey],
        positions: &FxHashMap<OffloadKey, i64>,
        slot: &mut RankSlot,
    ) {
        let major = self.request_rank(slot);
        for key in keys {
            let Some(&p) = positions.get(key) else {
                continue;
            };
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

    pub(super) fn on_request_finished(&mut self, ordered: &[OffloadKey]) {
        self.update_recency(ordered.iter().rev());
    }

    pub(super) fn clear(&mut self) {
        self.chunks.clear();
        self.evictable.clear();
        self.next_rank = 0;
    }

    pub(super) fn evict(
        &mut self,
        n: usize,
        protected: &FxHashSet<OffloadKey>,
    ) -> Option<Vec<(OffloadKey, Chunk)>> {
        if n == 0 {
            return Some(Vec::new());
        }
        let picked: Vec<(Rank, OffloadKey)> = self
            .evictable
            .iter()
            .filter(|(_, k)| !protected.contains(k))
            .take(n)
            .copied()
            .collect();
        if picked.len() < n {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for item in picked {
            self.evictable.remove(&item);
            let e = self
                .chunks
                .remove(&item.1)
                .expect("evictable keys are resident");
            out.push((item.1, e.chunk));
        }
        Some(out)
    }

    pub(super) fn mark_evictable(&mut self, key: &OffloadKey) {
        let entry = self.chunks.get_mut(key).expect("resident key");
        entry.evictable = true;
        self.evictable.insert((entry.rank, *key));
    }

    pub(super) fn mark_non_evictable(&mut self, key: &OffloadKey) {
        let entry = self.chunks.get_mut(key).expect("resident key");
        entry.evictable = false;
        self.evictable.remove(&(entry.rank, *key));
    }

    /// Resident keys with their chunks, in no order.
    pub(super) fn entries(&self) -> impl Iterator<Item = (&OffloadKey, &Chunk)> {
        self.chunks.iter().map(|(k, e)| (k, &e.chunk))
    }

    /// Evictable keys in eviction order.
    pub(super) fn eviction_order(&self) -> impl Iterator<Item = &OffloadKey> {
        self.evictable.iter().map(|(_, k)| k)
    }

    /// Whether the evictable set is exactly the resident chunks with no reader.
    pub(super) fn check(&self) -> Result<(), String> {
        let idle = self
            .chunks
            .values()
            .filter(|e| e.chunk.ref_cnt == 0)
            .count();
        if idle != self.evictable.len() {
            return Err(format!(
                "LRU: {idle} idle chunks but {} in the evictable set",
                self.evictable.len()
            ));
        }
        for (rank, key) in &self.evictable {
            match self.chunks.get(key) {
                Some(e) if e.evictable && e.rank == *rank && e.chunk.ref_cnt == 0 => {}
                _ => return Err(format!("LRU: stale evictable entry {key:?}")),
            }
        }
        Ok(())
    }
}
