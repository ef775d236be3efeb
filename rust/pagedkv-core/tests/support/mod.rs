//! Small helpers shared by the behaviour tables (`partial_hits`,
//! `scratch_groups`): unwrap with the error's text, register a prompt, read a
//! request's block ids.

use pagedkv_core::{Error, KvCacheManager, RequestSpec};

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
