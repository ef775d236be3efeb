//! Per-operation cost against pool size: build time, then admit (hash + lookup +
//! allocate) / decode / remove of requests on a pool that is 3/4 full of cached
//! blocks, for 10^3 .. 10^7 blocks.
//!
//! `cargo run --release -p pagedkv-benches --example scaling`
use std::time::Instant;

use pagedkv_benches::{admit, manager, tokens};
use pagedkv_core::AllocateArgs;

fn main() {
    println!(
        "| blocks | build | admit 512-token prompt | decode step | lookup hit (32 blocks) | remove |"
    );
    println!("|---|---|---|---|---|---|");
    for exp in 3..=7u32 {
        let n = 10u32.pow(exp);
        let t = Instant::now();
        let mut mgr = manager(n);
        let build = t.elapsed();
        // Fill 3/4 of the pool with cached blocks of finished requests.
        let fill = (n as usize * 3 / 4) / 32;
        for i in 0..fill {
            let id = format!("f{i}");
            assert!(admit(&mut mgr, &id, &tokens(i as u64, 512, 32000)));
            let _ = mgr.remove_request(&id);
        }
        let rounds = 2000usize.min(n as usize / 40).max(20);
        let prompts: Vec<Vec<u32>> = (0..rounds)
            .map(|i| tokens(1_000_000 + i as u64, 512, 32000))
            .collect();
        let t = Instant::now();
        for (i, p) in prompts.iter().enumerate() {
            assert!(admit(&mut mgr, &format!("r{i}"), p));
        }
        let admit_t = t.elapsed() / rounds as u32;
        let t = Instant::now();
        for i in 0..rounds {
            let _ = mgr.allocate_slots(&format!("r{i}"), &AllocateArgs::step(1, 511), None);
        }
        let decode_t = t.elapsed() / rounds as u32;
        // A prompt extending one just admitted: a 32-block hit.
        let mut probe = prompts[0].clone();
        probe.push(1);
        let _ = mgr.add_request(
            "probe",
            pagedkv_core::RequestSpec {
                prompt_token_ids: probe,
                ..Default::default()
            },
        );
        let t = Instant::now();
        for _ in 0..rounds {
            let _ = mgr.get_computed_blocks("probe");
        }
        let lookup_t = t.elapsed() / rounds as u32;
        let t = Instant::now();
        for i in 0..rounds {
            let _ = mgr.remove_request(&format!("r{i}"));
        }
        let remove_t = t.elapsed() / rounds as u32;
        println!(
            "| 10^{exp} | {build:.2?} | {admit_t:.2?} | {decode_t:.2?} | {lookup_t:.2?} | {remove_t:.2?} |"
        );
    }
}
