//! Property tests of `KvCacheManager` (full-attention / MLA groups: usually one,
//! sometimes several — equal specs with caching, any block sizes without) against
//! a naive reference model of vLLM 0.33's allocate / free / lookup semantics.
//!
//! The model knows nothing about hashes: a cached block's key is its group and the
//! token prefix it ends (`tokens[..(i + 1) * block_size]`), which is what the hash
//! chain stands for when there are no extra keys. Everything is `Vec`-based and
//! O(n). The test keeps a bijection between the manager's block hashes and the
//! model's prefixes (learnt from `block_hashes()` of live requests) and compares,
//! after every op: returned block ids, hit blocks and lengths, errors, the free
//! queue, ref counts, every block's key, the prefix map (duplicates in insertion
//! order), request block lists, preemption counts, common-prefix counts, KV events
//! and prefix-cache stats; plus model-free properties (block-list length ==
//! cdiv(allocated tokens, block size), hits are the request's own chain, free +
//! distinct held blocks == usable blocks, `check_invariants`, all blocks free
//! after removing every request).
//!
//! Random ops are interpreted against the current state (request / block picks are
//! indices modulo what exists), emulating a scheduler: admission = lookup (fresh
//! or kept from earlier, possibly stale) + `allocate_slots` with the hit (whole
//! prompt or a chunk, with lookahead, connector tokens, delayed caching and the
//! admission gates), running steps = chunked prefill or decode (append one token,
//! allocate for it), batched decode, `cache_blocks`, preemption, removal,
//! `evict_blocks`, `reset_prefix_cache`, stats snapshots, and refused calls (which
//! must change nothing).
// proptest's `Index` is taken by reference as its strategies hand it out.
#![allow(clippy::trivially_copy_pass_by_ref)]

mod support;

use std::collections::{HashMap, HashSet};

use support::ref_pool::RefPool;

use pagedkv_core::{
    AllocateArgs, AttentionKind, BatchAllocation, BatchStep, BlockHash, CacheKey, ComputedBlocks,
    Error, GroupSpec, HashAlgo, KvCacheManager, KvEvent, ManagerConfig, PrefixCacheStats,
    RequestRefs, RequestSpec,
};
use proptest::prelude::*;
use proptest::sample::Index;

// ---------------------------------------------------------------------------
// Configuration and ops
// ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Cfg {
    num_blocks: u32,
    /// Block size of each KV-cache group (all equal when caching is on).
    block_sizes: Vec<u32>,
    /// MLA instead of full attention (managed alike; events name the kind).
    mla: bool,
    /// `Some(d)`: an explicit hash block size dividing every block size.
    hash_block_size: Option<u32>,
    caching: bool,
    events: bool,
    eagle: bool,
    watermark: f64,
    algo: HashAlgo,
    max_model_len: u64,
    log_stats: bool,
}

impl Cfg {
    fn manager_config(&self) -> ManagerConfig {
        let mut c =
            ManagerConfig::full_attention(self.num_blocks, self.block_sizes[0], self.max_model_len);
        let kind = if self.mla {
            AttentionKind::MlaAttention
        } else {
            AttentionKind::FullAttention
        };
        c.groups = self
            .block_sizes
            .iter()
            .map(|&block_size| GroupSpec::new(kind.clone(), block_size))
            .collect();
        c.enable_caching = self.caching;
        c.enable_kv_cache_events = self.events;
        c.use_eagle = self.eagle;
        c.watermark = self.watermark;
        c.hash_algo = self.algo;
        c.hash_block_size = self.hash_block_size;
        c.log_stats = self.log_stats;
        c
    }

    fn min_bs(&self) -> u32 {
        self.block_sizes
            .iter()
            .copied()
            .min()
            .expect("one group at least")
    }

    fn hbs(&self) -> usize {
        self.hash_block_size.unwrap_or(self.min_bs()) as usize
    }
}

fn cfg_strategy(
    num_blocks: std::ops::RangeInclusive<u32>,
    caching: BoxedStrategy<bool>,
    groups: BoxedStrategy<usize>,
) -> impl Strategy<Value = Cfg> {
    (
        num_blocks,
        (
            groups,
            prop::collection::vec(prop::sample::select(vec![1u32, 2, 4, 16]), 9),
            prop::bool::weighted(0.2),
        ),
        any::<Index>(),
        caching,
        any::<bool>(),
        prop::bool::weighted(0.2),
        prop::sample::select(vec![0.0f64, 0.1]),
        prop::sample::select(vec![
            HashAlgo::Sha256Cbor,
            HashAlgo::XxhashCbor,
            HashAlgo::Xxh3Native,
        ]),
        prop::sample::select(vec![17u64, 48, 100_000]),
        any::<bool>(),
    )
        .prop_map(
            |(
                num_blocks,
                (num_groups, sizes, mla),
                hbs_pick,
                caching,
                events,
                eagle,
                watermark,
                algo,
                max_model_len,
                log_stats,
            )| {
                // Prefix caching needs equal group specs; without it sizes may differ.
                let block_sizes: Vec<u32> = if caching {
                    vec![sizes[0]; num_groups]
                } else {
                    sizes[..num_groups].to_vec()
                };
                let min_bs = block_sizes.iter().copied().min().unwrap_or(1);
                let divisors: Vec<u32> = (1..=min_bs).filter(|d| min_bs % d == 0).collect();
                // Half the time the default (= block size), else any divisor. A
                // hybrid (several cached groups) with a finer hash also registers
                // partial prompt-tail entries, which this model leaves out (they
                // are checked against vLLM in tests/core/test_hybrid.py).
                let hash_block_size = if hbs_pick.index(2) == 0 || (caching && num_groups > 1) {
                    None
                } else {
                    Some(divisors[hbs_pick.index(divisors.len())])
                };
                Cfg {
                    num_blocks,
                    block_sizes,
                    mla,
                    hash_block_size,
                    caching,
                    events,
                    eagle,
                    watermark,
                    algo,
                    max_model_len,
                    log_stats,
                }
            },
        )
}

/// The admission gates of `allocate_slots` (vLLM 0.33 arguments).
#[derive(Clone, Copy, Debug)]
struct Gate {
    full_sequence_must_fit: bool,
    reserved_blocks: u8,
    has_scheduled_reqs: bool,
}

fn gate_strategy() -> impl Strategy<Value = Gate> {
    (
        prop::bool::weighted(0.2),
        prop::sample::select(vec![0u8, 0, 0, 0, 1, 3]),
        prop::bool::weighted(0.85),
    )
        .prop_map(
            |(full_sequence_must_fit, reserved_blocks, has_scheduled_reqs)| Gate {
                full_sequence_must_fit,
                reserved_blocks,
                has_scheduled_reqs,
            },
        )
}

#[derive(Clone, Debug)]
enum Op {
    /// New request: a prefix of one of the shared base prompts plus a short suffix.
    Add {
        base: Index,
        len: Index,
        suffix: Vec<u32>,
        skip_reading: bool,
    },
    /// `get_computed_blocks` on a waiting request; the hit is kept for a later admission.
    Lookup { req: Index },
    /// Admission of a waiting request: lookup (or a kept, possibly stale, hit) then
    /// `allocate_slots` for the rest of the prompt or a chunk of it.
    /// `ext`: tokens a KV connector supplies (`num_external_computed_tokens`);
    /// `delay`: `delay_cache_blocks` (async load, published later by `CacheBlocks`).
    Admit {
        req: Index,
        chunk: Option<u8>,
        reuse_kept_hit: bool,
        lookahead: u8,
        none_if_empty: bool,
        ext: u8,
        delay: bool,
        gate: Gate,
    },
    /// A running request's step: continue a chunked prefill, or decode one token.
    Step {
        req: Index,
        chunk: Option<u8>,
        lookahead: u8,
        token: u32,
    },
    /// `allocate_slots_batch` over distinct running requests (decode or prefill rest);
    /// `fused`: the sampled tokens go in the same call (`append_token_ids`).
    Batch {
        picks: Vec<Index>,
        lookahead: u8,
        token: u32,
        fused: bool,
    },
    /// `cache_blocks(id, num_computed)` of a running request (after an async load);
    /// `overshoot` asks for one token more than the request has (refused).
    CacheBlocks { req: Index, overshoot: bool },
    /// `free` (preemption) of any known request.
    Preempt { req: Index },
    /// `remove_request` of any known request.
    Remove { req: Index },
    /// `evict_blocks` of arbitrary ids (optionally one out of range).
    Evict { ids: Vec<Index>, out_of_range: bool },
    /// `reset_prefix_cache`.
    Reset,
    /// `make_prefix_cache_stats` snapshot.
    Stats,
    /// A refused call (see `misuse`): must return the documented error and change
    /// nothing (the unchanged model is compared afterwards).
    Misuse { which: u8, req: Index, other: Index },
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let chunk = || prop::option::weighted(0.3, 1u8..20);
    let lookahead = || prop::sample::select(vec![0u8, 0, 0, 1, 3]);
    let token = || 0u32..3;
    let add = (
        any::<Index>(),
        any::<Index>(),
        prop::collection::vec(0u32..3, 0..6),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(base, len, suffix, skip_reading)| Op::Add {
            base,
            len,
            suffix,
            skip_reading,
        });
    let admit = (
        (
            any::<Index>(),
            chunk(),
            prop::bool::weighted(0.6),
            lookahead(),
        ),
        (
            prop::bool::weighted(0.2),
            prop::sample::select(vec![0u8, 0, 0, 0, 0, 0, 1, 5, 40]),
            prop::bool::weighted(0.15),
            gate_strategy(),
        ),
    )
        .prop_map(
            |((req, chunk, reuse_kept_hit, lookahead), (none_if_empty, ext, delay, gate))| {
                Op::Admit {
                    req,
                    chunk,
                    reuse_kept_hit,
                    lookahead,
                    none_if_empty,
                    ext,
                    delay,
                    gate,
                }
            },
        );
    let step = (any::<Index>(), chunk(), lookahead(), token()).prop_map(
        |(req, chunk, lookahead, token)| Op::Step {
            req,
            chunk,
            lookahead,
            token,
        },
    );
    let batch = (
        prop::collection::vec(any::<Index>(), 1..5),
        prop::sample::select(vec![0u8, 0, 2]),
        token(),
        any::<bool>(),
    )
        .prop_map(|(picks, lookahead, token, fused)| Op::Batch {
            picks,
            lookahead,
            token,
            fused,
        });
    let cache = (any::<Index>(), prop::bool::weighted(0.1))
        .prop_map(|(req, overshoot)| Op::CacheBlocks { req, overshoot });
    let evict = (
        prop::collection::vec(any::<Index>(), 0..4),
        prop::bool::weighted(0.15),
    )
        .prop_map(|(ids, out_of_range)| Op::Evict { ids, out_of_range });
    let misuse = (0u8..10, any::<Index>(), any::<Index>())
        .prop_map(|(which, req, other)| Op::Misuse { which, req, other });
    prop_oneof![
        5 => add,
        2 => any::<Index>().prop_map(|req| Op::Lookup { req }),
        6 => admit,
        1 => cache,
        7 => step,
        2 => batch,
        2 => any::<Index>().prop_map(|req| Op::Preempt { req }),
        2 => any::<Index>().prop_map(|req| Op::Remove { req }),
        1 => evict,
        1 => Just(Op::Reset),
        1 => Just(Op::Stats),
        2 => misuse,
    ]
}

// ---------------------------------------------------------------------------
// The reference model
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ErrKind {
    Stale,
    CannotFit,
    Invalid,
    Unknown,
    Duplicate,
}

fn kind(e: &Error) -> ErrKind {
    match e {
        Error::StaleComputedBlocks(_) => ErrKind::Stale,
        Error::CannotFit(_) => ErrKind::CannotFit,
        Error::InvalidArgument(_) => ErrKind::Invalid,
        Error::UnknownRequest(_) => ErrKind::Unknown,
        Error::DuplicateRequest(_) => ErrKind::Duplicate,
        other => panic!("unexpected error kind: {other:?}"),
    }
}

/// Events with prefixes in place of hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
enum MEvent {
    Stored {
        group: u32,
        blocks: Vec<Vec<u32>>,
        parent: Option<Vec<u32>>,
        token_ids: Vec<u32>,
    },
    Removed(u32, Vec<u32>),
    Cleared,
}

/// Per-group block lists.
type Groups = Vec<Vec<u32>>;

#[derive(Clone, Debug)]
struct KeptHit {
    real: ComputedBlocks,
    blocks: Groups,
    tokens: u64,
}

#[derive(Clone, Debug)]
struct MReq {
    id: String,
    tokens: Vec<u32>,
    blocks: Groups,
    /// Per group, leading blocks already published to the prefix cache.
    num_cached: Vec<usize>,
    /// Tokens the (emulated) scheduler considers computed.
    num_computed: u64,
    /// Largest `num_tokens_need_slot` allocated since admission.
    alloc_tokens: u64,
    skip_reading: bool,
    preemptions: u32,
    pending_lookup: bool,
    admitted: bool,
    kept_hit: Option<KeptHit>,
}

impl MReq {
    fn new(id: &str, tokens: Vec<u32>, num_groups: usize, skip_reading: bool) -> Self {
        Self {
            id: id.to_owned(),
            tokens,
            blocks: vec![Vec::new(); num_groups],
            num_cached: vec![0; num_groups],
            num_computed: 0,
            alloc_tokens: 0,
            skip_reading,
            preemptions: 0,
            pending_lookup: false,
            admitted: false,
            kept_hit: None,
        }
    }

    fn running(&self) -> bool {
        self.blocks.iter().any(|b| !b.is_empty())
    }
}

/// A cache key of the model: group and the token prefix the block ends.
type MKey = (u32, Vec<u32>);

struct Model {
    cfg: Cfg,
    n: usize,
    /// Block size per group.
    bss: Vec<usize>,
    /// The reference pool, keyed by (group, token prefix).
    pool: RefPool<MKey>,
    reqs: Vec<MReq>,
    events: Vec<MEvent>,
    stats: PrefixCacheStats,
    next_id: u64,
}

impl Model {
    fn new(cfg: &Cfg) -> Self {
        let n = cfg.num_blocks as usize;
        Self {
            cfg: cfg.clone(),
            n,
            bss: cfg.block_sizes.iter().map(|&b| b as usize).collect(),
            pool: RefPool::new(cfg.num_blocks, cfg.caching),
            reqs: Vec::new(),
            events: Vec::new(),
            stats: PrefixCacheStats::default(),
            next_id: 0,
        }
    }

    fn groups(&self) -> usize {
        self.bss.len()
    }

    fn req(&mut self, id: &str) -> &mut MReq {
        self.reqs
            .iter_mut()
            .find(|r| r.id == id)
            .expect("known request")
    }

    fn get(&self, id: &str) -> MReq {
        self.reqs
            .iter()
            .find(|r| r.id == id)
            .expect("known request")
            .clone()
    }

    /// Turns the pool's evictions into `Removed` events.
    fn publish_evictions(&mut self) {
        for (group, prefix) in self.pool.evicted.drain(..) {
            if self.cfg.events {
                self.events.push(MEvent::Removed(group, prefix));
            }
        }
    }

    fn evict(&mut self, b: u32) {
        self.pool.evict(b);
        self.publish_evictions();
    }

    fn pop_new(&mut self, count: usize) -> Vec<u32> {
        let out = self.pool.get_new(count).expect("capacity checked");
        self.publish_evictions();
        out
    }

    /// Frees the request's blocks, each group's list tail first (one
    /// `free_blocks` call per group, group order).
    fn release(&mut self, id: &str) {
        let r = self.req(id);
        let ng = r.blocks.len();
        let blocks = std::mem::replace(&mut r.blocks, vec![Vec::new(); ng]);
        r.num_cached.iter_mut().for_each(|c| *c = 0);
        r.num_computed = 0;
        r.alloc_tokens = 0;
        r.admitted = false;
        for g in blocks {
            let rev: Vec<u32> = g.into_iter().rev().collect();
            self.pool.free(&rev);
        }
    }

    fn prefix_key(&self, r: &MReq, g: usize, i: usize) -> Option<MKey> {
        r.tokens
            .get(..(i + 1) * self.bss[g])
            .map(|p| (g as u32, p.to_vec()))
    }

    /// `get_computed_blocks`: the longest run of full-block prefixes cached in
    /// every group, at most `num_tokens - 1` tokens; EAGLE drops the last block.
    fn lookup(&mut self, id: &str) -> (Groups, u64) {
        let ng = self.groups();
        let r = self.get(id);
        let mut hit: Groups = vec![Vec::new(); ng];
        if !self.cfg.caching || r.skip_reading {
            return (hit, 0);
        }
        let bs = self.bss[0]; // equal in every group when caching
        let mut max_len = r.tokens.len() - 1;
        if self.cfg.eagle && ng > 1 {
            // vLLM's hybrid coordinator lets an EAGLE group match one block past
            // the candidate (bounded by the hashed tokens) before dropping it.
            let hbs = self.cfg.hash_block_size.map_or(bs, |h| h as usize);
            max_len = (max_len + bs).min(r.tokens.len() / hbs * hbs);
        }
        'blocks: for i in 0..max_len / bs {
            let mut found = Vec::new();
            for g in 0..ng {
                match self
                    .prefix_key(&r, g, i)
                    .and_then(|k| self.pool.map.get(&k))
                {
                    Some(list) => found.push(list[0]),
                    None => break 'blocks,
                }
            }
            for (g, b) in found.into_iter().enumerate() {
                hit[g].push(b);
            }
        }
        if self.cfg.eagle && !hit[0].is_empty() {
            for h in &mut hit {
                h.pop();
            }
        }
        self.req(id).pending_lookup = true;
        let t = (hit[0].len() * bs) as u64;
        (hit, t)
    }

    fn watermark_blocks(&self) -> usize {
        (self.cfg.watermark * f64::from(self.cfg.num_blocks)) as usize
    }

    /// Blocks all groups together need to hold `tokens`.
    fn blocks_for(&self, tokens: u64) -> u64 {
        self.bss.iter().map(|&bs| tokens.div_ceil(bs as u64)).sum()
    }

    /// Validation that can fail for the emulated scheduler's calls: a stale hit and
    /// a request that can never fit. Returns `need_slot` on success.
    fn precheck(&self, r: &MReq, a: &AllocateArgs, hit: Option<&Groups>) -> Result<u64, ErrKind> {
        if let Some(h) = hit {
            for (g, blocks) in h.iter().enumerate() {
                for (i, &b) in blocks.iter().enumerate() {
                    if b != 0 && self.pool.key[b as usize] != self.prefix_key(r, g, i) {
                        return Err(ErrKind::Stale);
                    }
                }
            }
        }
        let max_len = self.cfg.max_model_len;
        let total =
            (a.num_computed_tokens + a.num_new_computed_tokens + a.num_external_computed_tokens)
                .min(max_len);
        let need_slot = (total + a.num_new_tokens + a.num_lookahead_tokens).min(max_len);
        let usable = (self.n - 1) as u64;
        if self.blocks_for(need_slot) > usable {
            return Err(ErrKind::CannotFit);
        }
        let full = (r.tokens.len() as u64).min(max_len);
        if a.full_sequence_must_fit && self.blocks_for(full) > usable {
            return Err(ErrKind::CannotFit);
        }
        Ok(need_slot)
    }

    /// vLLM's `allocate_slots` for full-attention groups, naively.
    fn allocate(
        &mut self,
        id: &str,
        a: &AllocateArgs,
        hit: Option<&Groups>,
    ) -> Result<Option<Groups>, ErrKind> {
        let r = self.get(id);
        let need_slot = self.precheck(&r, a, hit)?;
        let ng = self.groups();
        let local = a.num_computed_tokens + a.num_new_computed_tokens;
        let ext = a.num_external_computed_tokens;
        let total = (local + ext).min(self.cfg.max_model_len);
        let admitting = hit.is_some() || !r.running();
        let empty: Groups = vec![Vec::new(); ng];
        let hit_blocks = hit.unwrap_or(&empty);
        // Blocks taken from the free queue to hold `tokens`: fresh ones plus hit
        // blocks that are eviction candidates (touching pulls them out).
        let need = |tokens: u64| -> usize {
            (0..ng)
                .map(|g| {
                    let fresh = (tokens.div_ceil(self.bss[g] as u64) as usize)
                        .saturating_sub(r.blocks[g].len() + hit_blocks[g].len());
                    let evictable = hit_blocks[g]
                        .iter()
                        .filter(|&&b| b != 0 && self.pool.refs[b as usize] == 0)
                        .count();
                    fresh + evictable
                })
                .sum()
        };
        let watermark = if admitting && a.has_scheduled_reqs {
            self.watermark_blocks()
        } else {
            0
        };
        let free = self.pool.queue.len();
        if a.full_sequence_must_fit {
            let full = (r.tokens.len() as u64).min(self.cfg.max_model_len);
            if need(full) + watermark > free {
                return Ok(None);
            }
        }
        if need(need_slot) + watermark + a.reserved_blocks as usize > free {
            return Ok(None);
        }
        // Adopt the hit in every group, then fresh blocks for the connector's
        // tokens (held, but not reported as new blocks).
        if (hit.is_some() || ext > 0) && !r.running() {
            for (g, hb) in hit_blocks.iter().enumerate().take(ng) {
                if self.cfg.caching {
                    self.pool.touch(hb);
                }
                let rm = self.req(id);
                rm.blocks[g].extend_from_slice(hb);
                rm.num_cached[g] = rm.blocks[g].len();
            }
            if ext > 0 {
                for g in 0..ng {
                    let count = ((local + ext).div_ceil(self.bss[g] as u64) as usize)
                        .saturating_sub(self.req(id).blocks[g].len());
                    let got = self.pop_new(count);
                    self.req(id).blocks[g].extend(got);
                }
            }
        }
        let mut new: Groups = Vec::new();
        for g in 0..ng {
            let have = self.req(id).blocks[g].len();
            let got = self
                .pop_new((need_slot.div_ceil(self.bss[g] as u64) as usize).saturating_sub(have));
            self.req(id).blocks[g].extend_from_slice(&got);
            new.push(got);
        }
        // Publish the full blocks of committed tokens.
        if self.cfg.caching && !a.delay_cache_blocks {
            let to_cache = (total + a.num_new_tokens).min(r.tokens.len() as u64) as usize;
            self.cache_upto(id, to_cache);
        }
        let log_stats = self.cfg.log_stats;
        let rm = self.req(id);
        rm.admitted = true;
        rm.alloc_tokens = rm.alloc_tokens.max(need_slot);
        if admitting && rm.pending_lookup {
            rm.pending_lookup = false;
            let (n, pre) = (rm.tokens.len() as u64, rm.preemptions > 0);
            if log_stats {
                self.stats.record(n, a.num_new_computed_tokens, pre);
            }
        }
        Ok(Some(new))
    }

    /// Publishes, group by group, the request's full blocks covering `to_cache`
    /// tokens (from the first not yet published), one `BlockStored` per group.
    fn cache_upto(&mut self, id: &str, to_cache: usize) {
        for g in 0..self.groups() {
            let rm = self.get(id);
            let bs = self.bss[g];
            let (from, full) = (rm.num_cached[g], (to_cache / bs).min(rm.blocks[g].len()));
            if full <= from {
                continue;
            }
            let prefix = |i: usize| rm.tokens[..(i + 1) * bs].to_vec();
            for i in from..full {
                let b = rm.blocks[g][i];
                if b != 0 && self.pool.cache(b, (g as u32, prefix(i))) {}
            }
            if self.cfg.events {
                self.events.push(MEvent::Stored {
                    group: g as u32,
                    blocks: (from..full).map(prefix).collect(),
                    parent: (from > 0).then(|| prefix(from - 1)),
                    token_ids: rm.tokens[from * bs..full * bs].to_vec(),
                });
            }
            self.req(id).num_cached[g] = full;
        }
    }

    fn evict_blocks(&mut self, ids: &[u32]) -> Result<(), ErrKind> {
        if ids.iter().any(|&b| b as usize >= self.n) {
            return Err(ErrKind::Invalid);
        }
        for &b in ids {
            self.evict(b);
        }
        Ok(())
    }

    fn reset(&mut self) -> bool {
        if !self.pool.reset() {
            return false;
        }
        if self.cfg.events {
            self.events.push(MEvent::Cleared);
        }
        if self.cfg.log_stats {
            self.stats.reset = true;
        }
        true
    }
}

// ---------------------------------------------------------------------------
// Comparison
// ---------------------------------------------------------------------------

/// The manager's hashes <-> the model's prefixes, learnt as requests are seen.
#[derive(Default)]
struct Bijection {
    to_prefix: HashMap<BlockHash, Vec<u32>>,
    to_hash: HashMap<Vec<u32>, BlockHash>,
}

impl Bijection {
    fn learn(&mut self, h: BlockHash, prefix: &[u32]) -> Result<(), TestCaseError> {
        if let Some(p) = self.to_prefix.get(&h) {
            prop_assert_eq!(&p[..], prefix, "one hash for two prefixes");
        }
        if let Some(x) = self.to_hash.get(prefix) {
            prop_assert_eq!(*x, h, "one prefix with two hashes (len {})", prefix.len());
        }
        self.to_prefix.insert(h, prefix.to_vec());
        self.to_hash.insert(prefix.to_vec(), h);
        Ok(())
    }

    fn prefix(&self, h: &BlockHash) -> Result<Vec<u32>, TestCaseError> {
        self.to_prefix
            .get(h)
            .cloned()
            .ok_or_else(|| TestCaseError::fail(format!("hash {h:?} of no known prefix")))
    }
}

#[allow(clippy::too_many_lines)] // every observable against the model, in one pass
fn check_all(
    mgr: &mut KvCacheManager,
    m: &mut Model,
    bij: &mut Bijection,
    ctx: &str,
) -> Result<(), TestCaseError> {
    if let Err(e) = mgr.check_invariants() {
        return Err(TestCaseError::fail(format!("{ctx}: check_invariants: {e}")));
    }
    let pool = mgr.pool();
    let n = m.n;
    support::ref_pool::check_same_queue_and_refs(pool, &m.pool, ctx)?;
    prop_assert_eq!(
        mgr.num_free_blocks(),
        pool.num_free_blocks(),
        "{}: num_free",
        ctx
    );
    prop_assert!((mgr.usage() - pool.usage()).abs() < 1e-12, "{}: usage", ctx);
    prop_assert_eq!(mgr.num_requests(), m.reqs.len(), "{}: request count", ctx);

    // Learn hashes of every live request; hashes exist iff caching or events.
    let hbs = m.cfg.hbs();
    let hashing = m.cfg.caching || m.cfg.events;
    for r in &m.reqs {
        let hashes = mgr
            .block_hashes(&r.id)
            .map_err(|e| TestCaseError::fail(format!("{e}")))?
            .to_vec();
        let want = if hashing { r.tokens.len() / hbs } else { 0 };
        prop_assert_eq!(hashes.len(), want, "{}: hash count of {}", ctx, r.id);
        for (j, h) in hashes.iter().enumerate() {
            bij.learn(*h, &r.tokens[..(j + 1) * hbs])?;
        }
    }
    let pool = mgr.pool();
    for b in 0..n as u32 {
        let got = match pool.block_key(b) {
            None => None,
            Some(k) => Some((k.group, bij.prefix(&k.hash)?)),
        };
        prop_assert_eq!(
            got,
            m.pool.key[b as usize].clone(),
            "{}: key of block {}",
            ctx,
            b
        );
    }
    for ((group, prefix), list) in &m.pool.map {
        let Some(&h) = bij.to_hash.get(prefix) else {
            return Err(TestCaseError::fail(format!(
                "{ctx}: model key of unknown hash"
            )));
        };
        let k = CacheKey {
            hash: h,
            group: *group,
        };
        prop_assert_eq!(
            &pool.cached_blocks(&k),
            list,
            "{}: blocks cached under prefix len {}",
            ctx,
            prefix.len()
        );
    }
    prop_assert_eq!(
        pool.num_cached_keys(),
        m.pool.map.len(),
        "{}: cached key count",
        ctx
    );

    // Per request: blocks, tokens, preemptions; model-free block-count properties.
    let mut held = HashSet::new();
    let num_running = m.reqs.iter().filter(|r| r.admitted).count();
    for r in &m.reqs {
        let ids = mgr
            .block_ids(&r.id)
            .map_err(|e| TestCaseError::fail(format!("{e}")))?;
        prop_assert_eq!(ids.len(), m.groups());
        let mut common = Vec::new();
        for (g, got) in ids.iter().enumerate() {
            let bs = m.bss[g] as u64;
            prop_assert_eq!(
                *got,
                &r.blocks[g][..],
                "{}: blocks of {} in group {}",
                ctx,
                r.id,
                g
            );
            prop_assert_eq!(
                got.len() as u64,
                r.alloc_tokens.div_ceil(bs),
                "{}: block count of {}",
                ctx,
                r.id
            );
            prop_assert!(
                got.len() as u64 * bs >= r.num_computed,
                "{}: computed tokens without blocks",
                ctx
            );
            held.extend(got.iter().copied().filter(|&b| b != 0));
            common.push(
                got.iter()
                    .take_while(|&&b| m.pool.refs[b as usize] as usize == num_running)
                    .count() as u32,
            );
        }
        prop_assert_eq!(
            mgr.num_tokens(&r.id).ok(),
            Some(r.tokens.len()),
            "{}: tokens of {}",
            ctx,
            r.id
        );
        prop_assert_eq!(
            mgr.num_preemptions(&r.id).ok(),
            Some(r.preemptions),
            "{}: preemptions",
            ctx
        );
        if r.admitted {
            prop_assert_eq!(
                mgr.get_num_common_prefix_blocks(&r.id).ok(),
                Some(common),
                "{}: common prefix blocks of {}",
                ctx,
                r.id
            );
        }
    }
    prop_assert_eq!(
        mgr.num_free_blocks() as usize + held.len(),
        n - 1,
        "{}: free + distinct held blocks != usable blocks",
        ctx
    );

    // Events, hashes translated through the bijection.
    let evs = mgr.take_events();
    let mut got = Vec::new();
    for ev in evs {
        got.push(match ev {
            KvEvent::BlockStored(s) => {
                prop_assert_eq!(s.block_size as usize, m.bss[s.group_idx as usize]);
                prop_assert_eq!(s.lora_id, None);
                prop_assert_eq!(s.lora_name, None);
                let kind = if m.cfg.mla {
                    "mla_attention"
                } else {
                    "full_attention"
                };
                prop_assert_eq!(s.kv_cache_spec_kind, Some(kind));
                prop_assert_eq!(s.kv_cache_spec_sliding_window, None);
                prop_assert_eq!(
                    s.extra_keys.clone(),
                    Some(vec![None; s.block_hashes.len()]),
                    "{}: extra keys",
                    ctx
                );
                MEvent::Stored {
                    group: s.group_idx,
                    blocks: s
                        .block_hashes
                        .iter()
                        .map(|h| bij.prefix(h))
                        .collect::<Result<_, _>>()?,
                    parent: s.parent_block_hash.map(|h| bij.prefix(&h)).transpose()?,
                    token_ids: s.token_ids,
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                group_idx,
            } => {
                prop_assert_eq!(block_hashes.len(), 1);
                MEvent::Removed(group_idx, bij.prefix(&block_hashes[0])?)
            }
            KvEvent::AllBlocksCleared => MEvent::Cleared,
        });
    }
    prop_assert_eq!(got, std::mem::take(&mut m.events), "{}: events", ctx);
    Ok(())
}

// ---------------------------------------------------------------------------
// Driver
// ---------------------------------------------------------------------------

fn pick(m: &Model, idx: &Index, f: impl Fn(&MReq) -> bool) -> Option<String> {
    let c: Vec<&MReq> = m.reqs.iter().filter(|r| f(r)).collect();
    (!c.is_empty()).then(|| c[idx.index(c.len())].id.clone())
}

/// Model-free: every hit block is cached under the request's own chain hash at
/// its position, in its group; every group hits the same number of tokens.
fn check_hit_is_own_chain(
    mgr: &KvCacheManager,
    id: &str,
    hit: &ComputedBlocks,
    bss: &[usize],
    ctx: &str,
) -> Result<(), TestCaseError> {
    let hashes = mgr
        .block_hashes(id)
        .map_err(|e| TestCaseError::fail(format!("{e}")))?;
    let hbs = mgr.hash_block_size();
    prop_assert_eq!(hit.block_ids.len(), bss.len());
    for (g, blocks) in hit.block_ids.iter().enumerate() {
        let scale = bss[g] / hbs;
        for (i, &b) in blocks.iter().enumerate() {
            let want = CacheKey {
                hash: hashes[(i + 1) * scale - 1],
                group: g as u32,
            };
            prop_assert_eq!(
                mgr.pool().block_key(b),
                Some(want),
                "{}: hit block {} is not the request's chain",
                ctx,
                i
            );
        }
        prop_assert_eq!(
            hit.num_computed_tokens,
            (blocks.len() * bss[g]) as u64,
            "{}: hit length",
            ctx
        );
    }
    Ok(())
}

fn do_lookup(
    mgr: &mut KvCacheManager,
    m: &mut Model,
    id: &str,
    ctx: &str,
) -> Result<KeptHit, TestCaseError> {
    let real = mgr
        .get_computed_blocks(id)
        .map_err(|e| TestCaseError::fail(format!("{ctx}: lookup: {e}")))?;
    let (blocks, tokens) = m.lookup(id);
    prop_assert_eq!(&real.block_ids, &blocks, "{}: hit blocks", ctx);
    prop_assert_eq!(real.num_computed_tokens, tokens, "{}: hit tokens", ctx);
    prop_assert_eq!(real.shared_prefix_boundary, 0);
    prop_assert_eq!(real.is_empty(), tokens == 0);
    check_hit_is_own_chain(mgr, id, &real, &m.bss, ctx)?;
    Ok(KeptHit {
        real,
        blocks,
        tokens,
    })
}

fn compare_alloc(
    got: Result<Option<&[Vec<u32>]>, Error>,
    want: Result<Option<Groups>, ErrKind>,
    ctx: &str,
) -> Result<bool, TestCaseError> {
    match (got, want) {
        (Ok(Some(g)), Ok(Some(w))) => {
            prop_assert_eq!(g, &w[..], "{}: new blocks", ctx);
            Ok(true)
        }
        (Ok(None), Ok(None)) => Ok(false),
        (Err(e), Err(k)) => {
            prop_assert_eq!(kind(&e), k, "{}: error {}", ctx, e);
            Ok(false)
        }
        (g, w) => Err(TestCaseError::fail(format!(
            "{ctx}: manager returned {:?}, model {:?}",
            g.map(|o| o.map(<[Vec<u32>]>::to_vec)),
            w
        ))),
    }
}

#[allow(clippy::too_many_lines)] // one arm per operation of the model
fn run(cfg: &Cfg, bases: &[Vec<u32>], ops: &[Op]) -> Result<(), TestCaseError> {
    let mut mgr = KvCacheManager::new(cfg.manager_config())
        .map_err(|e| TestCaseError::fail(format!("config: {e}")))?;
    let mut m = Model::new(cfg);
    let mut bij = Bijection::default();
    let max_len = cfg.max_model_len;
    check_all(&mut mgr, &mut m, &mut bij, "fresh")?;
    for (step, op) in ops.iter().enumerate() {
        let ctx = format!("step {step} {op:?}");
        match op {
            Op::Add {
                base,
                len,
                suffix,
                skip_reading,
            } => {
                let b = &bases[base.index(bases.len())];
                // Prompts mostly fit in half the pool (so several requests share it),
                // sometimes up to the whole pool; the suffix may push past it.
                let per_token: f64 = cfg.block_sizes.iter().map(|&b| 1.0 / f64::from(b)).sum();
                let usable = (f64::from(cfg.num_blocks - 1) / per_token) as usize;
                let cap = if len.index(4) == 0 {
                    usable
                } else {
                    usable / 2
                };
                let cap = cap.clamp(1, b.len());
                let mut prompt = b[..len.index(cap + 1)].to_vec();
                prompt.extend_from_slice(suffix);
                if prompt.is_empty() {
                    prompt.push(0);
                }
                let id = format!("r{}", m.next_id);
                m.next_id += 1;
                let spec = RequestSpec {
                    prompt_token_ids: prompt.clone(),
                    skip_reading_prefix_cache: *skip_reading,
                    ..RequestSpec::default()
                };
                let res = mgr.add_request(&id, spec);
                if prompt.len() as u64 > max_len {
                    prop_assert!(
                        matches!(res, Err(Error::InvalidArgument(_))),
                        "{}: overlong prompt accepted",
                        ctx
                    );
                } else {
                    prop_assert!(res.is_ok(), "{}: add_request failed: {:?}", ctx, res);
                    m.reqs
                        .push(MReq::new(&id, prompt, cfg.block_sizes.len(), *skip_reading));
                }
            }
            Op::Lookup { req } => {
                if let Some(id) = pick(&m, req, |r| !r.running()) {
                    let kept = do_lookup(&mut mgr, &mut m, &id, &ctx)?;
                    m.req(&id).kept_hit = Some(kept);
                }
            }
            Op::Admit {
                req,
                chunk,
                reuse_kept_hit,
                lookahead,
                none_if_empty,
                ext,
                delay,
                gate,
            } => {
                let Some(id) = pick(&m, req, |r| !r.running()) else {
                    continue;
                };
                let kept = match (reuse_kept_hit, m.req(&id).kept_hit.clone()) {
                    (true, Some(k)) => k,
                    _ => do_lookup(&mut mgr, &mut m, &id, &ctx)?,
                };
                let num_tokens = m.req(&id).tokens.len() as u64;
                let ext = u64::from(*ext).min(num_tokens - kept.tokens);
                let remaining = num_tokens - kept.tokens - ext;
                let num_new = chunk.map_or(remaining, |c| u64::from(c).min(remaining));
                let args = AllocateArgs {
                    num_new_computed_tokens: kept.tokens,
                    num_lookahead_tokens: u64::from(*lookahead),
                    num_external_computed_tokens: ext,
                    delay_cache_blocks: *delay,
                    full_sequence_must_fit: gate.full_sequence_must_fit,
                    reserved_blocks: u64::from(gate.reserved_blocks),
                    has_scheduled_reqs: gate.has_scheduled_reqs,
                    ..AllocateArgs::step(num_new, 0)
                };
                let pass_none = *none_if_empty && kept.tokens == 0;
                let (real_hit, model_hit) = if pass_none {
                    (None, None)
                } else {
                    (Some(&kept.real), Some(&kept.blocks))
                };
                let want = m.allocate(&id, &args, model_hit);
                let got = mgr.allocate_slots(&id, &args, real_hit);
                let failed_stale = matches!(want, Err(ErrKind::Stale));
                if compare_alloc(got, want, &ctx)? {
                    let r = m.req(&id);
                    r.num_computed = kept.tokens + ext + num_new;
                    r.kept_hit = None;
                } else if failed_stale {
                    m.req(&id).kept_hit = None;
                } else {
                    // Not admitted: the hit stays usable for a later try.
                    m.req(&id).kept_hit = Some(kept);
                }
            }
            Op::Step {
                req,
                chunk,
                lookahead,
                token,
            } => {
                let Some(id) = pick(&m, req, MReq::running) else {
                    continue;
                };
                let (nc, nt) = {
                    let r = m.req(&id);
                    (r.num_computed, r.tokens.len() as u64)
                };
                if nc == nt {
                    if nt >= max_len {
                        // Finished: the scheduler removes it.
                        prop_assert!(mgr.remove_request(&id).is_ok());
                        m.release(&id);
                        m.reqs.retain(|r| r.id != id);
                        check_all(&mut mgr, &mut m, &mut bij, &ctx)?;
                        continue;
                    }
                    prop_assert!(mgr.append_token_ids(&id, &[*token]).is_ok());
                    m.req(&id).tokens.push(*token);
                }
                let nt = m.req(&id).tokens.len() as u64;
                let remaining = nt - nc;
                let num_new = chunk.map_or(remaining, |c| u64::from(c).min(remaining));
                let args = AllocateArgs {
                    num_lookahead_tokens: u64::from(*lookahead),
                    // Now and then a step whose caching an async load delays
                    // (the decode fast path serves it when nothing fills).
                    delay_cache_blocks: token % 5 == 0,
                    ..AllocateArgs::step(num_new, nc)
                };
                // Full attention never skips blocks: both are no-ops.
                mgr.new_step_starts();
                prop_assert!(mgr.remove_skipped_blocks(&id, nc).is_ok());
                let want = m.allocate(&id, &args, None);
                let got = mgr.allocate_slots(&id, &args, None);
                if compare_alloc(got, want, &ctx)? {
                    m.req(&id).num_computed = nc + num_new;
                }
            }
            Op::Batch {
                picks,
                lookahead,
                token,
                fused,
            } => {
                let mut cands: Vec<String> = m
                    .reqs
                    .iter()
                    .filter(|r| {
                        r.running()
                            && !(r.num_computed == r.tokens.len() as u64
                                && r.tokens.len() as u64 >= max_len)
                    })
                    .map(|r| r.id.clone())
                    .collect();
                let mut chosen = Vec::new();
                for p in picks {
                    if cands.is_empty() {
                        break;
                    }
                    chosen.push(cands.remove(p.index(cands.len())));
                }
                if chosen.is_empty() {
                    continue;
                }
                let mut news = Vec::new();
                let mut comps = Vec::new();
                let mut appended = Vec::new();
                for id in &chosen {
                    let r = m.req(id);
                    let sampled = r.num_computed == r.tokens.len() as u64;
                    if sampled {
                        r.tokens.push(*token);
                        if !*fused {
                            prop_assert!(mgr.append_token_ids(id, &[*token]).is_ok());
                        }
                    }
                    appended.push(sampled.then_some(*token));
                    let r = m.req(id);
                    news.push(r.tokens.len() as u64 - r.num_computed);
                    comps.push(r.num_computed);
                }
                let la = u64::from(*lookahead);
                let mut out = BatchAllocation::default();
                let ids: Vec<&str> = chosen.iter().map(String::as_str).collect();
                let res = if *fused {
                    let step = BatchStep {
                        num_lookahead_tokens: la,
                        append_token_ids: Some(&appended),
                        ..BatchStep::new(RequestRefs::Ids(&ids), &news, Some(&comps))
                    };
                    mgr.allocate_slots_batch_step(&step, &mut out)
                } else {
                    mgr.allocate_slots_batch(&ids, &news, &comps, la, &mut out)
                };
                // Model: every entry validated first, then one by one until one does not fit.
                let args: Vec<AllocateArgs> = (0..chosen.len())
                    .map(|i| AllocateArgs {
                        num_lookahead_tokens: la,
                        ..AllocateArgs::step(news[i], comps[i])
                    })
                    .collect();
                let mut pre_err = None;
                for (i, id) in chosen.iter().enumerate() {
                    let r = m.reqs.iter().find(|r| &r.id == id).expect("known").clone();
                    if let Err(k) = m.precheck(&r, &args[i], None) {
                        pre_err = Some(k);
                        break;
                    }
                }
                if let Some(k) = pre_err {
                    if *fused {
                        // A refused call appends nothing either.
                        for (id, t) in chosen.iter().zip(&appended) {
                            if t.is_some() {
                                m.req(id).tokens.pop();
                            }
                        }
                    }
                    match res {
                        Err(e) => prop_assert_eq!(kind(&e), k, "{}: batch error", ctx),
                        Ok(()) => {
                            return Err(TestCaseError::fail(format!(
                                "{ctx}: batch should fail with {k:?}"
                            )));
                        }
                    }
                } else {
                    prop_assert!(res.is_ok(), "{}: batch failed: {:?}", ctx, res);
                    let ng = m.groups();
                    let mut want_ids = vec![Vec::new(); ng];
                    let mut want_offsets = vec![vec![0u32]; ng];
                    let mut served = 0;
                    for (i, id) in chosen.iter().enumerate() {
                        match m.allocate(id, &args[i], None) {
                            Ok(Some(new)) => {
                                for (g, ids) in new.into_iter().enumerate() {
                                    want_ids[g].extend(ids);
                                    want_offsets[g].push(want_ids[g].len() as u32);
                                }
                                m.req(id).num_computed = comps[i] + news[i];
                                served += 1;
                            }
                            Ok(None) => break,
                            Err(k) => {
                                return Err(TestCaseError::fail(format!(
                                    "{ctx}: model batch error {k:?}"
                                )));
                            }
                        }
                    }
                    prop_assert_eq!(out.num_allocated, served, "{}: batch served", ctx);
                    prop_assert_eq!(&out.block_ids, &want_ids, "{}: batch blocks", ctx);
                    prop_assert_eq!(&out.offsets, &want_offsets, "{}: batch offsets", ctx);
                }
            }
            Op::CacheBlocks { req, overshoot } => {
                let Some(id) = pick(&m, req, MReq::running) else {
                    continue;
                };
                let r = m.req(&id).clone();
                if *overshoot {
                    let res = mgr.cache_blocks(&id, r.tokens.len() as u64 + 1);
                    prop_assert!(
                        matches!(res, Err(Error::InvalidArgument(_))),
                        "{}: {:?}",
                        ctx,
                        res
                    );
                } else {
                    prop_assert!(mgr.cache_blocks(&id, r.num_computed).is_ok());
                    if cfg.caching {
                        m.cache_upto(&id, r.num_computed as usize);
                    }
                }
            }
            Op::Preempt { req } => {
                let Some(id) = pick(&m, req, |_| true) else {
                    continue;
                };
                prop_assert!(mgr.free(&id).is_ok());
                // Only freeing a held allocation is a preemption.
                let was_admitted = m.get(&id).admitted;
                m.release(&id);
                if was_admitted {
                    m.req(&id).preemptions += 1;
                }
            }
            Op::Remove { req } => {
                let Some(id) = pick(&m, req, |_| true) else {
                    continue;
                };
                prop_assert!(mgr.remove_request(&id).is_ok());
                m.release(&id);
                m.reqs.retain(|r| r.id != id);
                prop_assert!(matches!(
                    mgr.remove_request(&id),
                    Err(Error::UnknownRequest(_))
                ));
            }
            Op::Evict { ids, out_of_range } => {
                let mut v: Vec<u32> = ids.iter().map(|i| i.index(m.n) as u32).collect();
                if *out_of_range {
                    let at = ids.first().map_or(0, |i| i.index(v.len() + 1));
                    v.insert(at, m.n as u32);
                }
                let got = mgr.evict_blocks(&v).map_err(|e| kind(&e));
                prop_assert_eq!(got, m.evict_blocks(&v), "{}: evict_blocks", ctx);
            }
            Op::Reset => {
                prop_assert_eq!(
                    mgr.reset_prefix_cache(),
                    m.reset(),
                    "{}: reset_prefix_cache",
                    ctx
                );
            }
            Op::Misuse { which, req, other } => misuse(&mut mgr, &mut m, *which, req, other, &ctx)?,
            Op::Stats => {
                let want = cfg.log_stats.then(|| std::mem::take(&mut m.stats));
                prop_assert_eq!(mgr.make_prefix_cache_stats(), want, "{}: stats", ctx);
            }
        }
        check_all(&mut mgr, &mut m, &mut bij, &ctx)?;
    }
    // Removing every request returns every block to the free queue.
    let ids: Vec<String> = m.reqs.iter().map(|r| r.id.clone()).collect();
    for id in ids {
        prop_assert!(mgr.remove_request(&id).is_ok());
        m.release(&id);
        m.reqs.retain(|r| r.id != id);
        check_all(&mut mgr, &mut m, &mut bij, "final removal")?;
    }
    prop_assert_eq!(
        mgr.num_free_blocks(),
        cfg.num_blocks - 1,
        "blocks leaked after removing every request"
    );
    prop_assert_eq!(mgr.num_requests(), 0);
    prop_assert!(mgr.reset_prefix_cache(), "reset refused with nothing held");
    prop_assert_eq!(mgr.pool().num_cached_keys(), 0);
    Ok(())
}

/// Performs one refused call; lookups it makes are mirrored in the model.
#[allow(clippy::too_many_lines)] // one arm per refused call
fn misuse(
    mgr: &mut KvCacheManager,
    m: &mut Model,
    which: u8,
    req: &Index,
    other: &Index,
    ctx: &str,
) -> Result<(), TestCaseError> {
    let expect = |res: Result<(), Error>, k: ErrKind, what: &str| -> Result<(), TestCaseError> {
        match res {
            Err(e) => {
                prop_assert_eq!(kind(&e), k, "{}: {}: {}", ctx, what, e);
                Ok(())
            }
            Ok(()) => Err(TestCaseError::fail(format!("{ctx}: {what} was accepted"))),
        }
    };
    let alloc =
        |mgr: &mut KvCacheManager, id: &str, a: &AllocateArgs, h: Option<&ComputedBlocks>| {
            mgr.allocate_slots(id, a, h).map(|_| ())
        };
    let min_bs = u64::from(m.cfg.min_bs());
    match which {
        // Unknown ids are refused by every per-request call.
        0 => {
            expect(
                alloc(mgr, "nope", &AllocateArgs::step(1, 0), None),
                ErrKind::Unknown,
                "allocate unknown",
            )?;
            expect(mgr.free("nope"), ErrKind::Unknown, "free unknown")?;
            expect(
                mgr.remove_request("nope"),
                ErrKind::Unknown,
                "remove unknown",
            )?;
            expect(
                mgr.get_computed_blocks("nope").map(|_| ()),
                ErrKind::Unknown,
                "lookup unknown",
            )?;
            expect(
                mgr.append_token_ids("nope", &[1]),
                ErrKind::Unknown,
                "append unknown",
            )?;
            expect(
                mgr.cache_blocks("nope", 0),
                ErrKind::Unknown,
                "cache_blocks unknown",
            )?;
            expect(
                mgr.num_tokens("nope").map(|_| ()),
                ErrKind::Unknown,
                "num_tokens unknown",
            )?;
            // An empty prompt is refused.
            let r = mgr.add_request("empty", RequestSpec::default()).map(|_| ());
            expect(r, ErrKind::Invalid, "empty prompt")?;
            return Ok(());
        }
        // A batch with one bad entry changes nothing, not even for the good entries.
        1 => {
            let ids: Vec<String> = m
                .reqs
                .iter()
                .filter(|r| r.running())
                .map(|r| r.id.clone())
                .collect();
            let mut names: Vec<&str> = ids.iter().map(String::as_str).collect();
            let mut news: Vec<u64> = names.iter().map(|_| 1).collect();
            let mut comps: Vec<u64> = ids
                .iter()
                .map(|id| {
                    m.reqs
                        .iter()
                        .find(|r| &r.id == id)
                        .map_or(0, |r| r.num_computed.saturating_sub(1))
                })
                .collect();
            names.push("nope");
            news.push(1);
            comps.push(0);
            let mut out = BatchAllocation::default();
            return expect(
                mgr.allocate_slots_batch(&names, &news, &comps, 0, &mut out),
                ErrKind::Unknown,
                "batch",
            );
        }
        _ => {}
    }
    let Some(id) = pick(m, req, |_| true) else {
        return Ok(());
    };
    let r = m.reqs.iter().find(|r| r.id == id).expect("known").clone();
    match which {
        2 => expect(
            alloc(mgr, &id, &AllocateArgs::step(0, r.num_computed), None),
            ErrKind::Invalid,
            "zero new tokens",
        ),
        3 => {
            // More tokens than the request has.
            let a = AllocateArgs::step(r.tokens.len() as u64 + 1 - r.num_computed, r.num_computed);
            let a = AllocateArgs {
                num_new_tokens: 1,
                num_external_computed_tokens: a.num_new_tokens,
                ..a
            };
            expect(
                alloc(mgr, &id, &a, None),
                ErrKind::Invalid,
                "computed past the request's tokens",
            )
        }
        4 => {
            // num_computed_tokens beyond what the held blocks cover.
            let nc = (0..m.groups())
                .map(|g| (r.blocks[g].len() * m.bss[g]) as u64)
                .min()
                .unwrap_or(0)
                + 1;
            if nc > r.tokens.len() as u64 {
                return Ok(());
            }
            expect(
                alloc(mgr, &id, &AllocateArgs::step(1, nc), None),
                ErrKind::Invalid,
                "computed beyond held blocks",
            )
        }
        5 => {
            // num_new_computed_tokens without the hit it came from.
            let a = AllocateArgs {
                num_new_computed_tokens: 1,
                ..AllocateArgs::step(1, 0)
            };
            if r.running() {
                return Ok(());
            }
            expect(
                alloc(mgr, &id, &a, None),
                ErrKind::Invalid,
                "new computed tokens without a hit",
            )
        }
        6 => {
            // A hit looked up for another request.
            let Some(oid) = pick(m, other, |o| o.id != id) else {
                return Ok(());
            };
            let h = mgr
                .get_computed_blocks(&oid)
                .map_err(|e| TestCaseError::fail(format!("{e}")))?;
            let _ = m.lookup(&oid);
            let a = AllocateArgs::step(1, r.num_computed.min(r.tokens.len() as u64 - 1));
            expect(alloc(mgr, &id, &a, Some(&h)), ErrKind::Stale, "foreign hit")
        }
        7 => {
            // A hit from another manager with the same configuration.
            let mut other_mgr = KvCacheManager::new(m.cfg.manager_config())
                .map_err(|e| TestCaseError::fail(format!("{e}")))?;
            let spec = RequestSpec {
                prompt_token_ids: r.tokens.clone(),
                ..RequestSpec::default()
            };
            prop_assert!(other_mgr.add_request(&id, spec).is_ok());
            let h = other_mgr
                .get_computed_blocks(&id)
                .map_err(|e| TestCaseError::fail(format!("{e}")))?;
            let a = AllocateArgs::step(1, r.num_computed.min(r.tokens.len() as u64 - 1));
            expect(
                alloc(mgr, &id, &a, Some(&h)),
                ErrKind::Stale,
                "hit of another manager",
            )
        }
        8 => {
            // A hit claiming more tokens than it covers.
            if r.running() {
                return Ok(());
            }
            let h = mgr
                .get_computed_blocks(&id)
                .map_err(|e| TestCaseError::fail(format!("{e}")))?;
            let _ = m.lookup(&id);
            let nnc = h.num_computed_tokens + min_bs;
            if nnc >= r.tokens.len() as u64 {
                return Ok(());
            }
            let a = AllocateArgs {
                num_new_computed_tokens: nnc,
                ..AllocateArgs::step(1, 0)
            };
            expect(
                alloc(mgr, &id, &a, Some(&h)),
                ErrKind::Invalid,
                "hit shorter than num_new_computed_tokens",
            )
        }
        _ => {
            // A non-empty hit offered to a request that already holds blocks;
            // a duplicate id.
            let dup = mgr.add_request(
                &id,
                RequestSpec {
                    prompt_token_ids: vec![1],
                    ..RequestSpec::default()
                },
            );
            prop_assert!(
                matches!(dup, Err(Error::DuplicateRequest(_))),
                "{}: duplicate id: {:?}",
                ctx,
                dup
            );
            if !r.running() {
                return Ok(());
            }
            let h = mgr
                .get_computed_blocks(&id)
                .map_err(|e| TestCaseError::fail(format!("{e}")))?;
            let (_, tokens) = m.lookup(&id);
            if tokens == 0 {
                return Ok(());
            }
            let a = AllocateArgs {
                num_new_computed_tokens: h.num_computed_tokens,
                ..AllocateArgs::step(1, 0)
            };
            expect(
                alloc(mgr, &id, &a, Some(&h)),
                ErrKind::Invalid,
                "hit for a running request",
            )
        }
    }
}

fn bases_strategy() -> impl Strategy<Value = Vec<Vec<u32>>> {
    prop::collection::vec(prop::collection::vec(0u32..4, 80), 2)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn manager_matches_naive_reference_model_op_by_op(
        cfg in cfg_strategy(
            2..=64,
            any::<bool>().boxed(),
            prop::sample::select(vec![1usize, 1, 1, 1, 1, 2, 3, 9]).boxed(),
        ),
        bases in bases_strategy(),
        ops in prop::collection::vec(op_strategy(), 1..60),
    ) {
        run(&cfg, &bases, &ops)?;
    }

    /// Tight pools with caching on: evictions, stale hits, duplicates and
    /// allocation failures are frequent.
    #[test]
    fn manager_matches_model_under_memory_pressure_with_caching(
        cfg in cfg_strategy(2..=8, Just(true).boxed(), Just(1usize).boxed()),
        bases in bases_strategy(),
        ops in prop::collection::vec(op_strategy(), 1..60),
    ) {
        run(&cfg, &bases, &ops)?;
    }
}

// ---------------------------------------------------------------------------
// Deterministic checks of the model and of paths the random walk rarely takes
// ---------------------------------------------------------------------------

fn plain_cfg(num_blocks: u32, block_size: u32) -> Cfg {
    Cfg {
        num_blocks,
        block_sizes: vec![block_size],
        mla: false,
        hash_block_size: None,
        caching: true,
        events: false,
        eagle: false,
        watermark: 0.0,
        algo: HashAlgo::Sha256Cbor,
        max_model_len: 4096,
        log_stats: false,
    }
}

fn model_admit(m: &mut Model, id: &str, tokens: &[u32]) -> Option<Vec<u32>> {
    m.reqs.push(MReq::new(id, tokens.to_vec(), 1, false));
    let (hit, t) = m.lookup(id);
    let a = AllocateArgs {
        num_new_computed_tokens: t,
        ..AllocateArgs::step(tokens.len() as u64 - t, 0)
    };
    m.allocate(id, &a, Some(&hit))
        .expect("valid")
        .map(|g| g[0].clone())
}

/// The model itself reproduces vLLM's `test_prefill` ids (reference §3.4, 0.33
/// free policy), so agreeing with it is agreeing with vLLM.
#[test]
fn reference_model_reproduces_vllm_test_prefill_ids() {
    let mut m = Model::new(&plain_cfg(11, 16));
    let common: Vec<u32> = (0..48).collect();
    let with =
        |tail: std::ops::Range<u32>| common.iter().copied().chain(tail).collect::<Vec<u32>>();
    assert_eq!(
        model_admit(&mut m, "r0", &with(100..107)),
        Some(vec![1, 2, 3, 4])
    );
    assert_eq!(model_admit(&mut m, "r1", &with(200..205)), Some(vec![5]));
    assert_eq!(m.req("r1").blocks, vec![vec![1, 2, 3, 5]]);
    m.release("r0");
    m.release("r1");
    assert_eq!(
        m.pool.queue.iter().copied().collect::<Vec<_>>(),
        vec![5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    );
    assert_eq!(model_admit(&mut m, "r2", &with(300..306)), Some(vec![5]));
    m.release("r2");
    let miss: Vec<u32> = (1000..1160).collect();
    assert_eq!(
        model_admit(&mut m, "r3", &miss),
        Some(vec![5, 4, 6, 7, 8, 9, 10, 3, 2, 1])
    );
    // The shared prefix was evicted on reuse; only r3's ten full blocks are cached.
    assert_eq!(m.pool.map.len(), 10);
    assert!(m.pool.key[1].as_ref().is_some_and(|k| k.1.len() == 160));
}

fn admit(
    mgr: &mut KvCacheManager,
    id: &str,
    tokens: &[u32],
    args: impl Fn(u64) -> AllocateArgs,
) -> Option<Vec<u32>> {
    mgr.add_request(
        id,
        RequestSpec {
            prompt_token_ids: tokens.to_vec(),
            ..RequestSpec::default()
        },
    )
    .expect("add");
    let hit = mgr.get_computed_blocks(id).expect("lookup");
    let a = AllocateArgs {
        num_new_computed_tokens: hit.num_computed_tokens,
        ..args(hit.num_computed_tokens)
    };
    mgr.allocate_slots(id, &a, Some(&hit))
        .expect("allocate")
        .map(|b| b[0].clone())
}

#[test]
fn lookup_never_covers_the_last_token_of_a_block_aligned_prompt() {
    let mut mgr = KvCacheManager::new(ManagerConfig::full_attention(10, 4, 4096)).expect("config");
    let p: Vec<u32> = (0..8).collect();
    assert_eq!(
        admit(&mut mgr, "a", &p, |h| AllocateArgs::step(8 - h, 0)),
        Some(vec![1, 2])
    );
    mgr.add_request(
        "b",
        RequestSpec {
            prompt_token_ids: p,
            ..RequestSpec::default()
        },
    )
    .expect("add");
    let hit = mgr.get_computed_blocks("b").expect("lookup");
    // Both blocks are cached, but the last token must be recomputed: one block.
    assert_eq!(hit.block_ids, vec![vec![1]]);
    assert_eq!(hit.num_computed_tokens, 4);
}

#[test]
fn identical_prompts_admitted_before_either_caches_become_duplicate_entries() {
    let mut mgr = KvCacheManager::new(ManagerConfig::full_attention(10, 2, 4096)).expect("config");
    let p = vec![7u32, 7, 8, 8, 9];
    for id in ["a", "b"] {
        mgr.add_request(
            id,
            RequestSpec {
                prompt_token_ids: p.clone(),
                ..RequestSpec::default()
            },
        )
        .expect("add");
    }
    let ha = mgr.get_computed_blocks("a").expect("lookup");
    let hb = mgr.get_computed_blocks("b").expect("lookup");
    assert!(ha.is_empty() && hb.is_empty());
    let a = mgr
        .allocate_slots("a", &AllocateArgs::step(5, 0), Some(&ha))
        .expect("alloc")
        .map(|b| b[0].clone());
    let b = mgr
        .allocate_slots("b", &AllocateArgs::step(5, 0), Some(&hb))
        .expect("alloc")
        .map(|b| b[0].clone());
    assert_eq!(a, Some(vec![1, 2, 3]));
    assert_eq!(b, Some(vec![4, 5, 6]));
    let k0 = mgr.pool().block_key(1).expect("cached");
    assert_eq!(mgr.pool().block_key(4), Some(k0));
    assert_eq!(mgr.pool().cached_blocks(&k0), vec![1, 4]);
    // A third request hits the first-inserted blocks.
    mgr.add_request(
        "c",
        RequestSpec {
            prompt_token_ids: p,
            ..RequestSpec::default()
        },
    )
    .expect("add");
    assert_eq!(
        mgr.get_computed_blocks("c").expect("lookup").block_ids,
        vec![vec![1, 2]]
    );
    // Removing "a" keeps its blocks cached (LRU tail); evicting one leaves the duplicate.
    mgr.remove_request("a").expect("remove");
    mgr.evict_blocks(&[1]).expect("evict");
    assert_eq!(mgr.pool().cached_blocks(&k0), vec![4]);
    assert_eq!(
        mgr.get_computed_blocks("c").expect("lookup").block_ids,
        vec![vec![4, 2]]
    );
    mgr.check_invariants().expect("invariants");
}

#[test]
fn delayed_admission_publishes_blocks_only_when_cache_blocks_is_called() {
    let mut mgr = KvCacheManager::new(ManagerConfig::full_attention(10, 2, 4096)).expect("config");
    let p = vec![1u32, 2, 3, 4, 5];
    // All five tokens arrive from a connector asynchronously: nothing to compute now.
    let new = admit(&mut mgr, "a", &p, |_| AllocateArgs {
        num_external_computed_tokens: 5,
        delay_cache_blocks: true,
        ..AllocateArgs::step(0, 0)
    });
    // Blocks for external tokens are held but not reported as new blocks.
    assert_eq!(new, Some(vec![]));
    assert_eq!(mgr.block_ids("a").expect("ids"), vec![&[1, 2, 3][..]]);
    assert_eq!(mgr.pool().num_cached_keys(), 0);
    mgr.cache_blocks("a", 5).expect("cache");
    assert_eq!(mgr.pool().num_cached_keys(), 2);
    assert!(mgr.pool().block_key(1).is_some() && mgr.pool().block_key(2).is_some());
    assert_eq!(mgr.pool().block_key(3), None);
    assert!(matches!(
        mgr.cache_blocks("a", 6),
        Err(Error::InvalidArgument(_))
    ));
    mgr.check_invariants().expect("invariants");
}
