//! `KvCacheManager`: the public surface. It owns the pool, the request table and
//! one single-type manager per KV-cache group, and implements vLLM 0.33's
//! `allocate_slots` stage by stage.

use rustc_hash::FxHashMap;

use crate::error::{Error, Result, invalid};
use crate::events::{BlockStored, KvEvent};
use crate::hash::{BlockHash, BlockHasher, DEFAULT_NONE_HASH_SEED};
use crate::pool::{BlockId, BlockPool, NULL_BLOCK};
use crate::request::{Request, RequestSpec};
use crate::single_type::{GroupManager, Lookup, Need, Retention};
use crate::spec::ManagerConfig;
use crate::stats::PrefixCacheStats;

/// Result of [`KvCacheManager::get_computed_blocks`]: the prefix-cache hit of a
/// request, valid until blocks are evicted (it is re-validated when used).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComputedBlocks {
    /// Hit blocks per group (null blocks pad skipped positions).
    pub block_ids: Vec<Vec<BlockId>>,
    /// Tokens covered by the hit.
    pub num_computed_tokens: u64,
    /// vLLM's `shared_prefix_boundary` (0 unless a sparse-retention group lags).
    pub shared_prefix_boundary: u64,
    request_uid: u64,
    manager_uid: u64,
    epoch: u64,
}

impl ComputedBlocks {
    /// Whether every group's hit is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.block_ids.iter().all(Vec::is_empty)
    }
}

/// A request's handle: returned by [`KvCacheManager::add_request`], valid until the
/// request is removed (a removed request's handle never names another request).
/// Batch calls take handles to skip the id lookup.
pub type RequestHandle = u64;

/// The requests of a batch call, named by ids or by handles.
#[derive(Clone, Copy, Debug)]
pub enum RequestRefs<'a> {
    /// Request ids.
    Ids(&'a [&'a str]),
    /// Handles from [`KvCacheManager::add_request`].
    Handles(&'a [RequestHandle]),
}

impl RequestRefs<'_> {
    /// Number of requests named.
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            Self::Ids(v) => v.len(),
            Self::Handles(v) => v.len(),
        }
    }

    /// No request named.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Arguments of [`KvCacheManager::allocate_slots`] besides the request and hit
/// (vLLM's meaning for each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocateArgs {
    pub num_new_tokens: u64,
    pub num_computed_tokens: u64,
    pub num_new_computed_tokens: u64,
    pub num_lookahead_tokens: u64,
    pub num_external_computed_tokens: u64,
    pub delay_cache_blocks: bool,
    pub num_encoder_tokens: u64,
    pub full_sequence_must_fit: bool,
    pub reserved_blocks: u64,
    pub has_scheduled_reqs: bool,
}

impl AllocateArgs {
    /// A running request's step: `num_new_tokens` after `num_computed_tokens`.
    #[must_use]
    pub fn step(num_new_tokens: u64, num_computed_tokens: u64) -> Self {
        Self {
            num_new_tokens,
            num_computed_tokens,
            num_new_computed_tokens: 0,
            num_lookahead_tokens: 0,
            num_external_computed_tokens: 0,
            delay_cache_blocks: false,
            num_encoder_tokens: 0,
            full_sequence_must_fit: false,
            reserved_blocks: 0,
            has_scheduled_reqs: true,
        }
    }
}

/// Output of [`KvCacheManager::allocate_slots_batch`]: per group, the new block
/// ids of every admitted request concatenated, with `offsets[g][i]..offsets[g][i+1]`
/// the span of request `i`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchAllocation {
    /// Requests served (a prefix of the batch).
    pub num_allocated: usize,
    pub block_ids: Vec<Vec<BlockId>>,
    pub offsets: Vec<Vec<u32>>,
}

static MANAGER_UIDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// The KV-cache manager (vLLM's `KVCacheManager` + coordinator + single-type
/// managers over one `BlockPool`).
#[derive(Debug)]
pub struct KvCacheManager {
    cfg: ManagerConfig,
    uid: u64,
    pool: BlockPool,
    groups: Vec<GroupManager>,
    hasher: BlockHasher,
    hash_block_size: usize,
    watermark_blocks: u64,
    reqs: Vec<Option<Request>>,
    /// Generation of each request slot, bumped when the slot is vacated, so a
    /// handle of a removed request never names its successor.
    slot_gen: Vec<u32>,
    free_slots: Vec<u32>,
    index: FxHashMap<String, u32>,
    next_uid: u64,
    num_admitted: usize,
    stats: Option<PrefixCacheStats>,
    new_blocks: Vec<Vec<BlockId>>,
    coordinator: Coordinator,
    scheduler_block_size: u64,
    /// Some group frees blocks outside its attention window (sliding window,
    /// chunked local, Mamba).
    any_skipping: bool,
    scratch_slots: Vec<u32>,
    /// With `verify_cached_tokens`: what each cached block was computed for.
    provenance: Vec<Option<Box<Provenance>>>,
    /// Prefix hits cut short because a cached block did not match the request.
    verification_failures: u64,
}

/// What a cached block was computed for (hit verification).
#[derive(Clone, Debug)]
struct Provenance {
    /// The pool's cache stamp when this was recorded (stale once it differs).
    stamp: u64,
    /// The block's token ids (as many as the request had when it was cached).
    tokens: Vec<u32>,
    /// The request's context digest at the end of each hash block covered.
    ctx_ends: Vec<[u8; 32]>,
}

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
enum Coordinator {
    /// Caching off: no lookups.
    NoPrefixCache,
    /// One group.
    Unitary,
    /// Several groups: a fixed-point search, full attention first.
    Hybrid { attn: Vec<AttnGroup>, simple: bool },
}

fn random_seed() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(MANAGER_UIDS.load(std::sync::atomic::Ordering::Relaxed));
    let a = h.finish();
    let mut h2 = std::collections::hash_map::RandomState::new().build_hasher();
    h2.write_u64(a);
    format!("{a:016x}{:016x}", h2.finish())
}

impl KvCacheManager {
    /// Builds a manager.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an inconsistent configuration.
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
        let pool = BlockPool::new(
            cfg.num_blocks,
            cfg.enable_caching,
            cfg.enable_kv_cache_events,
        )
        .with_metrics(cfg.kv_cache_metrics);
        let sbs = cfg.scheduler_block_size();
        let in_flight = cfg.max_in_flight_tokens.unwrap_or(cfg.max_model_len);
        let mut groups = cfg
            .groups
            .iter()
            .enumerate()
            .map(|(i, g)| {
                GroupManager::new(
                    g.clone(),
                    i as u32,
                    hbs,
                    sbs,
                    in_flight,
                    cfg.max_model_len,
                    cfg.num_blocks,
                )
            })
            .collect::<Vec<_>>();
        let coordinator = if !cfg.enable_caching {
            Coordinator::NoPrefixCache
        } else if groups.len() == 1 {
            groups[0].use_eagle = cfg.use_eagle;
            Coordinator::Unitary
        } else {
            let mut attn: Vec<AttnGroup> = Vec::new();
            for (i, g) in cfg.groups.iter().enumerate() {
                if !groups[i].prefix_cacheable() {
                    continue;
                }
                groups[i].use_eagle = cfg.use_eagle;
                match attn
                    .iter_mut()
                    .find(|a| cfg.groups[a.group_ids[0] as usize] == *g)
                {
                    Some(a) => a.group_ids.push(i as u32),
                    None => attn.push(AttnGroup {
                        group_ids: vec![i as u32],
                        is_full: g.kind.is_full_attention(),
                        is_mamba: matches!(g.kind, crate::spec::AttentionKind::Mamba { .. }),
                        use_eagle: cfg.use_eagle,
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
            Coordinator::Hybrid { attn, simple }
        };
        let watermark_blocks = (cfg.watermark * f64::from(cfg.num_blocks)) as u64;
        let n = groups.len();
        Ok(Self {
            uid: MANAGER_UIDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            pool,
            groups,
            hasher,
            hash_block_size: hbs as usize,
            watermark_blocks,
            reqs: Vec::new(),
            slot_gen: Vec::new(),
            free_slots: Vec::new(),
            index: FxHashMap::default(),
            next_uid: 1,
            num_admitted: 0,
            stats: cfg.log_stats.then(PrefixCacheStats::default),
            new_blocks: vec![Vec::new(); n],
            coordinator,
            scheduler_block_size: sbs,
            scratch_slots: Vec::new(),
            provenance: if cfg.verify_cached_tokens {
                vec![None; cfg.num_blocks.max(1) as usize]
            } else {
                Vec::new()
            },
            verification_failures: 0,
            any_skipping: cfg.groups.iter().any(|g| {
                !g.kind.is_full_attention() && g.kind != crate::spec::AttentionKind::CrossAttention
            }),
            cfg,
        })
    }

    // ---- accessors --------------------------------------------------------

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &ManagerConfig {
        &self.cfg
    }

    /// The block pool (read-only).
    #[must_use]
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Free blocks (evictable cached blocks included).
    #[must_use]
    pub fn num_free_blocks(&self) -> u32 {
        self.pool.num_free_blocks()
    }

    /// Block usage in `[0, 1]`, null block excluded.
    #[must_use]
    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Number of KV-cache groups.
    #[must_use]
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    /// Token granularity of block hashes.
    #[must_use]
    pub fn hash_block_size(&self) -> usize {
        self.hash_block_size
    }

    /// The chain seed in use.
    #[must_use]
    pub fn none_hash(&self) -> BlockHash {
        self.hasher.none_hash()
    }

    /// Number of known requests.
    #[must_use]
    pub fn num_requests(&self) -> usize {
        self.index.len()
    }

    fn slot(&self, id: &str) -> Result<u32> {
        self.index
            .get(id)
            .copied()
            .ok_or_else(|| Error::UnknownRequest(id.to_owned()))
    }

    fn handle_of(&self, slot: u32) -> RequestHandle {
        (u64::from(self.slot_gen[slot as usize]) << 32) | u64::from(slot)
    }

    /// The handle of a known request (the value `add_request` returned).
    ///
    /// # Errors
    /// Unknown request.
    pub fn request_handle(&self, id: &str) -> Result<RequestHandle> {
        Ok(self.handle_of(self.slot(id)?))
    }

    fn slot_of_handle(&self, handle: RequestHandle) -> Result<u32> {
        let slot = handle as u32;
        let live = self.reqs.get(slot as usize).is_some_and(Option::is_some)
            && u64::from(self.slot_gen[slot as usize]) == handle >> 32;
        if live {
            Ok(slot)
        } else {
            Err(Error::UnknownRequest(format!("handle {handle:#x}")))
        }
    }

    /// Resolves request references to slots (into `out`, cleared first).
    fn resolve(&self, refs: RequestRefs<'_>, out: &mut Vec<u32>) -> Result<()> {
        out.clear();
        match refs {
            RequestRefs::Ids(ids) => {
                out.reserve(ids.len());
                for id in ids {
                    out.push(self.slot(id)?);
                }
            }
            RequestRefs::Handles(hs) => {
                out.reserve(hs.len());
                for &h in hs {
                    out.push(self.slot_of_handle(h)?);
                }
            }
        }
        Ok(())
    }

    fn req(&self, slot: u32) -> &Request {
        match &self.reqs[slot as usize] {
            Some(r) => r,
            None => unreachable_slot(),
        }
    }

    fn req_mut(&mut self, slot: u32) -> &mut Request {
        match &mut self.reqs[slot as usize] {
            Some(r) => r,
            None => unreachable_slot(),
        }
    }

    /// Whether a request id is known.
    #[must_use]
    pub fn contains(&self, id: &str) -> bool {
        self.index.contains_key(id)
    }

    /// Token count of a request.
    ///
    /// # Errors
    /// Unknown request.
    pub fn num_tokens(&self, id: &str) -> Result<usize> {
        Ok(self.req(self.slot(id)?).num_tokens())
    }

    /// Prompt length of a request.
    ///
    /// # Errors
    /// Unknown request.
    pub fn num_prompt_tokens(&self, id: &str) -> Result<usize> {
        Ok(self.req(self.slot(id)?).num_prompt_tokens)
    }

    /// The request's block hashes at `hash_block_size` granularity.
    ///
    /// # Errors
    /// Unknown request.
    pub fn block_hashes(&self, id: &str) -> Result<&[BlockHash]> {
        Ok(&self.req(self.slot(id)?).hashes)
    }

    /// The request's block ids per group.
    ///
    /// # Errors
    /// Unknown request.
    pub fn block_ids(&self, id: &str) -> Result<Vec<&[BlockId]>> {
        let r = self.req(self.slot(id)?);
        Ok(r.groups.iter().map(|g| g.blocks.as_slice()).collect())
    }

    /// How many times the request was freed (preempted) while known.
    ///
    /// # Errors
    /// Unknown request.
    pub fn num_preemptions(&self, id: &str) -> Result<u32> {
        Ok(self.req(self.slot(id)?).num_preemptions)
    }

    // ---- request table ----------------------------------------------------

    /// Registers a request and hashes its full prompt blocks.
    ///
    /// # Errors
    /// Duplicate id; a prompt longer than `max_model_len`; inconsistent
    /// multimodal items or embeddings.
    pub fn add_request(&mut self, id: &str, spec: RequestSpec) -> Result<RequestHandle> {
        if self.index.contains_key(id) {
            return Err(Error::DuplicateRequest(id.to_owned()));
        }
        if spec.prompt_token_ids.is_empty() {
            return Err(invalid("prompt_token_ids must not be empty"));
        }
        if spec.prompt_token_ids.len() as u64 > self.cfg.max_model_len {
            return Err(invalid(format!(
                "prompt of {} tokens is longer than max_model_len {}",
                spec.prompt_token_ids.len(),
                self.cfg.max_model_len
            )));
        }
        let uid = self.next_uid;
        let mut req = Request::new(
            id.to_owned(),
            uid,
            spec,
            self.groups.len(),
            self.hash_block_size,
        )?;
        self.next_uid += 1;
        req.verify = self.cfg.verify_cached_tokens && self.cfg.enable_caching;
        if self.cfg.enable_caching || self.pool.events_enabled() {
            req.update_hashes(&mut self.hasher, self.hash_block_size);
        }
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.reqs[s as usize] = Some(req);
                s
            }
            None => {
                self.reqs.push(Some(req));
                self.slot_gen.push(0);
                (self.reqs.len() - 1) as u32
            }
        };
        self.index.insert(id.to_owned(), slot);
        Ok(self.handle_of(slot))
    }

    /// Appends generated tokens; blocks that fill get hashed.
    ///
    /// # Errors
    /// Unknown request.
    pub fn append_token_ids(&mut self, id: &str, tokens: &[u32]) -> Result<()> {
        let slot = self.slot(id)?;
        let hbs = self.hash_block_size;
        let hashing = self.cfg.enable_caching || self.pool.events_enabled();
        let Some(req) = self.reqs[slot as usize].as_mut() else {
            unreachable_slot()
        };
        req.tokens.extend_from_slice(tokens);
        if hashing {
            req.update_hashes(&mut self.hasher, hbs);
        }
        Ok(())
    }

    /// Appends one sampled token to each of many requests (one crossing per
    /// step). All ids are checked before any token is appended.
    ///
    /// # Errors
    /// Unknown request or lengths that differ.
    pub fn append_token_ids_batch(&mut self, ids: &[&str], tokens: &[u32]) -> Result<()> {
        self.append_token_ids_batch_refs(RequestRefs::Ids(ids), tokens)
    }

    /// [`Self::append_token_ids_batch`] with requests named by ids or handles.
    ///
    /// # Errors
    /// Unknown request or lengths that differ.
    pub fn append_token_ids_batch_refs(
        &mut self,
        refs: RequestRefs<'_>,
        tokens: &[u32],
    ) -> Result<()> {
        if refs.len() != tokens.len() {
            return Err(invalid("request ids and token ids differ in length"));
        }
        let mut slots = std::mem::take(&mut self.scratch_slots);
        if let Err(e) = self.resolve(refs, &mut slots) {
            self.scratch_slots = slots;
            return Err(e);
        }
        let hbs = self.hash_block_size;
        let hashing = self.cfg.enable_caching || self.pool.events_enabled();
        for (&slot, &t) in slots.iter().zip(tokens) {
            let Some(req) = self.reqs[slot as usize].as_mut() else {
                unreachable_slot()
            };
            req.tokens.push(t);
            if hashing && req.tokens.len() % hbs == 0 {
                req.update_hashes(&mut self.hasher, hbs);
            }
        }
        self.scratch_slots = slots;
        Ok(())
    }

    /// Releases the request's blocks, tail first (preemption). The request stays
    /// known and is re-admitted through `get_computed_blocks` + `allocate_slots`;
    /// if it held an allocation, that counts as a preemption (stats).
    ///
    /// # Errors
    /// Unknown request.
    pub fn free(&mut self, id: &str) -> Result<()> {
        let slot = self.slot(id)?;
        let was_admitted = self.req(slot).admitted;
        self.release(slot);
        if was_admitted {
            self.req_mut(slot).num_preemptions += 1;
        }
        Ok(())
    }

    /// Releases the request's blocks and forgets it (finished or aborted).
    ///
    /// # Errors
    /// Unknown request.
    pub fn remove_request(&mut self, id: &str) -> Result<()> {
        let slot = self.slot(id)?;
        self.release(slot);
        self.index.remove(id);
        self.reqs[slot as usize] = None;
        self.slot_gen[slot as usize] = self.slot_gen[slot as usize].wrapping_add(1);
        self.free_slots.push(slot);
        Ok(())
    }

    fn release(&mut self, slot: u32) {
        let Some(req) = self.reqs[slot as usize].as_mut() else {
            unreachable_slot()
        };
        if req.admitted {
            req.admitted = false;
            self.num_admitted -= 1;
        }
        for (g, gm) in self.groups.iter().enumerate() {
            gm.free(&mut self.pool, &mut req.groups[g]);
        }
    }

    // ---- lookup -----------------------------------------------------------

    /// The longest cached prefix of the request (at most `num_tokens - 1`
    /// tokens: the last token is always recomputed). Changes no ref counts.
    ///
    /// # Errors
    /// Unknown request.
    pub fn get_computed_blocks(&mut self, id: &str) -> Result<ComputedBlocks> {
        let slot = self.slot(id)?;
        let epoch = self.pool.epoch();
        let manager_uid = self.uid;
        let req = self.req(slot);
        let uid = req.uid;
        let n = self.groups.len();
        if !self.cfg.enable_caching || req.skip_reading {
            return Ok(ComputedBlocks {
                block_ids: vec![Vec::new(); n],
                num_computed_tokens: 0,
                shared_prefix_boundary: 0,
                request_uid: uid,
                manager_uid,
                epoch,
            });
        }
        let max_len = req.num_tokens().saturating_sub(1);
        let (mut block_ids, mut hit, mut uncached) =
            self.find_longest_cache_hit(&req.hashes, max_len);
        let mut failures = 0;
        if req.verify {
            // A block that does not match the request ends the hit at its start;
            // search again below it (each round lowers the limit).
            while let Some(p) = self.first_unverified(req, &block_ids, hit) {
                failures += 1;
                (block_ids, hit, uncached) = self.find_longest_cache_hit(&req.hashes, p);
            }
        }
        self.verification_failures += failures;
        let spb = if uncached > 0 {
            (hit + uncached) as u64
        } else {
            0
        };
        let r = self.req_mut(slot);
        r.pending_lookup = true;
        r.shared_prefix_boundary = spb;
        Ok(ComputedBlocks {
            block_ids,
            num_computed_tokens: hit as u64,
            shared_prefix_boundary: spb,
            request_uid: uid,
            manager_uid,
            epoch,
        })
    }

    /// Returns the hit blocks per group, the reconciled hit length, and how much
    /// longer the longest single-group hit was (an uncached shared prefix).
    fn find_longest_cache_hit(
        &self,
        hashes: &[BlockHash],
        max_len: usize,
    ) -> (Vec<Vec<BlockId>>, usize, usize) {
        let n = self.groups.len();
        let mut out = vec![Vec::new(); n];
        match &self.coordinator {
            Coordinator::NoPrefixCache => (out, 0, 0),
            Coordinator::Unitary => {
                let gm = &self.groups[0];
                let q = Lookup {
                    hashes,
                    max_len,
                    drop_eagle_block: gm.use_eagle,
                    alignment: gm.block_size() as usize,
                };
                let hit = gm.find_longest_cache_hit(&self.pool, &q, &[0], &mut out);
                (out, hit, 0)
            }
            Coordinator::Hybrid { attn, simple } => {
                self.find_hybrid(attn, *simple, hashes, max_len, out)
            }
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
    ) -> (Vec<Vec<BlockId>>, usize, usize) {
        let n = self.groups.len();
        let sbs = self.scheduler_block_size as usize;
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
                    // Match one block past the candidate, then drop it.
                    max_length =
                        (curr + gm.block_size() as usize).min(hashes.len() * self.hash_block_size);
                }
                let q = Lookup {
                    hashes,
                    max_len: max_length,
                    drop_eagle_block: drop,
                    alignment: sbs,
                };
                let new_hit = gm.find_longest_cache_hit(&self.pool, &q, &ag.group_ids, &mut out);
                if drop {
                    eagle_verified[idx] = true;
                } else if new_hit < curr {
                    eagle_verified.iter_mut().for_each(|v| *v = false);
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
        (out, hit_length, longest.saturating_sub(hit_length))
    }

    // ---- allocation -------------------------------------------------------

    fn validate_hit(&self, slot: u32, hit: &ComputedBlocks, num_new_computed: u64) -> Result<()> {
        let req = self.req(slot);
        if hit.manager_uid != self.uid || hit.request_uid != req.uid {
            return Err(Error::StaleComputedBlocks(format!(
                "the computed blocks were not looked up for request {:?} on this manager",
                req.id
            )));
        }
        if hit.block_ids.len() != self.groups.len() {
            return Err(invalid("computed blocks have the wrong number of groups"));
        }
        if req.holds_blocks() && !hit.is_empty() {
            return Err(invalid(format!(
                "request {:?} already holds blocks; a prefix hit only applies at admission",
                req.id
            )));
        }
        for (g, ids) in hit.block_ids.iter().enumerate() {
            if !self.groups[g].prefix_cacheable() {
                continue; // cross attention never hits
            }
            let bs = u64::from(self.groups[g].block_size());
            if (ids.len() as u64) * bs < num_new_computed {
                return Err(invalid(format!(
                    "num_new_computed_tokens {num_new_computed} exceeds the hit of group {g} \
                     ({} blocks of {bs} tokens)",
                    ids.len()
                )));
            }
        }
        if hit.epoch == self.pool.epoch() {
            return Ok(());
        }
        // Blocks were evicted since the lookup: every hit block must still be
        // cached under the request's own hash at its position.
        for (g, ids) in hit.block_ids.iter().enumerate() {
            let gm = &self.groups[g];
            for (i, &b) in ids.iter().enumerate() {
                if b == NULL_BLOCK {
                    continue;
                }
                let expect = gm.key_for(&req.hashes, i);
                if expect.is_none() || self.pool.block_key(b) != expect {
                    return Err(Error::StaleComputedBlocks(format!(
                        "block {b} of the prefix hit was evicted or reused since \
                         get_computed_blocks; look the request up again"
                    )));
                }
            }
        }
        Ok(())
    }

    fn validate_args(&self, slot: u32, a: &AllocateArgs) -> Result<()> {
        let req = self.req(slot);
        if a.num_new_tokens == 0
            && a.num_external_computed_tokens == 0
            && a.num_new_computed_tokens == 0
        {
            return Err(invalid(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt",
            ));
        }
        let local = a
            .num_computed_tokens
            .checked_add(a.num_new_computed_tokens)
            .ok_or_else(|| invalid("token counts overflow"))?;
        let total = local
            .checked_add(a.num_external_computed_tokens)
            .ok_or_else(|| invalid("token counts overflow"))?;
        if total > req.num_tokens() as u64 {
            return Err(invalid(format!(
                "num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens \
                 = {total} exceeds the request's {} tokens",
                req.num_tokens()
            )));
        }
        for x in [
            a.num_new_tokens,
            a.num_lookahead_tokens,
            a.num_encoder_tokens,
            a.reserved_blocks,
        ] {
            if x > (1 << 40) {
                return Err(invalid(format!("count {x} is out of range")));
            }
        }
        for (g, gm) in self.groups.iter().enumerate() {
            if !gm.prefix_cacheable() {
                continue; // cross attention: its blocks cover encoder tokens
            }
            let have = req.groups[g].blocks.len() as u64 * u64::from(gm.block_size());
            if a.num_computed_tokens > have {
                return Err(invalid(format!(
                    "num_computed_tokens {} but request {:?} holds blocks for only {have} tokens",
                    a.num_computed_tokens, req.id
                )));
            }
        }
        Ok(())
    }

    /// Refuses a request that can never be scheduled: the blocks it would hold
    /// after this call (fresh blocks plus every prefix-hit block, evictable or
    /// held by others) exceed all usable blocks minus those it keeps holding
    /// once skipped blocks are released. Only called when the need exceeds the
    /// free blocks.
    fn check_ever_fits(
        &self,
        slot: u32,
        need: i64,
        hit: &[Vec<BlockId>],
        total_computed: u64,
    ) -> Result<()> {
        let req = self.req(slot);
        let mut held = 0i64;
        let mut shared_hits = 0i64;
        for (g, gm) in self.groups.iter().enumerate() {
            let gb = &req.groups[g];
            let real = gb.blocks.iter().filter(|&&b| b != NULL_BLOCK).count();
            held += (real - gm.num_skippable_blocks(gb, total_computed).min(real)) as i64;
            if let Some(h) = hit.get(g) {
                // Hits referenced by other requests are not in `need` but will be
                // this request's too.
                let skip =
                    (gm.num_skipped_tokens(total_computed) / u64::from(gm.block_size())) as usize;
                shared_hits += h
                    .iter()
                    .skip(skip)
                    .filter(|&&b| b != NULL_BLOCK && !self.pool.is_evictable(b))
                    .count() as i64;
            }
        }
        let capacity = i64::from(self.pool.num_blocks()) - 1 - held;
        if need + shared_hits > capacity {
            return Err(Error::CannotFit(format!(
                "request {:?} needs {} more blocks but the pool can never give it more \
                 than {capacity} ({} usable blocks, {held} held by the request)",
                req.id,
                need + shared_hits,
                self.pool.num_blocks() - 1
            )));
        }
        Ok(())
    }

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
        let slot = self.slot(id)?;
        let ok = self.allocate_slot(slot, args, hit)?;
        Ok(ok.then_some(self.new_blocks.as_slice()))
    }

    fn allocate_slot(
        &mut self,
        slot: u32,
        a: &AllocateArgs,
        hit: Option<&ComputedBlocks>,
    ) -> Result<bool> {
        self.validate_args(slot, a)?;
        self.allocate_validated(slot, a, hit)
    }

    /// `allocate_slot` once the arguments were validated.
    fn allocate_validated(
        &mut self,
        slot: u32,
        a: &AllocateArgs,
        hit: Option<&ComputedBlocks>,
    ) -> Result<bool> {
        let num_new_computed = match hit {
            Some(h) => {
                self.validate_hit(slot, h, a.num_new_computed_tokens)?;
                a.num_new_computed_tokens
            }
            None => {
                if a.num_new_computed_tokens > 0 {
                    return Err(invalid(
                        "num_new_computed_tokens > 0 needs the new_computed_blocks it came from",
                    ));
                }
                0
            }
        };
        let max_len = self.cfg.max_model_len;
        let req = self.req(slot);
        let num_tokens = req.num_tokens() as u64;
        let admitting = hit.is_some() || !req.holds_blocks();
        let local = a.num_computed_tokens + num_new_computed;
        let total_computed = (local + a.num_external_computed_tokens).min(max_len);
        // Capped like the slot count: a count past max_model_len must not size
        // block lists (Mamba "align" pads them with null blocks up to it).
        let main_model = (total_computed + a.num_new_tokens).min(max_len);
        let need_slot = (main_model + a.num_lookahead_tokens).min(max_len);

        let empty: Vec<Vec<BlockId>> = Vec::new();
        let hit_blocks: &[Vec<BlockId>] = hit.map_or(empty.as_slice(), |h| &h.block_ids);
        let watermark = if a.has_scheduled_reqs && admitting {
            self.watermark_blocks as i64
        } else {
            0
        };
        let free = i64::from(self.pool.num_free_blocks());
        let enc = a.num_encoder_tokens;

        let need_args = Need {
            num_tokens: need_slot,
            total_computed: local + a.num_external_computed_tokens,
            main_model,
            cap: false,
        };
        // The need does not change when skipped blocks are nulled below, so a
        // request that can never fit is refused before anything changes.
        let (need, blocked) = self.num_blocks_to_allocate(slot, &need_args, hit_blocks, enc);
        if need > free && !blocked {
            self.check_ever_fits(slot, need, hit_blocks, total_computed)?;
        }

        if a.full_sequence_must_fit {
            let full = num_tokens.min(max_len);
            let full_args = Need {
                num_tokens: full,
                total_computed,
                main_model: full,
                cap: true,
            };
            let (need, blocked) = self.num_blocks_to_allocate(slot, &full_args, hit_blocks, enc);
            if need > free && !blocked {
                self.check_ever_fits(slot, need, hit_blocks, total_computed)?;
            }
            if need + watermark > free {
                return Ok(false);
            }
        }

        // Stage 1: release blocks that fell out of the attention window, even if
        // the allocation then fails (nothing to do for full attention).
        let need = if self.any_skipping {
            self.remove_skipped(slot, total_computed);
            self.num_blocks_to_allocate(slot, &need_args, hit_blocks, enc)
                .0
        } else {
            need
        };
        let available = i64::from(self.pool.num_free_blocks()) - a.reserved_blocks as i64;
        if need + watermark > available {
            return Ok(false);
        }

        // Stage 2: adopt the prefix hit (two phases: touch every group's hits
        // before any group allocates blocks for external tokens).
        // An empty hit is no hit (vLLM returns its shared empty sentinel then).
        let running = self.req(slot).groups.iter().any(|g| g.num_cached.is_some());
        let has_hit = hit.is_some_and(|h| !h.is_empty());
        if (has_hit || a.num_external_computed_tokens > 0) && !running {
            let Some(req) = self.reqs[slot as usize].as_mut() else {
                unreachable_slot()
            };
            for (g, gm) in self.groups.iter().enumerate() {
                let blocks = hit_blocks.get(g).map_or(&[][..], Vec::as_slice);
                gm.add_local_computed_blocks(
                    &mut self.pool,
                    &mut req.groups[g],
                    blocks,
                    local,
                    a.num_external_computed_tokens,
                );
            }
            if a.num_external_computed_tokens > 0 {
                for (g, gm) in self.groups.iter().enumerate() {
                    gm.allocate_external_computed_blocks(
                        &mut self.pool,
                        &mut req.groups[g],
                        local,
                        a.num_external_computed_tokens,
                    );
                }
            }
        }

        // Stage 3: fresh blocks for the tokens to compute (+ lookahead).
        {
            let Some(req) = self.reqs[slot as usize].as_mut() else {
                unreachable_slot()
            };
            for (g, gm) in self.groups.iter().enumerate() {
                let out = &mut self.new_blocks[g];
                out.clear();
                let (n, main) = if gm.prefix_cacheable() {
                    (need_slot, main_model)
                } else {
                    (enc, enc) // cross attention: one allocation for the encoder output
                };
                gm.allocate_new_blocks(&mut self.pool, &mut req.groups[g], n, main, out);
            }
            if !req.admitted {
                req.admitted = true;
                self.num_admitted += 1;
            }
        }

        // Stage 4: publish full blocks of committed tokens into the prefix cache.
        if self.cfg.enable_caching && !a.delay_cache_blocks {
            let to_cache = (total_computed + a.num_new_tokens).min(num_tokens);
            self.cache_blocks_slot(slot, to_cache as usize);
        }

        // Stats are recorded at admission, when a lookup preceded it.
        let req = self.req_mut(slot);
        if admitting && req.pending_lookup {
            req.pending_lookup = false;
            let (n, pre) = (req.num_tokens() as u64, req.num_preemptions > 0);
            if let Some(s) = self.stats.as_mut() {
                s.record(n, num_new_computed, pre);
            }
        }
        Ok(true)
    }

    /// vLLM's coordinator `get_num_blocks_to_allocate`; the flag says a Mamba hit
    /// was cached this very step (a transient refusal, not a capacity problem).
    fn num_blocks_to_allocate(
        &self,
        slot: u32,
        n: &Need,
        hit: &[Vec<BlockId>],
        num_encoder_tokens: u64,
    ) -> (i64, bool) {
        let req = self.req(slot);
        let mut total = 0i64;
        let mut blocked = false;
        for (g, gm) in self.groups.iter().enumerate() {
            let blocks = hit.get(g).map_or(&[][..], Vec::as_slice);
            let need = if gm.prefix_cacheable() {
                gm.num_blocks_to_allocate(&self.pool, &req.groups[g], blocks, n)
            } else {
                let enc = Need {
                    num_tokens: num_encoder_tokens,
                    total_computed: 0,
                    main_model: num_encoder_tokens,
                    cap: n.cap,
                };
                gm.num_blocks_to_allocate(&self.pool, &req.groups[g], &[], &enc)
            };
            blocked |= gm.hit_cached_this_step(&self.pool, blocks);
            total += need;
        }
        (total, blocked)
    }

    fn remove_skipped(&mut self, slot: u32, total_computed: u64) {
        let Some(req) = self.reqs[slot as usize].as_mut() else {
            unreachable_slot()
        };
        for (g, gm) in self.groups.iter().enumerate() {
            gm.remove_skipped_blocks(&mut self.pool, &mut req.groups[g], total_computed);
        }
    }

    /// Frees blocks that fell out of the attention window (sliding window, local
    /// chunks); a no-op for full attention.
    ///
    /// # Errors
    /// Unknown request, or more tokens than the request has.
    pub fn remove_skipped_blocks(&mut self, id: &str, total_computed_tokens: u64) -> Result<()> {
        let slot = self.slot(id)?;
        let n = self.req(slot).num_tokens();
        if total_computed_tokens > n as u64 {
            // Blocks the request still needs would be released.
            return Err(invalid(format!(
                "total_computed_tokens {total_computed_tokens} exceeds the request's {n} tokens"
            )));
        }
        self.remove_skipped(slot, total_computed_tokens);
        Ok(())
    }

    /// Publishes the request's full blocks covering `num_computed_tokens` into the
    /// prefix cache (used after a delayed allocation). No-op without caching.
    ///
    /// # Errors
    /// Unknown request, or more tokens than the request has.
    pub fn cache_blocks(&mut self, id: &str, num_computed_tokens: u64) -> Result<()> {
        let slot = self.slot(id)?;
        if num_computed_tokens > self.req(slot).num_tokens() as u64 {
            return Err(invalid(format!(
                "num_computed_tokens {num_computed_tokens} exceeds the request's {} tokens",
                self.req(slot).num_tokens()
            )));
        }
        if self.cfg.enable_caching {
            self.cache_blocks_slot(slot, num_computed_tokens as usize);
        }
        Ok(())
    }

    fn cache_blocks_slot(&mut self, slot: u32, num_tokens: usize) {
        let Some(req) = self.reqs[slot as usize].as_mut() else {
            unreachable_slot()
        };
        let hbs = self.hash_block_size;
        let sbs = self.scheduler_block_size as usize;
        let hybrid = matches!(self.coordinator, Coordinator::Hybrid { .. });
        // Most decode steps fill no block: nothing new to publish in any group.
        let hashed = req.hashes.len() * hbs;
        if !hybrid
            && self.groups.iter().zip(&req.groups).all(|(gm, gb)| {
                gm.blocks_floor(num_tokens.min(hashed) as u64) as usize
                    <= gb.num_cached.unwrap_or(0)
            })
        {
            return;
        }
        let (boundaries, nb) =
            replay_boundaries(req.num_prompt_tokens as u64, sbs as u64, self.cfg.use_eagle);
        let retention = Retention {
            interval: self.cfg.prefix_cache_retention_interval,
            boundaries: &boundaries[..nb],
        };
        for (g, gm) in self.groups.iter_mut().enumerate() {
            let cached_before = req.groups[g].num_cached.unwrap_or(0);
            // Nothing past the last aligned boundary can ever be hit in a hybrid
            // model (EAGLE groups keep one block past it).
            let n = if hybrid {
                let aligned = num_tokens / sbs * sbs;
                if gm.use_eagle && aligned > 0 {
                    num_tokens.min(aligned + gm.block_size() as usize)
                } else {
                    aligned
                }
            } else {
                num_tokens
            };
            if let Some((from, to, mask)) =
                gm.cache_blocks(&mut self.pool, req, g, n, hbs, &retention)
            {
                if self.pool.events_enabled() {
                    let ev = stored_event(gm, req, g, from, to, mask.as_deref());
                    self.pool.push_event(KvEvent::BlockStored(ev));
                }
            }
            // Partial prompt-tail entries exist where vLLM allows a hash block
            // below the group block size: hybrid models. (A single group with a
            // finer hash is pagedkv's extension; it caches whole blocks only.)
            let partial = if hybrid {
                gm.cache_partial_tail(&mut self.pool, req, g, n, hbs)
            } else {
                None
            };
            if let Some(boundary) = partial {
                if self.pool.events_enabled() {
                    let ev = partial_stored_event(req, g, boundary, hbs);
                    self.pool.push_event(KvEvent::BlockStored(ev));
                }
            }
            if req.verify {
                let bs = gm.block_size() as usize;
                let cached_after = req.groups[g].num_cached.unwrap_or(0);
                // The block before may have been cached partially (a prompt
                // tail); the one after may carry a partial entry now.
                let from = cached_before.saturating_sub(1);
                let to = (cached_after + 1).min(req.groups[g].blocks.len());
                for i in from..to {
                    record_provenance(&mut self.provenance, &self.pool, req, g, i, bs, hbs);
                }
            }
        }
    }

    /// The start (in tokens) of the first hit block that does not match the
    /// request: a stale or missing record, other token ids, or another context.
    fn first_unverified(
        &self,
        req: &Request,
        block_ids: &[Vec<BlockId>],
        hit: usize,
    ) -> Option<usize> {
        let hbs = self.hash_block_size;
        let mut first: Option<usize> = None;
        for (g, blocks) in block_ids.iter().enumerate() {
            let bs = self.groups[g].block_size() as usize;
            for (i, &b) in blocks.iter().enumerate() {
                let start = i * bs;
                let end = (start + bs).min(hit);
                if b == NULL_BLOCK || end <= start {
                    continue;
                }
                let ok = self.provenance[b as usize].as_deref().is_some_and(|p| {
                    let covered = end - start;
                    let hashed = covered / hbs;
                    Some(p.stamp) == self.pool.cache_stamp(b)
                        && hashed > 0
                        && p.tokens.len() >= covered
                        && p.tokens[..covered] == req.tokens[start..end]
                        && p.ctx_ends.get(hashed - 1) == req.ctx.get(start / hbs + hashed - 1)
                });
                if !ok {
                    first = Some(first.map_or(start, |f| f.min(start)));
                    break;
                }
            }
        }
        first
    }

    /// Prefix hits cut short by `verify_cached_tokens` (a cached block whose
    /// tokens or context did not match the request: a hash collision).
    #[must_use]
    pub fn verification_failures(&self) -> u64 {
        self.verification_failures
    }

    /// One decode step for many running requests in one call: the same result as
    /// calling `allocate_slots` for each in order until the first that does not fit.
    ///
    /// # Errors
    /// Any invalid entry (checked for all entries before anything changes).
    pub fn allocate_slots_batch(
        &mut self,
        ids: &[&str],
        num_new_tokens: &[u64],
        num_computed_tokens: &[u64],
        num_lookahead_tokens: u64,
        out: &mut BatchAllocation,
    ) -> Result<()> {
        self.allocate_slots_batch_refs(
            RequestRefs::Ids(ids),
            num_new_tokens,
            num_computed_tokens,
            num_lookahead_tokens,
            out,
        )
    }

    /// [`Self::allocate_slots_batch`] with requests named by ids or handles.
    ///
    /// # Errors
    /// Any invalid entry (checked for all entries before anything changes).
    pub fn allocate_slots_batch_refs(
        &mut self,
        refs: RequestRefs<'_>,
        num_new_tokens: &[u64],
        num_computed_tokens: &[u64],
        num_lookahead_tokens: u64,
        out: &mut BatchAllocation,
    ) -> Result<()> {
        let len = refs.len();
        if len != num_new_tokens.len() || len != num_computed_tokens.len() {
            return Err(invalid("request ids and token counts differ in length"));
        }
        let mut slots = std::mem::take(&mut self.scratch_slots);
        let checked = self.resolve(refs, &mut slots).and_then(|()| {
            self.validate_batch(
                &slots,
                num_new_tokens,
                num_computed_tokens,
                num_lookahead_tokens,
            )
        });
        if let Err(e) = checked {
            self.scratch_slots = slots;
            return Err(e);
        }
        let n = self.groups.len();
        out.num_allocated = 0;
        out.block_ids.resize(n, Vec::new());
        out.offsets.resize(n, Vec::new());
        for g in 0..n {
            out.block_ids[g].clear();
            out.offsets[g].clear();
            out.offsets[g].push(0);
        }
        for (i, &slot) in slots.iter().enumerate() {
            let args = AllocateArgs {
                num_lookahead_tokens,
                ..AllocateArgs::step(num_new_tokens[i], num_computed_tokens[i])
            };
            // Validated above, before anything changed.
            if !self.allocate_validated(slot, &args, None)? {
                break;
            }
            for g in 0..n {
                out.block_ids[g].extend_from_slice(&self.new_blocks[g]);
                out.offsets[g].push(out.block_ids[g].len() as u32);
            }
            out.num_allocated += 1;
        }
        self.scratch_slots = slots;
        Ok(())
    }

    /// Checks every entry of a batch (after slot resolution) before anything changes.
    fn validate_batch(
        &self,
        slots: &[u32],
        num_new_tokens: &[u64],
        num_computed_tokens: &[u64],
        num_lookahead_tokens: u64,
    ) -> Result<()> {
        let free_at_start = i64::from(self.pool.num_free_blocks());
        for (i, &slot) in slots.iter().enumerate() {
            let args = AllocateArgs {
                num_lookahead_tokens,
                ..AllocateArgs::step(num_new_tokens[i], num_computed_tokens[i])
            };
            self.validate_args(slot, &args)?;
            let max_len = self.cfg.max_model_len;
            let need_args = Need {
                num_tokens: (num_computed_tokens[i] + num_new_tokens[i] + num_lookahead_tokens)
                    .min(max_len),
                total_computed: num_computed_tokens[i],
                main_model: (num_computed_tokens[i] + num_new_tokens[i]).min(max_len),
                cap: false,
            };
            let (need, blocked) = self.num_blocks_to_allocate(slot, &need_args, &[], 0);
            if need > free_at_start && !blocked {
                self.check_ever_fits(slot, need, &[], num_computed_tokens[i].min(max_len))?;
            }
        }
        Ok(())
    }

    // ---- cache maintenance ------------------------------------------------

    /// Drops the given blocks from the prefix cache (their data is bad), without
    /// touching ref counts or the free queue.
    ///
    /// # Errors
    /// An id outside the pool (nothing is evicted then).
    pub fn evict_blocks(&mut self, ids: &[u64]) -> Result<()> {
        let n = u64::from(self.pool.num_blocks());
        if let Some(bad) = ids.iter().find(|&&b| b >= n) {
            return Err(invalid(format!(
                "block id {bad} is outside the pool of {n} blocks"
            )));
        }
        for &b in ids {
            self.pool.maybe_evict(b as BlockId);
        }
        Ok(())
    }

    /// Clears the prefix cache; `false` (and no change) while any block is held.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if !self.pool.reset_prefix_cache() {
            return false;
        }
        if let Some(s) = self.stats.as_mut() {
            s.reset = true;
        }
        true
    }

    /// Drains the KV events, annotated with each group's spec kind.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        let mut evs = self.pool.take_events();
        for ev in &mut evs {
            if let KvEvent::BlockStored(s) = ev {
                if let Some(gm) = self.groups.get(s.group_idx as usize) {
                    s.kv_cache_spec_kind = Some(gm.spec().kind.spec_kind());
                    s.kv_cache_spec_sliding_window = gm.spec().kind.sliding_window();
                }
            }
        }
        evs
    }

    /// Drains the pool's block activity log (`kv_cache_metrics`; empty otherwise).
    pub fn take_block_activity(&mut self) -> Vec<crate::pool::BlockActivity> {
        self.pool.take_block_activity()
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
        let req = self.req(self.slot(id)?);
        Ok(self
            .groups
            .iter()
            .enumerate()
            .map(|(g, gm)| {
                if !gm.spec().kind.is_full_attention() {
                    return 0;
                }
                req.groups[g]
                    .blocks
                    .iter()
                    .take_while(|&&b| self.pool.ref_cnt(b) as usize == self.num_admitted)
                    .count() as u32
            })
            .collect())
    }

    /// Per-step notification (Mamba "align" groups reset per-step state).
    pub fn new_step_starts(&mut self) {
        for gm in &mut self.groups {
            gm.new_step_starts();
        }
    }

    /// Checks every invariant of the pool and the request table.
    ///
    /// # Errors
    /// [`Error::InvariantViolation`] describing the first violation.
    pub fn check_invariants(&self) -> Result<()> {
        let n = self.pool.num_blocks() as usize;
        let mut refs = vec![0u32; n];
        let mut owner_group = vec![u32::MAX; n];
        let mut admitted = 0usize;
        for req in self.reqs.iter().flatten() {
            admitted += usize::from(req.admitted);
            for (g, gb) in req.groups.iter().enumerate() {
                for &b in &gb.blocks {
                    let i = b as usize;
                    if i >= n {
                        return Err(Error::InvariantViolation(format!(
                            "request {:?} holds out-of-range block {b}",
                            req.id
                        )));
                    }
                    if b == NULL_BLOCK {
                        continue;
                    }
                    refs[i] += 1;
                    if owner_group[i] != u32::MAX && owner_group[i] != g as u32 {
                        return Err(Error::InvariantViolation(format!(
                            "block {b} is held by groups {} and {g}",
                            owner_group[i]
                        )));
                    }
                    owner_group[i] = g as u32;
                }
                if let Some(c) = gb.num_cached {
                    if c > gb.blocks.len() {
                        return Err(Error::InvariantViolation(format!(
                            "request {:?} marks {c} cached blocks of {}",
                            req.id,
                            gb.blocks.len()
                        )));
                    }
                    let gm = &self.groups[g];
                    for (i, &b) in gb.blocks[..c].iter().enumerate() {
                        if b == NULL_BLOCK || !self.cfg.enable_caching {
                            continue;
                        }
                        // A full block carries its own key; a partial prompt-tail
                        // entry (re-registered after an eviction) is the other case.
                        let full_tokens = ((i + 1) * gm.block_size() as usize) as u32;
                        let partial = self.pool.primary_tokens(b).is_some_and(|t| t < full_tokens);
                        if let Some(k) = self.pool.block_key(b).filter(|_| !partial) {
                            if Some(k) != gm.key_for(&req.hashes, i) {
                                return Err(Error::InvariantViolation(format!(
                                    "block {b} of request {:?} is cached under another hash",
                                    req.id
                                )));
                            }
                        }
                    }
                }
            }
        }
        if admitted != self.num_admitted {
            return Err(Error::InvariantViolation(
                "admitted-request count is off".into(),
            ));
        }
        if self.index.len() != self.reqs.iter().flatten().count() {
            return Err(Error::InvariantViolation(
                "request index is out of sync".into(),
            ));
        }
        self.pool
            .check_invariants(Some(&refs))
            .map_err(Error::InvariantViolation)
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

/// The `BlockStored` of a partial prompt-tail entry: the one hash block ending at
/// `boundary`.
fn partial_stored_event(req: &Request, g: usize, boundary: usize, hbs: usize) -> BlockStored {
    let n = boundary / hbs;
    let start = boundary - hbs;
    BlockStored {
        block_hashes: vec![req.hashes[n - 1]],
        parent_block_hash: (n > 1).then(|| req.hashes[n - 2]),
        token_ids: req.tokens[start..boundary].to_vec(),
        block_size: hbs as u32,
        lora_id: req.lora.as_ref().and_then(|l| l.id),
        lora_name: req.lora.as_ref().map(|l| l.name.clone()),
        extra_keys: Some(vec![req.event_extra_keys(start, boundary)]),
        group_idx: g as u32,
        kv_cache_spec_kind: None,
        kv_cache_spec_sliding_window: None,
    }
}

fn stored_event(
    gm: &GroupManager,
    req: &Request,
    g: usize,
    from: usize,
    to: usize,
    mask: Option<&[bool]>,
) -> BlockStored {
    let bs = gm.block_size() as usize;
    let blocks = &req.groups[g].blocks;
    let mut hashes = Vec::new();
    let mut extra = Vec::new();
    for (i, &b) in blocks.iter().enumerate().take(to).skip(from) {
        if b == NULL_BLOCK || mask.is_some_and(|m| !m[i - from]) {
            continue;
        }
        if let Some(k) = gm.key_for(&req.hashes, i) {
            hashes.push(k.hash);
        }
        extra.push(req.event_extra_keys(i * bs, (i + 1) * bs));
    }
    let parent = if from == 0 {
        None
    } else {
        gm.key_for(&req.hashes, from - 1).map(|k| k.hash)
    };
    BlockStored {
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids: req.tokens[from * bs..to * bs].to_vec(),
        block_size: bs as u32,
        lora_id: req.lora.as_ref().and_then(|l| l.id),
        lora_name: req.lora.as_ref().map(|l| l.name.clone()),
        // vLLM publishes one entry per stored block (None entries included) and
        // None only when no block was stored.
        extra_keys: (!extra.is_empty()).then_some(extra),
        group_idx: g as u32,
        kv_cache_spec_kind: None,
        kv_cache_spec_sliding_window: None,
    }
}

#[cold]
fn unreachable_slot() -> ! {
    // The index maps ids only to occupied slots; reaching this is a bug in this
    // module, not misuse.
    unreachable!("request slot without a request")
}

/// Records what block `i` of the request's group `g` was computed for, when the
/// block is cached and the record is missing, stale or shorter than it can be.
fn record_provenance(
    provenance: &mut [Option<Box<Provenance>>],
    pool: &BlockPool,
    req: &Request,
    g: usize,
    i: usize,
    bs: usize,
    hbs: usize,
) {
    let b = req.groups[g].blocks[i];
    if b == NULL_BLOCK {
        return;
    }
    let Some(stamp) = pool.cache_stamp(b) else {
        return;
    };
    let start = i * bs;
    let end = (start + bs).min(req.tokens.len());
    let hashed_end = end.min(req.ctx.len() * hbs);
    if hashed_end <= start {
        return;
    }
    let slot = &mut provenance[b as usize];
    if slot
        .as_deref()
        .is_some_and(|p| p.stamp == stamp && p.tokens.len() >= end - start)
    {
        return;
    }
    *slot = Some(Box::new(Provenance {
        stamp,
        tokens: req.tokens[start..end].to_vec(),
        ctx_ends: req.ctx[start / hbs..hashed_end / hbs].to_vec(),
    }));
}
