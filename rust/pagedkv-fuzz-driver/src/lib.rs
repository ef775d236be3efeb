//! Interprets a byte string as a manager configuration plus a sequence of
//! operations, runs it against `KvCacheManager` and checks, after every call:
//!
//! - no panic (the fuzzer reports one as a crash);
//! - `check_invariants` holds;
//! - a call that returns an error leaves every observable piece of state as it
//!   was (free queue, ref counts, cache keys, request table), and an
//!   `allocate_slots` that returns "does not fit" does too unless a group frees
//!   out-of-window blocks first (documented);
//! - no call other than `check_invariants` reports an invariant violation;
//! - block conservation: free blocks plus distinct blocks held by requests (or
//!   by a queued copy) is the number of usable blocks, and nobody holds the
//!   null block's slot twice;
//! - a block held by two request slots sits at the same position in the same
//!   group and both requests have the same tokens up to the end of that block
//!   (two requests writing different contents into one block is corruption);
//! - once every request is removed, every usable block is free again, and a
//!   prefix-cache reset then empties the map.
//!
//! Shared by the cargo-fuzz target (`fuzz/fuzz_targets/ops.rs`) and the
//! regression tests that replay saved inputs (`tests/regressions.rs`).

use std::collections::HashMap;

mod index;
pub use index::run_index;

use pagedkv_core::{
    AllocateArgs, AttentionKind, BatchAllocation, ComputedBlocks, Error, GroupSpec, HashAlgo,
    KvCacheManager, Lora, MambaCacheMode, ManagerConfig, MmFeature, RequestSpec,
};

/// Reads the input byte by byte; past the end it yields zeros.
#[derive(Debug)]
pub struct Bytes<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Bytes<'a> {
    #[must_use]
    pub fn new(data: &'a [u8]) -> Self {
        Self { data, pos: 0 }
    }

    #[must_use]
    pub fn done(&self) -> bool {
        self.pos >= self.data.len()
    }

    pub fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }

    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            usize::from(self.u8()) % n
        }
    }

    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    /// A count: mostly small, sometimes at the edges of the range. Counts stay
    /// within `i64` (what the Python binding passes); u64 sums past that
    /// overflow (see `fuzz_regressions.rs`).
    pub fn count(&mut self) -> u64 {
        match self.u8() % 16 {
            0 => u64::from(self.u16()),
            1 => match self.u8() % 6 {
                0 => BIG,
                1 => BIG - 1,
                2 => 1 << 40,
                3 => (1 << 40) + 1,
                4 => u64::from(u32::MAX),
                _ => 1 << 32,
            },
            2..=5 => u64::from(self.u8()),
            _ => u64::from(self.u8() % 24),
        }
    }

    /// A token id: a small alphabet (so prompts share prefixes), sometimes any u32.
    pub fn token(&mut self) -> u32 {
        match self.u8() % 32 {
            0 => u32::MAX,
            1 => u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()]),
            b => u32::from(b % 3),
        }
    }
}

fn g(kind: AttentionKind, block_size: u32) -> GroupSpec {
    GroupSpec::new(kind, block_size)
}

fn swa(window: u32) -> AttentionKind {
    AttentionKind::SlidingWindow { window }
}

fn mamba(mode: MambaCacheMode, num_speculative_blocks: u32) -> AttentionKind {
    AttentionKind::Mamba {
        mode,
        num_speculative_blocks,
        prefill_checkpoint_alignment: None,
    }
}

/// The KV-cache group layouts the fuzzer picks from.
#[must_use]
pub fn layouts() -> Vec<Vec<GroupSpec>> {
    use AttentionKind::{CrossAttention, FullAttention, MlaAttention};
    vec![
        vec![g(FullAttention, 1)],
        vec![g(FullAttention, 2)],
        vec![g(FullAttention, 4)],
        vec![g(FullAttention, 16)],
        vec![g(MlaAttention, 4)],
        vec![g(FullAttention, 4), g(FullAttention, 4)],
        vec![g(FullAttention, 4), g(swa(8), 4)],
        vec![g(FullAttention, 4), g(swa(6), 4), g(swa(6), 4)],
        vec![g(FullAttention, 8), g(swa(8), 4)],
        vec![
            g(FullAttention, 4),
            g(AttentionKind::ChunkedLocal { chunk: 8 }, 4),
        ],
        vec![g(FullAttention, 4), g(mamba(MambaCacheMode::Align, 0), 8)],
        vec![g(FullAttention, 4), g(mamba(MambaCacheMode::All, 1), 4)],
        vec![g(FullAttention, 4), g(CrossAttention, 4)],
        vec![g(swa(4), 2)],
        vec![g(MlaAttention, 4), g(swa(12), 4), g(FullAttention, 4)],
        vec![
            g(AttentionKind::SinkFullAttention { sink_len: 8 }, 4),
            g(mamba(MambaCacheMode::Align, 2), 4),
        ],
        vec![g(FullAttention, 2), g(FullAttention, 6)],
    ]
}

/// Decodes the configuration from the first bytes. `None`: a configuration the
/// manager refuses (that refusal is itself checked not to panic).
pub fn config(b: &mut Bytes<'_>) -> ManagerConfig {
    let all = layouts();
    let groups = all[b.below(all.len())].clone();
    let num_blocks = 1 + b.below(48) as u32;
    let max_model_len = [16u64, 64, 256, 100_000][b.below(4)];
    let mut cfg = ManagerConfig::full_attention(num_blocks, 4, max_model_len);
    cfg.groups = groups;
    let flags = b.u8();
    cfg.enable_caching = flags & 1 == 0 || flags & 2 == 0;
    cfg.enable_kv_cache_events = flags & 4 != 0;
    cfg.log_stats = flags & 8 != 0;
    cfg.use_eagle = flags & 16 != 0 && flags & 32 != 0;
    cfg.watermark = if flags & 64 != 0 { 0.1 } else { 0.0 };
    cfg.hash_algo = [
        HashAlgo::Xxh3Native,
        HashAlgo::Sha256Cbor,
        HashAlgo::XxhashCbor,
    ][b.below(3)];
    cfg.hash_seed = Some("fuzz".into());
    // Collision safety; a deliberately weak (truncated) hash only with it on, so
    // that colliding prefixes are frequent and must never share a block.
    cfg.verify_cached_tokens = flags & 128 != 0;
    if cfg.verify_cached_tokens && b.bool() {
        cfg.hash_truncate_bytes = Some(1 + (b.u8() % 2));
    }
    let sbs = cfg.scheduler_block_size();
    cfg.prefix_cache_retention_interval = match b.u8() % 8 {
        0 => Some(0),
        1 => Some(sbs),
        2 => Some(2 * sbs),
        _ => None,
    };
    cfg.max_in_flight_tokens = match b.u8() % 8 {
        0 => Some(8),
        1 => Some(u64::from(b.u8()) + 1),
        _ => None,
    };
    cfg
}

/// A request as seen from outside: id, block ids per group, token count, hash
/// count, preemptions.
type RequestView = (String, Vec<Vec<u32>>, usize, usize, u32);

/// Everything observable about the manager, for "an error changed nothing".
#[derive(Debug, PartialEq)]
struct Snapshot {
    free: Vec<u32>,
    refs: Vec<u32>,
    keys: Vec<Option<pagedkv_core::CacheKey>>,
    num_keys: usize,
    num_requests: usize,
    reqs: Vec<RequestView>,
}

fn snapshot(mgr: &KvCacheManager, ids: &[String]) -> Snapshot {
    let pool = mgr.pool();
    let n = pool.num_blocks();
    let mut reqs = Vec::new();
    for id in ids {
        if let Ok(groups) = mgr.block_ids(id) {
            reqs.push((
                id.clone(),
                groups.iter().map(|s| s.to_vec()).collect(),
                mgr.num_tokens(id).unwrap_or(0),
                mgr.block_hashes(id).map_or(0, <[_]>::len),
                mgr.num_preemptions(id).unwrap_or(0),
            ));
        }
    }
    Snapshot {
        free: pool.free_queue(),
        refs: (0..n).map(|b| pool.ref_cnt(b)).collect(),
        keys: (0..n).map(|b| pool.block_key(b)).collect(),
        num_keys: pool.num_cached_keys(),
        num_requests: mgr.num_requests(),
        reqs,
    }
}

/// Model-free properties of the current state (see the module docs).
fn check_state(mgr: &KvCacheManager, ids: &[String], tokens: &HashMap<String, Vec<u32>>) {
    if let Err(e) = mgr.check_invariants() {
        panic!("invariant violated: {e}");
    }
    let pool = mgr.pool();
    let n = pool.num_blocks() as usize;
    let bss: Vec<usize> = mgr
        .config()
        .groups
        .iter()
        .map(|g| g.block_size as usize)
        .collect();
    // block -> (request, group, position) of its first holder
    let mut holder: Vec<Option<(usize, usize, usize)>> = vec![None; n];
    let mut distinct = 0usize;
    for (ri, id) in ids.iter().enumerate() {
        let Ok(groups) = mgr.block_ids(id) else {
            continue;
        };
        for (gi, blocks) in groups.iter().enumerate() {
            for (pos, &b) in blocks.iter().enumerate() {
                if b == 0 {
                    continue;
                }
                let b = b as usize;
                assert!(b < n, "block {b} outside the pool");
                match holder[b] {
                    None => {
                        holder[b] = Some((ri, gi, pos));
                        distinct += 1;
                    }
                    Some((rj, gj, pj)) => {
                        assert!(
                            gj == gi && pj == pos,
                            "block {b} held at group {gj} pos {pj} and group {gi} pos {pos}"
                        );
                        assert!(rj != ri, "request {id:?} holds block {b} twice");
                        // The same contents: equal tokens up to the block's end.
                        let end = (pos + 1) * bss[gi];
                        let a = &tokens[&ids[rj]];
                        let c = &tokens[id];
                        let common = end.min(a.len()).min(c.len());
                        assert!(
                            common > pos * bss[gi],
                            "block {b} shared by requests without tokens in it"
                        );
                        assert_eq!(
                            a[..common],
                            c[..common],
                            "block {b} shared by {:?} and {id:?} with different tokens",
                            ids[rj]
                        );
                    }
                }
            }
        }
    }
    // Blocks a queued copy holds that no request holds any more (a Mamba
    // request's own boundary kept in a copy of its state block).
    for b in mgr.pending_copy_blocks() {
        let b = b as usize;
        if b != 0 && holder[b].is_none() {
            holder[b] = Some((usize::MAX, 0, 0));
            distinct += 1;
        }
    }
    assert_eq!(
        pool.num_free_blocks() as usize + distinct,
        n - 1,
        "free + held blocks != usable blocks"
    );
}

/// A request id: a few known names (so calls hit existing, removed and unknown
/// requests), sometimes an odd string.
fn request_id(b: &mut Bytes<'_>) -> String {
    match b.u8() % 16 {
        0 => String::new(),
        1 => "é\u{0}x".into(),
        k => format!("r{}", k % 8),
    }
}

fn prompt(b: &mut Bytes<'_>, bases: &[Vec<u32>; 2]) -> Vec<u32> {
    let base = &bases[b.below(2)];
    let len = match b.u8() % 8 {
        0 => 0,
        1 => usize::from(b.u16() % 400),
        _ => b.below(base.len() + 1),
    };
    let mut p: Vec<u32> = base.iter().copied().cycle().take(len).collect();
    for _ in 0..b.below(6) {
        p.push(b.token());
    }
    p
}

/// `i64::MAX`: the largest multimodal offset or length Python can pass.
const BIG: u64 = i64::MAX as u64;

fn request_spec(b: &mut Bytes<'_>, bases: &[Vec<u32>; 2]) -> RequestSpec {
    let prompt_token_ids = prompt(b, bases);
    let extras = b.u8();
    let lora = (extras & 1 != 0).then(|| Lora {
        name: format!("lora{}", extras % 3),
        path: (extras & 8 != 0).then(|| "/p".into()),
        id: (extras & 16 != 0).then_some(i64::from(extras)),
    });
    let cache_salt = (extras & 2 != 0).then(|| format!("salt{}", extras % 2));
    let mut mm_features = Vec::new();
    if extras & 4 != 0 {
        for i in 0..b.below(3) {
            mm_features.push(MmFeature {
                identifier: format!("img{}", b.u8() % 3),
                offset: if b.u8() == 0 {
                    BIG - 1
                } else {
                    b.count().min(BIG)
                },
                length: b.count().min(BIG) + u64::from(i == 0 && b.bool()),
            });
        }
    }
    let prompt_embeds = (extras & 32 != 0 && extras & 64 != 0).then(|| {
        let row = b.below(3);
        let rows = if b.u8() == 0 {
            prompt_token_ids.len() + 1
        } else {
            prompt_token_ids.len()
        };
        (0..rows * row).map(|i| (i % 7) as u8).collect()
    });
    RequestSpec {
        prompt_token_ids,
        lora,
        cache_salt,
        mm_features,
        prompt_embeds,
        skip_reading_prefix_cache: extras & 128 != 0 && extras & 64 == 0,
        session_id: None,
    }
}

struct Driver {
    mgr: KvCacheManager,
    /// Every id the driver ever used (known, removed or never added).
    ids: Vec<String>,
    /// Tokens of live requests, mirrored from what was passed in.
    tokens: HashMap<String, Vec<u32>>,
    /// Per id: tokens the emulated scheduler has computed.
    computed: HashMap<String, u64>,
    /// Lookups kept for later (they go stale as blocks are evicted).
    kept: Vec<(String, ComputedBlocks)>,
    skipping: bool,
    batch: BatchAllocation,
}

impl Driver {
    fn note_id(&mut self, id: &str) {
        if !self.ids.iter().any(|x| x == id) {
            self.ids.push(id.to_owned());
        }
    }

    fn live_ids(&self) -> Vec<String> {
        self.ids
            .iter()
            .filter(|id| self.mgr.contains(id))
            .cloned()
            .collect()
    }

    fn args(&mut self, b: &mut Bytes<'_>, id: &str, admit: bool) -> AllocateArgs {
        let n = self.mgr.num_tokens(id).unwrap_or(0) as u64;
        let done = self.computed.get(id).copied().unwrap_or(0);
        let mode = b.u8();
        let num_computed_tokens = match mode % 8 {
            0 => b.count(),
            1 => done.saturating_sub(1),
            _ if admit => 0,
            _ => done,
        };
        let rest = n.saturating_sub(num_computed_tokens);
        let num_new_tokens = match (mode >> 3) % 8 {
            0 => b.count(),
            1 => 1,
            2 => rest.min(u64::from(b.u8() % 20) + 1),
            _ => rest,
        };
        let fancy = mode >> 6;
        AllocateArgs {
            num_new_tokens,
            num_computed_tokens,
            num_new_computed_tokens: 0,
            num_lookahead_tokens: if fancy > 0 { b.count() % 5 } else { 0 },
            num_external_computed_tokens: if fancy > 1 && b.bool() {
                b.count() % 9
            } else {
                0
            },
            delay_cache_blocks: fancy > 1 && b.bool(),
            num_encoder_tokens: if fancy > 0 { b.count() % 20 } else { 0 },
            full_sequence_must_fit: fancy == 3 && b.bool(),
            reserved_blocks: if fancy == 3 { b.count() % 4 } else { 0 },
            has_scheduled_reqs: !(fancy == 2 && b.bool()),
            num_in_flight_tokens: 0,
            vllm_lenient: false,
            skip_zeroing_groups: 0,
            engine_managed_blocks: 0,
            engine_managed_full_blocks: 0,
            // Now and then an allocation split at a group (group 0 and one
            // past the last are refused), finished or not by a later call.
            split_at_group: (fancy == 3 && b.u8().is_multiple_of(4))
                .then(|| b.below(self.mgr.config().groups.len() + 2)),
        }
    }

    /// Runs one call; `Err` results and refused allocations are checked to
    /// change nothing.
    #[allow(clippy::too_many_lines)] // one arm per manager call the driver makes
    fn step(&mut self, b: &mut Bytes<'_>, bases: &[Vec<u32>; 2]) {
        let ids = self.ids.clone();
        let before = snapshot(&self.mgr, &ids);
        let op = b.u8() % 20;
        let (result, refused): (Result<(), Error>, bool) = match op {
            0..=2 => {
                let id = request_id(b);
                self.note_id(&id);
                let spec = request_spec(b, bases);
                let toks = spec.prompt_token_ids.clone();
                let known = self.mgr.contains(&id);
                let r = self.mgr.add_request(&id, spec).map(|_| ());
                if r.is_ok() {
                    assert!(!known, "duplicate id {id:?} accepted");
                    self.tokens.insert(id.clone(), toks);
                    self.computed.insert(id, 0);
                }
                (r, false)
            }
            3 => {
                let id = request_id(b);
                match self.mgr.get_computed_blocks(&id) {
                    Ok(hit) => {
                        if self.kept.len() > 8 {
                            self.kept.remove(0);
                        }
                        self.kept.push((id, hit));
                        (Ok(()), false)
                    }
                    Err(e) => (Err(e), false),
                }
            }
            4..=6 => {
                // Admission: a fresh lookup, a kept one (maybe stale, maybe another
                // request's), or none.
                let id = request_id(b);
                let how = b.u8() % 4;
                let hit = match how {
                    0 if !self.kept.is_empty() => {
                        let k = b.below(self.kept.len());
                        Some(self.kept[k].1.clone())
                    }
                    1 => None,
                    _ => self.mgr.get_computed_blocks(&id).ok(),
                };
                // A fresh lookup is a state change of its own (stats bookkeeping):
                // take the "unchanged" baseline after it.
                let before = snapshot(&self.mgr, &ids);
                let mut a = self.args(b, &id, true);
                if let Some(h) = &hit {
                    a.num_new_computed_tokens = if b.u8() == 0 {
                        b.count()
                    } else {
                        h.num_computed_tokens
                    };
                }
                let r = self
                    .mgr
                    .allocate_slots(&id, &a, hit.as_ref())
                    .map(|o| o.is_some());
                let out = self.alloc_outcome(&id, &a, r);
                self.after(&before, &ids, &out);
                return;
            }
            7..=9 => {
                let id = request_id(b);
                let mut a = self.args(b, &id, false);
                if b.u8().is_multiple_of(4) {
                    a.num_external_computed_tokens = 0;
                }
                let r = self.mgr.allocate_slots(&id, &a, None).map(|o| o.is_some());
                self.alloc_outcome(&id, &a, r)
            }
            10 => {
                let id = request_id(b);
                let toks: Vec<u32> = (0..b.below(20)).map(|_| b.token()).collect();
                let r = self.mgr.append_token_ids(&id, &toks);
                if r.is_ok() {
                    self.tokens.get_mut(&id).expect("live").extend(&toks);
                }
                (r, false)
            }
            11 => {
                let k = 1 + b.below(5);
                let names: Vec<String> = (0..k).map(|_| request_id(b)).collect();
                let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                let toks: Vec<u32> = (0..k + usize::from(b.u8() == 0))
                    .map(|_| b.token())
                    .collect();
                let r = self.mgr.append_token_ids_batch(&refs, &toks);
                if r.is_ok() {
                    for (id, &t) in names.iter().zip(&toks) {
                        self.tokens.get_mut(id).expect("live").push(t);
                    }
                }
                (r, false)
            }
            12 => {
                let k = 1 + b.below(5);
                let names: Vec<String> = (0..k).map(|_| request_id(b)).collect();
                let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                let mut news = Vec::new();
                let mut comps = Vec::new();
                for id in &names {
                    let done = self.computed.get(id).copied().unwrap_or(0);
                    news.push(if b.u8().is_multiple_of(8) {
                        b.count()
                    } else {
                        1
                    });
                    comps.push(if b.u8().is_multiple_of(8) {
                        b.count()
                    } else {
                        done
                    });
                }
                if b.u8() == 0 {
                    news.pop();
                }
                let look = b.count() % 3;
                let mut out = std::mem::take(&mut self.batch);
                let r = self
                    .mgr
                    .allocate_slots_batch(&refs, &news, &comps, look, &mut out);
                if r.is_ok() {
                    assert!(out.num_allocated <= names.len());
                    for (i, id) in names.iter().enumerate().take(out.num_allocated) {
                        self.computed.insert(id.clone(), comps[i] + news[i]);
                    }
                }
                let refused = r.is_ok() && out.num_allocated == 0;
                self.batch = out;
                (r, refused)
            }
            13 => {
                let id = request_id(b);
                let r = self.mgr.free(&id);
                if r.is_ok() {
                    self.computed.insert(id, 0);
                }
                (r, false)
            }
            14 => {
                let id = request_id(b);
                let r = self.mgr.remove_request(&id);
                if r.is_ok() {
                    self.tokens.remove(&id);
                    self.computed.remove(&id);
                }
                (r, false)
            }
            15 => {
                let id = request_id(b);
                let n = b.count();
                (self.mgr.cache_blocks(&id, n), false)
            }
            16 => {
                let id = request_id(b);
                let n = b.count();
                (self.mgr.remove_skipped_blocks(&id, n), false)
            }
            17 => {
                let n = self.mgr.pool().num_blocks();
                let ids: Vec<u32> = (0..b.below(5))
                    .map(|_| match b.u8() % 16 {
                        0 => n,
                        1 => u32::MAX,
                        _ => u32::from(b.u8()) % n,
                    })
                    .collect();
                (self.mgr.evict_blocks(&ids), false)
            }
            18 => {
                let held = self.mgr.num_free_blocks() + 1 != self.mgr.pool().num_blocks();
                let ok = self.mgr.reset_prefix_cache();
                assert_eq!(ok, !held, "reset_prefix_cache refused iff blocks are held");
                if ok {
                    assert_eq!(self.mgr.pool().num_cached_keys(), 0);
                }
                (Ok(()), false)
            }
            _ => {
                self.mgr.new_step_starts();
                let _ = self.mgr.take_events();
                let _ = self.mgr.make_prefix_cache_stats();
                let id = request_id(b);
                let _ = self.mgr.get_num_common_prefix_blocks(&id);
                // Completes a split allocation of this request, if one waits.
                let waiting = snapshot(&self.mgr, &ids);
                if self.mgr.finish_allocation(&id).is_err() {
                    assert_eq!(
                        snapshot(&self.mgr, &ids),
                        waiting,
                        "a refused finish_allocation changed the state"
                    );
                }
                (Ok(()), false)
            }
        };
        self.after(&before, &ids, &(result, refused));
    }

    fn alloc_outcome(
        &mut self,
        id: &str,
        a: &AllocateArgs,
        r: Result<bool, Error>,
    ) -> (Result<(), Error>, bool) {
        match r {
            Ok(true) => {
                let done = a.num_computed_tokens
                    + a.num_new_computed_tokens
                    + a.num_external_computed_tokens
                    + a.num_new_tokens;
                self.computed.insert(id.to_owned(), done);
                (Ok(()), false)
            }
            Ok(false) => (Ok(()), true),
            Err(e) => (Err(e), false),
        }
    }

    fn after(&mut self, before: &Snapshot, ids: &[String], out: &(Result<(), Error>, bool)) {
        match &out.0 {
            Err(Error::InvariantViolation(m)) => panic!("a call reported a violation: {m}"),
            Err(_) => assert_eq!(
                &snapshot(&self.mgr, ids),
                before,
                "a refused call changed the state: {:?}",
                out.0
            ),
            Ok(()) if out.1 && !self.skipping => assert_eq!(
                &snapshot(&self.mgr, ids),
                before,
                "an allocation that did not fit changed the state"
            ),
            Ok(()) => {}
        }
        let live = self.live_ids();
        check_state(&self.mgr, &live, &self.tokens);
    }
}

/// Runs one fuzz input.
///
/// # Panics
/// On any violated property (the fuzzer reports the input as a crash).
pub fn run(data: &[u8]) {
    let mut b = Bytes::new(data);
    let cfg = config(&mut b);
    let skipping = cfg.groups.iter().any(|g| {
        matches!(
            g.kind,
            AttentionKind::SlidingWindow { .. }
                | AttentionKind::ChunkedLocal { .. }
                | AttentionKind::Mamba { .. }
        )
    });
    let num_blocks = cfg.num_blocks;
    let mgr = match KvCacheManager::new(cfg) {
        Ok(m) => m,
        Err(Error::InvalidConfig(_)) => return,
        Err(e) => panic!("config refused with the wrong error: {e:?}"),
    };
    let bases = [
        (0..96)
            .map(|i| [0u32, 1, 2, 0, 1][i % 5])
            .collect::<Vec<u32>>(),
        (0..96).map(|i| (i % 4) as u32).collect::<Vec<u32>>(),
    ];
    let mut d = Driver {
        mgr,
        ids: Vec::new(),
        tokens: HashMap::new(),
        computed: HashMap::new(),
        kept: Vec::new(),
        skipping,
        batch: BatchAllocation::default(),
    };
    let mut steps = 0;
    while !b.done() && steps < 256 {
        d.step(&mut b, &bases);
        steps += 1;
    }
    // Everything removed: every usable block is free; then the cache can be reset.
    for id in d.live_ids() {
        d.mgr.remove_request(&id).expect("remove a live request");
    }
    d.tokens.clear();
    check_state(&d.mgr, &[], &d.tokens);
    // Queued copies keep their endpoints until the engine ran them.
    let ends: Vec<u32> = d
        .mgr
        .take_block_copies()
        .into_iter()
        .flat_map(|(a, b)| [a, b])
        .filter(|&b| b != 0)
        .collect();
    d.mgr
        .free_blocks(&ends)
        .expect("the copies' references go back");
    assert_eq!(d.mgr.num_free_blocks(), num_blocks - 1, "blocks leaked");
    assert_eq!(d.mgr.num_requests(), 0);
    assert!(
        d.mgr.reset_prefix_cache(),
        "reset refused with no request left"
    );
    assert_eq!(d.mgr.pool().num_cached_keys(), 0);
    let mut free = d.mgr.pool().free_queue();
    free.sort_unstable();
    assert_eq!(free, (1..num_blocks).collect::<Vec<_>>());
    d.mgr.check_invariants().expect("invariants after reset");
}
