//! Unit tests of one request's state: its prompt room, the hash worker's
//! pending and lent prompts, and the extra keys of its blocks.

use super::hash_worker::{HashJob, HashWorker};
use super::hashing::EMPTY_SHA256;
use super::*;
use crate::hash::{BlockHasher, ExtraKey, sha256_bytes};
use std::sync::Arc;

/// A prompt vector without room for output gets it when the request is
/// made (one copy then, none at the first decode step); one that has the
/// room keeps its allocation.
#[test]
fn a_prompt_gets_room_for_its_output() {
    let exact: Vec<u32> = (0..100).collect();
    let spec = RequestSpec {
        prompt_token_ids: exact,
        ..RequestSpec::default()
    };
    let r = Request::new("r".into(), 0, spec, 1, 16, false).unwrap_or_else(|e| panic!("{e}"));
    assert!(r.tokens.capacity() >= 100 + OUTPUT_ROOM);
    let mut roomy = Vec::with_capacity(100 + OUTPUT_ROOM);
    roomy.extend(0..100u32);
    let ptr = roomy.as_ptr();
    let spec = RequestSpec {
        prompt_token_ids: roomy,
        ..RequestSpec::default()
    };
    let r = Request::new("r".into(), 0, spec, 1, 16, false).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.tokens.as_ptr(), ptr, "not reallocated");
}

/// A hashing job nobody has run yet is run by its first reader: a lookup
/// never waits behind the worker's queue (here there is no worker at all).
#[test]
fn a_pending_prompt_is_hashed_by_its_first_reader() {
    use crate::hash::HashAlgo;
    let spec = || RequestSpec {
        prompt_token_ids: (0..100).collect(),
        cache_salt: Some("s".into()),
        ..RequestSpec::default()
    };
    let new = || Request::new("r".into(), 0, spec(), 1, 16, true).unwrap_or_else(|e| panic!("{e}"));
    let mut hasher = BlockHasher::new(HashAlgo::Sha256Cbor, HashAlgo::Sha256Cbor.none_hash("x"));
    let mut sync = new();
    sync.update_hashes(&mut hasher, 16);
    let mut pending = new();
    let mut input = Box::new(pending.clone());
    input.group_vec = Vec::new();
    pending.pending = Some(Arc::new(HashJob::new(input, hasher.same_kind(), 16)));
    assert_eq!(pending.hashes(), sync.hashes());
    assert_eq!(pending.ctx(), sync.ctx());
    assert_eq!(pending.hashes().len(), 6);
    // Appending settles the pending hashes into the request, then continues.
    let tokens: Vec<u32> = (100..112).collect();
    pending.append_tokens(&tokens, Some(&mut hasher), 16);
    sync.append_tokens(&tokens, Some(&mut hasher), 16);
    assert!(pending.pending.is_none());
    assert_eq!(pending.hashes(), sync.hashes());
    assert_eq!(pending.hashes().len(), 7);
}

/// A prompt hashed in the background is lent to the job, not copied: the
/// request reads its tokens through the job meanwhile, and the first
/// mutation takes them back whole, with the hashes, before appending.
#[test]
fn a_prompt_lent_to_the_hash_worker_comes_back_whole() {
    use crate::hash::HashAlgo;
    let worker = HashWorker::spawn().unwrap_or_else(|e| panic!("{e}"));
    let new = || {
        let spec = RequestSpec {
            prompt_token_ids: (0..100).collect(),
            ..RequestSpec::default()
        };
        Request::new("r".into(), 0, spec, 1, 16, false).unwrap_or_else(|e| panic!("{e}"))
    };
    let mut hasher = BlockHasher::new(HashAlgo::Sha256Cbor, HashAlgo::Sha256Cbor.none_hash("x"));
    let mut sync = new();
    sync.update_hashes(&mut hasher, 16);
    for mutation in ["push", "append", "hash"] {
        let mut bg = new();
        bg.hash_in_background(&worker, &hasher, 16);
        assert!(bg.tokens.is_empty() && bg.lent == 100, "{mutation}: lent");
        assert_eq!(bg.num_tokens(), 100);
        assert_eq!(bg.tokens(), sync.tokens());
        assert_eq!(bg.hashes(), sync.hashes());
        let mut want = sync.clone();
        match mutation {
            "push" => {
                bg.push_token(7, Some(&mut hasher), 16);
                want.push_token(7, Some(&mut hasher), 16);
            }
            "append" => {
                bg.append_tokens(&[7, 8, 9, 10], Some(&mut hasher), 16);
                want.append_tokens(&[7, 8, 9, 10], Some(&mut hasher), 16);
            }
            _ => bg.update_hashes(&mut hasher, 16),
        }
        assert!(bg.pending.is_none() && bg.lent == 0, "{mutation}: settled");
        assert_eq!(bg.tokens, want.tokens, "{mutation}: tokens");
        assert_eq!(bg.num_tokens(), want.num_tokens());
        assert_eq!(bg.hashes(), want.hashes(), "{mutation}: hashes");
    }
}

#[test]
fn empty_sha256_constant_is_right() {
    assert_eq!(sha256_bytes(b""), EMPTY_SHA256);
}

#[test]
fn mm_keys_use_offsets_relative_to_block_start() {
    let spec = RequestSpec {
        prompt_token_ids: vec![0; 16],
        mm_features: vec![
            MmFeature {
                identifier: "hash2".into(),
                offset: 10,
                length: 5,
            },
            MmFeature {
                identifier: "hash1".into(),
                offset: 0,
                length: 5,
            },
        ],
        ..RequestSpec::default()
    };
    let r = Request::new("r".into(), 0, spec, 1, 16, false).unwrap_or_else(|e| panic!("{e}"));
    let mut k = Vec::new();
    r.extra_keys(0, 5, &mut k);
    assert_eq!(
        k,
        vec![ExtraKey::Mm {
            identifier: "hash1",
            offset: 0
        }]
    );
    r.extra_keys(3, 8, &mut k);
    assert_eq!(
        k,
        vec![ExtraKey::Mm {
            identifier: "hash1",
            offset: -3
        }]
    );
    r.extra_keys(6, 10, &mut k);
    assert!(k.is_empty());
    r.extra_keys(0, 15, &mut k);
    assert_eq!(
        k,
        vec![
            ExtraKey::Mm {
                identifier: "hash1",
                offset: 0
            },
            ExtraKey::Mm {
                identifier: "hash2",
                offset: 10
            }
        ]
    );
}

#[test]
fn overlapping_mm_items_are_rejected() {
    let spec = RequestSpec {
        prompt_token_ids: vec![0; 16],
        mm_features: vec![
            MmFeature {
                identifier: "a".into(),
                offset: 0,
                length: 5,
            },
            MmFeature {
                identifier: "b".into(),
                offset: 4,
                length: 5,
            },
        ],
        ..RequestSpec::default()
    };
    assert!(Request::new("r".into(), 0, spec, 1, 16, false).is_err());
}
