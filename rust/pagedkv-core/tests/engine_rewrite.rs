//! An engine that rewrites a request in place (vLLM 0.33's streaming-input
//! sessions drop the last sampled token and re-hash): `sync_from_engine` cuts
//! the request back to the first difference. Expected hits are vLLM 0.33's:
//! block size 4, prompt 1..6, sampled 100 and 101, next chunk 7..11; then 12
//! tokens hit for the session's real content, 4 for the discarded token.

use pagedkv_core::{
    AllocateArgs, BlockHash, EngineRequest, Error, KvCacheManager, KvEvent, ManagerConfig,
    RequestSpec,
};

const BS: usize = 4;

fn ok<T>(r: Result<T, Error>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

fn mgr(events: bool) -> KvCacheManager {
    let mut cfg = ManagerConfig::full_attention(64, BS as u32, 8192);
    cfg.external_block_hashes = true;
    cfg.record_stats_at_admission = false;
    cfg.enable_kv_cache_events = events;
    ok(KvCacheManager::new(cfg))
}

/// An engine's copy of a request: its token list and chained block hashes.
#[derive(Clone)]
struct Lists {
    tokens: Vec<u32>,
    hashes: Vec<BlockHash>,
}

impl Lists {
    fn new(tokens: &[u32]) -> Self {
        let mut l = Self {
            tokens: tokens.to_vec(),
            hashes: Vec::new(),
        };
        l.rehash();
        l
    }

    /// Hashes every full block not hashed yet (FNV-1a over the parent and the
    /// block's tokens).
    fn rehash(&mut self) {
        while (self.hashes.len() + 1) * BS <= self.tokens.len() {
            let j = self.hashes.len();
            let mut h: u64 = self.hashes.last().map_or(0xcbf2_9ce4_8422_2325, |p| {
                u64::from_le_bytes(p.as_bytes()[..8].try_into().unwrap_or_default())
            });
            for &t in &self.tokens[j * BS..(j + 1) * BS] {
                h = (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3);
            }
            self.hashes
                .push(BlockHash::from_slice(&h.to_le_bytes()).unwrap_or_default());
        }
    }
}

impl EngineRequest for Lists {
    type Error = Error;
    fn num_tokens(&self) -> usize {
        self.tokens.len()
    }
    fn num_hashes(&self) -> usize {
        self.hashes.len()
    }
    fn token(&self, i: usize) -> Result<u32, Error> {
        Ok(self.tokens[i])
    }
    fn hash(&self, j: usize) -> Result<BlockHash, Error> {
        Ok(self.hashes[j])
    }
    fn tokens_from(&self, from: usize) -> Result<Vec<u32>, Error> {
        Ok(self.tokens.get(from..).unwrap_or_default().to_vec())
    }
    fn hashes_from(&self, from: usize) -> Result<Vec<BlockHash>, Error> {
        Ok(self.hashes.get(from..).unwrap_or_default().to_vec())
    }
}

fn add(m: &mut KvCacheManager, id: &str, l: &Lists) {
    ok(m.add_request(
        id,
        RequestSpec {
            prompt_token_ids: l.tokens.clone(),
            ..Default::default()
        },
    ));
    ok(m.sync_from_engine(id, l, None, None));
}

fn step(m: &mut KvCacheManager, id: &str, l: &Lists, new: u64, computed: u64) {
    ok(m.sync_from_engine(id, l, None, None));
    assert!(ok(m.allocate_slots(id, &AllocateArgs::step(new, computed), None)).is_some());
}

fn hit(m: &mut KvCacheManager, id: &str, tokens: &[u32]) -> u64 {
    add(m, id, &Lists::new(tokens));
    ok(m.get_computed_blocks(id)).num_computed_tokens
}

/// The session: prompt 1..6 prefilled, 100 decoded with 101 already synced
/// (async scheduling), then the next chunk replaces 101 with 7..11.
fn session(m: &mut KvCacheManager) -> Lists {
    let mut s = Lists::new(&[1, 2, 3, 4, 5, 6]);
    add(m, "s", &s);
    step(m, "s", &s, 6, 0);
    s.tokens.push(100);
    step(m, "s", &s, 1, 6);
    s.tokens.push(101);
    s.rehash();
    assert!(!ok(m.sync_from_engine("s", &s, None, None)));
    // vLLM's `_update_request_as_session`.
    s.tokens.truncate(7);
    s.hashes.truncate(7 / BS);
    s.tokens.extend([7, 8, 9, 10, 11]);
    s.rehash();
    assert!(ok(m.sync_from_engine("s", &s, None, Some(12))));
    assert!(!ok(m.sync_from_engine("s", &s, None, Some(12))));
    assert_eq!(ok(m.block_hashes("s")), s.hashes);
    assert_eq!(ok(m.num_prompt_tokens("s")), 12);
    step(m, "s", &s, 5, 7);
    s
}

#[test]
fn a_streaming_rewrite_caches_the_new_content_never_the_discarded_token() {
    for events in [false, true] {
        let mut m = mgr(events);
        session(&mut m);
        assert_eq!(
            hit(
                &mut m,
                "real",
                &[1, 2, 3, 4, 5, 6, 100, 7, 8, 9, 10, 11, 50]
            ),
            12
        );
        assert_eq!(hit(&mut m, "old", &[1, 2, 3, 4, 5, 6, 100, 101, 60, 61]), 4);
        ok(m.check_invariants());
        if events {
            for e in m.take_events() {
                if let KvEvent::BlockStored(s) = e {
                    assert!(!s.token_ids.contains(&101), "{s:?}");
                }
            }
        }
    }
}

#[test]
fn a_rewrite_below_a_cached_block_changes_nothing() {
    let mut m = mgr(true);
    let l = Lists::new(&(1..13).collect::<Vec<_>>());
    add(&mut m, "r", &l);
    step(&mut m, "r", &l, 12, 0);
    let mut other = l.clone();
    other.tokens[5] = 99;
    other.hashes.clear();
    other.rehash();
    let e = m.sync_from_engine("r", &other, None, None);
    assert!(
        matches!(e, Err(Error::InvalidArgument(ref s)) if s.contains("cached")),
        "{e:?}"
    );
    let e = m.sync_from_engine("r", &l, None, Some(13));
    assert!(matches!(e, Err(Error::InvalidArgument(_))));
    assert_eq!(ok(m.block_hashes("r")), l.hashes);
    assert_eq!(ok(m.num_tokens("r")), 12);
    ok(m.check_invariants());
}

#[test]
fn a_sync_applied_after_the_request_changed_is_turned_back() {
    let mut m = mgr(true);
    let l = Lists::new(&[1, 2, 3, 4, 5]);
    add(&mut m, "r", &l);
    let anchor = ok(m.sync_anchor("r"));
    let mut ours = l.clone();
    ours.tokens.extend([6, 7, 8]);
    ours.rehash();
    let keep = ok(anchor.sync_point(&ours, || m.request_lists("r")));
    assert_eq!(keep, (5, 1));
    // Another call appends first: the anchor no longer holds.
    let mut other = l.clone();
    other.tokens.push(9);
    ok(m.sync_from_engine("r", &other, None, None));
    let (tokens, hashes) = (ok(ours.tokens_from(5)), ok(ours.hashes_from(1)));
    let applied = m.apply_sync("r", &anchor, keep, (&tokens, &hashes), None, None);
    assert_eq!(ok(applied), None);
    assert_eq!(ok(m.num_tokens("r")), 6);
    // Taken again, the sync finds the difference and applies.
    assert!(ok(m.sync_from_engine("r", &ours, None, None)));
    assert_eq!(ok(m.block_hashes("r")), ours.hashes);
    ok(m.check_invariants());
}
