//! The prefix index's best-replica query over long chains, each query on
//! caches a 64 MiB sweep has emptied (as between two routing decisions of a
//! busy router):
//!
//! `cargo run --release -p pagedkv-benches --example index_long_query [QUERIES]`
//!
//! 8 replicas hold 1,000 chains of 1,024 blocks (each chain whole on one
//! replica and its first half on another: 1.5 million indexed pairs); each
//! query is a whole chain, a different one each time. Prints the median and
//! the 99th percentile of QUERIES (default 600) timings, in µs.
use pagedkv_core::prefix_index::PrefixIndex;
use pagedkv_splitmix::SplitMix64;
use std::hint::black_box;
use std::time::Instant;

const CHAINS: usize = 1_000;
const BLOCKS: usize = 1_024;
const REPLICAS: usize = 8;

fn main() {
    let queries: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(600)
        .max(1);
    let mut index = PrefixIndex::new();
    let replicas: Vec<_> = (0..REPLICAS)
        .map(|r| index.replica(&format!("r{r}")))
        .collect();
    let mut rng = SplitMix64(7);
    let chains: Vec<Vec<u64>> = (0..CHAINS)
        .map(|_| (0..BLOCKS).map(|_| rng.next_u64()).collect())
        .collect();
    for (i, chain) in chains.iter().enumerate() {
        let whole = replicas[i % REPLICAS];
        let half = replicas[(i + 3) % REPLICAS];
        index
            .store(whole, None, chain, None)
            .expect("a registered replica");
        index
            .store(half, None, &chain[..BLOCKS / 2], None)
            .expect("a registered replica");
    }
    let mut sweep = vec![1u64; 8 << 20];
    let mut us = Vec::with_capacity(queries);
    for q in 0..queries {
        for (i, w) in sweep.iter_mut().enumerate().step_by(8) {
            *w = w.wrapping_add(i as u64);
        }
        let chain = &chains[(q * 7_919) % CHAINS];
        let t = Instant::now();
        black_box(index.longest_prefix(black_box(chain), None));
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    black_box(&sweep);
    us.sort_by(f64::total_cmp);
    println!(
        "best replica, {BLOCKS}-block chain, cold caches: median {:.1} µs, p99 {:.1} µs ({queries} queries)",
        us[us.len() / 2],
        us[(us.len() * 99 / 100).min(us.len() - 1)]
    );
}
