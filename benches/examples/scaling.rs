//! Per-operation cost against pool size, 10^3 .. 10^7 blocks. The pool is built,
//! 3/4 of it filled with cached blocks of finished 512-token requests, then the same
//! fixed workload runs at every size, so only the pool differs: cycles of 16
//! requests that are admitted (a 512-token prompt that misses and takes blocks by
//! evicting cached ones, hashing 32 blocks with `sha256_cbor`), decoded for 48
//! steps (append one token, allocate: a new block, evicting a cached one, every 16
//! steps), looked up again (a 32-block hit), and removed.
//!
//! `cargo run --release -p pagedkv-benches --example scaling [cycles]`
use std::time::{Duration, Instant};

use pagedkv_benches::{admit, manager, tokens};
use pagedkv_core::AllocateArgs;

const LIVE: usize = 16;
const PROMPT: usize = 512;
const DECODE: u64 = 48;

fn main() {
    let cycles: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    println!(
        "| blocks | build | admit (miss, 32 evictions) | decode step | \
         lookup hit (32 blocks) | remove |"
    );
    println!("|---|---|---|---|---|---|");
    for exp in 3..=7u32 {
        let n = 10u32.pow(exp);
        let t = Instant::now();
        let mut mgr = manager(n);
        let build = t.elapsed();
        let fill = (n as usize * 3 / 4) / (PROMPT / 16);
        for i in 0..fill {
            let id = format!("f{i}");
            assert!(admit(&mut mgr, &id, &tokens(i as u64, PROMPT, 32000)));
            let _ = mgr.remove_request(&id);
        }
        let ids: Vec<String> = (0..LIVE).map(|i| format!("r{i}")).collect();
        let (mut t_admit, mut t_decode, mut t_lookup, mut t_remove) = (
            Duration::ZERO,
            Duration::ZERO,
            Duration::ZERO,
            Duration::ZERO,
        );
        for c in 0..cycles {
            let prompts: Vec<Vec<u32>> = (0..LIVE)
                .map(|i| tokens(1_000_000 + (c * LIVE + i) as u64, PROMPT, 32000))
                .collect();
            let t = Instant::now();
            for (id, p) in ids.iter().zip(&prompts) {
                assert!(admit(&mut mgr, id, p));
            }
            t_admit += t.elapsed();
            let t = Instant::now();
            for s in 0..DECODE {
                for id in &ids {
                    let _ = mgr.append_token_ids(id, &[s as u32]);
                    let args = AllocateArgs::step(1, PROMPT as u64 + s);
                    assert!(matches!(mgr.allocate_slots(id, &args, None), Ok(Some(_))));
                }
            }
            t_decode += t.elapsed();
            let t = Instant::now();
            for id in &ids {
                let hit = mgr.get_computed_blocks(id);
                assert!(hit.is_ok());
            }
            t_lookup += t.elapsed();
            let t = Instant::now();
            for id in &ids {
                let _ = mgr.remove_request(id);
            }
            t_remove += t.elapsed();
        }
        let per = |d: Duration, k: u64| d / (cycles as u64 * k) as u32;
        println!(
            "| 10^{exp} | {build:.2?} | {:.2?} | {:.2?} | {:.2?} | {:.2?} |",
            per(t_admit, LIVE as u64),
            per(t_decode, LIVE as u64 * DECODE),
            per(t_lookup, LIVE as u64),
            per(t_remove, LIVE as u64),
        );
    }
}
