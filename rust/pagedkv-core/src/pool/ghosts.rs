//! ARC's ghost lists: the keys of recently evicted cached blocks, hash only,
//! in two bounded FIFOs (B1: evicted from T1, B2: evicted from T2) behind one
//! hash map that says where a key is listed.
//!
//! Each FIFO is a ring of at most `bound` key fingerprints (0 marks an empty
//! slot): a key recorded past the bound takes the oldest slot, and the key
//! there is forgotten. A ghost hit empties the key's slot. Every operation
//! is O(1) with at most two map operations; the rings grow to their bound as
//! keys are recorded (16 bytes a slot, map included).

/// Ghost map entries reserved when the lists are built (more grow on demand).
const RESERVE: usize = 1 << 12;

/// Bit of a map entry naming the list (B2) beside the slot.
const SECOND: u32 = 1 << 31;

/// The two ghost lists of ARC.
#[derive(Debug, Default)]
pub(super) struct Ghosts {
    ring: [Vec<u64>; 2],
    /// The next slot each ring writes.
    at: [usize; 2],
    /// Key fingerprint -> its slot, `SECOND` set for B2.
    live: rustc_hash::FxHashMap<u64, u32>,
    len: [u32; 2],
    /// The most keys each list holds.
    bound: u32,
}

/// A fingerprint as the rings keep it (never 0, the empty slot).
fn nonzero(fp: u64) -> u64 {
    fp.max(1)
}

impl Ghosts {
    /// Empty lists of at most `bound` keys each (at least 1, below 2^31).
    pub(super) fn new(bound: u32) -> Self {
        let bound = bound.clamp(1, SECOND - 1);
        let mut live = rustc_hash::FxHashMap::default();
        live.reserve((2 * bound as usize).min(RESERVE));
        Self {
            ring: [Vec::new(), Vec::new()],
            at: [0, 0],
            live,
            len: [0, 0],
            bound,
        }
    }

    /// Live keys in B1 and B2.
    pub(super) fn lens(&self) -> [u32; 2] {
        self.len
    }

    /// Empties the slot a map entry names.
    fn vacate(&mut self, entry: u32) {
        let list = usize::from(entry & SECOND != 0);
        self.ring[list][(entry & !SECOND) as usize] = 0;
        self.len[list] -= 1;
    }

    /// Records an evicted key in list `list` (0: B1, 1: B2), forgetting the
    /// oldest key of that list past its bound. A key already listed moves.
    pub(super) fn insert(&mut self, fp: u64, list: usize) {
        let fp = nonzero(fp);
        let slot = self.at[list];
        self.at[list] = if slot + 1 == self.bound as usize {
            0
        } else {
            slot + 1
        };
        if slot == self.ring[list].len() {
            self.ring[list].push(0);
        }
        let old = std::mem::replace(&mut self.ring[list][slot], fp);
        if old != 0 {
            self.live.remove(&old);
        } else {
            self.len[list] += 1;
        }
        let entry = slot as u32 | if list == 1 { SECOND } else { 0 };
        if let Some(prev) = self.live.insert(fp, entry)
            && prev != entry
        {
            self.vacate(prev);
        }
    }

    /// A ghost hit: forgets the key and says which list held it.
    pub(super) fn take(&mut self, fp: u64) -> Option<usize> {
        if self.live.is_empty() {
            return None;
        }
        let entry = self.live.remove(&nonzero(fp))?;
        self.vacate(entry);
        Some(usize::from(entry & SECOND != 0))
    }

    /// Forgets every key.
    pub(super) fn clear(&mut self) {
        self.ring.iter_mut().for_each(Vec::clear);
        self.at = [0, 0];
        self.live.clear();
        self.len = [0, 0];
    }

    /// The lists' invariants: each within its bound, counts matching the
    /// filled slots, the map naming exactly the filled slots.
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
        if self.live.len() != (self.len[0] + self.len[1]) as usize {
            return Err(format!(
                "ghost map holds {} keys, the lists {:?}",
                self.live.len(),
                self.len
            ));
        }
        for (&fp, &entry) in &self.live {
            let list = usize::from(entry & SECOND != 0);
            if self.ring[list].get((entry & !SECOND) as usize) != Some(&fp) {
                return Err(format!(
                    "ghost key {fp:#x} is mapped to a slot it is not in"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Ghosts;

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
}
