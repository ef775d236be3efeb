//! `KvCacheManager`, vLLM's `KVCacheManager`: what it does, in vLLM's order.
//!
//! It owns the request table and the coordinator, validates every call and
//! keeps the stats. This file holds the manager's construction and vLLM's
//! calls in vLLM's order: `get_computed_blocks`, `allocate_slots` stage by
//! stage (the general path), `free`, `remove_skipped_blocks`, `cache_blocks`,
//! eviction, reset, events, stats, the common prefix and `new_step_starts`.
//! Around it: the argument types (`args`), read-only accessors (`accessors`),
//! registering and growing requests (`requests`), `allocate_slots`' decode
//! fast path and the batch's lean path (`fast_path`), the checks made before
//! anything changes (`validate`), the batch calls (`batch`), the manager's
//! own counters and `check_invariants` (`readouts`), the calls of an
//! engine that owns its requests (`external`) and the host tier below the
//! pool (`offload`: host hits, loads, stores, the step's transfer plan).
//!
//! A call travels: the id or handle is resolved by the request table, the
//! arguments are checked (`validate`), the coordinator does the block work over
//! its group managers and the pool.

mod accessors;
mod args;
pub use args::{AllocateArgs, BatchAllocation, ComputedBlocks};
mod batch;
pub use batch::BatchStep;
mod connector;
pub use connector::ConnectorHit;
mod external;
pub use external::{EngineRequest, SyncAnchor};
mod fast_path;
mod hisparse;
mod offload;
pub use offload::{
    DiskTransfer, FailedLoad, OffloadConfig, OffloadStats, Transfer, TransferPlan, WritePolicy,
};
mod partial;
mod prepared;
pub use prepared::{PreparedRequest, RequestPreparer};
mod readouts;
mod requests;
mod validate;
mod zeroing;

use crate::coordinator::Coordinator;
use crate::error::{Result, invalid};
use crate::events::KvEvent;
use crate::hash::{BlockHasher, DEFAULT_NONE_HASH_SEED};
use crate::pool::BlockId;
use crate::request::HashWorker;
use crate::request_table::RequestTable;
pub use crate::request_table::{RequestHandle, RequestRefs};
use crate::single_type::Need;
use crate::spec::ManagerConfig;
use crate::stats::PrefixCacheStats;

/// The rest of an allocation split at a group: what `finish_allocation` needs.
#[derive(Debug)]
struct PendingSplit {
    /// The request's unique id (a removed request's successor in its slot is
    /// another request).
    uid: u64,
    from: usize,
    need_slot: u64,
    main_model: u64,
    enc: u64,
    /// Tokens to cache once every group allocated (caching on, not delayed).
    cache_to: Option<u64>,
}

static MANAGER_UIDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn random_seed() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(MANAGER_UIDS.load(std::sync::atomic::Ordering::Relaxed));
    let a = h.finish();
    let mut h2 = std::collections::hash_map::RandomState::new().build_hasher();
    h2.write_u64(a);
    format!("{a:016x}{:016x}", h2.finish())
}

/// The KV-cache manager (vLLM's `KVCacheManager` over a coordinator, one
/// single-type manager per group and one `BlockPool`).
#[derive(Debug)]
pub struct KvCacheManager {
    cfg: ManagerConfig,
    uid: u64,
    coord: Coordinator,
    table: RequestTable,
    hasher: BlockHasher,
    hash_block_size: usize,
    watermark_blocks: u64,
    /// Requests holding an allocation (vLLM's running requests).
    num_admitted: usize,
    stats: Option<PrefixCacheStats>,
    scratch_slots: Vec<u32>,
    scratch_counts: Vec<u64>,
    /// Per entry of a batch: where its fast-path step schedules through.
    scratch_fast: Vec<u64>,
    /// Per request slot, the batch call that last named it (`batch_stamp`):
    /// a batch naming a request twice is refused without a per-call set.
    batch_marks: Vec<u32>,
    batch_stamp: u32,
    /// An allocation split at a group (`AllocateArgs::split_at_group`) that
    /// awaits [`Self::finish_allocation`].
    pending_split: Option<PendingSplit>,
    /// The prompt-hashing thread (`background_hashing`), started by the first
    /// prompt it hashes.
    hash_worker: Option<HashWorker>,
    /// With the hash memo on: per first hash block (by a hash of its tokens,
    /// [`SOURCES`] slots), the last request hashed in place that began with
    /// it (its slot and uid; uid 0: none). A prompt that begins like a live
    /// one takes that one's hashes for the blocks they share
    /// ([`Request::take_shared_hashes`](crate::request::Request::take_shared_hashes)), the rest through the memo.
    hash_sources: Vec<(u32, u64)>,
    /// Prompt blocks whose hashes were taken that way.
    shared_hash_blocks: u64,
    /// The host tier below the pool ([`Self::enable_offload`]).
    offload: Option<Box<offload::Offloading>>,
}

/// Slots of [`KvCacheManager::hash_sources`]: a serving mix's system
/// prompts, and recent conversations' first blocks.
const SOURCES: usize = 256;

impl KvCacheManager {
    /// Builds a manager.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`](crate::Error::InvalidConfig) for an inconsistent configuration.
    pub fn new(cfg: ManagerConfig) -> Result<Self> {
        let hbs = cfg.validate()?;
        let seed = match &cfg.hash_seed {
            Some(s) => s.clone(),
            None if cfg.hash_algo.is_cryptographic() => DEFAULT_NONE_HASH_SEED.to_owned(),
            None => random_seed(),
        };
        let mut hasher = BlockHasher::new(cfg.hash_algo, cfg.hash_algo.none_hash(&seed));
        if let Some(n) = cfg.hash_truncate_bytes {
            hasher.set_truncation(n);
        }
        // At most 2**22 (validated).
        hasher.set_memo(hbs as usize, cfg.memo_blocks() as usize);
        let coord = Coordinator::new(&cfg, hbs)?;
        let uid = MANAGER_UIDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Self {
            uid,
            coord,
            table: RequestTable::new(uid),
            hasher,
            hash_block_size: hbs as usize,
            watermark_blocks: (cfg.watermark * f64::from(cfg.num_blocks)) as u64,
            num_admitted: 0,
            stats: cfg.log_stats.then(PrefixCacheStats::default),
            scratch_slots: Vec::new(),
            scratch_counts: Vec::new(),
            scratch_fast: Vec::new(),
            batch_marks: Vec::new(),
            batch_stamp: 0,
            pending_split: None,
            hash_worker: None,
            hash_sources: if cfg.memo_blocks() > 0 {
                vec![(0, 0); SOURCES]
            } else {
                Vec::new()
            },
            shared_hash_blocks: 0,
            offload: None,
            cfg,
        })
    }

    // ---- lookup -----------------------------------------------------------

    /// The longest cached prefix of the request (at most `num_tokens - 1`
    /// tokens: the last token is always recomputed). Changes no ref counts.
    ///
    /// # Errors
    /// Unknown request.
    pub fn get_computed_blocks(&mut self, id: &str) -> Result<ComputedBlocks> {
        self.get_computed_blocks_up_to(id, None)
    }

    /// [`Self::get_computed_blocks`] with the hit capped at
    /// `max_cache_hit_length` tokens (`None`: `num_tokens - 1`), as vLLM 0.33's
    /// `get_computed_blocks(request, max_cache_hit_length)`.
    ///
    /// # Errors
    /// Unknown request.
    pub fn get_computed_blocks_up_to(
        &mut self,
        id: &str,
        max_cache_hit_length: Option<u64>,
    ) -> Result<ComputedBlocks> {
        let slot = self.table.slot(id)?;
        let epoch = self.coord.pool().epoch();
        let req = self.table.get(slot);
        let request_uid = req.uid;
        if !self.cfg.enable_caching || req.skip_reading {
            return Ok(ComputedBlocks {
                block_ids: vec![Vec::new(); self.num_groups()],
                num_computed_tokens: 0,
                shared_prefix_boundary: 0,
                num_host_tokens: 0,
                request_uid,
                manager_uid: self.uid,
                epoch,
            });
        }
        let max_len = Self::max_hit_len(req.num_tokens(), max_cache_hit_length);
        let hit = self.coord.find_longest_cache_hit(req, max_len);
        let spb = if hit.uncached > 0 {
            (hit.len + hit.uncached) as u64
        } else {
            0
        };
        // An engine that owns its requests pins the boundary itself (vLLM's
        // scheduler copies the lookup's answer into the request).
        let own = (!self.cfg.external_block_hashes).then_some(spb);
        self.table.get_mut(slot).note_lookup(own);
        let num_host_tokens = self.host_hit(slot, hit.len as u64, max_cache_hit_length);
        Ok(ComputedBlocks {
            block_ids: hit.block_ids,
            num_computed_tokens: hit.len as u64,
            shared_prefix_boundary: spb,
            num_host_tokens,
            request_uid,
            manager_uid: self.uid,
            epoch,
        })
    }

    // ---- allocation -------------------------------------------------------

    /// vLLM 0.33's `allocate_slots`. Returns the newly allocated block ids per
    /// group (empty lists: success without new blocks), or `None` when the blocks
    /// do not fit (nothing changed but skipped-block removal).
    ///
    /// # Errors
    /// Unknown request, inconsistent counts, a stale or foreign hit, or a request
    /// that can never fit. A refused call changes nothing.
    pub fn allocate_slots(
        &mut self,
        id: &str,
        args: &AllocateArgs,
        hit: Option<&ComputedBlocks>,
    ) -> Result<Option<&[Vec<BlockId>]>> {
        let slot = self.table.slot(id)?;
        self.check_no_pending_split()?;
        let ok = if let Some(h) =
            hit.filter(|h| h.num_host_tokens > 0 && args.num_external_computed_tokens > 0)
        {
            self.validate_args(slot, args)?;
            if args.num_external_computed_tokens != h.num_host_tokens {
                return Err(invalid(format!(
                    "num_external_computed_tokens {} is not the host hit ({} tokens): pass it \
                     whole, or 0 to compute those tokens",
                    args.num_external_computed_tokens, h.num_host_tokens
                )));
            }
            self.validate_hit(slot, h, args.num_new_computed_tokens)?;
            self.allocate_with_host_hit(slot, args, h)?
        } else if hit.is_none() && args.is_batch_step() {
            // The batch's paths decide such a step; when they do not, the
            // decode fast path would not either: straight to the general one.
            self.running_step(slot, args) || {
                self.validate_args(slot, args)?;
                self.allocate_general(slot, args, None)?
            }
        } else {
            self.validate_args(slot, args)?;
            self.allocate_validated(slot, args, hit)?
        };
        Ok(ok.then_some(self.coord.new_blocks()))
    }

    /// Completes an allocation split at a group (`AllocateArgs::split_at_group`):
    /// fresh blocks for the groups from the split on, then the caching the
    /// first call left (unless it delayed caching). Returns the new blocks per
    /// group (none for the groups before the split).
    ///
    /// # Errors
    /// No split allocation of this request pending.
    pub fn finish_allocation(&mut self, id: &str) -> Result<&[Vec<BlockId>]> {
        let slot = self.table.slot(id)?;
        let uid = self.table.get(slot).uid;
        let Some(p) = self.pending_split.take_if(|p| p.uid == uid) else {
            return Err(invalid(format!(
                "request {id:?} has no allocation split at a group to finish"
            )));
        };
        let req = self.table.get_mut(slot);
        self.coord.allocate_new_blocks_in(
            req,
            p.need_slot,
            p.main_model,
            p.enc,
            p.from..usize::MAX,
        );
        if let Some(to_cache) = p.cache_to {
            self.coord
                .cache_blocks(req, to_cache as usize, req.num_computed_at_step);
        }
        req.set_step_limits(self.coord.step_limits(req));
        Ok(self.coord.new_blocks())
    }

    /// Refuses an allocation while another awaits `finish_allocation`: the
    /// requests' block counts are not final until it does.
    fn check_no_pending_split(&self) -> Result<()> {
        match &self.pending_split {
            None => Ok(()),
            Some(p) => Err(invalid(format!(
                "an allocation split at group {} awaits finish_allocation",
                p.from
            ))),
        }
    }

    /// `allocate_validated` without the decode fast path (the caller tried it).
    #[allow(clippy::too_many_lines)] // mirrors vLLM's allocate_slots stage by stage
    pub(super) fn allocate_general(
        &mut self,
        slot: u32,
        a: &AllocateArgs,
        hit: Option<&ComputedBlocks>,
    ) -> Result<bool> {
        let num_new_computed = if let Some(h) = hit {
            self.validate_hit(slot, h, a.num_new_computed_tokens)?;
            a.num_new_computed_tokens
        } else {
            if a.num_new_computed_tokens > 0 && !a.vllm_lenient {
                return Err(invalid(
                    "num_new_computed_tokens > 0 needs the new_computed_blocks it came from",
                ));
            }
            // vLLM counts computed tokens handed without blocks as computed
            // (they get fresh blocks like the tokens to compute).
            a.num_new_computed_tokens
        };
        let max_len = self.cfg.max_model_len;
        let req = self.table.get(slot);
        let num_tokens = req.num_tokens() as u64;
        let admitting = hit.is_some() || !req.holds_blocks();
        let local = a.num_computed_tokens + num_new_computed;
        let total_computed = (local + a.num_external_computed_tokens).min(max_len);
        // Capped like the slot count: a count past max_model_len must not size
        // block lists (Mamba "align" pads them with null blocks up to it).
        let main_model = (total_computed + a.num_new_tokens).min(max_len);
        let need_slot = (main_model + a.num_lookahead_tokens).min(max_len);

        let hit_blocks: &[Vec<BlockId>] = hit.map_or(&[], |h| &h.block_ids);
        let watermark = if a.has_scheduled_reqs && admitting {
            self.watermark_blocks as i64
        } else {
            0
        };
        let free = i64::from(self.num_free_blocks());
        let enc = a.num_encoder_tokens;

        let need_args = Need {
            num_tokens: need_slot,
            total_computed: local + a.num_external_computed_tokens,
            num_local: local,
            main_model,
            prefill_end: req.prefill_end(),
            cap: false,
        };
        // The need does not change when skipped blocks are nulled below, so a
        // request that can never fit is refused before anything changes.
        let (need, blocked) = self
            .coord
            .num_blocks_to_allocate(req, &need_args, hit_blocks, enc);
        if need > free && !blocked && !a.vllm_lenient {
            self.check_ever_fits(slot, need, hit_blocks, total_computed)?;
        }

        if a.full_sequence_must_fit {
            let full = num_tokens.min(max_len);
            let full_args = Need {
                num_tokens: full,
                total_computed,
                main_model: full,
                cap: true,
                ..need_args
            };
            let (need, blocked) = self
                .coord
                .num_blocks_to_allocate(req, &full_args, hit_blocks, enc);
            if need > free && !blocked && !a.vllm_lenient {
                self.check_ever_fits(slot, need, hit_blocks, total_computed)?;
            }
            if need + a.engine_managed_full_blocks as i64 + watermark > free {
                return Ok(false);
            }
        }

        // Stage 1: release blocks that fell out of the attention window, even if
        // the allocation then fails (nothing to do for full attention).
        let need = if self.coord.any_skipping() {
            let req = self.table.get_mut(slot);
            let processed = total_computed.saturating_sub(a.num_in_flight_tokens);
            self.coord.remove_skipped_blocks(req, processed);
            self.coord.record_checkpoints(req, &need_args);
            self.coord
                .num_blocks_to_allocate(req, &need_args, hit_blocks, enc)
                .0
        } else {
            need
        };
        let available = i64::from(self.num_free_blocks()) - a.reserved_blocks as i64;
        if need + a.engine_managed_blocks as i64 + watermark > available {
            return Ok(false);
        }

        // Stage 2: adopt the prefix hit (an empty hit is no hit: vLLM returns
        // its shared empty sentinel then).
        let req = self.table.get_mut(slot);
        req.num_computed_at_step = a.num_computed_tokens;
        let running = req.is_running();
        let has_hit = hit.is_some_and(|h| !h.is_empty());
        if (has_hit || a.num_external_computed_tokens > 0) && !running {
            self.coord.add_computed_blocks(
                req,
                hit_blocks,
                local,
                a.num_external_computed_tokens,
                a.skip_zeroing_groups,
            );
        }

        // Stage 3: fresh blocks for the tokens to compute (+ lookahead), up to
        // the split when there is one.
        let split = a.split_at_group.unwrap_or(usize::MAX);
        self.coord
            .allocate_new_blocks_in(req, need_slot, main_model, enc, 0..split);
        req.scheduled_through = main_model;
        if req.admit() {
            self.num_admitted += 1;
        }

        // Stage 4: publish full blocks of committed tokens into the prefix cache
        // (after the rest of a split allocation).
        let to_cache = (self.cfg.enable_caching && !a.delay_cache_blocks)
            .then(|| (total_computed + a.num_new_tokens).min(num_tokens));
        if split < self.coord.groups().len() {
            self.pending_split = Some(PendingSplit {
                uid: req.uid,
                from: split,
                need_slot,
                main_model,
                enc,
                cache_to: to_cache,
            });
        } else {
            if let Some(to_cache) = to_cache {
                self.coord
                    .cache_blocks(req, to_cache as usize, a.num_computed_tokens);
            }
            req.set_step_limits(self.coord.step_limits(req));
        }

        // Stats are recorded at admission, when a lookup preceded it.
        if admitting && self.cfg.record_stats_at_admission && req.take_pending_lookup() {
            let (n, pre) = (req.num_tokens() as u64, req.num_preemptions > 0);
            if let Some(s) = self.stats.as_mut() {
                s.record(n, num_new_computed, pre);
            }
        }
        Ok(true)
    }

    // ---- release ----------------------------------------------------------

    /// Releases the request's blocks, tail first (preemption). The request stays
    /// known and is re-admitted through `get_computed_blocks` + `allocate_slots`;
    /// if it held an allocation, that counts as a preemption (stats).
    ///
    /// # Errors
    /// Unknown request.
    pub fn free(&mut self, id: &str) -> Result<()> {
        let slot = self.table.slot(id)?;
        self.offload_release(slot, false)?;
        self.release(slot, true);
        Ok(())
    }

    /// Releases the request's blocks and forgets it (finished or aborted).
    ///
    /// # Errors
    /// Unknown request.
    pub fn remove_request(&mut self, id: &str) -> Result<()> {
        let slot = self.table.slot(id)?;
        self.offload_release(slot, true)?;
        self.release(slot, false);
        self.table.remove(id, slot);
        Ok(())
    }

    /// Releases the request's blocks (a held allocation released by `free`
    /// counts as a preemption).
    fn release(&mut self, slot: u32, preempted: bool) {
        let req = self.table.get_mut(slot);
        let uid = req.uid;
        self.pending_split.take_if(|p| p.uid == uid);
        if req.release(preempted) {
            self.num_admitted -= 1;
        }
        self.coord.free(req);
    }

    /// Frees blocks that fell out of the attention window (sliding window, local
    /// chunks); a no-op for full attention.
    ///
    /// # Errors
    /// Unknown request, or more tokens than the request has.
    pub fn remove_skipped_blocks(&mut self, id: &str, total_computed_tokens: u64) -> Result<()> {
        let slot = self.table.slot(id)?;
        let req = self.table.get_mut(slot);
        let n = req.num_tokens();
        if total_computed_tokens > n as u64 {
            // Blocks the request still needs would be released.
            return Err(invalid(format!(
                "total_computed_tokens {total_computed_tokens} exceeds the request's {n} tokens"
            )));
        }
        self.coord.remove_skipped_blocks(req, total_computed_tokens);
        Ok(())
    }

    /// Publishes the request's full blocks covering `num_computed_tokens` into the
    /// prefix cache (used after a delayed allocation). No-op without caching.
    ///
    /// # Errors
    /// Unknown request; more tokens than the request has, or than its
    /// allocations cover (computed plus scheduled tokens of its last step).
    pub fn cache_blocks(&mut self, id: &str, num_computed_tokens: u64) -> Result<()> {
        let slot = self.table.slot(id)?;
        let req = self.table.get_mut(slot);
        if num_computed_tokens > req.num_tokens() as u64 {
            return Err(invalid(format!(
                "num_computed_tokens {num_computed_tokens} exceeds the request's {} tokens",
                req.num_tokens()
            )));
        }
        if num_computed_tokens > req.scheduled_through {
            // Blocks past the allocated steps hold no KV yet (lookahead
            // slots, Mamba's speculative state blocks): caching them would
            // publish blocks a later step still writes or moves.
            return Err(invalid(format!(
                "num_computed_tokens {num_computed_tokens} is past the {} tokens request \
                 {id:?}'s allocations cover",
                req.scheduled_through
            )));
        }
        if self.cfg.enable_caching {
            let at = req.num_computed_at_step;
            self.coord
                .cache_blocks(req, num_computed_tokens as usize, at);
        }
        Ok(())
    }

    // ---- cache maintenance ------------------------------------------------

    /// Drops the given blocks from the prefix cache (their data is bad), without
    /// touching ref counts or the free queue.
    ///
    /// # Errors
    /// An id outside the pool (nothing is evicted then).
    pub fn evict_blocks(&mut self, ids: &[BlockId]) -> Result<()> {
        let n = self.coord.pool().num_blocks();
        if let Some(bad) = ids.iter().find(|&&b| b >= n) {
            return Err(invalid(format!(
                "block id {bad} is outside the pool of {n} blocks"
            )));
        }
        let pool = self.coord.pool_mut();
        for &b in ids {
            pool.maybe_evict(b);
        }
        Ok(())
    }

    /// Clears the prefix cache; `false` (and no change) while any block is held.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if !self.coord.pool_mut().reset_prefix_cache() {
            return false;
        }
        if let Some(s) = self.stats.as_mut() {
            s.reset = true;
        }
        true
    }

    /// Drains the KV events, annotated with each group's spec kind.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.coord.take_events()
    }

    /// Returns the prefix-cache stats gathered since the last call and starts new
    /// ones; `None` when stats are off.
    pub fn make_prefix_cache_stats(&mut self) -> Option<PrefixCacheStats> {
        self.stats.as_mut().map(std::mem::take)
    }

    /// Per group, the number of leading blocks of the request shared by every
    /// request holding blocks (vLLM 0.32's meaning, for cascade attention; full
    /// attention only).
    ///
    /// # Errors
    /// Unknown request.
    pub fn get_num_common_prefix_blocks(&self, id: &str) -> Result<Vec<u32>> {
        Ok(self
            .coord
            .num_common_prefix_blocks(self.req(id)?, self.num_admitted))
    }

    /// Per-step notification (Mamba "align" groups reset per-step state).
    pub fn new_step_starts(&mut self) {
        self.coord.new_step_starts();
    }
}
