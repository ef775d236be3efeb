//! The scheduler-step benchmark in pure Rust (the floor, `pagedkv_benches::floor`):
//! the same trace and the same policy as `benches/drive_bench.py` (which drives
//! pagedkv through `pagedkv.sim.policy` from Python), so the difference is the cost
//! of the Python boundary. Prints the allocation checksum (equal to
//! vLLM's `aea7f22d7e6432be` on the default trace) and manager time per step.
//!
//! `cargo run --release -p pagedkv-benches --example drive_floor [requests] [blocks]`
//!
//! `drive_floor critical [MiB] [rounds] [background|in-place|in-place,-no-memo|prepared]`:
//! the critical path of `benches/critical_path_bench.py` with no Python at all:
//! the calls the scheduler's backend makes (handles, sampled tokens with the
//! next allocation), prompts hashed in place (with the hash memo and without
//! it), on the hash worker, or with every
//! request built and hashed before the loop (`RequestPreparer`, registered by
//! `add_prepared`), alternated over the rounds (default 5; or only the one
//! named); time inside the manager's calls per step, min / median. With `MiB` > 0 a buffer that large is swept before
//! every step, the caches cold as after a Python scheduler's own work.
use std::time::Instant;

use pagedkv_benches::{arg, floor, trace};
use pagedkv_core::{KvCacheManager, ManagerConfig};

fn config(num_blocks: u32, background: bool) -> ManagerConfig {
    let mut cfg = ManagerConfig::full_attention(num_blocks, 16, 16384);
    cfg.max_in_flight_tokens = Some(8192);
    cfg.background_hashing = background;
    cfg
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("critical") {
        critical(arg(2, 0usize), arg(3, 5usize));
        return;
    }
    let reqs = trace::generate(0, arg(1, 2000usize));
    let Ok(mut kv) = KvCacheManager::new(config(arg(2, 4096u32), false)) else {
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

/// A row of the table: its label and the time it reports.
type Row = (&'static str, fn(&floor::CallTimes) -> u64);

fn critical(mib: usize, rounds: usize) {
    let reqs = trace::generate(0, 2000);
    let only = std::env::args().nth(4);
    // (name, background hashing, requests prepared before the loop, no
    // hash memo)
    let modes: Vec<(&str, bool, bool, bool)> = [
        ("in place", false, false, false),
        ("in place, no memo", false, false, true),
        ("background", true, false, false),
        ("prepared", false, true, false),
    ]
    .into_iter()
    .filter(|(name, ..)| only.as_deref().is_none_or(|o| o.replace('-', " ") == *name))
    .collect();
    if modes.is_empty() {
        eprintln!("modes: in-place, in-place,-no-memo, background, prepared");
        return;
    }
    let mut runs: Vec<Vec<floor::Summary>> = vec![Vec::new(); modes.len()];
    for round in 0..rounds.max(1) {
        for k in 0..modes.len() {
            let m = if round % 2 == 0 {
                k
            } else {
                modes.len() - 1 - k
            };
            let mut cfg = config(4096, modes[m].1);
            if modes[m].3 {
                cfg.hash_memo_blocks = Some(0);
            }
            let Ok(mut kv) = KvCacheManager::new(cfg) else {
                return;
            };
            let mut opts = floor::Options {
                fused: true,
                sweep: vec![0u8; mib << 20],
                prepared: modes[m].2,
                ..Default::default()
            };
            runs[m].push(floor::run_with(&mut kv, &reqs, &mut opts));
        }
    }
    let checksums: Vec<u64> = runs.iter().flatten().map(|s| s.alloc_checksum).collect();
    println!(
        "drive trace in pure Rust, {} MiB swept before each step, µs per step, min / median \
         of {} rounds (alloc_checksum {:016x}{})",
        mib,
        rounds.max(1),
        checksums[0],
        if checksums.iter().all(|&c| c == checksums[0]) {
            ", every run"
        } else {
            ", RUNS DIFFER"
        }
    );
    let rows: [Row; 8] = [
        ("critical path (manager calls)", floor::CallTimes::total),
        ("  add_request", |t| t.add_request),
        ("  get_computed_blocks", |t| t.lookup),
        ("  allocate_slots (admission)", |t| t.admit),
        ("  running requests' batch call", |t| t.batch),
        ("  remove_request", |t| t.remove_request),
        ("  preemption (append + free)", |t| t.preempt),
        ("  new_step_starts", |t| t.new_step_starts),
    ];
    print!("{:34}", "");
    for (name, ..) in &modes {
        print!("{name:>22}");
    }
    println!();
    for (label, get) in rows {
        print!("{label:34}");
        for r in &runs {
            let mut v: Vec<f64> = r
                .iter()
                .map(|s| get(&s.ns) as f64 / 1e3 / s.steps as f64)
                .collect();
            v.sort_by(f64::total_cmp);
            print!("{:>11.2} / {:>7.2}", v[0], v[v.len() / 2]);
        }
        println!();
    }
}
