//! A decode step of 256 running requests in the core, the floor the Python batch
//! calls are compared with in `benches/boundary_bench.py`: per step one
//! `allocate_slots_batch` (a new block every 16 steps per request) and one
//! `append_token_ids_batch` (hashing the blocks that fill). Requests of 1,000
//! prompt tokens; 2,000 steps per round, the best round counts (the machine is shared);
//! requests named by id, then by handle.
//!
//! `decode_batch cold [MiB]`: the same step by handle with the caches cold, as
//! after the scheduler's and the model runner's own work between two steps:
//! before each step a sweep writes a buffer (default 16 MiB); only the two
//! calls are timed, each on its own (per request); then the two in one call
//! (the sampled tokens in the allocation, the computed counts tracked by the
//! manager), as the scheduler loop makes it.
use std::time::{Duration, Instant};

use pagedkv_benches::{admit, manager, tokens};
use pagedkv_core::{BatchAllocation, BatchStep, KvCacheManager, RequestRefs};

const REQS: usize = 256;
const STEPS: u64 = 2000;

fn setup() -> (KvCacheManager, Vec<String>, Vec<u64>) {
    let mut mgr = manager(1 << 16);
    let ids: Vec<String> = (0..REQS).map(|i| format!("req-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        assert!(admit(&mut mgr, id, &tokens(i as u64, 1000, 32000)));
    }
    let handles = ids
        .iter()
        .map(|id| mgr.request_handle(id).expect("known"))
        .collect();
    (mgr, ids, handles)
}

/// Writes one byte per cache line of `buf` (evicting what the step used).
fn sweep(buf: &mut [u8], step: u64) {
    for i in (0..buf.len()).step_by(64) {
        buf[i] = buf[i].wrapping_add(step as u8);
    }
    std::hint::black_box(&buf[..]);
}

fn cold(mib: usize) {
    const COLD_STEPS: u64 = 300;
    let rounds = 5;
    let mut buf = vec![1u8; mib << 20];
    let (mut best_alloc, mut best_append) = (Duration::MAX, Duration::MAX);
    for _ in 0..rounds {
        let (mut mgr, _, handles) = setup();
        let refs = RequestRefs::Handles(&handles);
        let new = vec![1u64; REQS];
        let toks: Vec<u32> = (0..REQS as u32).collect();
        let mut out = BatchAllocation::default();
        let (mut t_alloc, mut t_append) = (Duration::ZERO, Duration::ZERO);
        for step in 0..COLD_STEPS {
            let computed = vec![999 + step; REQS];
            sweep(&mut buf, step);
            let t = Instant::now();
            let _ = mgr.allocate_slots_batch_refs(refs, &new, &computed, 0, &mut out);
            t_alloc += t.elapsed();
            assert_eq!(out.num_allocated, REQS);
            sweep(&mut buf, step);
            let t = Instant::now();
            let _ = mgr.append_token_ids_batch_refs(refs, &toks);
            t_append += t.elapsed();
        }
        best_alloc = best_alloc.min(t_alloc);
        best_append = best_append.min(t_append);
    }
    // The step as the scheduler loop makes it: one call, the sampled tokens in
    // it, the computed counts tracked by the manager.
    let mut best_fused = Duration::MAX;
    for _ in 0..rounds {
        let (mut mgr, _, handles) = setup();
        let new = vec![1u64; REQS];
        let mut sampled = vec![None; REQS];
        let mut out = BatchAllocation::default();
        let mut t_fused = Duration::ZERO;
        for step in 0..COLD_STEPS {
            for (i, t) in sampled.iter_mut().enumerate() {
                *t = Some((i as u64 + step) as u32 % 32000);
            }
            let call = BatchStep {
                append_token_ids: Some(&sampled),
                ..BatchStep::new(RequestRefs::Handles(&handles), &new, None)
            };
            sweep(&mut buf, step);
            let t = Instant::now();
            let _ = mgr.allocate_slots_batch_step(&call, &mut out);
            t_fused += t.elapsed();
            assert_eq!(out.num_allocated, REQS);
        }
        best_fused = best_fused.min(t_fused);
    }
    let per = |d: Duration| d / (COLD_STEPS as u32 * REQS as u32);
    println!(
        "cold ({mib} MiB swept before each call), per request: allocate_slots_batch {:.1?}, append_token_ids_batch {:.1?}, the two in one call {:.1?} (best of {rounds} rounds)",
        per(best_alloc),
        per(best_append),
        per(best_fused)
    );
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("cold") {
        let mib = std::env::args()
            .nth(2)
            .and_then(|s| s.parse().ok())
            .unwrap_or(16);
        cold(mib);
        return;
    }
    let rounds = 7;
    for by_handle in [false, true] {
        let mut best = Duration::MAX;
        for _ in 0..rounds {
            let (mut mgr, ids, handles) = setup();
            let names: Vec<&str> = ids.iter().map(String::as_str).collect();
            let refs = if by_handle {
                RequestRefs::Handles(&handles)
            } else {
                RequestRefs::Ids(&names)
            };
            let new = vec![1u64; REQS];
            let toks: Vec<u32> = (0..REQS as u32).collect();
            let mut out = BatchAllocation::default();
            let t = Instant::now();
            for step in 0..STEPS {
                let computed = vec![999 + step; REQS];
                let _ = mgr.allocate_slots_batch_refs(refs, &new, &computed, 0, &mut out);
                assert_eq!(out.num_allocated, REQS);
                let _ = mgr.append_token_ids_batch_refs(refs, &toks);
            }
            best = best.min(t.elapsed());
        }
        let name = if by_handle { "handles" } else { "ids" };
        println!(
            "{:.2?} per 256-request decode step by {name} (best of {rounds} rounds)",
            best / STEPS as u32
        );
    }
}
