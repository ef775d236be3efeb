//! The `sha256_cbor` memo changes no hash: managers with the memo off, tiny
//! (one set: blocks displacing each other), at its default size and larger
//! than the workload give every request the same block hashes, while the memo
//! answers the blocks it saw before.
use pagedkv_core::hash::{BlockHasher, HashAlgo};
use pagedkv_core::{Error, KvCacheManager, ManagerConfig, RequestSpec, hash::BlockHash};

mod support;
use pagedkv_splitmix::SplitMix64;
use support::specs;

fn manager(block_size: u32, memo: Option<u64>, algo: HashAlgo) -> KvCacheManager {
    let mut cfg = ManagerConfig::full_attention(512, block_size, 1 << 14);
    cfg.hash_memo_blocks = memo;
    cfg.hash_algo = algo;
    cfg.hash_seed = Some("memo".into());
    KvCacheManager::new(cfg).expect("config")
}

/// A prompt of a shared prefix (or none) and a fresh tail, sometimes salted,
/// with a `LoRA` adapter or a multimodal item (blocks the memo leaves alone).
fn spec(rng: &mut SplitMix64, prefixes: &[Vec<u32>]) -> RequestSpec {
    let mut prompt = match rng.below(prefixes.len() as u64 + 1) as usize {
        0 => Vec::new(),
        p => prefixes[p - 1].clone(),
    };
    prompt.extend((0..=rng.below(100)).map(|_| rng.below(u64::from(u32::MAX) + 1) as u32));
    specs::with_extra_keys(rng, prompt, 6, |rng| rng.below(40))
}

fn hashes(m: &KvCacheManager, id: &str) -> Vec<BlockHash> {
    m.block_hashes(id).expect("known").to_vec()
}

#[test]
fn the_memo_changes_no_hash() {
    for block_size in [16, 7, 1] {
        for seed in [1, 2] {
            let mut rng = SplitMix64(seed);
            let prefixes: Vec<Vec<u32>> = (0..3)
                .map(|_| (0..150).map(|_| rng.below(50_000) as u32).collect())
                .collect();
            let mut off = manager(block_size, Some(0), HashAlgo::Sha256Cbor);
            let mut tiny = manager(block_size, Some(1), HashAlgo::Sha256Cbor);
            let mut full = manager(block_size, None, HashAlgo::Sha256Cbor);
            let mut huge = manager(block_size, Some(1 << 20), HashAlgo::Sha256Cbor);
            for i in 0..200 {
                let s = spec(&mut rng, &prefixes);
                let id = format!("r{i}");
                for m in [&mut off, &mut tiny, &mut full, &mut huge] {
                    m.add_request(&id, s.clone()).expect("add");
                }
                let want = hashes(&off, &id);
                assert_eq!(hashes(&tiny, &id), want, "block {block_size}, request {i}");
                assert_eq!(hashes(&full, &id), want, "block {block_size}, request {i}");
                assert_eq!(hashes(&huge, &id), want, "block {block_size}, request {i}");
                // Sampled tokens fill blocks hashed without the memo.
                let sampled: Vec<u32> = (0..block_size * 2).collect();
                for m in [&mut off, &mut tiny, &mut full] {
                    m.append_token_ids(&id, &sampled).expect("append");
                }
                assert_eq!(hashes(&full, &id), hashes(&off, &id));
                for m in [&mut off, &mut tiny, &mut full, &mut huge] {
                    m.remove_request(&id).expect("remove");
                }
            }
            assert_eq!(off.hash_memo_counts(), (0, 0), "off");
            let (hits, misses) = full.hash_memo_counts();
            // Every prompt block not seen before is hashed, nearly every one
            // seen before found (1-token blocks outnumber the default's
            // 16,384 entries).
            let (most, fewest) = huge.hash_memo_counts();
            assert!(most > 0 && hits + misses == most + fewest);
            let share = if block_size == 1 { 85 } else { 98 };
            assert!(
                hits * 100 >= most * share,
                "block {block_size}: {hits} of {most}"
            );
            let (tiny_hits, _) = tiny.hash_memo_counts();
            assert!(tiny_hits < hits, "one entry holds less");
        }
    }
}

/// The memo's slot is chosen by a block's tokens alone: blocks of the same
/// tokens under different parents share it, and each gets its own hash.
#[test]
fn the_same_tokens_under_another_parent_hash_anew() {
    let shared: Vec<u32> = (100..116).collect();
    let mut on = manager(16, Some(1 << 12), HashAlgo::Sha256Cbor);
    let mut off = manager(16, Some(0), HashAlgo::Sha256Cbor);
    for (i, first) in [[1u32; 16], [2; 16], [1; 16]].iter().enumerate() {
        let prompt: Vec<u32> = first.iter().chain(&shared).copied().collect();
        for m in [&mut on, &mut off] {
            let spec = RequestSpec {
                prompt_token_ids: prompt.clone(),
                ..RequestSpec::default()
            };
            m.add_request(&format!("r{i}"), spec).expect("add");
        }
        assert_eq!(
            hashes(&on, &format!("r{i}")),
            hashes(&off, &format!("r{i}"))
        );
    }
    assert_ne!(hashes(&on, "r0")[1], hashes(&on, "r1")[1]);
    assert_eq!(hashes(&on, "r0"), hashes(&on, "r2"));
    // r0's two blocks and r1's are hashed (r1's second in the set of r0's);
    // r2's both come from the memo.
    assert_eq!(on.hash_memo_counts(), (2, 4));
}

/// Only plain `sha256_cbor` blocks go through the memo: the other
/// algorithms and truncated hashes are always hashed (the memo is off).
#[test]
fn other_algorithms_and_truncated_hashes_have_no_memo() {
    let prompt: Vec<u32> = (0..64).collect();
    for algo in [HashAlgo::XxhashCbor, HashAlgo::Xxh3Native] {
        let mut m = manager(16, None, algo);
        for id in ["a", "b"] {
            let spec = RequestSpec {
                prompt_token_ids: prompt.clone(),
                ..RequestSpec::default()
            };
            m.add_request(id, spec).expect("add");
        }
        assert_eq!(m.hash_memo_counts(), (0, 0), "{algo:?}");
    }
    let mut cfg = ManagerConfig::full_attention(64, 16, 1024);
    cfg.hash_truncate_bytes = Some(4);
    let mut m = KvCacheManager::new(cfg).expect("config");
    for id in ["a", "b"] {
        let spec = RequestSpec {
            prompt_token_ids: prompt.clone(),
            ..RequestSpec::default()
        };
        m.add_request(id, spec).expect("add");
    }
    assert_eq!(m.hash_memo_counts(), (0, 0), "truncated");
}

#[test]
fn a_memo_past_its_limit_is_refused() {
    let mut cfg = ManagerConfig::full_attention(64, 16, 1024);
    cfg.hash_memo_blocks = Some((1 << 22) + 1);
    match KvCacheManager::new(cfg) {
        Err(Error::InvalidConfig(m)) => assert!(m.contains("hash_memo_blocks"), "{m}"),
        other => panic!("{other:?}"),
    }
}

/// The hasher itself: a chain through the memo, hashed again, gives the
/// digests of a hasher without one, and blocks of another width bypass it.
#[test]
fn the_hasher_answers_repeated_chains_exactly() {
    let none = HashAlgo::Sha256Cbor.none_hash("x");
    let mut plain = BlockHasher::new(HashAlgo::Sha256Cbor, none);
    let mut memo = BlockHasher::new(HashAlgo::Sha256Cbor, none);
    memo.set_memo(16, 1 << 10);
    assert_eq!(memo.memo_bytes(), (1 << 10) * 128);
    let blocks: Vec<Vec<u32>> = (0..40u32)
        .map(|b| (0..16).map(|t| b * 31 + t).collect())
        .collect();
    for round in 0..3 {
        let (mut p, mut q) = (None, None);
        for b in &blocks {
            let want = plain.hash_block(p.as_ref(), b, &[]);
            let got = memo.hash_block(q.as_ref(), b, &[]);
            assert_eq!(got, want, "round {round}");
            (p, q) = (Some(want), Some(got));
        }
    }
    let (hits, misses) = memo.memo_counts();
    assert_eq!(hits + misses, 120);
    // The second and third rounds from the memo.
    assert_eq!((hits, misses), (80, 40));
    // A block of another width is hashed, not looked up.
    let short: Vec<u32> = (0..15).collect();
    assert_eq!(
        memo.hash_block(None, &short, &[]),
        plain.hash_block(None, &short, &[])
    );
    assert_eq!(memo.memo_counts(), (hits, misses));
    memo.clear_memo();
    assert_eq!(
        memo.hash_block(None, &blocks[0], &[]),
        plain.hash_block(None, &blocks[0], &[])
    );
    assert_eq!(memo.memo_counts(), (hits, misses + 1), "cleared");
}

/// The manager's hash worker and its preparers hash through the manager's
/// memo: a prompt they see again is found, with the hashes of a manager
/// without a memo.
#[test]
fn the_worker_and_preparers_share_the_memo() {
    let system: Vec<u32> = (5000..5000 + 16 * 12).collect();
    let spec = |tail: u32| RequestSpec {
        prompt_token_ids: system.iter().copied().chain([tail; 20]).collect(),
        ..RequestSpec::default()
    };
    let mut off = manager(16, Some(0), HashAlgo::Sha256Cbor);
    let mut cfg = ManagerConfig::full_attention(512, 16, 1 << 14);
    cfg.hash_seed = Some("memo".into());
    cfg.background_hashing = true;
    let mut bg = KvCacheManager::new(cfg).expect("config");
    for (i, id) in ["a", "b"].iter().enumerate() {
        bg.add_request(id, spec(i as u32)).expect("add");
        off.add_request(id, spec(i as u32)).expect("add");
        // Waits for the worker's hashes.
        assert_eq!(hashes(&bg, id), hashes(&off, id));
    }
    // "a": 13 blocks hashed; "b": the 12 shared found, its 13th hashed.
    assert_eq!(bg.hash_memo_counts(), (12, 14));

    let worker_side = bg.request_preparer().expect("preparer");
    let c = spec(7);
    let prepared = std::thread::spawn(move || worker_side.prepare("c", c).expect("prepare"))
        .join()
        .expect("thread");
    bg.add_prepared(prepared).expect("add prepared");
    off.add_request("c", spec(7)).expect("add");
    assert_eq!(hashes(&bg, "c"), hashes(&off, "c"));
    assert_eq!(bg.hash_memo_counts(), (24, 15));
}

fn plain(prompt: Vec<u32>) -> RequestSpec {
    RequestSpec {
        prompt_token_ids: prompt,
        ..RequestSpec::default()
    }
}

/// A prompt that begins like a live request's takes that request's hashes
/// for the whole blocks they share, up to the first token that differs, and
/// hashes the rest; with a memo of a single set (which finds none of these
/// blocks again) the counts show each block taken or hashed.
#[test]
fn a_prompt_takes_the_hashes_it_shares_with_a_live_request() {
    let system: Vec<u32> = (7000..7000 + 16 * 20).collect();
    let mut on = manager(16, Some(1), HashAlgo::Sha256Cbor);
    let mut off = manager(16, Some(0), HashAlgo::Sha256Cbor);
    // "b" differs from "a" at token 16 * 5 + 3: five blocks shared.
    let mut b: Vec<u32> = system.clone();
    b[16 * 5 + 3] = 1;
    // "c" holds all of "a" (20 blocks and its 8-token tail) and more.
    let a: Vec<u32> = system.iter().copied().chain([3; 8]).collect();
    let c: Vec<u32> = a.iter().copied().chain(0..40).collect();
    for (id, prompt) in [("a", &a), ("b", &b), ("c", &c)] {
        for m in [&mut on, &mut off] {
            m.add_request(id, plain(prompt.clone())).expect("add");
        }
        assert_eq!(hashes(&on, id), hashes(&off, id), "{id}");
    }
    // "a" hashes 20; "b" takes 5 and hashes 15; "c" (its last source "b")
    // takes 5 and hashes 18 of 23.
    let (found, hashed) = on.hash_memo_counts();
    assert_eq!((found, hashed - 20 - 15), (10, 18));

    // A follow-up turn of "a" (its prompt, the output sampled for it, a
    // question) takes from a live source only, and the blocks filled by the
    // source's sampled tokens too.
    let output: Vec<u32> = (0..40).map(|t| 90_000 + t).collect();
    let turn: Vec<u32> = a.iter().chain(&output).copied().chain([5; 30]).collect();
    for m in [&mut on, &mut off] {
        m.remove_request("b").expect("remove");
        m.remove_request("c").expect("remove");
        m.append_token_ids("a", &output).expect("append");
    }
    // The last request to begin so was "c", removed: nothing taken.
    assert_eq!(add_both(&mut on, &mut off, "a2", &turn), 0);
    for m in [&mut on, &mut off] {
        m.remove_request("a2").expect("remove");
        m.add_request("a3", plain(a.clone())).expect("add");
        m.remove_request("a").expect("remove");
        m.append_token_ids("a3", &output).expect("append");
    }
    // From "a3": its 20 prompt blocks and the 3 its tail and output fill.
    assert_eq!(add_both(&mut on, &mut off, "a4", &turn), 23);
}

/// Adds a plain request to both managers, checks that they give it the same
/// hashes, and returns the blocks `on` found instead of hashing.
fn add_both(on: &mut KvCacheManager, off: &mut KvCacheManager, id: &str, prompt: &[u32]) -> u64 {
    let before = on.hash_memo_counts().0;
    for m in [&mut *on, &mut *off] {
        m.add_request(id, plain(prompt.to_vec())).expect("add");
    }
    assert_eq!(hashes(on, id), hashes(off, id), "{id}");
    on.hash_memo_counts().0 - before
}

/// Requests whose hashes do not follow from their tokens alone (a salt, a
/// `LoRA` adapter, a multimodal item) neither take hashes nor lend theirs;
/// nor do managers with the memo off or another algorithm.
#[test]
fn requests_with_extra_keys_share_no_hashes() {
    let prompt: Vec<u32> = (100..100 + 16 * 6).collect();
    let mut rng = SplitMix64(9);
    for choice in 0..3 {
        let keyed = loop {
            let s = specs::with_extra_keys(&mut rng, prompt.clone(), 3, |_| 40);
            let kind = [
                s.cache_salt.is_some(),
                s.lora.is_some(),
                !s.mm_features.is_empty(),
            ];
            if kind[choice] {
                break s;
            }
        };
        let mut on = manager(16, Some(1), HashAlgo::Sha256Cbor);
        let mut off = manager(16, Some(0), HashAlgo::Sha256Cbor);
        for m in [&mut on, &mut off] {
            m.add_request("plain", plain(prompt.clone())).expect("add");
            m.add_request("keyed", keyed.clone()).expect("add");
            m.add_request("plain2", plain(prompt.clone())).expect("add");
            m.add_request("keyed2", keyed.clone()).expect("add");
        }
        for id in ["plain", "keyed", "plain2", "keyed2"] {
            assert_eq!(hashes(&on, id), hashes(&off, id), "{choice} {id}");
        }
        // Only "plain2" takes (from "plain", the last plain request to begin
        // so): its 6 blocks.
        assert_eq!(on.hash_memo_counts().0, 6, "{choice}");
    }
    for (memo, algo) in [
        (Some(0), HashAlgo::Sha256Cbor),
        (None, HashAlgo::Xxh3Native),
    ] {
        let mut m = manager(16, memo, algo);
        m.add_request("a", plain(prompt.clone())).expect("add");
        m.add_request("b", plain(prompt.clone())).expect("add");
        assert_eq!(m.hash_memo_counts(), (0, 0), "{algo:?}");
    }
}

/// Many live requests of shared prefixes cut at any token, with extra keys
/// now and then, added and removed at random: every hash is the one a
/// manager without the memo gives, whatever was taken from whom.
#[test]
fn shared_hashes_change_no_hash() {
    for block_size in [16, 5, 1] {
        let mut rng = SplitMix64(u64::from(block_size) + 40);
        let roots: Vec<Vec<u32>> = (0..4)
            .map(|_| (0..120).map(|_| rng.below(1000) as u32).collect())
            .collect();
        let mut on = manager(block_size, None, HashAlgo::Sha256Cbor);
        let mut off = manager(block_size, Some(0), HashAlgo::Sha256Cbor);
        let mut live: Vec<String> = Vec::new();
        for i in 0..300 {
            let root = &roots[rng.below(roots.len() as u64) as usize];
            let cut = rng.below(root.len() as u64 + 1) as usize;
            let mut prompt = root[..cut].to_vec();
            prompt.extend((0..rng.below(40)).map(|_| rng.below(1000) as u32));
            let s = specs::with_extra_keys(&mut rng, prompt, 8, |rng| rng.below(60));
            let id = format!("r{i}");
            for m in [&mut on, &mut off] {
                m.add_request(&id, s.clone()).expect("add");
            }
            assert_eq!(hashes(&on, &id), hashes(&off, &id), "{block_size} {id}");
            if rng.below(3) == 0 {
                let out: Vec<u32> = (0..rng.below(30)).map(|_| rng.below(1000) as u32).collect();
                for m in [&mut on, &mut off] {
                    m.append_token_ids(&id, &out).expect("append");
                }
            }
            live.push(id);
            while live.len() > 12 || (rng.below(4) == 0 && !live.is_empty()) {
                let gone = live.swap_remove(rng.below(live.len() as u64) as usize);
                for m in [&mut on, &mut off] {
                    m.remove_request(&gone).expect("remove");
                }
            }
        }
        assert!(on.hash_memo_counts().0 > 0);
    }
}
