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

use rustc_hash::FxHashSet;

use crate::hash::BlockHash;
use crate::pool::{BlockId, BlockPool, CacheKey, NULL_BLOCK};
use crate::request::{GroupBlocks, Request};
use crate::spec::{AttentionKind, GroupSpec, MambaCacheMode};

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
    pub main_model: u64,
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
    pub(crate) use_eagle: bool,
    /// Recycling-aware per-request block cap (sliding window, chunked local).
    admission_cap: Option<u64>,
    /// Mamba: state blocks cached this step (a hit on one cannot be used yet).
    cached_this_step: FxHashSet<CacheKey>,
    num_gpu_blocks: u32,
    /// `log2(block_size)` for power-of-two block sizes (divisions on the hot path
    /// become shifts), `None` otherwise.
    shift: Option<u32>,
}

impl GroupManager {
    pub(crate) fn new(
        spec: GroupSpec,
        group_id: u32,
        hash_block_size: u32,
        alignment: u64,
        max_in_flight_tokens: u64,
        max_model_len: u64,
        num_gpu_blocks: u32,
    ) -> Self {
        let block_size = spec.block_size;
        let bs = u64::from(block_size);
        let admission_cap = match spec.kind {
            AttentionKind::SlidingWindow { window } => {
                let n = (u64::from(window) - 1 + max_in_flight_tokens).min(max_model_len);
                Some(n.div_ceil(bs) + 1)
            }
            AttentionKind::ChunkedLocal { chunk } => {
                let n = (u64::from(chunk) + max_in_flight_tokens).min(max_model_len);
                Some(n.div_ceil(bs))
            }
            _ => None,
        };
        Self {
            scale: (block_size / hash_block_size) as usize,
            spec,
            group_id,
            block_size,
            alignment,
            use_eagle: false,
            admission_cap,
            cached_this_step: FxHashSet::default(),
            num_gpu_blocks,
            shift: block_size
                .is_power_of_two()
                .then(|| block_size.trailing_zeros()),
        }
    }

    /// The group's spec.
    #[must_use]
    pub fn spec(&self) -> &GroupSpec {
        &self.spec
    }

    /// Tokens per block.
    #[must_use]
    pub fn block_size(&self) -> u32 {
        self.block_size
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
            } => Some(u64::from(num_speculative_blocks)),
            _ => None,
        }
    }

    /// Whether blocks of this group enter the prefix cache.
    #[must_use]
    pub fn prefix_cacheable(&self) -> bool {
        !matches!(self.spec.kind, AttentionKind::CrossAttention)
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
            | AttentionKind::CrossAttention => 0,
            AttentionKind::SlidingWindow { window } => (n + 1).saturating_sub(u64::from(window)),
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
            match pool.cached_block(&CacheKey { hash, group: g }) {
                Some(b) => found.push(b),
                None => return false,
            }
        }
        true
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
            AttentionKind::CrossAttention => 0,
        }
    }

    fn push_all(out: &mut [Vec<BlockId>], group_ids: &[u32], found: &[BlockId]) {
        for (&g, &b) in group_ids.iter().zip(found) {
            out[g as usize].push(b);
        }
    }

    fn truncate_all(out: &mut [Vec<BlockId>], group_ids: &[u32], n: usize) {
        for &g in group_ids {
            out[g as usize].truncate(n);
        }
    }

    fn find_full(
        &self,
        pool: &BlockPool,
        q: &Lookup<'_>,
        group_ids: &[u32],
        out: &mut [Vec<BlockId>],
    ) -> usize {
        let bs = self.block_size as usize;
        let mut found = Vec::with_capacity(group_ids.len());
        let mut n = 0usize;
        for i in 0..q.max_len / bs {
            let Some(hash) = self.hash_at(q.hashes, i) else {
                break;
            };
            if !Self::lookup_all(pool, hash, group_ids, &mut found) {
                break;
            }
            Self::push_all(out, group_ids, &found);
            n += 1;
        }
        let mut hit = n * bs;
        if q.drop_eagle_block && hit > 0 {
            hit -= q.alignment.min(bs);
        }
        hit -= hit % q.alignment;
        Self::truncate_all(out, group_ids, hit.div_ceil(bs));
        hit
    }

    fn find_sliding(
        &self,
        pool: &BlockPool,
        q: &Lookup<'_>,
        window: u32,
        group_ids: &[u32],
        out: &mut [Vec<BlockId>],
    ) -> usize {
        let bs = self.block_size as usize;
        let need = contiguous_blocks_for_hit(window, self.block_size, q.drop_eagle_block);
        let max_blocks = q.max_len / bs;
        for &g in group_ids {
            out[g as usize].resize(max_blocks, NULL_BLOCK);
        }
        let mut found = Vec::with_capacity(group_ids.len());
        let mut run = 0usize;
        let mut matched = false;
        for i in (0..max_blocks).rev() {
            let hit = self
                .hash_at(q.hashes, i)
                .is_some_and(|h| Self::lookup_all(pool, h, group_ids, &mut found));
            if !hit {
                run = 0;
                continue;
            }
            if run == 0 && bs != q.alignment {
                let post_pop = if q.drop_eagle_block { i } else { i + 1 };
                if (post_pop * bs) % q.alignment != 0 {
                    continue;
                }
            }
            for (&g, &b) in group_ids.iter().zip(&found) {
                out[g as usize][i] = b;
            }
            run += 1;
            if run >= need {
                Self::truncate_all(out, group_ids, i + run);
                matched = true;
                break;
            }
        }
        let len_of = |out: &[Vec<BlockId>]| out[group_ids[0] as usize].len();
        if !matched {
            // A run touching position 0 is a hit even if shorter than the window.
            Self::truncate_all(out, group_ids, run);
            while bs != q.alignment && (len_of(out) * bs) % q.alignment != 0 {
                let l = len_of(out) - 1;
                Self::truncate_all(out, group_ids, l);
            }
        }
        if q.drop_eagle_block && len_of(out) > 0 {
            let l = len_of(out) - 1;
            Self::truncate_all(out, group_ids, l);
            while bs != q.alignment && (len_of(out) * bs) % q.alignment != 0 {
                let l = len_of(out) - 1;
                Self::truncate_all(out, group_ids, l);
            }
        }
        len_of(out) * bs
    }

    fn find_chunked(
        &self,
        pool: &BlockPool,
        q: &Lookup<'_>,
        chunk: u32,
        group_ids: &[u32],
        out: &mut [Vec<BlockId>],
    ) -> usize {
        let bs = self.block_size as usize;
        let chunk = chunk as usize;
        let max_blocks = q.max_len / bs;
        let start = if q.max_len > 0 {
            q.max_len / chunk * chunk
        } else {
            0
        };
        let start_block = start / bs;
        for &g in group_ids {
            out[g as usize].resize(start_block, NULL_BLOCK);
        }
        let mut found = Vec::with_capacity(group_ids.len());
        for i in start_block..max_blocks {
            let Some(hash) = self.hash_at(q.hashes, i) else {
                break;
            };
            if !Self::lookup_all(pool, hash, group_ids, &mut found) {
                break;
            }
            Self::push_all(out, group_ids, &found);
        }
        out[group_ids[0] as usize].len() * bs
    }

    fn find_mamba(
        &self,
        pool: &BlockPool,
        q: &Lookup<'_>,
        group_ids: &[u32],
        out: &mut [Vec<BlockId>],
    ) -> usize {
        let bs = self.block_size as usize;
        let mut found = Vec::with_capacity(group_ids.len());
        for i in (0..q.max_len / bs).rev() {
            let Some(hash) = self.hash_at(q.hashes, i) else {
                continue;
            };
            if !Self::lookup_all(pool, hash, group_ids, &mut found) {
                continue;
            }
            if bs != q.alignment && ((i + 1) * bs) % q.alignment != 0 {
                continue;
            }
            for (&g, &b) in group_ids.iter().zip(&found) {
                let v = &mut out[g as usize];
                v.resize(i, NULL_BLOCK);
                v.push(b);
            }
            return (i + 1) * bs;
        }
        0
    }

    /// Mamba: whether the hit's state block was cached during this step.
    pub(crate) fn hit_cached_this_step(&self, pool: &BlockPool, hit: &[BlockId]) -> bool {
        matches!(self.kind(), AttentionKind::Mamba { .. })
            && hit
                .last()
                .and_then(|&b| pool.block_key(b))
                .is_some_and(|k| self.cached_this_step.contains(&k))
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
        if let AttentionKind::Mamba {
            num_speculative_blocks,
            mode,
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
                if new > 0 {
                    let cap = 1 + if gb.mamba_allocated { 0 } else { spec };
                    new = new.min(cap as i64);
                }
                return new + evictable(hit);
            }
            num_tokens += bs * u64::from(num_speculative_blocks);
        }
        let mut required = self.blocks_ceil(num_tokens);
        if apply_admission_cap {
            if let Some(cap) = self.admission_cap {
                required = required.min(cap);
            }
        }
        let have = gb.blocks.len() as u64;
        if gb.num_cached.is_some() {
            return required.saturating_sub(have) as i64;
        }
        let skipped_blocks = self.blocks_floor(self.num_skipped_tokens(total_computed));
        let local = hit.len() as u64 + have;
        let fresh = required.saturating_sub(skipped_blocks.max(local));
        let skip_hits = (skipped_blocks.saturating_sub(have) as usize).min(hit.len());
        fresh as i64 + evictable(&hit[skip_hits..])
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
        if matches!(self.kind(), AttentionKind::CrossAttention) {
            return;
        }
        let bs = u64::from(self.block_size);
        let skipped_blocks = (self.num_skipped_tokens(num_local + num_external) / bs) as usize;
        let hit = &hit[skipped_blocks.min(hit.len())..];
        if pool.enable_caching() {
            pool.touch(hit);
        }
        gb.blocks
            .extend(std::iter::repeat_n(NULL_BLOCK, skipped_blocks));
        gb.blocks.extend_from_slice(hit);
        gb.num_cached = Some(gb.blocks.len());
    }

    /// Fresh blocks for tokens whose KV an external connector supplies.
    pub(crate) fn allocate_external_computed_blocks(
        &self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        num_local: u64,
        num_external: u64,
    ) {
        if matches!(self.kind(), AttentionKind::CrossAttention) {
            return;
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
        let _ = pool.get_new_blocks(need as u32, &mut gb.blocks);
    }

    /// Grows the block list to cover `num_tokens`, returning the new ids in `out`.
    pub(crate) fn allocate_new_blocks(
        &self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        mut num_tokens: u64,
        num_tokens_main_model: u64,
        out: &mut Vec<BlockId>,
    ) {
        let bs = u64::from(self.block_size);
        if let AttentionKind::Mamba {
            mode,
            num_speculative_blocks,
        } = self.spec.kind
        {
            if mode == MambaCacheMode::Align {
                self.allocate_mamba_align(
                    pool,
                    gb,
                    num_tokens_main_model,
                    num_speculative_blocks,
                    out,
                );
                return;
            }
            num_tokens += bs * u64::from(num_speculative_blocks);
        }
        let required = self.blocks_ceil(num_tokens);
        let have = gb.blocks.len() as u64;
        if required <= have {
            return;
        }
        // Capacity was checked by the caller.
        let _ = pool.get_new_blocks((required - have) as u32, out);
        gb.blocks.extend_from_slice(out);
    }

    /// Mamba "align": a request holds only the running state block (plus
    /// speculative blocks); earlier positions are null, the previous state block
    /// is released one step later (`remove_skipped_blocks`).
    fn allocate_mamba_align(
        &self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        num_tokens: u64,
        spec: u32,
        out: &mut Vec<BlockId>,
    ) {
        let bs = u64::from(self.block_size);
        let spec = spec as usize;
        let required = num_tokens.div_ceil(bs) as usize + spec;
        if required <= gb.blocks.len() {
            gb.mamba_allocated = true;
            return;
        }
        let prev_len = gb.blocks.len();
        if gb.mamba_allocated {
            gb.mamba_last_state = Some(prev_len - 1 - spec);
        } else if prev_len > 0 {
            gb.mamba_last_state = Some(prev_len - 1);
        }
        let skipped = required - spec - 1;
        if prev_len < skipped {
            gb.blocks.resize(skipped, NULL_BLOCK);
        }
        if gb.mamba_allocated {
            // Speculative blocks move forward; their old slots become null.
            for idx in prev_len - spec..prev_len {
                if idx >= skipped {
                    break;
                }
                let b = gb.blocks[idx];
                gb.blocks.push(b);
                gb.blocks[idx] = NULL_BLOCK;
            }
        }
        let new = required.saturating_sub(gb.blocks.len());
        out.extend_from_slice(&gb.blocks[prev_len.min(gb.blocks.len())..]);
        let start = out.len();
        let _ = pool.get_new_blocks(new as u32, out);
        gb.blocks.extend_from_slice(&out[start..]);
        gb.mamba_allocated = true;
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
        let gb = &mut req.groups[g];
        let cached = gb.num_cached.unwrap_or(0);
        let hashed_tokens = req.hashes.len() * hash_block_size;
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
            self.reachable_block_mask(cached, full, retention.interval, &b[..nb])
        } else {
            None
        };
        for i in cached..full {
            let b = gb.blocks[i];
            if b == NULL_BLOCK || mask.as_ref().is_some_and(|m| !m[i - cached]) {
                continue;
            }
            if let Some(key) = self.key_for(&req.hashes, i) {
                pool.cache_full_block(b, key, ((i + 1) * self.block_size as usize) as u32);
                if matches!(self.kind(), AttentionKind::Mamba { .. }) {
                    self.cached_this_step.insert(key);
                }
            }
        }
        gb.num_cached = Some(full);
        Some((cached, full, mask))
    }

    /// vLLM's `_cache_partial_tail_block` (full-attention groups whose block spans
    /// several hash blocks): registers the prompt's last hash boundary inside a
    /// block as a partial entry of that block. Returns the boundary (tokens) when
    /// the entry is new, for its `BlockStored` event.
    pub(crate) fn cache_partial_tail(
        &self,
        pool: &mut BlockPool,
        req: &Request,
        g: usize,
        num_tokens: usize,
        hash_block_size: usize,
    ) -> Option<usize> {
        if self.scale <= 1 || !self.spec.kind.is_full_attention() {
            return None;
        }
        let limit = if self.use_eagle {
            req.num_prompt_tokens
        } else {
            req.num_prompt_tokens.saturating_sub(1)
        };
        let boundary = (limit / hash_block_size).min(req.hashes.len()) * hash_block_size;
        let bs = self.block_size as usize;
        if boundary == 0 || boundary > num_tokens || boundary % bs == 0 {
            return None;
        }
        let &block = req.groups[g].blocks.get(boundary / bs)?;
        let key = CacheKey {
            hash: req.hashes[boundary / hash_block_size - 1],
            group: self.group_id,
        };
        pool.cache_partial_block(block, key, boundary as u32)
            .then_some(boundary)
    }

    /// Which of blocks `[start, end)` can ever serve a hit (vLLM's
    /// `reachable_block_mask`); `None` = all of them.
    fn reachable_block_mask(
        &self,
        start: usize,
        end: usize,
        interval: Option<u64>,
        boundaries: &[u64],
    ) -> Option<Vec<bool>> {
        let bs = u64::from(self.block_size);
        let align = self.alignment;
        match *self.kind() {
            AttentionKind::SlidingWindow { window } => {
                if align % bs != 0 {
                    return None;
                }
                let need = contiguous_blocks_for_hit(window, self.block_size, self.use_eagle);
                let shift = usize::from(self.use_eagle);
                let mut mask = vec![false; end - start];
                let segment = match interval {
                    None => Some(align),
                    Some(0) => None,
                    Some(r) => Some(r),
                };
                if let Some(seg) = segment {
                    let per = (seg / bs) as usize;
                    if need >= per {
                        return None;
                    }
                    for i in start..end {
                        if i >= shift && (i - shift) % per >= per - need {
                            mask[i - start] = true;
                        }
                    }
                }
                if interval.is_some() {
                    for &b in boundaries {
                        let aligned = b / align * align;
                        let e = (aligned / bs) as usize + shift;
                        for j in start.max(e.saturating_sub(need))..end.min(e) {
                            mask[j - start] = true;
                        }
                    }
                }
                Some(mask)
            }
            AttentionKind::Mamba { .. } => {
                let r = interval?;
                let mut mask = vec![false; end - start];
                if r > 0 {
                    let per = (r / bs) as usize;
                    if per <= 1 {
                        return None;
                    }
                    let first = (start + per) / per * per - 1;
                    let mut i = first - start;
                    while i < mask.len() {
                        mask[i] = true;
                        i += per;
                    }
                }
                for &b in boundaries {
                    let aligned = b / align * align;
                    let Some(block) = ((aligned / bs) as usize).checked_sub(1) else {
                        continue;
                    };
                    if (start..end).contains(&block) {
                        mask[block - start] = true;
                    }
                }
                Some(mask)
            }
            _ => None,
        }
    }

    /// Releases every block of the request, tail first.
    pub(crate) fn free(&self, pool: &mut BlockPool, gb: &mut GroupBlocks) {
        pool.free_blocks(gb.blocks.iter().rev().copied());
        gb.blocks.clear();
        gb.num_cached = None;
        gb.mamba_allocated = false;
        gb.mamba_last_state = None;
        gb.mamba_retired = 0;
    }

    /// Blocks `remove_skipped_blocks(total_computed)` would release (dry run).
    pub(crate) fn num_skippable_blocks(&self, gb: &GroupBlocks, total_computed: u64) -> usize {
        let skipped = self.num_skipped_tokens(total_computed);
        if skipped == 0 {
            return 0;
        }
        let n = ((skipped / u64::from(self.block_size)) as usize).min(gb.blocks.len());
        let mut count = if self.mamba_align().is_some() {
            gb.blocks[gb.mamba_retired.min(n)..n]
                .iter()
                .filter(|&&b| b != NULL_BLOCK)
                .count()
        } else {
            gb.blocks[..n]
                .iter()
                .rev()
                .take_while(|&&b| b != NULL_BLOCK)
                .count()
        };
        if let (Some(_), Some(last)) = (self.mamba_align(), gb.mamba_last_state) {
            let limit = total_computed.div_ceil(u64::from(self.block_size)) as usize;
            if last + 1 < limit
                && last >= n
                && gb.blocks.get(last).is_some_and(|&b| b != NULL_BLOCK)
            {
                count += 1;
            }
        }
        count
    }

    /// Replaces blocks outside the attention window with the null block, freeing
    /// the deeper ones first.
    pub(crate) fn remove_skipped_blocks(
        &self,
        pool: &mut BlockPool,
        gb: &mut GroupBlocks,
        total_computed: u64,
    ) {
        let skipped = self.num_skipped_tokens(total_computed);
        if skipped > 0 {
            let n = ((skipped / u64::from(self.block_size)) as usize).min(gb.blocks.len());
            let mut freed = Vec::new();
            if self.mamba_align().is_some() {
                // Prefill leaves null gaps between states awaiting retirement.
                let first = gb.mamba_retired;
                if first < n {
                    for i in (first..n).rev() {
                        if gb.blocks[i] != NULL_BLOCK {
                            freed.push(gb.blocks[i]);
                            gb.blocks[i] = NULL_BLOCK;
                        }
                    }
                    gb.mamba_retired = n;
                }
            } else {
                for i in (0..n).rev() {
                    if gb.blocks[i] == NULL_BLOCK {
                        break;
                    }
                    freed.push(gb.blocks[i]);
                    gb.blocks[i] = NULL_BLOCK;
                }
            }
            pool.free_blocks(freed);
        }
        if self.mamba_align().is_some() {
            // The state block of two steps ago is no longer needed.
            if let Some(last) = gb.mamba_last_state {
                let limit = total_computed.div_ceil(u64::from(self.block_size)) as usize;
                if last + 1 < limit && gb.blocks[last] != NULL_BLOCK {
                    let b = gb.blocks[last];
                    gb.blocks[last] = NULL_BLOCK;
                    pool.free_blocks([b]);
                }
            }
        }
    }

    /// Per-step reset (Mamba forgets which states were cached this step).
    pub(crate) fn new_step_starts(&mut self) {
        self.cached_this_step.clear();
    }
}

/// Contiguous blocks a sliding-window hit needs: `cdiv(window - 1, bs)`, plus one
/// with EAGLE (the last matched block is dropped).
fn contiguous_blocks_for_hit(window: u32, block_size: u32, use_eagle: bool) -> usize {
    ((window - 1).div_ceil(block_size) as usize) + usize::from(use_eagle)
}

#[cfg(test)]
mod tests {
    //! vLLM's `test_single_type_kv_cache_manager.py` tables.
    use super::*;

    fn manager(kind: AttentionKind, block_size: u32) -> GroupManager {
        let spec = GroupSpec::new(kind, block_size);
        GroupManager::new(
            spec,
            0,
            block_size,
            u64::from(block_size),
            1 << 20,
            1 << 20,
            2000,
        )
    }

    fn hash(i: usize) -> BlockHash {
        let mut b = [0u8; 32];
        b[..8].copy_from_slice(&(i as u64 + 1).to_le_bytes());
        BlockHash::from_slice(&b).unwrap_or_default()
    }

    /// Caches block `i + 10` under hash `i` for every `true` flag; returns hashes.
    fn cached_pool(flags: &[bool]) -> (BlockPool, Vec<BlockHash>) {
        let mut pool = BlockPool::new(2000, true, false);
        let hashes: Vec<BlockHash> = (0..flags.len()).map(hash).collect();
        for (i, &f) in flags.iter().enumerate() {
            if f {
                pool.cache_block(
                    i as u32 + 10,
                    CacheKey {
                        hash: hashes[i],
                        group: 0,
                    },
                );
            }
        }
        (pool, hashes)
    }

    fn lookup(m: &GroupManager, flags: &[bool], max_len: usize) -> Vec<BlockId> {
        let (pool, hashes) = cached_pool(flags);
        let q = Lookup {
            hashes: &hashes,
            max_len,
            drop_eagle_block: false,
            alignment: m.block_size() as usize,
        };
        let mut out = vec![Vec::new()];
        let hit = m.find_longest_cache_hit(&pool, &q, &[0], &mut out);
        assert_eq!(hit, out[0].len() * m.block_size() as usize);
        out.remove(0)
    }

    #[test]
    fn sliding_window_hit_needs_a_contiguous_run_ending_the_prefix() {
        let m = manager(AttentionKind::SlidingWindow { window: 4 }, 2);
        let (t, f) = (true, false);
        let cases: &[(&[bool], usize)] = &[
            (&[f; 10], 0),
            (&[t], 1),
            (&[t, f], 1),
            (&[t, t], 2),
            (&[t, t, f], 2),
            (&[t, t, t], 3),
            (&[t, t, t, f], 3),
            (&[t, t, f, t, f, f, t, t, f, t, t, t], 12),
            (&[t, t, f, t, f, f, t, t, f, f, f], 8),
            (&[t, t, f, t, f, f, t, t, f, f, f, t], 8),
        ];
        for &(flags, expect) in cases {
            let got = lookup(&m, flags, flags.len() * 2);
            assert_eq!(got.len(), expect, "{flags:?}");
            // All but the last `cdiv(window - 1, bs)` = 2 entries are null.
            for (i, &b) in got.iter().enumerate() {
                if i + 2 < expect {
                    assert_eq!(b, NULL_BLOCK, "{flags:?}");
                } else {
                    assert_eq!(b, i as u32 + 10, "{flags:?}");
                }
            }
        }
    }

    #[test]
    fn chunked_local_hit_starts_at_the_current_chunk() {
        let m = manager(AttentionKind::ChunkedLocal { chunk: 4 }, 2);
        let (t, f) = (true, false);
        let cases: &[(&[bool], usize, usize)] = &[
            (&[t], 0, 1),
            (&[t], 1, 1),
            (&[t, f], 0, 2),
            (&[t, f], 1, 2),
            (&[t, t], 0, 2),
            (&[t, t], 1, 2),
            (&[t, t, f], 0, 2),
            (&[t, t, f], 1, 2),
            (&[t, t, t], 0, 3),
            (&[t, t, t], 1, 3),
            (&[t, t, t, f], 0, 4),
            (&[t, t, t, f], 1, 4),
            (&[f, t, f, t, f, t, f, t, t], 1, 9),
            (&[t, f, t, f, t, f, t, f, f], 1, 8),
            (&[f, f, f, f, f, f, f, f, t, t], 0, 10),
        ];
        for &(flags, tail, expect) in cases {
            let got = lookup(&m, flags, flags.len() * 2 + tail);
            assert_eq!(got.len(), expect, "{flags:?} + {tail}");
            let start = (flags.len() * 2 + tail) / 4 * 4 / 2;
            assert!(got[..start.min(got.len())].iter().all(|&b| b == NULL_BLOCK));
        }
    }

    fn held_blocks(pool: &mut BlockPool, ids: std::ops::Range<u32>) -> GroupBlocks {
        let blocks: Vec<BlockId> = ids.collect();
        pool.touch(&blocks);
        GroupBlocks {
            blocks,
            ..GroupBlocks::default()
        }
    }

    #[test]
    fn sliding_window_remove_skipped_blocks_frees_deepest_first() {
        let m = manager(AttentionKind::SlidingWindow { window: 4 }, 2);
        let mut pool = BlockPool::new(2000, true, false);
        let mut gb = held_blocks(&mut pool, 1000..1011);
        let nulls = |gb: &GroupBlocks| gb.blocks.iter().take_while(|&&b| b == NULL_BLOCK).count();
        m.remove_skipped_blocks(&mut pool, &mut gb, 0);
        assert_eq!(nulls(&gb), 0);
        m.remove_skipped_blocks(&mut pool, &mut gb, 4);
        assert_eq!(nulls(&gb), 0);
        m.remove_skipped_blocks(&mut pool, &mut gb, 5);
        assert_eq!(nulls(&gb), 1);
        m.remove_skipped_blocks(&mut pool, &mut gb, 6);
        assert_eq!(nulls(&gb), 1);
        m.remove_skipped_blocks(&mut pool, &mut gb, 7);
        assert_eq!(nulls(&gb), 2);
        m.remove_skipped_blocks(&mut pool, &mut gb, 11);
        assert_eq!(nulls(&gb), 4);
        // 1003 then 1002 were freed by the last call: unhashed, so in front.
        assert_eq!(&pool.free_queue()[..4], &[1003, 1002, 1001, 1000]);
    }

    #[test]
    fn chunked_local_remove_skipped_blocks_nulls_whole_chunks() {
        let m = manager(AttentionKind::ChunkedLocal { chunk: 4 }, 2);
        let mut pool = BlockPool::new(2000, true, false);
        let mut gb = held_blocks(&mut pool, 1000..1011);
        let nulls = |gb: &GroupBlocks| gb.blocks.iter().take_while(|&&b| b == NULL_BLOCK).count();
        for (n, expect) in [(0, 0), (4, 2), (6, 2), (12, 6)] {
            m.remove_skipped_blocks(&mut pool, &mut gb, n);
            assert_eq!(nulls(&gb), expect, "n = {n}");
        }
    }

    #[test]
    fn blocks_to_allocate_count_evictable_hits_but_not_null_padding() {
        for kind in [
            AttentionKind::SlidingWindow { window: 4 },
            AttentionKind::ChunkedLocal { chunk: 4 },
        ] {
            let m = manager(kind, 2);
            let pool = BlockPool::new(100, true, false);
            let gb = GroupBlocks::default();
            let n = Need {
                num_tokens: 40,
                total_computed: 0,
                main_model: 40,
                cap: false,
            };
            let hits: Vec<BlockId> = (1..=10).collect();
            assert_eq!(m.num_blocks_to_allocate(&pool, &gb, &hits, &n), 20);
            let hits: Vec<BlockId> = [0, 0, 0, 0, 0, 1, 2, 3, 4, 5].to_vec();
            assert_eq!(m.num_blocks_to_allocate(&pool, &gb, &hits, &n), 15);
        }
    }

    #[test]
    fn sliding_window_admission_cap_bounds_full_sequence_need() {
        let spec = GroupSpec::new(AttentionKind::SlidingWindow { window: 128 }, 16);
        let m = GroupManager::new(spec, 0, 16, 16, 256, 1 << 20, 2000);
        let pool = BlockPool::new(100, true, false);
        let gb = GroupBlocks::default();
        let n = Need {
            num_tokens: 10_000,
            total_computed: 0,
            main_model: 10_000,
            cap: true,
        };
        // cdiv(min(128 - 1 + 256, max_model_len), 16) + 1
        assert_eq!(m.num_blocks_to_allocate(&pool, &gb, &[], &n), 24 + 1);
    }

    #[test]
    fn mamba_keeps_only_the_rightmost_aligned_state() {
        let m = manager(
            AttentionKind::Mamba {
                mode: MambaCacheMode::Align,
                num_speculative_blocks: 0,
            },
            2,
        );
        let got = lookup(&m, &[true, false, true, false], 8);
        assert_eq!(got, vec![NULL_BLOCK, NULL_BLOCK, 12]);
        assert!(lookup(&m, &[false, false], 4).is_empty());
    }

    #[test]
    fn sliding_window_retention_keeps_only_reachable_tails() {
        // Pure SWA, bs 16, window 16, 256 tokens (vLLM's test_pure_swa_retention).
        let mut m = manager(AttentionKind::SlidingWindow { window: 16 }, 16);
        let masked = |m: &GroupManager, interval: Option<u64>| -> Vec<usize> {
            match m.reachable_block_mask(0, 16, interval, &[255]) {
                None => (0..16).collect(),
                Some(mask) => (0..16).filter(|&i| mask[i]).collect(),
            }
        };
        assert_eq!(masked(&m, Some(64)), vec![3, 7, 11, 14, 15]);
        assert_eq!(masked(&m, Some(0)), vec![14]);
        assert_eq!(masked(&m, None), (0..16).collect::<Vec<_>>());
        m.alignment = 16;
        assert_eq!(masked(&m, Some(16)).len(), 16);
    }
}
