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
/// generated exactly as `pagedkv.trace.generate` does.
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
