//! A decode step of 256 running requests in the core, the floor the Python batch
//! calls are compared with in `benches/boundary_bench.py`: per step one
//! `allocate_slots_batch` (a new block every 16 steps per request) and one
//! `append_token_ids_batch` (hashing the blocks that fill). Requests of 1,000
//! prompt tokens; 2,000 steps per round, the best round counts (the machine is shared);
//! requests named by id, then by handle.
use std::time::{Duration, Instant};

use pagedkv_benches::{admit, manager, tokens};
use pagedkv_core::{BatchAllocation, KvCacheManager, RequestRefs};

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

fn main() {
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
