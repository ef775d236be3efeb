//! The device pool's eviction policy, by name (the manager's `eviction`
//! option); the policies themselves live in the pool.

use crate::error::{Error, Result};

/// How the device pool picks the free block to hand out (and the cached key
/// to evict): see [`crate::BlockPool::with_eviction`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Eviction {
    /// vLLM's single LRU free queue (the default).
    #[default]
    Lru,
    /// Adaptive replacement (recency and frequency, ghost lists).
    Arc,
    /// Segmented LRU: probationary and protected segments.
    Slru,
}

impl Eviction {
    /// Every policy, the default first.
    pub const ALL: [Self; 3] = [Self::Lru, Self::Arc, Self::Slru];

    /// A policy by name.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.name() == name)
    }

    /// A policy by name, explaining a bad one.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an unknown name.
    pub fn parse(name: &str) -> Result<Self> {
        Self::from_name(name).ok_or_else(|| {
            Error::InvalidConfig(format!(
                "unknown eviction {name:?}; expected 'lru', 'arc' or 'slru'"
            ))
        })
    }

    /// The policy's name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::Arc => "arc",
            Self::Slru => "slru",
        }
    }
}
