//! The calls of a serving engine that owns its requests (vLLM 0.33 behind
//! `pagedkv.vllm`): engine-supplied block hashes, deferred frees
//! (`pop_blocks_for_free` + `free_blocks`), capped lookups, hits named by block
//! ids, in-flight tokens, vLLM's lenient answers, and scheduler-recorded stats.
//! Expected ids follow vLLM 0.33 (`tests/v1/core/test_prefix_caching.py`,
//! `test_deferred_block_free.py`, `test_swa_inflight_window_free.py`).

use pagedkv_core::{
    AllocateArgs, AttentionKind, BlockHash, BlockStored, Error, GroupSpec, KvCacheManager, KvEvent,
    ManagerConfig, PLACEHOLDER_TOKEN, RequestSpec,
};

fn ok<T>(r: Result<T, Error>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

fn engine_mgr(num_blocks: u32, block_size: u32) -> KvCacheManager {
    let mut cfg = ManagerConfig::full_attention(num_blocks, block_size, 8192);
    cfg.external_block_hashes = true;
    cfg.record_stats_at_admission = false;
    cfg.enable_kv_cache_events = true;
    cfg.log_stats = true;
    ok(KvCacheManager::new(cfg))
}

/// An engine's hash of block `i` of a prompt family: any bytes will do, the
/// manager never recomputes them.
fn h(family: u8, i: usize) -> BlockHash {
    BlockHash::from_slice(&[family, i as u8, 0xAB, 0xCD]).unwrap_or_default()
}

fn add(m: &mut KvCacheManager, id: &str, tokens: Vec<u32>, hashes: &[BlockHash]) {
    let n = tokens.len();
    ok(m.add_request(
        id,
        RequestSpec {
            prompt_token_ids: tokens,
            session_id: Some(format!("session-{id}")),
            ..Default::default()
        },
    ));
    ok(m.extend_request(id, (n, 0), &[], hashes));
}

/// Lookup + admission of a whole prompt; (hit ids, hit tokens, new ids).
fn admit(m: &mut KvCacheManager, id: &str) -> (Vec<u32>, u64, Option<Vec<u32>>) {
    let hit = ok(m.get_computed_blocks(id));
    let n = ok(m.num_tokens(id)) as u64;
    let args = AllocateArgs {
        num_new_computed_tokens: hit.num_computed_tokens,
        ..AllocateArgs::step(n - hit.num_computed_tokens, 0)
    };
    let new = ok(m.allocate_slots(id, &args, Some(&hit))).map(|g| g[0].clone());
    (hit.block_ids[0].clone(), hit.num_computed_tokens, new)
}

/// The `BlockStored` events drained from `m`.
fn stored_events(m: &mut KvCacheManager) -> Vec<BlockStored> {
    m.take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored(s) => Some(s),
            _ => None,
        })
        .collect()
}

fn seq(a: u32, b: u32) -> Vec<u32> {
    (a..b).collect()
}

#[test]
fn hits_follow_the_engines_hashes_not_the_tokens() {
    let mut m = engine_mgr(11, 16);
    add(&mut m, "r0", seq(0, 55), &[h(1, 0), h(1, 1), h(1, 2)]);
    assert_eq!(admit(&mut m, "r0"), (vec![], 0, Some(vec![1, 2, 3, 4])));
    // Other tokens, same hashes: the engine says these blocks are equal.
    add(&mut m, "r1", seq(500, 555), &[h(1, 0), h(1, 1), h(2, 2)]);
    assert_eq!(admit(&mut m, "r1"), (vec![1, 2], 32, Some(vec![5, 6])));
    // Same tokens, other hashes: no hit.
    add(&mut m, "r2", seq(0, 55), &[h(3, 0)]);
    assert_eq!(admit(&mut m, "r2").1, 0);
    // The events carry the engine's hashes and the request's session.
    let stored = stored_events(&mut m);
    assert_eq!(stored[0].block_hashes, vec![h(1, 0), h(1, 1), h(1, 2)]);
    assert_eq!(stored[0].session_id.as_deref(), Some("session-r0"));
    assert_eq!(stored[1].block_hashes, vec![h(2, 2)]);
    assert_eq!(stored[1].parent_block_hash, Some(h(1, 1)));
    ok(m.check_invariants());
}

#[test]
fn hashes_may_run_ahead_of_the_tokens_and_only_known_blocks_are_cached() {
    let mut m = engine_mgr(11, 4);
    // Four hashes for 9 tokens (vLLM's prefill-side connectors drop a prompt's
    // last token after it was hashed): two blocks are full.
    add(
        &mut m,
        "r0",
        seq(0, 9),
        &[h(1, 0), h(1, 1), h(1, 2), h(1, 3)],
    );
    admit(&mut m, "r0");
    assert_eq!(m.pool().num_cached_keys(), 2);
    let stored = stored_events(&mut m);
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].block_hashes.len(), 2);
    assert_eq!(stored[0].token_ids, seq(0, 8));
    ok(m.check_invariants());
}

#[test]
fn extend_request_refuses_a_stale_position_or_a_hashing_manager() {
    let mut m = engine_mgr(11, 16);
    add(&mut m, "r0", seq(0, 20), &[h(1, 0)]);
    assert!(m.extend_request("r0", (19, 1), &[5], &[]).is_err());
    ok(m.extend_request("r0", (20, 1), &[5, PLACEHOLDER_TOKEN], &[]));
    assert_eq!(ok(m.num_tokens("r0")), 22);
    let mut own = ok(KvCacheManager::new(ManagerConfig::full_attention(
        11, 16, 64,
    )));
    ok(own.add_request(
        "r",
        RequestSpec {
            prompt_token_ids: seq(0, 4),
            ..Default::default()
        },
    ));
    assert!(own.extend_request("r", (4, 0), &[1], &[]).is_err());
}

#[test]
fn deferred_free_holds_blocks_until_free_blocks_then_frees_like_free() {
    // vLLM's test_prefill: r0 and r1 share three blocks; freeing both puts the
    // unshared tail blocks first, then the shared prefix deepest first.
    let mut m = engine_mgr(11, 16);
    let common = [h(1, 0), h(1, 1), h(1, 2)];
    add(&mut m, "r0", seq(0, 55), &common);
    admit(&mut m, "r0");
    add(&mut m, "r1", [seq(0, 48), seq(100, 105)].concat(), &common);
    assert_eq!(admit(&mut m, "r1"), (vec![1, 2, 3], 48, Some(vec![5])));
    let popped = ok(m.pop_blocks_for_free("r0"));
    assert_eq!(popped, vec![1, 2, 3, 4]);
    // Still referenced: nothing returned to the pool, r0 forgotten.
    assert_eq!(m.num_free_blocks(), 5);
    assert_eq!(m.pool().ref_cnt(4), 1);
    assert_eq!(m.pool().ref_cnt(1), 2);
    assert!(!m.contains("r0"));
    assert_eq!(m.num_detached_block_refs(), 4);
    ok(m.check_invariants());
    let reversed: Vec<u32> = popped.iter().rev().copied().collect();
    ok(m.free_blocks(&reversed));
    ok(m.remove_request("r1"));
    assert_eq!(m.pool().free_queue(), vec![5, 4, 6, 7, 8, 9, 10, 3, 2, 1]);
    assert_eq!(m.num_detached_block_refs(), 0);
    ok(m.check_invariants());
}

#[test]
fn free_blocks_refuses_blocks_that_were_not_detached_and_changes_nothing() {
    let mut m = engine_mgr(11, 16);
    add(&mut m, "r0", seq(0, 40), &[h(1, 0), h(1, 1)]);
    admit(&mut m, "r0");
    add(&mut m, "r1", seq(0, 20), &[h(2, 0)]);
    admit(&mut m, "r1");
    let popped = ok(m.pop_blocks_for_free("r0"));
    assert_eq!(popped, vec![1, 2, 3]);
    let before = m.pool().free_queue();
    // r1's block, and r0's block listed twice: refused whole.
    assert!(m.free_blocks(&[3, 4]).is_err());
    assert!(m.free_blocks(&[3, 3]).is_err());
    assert_eq!(m.pool().free_queue(), before);
    assert_eq!(m.num_detached_block_refs(), 3);
    ok(m.free_blocks(&[0, 3, 2, 1])); // the null block is skipped
    ok(m.check_invariants());
}

#[test]
fn lookups_are_capped_at_max_cache_hit_length() {
    let mut m = engine_mgr(11, 16);
    let hashes = [h(1, 0), h(1, 1), h(1, 2)];
    add(&mut m, "r0", seq(0, 55), &hashes);
    admit(&mut m, "r0");
    add(&mut m, "r1", seq(0, 55), &hashes);
    let full = ok(m.get_computed_blocks("r1"));
    assert_eq!(
        (full.block_ids[0].clone(), full.num_computed_tokens),
        (vec![1, 2, 3], 48)
    );
    let capped = ok(m.get_computed_blocks_up_to("r1", Some(40)));
    assert_eq!(
        (capped.block_ids[0].clone(), capped.num_computed_tokens),
        (vec![1, 2], 32)
    );
    let none = ok(m.get_computed_blocks_up_to("r1", Some(15)));
    assert_eq!(none.num_computed_tokens, 0);
}

#[test]
fn a_hit_named_by_block_ids_is_checked_against_the_cache() {
    let mut m = engine_mgr(11, 16);
    let hashes = [h(1, 0), h(1, 1), h(1, 2)];
    add(&mut m, "r0", seq(0, 55), &hashes);
    admit(&mut m, "r0");
    add(&mut m, "r1", seq(0, 55), &hashes);
    let hit = ok(m.computed_blocks_from_ids("r1", vec![vec![1, 2]], 32, true));
    let args = AllocateArgs {
        num_new_computed_tokens: 32,
        ..AllocateArgs::step(23, 0)
    };
    let new = ok(m.allocate_slots("r1", &args, Some(&hit))).map(|g| g[0].clone());
    assert_eq!(new, Some(vec![5, 6]));
    assert_eq!(m.pool().ref_cnt(2), 2);
    // Block 4 is r0's unhashed tail; 99 is out of range.
    add(&mut m, "r2", seq(0, 55), &hashes);
    assert!(matches!(
        m.computed_blocks_from_ids("r2", vec![vec![1, 4]], 32, true),
        Err(Error::StaleComputedBlocks(_))
    ));
    assert!(
        m.computed_blocks_from_ids("r2", vec![vec![99]], 16, false)
            .is_err()
    );
    assert!(m.computed_blocks_from_ids("r2", vec![], 0, false).is_err());
    // Unchecked, the engine vouches: two free, uncached blocks are adopted
    // (vLLM's test_cache_hit_local_and_external hands in free-queue blocks).
    let free = m.pool().free_queue();
    let vouched = ok(m.computed_blocks_from_ids("r2", vec![free[..2].to_vec()], 32, false));
    let args = AllocateArgs {
        num_new_computed_tokens: 32,
        ..AllocateArgs::step(23, 0)
    };
    ok(m.allocate_slots("r2", &args, Some(&vouched)));
    assert_eq!(&ok(m.block_ids("r2"))[0][..2], &free[..2]);
    assert_eq!(m.pool().ref_cnt(free[0]), 1);
    ok(m.check_invariants());
}

#[test]
fn vllm_lenient_answers_none_for_a_request_that_can_never_fit() {
    let mut m = engine_mgr(5, 16); // 4 usable blocks
    add(&mut m, "big", seq(0, 100), &[]);
    let args = AllocateArgs::step(100, 0);
    assert!(matches!(
        m.allocate_slots("big", &args, None),
        Err(Error::CannotFit(_))
    ));
    let lenient = AllocateArgs {
        vllm_lenient: true,
        ..args
    };
    assert!(ok(m.allocate_slots("big", &lenient, None)).is_none());
    ok(m.check_invariants());
}

#[test]
fn vllm_lenient_allows_computed_tokens_the_request_holds_no_blocks_for() {
    // A disaggregated decode worker: all but the last prompt token computed
    // remotely, no local blocks yet (vLLM's test_async_scheduler).
    let mut m = engine_mgr(11, 16);
    add(&mut m, "r", seq(0, 31), &[]);
    let strict = AllocateArgs::step(1, 30);
    assert!(m.allocate_slots("r", &strict, None).is_err());
    let lenient = AllocateArgs {
        vllm_lenient: true,
        ..strict
    };
    let new = ok(m.allocate_slots("r", &lenient, None)).map(|g| g[0].clone());
    assert_eq!(new, Some(vec![1, 2]));
    // In-flight output tokens counted as computed before they are appended.
    let ahead = AllocateArgs {
        vllm_lenient: true,
        ..AllocateArgs::step(1, 32)
    };
    assert!(ok(m.allocate_slots("r", &ahead, None)).is_some());
}

#[test]
fn in_flight_tokens_keep_the_window_blocks_an_in_flight_step_reads() {
    let swa = |in_flight: u64| -> Vec<u32> {
        let groups = vec![GroupSpec::new(
            AttentionKind::SlidingWindow { window: 32 },
            16,
        )];
        let mut cfg = ManagerConfig::new(20, groups, 4096);
        cfg.external_block_hashes = true;
        let mut m = ok(KvCacheManager::new(cfg));
        ok(m.add_request(
            "r",
            RequestSpec {
                prompt_token_ids: seq(0, 64),
                ..Default::default()
            },
        ));
        ok(m.allocate_slots("r", &AllocateArgs::step(64, 0), None));
        ok(m.extend_request("r", (64, 0), &[7], &[]));
        let args = AllocateArgs {
            num_in_flight_tokens: in_flight,
            ..AllocateArgs::step(1, 64)
        };
        ok(m.allocate_slots("r", &args, None));
        ok(m.block_ids("r"))[0].to_vec()
    };
    // 64 computed, window 32: tokens before 33 are skipped: two blocks nulled
    // and freed to the front of the queue, where the new block comes from.
    assert_eq!(swa(0), vec![0, 0, 3, 4, 2]);
    // 32 of them still in flight: only what is before 1 may go (nothing).
    assert_eq!(swa(32), vec![1, 2, 3, 4, 5]);
}

#[test]
fn blocks_to_allocate_for_a_request_holding_none() {
    let m = engine_mgr(11, 16);
    assert_eq!(
        ok(m.num_blocks_to_allocate(None, 33, (0, None), 33, 0, false)),
        3
    );
    assert!(
        m.num_blocks_to_allocate(Some("nope"), 1, (0, None), 1, 0, false)
            .is_err()
    );
}

#[test]
fn stats_are_recorded_by_the_scheduler_and_readable_without_reset() {
    let mut m = engine_mgr(11, 16);
    add(&mut m, "r0", seq(0, 55), &[h(1, 0)]);
    admit(&mut m, "r0");
    // Admission records nothing with record_stats_at_admission off.
    assert_eq!(m.prefix_cache_stats().map(|s| s.requests), Some(0));
    ok(m.record_prefix_cache_stats(55, 16, false));
    ok(m.record_prefix_cache_stats(40, 0, true));
    assert!(m.record_prefix_cache_stats(10, 11, false).is_err());
    let peek = m.prefix_cache_stats().copied();
    assert_eq!(
        peek.as_ref().map(|s| (s.requests, s.queries, s.hits)),
        Some((1, 55, 16))
    );
    assert_eq!(peek.as_ref().map(|s| s.preempted_requests), Some(1));
    // Peeking reset nothing; taking does.
    let taken = m.make_prefix_cache_stats();
    assert_eq!(taken.map(|s| s.queries), Some(55));
    assert_eq!(m.prefix_cache_stats().map(|s| s.queries), Some(0));
}

#[test]
fn external_hashes_cannot_be_combined_with_verification() {
    let mut cfg = ManagerConfig::full_attention(11, 16, 64);
    cfg.external_block_hashes = true;
    cfg.verify_cached_tokens = true;
    assert!(KvCacheManager::new(cfg).is_err());
}

#[test]
fn lookahead_hashing_publishes_the_tokens_each_block_hash_covers() {
    // vLLM's test_kv_events_reconstruct_lookahead_block_hashes: block size 2,
    // L lookahead tokens, tokens 0..4+L: two blocks hashed, one BlockStored.
    for lookahead in [1u32, 2] {
        let mut cfg = ManagerConfig::full_attention(11, 2, 64);
        cfg.external_block_hashes = true;
        cfg.enable_kv_cache_events = true;
        cfg.num_hash_lookahead_tokens = lookahead;
        let mut m = ok(KvCacheManager::new(cfg));
        let tokens = seq(0, 4 + lookahead);
        add(&mut m, "r", tokens.clone(), &[h(1, 0), h(1, 1)]);
        admit(&mut m, "r");
        let events = m.take_events();
        assert_eq!(events.len(), 1);
        let KvEvent::BlockStored(s) = &events[0] else {
            panic!("expected BlockStored, got {events:?}");
        };
        assert_eq!(s.block_hashes, vec![h(1, 0), h(1, 1)]);
        assert_eq!(s.token_ids, seq(0, 4));
        let l = lookahead as usize;
        assert_eq!(
            s.lookahead_token_ids,
            Some(vec![tokens[2..2 + l].to_vec(), tokens[4..4 + l].to_vec()])
        );
        assert_eq!(s.extra_keys, Some(vec![None, None]));
    }
    // Lookahead hashing needs the engine's hashes.
    let mut cfg = ManagerConfig::full_attention(11, 2, 64);
    cfg.num_hash_lookahead_tokens = 1;
    assert!(KvCacheManager::new(cfg).is_err());
}

#[test]
fn eagle_groups_drop_for_their_whole_spec_group() {
    // vLLM's test_eagle_grouped_swa_siblings_use_same_cache_mask: full
    // attention (block 32) and two sliding-window groups of one spec (block 8,
    // window 8), the second EAGLE's: both siblings cache the block past the
    // aligned boundary, and a longer prompt hits 64 tokens.
    let swa = GroupSpec::new(AttentionKind::SlidingWindow { window: 8 }, 8);
    let groups = vec![
        GroupSpec::new(AttentionKind::FullAttention, 32),
        swa.clone(),
        swa,
    ];
    let mut cfg = ManagerConfig::new(100, groups, 8192);
    cfg.hash_block_size = Some(8);
    cfg.use_eagle = true;
    cfg.eagle_groups = vec![2];
    let mut m = ok(KvCacheManager::new(cfg));
    let tokens: Vec<u32> = (0..9).flat_map(|i| [i; 8]).collect();
    ok(m.add_request(
        "r0",
        RequestSpec {
            prompt_token_ids: tokens.clone(),
            ..Default::default()
        },
    ));
    assert_eq!(admit_groups(&mut m, "r0"), 0);
    let hashes = ok(m.block_hashes("r0")).to_vec();
    for group in [1, 2] {
        for i in [4, 8] {
            let key = pagedkv_core::CacheKey {
                hash: hashes[i],
                group,
            };
            assert!(
                m.pool().cached_block(&key).is_some(),
                "block {i} of group {group}"
            );
        }
    }
    ok(m.remove_request("r0"));
    ok(m.add_request(
        "r1",
        RequestSpec {
            prompt_token_ids: [tokens, vec![999]].concat(),
            ..Default::default()
        },
    ));
    assert_eq!(ok(m.get_computed_blocks("r1")).num_computed_tokens, 64);
    // An EAGLE group out of range is refused.
    let mut bad = ManagerConfig::full_attention(11, 16, 64);
    bad.eagle_groups = vec![1];
    assert!(KvCacheManager::new(bad).is_err());
}

/// Admits a request whole in every group; returns the hit length.
fn admit_groups(m: &mut KvCacheManager, id: &str) -> u64 {
    let hit = ok(m.get_computed_blocks(id));
    let n = ok(m.num_tokens(id)) as u64;
    let args = AllocateArgs {
        num_new_computed_tokens: hit.num_computed_tokens,
        ..AllocateArgs::step(n - hit.num_computed_tokens, 0)
    };
    assert!(ok(m.allocate_slots(id, &args, Some(&hit))).is_some());
    hit.num_computed_tokens
}

/// An engine's chained block hashes of `tokens` (any chain will do).
fn chain(tokens: &[u32], bs: usize) -> Vec<BlockHash> {
    let mut prev = 0xcbf2_9ce4_8422_2325_u64;
    tokens
        .chunks_exact(bs)
        .map(|block| {
            for &t in block {
                prev = (prev ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3);
            }
            BlockHash::from_slice(&prev.to_be_bytes()).unwrap_or_default()
        })
        .collect()
}

#[test]
fn the_engine_pins_the_shared_prefix_boundary() {
    // vLLM's test_swa_shared_prefix_reuse_under_zero_retention[False]: full
    // attention + sliding window (2 blocks of 16), retention 0. The lookup
    // reports the junction; only a request whose engine pins it (vLLM's
    // scheduler copies it into the request) keeps the window there cached.
    let last_hit = |retention: Option<u64>, pin: bool| -> u64 {
        let groups = vec![
            GroupSpec::new(AttentionKind::FullAttention, 16),
            GroupSpec::new(AttentionKind::SlidingWindow { window: 32 }, 16),
        ];
        let mut cfg = ManagerConfig::new(200, groups, 8192);
        cfg.external_block_hashes = true;
        cfg.prefix_cache_retention_interval = retention;
        let mut m = ok(KvCacheManager::new(cfg));
        let shared = vec![7u32; 64];
        let mut hit = 0;
        for (i, v) in [50u32, 60, 70].into_iter().enumerate() {
            let id = format!("r{i}");
            let tokens = [shared.clone(), vec![v; 64]].concat();
            ok(m.add_request(
                &id,
                RequestSpec {
                    prompt_token_ids: tokens.clone(),
                    ..Default::default()
                },
            ));
            ok(m.extend_request(&id, (128, 0), &[], &chain(&tokens, 16)));
            let found = ok(m.get_computed_blocks(&id));
            hit = found.num_computed_tokens;
            if i == 1 {
                if retention == Some(0) {
                    assert_eq!(found.shared_prefix_boundary, 64);
                }
                if pin {
                    ok(m.set_shared_prefix_boundary(&id, found.shared_prefix_boundary));
                }
            }
            if i < 2 {
                let args = AllocateArgs {
                    num_new_computed_tokens: hit,
                    ..AllocateArgs::step(128 - hit, 0)
                };
                ok(m.allocate_slots(&id, &args, Some(&found)));
            }
        }
        hit
    };
    assert_eq!(last_hit(None, false), 64);
    assert_eq!(last_hit(Some(0), false), 0);
    assert_eq!(last_hit(Some(0), true), 64);
}

#[test]
fn cached_tokens_are_estimated_from_the_requests_blocks() {
    // vLLM's estimate_cached_tokens: the deepest cached block of the request.
    let mut m = engine_mgr(11, 16);
    add(&mut m, "r", seq(0, 55), &[h(1, 0), h(1, 1), h(1, 2)]);
    assert_eq!(ok(m.estimate_cached_tokens("r")), 0);
    admit(&mut m, "r");
    assert_eq!(ok(m.estimate_cached_tokens("r")), 48);
    assert!(m.estimate_cached_tokens("nope").is_err());
}

#[test]
fn a_manager_that_only_counts_tokens_takes_a_prompt_by_its_length() {
    // Events off: with the engine's hashes nothing reads a token id's value.
    let quiet = |num_blocks| {
        let mut cfg = ManagerConfig::full_attention(num_blocks, 16, 128);
        cfg.external_block_hashes = true;
        ok(KvCacheManager::new(cfg))
    };
    let (mut counted, mut listed) = (quiet(11), quiet(11));
    assert!(!counted.reads_token_values());
    let hashes = [h(1, 0), h(1, 1), h(1, 2)];
    ok(counted.add_request_counted("r0", 55, RequestSpec::default()));
    ok(counted.extend_request("r0", (55, 0), &[], &hashes));
    add(&mut listed, "r0", seq(0, 55), &hashes);
    assert_eq!(ok(counted.num_tokens("r0")), 55);
    assert_eq!(ok(counted.num_prompt_tokens("r0")), 55);
    // Output tokens come as usual; lookups and allocations match those of
    // the same request registered with its ids.
    for m in [&mut counted, &mut listed] {
        assert_eq!(admit(m, "r0"), (vec![], 0, Some(vec![1, 2, 3, 4])));
        ok(m.sync_request("r0", (55, 3), &[7], &[], None));
        add(m, "r1", seq(0, 40), &hashes[..2]);
        assert_eq!(admit(m, "r1"), (vec![1, 2], 32, Some(vec![5])));
    }
    assert_eq!(ok(counted.num_tokens("r0")), 56);

    // Refused, and nothing registered: ids given too, a prompt past
    // max_model_len (before anything is reserved for it), a manager that
    // hashes, verifies or publishes events.
    let with_ids = RequestSpec {
        prompt_token_ids: seq(0, 4),
        ..Default::default()
    };
    assert!(counted.add_request_counted("x", 4, with_ids).is_err());
    assert!(
        counted
            .add_request_counted("x", usize::MAX, RequestSpec::default())
            .is_err()
    );
    assert!(!counted.contains("x"));
    let mut events = engine_mgr(11, 16);
    let mut hashing = ok(KvCacheManager::new(ManagerConfig::full_attention(
        11, 16, 128,
    )));
    for m in [&mut events, &mut hashing] {
        assert!(m.reads_token_values());
        let e = m.add_request_counted("x", 4, RequestSpec::default());
        assert!(e.is_err_and(|e| e.to_string().contains("pass the prompt's token ids")));
        assert!(!m.contains("x"));
    }
}

#[test]
fn blocks_the_engine_filled_are_cached_under_the_requests_hashes() {
    // vLLM's BlockPool.cache_full_blocks on blocks a connector took with
    // get_new_blocks and filled: cached, one BlockStored, hit by the next request.
    let mut m = engine_mgr(11, 4);
    let hashes = [h(1, 0), h(1, 1), h(1, 2)];
    add(&mut m, "r", seq(0, 13), &hashes);
    let Some(mine) = m.get_new_blocks(3) else {
        panic!("3 blocks are free")
    };
    assert_eq!(mine, vec![1, 2, 3]);
    // Refused, nothing cached: past the blocks given, past the hashed tokens,
    // a block the engine does not hold, an unknown group or request.
    assert!(
        m.cache_detached_blocks("r", 0, &mine[..1], (0, 2), None)
            .is_err()
    );
    assert!(
        m.cache_detached_blocks("r", 0, &[1, 2, 3, 4], (0, 4), None)
            .is_err()
    );
    assert!(
        m.cache_detached_blocks("r", 0, &[1, 9], (0, 2), None)
            .is_err()
    );
    assert!(
        m.cache_detached_blocks("r", 1, &mine, (0, 2), None)
            .is_err()
    );
    assert!(
        m.cache_detached_blocks("nobody", 0, &mine, (0, 2), None)
            .is_err()
    );
    assert!(
        m.cache_detached_blocks("r", 0, &mine, (0, 2), Some(&[true]))
            .is_err()
    );
    assert!(m.take_events().is_empty());
    // A masked-out block is neither cached nor published.
    ok(m.cache_detached_blocks("r", 0, &mine, (0, 1), Some(&[false])));
    assert_eq!(ok(m.get_computed_blocks("r")).num_computed_tokens, 0);
    // Blocks 1 and 2 of the request (0 was cached before: the parent).
    ok(m.cache_detached_blocks("r", 0, &mine, (0, 1), None));
    ok(m.cache_detached_blocks("r", 0, &mine, (1, 3), Some(&[true, true])));
    let stored = stored_events(&mut m);
    assert_eq!(stored.len(), 3);
    assert!(stored[0].block_hashes.is_empty());
    let stored = &stored[1..];
    assert_eq!(stored[0].block_hashes, vec![hashes[0]]);
    assert_eq!(stored[0].parent_block_hash, None);
    assert_eq!(stored[0].token_ids, seq(0, 4));
    assert_eq!(stored[1].block_hashes, hashes[1..].to_vec());
    assert_eq!(stored[1].parent_block_hash, Some(hashes[0]));
    assert_eq!(stored[1].token_ids, seq(4, 12));
    assert_eq!(
        (stored[1].group_idx, stored[1].session_id.as_deref()),
        (0, Some("session-r"))
    );
    // Still the engine's: a request's lookup finds them, and they return to
    // the pool as cached blocks when the engine frees them.
    add(&mut m, "s", seq(0, 13), &hashes);
    let hit = ok(m.get_computed_blocks("s"));
    assert_eq!(
        (hit.block_ids[0].clone(), hit.num_computed_tokens),
        (vec![1, 2, 3], 12)
    );
    ok(m.free_blocks(&mine));
    assert_eq!(m.num_free_blocks(), 10);
    assert_eq!(admit(&mut m, "s"), (vec![1, 2, 3], 12, Some(vec![4])));
}

#[test]
fn only_blocks_the_engine_alone_holds_take_cache_entries() {
    let mut m = engine_mgr(11, 4);
    let hashes = [h(1, 0), h(1, 1), h(1, 2)];
    add(&mut m, "r", seq(0, 13), &hashes);
    assert_eq!(admit(&mut m, "r"), (vec![], 0, Some(vec![1, 2, 3, 4])));
    add(&mut m, "s", seq(0, 13), &hashes);
    // A request's block is not the engine's to cache.
    let of_r = m.cache_detached_blocks("s", 0, &[1], (0, 1), None);
    assert!(of_r.is_err_and(|e| e.to_string().contains("not held by the engine")));
    let Some(mine) = m.get_new_blocks(2) else {
        panic!("free blocks")
    };
    // Cached as the request's block 1 (8 tokens): as block 0 (4 tokens) it
    // would hold other content, refused; as block 2 it is promoted, as vLLM's
    // cache_full_blocks does with a block cached for fewer tokens.
    ok(m.cache_detached_blocks("s", 0, &[0, mine[0]], (1, 2), None));
    let shorter = m.cache_detached_blocks("s", 0, &mine, (0, 1), None);
    assert!(shorter.is_err_and(|e| e.to_string().contains("another hash")));
    ok(m.cache_detached_blocks("s", 0, &[0, mine[0]], (1, 2), None)); // same entry
    ok(m.cache_detached_blocks("s", 0, &[0, 0, mine[0]], (2, 3), None));
    // A request that hits an engine-held block holds it too: its entries are
    // then the request's, and the engine's calls are refused.
    ok(m.cache_detached_blocks("s", 0, &mine[1..], (0, 1), None));
    ok(m.evict_blocks(&[1]));
    // (Block 2 of the chain is cached twice: r's block 3 first, found first.)
    assert_eq!(admit(&mut m, "s").0, vec![mine[1], 2, 3]);
    let e = m.cache_detached_blocks("s", 0, &[mine[1]], (0, 1), None);
    assert!(e.is_err_and(|e| e.to_string().contains("held by a request too")));
    let e = m.cache_detached_partial_block("s", 0, mine[1], 4, true);
    assert!(e.is_err_and(|e| e.to_string().contains("held by a request too")));
    ok(m.free_blocks(&mine));
    ok(m.remove_request("s"));
    ok(m.remove_request("r"));
    m.check_invariants().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(m.num_free_blocks(), 10);
}
