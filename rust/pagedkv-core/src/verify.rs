//! Hit verification (`verify_cached_tokens`): what each cached block was
//! computed for, so a prefix hit through a colliding hash is cut short at the
//! first block that does not match the request.

use crate::error::{Error, Result};
use crate::pool::{BlockId, BlockPool, NULL_BLOCK};
use crate::request::Request;

/// What a cached block was computed for.
#[derive(Clone, Debug)]
struct Provenance {
    /// The pool's cache stamp when this was recorded (stale once it differs).
    stamp: u64,
    /// The block's token ids (as many as the request had when it was cached).
    tokens: Vec<u32>,
    /// The request's context digest at the end of each hash block covered.
    ctx_ends: Vec<[u8; 32]>,
}

/// Provenance records per block and the failure counter; empty when
/// verification is off.
#[derive(Clone, Debug, Default)]
pub(crate) struct Verifier {
    provenance: Vec<Option<Box<Provenance>>>,
    failures: u64,
}

impl Verifier {
    /// Records for a pool of `num_blocks` blocks, or none when `enabled` is false.
    pub(crate) fn new(enabled: bool, num_blocks: u32) -> Result<Self> {
        let mut provenance = Vec::new();
        if enabled {
            let n = num_blocks.max(1) as usize;
            provenance.try_reserve_exact(n).map_err(|_| {
                Error::InvalidConfig(crate::pool::cannot_allocate(
                    num_blocks,
                    size_of::<Option<Box<Provenance>>>(),
                ))
            })?;
            provenance.resize(n, None);
        }
        Ok(Self {
            provenance,
            failures: 0,
        })
    }

    /// Prefix hits cut short so far.
    pub(crate) fn failures(&self) -> u64 {
        self.failures
    }

    /// Counts one hit cut short.
    pub(crate) fn count_failure(&mut self) {
        self.failures += 1;
    }

    /// Records what block `i` of the request's group `g` (blocks of `bs`
    /// tokens, hashes of `hbs`) was computed for, when the block is cached and
    /// the record is missing, stale or shorter than it can be.
    pub(crate) fn record(
        &mut self,
        pool: &BlockPool,
        req: &Request,
        g: usize,
        i: usize,
        bs: usize,
        hbs: usize,
    ) {
        let b = req.groups()[g].blocks()[i];
        if b == NULL_BLOCK {
            return;
        }
        let Some(stamp) = pool.cache_stamp(b) else {
            return;
        };
        let start = i * bs;
        let end = (start + bs).min(req.tokens().len());
        let hashed_end = end.min(req.ctx().len() * hbs);
        if hashed_end <= start {
            return;
        }
        let slot = &mut self.provenance[b as usize];
        if slot
            .as_deref()
            .is_some_and(|p| p.stamp == stamp && p.tokens.len() >= end - start)
        {
            return;
        }
        *slot = Some(Box::new(Provenance {
            stamp,
            tokens: req.tokens()[start..end].to_vec(),
            ctx_ends: req.ctx()[start / hbs..hashed_end / hbs].to_vec(),
        }));
    }

    /// The start (in tokens) of the first hit block that does not match the
    /// request: a stale or missing record, other token ids, or another context.
    /// `block_sizes[g]` is group `g`'s block size; the hit is `hit` tokens long.
    pub(crate) fn first_unverified(
        &self,
        pool: &BlockPool,
        req: &Request,
        block_ids: &[Vec<BlockId>],
        block_sizes: impl Fn(usize) -> usize,
        hit: usize,
        hbs: usize,
    ) -> Option<usize> {
        let mut first: Option<usize> = None;
        for (g, blocks) in block_ids.iter().enumerate() {
            let bs = block_sizes(g);
            for (i, &b) in blocks.iter().enumerate() {
                let start = i * bs;
                let end = (start + bs).min(hit);
                if b == NULL_BLOCK || end <= start {
                    continue;
                }
                let ok = self.provenance[b as usize].as_deref().is_some_and(|p| {
                    let covered = end - start;
                    let hashed = covered / hbs;
                    Some(p.stamp) == pool.cache_stamp(b)
                        && hashed > 0
                        && p.tokens.len() >= covered
                        && p.tokens[..covered] == req.tokens()[start..end]
                        && p.ctx_ends.get(hashed - 1) == req.ctx().get(start / hbs + hashed - 1)
                });
                if !ok {
                    first = Some(first.map_or(start, |f| f.min(start)));
                    break;
                }
            }
        }
        first
    }
}
