//! The prefix index's nodes: one `Vec` of (hash, node) slots with a free list,
//! and a table from hash to slot. Per-replica sets hold 4-byte slot ids, and a
//! clear walks them without hashing; a query's probe costs one table slot of 4
//! bytes plus the node.

use std::hash::BuildHasher;

use hashbrown::HashTable;
use rustc_hash::FxBuildHasher;

use super::node::Node;

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
    table: HashTable<u32>,
}

fn fx(h: u64) -> u64 {
    FxBuildHasher.hash_one(h)
}

impl Nodes {
    /// Live nodes.
    pub(super) fn len(&self) -> usize {
        self.table.len()
    }

    /// The slot of a held hash.
    pub(super) fn id(&self, h: u64) -> Option<NodeId> {
        let slots = &self.slots;
        self.table
            .find(fx(h), |&i| slots[i as usize].hash == h)
            .map(|&i| NodeId(i))
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
        if let Some(id) = self.id(h) {
            return id;
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

    /// Removes a node (its slot is reused by a later insert).
    pub(super) fn remove(&mut self, id: NodeId) {
        let h = self.hash(id);
        if let Ok(entry) = self.table.find_entry(fx(h), |&i| i == id.0) {
            entry.remove();
            self.slots[id.0 as usize].node = Node::new(None);
            self.free.push(id.0);
        }
    }

    /// Every live node with its slot and hash.
    pub(super) fn iter(&self) -> impl Iterator<Item = (NodeId, u64, &Node)> {
        self.table.iter().map(|&i| {
            let s = &self.slots[i as usize];
            (NodeId(i), s.hash, &s.node)
        })
    }
}
