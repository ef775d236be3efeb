//! The scheduler-step benchmark in pure Rust: the same trace and the same loop as
//! `benches/drive_bench.py` (which drives pagedkv from Python), so the difference
//! is the cost of the Python boundary. Prints the allocation checksum (equal to
//! vLLM's `aea7f22d7e6432be` on the default trace) and manager time per step.
//!
//! `cargo run --release -p pagedkv-benches --example drive_floor`
use std::collections::VecDeque;
use std::time::Instant;

use pagedkv_benches::trace;
use pagedkv_core::{AllocateArgs, BatchAllocation, KvCacheManager, ManagerConfig, RequestSpec};

struct Run {
    idx: usize,
    computed: u64,
    outputs: usize,
}

fn main() {
    let arg = |i: usize, d: usize| {
        std::env::args()
            .nth(i)
            .and_then(|s| s.parse().ok())
            .unwrap_or(d)
    };
    let reqs = trace::generate(0, arg(1, 2000));
    let mut cfg = ManagerConfig::full_attention(arg(2, 4096) as u32, 16, 16384);
    cfg.max_in_flight_tokens = Some(8192);
    let Ok(mut kv) = KvCacheManager::new(cfg) else {
        return;
    };
    let mut ck: u64 = 0xCBF2_9CE4_8422_2325;
    let dbg = std::env::var_os("DRIVE_DEBUG").is_some();
    let mut feed = |w: u64| {
        if dbg {
            println!("{w}");
        }
        ck = (ck ^ w).wrapping_mul(0x0000_0100_0000_01B3);
    };
    let (mut waiting, mut running): (VecDeque<Run>, Vec<Run>) = (VecDeque::new(), Vec::new());
    let (mut next, mut clock, mut steps, mut preemptions) = (0usize, 0u64, 0u64, 0u64);
    let mut out = BatchAllocation::default();
    let t0 = Instant::now();
    while next < reqs.len() || !waiting.is_empty() || !running.is_empty() {
        if waiting.is_empty() && running.is_empty() {
            clock = clock.max(reqs[next].arrival_step);
        }
        while next < reqs.len() && reqs[next].arrival_step <= clock {
            let spec = RequestSpec {
                prompt_token_ids: reqs[next].prompt.clone(),
                ..Default::default()
            };
            let _ = kv.add_request(&reqs[next].id, spec);
            waiting.push_back(Run {
                idx: next,
                computed: 0,
                outputs: 0,
            });
            next += 1;
        }
        kv.new_step_starts();
        let mut budget = 8192u64;
        let mut scheduled: Vec<(usize, u64)> = Vec::new(); // (index into running, tokens)
        let num_tokens = |r: &Run| (reqs[r.idx].prompt.len() + r.outputs) as u64;
        let mut preempted = false;
        let mut ri = 0;
        while ri < running.len() && budget > 0 {
            let (mut ids, mut new, mut comp) = (Vec::new(), Vec::new(), Vec::new());
            let mut b = budget;
            for r in &running[ri..] {
                if b == 0 {
                    break;
                }
                let n = (num_tokens(r) - r.computed).min(b);
                ids.push(reqs[r.idx].id.as_str());
                new.push(n);
                comp.push(r.computed);
                b -= n;
            }
            let _ = kv.allocate_slots_batch(&ids, &new, &comp, 0, &mut out);
            for (i, &n) in new.iter().enumerate().take(out.num_allocated) {
                feed(1);
                let (s, e) = (out.offsets[0][i] as usize, out.offsets[0][i + 1] as usize);
                feed((e - s) as u64);
                out.block_ids[0][s..e]
                    .iter()
                    .for_each(|&b| feed(u64::from(b)));
                scheduled.push((ri + i, n));
                budget -= n;
            }
            ri += out.num_allocated;
            if out.num_allocated == ids.len() {
                continue;
            }
            feed(u64::MAX);
            let Some(victim) = running.pop() else { break };
            let _ = kv.free(&reqs[victim.idx].id);
            preemptions += 1;
            preempted = true;
            let was_self = ri == running.len();
            waiting.push_front(Run {
                computed: 0,
                ..victim
            });
            if was_self {
                break;
            }
        }
        if !preempted {
            while budget > 0 && running.len() < 256 {
                let Some(r) = waiting.front() else { break };
                let id = reqs[r.idx].id.as_str();
                let Ok(hit) = kv.get_computed_blocks(id) else {
                    break;
                };
                let n = (num_tokens(r) - hit.num_computed_tokens).min(budget);
                let args = AllocateArgs {
                    num_new_computed_tokens: hit.num_computed_tokens,
                    full_sequence_must_fit: true,
                    has_scheduled_reqs: !running.is_empty(),
                    ..AllocateArgs::step(n, 0)
                };
                match kv.allocate_slots(id, &args, Some(&hit)) {
                    Ok(Some(g)) => {
                        feed(1);
                        feed(g[0].len() as u64);
                        g[0].iter().for_each(|&b| feed(u64::from(b)));
                    }
                    _ => {
                        feed(u64::MAX);
                        break;
                    }
                }
                if let Some(r) = waiting.pop_front() {
                    running.push(r); // like the reference loop: hits are computed again
                }
                scheduled.push((running.len() - 1, n));
                budget -= n;
            }
        }
        let (mut ids, mut toks, mut done) = (Vec::new(), Vec::new(), Vec::new());
        for &(i, n) in &scheduled {
            let r = &mut running[i];
            r.computed += n;
            if r.computed == (reqs[r.idx].prompt.len() + r.outputs) as u64 {
                ids.push(reqs[r.idx].id.as_str());
                toks.push(reqs[r.idx].output[r.outputs]);
                r.outputs += 1;
                if r.outputs >= reqs[r.idx].output.len() {
                    done.push(i);
                }
            }
        }
        let _ = kv.append_token_ids_batch(&ids, &toks);
        // Finished requests leave in scheduling order (it decides the free order).
        for &i in &done {
            let _ = kv.remove_request(&reqs[running[i].idx].id);
        }
        done.sort_unstable();
        let mut k = 0;
        running.retain(|_| {
            k += 1;
            done.binary_search(&(k - 1)).is_err()
        });
        steps += 1;
        clock += 1;
    }
    let el = t0.elapsed();
    println!(
        "steps {steps}, preemptions {preemptions}, alloc_checksum {ck:016x}, \
         {:.1} µs/step (loop incl. hashing; {:.2?} total)",
        el.as_secs_f64() * 1e6 / steps as f64,
        el
    );
}
