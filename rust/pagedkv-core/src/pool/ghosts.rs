//! ARC's ghost lists: the keys of recently evicted cached blocks, in two
//! bounded FIFOs (B1: evicted from T1, B2: evicted from T2).
//!
//! The ghosts themselves live in the prefix map, each in its key's home
//! bucket (`prefix_map::ghost_lanes`): recording one costs no line the
//! eviction does not read already, and a key cached again finds its ghost in
//! the bucket its insertion reads anyway. The rings here keep the order:
//! each is at most `bound` records ([`GhostRecord`]: where a ghost was left),
//! and a record past the bound forgets the oldest ghost of its list, which a
//! caller reading ahead has prefetched ([`Ghosts::at_position`]). A record whose
//! ghost was hit or dropped since forgets nothing.
//! Memory: 8 bytes a ring slot.

use pagedkv_arch::prefetch;

use super::prefix_map::GhostRecord;

/// The two rings of ARC's ghost lists.
#[derive(Debug, Default)]
pub(super) struct Ghosts {
    ring: [Vec<u64>; 2],
    /// The next slot each ring writes.
    at: [usize; 2],
    /// The most records each ring holds.
    bound: u32,
}

impl Ghosts {
    /// Empty rings of at most `bound` records each (at least 1).
    pub(super) fn new(bound: u32) -> Self {
        Self {
            bound: bound.max(1),
            ..Self::default()
        }
    }

    /// The ring slot the next record of `list` takes.
    pub(super) fn next_slot(&self, list: usize) -> usize {
        self.at[list]
    }

    /// The ring slots the next records take, per list (positions for
    /// [`Self::at_position`]).
    pub(super) fn positions(&self) -> [usize; 2] {
        self.at
    }

    /// The record a record into `list` at position `pos` (a ring slot, or
    /// past the ring's end: it wraps) replaces, the ghost it forgets, if any.
    #[inline]
    pub(super) fn at_position(&self, list: usize, pos: usize) -> Option<GhostRecord> {
        let bound = self.bound as usize;
        let i = if pos < bound { pos } else { pos % bound };
        self.ring[list]
            .get(i)
            .filter(|&&r| r != 0)
            .map(|&r| GhostRecord(r))
    }

    /// Starts loading the ring line of position `pos` in `list` (the ring is
    /// read in order, but among random reads that hide the order from the
    /// hardware's own prefetcher).
    #[inline]
    pub(super) fn prefetch_position(&self, list: usize, pos: usize) {
        let bound = self.bound as usize;
        let i = if pos < bound { pos } else { pos % bound };
        if let Some(r) = self.ring[list].get(i) {
            prefetch(r);
        }
    }

    /// Appends a record to `list`'s ring (at [`Self::next_slot`]); the record
    /// it replaces, whose ghost is to be forgotten.
    pub(super) fn push(&mut self, list: usize, r: GhostRecord) -> Option<GhostRecord> {
        let slot = self.at[list];
        self.at[list] = if slot + 1 == self.bound as usize {
            0
        } else {
            slot + 1
        };
        let ring = &mut self.ring[list];
        if slot == ring.len() {
            ring.push(r.0);
            return None;
        }
        let old = std::mem::replace(&mut ring[slot], r.0);
        (old != 0).then_some(GhostRecord(old))
    }

    /// Forgets every record.
    pub(super) fn clear(&mut self) {
        self.ring.iter_mut().for_each(Vec::clear);
        self.at = [0, 0];
    }

    /// Each ring within its bound, holding at least the ghosts of its list.
    pub(super) fn check(&self, lens: [u32; 2]) -> Result<(), String> {
        for (list, (ring, &len)) in self.ring.iter().zip(&lens).enumerate() {
            let held = ring.iter().filter(|&&r| r != 0).count();
            if ring.len() > self.bound as usize || held < len as usize {
                return Err(format!(
                    "ghost list B{} holds {len} ghosts, its ring {held} records in {} slots (bound {})",
                    list + 1,
                    ring.len(),
                    self.bound
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{GhostRecord, Ghosts};

    #[test]
    fn a_full_ring_hands_back_its_oldest_record_and_says_which_comes_next() {
        let mut g = Ghosts::new(3);
        let r = |i: u64| GhostRecord(i << 32 | 1 << 31);
        for i in 1..=3 {
            assert_eq!(g.next_slot(0), (i - 1) as usize);
            assert_eq!(
                g.at_position(0, g.positions()[0]),
                None,
                "a ring filling forgets nothing"
            );
            assert_eq!(g.push(0, r(i)), None);
        }
        assert_eq!(g.next_slot(0), 0);
        assert_eq!(g.positions(), [0, 0]);
        assert_eq!(g.at_position(0, 0), Some(r(1)));
        assert_eq!(g.at_position(0, 2), Some(r(3)));
        assert_eq!(g.at_position(0, 4), Some(r(2)), "wraps");
        assert_eq!(g.push(0, r(4)), Some(r(1)));
        assert_eq!(g.push(0, r(5)), Some(r(2)));
        // The other list is its own ring.
        assert_eq!(g.push(1, r(9)), None);
        assert_eq!(g.positions(), [2, 1]);
        assert_eq!(g.at_position(1, 0), Some(r(9)));
        assert_eq!(g.at_position(1, 1), None);
        assert!(g.check([3, 1]).is_ok());
        assert!(g.check([4, 0]).is_err(), "more ghosts than records");
        g.clear();
        assert_eq!(g.next_slot(0), 0);
        assert_eq!(g.at_position(0, 0), None);
    }
}
