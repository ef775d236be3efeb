//! One hash's entry in the prefix index: its parent and its holders.
//!
//! Most hashes are held by one or two (replica, group) pairs, so those are kept
//! inline in the node; more go to a boxed list, with a map to them past
//! [`INDEXED_HOLDERS`]. A node is 40 bytes: the parent, then the holders with
//! the "has a parent" flag in their padding.

use rustc_hash::FxHashMap;

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

/// Holders past which a node keeps a map to them: a hash stored under many
/// groups (or replicas) costs the same per event as one under a few.
const INDEXED_HOLDERS: usize = 16;

/// `(replica, group)` -> position in the list, and holders per replica.
#[derive(Clone, Debug, Default)]
struct HolderIndex {
    pos: FxHashMap<(u32, u32), u32>,
    per_replica: FxHashMap<u32, u32>,
}

impl HolderIndex {
    fn build(holders: &[Holder]) -> Self {
        let mut ix = Self::default();
        for (i, x) in holders.iter().enumerate() {
            ix.pos.insert((x.replica, x.group), i as u32);
            *ix.per_replica.entry(x.replica).or_insert(0) += 1;
        }
        ix
    }
}

/// Three or more holders.
#[derive(Clone, Debug)]
struct Many {
    list: Vec<Holder>,
    /// With more than [`INDEXED_HOLDERS`] holders: where each is.
    index: Option<HolderIndex>,
}

impl Many {
    fn push(&mut self, x: Holder) {
        self.list.push(x);
        let n = self.list.len();
        match &mut self.index {
            Some(ix) => {
                ix.pos.insert((x.replica, x.group), (n - 1) as u32);
                *ix.per_replica.entry(x.replica).or_insert(0) += 1;
            }
            None if n > INDEXED_HOLDERS => self.index = Some(HolderIndex::build(&self.list)),
            None => {}
        }
    }

    fn swap_remove(&mut self, p: usize) {
        let x = self.list.swap_remove(p);
        if let Some(ix) = &mut self.index {
            ix.pos.remove(&(x.replica, x.group));
            if let Some(moved) = self.list.get(p) {
                ix.pos.insert((moved.replica, moved.group), p as u32);
            }
            if let Some(c) = ix.per_replica.get_mut(&x.replica) {
                *c -= 1;
                if *c == 0 {
                    ix.per_replica.remove(&x.replica);
                }
            }
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
    Many(Box<Many>, bool),
}

#[derive(Clone, Debug)]
pub(super) struct Node {
    /// Meaningful only with the flag in `holders` set.
    parent: u64,
    /// Never empty outside a call: a node without holders is removed.
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
            Holders::Many(m, _) => &m.list,
        }
    }

    fn holders_mut(&mut self) -> &mut [Holder] {
        match &mut self.holders {
            Holders::Empty(_) => &mut [],
            Holders::One(x, _) => std::slice::from_mut(x),
            Holders::Two(xs, _) => xs,
            Holders::Many(m, _) => &mut m.list,
        }
    }

    fn index(&self) -> Option<&HolderIndex> {
        match &self.holders {
            Holders::Many(m, _) => m.index.as_ref(),
            _ => None,
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        matches!(self.holders, Holders::Empty(_))
    }

    fn find(&self, replica: u32, group: u32) -> Option<usize> {
        match self.index() {
            Some(ix) => ix.pos.get(&(replica, group)).map(|&p| p as usize),
            None => self
                .holders()
                .iter()
                .position(|x| x.replica == replica && x.group == group),
        }
    }

    pub(super) fn holds_any(&self, replica: u32) -> bool {
        match self.index() {
            Some(ix) => ix.per_replica.contains_key(&replica),
            None => self.holders().iter().any(|x| x.replica == replica),
        }
    }

    pub(super) fn held_by(&self, replica: u32, group: Option<u32>) -> bool {
        match group {
            Some(g) => match self.index() {
                Some(ix) => (0..3).any(|t| ix.pos.contains_key(&(replica, g | t << TIER_SHIFT))),
                None => self
                    .holders()
                    .iter()
                    .any(|x| x.replica == replica && key_group(x.group) == g),
            },
            None => self.holds_any(replica),
        }
    }

    /// The fastest tier `replica` holds this hash in (`group`, or any for None).
    pub(super) fn best_tier(&self, replica: u32, group: Option<u32>) -> Option<Tier> {
        self.holders()
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
                Holders::Many(Box::new(Many { list, index: None }), f)
            }
            Holders::Many(mut m, _) => {
                m.push(new);
                Holders::Many(m, f)
            }
        };
    }

    fn remove_at(&mut self, p: usize) {
        let f = self.has_parent();
        match &mut self.holders {
            Holders::Empty(_) => {}
            Holders::One(..) => self.holders = Holders::Empty(f),
            Holders::Two(xs, _) => self.holders = Holders::One(xs[1 - p], f),
            Holders::Many(m, _) => m.swap_remove(p),
        }
    }

    /// A list of two holders or fewer goes back inline.
    fn inline_small(&mut self) {
        let f = self.has_parent();
        if let Holders::Many(m, _) = &self.holders {
            self.holders = match m.list[..] {
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

    /// Drops every holder `gone` picks (in place: a holder map is kept up to
    /// date, not rebuilt).
    fn remove_where(&mut self, gone: impl Fn(&Holder) -> bool) {
        let mut i = 0;
        while let Some(&x) = self.holders().get(i) {
            if gone(&x) {
                // What was last (or the other of two) is at `i` now.
                self.remove_at(i);
            } else {
                i += 1;
            }
        }
        self.inline_small();
    }

    /// Drops every holder of `replica`.
    pub(super) fn remove_replica(&mut self, replica: u32) {
        match &self.holders {
            Holders::Empty(_) => {}
            &Holders::One(a, f) => {
                if a.replica == replica {
                    self.holders = Holders::Empty(f);
                }
            }
            &Holders::Two([a, b], f) => {
                self.holders = match (a.replica == replica, b.replica == replica) {
                    (false, false) => return,
                    (true, true) => Holders::Empty(f),
                    (true, false) => Holders::One(b, f),
                    (false, true) => Holders::One(a, f),
                };
            }
            Holders::Many(m, _) => {
                if m.index.is_none() || self.holds_any(replica) {
                    self.remove_where(|x| x.replica == replica);
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

    /// Whether the holder map, where there is one, matches the list.
    pub(super) fn index_matches(&self) -> bool {
        let Some(ix) = self.index() else {
            return true;
        };
        let holders = self.holders();
        let mut per_replica: FxHashMap<u32, u32> = FxHashMap::default();
        for (i, x) in holders.iter().enumerate() {
            if ix.pos.get(&(x.replica, x.group)) != Some(&(i as u32)) {
                return false;
            }
            *per_replica.entry(x.replica).or_insert(0) += 1;
        }
        ix.pos.len() == holders.len() && ix.per_replica == per_replica
    }
}
