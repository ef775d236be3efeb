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
