//! Property tests of `KvCacheManager` (full attention, one group) against a naive
//! reference model of vLLM 0.33's allocate / free / lookup semantics.
//!
//! The model knows nothing about hashes: a cached block's key is the token prefix
//! it ends (`tokens[..(i + 1) * block_size]`), which is what the hash chain stands
//! for when there are no extra keys. Everything is `Vec`-based and O(n). The test
//! keeps a bijection between the manager's block hashes and the model's prefixes
//! (learnt from `block_hashes()` of live requests) and compares, after every op:
//! returned block ids, hit blocks and lengths, the free queue, ref counts, every
//! block's key, the prefix map (duplicates in insertion order), request block
//! lists, preemption counts, KV events and prefix-cache stats; plus model-free
//! properties (block-list length, hits are the request's own chain, free + held
//! blocks add up, `check_invariants`).
//!
//! Random ops are interpreted against the current state (request / block picks are
//! indices modulo what exists), emulating a scheduler: admission = lookup +
//! `allocate_slots` with the hit (whole prompt or a chunk), running steps =
//! chunked prefill or decode (append one token, allocate for it), batched decode,
//! preemption, removal, `evict_blocks`, `reset_prefix_cache`.

use std::collections::{HashMap, HashSet, VecDeque};

use pagedkv_core::{
    AllocateArgs, BatchAllocation, BlockHash, CacheKey, ComputedBlocks, Error, HashAlgo,
    KvCacheManager, KvEvent, ManagerConfig, PrefixCacheStats, RequestSpec,
};
use proptest::prelude::*;
use proptest::sample::Index;
use std::sync::Mutex;
static COV: Mutex<Option<HashMap<String, usize>>> = Mutex::new(None);
fn cov(k: &str) {
    let mut g = COV.lock().unwrap();
    *g.get_or_insert_with(HashMap::new)
        .entry(k.to_string())
        .or_default() += 1;
}

// ---------------------------------------------------------------------------
// Configuration and ops
// ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Cfg {
    num_blocks: u32,
    block_size: u32,
    /// `Some(d)`: an explicit hash block size dividing `block_size`.
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
            ManagerConfig::full_attention(self.num_blocks, self.block_size, self.max_model_len);
        c.enable_caching = self.caching;
        c.enable_kv_cache_events = self.events;
        c.use_eagle = self.eagle;
        c.watermark = self.watermark;
        c.hash_algo = self.algo;
        c.hash_block_size = self.hash_block_size;
        c.log_stats = self.log_stats;
        c
    }

    fn hbs(&self) -> usize {
        self.hash_block_size.unwrap_or(self.block_size) as usize
    }
}

fn cfg_strategy(
    num_blocks: std::ops::RangeInclusive<u32>,
    caching: BoxedStrategy<bool>,
) -> impl Strategy<Value = Cfg> {
    (
        num_blocks,
        prop::sample::select(vec![1u32, 2, 4, 16]),
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
                block_size,
                hbs_pick,
                caching,
                events,
                eagle,
                watermark,
                algo,
                max_model_len,
                log_stats,
            )| {
                let divisors: Vec<u32> = (1..=block_size).filter(|d| block_size % d == 0).collect();
                // Half the time the default (= block size), else any divisor.
                let hash_block_size = if hbs_pick.index(2) == 0 {
                    None
                } else {
                    Some(divisors[hbs_pick.index(divisors.len())])
                };
                Cfg {
                    num_blocks,
                    block_size,
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
    Admit {
        req: Index,
        chunk: Option<u8>,
        reuse_kept_hit: bool,
        lookahead: u8,
        none_if_empty: bool,
    },
    /// A running request's step: continue a chunked prefill, or decode one token.
    Step {
        req: Index,
        chunk: Option<u8>,
        lookahead: u8,
        token: u32,
    },
    /// `allocate_slots_batch` over distinct running requests (decode or prefill rest).
    Batch {
        picks: Vec<Index>,
        lookahead: u8,
        token: u32,
    },
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
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let tok = 0u32..3;
    prop_oneof![
        5 => (any::<Index>(), any::<Index>(), prop::collection::vec(0u32..3, 0..6), prop::bool::weighted(0.1))
            .prop_map(|(base, len, suffix, skip_reading)| Op::Add { base, len, suffix, skip_reading }),
        1 => any::<Index>().prop_map(|req| Op::Lookup { req }),
        6 => (any::<Index>(), prop::option::weighted(0.3, 1u8..20), prop::bool::weighted(0.3),
              prop::sample::select(vec![0u8, 0, 0, 1, 3]), prop::bool::weighted(0.2))
            .prop_map(|(req, chunk, reuse_kept_hit, lookahead, none_if_empty)| Op::Admit {
                req, chunk, reuse_kept_hit, lookahead, none_if_empty,
            }),
        7 => (any::<Index>(), prop::option::weighted(0.3, 1u8..20), prop::sample::select(vec![0u8, 0, 0, 1, 3]), tok.clone())
            .prop_map(|(req, chunk, lookahead, token)| Op::Step { req, chunk, lookahead, token }),
        2 => (prop::collection::vec(any::<Index>(), 1..5), prop::sample::select(vec![0u8, 0, 2]), tok)
            .prop_map(|(picks, lookahead, token)| Op::Batch { picks, lookahead, token }),
        2 => any::<Index>().prop_map(|req| Op::Preempt { req }),
        2 => any::<Index>().prop_map(|req| Op::Remove { req }),
        1 => (prop::collection::vec(any::<Index>(), 0..4), prop::bool::weighted(0.15))
            .prop_map(|(ids, out_of_range)| Op::Evict { ids, out_of_range }),
        1 => Just(Op::Reset),
        1 => Just(Op::Stats),
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
}

fn kind(e: &Error) -> ErrKind {
    match e {
        Error::StaleComputedBlocks(_) => ErrKind::Stale,
        Error::CannotFit(_) => ErrKind::CannotFit,
        Error::InvalidArgument(_) => ErrKind::Invalid,
        Error::UnknownRequest(_) => ErrKind::Unknown,
        other => panic!("unexpected error kind: {other:?}"),
    }
}

/// Events with prefixes in place of hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
enum MEvent {
    Stored {
        blocks: Vec<Vec<u32>>,
        parent: Option<Vec<u32>>,
        token_ids: Vec<u32>,
    },
    Removed(Vec<u32>),
    Cleared,
}

#[derive(Clone, Debug)]
struct KeptHit {
    real: ComputedBlocks,
    blocks: Vec<u32>,
    tokens: u64,
}

#[derive(Clone, Debug)]
struct MReq {
    id: String,
    tokens: Vec<u32>,
    blocks: Vec<u32>,
    /// Leading blocks already published to the prefix cache.
    num_cached: usize,
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
    fn running(&self) -> bool {
        !self.blocks.is_empty()
    }
}

struct Model {
    cfg: Cfg,
    n: usize,
    bs: usize,
    queue: VecDeque<u32>,
    refs: Vec<u32>,
    key: Vec<Option<Vec<u32>>>,
    /// Prefix -> blocks in insertion order (the first one is handed out).
    map: HashMap<Vec<u32>, Vec<u32>>,
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
            bs: cfg.block_size as usize,
            queue: (1..n as u32).collect(),
            refs: vec![0; n],
            key: vec![None; n],
            map: HashMap::new(),
            reqs: Vec::new(),
            events: Vec::new(),
            stats: PrefixCacheStats::default(),
            next_id: 0,
        }
    }

    fn req(&mut self, id: &str) -> &mut MReq {
        self.reqs
            .iter_mut()
            .find(|r| r.id == id)
            .expect("known request")
    }

    fn evict(&mut self, b: u32) {
        let Some(k) = self.key[b as usize].take() else {
            return;
        };
        let list = self.map.get_mut(&k).expect("keyed block is listed");
        list.retain(|&x| x != b);
        if list.is_empty() {
            self.map.remove(&k);
        }
        if self.cfg.events {
            self.events.push(MEvent::Removed(k));
        }
    }

    fn pop_new(&mut self, count: usize) -> Vec<u32> {
        let mut out = Vec::new();
        for _ in 0..count {
            let b = self.queue.pop_front().expect("capacity checked");
            if self.cfg.caching {
                self.evict(b);
            }
            self.refs[b as usize] = 1;
            out.push(b);
        }
        out
    }

    fn touch(&mut self, ids: &[u32]) {
        for &b in ids {
            if b == 0 {
                continue;
            }
            if self.refs[b as usize] == 0 {
                self.queue.retain(|&x| x != b);
            }
            self.refs[b as usize] += 1;
        }
    }

    fn release(&mut self, id: &str) {
        let caching = self.cfg.caching;
        let r = self.req(id);
        let blocks = std::mem::take(&mut r.blocks);
        r.num_cached = 0;
        r.num_computed = 0;
        r.alloc_tokens = 0;
        r.admitted = false;
        let mut first = Vec::new();
        let mut last = Vec::new();
        for &b in blocks.iter().rev() {
            if b == 0 {
                continue;
            }
            self.refs[b as usize] -= 1;
            if self.refs[b as usize] == 0 {
                if self.key[b as usize].is_none() || !caching {
                    first.push(b);
                } else {
                    last.push(b);
                }
            }
        }
        for &b in first.iter().rev() {
            self.queue.push_front(b);
        }
        self.queue.extend(last);
    }

    /// `get_computed_blocks`: the longest run of cached full-block prefixes, at
    /// most `num_tokens - 1` tokens; EAGLE drops the last matched block.
    fn lookup(&mut self, id: &str) -> (Vec<u32>, u64) {
        let (caching, eagle, bs) = (self.cfg.caching, self.cfg.eagle, self.bs);
        let r = self
            .reqs
            .iter()
            .find(|r| r.id == id)
            .expect("known")
            .clone();
        if !caching || r.skip_reading {
            return (Vec::new(), 0);
        }
        let mut hit = Vec::new();
        for i in 0..(r.tokens.len() - 1) / bs {
            match self.map.get(&r.tokens[..(i + 1) * bs]) {
                Some(list) => hit.push(list[0]),
                None => break,
            }
        }
        if eagle && !hit.is_empty() {
            hit.pop();
        }
        self.req(id).pending_lookup = true;
        let t = (hit.len() * bs) as u64;
        (hit, t)
    }

    fn watermark_blocks(&self) -> usize {
        (self.cfg.watermark * f64::from(self.cfg.num_blocks)) as usize
    }

    /// Validation that can fail for the emulated scheduler's calls: a stale hit and
    /// a request that can never fit. Returns `need_slot` on success.
    fn precheck(&self, r: &MReq, a: &AllocateArgs, hit: Option<&[u32]>) -> Result<u64, ErrKind> {
        if let Some(h) = hit {
            for (i, &b) in h.iter().enumerate() {
                let want = r.tokens.get(..(i + 1) * self.bs);
                if b != 0 && self.key[b as usize].as_deref() != want {
                    return Err(ErrKind::Stale);
                }
            }
        }
        let max_len = self.cfg.max_model_len;
        let total = (a.num_computed_tokens + a.num_new_computed_tokens).min(max_len);
        let need_slot = (total + a.num_new_tokens + a.num_lookahead_tokens).min(max_len);
        if need_slot.div_ceil(self.bs as u64) > (self.n - 1) as u64 {
            return Err(ErrKind::CannotFit);
        }
        Ok(need_slot)
    }

    /// vLLM's `allocate_slots` for full attention, naively.
    fn allocate(
        &mut self,
        id: &str,
        a: &AllocateArgs,
        hit: Option<&[u32]>,
    ) -> Result<Option<Vec<u32>>, ErrKind> {
        let r = self
            .reqs
            .iter()
            .find(|r| r.id == id)
            .expect("known")
            .clone();
        let need_slot = self.precheck(&r, a, hit)?;
        let bs = self.bs as u64;
        let total = (a.num_computed_tokens + a.num_new_computed_tokens).min(self.cfg.max_model_len);
        let admitting = hit.is_some() || !r.running();
        let required = need_slot.div_ceil(bs) as usize;
        let hit_blocks = hit.unwrap_or(&[]);
        let fresh = required.saturating_sub(r.blocks.len() + hit_blocks.len());
        let evictable = hit_blocks
            .iter()
            .filter(|&&b| b != 0 && self.refs[b as usize] == 0)
            .count();
        let watermark = if admitting {
            self.watermark_blocks()
        } else {
            0
        };
        if fresh + evictable + watermark > self.queue.len() {
            return Ok(None);
        }
        // Adopt the hit (touching pulls eviction candidates out of the queue).
        if let Some(h) = hit {
            if !r.running() {
                if self.cfg.caching {
                    self.touch(h);
                }
                let rm = self.req(id);
                rm.blocks.extend_from_slice(h);
                rm.num_cached = rm.blocks.len();
            }
        }
        let have = self.req(id).blocks.len();
        let new = self.pop_new(required.saturating_sub(have));
        self.req(id).blocks.extend_from_slice(&new);
        // Publish the full blocks of committed tokens.
        if self.cfg.caching {
            let rm = self.req(id).clone();
            let to_cache = (total + a.num_new_tokens).min(rm.tokens.len() as u64) as usize;
            let full = (to_cache / self.bs).min(rm.blocks.len());
            if full > rm.num_cached {
                for i in rm.num_cached..full {
                    let b = rm.blocks[i];
                    if b != 0 && self.key[b as usize].is_none() {
                        let k = rm.tokens[..(i + 1) * self.bs].to_vec();
                        self.key[b as usize] = Some(k.clone());
                        self.map.entry(k).or_default().push(b);
                    }
                }
                if self.cfg.events {
                    self.events.push(MEvent::Stored {
                        blocks: (rm.num_cached..full)
                            .map(|i| rm.tokens[..(i + 1) * self.bs].to_vec())
                            .collect(),
                        parent: (rm.num_cached > 0)
                            .then(|| rm.tokens[..rm.num_cached * self.bs].to_vec()),
                        token_ids: rm.tokens[rm.num_cached * self.bs..full * self.bs].to_vec(),
                    });
                }
                self.req(id).num_cached = full;
            }
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

    fn evict_blocks(&mut self, ids: &[u64]) -> Result<(), ErrKind> {
        if ids.iter().any(|&b| b >= self.n as u64) {
            return Err(ErrKind::Invalid);
        }
        for &b in ids {
            self.evict(b as u32);
        }
        Ok(())
    }

    fn reset(&mut self) -> bool {
        if self.queue.len() != self.n - 1 {
            return false;
        }
        self.map.clear();
        self.key.iter_mut().for_each(|k| *k = None);
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
    prop_assert_eq!(
        pool.free_queue(),
        m.queue.iter().copied().collect::<Vec<_>>(),
        "{}: free queue",
        ctx
    );
    prop_assert_eq!(
        mgr.num_free_blocks() as usize,
        m.queue.len(),
        "{}: num_free",
        ctx
    );
    for b in 1..n as u32 {
        prop_assert_eq!(
            pool.ref_cnt(b),
            m.refs[b as usize],
            "{}: ref_cnt of block {}",
            ctx,
            b
        );
    }
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
            Some(k) => {
                prop_assert_eq!(k.group, 0, "{}: group", ctx);
                Some(bij.prefix(&k.hash)?)
            }
        };
        prop_assert_eq!(
            got,
            m.key[b as usize].clone(),
            "{}: key of block {}",
            ctx,
            b
        );
    }
    for (prefix, list) in &m.map {
        let Some(&h) = bij.to_hash.get(prefix) else {
            return Err(TestCaseError::fail(format!(
                "{ctx}: model key of unknown hash"
            )));
        };
        let k = CacheKey { hash: h, group: 0 };
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
        m.map.len(),
        "{}: cached key count",
        ctx
    );
    if m.map.values().any(|l| l.len() > 1) {
        cov("dup keys state");
    }

    // Per request: blocks, tokens, preemptions; model-free block-count properties.
    let bs = m.bs as u64;
    let mut held = HashSet::new();
    let num_running = m.reqs.iter().filter(|r| r.admitted).count();
    for r in &m.reqs {
        let ids = mgr
            .block_ids(&r.id)
            .map_err(|e| TestCaseError::fail(format!("{e}")))?;
        prop_assert_eq!(ids.len(), 1);
        prop_assert_eq!(ids[0], &r.blocks[..], "{}: blocks of {}", ctx, r.id);
        prop_assert_eq!(
            ids[0].len() as u64,
            r.alloc_tokens.div_ceil(bs),
            "{}: block count of {}",
            ctx,
            r.id
        );
        prop_assert!(
            ids[0].len() as u64 * bs >= r.num_computed,
            "{}: computed tokens without blocks",
            ctx
        );
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
        held.extend(ids[0].iter().copied().filter(|&b| b != 0));
        if r.admitted {
            let common = r
                .blocks
                .iter()
                .take_while(|&&b| m.refs[b as usize] as usize == num_running)
                .count() as u32;
            prop_assert_eq!(
                mgr.get_num_common_prefix_blocks(&r.id).ok(),
                Some(vec![common]),
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
                prop_assert_eq!(s.block_size, m.cfg.block_size);
                prop_assert_eq!(s.group_idx, 0);
                prop_assert_eq!(s.lora_id, None);
                prop_assert_eq!(s.lora_name, None);
                prop_assert_eq!(s.kv_cache_spec_kind, Some("full_attention"));
                prop_assert_eq!(s.kv_cache_spec_sliding_window, None);
                prop_assert_eq!(
                    s.extra_keys.clone(),
                    Some(vec![None; s.block_hashes.len()]),
                    "{}: extra keys",
                    ctx
                );
                MEvent::Stored {
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
                prop_assert_eq!(group_idx, 0);
                prop_assert_eq!(block_hashes.len(), 1);
                MEvent::Removed(bij.prefix(&block_hashes[0])?)
            }
            KvEvent::AllBlocksCleared => MEvent::Cleared,
        });
    }
    for e in &got {
        cov(match e {
            MEvent::Stored { .. } => "ev stored",
            MEvent::Removed(_) => "ev removed",
            MEvent::Cleared => "ev cleared",
        });
    }
    prop_assert_eq!(got, std::mem::take(&mut m.events), "{}: events", ctx);
    Ok(())
}

// ---------------------------------------------------------------------------
// Driver
// ---------------------------------------------------------------------------

fn pick<'a>(m: &'a Model, idx: &Index, f: impl Fn(&MReq) -> bool) -> Option<String> {
    let c: Vec<&MReq> = m.reqs.iter().filter(|r| f(r)).collect();
    (!c.is_empty()).then(|| c[idx.index(c.len())].id.clone())
}

fn check_hit_is_own_chain(
    mgr: &KvCacheManager,
    id: &str,
    hit: &ComputedBlocks,
    scale: usize,
    ctx: &str,
) -> Result<(), TestCaseError> {
    let hashes = mgr
        .block_hashes(id)
        .map_err(|e| TestCaseError::fail(format!("{e}")))?;
    for (i, &b) in hit.block_ids[0].iter().enumerate() {
        let want = CacheKey {
            hash: hashes[(i + 1) * scale - 1],
            group: 0,
        };
        prop_assert_eq!(
            mgr.pool().block_key(b),
            Some(want),
            "{}: hit block {} is not the request's chain",
            ctx,
            i
        );
    }
    let bs = (scale * mgr.hash_block_size()) as u64;
    prop_assert_eq!(
        hit.num_computed_tokens,
        hit.block_ids[0].len() as u64 * bs,
        "{}: hit length",
        ctx
    );
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
    prop_assert_eq!(
        &real.block_ids,
        &vec![blocks.clone()],
        "{}: hit blocks",
        ctx
    );
    prop_assert_eq!(real.num_computed_tokens, tokens, "{}: hit tokens", ctx);
    prop_assert_eq!(real.shared_prefix_boundary, 0);
    prop_assert_eq!(real.is_empty(), blocks.is_empty());
    if !blocks.is_empty() {
        cov("lookup hit");
        if blocks.iter().any(|&b| m.refs[b as usize] == 0) {
            cov("lookup hit evictable");
        }
    } else {
        cov("lookup miss");
    }
    let scale = (m.cfg.block_size as usize) / m.cfg.hbs();
    check_hit_is_own_chain(mgr, id, &real, scale, ctx)?;
    Ok(KeptHit {
        real,
        blocks,
        tokens,
    })
}

fn compare_alloc(
    got: Result<Option<&[Vec<u32>]>, Error>,
    want: Result<Option<Vec<u32>>, ErrKind>,
    ctx: &str,
) -> Result<bool, TestCaseError> {
    match (got, want) {
        (Ok(Some(g)), Ok(Some(w))) => {
            cov(&format!("alloc ok {}", ctx.split(' ').nth(2).unwrap_or("")));
            prop_assert_eq!(g.len(), 1);
            prop_assert_eq!(&g[0], &w, "{}: new blocks", ctx);
            Ok(true)
        }
        (Ok(None), Ok(None)) => {
            cov(&format!(
                "alloc none {}",
                ctx.split(' ').nth(2).unwrap_or("")
            ));
            Ok(false)
        }
        (Err(e), Err(k)) => {
            cov(&format!("alloc err {:?}", k));
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
                // Mostly prompts that fit the pool, sometimes longer.
                let cap =
                    (((cfg.num_blocks - 1) as usize) * cfg.block_size as usize).clamp(1, b.len());
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
                    m.reqs.push(MReq {
                        id,
                        tokens: prompt,
                        blocks: Vec::new(),
                        num_cached: 0,
                        num_computed: 0,
                        alloc_tokens: 0,
                        skip_reading: *skip_reading,
                        preemptions: 0,
                        pending_lookup: false,
                        admitted: false,
                        kept_hit: None,
                    });
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
            } => {
                let Some(id) = pick(&m, req, |r| !r.running()) else {
                    continue;
                };
                let kept = match (reuse_kept_hit, m.req(&id).kept_hit.clone()) {
                    (true, Some(k)) => k,
                    _ => do_lookup(&mut mgr, &mut m, &id, &ctx)?,
                };
                let num_tokens = m.req(&id).tokens.len() as u64;
                let remaining = num_tokens - kept.tokens;
                let num_new = chunk.map_or(remaining, |c| u64::from(c).min(remaining));
                let args = AllocateArgs {
                    num_new_computed_tokens: kept.tokens,
                    num_lookahead_tokens: u64::from(*lookahead),
                    ..AllocateArgs::step(num_new, 0)
                };
                let pass_none = *none_if_empty && kept.blocks.is_empty();
                let (real_hit, model_hit) = if pass_none {
                    (None, None)
                } else {
                    (Some(&kept.real), Some(kept.blocks.as_slice()))
                };
                let want = m.allocate(&id, &args, model_hit);
                let got = mgr.allocate_slots(&id, &args, real_hit);
                let failed_stale = matches!(want, Err(ErrKind::Stale));
                if compare_alloc(got, want, &ctx)? {
                    let r = m.req(&id);
                    r.num_computed = kept.tokens + num_new;
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
                    ..AllocateArgs::step(num_new, nc)
                };
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
                for id in &chosen {
                    let r = m.req(id);
                    if r.num_computed == r.tokens.len() as u64 {
                        r.tokens.push(*token);
                        prop_assert!(mgr.append_token_ids(id, &[*token]).is_ok());
                    }
                    let r = m.req(id);
                    news.push(r.tokens.len() as u64 - r.num_computed);
                    comps.push(r.num_computed);
                }
                let la = u64::from(*lookahead);
                let mut out = BatchAllocation::default();
                let ids: Vec<&str> = chosen.iter().map(String::as_str).collect();
                let res = mgr.allocate_slots_batch(&ids, &news, &comps, la, &mut out);
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
                    let mut want_ids = Vec::new();
                    let mut want_offsets = vec![0u32];
                    let mut served = 0;
                    for (i, id) in chosen.iter().enumerate() {
                        match m.allocate(id, &args[i], None) {
                            Ok(Some(new)) => {
                                want_ids.extend(new);
                                want_offsets.push(want_ids.len() as u32);
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
                    cov(if served == chosen.len() {
                        "batch full"
                    } else if served > 0 {
                        "batch partial"
                    } else {
                        "batch zero"
                    });
                    prop_assert_eq!(out.num_allocated, served, "{}: batch served", ctx);
                    prop_assert_eq!(&out.block_ids, &vec![want_ids], "{}: batch blocks", ctx);
                    prop_assert_eq!(&out.offsets, &vec![want_offsets], "{}: batch offsets", ctx);
                }
            }
            Op::Preempt { req } => {
                let Some(id) = pick(&m, req, |_| true) else {
                    continue;
                };
                prop_assert!(mgr.free(&id).is_ok());
                m.release(&id);
                m.req(&id).preemptions += 1;
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
                let mut v: Vec<u64> = ids.iter().map(|i| i.index(m.n) as u64).collect();
                if *out_of_range {
                    let at = ids.first().map_or(0, |i| i.index(v.len() + 1));
                    v.insert(at, m.n as u64);
                }
                let got = mgr.evict_blocks(&v).map_err(|e| kind(&e));
                prop_assert_eq!(got, m.evict_blocks(&v), "{}: evict_blocks", ctx);
            }
            Op::Reset => {
                let rr = m.reset();
                cov(&format!("reset {rr}"));
                prop_assert_eq!(mgr.reset_prefix_cache(), rr, "{}: reset_prefix_cache", ctx);
            }
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

fn bases_strategy() -> impl Strategy<Value = Vec<Vec<u32>>> {
    prop::collection::vec(prop::collection::vec(0u32..4, 80), 3)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn manager_matches_naive_reference_model_op_by_op(
        cfg in cfg_strategy(2..=64, any::<bool>().boxed()),
        bases in bases_strategy(),
        ops in prop::collection::vec(op_strategy(), 1..60),
    ) {
        run(&cfg, &bases, &ops)?;
    }

    #[test]
    fn zz_print(x in 0..1u8) { let _ = x; std::thread::sleep(std::time::Duration::from_secs(12)); let g = COV.lock().unwrap(); let mut v: Vec<_> = g.as_ref().unwrap().iter().collect(); v.sort(); for (k,c) in v { eprintln!("COV {k}: {c}"); } }

    /// Tight pools with caching on: evictions, stale hits, duplicates and
    /// allocation failures are frequent.
    #[test]
    fn manager_matches_model_under_memory_pressure_with_caching(
        cfg in cfg_strategy(2..=8, Just(true).boxed()),
        bases in bases_strategy(),
        ops in prop::collection::vec(op_strategy(), 1..60),
    ) {
        run(&cfg, &bases, &ops)?;
    }
}
