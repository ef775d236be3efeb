//! KV-cache group specs and the manager's configuration.

use crate::error::{Error, Result};
use crate::hash::HashAlgo;

mod eviction;
pub(crate) mod fields;
pub use eviction::Eviction;
pub use fields::{OptionValue, SpecFields, config_int};

/// Mamba state caching mode (vLLM's `mamba_cache_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MambaCacheMode {
    /// No prefix caching; one state block per request (+ speculative blocks).
    None,
    /// Prefix caching: a state is cached at every block boundary reached while a
    /// request only holds its running state block.
    Align,
    /// A state per block (memory grows with the sequence).
    All,
}

impl MambaCacheMode {
    /// Parses vLLM's mode name.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "none" => Some(Self::None),
            "align" => Some(Self::Align),
            "all" => Some(Self::All),
            _ => None,
        }
    }
}

/// The attention type of a KV-cache group, with the fields its manager needs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// Full (causal) attention: every block stays needed until the request ends.
    FullAttention,
    /// Multi-head latent attention: managed exactly like full attention.
    MlaAttention,
    /// Sliding-window attention over the last `window` tokens.
    SlidingWindow {
        /// Tokens each token attends to (itself included).
        window: u32,
    },
    /// Chunked local attention (Llama 4): attention within `chunk`-token chunks.
    ChunkedLocal {
        /// Tokens per chunk.
        chunk: u32,
    },
    /// Mamba / linear-attention state.
    Mamba {
        /// How states are cached.
        mode: MambaCacheMode,
        /// Extra state blocks for speculative decoding.
        num_speculative_blocks: u32,
        /// "align" prefill checkpoints (vLLM's `num_prefill_checkpoint_blocks`
        /// with its `prefill_checkpoint_alignment`): a chunk that ends a prefill
        /// reserves one more state block, where the kernel exports the state at
        /// the prompt's reusable boundary (a multiple of this many tokens past
        /// the chunk start). `None`: no checkpoints.
        prefill_checkpoint_alignment: Option<u32>,
    },
    /// Encoder-decoder cross attention: blocks for the encoder output, allocated
    /// once per request, never cached.
    CrossAttention,
    /// Full attention with attention sinks (`sink_len` tokens).
    SinkFullAttention {
        /// Sink tokens.
        sink_len: u32,
    },
    /// Sliding-window attention whose KV is never cached (vLLM's
    /// `SlidingWindowMLASpec(bounded_replay=True)`): hits come from the other
    /// groups, and after one the engine recomputes the hit's last `window`
    /// tokens for this group, whose blocks below that window stay null.
    ReplayedSlidingWindow {
        /// Tokens each token attends to (itself included).
        window: u32,
    },
    /// One scratch block per request for its whole life, never cached (vLLM's
    /// `CircularBufferSpec`: a ring holding the keys still being compressed).
    CircularBuffer,
    /// A group whose blocks the engine manages itself, through the pool's
    /// engine-held block calls (`get_new_blocks`, `touch_blocks`,
    /// `unpin_blocks`, `free_blocks`): the manager allocates, caches and looks
    /// up nothing for it, and keeps its place in the group order (vLLM's
    /// HiSparse host source, run by vLLM's own manager on a host pool).
    EngineManaged,
    /// vLLM's HiSparse resident group (`HiSparseResidentSpec`): per request, a
    /// row of device pages for KV whose home is the host tier. Pages of a
    /// host-backed prefix start as the null block; the engine points them at
    /// pinned device copies and back (`hisparse_adopt_page`,
    /// `hisparse_drop_page`: the residency overlay) and pins and unpins the
    /// blocks itself, so every reference a row holds is engine-held (a free
    /// returns those the engine still holds). A page the engine unpinned must
    /// be dropped once `take_reused_blocks` reports its block reused (vLLM's
    /// coordinator does so in its reuse callback). Never cached, never looked
    /// up.
    HiSparseResident,
    /// vLLM's HiSparse hot group (`HiSparseHotSpec`): `blocks_per_request`
    /// blocks a request takes once it reads host-backed history (an import, a
    /// resumed host prefix, or the engine's `hisparse_require_hot`). Never
    /// cached, never looked up.
    HiSparseHot {
        /// Blocks of a request's hot region.
        blocks_per_request: u32,
    },
}

impl AttentionKind {
    /// vLLM's `KVCacheSpecKind` value, used to annotate `BlockStored` events.
    #[must_use]
    pub fn spec_kind(&self) -> &'static str {
        match self {
            Self::FullAttention => "full_attention",
            Self::MlaAttention => "mla_attention",
            Self::SlidingWindow { .. } => "sliding_window",
            Self::ChunkedLocal { .. } => "chunked_local_attention",
            Self::Mamba { .. } => "mamba",
            Self::CrossAttention => "cross_attention",
            Self::SinkFullAttention { .. } => "sink_full_attention",
            Self::ReplayedSlidingWindow { .. } => "sliding_window_mla",
            Self::CircularBuffer
            | Self::EngineManaged
            | Self::HiSparseResident
            | Self::HiSparseHot { .. } => "unknown",
        }
    }

    /// The sliding window published in events (`None` for other types).
    #[must_use]
    pub fn sliding_window(&self) -> Option<u32> {
        match self {
            Self::SlidingWindow { window } | Self::ReplayedSlidingWindow { window } => {
                Some(*window)
            }
            _ => None,
        }
    }

    /// Whether vLLM treats the spec as a `FullAttentionSpec` (full attention, MLA,
    /// sinks): hits are downward closed, searched first, counted for cascade
    /// attention.
    #[must_use]
    pub fn is_full_attention(&self) -> bool {
        matches!(
            self,
            Self::FullAttention | Self::MlaAttention | Self::SinkFullAttention { .. }
        )
    }

    /// Whether hits can end inside a block (vLLM's
    /// `supports_fine_grained_hash_lookup`): full attention and Mamba.
    #[must_use]
    pub fn supports_fine_grained_lookup(&self) -> bool {
        self.is_full_attention() || matches!(self, Self::Mamba { .. })
    }

    /// Whether the group's blocks enter the prefix cache and its hits are looked
    /// up (vLLM's `prefix_cacheable`, plus cross attention, which never hits).
    #[must_use]
    pub fn prefix_cacheable(&self) -> bool {
        !matches!(
            self,
            Self::CrossAttention
                | Self::ReplayedSlidingWindow { .. }
                | Self::CircularBuffer
                | Self::EngineManaged
                | Self::HiSparseResident
                | Self::HiSparseHot { .. }
        )
    }

    /// Sliding-window and Mamba groups cache sparsely under a retention interval.
    #[must_use]
    pub fn is_sparse_retention(&self) -> bool {
        matches!(self, Self::SlidingWindow { .. } | Self::Mamba { .. })
    }
}

/// One KV-cache group as the manager sees it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GroupSpec {
    /// The attention type.
    pub kind: AttentionKind,
    /// Tokens per block.
    pub block_size: u32,
    /// Distinguishes specs that differ only in fields the manager does not read
    /// (head counts, dtypes): groups are looked up together only when their
    /// kinds, block sizes and tags are all equal.
    pub tag: String,
    /// Sliding window: tokens below the window whose blocks a request keeps
    /// (vLLM's `extra_retained_tokens`: multi-module speculative decoding may
    /// prefill them again). They are not attended; they are freed that much
    /// later and count in the per-request admission cap. 0 for other kinds.
    pub extra_retained_tokens: u32,
}

impl GroupSpec {
    /// A spec with an empty tag.
    #[must_use]
    pub fn new(kind: AttentionKind, block_size: u32) -> Self {
        Self {
            kind,
            block_size,
            tag: String::new(),
            extra_retained_tokens: 0,
        }
    }

    /// The same spec keeping `tokens` more tokens below its sliding window
    /// (vLLM's `extra_retained_tokens`).
    #[must_use]
    pub fn with_extra_retained_tokens(mut self, tokens: u32) -> Self {
        self.extra_retained_tokens = tokens;
        self
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Everything a [`crate::KvCacheManager`] is built from.
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    /// Blocks in the pool, the null block included.
    pub num_blocks: u32,
    /// The KV-cache groups, by group id.
    pub groups: Vec<GroupSpec>,
    /// Longest request in tokens.
    pub max_model_len: u64,
    /// Prefix caching on.
    pub enable_caching: bool,
    /// Which free block the device pool hands out next, so which cached block
    /// it evicts ([`crate::Eviction`]): vLLM's LRU (the default), or SLRU /
    /// ARC, which change only that order. No effect with caching off.
    pub eviction: Eviction,
    /// Block-hash algorithm.
    pub hash_algo: HashAlgo,
    /// Seed of `NONE_HASH` (vLLM reads `PYTHONHASHSEED`). `None`: vLLM's fixed
    /// default for `sha256_cbor`; a random per-manager seed for the
    /// non-cryptographic algorithms.
    pub hash_seed: Option<String>,
    /// Hash granularity in tokens; must divide every group's block size.
    /// `None`: the smallest group block size.
    pub hash_block_size: Option<u32>,
    /// EAGLE / MTP: drop the last matched block of every hit.
    pub use_eagle: bool,
    /// The groups EAGLE's drafter runs on (vLLM's `is_eagle_group`); with
    /// `use_eagle`, only their hits drop a block. Empty: every group.
    pub eagle_groups: Vec<u32>,
    /// Gather prefix-cache stats.
    pub log_stats: bool,
    /// Record KV events (`take_events`).
    pub enable_kv_cache_events: bool,
    /// Fraction of `num_blocks` kept free when admitting waiting requests.
    pub watermark: f64,
    /// Tokens scheduled but not yet settled (vLLM's admission cap for
    /// sliding-window and chunked-local groups). `None`: `max_model_len`.
    pub max_in_flight_tokens: Option<u64>,
    /// Sparse retention of sliding-window / Mamba checkpoints: `None` dense,
    /// `Some(0)` only the replay boundary, `Some(r)` one per `r` tokens.
    pub prefix_cache_retention_interval: Option<u64>,
    /// Collision safety: every cached block keeps the token ids it was computed
    /// for (and a strong digest of its whole context), and every prefix hit is
    /// checked against the request's own tokens before it is served; a block
    /// that does not match ends the hit there. Costs one SHA-256 per hashed
    /// block and the stored tokens.
    pub verify_cached_tokens: bool,
    /// Keep only this many leading bytes of every block hash (1..=32). A
    /// deliberately weak hash, for testing collision handling. `None`: all.
    pub hash_truncate_bytes: Option<u8>,
    /// vLLM's `kv_cache_metrics`: the pool counts block allocations, hits and
    /// evictions and logs them for a residency collector, as vLLM's pool calls
    /// its `KVCacheMetricsCollector` (see [`crate::BlockPool::with_metrics`]).
    pub kv_cache_metrics: bool,
    /// Block hashes come from the caller ([`crate::KvCacheManager::extend_request`]),
    /// not from the manager's own hasher: the mode of a drop-in under a serving
    /// engine that hashes requests itself (vLLM's `Request.block_hashes`, with any
    /// hash function). Requires `verify_cached_tokens` off.
    pub external_block_hashes: bool,
    /// Record prefix-cache stats when a looked-up request is admitted (pagedkv's
    /// own API). Off: only [`crate::KvCacheManager::record_prefix_cache_stats`]
    /// records, as vLLM 0.33's scheduler does.
    pub record_stats_at_admission: bool,
    /// vLLM's lookahead hashing (speculative decoding): each block hash covers
    /// this many tokens after the block. The engine hashes (so it needs
    /// `external_block_hashes`); events publish those tokens per stored block.
    pub num_hash_lookahead_tokens: u32,
    /// vLLM's `num_prefill_lookahead` (multi-module MTP): the last
    /// `num_prefill_lookahead - 1` computed tokens may be prefilled again, so
    /// they are never cached.
    pub num_prefill_lookahead: u32,
    /// vLLM's fine-grained (partial) prefix hits: in a hybrid model with a Mamba
    /// "align" group whose block spans several hash blocks, hits may end on any
    /// hash-block boundary; a hit ending inside a block is copied on write, and
    /// the engine drains the copies ([`crate::KvCacheManager::take_block_copies`]).
    /// vLLM's drop-in turns it on (vLLM's default); off, hits end on block
    /// boundaries and no block is ever copied.
    pub partial_hash_hits: bool,
    /// Decode context parallelism: the group block sizes given are already
    /// scaled by it; it only decides where partial hits apply (a Mamba block
    /// may then equal the hash block).
    pub dcp_world_size: u32,
    /// vLLM's `enable_mamba_shared_prefix_checkpoint`: an EAGLE model's Mamba
    /// groups also register the state at a shared-prefix junction the
    /// scheduler ended a chunk on (needs partial hits, no prefill lookahead).
    pub mamba_shared_prefix_checkpoint: bool,
    /// The worker zeroes fresh attention blocks before use (vLLM's
    /// `needs_kv_cache_zeroing`: Mamba layouts and mixed-precision caches): the
    /// manager lists them ([`crate::KvCacheManager::take_new_block_ids`]).
    pub zero_new_blocks: bool,
    /// Prompts are hashed on a worker thread: `add_request` returns once the
    /// request is registered, and the first call that reads the request's
    /// hashes (a lookup, an append, an allocation that caches blocks) waits for
    /// them. The same hashes, events and results as hashing in place.
    pub background_hashing: bool,
    /// Blocks the `sha256_cbor` memo keeps ([`crate::hash::BlockHasher::set_memo`]):
    /// a prompt block hashed before (a shared prefix, a conversation's earlier
    /// turns) is looked up with its whole input instead of hashed again. `None`:
    /// [`MEMO_DEFAULT_BLOCKS`]; 0: off. 128 bytes a block for 16-token blocks.
    pub hash_memo_blocks: Option<u64>,
    /// KV events kept until [`crate::KvCacheManager::take_events`] drains
    /// them; past it the oldest quarter is dropped and counted
    /// ([`crate::KvCacheManager::num_dropped_events`]). `None`:
    /// [`PENDING_EVENTS_DEFAULT`].
    pub max_pending_events: Option<u64>,
    /// Block activity entries (`kv_cache_metrics`) kept until
    /// [`crate::KvCacheManager::take_block_activity`] drains them; past it the
    /// oldest quarter is dropped and counted. `None`:
    /// [`PENDING_ACTIVITY_DEFAULT`].
    pub max_pending_block_activity: Option<u64>,
}

/// Events kept undrained by default: a server drains them every step (a few
/// hundred); 262,144 events are some tens of MiB.
pub const PENDING_EVENTS_DEFAULT: u64 = 1 << 18;
/// Block activity entries kept undrained by default (8 bytes each: 8 MiB).
pub const PENDING_ACTIVITY_DEFAULT: u64 = 1 << 20;
/// The largest cap either queue takes.
pub const PENDING_MAX: u64 = 1 << 30;

/// The blocks the hash memo keeps by default (2 MiB of 16-token blocks),
/// whatever the pool's size: a memo is worth its lookups while it stays in
/// the caches (on the drive trace 16,384 entries found the most in the
/// time, against 4,096 and 65,536).
pub const MEMO_DEFAULT_BLOCKS: u64 = 1 << 14;
/// The most blocks a hash memo may be given.
pub const MEMO_LIMIT_BLOCKS: u64 = 1 << 22;

/// Largest `max_model_len` / `max_in_flight_tokens`: token counts stay far from
/// overflowing the `i64` arithmetic of capacity checks.
pub const MAX_TOKENS: u64 = 1 << 40;

/// Refuses the first named token count past [`MAX_TOKENS`]: the one range
/// check of the counts a call takes.
pub(crate) fn check_token_counts<const N: usize>(counts: [(&str, u64); N]) -> Result<()> {
    match counts.into_iter().find(|&(_, n)| n > MAX_TOKENS) {
        Some((name, n)) => Err(Error::InvalidArgument(format!(
            "{name} = {n} is out of range (at most 2**40)"
        ))),
        None => Ok(()),
    }
}

impl ManagerConfig {
    /// A configuration of these groups with every option at its default (vLLM's
    /// defaults: caching on, `sha256_cbor`, no stats, no events).
    #[must_use]
    pub fn new(num_blocks: u32, groups: Vec<GroupSpec>, max_model_len: u64) -> Self {
        Self {
            num_blocks,
            groups,
            max_model_len,
            enable_caching: true,
            eviction: Eviction::Lru,
            hash_algo: HashAlgo::Sha256Cbor,
            hash_seed: None,
            hash_block_size: None,
            use_eagle: false,
            eagle_groups: Vec::new(),
            log_stats: false,
            enable_kv_cache_events: false,
            watermark: 0.0,
            max_in_flight_tokens: None,
            prefix_cache_retention_interval: None,
            verify_cached_tokens: false,
            hash_truncate_bytes: None,
            kv_cache_metrics: false,
            external_block_hashes: false,
            record_stats_at_admission: true,
            num_hash_lookahead_tokens: 0,
            num_prefill_lookahead: 0,
            partial_hash_hits: false,
            dcp_world_size: 1,
            mamba_shared_prefix_checkpoint: false,
            zero_new_blocks: false,
            background_hashing: false,
            hash_memo_blocks: None,
            max_pending_events: None,
            max_pending_block_activity: None,
        }
    }

    /// Blocks the hash memo keeps under this configuration (0: none).
    #[must_use]
    pub fn memo_blocks(&self) -> u64 {
        if self.hash_algo != HashAlgo::Sha256Cbor
            || self.hash_truncate_bytes.is_some_and(|n| n != 0)
            || self.external_block_hashes
        {
            return 0;
        }
        self.hash_memo_blocks.unwrap_or(MEMO_DEFAULT_BLOCKS)
    }

    /// A single full-attention group with defaults everywhere else.
    #[must_use]
    pub fn full_attention(num_blocks: u32, block_size: u32, max_model_len: u64) -> Self {
        Self::new(
            num_blocks,
            vec![GroupSpec::new(AttentionKind::FullAttention, block_size)],
            max_model_len,
        )
    }

    /// Whether group `g`'s hits drop EAGLE's block: `use_eagle`, and `g` is one
    /// of `eagle_groups` (all groups when none is named).
    #[must_use]
    pub fn is_eagle_group(&self, g: usize) -> bool {
        self.use_eagle && (self.eagle_groups.is_empty() || self.eagle_groups.contains(&(g as u32)))
    }

    /// Whether any group is an EAGLE group (vLLM's non-empty `eagle_group_ids`:
    /// named groups, or every group under `use_eagle`).
    #[must_use]
    pub fn has_eagle_groups(&self) -> bool {
        self.use_eagle || !self.eagle_groups.is_empty()
    }

    /// vLLM's `partial_hash_hits_enabled`: several groups, prefix caching on, a
    /// Mamba "align" group whose block is finer-hashed (or equal under DCP), and
    /// every other cacheable group able to look up at hash granularity (full
    /// attention, MLA, sinks, Mamba) or blocked at the hash size.
    #[must_use]
    pub fn partial_hash_hits_enabled(&self, hbs: u32) -> bool {
        if !self.partial_hash_hits || !self.enable_caching || self.groups.len() < 2 {
            return false;
        }
        let dcp = self.dcp_world_size.max(1);
        let mamba = self.groups.iter().any(|g| {
            matches!(
                g.kind,
                AttentionKind::Mamba {
                    mode: MambaCacheMode::Align,
                    ..
                }
            ) && ((dcp == 1 && g.block_size > hbs) || (dcp > 1 && g.block_size >= hbs))
        });
        mamba
            && self.groups.iter().all(|g| {
                !g.kind.prefix_cacheable()
                    || g.kind.supports_fine_grained_lookup()
                    || g.block_size == hbs
            })
    }

    /// Tokens at the end of the computed prefix that may be prefilled again
    /// (multi-module MTP) and are never cached.
    #[must_use]
    pub fn num_reprefillable_tokens(&self) -> u64 {
        u64::from(self.num_prefill_lookahead.saturating_sub(1))
    }

    /// The scheduler block size: the LCM of every group's block size.
    #[must_use]
    pub fn scheduler_block_size(&self) -> u64 {
        self.groups
            .iter()
            .map(|g| u64::from(g.block_size))
            .fold(1, |acc, b| acc / gcd(acc, b) * b)
    }

    #[allow(clippy::too_many_lines)] // every configuration rule, checked in one place
    pub(crate) fn validate(&self) -> Result<u32> {
        let bad = |m: String| Err(Error::InvalidConfig(m));
        if self.num_blocks == 0 {
            return bad("num_blocks must be at least 1 (block 0 is the null block)".into());
        }
        if self.num_blocks == u32::MAX {
            return bad("num_blocks must be below 2^32 - 1".into());
        }
        if self.groups.is_empty() {
            return bad("at least one KV-cache group is required".into());
        }
        if self.max_model_len == 0 || self.max_model_len >= MAX_TOKENS {
            return bad(format!(
                "max_model_len must be in 1..2**40, got {}",
                self.max_model_len
            ));
        }
        if let Some(n) = self.hash_truncate_bytes
            && !(1..=32).contains(&n)
        {
            return bad(format!("hash_truncate_bytes must be in 1..=32, got {n}"));
        }
        for (name, cap) in [
            ("max_pending_events", self.max_pending_events),
            (
                "max_pending_block_activity",
                self.max_pending_block_activity,
            ),
        ] {
            if let Some(n) = cap.filter(|&n| n == 0 || n > PENDING_MAX) {
                return bad(format!("{name} must be in 1..=2**30, got {n}"));
            }
        }
        if let Some(n) = self.hash_memo_blocks
            && n > MEMO_LIMIT_BLOCKS
        {
            return bad(format!(
                "hash_memo_blocks must be at most 2**22 (4,194,304), got {n}"
            ));
        }
        if !(self.watermark >= 0.0 && self.watermark.is_finite()) {
            return bad(format!(
                "watermark must be a non-negative number, got {}",
                self.watermark
            ));
        }
        for (i, g) in self.groups.iter().enumerate() {
            if g.block_size == 0 {
                return bad(format!("group {i}: block_size must be positive"));
            }
            if g.extra_retained_tokens != 0 && g.kind.sliding_window().is_none() {
                return bad(format!(
                    "group {i}: extra_retained_tokens applies to sliding-window groups only \
                     ({} group given {})",
                    g.kind.spec_kind(),
                    g.extra_retained_tokens
                ));
            }
        }
        for (i, g) in self.groups.iter().enumerate() {
            let bad_kind = match g.kind {
                AttentionKind::SlidingWindow { window }
                | AttentionKind::ReplayedSlidingWindow { window } => window == 0,
                AttentionKind::ChunkedLocal { chunk } => chunk == 0,
                AttentionKind::SinkFullAttention { sink_len } => {
                    sink_len == 0 || sink_len % g.block_size != 0
                }
                // Prefix caching needs a cached state at block boundaries: "align"
                // (vLLM 0.33) or "all" (a state per block, the older vLLM mode).
                AttentionKind::Mamba { mode, .. } => {
                    self.enable_caching && mode == MambaCacheMode::None
                }
                _ => false,
            };
            if bad_kind {
                return bad(format!(
                    "group {i}: invalid {} spec {:?} (windows and chunks must be positive, \
                     sink_len a positive multiple of the block size, and Mamba prefix \
                     caching needs mamba_cache_mode 'align' or 'all')",
                    g.kind.spec_kind(),
                    g.kind
                ));
            }
        }
        // Hashes are computed at the GCD of the cacheable groups' block sizes.
        let hbs = if let Some(h) = self.hash_block_size {
            h
        } else {
            let sizes = self
                .groups
                .iter()
                .filter(|g| g.kind.prefix_cacheable())
                .map(|g| u64::from(g.block_size));
            u32::try_from(sizes.fold(0, gcd)).unwrap_or(1).max(1)
        };
        if hbs == 0 {
            return bad("hash_block_size must be positive".into());
        }
        if let Some(g) = self
            .groups
            .iter()
            .find(|g| g.kind.prefix_cacheable() && g.block_size % hbs != 0)
        {
            return bad(format!(
                "hash_block_size {hbs} must divide every group's block size (found {})",
                g.block_size
            ));
        }
        if let Some(r) = self.prefix_cache_retention_interval {
            let sparse = self.groups.iter().any(|g| g.kind.is_sparse_retention());
            if !sparse && r != 0 {
                return bad(
                    "prefix_cache_retention_interval is set but this model has no \
                     sliding-window or Mamba KV cache group, so retention has no effect. \
                     Set it to 0 (it only applies to sliding-window and Mamba attention)."
                        .into(),
                );
            }
            let sbs = self.scheduler_block_size();
            if sparse && r % sbs != 0 {
                return bad(format!(
                    "prefix_cache_retention_interval ({r}) must be non-negative and a \
                     multiple of scheduler_block_size ({sbs})."
                ));
            }
        }
        if let Some(&g) = self
            .eagle_groups
            .iter()
            .find(|&&g| g as usize >= self.groups.len())
        {
            return bad(format!(
                "eagle_groups names group {g}; the model has {}",
                self.groups.len()
            ));
        }
        if self.num_hash_lookahead_tokens > 0 && !self.external_block_hashes {
            return bad(
                "num_hash_lookahead_tokens needs external_block_hashes (the engine \
                 hashes the lookahead tokens)"
                    .into(),
            );
        }
        if self.external_block_hashes && self.verify_cached_tokens {
            return bad(
                "verify_cached_tokens needs the manager's own hashing; it cannot be \
                 combined with external_block_hashes"
                    .into(),
            );
        }
        if self.dcp_world_size == 0 {
            return bad("dcp_world_size must be at least 1".into());
        }
        if let Some((i, _)) = self.groups.iter().enumerate().find(|(_, g)| {
            matches!(
                g.kind,
                AttentionKind::Mamba {
                    prefill_checkpoint_alignment: Some(0),
                    ..
                }
            )
        }) {
            return bad(format!(
                "group {i}: prefill_checkpoint_alignment must be positive"
            ));
        }
        if self.enable_caching
            && self.has_eagle_groups()
            && self.scheduler_block_size() < u64::from(self.num_prefill_lookahead)
        {
            return bad(format!(
                "Multi-module MTP with prefix caching requires scheduler_block_size (={}) \
                 >= num_speculative_tokens (={})",
                self.scheduler_block_size(),
                self.num_prefill_lookahead
            ));
        }
        if let Some(n) = self.max_in_flight_tokens
            && (n == 0 || n >= MAX_TOKENS)
        {
            return bad(format!("max_in_flight_tokens must be in 1..2**40, got {n}"));
        }
        Ok(hbs)
    }
}
