//! Read-only views of the tier's structure, for debugging, drop-in views and
//! parity checks against vLLM's policy objects.

use super::OffloadTier;
use super::keys::OffloadKey;
use super::policy::Policy;
use super::slots::Chunk;
use crate::error::{Result, invalid};

/// ARC's lists, each least recently used first.
#[derive(Clone, Debug, PartialEq)]
pub struct ArcLists {
    /// The adaptive target size of T1.
    pub target_t1_size: f64,
    /// Chunks seen once.
    pub t1: Vec<(OffloadKey, Chunk)>,
    /// Chunks reused.
    pub t2: Vec<(OffloadKey, Chunk)>,
    /// Ghosts of chunks evicted from T1.
    pub b1: Vec<OffloadKey>,
    /// Ghosts of chunks evicted from T2.
    pub b2: Vec<OffloadKey>,
}

impl OffloadTier {
    /// ARC's lists (`None` under LRU).
    #[must_use]
    pub fn arc_lists(&self) -> Option<ArcLists> {
        let Policy::Arc(a) = &self.policy else {
            return None;
        };
        Some(ArcLists {
            target_t1_size: a.target_t1_size,
            t1: a.t1.iter().map(|(k, c)| (*k, *c)).collect(),
            t2: a.t2.iter().map(|(k, c)| (*k, *c)).collect(),
            b1: a.b1.keys().copied().collect(),
            b2: a.b2.keys().copied().collect(),
        })
    }

    /// Sets ARC's adaptive target size of T1 (a warm start, or a test's setup).
    ///
    /// # Errors
    /// `InvalidArgument` under LRU or for a value outside `0..=num_chunks`.
    pub fn set_arc_target_t1_size(&mut self, target: f64) -> Result<()> {
        let cap = self.config.num_chunks as f64;
        let Policy::Arc(a) = &mut self.policy else {
            return Err(invalid(
                "the target size of T1 is ARC's; this tier evicts by LRU",
            ));
        };
        if !(0.0..=cap).contains(&target) {
            return Err(invalid(format!(
                "target_t1_size {target} outside 0..={cap}"
            )));
        }
        a.target_t1_size = target;
        Ok(())
    }

    /// LRU: the evictable chunks in the order they would be evicted (`None`
    /// under ARC).
    #[must_use]
    pub fn lru_eviction_order(&self) -> Option<Vec<OffloadKey>> {
        let Policy::Lru(l) = &self.policy else {
            return None;
        };
        Some(l.eviction_order())
    }

    /// The admission filter's counts, least recently offered first (`None`
    /// without the filter).
    #[must_use]
    pub fn tracked_offers(&self) -> Option<Vec<(OffloadKey, u64)>> {
        Some(
            self.tracker
                .as_ref()?
                .iter()
                .map(|(k, n)| (*k, *n))
                .collect(),
        )
    }

    /// Every resident chunk (LRU: in no particular order; ARC: T1 then T2).
    #[must_use]
    pub fn resident(&self) -> Vec<(OffloadKey, Chunk)> {
        self.policy.entries().map(|(k, c)| (*k, *c)).collect()
    }
}
