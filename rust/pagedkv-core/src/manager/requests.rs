//! Registering requests and growing them: `add_request` (a prompt hashed in
//! place, taking the hashes it shares with a live request that began like it,
//! or handed to the hash worker), `append_token_ids`, and the `max_model_len`
//! room check.

use super::KvCacheManager;
use crate::error::{Error, Result, invalid};
use crate::request::{HashWorker, Request, RequestSpec};
use crate::request_table::RequestHandle;
use std::hash::{Hash, Hasher};

impl KvCacheManager {
    /// Whether block hashes are kept up to date (caching or events need them).
    pub(super) fn hashing(&self) -> bool {
        !self.cfg.external_block_hashes
            && (self.cfg.enable_caching || self.coord.pool().events_enabled())
    }

    // ---- requests ---------------------------------------------------------

    /// Registers a request and hashes its full prompt blocks.
    ///
    /// # Errors
    /// Duplicate id; a prompt longer than `max_model_len`; inconsistent
    /// multimodal items or embeddings.
    pub fn add_request(&mut self, id: &str, spec: RequestSpec) -> Result<RequestHandle> {
        if self.table.contains(id) {
            return Err(Error::DuplicateRequest(id.to_owned()));
        }
        // An engine may register a request before any token (vLLM allows it).
        if !(self.cfg.external_block_hashes && spec.prompt_token_ids.is_empty()) {
            super::prepared::check_prompt(&spec, self.cfg.max_model_len)?;
        }
        let mut req = Request::new(
            id.to_owned(),
            self.table.next_uid(),
            spec,
            self.num_groups(),
            self.hash_block_size,
            self.cfg.verify_cached_tokens && self.cfg.enable_caching,
        )?;
        // The request's `hash_sources` slot, where it becomes the source.
        let mut source = None;
        if self.hashing() {
            let full_blocks = req.num_tokens() / self.hash_block_size;
            if full_blocks > 0 && self.start_background_worker() {
                if let Some(worker) = &self.hash_worker {
                    req.hash_in_background(worker, &self.hasher, self.hash_block_size);
                }
            } else {
                source = self.take_shared_hashes(&mut req);
                req.update_hashes(&mut self.hasher, self.hash_block_size);
            }
        }
        let uid = req.uid;
        let slot = self.table.insert(id, req)?;
        if let Some(i) = source {
            self.hash_sources[i] = (slot, uid);
        }
        Ok(self.table.handle_of(slot))
    }

    /// With the memo on, for a request about to be hashed in place whose
    /// hashes follow its tokens: takes the hashes of the blocks it shares
    /// from the start with the last live request that began like it. Returns
    /// the request's [`Self::hash_sources`] slot (where it becomes the
    /// source), `None` for a request that is no source. Only such requests
    /// become sources, and what makes their hashes follow their tokens never
    /// changes, so a live source with the recorded uid still qualifies.
    fn take_shared_hashes(&mut self, req: &mut Request) -> Option<usize> {
        if self.hash_sources.is_empty() || !req.hashes_follow_tokens() {
            return None;
        }
        let bs = self.hash_block_size;
        let mut h = rustc_hash::FxHasher::default();
        req.tokens().get(..bs)?.hash(&mut h);
        let i = h.finish() as usize % self.hash_sources.len();
        let (slot, uid) = self.hash_sources[i];
        if let Some(src) = self.table.live(slot)
            && src.uid == uid
        {
            let n = req.take_shared_hashes(src, bs);
            self.shared_hash_blocks += n as u64;
        }
        Some(i)
    }

    /// Appends generated tokens; blocks that fill get hashed.
    ///
    /// # Errors
    /// Unknown request, or one that would pass `max_model_len` tokens (nothing
    /// is appended then).
    pub fn append_token_ids(&mut self, id: &str, tokens: &[u32]) -> Result<()> {
        let slot = self.table.slot(id)?;
        self.check_room(slot, tokens.len())?;
        let hasher = self.hashing().then_some(&mut self.hasher);
        self.table
            .get_mut(slot)
            .append_tokens(tokens, hasher, self.hash_block_size);
        Ok(())
    }

    /// Whether prompts go to the hash worker: `background_hashing` is on and the
    /// thread runs (started on first use; false, hashing in place, if it cannot
    /// be started).
    fn start_background_worker(&mut self) -> bool {
        if !self.cfg.background_hashing {
            return false;
        }
        if self
            .hash_worker
            .as_ref()
            .is_some_and(HashWorker::left_behind)
        {
            // A forked child's: dropped without a join (see `crate::fork`).
            self.hash_worker = None;
        }
        if self.hash_worker.is_none() {
            self.hash_worker = HashWorker::spawn().ok();
        }
        self.hash_worker.is_some()
    }

    /// Refuses tokens that would take the request past `max_model_len`.
    pub(crate) fn check_room(&self, slot: u32, n: usize) -> Result<()> {
        let req = self.table.get(slot);
        let total = req.num_tokens() as u64 + n as u64;
        if total > self.cfg.max_model_len {
            return Err(invalid(format!(
                "request {:?} would have {total} tokens, more than max_model_len {}",
                req.id, self.cfg.max_model_len
            )));
        }
        Ok(())
    }
}
