//! Sliding-window groups that keep tokens below their window (vLLM's
//! `SlidingWindowSpec.extra_retained_tokens`, for multi-module speculative
//! decoding): blocks fall out that many tokens later and the admission cap
//! counts them; hits still need only the window.

use pagedkv_core::{AllocateArgs, AttentionKind, Error, GroupSpec, KvCacheManager, ManagerConfig};

mod support;
use support::{add, ids, ok};

fn manager(window: u32, extra: u32, num_blocks: u32) -> KvCacheManager {
    let spec = GroupSpec::new(AttentionKind::SlidingWindow { window }, 2)
        .with_extra_retained_tokens(extra);
    ok(KvCacheManager::new(ManagerConfig::new(
        num_blocks,
        vec![spec],
        8192,
    )))
}

/// How many leading blocks are null after `remove_skipped_blocks(n)`, for
/// each `n`.
fn nulled(m: &mut KvCacheManager, steps: &[u64]) -> Vec<usize> {
    add(m, "a", (0..21).collect());
    assert!(ok(m.allocate_slots("a", &AllocateArgs::step(21, 0), None)).is_some());
    steps
        .iter()
        .map(|&n| {
            ok(m.remove_skipped_blocks("a", n));
            ok(m.check_invariants());
            ids(m, "a")[0].iter().take_while(|&&b| b == 0).count()
        })
        .collect()
}

#[test]
fn blocks_fall_out_of_the_window_that_many_tokens_later() {
    // Block size 2, window 4, 3 tokens kept below it: `n - 4 + 1 - 3` tokens
    // are skipped once `n` are computed.
    let steps = [0, 6, 7, 8, 9, 12, 21];
    assert_eq!(
        nulled(&mut manager(4, 3, 30), &steps),
        [0, 0, 0, 1, 1, 3, 7]
    );
    // As a window of 7 frees them; without the extra tokens, 3 tokens sooner.
    assert_eq!(
        nulled(&mut manager(7, 0, 30), &steps),
        [0, 0, 0, 1, 1, 3, 7]
    );
    assert_eq!(
        nulled(&mut manager(4, 0, 30), &steps),
        [0, 1, 2, 2, 3, 4, 9]
    );
}

#[test]
fn the_admission_cap_counts_the_kept_tokens() {
    // Block size 16, window 64, in flight 128: the cap is
    // cdiv(63 + 16 + 128, 16) + 1 = 14 blocks with 16 kept tokens, 13 without.
    for (extra, num_blocks, admitted) in [(16, 15, true), (16, 14, false), (0, 14, true)] {
        let spec = GroupSpec::new(AttentionKind::SlidingWindow { window: 64 }, 16)
            .with_extra_retained_tokens(extra);
        let mut cfg = ManagerConfig::new(num_blocks, vec![spec], 1024);
        cfg.max_in_flight_tokens = Some(128);
        let mut m = ok(KvCacheManager::new(cfg));
        add(&mut m, "r", (0..1000).collect());
        let args = AllocateArgs {
            full_sequence_must_fit: true,
            ..AllocateArgs::step(128, 0)
        };
        let got = m.allocate_slots("r", &args, None);
        assert_eq!(
            matches!(got, Ok(Some(_))),
            admitted,
            "extra {extra}, {num_blocks} blocks"
        );
    }
}

#[test]
fn hits_still_need_only_the_window() {
    // Window 4 at block size 2: a hit ends in a run of 2 cached blocks, kept
    // tokens or not; the blocks below it are null.
    for extra in [0, 3] {
        let mut m = manager(4, extra, 30);
        add(&mut m, "a", (0..20).collect());
        assert!(ok(m.allocate_slots("a", &AllocateArgs::step(20, 0), None)).is_some());
        ok(m.cache_blocks("a", 20));
        ok(m.free("a"));
        add(&mut m, "b", (0..20).chain([999]).collect());
        let hit = ok(m.get_computed_blocks("b"));
        assert_eq!(hit.num_computed_tokens, 20, "extra {extra}");
        ok(m.check_invariants());
    }
}

#[test]
fn only_sliding_window_groups_keep_tokens_below_a_window() {
    let spec = GroupSpec::new(AttentionKind::FullAttention, 16).with_extra_retained_tokens(1);
    let err = KvCacheManager::new(ManagerConfig::new(10, vec![spec], 1024)).unwrap_err();
    assert!(matches!(err, Error::InvalidConfig(_)), "{err}");
    assert!(err.to_string().contains("extra_retained_tokens"), "{err}");
    let replayed = GroupSpec::new(AttentionKind::ReplayedSlidingWindow { window: 8 }, 4)
        .with_extra_retained_tokens(2);
    let full = GroupSpec::new(AttentionKind::FullAttention, 4);
    assert!(KvCacheManager::new(ManagerConfig::new(10, vec![full, replayed], 1024)).is_ok());
}
