//! ARC's ghost lists: the keys of recently evicted cached blocks, hash only,
//! in two bounded FIFOs (B1: evicted from T1, B2: evicted from T2) behind one
//! hash map that says which list holds a key now.
//!
//! A key leaves its list on a ghost hit (the map entry goes; its FIFO entry
//! stays behind, stale, until it reaches the front or the FIFO is compacted)
//! or when its list grows past the bound (the oldest live entry goes). Each
//! FIFO entry carries the sequence number its map entry had, so a stale entry
//! never removes a later live one of the same key. Every operation is O(1)
//! amortised: a compaction (a FIFO past twice the bound) keeps only live
//! entries, at most the bound.

use std::collections::VecDeque;

/// Ghost entries reserved when the lists are built (more grow on demand).
const RESERVE: usize = 1 << 12;

/// The two ghost lists of ARC.
#[derive(Debug, Default)]
pub(super) struct Ghosts {
    fifo: [VecDeque<(u64, u64)>; 2],
    /// Key fingerprint -> (list, sequence number of its live FIFO entry).
    live: rustc_hash::FxHashMap<u64, (u8, u64)>,
    len: [u32; 2],
    next_seq: u64,
    /// The most live keys each list holds.
    bound: u32,
}

impl Ghosts {
    /// Empty lists of at most `bound` keys each (at least 1).
    pub(super) fn new(bound: u32) -> Self {
        let bound = bound.max(1);
        let reserve = (bound as usize).min(RESERVE);
        let mut live = rustc_hash::FxHashMap::default();
        live.reserve(2 * reserve);
        Self {
            fifo: [
                VecDeque::with_capacity(reserve),
                VecDeque::with_capacity(reserve),
            ],
            live,
            len: [0, 0],
            next_seq: 0,
            bound,
        }
    }

    /// Live keys in B1 and B2.
    pub(super) fn lens(&self) -> [u32; 2] {
        self.len
    }

    /// Records an evicted key in list `list` (0: B1, 1: B2), dropping the
    /// oldest key of that list past its bound. A key already listed moves.
    pub(super) fn insert(&mut self, fp: u64, list: usize) {
        let seq = self.next_seq;
        self.next_seq += 1;
        if let Some((old, _)) = self.live.insert(fp, (list as u8, seq)) {
            self.len[old as usize] -= 1;
        }
        self.len[list] += 1;
        self.fifo[list].push_back((fp, seq));
        while self.len[list] > self.bound {
            let Some((f, s)) = self.fifo[list].pop_front() else {
                break;
            };
            if self.live.get(&f) == Some(&(list as u8, s)) {
                self.live.remove(&f);
                self.len[list] -= 1;
            }
        }
        if self.fifo[list].len() > 2 * self.bound as usize {
            let live = &self.live;
            self.fifo[list].retain(|(f, s)| live.get(f) == Some(&(list as u8, *s)));
        }
    }

    /// A ghost hit: removes the key and says which list held it.
    pub(super) fn take(&mut self, fp: u64) -> Option<usize> {
        if self.live.is_empty() {
            return None;
        }
        let (list, _) = self.live.remove(&fp)?;
        self.len[list as usize] -= 1;
        Some(list as usize)
    }

    /// Forgets every key.
    pub(super) fn clear(&mut self) {
        self.fifo.iter_mut().for_each(VecDeque::clear);
        self.live.clear();
        self.len = [0, 0];
    }

    /// The lists' invariants: counts match the map, each list within its
    /// bound, each FIFO within twice it, every live key in its FIFO.
    pub(super) fn check(&self) -> Result<(), String> {
        let mut counted = [0u32; 2];
        for &(list, _) in self.live.values() {
            counted[list as usize] += 1;
        }
        if counted != self.len {
            return Err(format!(
                "ghost lists count {:?} but the map holds {counted:?}",
                self.len
            ));
        }
        for list in 0..2 {
            if self.len[list] > self.bound {
                return Err(format!(
                    "ghost list B{} holds {} keys, past its bound {}",
                    list + 1,
                    self.len[list],
                    self.bound
                ));
            }
            if self.fifo[list].len() > 2 * self.bound as usize {
                return Err(format!(
                    "ghost FIFO B{} holds {} entries, past twice its bound",
                    list + 1,
                    self.fifo[list].len()
                ));
            }
            let listed = self.fifo[list]
                .iter()
                .filter(|(f, s)| self.live.get(f) == Some(&(list as u8, *s)))
                .count();
            if listed != self.len[list] as usize {
                return Err(format!(
                    "ghost list B{} has {} live keys but its FIFO lists {listed}",
                    list + 1,
                    self.len[list]
                ));
            }
        }
        Ok(())
    }
}
