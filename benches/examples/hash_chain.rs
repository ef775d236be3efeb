//! `sha256_cbor` over a chained prompt (each block's parent is the hash just
//! computed, as in `add_request`), timed in many short rounds so that the
//! machine's noise shows in the percentiles instead of in one mean:
//!
//! `cargo run --release -p pagedkv-benches --example hash_chain [ROUNDS]`
//!
//! Prints ns per block: min, 10th percentile and median of ROUNDS (default
//! 400) timings of 20 hashes of a 64-block prompt of 16-token blocks.
use pagedkv_core::hash::{BlockHasher, HashAlgo};
use std::hint::black_box;
use std::time::Instant;

const PROMPTS_PER_ROUND: u32 = 20;

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(400)
        .max(1);
    // Token ids below 32,000 (a Llama-2-sized vocabulary), from a fixed LCG.
    let mut x: u32 = 12_345;
    let chain: Vec<Vec<u32>> = (0..64)
        .map(|_| {
            (0..16)
                .map(|_| {
                    x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                    (x >> 8) % 32_000
                })
                .collect()
        })
        .collect();
    let mut h = BlockHasher::new(
        HashAlgo::Sha256Cbor,
        HashAlgo::Sha256Cbor.none_hash("bench"),
    );
    let blocks = f64::from(PROMPTS_PER_ROUND) * chain.len() as f64;
    let mut ns: Vec<f64> = (0..rounds)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..PROMPTS_PER_ROUND {
                let mut parent = None;
                for block in &chain {
                    parent = Some(h.hash_block(parent.as_ref(), black_box(block), &[]));
                }
                black_box(parent);
            }
            t.elapsed().as_nanos() as f64 / blocks
        })
        .collect();
    ns.sort_by(f64::total_cmp);
    println!(
        "sha256_cbor chained, ns per block: min {:.1}  p10 {:.1}  median {:.1}",
        ns[0],
        ns[rounds / 10],
        ns[rounds / 2]
    );
}
