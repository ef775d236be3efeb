//! Requests with the extra keys that change their block hashes, for the tests
//! that compare two ways of hashing (`background_hashing`, `hash_memo`).

use pagedkv_core::{Lora, MmFeature, RequestSpec};

use pagedkv_splitmix::SplitMix64;

/// A request of this prompt that, one time in `choices` each, has a cache
/// salt (one of two), a `LoRA` adapter (one of two) or a multimodal item (one
/// of three, 20 tokens at `mm_offset`), and otherwise nothing extra.
pub fn with_extra_keys(
    rng: &mut SplitMix64,
    prompt: Vec<u32>,
    choices: u64,
    mm_offset: impl FnOnce(&mut SplitMix64) -> u64,
) -> RequestSpec {
    let mut s = RequestSpec {
        prompt_token_ids: prompt,
        ..RequestSpec::default()
    };
    match rng.below(choices) {
        0 => s.cache_salt = Some(format!("tenant-{}", rng.below(2))),
        1 => {
            s.lora = Some(Lora {
                name: format!("adapter-{}", rng.below(2)),
                path: None,
                id: Some(1),
            });
        }
        2 => {
            let identifier = format!("image-{}", rng.below(3));
            s.mm_features = vec![MmFeature {
                identifier,
                offset: mm_offset(rng),
                length: 20,
            }];
        }
        _ => {}
    }
    s
}
