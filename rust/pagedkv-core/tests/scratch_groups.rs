//! Hybrid layouts beyond reconciled hits: groups that never enter the prefix
//! cache beside a cached full-attention group (vLLM 0.33's bounded-replay
//! sliding window, `SlidingWindowMLASpec(bounded_replay=True)`, and
//! `CircularBufferSpec`); the fresh-block zeroing lists
//! (`needs_kv_cache_zeroing`); and per-group lookups for a KV connector in a
//! full-attention + Mamba model (`get_computed_blocks_for_connector`). Expected
//! ids are what vLLM 0.33's own `KVCacheManager` answers for the same calls
//! (the scratch layouts: full attention float32 + the scratch group in
//! bfloat16, a mixed-precision layout, so vLLM zeroes fresh attention blocks).

use pagedkv_core::{
    AllocateArgs, AttentionKind, Error, GroupSpec, KvCacheManager, KvEvent, ManagerConfig,
};

mod support;
use support::{add, ids, ok};

fn manager(second: AttentionKind, second_bs: u32, num_blocks: u32, zero: bool) -> KvCacheManager {
    let groups = vec![
        GroupSpec::new(AttentionKind::FullAttention, 4),
        GroupSpec::new(second, second_bs),
    ];
    let mut cfg = ManagerConfig::new(num_blocks, groups, 256);
    cfg.hash_block_size = Some(4);
    cfg.enable_kv_cache_events = true;
    cfg.zero_new_blocks = zero;
    ok(KvCacheManager::new(cfg))
}

fn replayed() -> KvCacheManager {
    manager(
        AttentionKind::ReplayedSlidingWindow { window: 8 },
        4,
        30,
        true,
    )
}

/// Blocks per group.
type Groups = Vec<Vec<u32>>;

/// Looks the request up and allocates `num_new_tokens` past its hit; returns
/// the hit (blocks per group, tokens) and the new blocks.
fn admit(
    m: &mut KvCacheManager,
    id: &str,
    num_new_tokens: u64,
    external: u64,
    skip_zeroing_groups: u64,
) -> ((Groups, u64), Groups) {
    let hit = ok(m.get_computed_blocks(id));
    let args = AllocateArgs {
        num_new_computed_tokens: hit.num_computed_tokens,
        num_external_computed_tokens: external,
        skip_zeroing_groups,
        ..AllocateArgs::step(num_new_tokens, 0)
    };
    let new = ok(m.allocate_slots(id, &args, Some(&hit)))
        .expect("fits")
        .to_vec();
    ((hit.block_ids.clone(), hit.num_computed_tokens), new)
}

#[test]
fn replayed_window_never_hits_and_holds_nulls_below_the_window() {
    let mut m = replayed();
    add(&mut m, "r0", (0..20).collect());
    let (hit, new) = admit(&mut m, "r0", 20, 0, 0);
    assert_eq!(hit, (vec![vec![], vec![]], 0));
    assert_eq!(new, vec![vec![1, 2, 3, 4, 5], vec![6, 7, 8, 9, 10]]);
    assert_eq!(ok(m.take_new_block_ids(None)), (1..=10).collect::<Vec<_>>());
    // Only the full-attention group is cached.
    let stored: Vec<(u32, usize)> = m
        .take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored(s) => Some((s.group_idx, s.block_hashes.len())),
            _ => None,
        })
        .collect();
    assert_eq!(stored, vec![(0, 5)]);

    // The same prompt and 4 more tokens: a 20-token hit from full attention
    // alone; the window group gets nulls below the hit's window (20 - 8 + 1
    // tokens) and fresh blocks from there, which the engine recomputes.
    let mut prompt: Vec<u32> = (0..20).collect();
    prompt.extend([100, 101, 102, 103]);
    add(&mut m, "r1", prompt);
    let (hit, new) = admit(&mut m, "r1", 4, 0, 0);
    assert_eq!(hit, (vec![vec![1, 2, 3, 4, 5], vec![]], 20));
    assert_eq!(new, vec![vec![11], vec![12, 13, 14]]);
    assert_eq!(
        ids(&m, "r1"),
        vec![vec![1, 2, 3, 4, 5, 11], vec![0, 0, 0, 12, 13, 14]]
    );
    assert_eq!(ok(m.take_new_block_ids(None)), vec![11, 12, 13, 14]);
    // Blocks a failed load left unwritten, from token 16 on, are listed again.
    ok(m.record_blocks_for_zeroing("r1", 16));
    assert_eq!(ok(m.take_new_block_ids(None)), vec![5, 11, 13, 14]);

    assert_eq!(m.num_free_blocks(), 15);
    ok(m.remove_request("r1"));
    ok(m.remove_request("r0"));
    assert_eq!(m.num_free_blocks(), 29);
    ok(m.check_invariants());
}

#[test]
fn external_blocks_of_groups_an_async_load_writes_are_not_zeroed() {
    let mut m = replayed();
    add(&mut m, "r0", (0..20).collect());
    admit(&mut m, "r0", 20, 0, 0);
    let mut prompt: Vec<u32> = (0..20).collect();
    prompt.extend([100, 101, 102, 103]);
    add(&mut m, "r1", prompt);
    admit(&mut m, "r1", 4, 0, 0);
    ok(m.remove_request("r1"));
    ok(m.remove_request("r0"));
    ok(m.take_new_block_ids(None));

    // 16 external tokens, group 0's written by the load (bit 0).
    add(&mut m, "r2", (200..224).collect());
    let (_, new) = admit(&mut m, "r2", 8, 16, 1);
    assert_eq!(new, vec![vec![13, 12], vec![15, 16]]);
    assert_eq!(
        ids(&m, "r2"),
        vec![vec![10, 9, 8, 7, 13, 12], vec![0, 0, 6, 14, 15, 16]]
    );
    // Per group: group 0's fresh blocks only; group 1's external and fresh ones.
    assert_eq!(ok(m.take_new_block_ids(None)), vec![13, 12, 6, 14, 15, 16]);
    ok(m.check_invariants());
}

#[test]
fn circular_buffer_claims_one_block_per_request_and_is_never_zeroed() {
    let mut m = manager(AttentionKind::CircularBuffer, 8, 20, true);
    add(&mut m, "r0", (0..10).collect());
    let (_, new) = admit(&mut m, "r0", 10, 0, 0);
    assert_eq!(new, vec![vec![1, 2, 3], vec![4]]);
    ok(m.append_token_ids("r0", &[7]));
    let decode = ok(m.allocate_slots("r0", &AllocateArgs::step(1, 10), None))
        .expect("fits")
        .to_vec();
    assert_eq!(decode, vec![Vec::<u32>::new(), vec![]]);
    assert_eq!(ok(m.take_new_block_ids(None)), vec![1, 2, 3]);

    add(&mut m, "r1", (0..10).collect());
    let (hit, new) = admit(&mut m, "r1", 2, 0, 0);
    assert_eq!(hit, (vec![vec![1, 2], vec![]], 8));
    assert_eq!(new, vec![vec![5], vec![6]]);
    assert_eq!(ids(&m, "r1"), vec![vec![1, 2, 5], vec![6]]);
    assert_eq!(m.num_free_blocks(), 13);
    ok(m.remove_request("r0"));
    assert_eq!(m.num_free_blocks(), 15);
    ok(m.check_invariants());
}

#[test]
fn nothing_is_listed_for_zeroing_unless_the_layout_needs_it() {
    let mut m = manager(
        AttentionKind::ReplayedSlidingWindow { window: 8 },
        4,
        30,
        false,
    );
    assert_eq!(m.records_new_block_ids(), vec![false, false]);
    add(&mut m, "r0", (0..20).collect());
    admit(&mut m, "r0", 20, 0, 0);
    assert_eq!(ok(m.take_new_block_ids(None)), Vec::<u32>::new());
    let m = replayed();
    assert_eq!(m.records_new_block_ids(), vec![true, true]);
    let m = manager(AttentionKind::CircularBuffer, 8, 20, true);
    assert_eq!(m.records_new_block_ids(), vec![true, false]);
}

#[test]
fn zeroing_calls_refuse_bad_input_and_change_nothing() {
    let mut m = replayed();
    add(&mut m, "r0", (0..20).collect());
    admit(&mut m, "r0", 20, 0, 0);
    assert!(matches!(
        m.take_new_block_ids(Some(2)),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        m.record_blocks_for_zeroing("r0", 6),
        Err(Error::InvalidArgument(_))
    ));
    assert!(m.record_blocks_for_zeroing("nope", 0).is_err());
    // Group 1 alone, then the rest: the list was left as it was.
    assert_eq!(ok(m.take_new_block_ids(Some(1))), vec![6, 7, 8, 9, 10]);
    assert_eq!(ok(m.take_new_block_ids(None)), vec![1, 2, 3, 4, 5]);
    // An async-load group past the manager's groups is refused before anything.
    add(&mut m, "r1", (50..70).collect());
    let hit = ok(m.get_computed_blocks("r1"));
    let args = AllocateArgs {
        num_external_computed_tokens: 8,
        skip_zeroing_groups: 1 << 5,
        ..AllocateArgs::step(12, 0)
    };
    let free = m.num_free_blocks();
    assert!(matches!(
        m.allocate_slots("r1", &args, Some(&hit)),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(m.num_free_blocks(), free);
    ok(m.check_invariants());
}

#[test]
fn scratch_groups_are_not_looked_up() {
    let m = replayed();
    assert_eq!(m.lookup_groups(), Some(vec![(vec![0], false)]));
    let m = manager(AttentionKind::CircularBuffer, 8, 20, false);
    assert_eq!(m.lookup_groups(), Some(vec![(vec![0], false)]));
    let single = ok(KvCacheManager::new(ManagerConfig::full_attention(8, 4, 64)));
    assert_eq!(single.lookup_groups(), None);
}

/// Full attention + Mamba "align" (16-token blocks) with a 4-block prompt
/// prefilled one block per step, so both groups cache all four boundaries.
fn seeded_hybrid() -> (KvCacheManager, Groups) {
    use pagedkv_core::MambaCacheMode;
    let groups = vec![
        GroupSpec::new(AttentionKind::FullAttention, 16),
        GroupSpec::new(
            AttentionKind::Mamba {
                mode: MambaCacheMode::Align,
                num_speculative_blocks: 0,
                prefill_checkpoint_alignment: None,
            },
            16,
        ),
    ];
    let mut m = ok(KvCacheManager::new(ManagerConfig::new(24, groups, 8192)));
    add(&mut m, "fill", (0..64).collect());
    let hit = ok(m.get_computed_blocks("fill"));
    let mut mamba = Vec::new();
    for i in 0..4u64 {
        let args = AllocateArgs::step(16, i * 16);
        let h = (i == 0).then_some(&hit);
        assert!(ok(m.allocate_slots("fill", &args, h)).is_some());
        mamba.push(ids(&m, "fill")[1][i as usize]);
    }
    let fa = ids(&m, "fill")[0].clone();
    assert_eq!(
        (fa.clone(), mamba.clone()),
        (vec![1, 3, 5, 7], vec![2, 4, 6, 8])
    );
    ok(m.remove_request("fill"));
    (m, vec![fa, mamba])
}

#[test]
fn a_connector_lookup_reports_the_deeper_full_attention_hit_as_diverged() {
    let (mut m, seeded) = seeded_hybrid();
    let mamba = &seeded[1];
    ok(m.evict_blocks(&[mamba[1], mamba[2], mamba[3]]));
    m.new_step_starts();
    let mut prompt: Vec<u32> = (0..64).collect();
    prompt.extend(500..532);
    add(&mut m, "rep", prompt);
    let hashes = ok(m.block_hashes("rep")).to_vec();
    assert_eq!(
        m.find_longest_cache_hit_per_group(&hashes, 95),
        Some((vec![vec![1, 3, 5, 7], vec![2]], vec![64, 16]))
    );
    let conn = ok(m.get_computed_blocks_for_connector("rep", None));
    assert!(conn.diverged);
    assert_eq!(
        (conn.hit.block_ids.clone(), conn.hit.num_computed_tokens),
        (vec![vec![1, 3, 5, 7], vec![2]], 64)
    );
    // A connector supplies 16 tokens (and the Mamba state) past the hit.
    let args = AllocateArgs {
        num_new_computed_tokens: 64,
        num_external_computed_tokens: 16,
        ..AllocateArgs::step(16, 0)
    };
    let new = ok(m.allocate_slots("rep", &args, Some(&conn.hit))).map(<[Vec<u32>]>::to_vec);
    assert_eq!(new, Some(vec![vec![11], vec![12]]));
    assert_eq!(
        ids(&m, "rep"),
        vec![vec![1, 3, 5, 7, 9, 11], vec![0, 0, 0, 0, 10, 12]]
    );
    assert_eq!(m.num_free_blocks(), 15);
    ok(m.check_invariants());
    // The reconciled lookup stops where every group agrees.
    add(&mut m, "other", (0..64).chain([7; 32]).collect());
    let hit = ok(m.get_computed_blocks("other"));
    assert_eq!(
        (hit.block_ids, hit.num_computed_tokens),
        (vec![vec![1], vec![2]], 16)
    );
}

#[test]
fn a_connector_lookup_falls_back_when_another_group_runs_deeper() {
    let (mut m, seeded) = seeded_hybrid();
    let (fa, mamba) = (&seeded[0], &seeded[1]);
    ok(m.evict_blocks(&[fa[2], fa[3], mamba[1], mamba[2]]));
    add(&mut m, "rep", (0..80).collect());
    let hashes = ok(m.block_hashes("rep")).to_vec();
    assert_eq!(
        m.find_longest_cache_hit_per_group(&hashes, 79),
        Some((vec![vec![1, 3], vec![0, 0, 0, 8]], vec![32, 64]))
    );
    // Full attention lost its tail: the hit every group agrees on, with the
    // uncached shared prefix up to the Mamba state's boundary.
    let conn = ok(m.get_computed_blocks_for_connector("rep", None));
    assert!(!conn.diverged);
    assert_eq!(
        (
            conn.hit.block_ids,
            conn.hit.num_computed_tokens,
            conn.hit.shared_prefix_boundary
        ),
        (vec![vec![1], vec![2]], 16, 32)
    );
    assert_eq!(m.full_attention_group(), Some(0));
}

#[test]
fn connector_lookups_of_a_model_without_mamba_are_the_common_lookup() {
    let mut m = replayed();
    add(&mut m, "r0", (0..20).collect());
    admit(&mut m, "r0", 20, 0, 0);
    add(&mut m, "r1", (0..24).collect());
    let conn = ok(m.get_computed_blocks_for_connector("r1", None));
    assert!(!conn.diverged);
    assert_eq!(conn.hit.num_computed_tokens, 20);
    let single = ok(KvCacheManager::new(ManagerConfig::full_attention(8, 4, 64)));
    assert_eq!(single.find_longest_cache_hit_per_group(&[], 10), None);
    assert_eq!(single.full_attention_group(), None);
}
