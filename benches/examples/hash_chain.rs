//! `sha256_cbor` over a chained prompt (each block's parent is the hash just
//! computed, as in `add_request`), timed in many short rounds so that the
//! machine's noise shows in the percentiles instead of in one mean:
//!
//! `cargo run --release -p pagedkv-benches --example hash_chain [ROUNDS]`
//!
//! Prints ns per block: min, 10th percentile and median of ROUNDS (default
//! 400) timings of 20 hashes of a 64-block prompt of 16-token blocks, without
//! the hash memo, with a memo that holds the prompt (every block looked up and
//! found) and with one that holds two blocks (every block looked up, missed,
//! hashed and recorded).
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
    let blocks = f64::from(PROMPTS_PER_ROUND) * chain.len() as f64;
    // (label, memo entries): no memo; a memo holding the chain, every block
    // found; a memo of one set, every block displacing another and hashed.
    for (label, memo) in [
        ("no memo", 0),
        ("memo, all found", 1 << 12),
        ("memo, none found", 2),
    ] {
        let mut h = BlockHasher::new(
            HashAlgo::Sha256Cbor,
            HashAlgo::Sha256Cbor.none_hash("bench"),
        );
        h.set_memo(16, memo);
        let mut ns: Vec<f64> = (0..rounds)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..PROMPTS_PER_ROUND {
                    // As `add_request` hashes a prompt: the memo taken once.
                    let last = h.chain(true, |c| {
                        let mut parent = None;
                        for block in &chain {
                            parent = Some(c.hash(parent.as_ref(), black_box(block), &[]));
                        }
                        parent
                    });
                    black_box(last);
                }
                t.elapsed().as_nanos() as f64 / blocks
            })
            .collect();
        ns.sort_by(f64::total_cmp);
        println!(
            "sha256_cbor chained, {label:>16}, ns per block: min {:.1}  p10 {:.1}  median {:.1}",
            ns[0],
            ns[rounds / 10],
            ns[rounds / 2]
        );
    }
}
