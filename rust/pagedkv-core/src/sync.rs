//! Syncing a request with an engine's own copy while the manager is held only
//! in short turns: what is read, what must match, when to start over.
//!
//! [`KvCacheManager::sync_from_engine`] holds the manager for the whole sync.
//! A caller whose engine lists run the engine's own code when read (a Python
//! sequence type) must not: that code may call back into the manager or let
//! another thread change it. [`EngineSync::run`] takes the manager in turns
//! ([`ManagerTurns`]): the anchor, the request's lists when they differ, the
//! apply; the engine's lists are read between turns, only the items from the
//! sync point on, and a request that changed in between is synced again from
//! a new anchor, up to [`SYNC_ATTEMPTS`] times.

use crate::error::{Error, Result};
use crate::manager::{EngineRequest, KvCacheManager};

/// Times a sync starts over when the request changed while the engine's
/// lists were read.
pub const SYNC_ATTEMPTS: usize = 3;

/// Short turns on a manager the caller holds elsewhere (behind a lock or a
/// borrow flag): each call takes it, runs `f` and gives it back.
pub trait ManagerTurns {
    /// The error of taking the manager, and of the core's refusals.
    type Error: From<Error>;
    /// `f` on the manager, read only.
    ///
    /// # Errors
    /// The manager cannot be taken; what `f` refuses.
    fn read<T>(
        &self,
        f: impl FnOnce(&KvCacheManager) -> Result<T>,
    ) -> std::result::Result<T, Self::Error>;
    /// `f` on the manager.
    ///
    /// # Errors
    /// The manager cannot be taken; what `f` refuses.
    fn write<T>(
        &self,
        f: impl FnOnce(&mut KvCacheManager) -> Result<T>,
    ) -> std::result::Result<T, Self::Error>;
}

/// How a sync ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncOutcome {
    /// Applied; `rewound`: the request was cut back to the first difference.
    Synced {
        /// Whether the request was cut back.
        rewound: bool,
    },
    /// The request changed between turns on every one of [`SYNC_ATTEMPTS`]
    /// attempts (other calls on it from inside the engine's sequences or
    /// from other threads); nothing was applied.
    KeptChanging,
}

/// One sync of a request with an engine's lists: the arguments of
/// [`KvCacheManager::sync_from_engine`].
#[derive(Clone, Copy, Debug)]
pub struct EngineSync<'a> {
    /// The request.
    pub id: &'a str,
    /// The engine's shared-prefix boundary, set with the sync.
    pub shared_prefix_boundary: Option<u64>,
    /// The prompt's length now, set with the sync.
    pub num_prompt_tokens: Option<usize>,
}

/// A sequence of `len` items given where the manager holds `from` already.
#[must_use]
pub fn shorter_than_held(len: usize, from: usize) -> Error {
    Error::InvalidArgument(format!(
        "the sequence has {len} items, fewer than the {from} the manager already holds"
    ))
}

impl EngineSync<'_> {
    /// Syncs the request with the engine's lists, which `open` gives once
    /// the request is known (its argument: the most items one read may
    /// return, `max_model_len`). Between turns on the manager, only the
    /// items the core asks for are read: the last hash held and the last
    /// block's tokens where the lists only grew, the whole lists where they
    /// differ, then the items past the sync point.
    ///
    /// # Errors
    /// As [`KvCacheManager::sync_from_engine`]; an engine list shorter than
    /// its sync point.
    pub fn run<A, S>(
        &self,
        manager: &A,
        open: impl FnOnce(usize) -> std::result::Result<S, A::Error>,
    ) -> std::result::Result<SyncOutcome, A::Error>
    where
        A: ManagerTurns,
        S: EngineRequest<Error = A::Error>,
    {
        let id = self.id;
        let mut anchor = manager.read(|m| m.sync_anchor(id))?;
        let src = open(anchor.token_limit())?;
        for attempt in 0..SYNC_ATTEMPTS {
            if attempt > 0 {
                anchor = manager.read(|m| m.sync_anchor(id))?;
            }
            let keep = anchor.sync_point(&src, || manager.read(|m| m.request_lists(id)))?;
            if keep.0 > src.num_tokens() {
                return Err(shorter_than_held(src.num_tokens(), keep.0).into());
            }
            if keep.1 > src.num_hashes() {
                return Err(shorter_than_held(src.num_hashes(), keep.1).into());
            }
            let tokens = src.tokens_from(keep.0)?;
            let hashes = src.hashes_from(keep.1)?;
            let applied = manager.write(|m| {
                m.apply_sync(
                    id,
                    &anchor,
                    keep,
                    (&tokens, &hashes),
                    self.shared_prefix_boundary,
                    self.num_prompt_tokens,
                )
            })?;
            if let Some(rewound) = applied {
                return Ok(SyncOutcome::Synced { rewound });
            }
        }
        Ok(SyncOutcome::KeptChanging)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::BlockHash;
    use crate::spec::ManagerConfig;
    use crate::{GroupSpec, RequestSpec};
    use std::cell::{Cell, RefCell};

    /// A manager behind a `RefCell`, changed by `meddle` on the first
    /// `meddles` writes (another caller between turns).
    struct Turns {
        m: RefCell<KvCacheManager>,
        meddles: Cell<usize>,
    }

    impl ManagerTurns for Turns {
        type Error = Error;
        fn read<T>(&self, f: impl FnOnce(&KvCacheManager) -> Result<T>) -> Result<T> {
            f(&self.m.borrow())
        }
        fn write<T>(&self, f: impl FnOnce(&mut KvCacheManager) -> Result<T>) -> Result<T> {
            let mut m = self.m.borrow_mut();
            if self.meddles.get() > 0 {
                self.meddles.set(self.meddles.get() - 1);
                let n = m.num_tokens("r")?;
                let h = m.block_hashes("r")?.len();
                m.extend_request("r", (n, h), &[7], &[])?;
            }
            f(&mut m)
        }
    }

    struct Lists {
        tokens: Vec<u32>,
        hashes: Vec<BlockHash>,
    }

    impl EngineRequest for Lists {
        type Error = Error;
        fn num_tokens(&self) -> usize {
            self.tokens.len()
        }
        fn num_hashes(&self) -> usize {
            self.hashes.len()
        }
        fn token(&self, i: usize) -> Result<u32> {
            Ok(self.tokens[i])
        }
        fn hash(&self, j: usize) -> Result<BlockHash> {
            Ok(self.hashes[j])
        }
        fn tokens_from(&self, from: usize) -> Result<Vec<u32>> {
            Ok(self.tokens.get(from..).unwrap_or_default().to_vec())
        }
        fn hashes_from(&self, from: usize) -> Result<Vec<BlockHash>> {
            Ok(self.hashes.get(from..).unwrap_or_default().to_vec())
        }
    }

    fn manager(meddles: usize) -> Turns {
        let mut cfg = ManagerConfig::new(
            16,
            vec![GroupSpec::new(crate::AttentionKind::FullAttention, 4)],
            64,
        );
        cfg.external_block_hashes = true;
        let mut m = KvCacheManager::new(cfg).unwrap();
        m.add_request("r", RequestSpec::default()).unwrap();
        Turns {
            m: RefCell::new(m),
            meddles: Cell::new(meddles),
        }
    }

    fn hash(b: u8) -> BlockHash {
        BlockHash::from_slice(&[b; 8]).unwrap()
    }

    const SYNC: EngineSync<'static> = EngineSync {
        id: "r",
        shared_prefix_boundary: None,
        num_prompt_tokens: None,
    };

    #[test]
    fn reads_the_new_items_and_starts_over_when_the_request_changed() {
        let mgr = manager(1);
        let lists = || Lists {
            tokens: vec![1, 2, 3, 4, 5],
            hashes: vec![hash(1)],
        };
        // The first apply met a request another call had grown: the second
        // attempt took a new anchor and read the items past it.
        let out = SYNC.run(&mgr, |_| Ok(lists())).unwrap();
        assert_eq!(out, SyncOutcome::Synced { rewound: false });
        assert_eq!(mgr.m.borrow().num_tokens("r").unwrap(), 5);
        assert_eq!(mgr.m.borrow().block_hashes("r").unwrap(), &[hash(1)]);
        let out = SYNC.run(&mgr, |_| Ok(lists())).unwrap();
        assert_eq!(out, SyncOutcome::Synced { rewound: false });
    }

    #[test]
    fn gives_up_after_every_attempt_met_a_change() {
        let mgr = manager(SYNC_ATTEMPTS);
        let lists = Lists {
            tokens: vec![1, 2],
            hashes: vec![],
        };
        let out = SYNC.run(&mgr, |_| Ok(lists)).unwrap();
        assert_eq!(out, SyncOutcome::KeptChanging);
    }
}
