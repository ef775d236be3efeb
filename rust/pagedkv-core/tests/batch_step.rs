//! The batch call with the step's sampled tokens (`BatchStep::append_token_ids`):
//! the same manager state, results and events as `append_token_ids_batch`
//! followed by `allocate_slots_batch`, and a refused call appends nothing.
mod support;

use pagedkv_core::{
    AllocateArgs, BatchAllocation, BatchStep, Error, KvCacheManager, ManagerConfig, RequestRefs,
};
use support::admit_prompt as admit;

const MAX_LEN: u64 = 64;

fn mgr() -> KvCacheManager {
    let cfg = ManagerConfig {
        enable_kv_cache_events: true,
        ..ManagerConfig::full_attention(64, 4, MAX_LEN)
    };
    KvCacheManager::new(cfg).expect("config")
}

/// Everything a caller can observe of the requests and the pool.
fn state(m: &mut KvCacheManager, ids: &[&str]) -> String {
    use std::fmt::Write;
    let mut s = format!(
        "free {} events {:?}\n",
        m.num_free_blocks(),
        m.take_events()
    );
    for id in ids {
        writeln!(
            s,
            "{id}: tokens {} blocks {:?} hashes {:?}",
            m.num_tokens(id).expect("known"),
            m.block_ids(id).expect("known"),
            m.block_hashes(id).expect("known"),
        )
        .expect("a String takes any write");
    }
    s
}

/// Three requests decode in lockstep (every fourth token fills a block, which
/// the same step caches), one of them a prefill chunk that samples nothing; the
/// fused call and the two calls agree step by step, with counts given and
/// tracked.
#[test]
fn fused_step_matches_append_then_allocate() {
    let ids = ["a", "b", "c"];
    for tracked in [false, true] {
        let (mut one, mut two) = (mgr(), mgr());
        let (mut hs, mut hs_two) = (Vec::new(), Vec::new());
        for (i, id) in ids.iter().enumerate() {
            let n = if i == 2 { 9 } else { 6 + i as u32 };
            hs.push(admit(&mut one, id, i as u32, n));
            hs_two.push(admit(&mut two, id, i as u32, n));
        }
        assert_eq!(state(&mut one, &ids), state(&mut two, &ids));
        let refs = RequestRefs::Handles(&hs);
        let refs_two = RequestRefs::Handles(&hs_two);
        for step in 0..20u32 {
            // "c" samples nothing at the first step (as a prefill chunk would).
            let sampled: Vec<Option<u32>> = (0..3u32)
                .map(|i| (step > 0 || i != 2).then_some(5000 + step * 3 + i))
                .collect();
            let computed: Vec<u64> = ids
                .iter()
                .map(|id| one.num_tokens(id).expect("known") as u64)
                .collect();
            let new: Vec<u64> = sampled.iter().map(|t| u64::from(t.is_some())).collect();
            let new = if step == 0 { vec![1, 1, 1] } else { new };
            let computed = if step == 0 {
                // "c" still has one prompt token to compute: its last chunk.
                vec![computed[0], computed[1], computed[2] - 1]
            } else {
                computed
            };
            let mut fused = BatchAllocation::default();
            let step_args = BatchStep {
                append_token_ids: Some(&sampled),
                ..BatchStep::new(refs, &new, (!tracked).then_some(&computed[..]))
            };
            one.allocate_slots_batch_step(&step_args, &mut fused)
                .expect("fused step");
            let (sampled_two, toks): (Vec<u64>, Vec<u32>) = hs_two
                .iter()
                .zip(&sampled)
                .filter_map(|(&h, t)| t.map(|t| (h, t)))
                .unzip();
            two.append_token_ids_batch_refs(RequestRefs::Handles(&sampled_two), &toks)
                .expect("append");
            let mut split = BatchAllocation::default();
            if tracked {
                two.allocate_slots_batch_tracked(refs_two, &new, 0, &mut split)
            } else {
                two.allocate_slots_batch_refs(refs_two, &new, &computed, 0, &mut split)
            }
            .expect("allocate");
            assert_eq!(fused.num_allocated, 3, "step {step}");
            assert_eq!(fused.block_ids, split.block_ids, "step {step}");
            assert_eq!(fused.offsets, split.offsets, "step {step}");
            assert_eq!(state(&mut one, &ids), state(&mut two, &ids), "step {step}");
        }
    }
}

/// The appended token counts among the request's tokens when the step's
/// counts are checked: computed tokens that include it (as an engine that
/// counts the sampled token as computed passes them) are refused without it
/// and served with it in the same call.
#[test]
fn the_appended_token_counts_in_the_step() {
    let mut m = mgr();
    // Six prompt tokens in two blocks of four: room for two more.
    let h = [admit(&mut m, "a", 1, 6)];
    let refs = RequestRefs::Handles(&h);
    let mut out = BatchAllocation::default();
    let err = m
        .allocate_slots_batch_refs(refs, &[2], &[7], 0, &mut out)
        .expect_err("7 computed tokens of 6");
    assert!(
        err.to_string().contains("exceeds the request's 6 tokens"),
        "{err}"
    );
    let step = BatchStep {
        append_token_ids: Some(&[Some(77)]),
        ..BatchStep::new(refs, &[2], Some(&[7]))
    };
    m.allocate_slots_batch_step(&step, &mut out)
        .expect("served");
    assert_eq!(out.num_allocated, 1);
    assert_eq!(m.num_tokens("a").expect("known"), 7);
    assert_eq!(out.block_ids, vec![vec![3]], "a third block for token 9");
}

/// A refused call leaves every request as it was: no token appended, nothing
/// allocated, no event, whichever entry is at fault.
#[test]
fn a_refused_step_appends_nothing() {
    let mut m = mgr();
    let h = [admit(&mut m, "a", 1, 8), admit(&mut m, "b", 2, 62)];
    let ids = ["a", "b"];
    let refs = RequestRefs::Handles(&h);
    let sampled = [Some(7), Some(8)];
    m.take_events();
    let before = state(&mut m, &ids);
    let mut out = BatchAllocation::default();
    // "b" at 62 tokens: one more fits max_model_len 64, so refuse through its
    // counts; then through a length mismatch; then an unknown handle.
    let bad_counts = BatchStep {
        append_token_ids: Some(&sampled),
        ..BatchStep::new(refs, &[1, 1], Some(&[8, 64]))
    };
    let short = BatchStep {
        append_token_ids: Some(&sampled[..1]),
        ..BatchStep::new(refs, &[1, 1], Some(&[8, 62]))
    };
    let gone = [h[0], h[1] ^ (1 << 40)];
    let unknown = BatchStep {
        append_token_ids: Some(&sampled),
        ..BatchStep::new(RequestRefs::Handles(&gone), &[1, 1], Some(&[8, 62]))
    };
    for (what, step) in [
        ("counts", bad_counts),
        ("length", short),
        ("handle", unknown),
    ] {
        let err = m
            .allocate_slots_batch_step(&step, &mut out)
            .expect_err(what);
        assert!(
            matches!(err, Error::InvalidArgument(_) | Error::UnknownRequest(_)),
            "{what}: {err}"
        );
        assert_eq!(state(&mut m, &ids), before, "{what}");
    }
    // Past max_model_len: "b" reaches 64 tokens, then one more is refused.
    let ok = BatchStep {
        append_token_ids: Some(&sampled),
        ..BatchStep::new(refs, &[1, 1], Some(&[8, 62]))
    };
    m.allocate_slots_batch_step(&ok, &mut out)
        .expect("63 tokens");
    let ok = BatchStep {
        append_token_ids: Some(&sampled),
        ..BatchStep::new(refs, &[1, 1], Some(&[9, 63]))
    };
    m.allocate_slots_batch_step(&ok, &mut out)
        .expect("64 tokens");
    m.take_events();
    let before = state(&mut m, &ids);
    let past = BatchStep {
        append_token_ids: Some(&sampled),
        ..BatchStep::new(refs, &[1, 1], Some(&[10, 64]))
    };
    let err = m
        .allocate_slots_batch_step(&past, &mut out)
        .expect_err("65 tokens");
    assert!(err.to_string().contains("max_model_len"), "{err}");
    assert_eq!(state(&mut m, &ids), before, "past max_model_len");
}

/// A batch names each request once: a second step of the same request would
/// be checked against the state its first leaves (vLLM's scheduler schedules
/// a request once a step). Refused before anything changes.
#[test]
fn a_batch_naming_a_request_twice_is_refused() {
    let mut m = mgr();
    let h = admit(&mut m, "a", 1, 8);
    admit(&mut m, "b", 2, 8);
    m.take_events();
    let before = state(&mut m, &["a", "b"]);
    let hs = [h, h];
    let mut out = BatchAllocation::default();
    let err = m
        .allocate_slots_batch_refs(RequestRefs::Handles(&hs), &[1, 20], &[8, 8], 0, &mut out)
        .expect_err("named twice");
    assert!(err.to_string().contains("named twice"), "{err}");
    let err = m
        .allocate_slots_batch(&["b", "a", "b"], &[1, 1, 1], &[8, 8, 8], 0, &mut out)
        .expect_err("named twice");
    assert!(err.to_string().contains("\"b\""), "{err}");
    assert_eq!(state(&mut m, &["a", "b"]), before);
    // Each once: served.
    m.allocate_slots_batch(&["b", "a"], &[1, 1], &[8, 8], 0, &mut out)
        .expect("served");
    assert_eq!(out.num_allocated, 2);
}

/// The batch decides most decode steps up front (a running request's step
/// that takes no block and caches none); the steps it decides that way and
/// those it leaves to the general path (a block boundary, a block that
/// fills, a prefill chunk, speculative slots) give what `append_token_ids`
/// and `allocate_slots` called request by request give: the same new blocks
/// step by step, the same events and the same final state.
#[test]
fn batch_steps_match_single_calls() {
    use pagedkv_core::AllocateArgs;
    let ids = ["a", "b", "c", "d"];
    let cfg = || ManagerConfig {
        enable_kv_cache_events: true,
        ..ManagerConfig::full_attention(256, 4, 512)
    };
    let mut batch = KvCacheManager::new(cfg()).expect("config");
    let mut single = KvCacheManager::new(cfg()).expect("config");
    let mut handles = Vec::new();
    // "d": a 20-token prompt of which only 8 are scheduled at admission; it
    // prefills 3 more per step until its prompt is computed, sampling nothing.
    let mut computed = [5u64, 6, 7, 8];
    for (i, id) in ids.iter().enumerate() {
        let n = if i == 3 { 20 } else { 5 + i as u32 };
        for (k, m) in [&mut batch, &mut single].into_iter().enumerate() {
            let spec = pagedkv_core::RequestSpec {
                prompt_token_ids: (0..n).map(|t| i as u32 * 1000 + t).collect(),
                ..Default::default()
            };
            let h = m.add_request(id, spec).expect("added");
            let hit = m.get_computed_blocks(id).expect("known");
            assert_eq!(hit.num_computed_tokens, 0);
            let args = AllocateArgs::step(computed[i], 0);
            assert!(
                m.allocate_slots(id, &args, Some(&hit))
                    .expect("ok")
                    .is_some()
            );
            if k == 0 {
                handles.push(h);
            }
        }
    }
    let mut out = BatchAllocation::default();
    let mut fast_and_general = [0usize; 2];
    for step in 0..40u64 {
        let lookahead = [0, 0, 0, 1, 0, 2][step as usize % 6];
        let mut sampled = Vec::new();
        let mut new = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            let tokens = single.num_tokens(id).expect("known") as u64;
            let prefilling = computed[i] < tokens;
            sampled.push((!prefilling && step > 0).then_some(step as u32 * 10 + i as u32));
            new.push(if prefilling {
                (tokens - computed[i]).min(3)
            } else {
                1
            });
        }
        // Request by request.
        let mut expect = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            if let Some(t) = sampled[i] {
                single.append_token_ids(id, &[t]).expect("room");
            }
            let args = AllocateArgs {
                num_lookahead_tokens: lookahead,
                ..AllocateArgs::step(new[i], computed[i])
            };
            let blocks = single.allocate_slots(id, &args, None).expect("valid");
            let blocks = blocks.expect("fits").to_vec();
            fast_and_general[usize::from(!blocks.iter().all(Vec::is_empty))] += 1;
            expect.push(blocks);
        }
        // In one call, counts tracked from the second step on.
        let counts = (step > 0).then_some(&computed[..]);
        let step_call = BatchStep {
            num_lookahead_tokens: lookahead,
            append_token_ids: Some(&sampled),
            ..BatchStep::new(RequestRefs::Handles(&handles), &new, counts)
        };
        batch
            .allocate_slots_batch_step(&step_call, &mut out)
            .expect("valid");
        assert_eq!(out.num_allocated, ids.len());
        for (i, blocks) in expect.iter().enumerate() {
            let got = &out.block_ids[0][out.offsets[0][i] as usize..out.offsets[0][i + 1] as usize];
            assert_eq!(got, &blocks[0][..], "step {step}, request {}", ids[i]);
        }
        for i in 0..ids.len() {
            computed[i] += new[i];
        }
        assert_eq!(
            state(&mut batch, &ids),
            state(&mut single, &ids),
            "step {step}"
        );
    }
    // Both kinds of step were taken.
    assert!(
        fast_and_general[0] > 60 && fast_and_general[1] > 20,
        "{fast_and_general:?}"
    );
}

/// Steps that take a block or publish one, decided up front as lean steps:
/// the same blocks, events and state as one `allocate_slots` per request,
/// the batch ending at the first request the free blocks cannot serve (a
/// cached block evicted for an earlier one), and a step the pool can never
/// serve refused before anything changes.
#[test]
fn block_taking_steps_match_single_calls() {
    // 12 usable blocks of 4 tokens; events on, so evictions show.
    let cfg = || ManagerConfig {
        enable_kv_cache_events: true,
        ..ManagerConfig::full_attention(13, 4, 256)
    };
    let (mut one, mut two) = (
        KvCacheManager::new(cfg()).expect("config"),
        KvCacheManager::new(cfg()).expect("config"),
    );
    let ids = ["a", "b", "c"];
    let mut hs = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        // 8, 9 and 10 tokens: 2, 3 and 3 blocks.
        hs.push(admit(&mut one, id, i as u32, 8 + i as u32));
        admit(&mut two, id, i as u32, 8 + i as u32);
    }
    // A cached block nobody holds, evicted once the free blocks run out.
    admit(&mut one, "d", 9, 4);
    admit(&mut two, "d", 9, 4);
    one.remove_request("d").expect("known");
    two.remove_request("d").expect("known");
    let mut served_total = 0;
    for step in 0..12u32 {
        let computed: Vec<u64> = ids
            .iter()
            .map(|id| one.num_tokens(id).expect("known") as u64)
            .collect();
        let sampled: Vec<Option<u32>> = (0..3).map(|i| Some(700 + step * 3 + i)).collect();
        let mut out = BatchAllocation::default();
        let call = BatchStep {
            append_token_ids: Some(&sampled),
            ..BatchStep::new(RequestRefs::Handles(&hs), &[1, 1, 1], Some(&computed))
        };
        one.allocate_slots_batch_step(&call, &mut out)
            .expect("valid step");
        let mut want = vec![Vec::new()];
        let mut served = 0;
        for (i, id) in ids.iter().enumerate() {
            two.append_token_ids(id, &[sampled[i].expect("sampled")])
                .expect("known");
        }
        for (i, id) in ids.iter().enumerate() {
            let args = AllocateArgs::step(1, computed[i]);
            match two.allocate_slots(id, &args, None).expect("valid") {
                Some(new) => want[0].extend_from_slice(&new[0]),
                None => break,
            }
            served += 1;
        }
        assert_eq!(out.num_allocated, served, "step {step}");
        assert_eq!(out.block_ids, want, "step {step}");
        assert_eq!(state(&mut one, &ids), state(&mut two, &ids), "step {step}");
        served_total += served;
        if served < 3 {
            break;
        }
    }
    assert!(served_total < 36, "the pool ran out before 12 full steps");

    // One request holding 12 blocks of 4 tokens (all usable ones, 48 tokens):
    // a 49th token can never get a block.
    let mut m = KvCacheManager::new(ManagerConfig::full_attention(13, 4, 256)).expect("config");
    let h = [admit(&mut m, "big", 1, 47)];
    let mut out = BatchAllocation::default();
    let fits = BatchStep {
        append_token_ids: Some(&[Some(5)]),
        ..BatchStep::new(RequestRefs::Handles(&h), &[1], Some(&[47]))
    };
    m.allocate_slots_batch_step(&fits, &mut out)
        .expect("the 48th token fits");
    assert_eq!(out.num_allocated, 1);
    let before = state(&mut m, &["big"]);
    let never = BatchStep {
        append_token_ids: Some(&[Some(6)]),
        ..BatchStep::new(RequestRefs::Handles(&h), &[1], Some(&[48]))
    };
    let err = m
        .allocate_slots_batch_step(&never, &mut out)
        .expect_err("the pool can never give it a 13th block");
    assert!(matches!(err, Error::CannotFit(_)), "{err}");
    assert_eq!(state(&mut m, &["big"]), before, "refused: nothing changed");
}

/// A running request's single `allocate_slots` with a batch entry's arguments
/// takes the batch's paths (a step that needs nothing, a lean one); with any
/// other argument set (`has_scheduled_reqs: false`, which only an admission
/// reads) the full checks and the general path. Both give the same results,
/// blocks, events and state step by step, through block-taking steps, steps
/// with lookahead, a refused step and (on the small pool) a pool that runs
/// out; every other step is a batch call on the counts each manager tracks
/// (what the single steps before it left behind).
#[test]
fn single_running_steps_match_the_general_path() {
    for num_blocks in [64, 14] {
        let cfg = || ManagerConfig {
            enable_kv_cache_events: true,
            ..ManagerConfig::full_attention(num_blocks, 4, 256)
        };
        let mut ms = [
            KvCacheManager::new(cfg()).expect("config"),
            KvCacheManager::new(cfg()).expect("config"),
        ];
        let ids = ["a", "b", "c"];
        let mut handles = [Vec::new(), Vec::new()];
        for (m, hs) in ms.iter_mut().zip(&mut handles) {
            for (i, id) in ids.iter().enumerate() {
                hs.push(admit(m, id, i as u32, 6 + 3 * i as u32));
            }
        }
        let mut ran_out = false;
        for step in 0..24u32 {
            let sampled: Vec<u32> = (0..3).map(|i| 900 + step * 3 + i).collect();
            if step % 2 == 1 {
                let mut got = Vec::new();
                for (m, hs) in ms.iter_mut().zip(&handles) {
                    let tokens: Vec<Option<u32>> = sampled.iter().copied().map(Some).collect();
                    let call = BatchStep {
                        append_token_ids: Some(&tokens),
                        ..BatchStep::new(RequestRefs::Handles(hs), &[1, 1, 1], None)
                    };
                    let mut out = BatchAllocation::default();
                    got.push(
                        m.allocate_slots_batch_step(&call, &mut out)
                            .map(|()| (out.num_allocated, out.block_ids)),
                    );
                }
                assert_eq!(got[0], got[1], "step {step}");
            } else {
                for (i, id) in ids.iter().enumerate() {
                    let lookahead = u64::from(step % 5 == 2) * 2;
                    let computed = ms[0].num_tokens(id).expect("known") as u64;
                    let mut got = Vec::new();
                    for (k, m) in ms.iter_mut().enumerate() {
                        m.append_token_ids(id, &[sampled[i]]).expect("known");
                        let args = AllocateArgs {
                            num_lookahead_tokens: lookahead,
                            has_scheduled_reqs: k == 0,
                            ..AllocateArgs::step(1, computed)
                        };
                        got.push(
                            m.allocate_slots(id, &args, None)
                                .map(|r| r.map(<[_]>::to_vec)),
                        );
                        // More computed tokens than the request has: refused.
                        let bad = AllocateArgs::step(1, computed + 5);
                        assert!(m.allocate_slots(id, &bad, None).is_err());
                    }
                    assert_eq!(got[0], got[1], "step {step} {id}");
                    ran_out |= matches!(got[0], Ok(None));
                }
            }
            let [fast, general] = &mut ms;
            assert_eq!(state(fast, &ids), state(general, &ids), "step {step}");
        }
        assert_eq!(ran_out, num_blocks < 64, "the small pool runs out");
    }
}
