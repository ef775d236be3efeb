//! One hash's entry in the prefix index: its parent and its holders.
//!
//! Most hashes are held by one or two (replica, group) pairs, so those are kept
//! inline in the node; more go to a list sorted by (replica, group), searched
//! by bisection: a hash stored under many groups (or replicas) costs little
//! more per event than one under a few, and a replica's holders are adjacent.
//! A node is 40 bytes: the parent, then the holders with the "has a parent"
//! flag in their padding.

use super::Tier;

/// A holder's key packs its tier above its group: `tier << 30 | group`.
pub(super) const TIER_SHIFT: u32 = 30;
pub(super) const GROUP_MASK: u32 = (1 << TIER_SHIFT) - 1;

pub(super) fn key_group(key: u32) -> u32 {
    key & GROUP_MASK
}

pub(super) fn key_tier(key: u32) -> Tier {
    Tier::from_bits(key >> TIER_SHIFT)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Holder {
    pub(super) replica: u32,
    /// The group and the tier (`group_key`).
    pub(super) group: u32,
    /// Blocks of this replica and group cached under the hash (>= 1).
    pub(super) count: u32,
}

impl Holder {
    fn new(replica: u32, group: u32) -> Self {
        Self {
            replica,
            group,
            count: 1,
        }
    }
}

/// The holders; each variant carries whether the node has a parent (it fits in
/// the padding after the tag).
#[derive(Clone, Debug)]
enum Holders {
    /// Only while a node is being built or torn down.
    Empty(bool),
    One(Holder, bool),
    Two([Holder; 2], bool),
    /// Three or more, sorted by (replica, group).
    Many(Vec<Holder>, bool),
}

fn sort_key(x: &Holder) -> (u32, u32) {
    (x.replica, x.group)
}

/// The holders of `replica` in a sorted list.
fn replica_range(list: &[Holder], replica: u32) -> &[Holder] {
    let lo = list.partition_point(|x| x.replica < replica);
    let n = list[lo..].partition_point(|x| x.replica == replica);
    &list[lo..lo + n]
}

/// Where a replica's holders would sit in a sorted list if the replica ids
/// were spread evenly: the replica's id over the number of ids, in 0.32 fixed
/// point (worked out once per clear, so that each list costs a multiply, not a
/// division). Exact when every replica holds the hash in one group, close
/// when most do.
#[derive(Clone, Copy, Debug)]
pub(super) struct Spread(u32);

impl Spread {
    /// Replica `replica` of `replicas` ids.
    pub(super) fn of(replica: u32, replicas: u32) -> Self {
        // Rounded up, so that a list of one holder per replica maps exactly.
        let n = u64::from(replicas.max(1));
        let frac = (u64::from(replica) << 32).div_ceil(n);
        Self(u32::try_from(frac).unwrap_or(u32::MAX))
    }

    /// The guessed index in a list of `len` holders.
    fn at(self, len: usize) -> usize {
        let at = ((len as u64 * u64::from(self.0)) >> 32) as usize;
        at.min(len.saturating_sub(1))
    }
}

/// The first index of a sorted list whose holder is not below `replica`,
/// searched from `from` outwards (steps doubling, then a bisection), so that
/// a good guess reads a line or two instead of the bisection's scattered
/// probes.
fn first_of_replica(list: &[Holder], replica: u32, from: usize) -> usize {
    if list.is_empty() {
        return 0;
    }
    let from = from.min(list.len() - 1);
    let below = |i: usize| list[i].replica < replica;
    let (mut lo, mut hi) = if below(from) {
        // The answer is past `from`: step right until a holder is not below.
        let (mut lo, mut step) = (from + 1, 1);
        while lo + step <= list.len() && below(lo + step - 1) {
            lo += step;
            step *= 2;
        }
        (lo, (lo + step).min(list.len()))
    } else {
        // At `from` or before it: step left while the holder is not below.
        let (mut hi, mut step) = (from, 1);
        while hi >= step && !below(hi - step) {
            hi -= step;
            step *= 2;
        }
        (hi.saturating_sub(step), hi)
    };
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if below(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

#[derive(Clone, Debug)]
pub(super) struct Node {
    /// Meaningful only with the flag in `holders` set.
    parent: u64,
    /// Never empty outside a call, unless vacant: a node without holders is
    /// removed, or left vacant by a clear (see the arena).
    holders: Holders,
}

impl Node {
    pub(super) fn new(parent: Option<u64>) -> Self {
        Self {
            parent: parent.unwrap_or(0),
            holders: Holders::Empty(parent.is_some()),
        }
    }

    fn has_parent(&self) -> bool {
        match self.holders {
            Holders::Empty(f) | Holders::One(_, f) | Holders::Two(_, f) | Holders::Many(_, f) => f,
        }
    }

    pub(super) fn parent(&self) -> Option<u64> {
        self.has_parent().then_some(self.parent)
    }

    /// Records `parent` unless a parent is known already.
    pub(super) fn adopt(&mut self, parent: Option<u64>) {
        if let Some(p) = parent
            && !self.has_parent()
        {
            self.parent = p;
            match &mut self.holders {
                Holders::Empty(f)
                | Holders::One(_, f)
                | Holders::Two(_, f)
                | Holders::Many(_, f) => {
                    *f = true;
                }
            }
        }
    }

    pub(super) fn holders(&self) -> &[Holder] {
        match &self.holders {
            Holders::Empty(_) => &[],
            Holders::One(x, _) => std::slice::from_ref(x),
            Holders::Two(xs, _) => xs,
            Holders::Many(list, _) => list,
        }
    }

    fn holders_mut(&mut self) -> &mut [Holder] {
        match &mut self.holders {
            Holders::Empty(_) => &mut [],
            Holders::One(x, _) => std::slice::from_mut(x),
            Holders::Two(xs, _) => xs,
            Holders::Many(list, _) => list,
        }
    }

    /// The holders of `replica` (all of them, unsorted, for an inline pair).
    fn of_replica(&self, replica: u32) -> &[Holder] {
        match &self.holders {
            Holders::Many(list, _) => replica_range(list, replica),
            _ => self.holders(),
        }
    }

    /// Starts loading a list of three or more holders.
    pub(super) fn prefetch_list(&self) {
        if let Holders::Many(list, _) = &self.holders
            && let Some(x) = list.first()
        {
            pagedkv_arch::prefetch(x);
        }
    }

    /// Starts loading the part of a list of three or more holders where
    /// the replica's would be ([`Spread`]).
    pub(super) fn prefetch_list_near(&self, spread: Spread) {
        if let Holders::Many(list, _) = &self.holders
            && let Some(x) = list.get(spread.at(list.len()))
        {
            pagedkv_arch::prefetch(x);
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        matches!(self.holders, Holders::Empty(_))
    }

    fn find(&self, replica: u32, group: u32) -> Option<usize> {
        match &self.holders {
            Holders::Many(list, _) => list.binary_search_by_key(&(replica, group), sort_key).ok(),
            _ => self
                .holders()
                .iter()
                .position(|x| x.replica == replica && x.group == group),
        }
    }

    pub(super) fn holds_any(&self, replica: u32) -> bool {
        self.of_replica(replica)
            .iter()
            .any(|x| x.replica == replica)
    }

    pub(super) fn held_by(&self, replica: u32, group: Option<u32>) -> bool {
        match group {
            Some(g) => self
                .of_replica(replica)
                .iter()
                .any(|x| x.replica == replica && key_group(x.group) == g),
            None => self.holds_any(replica),
        }
    }

    /// The fastest tier `replica` holds this hash in (`group`, or any for None).
    pub(super) fn best_tier(&self, replica: u32, group: Option<u32>) -> Option<Tier> {
        self.of_replica(replica)
            .iter()
            .filter(|x| x.replica == replica && group.is_none_or(|g| key_group(x.group) == g))
            .map(|x| key_tier(x.group))
            .min()
    }

    /// One more block of `replica`'s `group` under this hash.
    pub(super) fn add(&mut self, replica: u32, group: u32) {
        if let Some(p) = self.find(replica, group) {
            let x = &mut self.holders_mut()[p];
            x.count = x.count.saturating_add(1);
            return;
        }
        let new = Holder::new(replica, group);
        let f = self.has_parent();
        self.holders = match std::mem::replace(&mut self.holders, Holders::Empty(f)) {
            Holders::Empty(_) => Holders::One(new, f),
            Holders::One(a, _) => Holders::Two([a, new], f),
            Holders::Two([a, b], _) => {
                let mut list = Vec::with_capacity(4);
                list.extend([a, b, new]);
                list.sort_unstable_by_key(sort_key);
                Holders::Many(list, f)
            }
            Holders::Many(mut list, _) => {
                let p = list.partition_point(|x| sort_key(x) < (replica, group));
                list.insert(p, new);
                Holders::Many(list, f)
            }
        };
    }

    fn remove_at(&mut self, p: usize) {
        let f = self.has_parent();
        match &mut self.holders {
            Holders::Empty(_) => {}
            Holders::One(..) => self.holders = Holders::Empty(f),
            Holders::Two(xs, _) => self.holders = Holders::One(xs[1 - p], f),
            Holders::Many(list, _) => {
                list.remove(p);
            }
        }
    }

    /// A list of two holders or fewer goes back inline.
    fn inline_small(&mut self) {
        let f = self.has_parent();
        if let Holders::Many(list, _) = &self.holders {
            self.holders = match list[..] {
                [] => Holders::Empty(f),
                [a] => Holders::One(a, f),
                [a, b] => Holders::Two([a, b], f),
                _ => return,
            };
        }
    }

    /// One block fewer of `replica`'s `group`: None when it held none, else
    /// whether the replica still holds the hash in some group.
    pub(super) fn remove_one(&mut self, replica: u32, group: u32) -> Option<bool> {
        let p = self.find(replica, group)?;
        let x = &mut self.holders_mut()[p];
        x.count -= 1;
        if x.count > 0 {
            return Some(true);
        }
        self.remove_at(p);
        self.inline_small();
        Some(self.holds_any(replica))
    }

    /// Drops every holder `gone` picks.
    fn remove_where(&mut self, gone: impl Fn(&Holder) -> bool) {
        if let Holders::Many(list, _) = &mut self.holders {
            list.retain(|x| !gone(x));
        } else {
            let mut i = 0;
            while let Some(&x) = self.holders().get(i) {
                if gone(&x) {
                    // The other of two is at `i` now.
                    self.remove_at(i);
                } else {
                    i += 1;
                }
            }
        }
        self.inline_small();
    }

    /// Drops every holder of `replica` (the search of a long list starts
    /// where `spread`, the replica's, puts it).
    pub(super) fn remove_replica(&mut self, replica: u32, spread: Spread) {
        match &mut self.holders {
            Holders::Empty(_) => {}
            &mut Holders::One(a, f) => {
                if a.replica == replica {
                    self.holders = Holders::Empty(f);
                }
            }
            &mut Holders::Two([a, b], f) => {
                self.holders = match (a.replica == replica, b.replica == replica) {
                    (false, false) => return,
                    (true, true) => Holders::Empty(f),
                    (true, false) => Holders::One(b, f),
                    (false, true) => Holders::One(a, f),
                };
            }
            Holders::Many(list, _) => {
                let lo = first_of_replica(list, replica, spread.at(list.len()));
                let n = list[lo..].partition_point(|x| x.replica == replica);
                if n > 0 {
                    list.drain(lo..lo + n);
                    // Kept as a list while it holds more than one: a clear
                    // frees no memory a later store would take back.
                    if list.len() <= 1 {
                        self.inline_small();
                    }
                }
            }
        }
    }

    /// Drops every holder of `replica` in `tier`; whether it still holds the
    /// hash (in another tier).
    pub(super) fn remove_tier(&mut self, replica: u32, tier: Tier) -> bool {
        self.remove_where(|x| x.replica == replica && key_tier(x.group) == tier);
        self.holds_any(replica)
    }

    /// Whether a list of three or more holders is sorted by (replica, group).
    pub(super) fn in_order(&self) -> bool {
        match &self.holders {
            Holders::Many(list, _) => list.windows(2).all(|w| sort_key(&w[0]) < sort_key(&w[1])),
            _ => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Holder, Spread, first_of_replica};

    /// With every replica holding the hash once, the guess is exact.
    #[test]
    fn the_guess_is_exact_when_every_replica_holds_the_hash_once() {
        for replicas in [3u32, 8, 24, 64, 1000] {
            for replica in 0..replicas {
                assert_eq!(
                    Spread::of(replica, replicas).at(replicas as usize),
                    replica as usize
                );
            }
        }
    }

    /// The search from a guess finds what a bisection of the whole list
    /// finds, for every replica and every starting point, over lists with
    /// gaps, repeats (several groups) and replicas absent at either end.
    #[test]
    fn the_search_from_a_guess_agrees_with_a_bisection() {
        let mut rng = pagedkv_splitmix::SplitMix64(7);
        for _ in 0..300 {
            let len = rng.between(0, 40) as usize;
            let mut list: Vec<Holder> = (0..len)
                .map(|_| Holder::new(rng.below(24) as u32, rng.below(3) as u32))
                .collect();
            list.sort_unstable_by_key(|x| (x.replica, x.group));
            list.dedup_by_key(|x| (x.replica, x.group));
            for replica in 0..26 {
                let want = list.partition_point(|x| x.replica < replica);
                for from in 0..list.len().max(1) + 2 {
                    assert_eq!(
                        first_of_replica(&list, replica, from),
                        want,
                        "replica {replica} from {from} in {list:?}"
                    );
                }
                let g = Spread::of(replica, 24).at(list.len());
                assert!(g < list.len().max(1));
            }
        }
    }
}
