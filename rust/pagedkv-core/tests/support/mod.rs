//! The one test-support module of the core's integration tests (`mod support;` in each).
//!
//! Here, the small helpers of the behaviour tables (`partial_hits`,
//! `scratch_groups`, ...) and the batch tests (`handles`, `batch_step`): unwrap
//! with the error's text, register a prompt, admit one, read a request's block
//! ids. Beside them, [`ref_pool`], the naive reference pool of the model tests
//! (`pool_model`, `manager_model`), and [`specs`], requests with hash-changing
//! extra keys drawn from `pagedkv_splitmix::SplitMix64` (`background_hashing`,
//! `hash_memo`).

// Each test binary that includes this module uses a part of it.
#![allow(dead_code)]

pub mod ref_pool;
pub mod specs;

use pagedkv_core::{AllocateArgs, Error, KvCacheManager, RequestSpec};

/// The value, or a panic showing the error.
pub fn ok<T>(r: Result<T, Error>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

/// Registers request `id` with prompt `tokens`.
pub fn add(m: &mut KvCacheManager, id: &str, tokens: Vec<u32>) {
    ok(m.add_request(
        id,
        RequestSpec {
            prompt_token_ids: tokens,
            ..Default::default()
        },
    ));
}

/// The request's block ids per group.
pub fn ids(m: &KvCacheManager, id: &str) -> Vec<Vec<u32>> {
    ok(m.block_ids(id))
        .into_iter()
        .map(<[u32]>::to_vec)
        .collect()
}

/// Adds request `id` with `n` prompt tokens (`seed * 1000 + i`) and admits it
/// with its prefix hit, the rest of its prompt in one step; its handle.
pub fn admit_prompt(m: &mut KvCacheManager, id: &str, seed: u32, n: u32) -> u64 {
    let spec = RequestSpec {
        prompt_token_ids: (0..n).map(|i| seed * 1000 + i).collect(),
        ..Default::default()
    };
    let h = ok(m.add_request(id, spec));
    let hit = ok(m.get_computed_blocks(id));
    let args = AllocateArgs {
        num_new_computed_tokens: hit.num_computed_tokens,
        ..AllocateArgs::step(u64::from(n) - hit.num_computed_tokens, 0)
    };
    assert!(ok(m.allocate_slots(id, &args, Some(&hit))).is_some());
    h
}

/// `n` prompt tokens of family `seed` (`seed * 1000 + i`).
pub fn prompt(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| seed * 1000 + i).collect()
}

/// Admits `id` with its whole device hit and its host hit (a manager with a
/// host tier), the rest of its tokens in one step: (device hit, host hit,
/// the new block ids of group 0).
pub fn admit_with_host(m: &mut KvCacheManager, id: &str) -> (u64, u64, Vec<u32>) {
    let hit = ok(m.get_computed_blocks(id));
    let n = ok(m.num_tokens(id)) as u64;
    let (dev, host) = (hit.num_computed_tokens, hit.num_host_tokens);
    let args = AllocateArgs {
        num_new_computed_tokens: dev,
        num_external_computed_tokens: host,
        ..AllocateArgs::step(n - dev - host, 0)
    };
    let new = ok(m.allocate_slots(id, &args, Some(&hit))).expect("room for the request");
    (dev, host, new[0].clone())
}
