//! Random operation sequences over multi-group (hybrid) pools: after every call the
//! invariants hold (ref counts equal holders, free queue xor referenced, no block
//! held by two groups, map and block keys agree), calls never panic, and
//! removing every request (and freeing the blocks the engine took or touched
//! for itself, cached under a request's hashes or not) returns every block;
//! only blocks the engine unpinned are reported reused, each once. HiSparse
//! layouts run with their resident and hot groups in the core, and the engine
//! adopts and drops resident pages, asks for hot regions and releases requests
//! stopped at the resident group.

use pagedkv_core::{
    AllocateArgs, AttentionKind, Eviction, GroupSpec, HashAlgo, KvCacheManager, MambaCacheMode,
    ManagerConfig, RequestSpec,
};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Add {
        base: usize,
        suffix: Vec<u32>,
    },
    Admit {
        req: usize,
        chunk: Option<usize>,
        enc: u32,
    },
    Step {
        req: usize,
        chunk: usize,
    },
    Decode {
        req: usize,
        token: u32,
    },
    Free {
        req: usize,
    },
    Remove {
        req: usize,
    },
    Evict {
        block: u32,
    },
    Reset,
    NewStep,
    /// The engine takes blocks for itself (`get_new_blocks`).
    Take {
        n: u32,
    },
    /// It caches blocks it took under a request's hashes, whole or partial.
    CacheTaken {
        req: usize,
        group: usize,
        first: usize,
        range: (usize, usize),
        partial: Option<(usize, bool)>,
    },
    /// It frees some of them (`free_blocks`).
    FreeTaken {
        k: usize,
    },
    /// It takes a reference on any block (`touch_blocks`).
    Touch {
        block: u32,
    },
    /// It releases some of its references while watching the blocks
    /// (`unpin_blocks`).
    Unpin {
        k: usize,
    },
    /// HiSparse: the engine points a resident page at a fresh device copy
    /// (`get_new_blocks` then `hisparse_adopt_page`).
    Adopt {
        req: usize,
        page: usize,
    },
    /// HiSparse: the engine stops reading a resident page from the device;
    /// the block's reference is the engine's to return.
    DropPage {
        req: usize,
        page: usize,
    },
    /// HiSparse: the request needs its hot region.
    RequireHot {
        req: usize,
    },
    /// A release stopped at the first resident group, then the rest; `pop`:
    /// deferred (the engine returns the blocks later).
    Release {
        req: usize,
        pop: bool,
    },
}

fn layouts() -> Vec<Vec<GroupSpec>> {
    let g = |kind, bs| GroupSpec::new(kind, bs);
    let managed = || GroupSpec::new(AttentionKind::EngineManaged, 4);
    let swa = |w| AttentionKind::SlidingWindow { window: w };
    let align = AttentionKind::Mamba {
        mode: MambaCacheMode::Align,
        num_speculative_blocks: 0,
        prefill_checkpoint_alignment: None,
    };
    vec![
        vec![g(AttentionKind::FullAttention, 4), g(swa(8), 4)],
        vec![
            g(AttentionKind::FullAttention, 4),
            g(swa(6), 4),
            g(swa(6), 4),
        ],
        vec![g(AttentionKind::FullAttention, 8), g(swa(8), 4)],
        vec![
            g(AttentionKind::FullAttention, 4),
            g(AttentionKind::ChunkedLocal { chunk: 8 }, 4),
        ],
        vec![g(AttentionKind::FullAttention, 4), g(align, 8)],
        vec![
            g(AttentionKind::FullAttention, 4),
            g(AttentionKind::CrossAttention, 4),
        ],
        vec![g(swa(4), 2)],
        vec![
            g(AttentionKind::MlaAttention, 4),
            g(swa(12), 4),
            g(AttentionKind::FullAttention, 4),
        ],
        vec![
            g(AttentionKind::FullAttention, 4),
            g(
                AttentionKind::Mamba {
                    mode: MambaCacheMode::All,
                    num_speculative_blocks: 1,
                    prefill_checkpoint_alignment: None,
                },
                4,
            ),
        ],
        vec![
            g(AttentionKind::SinkFullAttention { sink_len: 8 }, 4),
            g(
                AttentionKind::Mamba {
                    mode: MambaCacheMode::Align,
                    num_speculative_blocks: 2,
                    prefill_checkpoint_alignment: None,
                },
                4,
            ),
        ],
        // vLLM's HiSparse layout: host source, indexer, resident.
        vec![managed(), g(AttentionKind::FullAttention, 4), managed()],
        // The resident and hot groups in the core, the source the engine's;
        // and the production order with a regular group after them.
        vec![
            managed(),
            g(AttentionKind::FullAttention, 4),
            g(AttentionKind::HiSparseResident, 4),
            g(
                AttentionKind::HiSparseHot {
                    blocks_per_request: 2,
                },
                4,
            ),
        ],
        vec![
            managed(),
            g(AttentionKind::FullAttention, 4),
            g(AttentionKind::HiSparseResident, 4),
            g(
                AttentionKind::HiSparseHot {
                    blocks_per_request: 2,
                },
                4,
            ),
            g(swa(8), 4),
        ],
        // Its production order: regular groups after the resident and hot
        // ones (admissions split at the resident group).
        vec![
            managed(),
            g(AttentionKind::FullAttention, 4),
            managed(),
            managed(),
            g(swa(8), 4),
        ],
    ]
}

/// Where an admission splits: the first engine-managed group after the first
/// group the manager runs, when a group it runs comes after that one.
fn split_group(groups: &[GroupSpec]) -> Option<usize> {
    let managed = |g: &GroupSpec| matches!(g.kind, AttentionKind::EngineManaged);
    let first_core = groups.iter().position(|g| !managed(g))?;
    let split = (first_core..groups.len()).find(|&i| managed(&groups[i]))?;
    groups[split..].iter().any(|g| !managed(g)).then_some(split)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..3usize, prop::collection::vec(0..3u32, 0..30))
            .prop_map(|(base, suffix)| Op::Add { base, suffix }),
        8 => (0..8usize, prop::option::of(1..40usize), 0..20u32)
            .prop_map(|(req, chunk, enc)| Op::Admit { req, chunk, enc }),
        3 => (0..8usize, 1..30usize).prop_map(|(req, chunk)| Op::Step { req, chunk }),
        8 => (0..8usize, 0..3u32).prop_map(|(req, token)| Op::Decode { req, token }),
        1 => (0..8usize).prop_map(|req| Op::Free { req }),
        2 => (0..8usize).prop_map(|req| Op::Remove { req }),
        1 => (0..80u32).prop_map(|block| Op::Evict { block }),
        1 => Just(Op::Reset),
        2 => Just(Op::NewStep),
        1 => (1..5u32).prop_map(|n| Op::Take { n }),
        2 => (
            (0..8usize, 0..3usize, 0..8usize),
            (0..6usize, 0..6usize),
            prop::option::weighted(0.4, (1..40usize, any::<bool>())),
        )
            .prop_map(|((req, group, first), range, partial)| Op::CacheTaken {
                req,
                group,
                first,
                range,
                partial,
            }),
        1 => (0..8usize).prop_map(|k| Op::FreeTaken { k }),
        1 => (0..80u32).prop_map(|block| Op::Touch { block }),
        1 => (0..8usize).prop_map(|k| Op::Unpin { k }),
        2 => (0..8usize, 0..12usize).prop_map(|(req, page)| Op::Adopt { req, page }),
        2 => (0..8usize, 0..12usize).prop_map(|(req, page)| Op::DropPage { req, page }),
        1 => (0..8usize).prop_map(|req| Op::RequireHot { req }),
        1 => (0..8usize, any::<bool>()).prop_map(|(req, pop)| Op::Release { req, pop }),
    ]
}

/// Drives one request like a scheduler: `computed` tokens are done.
struct Sim {
    mgr: KvCacheManager,
    reqs: Vec<(String, u64)>,
    next: usize,
    /// Blocks the engine took with `get_new_blocks` or `touch_blocks` and
    /// has not freed.
    taken: Vec<u32>,
    /// Blocks unpinned and not reported reused yet.
    watched: std::collections::HashSet<u32>,
}

impl Sim {
    /// The first HiSparse resident group, if the layout has one.
    fn resident(&self) -> Option<usize> {
        self.mgr
            .config()
            .groups
            .iter()
            .position(|g| g.kind == AttentionKind::HiSparseResident)
    }

    fn id(&self, i: usize) -> Option<(String, u64)> {
        (!self.reqs.is_empty()).then(|| self.reqs[i % self.reqs.len()].clone())
    }

    fn set(&mut self, id: &str, computed: u64) {
        if let Some(r) = self.reqs.iter_mut().find(|r| r.0 == id) {
            r.1 = computed;
        }
    }

    #[allow(clippy::too_many_lines)] // one arm per operation of the model
    fn apply(&mut self, op: &Op, bases: &[Vec<u32>]) {
        match op {
            Op::Add { base, suffix } => {
                let id = format!("r{}", self.next);
                self.next += 1;
                let mut p = bases[*base].clone();
                p.extend(suffix);
                p.truncate(120);
                let spec = RequestSpec {
                    prompt_token_ids: p,
                    ..Default::default()
                };
                if self.mgr.add_request(&id, spec).is_ok() {
                    self.reqs.push((id, 0));
                }
            }
            Op::Admit { req, chunk, enc } => {
                let Some((id, computed)) = self.id(*req) else {
                    return;
                };
                if computed > 0
                    || self
                        .mgr
                        .block_ids(&id)
                        .is_ok_and(|g| g.iter().any(|b| !b.is_empty()))
                {
                    return;
                }
                let Ok(hit) = self.mgr.get_computed_blocks(&id) else {
                    return;
                };
                let n = self.mgr.num_tokens(&id).unwrap_or(0) as u64;
                let rest = n - hit.num_computed_tokens;
                let new = chunk
                    .map_or(rest, |c| (c as u64).min(rest))
                    .max(1)
                    .min(rest);
                if new == 0 {
                    return;
                }
                let engine = u64::from(*enc % 4);
                let split = split_group(&self.mgr.config().groups).filter(|_| enc % 3 != 0);
                let args = AllocateArgs {
                    num_new_computed_tokens: hit.num_computed_tokens,
                    num_encoder_tokens: u64::from(*enc),
                    full_sequence_must_fit: true,
                    engine_managed_blocks: engine,
                    engine_managed_full_blocks: u64::from(*enc % 5),
                    split_at_group: split,
                    ..AllocateArgs::step(new, 0)
                };
                if let Ok(Some(_)) = self.mgr.allocate_slots(&id, &args, Some(&hit)) {
                    self.set(&id, hit.num_computed_tokens + new);
                    if split.is_some() {
                        // The engine's groups take what the step counted for
                        // them, then the rest of the allocation runs.
                        let blocks = self.mgr.get_new_blocks(engine as u32);
                        assert!(blocks.is_some(), "the step counted {engine} engine blocks");
                        self.taken.extend(blocks.unwrap_or_default());
                        assert!(self.mgr.finish_allocation(&id).is_ok());
                    }
                }
            }
            Op::Step { req, chunk } => {
                let Some((id, computed)) = self.id(*req) else {
                    return;
                };
                let n = self.mgr.num_tokens(&id).unwrap_or(0) as u64;
                if computed == 0 || computed >= n {
                    return;
                }
                let new = (*chunk as u64).min(n - computed);
                if let Ok(Some(_)) =
                    self.mgr
                        .allocate_slots(&id, &AllocateArgs::step(new, computed), None)
                {
                    self.set(&id, computed + new);
                }
            }
            Op::Decode { req, token } => {
                let Some((id, computed)) = self.id(*req) else {
                    return;
                };
                let n = self.mgr.num_tokens(&id).unwrap_or(0) as u64;
                if computed == 0 || computed != n || n >= 150 {
                    return;
                }
                let _ = self.mgr.append_token_ids(&id, &[*token]);
                if let Ok(Some(_)) =
                    self.mgr
                        .allocate_slots(&id, &AllocateArgs::step(1, computed), None)
                {
                    self.set(&id, computed + 1);
                }
            }
            Op::Free { req } => {
                let Some((id, _)) = self.id(*req) else { return };
                let _ = self.mgr.free(&id);
                self.set(&id, 0);
            }
            Op::Remove { req } => {
                let Some((id, _)) = self.id(*req) else { return };
                let _ = self.mgr.remove_request(&id);
                self.reqs.retain(|r| r.0 != id);
            }
            Op::Evict { block } => {
                let _ = self.mgr.evict_blocks(&[*block]);
            }
            Op::Reset => {
                if self.mgr.reset_prefix_cache() {
                    // Every watched block is reported.
                    let mut reused = self.mgr.take_reused_blocks();
                    reused.sort_unstable();
                    let mut watched: Vec<u32> = self.watched.drain().collect();
                    watched.sort_unstable();
                    assert_eq!(reused, watched);
                }
            }
            Op::NewStep => self.mgr.new_step_starts(),
            Op::Take { n } => {
                if let Some(ids) = self.mgr.get_new_blocks(*n) {
                    self.taken.extend(ids);
                }
            }
            Op::CacheTaken {
                req,
                group,
                first,
                range: (from, to),
                partial,
            } => {
                let Some((id, _)) = self.id(*req) else { return };
                if self.taken.is_empty() {
                    return;
                }
                // The request's blocks `from..to`, held in taken blocks from
                // `first` on (refusals, e.g. past the hashed tokens, allowed).
                let first = first % self.taken.len();
                let blocks = &self.taken[first..];
                match partial {
                    None => {
                        let _ =
                            self.mgr
                                .cache_detached_blocks(&id, *group, blocks, (*from, *to), None);
                    }
                    Some((tokens, replace)) => {
                        let _ = self.mgr.cache_detached_partial_block(
                            &id, *group, blocks[0], *tokens, *replace,
                        );
                    }
                }
            }
            Op::FreeTaken { k } => {
                if self.taken.is_empty() {
                    return;
                }
                let k = k % self.taken.len() + 1;
                let freed: Vec<u32> = self.taken.drain(..k).collect();
                assert!(self.mgr.free_blocks(&freed).is_ok());
            }
            Op::Touch { block } => {
                if self.mgr.touch_blocks(&[*block]).is_ok() && *block != 0 {
                    self.taken.push(*block);
                }
            }
            Op::Adopt { req, page } => {
                let (Some((id, _)), Some(g)) = (self.id(*req), self.resident()) else {
                    return;
                };
                let Some(b) = self.mgr.get_new_blocks(1) else {
                    return;
                };
                if !self
                    .mgr
                    .hisparse_adopt_page(&id, g, *page, b[0])
                    .unwrap_or(false)
                {
                    self.taken.push(b[0]);
                }
            }
            Op::DropPage { req, page } => {
                let (Some((id, _)), Some(g)) = (self.id(*req), self.resident()) else {
                    return;
                };
                if let Ok(Some(b)) = self.mgr.hisparse_drop_page(&id, g, *page) {
                    self.taken.push(b);
                }
            }
            Op::RequireHot { req } => {
                let groups = &self.mgr.config().groups;
                let hot = groups
                    .iter()
                    .position(|g| matches!(g.kind, AttentionKind::HiSparseHot { .. }));
                let (Some((id, _)), Some(g)) = (self.id(*req), hot) else {
                    return;
                };
                assert!(self.mgr.hisparse_require_hot(&id, g).is_ok());
            }
            Op::Release { req, pop } => {
                let (Some((id, _)), Some(g)) = (self.id(*req), self.resident()) else {
                    return;
                };
                if *pop {
                    let mut blocks = self.mgr.pop_blocks_before(&id, g).unwrap_or_default();
                    blocks.extend(self.mgr.pop_blocks_for_free(&id).unwrap_or_default());
                    self.taken.extend(blocks.into_iter().filter(|&b| b != 0));
                    self.reqs.retain(|r| r.0 != id);
                } else {
                    assert!(self.mgr.free_groups_before(&id, g).is_ok());
                    assert!(self.mgr.free(&id).is_ok());
                    self.set(&id, 0);
                }
            }
            Op::Unpin { k } => {
                if self.taken.is_empty() {
                    return;
                }
                let k = k % self.taken.len() + 1;
                let unpinned: Vec<u32> = self.taken.drain(..k).collect();
                assert!(self.mgr.unpin_blocks(&unpinned).is_ok());
                self.watched.extend(unpinned);
            }
        }
    }
}

/// One drawn configuration of [`run_hybrid`].
#[derive(Clone, Copy, Debug)]
struct Case {
    layout: usize,
    num_blocks: u32,
    caching: bool,
    eagle: bool,
    retention: Option<u64>,
    eviction: Eviction,
}

/// Runs `ops` on a hybrid manager of `case`, checking every invariant after
/// each op, then releases everything.
fn run_hybrid(case: &Case, bases: &[Vec<u32>], ops: &[Op]) -> Result<(), TestCaseError> {
    let Case {
        layout,
        num_blocks,
        caching,
        eagle,
        retention,
        ..
    } = *case;
    let groups = layouts()[layout].clone();
    let sparse = groups.iter().any(|g| g.kind.is_sparse_retention());
    let mut cfg = ManagerConfig::full_attention(num_blocks, 4, 160);
    cfg.groups = groups;
    cfg.enable_caching = caching;
    cfg.use_eagle = eagle && layout != 3; // vLLM refuses EAGLE with chunked local
    cfg.enable_kv_cache_events = true;
    cfg.hash_algo = HashAlgo::Xxh3Native;
    cfg.hash_seed = Some("p".into());
    cfg.max_in_flight_tokens = Some(32);
    cfg.prefix_cache_retention_interval = if sparse { retention } else { None };
    cfg.eviction = case.eviction;
    let Ok(mgr) = KvCacheManager::new(cfg) else {
        return Ok(());
    };
    let mut sim = Sim {
        mgr,
        reqs: Vec::new(),
        next: 0,
        taken: Vec::new(),
        watched: std::collections::HashSet::new(),
    };
    for (i, op) in ops.iter().enumerate() {
        sim.apply(op, bases);
        if let Err(e) = sim.mgr.check_invariants() {
            prop_assert!(false, "after op {i} {op:?}: {e}");
        }
        let _ = sim.mgr.take_events();
        // Only unpinned blocks are reported reused, each once.
        for b in sim.mgr.take_reused_blocks() {
            prop_assert!(sim.watched.remove(&b), "after op {i} {op:?}: {b} reported");
        }
    }
    let ids: Vec<String> = sim.reqs.iter().map(|r| r.0.clone()).collect();
    for id in ids {
        prop_assert!(sim.mgr.remove_request(&id).is_ok());
    }
    prop_assert!(sim.mgr.free_blocks(&sim.taken).is_ok());
    // vLLM 0.33 itself keeps blocks of a Mamba "align" group referenced
    // after an EAGLE request that ended a chunk inside a Mamba block is
    // freed (the regression case below: its own KVCacheManager leaves the
    // same two blocks, 27 of 29 free); pagedkv reproduces it, so the pool
    // need not be whole again in that corner (and resetting the prefix
    // cache, which needs every block free, may refuse, as vLLM's does).
    let mamba_align_eagle = sim.mgr.config().use_eagle
        && sim.mgr.config().groups.iter().any(|g| {
            matches!(
                g.kind,
                AttentionKind::Mamba {
                    mode: MambaCacheMode::Align,
                    ..
                }
            )
        });
    prop_assert!(sim.mgr.check_invariants().is_ok());
    if !mamba_align_eagle {
        prop_assert_eq!(sim.mgr.num_free_blocks(), num_blocks - 1);
        prop_assert!(sim.mgr.reset_prefix_cache());
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn hybrid_pools_keep_every_invariant(
        layout in 0..14usize,
        num_blocks in 4..80u32,
        caching in any::<bool>(),
        eagle in any::<bool>(),
        retention in prop::option::of(prop_oneof![Just(0u64), Just(16u64)]),
        bases in prop::collection::vec(prop::collection::vec(0..4u32, 8..60), 3),
        ops in prop::collection::vec(op(), 1..150),
    ) {
        let case = Case { layout, num_blocks, caching, eagle, retention, eviction: Eviction::Lru };
        run_hybrid(&case, &bases, &ops)?;
    }

    /// The same under the SLRU and ARC device eviction policies (the pool's
    /// segment invariants included).
    #[test]
    fn hybrid_pools_keep_every_invariant_under_slru_and_arc(
        layout in 0..14usize,
        num_blocks in 4..80u32,
        eagle in any::<bool>(),
        retention in prop::option::of(prop_oneof![Just(0u64), Just(16u64)]),
        arc in any::<bool>(),
        bases in prop::collection::vec(prop::collection::vec(0..4u32, 8..60), 3),
        ops in prop::collection::vec(op(), 1..150),
    ) {
        let eviction = if arc { Eviction::Arc } else { Eviction::Slru };
        let case = Case { layout, num_blocks, caching: true, eagle, retention, eviction };
        run_hybrid(&case, &bases, &ops)?;
    }
}
