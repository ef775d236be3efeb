//! The calls of a serving engine that owns its requests (vLLM's drop-in): block
//! hashes supplied by the engine, frees deferred past an in-flight step, hits
//! handed back as plain block ids, and prefix-cache stats recorded by the
//! scheduler.

use super::{ComputedBlocks, KvCacheManager};
use crate::error::{Error, Result, invalid};
use crate::hash::BlockHash;
use crate::pool::{BlockId, CacheKey, NULL_BLOCK};
use crate::request::{Request, RequestSpec};
use crate::request_table::RequestHandle;
use crate::single_type::{GroupBlocks, GroupManager, Need};
use crate::spec::MAX_TOKENS;
use crate::stats::PrefixCacheStats;

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
            token_limit: usize::try_from(self.cfg.max_model_len).unwrap_or(usize::MAX),
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

    /// Detaches the request's blocks without returning them to the pool and
    /// forgets the request: the blocks, in allocation order (group by group,
    /// leading null blocks dropped), stay referenced until
    /// [`Self::free_blocks`] returns them (vLLM's deferred free while a step
    /// that may still write them is in flight).
    ///
    /// # Errors
    /// Unknown request.
    pub fn pop_blocks_for_free(&mut self, id: &str) -> Result<Vec<BlockId>> {
        let slot = self.table.slot(id)?;
        let req = self.table.get_mut(slot);
        let uid = req.uid;
        self.pending_split.take_if(|p| p.uid == uid);
        if req.release(false) {
            self.num_admitted -= 1;
        }
        let blocks = self.coord.pop_blocks(req);
        self.table.remove(id, slot);
        Ok(blocks)
    }

    /// Returns detached blocks ([`Self::pop_blocks_for_free`]) to the pool in
    /// eviction order: the first is evicted first. Null blocks are skipped.
    ///
    /// # Errors
    /// A block that is not detached (as often as it is listed); nothing is
    /// freed then.
    pub fn free_blocks(&mut self, ordered: &[BlockId]) -> Result<()> {
        self.coord.pool_mut().engine_release(ordered, "freed")?;
        self.coord.pool_mut().free_blocks(ordered.iter().copied());
        Ok(())
    }

    /// Takes one more reference on each block for the engine (vLLM's
    /// `BlockPool.touch`): a free block leaves the free queue and keeps its
    /// cache entries. The engine returns the reference with
    /// [`Self::free_blocks`] or [`Self::unpin_blocks`]. The null block is
    /// skipped.
    ///
    /// # Errors
    /// A block id outside the pool; nothing is touched then.
    pub fn touch_blocks(&mut self, ids: &[BlockId]) -> Result<()> {
        let n = self.coord.pool().num_blocks();
        if let Some(&b) = ids.iter().find(|&&b| b >= n) {
            return Err(invalid(format!(
                "block {b} is not in the pool of {n} blocks"
            )));
        }
        self.coord.pool_mut().touch(ids);
        for &b in ids {
            if b != NULL_BLOCK {
                self.coord.pool_mut().engine_hold(b);
            }
        }
        Ok(())
    }

    /// Returns engine-held references whose blocks stay readable until the
    /// pool reuses them (vLLM's `BlockPool.unpin_blocks`): a block no one
    /// references any more joins the tail of the free queue, cached or not,
    /// so it is evicted last, and [`Self::take_reused_blocks`] reports it once
    /// the pool hands it out again or a reset wipes the cache.
    ///
    /// # Errors
    /// A block the engine holds fewer references on than listed; nothing
    /// changes then.
    pub fn unpin_blocks(&mut self, ids: &[BlockId]) -> Result<()> {
        self.coord.pool_mut().engine_release(ids, "unpinned")?;
        self.coord.pool_mut().unpin(ids);
        Ok(())
    }

    /// The unpinned blocks ([`Self::unpin_blocks`]) the pool handed out again
    /// since the last call, in that order (every allocation path: requests'
    /// blocks, copy-on-write copies, [`Self::get_new_blocks`]), and after a
    /// prefix-cache reset every unpinned block not reported yet. Left
    /// undrained, the list stays within four entries a pool block: a block
    /// reused again then keeps its first listing only, so no reuse goes
    /// unreported.
    pub fn take_reused_blocks(&mut self) -> Vec<BlockId> {
        self.coord.pool_mut().take_reused()
    }

    /// Takes `n` blocks from the free queue (evicting cached ones as vLLM's
    /// pool does) for the engine's own use, outside any request: they count as
    /// detached until [`Self::free_blocks`] returns them. `None` when fewer
    /// than `n` are free (nothing taken).
    pub fn get_new_blocks(&mut self, n: u32) -> Option<Vec<BlockId>> {
        let mut out = Vec::new();
        if !self.coord.pool_mut().get_new_blocks(n, &mut out) {
            return None;
        }
        for &b in &out {
            self.coord.pool_mut().engine_hold(b);
        }
        Some(out)
    }

    /// Publishes blocks the engine holds ([`Self::get_new_blocks`]) and has
    /// filled with the request's tokens into the prefix cache of group `group`:
    /// `blocks[i]` holds the request's block `i`, and blocks `num_cached_blocks`
    /// to `num_full_blocks` (those `mask` keeps: one entry per block of the
    /// range) are cached under the request's hashes, with one `BlockStored`
    /// (vLLM's `BlockPool.cache_full_blocks`; a connector that loaded KV
    /// computed elsewhere). The blocks stay the engine's until
    /// [`Self::free_blocks`], which returns them as cached, evictable blocks.
    ///
    /// # Errors
    /// Unknown request or group; a range past `blocks` or past the request's
    /// hashed tokens; a mask of another length; a block in the range the
    /// engine does not hold, or that a request holds too, or that is cached
    /// under another key (a shorter entry of the same group is promoted, as
    /// vLLM does). Nothing is cached then.
    pub fn cache_detached_blocks(
        &mut self,
        id: &str,
        group: usize,
        blocks: &[BlockId],
        (num_cached_blocks, num_full_blocks): (usize, usize),
        mask: Option<&[bool]>,
    ) -> Result<()> {
        let slot = self.table.slot(id)?;
        let gm = self.group_manager(group)?;
        let req = self.table.get(slot);
        let bs = gm.block_size() as usize;
        // A block is published only with every token it holds.
        let hashed = (req.hashes().len() * self.hash_block_size).min(req.num_tokens());
        if num_full_blocks > blocks.len() || num_full_blocks * bs > hashed {
            return Err(invalid(format!(
                "blocks {num_cached_blocks}..{num_full_blocks} are past the {} given or the \
                 {hashed} hashed tokens of request {id:?}",
                blocks.len()
            )));
        }
        let range = num_cached_blocks.min(num_full_blocks)..num_full_blocks;
        if let Some(m) = mask
            && m.len() != range.len()
        {
            return Err(invalid(format!(
                "the mask has {} entries for {} blocks",
                m.len(),
                range.len()
            )));
        }
        for (i, &b) in blocks.iter().enumerate().take(range.end).skip(range.start) {
            if b == NULL_BLOCK || mask.is_some_and(|m| !m[i - range.start]) {
                continue;
            }
            self.check_engine_only(b)?;
            // A block cached under another key holds other content (vLLM
            // asserts), except a shorter partial entry of the same group,
            // which is promoted.
            let tokens = ((i + 1) * bs) as u32;
            let key = gm.key_for(req.hashes(), i);
            let pool = self.coord.pool();
            if let (Some(k), Some(key)) = (pool.block_key(b), key)
                && k != key
                && (k.group != key.group || pool.primary_tokens(b).is_none_or(|t| t >= tokens))
            {
                return Err(invalid(format!(
                    "block {b} is cached under another hash already"
                )));
            }
        }
        if range.is_empty() {
            return Ok(());
        }
        self.coord
            .cache_blocks_held_outside(req, group, blocks, (range.start, range.end), mask);
        Ok(())
    }

    /// Makes a block the engine holds ([`Self::get_new_blocks`]) reachable from
    /// the request's prefix boundary of `num_tokens` tokens in group `group`: a
    /// partial entry under the hash of the hash block ending there (vLLM's
    /// `BlockPool.cache_partial_block`). With `replace_existing`, the block's
    /// entries are dropped first (its contents were replaced). Returns the key
    /// the entry is under; `None` for the null block (nothing cached).
    ///
    /// # Errors
    /// Unknown request or group; `num_tokens` not a positive multiple of the
    /// hash block size, or past the request's hashed tokens; a block the
    /// engine does not hold, or that a request holds too, or (unless replaced)
    /// cached in another group.
    pub fn cache_detached_partial_block(
        &mut self,
        id: &str,
        group: usize,
        block: BlockId,
        num_tokens: usize,
        replace_existing: bool,
    ) -> Result<Option<CacheKey>> {
        let slot = self.table.slot(id)?;
        let group_id = self.group_manager(group)?.group_id();
        let req = self.table.get(slot);
        let hbs = self.hash_block_size;
        let hashed = (req.hashes().len() * hbs).min(req.num_tokens());
        if num_tokens == 0 || !num_tokens.is_multiple_of(hbs) || num_tokens > hashed {
            return Err(invalid(format!(
                "a partial entry ends on a hash block boundary within the {hashed} hashed \
                 tokens of request {id:?}, not at {num_tokens}"
            )));
        }
        if block == NULL_BLOCK {
            return Ok(None);
        }
        self.check_engine_only(block)?;
        // A block holds one group's content: entries of another group's are
        // refused unless they are all replaced.
        if !replace_existing
            && let Some(k) = self.coord.pool().block_key(block)
            && k.group != group_id
        {
            return Err(invalid(format!(
                "block {block} is cached in group {} already",
                k.group
            )));
        }
        Ok(Some(self.coord.cache_partial_held_outside(
            req,
            group,
            block,
            num_tokens,
            replace_existing,
        )))
    }

    /// The manager of group `group`.
    pub(super) fn group_manager(&self, group: usize) -> Result<&GroupManager> {
        let groups = self.coord.groups();
        groups.get(group).ok_or_else(|| {
            invalid(format!(
                "group {group} is past the manager's {}",
                groups.len()
            ))
        })
    }

    /// Refuses a block the engine does not hold, or one a request holds too
    /// (its cache entries are that request's to keep).
    fn check_engine_only(&self, b: BlockId) -> Result<()> {
        let held = self.coord.pool().engine_refs_of(b);
        if held == 0 {
            return Err(invalid(format!(
                "block {b} is not held by the engine (get_new_blocks or pop_blocks_for_free)"
            )));
        }
        if self.coord.pool().ref_cnt(b) > held {
            return Err(invalid(format!(
                "block {b} is held by a request too: its cache entries stay as they are"
            )));
        }
        Ok(())
    }

    /// Leading blocks of the request already cached, per group (`None` in a
    /// group the request has not run in yet: vLLM's `num_cached_block` entry).
    ///
    /// # Errors
    /// Unknown request.
    pub fn num_cached_blocks(&self, id: &str) -> Result<Vec<Option<usize>>> {
        let req = self.table.get(self.table.slot(id)?);
        Ok(req.groups().iter().map(GroupBlocks::num_cached).collect())
    }

    /// vLLM's `estimate_cached_tokens`: over the prefix-cacheable groups, the
    /// fewest of (the most prefix tokens any of the request's blocks is cached
    /// for) in each group; 0 when none.
    ///
    /// # Errors
    /// Unknown request.
    pub fn estimate_cached_tokens(&self, id: &str) -> Result<u64> {
        let req = self.table.get(self.table.slot(id)?);
        let pool = self.coord.pool();
        let per_group = self
            .coord
            .groups()
            .iter()
            .zip(req.groups())
            .filter(|(gm, _)| gm.prefix_cacheable())
            .map(|(_, gb)| {
                gb.blocks()
                    .iter()
                    .filter(|&&b| b != NULL_BLOCK)
                    .filter_map(|&b| pool.primary_tokens(b))
                    .max()
                    .unwrap_or(0)
            });
        Ok(per_group.min().map_or(0, u64::from))
    }

    /// Block references detached by [`Self::pop_blocks_for_free`] and not yet
    /// returned.
    #[must_use]
    pub fn num_detached_block_refs(&self) -> u64 {
        self.coord
            .pool()
            .engine_refs()
            .map(|(_, n)| u64::from(n))
            .sum()
    }

    /// A prefix hit named by block ids per group (what an engine hands back
    /// from an earlier lookup). With `check_cached`, every block must be cached
    /// under the request's own hash at its position; without, the engine
    /// vouches for them (vLLM adopts whatever blocks its caller passes, e.g. a
    /// connector's freshly taken blocks), and each block only has to exist.
    ///
    /// # Errors
    /// Unknown request; a block out of range, or (checked) not the request's
    /// cached block there; the wrong number of groups.
    pub fn computed_blocks_from_ids(
        &self,
        id: &str,
        block_ids: Vec<Vec<BlockId>>,
        num_computed_tokens: u64,
        check_cached: bool,
    ) -> Result<ComputedBlocks> {
        let slot = self.table.slot(id)?;
        let req = self.table.get(slot);
        if num_computed_tokens > req.num_tokens() as u64 {
            return Err(invalid(format!(
                "num_computed_tokens {num_computed_tokens} exceeds the request's {} tokens",
                req.num_tokens()
            )));
        }
        if block_ids.len() != self.num_groups() {
            return Err(invalid(format!(
                "computed blocks name {} groups; the manager has {}",
                block_ids.len(),
                self.num_groups()
            )));
        }
        let n = self.coord.pool().num_blocks();
        if let Some(&b) = block_ids.iter().flatten().find(|&&b| b >= n) {
            return Err(invalid(format!("block id {b} is out of range (0..{n})")));
        }
        if let Some(b) = check_cached
            .then(|| self.coord.first_stale_hit_block(req, &block_ids))
            .flatten()
        {
            return Err(Error::StaleComputedBlocks(format!(
                "block {b} is not the request's cached block at its position"
            )));
        }
        Ok(ComputedBlocks {
            block_ids,
            num_computed_tokens,
            shared_prefix_boundary: 0,
            request_uid: req.uid,
            manager_uid: self.uid,
            epoch: self.coord.pool().epoch(),
        })
    }

    /// Records one admitted request's lookup (vLLM 0.33's scheduler calls this
    /// itself; see `record_stats_at_admission`). No-op with stats off.
    ///
    /// # Errors
    /// More hits than tokens, or a count past `2**40`.
    pub fn record_prefix_cache_stats(
        &mut self,
        num_tokens: u64,
        num_hits: u64,
        preempted: bool,
    ) -> Result<()> {
        if num_tokens > MAX_TOKENS || num_hits > num_tokens {
            return Err(invalid(format!(
                "{num_hits} hits of {num_tokens} tokens is not a lookup (at most 2**40 tokens)"
            )));
        }
        if let Some(s) = self.stats.as_mut() {
            s.record(num_tokens, num_hits, preempted);
        }
        Ok(())
    }

    /// The stats gathered since the last [`Self::make_prefix_cache_stats`],
    /// without resetting them; `None` with stats off.
    #[must_use]
    pub fn prefix_cache_stats(&self) -> Option<&PrefixCacheStats> {
        self.stats.as_ref()
    }
}

impl KvCacheManager {
    /// vLLM's `coordinator.get_num_blocks_to_allocate` without a new hit: the
    /// blocks the request (or, for `None`, a request holding none) needs to
    /// hold `num_tokens` tokens after `total_computed` computed ones, of which
    /// `num_local` were computed locally (the rest a connector imports; HiSparse
    /// groups count those apart). `apply_admission_cap` caps sliding-window,
    /// chunked-local and HiSparse resident groups at the in-flight admission
    /// bound, as vLLM's admission gate does.
    ///
    /// # Errors
    /// Unknown request; `num_local` past `total_computed`.
    pub fn num_blocks_to_allocate(
        &self,
        id: Option<&str>,
        num_tokens: u64,
        (total_computed, num_local): (u64, u64),
        num_tokens_main_model: u64,
        num_encoder_tokens: u64,
        apply_admission_cap: bool,
    ) -> Result<u64> {
        for n in [
            num_tokens,
            total_computed,
            num_tokens_main_model,
            num_encoder_tokens,
        ] {
            if n > MAX_TOKENS {
                return Err(invalid(format!(
                    "count {n} is out of range (at most 2**40)"
                )));
            }
        }
        if num_local > total_computed {
            return Err(invalid(format!(
                "{num_local} locally computed tokens of only {total_computed} computed"
            )));
        }
        let max_len = self.cfg.max_model_len;
        let need = Need {
            num_tokens: num_tokens.min(max_len),
            total_computed: total_computed.min(max_len),
            num_local: num_local.min(max_len),
            main_model: num_tokens_main_model.min(max_len),
            prefill_end: 0,
            cap: apply_admission_cap,
        };
        let blank;
        let req = if let Some(id) = id {
            self.table.get(self.table.slot(id)?)
        } else {
            blank = Request::new(
                String::new(),
                0,
                RequestSpec::default(),
                self.num_groups(),
                self.hash_block_size,
                false,
            )?;
            &blank
        };
        let (n, _) = self
            .coord
            .num_blocks_to_allocate(req, &need, &[], num_encoder_tokens);
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
