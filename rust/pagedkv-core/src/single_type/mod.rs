//! Single-type managers: one attention type's rules for one KV-cache group — what
//! a prefix hit is, which blocks fall out of use, how many blocks a step needs.
//!
//! | type | hit search | skipped tokens after `n` computed |
//! |---|---|---|
//! | full / MLA / sink | left to right, stop at the first miss | none |
//! | sliding window `w` | right to left, a contiguous run of `cdiv(w-1, bs)` | `n - w + 1` |
//! | chunked local `c` | nulls before the current chunk, then left to right | `n / c * c` |
//! | Mamba | right to left, the first aligned hit | `n - 1` |
//! | cross attention | never cached | none |
//!
//! `GroupManager` keeps one enum dispatch over [`AttentionKind`]; each kind's
//! rules live in its own file (`full`, `sliding_window`, `chunked_local`,
//! `mamba`, `hisparse`). Cross attention needs no file: its blocks hold the
//! encoder output, are allocated once per request and never enter the prefix
//! cache. What all kinds share is split by stage: this file holds the types,
//! construction and block arithmetic; `lookup` the hit search, `allocate` a
//! step's blocks, `caching` publishing full blocks, `release` freeing and
//! skipped blocks.

mod allocate;
mod caching;
mod chunked_local;
mod full;
mod hisparse;
mod lookup;
mod mamba;
mod release;
mod sliding_window;

use rustc_hash::FxHashSet;

use crate::hash::BlockHash;
use crate::pool::{BlockId, CacheKey};
pub(crate) use crate::request::GroupBlocks;
use crate::spec::{AttentionKind, GroupSpec, MambaCacheMode};

// A HiSparse resident row's overlay (`hisparse::Overlay`) is what a request's
// `GroupBlocks` holds for it.
const _: fn(&GroupBlocks) -> Option<&hisparse::Overlay> = |gb| gb.overlay.as_ref();

/// Lookup inputs shared by all groups of one coordinator.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lookup<'a> {
    pub hashes: &'a [BlockHash],
    pub max_len: usize,
    pub drop_eagle_block: bool,
    /// Hits must end on a multiple of this many tokens.
    pub alignment: usize,
}

/// Token counts of one `get_num_blocks_to_allocate` question.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Need {
    pub num_tokens: u64,
    pub total_computed: u64,
    /// Tokens computed locally (the request's own plus the prefix hit).
    pub num_local: u64,
    pub main_model: u64,
    /// Where the request's prefill ends (`max(prompt, num_tokens - 1)`): Mamba
    /// reserves a checkpoint only on the chunk reaching it.
    pub prefill_end: u64,
    /// Apply the recycling-aware admission cap (full-sequence gate only).
    pub cap: bool,
}

/// What `cache_blocks` needs beyond the request: sparse-retention settings.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Retention<'a> {
    /// `None` = dense, `Some(0)` = replay boundary only, `Some(r)` = one tail per
    /// `r`-token segment.
    pub interval: Option<u64>,
    /// Token positions whose reachable tail must be kept.
    pub boundaries: &'a [u64],
}

/// The manager of one KV-cache group.
#[derive(Clone, Debug)]
pub struct GroupManager {
    spec: GroupSpec,
    group_id: u32,
    block_size: u32,
    /// Hash blocks per group block (`block_size / hash_block_size`).
    scale: usize,
    /// Tokens a hit must be aligned to (the scheduler block size).
    alignment: u64,
    /// EAGLE: hits of this group drop their last block; caching keeps one block
    /// past the aligned boundary.
    use_eagle: bool,
    /// Recycling-aware per-request block cap (sliding window, chunked local).
    admission_cap: Option<u64>,
    /// Mamba: state blocks cached this step (a hit on one cannot be used yet).
    cached_this_step: FxHashSet<CacheKey>,
    /// Tokens per hash block.
    hash_block_size: u32,
    /// Tokens past each block that block hashes cover (lookahead hashing).
    lookahead: u32,
    /// Mamba: checkpoints sit one hash block lower, at EAGLE's replay boundary.
    drop_eagle_checkpoint: bool,
    /// Mamba: also register the state at a shared-prefix junction.
    shared_prefix_checkpoint: bool,
    /// Copy-on-write pairs `(source, copy)` not yet handed out; each endpoint
    /// holds one extra reference until the copy has run.
    pending_cow: Vec<(BlockId, BlockId)>,
    /// Mamba "align": committed boundary states offered to a KV connector,
    /// `(request id, block, boundary tokens)`.
    boundary_offloads: Vec<(String, BlockId, u64)>,
    /// The worker zeroes this group's fresh blocks before use (vLLM's
    /// `records_new_block_ids`): attention groups of a layout that needs it.
    records_new_block_ids: bool,
    /// Fresh blocks to zero since the last drain (copy-on-write copies are
    /// always listed, as vLLM lists them); at most
    /// [`crate::pool::PENDING_BLOCKS_PER_POOL_BLOCK`] entries a pool block
    /// undrained, a block listed again past that keeping its first listing.
    new_block_ids: Vec<BlockId>,
    num_gpu_blocks: u32,
    /// `log2(block_size)` for power-of-two block sizes (divisions on the hot path
    /// become shifts), `None` otherwise.
    shift: Option<u32>,
    /// HiSparse hot: the layout has resident groups (a cold admission then
    /// needs no hot region).
    hisparse_has_resident: bool,
}

/// What every group manager of one coordinator shares.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GroupParams {
    /// Token granularity of the request's block hashes.
    pub hash_block_size: u32,
    /// Tokens a hit must be aligned to (the scheduler block size).
    pub alignment: u64,
    /// Tokens one request may have in flight (bounds windowed admission).
    pub max_in_flight_tokens: u64,
    pub max_model_len: u64,
    pub num_gpu_blocks: u32,
    /// EAGLE applies to this group (prefix-cached groups of an EAGLE model).
    pub use_eagle: bool,
    /// Tokens past each block that block hashes cover.
    pub lookahead: u32,
    /// The model runs EAGLE (Mamba checkpoints follow its replay boundary).
    pub model_eagle: bool,
    /// Mamba: register shared-prefix junction states.
    pub shared_prefix_checkpoint: bool,
    /// The layout needs fresh blocks zeroed (vLLM's `needs_kv_cache_zeroing`).
    pub zero_new_blocks: bool,
    /// The layout has HiSparse resident groups.
    pub hisparse_has_resident: bool,
}

impl GroupManager {
    pub(crate) fn new(spec: GroupSpec, group_id: u32, p: &GroupParams) -> Self {
        let GroupParams {
            hash_block_size,
            alignment,
            max_in_flight_tokens,
            max_model_len,
            num_gpu_blocks,
            use_eagle,
            lookahead,
            model_eagle,
            shared_prefix_checkpoint,
            zero_new_blocks,
            hisparse_has_resident,
        } = *p;
        let is_mamba = matches!(spec.kind, AttentionKind::Mamba { .. });
        // Attention groups only: Mamba states and the ring are not zeroed.
        // (vLLM's HiSparse resident and hot specs are not attention specs.)
        let records_new_block_ids = zero_new_blocks
            && !is_mamba
            && !matches!(
                spec.kind,
                AttentionKind::CircularBuffer
                    | AttentionKind::HiSparseResident
                    | AttentionKind::HiSparseHot { .. }
            );
        let block_size = spec.block_size;
        let bs = u64::from(block_size);
        let admission_cap = match spec.kind {
            AttentionKind::SlidingWindow { window }
            | AttentionKind::ReplayedSlidingWindow { window } => {
                let retained = u64::from(window) - 1 + u64::from(spec.extra_retained_tokens);
                let n = (retained + max_in_flight_tokens).min(max_model_len);
                Some(n.div_ceil(bs) + 1)
            }
            AttentionKind::ChunkedLocal { chunk } => {
                let n = (u64::from(chunk) + max_in_flight_tokens).min(max_model_len);
                Some(n.div_ceil(bs))
            }
            AttentionKind::HiSparseResident => {
                Some(max_in_flight_tokens.min(max_model_len).div_ceil(bs))
            }
            _ => None,
        };
        Self {
            scale: (block_size / hash_block_size) as usize,
            spec,
            group_id,
            block_size,
            alignment,
            use_eagle,
            admission_cap,
            cached_this_step: FxHashSet::default(),
            hash_block_size,
            lookahead,
            drop_eagle_checkpoint: model_eagle && is_mamba,
            shared_prefix_checkpoint: shared_prefix_checkpoint && is_mamba,
            pending_cow: Vec::new(),
            boundary_offloads: Vec::new(),
            records_new_block_ids,
            new_block_ids: Vec::new(),
            num_gpu_blocks,
            shift: block_size
                .is_power_of_two()
                .then(|| block_size.trailing_zeros()),
            hisparse_has_resident,
        }
    }

    /// The group's spec.
    #[must_use]
    pub fn spec(&self) -> &GroupSpec {
        &self.spec
    }

    /// Whether EAGLE applies to this group.
    #[must_use]
    pub fn use_eagle(&self) -> bool {
        self.use_eagle
    }

    /// Tokens per block.
    #[must_use]
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The group its cache keys carry.
    pub(crate) fn group_id(&self) -> u32 {
        self.group_id
    }

    /// Whole blocks in `n` tokens.
    #[inline]
    pub(crate) fn blocks_floor(&self, n: u64) -> u64 {
        match self.shift {
            Some(s) => n >> s,
            None => n / u64::from(self.block_size),
        }
    }

    /// Blocks needed for `n` tokens.
    #[inline]
    pub(crate) fn blocks_ceil(&self, n: u64) -> u64 {
        match self.shift {
            Some(s) => (n + u64::from(self.block_size) - 1) >> s,
            None => n.div_ceil(u64::from(self.block_size)),
        }
    }

    fn kind(&self) -> &AttentionKind {
        &self.spec.kind
    }

    fn mamba_align(&self) -> Option<u64> {
        match self.spec.kind {
            AttentionKind::Mamba {
                mode: MambaCacheMode::Align,
                num_speculative_blocks,
                ..
            } => Some(u64::from(num_speculative_blocks)),
            _ => None,
        }
    }

    /// Whether blocks of this group enter the prefix cache.
    #[must_use]
    pub fn prefix_cacheable(&self) -> bool {
        self.spec.kind.prefix_cacheable()
    }

    /// A Mamba state group.
    pub(crate) fn is_mamba(&self) -> bool {
        matches!(self.spec.kind, AttentionKind::Mamba { .. })
    }

    /// Cross attention: blocks for the encoder output, sized by the encoder
    /// token count.
    pub(crate) fn is_cross_attention(&self) -> bool {
        self.spec.kind == AttentionKind::CrossAttention
    }

    /// A group whose blocks the engine manages itself: the manager gives it none.
    pub(crate) fn is_engine_managed(&self) -> bool {
        self.spec.kind == AttentionKind::EngineManaged
    }

    /// Cache key of the request's `i`-th block of this group. A block spanning
    /// several hash blocks is keyed by its last hash block's hash: vLLM keys it by
    /// the concatenation of the spanned hashes, and since each hash chains over all
    /// before it, the last one identifies the concatenation. Events publish the
    /// last 8 bytes, which are the same either way.
    #[must_use]
    pub fn key_for(&self, hashes: &[BlockHash], i: usize) -> Option<CacheKey> {
        let j = (i + 1) * self.scale;
        (j <= hashes.len()).then(|| CacheKey {
            hash: hashes[j - 1],
            group: self.group_id,
        })
    }

    /// Tokens that attention no longer reads once `n` tokens are computed.
    pub(crate) fn num_skipped_tokens(&self, n: u64) -> u64 {
        match *self.kind() {
            AttentionKind::FullAttention
            | AttentionKind::MlaAttention
            | AttentionKind::SinkFullAttention { .. }
            | AttentionKind::CrossAttention
            | AttentionKind::CircularBuffer
            | AttentionKind::EngineManaged
            | AttentionKind::HiSparseResident
            | AttentionKind::HiSparseHot { .. } => 0,
            AttentionKind::SlidingWindow { window }
            | AttentionKind::ReplayedSlidingWindow { window } => (n + 1)
                .saturating_sub(u64::from(window) + u64::from(self.spec.extra_retained_tokens)),
            AttentionKind::ChunkedLocal { chunk } => n / u64::from(chunk) * u64::from(chunk),
            AttentionKind::Mamba { .. } => n.saturating_sub(1),
        }
    }
}

/// vLLM's `get_mamba_prefill_checkpoint_position`: the reusable Mamba state
/// boundary of a prefill of `num_tokens` tokens, a multiple of `alignment`
/// leaving tokens for the logits (and the lookahead hash) to recompute; with
/// EAGLE one unit lower, at its replay boundary.
pub(crate) fn checkpoint_position(
    num_tokens: u64,
    alignment: u64,
    eagle: bool,
    lookahead: u32,
) -> u64 {
    let limit = if eagle {
        num_tokens as i64
    } else {
        num_tokens as i64 - i64::from(lookahead.max(1))
    };
    let a = alignment as i64;
    let mut p = limit.div_euclid(a) * a;
    if eagle {
        p -= a;
    }
    p.max(0) as u64
}

#[cfg(test)]
mod tests;
