//! The prefix index's nodes: one `Vec` of (hash, node) slots with a free list,
//! and a table from hash to slot. Per-replica sets hold 4-byte slot ids, and a
//! clear walks them without hashing; a query's probe costs one table slot of 4
//! bytes plus the node.
//!
//! A clear leaves the nodes it empties in the table, vacant: a vacant node reads
//! as absent (every lookup, [`Nodes::len`], [`Nodes::iter`]), a store of its
//! hash takes it back as a new node, and later stores take the vacant ones out
//! of the table a few at a time ([`Nodes::reclaim`]). The clear then costs one
//! node per block, without the table's probes.

use std::hash::BuildHasher;

use hashbrown::HashTable;
use pagedkv_arch::prefetch;
use rustc_hash::FxBuildHasher;

use super::node::{Node, Spread};

/// A node's slot in the arena (stable while the node lives).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct NodeId(pub(super) u32);

#[derive(Clone, Debug)]
struct Slot {
    hash: u64,
    node: Node,
}

#[derive(Clone, Debug, Default)]
pub(super) struct Nodes {
    slots: Vec<Slot>,
    /// Slots of removed nodes, reused first.
    free: Vec<u32>,
    /// Slots of the nodes clears left vacant, to reclaim; an entry is stale
    /// when its node was stored again or reclaimed already.
    vacant: Vec<u32>,
    /// Nodes in the table without holders (exact).
    num_vacant: usize,
    table: HashTable<u32>,
}

fn fx(h: u64) -> u64 {
    FxBuildHasher.hash_one(h)
}

impl Nodes {
    /// Live nodes (the vacant ones left out).
    pub(super) fn len(&self) -> usize {
        self.table.len() - self.num_vacant
    }

    /// The slot of a hash in the table, vacant or not.
    fn slot_of(&self, h: u64) -> Option<u32> {
        let slots = &self.slots;
        self.table
            .find(fx(h), |&i| slots[i as usize].hash == h)
            .copied()
    }

    /// The slot of a held hash.
    pub(super) fn id(&self, h: u64) -> Option<NodeId> {
        self.slot_of(h)
            .filter(|&i| !self.slots[i as usize].node.is_empty())
            .map(NodeId)
    }

    pub(super) fn get(&self, h: u64) -> Option<&Node> {
        self.id(h).map(|id| self.node(id))
    }

    pub(super) fn node(&self, id: NodeId) -> &Node {
        &self.slots[id.0 as usize].node
    }

    pub(super) fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.slots[id.0 as usize].node
    }

    pub(super) fn hash(&self, id: NodeId) -> u64 {
        self.slots[id.0 as usize].hash
    }

    /// The node of `h`, a new one (child of `parent`) if it is not held.
    pub(super) fn get_or_insert(&mut self, h: u64, parent: Option<u64>) -> NodeId {
        if let Some(i) = self.slot_of(h) {
            let node = &mut self.slots[i as usize].node;
            if node.is_empty() {
                // A vacant node, new again: its old parent is forgotten.
                *node = Node::new(parent);
                self.num_vacant -= 1;
            }
            return NodeId(i);
        }
        let slot = Slot {
            hash: h,
            node: Node::new(parent),
        };
        let i = if let Some(i) = self.free.pop() {
            self.slots[i as usize] = slot;
            i
        } else {
            self.slots.push(slot);
            u32::try_from(self.slots.len() - 1).unwrap_or(u32::MAX)
        };
        let slots = &self.slots;
        self.table
            .insert_unique(fx(h), i, |&j| fx(slots[j as usize].hash));
        NodeId(i)
    }

    /// Starts loading a node's list of holders, when it has one (its slot
    /// should be loaded by now).
    pub(super) fn prefetch_list(&self, id: NodeId) {
        if let Some(s) = self.slots.get(id.0 as usize) {
            s.node.prefetch_list();
        }
    }

    /// Starts loading a node's slot.
    pub(super) fn prefetch(&self, id: NodeId) {
        if let Some(s) = self.slots.get(id.0 as usize) {
            prefetch(s);
        }
    }

    /// Reads a node's slot and starts loading its list of holders where a
    /// replica's holders should be ([`Spread`]), when it has one.
    pub(super) fn prefetch_list_near(&self, id: NodeId, spread: Spread) {
        if let Some(s) = self.slots.get(id.0 as usize) {
            s.node.prefetch_list_near(spread);
        }
    }

    /// Removes a node (its slot is reused by a later insert).
    pub(super) fn remove(&mut self, id: NodeId) {
        self.unlink(id);
    }

    /// Takes a node out of the table and frees its slot; false when the slot
    /// is not in the table (freed already).
    fn unlink(&mut self, id: NodeId) -> bool {
        let h = self.hash(id);
        let Ok(entry) = self.table.find_entry(fx(h), |&i| i == id.0) else {
            return false;
        };
        entry.remove();
        self.slots[id.0 as usize].node = Node::new(None);
        self.free.push(id.0);
        true
    }

    /// Leaves a node a clear emptied in the table, vacant, for a later
    /// [`Nodes::reclaim`].
    pub(super) fn vacate(&mut self, id: NodeId) {
        self.vacant.push(id.0);
        self.num_vacant += 1;
    }

    /// Takes up to `budget` vacant nodes out of the table (stale entries count).
    pub(super) fn reclaim(&mut self, budget: usize) {
        for _ in 0..budget {
            let Some(i) = self.vacant.pop() else {
                return;
            };
            if self.slots[i as usize].node.is_empty() && self.unlink(NodeId(i)) {
                self.num_vacant -= 1;
            }
        }
    }

    /// Every live node with its slot and hash.
    pub(super) fn iter(&self) -> impl Iterator<Item = (NodeId, u64, &Node)> {
        self.table.iter().filter_map(|&i| {
            let s = &self.slots[i as usize];
            (!s.node.is_empty()).then_some((NodeId(i), s.hash, &s.node))
        })
    }

    /// Checks the vacant nodes' count and list against the table.
    pub(super) fn check_vacant(&self) -> Result<(), String> {
        let listed: rustc_hash::FxHashSet<u32> = self.vacant.iter().copied().collect();
        let mut n = 0;
        for &i in &self.table {
            if self.slots[i as usize].node.is_empty() {
                n += 1;
                if !listed.contains(&i) {
                    return Err(format!("vacant slot {i} is not listed"));
                }
            }
        }
        if n == self.num_vacant {
            Ok(())
        } else {
            Err(format!("{n} vacant nodes, {} counted", self.num_vacant))
        }
    }
}
