//! The batch decode call in the core: 256 running requests per step, no new block
//! (the floor the Python batch call is compared with).
use std::time::Instant;

use pagedkv_benches::{admit, manager, tokens};
use pagedkv_core::BatchAllocation;

fn main() {
    let mut mgr = manager(1 << 16);
    let ids: Vec<String> = (0..256).map(|i| format!("req-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        assert!(admit(&mut mgr, id, &tokens(i as u64, 1000, 32000)));
    }
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let new = vec![1u64; 256];
    let computed = vec![999u64; 256];
    let mut out = BatchAllocation::default();
    let steps = 20_000u32;
    let t = Instant::now();
    for _ in 0..steps {
        let _ = mgr.allocate_slots_batch(&refs, &new, &computed, 0, &mut out);
    }
    println!("{:.2?} per 256-request batch", t.elapsed() / steps);
}
