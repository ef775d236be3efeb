//! ARC (vLLM 0.33 `cpu/policies/arc.py`): T1 (seen once) and T2 (reused), their
//! ghost lists B1 / B2, and the adaptive target size of T1.
//!
//! New chunks enter T1; a request's reuse of a ready chunk moves it to T2 once,
//! when the request ends; storing is not reuse. A store miss or touch of a ghost
//! adapts the target (B1 grows it, B2 shrinks it). Eviction takes from T1 while
//! T1 is at or above the target, from T2 otherwise, and falls back to T1.

use hashlink::LinkedHashMap;
use rustc_hash::FxBuildHasher;

use super::keys::OffloadKey;
use super::policy::Protected;
use super::requests::{INSERTED, REUSED};
use super::slots::Chunk;

type List<V> = LinkedHashMap<OffloadKey, V, FxBuildHasher>;

/// The ARC policy's state.
#[derive(Clone, Debug)]
pub struct Arc {
    capacity: u64,
    pub(super) target_t1_size: f64,
    pub(super) t1: List<Chunk>,
    pub(super) t2: List<Chunk>,
    pub(super) b1: List<()>,
    pub(super) b2: List<()>,
}

impl Arc {
    pub(super) fn new(capacity: u64) -> Self {
        Self {
            capacity,
            target_t1_size: 0.0,
            t1: List::with_hasher(FxBuildHasher),
            t2: List::with_hasher(FxBuildHasher),
            b1: List::with_hasher(FxBuildHasher),
            b2: List::with_hasher(FxBuildHasher),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.t1.len() + self.t2.len()
    }

    pub(super) fn get(&self, key: &OffloadKey) -> Option<&Chunk> {
        self.t1.get(key).or_else(|| self.t2.get(key))
    }

    pub(super) fn get_mut(&mut self, key: &OffloadKey) -> Option<&mut Chunk> {
        if self.t1.contains_key(key) {
            return self.t1.get_mut(key);
        }
        self.t2.get_mut(key)
    }

    pub(super) fn insert(&mut self, key: OffloadKey, chunk: Chunk) {
        self.t1.insert(key, chunk);
        self.b1.remove(&key);
        self.b2.remove(&key);
    }

    pub(super) fn remove(&mut self, key: &OffloadKey) {
        if self.t1.remove(key).is_none() {
            self.t2.remove(key);
        }
    }

    /// A ghost hit moves the target (B1 up, B2 down) and refreshes the ghost.
    fn adapt_to_ghost_hit(&mut self, key: &OffloadKey) {
        // moving a ghost to the back leaves the lists' lengths as they were
        if self.b1.to_back(key).is_some() {
            let delta = (self.b2.len() as f64 / self.b1.len() as f64).max(1.0);
            self.target_t1_size = (self.target_t1_size + delta).min(self.capacity as f64);
        } else if self.b2.to_back(key).is_some() {
            let delta = (self.b1.len() as f64 / self.b2.len() as f64).max(1.0);
            self.target_t1_size = (self.target_t1_size - delta).max(0.0);
        }
    }

    pub(super) fn on_store_miss(&mut self, keys: &[OffloadKey]) {
        for key in keys.iter().rev() {
            self.adapt_to_ghost_hit(key);
        }
    }

    pub(super) fn touch(&mut self, keys: &[OffloadKey]) {
        for key in keys.iter().rev() {
            if let Some(chunk) = self.t1.remove(key) {
                if chunk.is_ready() {
                    self.t2.insert(*key, chunk);
                } else {
                    // only just prepared for storing: not a second use
                    self.t1.insert(*key, chunk);
                }
            } else if self.t2.to_back(key).is_none() {
                self.adapt_to_ghost_hit(key);
            }
        }
    }

    pub(super) fn on_request_finished(&mut self, ordered: &[(OffloadKey, u8)]) {
        for (key, flags) in ordered.iter().rev() {
            let reused = flags & REUSED != 0;
            // a store is not a frequency hit: T1 membership kept, recency restored
            if flags & INSERTED != 0 && !reused {
                if self.t1.to_back(key).is_none() {
                    self.t2.to_back(key);
                }
                continue;
            }
            if reused {
                if let Some(chunk) = self.t1.remove(key) {
                    self.t2.insert(*key, chunk);
                } else {
                    self.t2.to_back(key);
                }
            }
        }
    }

    pub(super) fn clear(&mut self) {
        self.t1.clear();
        self.t2.clear();
        self.b1.clear();
        self.b2.clear();
        self.target_t1_size = 0.0;
    }

    pub(super) fn evict(
        &mut self,
        n: usize,
        protected: &Protected<'_>,
    ) -> Option<Vec<(OffloadKey, Chunk)>> {
        if n == 0 {
            return Some(Vec::new());
        }
        let idle = |(k, c): (&OffloadKey, &Chunk)| {
            (c.ref_cnt == 0 && !protected.contains(k)).then_some(*k)
        };
        let mut t1 = self.t1.iter().filter_map(idle);
        let mut t2 = self.t2.iter().filter_map(idle);
        // (key, from T1); selection first, changes only once n are found
        let mut picked: Vec<(OffloadKey, bool)> = Vec::with_capacity(n);
        let mut virtual_t1 = self.t1.len();
        // Python's int() of the non-negative target
        let target = self.target_t1_size.trunc() as usize;
        for _ in 0..n {
            let mut pick = None;
            if virtual_t1 >= target
                && let Some(k) = t1.next()
            {
                pick = Some((k, true));
                virtual_t1 -= 1;
            }
            if pick.is_none()
                && let Some(k) = t2.next()
            {
                pick = Some((k, false));
            }
            if pick.is_none() {
                let k = t1.next()?;
                pick = Some((k, true));
                virtual_t1 -= 1;
            }
            picked.push(pick.expect("set above"));
        }
        let mut out = Vec::with_capacity(n);
        for (key, from_t1) in picked {
            let chunk = if from_t1 {
                self.b1.insert(key, ());
                self.t1.remove(&key)
            } else {
                self.b2.insert(key, ());
                self.t2.remove(&key)
            };
            out.push((key, chunk.expect("picked from the list")));
        }
        for ghost in [&mut self.b1, &mut self.b2] {
            while ghost.len() as u64 > self.capacity {
                ghost.pop_front();
            }
        }
        Some(out)
    }

    /// Resident keys with their chunks, T1 then T2, each oldest first.
    pub(super) fn entries(&self) -> impl Iterator<Item = (&OffloadKey, &Chunk)> {
        self.t1.iter().chain(self.t2.iter())
    }

    pub(super) fn check(&self) -> Result<(), String> {
        if let Some(k) = self.t1.keys().find(|k| self.t2.contains_key(*k)) {
            return Err(format!("ARC: {k:?} in both T1 and T2"));
        }
        for (name, ghost) in [("B1", &self.b1), ("B2", &self.b2)] {
            if ghost.len() as u64 > self.capacity {
                return Err(format!(
                    "ARC: {name} holds {} > capacity {}",
                    ghost.len(),
                    self.capacity
                ));
            }
            if let Some(k) = ghost.keys().find(|k| self.get(k).is_some()) {
                return Err(format!("ARC: ghost {k:?} in {name} is resident"));
            }
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
