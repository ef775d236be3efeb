//! Router-side prefix index: which replica holds the longest cached prefix of a
//! request, learnt from the KV events of many managers (one per serving replica).
//!
//! Blocks are keyed by vLLM's event form of a block hash (`u64`: the last 8
//! bytes of the digest, big-endian). Because a block hash chains its parent's,
//! a request's hash chain identifies its prefix: a replica holds a prefix of
//! `n` blocks when it holds the first `n` hashes of the chain.
//!
//! Per hash the index keeps its parent (from `BlockStored.parent_block_hash`)
//! and its holders: `(replica, group, count)`. The count matters because vLLM
//! does not de-duplicate: the same content computed twice is stored under two
//! blocks (two `BlockStored`), and evicting one of them (one `BlockRemoved`)
//! leaves the other cached. Groups are kept apart so that a sliding-window or
//! Mamba group dropping a block does not read as the full-attention group
//! dropping it. Per replica the index keeps the set of hashes it holds (as
//! slots of the node arena), so `AllBlocksCleared` costs the replica's size,
//! not the index's; the nodes it empties leave the hash table during later
//! stores (see `arena`), every read-out treating them as gone meanwhile.
//!
//! ```
//! use pagedkv_core::prefix_index::PrefixIndex;
//!
//! let mut index = PrefixIndex::new();
//! let a = index.replica("replica-a");
//! let b = index.replica("replica-b");
//! index.store(a, None, &[11, 12, 13], Some(0)).unwrap();
//! index.store(b, None, &[11, 12], Some(0)).unwrap();
//! index.store(b, Some(12), &[99], Some(0)).unwrap(); // a branch off block 12
//! let best = index.longest_prefix(&[11, 12, 13, 14], None).unwrap();
//! assert_eq!((best.replica, best.num_blocks), (a, 3));
//! index.remove(a, &[12], Some(0)).unwrap();
//! assert_eq!(index.match_lengths(&[11, 12, 13], None), vec![1, 2]);
//! assert_eq!(index.chain(99), vec![11, 12, 99]);
//! index.clear(b).unwrap();
//! assert_eq!(index.longest_prefix(&[11, 12], None).map(|m| m.replica), Some(a));
//! index.check_invariants().unwrap();
//! ```

use hashbrown::HashMap;
use rustc_hash::{FxBuildHasher, FxHashMap, FxHashSet};

use crate::error::{Error, Result};

mod arena;
mod node;
mod node_set;

use arena::{NodeId, Nodes};
use node::{GROUP_MASK, Spread, TIER_SHIFT, key_group};
use node_set::NodeSet;

/// A replica registered with [`PrefixIndex::replica`] (dense, from 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReplicaId(pub u32);

/// Where a replica holds a block: GPU memory, host memory or disk (the `medium`
/// of vLLM's events: `"GPU"`, `"CPU"`, and `"DISK"` or `"STORAGE"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// GPU memory: a hit is served as it is.
    Device = 0,
    /// Host memory: a hit is loaded first.
    Host = 1,
    /// Disk: a hit is read into host memory, then loaded.
    Disk = 2,
}

impl Tier {
    /// Every tier, fastest first.
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    /// The tier of an event's `medium` (None: the device, as vLLM's events
    /// without one).
    ///
    /// # Errors
    /// `InvalidArgument` for a medium that is none of those.
    pub fn from_medium(medium: Option<&str>) -> Result<Self> {
        match medium {
            None | Some("GPU") => Ok(Self::Device),
            Some("CPU") => Ok(Self::Host),
            Some("DISK" | "STORAGE") => Ok(Self::Disk),
            Some(other) => Err(Error::InvalidArgument(format!(
                "unknown medium {other:?} (GPU, CPU, DISK or STORAGE)"
            ))),
        }
    }

    fn from_bits(bits: u32) -> Self {
        match bits {
            0 => Self::Device,
            1 => Self::Host,
            _ => Self::Disk,
        }
    }
}

/// The group of events without `group_idx` (vLLM before group annotations).
const NO_GROUP: u32 = GROUP_MASK;

fn group_key(group: Option<u32>, tier: Tier) -> Result<u32> {
    let g = match group {
        None => NO_GROUP,
        Some(g) if g < NO_GROUP => g,
        Some(g) => {
            return Err(Error::InvalidArgument(format!(
                "group index {g} out of range (0..{NO_GROUP})"
            )));
        }
    };
    Ok(g | (tier as u32) << TIER_SHIFT)
}

#[derive(Clone, Debug, Default)]
struct Replica {
    name: String,
    /// Nodes with at least one holder entry of this replica.
    nodes: NodeSet,
}

/// The replica holding the longest prefix, and its length in blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixMatch {
    /// The replica.
    pub replica: ReplicaId,
    /// Leading blocks of the query it holds.
    pub num_blocks: usize,
}

/// Counters of what the index was fed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Block hashes stored (`BlockStored`, one per hash).
    pub blocks_stored: u64,
    /// Block hashes removed (`BlockRemoved`, one per hash).
    pub blocks_removed: u64,
    /// `BlockRemoved` hashes the replica was not known to hold (events missed,
    /// or a removal of a block stored before the index started).
    pub unknown_removals: u64,
    /// `AllBlocksCleared` events.
    pub clears: u64,
}

/// One KV event of a replica, as the index applies it (vLLM's three events,
/// hashes in their integer form).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IndexEvent {
    /// `BlockStored`: a chain of `hashes`, the first a child of `parent`.
    Stored {
        /// The block before the chain (`None` at the start of a prompt).
        parent: Option<u64>,
        /// The stored blocks' hashes, in order.
        hashes: Vec<u64>,
        /// The KV-cache group (`None`: the default group).
        group: Option<u32>,
        /// Where they are held.
        tier: Tier,
    },
    /// `BlockRemoved`: one block per hash.
    Removed {
        /// The removed blocks' hashes.
        hashes: Vec<u64>,
        /// The KV-cache group (`None`: the default group).
        group: Option<u32>,
        /// Where they were held.
        tier: Tier,
    },
    /// `AllBlocksCleared`: the replica's device cache was reset (what it
    /// keeps in host memory or on disk stays).
    Cleared,
}

/// Hashes a query looks up at once ([`PrefixIndex::match_lengths`]): its
/// first window, and the most its windows grow to.
const WALK_FIRST: usize = 8;
const WALK_MOST: usize = 64;

/// Which replica holds which cached blocks; see the module docs.
#[derive(Clone, Debug, Default)]
pub struct PrefixIndex {
    nodes: Nodes,
    replicas: Vec<Replica>,
    by_name: HashMap<String, u32, FxBuildHasher>,
    stats: IndexStats,
    /// A removal's slots, kept between calls.
    scratch: Vec<Option<NodeId>>,
}

impl PrefixIndex {
    /// An empty index.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The id of a replica, registering it on first use.
    pub fn replica(&mut self, name: &str) -> ReplicaId {
        if let Some(&id) = self.by_name.get(name) {
            return ReplicaId(id);
        }
        let id = u32::try_from(self.replicas.len()).unwrap_or(u32::MAX);
        self.replicas.push(Replica {
            name: name.to_owned(),
            nodes: NodeSet::default(),
        });
        self.by_name.insert(name.to_owned(), id);
        ReplicaId(id)
    }

    /// The id of a registered replica.
    #[must_use]
    pub fn replica_id(&self, name: &str) -> Option<ReplicaId> {
        self.by_name.get(name).map(|&id| ReplicaId(id))
    }

    /// The name of a registered replica.
    #[must_use]
    pub fn replica_name(&self, replica: ReplicaId) -> Option<&str> {
        self.replicas
            .get(replica.0 as usize)
            .map(|r| r.name.as_str())
    }

    /// Number of registered replicas.
    #[must_use]
    pub fn num_replicas(&self) -> usize {
        self.replicas.len()
    }

    /// Distinct block hashes held by any replica.
    #[must_use]
    pub fn num_blocks(&self) -> usize {
        self.nodes.len()
    }

    /// Distinct block hashes held by one replica (0 for an unknown id).
    #[must_use]
    pub fn replica_num_blocks(&self, replica: ReplicaId) -> usize {
        self.replicas
            .get(replica.0 as usize)
            .map_or(0, |r| r.nodes.len())
    }

    /// What the index has been fed so far.
    #[must_use]
    pub fn stats(&self) -> IndexStats {
        self.stats
    }

    fn check_replica(&self, replica: ReplicaId) -> Result<usize> {
        let i = replica.0 as usize;
        if i < self.replicas.len() {
            Ok(i)
        } else {
            Err(Error::InvalidArgument(format!(
                "replica id {} is not registered",
                replica.0
            )))
        }
    }

    /// Applies one event of `replica` ([`PrefixIndex::store`],
    /// [`PrefixIndex::remove`] or [`PrefixIndex::clear`]).
    ///
    /// # Errors
    /// `InvalidArgument` for an unregistered replica (nothing changes).
    pub fn apply(&mut self, replica: ReplicaId, event: &IndexEvent) -> Result<()> {
        match event {
            IndexEvent::Stored {
                parent,
                hashes,
                group,
                tier,
            } => self.store_in(replica, *parent, hashes, *group, *tier),
            IndexEvent::Removed {
                hashes,
                group,
                tier,
            } => self.remove_from(replica, hashes, *group, *tier),
            IndexEvent::Cleared => self.clear_tier(replica, Tier::Device),
        }
    }

    /// Applies a batch of one replica's events in order, all or nothing: an
    /// unregistered replica or an event's group out of range refuses the batch
    /// before any event is applied.
    /// Returns how many were applied.
    ///
    /// # Errors
    /// `InvalidArgument` for an unregistered replica (nothing changes).
    pub fn apply_all(&mut self, replica: ReplicaId, events: &[IndexEvent]) -> Result<usize> {
        self.check_replica(replica)?;
        for ev in events {
            if let IndexEvent::Stored { group, tier, .. }
            | IndexEvent::Removed { group, tier, .. } = ev
            {
                group_key(*group, *tier)?;
            }
        }
        for ev in events {
            self.apply(replica, ev)?;
        }
        Ok(events.len())
    }

    /// `BlockStored`: `replica` cached `hashes` (a chain: each the parent of the
    /// next, the first a child of `parent`) in `group`.
    ///
    /// # Errors
    /// `InvalidArgument` for an unregistered replica (nothing changes).
    pub fn store(
        &mut self,
        replica: ReplicaId,
        parent: Option<u64>,
        hashes: &[u64],
        group: Option<u32>,
    ) -> Result<()> {
        self.store_in(replica, parent, hashes, group, Tier::Device)
    }

    /// [`PrefixIndex::store`] of blocks held in `tier`.
    ///
    /// # Errors
    /// `InvalidArgument` for an unregistered replica or a group index of 2**30
    /// or more (nothing changes).
    pub fn store_in(
        &mut self,
        replica: ReplicaId,
        parent: Option<u64>,
        hashes: &[u64],
        group: Option<u32>,
        tier: Tier,
    ) -> Result<()> {
        let r = self.check_replica(replica)?;
        let g = group_key(group, tier)?;
        // What clears left vacant leaves the table alongside the stores.
        self.nodes.reclaim(hashes.len() + 8);
        let mut parent = parent;
        for &h in hashes {
            let id = self.nodes.get_or_insert(h, parent);
            let node = self.nodes.node_mut(id);
            node.adopt(parent);
            node.add(replica.0, g);
            self.replicas[r].nodes.insert(id);
            parent = Some(h);
        }
        self.stats.blocks_stored += hashes.len() as u64;
        Ok(())
    }

    /// `BlockRemoved`: one block per hash of `replica`'s `group` was evicted
    /// (`group` None: the events' own None group, vLLM without group annotations).
    /// A hash the replica is not known to hold is counted in
    /// [`IndexStats::unknown_removals`].
    ///
    /// # Errors
    /// `InvalidArgument` for an unregistered replica (nothing changes).
    pub fn remove(&mut self, replica: ReplicaId, hashes: &[u64], group: Option<u32>) -> Result<()> {
        self.remove_from(replica, hashes, group, Tier::Device)
    }

    /// [`PrefixIndex::remove`] of blocks held in `tier`.
    ///
    /// # Errors
    /// `InvalidArgument` for an unregistered replica or a group index of 2**30
    /// or more (nothing changes).
    pub fn remove_from(
        &mut self,
        replica: ReplicaId,
        hashes: &[u64],
        group: Option<u32>,
        tier: Tier,
    ) -> Result<()> {
        let r = self.check_replica(replica)?;
        let g = group_key(group, tier)?;
        // In three passes, each a loop of independent loads whose misses
        // overlap: the table probes, then the nodes, then the replica's set.
        let mut ids = std::mem::take(&mut self.scratch);
        ids.clear();
        ids.extend(hashes.iter().map(|&h| self.nodes.id(h)));
        let mut gone = 0;
        for i in 0..ids.len() {
            let Some(id) = ids[i] else {
                self.stats.unknown_removals += 1;
                continue;
            };
            let node = self.nodes.node_mut(id);
            let Some(still_held) = node.remove_one(replica.0, g) else {
                self.stats.unknown_removals += 1;
                continue;
            };
            self.stats.blocks_removed += 1;
            if node.is_empty() {
                self.nodes.remove(id);
            }
            if !still_held {
                ids[gone] = Some(id);
                gone += 1;
            }
        }
        let set = &mut self.replicas[r].nodes;
        for &id in ids[..gone].iter().flatten() {
            set.remove(id);
        }
        self.scratch = ids;
        Ok(())
    }

    /// `AllBlocksCleared`: `replica` holds nothing any more (also what to do when
    /// its publisher restarted).
    ///
    /// # Errors
    /// `InvalidArgument` for an unregistered replica.
    pub fn clear(&mut self, replica: ReplicaId) -> Result<()> {
        let r = self.check_replica(replica)?;
        let spread = self.spread(r);
        self.drop_holders(r, |node| {
            node.remove_replica(replica.0, spread);
            false
        });
        self.stats.clears += 1;
        Ok(())
    }

    /// `AllBlocksCleared` of one tier: `replica` holds nothing there any more
    /// (a device cache reset leaves host memory and disk as they were).
    ///
    /// # Errors
    /// `InvalidArgument` for an unregistered replica.
    pub fn clear_tier(&mut self, replica: ReplicaId, tier: Tier) -> Result<()> {
        let r = self.check_replica(replica)?;
        self.drop_holders(r, |node| node.remove_tier(replica.0, tier));
        self.stats.clears += 1;
        Ok(())
    }

    /// Where replica `r`'s holders should sit in a long holder list.
    fn spread(&self, r: usize) -> Spread {
        let replicas = u32::try_from(self.replicas.len()).unwrap_or(u32::MAX);
        Spread::of(u32::try_from(r).unwrap_or(u32::MAX), replicas)
    }

    /// Applies `drop` (which returns whether the replica still holds the node)
    /// to each node of replica `r`, removing the nodes left without holders;
    /// the emptied ones stay in the table, vacant, until later stores reclaim
    /// them. The set's order is random in the arena, so the nodes go in
    /// batches: a batch's slots are read together, each long holder list
    /// starting to load where this replica's holders should be (their misses
    /// overlap), then the batch is changed while the next batch's slots are
    /// prefetched.
    fn drop_holders(&mut self, r: usize, mut drop: impl FnMut(&mut node::Node) -> bool) {
        /// Nodes read together.
        const BATCH: usize = 32;
        let mut ids = Vec::new();
        std::mem::take(&mut self.replicas[r].nodes).append_to(&mut ids);
        let mut kept = NodeSet::default();
        let spread = self.spread(r);
        let mut batches = ids.chunks(BATCH).peekable();
        while let Some(batch) = batches.next() {
            for &id in batch {
                self.nodes.prefetch_list_near(id, spread);
            }
            let next = batches.peek().copied().unwrap_or_default();
            for (i, &id) in batch.iter().enumerate() {
                if let Some(&ahead) = next.get(i) {
                    self.nodes.prefetch(ahead);
                }
                let node = self.nodes.node_mut(id);
                if drop(node) {
                    kept.insert(id);
                } else if node.is_empty() {
                    self.nodes.vacate(id);
                }
            }
        }
        self.replicas[r].nodes = kept;
    }

    /// Whether `replica` holds `hash` (in `group`, or in any group for None).
    #[must_use]
    pub fn contains(&self, replica: ReplicaId, hash: u64, group: Option<u32>) -> bool {
        self.nodes
            .get(hash)
            .is_some_and(|n| n.held_by(replica.0, group))
    }

    /// The parent recorded for a held hash (None for a first block or an
    /// unknown hash).
    #[must_use]
    pub fn parent(&self, hash: u64) -> Option<u64> {
        self.nodes.get(hash).and_then(node::Node::parent)
    }

    /// The chain ending at `hash`, first block first, following parent links
    /// while the parents are held (empty for an unknown hash).
    #[must_use]
    pub fn chain(&self, hash: u64) -> Vec<u64> {
        let mut out = Vec::new();
        let mut cur = Some(hash);
        while let Some(h) = cur {
            let Some(node) = self.nodes.get(h) else {
                break;
            };
            out.push(h);
            // A cycle needs a 64-bit collision; stop rather than loop forever.
            if out.len() > self.nodes.len() {
                break;
            }
            cur = node.parent();
        }
        out.reverse();
        out
    }

    /// Calls `f(i, node)` for the nodes of `hashes` in order while it returns
    /// true, up to the first hash not held. The lookups are made a window at a
    /// time, each independent of the others, so that their cache misses
    /// overlap instead of queueing behind the walk. The windows double from
    /// [`WALK_FIRST`] to [`WALK_MOST`] hashes: a short match wastes at most
    /// a few lookups past its end, a long query's misses overlap more.
    fn walk(&self, hashes: &[u64], mut f: impl FnMut(usize, &node::Node) -> bool) {
        let mut ids = [None; WALK_MOST];
        let (mut start, mut size) = (0, WALK_FIRST);
        while start < hashes.len() {
            let window = &hashes[start..hashes.len().min(start + size)];
            for (id, &h) in ids.iter_mut().zip(window) {
                *id = self.nodes.id(h);
            }
            for id in ids[..window.len()].iter().flatten() {
                self.nodes.prefetch_list(*id);
            }
            for (k, id) in ids[..window.len()].iter().enumerate() {
                let Some(id) = *id else {
                    return;
                };
                if !f(start + k, self.nodes.node(id)) {
                    return;
                }
            }
            start += window.len();
            size = (2 * size).min(WALK_MOST);
        }
    }

    /// Per registered replica (by id), the number of leading blocks of the hash
    /// chain it holds. `group`: count only that group's blocks (None: any).
    #[must_use]
    pub fn match_lengths(&self, hashes: &[u64], group: Option<u32>) -> Vec<usize> {
        let mut lengths = vec![0; self.replicas.len()];
        // Replicas holding every block so far; a replica leaving it gets its
        // length then, those left at the end the blocks matched.
        let mut alive: Vec<u32> = Vec::new();
        // Per replica, the last block (1-based) whose holders named it.
        let mut seen: Vec<u32> = Vec::new();
        let mut matched = 0;
        self.walk(hashes, |i, node| {
            let holders = node.holders();
            let wanted = |x: &&node::Holder| group.is_none_or(|g| key_group(x.group) == g);
            if i == 0 {
                for x in holders.iter().filter(wanted) {
                    if !alive.contains(&x.replica) {
                        alive.push(x.replica);
                    }
                }
            } else if let [r] = alive[..] {
                // The common tail of a long query: one replica left.
                if !holders.iter().filter(wanted).any(|x| x.replica == r) {
                    lengths[r as usize] = i;
                    alive.clear();
                }
            } else if alive.len() * holders.len() <= 16 {
                alive.retain(|&r| {
                    let keep = holders.iter().filter(wanted).any(|x| x.replica == r);
                    if !keep {
                        lengths[r as usize] = i;
                    }
                    keep
                });
            } else {
                // Each holder once rather than each alive replica's search.
                if seen.is_empty() {
                    seen = vec![0; self.replicas.len()];
                }
                let stamp = u32::try_from(i).unwrap_or(u32::MAX);
                for x in holders.iter().filter(wanted) {
                    seen[x.replica as usize] = stamp;
                }
                alive.retain(|&r| {
                    let keep = seen[r as usize] == stamp;
                    if !keep {
                        lengths[r as usize] = i;
                    }
                    keep
                });
            }
            if alive.is_empty() {
                return false;
            }
            matched = i + 1;
            true
        });
        for &r in &alive {
            lengths[r as usize] = matched;
        }
        lengths
    }

    /// Per registered replica (by id), the leading blocks of the hash chain it
    /// holds, counted by the fastest tier each is held in: `[device, host,
    /// disk]`, adding up to its [`PrefixIndex::match_lengths`].
    #[must_use]
    pub fn match_tiers(&self, hashes: &[u64], group: Option<u32>) -> Vec<[usize; 3]> {
        let mut out = vec![[0; 3]; self.replicas.len()];
        let mut alive: Vec<u32> =
            (0..u32::try_from(self.replicas.len()).unwrap_or(u32::MAX)).collect();
        self.walk(hashes, |_, node| {
            alive.retain(|&r| match node.best_tier(r, group) {
                Some(t) => {
                    out[r as usize][t as usize] += 1;
                    true
                }
                None => false,
            });
            !alive.is_empty()
        });
        out
    }

    /// Per registered replica, its held prefix weighed by tier: `weights[t]`
    /// for each leading block held at best in tier `t` (e.g. 1, 0.75, 0.25:
    /// a host hit is worth three quarters of a device hit, as Dynamo's
    /// router counts them).
    #[must_use]
    pub fn weighted_match(
        &self,
        hashes: &[u64],
        group: Option<u32>,
        weights: [f64; 3],
    ) -> Vec<f64> {
        self.match_tiers(hashes, group)
            .into_iter()
            .map(|n| {
                n.iter()
                    .zip(weights)
                    .map(|(&c, w)| f64::from(u32::try_from(c).unwrap_or(u32::MAX)) * w)
                    .sum()
            })
            .collect()
    }

    /// The replica holding the longest prefix of the hash chain (the lowest id
    /// among equals), or None when no replica holds its first block.
    #[must_use]
    pub fn longest_prefix(&self, hashes: &[u64], group: Option<u32>) -> Option<PrefixMatch> {
        let mut best: Option<PrefixMatch> = None;
        for (r, n) in self.match_lengths(hashes, group).into_iter().enumerate() {
            if n > 0 && best.is_none_or(|b| n > b.num_blocks) {
                best = Some(PrefixMatch {
                    replica: ReplicaId(u32::try_from(r).unwrap_or(u32::MAX)),
                    num_blocks: n,
                });
            }
        }
        best
    }

    /// The (hash, group, count) entries of one replica, sorted (for tests and
    /// snapshots). `None` groups come back as None.
    #[must_use]
    pub fn replica_entries(&self, replica: ReplicaId) -> Vec<(u64, Option<u32>, u32)> {
        let Some(rep) = self.replicas.get(replica.0 as usize) else {
            return Vec::new();
        };
        let mut out: Vec<(u64, Option<u32>, u32)> = rep
            .nodes
            .iter()
            .map(|id| (self.nodes.hash(id), self.nodes.node(id)))
            .flat_map(|(h, n)| {
                n.holders()
                    .iter()
                    .filter(|x| x.replica == replica.0)
                    .map(move |x| {
                        let g = key_group(x.group);
                        (h, (g != NO_GROUP).then_some(g), x.count)
                    })
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// Checks the internal bookkeeping: no empty node (but the vacant ones a
    /// clear left, counted and listed), no zero count, no duplicate holder,
    /// per-replica sets equal to the holders.
    ///
    /// # Errors
    /// `InvariantViolation` describing the first problem found.
    pub fn check_invariants(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvariantViolation(m));
        if let Err(m) = self.nodes.check_vacant() {
            return bad(m);
        }
        let mut per_replica = vec![0usize; self.replicas.len()];
        for (id, h, node) in self.nodes.iter() {
            if node.holders().is_empty() {
                return bad(format!("hash {h:#x} has no holder"));
            }
            let mut seen: FxHashSet<(u32, u32)> = FxHashSet::default();
            let mut replicas: FxHashMap<u32, u32> = FxHashMap::default();
            for x in node.holders() {
                if !seen.insert((x.replica, x.group)) {
                    return bad(format!("hash {h:#x} has a duplicate holder"));
                }
                *replicas.entry(x.replica).or_insert(0) += 1;
                if x.count == 0 {
                    return bad(format!("hash {h:#x} has a zero count"));
                }
                let Some(rep) = self.replicas.get(x.replica as usize) else {
                    return bad(format!("hash {h:#x} held by unknown replica {}", x.replica));
                };
                if !rep.nodes.contains(id) {
                    return bad(format!("replica {} misses hash {h:#x}", x.replica));
                }
            }
            if !node.in_order() {
                return bad(format!("hash {h:#x}: its holders are out of order"));
            }
            for &r in replicas.keys() {
                per_replica[r as usize] += 1;
            }
        }
        for (i, rep) in self.replicas.iter().enumerate() {
            if rep.nodes.len() != per_replica[i] {
                return bad(format!(
                    "replica {i} lists {} hashes, holds {}",
                    rep.nodes.len(),
                    per_replica[i]
                ));
            }
        }
        Ok(())
    }
}
