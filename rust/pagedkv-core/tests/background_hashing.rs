//! Hashing prompts on the worker thread changes nothing observable: two managers,
//! one hashing in place and one in the background, driven through the same
//! operations, give the same hits, block ids, hashes and events.
use pagedkv_core::{AllocateArgs, KvCacheManager, ManagerConfig, RequestSpec};

mod support;
use pagedkv_splitmix::SplitMix64;
use support::specs;

fn spec(rng: &mut SplitMix64, prefixes: &[Vec<u32>]) -> RequestSpec {
    let mut prompt = prefixes[rng.below(prefixes.len() as u64) as usize].clone();
    let tail = 1 + rng.below(200) as usize;
    prompt.extend((0..tail).map(|_| rng.below(32_000) as u32));
    specs::with_extra_keys(rng, prompt, 5, |_| 4)
}

fn run(background: bool, verify: bool, seed: u64) -> Vec<String> {
    let mut cfg = ManagerConfig::full_attention(600, 16, 4096);
    cfg.enable_kv_cache_events = true;
    cfg.verify_cached_tokens = verify;
    cfg.background_hashing = background;
    let mut mgr = KvCacheManager::new(cfg).expect("config");
    let mut rng = SplitMix64(seed);
    let prefixes: Vec<Vec<u32>> = (0..4)
        .map(|p| {
            (0..(64 + 48 * p))
                .map(|t| (t * 7 + p * 1000) as u32)
                .collect()
        })
        .collect();
    let mut log = Vec::new();
    let mut running: Vec<String> = Vec::new();
    let mut waiting: Vec<String> = Vec::new();
    for step in 0..400 {
        // Arrivals: registered, not looked up yet (the worker hashes meanwhile).
        for k in 0..rng.below(3) {
            let id = format!("r{step}-{k}");
            mgr.add_request(&id, spec(&mut rng, &prefixes))
                .expect("add");
            waiting.push(id);
        }
        // Admit the oldest waiting request if it fits.
        if let Some(id) = waiting.first().cloned() {
            let hit = mgr.get_computed_blocks(&id).expect("lookup");
            let n = mgr.num_tokens(&id).expect("known") as u64;
            let args = AllocateArgs {
                num_new_computed_tokens: hit.num_computed_tokens,
                full_sequence_must_fit: true,
                ..AllocateArgs::step(n - hit.num_computed_tokens, 0)
            };
            let got = mgr.allocate_slots(&id, &args, Some(&hit)).expect("admit");
            log.push(format!(
                "admit {id} hit {:?} -> {got:?}",
                hit.num_computed_tokens
            ));
            if got.is_some() {
                waiting.remove(0);
                running.push(id);
            }
        }
        // Decode every running request; finish or preempt some.
        let mut i = 0;
        while i < running.len() {
            let id = running[i].clone();
            let n = mgr.num_tokens(&id).expect("known") as u64;
            let args = AllocateArgs::step(1, n);
            if let Some(new) = mgr.allocate_slots(&id, &args, None).expect("decode") {
                log.push(format!("decode {id} {new:?}"));
                let tok = rng.below(32_000) as u32;
                mgr.append_token_ids(&id, &[tok]).expect("append");
                i += 1;
            } else {
                let victim = running.pop().expect("running");
                mgr.free(&victim).expect("free");
                log.push(format!("preempt {victim}"));
                waiting.insert(0, victim);
            }
            if i < running.len() && rng.below(40) == 0 {
                let done = running.remove(i);
                log.push(format!(
                    "hashes {done} {:?}",
                    mgr.block_hashes(&done).expect("known")
                ));
                mgr.remove_request(&done).expect("remove");
            }
        }
        log.push(format!("events {:?}", mgr.take_events()));
    }
    for id in waiting.iter().chain(&running) {
        log.push(format!(
            "hashes {id} {:?}",
            mgr.block_hashes(id).expect("known")
        ));
    }
    mgr.check_invariants().expect("invariants");
    log
}

#[test]
fn background_hashing_changes_nothing() {
    for seed in [1, 2, 3] {
        for verify in [false, true] {
            let sync = run(false, verify, seed);
            let background = run(true, verify, seed);
            assert_eq!(sync.len(), background.len());
            for (a, b) in sync.iter().zip(&background) {
                assert_eq!(a, b, "seed {seed}, verify {verify}");
            }
            assert!(
                sync.iter()
                    .any(|l| l.starts_with("admit") && !l.contains("hit 0"))
            );
        }
    }
}
