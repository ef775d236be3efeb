//! Request handles: batch calls that name requests by the handle `add_request`
//! returned behave exactly like the same calls by id, and a removed request's
//! handle never names another request.
use pagedkv_core::{
    AllocateArgs, BatchAllocation, Error, KvCacheManager, ManagerConfig, RequestRefs, RequestSpec,
};

fn mgr() -> KvCacheManager {
    KvCacheManager::new(ManagerConfig::full_attention(64, 4, 1024)).expect("config")
}

fn prompt(seed: u32, n: u32) -> RequestSpec {
    RequestSpec {
        prompt_token_ids: (0..n).map(|i| seed * 1000 + i).collect(),
        ..Default::default()
    }
}

fn admit(m: &mut KvCacheManager, id: &str, seed: u32, n: u32) -> u64 {
    let h = m.add_request(id, prompt(seed, n)).expect("add");
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
