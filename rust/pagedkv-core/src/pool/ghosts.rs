//! ARC's ghost lists: the keys of recently evicted cached blocks, hash only,
//! in two bounded FIFOs (B1: evicted from T1, B2: evicted from T2) behind one
//! table that says where a key is listed.
//!
//! Each FIFO is a ring of at most `bound` key fingerprints (0 marks an empty
//! slot): a key recorded past the bound takes the oldest slot, and the key
//! there is forgotten. A ghost hit empties the key's slot. Every operation
//! is O(1) expected.
//!
//! The table is open addressing with linear probing, at most half full, of
//! 8-byte slots: a 32-bit tag of the key and the ring slot it names (the list
//! in the top bit). A slot's home derives from its tag alone, so removing a
//! key (backward shift) never reads a ring; a tag match is confirmed against
//! the ring, so answers are exact. The slots the table will touch are known
//! ahead of time and prefetched: the oldest keys a ring is about to forget
//! ([`AHEAD`] records ahead, on every record) and, through
//! [`Ghosts::prefetch`], the keys callers are about to record or look up.
//! Memory: 8 bytes a ring slot, and a table of at least two 8-byte slots a
//! key, sized by doubling for the most keys listed at once.

use pagedkv_arch::prefetch;

/// Bit of a ring-slot reference naming the list (B2).
const SECOND: u32 = 1 << 31;

/// A table slot holding no key (its reference half is never a ring slot).
const EMPTY: u64 = u64::MAX;

/// How many records ahead a ring's oldest keys have their table slots read.
const AHEAD: usize = 16;

/// How many records ahead a ring's slots are read (8 lines: the ring is
/// read in order, but among random reads that hide the order from the
/// hardware's own prefetcher).
const RING_AHEAD: usize = 64;

/// The smallest table (slots).
const MIN_TABLE: usize = 64;

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// The two ghost lists of ARC.
#[derive(Debug, Default)]
pub(super) struct Ghosts {
    ring: [Vec<u64>; 2],
    /// The next slot each ring writes.
    at: [usize; 2],
    /// Tag << 32 | ring-slot reference, or `EMPTY`; a power of two long.
    table: Vec<u64>,
    /// 64 - log2(table length): a tag's home is its Fibonacci hash's top bits.
    shift: u32,
    len: [u32; 2],
    /// The most keys each list holds.
    bound: u32,
}

/// A fingerprint as the rings keep it (never 0, the empty slot).
fn nonzero(fp: u64) -> u64 {
    fp.max(1)
}

/// The 32-bit tag the table keeps of a fingerprint.
#[inline]
fn tag(fp: u64) -> u32 {
    (fp.wrapping_mul(0xff51_afd7_ed55_8ccd) >> 32) as u32
}

/// A ring-slot reference: list 0 / 1 and the slot.
#[inline]
fn reference(list: usize, slot: usize) -> u32 {
    slot as u32 | if list == 1 { SECOND } else { 0 }
}

impl Ghosts {
    /// Empty lists of at most `bound` keys each (at least 1, below 2^31).
    pub(super) fn new(bound: u32) -> Self {
        Self {
            bound: bound.clamp(1, SECOND - 1),
            ..Self::default()
        }
    }

    /// Live keys in B1 and B2.
    pub(super) fn lens(&self) -> [u32; 2] {
        self.len
    }

    #[inline]
    fn home(&self, tag: u32) -> usize {
        (u64::from(tag).wrapping_mul(GOLDEN) >> self.shift) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.table.len() - 1
    }

    /// The fingerprint in the ring slot a reference names.
    #[inline]
    fn at_ref(&self, r: u32) -> u64 {
        self.ring[usize::from(r & SECOND != 0)][(r & !SECOND) as usize]
    }

    /// The table slot listing `fp`, if any.
    #[inline]
    fn find(&self, fp: u64) -> Option<usize> {
        let t = tag(fp);
        let mut i = self.home(t);
        loop {
            let s = self.table[i];
            if s == EMPTY {
                return None;
            }
            if (s >> 32) as u32 == t && self.at_ref(s as u32) == fp {
                return Some(i);
            }
            i = (i + 1) & self.mask();
        }
    }

    /// The table slot holding reference `r` (listed, with tag `t`).
    #[inline]
    fn slot_of(&self, t: u32, r: u32) -> usize {
        let mut i = self.home(t);
        while self.table[i] as u32 != r {
            i = (i + 1) & self.mask();
        }
        i
    }

    /// Puts a slot in the first free place from its home (not listed yet).
    #[inline]
    fn place(&mut self, s: u64) {
        let mut i = self.home((s >> 32) as u32);
        while self.table[i] != EMPTY {
            i = (i + 1) & self.mask();
        }
        self.table[i] = s;
    }

    /// Empties table slot `i`, shifting back the slots after it that would
    /// otherwise no longer be found from their homes.
    fn remove_at(&mut self, mut i: usize) {
        let mask = self.mask();
        self.table[i] = EMPTY;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let s = self.table[j];
            if s == EMPTY {
                return;
            }
            let h = self.home((s >> 32) as u32);
            // The slot may stay when its home lies cyclically in (i, j].
            let stays = if i <= j {
                i < h && h <= j
            } else {
                i < h || h <= j
            };
            if !stays {
                self.table[i] = s;
                self.table[j] = EMPTY;
                i = j;
            }
        }
    }

    /// Makes room for one more key at most half full (doubling, re-placing
    /// every listed key).
    fn reserve_one(&mut self) {
        let live = (self.len[0] + self.len[1]) as usize;
        if (live + 1) * 2 <= self.table.len() {
            return;
        }
        let size = ((live + 1) * 2).next_power_of_two().max(MIN_TABLE);
        self.table.clear();
        self.table.resize(size, EMPTY);
        self.shift = 64 - size.trailing_zeros();
        for list in 0..2 {
            for slot in 0..self.ring[list].len() {
                let fp = self.ring[list][slot];
                if fp != 0 {
                    self.place(u64::from(tag(fp)) << 32 | u64::from(reference(list, slot)));
                }
            }
        }
    }

    /// Starts reading the table slot a lookup or record of `fp` starts at
    /// (a prefetch: returns at once, and is dropped when too many misses are
    /// in flight, so callers issue it a few keys ahead, not a run at once).
    #[inline]
    pub(super) fn prefetch(&self, fp: u64) {
        if !self.table.is_empty() {
            prefetch(&self.table[self.home(tag(nonzero(fp)))]);
        }
    }

    /// Records an evicted key in list `list` (0: B1, 1: B2), forgetting the
    /// oldest key of that list past its bound. A key already listed moves.
    pub(super) fn insert(&mut self, fp: u64, list: usize) {
        let fp = nonzero(fp);
        self.reserve_one();
        let bound = self.bound as usize;
        let slot = self.at[list];
        self.at[list] = if slot + 1 == bound { 0 } else { slot + 1 };
        if slot == self.ring[list].len() {
            self.ring[list].push(0);
        }
        // The key this ring forgets AHEAD records from now (its table slot),
        // and the ring's line RING_AHEAD records from now.
        let wrap = |i: usize| if i < bound { i } else { i % bound };
        if let Some(&f) = self.ring[list].get(wrap(slot + AHEAD))
            && f != 0
        {
            prefetch(&self.table[self.home(tag(f))]);
        }
        if let Some(f) = self.ring[list].get(wrap(slot + RING_AHEAD)) {
            prefetch(f);
        }
        let r = reference(list, slot);
        let old = self.ring[list][slot];
        if old != 0 {
            let i = self.slot_of(tag(old), r);
            self.remove_at(i);
            self.ring[list][slot] = 0;
            self.len[list] -= 1;
        }
        let s = u64::from(tag(fp)) << 32 | u64::from(r);
        if let Some(i) = self.find(fp) {
            self.vacate(self.table[i] as u32);
            self.table[i] = s;
        } else {
            self.place(s);
        }
        self.ring[list][slot] = fp;
        self.len[list] += 1;
    }

    /// Empties the ring slot a reference names.
    fn vacate(&mut self, r: u32) {
        let list = usize::from(r & SECOND != 0);
        self.ring[list][(r & !SECOND) as usize] = 0;
        self.len[list] -= 1;
    }

    /// A ghost hit: forgets the key and says which list held it.
    pub(super) fn take(&mut self, fp: u64) -> Option<usize> {
        if self.len == [0, 0] {
            return None;
        }
        let i = self.find(nonzero(fp))?;
        let r = self.table[i] as u32;
        self.remove_at(i);
        self.vacate(r);
        Some(usize::from(r & SECOND != 0))
    }

    /// Forgets every key.
    pub(super) fn clear(&mut self) {
        self.ring.iter_mut().for_each(Vec::clear);
        self.at = [0, 0];
        self.table.fill(EMPTY);
        self.len = [0, 0];
    }

    /// The lists' invariants: each within its bound, counts matching the
    /// filled slots, the table listing exactly the filled slots, each where
    /// a lookup finds it, at most half full.
    pub(super) fn check(&self) -> Result<(), String> {
        for list in 0..2 {
            let filled = self.ring[list].iter().filter(|&&f| f != 0).count();
            if self.ring[list].len() > self.bound as usize || filled != self.len[list] as usize {
                return Err(format!(
                    "ghost list B{} counts {} keys, holds {filled} in {} slots (bound {})",
                    list + 1,
                    self.len[list],
                    self.ring[list].len(),
                    self.bound
                ));
            }
        }
        let live = (self.len[0] + self.len[1]) as usize;
        let held = self.table.iter().filter(|&&s| s != EMPTY).count();
        if held != live || (live > 0 && live * 2 > self.table.len()) {
            return Err(format!(
                "ghost table holds {held} keys in {} slots, the lists {:?}",
                self.table.len(),
                self.len
            ));
        }
        for (i, &s) in self.table.iter().enumerate() {
            if s == EMPTY {
                continue;
            }
            let r = s as u32;
            let (list, slot) = (usize::from(r & SECOND != 0), (r & !SECOND) as usize);
            let fp = self.ring[list].get(slot).copied().unwrap_or(0);
            if fp == 0 || tag(fp) != (s >> 32) as u32 || self.find(fp) != Some(i) {
                return Err(format!(
                    "ghost table slot {i} names B{} slot {slot}, which does not list it",
                    list + 1
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Ghosts;
    use std::collections::{HashMap, VecDeque};

    #[test]
    fn a_full_ring_forgets_its_oldest_key_and_a_hit_frees_a_slot() {
        let mut g = Ghosts::new(3);
        for fp in 1..=3 {
            g.insert(fp, 0);
        }
        g.insert(4, 0);
        assert_eq!(g.lens(), [3, 0]);
        assert_eq!(g.take(1), None);
        assert_eq!(g.take(3), Some(0));
        assert_eq!(g.lens(), [2, 0]);
        // A key listed again moves (here to B2); the slot it left stays empty.
        g.insert(2, 1);
        assert_eq!(g.lens(), [1, 1]);
        assert_eq!(g.take(2), Some(1));
        g.check().expect("invariants");
        for fp in 10..20 {
            g.insert(fp, 1);
            g.check().expect("invariants");
        }
        assert_eq!(g.lens(), [1, 3]);
        assert_eq!(g.take(4), Some(0));
        assert_eq!(g.take(0), None);
        g.clear();
        assert_eq!(g.lens(), [0, 0]);
        g.check().expect("invariants");
    }

    /// The rings as plain FIFOs of (slot, key) per list, slots emptied on
    /// a hit or a move, against the table over random records and hits.
    #[test]
    fn records_and_hits_match_a_fifo_model() {
        for (bound, keys) in [(1u32, 4u64), (5, 12), (37, 90), (300, 2_000)] {
            let mut rng = pagedkv_splitmix::SplitMix64(u64::from(bound) * 7919);
            let mut g = Ghosts::new(bound);
            // Per list: the keys in their ring slots (None = emptied), oldest first.
            let mut model: [VecDeque<Option<u64>>; 2] = [VecDeque::new(), VecDeque::new()];
            for step in 0..20_000 {
                // Keys drawn so that some collide in their tag's home.
                let fp = rng.below(keys) + 1;
                if rng.below(3) == 0 {
                    let want = (0..2).find(|&l| model[l].contains(&Some(fp)));
                    if let Some(l) = want {
                        let at = model[l].iter().position(|&k| k == Some(fp));
                        model[l][at.expect("listed")] = None;
                    }
                    assert_eq!(g.take(fp), want, "bound {bound} step {step}");
                } else {
                    let list = rng.below(2) as usize;
                    g.insert(fp, list);
                    for k in model.iter_mut().flatten() {
                        if *k == Some(fp) {
                            *k = None;
                        }
                    }
                    if model[list].len() == bound as usize {
                        model[list].pop_front();
                    }
                    model[list].push_back(Some(fp));
                }
                if step % 97 == 0 {
                    g.check().expect("invariants");
                }
                let lens = [0, 1].map(|l| model[l].iter().flatten().count() as u32);
                assert_eq!(g.lens(), lens, "bound {bound} step {step}");
            }
            g.check().expect("invariants");
            let mut listed: HashMap<u64, usize> = HashMap::new();
            for (l, ring) in model.iter().enumerate() {
                for k in ring.iter().flatten() {
                    listed.insert(*k, l);
                }
            }
            for fp in 1..=keys {
                assert_eq!(
                    g.take(fp),
                    listed.get(&fp).copied(),
                    "bound {bound} key {fp}"
                );
            }
            assert_eq!(g.lens(), [0, 0]);
        }
    }
}
