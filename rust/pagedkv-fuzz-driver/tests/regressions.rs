//! Regression tests from fuzzing (`fuzz/`, target `ops`).
//!
//! - Every input in `fuzz/seeds/ops/` (the largest inputs of the fuzzer's
//!   minimised corpus) and `fuzz/regressions/ops/` (the raw inputs that once
//!   crashed, now decoded within the driver's bounds) is replayed through the
//!   fuzz driver, which checks after every call: no panic, `check_invariants`,
//!   refused calls change nothing, block conservation, shared blocks hold the
//!   same tokens, and every block is free again once all requests are removed.
//! - The crashes the fuzzer found are reduced to plain reproducers below; each
//!   states the intended behaviour (a refusal or a capped allocation, never a
//!   panic or an abort).

use pagedkv_fuzz_driver as driver;

use std::path::Path;

use pagedkv_core::{
    AllocateArgs, AttentionKind, Error, GroupSpec, KvCacheManager, ManagerConfig, MmFeature,
    RequestSpec,
};
use pagedkv_splitmix::SplitMix64;

fn replay_dir(dir: &Path) -> usize {
    replay_dir_with(dir, driver::run)
}

fn replay_dir_with(dir: &Path, run: fn(&[u8])) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut files: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    files.sort();
    for path in &files {
        let data = std::fs::read(path).expect("read a fuzz input");
        let name = path.display().to_string();
        let outcome = std::panic::catch_unwind(|| run(&data));
        assert!(outcome.is_ok(), "fuzz input {name} fails");
    }
    files.len()
}

#[test]
fn fuzz_corpus_inputs_keep_every_property() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let n = replay_dir(&root.join("seeds/ops")) + replay_dir(&root.join("regressions/ops"));
    assert!(n > 0, "no fuzz inputs found under {}", root.display());
}

/// The prefix index's target (`fuzz/fuzz_targets/index.rs`): its saved inputs,
/// then inputs drawn from a fixed-seed generator (a small fuzz run in every
/// `cargo test`).
#[test]
fn index_fuzz_inputs_keep_every_property() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let n = replay_dir_with(&root.join("seeds/index"), driver::run_index)
        + replay_dir_with(&root.join("regressions/index"), driver::run_index);
    assert!(n > 0, "no index fuzz inputs found under {}", root.display());
    let mut rng = SplitMix64(SplitMix64::GAMMA);
    for _ in 0..300 {
        let len = rng.below(600) as usize;
        let data: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        driver::run_index(&data);
    }
}

/// Found by the fuzzer: a multimodal item whose `offset + length` overflowed u64
/// panicked while hashing (`request.rs`, `f.offset + f.length`) instead of being
/// refused. Python cannot reach it (offsets and lengths are i64 there), the Rust
/// API can.
#[test]
fn multimodal_item_past_u64_is_refused_not_a_panic() {
    let mut mgr = KvCacheManager::new(ManagerConfig::full_attention(11, 16, 4096)).expect("config");
    let spec = RequestSpec {
        prompt_token_ids: vec![1; 32],
        mm_features: vec![MmFeature {
            identifier: "img".into(),
            offset: u64::MAX - 1,
            length: 2,
        }],
        ..RequestSpec::default()
    };
    let r = mgr.add_request("r", spec);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    assert!(!mgr.contains("r"));
    mgr.check_invariants().expect("invariants");
}

/// Found by the fuzzer: `remove_skipped_blocks` with a count near `u64::MAX` on a
/// sliding-window group panicked (`single_type.rs`, `(n + 1)` in
/// `num_skipped_tokens`); counts past the request's tokens are now refused. Python cannot reach it (counts are i64 there); the
/// same count past the request's tokens from Python frees the blocks the window
/// still needs (see `tests/core/test_bad_input.py`).
#[test]
fn remove_skipped_blocks_with_a_huge_count_is_refused_not_a_panic() {
    let mut cfg = ManagerConfig::full_attention(20, 4, 4096);
    cfg.groups = vec![
        GroupSpec::new(AttentionKind::FullAttention, 4),
        GroupSpec::new(AttentionKind::SlidingWindow { window: 8 }, 4),
    ];
    let mut mgr = KvCacheManager::new(cfg).expect("config");
    let spec = RequestSpec {
        prompt_token_ids: (0..30).collect(),
        ..RequestSpec::default()
    };
    mgr.add_request("r", spec).expect("add");
    let hit = mgr.get_computed_blocks("r").expect("lookup");
    mgr.allocate_slots("r", &AllocateArgs::step(30, 0), Some(&hit))
        .expect("allocate")
        .expect("fits");
    let before: Vec<Vec<u32>> = mgr
        .block_ids("r")
        .expect("ids")
        .iter()
        .map(|g| g.to_vec())
        .collect();
    let r = mgr.remove_skipped_blocks("r", u64::MAX);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    let after: Vec<Vec<u32>> = mgr
        .block_ids("r")
        .expect("ids")
        .iter()
        .map(|g| g.to_vec())
        .collect();
    assert_eq!(before, after);
    mgr.check_invariants().expect("invariants");
}

/// Found by the fuzzer (an out-of-memory abort, reachable from Python): a Mamba
/// "align" group sized the request's block list by `num_computed_tokens +
/// num_new_tokens` without the `max_model_len` cap the other groups apply, so a
/// count the validation accepts (up to 2^40) asked for hundreds of GiB and the
/// allocation failure aborted the process.
#[test]
fn mamba_align_allocation_with_a_huge_count_is_capped_or_refused() {
    let mut cfg = ManagerConfig::full_attention(64, 4, 64);
    cfg.groups = vec![
        GroupSpec::new(AttentionKind::FullAttention, 4),
        GroupSpec::new(
            AttentionKind::Mamba {
                mode: pagedkv_core::MambaCacheMode::Align,
                num_speculative_blocks: 0,
                prefill_checkpoint_alignment: None,
            },
            8,
        ),
    ];
    let mut mgr = KvCacheManager::new(cfg).expect("config");
    let spec = RequestSpec {
        prompt_token_ids: (0..10).collect(),
        ..RequestSpec::default()
    };
    mgr.add_request("r", spec).expect("add");
    let hit = mgr.get_computed_blocks("r").expect("lookup");
    let r = mgr.allocate_slots("r", &AllocateArgs::step(1 << 40, 0), Some(&hit));
    match r {
        Ok(Some(groups)) => assert!(groups.iter().all(|g| g.len() <= 16)),
        Ok(None) | Err(Error::InvalidArgument(_) | Error::CannotFit(_)) => {}
        Err(e) => panic!("unexpected error {e:?}"),
    }
    let held: usize = mgr
        .block_ids("r")
        .expect("ids")
        .iter()
        .map(|g| g.len())
        .sum();
    assert!(held <= 32, "the request holds {held} block slots");
    mgr.check_invariants().expect("invariants");
}

#[test]
fn caching_past_the_allocated_tokens_is_refused() {
    // A Mamba "align" group with two speculative blocks: after a 5-token
    // step the request's state row is [null, state, spec, spec]. Caching 12
    // tokens would publish the first speculative block as the 12-token state;
    // the next step then moves that block to the end of the row (vLLM's
    // relocation of exclusively owned scratch blocks), and a second request
    // hitting the 12-token prefix would share a block the first one writes.
    let mut cfg = ManagerConfig::full_attention(64, 4, 256);
    cfg.groups = vec![
        GroupSpec::new(AttentionKind::SinkFullAttention { sink_len: 8 }, 4),
        GroupSpec::new(
            AttentionKind::Mamba {
                mode: pagedkv_core::MambaCacheMode::Align,
                num_speculative_blocks: 2,
                prefill_checkpoint_alignment: None,
            },
            4,
        ),
    ];
    let mut mgr = KvCacheManager::new(cfg).expect("config");
    let prompt: Vec<u32> = (0..40).collect();
    let spec = |p: &[u32]| RequestSpec {
        prompt_token_ids: p.to_vec(),
        ..RequestSpec::default()
    };
    mgr.add_request("a", spec(&prompt)).expect("add");
    mgr.allocate_slots("a", &AllocateArgs::step(5, 0), None)
        .expect("fits")
        .expect("fits");
    let row = mgr.block_ids("a").expect("ids")[1].to_vec();
    assert_eq!(row.len(), 4);
    let keys = mgr.pool().num_cached_keys();
    match mgr.cache_blocks("a", 12) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("allocations cover"), "{m}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(mgr.pool().num_cached_keys(), keys);
    // Up to what the step allocated is fine.
    mgr.cache_blocks("a", 5).expect("cache");
    mgr.allocate_slots("a", &AllocateArgs::step(11, 5), None)
        .expect("fits")
        .expect("fits");
    mgr.add_request("b", spec(&prompt[..13])).expect("add");
    let hit = mgr.get_computed_blocks("b").expect("lookup");
    let a_row = mgr.block_ids("a").expect("ids")[1].to_vec();
    for (pos, &blk) in hit.block_ids[1].iter().enumerate() {
        if blk != 0 {
            assert_eq!(
                a_row.get(pos),
                Some(&blk),
                "hit block {blk} at {pos}, a holds {a_row:?}"
            );
        }
    }
    mgr.check_invariants().expect("invariants");
}
