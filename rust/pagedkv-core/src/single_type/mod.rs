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
//! `mamba`). Cross attention needs no file: its blocks hold the encoder output,
//! are allocated once per request and never enter the prefix cache.

mod chunked_local;
mod full;
mod hisparse;
mod mamba;
mod sliding_window;

use rustc_hash::FxHashSet;

use crate::hash::BlockHash;
use crate::pool::{BlockId, BlockPool, CacheKey, NULL_BLOCK};
pub(crate) use crate::request::GroupBlocks;
use crate::request::Request;
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

    /// Blocks one cached block of every group in `group_ids` under `hash`, or
    /// `None` when any group misses.
    fn lookup_all(
        pool: &BlockPool,
        hash: BlockHash,
        group_ids: &[u32],
        found: &mut Vec<BlockId>,
    ) -> bool {
        found.clear();
        for &g in group_ids {
            match pool.first_cached(&hash, g) {
                Some(b) => found.push(b),
                None => return false,
            }
        }
        true
    }

    /// Appends one cached block of every group in `group_ids` under `hash` to
    /// that group's list in `out`; appends nothing and returns `false` when any
    /// group misses. Inlined into the lookup loops: as a call it costs a
    /// third more instructions per block looked up.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn lookup_into(
        pool: &BlockPool,
        hash: BlockHash,
        group_ids: &[u32],
        out: &mut [Vec<BlockId>],
    ) -> bool {
        for (k, &g) in group_ids.iter().enumerate() {
            let Some(b) = pool.first_cached(&hash, g) else {
                for &done in &group_ids[..k] {
                    out[done as usize].pop();
                }
                return false;
            };
            out[g as usize].push(b);
        }
        true
    }

    /// Reads ahead the lookups of blocks `range` in every group of
    /// `group_ids` (a map larger than the caches; see `BlockPool::warm_lookups`).
    /// Callers ask [`BlockPool::reads_ahead`] first: with a small map the loop
    /// stays free of it.
    #[cold]
    fn warm_range(
        &self,
        pool: &BlockPool,
        hashes: &[BlockHash],
        range: std::ops::Range<usize>,
        group_ids: &[u32],
    ) {
        pool.warm_lookups(
            range
                .filter_map(|j| self.hash_at(hashes, j))
                .flat_map(|hash| group_ids.iter().map(move |&group| CacheKey { hash, group })),
        );
    }

    fn hash_at(&self, hashes: &[BlockHash], i: usize) -> Option<BlockHash> {
        hashes.get((i + 1) * self.scale - 1).copied()
    }

    /// Longest cached prefix for the groups `group_ids` (all with this spec) within
    /// `q.max_len` tokens; writes one list per group into `out` (indexed by group
    /// id, skipped positions as null blocks) and returns the hit length in tokens.
    pub(crate) fn find_longest_cache_hit(
        &self,
        pool: &BlockPool,
        q: &Lookup<'_>,
        group_ids: &[u32],
        out: &mut [Vec<BlockId>],
    ) -> usize {
        for &g in group_ids {
            out[g as usize].clear();
        }
        match *self.kind() {
            AttentionKind::FullAttention
            | AttentionKind::MlaAttention
            | AttentionKind::SinkFullAttention { .. } => self.find_full(pool, q, group_ids, out),
            AttentionKind::SlidingWindow { window } => {
                self.find_sliding(pool, q, window, group_ids, out)
            }
            AttentionKind::ChunkedLocal { chunk } => {
                self.find_chunked(pool, q, chunk, group_ids, out)
            }
            AttentionKind::Mamba { .. } => self.find_mamba(pool, q, group_ids, out),
            AttentionKind::CrossAttention
            | AttentionKind::ReplayedSlidingWindow { .. }
            | AttentionKind::CircularBuffer
            | AttentionKind::EngineManaged
            | AttentionKind::HiSparseResident
            | AttentionKind::HiSparseHot { .. } => 0,
        }
    }

    fn truncate_all(out: &mut [Vec<BlockId>], group_ids: &[u32], n: usize) {
        for &g in group_ids {
            out[g as usize].truncate(n);
        }
    }

    /// Blocks this step takes from the free queue: fresh blocks plus prefix-hit
    /// blocks that are eviction candidates (touching pulls them out of the queue).
    /// May be negative for Mamba "align" (vLLM's arithmetic, kept as is).
    pub(crate) fn num_blocks_to_allocate(
        &self,
        pool: &BlockPool,
        gb: &GroupBlocks,
        hit: &[BlockId],
        n: &Need,
    ) -> i64 {
        let (mut num_tokens, total_computed, num_tokens_main_model, apply_admission_cap) =
            (n.num_tokens, n.total_computed, n.main_model, n.cap);
        let bs = u64::from(self.block_size);
        let evictable =
            |blocks: &[BlockId]| blocks.iter().filter(|&&b| pool.is_evictable(b)).count() as i64;
        if self.spec.kind == AttentionKind::CircularBuffer {
            // The ring's one block, claimed once.
            return i64::from(gb.blocks.is_empty());
        }
        if self.is_engine_managed() {
            return 0;
        }
        if let Some(need) = self.hisparse_need(gb, n) {
            return need;
        }
        if let AttentionKind::Mamba {
            num_speculative_blocks,
            mode,
            ..
        } = self.spec.kind
        {
            if self.hit_cached_this_step(pool, hit) {
                // The state is written at the end of the step that cached it and
                // cannot be read yet: vLLM makes the request not fit this step.
                return i64::from(self.num_gpu_blocks) + 1;
            }
            if mode == MambaCacheMode::Align {
                let spec = u64::from(num_speculative_blocks);
                let required = num_tokens_main_model.div_ceil(bs) + spec;
                let mut new = required as i64 - hit.len() as i64 - gb.blocks.len() as i64;
                let partial =
                    self.has_partial_local_hit(hit, n.num_local) || gb.partial_hit.is_some();
                if partial {
                    new = new.max(0) + 1;
                }
                let checkpoint = u64::from(self.mamba_checkpoint(gb, n).is_some());
                if new > 0 {
                    let cap = 1
                        + u64::from(partial)
                        + checkpoint
                        + if gb.mamba_allocated { 0 } else { spec };
                    new = new.min(cap as i64);
                }
                return new + evictable(hit);
            }
            num_tokens += bs * u64::from(num_speculative_blocks);
        }
        let mut required = self.blocks_ceil(num_tokens);
        if apply_admission_cap && let Some(cap) = self.admission_cap {
            required = required.min(cap);
        }
        let have = gb.blocks.len() as u64;
        if gb.num_cached.is_some() {
            return required.saturating_sub(have) as i64;
        }
        let skipped_blocks = self.blocks_floor(self.num_skipped_tokens(total_computed));
        let local = hit.len() as u64 + have;
        let fresh = required.saturating_sub(skipped_blocks.max(local));
        let skip_hits = (skipped_blocks.saturating_sub(have) as usize).min(hit.len());
        // A hit ending inside a block takes one more block for its copy.
        let cow = i64::from(self.has_partial_local_hit(hit, n.num_local));
        fresh as i64 + cow + evictable(&hit[skip_hits..])
    }

    /// vLLM's `_has_partial_local_hit`: the local prefix hit ends inside one of
    /// this group's blocks, so its shared tail block is copied on write.
    fn has_partial_local_hit(&self, hit: &[BlockId], num_local: u64) -> bool {
        !hit.is_empty() && !num_local.is_multiple_of(u64::from(self.block_size))
    }

    /// Mamba "align": the prefill checkpoint this step reserves, `(position,
    /// column)`: the reusable boundary below the chunk end (vLLM's
    /// `get_mamba_prefill_checkpoint_position`), when the chunk reaches the end
    /// of the prefill and the kernel can export it there
    /// (`_needs_internal_checkpoint`).
    pub(crate) fn mamba_checkpoint(&self, gb: &GroupBlocks, n: &Need) -> Option<(u64, usize)> {
        let AttentionKind::Mamba {
            mode: MambaCacheMode::Align,
            num_speculative_blocks,
            prefill_checkpoint_alignment: Some(align),
        } = self.spec.kind
        else {
            return None;
        };
        let bs = i64::from(self.block_size);
        let end = n.main_model;
        let position = checkpoint_position(
            end,
            self.alignment,
            self.drop_eagle_checkpoint,
            self.lookahead,
        );
        let start = n.total_computed as i64;
        let (pos, end_i) = (position as i64, end as i64);
        let hbs = i64::from(self.hash_block_size);
        let column = (end_i + bs - 1).div_euclid(bs) - 2;
        let valid = start % hbs == 0
            && column > (start - 1).div_euclid(bs)
            && start + hbs <= pos
            && start < pos
            && pos < end_i
            && (pos - start) % i64::from(align) == 0;
        if end < n.prefill_end || !valid || column < 0 {
            return None;
        }
        let c = column as usize;
        let len = gb.blocks.len();
        let free_column = c >= len
            || gb.blocks[c] == NULL_BLOCK
            || (gb.mamba_allocated && c + num_speculative_blocks as usize >= len);
        free_column.then_some((position, c))
    }

    /// Records the checkpoint [`Self::mamba_checkpoint`] reserves (vLLM records it
    /// while counting the blocks a step needs).
    pub(crate) fn record_checkpoint(&self, gb: &mut GroupBlocks, n: &Need) {
        if self.mamba_align().is_some() {
            gb.checkpoint = self.mamba_checkpoint(gb, n);
        }
    }

    /// Adopts the prefix hit at admission: touches the hit blocks, pads skipped
    /// positions with the null block, marks them cached.
    pub(crate) fn add_local_computed_blocks(
        &self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        hit: &[BlockId],
        num_local: u64,
        num_external: u64,
    ) {
        if matches!(
            self.kind(),
            AttentionKind::CrossAttention
                | AttentionKind::CircularBuffer
                | AttentionKind::EngineManaged
        ) {
            return;
        }
        if matches!(
            self.kind(),
            AttentionKind::HiSparseResident | AttentionKind::HiSparseHot { .. }
        ) {
            self.hisparse_add_local(gb, num_local);
            return;
        }
        let bs = u64::from(self.block_size);
        // Only the blocks the adopted tokens reach: a caller may adopt fewer
        // tokens than the lookup found (the rest it computes, or a connector
        // loads into fresh blocks).
        let hit = &hit[..(num_local.div_ceil(bs) as usize).min(hit.len())];
        let skipped_blocks = (self.num_skipped_tokens(num_local + num_external) / bs) as usize;
        let hit = &hit[skipped_blocks.min(hit.len())..];
        if pool.enable_caching() {
            pool.touch(hit);
        }
        gb.blocks
            .extend(std::iter::repeat_n(NULL_BLOCK, skipped_blocks));
        gb.blocks.extend_from_slice(hit);
        gb.num_cached = Some(gb.blocks.len());
        if let Some(&last) = hit.last().filter(|_| !num_local.is_multiple_of(bs)) {
            // The hit ends inside its last block: the next allocation copies it
            // into a private block, which is cached again once full.
            let idx = (num_local / bs) as usize;
            gb.partial_hit = Some((idx, last));
            gb.num_cached = Some(idx);
        }
    }

    /// Fresh blocks for tokens whose KV an external connector supplies.
    pub(crate) fn allocate_external_computed_blocks(
        &mut self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        num_local: u64,
        num_external: u64,
        record_for_zeroing: bool,
    ) {
        match self.kind() {
            AttentionKind::CrossAttention | AttentionKind::EngineManaged => return,
            AttentionKind::HiSparseResident | AttentionKind::HiSparseHot { .. } => {
                self.hisparse_add_external(pool, gb, num_local, num_external);
                return;
            }
            AttentionKind::CircularBuffer => {
                if gb.blocks.is_empty() {
                    let _ = pool.get_new_blocks(1, &mut gb.blocks);
                }
                return;
            }
            _ => {}
        }
        let total = num_local + num_external;
        let skipped = self.num_skipped_tokens(total);
        let ext = if skipped > 0 {
            (total - skipped).min(num_external)
        } else {
            num_external
        };
        if ext == 0 {
            return;
        }
        let need = total
            .div_ceil(u64::from(self.block_size))
            .saturating_sub(gb.blocks.len() as u64);
        // Capacity was checked by the caller.
        let start = gb.blocks.len();
        let _ = pool.get_new_blocks(need as u32, &mut gb.blocks);
        if self.records_new_block_ids && record_for_zeroing {
            self.new_block_ids.extend_from_slice(&gb.blocks[start..]);
            self.bound_new_block_ids();
        }
    }

    /// Grows the block list to cover `num_tokens`, returning the new ids in `out`.
    pub(crate) fn allocate_new_blocks(
        &mut self,
        pool: &mut BlockPool,
        id: &str,
        gb: &mut GroupBlocks,
        mut num_tokens: u64,
        num_tokens_main_model: u64,
        out: &mut Vec<BlockId>,
    ) {
        let bs = u64::from(self.block_size);
        if self.spec.kind == AttentionKind::CircularBuffer {
            if gb.blocks.is_empty() {
                let start = out.len();
                let _ = pool.get_new_blocks(1, out);
                gb.blocks.extend_from_slice(&out[start..]);
            }
            return;
        }
        if self.is_engine_managed() {
            return;
        }
        if matches!(
            self.kind(),
            AttentionKind::HiSparseResident | AttentionKind::HiSparseHot { .. }
        ) {
            self.hisparse_allocate(pool, gb, num_tokens, out);
            return;
        }
        if let AttentionKind::Mamba {
            mode,
            num_speculative_blocks,
            ..
        } = self.spec.kind
        {
            if mode == MambaCacheMode::Align {
                self.allocate_mamba_align(
                    pool,
                    id,
                    gb,
                    num_tokens_main_model,
                    num_speculative_blocks,
                    out,
                );
                return;
            }
            num_tokens += bs * u64::from(num_speculative_blocks);
        }
        if let Some((idx, source)) = gb.partial_hit.take() {
            // The shared tail block of a partial hit: the request continues in a
            // private copy (capacity was checked by the caller).
            let _ = pool.get_new_blocks(1, out);
            let copy = out[out.len() - 1];
            self.apply_cow(pool, gb, idx, source, copy);
            self.new_block_ids.push(copy);
            self.bound_new_block_ids();
        }
        let required = self.blocks_ceil(num_tokens);
        let have = gb.blocks.len() as u64;
        if required <= have {
            return;
        }
        let start = out.len();
        let _ = pool.get_new_blocks((required - have) as u32, out);
        gb.extend_blocks(&out[start..]);
        if self.records_new_block_ids {
            self.new_block_ids.extend_from_slice(&out[start..]);
            self.bound_new_block_ids();
        }
    }

    /// Whether the worker zeroes this group's fresh blocks.
    #[must_use]
    pub fn records_new_block_ids(&self) -> bool {
        self.records_new_block_ids
    }

    /// Drains the blocks to zero recorded since the last call into `out`.
    pub(crate) fn take_new_block_ids(&mut self, out: &mut Vec<BlockId>) {
        out.append(&mut self.new_block_ids);
    }

    /// Records the request's blocks from block `start` on for zeroing again
    /// (blocks a failed KV load left unwritten).
    pub(crate) fn record_blocks_for_zeroing(&mut self, gb: &GroupBlocks, start: usize) {
        if self.records_new_block_ids {
            self.new_block_ids
                .extend_from_slice(gb.blocks.get(start..).unwrap_or(&[]));
            self.bound_new_block_ids();
        }
    }

    /// Keeps the undrained blocks to zero within
    /// [`crate::pool::PENDING_BLOCKS_PER_POOL_BLOCK`] entries a pool block:
    /// past that, a block listed again keeps its first listing only (zeroed
    /// once at drain time, which is all a listing asks).
    fn bound_new_block_ids(&mut self) {
        crate::pool::dedupe_past_bound(&mut self.new_block_ids, self.num_gpu_blocks as usize);
    }

    /// vLLM's `_apply_cow`: the request's block `idx` becomes `copy`; both
    /// endpoints stay referenced until the copy has run (the source keeps the
    /// hit's reference, the copy takes one more).
    fn apply_cow(
        &mut self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        idx: usize,
        source: BlockId,
        copy: BlockId,
    ) {
        debug_assert_eq!(gb.blocks.get(idx), Some(&source));
        gb.blocks[idx] = copy;
        self.pending_cow.push((source, copy));
        pool.add_ref(copy);
    }

    /// Drains the copy-on-write pairs `(source, copy)` made since the last call;
    /// each endpoint still holds the one reference the caller now owns.
    pub(crate) fn take_pending_cow(&mut self, out: &mut Vec<(BlockId, BlockId)>) {
        out.append(&mut self.pending_cow);
    }

    /// The copy-on-write pairs not yet handed out.
    pub(crate) fn pending_cow(&self) -> &[(BlockId, BlockId)] {
        &self.pending_cow
    }

    /// Caches the request's newly full blocks covering `num_tokens`; returns the
    /// block range `[from, to)` that was published, if any, with the mask of
    /// blocks kept (`None` = all).
    pub(crate) fn cache_blocks(
        &mut self,
        pool: &mut BlockPool,
        req: &mut Request,
        g: usize,
        num_tokens: usize,
        hash_block_size: usize,
        retention: &Retention<'_>,
    ) -> Option<(usize, usize, Option<Vec<bool>>)> {
        if !self.prefix_cacheable() {
            return None;
        }
        let shared = req.shared_prefix_boundary;
        let (hashes, gb) = req.hashes_and_group_mut(g);
        let cached = gb.num_cached.unwrap_or(0);
        let hashed_tokens = hashes.len() * hash_block_size;
        let full =
            (self.blocks_floor(num_tokens.min(hashed_tokens) as u64) as usize).min(gb.blocks.len());
        if cached >= full {
            return None;
        }
        let mask = if self.spec.kind.is_sparse_retention() {
            // The replay boundaries plus a pinned shared-prefix junction.
            let mut b = [0u64; 4];
            let mut nb = retention.boundaries.len().min(2);
            b[..nb].copy_from_slice(&retention.boundaries[..nb]);
            if shared > 0 {
                b[nb] = shared;
                nb += 1;
                if self.use_eagle {
                    b[nb] = shared.saturating_sub(u64::from(self.block_size));
                    nb += 1;
                }
            }
            match *self.kind() {
                AttentionKind::SlidingWindow { window } => {
                    self.sliding_reachable_mask(window, cached, full, retention.interval, &b[..nb])
                }
                AttentionKind::Mamba { .. } => {
                    self.mamba_reachable_mask(cached, full, retention.interval, &b[..nb])
                }
                _ => None,
            }
        } else {
            None
        };
        if full - cached > 1 {
            pool.warm_lookups((cached..full).filter_map(|i| self.key_for(hashes, i)));
        }
        for i in cached..full {
            let b = gb.blocks[i];
            if b == NULL_BLOCK || mask.as_ref().is_some_and(|m| !m[i - cached]) {
                continue;
            }
            if let Some(key) = self.key_for(hashes, i) {
                pool.cache_full_block(b, key, ((i + 1) * self.block_size as usize) as u32);
                if matches!(self.kind(), AttentionKind::Mamba { .. }) {
                    self.cached_this_step.insert(key);
                }
            }
        }
        gb.num_cached = Some(full);
        Some((cached, full, mask))
    }

    /// Releases every block of the request, tail first.
    pub(crate) fn free(pool: &mut BlockPool, gb: &mut GroupBlocks) {
        pool.free_blocks(gb.blocks.iter().rev().copied());
        Self::forget(gb);
    }

    /// Moves the request's blocks to `out` without freeing them (allocation
    /// order, leading null blocks dropped) and forgets them.
    pub(crate) fn pop_blocks(gb: &mut GroupBlocks, out: &mut Vec<BlockId>) {
        let first = gb.blocks.iter().position(|&b| b != NULL_BLOCK);
        out.extend_from_slice(first.map_or(&[][..], |i| &gb.blocks[i..]));
        Self::forget(gb);
    }

    fn forget(gb: &mut GroupBlocks) {
        gb.blocks.clear();
        gb.num_cached = None;
        gb.mamba_allocated = false;
        gb.mamba_last_state = None;
        gb.mamba_retired = 0;
        gb.partial_hit = None;
        gb.checkpoint = None;
        gb.producer_tail = None;
        gb.overlay = None;
        gb.hot_required = false;
    }

    /// Blocks `remove_skipped_blocks(total_computed)` would release (dry run).
    pub(crate) fn num_skippable_blocks(&self, gb: &GroupBlocks, total_computed: u64) -> usize {
        let skipped = self.num_skipped_tokens(total_computed);
        if skipped == 0 {
            return 0;
        }
        let n = ((skipped / u64::from(self.block_size)) as usize).min(gb.blocks.len());
        if self.mamba_align().is_some() {
            return self.mamba_align_num_skippable(gb, n, total_computed);
        }
        gb.blocks[..n]
            .iter()
            .rev()
            .take_while(|&&b| b != NULL_BLOCK)
            .count()
    }

    /// Replaces blocks outside the attention window with the null block, freeing
    /// the deeper ones first.
    pub(crate) fn remove_skipped_blocks(
        &self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        total_computed: u64,
    ) {
        if self.mamba_align().is_some() {
            self.mamba_align_remove_skipped(pool, gb, total_computed);
            return;
        }
        let skipped = self.num_skipped_tokens(total_computed);
        if skipped > 0 {
            let n = ((skipped / u64::from(self.block_size)) as usize).min(gb.blocks.len());
            let mut freed = Vec::new();
            for i in (0..n).rev() {
                if gb.blocks[i] == NULL_BLOCK {
                    break;
                }
                freed.push(gb.blocks[i]);
                gb.blocks[i] = NULL_BLOCK;
            }
            pool.free_blocks(freed);
        }
    }

    /// Per-step reset (Mamba forgets which states were cached this step).
    pub(crate) fn new_step_starts(&mut self) {
        self.cached_this_step.clear();
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
