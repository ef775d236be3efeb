//! The eviction policy of a tier, by name: `"lru"` or `"arc"`.

use rustc_hash::FxHashSet;

use super::arc::Arc;
use super::keys::OffloadKey;
use super::lru::Lru;
use super::requests::RankSlot;
use super::slots::Chunk;
use crate::error::{Result, invalid};

/// Offers of at most this many keys are checked by scanning them, not hashing.
const SHORT_OFFER: usize = 16;

/// Keys an eviction must not take (an offer's): a short list is scanned, a
/// long one hashed.
pub(super) struct Protected<'a> {
    keys: &'a [OffloadKey],
    set: Option<FxHashSet<OffloadKey>>,
}

impl<'a> Protected<'a> {
    /// The keys, or `None` when one appears twice.
    pub(super) fn new(keys: &'a [OffloadKey]) -> Option<Self> {
        if keys.len() <= SHORT_OFFER {
            let repeated = (1..keys.len()).any(|i| keys[..i].contains(&keys[i]));
            return (!repeated).then_some(Self { keys, set: None });
        }
        let set: FxHashSet<OffloadKey> = keys.iter().copied().collect();
        (set.len() == keys.len()).then_some(Self {
            keys,
            set: Some(set),
        })
    }

    /// The keys, repeats allowed.
    pub(super) fn with_repeats(keys: &'a [OffloadKey]) -> Self {
        let set = (keys.len() > SHORT_OFFER).then(|| keys.iter().copied().collect());
        Self { keys, set }
    }

    /// Whether `key` is protected.
    pub(super) fn contains(&self, key: &OffloadKey) -> bool {
        match &self.set {
            Some(set) => set.contains(key),
            None => self.keys.contains(key),
        }
    }
}

/// Which policy a tier evicts by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyKind {
    /// Least recently used, a request's tail first.
    Lru,
    /// Adaptive replacement (recency and frequency).
    Arc,
}

impl PolicyKind {
    /// `"lru"` or `"arc"`.
    ///
    /// # Errors
    /// `InvalidArgument` for any other name.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "lru" => Ok(Self::Lru),
            "arc" => Ok(Self::Arc),
            other => Err(invalid(format!(
                "unknown cache policy {other:?}: supported are 'lru' and 'arc'"
            ))),
        }
    }

    /// The policy's name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::Arc => "arc",
        }
    }
}

/// A policy's state (vLLM's `CachePolicy`): where chunks live and which go first.
#[derive(Clone, Debug)]
pub enum Policy {
    /// See [`Lru`].
    Lru(Lru),
    /// See [`Arc`].
    Arc(Arc),
}

macro_rules! each {
    ($self:expr, $p:ident => $e:expr) => {
        match $self {
            Policy::Lru($p) => $e,
            Policy::Arc($p) => $e,
        }
    };
}

impl Policy {
    pub(super) fn new(kind: PolicyKind, capacity: u64) -> Self {
        match kind {
            PolicyKind::Lru => Self::Lru(Lru::default()),
            PolicyKind::Arc => Self::Arc(Arc::new(capacity)),
        }
    }

    pub(super) fn len(&self) -> usize {
        each!(self, p => p.len())
    }

    pub(super) fn get(&self, key: &OffloadKey) -> Option<&Chunk> {
        each!(self, p => p.get(key))
    }

    pub(super) fn get_mut(&mut self, key: &OffloadKey) -> Option<&mut Chunk> {
        each!(self, p => p.get_mut(key))
    }

    pub(super) fn insert(
        &mut self,
        key: OffloadKey,
        chunk: Chunk,
        position: Option<i64>,
        slot: &mut RankSlot,
    ) {
        match self {
            Self::Lru(p) => p.insert(key, chunk, position, slot),
            Self::Arc(p) => p.insert(key, chunk),
        }
    }

    pub(super) fn remove(&mut self, key: &OffloadKey) {
        each!(self, p => p.remove(key));
    }

    pub(super) fn touch(&mut self, keys: &[OffloadKey]) {
        each!(self, p => p.touch(keys));
    }

    /// Store misses seen before insertion (ARC's ghost hits; LRU's touch of
    /// absent keys, which changes nothing).
    pub(super) fn on_store_miss(&mut self, keys: &[OffloadKey]) {
        if let Self::Arc(p) = self {
            p.on_store_miss(keys);
        }
    }

    /// A request's first access to resident keys, with their positions (LRU
    /// orders them by the request's rank, drawn here if not yet).
    pub(super) fn on_request_access(&mut self, keys: &[(OffloadKey, i64)], slot: &mut RankSlot) {
        if let Self::Lru(p) = self {
            p.on_request_access(keys, slot);
        }
    }

    /// A request's end: its keys head to tail with their access flags.
    pub(super) fn on_request_finished(&mut self, ordered: &[(OffloadKey, u8)]) {
        match self {
            Self::Lru(p) => p.on_request_finished(ordered),
            Self::Arc(p) => p.on_request_finished(ordered),
        }
    }

    pub(super) fn evict(
        &mut self,
        n: usize,
        protected: &Protected<'_>,
    ) -> Option<Vec<(OffloadKey, Chunk)>> {
        if n == 0 {
            return Some(Vec::new());
        }
        each!(self, p => p.evict(n, protected))
    }

    pub(super) fn clear(&mut self) {
        each!(self, p => p.clear());
    }

    pub(super) fn mark_evictable(&mut self, key: &OffloadKey) {
        if let Self::Lru(p) = self {
            p.mark_evictable(key);
        }
    }

    pub(super) fn mark_non_evictable(&mut self, key: &OffloadKey) {
        if let Self::Lru(p) = self {
            p.mark_non_evictable(key);
        }
    }

    pub(super) fn entries(&self) -> Box<dyn Iterator<Item = (&OffloadKey, &Chunk)> + '_> {
        match self {
            Self::Lru(p) => Box::new(p.entries()),
            Self::Arc(p) => Box::new(p.entries()),
        }
    }

    pub(super) fn check(&self) -> std::result::Result<(), String> {
        each!(self, p => p.check())
    }
}
