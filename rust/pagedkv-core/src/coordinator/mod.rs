//! The coordinator (vLLM's `KVCacheCoordinator`): its type, its setup and the
//! allocation stages a step goes through.
//!
//! It owns the block pool and one single-type manager per KV-cache group, and
//! reconciles the groups. This file holds the type, building it from a
//! configuration, its accessors and settings, and the stages vLLM's
//! coordinator runs for `allocate_slots` (skipped-block removal, adopting a
//! hit, fresh blocks). The rest lives beside it:
//! - `lookup`: the prefix-hit search (one group, or vLLM's fixed point across
//!   several);
//! - `step_limits`: what a step needs (the decode fast-path checks, the block
//!   counts, Mamba checkpoints);
//! - `cache`: caching with its `BlockStored` events;
//! - `release`: freeing and popping a request's blocks, Mamba boundary
//!   offloads, pending copy-on-write pairs;
//! - `check`: the common-prefix count and the per-request invariant checks.
//!
//! It works on request state handed to it by the manager and never sees request
//! ids or handles.

use crate::error::{Error, Result};
use crate::pool::{BlockId, BlockPool};
use crate::request::Request;
use crate::single_type::{GroupManager, GroupParams};
use crate::spec::{AttentionKind, ManagerConfig};
use crate::verify::Verifier;

mod cache;
mod check;
mod lookup;
mod release;
mod step_limits;

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
    #[allow(clippy::too_many_lines)] // pool, group parameters and lookup mode set up together
    pub(crate) fn new(cfg: &ManagerConfig, hbs: u32) -> Result<Self> {
        let pool = BlockPool::try_new(
            cfg.num_blocks,
            cfg.enable_caching,
            cfg.enable_kv_cache_events,
        )?
        .with_metrics(cfg.kv_cache_metrics)
        .with_eviction(cfg.eviction)
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

    // ---- allocation -------------------------------------------------------

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

    /// Per-step notification (Mamba "align" groups reset per-step state).
    pub(crate) fn new_step_starts(&mut self) {
        for gm in &mut self.groups {
            gm.new_step_starts();
        }
    }
}
