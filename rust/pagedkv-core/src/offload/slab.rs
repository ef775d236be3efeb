//! Nodes of a policy's keys in one slab, found through a table of 4-byte node
//! numbers hashed by the key's digest: at a million chunks a look-up reads the
//! table's control bytes, one 4-byte slot and the node, and a node keeps its
//! number while it moves between the policy's lists or heap.

use hashbrown::HashTable;

use super::keys::OffloadKey;

/// A node that carries its key.
pub(super) trait Keyed {
    fn key(&self) -> &OffloadKey;
}

/// The slab: nodes, the index of those with a key in the policy, and the
/// numbers free for reuse.
#[derive(Clone, Debug)]
pub(super) struct Slab<T> {
    pub(super) nodes: Vec<T>,
    index: HashTable<u32>,
    free: Vec<u32>,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Self {
            nodes: Vec::new(),
            index: HashTable::new(),
            free: Vec::new(),
        }
    }
}

impl<T: Keyed> Slab<T> {
    /// The node holding `key`.
    pub(super) fn find(&self, key: &OffloadKey) -> Option<usize> {
        let nodes = &self.nodes;
        self.index
            .find(key.digest(), |&i| nodes[i as usize].key() == key)
            .map(|&i| i as usize)
    }

    /// Places a node (a free number first) and indexes its key, which must
    /// not be indexed already; its number.
    pub(super) fn insert(&mut self, node: T) -> usize {
        let digest = node.key().digest();
        let i = if let Some(i) = self.free.pop() {
            self.nodes[i as usize] = node;
            i as usize
        } else {
            self.nodes.push(node);
            self.nodes.len() - 1
        };
        let nodes = &self.nodes;
        self.index
            .insert_unique(digest, i as u32, |&j| nodes[j as usize].key().digest());
        i
    }

    /// Drops node `i`'s key from the index (the node keeps its contents until
    /// released).
    pub(super) fn unindex(&mut self, i: usize) {
        let nodes = &self.nodes;
        let key = nodes[i].key();
        if let Ok(entry) = self
            .index
            .find_entry(key.digest(), |&j| nodes[j as usize].key() == key)
        {
            entry.remove();
        }
    }

    /// Node `i` (unindexed) may be reused.
    pub(super) fn release(&mut self, i: usize) {
        self.free.push(i as u32);
    }

    /// Keys indexed.
    pub(super) fn len(&self) -> usize {
        self.index.len()
    }

    /// Node numbers free for reuse.
    pub(super) fn free(&self) -> &[u32] {
        &self.free
    }

    pub(super) fn clear(&mut self) {
        self.nodes.clear();
        self.index.clear();
        self.free.clear();
    }
}
