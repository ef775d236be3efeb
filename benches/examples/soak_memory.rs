//! Resident memory over 10^7 manager operations (admit, decode steps, remove, in a
//! rotating set of requests whose finished blocks stay cached): RSS is
//! printed every 10^6 operations; once warm it should stay flat.
//!
//! `cargo run --release -p pagedkv-benches --example soak_memory`
use pagedkv_benches::{admit, manager, tokens};
use pagedkv_core::AllocateArgs;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map_or(0, |pages| pages * 4)
}

fn main() {
    let total: u64 = pagedkv_benches::arg(1, 10_000_000);
    let mut mgr = manager(1 << 14);
    let mut ops = 0u64;
    let mut next = 0u64;
    let mut live: Vec<(String, u64)> = Vec::new();
    let mut report = 1_000_000u64;
    println!("| operations | RSS (MiB) | free blocks |");
    println!("|---|---|---|");
    while ops < total {
        // Keep 64 requests running; each runs 64 decode steps, then leaves.
        while live.len() < 64 {
            let id = format!("r{next}");
            // Prompts share one of 16 prefixes, so lookups hit.
            let mut p = tokens(next % 16, 256, 32000);
            p.extend(tokens(next + 1_000_000, 64, 32000));
            next += 1;
            if admit(&mut mgr, &id, &p) {
                live.push((id, 320));
            }
            ops += 3;
        }
        for (id, n) in &mut live {
            let _ = mgr.append_token_ids(id, &[(*n % 32000) as u32]);
            let _ = mgr.allocate_slots(id, &AllocateArgs::step(1, *n), None);
            *n += 1;
            ops += 2;
        }
        live.retain(|(id, n)| {
            if *n >= 384 {
                let _ = mgr.remove_request(id);
                false
            } else {
                true
            }
        });
        if ops >= report || ops >= total {
            report += 1_000_000;
            println!(
                "| {ops} | {:.1} | {} |",
                rss_kib() as f64 / 1024.0,
                mgr.num_free_blocks()
            );
        }
    }
}
