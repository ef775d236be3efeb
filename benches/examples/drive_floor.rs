//! The scheduler-step benchmark in pure Rust (the floor, `pagedkv_benches::floor`):
//! the same trace and the same policy as `benches/drive_bench.py` (which drives
//! pagedkv through `pagedkv.sim.policy` from Python), so the difference is the cost
//! of the Python boundary. Prints the allocation checksum (equal to
//! vLLM's `aea7f22d7e6432be` on the default trace) and manager time per step.
//!
//! `cargo run --release -p pagedkv-benches --example drive_floor [requests] [blocks]`
use std::time::Instant;

use pagedkv_benches::{arg, floor, trace};
use pagedkv_core::{KvCacheManager, ManagerConfig};

fn main() {
    let reqs = trace::generate(0, arg(1, 2000usize));
    let mut cfg = ManagerConfig::full_attention(arg(2, 4096u32), 16, 16384);
    cfg.max_in_flight_tokens = Some(8192);
    let Ok(mut kv) = KvCacheManager::new(cfg) else {
        return;
    };
    let dbg = std::env::var_os("DRIVE_DEBUG").is_some();
    let t0 = Instant::now();
    let s = floor::run(&mut kv, &reqs, dbg);
    let el = t0.elapsed();
    println!(
        "steps {}, preemptions {}, alloc_checksum {:016x}, \
         {:.1} µs/step (loop incl. hashing; {:.2?} total)",
        s.steps,
        s.preemptions,
        s.alloc_checksum,
        el.as_secs_f64() * 1e6 / s.steps as f64,
        el
    );
}
