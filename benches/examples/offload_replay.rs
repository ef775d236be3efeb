//! The core's side of `benches/offload_bench.py --core-bin`: replays the calls
//! `--core-ops` wrote (recorded from vLLM's manager), each pass on a fresh
//! tier as the Python sides build a fresh manager, and prints µs per call (the
//! median of `PASSES` timed passes, after one untimed pass).
//!
//! `cargo run --release -p pagedkv-benches --example offload_replay -- OPS.txt [PASSES]`

use std::hint::black_box;
use std::process::ExitCode;
use std::time::Instant;

use pagedkv_benches::offload_replay;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let Some(path) = args.get(1) else {
        eprintln!("usage: offload_replay OPS.txt [PASSES (1..=100000)]");
        return ExitCode::FAILURE;
    };
    let passes = match args.get(2).map(|s| s.parse::<u32>()) {
        None => 20,
        Some(Ok(n)) if (1..=100_000).contains(&n) => n,
        Some(_) => {
            eprintln!("PASSES: an integer in 1..=100000");
            return ExitCode::FAILURE;
        }
    };
    let calls = match std::fs::read_to_string(path)
        .map_err(|e| e.to_string())
        .and_then(|t| offload_replay::parse(&t))
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{path}: {e}");
            return ExitCode::FAILURE;
        }
    };
    black_box(offload_replay::run(&calls));
    let mut times: Vec<f64> = (0..passes)
        .map(|_| {
            let t = Instant::now();
            black_box(offload_replay::run(&calls));
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    let per_call = times[times.len() / 2] * 1e6 / calls.calls.len() as f64;
    println!("{per_call:.4}");
    ExitCode::SUCCESS
}
