//! One request's state: its tokens, block hashes, extra keys and per-group
//! block lists, laid out so that a decode step reads its first two cache lines.
//!
//! What `add_request` takes (`RequestSpec`, `Lora`, `MmFeature`) and the
//! request's accessors and mutations are here; its block hashes and extra keys
//! in `hashing`, the prompt-hash worker in `hash_worker`, one group's blocks
//! (`GroupBlocks`, which the group managers change) in `group_blocks`. The table of
//! requests is `crate::request_table`.

mod group_blocks;
mod hash_worker;
mod hashing;

use crate::error::{Result, invalid};
use crate::hash::{BlockHash, BlockHasher, sha256_bytes};
pub(crate) use group_blocks::GroupBlocks;
use hash_worker::HashJob;
pub(crate) use hash_worker::HashWorker;
use std::sync::Arc;

/// `LoRA` adapter of a request (`lora_id` only travels in events).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Lora {
    /// Adapter name (part of every block's hash).
    pub name: String,
    /// Adapter path (part of the hash when given).
    pub path: Option<String>,
    /// Adapter id, published in events only.
    pub id: Option<i64>,
}

impl Lora {
    /// The adapter of `add_request`'s `lora_name` / `lora_path` / `lora_id`: none
    /// at all, or a name with an optional path and id.
    ///
    /// # Errors
    /// A path or an id without a name.
    pub fn from_parts(
        name: Option<String>,
        path: Option<String>,
        id: Option<i64>,
    ) -> Result<Option<Self>> {
        match (name, path, id) {
            (None, None, None) => Ok(None),
            (Some(name), path, id) => Ok(Some(Self { name, path, id })),
            _ => Err(invalid("lora_path / lora_id need a lora_name")),
        }
    }
}

/// A multimodal item's placeholder span in the prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MmFeature {
    /// The item's identifier (its content hash).
    pub identifier: String,
    /// First placeholder token of the item in the prompt.
    pub offset: u64,
    /// Placeholder tokens of the item.
    pub length: u64,
}

/// Output tokens a request's token vector holds room for beyond its prompt:
/// a prompt vector with less spare capacity is grown once when the request is
/// added (a caller building the vector reserves it up front and saves that
/// copy), so the first decode steps append without copying the prompt.
pub const OUTPUT_ROOM: usize = 256;

/// Everything `add_request` takes besides the id.
#[derive(Clone, Debug, Default)]
pub struct RequestSpec {
    /// The prompt (given [`OUTPUT_ROOM`] spare capacity, if it has less).
    pub prompt_token_ids: Vec<u32>,
    /// The request's `LoRA` adapter.
    pub lora: Option<Lora>,
    /// Isolates the request's cached prefix (part of the first block's hash).
    pub cache_salt: Option<String>,
    /// Multimodal items, by offset.
    pub mm_features: Vec<MmFeature>,
    /// Raw bytes of the prompt embeddings, row-major, one row per prompt token.
    pub prompt_embeds: Option<Vec<u8>>,
    /// Prompt-logprobs / all-pooling requests never read the prefix cache.
    pub skip_reading_prefix_cache: bool,
    /// The client session the request belongs to (published on its events).
    pub session_id: Option<String>,
}

/// One request's state. Its fields are read across the crate and written only
/// here and, for the per-group block lists, by the group managers.
///
/// Laid out for a decode step on cold caches: what `allocate_slots` and
/// `append_token_ids` read of a running request (its token and hash counts,
/// the pending hash job, its step counts, the group block lists, `admitted`)
/// sits in its first two cache lines; the rest follows.
#[derive(Clone, Debug)]
#[repr(C, align(64))]
pub(crate) struct Request {
    /// The token ids (read through [`Self::tokens`]: while the prompt is hashed
    /// in the background, the hash job holds them and this is empty).
    tokens: Vec<u32>,
    /// The block hashes (read through [`Self::hashes`]: while the prompt is
    /// hashed in the background they are in `pending`).
    hash_vec: Vec<BlockHash>,
    /// The prompt's hashes being computed on the manager's hash worker.
    pending: Option<Arc<HashJob>>,
    /// Tokens lent to the pending hash job (the prompt, not copied), returned
    /// when the request settles; 0 once they are back.
    lent: usize,
    /// Tokens computed once the last allocated step has run: its computed tokens
    /// (hit and external included) plus the tokens it scheduled. What a decode
    /// step's `num_computed_tokens` is when the caller does not pass it.
    pub scheduled_through: u64,
    /// Tokens computed when the last allocation started (vLLM reads
    /// `request.num_computed_tokens` while caching).
    pub num_computed_at_step: u64,
    /// A running step that needs no block and publishes none, at a glance:
    /// `(slots, cached)`, the step's slots (computed plus new plus lookahead
    /// tokens) and its tokens to cache below these take no block and publish
    /// none in any group ([`crate::coordinator::Coordinator::step_limits`]).
    /// `(0, 0)`: not known, the groups decide. Reset by every mutable access to
    /// the groups ([`Self::groups_mut`]), set after an allocation.
    step_limits: (u64, u64),
    /// The blocks per KV-cache group (read through [`Self::groups`], changed
    /// through [`Self::groups_mut`]).
    group_vec: Vec<GroupBlocks>,
    /// Holds an allocation (between a successful `allocate_slots` and `free`).
    pub admitted: bool,
    pub verify: bool,
    pub skip_reading: bool,
    /// A prefix-cache lookup ran since the last admission (stats are recorded at
    /// admission, as vLLM's scheduler does).
    pub pending_lookup: bool,
    pub num_preemptions: u32,
    pub num_prompt_tokens: usize,
    pub id: String,
    pub uid: u64,
    /// With hit verification on: the strong context digest through each hash
    /// block (`ctx[j]` covers tokens and extra keys of hash blocks `0..=j`).
    ctx_vec: Vec<[u8; 32]>,
    pub lora: Option<Lora>,
    pub cache_salt: Option<String>,
    pub mm: Vec<MmFeature>,
    /// SHA-256 of each hash block's slice of the prompt embeddings (blocks past
    /// the prompt hash the empty slice, as vLLM does).
    pub embed_digests: Option<Vec<[u8; 32]>>,
    pub session_id: Option<String>,
    pub shared_prefix_boundary: u64,
}

impl Request {
    /// What a vacant slot of the request table holds: nothing allocated.
    pub(crate) fn vacant() -> Self {
        Self {
            id: String::new(),
            uid: 0,
            tokens: Vec::new(),
            num_prompt_tokens: 0,
            hash_vec: Vec::new(),
            ctx_vec: Vec::new(),
            pending: None,
            lent: 0,
            verify: false,
            lora: None,
            cache_salt: None,
            mm: Vec::new(),
            embed_digests: None,
            skip_reading: false,
            session_id: None,
            num_preemptions: 0,
            pending_lookup: false,
            shared_prefix_boundary: 0,
            num_computed_at_step: 0,
            admitted: false,
            scheduled_through: 0,
            step_limits: (0, 0),
            group_vec: Vec::new(),
        }
    }

    pub fn new(
        id: String,
        uid: u64,
        spec: RequestSpec,
        num_groups: usize,
        hash_block_size: usize,
        verify: bool,
    ) -> Result<Self> {
        let RequestSpec {
            prompt_token_ids,
            lora,
            cache_salt,
            mut mm_features,
            prompt_embeds,
            skip_reading_prefix_cache,
            session_id,
        } = spec;
        let n = prompt_token_ids.len();
        if let Some(f) = mm_features.iter().find(|f| {
            f.offset
                .checked_add(f.length)
                .is_none_or(|e| e > i64::MAX as u64)
        }) {
            return Err(invalid(format!(
                "multimodal item {:?} ends past 2**63 tokens",
                f.identifier
            )));
        }
        mm_features.sort_by_key(|f| f.offset);
        for w in mm_features.windows(2) {
            if w[0].offset + w[0].length > w[1].offset {
                return Err(invalid(format!(
                    "multimodal items {:?} and {:?} overlap",
                    w[0].identifier, w[1].identifier
                )));
            }
        }
        if let Some(f) = mm_features.iter().find(|f| f.length == 0) {
            return Err(invalid(format!(
                "multimodal item {:?} has length 0",
                f.identifier
            )));
        }
        let embed_digests = match prompt_embeds {
            None => None,
            Some(bytes) => {
                if n == 0 || bytes.len() % n != 0 {
                    return Err(invalid(format!(
                        "prompt_embeds has {} bytes, not a whole number of rows for {n} prompt tokens",
                        bytes.len()
                    )));
                }
                let row = bytes.len() / n;
                let digests = (0..n.div_ceil(hash_block_size))
                    .map(|j| {
                        let s = j * hash_block_size;
                        let e = (s + hash_block_size).min(n);
                        sha256_bytes(&bytes[s * row..e * row])
                    })
                    .collect();
                Some(digests)
            }
        };
        let mut tokens = prompt_token_ids;
        if n > 0 {
            tokens.reserve_exact(OUTPUT_ROOM);
        }
        // Counts, hashes and flags start as a vacant slot's.
        Ok(Self {
            id,
            uid,
            tokens,
            num_prompt_tokens: n,
            verify,
            lora,
            cache_salt: cache_salt.filter(|s| !s.is_empty()),
            mm: mm_features,
            embed_digests,
            skip_reading: skip_reading_prefix_cache,
            session_id,
            group_vec: vec![GroupBlocks::default(); num_groups],
            ..Self::vacant()
        })
    }

    /// The request's token ids (waiting, while its prompt is being hashed in
    /// the background, until the hash job hands them back).
    pub fn tokens(&self) -> &[u32] {
        match &self.pending {
            Some(job) if self.lent > 0 => &job.wait_output().tokens,
            _ => &self.tokens,
        }
    }

    /// The request's block hashes (waiting, when its prompt is being hashed in
    /// the background, until they are there).
    pub fn hashes(&self) -> &[BlockHash] {
        match &self.pending {
            Some(job) => &job.wait().hashes,
            None => &self.hash_vec,
        }
    }

    /// The hashes and one group's blocks at once (disjoint borrows).
    pub fn hashes_and_group_mut(&mut self, g: usize) -> (&[BlockHash], &mut GroupBlocks) {
        let hashes = match &self.pending {
            Some(job) => &job.wait().hashes[..],
            None => &self.hash_vec[..],
        };
        self.step_limits = (0, 0);
        (hashes, &mut self.group_vec[g])
    }

    /// The context digests of hit verification (waiting like [`Self::hashes`]).
    pub fn ctx(&self) -> &[[u8; 32]] {
        match &self.pending {
            Some(job) => &job.wait().ctx,
            None => &self.ctx_vec,
        }
    }

    /// Where the prefill ends: the prompt, or all but the last token of a
    /// resumed request replaying its output.
    pub fn prefill_end(&self) -> u64 {
        self.prefill_end_after(0)
    }

    /// [`Self::prefill_end`] once `appending` more tokens are appended.
    pub fn prefill_end_after(&self, appending: u64) -> u64 {
        (self.num_prompt_tokens as u64)
            .max((self.num_tokens() as u64 + appending).saturating_sub(1))
    }

    pub fn num_tokens(&self) -> usize {
        self.tokens.len() + self.lent
    }

    /// The blocks per KV-cache group.
    pub fn groups(&self) -> &[GroupBlocks] {
        &self.group_vec
    }

    /// The blocks per KV-cache group, to change: forgets the step limits.
    pub fn groups_mut(&mut self) -> &mut [GroupBlocks] {
        self.step_limits = (0, 0);
        &mut self.group_vec
    }

    /// The request's id and its groups' blocks to change (disjoint borrows;
    /// forgets the step limits).
    pub fn id_and_groups_mut(&mut self) -> (&str, &mut [GroupBlocks]) {
        self.step_limits = (0, 0);
        (&self.id, &mut self.group_vec)
    }

    /// The step limits (`(0, 0)` when not known): see the field.
    pub fn step_limits(&self) -> (u64, u64) {
        self.step_limits
    }

    /// Records the step limits computed from the groups as they are now.
    pub fn set_step_limits(&mut self, limits: (u64, u64)) {
        self.step_limits = limits;
    }

    pub fn holds_blocks(&self) -> bool {
        self.group_vec.iter().any(|g| !g.blocks().is_empty())
    }

    /// Whether some group runs the request (its prefix hit was adopted).
    pub fn is_running(&self) -> bool {
        self.group_vec.iter().any(|g| g.num_cached().is_some())
    }

    /// Appends tokens; with a hasher, every newly full hash block is hashed.
    pub fn append_tokens(
        &mut self,
        tokens: &[u32],
        mut hasher: Option<&mut BlockHasher>,
        hash_block_size: usize,
    ) {
        if self.lent > 0 {
            self.settle(hasher.as_deref_mut(), hash_block_size);
        }
        self.tokens.extend_from_slice(tokens);
        if let Some(h) = hasher {
            self.update_sampled_hashes(h, hash_block_size);
        }
    }

    /// Appends one token (the decode step's fast path: hashes only when it fills
    /// a hash block).
    pub fn push_token(
        &mut self,
        token: u32,
        mut hasher: Option<&mut BlockHasher>,
        hash_block_size: usize,
    ) {
        if self.lent > 0 {
            self.settle(hasher.as_deref_mut(), hash_block_size);
        }
        self.tokens.push(token);
        if let Some(h) = hasher
            && self.tokens.len().is_multiple_of(hash_block_size)
        {
            self.update_sampled_hashes(h, hash_block_size);
        }
    }

    /// Marks the request as holding an allocation; whether it was not before.
    pub fn admit(&mut self) -> bool {
        !std::mem::replace(&mut self.admitted, true)
    }

    /// Marks the request's allocation released; whether it held one. With
    /// `preempted`, a released allocation counts as a preemption.
    pub fn release(&mut self, preempted: bool) -> bool {
        let was = std::mem::replace(&mut self.admitted, false);
        if was && preempted {
            self.num_preemptions += 1;
        }
        was
    }

    /// Records a prefix-cache lookup and the shared-prefix boundary it found
    /// (`None`: the engine sets the boundary itself).
    pub fn note_lookup(&mut self, shared_prefix_boundary: Option<u64>) {
        self.pending_lookup = true;
        if let Some(b) = shared_prefix_boundary {
            self.shared_prefix_boundary = b;
        }
    }

    /// The engine's shared-prefix boundary for this request.
    pub fn set_shared_prefix_boundary(&mut self, boundary: u64) {
        self.shared_prefix_boundary = boundary;
    }

    /// Whether a lookup preceded this admission (consumed: stats count it once).
    pub fn take_pending_lookup(&mut self) -> bool {
        std::mem::take(&mut self.pending_lookup)
    }

    /// Appends tokens and block hashes computed by the engine (no hashing here).
    pub fn extend_external(&mut self, tokens: &[u32], hashes: &[BlockHash]) {
        debug_assert!(self.pending.is_none(), "external hashes are never pending");
        self.tokens.extend_from_slice(tokens);
        self.hash_vec.extend_from_slice(hashes);
    }

    /// Drops the tokens past `num_tokens` and the hashes past `num_hashes` (an
    /// engine rewrote the request's tail; the caller checked that no cached
    /// block lies past them).
    pub fn truncate_external(&mut self, num_tokens: usize, num_hashes: usize) {
        debug_assert!(self.pending.is_none() && self.lent == 0);
        self.tokens.truncate(num_tokens);
        self.hash_vec.truncate(num_hashes);
        self.scheduled_through = self.scheduled_through.min(num_tokens as u64);
        self.step_limits = (0, 0);
    }
}

/// Block hashes a request reserves room for beyond those it has: a decode that
/// fills this many blocks appends its hashes without a reallocation.
pub const HASH_HEADROOM: usize = 64;

// What a decode step reads of a request stays in its first two cache lines.
const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(align_of::<Request>() == 64);
    assert!(offset_of!(Request, tokens) + size_of::<Vec<u32>>() <= 128);
    assert!(offset_of!(Request, hash_vec) + size_of::<Vec<BlockHash>>() <= 128);
    assert!(offset_of!(Request, pending) + size_of::<Option<Arc<HashJob>>>() <= 128);
    assert!(offset_of!(Request, scheduled_through) + 8 <= 128);
    assert!(offset_of!(Request, num_computed_at_step) + 8 <= 128);
    assert!(offset_of!(Request, group_vec) + size_of::<Vec<GroupBlocks>>() <= 128);
    assert!(offset_of!(Request, step_limits) + 16 <= 128);
    assert!(offset_of!(Request, admitted) < 128);
};

#[cfg(test)]
mod tests;
