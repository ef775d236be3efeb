//! Collision safety (`verify_cached_tokens`): with a deliberately weak hash (one
//! byte), prefix hits without verification serve blocks computed for other
//! tokens; with it, no hit ever covers a token that differs from what the block
//! was computed for. With an honest hash, verification changes nothing.
// Short names (`m`, `g`, `b`, `i`, `n`) follow the model's notation.
#![allow(clippy::many_single_char_names)]
use pagedkv_core::{
    AllocateArgs, AttentionKind, GroupSpec, HashAlgo, KvCacheManager, ManagerConfig, RequestSpec,
};

use pagedkv_splitmix::SplitMix64;

fn config(groups: Vec<GroupSpec>, verify: bool, truncate: Option<u8>) -> ManagerConfig {
    let mut c = ManagerConfig::full_attention(96, 4, 4096);
    c.groups = groups;
    c.verify_cached_tokens = verify;
    c.hash_truncate_bytes = truncate;
    c.hash_algo = HashAlgo::Sha256Cbor;
    c
}

fn fa(bs: u32) -> GroupSpec {
    GroupSpec::new(AttentionKind::FullAttention, bs)
}

/// Prompts built from a few shared stems plus random tails, so real prefix hits
/// happen alongside the hash collisions.
fn prompt(rng: &mut SplitMix64) -> Vec<u32> {
    let stem = rng.below(4) as u32;
    let stem_len = rng.below(24) as usize;
    let tail = 1 + rng.below(20) as usize;
    let mut p: Vec<u32> = (0..stem_len).map(|i| stem * 100 + i as u32 % 3).collect();
    p.extend((0..tail).map(|_| rng.below(3) as u32));
    p
}

struct Outcome {
    hits: Vec<(u64, Vec<Vec<u32>>)>,
    /// Hits that covered a block computed for other tokens.
    bad_hits: usize,
    failures: u64,
}

/// Admits requests one after another (full prompt, a few decode tokens), keeping
/// a few running; checks every hit against the tokens each block was computed for.
fn run(cfg: ManagerConfig, seed: u64, n: usize) -> Outcome {
    let groups = cfg.groups.clone();
    let mut m = KvCacheManager::new(cfg).expect("config");
    let mut rng = SplitMix64(seed);
    // What each block was last computed for: (group, block) -> tokens of its span
    // and the whole prefix before it.
    let mut written: std::collections::HashMap<(usize, u32), Vec<u32>> =
        std::collections::HashMap::default();
    let mut live: Vec<(String, Vec<u32>)> = Vec::new();
    let mut out = Outcome {
        hits: Vec::new(),
        bad_hits: 0,
        failures: 0,
    };
    for r in 0..n {
        let id = format!("r{r}");
        let p = prompt(&mut rng);
        m.add_request(
            &id,
            RequestSpec {
                prompt_token_ids: p.clone(),
                ..Default::default()
            },
        )
        .expect("add");
        let hit = m.get_computed_blocks(&id).expect("lookup");
        let h = hit.num_computed_tokens as usize;
        // Every non-null hit block must hold exactly this request's prefix.
        let mut bad = false;
        for (g, blocks) in hit.block_ids.iter().enumerate() {
            let bs = groups[g].block_size as usize;
            for (i, &b) in blocks.iter().enumerate() {
                let end = ((i + 1) * bs).min(h);
                if b == 0 || end <= i * bs {
                    continue;
                }
                let w = &written[&(g, b)];
                if w.len() < end || w[..end] != p[..end] {
                    bad = true;
                }
            }
        }
        out.bad_hits += usize::from(bad);
        out.hits
            .push((hit.num_computed_tokens, hit.block_ids.clone()));
        let args = AllocateArgs {
            num_new_computed_tokens: hit.num_computed_tokens,
            ..AllocateArgs::step(p.len() as u64 - hit.num_computed_tokens, 0)
        };
        while m
            .allocate_slots(&id, &args, Some(&hit))
            .expect("alloc")
            .is_none()
        {
            assert!(
                !live.is_empty(),
                "{groups:?} free {} prompt {} hit {h}",
                m.num_free_blocks(),
                p.len()
            );
            let (old, _) = live.remove(0);
            m.remove_request(&old).expect("remove");
        }
        // The request computed its whole prompt into its blocks.
        let ids = m.block_ids(&id).expect("ids");
        for (g, blocks) in ids.iter().enumerate() {
            let bs = groups[g].block_size as usize;
            for (i, &b) in blocks.iter().enumerate() {
                if b != 0 && i * bs >= h {
                    written.insert((g, b), p[..((i + 1) * bs).min(p.len())].to_vec());
                }
            }
        }
        live.push((id, p));
        if live.len() > 3 {
            let (old, _) = live.remove(0);
            m.remove_request(&old).expect("remove");
        }
        m.check_invariants().expect("invariants");
    }
    out.failures = m.verification_failures();
    out
}

fn layouts() -> Vec<Vec<GroupSpec>> {
    vec![
        vec![fa(4)],
        vec![fa(8)],
        vec![
            fa(4),
            GroupSpec::new(AttentionKind::SlidingWindow { window: 8 }, 4),
        ],
        vec![
            fa(8),
            GroupSpec::new(AttentionKind::SlidingWindow { window: 12 }, 4),
        ],
        vec![
            fa(4),
            GroupSpec::new(AttentionKind::ChunkedLocal { chunk: 8 }, 4),
        ],
    ]
}

#[test]
fn a_one_byte_hash_serves_wrong_blocks_without_verification() {
    let mut bad = 0;
    for (k, groups) in layouts().into_iter().enumerate() {
        bad += run(config(groups, false, Some(1)), 7 + k as u64, 300).bad_hits;
    }
    assert!(bad > 0, "a one-byte hash should collide in 1,500 requests");
}

#[test]
fn verification_stops_every_hit_at_the_first_foreign_block() {
    for (k, groups) in layouts().into_iter().enumerate() {
        let o = run(config(groups.clone(), true, Some(1)), 7 + k as u64, 300);
        assert_eq!(o.bad_hits, 0, "layout {groups:?}");
        assert!(o.failures > 0, "layout {groups:?}: collisions were caught");
    }
}

#[test]
fn with_an_honest_hash_verification_changes_nothing() {
    for (k, groups) in layouts().into_iter().enumerate() {
        let plain = run(config(groups.clone(), false, None), 99 + k as u64, 300);
        let checked = run(config(groups.clone(), true, None), 99 + k as u64, 300);
        assert_eq!(plain.bad_hits, 0);
        assert_eq!(checked.failures, 0, "layout {groups:?}");
        assert_eq!(plain.hits, checked.hits, "layout {groups:?}");
        assert!(plain.hits.iter().any(|(h, _)| *h > 0), "real hits happen");
    }
}
