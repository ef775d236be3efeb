//! Requests synced from a serving engine that owns them (vLLM's drop-in).
//!
//! The engine's calls: block hashes supplied by the engine, frees deferred
//! past an in-flight step, hits handed back as plain block ids, and
//! prefix-cache stats recorded by the scheduler. This file holds the request
//! sync: engine-supplied tokens and block hashes (`extend_request`,
//! `sync_request`, `sync_from_engine` through the [`EngineRequest`] trait and
//! a [`SyncAnchor`]), the shared prefix boundary and prompts registered by
//! length. `engine_blocks` holds the blocks the engine holds outside requests,
//! `engine_lookup` its hits by block ids, read-outs and stats.

mod engine_blocks;
mod engine_lookup;

use super::KvCacheManager;
use crate::error::{Error, Result, invalid};
use crate::hash::BlockHash;
use crate::request::RequestSpec;
use crate::request_table::RequestHandle;

/// An engine's own copy of a request, as [`KvCacheManager::sync_from_engine`]
/// reads it: its whole token and block-hash lists, item by item or as the
/// suffix from an index on. Reading may fail (the engine's items may not be
/// token ids or hashes); `Error` carries the manager's own errors too.
pub trait EngineRequest {
    /// The error of a read, and of the manager's refusals.
    type Error: From<Error>;
    /// Tokens in the engine's list.
    fn num_tokens(&self) -> usize;
    /// Block hashes in the engine's list.
    fn num_hashes(&self) -> usize;
    /// Token `i` (below [`Self::num_tokens`]).
    ///
    /// # Errors
    /// An item that is not a token id.
    fn token(&self, i: usize) -> std::result::Result<u32, Self::Error>;
    /// Block hash `j` (below [`Self::num_hashes`]).
    ///
    /// # Errors
    /// An item that is not a block hash.
    fn hash(&self, j: usize) -> std::result::Result<BlockHash, Self::Error>;
    /// Whether block hash `j` (below [`Self::num_hashes`]) is `held`.
    ///
    /// # Errors
    /// An item that is not a block hash.
    fn hash_is(&self, j: usize, held: &BlockHash) -> std::result::Result<bool, Self::Error> {
        Ok(self.hash(j)? == *held)
    }
    /// Whether the tokens from index `from` on begin with `held` (all within
    /// [`Self::num_tokens`]).
    ///
    /// # Errors
    /// An item that is not a token id.
    fn tokens_are(&self, from: usize, held: &[u32]) -> std::result::Result<bool, Self::Error> {
        for (i, &t) in held.iter().enumerate() {
            if self.token(from + i)? != t {
                return Ok(false);
            }
        }
        Ok(true)
    }
    /// The tokens from index `from` on (none when `from` is past the end).
    ///
    /// # Errors
    /// An item that is not a token id; too many.
    fn tokens_from(&self, from: usize) -> std::result::Result<Vec<u32>, Self::Error>;
    /// The block hashes from index `from` on (none when `from` is past the end).
    ///
    /// # Errors
    /// An item that is not a block hash; too many.
    fn hashes_from(&self, from: usize) -> std::result::Result<Vec<BlockHash>, Self::Error>;
}

/// A request as the manager holds it, for checking an engine's copy against
/// ([`KvCacheManager::sync_anchor`]).
#[derive(Clone, Debug)]
pub struct SyncAnchor {
    slot: u32,
    uid: u64,
    num_tokens: usize,
    num_hashes: usize,
    last_hash: Option<BlockHash>,
    /// Where `tail` starts: the tokens past the last hashed block.
    tail_start: usize,
    /// The request's tokens from `tail_start` on, where token values are
    /// read (empty otherwise).
    tail: Vec<u32>,
    values: bool,
    /// `max_model_len`: the most tokens one read of the engine's lists needs.
    token_limit: usize,
}

impl SyncAnchor {
    /// The most tokens or hashes a read of the engine's lists may return
    /// (`max_model_len`, which no request passes).
    #[must_use]
    pub fn token_limit(&self) -> usize {
        self.token_limit
    }

    /// Where the manager's copy of the request and the engine's agree up to:
    /// `(tokens, hashes)`, the request's own lengths when the engine's lists
    /// only grew. On that path only the last hash held and, where token
    /// values are read, the last block's tokens are read from `src`; a
    /// difference or a shorter list reads `held()` (the request's whole
    /// lists, [`KvCacheManager::request_lists`]) and finds the first token
    /// and hash that differ.
    ///
    /// # Errors
    /// What `src` or `held` refuses.
    pub fn sync_point<S: EngineRequest>(
        &self,
        src: &S,
        held: impl FnOnce() -> std::result::Result<(Vec<u32>, Vec<BlockHash>), S::Error>,
    ) -> std::result::Result<(usize, usize), S::Error> {
        let (nt, nh) = (self.num_tokens, self.num_hashes);
        let (src_t, src_h) = (src.num_tokens(), src.num_hashes());
        if src_t >= nt && src_h >= nh {
            let hash_ok = match &self.last_hash {
                Some(h) => src.hash_is(nh - 1, h)?,
                None => true,
            };
            if hash_ok && src.tokens_are(self.tail_start, &self.tail)? {
                return Ok((nt, nh));
            }
        }
        // Rewritten: the first hash and (where values count) token that differ.
        let (held_tokens, held_hashes) = held()?;
        let mut keep_h = nh.min(src_h);
        for (j, h) in held_hashes.iter().enumerate().take(keep_h) {
            if src.hash(j)? != *h {
                keep_h = j;
                break;
            }
        }
        let mut keep_t = nt.min(src_t);
        if self.values {
            for (i, &t) in held_tokens.iter().enumerate().take(keep_t) {
                if src.token(i)? != t {
                    keep_t = i;
                    break;
                }
            }
        }
        Ok((keep_t, keep_h))
    }
}

impl KvCacheManager {
    /// Appends tokens and the engine's block hashes to a request (managers
    /// built with `external_block_hashes`), after the `at = (tokens, hashes)` the
    /// request holds. Hashes may run ahead of the tokens (vLLM's prefill-side
    /// connectors drop a prompt's last token after it was hashed); a block is
    /// cached only once all its tokens are there.
    ///
    /// # Errors
    /// Unknown request; a manager that hashes requests itself; `at` is not
    /// where the request's tokens and hashes end.
    pub fn extend_request(
        &mut self,
        id: &str,
        at: (usize, usize),
        tokens: &[u32],
        hashes: &[BlockHash],
    ) -> Result<()> {
        self.sync_request(id, at, tokens, hashes, None)
    }

    /// [`Self::extend_request`] and, with `Some`, [`Self::set_shared_prefix_boundary`]
    /// in one call: everything is checked before anything changes.
    ///
    /// # Errors
    /// As those two.
    pub fn sync_request(
        &mut self,
        id: &str,
        at: (usize, usize),
        tokens: &[u32],
        hashes: &[BlockHash],
        shared_prefix_boundary: Option<u64>,
    ) -> Result<()> {
        self.check_engine_mode("sync_request")?;
        if let Some(b) = shared_prefix_boundary {
            self.check_boundary(b)?;
        }
        let slot = self.table.slot(id)?;
        let req = self.table.get(slot);
        if at != (req.num_tokens(), req.hashes().len()) {
            return Err(invalid(format!(
                "request {id:?} holds {} tokens and {} block hashes, not {} and {}",
                req.num_tokens(),
                req.hashes().len(),
                at.0,
                at.1
            )));
        }
        if (req.num_tokens() + tokens.len()) as u64 > self.cfg.max_model_len {
            return Err(invalid(format!(
                "request {id:?} would have {} tokens, more than max_model_len {}",
                req.num_tokens() + tokens.len(),
                self.cfg.max_model_len
            )));
        }
        let req = self.table.get_mut(slot);
        req.extend_external(tokens, hashes);
        if let Some(b) = shared_prefix_boundary {
            req.set_shared_prefix_boundary(b);
        }
        Ok(())
    }

    /// Brings a request up to date with the engine's own copy of it (`src`:
    /// its whole token and block-hash lists), trusting nothing: the common
    /// case, lists that only grew, costs a check of the last hash the manager
    /// holds (and, where token values are read, the tokens of the last
    /// block) before the new items are read. An engine may rewrite a request
    /// in place (vLLM's streaming-input sessions drop the last sampled token
    /// and re-hash); then the request is cut back to the first token and hash
    /// that differ and re-read from there, so no block is ever cached under a
    /// hash or with tokens the request no longer has. With `Some`, the
    /// shared-prefix boundary and the prompt length are set too. Returns
    /// whether the request was cut back. Everything is read and checked
    /// before anything changes.
    ///
    /// The three steps, for a caller that must not hold the manager while it
    /// reads the engine's lists (they may run the engine's code):
    /// [`Self::sync_anchor`], [`SyncAnchor::sync_point`], [`Self::apply_sync`].
    ///
    /// # Errors
    /// Unknown request; a manager that hashes requests itself; a boundary or
    /// a request past `max_model_len`; a prompt longer than the request; a
    /// rewrite of tokens whose blocks the
    /// request has already cached (their KV was computed from the old
    /// tokens); what `src` refuses to read.
    pub fn sync_from_engine<S: EngineRequest>(
        &mut self,
        id: &str,
        src: &S,
        shared_prefix_boundary: Option<u64>,
        num_prompt_tokens: Option<usize>,
    ) -> std::result::Result<bool, S::Error> {
        let anchor = self.sync_anchor(id)?;
        let keep = anchor.sync_point(src, || Ok(self.request_lists(id)?))?;
        let tokens = src.tokens_from(keep.0)?;
        let hashes = src.hashes_from(keep.1)?;
        let synced = self.apply_sync(
            id,
            &anchor,
            keep,
            (&tokens, &hashes),
            shared_prefix_boundary,
            num_prompt_tokens,
        )?;
        Ok(synced.unwrap_or_else(|| unreachable!("nothing ran between the steps")))
    }

    /// What an engine's copy of the request is checked against
    /// ([`SyncAnchor::sync_point`]): the request's lengths and the items that
    /// anchor them, owned, so the manager need not be held while the engine's
    /// lists are read.
    ///
    /// # Errors
    /// Unknown request; a manager that hashes requests itself.
    pub fn sync_anchor(&self, id: &str) -> Result<SyncAnchor> {
        let slot = self.table.slot(id)?;
        self.check_engine_mode("sync_request")?;
        let req = self.table.get(slot);
        let (tokens, hashes) = (req.tokens(), req.hashes());
        let (nt, nh) = (tokens.len(), hashes.len());
        // Token values matter only where the manager reads them (events);
        // otherwise they are placeholders and only their number counts.
        let values = self.reads_token_values();
        // The tokens past the last hashed block (the last block's, when
        // hashes ran ahead): the hash chain covers the rest.
        let (tail_start, tail) = if values {
            let hbs = self.hash_block_size;
            let start = (nh * hbs).min(nt.saturating_sub(1) / hbs * hbs);
            (start, tokens[start..].to_vec())
        } else {
            (nt, Vec::new())
        };
        Ok(SyncAnchor {
            slot,
            uid: req.uid,
            num_tokens: nt,
            num_hashes: nh,
            last_hash: hashes.last().copied(),
            tail_start,
            tail,
            values,
            token_limit: self.cfg.token_limit(),
        })
    }

    /// The request's whole token and block-hash lists, copied (where a sync
    /// looks for the first difference).
    ///
    /// # Errors
    /// Unknown request.
    pub fn request_lists(&self, id: &str) -> Result<(Vec<u32>, Vec<BlockHash>)> {
        let req = self.table.get(self.table.slot(id)?);
        Ok((req.tokens().to_vec(), req.hashes().to_vec()))
    }

    /// Applies a sync: cuts the request back to `keep = (tokens, hashes)`
    /// ([`SyncAnchor::sync_point`]), appends `new` (the engine's items from
    /// there on) and sets what is `Some`. `None`, with nothing changed, when
    /// the request changed since `anchor` was taken (another call ran in
    /// between: take a new anchor). Else whether it was cut back.
    ///
    /// # Errors
    /// As [`Self::sync_from_engine`]; nothing changes then.
    pub fn apply_sync(
        &mut self,
        id: &str,
        anchor: &SyncAnchor,
        (keep_tokens, keep_hashes): (usize, usize),
        (tokens, hashes): (&[u32], &[BlockHash]),
        shared_prefix_boundary: Option<u64>,
        num_prompt_tokens: Option<usize>,
    ) -> Result<Option<bool>> {
        self.check_engine_mode("sync_request")?;
        if let Some(b) = shared_prefix_boundary {
            self.check_boundary(b)?;
        }
        let slot = anchor.slot;
        // The anchor names its request instance (a removed request's slot may
        // hold another one now).
        let Some(req) = self.table.live(slot).filter(|r| r.uid == anchor.uid) else {
            return match self.table.slot(id) {
                Ok(_) => Ok(None),
                Err(e) => Err(e),
            };
        };
        if req.id != id {
            return Err(invalid(format!(
                "the sync anchor is request {:?}'s, not {id:?}'s",
                req.id
            )));
        }
        let held = req.hashes();
        if (req.num_tokens(), held.len()) != (anchor.num_tokens, anchor.num_hashes)
            || held.last() != anchor.last_hash.as_ref()
        {
            return Ok(None);
        }
        if keep_tokens > anchor.num_tokens || keep_hashes > anchor.num_hashes {
            return Err(invalid(format!(
                "a sync keeps {keep_tokens} tokens and {keep_hashes} block hashes of \
                 request {id:?}, which holds {} and {}",
                anchor.num_tokens, anchor.num_hashes
            )));
        }
        let total = keep_tokens + tokens.len();
        if total as u64 > self.cfg.max_model_len {
            return Err(invalid(format!(
                "request {id:?} would have {total} tokens, more than max_model_len {}",
                self.cfg.max_model_len
            )));
        }
        if let Some(p) = num_prompt_tokens
            && p > total
        {
            return Err(invalid(format!(
                "request {id:?} has a prompt of {p} tokens but only {total} tokens"
            )));
        }
        let rewound = (keep_tokens, keep_hashes) != (anchor.num_tokens, anchor.num_hashes);
        if rewound {
            self.check_rewind(slot, keep_tokens, keep_hashes)?;
            self.table
                .get_mut(slot)
                .truncate_external(keep_tokens, keep_hashes);
            // A lookup taken before the rewrite named blocks under the old
            // hashes: it is checked again before it is adopted.
            self.coord.pool_mut().invalidate_lookups();
        }
        let req = self.table.get_mut(slot);
        req.extend_external(tokens, hashes);
        if let Some(b) = shared_prefix_boundary {
            req.set_shared_prefix_boundary(b);
        }
        if let Some(p) = num_prompt_tokens {
            req.num_prompt_tokens = p;
        }
        Ok(Some(rewound))
    }

    /// Refuses cutting a request back below a block it has cached: that
    /// block's KV was computed from the tokens being replaced.
    fn check_rewind(&self, slot: u32, keep_tokens: usize, keep_hashes: usize) -> Result<()> {
        let req = self.table.get(slot);
        let limit = keep_tokens.min(keep_hashes * self.hash_block_size);
        for (g, gm) in self.coord.groups().iter().enumerate() {
            let cached = req.groups()[g].num_cached().unwrap_or(0);
            let bs = gm.block_size() as usize;
            if cached * bs > limit {
                return Err(invalid(format!(
                    "request {:?} was rewritten from token {limit} on, but group {g} has \
                     cached its first {} tokens: their KV was computed from the old tokens",
                    req.id,
                    cached * bs
                )));
            }
        }
        Ok(())
    }

    /// Sets the request's shared-prefix boundary (vLLM's
    /// `Request.shared_prefix_boundary`, which its scheduler copies from the
    /// lookup): sparse-retention groups keep the block ending there cached.
    ///
    /// # Errors
    /// Unknown request; a manager that sets the boundary at lookup itself; a
    /// boundary past `max_model_len`.
    pub fn set_shared_prefix_boundary(&mut self, id: &str, boundary: u64) -> Result<()> {
        self.check_engine_mode("set_shared_prefix_boundary")?;
        self.check_boundary(boundary)?;
        let slot = self.table.slot(id)?;
        self.table
            .get_mut(slot)
            .set_shared_prefix_boundary(boundary);
        Ok(())
    }

    /// Whether the manager reads the values of a request's token ids, not only
    /// their number: it hashes them itself, checks hits against them, or
    /// publishes them in `BlockStored` events. One that does none of these (an
    /// engine's own hashes and events off, vLLM's default) only counts them,
    /// and takes a prompt by its length ([`Self::add_request_counted`]).
    #[must_use]
    pub fn reads_token_values(&self) -> bool {
        !self.cfg.external_block_hashes
            || self.coord.pool().events_enabled()
            || self.cfg.verify_cached_tokens
    }

    /// [`Self::add_request`] with the prompt given by its length alone
    /// (`spec.prompt_token_ids` empty), for a manager that does not read token
    /// values ([`Self::reads_token_values`]): an engine need not convert ids
    /// nothing reads. The request's tokens past the prompt come as usual.
    ///
    /// # Errors
    /// A manager that reads token values; token ids in `spec`; as
    /// [`Self::add_request`].
    pub fn add_request_counted(
        &mut self,
        id: &str,
        num_prompt_tokens: usize,
        mut spec: RequestSpec,
    ) -> Result<RequestHandle> {
        if self.reads_token_values() {
            return Err(invalid(
                "this manager reads token ids (it hashes them, verifies hits against \
                 them or publishes them in events): pass the prompt's token ids",
            ));
        }
        if !spec.prompt_token_ids.is_empty() {
            return Err(invalid("a prompt given by its length carries no token ids"));
        }
        // Checked before the placeholder ids are allocated.
        if num_prompt_tokens as u64 > self.cfg.max_model_len {
            return Err(invalid(format!(
                "prompt of {num_prompt_tokens} tokens is longer than max_model_len {}",
                self.cfg.max_model_len
            )));
        }
        // Placeholder values: only their number is ever read.
        spec.prompt_token_ids = vec![0; num_prompt_tokens];
        self.add_request(id, spec)
    }

    fn check_engine_mode(&self, call: &str) -> Result<()> {
        if self.cfg.external_block_hashes {
            Ok(())
        } else {
            Err(invalid(format!(
                "{call} needs a manager built with external_block_hashes"
            )))
        }
    }

    fn check_boundary(&self, boundary: u64) -> Result<()> {
        if boundary > self.cfg.max_model_len {
            return Err(invalid(format!(
                "shared_prefix_boundary {boundary} is past max_model_len {}",
                self.cfg.max_model_len
            )));
        }
        Ok(())
    }
}
