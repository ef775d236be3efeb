//! ARC's ghosts in the prefix map's own table: a key evicted from the cache
//! (under ARC) keeps its lane in its home bucket, its tag in place and its
//! entry word turned into a *ghost word* (the ghost bit, its list, the low
//! bits of the ring slot that lists it and 16 more bits of its hash). A
//! ghost costs no line the eviction does not read already (the removal
//! found the key's lane), and a key cached again finds its ghost in the
//! bucket its insertion reads anyway; the lookups skip ghost lanes (a ghost
//! word names no entry).
//!
//! Ghosts are few per bucket, kept only where they cost nothing:
//! - only in the key's home bucket (a key that overflowed moves its ghost
//!   home when a lane is free there, or leaves none), so a ghost never
//!   changes the overflow counts;
//! - a key placed in a bucket without an empty lane takes a ghost's lane,
//!   dropping the ghost, so ghosts never make keys overflow;
//! - a growing table drops them all (a ghost keeps too little of its hash
//!   to find its new home). A pool under ARC sizes its table for them.
//!
//! A ghost is recognised by its tag and 16 bits of the hash (31 bits: a
//! stranger passes for a ghost once in 2^31 ghost lanes matched), and
//! forgotten through its [`GhostRecord`] (its lane and ghost word): a record
//! whose lane no longer holds that word was hit, dropped or forgotten already.

use super::{
    ENTRIES, LANES, PrefixMap, Slot, WORDS, first_lane, matching_lanes, set_tag, tag, tag_at,
};
use pagedkv_arch::prefetch;

/// The ghost bit of an entry word (entry numbers stay below it).
const GHOST: u32 = 1 << 31;
/// A ghost word's list bit (B2).
const SECOND: u32 = 1 << 30;
/// The ring slot's bits a ghost word keeps.
const SLOT_BITS: u32 = 14;

/// Whether an entry word is a ghost's.
pub(super) fn is_ghost(word: u32) -> bool {
    word & GHOST != 0
}

/// The ghost word of the key hashing to `h`, listed in `list` at ring slot `slot`.
fn ghost_word(h: u64, list: usize, slot: usize) -> u32 {
    let check = (h >> 16) as u32 & 0xffff;
    let slot = (slot as u32 & ((1 << SLOT_BITS) - 1)) << 16;
    GHOST | if list == 1 { SECOND } else { 0 } | slot | check
}

fn list_of(word: u32) -> usize {
    usize::from(word & SECOND != 0)
}

/// Where a ghost was left and its word: what a ring keeps to forget it
/// (never 0: the word carries the ghost bit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GhostRecord(pub(crate) u64);

impl GhostRecord {
    fn new(bucket: usize, lane: usize, word: u32) -> Self {
        Self(((bucket * LANES + lane) as u64) << 32 | u64::from(word))
    }

    fn bucket(self) -> usize {
        (self.0 >> 32) as usize / LANES
    }

    fn lane(self) -> usize {
        (self.0 >> 32) as usize % LANES
    }

    fn word(self) -> u32 {
        self.0 as u32
    }
}

impl PrefixMap {
    /// Ghosts in each list (B1, B2).
    pub(crate) fn ghost_lens(&self) -> [u32; 2] {
        self.ghosts
    }

    /// The key hashing to `h`, in slot `s`, just lost its last block: leaves
    /// it as a ghost of `list` (ring slot `slot`) in its home bucket, or
    /// takes it out when that bucket has no lane for it.
    pub(super) fn leave_ghost(
        &mut self,
        h: u64,
        s: Slot,
        list: usize,
        slot: usize,
    ) -> Option<GhostRecord> {
        let word = ghost_word(h, list, slot);
        let home = self.home(h);
        if self.num_buckets * LANES > u32::MAX as usize || self.entries.len() >= 1 << 30 {
            // A record names a lane in 32 bits, and entry numbers stay far
            // below the ghost bit: a map this large keeps no ghosts.
            self.remove_slot(h, s);
            return None;
        }
        let lane = if s.bucket == home {
            self.len -= 1;
            s.lane
        } else {
            self.remove_slot(h, s);
            let bucket = self.bucket_mut(home);
            let empty = matching_lanes(bucket, 0);
            if empty == 0 {
                return None;
            }
            let lane = first_lane(empty);
            set_tag(bucket, lane, tag(h));
            lane
        };
        self.bucket_mut(home)[ENTRIES + lane] = word;
        self.ghosts[list] += 1;
        Some(GhostRecord::new(home, lane, word))
    }

    /// A key hashing to `h`, absent from the map, is about to be placed:
    /// when its home bucket holds its ghost, the ghost's lane takes entry `e`
    /// and the ghost's list comes back (`true`: B2).
    pub(super) fn take_ghost(&mut self, h: u64, e: u32) -> Option<bool> {
        let home = self.home(h);
        let check = ghost_word(h, 0, 0) & 0xffff;
        let bucket = self.bucket_mut(home);
        let mut hits = matching_lanes(bucket, tag(h));
        while hits != 0 {
            let lane = first_lane(hits);
            let w = bucket[ENTRIES + lane];
            if is_ghost(w) && w & 0xffff == check {
                bucket[ENTRIES + lane] = e;
                self.ghosts[list_of(w)] -= 1;
                return Some(list_of(w) == 1);
            }
            hits &= hits - 1;
        }
        None
    }

    /// Empties a ghost's lane in bucket `b` for a key being placed there
    /// (no lane of it empty); the lane, if the bucket holds a ghost.
    pub(super) fn drop_a_ghost(&mut self, b: usize) -> Option<usize> {
        let bucket = self.bucket(b);
        let lane = (0..LANES).find(|&l| is_ghost(bucket[ENTRIES + l]))?;
        let w = bucket[ENTRIES + lane];
        self.ghosts[list_of(w)] -= 1;
        let bucket = self.bucket_mut(b);
        set_tag(bucket, lane, 0);
        bucket[ENTRIES + lane] = 0;
        Some(lane)
    }

    /// Forgets the ghost a ring's record names, if its lane still holds it;
    /// the ghost's list then.
    pub(crate) fn forget_ghost(&mut self, r: GhostRecord) -> Option<usize> {
        if r.bucket() >= self.num_buckets {
            return None;
        }
        let bucket = self.bucket_mut(r.bucket());
        if bucket[ENTRIES + r.lane()] != r.word() || tag_at(bucket, r.lane()) == 0 {
            return None;
        }
        set_tag(bucket, r.lane(), 0);
        bucket[ENTRIES + r.lane()] = 0;
        let list = list_of(r.word());
        self.ghosts[list] -= 1;
        Some(list)
    }

    /// Starts loading the bucket a record names (a ring's next forgetting).
    pub(crate) fn prefetch_ghost(&self, r: GhostRecord) {
        if let Some(word) = self.table.get(self.base + r.bucket() * WORDS) {
            prefetch(word);
        }
    }

    /// The ghost lanes, per list, against the counts.
    pub(super) fn check_ghosts(&self) -> Result<(), String> {
        let mut held = [0u32; 2];
        for b in 0..self.num_buckets {
            let bucket = self.bucket(b);
            for lane in 0..LANES {
                let w = bucket[ENTRIES + lane];
                if is_ghost(w) {
                    if tag_at(bucket, lane) == 0 {
                        return Err(format!(
                            "prefix map bucket {b} lane {lane}: a ghost without a tag"
                        ));
                    }
                    held[list_of(w)] += 1;
                }
            }
        }
        if held == self.ghosts {
            Ok(())
        } else {
            Err(format!(
                "prefix map holds {held:?} ghosts, counts {:?}",
                self.ghosts
            ))
        }
    }
}
