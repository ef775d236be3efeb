//! A tier below GPU memory: chunks of evicted KV blocks kept in host memory,
//! with vLLM 0.33's offloading semantics (`vllm/v1/kv_offload/cpu/manager.py`
//! and its LRU / ARC policies): the same keys stored, the same slots handed
//! out, the same keys evicted, the same events.
//!
//! A chunk is `blocks_per_chunk` GPU blocks of one KV-cache group, keyed by
//! [`OffloadKey`]. A store is prepared (slots reserved, the chunk pending),
//! then completed (readable) or failed (slot freed, a metadata-only removal);
//! a load pins the chunk until it completes. Calls carry a request key
//! ([`ReqKey`], chosen by the caller) so the policy can order a request's
//! chunks and commit their recency when the request ends.
//!
//! Rooms: `keys` (the key and its digest), `slots` (slot allocation, a
//! chunk's state), `lru` / `arc` / `policy` (the policies and their dispatch),
//! `requests` (per-request access records, the admission tracker), `slab` (the
//! policies' nodes and their index by key), `load` /
//! `store` (the calls that read and write the tier), `disk` (the disk tier
//! below), `events`, `readouts`
//! (accessors, metrics, views of the policy), `check` (invariants).
//!
//! ```
//! use pagedkv_core::offload::{LookupResult, OffloadKey, OffloadTier, TierConfig};
//!
//! let mut tier = OffloadTier::new(TierConfig::new(2)).unwrap();
//! let keys: Vec<_> = [b"a", b"b", b"c"].iter().map(|h| OffloadKey::new(*h, 0).unwrap()).collect();
//! let out = tier.prepare_store(&keys[..2], 1, &[]).unwrap().unwrap();
//! assert_eq!(out.slots, vec![0, 1]);
//! tier.complete_store(&keys[..2], true);
//! assert_eq!(tier.lookup(&keys[0]), LookupResult::Hit);
//! // a third chunk evicts the least recently used one and takes its slot
//! let out = tier.prepare_store(&keys[2..], 1, &[]).unwrap().unwrap();
//! assert_eq!((out.slots, out.evicted), (vec![0], vec![keys[0]]));
//! tier.check_invariants().unwrap();
//! ```

mod arc;
mod check;
mod disk;
mod events;
mod keys;
mod load;
mod lru;
mod policy;
mod readouts;
mod requests;
mod slab;
mod slots;
mod store;
#[cfg(test)]
mod tests;

use rustc_hash::FxHashMap;

pub use disk::{DiskConfig, DiskCounters, DiskRead, DiskTier};
pub use events::{Medium, OffloadEvent, TierKvEvent, kv_events};
pub use keys::{MAX_KEY_LEN, OffloadKey};
pub use policy::PolicyKind;
pub use readouts::ArcLists;
pub use slots::Chunk;

use crate::error::{Result, invalid};
use policy::Policy;
use requests::{ReqState, SEEN, Tracker};
use slots::Slots;

/// The caller's key for one request (one vLLM `ReqContext`).
pub type ReqKey = u64;

/// How a tier is built (vLLM `CPUOffloadingManager`'s arguments).
#[derive(Clone, Debug)]
pub struct TierConfig {
    /// Chunk slots in the tier.
    pub num_chunks: u64,
    /// The eviction policy.
    pub policy: PolicyKind,
    /// Whether stores and removals are recorded as events.
    pub enable_events: bool,
    /// A new chunk is stored only once offered this many times (2 or more turns
    /// the admission filter on).
    pub store_threshold: u64,
    /// Keys the admission filter tracks at most.
    pub max_tracker_size: usize,
    /// The medium named in events.
    pub medium: Medium,
}

impl TierConfig {
    /// `num_chunks` slots in host memory, LRU, no events, every chunk admitted.
    #[must_use]
    pub fn new(num_chunks: u64) -> Self {
        Self {
            num_chunks,
            policy: PolicyKind::Lru,
            enable_events: false,
            store_threshold: 1,
            max_tracker_size: 64_000,
            medium: Medium::Cpu,
        }
    }
}

/// `lookup`'s answer for one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LookupResult {
    /// Not in the tier.
    Miss,
    /// In the tier and readable.
    Hit,
    /// In the tier, its store not yet complete.
    HitPending,
}

/// What `prepare_store` decided.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreOutput {
    /// The offered keys to write, in offer order (absent ones that passed the
    /// admission filter).
    pub keys_to_store: Vec<OffloadKey>,
    /// The slot of each key to write.
    pub slots: Vec<u64>,
    /// Keys evicted to make room, in eviction order.
    pub evicted: Vec<OffloadKey>,
}

/// vLLM's per-step offloading metrics of the tier (`get_stats`).
#[derive(Clone, Debug, PartialEq)]
pub struct TierStats {
    /// Share of slots holding a chunk that is pinned or being written.
    pub usage: f64,
    /// Share of slots being written.
    pub write_usage: f64,
    /// Share of slots pinned by loads (`usage - write_usage`, at least 0).
    pub read_usage: f64,
    /// The size of each allocation since the last call.
    pub allocation_sizes: Vec<u64>,
    /// New chunks the admission filter skipped since the last call (`None`
    /// without the filter).
    pub stores_skipped: Option<u64>,
}

/// Running totals of the tier, never reset (pagedkv's own read-out).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierCounters {
    /// `lookup` calls.
    pub lookups: u64,
    /// Lookups answered `Hit`.
    pub hits: u64,
    /// Lookups answered `HitPending`.
    pub pending_hits: u64,
    /// Chunks pinned for loading.
    pub chunks_loaded: u64,
    /// Chunks whose store was prepared.
    pub stores_prepared: u64,
    /// Chunks whose store completed.
    pub stores_completed: u64,
    /// Chunks whose store failed (slot freed).
    pub stores_failed: u64,
    /// Chunks evicted.
    pub evictions: u64,
    /// `prepare_store` calls refused for want of evictable chunks.
    pub stores_refused: u64,
    /// Keys in `complete_store` that had no store in flight (ignored).
    pub ignored_completions: u64,
}

impl TierCounters {
    /// Every total with its name.
    #[must_use]
    pub fn named(&self) -> [(&'static str, u64); 10] {
        [
            ("lookups", self.lookups),
            ("hits", self.hits),
            ("pending_hits", self.pending_hits),
            ("chunks_loaded", self.chunks_loaded),
            ("stores_prepared", self.stores_prepared),
            ("stores_completed", self.stores_completed),
            ("stores_failed", self.stores_failed),
            ("evictions", self.evictions),
            ("stores_refused", self.stores_refused),
            ("ignored_completions", self.ignored_completions),
        ]
    }
}

/// A host-memory tier: slots, a policy, per-request access records, events.
#[derive(Clone, Debug)]
pub struct OffloadTier {
    config: TierConfig,
    slots: Slots,
    policy: Policy,
    num_evictable: u64,
    num_write_pending: u64,
    tracker: Option<Tracker>,
    stores_skipped: u64,
    allocation_sizes: Vec<u64>,
    generation: u64,
    events: Option<Vec<OffloadEvent>>,
    requests: FxHashMap<ReqKey, ReqState>,
    counters: TierCounters,
    /// Working lists of the calls, kept for their capacity.
    scratch: Scratch,
}

/// Working lists of the calls, kept for their capacity.
#[derive(Clone, Debug, Default)]
struct Scratch {
    /// Each offered key's residency (`None` absent, else whether ready).
    resident: Vec<Option<bool>>,
    store: store::StoreScratch,
    /// Keys a load reads first for its request, with their positions.
    reaccessed: Vec<(OffloadKey, i64)>,
}

impl OffloadTier {
    /// A tier of `config.num_chunks` free slots.
    ///
    /// # Errors
    /// `InvalidArgument` for more than 2**31 - 1 chunks (vLLM's slot ids are
    /// int32), or an admission filter
    /// tracking no key.
    pub fn new(config: TierConfig) -> Result<Self> {
        if config.num_chunks > i32::MAX as u64 {
            return Err(invalid(format!(
                "num_chunks {} is out of range (at most 2**31 - 1)",
                config.num_chunks
            )));
        }
        if config.store_threshold >= 2 && config.max_tracker_size == 0 {
            return Err(invalid(
                "max_tracker_size must be positive with a store_threshold of 2 or more",
            ));
        }
        Ok(Self {
            slots: Slots::new(config.num_chunks),
            policy: Policy::new(config.policy, config.num_chunks),
            num_evictable: 0,
            num_write_pending: 0,
            tracker: (config.store_threshold >= 2).then(|| Tracker::new(config.max_tracker_size)),
            stores_skipped: 0,
            allocation_sizes: Vec::new(),
            generation: 0,
            events: config.enable_events.then(Vec::new),
            requests: FxHashMap::default(),
            counters: TierCounters::default(),
            scratch: Scratch::default(),
            config,
        })
    }

    /// Whether `key` is in the tier and readable.
    pub fn lookup(&mut self, key: &OffloadKey) -> LookupResult {
        self.counters.lookups += 1;
        match self.policy.get(key) {
            None => LookupResult::Miss,
            Some(c) if !c.is_ready() => {
                self.counters.pending_hits += 1;
                LookupResult::HitPending
            }
            Some(_) => {
                self.counters.hits += 1;
                LookupResult::Hit
            }
        }
    }

    /// The number of leading keys that are readable (a prefix hit, in chunks).
    pub fn lookup_prefix(&mut self, keys: &[OffloadKey]) -> usize {
        keys.iter()
            .take_while(|k| self.lookup(k) == LookupResult::Hit)
            .count()
    }

    /// `on_new_request`: the request's access record of this generation.
    pub fn on_new_request(&mut self, req: ReqKey) {
        let generation = self.generation;
        self.requests
            .entry(req)
            .or_insert_with(ReqState::new)
            .refresh(generation);
    }

    /// Drops what the tier keeps for a request (its context is gone).
    pub fn forget_request(&mut self, req: ReqKey) {
        self.requests.remove(&req);
    }

    /// The request ended: its access commits to the policy (recency, ARC's
    /// T1 → T2). `keys` / `positions`: every position the scheduler recorded
    /// for the request (they order its chunks head to tail).
    ///
    /// # Errors
    /// `InvalidArgument` when positions do not match the keys.
    pub fn on_request_finished(
        &mut self,
        req: ReqKey,
        keys: &[OffloadKey],
        positions: &[i64],
    ) -> Result<()> {
        check_positions(keys, positions)?;
        let generation = self.generation;
        let Some(state) = self.requests.get_mut(&req) else {
            return Ok(());
        };
        if !state.is_current(generation) || state.finished() {
            return Ok(());
        }
        state.record_positions(keys, positions);
        state.set_finished();
        let ordered = state.ordered_keys();
        self.policy.on_request_finished(&ordered);
        Ok(())
    }

    /// Empties the tier (every chunk, pinned or not), without events; request
    /// records become stale. The admission tracker is kept.
    pub fn reset_cache(&mut self) {
        self.policy.clear();
        self.generation += 1;
        self.num_evictable = 0;
        self.num_write_pending = 0;
        self.slots.reset();
    }

    /// The events since the last call; a failed store's removal is dropped for
    /// keys stored again since.
    pub fn take_events(&mut self) -> Vec<OffloadEvent> {
        let Some(events) = self.events.as_mut() else {
            return Vec::new();
        };
        let events = std::mem::take(events);
        events
            .into_iter()
            .filter_map(|mut e| {
                if e.metadata_only {
                    e.keys.retain(|k| self.policy.get(k).is_none());
                    if e.keys.is_empty() {
                        return None;
                    }
                }
                Some(e)
            })
            .collect()
    }

    /// Refuses new keys for a request whose end was already committed.
    fn check_open(&self, req: ReqKey, keys: &[OffloadKey]) -> Result<()> {
        let Some(state) = self.requests.get(&req) else {
            return Ok(());
        };
        if !state.is_current(self.generation) {
            return Ok(());
        }
        if state.finished() && keys.iter().any(|k| !state.has(k, SEEN)) {
            return Err(invalid(
                "new cache keys observed after the request finished",
            ));
        }
        Ok(())
    }

    /// Whether the request's end was committed in this generation.
    fn is_finished(&self, req: ReqKey) -> bool {
        self.requests
            .get(&req)
            .is_some_and(|s| s.is_current(self.generation) && s.finished())
    }

    /// Records a load's keys in the request's access (read, reused unless the
    /// request stored them, first sightings in order) with their positions.
    fn record_load(&mut self, req: ReqKey, keys: &[OffloadKey], positions: &[i64]) {
        let generation = self.generation;
        let state = self.requests.entry(req).or_insert_with(ReqState::new);
        state.refresh(generation);
        let mut reaccessed = std::mem::take(&mut self.scratch.reaccessed);
        reaccessed.clear();
        let mut any_new = false;
        for (i, key) in keys.iter().enumerate() {
            any_new |= state.read_ready(
                *key,
                positions.get(i).copied().unwrap_or(-1),
                &mut reaccessed,
            );
        }
        if any_new {
            commit_access(&mut self.policy, state, generation, &reaccessed);
        }
        self.scratch.reaccessed = reaccessed;
    }

    fn push_event(&mut self, keys: Vec<OffloadKey>, removed: bool, metadata_only: bool) {
        if keys.is_empty() {
            return;
        }
        if let Some(events) = &mut self.events {
            events.push(OffloadEvent {
                keys,
                medium: self.config.medium,
                removed,
                metadata_only,
            });
        }
    }
}

/// A request's first reads of resident keys reach the policy (LRU ranks them
/// by the request's rank, drawn here if not yet).
fn commit_access(
    policy: &mut Policy,
    state: &mut ReqState,
    generation: u64,
    reaccessed: &[(OffloadKey, i64)],
) {
    let mut slot = *state.rank_slot(generation);
    policy.on_request_access(reaccessed, &mut slot);
    state.rank = slot;
}

fn check_positions(keys: &[OffloadKey], positions: &[i64]) -> Result<()> {
    if !positions.is_empty() && positions.len() != keys.len() {
        return Err(invalid(format!(
            "{} positions for {} keys: give one per key (negative: unknown) or none",
            positions.len(),
            keys.len()
        )));
    }
    Ok(())
}
