//! Instruction-count probe for comparing two builds without timing noise:
//! `decode N` makes N decode `allocate_slots` calls that need no new block,
//! `admit N` admits and removes N distinct 2,560-token prompts, on one
//! full-attention manager, `lookup N` makes N lookups of a cached 160-block
//! prefix (`lookup_hybrid N`: with three sliding-window groups beside),
//! `batch N` makes N decode steps of 256 running requests, each one
//! `allocate_slots_batch_step` by handle with the tracked counts and a sampled
//! token per request (a block fills every 16 steps). Run under callgrind with N
//! and with 0; the difference divided by N is the instructions per call (per
//! step for `batch`: divide by 256 for a request's share):
//!
//! `valgrind --tool=callgrind target/release/examples/call_instructions decode 200000`
//!
//! Pool probes per device eviction policy (`lru`, `arc`, `slru`):
//! `get_free_<policy> N` takes and frees one block N times,
//! `cycle_<policy> N` runs the pool bench's cached cycle (take 16 blocks of a
//! full cache, cache them, hit half, free all) N times.
use pagedkv_core::{
    AllocateArgs, AttentionKind, BatchAllocation, BatchStep, BlockHash, BlockPool, CacheKey,
    Eviction, GroupSpec, KvCacheManager, ManagerConfig, RequestRefs, RequestSpec,
};
use std::hint::black_box;

fn main() {
    let what = std::env::args().nth(1).unwrap_or_default();
    let n: u64 = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000);
    if let Some(policy) = what.strip_prefix("get_free_") {
        pool_probe(Eviction::parse(policy).unwrap(), n, false);
        return;
    }
    if let Some(policy) = what.strip_prefix("cycle_") {
        pool_probe(Eviction::parse(policy).unwrap(), n, true);
        return;
    }
    let mut cfg = ManagerConfig::full_attention(1 << 16, 16, 1 << 20);
    if what == "lookup_hybrid" {
        // Full attention and three sliding windows (512, 1,024 and 1,536 tokens).
        cfg.groups = (0..4u32)
            .map(|i| {
                let kind = if i == 0 {
                    AttentionKind::FullAttention
                } else {
                    AttentionKind::SlidingWindow { window: 512 * i }
                };
                GroupSpec::new(kind, 16)
            })
            .collect();
    }
    let mut mgr = KvCacheManager::new(cfg).unwrap();
    let prompt: Vec<u32> = (0..1000u32).map(|i| (i * 7919) % 32000).collect();
    mgr.add_request(
        "r",
        RequestSpec {
            prompt_token_ids: prompt,
            ..Default::default()
        },
    )
    .unwrap();
    let hit = mgr.get_computed_blocks("r").unwrap();
    mgr.allocate_slots("r", &AllocateArgs::step(1000, 0), Some(&hit))
        .unwrap();
    if what == "batch" {
        batch(&mut mgr, n);
    } else if what == "decode" {
        let args = AllocateArgs::step(1, 999);
        for _ in 0..n {
            black_box(mgr.allocate_slots("r", &args, None).unwrap().is_some());
        }
    } else if what == "lookup" || what == "lookup_hybrid" {
        let cached: Vec<u32> = (0..2560u32).map(|i| (i * 31) % 32000).collect();
        assert!(pagedkv_benches::admit(&mut mgr, "c", &cached));
        let mut p = cached;
        p.push(1);
        mgr.add_request(
            "h",
            RequestSpec {
                prompt_token_ids: p,
                ..Default::default()
            },
        )
        .unwrap();
        for _ in 0..n {
            black_box(mgr.get_computed_blocks("h").unwrap().num_computed_tokens);
        }
    } else if what == "admit" {
        let base: Vec<u32> = (0..2560u32).map(|i| (i * 31) % 32000).collect();
        for i in 0..n {
            let mut p = base.clone();
            p[0] = (i % 30000) as u32;
            let id = format!("a{i}");
            mgr.add_request(
                &id,
                RequestSpec {
                    prompt_token_ids: p,
                    ..Default::default()
                },
            )
            .unwrap();
            let h = mgr.get_computed_blocks(&id).unwrap();
            black_box(
                mgr.allocate_slots(&id, &AllocateArgs::step(2560, 0), Some(&h))
                    .unwrap()
                    .is_some(),
            );
            mgr.remove_request(&id).unwrap();
        }
    }
}

/// `batch N`: 256 requests of 1,000 prompt tokens admitted, then N decode steps.
fn batch(mgr: &mut KvCacheManager, n: u64) {
    const REQS: u32 = 256;
    let mut handles = Vec::new();
    for i in 0..REQS {
        let id = format!("b{i}");
        let prompt: Vec<u32> = (0..1000u32).map(|t| (t * 7919 + i * 31) % 32000).collect();
        assert!(pagedkv_benches::admit(mgr, &id, &prompt));
        handles.push(mgr.request_handle(&id).unwrap());
    }
    let new = vec![1u64; REQS as usize];
    let mut out = BatchAllocation::default();
    let mut tokens = vec![None; REQS as usize];
    for step in 0..n {
        for (i, t) in tokens.iter_mut().enumerate() {
            *t = Some((i as u32 + step as u32) % 32000);
        }
        mgr.allocate_slots_batch_step(
            &BatchStep {
                append_token_ids: Some(&tokens),
                ..BatchStep::new(RequestRefs::Handles(&handles), &new, None)
            },
            &mut out,
        )
        .unwrap();
        black_box(out.num_allocated);
    }
}

/// The pool probes: N calls of one block taken and freed, or (`cycle`) of
/// the cached cycle: 16 blocks of a full cache taken (evicting), cached
/// afresh, half of them hit, all freed tail first.
fn pool_probe(policy: Eviction, n: u64, cycle: bool) {
    let mut pool = BlockPool::new(1 << 16, true, false).with_eviction(policy);
    let mut out = Vec::with_capacity(16);
    let key = |i: u64| {
        let mut d = [0u8; 32];
        d[..8].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
        CacheKey {
            hash: BlockHash::from_slice(&d).unwrap(),
            group: 0,
        }
    };
    // A full cache first: every block cached once.
    let warm = if cycle { (1u64 << 16) / 16 + 1 } else { 0 };
    let mut k = 0u64;
    for i in 0..warm + n {
        out.clear();
        if cycle {
            pool.get_new_blocks(16, &mut out);
            for &id in &out {
                pool.cache_block(id, key(k));
                k += 1;
            }
            pool.touch(&out[..8]);
            pool.free_blocks(out[..8].iter().rev().copied());
        } else {
            pool.get_new_blocks(1, &mut out);
        }
        pool.free_blocks(out.iter().rev().copied());
        black_box(i);
    }
}
