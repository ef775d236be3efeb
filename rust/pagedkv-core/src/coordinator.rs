//! The coordinator (vLLM's `KVCacheCoordinator`): owns the block pool and one
//! single-type manager per KV-cache group, and reconciles the groups — the
//! prefix-hit search (one group, or vLLM's fixed point across several), the
//! blocks a step needs, allocation of hit and fresh blocks, caching with its
//! `BlockStored` events, freeing and skipped-block removal.
//!
//! It works on request state handed to it by the manager and never sees request
//! ids or handles.

use crate::error::{Error, Result};
use crate::events::{BlockStored, KvEvent};
use crate::hash::BlockHash;
use crate::pool::{BlockId, BlockPool, CacheKey, NULL_BLOCK};
use crate::request::Request;
use crate::single_type::{GroupManager, GroupParams, Lookup, Need, Retention};
use crate::spec::{AttentionKind, ManagerConfig};
use crate::verify::Verifier;

/// Groups with equal specs, looked up together (vLLM's `SpecGroup`).
#[derive(Clone, Debug)]
struct AttnGroup {
    group_ids: Vec<u32>,
    is_full: bool,
    is_mamba: bool,
    use_eagle: bool,
}

/// How prefix hits are reconciled across groups.
#[derive(Clone, Debug)]
enum Mode {
    /// Caching off: no lookups.
    NoPrefixCache,
    /// One group.
    Unitary,
    /// Several groups: a fixed-point search, full attention first.
    Hybrid { attn: Vec<AttnGroup>, simple: bool },
}

/// A prefix-cache hit before it is handed out.
pub(crate) struct Hit {
    /// Hit blocks per group (null blocks pad skipped positions).
    pub block_ids: Vec<Vec<BlockId>>,
    /// Tokens covered, reconciled across groups.
    pub len: usize,
    /// How much longer the longest single-group hit was (an uncached shared
    /// prefix).
    pub uncached: usize,
}

/// The pool, the group managers and the reconciliation mode.
#[derive(Debug)]
pub(crate) struct Coordinator {
    pool: BlockPool,
    groups: Vec<GroupManager>,
    mode: Mode,
    hash_block_size: usize,
    scheduler_block_size: u64,
    use_eagle: bool,
    retention_interval: Option<u64>,
    /// Fine-grained (partial) prefix hits are on: hits align to the hash block.
    partial_hits: bool,
    /// Tokens every hit is aligned to: the hash block with partial hits, the
    /// scheduler block otherwise (vLLM's `_cache_hit_alignment_tokens`).
    alignment: u64,
    /// Tokens at the end of the computed prefix never cached (multi-module MTP).
    reprefillable: u64,
    /// Mamba groups register shared-prefix junction states.
    shared_prefix_checkpoint: bool,
    /// Tokens past each block that the engine's block hashes cover (events
    /// publish them per stored block).
    lookahead: usize,
    /// Some group frees blocks outside its attention window (sliding window,
    /// chunked local, Mamba).
    any_skipping: bool,
    /// Every group is full attention (or MLA, sinks) and the groups are not
    /// searched as a hybrid: a running request's decode step that needs no
    /// block and fills none changes nothing but its counts.
    plain_decode: bool,
    /// A plain decode whose groups are all full attention or MLA (no sinks,
    /// none engine-managed): a running request's step takes exactly the
    /// blocks its slots span beyond those it holds
    /// ([`Self::lean_step_need`]).
    lean_steps: bool,
    verifier: Verifier,
    /// The blocks the last allocation took, per group.
    new_blocks: Vec<Vec<BlockId>>,
}

impl Coordinator {
    /// Builds the pool and the group managers of a validated configuration whose
    /// hash block size is `hbs`.
    pub(crate) fn new(cfg: &ManagerConfig, hbs: u32) -> Result<Self> {
        let pool = BlockPool::try_new(
            cfg.num_blocks,
            cfg.enable_caching,
            cfg.enable_kv_cache_events,
        )?
        .with_metrics(cfg.kv_cache_metrics)
        .with_pending_caps(
            cfg.max_pending_events
                .unwrap_or(crate::spec::PENDING_EVENTS_DEFAULT),
            cfg.max_pending_block_activity
                .unwrap_or(crate::spec::PENDING_ACTIVITY_DEFAULT),
        );
        let sbs = cfg.scheduler_block_size();
        let single = cfg.groups.len() == 1;
        let partial_hits = cfg.partial_hash_hits_enabled(hbs);
        let alignment = if partial_hits { u64::from(hbs) } else { sbs };
        let shared_prefix_checkpoint = cfg.mamba_shared_prefix_checkpoint
            && cfg.has_eagle_groups()
            && partial_hits
            && cfg.num_reprefillable_tokens() == 0;
        // EAGLE's drop applies to every group of a spec group (groups with equal
        // specs) that holds an EAGLE group, as vLLM's spec groups share it.
        let eagle: Vec<bool> = cfg
            .groups
            .iter()
            .map(|g| {
                cfg.groups
                    .iter()
                    .enumerate()
                    .any(|(j, other)| other == g && cfg.is_eagle_group(j))
            })
            .collect();
        let hisparse_has_resident = cfg
            .groups
            .iter()
            .any(|g| g.kind == AttentionKind::HiSparseResident);
        let groups: Vec<GroupManager> = cfg
            .groups
            .iter()
            .enumerate()
            .map(|(i, g)| {
                // EAGLE applies to the groups whose hits are searched.
                let searched = single || g.kind.prefix_cacheable();
                let p = GroupParams {
                    hash_block_size: hbs,
                    alignment,
                    max_in_flight_tokens: cfg.max_in_flight_tokens.unwrap_or(cfg.max_model_len),
                    max_model_len: cfg.max_model_len,
                    num_gpu_blocks: cfg.num_blocks,
                    use_eagle: cfg.enable_caching && eagle[i] && searched,
                    lookahead: cfg.num_hash_lookahead_tokens,
                    model_eagle: cfg.use_eagle,
                    shared_prefix_checkpoint,
                    zero_new_blocks: cfg.zero_new_blocks,
                    hisparse_has_resident,
                };
                GroupManager::new(g.clone(), i as u32, &p)
            })
            .collect();
        let mode = if !cfg.enable_caching {
            Mode::NoPrefixCache
        } else if single {
            Mode::Unitary
        } else {
            let mut attn: Vec<AttnGroup> = Vec::new();
            for (i, g) in cfg.groups.iter().enumerate() {
                if !groups[i].prefix_cacheable() {
                    continue;
                }
                match attn
                    .iter_mut()
                    .find(|a| cfg.groups[a.group_ids[0] as usize] == *g)
                {
                    Some(a) => a.group_ids.push(i as u32),
                    None => attn.push(AttnGroup {
                        group_ids: vec![i as u32],
                        is_full: g.kind.is_full_attention(),
                        is_mamba: matches!(g.kind, AttentionKind::Mamba { .. }),
                        use_eagle: eagle[i],
                    }),
                }
            }
            if attn.is_empty() {
                return Err(Error::InvalidConfig(
                    "prefix caching needs at least one cacheable KV-cache group".into(),
                ));
            }
            // Full attention first: the cheapest scan gives the tightest bound.
            attn.sort_by_key(|a| !a.is_full);
            let simple = attn.len() == 2 && attn[0].is_full;
            Mode::Hybrid { attn, simple }
        };
        let plain_decode = !matches!(mode, Mode::Hybrid { .. })
            && cfg.groups.iter().all(|g| g.kind.is_full_attention());
        let lean_steps = plain_decode
            && cfg.groups.iter().all(|g| {
                matches!(
                    g.kind,
                    AttentionKind::FullAttention | AttentionKind::MlaAttention
                )
            });
        Ok(Self {
            pool,
            plain_decode,
            lean_steps,
            new_blocks: vec![Vec::new(); groups.len()],
            groups,
            mode,
            hash_block_size: hbs as usize,
            scheduler_block_size: sbs,
            use_eagle: cfg.use_eagle,
            retention_interval: cfg.prefix_cache_retention_interval,
            partial_hits,
            alignment,
            reprefillable: cfg.num_reprefillable_tokens(),
            shared_prefix_checkpoint,
            lookahead: cfg.num_hash_lookahead_tokens as usize,
            any_skipping: cfg.groups.iter().any(|g| {
                !g.kind.is_full_attention()
                    && !matches!(
                        g.kind,
                        AttentionKind::CrossAttention
                            | AttentionKind::CircularBuffer
                            | AttentionKind::EngineManaged
                            | AttentionKind::HiSparseResident
                            | AttentionKind::HiSparseHot { .. }
                    )
            }),
            verifier: Verifier::new(cfg.verify_cached_tokens, cfg.num_blocks)?,
        })
    }

    // ---- accessors --------------------------------------------------------

    /// Several groups: the groups looked up together (equal specs), in lookup
    /// order (full attention first), each with whether EAGLE's drop applies.
    pub(crate) fn lookup_groups(&self) -> Option<Vec<(Vec<u32>, bool)>> {
        match &self.mode {
            Mode::Hybrid { attn, .. } => Some(
                attn.iter()
                    .map(|a| (a.group_ids.clone(), a.use_eagle))
                    .collect(),
            ),
            Mode::NoPrefixCache | Mode::Unitary => None,
        }
    }

    /// The block pool.
    pub(crate) fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The block pool, mutably (cache maintenance: eviction, reset).
    pub(crate) fn pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
    }

    /// The group managers, by group id.
    pub(crate) fn groups(&self) -> &[GroupManager] {
        &self.groups
    }

    /// The blocks the last successful allocation took, per group.
    pub(crate) fn new_blocks(&self) -> &[Vec<BlockId>] {
        &self.new_blocks
    }

    /// Whether some group releases blocks that fall out of its window.
    pub(crate) fn any_skipping(&self) -> bool {
        self.any_skipping
    }

    /// The common decode step of a running request (one that holds blocks),
    /// decided without the general path: no group needs a block for
    /// `num_tokens` slots and none has a block to publish up to `to_cache`
    /// tokens (with caching; as far as the request is hashed). Then
    /// the step's new blocks are none and `true` is returned; `false` leaves
    /// the step to the general path, with nothing changed.
    pub(crate) fn decode_step_needs_nothing(
        &mut self,
        req: &Request,
        num_tokens: u64,
        to_cache: usize,
        caching: bool,
    ) -> bool {
        if !self.holds_step(req, num_tokens, None)
            || (caching && !self.fills_no_block(req, to_cache))
        {
            return false;
        }
        for out in &mut self.new_blocks {
            out.clear();
        }
        true
    }

    /// Whether a running request's step of `num_tokens` slots (at least one)
    /// takes no block: every group of a plain decode holds the blocks for them,
    /// without a pending copy-on-write (so the request holds blocks: it runs).
    /// With `cached_to`, every group has also cached each block full at that
    /// many tokens. Reads no hashes: the batch decides its steps with it
    /// before anything is appended (conservatively: a block full but not yet
    /// hashed counts as one to publish).
    #[allow(clippy::inline_always)] // see `KvCacheManager::batch_path`
    #[inline(always)]
    pub(crate) fn holds_step(
        &self,
        req: &Request,
        num_tokens: u64,
        cached_to: Option<u64>,
    ) -> bool {
        let (slots, cached) = req.step_limits();
        if slots != 0 {
            debug_assert_eq!((slots, cached), self.step_limits(req), "stale step limits");
            return num_tokens > 0 && num_tokens <= slots && cached_to.is_none_or(|t| t < cached);
        }
        self.plain_decode
            && num_tokens > 0
            && self.groups.iter().zip(req.groups()).all(|(gm, gb)| {
                gb.partial_hit().is_none()
                    && gm.blocks_ceil(num_tokens) <= gb.blocks().len() as u64
                    && cached_to
                        .is_none_or(|t| gm.blocks_floor(t) <= gb.num_cached().unwrap_or(0) as u64)
            })
    }

    /// What [`Self::holds_step`] decides from, for the request's groups as they
    /// are now: `(slots, cached)`, a step of at most `slots` slots and fewer
    /// than `cached` tokens to cache takes no block and publishes none in any
    /// group; `(0, 0)` when no step is that plain (not a plain decode, a
    /// pending copy-on-write, no blocks). Kept on the request
    /// ([`Request::set_step_limits`]) so a decode step reads none of its
    /// groups' state.
    pub(crate) fn step_limits(&self, req: &Request) -> (u64, u64) {
        if !self.plain_decode || self.groups.is_empty() {
            return (0, 0);
        }
        let mut lim = (u64::MAX, u64::MAX);
        for (gm, gb) in self.groups.iter().zip(req.groups()) {
            if gb.partial_hit().is_some() {
                return (0, 0);
            }
            let bs = u64::from(gm.block_size());
            lim.0 = lim.0.min(gb.blocks().len() as u64 * bs);
            lim.1 = lim.1.min((gb.num_cached().unwrap_or(0) as u64 + 1) * bs);
        }
        if lim.0 == 0 { (0, 0) } else { lim }
    }

    /// The blocks a running request's step of `num_tokens` slots takes across
    /// the groups (what [`Self::num_blocks_to_allocate`] counts for it), for a
    /// request whose step is lean: the layout allows it ([`Self::lean_steps`]),
    /// the request runs in every group and has no pending copy-on-write (its
    /// step limits are known). `None`: the general path decides.
    pub(crate) fn lean_step_need(&self, req: &Request, num_tokens: u64) -> Option<i64> {
        if !self.lean_steps || req.step_limits().0 == 0 {
            return None;
        }
        let mut need = 0;
        for (gm, gb) in self.groups.iter().zip(req.groups()) {
            gb.num_cached()?;
            need += gm
                .blocks_ceil(num_tokens)
                .saturating_sub(gb.blocks().len() as u64) as i64;
        }
        Some(need)
    }

    /// No group has a full block to publish up to `num_tokens` tokens (as far
    /// as the request is hashed) beyond what it has cached.
    fn fills_no_block(&self, req: &Request, num_tokens: usize) -> bool {
        let (slots, cached) = req.step_limits();
        if slots != 0 && (num_tokens as u64) < cached {
            return true;
        }
        let hashed = req.hashes().len() * self.hash_block_size;
        self.groups.iter().zip(req.groups()).all(|(gm, gb)| {
            gm.blocks_floor(num_tokens.min(hashed) as u64) as usize <= gb.num_cached().unwrap_or(0)
        })
    }

    /// Prefix hits cut short by hit verification.
    pub(crate) fn verification_failures(&self) -> u64 {
        self.verifier.failures()
    }

    // ---- lookup -----------------------------------------------------------

    /// The request's longest cached prefix of at most `max_len` tokens; with
    /// verification, cut at the first block that does not match the request.
    pub(crate) fn find_longest_cache_hit(&mut self, req: &Request, max_len: usize) -> Hit {
        let mut hit = self.search(req.hashes(), max_len);
        if req.verify {
            // A block that does not match the request ends the hit at its start;
            // search again below it (each round lowers the limit).
            let hbs = self.hash_block_size;
            while let Some(p) = self.verifier.first_unverified(
                &self.pool,
                req,
                &hit.block_ids,
                |g| self.groups[g].block_size() as usize,
                hit.len,
                hbs,
            ) {
                self.verifier.count_failure();
                hit = self.search(req.hashes(), p);
            }
        }
        hit
    }

    fn search(&self, hashes: &[BlockHash], max_len: usize) -> Hit {
        let mut out = vec![Vec::new(); self.groups.len()];
        match &self.mode {
            Mode::NoPrefixCache => Hit {
                block_ids: out,
                len: 0,
                uncached: 0,
            },
            Mode::Unitary => {
                let gm = &self.groups[0];
                let q = Lookup {
                    hashes,
                    max_len,
                    drop_eagle_block: gm.use_eagle(),
                    alignment: gm.block_size() as usize,
                };
                let len = gm.find_longest_cache_hit(&self.pool, &q, &[0], &mut out);
                Hit {
                    block_ids: out,
                    len,
                    uncached: 0,
                }
            }
            Mode::Hybrid { attn, simple } => self.find_hybrid(attn, *simple, hashes, max_len, out),
        }
    }

    /// EAGLE: how far past a candidate length a group matches before dropping
    /// the last unit (a hash block for fine-grained lookups, else a block).
    fn eagle_margin(&self, gm: &GroupManager) -> usize {
        let bs = gm.block_size() as usize;
        let hbs = self.hash_block_size;
        if self.partial_hits && gm.spec().kind.supports_fine_grained_lookup() && bs > hbs {
            hbs
        } else {
            bs
        }
    }

    /// vLLM's `find_longest_cache_hit_per_group`: each lookup group searched on
    /// its own up to `max_len`, with no reconciliation; the blocks and the hit
    /// length of every group (0 for groups never looked up). `None` unless
    /// several groups are looked up (vLLM's hybrid coordinator).
    pub(crate) fn find_per_group(
        &self,
        hashes: &[BlockHash],
        max_len: usize,
    ) -> Option<(Vec<Vec<BlockId>>, Vec<usize>)> {
        let Mode::Hybrid { attn, .. } = &self.mode else {
            return None;
        };
        let mut out = vec![Vec::new(); self.groups.len()];
        let mut hits = vec![0usize; self.groups.len()];
        for ag in attn {
            let gm = &self.groups[ag.group_ids[0] as usize];
            let max_length = if ag.use_eagle && !ag.is_mamba {
                (max_len + self.eagle_margin(gm)).min(hashes.len() * self.hash_block_size)
            } else {
                max_len
            };
            let q = Lookup {
                hashes,
                max_len: max_length,
                drop_eagle_block: ag.use_eagle,
                alignment: self.alignment as usize,
            };
            let n = gm.find_longest_cache_hit(&self.pool, &q, &ag.group_ids, &mut out);
            for &g in &ag.group_ids {
                hits[g as usize] = n;
            }
        }
        Some((out, hits))
    }

    /// The first full-attention group looked up (vLLM's
    /// `full_attention_group_id`), with several groups looked up.
    pub(crate) fn full_attention_group(&self) -> Option<usize> {
        match &self.mode {
            Mode::Hybrid { attn, .. } => attn
                .first()
                .filter(|a| a.is_full)
                .map(|a| a.group_ids[0] as usize),
            _ => None,
        }
    }

    /// vLLM's fixed-point search: each attention group accepts the candidate
    /// length or lowers it; repeat until no group lowers it (one pass for a
    /// simple full-attention + one-other-type hybrid).
    fn find_hybrid(
        &self,
        attn: &[AttnGroup],
        simple: bool,
        hashes: &[BlockHash],
        max_len: usize,
        mut out: Vec<Vec<BlockId>>,
    ) -> Hit {
        let n = self.groups.len();
        let align = self.alignment as usize;
        let hbs = self.hash_block_size;
        let mut hit_length = max_len;
        let mut longest = 0usize;
        let mut searched = vec![false; n];
        let mut hit_by_group = vec![0usize; n];
        let mut eagle_verified = vec![false; attn.len()];
        loop {
            let mut curr = hit_length;
            for (idx, ag) in attn.iter().enumerate() {
                let first = ag.group_ids[0] as usize;
                if ag.is_full && searched[first] {
                    // Full attention is downward closed: just trim.
                    curr = curr.min(hit_by_group[first]);
                    continue;
                }
                let gm = &self.groups[first];
                let drop = ag.use_eagle && !eagle_verified[idx];
                let mut max_length = curr;
                if drop && !ag.is_mamba {
                    max_length = (curr + self.eagle_margin(gm)).min(hashes.len() * hbs);
                }
                let q = Lookup {
                    hashes,
                    max_len: max_length,
                    drop_eagle_block: drop,
                    alignment: align,
                };
                let new_hit = gm.find_longest_cache_hit(&self.pool, &q, &ag.group_ids, &mut out);
                if drop {
                    eagle_verified[idx] = true;
                } else if new_hit < curr {
                    eagle_verified.fill(false);
                }
                curr = new_hit;
                for &g in &ag.group_ids {
                    searched[g as usize] = true;
                    hit_by_group[g as usize] = new_hit;
                }
                longest = longest.max(curr);
            }
            if curr >= hit_length {
                break;
            }
            hit_length = curr;
            if simple {
                break;
            }
        }
        for ag in attn.iter().filter(|a| a.is_full) {
            for &g in &ag.group_ids {
                let bs = self.groups[g as usize].block_size() as usize;
                out[g as usize].truncate(hit_length.div_ceil(bs));
            }
        }
        Hit {
            block_ids: out,
            len: hit_length,
            uncached: longest.saturating_sub(hit_length),
        }
    }

    /// The first hit block no longer cached under the request's own hash at its
    /// position (it was evicted or reused since the lookup), if any.
    pub(crate) fn first_stale_hit_block(
        &self,
        req: &Request,
        hit: &[Vec<BlockId>],
    ) -> Option<BlockId> {
        for (g, ids) in hit.iter().enumerate() {
            let gm = &self.groups[g];
            for (i, &b) in ids.iter().enumerate() {
                if b == NULL_BLOCK {
                    continue;
                }
                let expect = gm.key_for(req.hashes(), i);
                if expect.is_none() || self.pool.block_key(b) != expect {
                    return Some(b);
                }
            }
        }
        None
    }

    // ---- allocation -------------------------------------------------------

    /// vLLM's `get_num_blocks_to_allocate`; the flag says a Mamba hit was cached
    /// this very step (a transient refusal, not a capacity problem).
    pub(crate) fn num_blocks_to_allocate(
        &self,
        req: &Request,
        n: &Need,
        hit: &[Vec<BlockId>],
        num_encoder_tokens: u64,
    ) -> (i64, bool) {
        let n = &self.checkpoint_need(n);
        let mut total = 0i64;
        let mut blocked = false;
        for (g, gm) in self.groups.iter().enumerate() {
            let blocks = hit.get(g).map_or(&[][..], Vec::as_slice);
            let need = if gm.is_cross_attention() {
                let enc = Need {
                    num_tokens: num_encoder_tokens,
                    total_computed: 0,
                    num_local: 0,
                    main_model: num_encoder_tokens,
                    prefill_end: 0,
                    cap: n.cap,
                };
                gm.num_blocks_to_allocate(&self.pool, &req.groups()[g], &[], &enc)
            } else {
                gm.num_blocks_to_allocate(&self.pool, &req.groups()[g], blocks, n)
            };
            blocked |= gm.hit_cached_this_step(&self.pool, blocks);
            total += need;
        }
        (total, blocked)
    }

    /// For the can-it-ever-fit check: the blocks the request keeps holding once
    /// skipped blocks are released, and the hit blocks other requests hold (not
    /// counted in the need, but this request's too once admitted).
    pub(crate) fn held_and_shared_hits(
        &self,
        req: &Request,
        hit: &[Vec<BlockId>],
        total_computed: u64,
    ) -> (i64, i64) {
        let mut held = 0i64;
        let mut shared_hits = 0i64;
        for (g, gm) in self.groups.iter().enumerate() {
            let gb = &req.groups()[g];
            let real = gb.blocks().iter().filter(|&&b| b != NULL_BLOCK).count();
            held += (real - gm.num_skippable_blocks(gb, total_computed).min(real)) as i64;
            if let Some(h) = hit.get(g) {
                let skip =
                    (gm.num_skipped_tokens(total_computed) / u64::from(gm.block_size())) as usize;
                shared_hits += h
                    .iter()
                    .skip(skip)
                    .filter(|&&b| b != NULL_BLOCK && !self.pool.is_evictable(b))
                    .count() as i64;
            }
        }
        (held, shared_hits)
    }

    /// Releases the request's blocks that fell out of every attention window.
    pub(crate) fn remove_skipped_blocks(&mut self, req: &mut Request, total_computed: u64) {
        for (g, gm) in self.groups.iter().enumerate() {
            gm.remove_skipped_blocks(&mut self.pool, &mut req.groups_mut()[g], total_computed);
        }
    }

    /// Adopts a prefix hit at admission, in two phases: every group's hit blocks
    /// are touched before any group takes blocks for externally computed tokens.
    pub(crate) fn add_computed_blocks(
        &mut self,
        req: &mut Request,
        hit: &[Vec<BlockId>],
        num_local: u64,
        num_external: u64,
        skip_zeroing_groups: u64,
    ) {
        for (g, gm) in self.groups.iter().enumerate() {
            let blocks = hit.get(g).map_or(&[][..], Vec::as_slice);
            gm.add_local_computed_blocks(
                &mut self.pool,
                &mut req.groups_mut()[g],
                blocks,
                num_local,
                num_external,
            );
        }
        if num_external > 0 {
            for (g, gm) in self.groups.iter_mut().enumerate() {
                gm.allocate_external_computed_blocks(
                    &mut self.pool,
                    &mut req.groups_mut()[g],
                    num_local,
                    num_external,
                    skip_zeroing_groups & (1u64 << g.min(63)) == 0,
                );
            }
        }
    }

    /// Fresh blocks up to `num_tokens` (`main_model` without lookahead); cross
    /// attention gets one allocation for the `num_encoder_tokens` of the encoder
    /// output. The new ids are in [`Self::new_blocks`]. Only the groups in
    /// `groups` allocate; every group's list of new blocks is cleared first.
    pub(crate) fn allocate_new_blocks_in(
        &mut self,
        req: &mut Request,
        num_tokens: u64,
        main_model: u64,
        num_encoder_tokens: u64,
        groups: std::ops::Range<usize>,
    ) {
        for (g, gm) in self.groups.iter_mut().enumerate() {
            let out = &mut self.new_blocks[g];
            out.clear();
            if !groups.contains(&g) {
                continue;
            }
            let (n, main) = if gm.is_cross_attention() {
                (num_encoder_tokens, num_encoder_tokens)
            } else {
                (num_tokens, main_model)
            };
            let (id, groups) = req.id_and_groups_mut();
            gm.allocate_new_blocks(&mut self.pool, id, &mut groups[g], n, main, out);
        }
    }

    /// One HiSparse group's `allocate_new_blocks`, outside a whole
    /// allocation: `None` (nothing taken) when fewer blocks are free than it
    /// needs.
    pub(crate) fn hisparse_allocate(
        &mut self,
        req: &mut Request,
        g: usize,
        num_tokens: u64,
    ) -> Option<Vec<BlockId>> {
        let gm = &self.groups[g];
        let gb = &mut req.groups_mut()[g];
        if gm.hisparse_new_blocks(gb, num_tokens) > u64::from(self.pool.num_free_blocks()) {
            return None;
        }
        let mut out = Vec::new();
        gm.hisparse_allocate(&mut self.pool, gb, num_tokens, &mut out);
        Some(out)
    }

    /// Drains the blocks the worker must zero: group `g`'s, or every group's
    /// in group order.
    pub(crate) fn take_new_block_ids(&mut self, group: Option<usize>) -> Vec<BlockId> {
        let mut out = Vec::new();
        for (g, gm) in self.groups.iter_mut().enumerate() {
            if group.is_none_or(|only| only == g) {
                gm.take_new_block_ids(&mut out);
            }
        }
        out
    }

    /// Records the request's blocks from `start_token` on for zeroing again, in
    /// every group that zeroes; `start_token` must be a multiple of each such
    /// group's block size (checked by the caller).
    pub(crate) fn record_blocks_for_zeroing(&mut self, req: &Request, start_token: u64) {
        for (g, gm) in self.groups.iter_mut().enumerate() {
            let start = (start_token / u64::from(gm.block_size())) as usize;
            gm.record_blocks_for_zeroing(&req.groups()[g], start);
        }
    }

    /// Releases every block of the request, tail first.
    pub(crate) fn free(&mut self, req: &mut Request) {
        self.free_groups(req, self.groups.len());
    }

    /// Frees the request's blocks in the groups before `until` (all of them
    /// with `until` = the group count), in group order, each group's blocks
    /// tail first. A HiSparse resident row returns its engine-held references
    /// (those the engine still holds: a page it unpinned is skipped).
    pub(crate) fn free_groups(&mut self, req: &mut Request, until: usize) {
        let (id, groups) = req.id_and_groups_mut();
        for (gm, gb) in self.groups.iter_mut().zip(groups).take(until) {
            gm.drop_boundary_offloads(id);
            if gm.is_hisparse_resident() {
                let mut row = GroupManager::resident_release(gb);
                row.reverse();
                row.retain(|&b| self.pool.engine_release_one(b));
                self.pool.free_blocks(row);
            } else {
                GroupManager::free(&mut self.pool, gb);
            }
        }
    }

    /// Detaches every block of the request without freeing any: group by
    /// group, allocation order, leading null blocks dropped. The engine holds
    /// one reference per block listed.
    pub(crate) fn pop_blocks(&mut self, req: &mut Request) -> Vec<BlockId> {
        self.pop_groups(req, self.groups.len())
    }

    /// [`Self::pop_blocks`] of the groups before `until`.
    pub(crate) fn pop_groups(&mut self, req: &mut Request, until: usize) -> Vec<BlockId> {
        let mut out = Vec::new();
        let (id, groups) = req.id_and_groups_mut();
        for (gm, gb) in self.groups.iter_mut().zip(groups).take(until) {
            gm.drop_boundary_offloads(id);
            if gm.is_hisparse_resident() {
                // Already engine-held.
                out.extend(GroupManager::resident_release(gb));
            } else {
                let start = out.len();
                GroupManager::pop_blocks(gb, &mut out);
                for &b in &out[start..] {
                    self.pool.engine_hold(b);
                }
            }
        }
        out
    }

    /// Drains every group's boundary-state offers, `(request id, group, block,
    /// tokens)`.
    pub(crate) fn take_boundary_offloads(&mut self) -> Vec<(String, u32, BlockId, u64)> {
        let mut out = Vec::new();
        for gm in &mut self.groups {
            gm.take_boundary_offloads(&mut out);
        }
        out
    }

    /// The producer partial tails a finishing request leaves as valid sources,
    /// `(group, block, tokens)`.
    pub(crate) fn finalize_partial_tails(
        &self,
        req: &mut Request,
        num_computed: u64,
        num_in_flight: u64,
    ) -> Vec<(u32, BlockId, u64)> {
        let mut out = Vec::new();
        for (g, gm) in self.groups.iter().enumerate() {
            if let Some((b, t)) =
                gm.finalize_partial_tail(&mut req.groups_mut()[g], num_computed, num_in_flight)
            {
                out.push((g as u32, b, t));
            }
        }
        out
    }

    // ---- caching ----------------------------------------------------------

    /// Publishes the request's full blocks covering `num_tokens` into the prefix
    /// cache, with their `BlockStored` events and provenance records.
    pub(crate) fn cache_blocks(&mut self, req: &mut Request, num_tokens: usize, num_computed: u64) {
        let hbs = self.hash_block_size;
        let hybrid = matches!(self.mode, Mode::Hybrid { .. });
        let cacheable = Cacheable {
            hybrid,
            partial_hits: self.partial_hits,
            sbs: self.scheduler_block_size as usize,
            reprefillable: self.reprefillable as usize,
        };
        // Most decode steps fill no block: nothing new to publish in any group.
        if !hybrid && self.fills_no_block(req, num_tokens) {
            return;
        }
        let (boundaries, nb) = replay_boundaries(
            req.num_prompt_tokens as u64,
            self.scheduler_block_size,
            self.use_eagle,
        );
        let retention = Retention {
            interval: self.retention_interval,
            boundaries: &boundaries[..nb],
        };
        for (g, gm) in self.groups.iter_mut().enumerate() {
            let cached_before = req.groups()[g].num_cached().unwrap_or(0);
            let n = cacheable.tokens(gm, num_tokens);
            let published = gm.cache_blocks(&mut self.pool, req, g, n, hbs, &retention);
            if let Some((from, to, mask)) = &published
                && self.pool.events_enabled()
            {
                let blocks = req.groups()[g].blocks();
                let ev = stored_event(
                    gm,
                    req,
                    g,
                    blocks,
                    (*from, *to),
                    mask.as_deref(),
                    self.lookahead,
                );
                self.pool.push_event(KvEvent::BlockStored(ev));
            }
            // Partial prompt-tail entries exist where vLLM allows a hash block
            // below the group block size: hybrid models. (A single group with a
            // finer hash is pagedkv's extension; it caches whole blocks only.)
            let partial = if !hybrid {
                None
            } else if gm.spec().kind.is_full_attention() {
                gm.cache_partial_tail(&mut self.pool, req, g, n, hbs)
            } else {
                gm.cache_mamba_partial_tail(
                    &mut self.pool,
                    req,
                    g,
                    n as u64,
                    self.retention_interval,
                    num_computed,
                )
                .map(|b| b as usize)
            };
            if let Some(boundary) = partial
                && self.pool.events_enabled()
            {
                let ev = partial_stored_event(req, g, boundary, hbs, self.lookahead);
                self.pool.push_event(KvEvent::BlockStored(ev));
            }
            if let Some((from, to, _)) = published {
                gm.offer_boundary_states(&self.pool, req, g, from..to);
            }
            if req.verify {
                let bs = gm.block_size() as usize;
                let cached_after = req.groups()[g].num_cached().unwrap_or(0);
                // The block before may have been cached partially (a prompt
                // tail); the one after may carry a partial entry now.
                let from = cached_before.saturating_sub(1);
                let to = (cached_after + 1).min(req.groups()[g].blocks().len());
                for i in from..to {
                    self.verifier.record(&self.pool, req, g, i, bs, hbs);
                }
            }
        }
    }

    /// Caches blocks `[from, to)` of `blocks` (those `mask` keeps), the
    /// request's blocks in group `g` held outside it (an engine filled them),
    /// under the request's hashes, as vLLM's `BlockPool.cache_full_blocks`:
    /// one `BlockStored` for the run. The caller checked the range, the mask,
    /// the hashes and the blocks.
    pub(crate) fn cache_blocks_held_outside(
        &mut self,
        req: &Request,
        g: usize,
        blocks: &[BlockId],
        (from, to): (usize, usize),
        mask: Option<&[bool]>,
    ) {
        let gm = &self.groups[g];
        let bs = gm.block_size() as usize;
        for (i, &b) in blocks.iter().enumerate().take(to).skip(from) {
            if mask.is_some_and(|m| !m[i - from]) {
                continue;
            }
            if let Some(key) = gm.key_for(req.hashes(), i) {
                self.pool.cache_full_block(b, key, ((i + 1) * bs) as u32);
            }
        }
        if self.pool.events_enabled() {
            let ev = stored_event(gm, req, g, blocks, (from, to), mask, self.lookahead);
            self.pool.push_event(KvEvent::BlockStored(ev));
        }
    }

    /// Makes `block`, held outside the request (an engine filled it), reachable
    /// from the prefix boundary of `boundary` tokens of the request in group
    /// `g` (a partial entry, vLLM's `BlockPool.cache_partial_block`); with
    /// `replace`, the block's entries are dropped first. A new entry gets its
    /// `BlockStored`. The caller checked the boundary and the block.
    pub(crate) fn cache_partial_held_outside(
        &mut self,
        req: &Request,
        g: usize,
        block: BlockId,
        boundary: usize,
        replace: bool,
    ) -> CacheKey {
        let hbs = self.hash_block_size;
        let key = CacheKey {
            hash: req.hashes()[boundary / hbs - 1],
            group: self.groups[g].group_id(),
        };
        if replace {
            self.pool.maybe_evict(block);
        }
        if self.pool.cache_partial_block(block, key, boundary as u32) && self.pool.events_enabled()
        {
            let ev = partial_stored_event(req, g, boundary, hbs, self.lookahead);
            self.pool.push_event(KvEvent::BlockStored(ev));
        }
        key
    }

    /// Records each Mamba group's prefill checkpoint for this step (vLLM does so
    /// while counting the blocks the step needs).
    pub(crate) fn record_checkpoints(&self, req: &mut Request, n: &Need) {
        let n = &self.checkpoint_need(n);
        for (g, gm) in self.groups.iter().enumerate() {
            gm.record_checkpoint(&mut req.groups_mut()[g], n);
        }
    }

    /// Under dense or interval retention every prefill chunk publishes a state,
    /// so a Mamba checkpoint is reserved on every chunk (`prefill_end` 0); only
    /// with the replay boundary alone does it wait for the prefill's end.
    fn checkpoint_need(&self, n: &Need) -> Need {
        Need {
            prefill_end: if self.retention_interval == Some(0) {
                n.prefill_end
            } else {
                0
            },
            ..*n
        }
    }

    /// Drains every group's copy-on-write pairs `(source, copy)`; each endpoint
    /// holds one reference the caller now owns.
    pub(crate) fn take_pending_cow(&mut self) -> Vec<(BlockId, BlockId)> {
        let mut out = Vec::new();
        for gm in &mut self.groups {
            gm.take_pending_cow(&mut out);
        }
        out
    }

    /// Block references held for copies not yet handed out.
    pub(crate) fn pending_cow_refs(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.groups
            .iter()
            .flat_map(|gm| gm.pending_cow().iter().flat_map(|&(a, b)| [a, b]))
    }

    /// Whether fine-grained (partial) prefix hits are on.
    pub(crate) fn partial_hits(&self) -> bool {
        self.partial_hits
    }

    /// Whether Mamba groups register shared-prefix junction states.
    pub(crate) fn shared_prefix_checkpoint(&self) -> bool {
        self.shared_prefix_checkpoint
    }

    /// The sparse-retention interval of sliding-window and Mamba groups.
    pub(crate) fn retention_interval(&self) -> Option<u64> {
        self.retention_interval
    }

    /// Changes the sparse-retention interval (applies to later caching).
    pub(crate) fn set_retention_interval(&mut self, interval: Option<u64>) {
        self.retention_interval = interval;
    }

    /// Drains the pool's KV events, annotated with each group's spec kind.
    pub(crate) fn take_events(&mut self) -> Vec<KvEvent> {
        let mut evs = self.pool.take_events();
        for ev in &mut evs {
            if let KvEvent::BlockStored(s) = ev
                && let Some(gm) = self.groups.get(s.group_idx as usize)
            {
                s.kv_cache_spec_kind = Some(gm.spec().kind.spec_kind());
                s.kv_cache_spec_sliding_window = gm.spec().kind.sliding_window();
            }
        }
        evs
    }

    /// Per-step notification (Mamba "align" groups reset per-step state).
    pub(crate) fn new_step_starts(&mut self) {
        for gm in &mut self.groups {
            gm.new_step_starts();
        }
    }

    // ---- inspection -------------------------------------------------------

    /// Per group, the request's leading blocks held by all `num_running`
    /// requests that hold blocks (vLLM 0.32's meaning; full attention only).
    pub(crate) fn num_common_prefix_blocks(&self, req: &Request, num_running: usize) -> Vec<u32> {
        self.groups
            .iter()
            .enumerate()
            .map(|(g, gm)| {
                if !gm.spec().kind.is_full_attention() {
                    return 0;
                }
                req.groups()[g]
                    .blocks()
                    .iter()
                    .take_while(|&&b| self.pool.ref_cnt(b) as usize == num_running)
                    .count() as u32
            })
            .collect()
    }

    /// Checks one request's blocks (range, one group per block, cached blocks
    /// under the request's own hashes) and adds them to the per-block reference
    /// counts `refs` and owners `owner_group`.
    pub(crate) fn check_request(
        &self,
        req: &Request,
        refs: &mut [u32],
        owner_group: &mut [u32],
    ) -> Result<()> {
        let n = refs.len();
        let violation = |m: String| Err(Error::InvariantViolation(m));
        for (g, gb) in req.groups().iter().enumerate() {
            if self.groups[g].is_hisparse_resident() {
                // Its references are engine-held (counted with the engine's).
                continue;
            }
            for &b in gb.blocks() {
                let i = b as usize;
                if i >= n {
                    return violation(format!("request {:?} holds out-of-range block {b}", req.id));
                }
                if b == NULL_BLOCK {
                    continue;
                }
                refs[i] += 1;
                if owner_group[i] != u32::MAX && owner_group[i] != g as u32 {
                    return violation(format!(
                        "block {b} is held by groups {} and {g}",
                        owner_group[i]
                    ));
                }
                owner_group[i] = g as u32;
            }
            let Some(c) = gb.num_cached() else {
                continue;
            };
            if c > gb.blocks().len() {
                return violation(format!(
                    "request {:?} marks {c} cached blocks of {}",
                    req.id,
                    gb.blocks().len()
                ));
            }
            let gm = &self.groups[g];
            for (i, &b) in gb.blocks()[..c].iter().enumerate() {
                if b == NULL_BLOCK || !self.pool.enable_caching() {
                    continue;
                }
                // A full block carries its own key; a partial prompt-tail entry
                // (re-registered after an eviction) is the other case. A block
                // reached under another of its entries is shared, not corrupt:
                // without verification, a colliding (weak) hash can match a
                // prompt-tail entry made at another position.
                let full_tokens = ((i + 1) * gm.block_size() as usize) as u32;
                let partial = self.pool.primary_tokens(b).is_some_and(|t| t < full_tokens);
                if let Some(k) = self.pool.block_key(b).filter(|_| !partial) {
                    let own = gm.key_for(req.hashes(), i);
                    if Some(k) != own && !own.is_some_and(|o| self.pool.map_contains(&o, b)) {
                        return violation(format!(
                            "block {b} of request {:?} is cached under another hash",
                            req.id
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// vLLM's `get_num_cacheable_tokens`: the prefix of a step's tokens a group may
/// cache. Tokens that may be prefilled again never are; in a hybrid model
/// nothing past the last aligned boundary can ever be hit (EAGLE groups keep one
/// block past it; partial hits need no rounding).
struct Cacheable {
    hybrid: bool,
    partial_hits: bool,
    sbs: usize,
    reprefillable: usize,
}

impl Cacheable {
    fn tokens(&self, gm: &GroupManager, num_tokens: usize) -> usize {
        let finalized = num_tokens.saturating_sub(self.reprefillable);
        if !self.hybrid {
            return finalized;
        }
        let align = |n: usize| {
            if self.partial_hits {
                n
            } else {
                n / self.sbs * self.sbs
            }
        };
        let aligned = align(num_tokens);
        if gm.use_eagle() && aligned > 0 {
            finalized.min(align(finalized) + gm.block_size() as usize)
        } else {
            aligned
        }
    }
}

/// Tokens a later request replaying this prompt can resume at (vLLM's
/// `replay_boundaries`): the resend cap `P - 1`, or with EAGLE the aligned
/// positions one block below the resend and the extension. Returns the
/// positions and how many of the two slots are used.
fn replay_boundaries(num_prompt_tokens: u64, sbs: u64, use_eagle: bool) -> ([u64; 2], usize) {
    if !use_eagle {
        return ([num_prompt_tokens.saturating_sub(1), 0], 1);
    }
    let resend = num_prompt_tokens.saturating_sub(1) / sbs * sbs;
    let extension = num_prompt_tokens / sbs * sbs;
    let (a, b) = (resend.saturating_sub(sbs), extension.saturating_sub(sbs));
    if a == b {
        ([a, 0], 1)
    } else {
        ([a.min(b), a.max(b)], 2)
    }
}

/// The `lookahead` tokens after position `end` that a block's hash covers.
fn lookahead_tokens(req: &Request, end: usize, lookahead: usize) -> Vec<u32> {
    let n = req.tokens().len();
    req.tokens()[end.min(n)..(end + lookahead).min(n)].to_vec()
}

/// The `BlockStored` of a partial prompt-tail entry: the one hash block ending at
/// `boundary`.
fn partial_stored_event(
    req: &Request,
    g: usize,
    boundary: usize,
    hbs: usize,
    lookahead: usize,
) -> BlockStored {
    let n = boundary / hbs;
    let start = boundary - hbs;
    BlockStored {
        block_hashes: vec![req.hashes()[n - 1]],
        parent_block_hash: (n > 1).then(|| req.hashes()[n - 2]),
        token_ids: req.tokens()[start..boundary].to_vec(),
        block_size: hbs as u32,
        lora_id: req.lora.as_ref().and_then(|l| l.id),
        lora_name: req.lora.as_ref().map(|l| l.name.clone()),
        extra_keys: Some(vec![req.event_extra_keys(start, boundary + lookahead)]),
        lookahead_token_ids: (lookahead > 0)
            .then(|| vec![lookahead_tokens(req, boundary, lookahead)]),
        group_idx: g as u32,
        kv_cache_spec_kind: None,
        kv_cache_spec_sliding_window: None,
        session_id: req.session_id.clone(),
    }
}

/// The `BlockStored` of blocks `[from, to)` of group `g` (those `mask` keeps),
/// the request's `blocks` in that group.
fn stored_event(
    gm: &GroupManager,
    req: &Request,
    g: usize,
    blocks: &[BlockId],
    (from, to): (usize, usize),
    mask: Option<&[bool]>,
    lookahead: usize,
) -> BlockStored {
    let bs = gm.block_size() as usize;
    let mut hashes = Vec::new();
    let mut extra = Vec::new();
    let mut ahead = Vec::new();
    for (i, &b) in blocks.iter().enumerate().take(to).skip(from) {
        if b == NULL_BLOCK || mask.is_some_and(|m| !m[i - from]) {
            continue;
        }
        if let Some(k) = gm.key_for(req.hashes(), i) {
            hashes.push(k.hash);
        }
        // With lookahead hashing the keys cover the widened window.
        extra.push(req.event_extra_keys(i * bs, (i + 1) * bs + lookahead));
        if lookahead > 0 {
            ahead.push(lookahead_tokens(req, (i + 1) * bs, lookahead));
        }
    }
    let parent = if from == 0 {
        None
    } else {
        gm.key_for(req.hashes(), from - 1).map(|k| k.hash)
    };
    BlockStored {
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids: req.tokens()[from * bs..to * bs].to_vec(),
        block_size: bs as u32,
        lora_id: req.lora.as_ref().and_then(|l| l.id),
        lora_name: req.lora.as_ref().map(|l| l.name.clone()),
        // vLLM publishes one entry per stored block (None entries included) and
        // None only when no block was stored.
        extra_keys: (!extra.is_empty()).then_some(extra),
        lookahead_token_ids: (lookahead > 0).then_some(ahead),
        group_idx: g as u32,
        kv_cache_spec_kind: None,
        kv_cache_spec_sliding_window: None,
        session_id: req.session_id.clone(),
    }
}
