//! A decode step decides most steps (no block needed, none filled) without the
//! general allocation path: the batch's results, block tables, events and
//! tracked counts must be those of the general path called for each request in
//! order, including the steps where a lookahead needs a block or a token fills
//! one. (The single calls take the general path through an in-flight token
//! count, which full attention ignores.)
use pagedkv_core::{
    AllocateArgs, BatchAllocation, KvCacheManager, ManagerConfig, RequestRefs, RequestSpec,
};

fn mgr() -> KvCacheManager {
    let cfg = ManagerConfig {
        enable_kv_cache_events: true,
        ..ManagerConfig::full_attention(64, 4, 1024)
    };
    KvCacheManager::new(cfg).expect("config")
}

fn admit(m: &mut KvCacheManager, id: &str, n: u32) -> u64 {
    let spec = RequestSpec {
        prompt_token_ids: (0..n).map(|i| n * 100 + i).collect(),
        ..Default::default()
    };
    let h = m.add_request(id, spec).expect("add");
    let hit = m.get_computed_blocks(id).expect("lookup");
    let args = AllocateArgs {
        num_new_computed_tokens: hit.num_computed_tokens,
        ..AllocateArgs::step(u64::from(n) - hit.num_computed_tokens, 0)
    };
    assert!(
        m.allocate_slots(id, &args, Some(&hit))
            .expect("alloc")
            .is_some()
    );
    h
}

#[test]
fn batch_decode_steps_match_single_calls_block_for_block_and_event_for_event() {
    let (mut single, mut batch, mut plain) = (mgr(), mgr(), mgr());
    let ids = ["a", "b", "c"];
    let lens = [7u32, 8, 9];
    let mut handles = Vec::new();
    for (id, &n) in ids.iter().zip(&lens) {
        admit(&mut single, id, n);
        admit(&mut plain, id, n);
        handles.push(admit(&mut batch, id, n));
    }
    let _ = (
        single.take_events(),
        batch.take_events(),
        plain.take_events(),
    );
    let mut computed: Vec<u64> = lens.iter().map(|&n| u64::from(n)).collect();
    let mut saw_noop = false;
    let mut saw_alloc = false;
    for step in 0..30u64 {
        // Lookahead slots every third step: a block needed before one fills.
        let la = if step % 3 == 2 { 3 } else { 0 };
        let mut want = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            let args = AllocateArgs {
                num_lookahead_tokens: la,
                num_in_flight_tokens: 1,
                ..AllocateArgs::step(1, computed[i])
            };
            assert!(!args.is_plain_step());
            let new = single.allocate_slots(id, &args, None).expect("single");
            want.push(new.expect("fits")[0].clone());
            // The same step as a plain single call (the fast path).
            let args = AllocateArgs {
                num_lookahead_tokens: la,
                ..AllocateArgs::step(1, computed[i])
            };
            let new = plain.allocate_slots(id, &args, None).expect("plain");
            assert_eq!(new.expect("fits")[0], want[i], "step {step}: plain call");
        }
        let events = single.take_events();
        assert_eq!(events, plain.take_events(), "step {step}: plain events");
        let mut out = BatchAllocation::default();
        if step % 2 == 0 {
            batch
                .allocate_slots_batch_tracked(RequestRefs::Handles(&handles), &[1; 3], la, &mut out)
                .expect("tracked batch");
        } else {
            batch
                .allocate_slots_batch_refs(
                    RequestRefs::Handles(&handles),
                    &[1; 3],
                    &computed,
                    la,
                    &mut out,
                )
                .expect("batch");
        }
        assert_eq!(out.num_allocated, 3, "step {step}");
        let got: Vec<Vec<u32>> = (0..3)
            .map(|i| {
                let (s, e) = (out.offsets[0][i] as usize, out.offsets[0][i + 1] as usize);
                out.block_ids[0][s..e].to_vec()
            })
            .collect();
        assert_eq!(got, want, "step {step}: new blocks");
        saw_noop |= got.iter().any(Vec::is_empty);
        saw_alloc |= got.iter().any(|b| !b.is_empty());
        assert_eq!(events, batch.take_events(), "step {step}: events");
        assert_eq!(single.num_free_blocks(), batch.num_free_blocks());
        for id in ids {
            assert_eq!(
                single.block_ids(id).expect("a"),
                batch.block_ids(id).expect("b")
            );
        }
        let tokens = [step as u32; 3];
        for (id, t) in ids.iter().zip(tokens) {
            single.append_token_ids(id, &[t]).expect("append");
            plain.append_token_ids(id, &[t]).expect("append");
        }
        batch
            .append_token_ids_batch_refs(RequestRefs::Handles(&handles), &tokens)
            .expect("append");
        for c in &mut computed {
            *c += 1;
        }
    }
    assert!(saw_noop && saw_alloc);
    // The blocks filled while decoding are cached alike.
    for id in ids {
        let (x, y) = (
            single.get_computed_blocks(id).expect("a"),
            batch.get_computed_blocks(id).expect("b"),
        );
        assert_eq!(x.num_computed_tokens, y.num_computed_tokens);
        assert_eq!(x.block_ids, y.block_ids);
    }
}
