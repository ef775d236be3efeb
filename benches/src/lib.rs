//! Shared helpers of pagedkv's criterion benches.

use pagedkv_core::{AllocateArgs, KvCacheManager, ManagerConfig, RequestSpec};

/// Deterministic token ids (SplitMix64), so benches need no RNG crate.
#[must_use]
pub fn tokens(seed: u64, n: usize, vocab: u32) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) % u64::from(vocab)) as u32
        })
        .collect()
}

/// The example's `i`-th command-line argument parsed, or `default`.
#[must_use]
pub fn arg<T: std::str::FromStr>(i: usize, default: T) -> T {
    std::env::args()
        .nth(i)
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// A full-attention manager with block size 16.
#[must_use]
pub fn manager(num_blocks: u32) -> KvCacheManager {
    match KvCacheManager::new(ManagerConfig::full_attention(num_blocks, 16, 1 << 20)) {
        Ok(m) => m,
        Err(e) => panic!("bench config: {e}"),
    }
}

/// Adds `id` with `prompt`, looks it up and admits it; returns whether it fit.
pub fn admit(mgr: &mut KvCacheManager, id: &str, prompt: &[u32]) -> bool {
    let spec = RequestSpec {
        prompt_token_ids: prompt.to_vec(),
        ..RequestSpec::default()
    };
    if mgr.add_request(id, spec).is_err() {
        return false;
    }
    let Ok(hit) = mgr.get_computed_blocks(id) else {
        return false;
    };
    let n = prompt.len() as u64;
    let args = AllocateArgs {
        num_new_computed_tokens: hit.num_computed_tokens,
        full_sequence_must_fit: true,
        ..AllocateArgs::step(n - hit.num_computed_tokens, 0)
    };
    matches!(mgr.allocate_slots(id, &args, Some(&hit)), Ok(Some(_)))
}

/// The oracle's synthetic shared-prefix trace (format "vllm-oracle-trace" v1),
/// generated exactly as `pagedkv._oracle.trace.generate` does.
pub mod trace {
    /// SplitMix64.
    pub struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn between(&mut self, lo: u64, hi: u64) -> u64 {
            lo + self.below(hi - lo + 1)
        }
    }

    /// One request: its prompt, the tokens it samples, its arrival step.
    pub struct Req {
        pub id: String,
        pub prompt: Vec<u32>,
        pub output: Vec<u32>,
        pub arrival_step: u64,
    }

    /// The trace for `seed` with the default sizes and `num_requests` requests.
    #[must_use]
    pub fn generate(seed: u64, num_requests: usize) -> Vec<Req> {
        let vocab = 32000;
        let mut rng = Rng(seed);
        let prefixes: Vec<Vec<u32>> = (0..8)
            .map(|_| {
                let n = rng.between(1024, 4096);
                (0..n).map(|_| rng.below(vocab) as u32).collect()
            })
            .collect();
        let mut reqs: Vec<Req> = Vec::with_capacity(num_requests);
        let mut t = 0u64;
        for i in 0..num_requests {
            if i > 0 {
                t += rng.below(2001);
            }
            let mut parent = None;
            if i > 0 && rng.below(100) < 20 {
                parent = Some(i - 1 - rng.below((i as u64).min(64)) as usize);
            }
            let suffix_len = rng.between(16, 512);
            let decode_len = rng.between(16, 256);
            if let Some(p) = parent {
                let base = reqs[p].prompt.len() + reqs[p].output.len();
                if base as u64 + suffix_len > 12288 {
                    parent = None;
                }
            }
            let mut prompt = match parent {
                Some(p) => {
                    let mut v = reqs[p].prompt.clone();
                    v.extend_from_slice(&reqs[p].output);
                    v
                }
                None => prefixes[rng.below(8) as usize].clone(),
            };
            prompt.extend((0..suffix_len).map(|_| rng.below(vocab) as u32));
            let output = (0..decode_len).map(|_| rng.below(vocab) as u32).collect();
            reqs.push(Req {
                id: format!("r{i}"),
                prompt,
                output,
                arrival_step: t / 1000,
            });
        }
        reqs
    }
}

/// The scheduler loop of `benches/drive_bench.py` in Rust (the pure-Rust floor):
/// FCFS continuous batching with chunked prefill under an 8,192-token budget, at
/// most 256 running requests, preemption of the newest request when one does not
/// fit, and (as the reference loop does) prefix hits computed again after
/// admission. One `allocate_slots_batch` and one `append_token_ids_batch` per step.
pub mod drive {
    use std::collections::VecDeque;

    use pagedkv_core::{AllocateArgs, BatchAllocation, KvCacheManager, RequestSpec};

    use crate::trace::Req;

    struct Run {
        idx: usize,
        computed: u64,
        outputs: usize,
    }

    /// What a run did: steps, preemptions and the FNV-1a-64 checksum over every
    /// allocation (equal to vLLM's `alloc_checksum` on the same trace).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Summary {
        pub steps: u64,
        pub preemptions: u64,
        pub alloc_checksum: u64,
    }

    /// Drives `reqs` through `kv` to the end. `debug` prints every checksum word.
    pub fn run(kv: &mut KvCacheManager, reqs: &[Req], debug: bool) -> Summary {
        let mut ck: u64 = 0xCBF2_9CE4_8422_2325;
        let mut feed = |w: u64| {
            if debug {
                println!("{w}");
            }
            ck = (ck ^ w).wrapping_mul(0x0000_0100_0000_01B3);
        };
        let (mut waiting, mut running): (VecDeque<Run>, Vec<Run>) = (VecDeque::new(), Vec::new());
        let (mut next, mut clock, mut steps, mut preemptions) = (0usize, 0u64, 0u64, 0u64);
        let mut out = BatchAllocation::default();
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

        Summary {
            steps,
            preemptions,
            alloc_checksum: ck,
        }
    }
}

#[cfg(test)]
mod tests {
    use pagedkv_core::{KvCacheManager, ManagerConfig};

    /// The Rust loop makes vLLM 0.33's allocations on the oracle's default trace
    /// (the checksum vLLM's own manager produces under the reference drive loop).
    #[test]
    fn the_floor_loop_allocates_as_vllm_does() {
        let reqs = crate::trace::generate(0, 2000);
        let mut cfg = ManagerConfig::full_attention(4096, 16, 16384);
        cfg.max_in_flight_tokens = Some(8192);
        let mut kv = KvCacheManager::new(cfg).expect("config");
        let s = crate::drive::run(&mut kv, &reqs, false);
        assert_eq!((s.steps, s.preemptions), (2602, 330));
        assert_eq!(s.alloc_checksum, 0xaea7_f22d_7e64_32be);
        kv.check_invariants().expect("invariants");
    }
}
