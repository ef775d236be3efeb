//! A profiling target: decode steps of 256 running requests (no new block on 15 of
//! 16 steps), as `perf record` / callgrind input.
use pagedkv_benches::{admit, manager, tokens};
use pagedkv_core::AllocateArgs;

fn main() {
    let mut mgr = manager(1 << 16);
    let ids: Vec<String> = (0..256).map(|i| format!("req-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        assert!(admit(&mut mgr, id, &tokens(i as u64, 1000, 32000)));
    }
    let steps: u64 = pagedkv_benches::arg(1, 2000);
    for step in 0..steps {
        for id in &ids {
            if step % 16 == 0 {
                let _ = mgr.append_token_ids(id, &[7; 16]);
            }
            let args = AllocateArgs::step(1, 999);
            let _ = mgr.allocate_slots(id, &args, None);
        }
    }
    println!("free {}", mgr.num_free_blocks());
}
