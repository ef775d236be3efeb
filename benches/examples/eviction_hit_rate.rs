//! Prefix-cache hit rate of the floor's trace (`pagedkv_benches::trace`, the
//! trace of `benches/drive_bench.py`) under each device eviction policy, by
//! pool size: tokens served from the cache over tokens looked up, and the
//! steps and preemptions of the run.
//!
//! `cargo run --release -p pagedkv-benches --example eviction_hit_rate [requests] [blocks,...]`
use pagedkv_benches::{arg, floor, trace};
use pagedkv_core::{Eviction, KvCacheManager, ManagerConfig};

fn main() {
    let reqs = trace::generate(0, arg(1, 2000usize));
    let sizes: Vec<u32> = std::env::args()
        .nth(2)
        .unwrap_or_else(|| "1024,2048,4096".into())
        .split(',')
        .filter_map(|s| s.parse().ok())
        .collect();
    println!("blocks  policy  hit_rate  steps  preemptions");
    for &blocks in &sizes {
        for policy in Eviction::ALL {
            let mut cfg = ManagerConfig::full_attention(blocks, 16, 16384);
            cfg.max_in_flight_tokens = Some(8192);
            cfg.log_stats = true;
            cfg.eviction = policy;
            let Ok(mut kv) = KvCacheManager::new(cfg) else {
                continue;
            };
            let s = floor::run(&mut kv, &reqs, false);
            let st = kv.make_prefix_cache_stats().unwrap_or_default();
            let (hits, queries) = (
                st.hits + st.preempted_hits,
                st.queries + st.preempted_queries,
            );
            println!(
                "{blocks:6}  {:6}  {:8.4}  {:5}  {:11}",
                policy.name(),
                hits as f64 / queries.max(1) as f64,
                s.steps,
                s.preemptions
            );
        }
    }
}
