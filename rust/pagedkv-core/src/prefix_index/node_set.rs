//! The nodes one replica holds: a hash set of node ids while the replica holds
//! few of the arena's slots, a bitmap over the slots once it holds many.
//!
//! The bitmap costs one bit per slot up to the highest id held, the hash set
//! about six to ten bytes per id, so the set turns into a bitmap when the ids
//! held are at least one in [`TO_DENSE`] of that range (the bitmap is then no
//! larger), and back when they fall below one in [`TO_SPARSE`] (a gap of 4x,
//! so that a replica near the line does not switch back and forth). A bitmap
//! walks its ids in slot order, which reads the arena front to back: a clear
//! of a replica that holds many nodes streams through memory instead of
//! jumping at random, and each store or removal sets or clears a bit in a
//! small array rather than probing a table.

use hashbrown::HashSet;
use rustc_hash::FxBuildHasher;

use super::arena::NodeId;

/// A hash set becomes a bitmap at this many slots of range per id held, or fewer.
const TO_DENSE: usize = 48;
/// A bitmap becomes a hash set past this many slots of range per id held.
const TO_SPARSE: usize = 4 * TO_DENSE;
/// Sets smaller than this stay hash sets: a bitmap pays off in the walk of a
/// large replica's clear, and a small set switching forms as it grows would
/// leave memory behind for little gain.
const MIN_DENSE: usize = 4_096;

#[derive(Clone, Debug)]
pub(super) enum NodeSet {
    /// The ids, and one past the highest id inserted.
    Sparse(HashSet<NodeId, FxBuildHasher>, u32),
    /// One bit per slot, and how many are set.
    Dense(Vec<u64>, usize),
}

impl Default for NodeSet {
    fn default() -> Self {
        Self::Sparse(HashSet::default(), 0)
    }
}

impl NodeSet {
    pub(super) fn len(&self) -> usize {
        match self {
            Self::Sparse(set, _) => set.len(),
            Self::Dense(_, n) => *n,
        }
    }

    pub(super) fn contains(&self, id: NodeId) -> bool {
        match self {
            Self::Sparse(set, _) => set.contains(&id),
            Self::Dense(words, _) => words
                .get((id.0 >> 6) as usize)
                .is_some_and(|w| w >> (id.0 & 63) & 1 != 0),
        }
    }

    /// Adds an id; whether it was new.
    pub(super) fn insert(&mut self, id: NodeId) -> bool {
        match self {
            Self::Sparse(set, end) => {
                *end = (*end).max(id.0 + 1);
                let new = set.insert(id);
                if new && set.len() >= MIN_DENSE && set.len() * TO_DENSE >= *end as usize {
                    self.make_dense();
                }
                new
            }
            Self::Dense(words, n) => {
                let w = (id.0 >> 6) as usize;
                if w >= words.len() {
                    words.resize(w + 1, 0);
                }
                let bit = 1u64 << (id.0 & 63);
                let new = words[w] & bit == 0;
                words[w] |= bit;
                *n += usize::from(new);
                if new && *n * TO_SPARSE < words.len() * 64 {
                    self.make_sparse();
                }
                new
            }
        }
    }

    /// Drops an id; whether it was there.
    pub(super) fn remove(&mut self, id: NodeId) -> bool {
        match self {
            Self::Sparse(set, _) => set.remove(&id),
            Self::Dense(words, n) => {
                let Some(word) = words.get_mut((id.0 >> 6) as usize) else {
                    return false;
                };
                let bit = 1u64 << (id.0 & 63);
                let was = *word & bit != 0;
                *word &= !bit;
                *n -= usize::from(was);
                if was && *n * TO_SPARSE < words.len() * 64 {
                    self.make_sparse();
                }
                was
            }
        }
    }

    /// The ids: in slot order for a bitmap, in no set order for a hash set.
    pub(super) fn iter(&self) -> impl Iterator<Item = NodeId> + '_ {
        let (sparse, dense) = match self {
            Self::Sparse(set, _) => (Some(set.iter().copied()), None),
            Self::Dense(words, _) => (None, Some(dense_ids(words))),
        };
        sparse
            .into_iter()
            .flatten()
            .chain(dense.into_iter().flatten())
    }

    /// Appends the ids to `out` in [`Self::iter`]'s order, each form walked
    /// by its own loop (a clear's walk, without the per-id step of a chained
    /// iterator).
    pub(super) fn append_to(&self, out: &mut Vec<NodeId>) {
        out.reserve(self.len());
        match self {
            Self::Sparse(set, _) => out.extend(set.iter().copied()),
            Self::Dense(words, _) => {
                // `dense_ids`' walk written out: extending from that iterator
                // made the warm 1e5 x 64 clear 4 % slower (0.089 against 0.085 ms).
                for (w, &word) in words.iter().enumerate() {
                    let mut bits = word;
                    while bits != 0 {
                        out.push(NodeId((w as u32) << 6 | bits.trailing_zeros()));
                        bits &= bits - 1;
                    }
                }
            }
        }
    }

    fn make_dense(&mut self) {
        if let Self::Sparse(set, end) = self {
            let mut words = vec![0u64; (*end as usize).div_ceil(64)];
            for id in set.iter() {
                words[(id.0 >> 6) as usize] |= 1 << (id.0 & 63);
            }
            *self = Self::Dense(words, set.len());
        }
    }

    fn make_sparse(&mut self) {
        if let Self::Dense(words, _) = self {
            let set: HashSet<NodeId, FxBuildHasher> = dense_ids(words).collect();
            let end = words.len() as u32 * 64;
            *self = Self::Sparse(set, end);
        }
    }

    /// Whether the set holds as a bitmap (for tests).
    #[cfg(test)]
    fn is_dense(&self) -> bool {
        matches!(self, Self::Dense(..))
    }
}

/// The ids set in a bitmap, in order.
fn dense_ids(words: &[u64]) -> impl Iterator<Item = NodeId> + '_ {
    words.iter().enumerate().flat_map(|(w, &word)| {
        let mut bits = word;
        std::iter::from_fn(move || {
            if bits == 0 {
                return None;
            }
            let b = bits.trailing_zeros();
            bits &= bits - 1;
            Some(NodeId((w as u32) << 6 | b))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::{MIN_DENSE, NodeId, NodeSet, TO_DENSE};
    use std::collections::BTreeSet;

    /// Inserts and removals against a model, through both forms and the
    /// switches between them: same answers, same members, slot order once
    /// dense.
    #[test]
    fn a_node_set_agrees_with_a_model_through_both_forms() {
        let mut rng = pagedkv_splitmix::SplitMix64(11);
        let mut set = NodeSet::default();
        let mut model = BTreeSet::new();
        let (mut dense_seen, mut sparse_again) = (false, false);
        for step in 0..60_000u32 {
            // Dense phases (ids below 2^14) and sparse ones (ids up to 2^22).
            let range = if (step / 20_000) % 2 == 0 {
                1 << 14
            } else {
                1 << 22
            };
            let id = NodeId(rng.below(range) as u32);
            // Mostly inserts early in a phase, mostly removals late.
            let insert = if step % 20_000 < 12_000 {
                rng.below(20) != 0
            } else {
                rng.below(10) == 0
            };
            if insert {
                assert_eq!(set.insert(id), model.insert(id.0), "step {step}");
            } else {
                let victim = model.iter().next().copied().map_or(id, NodeId);
                assert_eq!(set.remove(victim), model.remove(&victim.0), "step {step}");
            }
            assert_eq!(set.len(), model.len(), "step {step}");
            if set.is_dense() {
                dense_seen = true;
                let ids: Vec<u32> = set.iter().map(|x| x.0).collect();
                if step % 501 == 0 {
                    assert_eq!(ids, model.iter().copied().collect::<Vec<_>>());
                }
            } else if dense_seen {
                sparse_again = true;
            }
            if step % 997 == 0 {
                for probe in 0..64 {
                    let p = NodeId(rng.below(range) as u32 + probe);
                    assert_eq!(set.contains(p), model.contains(&p.0));
                }
                let mut ids: Vec<u32> = set.iter().map(|x| x.0).collect();
                let mut appended = vec![NodeId(u32::MAX)];
                set.append_to(&mut appended);
                assert_eq!(
                    appended[0],
                    NodeId(u32::MAX),
                    "appends, keeps what is there"
                );
                assert_eq!(appended[1..], set.iter().collect::<Vec<_>>()[..]);
                ids.sort_unstable();
                assert_eq!(ids, model.iter().copied().collect::<Vec<_>>());
            }
        }
        assert!(
            dense_seen && sparse_again,
            "both forms and both switches ran"
        );
    }

    #[test]
    fn a_set_turns_dense_at_one_id_in_48_of_its_range_from_its_minimum_size() {
        let mut set = NodeSet::default();
        for i in 0..(MIN_DENSE as u32 - 1) {
            set.insert(NodeId(i));
        }
        assert!(!set.is_dense(), "below the minimum size");
        set.insert(NodeId(MIN_DENSE as u32 - 1));
        assert!(set.is_dense());
        let mut sparse = NodeSet::default();
        for i in 0..MIN_DENSE as u32 {
            // Spaced one past the line: stays a hash set.
            sparse.insert(NodeId(i * (TO_DENSE as u32 + 1)));
        }
        assert!(!sparse.is_dense());
    }
}
