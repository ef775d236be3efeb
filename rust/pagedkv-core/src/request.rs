//! The request table: each request's tokens, hashing inputs and block hashes
//! (grown incrementally as tokens are appended), and its per-group block lists.

use crate::error::{Result, invalid};
use crate::events::EventExtraKey;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};

use crate::hash::{BlockHash, BlockHasher, ExtraKey, sha256_bytes};
use crate::single_type::GroupBlocks;

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

/// Blocks ahead of the one being hashed whose memo entry is prefetched.
const MEMO_AHEAD: usize = 8;
/// Blocks of two prompts compared at once when one takes the other's hashes.
const SHARED_RUN: usize = 16;

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

    /// Hands the prompt to `worker` to hash; the request's hashes are pending
    /// until a mutation settles them.
    pub fn hash_in_background(
        &mut self,
        worker: &HashWorker,
        hasher: &BlockHasher,
        hash_block_size: usize,
    ) {
        debug_assert!(self.pending.is_none() && self.hash_vec.is_empty());
        // The job gets a copy of the request without its blocks and with the
        // prompt itself, lent (not copied) until the request settles.
        let tokens = std::mem::take(&mut self.tokens);
        let groups = std::mem::take(&mut self.group_vec);
        let mut input = Box::new(self.clone());
        self.group_vec = groups;
        self.lent = tokens.len();
        input.tokens = tokens;
        let job = Arc::new(HashJob::new(input, hasher.same_kind(), hash_block_size));
        worker.submit(&job);
        self.pending = Some(job);
    }

    /// Takes the background hashes and the lent prompt back into the request
    /// (the hashes computed here, with `hasher`, if the worker could not).
    fn settle(&mut self, hasher: Option<&mut BlockHasher>, hash_block_size: usize) {
        let Some(job) = self.pending.take() else {
            return;
        };
        job.wait_output();
        let done = match Arc::try_unwrap(job) {
            Ok(job) => job.result.into_inner(),
            Err(job) => job.result.get().cloned(),
        };
        // Set: it was waited for above, and a set result stays set.
        let Some(out) = done else {
            return;
        };
        if self.lent > 0 {
            // Nothing was appended while the prompt was lent (every mutation
            // settles first), so the prompt comes back whole.
            debug_assert!(self.tokens.is_empty());
            self.tokens = out.tokens;
            self.lent = 0;
        }
        if let Some(chain) = out.chain {
            self.hash_vec = chain.hashes;
            self.ctx_vec = chain.ctx;
        } else {
            self.hash_vec.clear();
            self.ctx_vec.clear();
            if let Some(hasher) = hasher {
                self.update_hashes(hasher, hash_block_size);
            }
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

    /// vLLM 0.33's extra keys of the block `[start, end)`, in order: `LoRA`,
    /// multimodal items overlapping the block, cache salt (block 0), embeddings.
    pub fn extra_keys<'a>(&'a self, start: usize, end: usize, out: &mut Vec<ExtraKey<'a>>) {
        out.clear();
        if let Some(l) = &self.lora {
            out.push(ExtraKey::Lora {
                name: &l.name,
                path: l.path.as_deref(),
            });
        }
        if !self.mm.is_empty() {
            let (s, e) = (start as u64, end as u64);
            let first = self.mm.partition_point(|f| f.offset + f.length <= s);
            for f in &self.mm[first..] {
                if f.offset >= e {
                    break;
                }
                out.push(ExtraKey::Mm {
                    identifier: &f.identifier,
                    offset: f.offset as i64 - start as i64,
                });
            }
        }
        if start == 0
            && let Some(salt) = &self.cache_salt
        {
            out.push(ExtraKey::CacheSalt(salt));
        }
        if let Some(d) = &self.embed_digests {
            let empty = EMPTY_SHA256;
            let j = start / (end - start).max(1);
            out.push(ExtraKey::PromptEmbeds(*d.get(j).unwrap_or(&empty)));
        }
    }

    /// Event form of a block's extra keys (vLLM's `to_event_extra_keys`).
    pub fn event_extra_keys(&self, start: usize, end: usize) -> Option<Vec<EventExtraKey>> {
        let mut keys = Vec::new();
        self.extra_keys(start, end, &mut keys);
        if keys.is_empty() {
            return None;
        }
        Some(
            keys.iter()
                .map(|k| match *k {
                    ExtraKey::Lora { name, .. } => EventExtraKey::LoraName(name.to_owned()),
                    ExtraKey::Mm { identifier, offset } => {
                        EventExtraKey::Mm(identifier.to_owned(), offset)
                    }
                    ExtraKey::CacheSalt(s) => EventExtraKey::CacheSalt(s.to_owned()),
                    ExtraKey::PromptEmbeds(d) => EventExtraKey::PromptEmbeds(d),
                })
                .collect(),
        )
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

    /// Hashes every newly full hash block. Allocates nothing in the common case:
    /// the hashes go straight into the request's vector (whose capacity covers
    /// [`HASH_HEADROOM`] blocks past the prompt), and the extra-key list stays
    /// empty for requests without a `LoRA` adapter, salt or multimodal items.
    pub fn update_hashes(&mut self, hasher: &mut BlockHasher, hash_block_size: usize) {
        self.hash_new_blocks(hasher, hash_block_size, true);
    }

    /// Whether its block hashes follow from its tokens alone (under the
    /// manager's hasher): no block has extra keys (no `LoRA` adapter, salt,
    /// multimodal item or prompt embeddings), no context digests are kept,
    /// and none are being computed elsewhere.
    pub(crate) fn hashes_follow_tokens(&self) -> bool {
        self.lora.is_none()
            && self.cache_salt.is_none()
            && self.mm.is_empty()
            && self.embed_digests.is_none()
            && !self.verify
            && self.pending.is_none()
    }

    /// Takes from `src` the hashes of the leading hash blocks the two share
    /// (as many whole blocks as their tokens agree on from the start and
    /// `src` has hashed): a block's hash follows from the tokens up to its
    /// end, so they are the hashes this request's blocks would get. Both must
    /// be requests of one manager whose hashes follow their tokens
    /// ([`Self::hashes_follow_tokens`]), this one without hashes yet. Returns
    /// the blocks taken.
    pub(crate) fn take_shared_hashes(&mut self, src: &Self, hash_block_size: usize) -> usize {
        debug_assert!(self.hash_vec.is_empty() && self.hashes_follow_tokens());
        debug_assert!(src.hashes_follow_tokens());
        let bs = hash_block_size;
        let limit = src.hash_vec.len().min(self.tokens.len() / bs);
        let (a, b) = (&self.tokens[..limit * bs], &src.tokens[..limit * bs]);
        let mut n = 0;
        // Whole runs of blocks compared at once (one `memcmp` each), the run
        // that differs block by block.
        while n < limit {
            let end = (n + SHARED_RUN).min(limit);
            if a[n * bs..end * bs] == b[n * bs..end * bs] {
                n = end;
                continue;
            }
            while a[n * bs..(n + 1) * bs] == b[n * bs..(n + 1) * bs] {
                n += 1;
            }
            break;
        }
        if n > 0 {
            let full = self.tokens.len() / bs;
            self.hash_vec.reserve(full + HASH_HEADROOM);
            self.hash_vec.extend_from_slice(&src.hash_vec[..n]);
        }
        n
    }

    /// [`Self::update_hashes`] for blocks filled by sampled tokens: not
    /// through the hash memo.
    fn update_sampled_hashes(&mut self, hasher: &mut BlockHasher, hash_block_size: usize) {
        self.hash_new_blocks(hasher, hash_block_size, false);
    }

    fn hash_new_blocks(&mut self, hasher: &mut BlockHasher, hash_block_size: usize, memo: bool) {
        if self.pending.is_some() {
            self.settle(Some(&mut *hasher), hash_block_size);
        }
        if self.hash_vec.len() + 1 > self.hash_vec.capacity() {
            // Room for what is full now and the next HASH_HEADROOM blocks.
            let full = self.tokens.len() / hash_block_size;
            self.hash_vec
                .reserve(full.saturating_sub(self.hash_vec.len()) + HASH_HEADROOM);
        }
        // Moved out for the loop: the keys borrow the request, the hashes grow.
        let mut chain = std::mem::take(&mut self.hash_vec);
        let mut contexts = std::mem::take(&mut self.ctx_vec);
        let mut keys: Vec<ExtraKey<'_>> = Vec::new();
        let mut start = chain.len() * hash_block_size;
        if start + hash_block_size <= self.tokens.len() {
            let mut parent = chain.last().copied();
            let mut ctx = contexts.last().copied().unwrap_or([0; 32]);
            hasher.chain(memo, |hasher| {
                while start + hash_block_size <= self.tokens.len() {
                    let end = start + hash_block_size;
                    // The memo entry of a block a few ahead, loading while this
                    // one is hashed or looked up.
                    if let Some(later) = self.tokens.get(
                        end + MEMO_AHEAD * hash_block_size
                            ..end + (MEMO_AHEAD + 1) * hash_block_size,
                    ) {
                        hasher.prefetch(later);
                    }
                    self.extra_keys(start, end, &mut keys);
                    let h = hasher.hash(parent.as_ref(), &self.tokens[start..end], &keys);
                    chain.push(h);
                    if self.verify {
                        ctx = hasher.context_digest(&ctx, &self.tokens[start..end], &keys);
                        contexts.push(ctx);
                    }
                    parent = Some(h);
                    start = end;
                }
            });
        }
        drop(keys);
        self.hash_vec = chain;
        self.ctx_vec = contexts;
    }
}

/// A prompt's block hashes and, with verification, its context digests.
#[derive(Clone, Debug, Default)]
pub(crate) struct HashChain {
    hashes: Vec<BlockHash>,
    ctx: Vec<[u8; 32]>,
}

/// A prompt's hashes, computed by whoever gets to them first: the manager's
/// worker thread, or the first caller that needs them before the worker has
/// started on them (so a lookup never waits behind the queue: at worst it
/// hashes its own prompt, as without the worker). `None` if the hashing failed
/// (the request then hashes in place when it settles).
#[derive(Debug)]
pub(crate) struct HashJob {
    /// The request to hash (a copy without blocks, holding the lent prompt),
    /// its hasher and the hash block size, until someone takes them.
    input: Mutex<Option<(Box<Request>, BlockHasher, usize)>>,
    result: OnceLock<JobOutput>,
}

/// What a hash job hands back: the lent tokens, and the hashes (`None` if the
/// hashing failed; the request then hashes in place when it settles).
#[derive(Clone, Debug)]
struct JobOutput {
    tokens: Vec<u32>,
    chain: Option<HashChain>,
}

/// An empty chain, what a request reads while a failed job awaits settling.
static NO_HASHES: HashChain = HashChain {
    hashes: Vec::new(),
    ctx: Vec::new(),
};

impl HashJob {
    fn new(req: Box<Request>, hasher: BlockHasher, hash_block_size: usize) -> Self {
        Self {
            input: Mutex::new(Some((req, hasher, hash_block_size))),
            result: OnceLock::new(),
        }
    }

    /// Hashes the prompt if nobody has taken it yet.
    fn run(&self) {
        let taken = match self.input.lock() {
            Ok(mut input) => input.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        let Some((mut req, mut hasher, hbs)) = taken else {
            return;
        };
        // A panic here must not leave a reader waiting forever, nor lose the
        // lent tokens.
        let chain = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            req.update_hashes(&mut hasher, hbs);
            HashChain {
                hashes: std::mem::take(&mut req.hash_vec),
                ctx: std::mem::take(&mut req.ctx_vec),
            }
        }));
        let tokens = std::mem::take(&mut req.tokens);
        let _ = self.result.set(JobOutput {
            tokens,
            chain: chain.ok(),
        });
    }

    /// The job's output, once someone has run it (here, if nobody has taken it
    /// yet).
    fn wait_output(&self) -> &JobOutput {
        if let Some(done) = self.result.get() {
            return done;
        }
        self.run();
        self.result.wait()
    }

    fn wait(&self) -> &HashChain {
        self.wait_output().chain.as_ref().unwrap_or(&NO_HASHES)
    }
}

/// The manager's prompt-hashing thread: runs each submitted job nobody has
/// taken yet, in submission order. Dropping it ends the thread once the queue is
/// drained.
#[derive(Debug)]
pub(crate) struct HashWorker {
    tx: Option<mpsc::Sender<Arc<HashJob>>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The fork generation it was spawned in ([`crate::fork`]).
    generation: u64,
}

impl HashWorker {
    pub fn spawn() -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Arc<HashJob>>();
        let thread = std::thread::Builder::new()
            .name("pagedkv-hash".into())
            .spawn(move || {
                while let Some(job) = next_job(&rx) {
                    crate::fork::enter_job();
                    job.run();
                    crate::fork::leave_job();
                }
            })?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            generation: crate::fork::generation(),
        })
    }

    /// Whether the process forked since the worker was spawned and this is the
    /// child: the thread stayed in the parent.
    pub fn left_behind(&self) -> bool {
        self.generation != crate::fork::generation()
    }

    /// Queues the job; if the thread is gone, its first reader runs it.
    fn submit(&self, job: &Arc<HashJob>) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Arc::clone(job));
        }
    }
}

/// How the hash worker waits for the next prompt: it naps [`WORKER_NAP`] at a
/// time until it has been idle for [`WORKER_IDLE`], and only then sleeps on the
/// queue. While it naps a prompt submitted costs its sender no wake-up (a futex
/// call, several microseconds on a virtual machine, on the scheduler's critical
/// path); an idle manager's worker stops waking up after [`WORKER_IDLE`]. It
/// does not spin between naps: polling burnt a core and slowed the scheduler's
/// thread beside it without shortening any step (a prompt the worker has not
/// started when a lookup needs it is hashed by the lookup).
const WORKER_NAP: std::time::Duration = std::time::Duration::from_micros(50);
const WORKER_IDLE: std::time::Duration = std::time::Duration::from_millis(20);

/// The next job (see [`WORKER_NAP`]); None once every sender is gone.
fn next_job<T>(rx: &mpsc::Receiver<T>) -> Option<T> {
    let start = std::time::Instant::now();
    loop {
        match rx.try_recv() {
            Ok(item) => return Some(item),
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) => {}
        }
        if start.elapsed() < WORKER_IDLE {
            std::thread::sleep(WORKER_NAP);
        } else {
            return rx.recv().ok();
        }
    }
}

impl Drop for HashWorker {
    fn drop(&mut self) {
        if self.left_behind() {
            // In a forked child: there is no thread to join, and the channel
            // may have been in use by the parent's thread at the fork.
            std::mem::forget(self.tx.take());
            std::mem::forget(self.thread.take());
            return;
        }
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Block hashes a request reserves room for beyond those it has: a decode that
/// fills this many blocks appends its hashes without a reallocation.
pub const HASH_HEADROOM: usize = 64;

/// `sha256(b"")`: vLLM hashes an empty embedding slice for blocks past the prompt.
const EMPTY_SHA256: [u8; 32] = [
    0xe3, 0xb0, 0xc4, 0x42, 0x98, 0xfc, 0x1c, 0x14, 0x9a, 0xfb, 0xf4, 0xc8, 0x99, 0x6f, 0xb9, 0x24,
    0x27, 0xae, 0x41, 0xe4, 0x64, 0x9b, 0x93, 0x4c, 0xa4, 0x95, 0x99, 0x1b, 0x78, 0x52, 0xb8, 0x55,
];

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
mod tests {
    use super::*;

    /// A prompt vector without room for output gets it when the request is
    /// made (one copy then, none at the first decode step); one that has the
    /// room keeps its allocation.
    #[test]
    fn a_prompt_gets_room_for_its_output() {
        let exact: Vec<u32> = (0..100).collect();
        let spec = RequestSpec {
            prompt_token_ids: exact,
            ..RequestSpec::default()
        };
        let r = Request::new("r".into(), 0, spec, 1, 16, false).unwrap_or_else(|e| panic!("{e}"));
        assert!(r.tokens.capacity() >= 100 + OUTPUT_ROOM);
        let mut roomy = Vec::with_capacity(100 + OUTPUT_ROOM);
        roomy.extend(0..100u32);
        let ptr = roomy.as_ptr();
        let spec = RequestSpec {
            prompt_token_ids: roomy,
            ..RequestSpec::default()
        };
        let r = Request::new("r".into(), 0, spec, 1, 16, false).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.tokens.as_ptr(), ptr, "not reallocated");
    }

    /// A hashing job nobody has run yet is run by its first reader: a lookup
    /// never waits behind the worker's queue (here there is no worker at all).
    #[test]
    fn a_pending_prompt_is_hashed_by_its_first_reader() {
        use crate::hash::HashAlgo;
        let spec = || RequestSpec {
            prompt_token_ids: (0..100).collect(),
            cache_salt: Some("s".into()),
            ..RequestSpec::default()
        };
        let new =
            || Request::new("r".into(), 0, spec(), 1, 16, true).unwrap_or_else(|e| panic!("{e}"));
        let mut hasher =
            BlockHasher::new(HashAlgo::Sha256Cbor, HashAlgo::Sha256Cbor.none_hash("x"));
        let mut sync = new();
        sync.update_hashes(&mut hasher, 16);
        let mut pending = new();
        let mut input = Box::new(pending.clone());
        input.group_vec = Vec::new();
        pending.pending = Some(Arc::new(HashJob::new(input, hasher.same_kind(), 16)));
        assert_eq!(pending.hashes(), sync.hashes());
        assert_eq!(pending.ctx(), sync.ctx());
        assert_eq!(pending.hashes().len(), 6);
        // Appending settles the pending hashes into the request, then continues.
        let tokens: Vec<u32> = (100..112).collect();
        pending.append_tokens(&tokens, Some(&mut hasher), 16);
        sync.append_tokens(&tokens, Some(&mut hasher), 16);
        assert!(pending.pending.is_none());
        assert_eq!(pending.hashes(), sync.hashes());
        assert_eq!(pending.hashes().len(), 7);
    }

    /// A prompt hashed in the background is lent to the job, not copied: the
    /// request reads its tokens through the job meanwhile, and the first
    /// mutation takes them back whole, with the hashes, before appending.
    #[test]
    fn a_prompt_lent_to_the_hash_worker_comes_back_whole() {
        use crate::hash::HashAlgo;
        let worker = HashWorker::spawn().unwrap_or_else(|e| panic!("{e}"));
        let new = || {
            let spec = RequestSpec {
                prompt_token_ids: (0..100).collect(),
                ..RequestSpec::default()
            };
            Request::new("r".into(), 0, spec, 1, 16, false).unwrap_or_else(|e| panic!("{e}"))
        };
        let mut hasher =
            BlockHasher::new(HashAlgo::Sha256Cbor, HashAlgo::Sha256Cbor.none_hash("x"));
        let mut sync = new();
        sync.update_hashes(&mut hasher, 16);
        for mutation in ["push", "append", "hash"] {
            let mut bg = new();
            bg.hash_in_background(&worker, &hasher, 16);
            assert!(bg.tokens.is_empty() && bg.lent == 100, "{mutation}: lent");
            assert_eq!(bg.num_tokens(), 100);
            assert_eq!(bg.tokens(), sync.tokens());
            assert_eq!(bg.hashes(), sync.hashes());
            let mut want = sync.clone();
            match mutation {
                "push" => {
                    bg.push_token(7, Some(&mut hasher), 16);
                    want.push_token(7, Some(&mut hasher), 16);
                }
                "append" => {
                    bg.append_tokens(&[7, 8, 9, 10], Some(&mut hasher), 16);
                    want.append_tokens(&[7, 8, 9, 10], Some(&mut hasher), 16);
                }
                _ => bg.update_hashes(&mut hasher, 16),
            }
            assert!(bg.pending.is_none() && bg.lent == 0, "{mutation}: settled");
            assert_eq!(bg.tokens, want.tokens, "{mutation}: tokens");
            assert_eq!(bg.num_tokens(), want.num_tokens());
            assert_eq!(bg.hashes(), want.hashes(), "{mutation}: hashes");
        }
    }

    #[test]
    fn empty_sha256_constant_is_right() {
        assert_eq!(sha256_bytes(b""), EMPTY_SHA256);
    }

    #[test]
    fn mm_keys_use_offsets_relative_to_block_start() {
        let spec = RequestSpec {
            prompt_token_ids: vec![0; 16],
            mm_features: vec![
                MmFeature {
                    identifier: "hash2".into(),
                    offset: 10,
                    length: 5,
                },
                MmFeature {
                    identifier: "hash1".into(),
                    offset: 0,
                    length: 5,
                },
            ],
            ..RequestSpec::default()
        };
        let r = Request::new("r".into(), 0, spec, 1, 16, false).unwrap_or_else(|e| panic!("{e}"));
        let mut k = Vec::new();
        r.extra_keys(0, 5, &mut k);
        assert_eq!(
            k,
            vec![ExtraKey::Mm {
                identifier: "hash1",
                offset: 0
            }]
        );
        r.extra_keys(3, 8, &mut k);
        assert_eq!(
            k,
            vec![ExtraKey::Mm {
                identifier: "hash1",
                offset: -3
            }]
        );
        r.extra_keys(6, 10, &mut k);
        assert!(k.is_empty());
        r.extra_keys(0, 15, &mut k);
        assert_eq!(
            k,
            vec![
                ExtraKey::Mm {
                    identifier: "hash1",
                    offset: 0
                },
                ExtraKey::Mm {
                    identifier: "hash2",
                    offset: 10
                }
            ]
        );
    }

    #[test]
    fn overlapping_mm_items_are_rejected() {
        let spec = RequestSpec {
            prompt_token_ids: vec![0; 16],
            mm_features: vec![
                MmFeature {
                    identifier: "a".into(),
                    offset: 0,
                    length: 5,
                },
                MmFeature {
                    identifier: "b".into(),
                    offset: 4,
                    length: 5,
                },
            ],
            ..RequestSpec::default()
        };
        assert!(Request::new("r".into(), 0, spec, 1, 16, false).is_err());
    }
}
