//! Shared helpers of pagedkv's criterion benches, and the pure-Rust floor of the
//! scheduler loop ([`floor`]).

use pagedkv_core::{AllocateArgs, KvCacheManager, ManagerConfig, RequestSpec};
use pagedkv_splitmix::SplitMix64;

/// Deterministic token ids (`SplitMix64`), so benches need no RNG crate.
#[must_use]
pub fn tokens(seed: u64, n: usize, vocab: u32) -> Vec<u32> {
    let mut rng = SplitMix64(seed);
    (0..n).map(|_| rng.below(u64::from(vocab)) as u32).collect()
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
///
/// # Panics
/// If the pool is too small for the configuration.
#[must_use]
pub fn manager(num_blocks: u32) -> KvCacheManager {
    match KvCacheManager::new(ManagerConfig::full_attention(num_blocks, 16, 1 << 20)) {
        Ok(m) => m,
        Err(e) => panic!("bench config: {e}"),
    }
}

/// Adds `id` with `prompt`, looks it up and admits it; returns whether it fit.
///
/// # Panics
/// If the manager refuses the request as misuse (a bug in the bench).
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
/// A steady serving workload on a full host offload tier ([`pagedkv_core::offload`]).
pub mod offload {
    use pagedkv_core::offload::{OffloadKey, OffloadTier, PolicyKind, TierConfig};
    use pagedkv_splitmix::SplitMix64;

    /// Chunks a request finds in the tier (its shared prefix).
    pub const PREFIX: usize = 8;
    /// Chunks a request stores (its new tail).
    pub const TAIL: usize = 4;
    /// Tier calls one request makes.
    pub const CALLS_PER_REQUEST: u64 = 7;

    fn key(n: u64) -> OffloadKey {
        let mut h = [0u8; 32];
        let mut rng = SplitMix64(n);
        for c in h.chunks_mut(8) {
            c.copy_from_slice(&rng.next_u64().to_le_bytes());
        }
        OffloadKey::new(&h, 0).expect("32-byte hash")
    }

    /// A tier of `num_chunks` slots filled with completed chunks, and the
    /// request stream's state.
    #[derive(Debug)]
    pub struct Workload {
        /// The tier.
        pub tier: OffloadTier,
        rng: SplitMix64,
        next_key: u64,
        next_req: u64,
        recent: Vec<Vec<OffloadKey>>,
    }

    impl Workload {
        /// A full tier under `policy`.
        ///
        /// # Panics
        /// If the tier refuses the configuration or a store (a bench bug).
        #[must_use]
        pub fn new(num_chunks: u64, policy: PolicyKind) -> Self {
            let cfg = TierConfig {
                policy,
                ..TierConfig::new(num_chunks)
            };
            let mut tier = OffloadTier::new(cfg).expect("tier");
            let mut recent = Vec::new();
            let mut next_key = 0;
            while next_key < num_chunks {
                let keys: Vec<OffloadKey> = (next_key..(next_key + PREFIX as u64).min(num_chunks))
                    .map(key)
                    .collect();
                next_key += keys.len() as u64;
                tier.prepare_store(&keys, 0, &[])
                    .expect("fill")
                    .expect("room");
                tier.complete_store(&keys, true);
                recent.push(keys);
            }
            let tail = recent.len().saturating_sub(1024);
            recent.drain(..tail);
            Self {
                tier,
                rng: SplitMix64(7),
                next_key,
                next_req: 1,
                recent,
            }
        }

        /// One request: finds a recent prefix, loads what hits, stores a new
        /// tail (evicting), ends. Returns the chunks it loaded.
        ///
        /// # Panics
        /// If the tier refuses a call (a bench bug).
        pub fn request(&mut self) -> usize {
            let req = self.next_req;
            self.next_req += 1;
            let pick = self.rng.below(self.recent.len() as u64) as usize;
            let prefix = self.recent[pick].clone();
            let tail: Vec<OffloadKey> = (self.next_key..self.next_key + TAIL as u64)
                .map(key)
                .collect();
            self.next_key += TAIL as u64;
            let positions: Vec<i64> = (1..=(prefix.len() + TAIL) as i64).map(|i| i * 16).collect();
            let t = &mut self.tier;
            t.on_new_request(req);
            let hit = t.lookup_prefix(&prefix);
            t.prepare_load(&prefix[..hit], req, &positions[..hit])
                .expect("load");
            t.complete_load(&prefix[..hit]).expect("complete load");
            let tail_pos = &positions[prefix.len()..];
            if t.prepare_store(&tail, req, tail_pos)
                .expect("store")
                .is_some()
            {
                t.complete_store(&tail, true);
            }
            t.on_request_finished(req, &[], &[]).expect("finish");
            t.forget_request(req);
            self.recent[pick] = tail;
            hit
        }
    }
}

/// Replaying recorded calls of vLLM's CPU offloading manager on the core's tier
/// (the text `benches/offload_bench.py --core-ops` writes).
pub mod offload_replay {
    use pagedkv_core::offload::{OffloadKey, OffloadTier, PolicyKind, TierConfig};

    /// One call.
    #[derive(Clone, Debug)]
    pub struct Call {
        op: String,
        req: u64,
        flag: bool,
        keys: Vec<OffloadKey>,
        positions: Vec<i64>,
    }

    /// A tier's configuration and the calls made on it.
    #[derive(Clone, Debug)]
    pub struct Calls {
        /// The tier the calls were made on.
        pub config: TierConfig,
        /// The calls, in order.
        pub calls: Vec<Call>,
    }

    fn parse_list<T>(
        field: &str,
        item: impl Fn(&str) -> Result<T, String>,
    ) -> Result<Vec<T>, String> {
        if field == "-" {
            return Ok(Vec::new());
        }
        field.split(',').map(item).collect()
    }

    fn hex_key(h: &str) -> Result<OffloadKey, String> {
        let bytes = (0..h.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(h.get(i..i + 2).unwrap_or("zz"), 16))
            .collect::<Result<Vec<u8>, _>>()
            .map_err(|e| format!("key {h}: {e}"))?;
        OffloadKey::from_bytes(&bytes).map_err(|e| e.to_string())
    }

    /// Reads the text form.
    ///
    /// # Errors
    /// A line that does not parse, with its number.
    pub fn parse(text: &str) -> Result<Calls, String> {
        let mut lines = text.lines();
        let head: Vec<&str> = lines.next().ok_or("empty")?.split(' ').collect();
        let [_, n, policy, events, threshold, tracker] = head[..] else {
            return Err("bad config line".into());
        };
        let num = |s: &str| s.parse::<u64>().map_err(|e| format!("{s}: {e}"));
        let config = TierConfig {
            policy: PolicyKind::from_name(policy).map_err(|e| e.to_string())?,
            enable_events: events == "1",
            store_threshold: num(threshold)?,
            max_tracker_size: num(tracker)? as usize,
            ..TierConfig::new(num(n)?)
        };
        let mut calls = Vec::new();
        for (i, line) in lines.enumerate() {
            let f: Vec<&str> = line.split(' ').collect();
            let [op, req, flag, keys, positions] = f[..] else {
                return Err(format!("line {}: {line}", i + 2));
            };
            calls.push(Call {
                op: op.to_owned(),
                req: num(req)?,
                flag: flag == "1",
                keys: parse_list(keys, hex_key)?,
                positions: parse_list(positions, |p| {
                    if p == "_" {
                        Ok(-1)
                    } else {
                        p.parse().map_err(|e| format!("{p}: {e}"))
                    }
                })?,
            });
        }
        Ok(Calls { config, calls })
    }

    /// Makes every call on a fresh tier; returns a count of what it answered
    /// (so the work is not optimised away).
    ///
    /// # Panics
    /// If the tier refuses a call the recording made (a broken recording).
    #[must_use]
    pub fn run(recorded: &Calls) -> u64 {
        let mut tier = OffloadTier::new(recorded.config.clone()).expect("recorded config");
        let mut answered = 0u64;
        for call in &recorded.calls {
            let (keys, pos, req) = (&call.keys[..], &call.positions[..], call.req);
            match call.op.as_str() {
                "new_request" => tier.on_new_request(req),
                "lookup" => answered += tier.lookup(&keys[0]) as u64,
                "prepare_load" => {
                    answered += tier.prepare_load(keys, req, pos).expect("load").len() as u64;
                }
                "complete_load" => tier.complete_load(keys).expect("complete load"),
                "touch" => tier.touch(keys),
                "prepare_store" => {
                    answered += tier
                        .prepare_store(keys, req, pos)
                        .expect("store")
                        .map_or(0, |o| o.slots.len() as u64);
                }
                "complete_store" => tier.complete_store(keys, call.flag),
                "finish" => tier.on_request_finished(req, keys, pos).expect("finish"),
                "reset" => tier.reset_cache(),
                "events" => answered += tier.take_events().len() as u64,
                "stats" => answered += tier.stats().allocation_sizes.len() as u64,
                other => panic!("unknown call {other}"),
            }
        }
        answered
    }
}

pub mod trace {
    use pagedkv_splitmix::SplitMix64 as Rng;

    /// One request: its prompt, the tokens it samples, its arrival step.
    #[derive(Debug)]
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

/// The floor: the scheduler policy in pure Rust, to measure what a step costs with
/// no Python at all.
///
/// The policy itself lives once, in Python (`pagedkv.sim.policy`), and drives the
/// simulator, vLLM's manager, the torch engine and `benches/drive_bench.py`. This
/// module is a deliberate second copy of it, fixed to the bench's configuration:
/// FCFS continuous batching with chunked prefill under an 8,192-token budget, at
/// most 256 running requests, preemption of the newest request when one does not
/// fit, and prefix hits computed again after admission (the oracle's reference
/// loop; `SchedulerConfig(hits_count_as_computed=False)` in Python). One
/// `allocate_slots_batch` and one `append_token_ids_batch` per step. A test pins it
/// to vLLM's checksum, so the two copies cannot drift apart unnoticed.
pub mod floor {
    use std::collections::VecDeque;
    use std::time::Instant;

    use pagedkv_core::{
        AllocateArgs, BatchAllocation, BatchStep, KvCacheManager, PreparedRequest, RequestRefs,
        RequestSpec,
    };

    use crate::trace::Req;

    struct Run {
        idx: usize,
        handle: u64,
        computed: u64,
        outputs: usize,
        /// The token sampled since its last allocation, not handed over yet
        /// ([`Options::fused`]).
        sampled: Option<u32>,
    }

    /// How [`run_with`] drives the manager.
    #[derive(Debug, Default)]
    pub struct Options {
        /// Prints every checksum word.
        pub debug: bool,
        /// As the Python scheduler's backend does (`ManagerBackend`): requests
        /// named by handle, each step's sampled tokens handed over with the
        /// requests' next allocation (one batch crossing per step), a
        /// preempted request's token appended before it is freed. Otherwise
        /// by id, with one `append_token_ids_batch` per step.
        pub fused: bool,
        /// Written one byte per cache line before every step (the caches cold,
        /// as after a scheduler's own work between steps); empty: warm.
        pub sweep: Vec<u8>,
        /// Every request built and hashed before the loop (the manager's
        /// `RequestPreparer`, an engine's input thread), registered in the
        /// loop by `add_prepared`.
        pub prepared: bool,
    }

    /// Nanoseconds inside the manager's calls, per API, over a run.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct CallTimes {
        pub add_request: u64,
        pub new_step_starts: u64,
        pub batch: u64,
        pub lookup: u64,
        pub admit: u64,
        pub preempt: u64,
        pub append: u64,
        pub remove_request: u64,
    }

    impl CallTimes {
        /// Every call's time together: what the scheduler waits for.
        #[must_use]
        pub fn total(&self) -> u64 {
            self.add_request
                + self.new_step_starts
                + self.batch
                + self.lookup
                + self.admit
                + self.preempt
                + self.append
                + self.remove_request
        }
    }

    /// What a run did: steps, preemptions and the FNV-1a-64 checksum over every
    /// allocation (equal to vLLM's `alloc_checksum` on the same trace), and the
    /// time spent inside the manager's calls.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Summary {
        pub steps: u64,
        pub preemptions: u64,
        pub alloc_checksum: u64,
        pub ns: CallTimes,
        /// Requests registered by `add_prepared` ([`Options::prepared`]).
        pub num_prepared: u64,
    }

    /// Adds the time `f` takes to `ns`.
    fn timed<T>(ns: &mut u64, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        *ns += t.elapsed().as_nanos() as u64;
        out
    }

    /// Drives `reqs` through `kv` to the end. `debug` prints every checksum word.
    pub fn run(kv: &mut KvCacheManager, reqs: &[Req], debug: bool) -> Summary {
        run_with(
            kv,
            reqs,
            &mut Options {
                debug,
                ..Options::default()
            },
        )
    }

    /// [`run`] as `opts` say.
    #[allow(clippy::too_many_lines)] // the policy's one step, kept in one piece
    pub fn run_with(kv: &mut KvCacheManager, reqs: &[Req], opts: &mut Options) -> Summary {
        let debug = opts.debug;
        let mut ck: u64 = 0xCBF2_9CE4_8422_2325;
        let mut feed = |w: u64| {
            if debug {
                println!("{w}");
            }
            ck = (ck ^ w).wrapping_mul(0x0000_0100_0000_01B3);
        };
        let mut ns = CallTimes::default();
        let (mut waiting, mut running): (VecDeque<Run>, Vec<Run>) = (VecDeque::new(), Vec::new());
        let (mut next, mut clock, mut steps, mut preemptions) = (0usize, 0u64, 0u64, 0u64);
        let mut out = BatchAllocation::default();
        let mut prepared: Vec<Option<PreparedRequest>> = match kv.request_preparer() {
            Ok(preparer) if opts.prepared => reqs
                .iter()
                .map(|r| {
                    let spec = RequestSpec {
                        prompt_token_ids: r.prompt.clone(),
                        ..Default::default()
                    };
                    preparer.prepare(&r.id, spec).ok()
                })
                .collect(),
            _ => Vec::new(),
        };
        let mut num_prepared = 0;
        while next < reqs.len() || !waiting.is_empty() || !running.is_empty() {
            if waiting.is_empty() && running.is_empty() {
                clock = clock.max(reqs[next].arrival_step);
            }
            let sweep = &mut opts.sweep;
            for i in (0..sweep.len()).step_by(64) {
                sweep[i] = sweep[i].wrapping_add(1);
            }
            std::hint::black_box(&sweep[..]);
            while next < reqs.len() && reqs[next].arrival_step <= clock {
                let handle = if let Some(p) = prepared.get_mut(next).and_then(Option::take) {
                    num_prepared += 1;
                    timed(&mut ns.add_request, || kv.add_prepared(p))
                } else {
                    let spec = RequestSpec {
                        prompt_token_ids: reqs[next].prompt.clone(),
                        ..Default::default()
                    };
                    let id = reqs[next].id.as_str();
                    timed(&mut ns.add_request, || kv.add_request(id, spec))
                }
                .unwrap_or(u64::MAX);
                waiting.push_back(Run {
                    idx: next,
                    handle,
                    computed: 0,
                    outputs: 0,
                    sampled: None,
                });
                next += 1;
            }
            timed(&mut ns.new_step_starts, || kv.new_step_starts());
            let mut budget = 8192u64;
            let mut scheduled: Vec<(usize, u64)> = Vec::new(); // (index into running, tokens)
            let num_tokens = |r: &Run| (reqs[r.idx].prompt.len() + r.outputs) as u64;
            let mut preempted = false;
            let mut ri = 0;
            while ri < running.len() && budget > 0 {
                let (mut ids, mut handles, mut new, mut comp, mut toks) =
                    (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
                let mut b = budget;
                for r in &mut running[ri..] {
                    if b == 0 {
                        break;
                    }
                    let n = (num_tokens(r) - r.computed).min(b);
                    if opts.fused {
                        handles.push(r.handle);
                        toks.push(r.sampled.take());
                    } else {
                        ids.push(reqs[r.idx].id.as_str());
                    }
                    new.push(n);
                    comp.push(r.computed);
                    b -= n;
                }
                let _ = timed(&mut ns.batch, || {
                    if opts.fused {
                        let step = BatchStep {
                            append_token_ids: Some(&toks),
                            ..BatchStep::new(RequestRefs::Handles(&handles), &new, Some(&comp))
                        };
                        kv.allocate_slots_batch_step(&step, &mut out)
                    } else {
                        kv.allocate_slots_batch(&ids, &new, &comp, 0, &mut out)
                    }
                });
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
                if out.num_allocated == new.len() {
                    continue;
                }
                feed(u64::MAX);
                let Some(mut victim) = running.pop() else {
                    break;
                };
                let id = reqs[victim.idx].id.as_str();
                let sampled = victim.sampled.take();
                let _ = timed(&mut ns.preempt, || {
                    // Its token first: a re-admission looks up every token.
                    let appended = sampled.map_or(Ok(()), |t| kv.append_token_ids(id, &[t]));
                    appended.and_then(|()| kv.free(id))
                });
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
                    let Ok(hit) = timed(&mut ns.lookup, || kv.get_computed_blocks(id)) else {
                        break;
                    };
                    let n = (num_tokens(r) - hit.num_computed_tokens).min(budget);
                    let args = AllocateArgs {
                        num_new_computed_tokens: hit.num_computed_tokens,
                        full_sequence_must_fit: true,
                        has_scheduled_reqs: !running.is_empty(),
                        ..AllocateArgs::step(n, 0)
                    };
                    let admitted =
                        timed(&mut ns.admit, || kv.allocate_slots(id, &args, Some(&hit)));
                    if let Ok(Some(g)) = admitted {
                        feed(1);
                        feed(g[0].len() as u64);
                        g[0].iter().for_each(|&b| feed(u64::from(b)));
                    } else {
                        feed(u64::MAX);
                        break;
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
                    let t = reqs[r.idx].output[r.outputs];
                    if opts.fused {
                        r.sampled = Some(t);
                    } else {
                        ids.push(reqs[r.idx].id.as_str());
                        toks.push(t);
                    }
                    r.outputs += 1;
                    if r.outputs >= reqs[r.idx].output.len() {
                        done.push(i);
                    }
                }
            }
            if !opts.fused {
                let _ = timed(&mut ns.append, || kv.append_token_ids_batch(&ids, &toks));
            }
            // Finished requests leave in scheduling order (it decides the free order).
            for &i in &done {
                let id = reqs[running[i].idx].id.as_str();
                let _ = timed(&mut ns.remove_request, || kv.remove_request(id));
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
            ns,
            num_prepared,
        }
    }
}

#[cfg(test)]
mod tests {
    use pagedkv_core::{KvCacheManager, ManagerConfig};

    /// Token ids are `SplitMix64(seed).below(vocab)`, the draws of
    /// `pagedkv._util.SplitMix64` in Python.
    #[test]
    fn tokens_are_the_splitmix64_stream() {
        assert_eq!(crate::tokens(7, 5, 1000), [487, 804, 346, 203, 674]);
    }

    /// The Rust loop makes vLLM 0.33's allocations on the oracle's default trace
    /// (the checksum vLLM's own manager produces under the reference drive loop).
    #[test]
    fn the_floor_loop_allocates_as_vllm_does() {
        let reqs = crate::trace::generate(0, 2000);
        let mut cfg = ManagerConfig::full_attention(4096, 16, 16384);
        cfg.max_in_flight_tokens = Some(8192);
        let mut kv = KvCacheManager::new(cfg).expect("config");
        let s = crate::floor::run(&mut kv, &reqs, false);
        assert_eq!((s.steps, s.preemptions), (2602, 330));
        assert_eq!(s.alloc_checksum, 0xaea7_f22d_7e64_32be);
        kv.check_invariants().expect("invariants");
    }

    /// The same with the scheduler backend's calls (handles, sampled tokens
    /// handed over with the next allocation) and prompts hashed on the worker.
    #[test]
    fn the_fused_floor_loop_allocates_as_vllm_does() {
        let reqs = crate::trace::generate(0, 2000);
        let mut cfg = ManagerConfig::full_attention(4096, 16, 16384);
        cfg.max_in_flight_tokens = Some(8192);
        cfg.background_hashing = true;
        let mut kv = KvCacheManager::new(cfg).expect("config");
        let mut opts = crate::floor::Options {
            fused: true,
            ..Default::default()
        };
        let s = crate::floor::run_with(&mut kv, &reqs, &mut opts);
        assert_eq!((s.steps, s.preemptions), (2602, 330));
        assert_eq!(s.alloc_checksum, 0xaea7_f22d_7e64_32be);
        assert!(s.ns.batch > 0 && s.ns.lookup > 0 && s.ns.admit > 0 && s.ns.preempt > 0);
        kv.check_invariants().expect("invariants");
    }

    /// The same with every request prepared before the loop (`RequestPreparer`)
    /// and registered by `add_prepared`.
    #[test]
    fn the_floor_loop_on_prepared_requests_allocates_as_vllm_does() {
        let reqs = crate::trace::generate(0, 2000);
        let mut cfg = ManagerConfig::full_attention(4096, 16, 16384);
        cfg.max_in_flight_tokens = Some(8192);
        let mut kv = KvCacheManager::new(cfg).expect("config");
        let mut opts = crate::floor::Options {
            fused: true,
            prepared: true,
            ..Default::default()
        };
        let s = crate::floor::run_with(&mut kv, &reqs, &mut opts);
        assert_eq!((s.steps, s.preemptions), (2602, 330));
        assert_eq!(s.alloc_checksum, 0xaea7_f22d_7e64_32be);
        assert_eq!(s.num_prepared, 2000);
        kv.check_invariants().expect("invariants");
    }
}
