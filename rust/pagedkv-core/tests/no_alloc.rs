//! A steady-state decode step makes no heap allocation: the batch calls reuse
//! their output buffers, hashing encodes on the stack, and per-request vectors
//! grow only when a request outgrows what it reserved.
// A global allocator is an `unsafe impl` by definition; this one only counts
// and forwards every call to the system allocator.
#![allow(unsafe_code)]
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use pagedkv_core::{
    AllocateArgs, BatchAllocation, KvCacheManager, ManagerConfig, RequestRefs, RequestSpec,
};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: the caller's contract is System's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is System's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: the caller's contract is System's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn counted<T>(f: impl FnOnce() -> T) -> (T, u64) {
    ALLOCATIONS.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::Relaxed);
    let out = f();
    COUNTING.store(false, Ordering::Relaxed);
    (out, ALLOCATIONS.load(Ordering::Relaxed))
}

#[test]
fn steady_state_decode_steps_allocate_nothing() {
    const REQS: usize = 64;
    let mut mgr =
        KvCacheManager::new(ManagerConfig::full_attention(1 << 14, 16, 1 << 16)).expect("config");
    let mut handles = Vec::new();
    for i in 0..REQS {
        let id = format!("r{i}");
        let prompt: Vec<u32> = (0..1000).map(|t| (t * 31 + i as u32 * 7) % 32000).collect();
        let spec = RequestSpec {
            prompt_token_ids: prompt,
            ..RequestSpec::default()
        };
        handles.push(mgr.add_request(&id, spec).expect("add"));
        let hit = mgr.get_computed_blocks(&id).expect("lookup");
        let args = AllocateArgs {
            num_new_computed_tokens: hit.num_computed_tokens,
            full_sequence_must_fit: true,
            ..AllocateArgs::step(1000 - hit.num_computed_tokens, 0)
        };
        let admitted = mgr.allocate_slots(&id, &args, Some(&hit)).expect("admit");
        assert!(admitted.is_some());
    }
    let refs = RequestRefs::Handles(&handles);
    let new = vec![1u64; REQS];
    let toks: Vec<u32> = (0..REQS as u32).collect();
    let mut computed = vec![0u64; REQS];
    let mut out = BatchAllocation::default();
    let mut step = |s: u64, out: &mut BatchAllocation| {
        computed.fill(999 + s);
        mgr.allocate_slots_batch_refs(refs, &new, &computed, 0, out)
            .expect("allocate");
        assert_eq!(out.num_allocated, REQS);
        mgr.append_token_ids_batch_refs(refs, &toks)
            .expect("append");
    };
    // Warm-up: the batch's output buffers reach their size (a step in which
    // every request gets a new block).
    for s in 0..16 {
        step(s, &mut out);
    }
    // 96 steps: six blocks fill and get hashed per request, six new blocks per
    // request. (The prefix map grows by doubling while the cache fills; it has
    // room here: 4,416 entries in a table that holds 7,168.)
    let ((), n) = counted(|| {
        for s in 16..112 {
            step(s, &mut out);
        }
    });
    assert_eq!(n, 0, "{n} heap allocations in 96 steady-state decode steps");
}
