//! A caller may adopt fewer tokens of a prefix hit than the lookup found (the
//! rest it computes, or a connector loads into fresh blocks): only the blocks
//! those tokens reach are adopted, and a hit that ends inside a block continues
//! in a private copy of that block, never of a later one.

mod support;

use pagedkv_core::{AllocateArgs, KvCacheManager, ManagerConfig};
use support::{add, ids, ok};

#[test]
fn adopting_fewer_tokens_than_the_hit_adopts_only_their_blocks() {
    let mut m = ok(KvCacheManager::new(ManagerConfig::full_attention(
        32, 8, 1024,
    )));
    let prompt: Vec<u32> = (0..40).collect();
    add(&mut m, "a", prompt.clone());
    assert!(ok(m.allocate_slots("a", &AllocateArgs::step(40, 0), None)).is_some());
    let cached = ids(&m, "a")[0].clone();
    ok(m.remove_request("a"));

    add(&mut m, "b", prompt);
    let hit = ok(m.get_computed_blocks("b"));
    assert_eq!(hit.num_computed_tokens, 32);
    assert_eq!(hit.block_ids[0], cached[..4].to_vec());
    // 22 of the 32 hit tokens adopted, 5 loaded by a connector, 13 computed.
    let args = AllocateArgs {
        num_new_computed_tokens: 22,
        num_external_computed_tokens: 5,
        ..AllocateArgs::step(13, 0)
    };
    assert!(ok(m.allocate_slots("b", &args, Some(&hit))).is_some());
    ok(m.check_invariants());
    let row = ids(&m, "b")[0].clone();
    assert_eq!(row.len(), 5, "40 tokens in blocks of 8");
    assert_eq!(row[..2], cached[..2], "the two full hit blocks adopted");
    assert!(
        !cached.contains(&row[2]),
        "the third continues in a private copy"
    );
    assert!(
        !row.contains(&cached[3]),
        "the fourth hit block is not adopted"
    );
    assert_eq!(m.pool().ref_cnt(cached[3]), 0);
    // The copy's source stays referenced until the copy is handed out.
    assert_eq!(m.pool().ref_cnt(cached[2]), 1);
    let copies = m.take_block_copies();
    assert_eq!(copies, vec![(cached[2], row[2])]);
    let ends: Vec<u32> = copies.iter().flat_map(|&(a, b)| [a, b]).collect();
    ok(m.free_blocks(&ends));
    ok(m.remove_request("b"));
    ok(m.check_invariants());
    assert_eq!(m.num_free_blocks(), 31);
}
