//! Request handles: batch calls that name requests by the handle `add_request`
//! returned behave exactly like the same calls by id, and a removed request's
//! handle never names another request.
//!
//! The decode fast path: most decode steps (no block needed, none filled) are
//! decided without the general allocation path; the batch's results, block
//! tables, events and tracked counts must be those of the general path called
//! for each request in order, including the steps where a lookahead needs a
//! block or a token fills one. (The reference single calls take the general
//! path through an in-flight token count, which full attention ignores.)
mod support;

use support::admit_prompt as admit;

use pagedkv_core::{
    AllocateArgs, BatchAllocation, Error, KvCacheManager, ManagerConfig, RequestRefs, RequestSpec,
};

fn mgr() -> KvCacheManager {
    KvCacheManager::new(ManagerConfig::full_attention(64, 4, 1024)).expect("config")
}

fn events_mgr() -> KvCacheManager {
    let cfg = ManagerConfig {
        enable_kv_cache_events: true,
        ..ManagerConfig::full_attention(64, 4, 1024)
    };
    KvCacheManager::new(cfg).expect("config")
}

fn prompt(seed: u32, n: u32) -> RequestSpec {
    RequestSpec {
        prompt_token_ids: (0..n).map(|i| seed * 1000 + i).collect(),
        ..Default::default()
    }
}

#[test]
fn handles_and_ids_give_the_same_batch() {
    let (mut a, mut b) = (mgr(), mgr());
    let ids = ["x", "y", "z"];
    let mut hs = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        admit(&mut a, id, i as u32, 7);
        hs.push(admit(&mut b, id, i as u32, 7));
    }
    assert_eq!(b.request_handle("y").expect("known"), hs[1]);
    for step in 0..12u64 {
        let new = [1u64; 3];
        let comp = [7 + step; 3];
        let (mut oa, mut ob) = (BatchAllocation::default(), BatchAllocation::default());
        a.allocate_slots_batch(&ids, &new, &comp, 0, &mut oa)
            .expect("ids");
        b.allocate_slots_batch_refs(RequestRefs::Handles(&hs), &new, &comp, 0, &mut ob)
            .expect("handles");
        assert_eq!(oa.num_allocated, ob.num_allocated);
        assert_eq!(oa.block_ids, ob.block_ids);
        assert_eq!(oa.offsets, ob.offsets);
        let toks = [5u32, 6, 7];
        a.append_token_ids_batch(&ids, &toks).expect("ids");
        b.append_token_ids_batch_refs(RequestRefs::Handles(&hs), &toks)
            .expect("handles");
    }
    for id in ids {
        assert_eq!(a.block_ids(id).expect("a"), b.block_ids(id).expect("b"));
        assert_eq!(
            a.block_hashes(id).expect("a"),
            b.block_hashes(id).expect("b")
        );
    }
    a.check_invariants().expect("a");
    b.check_invariants().expect("b");
}

#[test]
fn a_removed_requests_handle_is_rejected_even_when_its_slot_is_reused() {
    let mut m = mgr();
    let old = admit(&mut m, "old", 1, 5);
    m.remove_request("old").expect("remove");
    let new = admit(&mut m, "new", 2, 5);
    assert_eq!(old as u32, new as u32, "the slot is reused");
    assert_ne!(old, new);
    let free = m.num_free_blocks();
    let mut out = BatchAllocation::default();
    let r = m.allocate_slots_batch_refs(
        RequestRefs::Handles(&[new, old]),
        &[1, 1],
        &[5, 5],
        0,
        &mut out,
    );
    assert!(matches!(r, Err(Error::UnknownRequest(_))), "{r:?}");
    let r = m.append_token_ids_batch_refs(RequestRefs::Handles(&[new, old]), &[1, 2]);
    assert!(matches!(r, Err(Error::UnknownRequest(_))), "{r:?}");
    // Nothing changed: no block taken, no token appended to the live request.
    assert_eq!(m.num_free_blocks(), free);
    assert_eq!(m.num_tokens("new").expect("known"), 5);
    let r = m.append_token_ids_batch_refs(RequestRefs::Handles(&[u64::MAX]), &[1]);
    assert!(matches!(r, Err(Error::UnknownRequest(_))), "{r:?}");
    m.check_invariants().expect("invariants");
}

#[test]
fn no_request_grows_past_max_model_len_by_id_or_handle() {
    let mut m = mgr();
    let h = m.add_request("r", prompt(1, 1022)).expect("add");
    assert!(matches!(
        m.append_token_ids("r", &[1, 2, 3]),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(m.num_tokens("r").expect("known"), 1022);
    m.append_token_ids_batch_refs(RequestRefs::Handles(&[h]), &[7])
        .expect("room for one");
    m.append_token_ids("r", &[8]).expect("room for one");
    assert!(matches!(
        m.append_token_ids_batch_refs(RequestRefs::Handles(&[h]), &[9]),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(m.num_tokens("r").expect("known"), 1024);
    m.check_invariants().expect("invariants");
}

#[test]
fn batch_decode_steps_match_single_calls_block_for_block_and_event_for_event() {
    let (mut single, mut batch, mut plain) = (events_mgr(), events_mgr(), events_mgr());
    let ids = ["a", "b", "c"];
    let lens = [7u32, 8, 9];
    let mut handles = Vec::new();
    for (id, &n) in ids.iter().zip(&lens) {
        admit(&mut single, id, n, n);
        admit(&mut plain, id, n, n);
        handles.push(admit(&mut batch, id, n, n));
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
