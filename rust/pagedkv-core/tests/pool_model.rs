//! State-machine property test of `BlockPool` against a naive reference model.
//!
//! The model is the shared reference pool (`common/mod.rs`) plus the events the
//! real pool publishes: vLLM 0.33's `BlockPool` / `FreeKVCacheBlockQueue`
//! semantics, written as plainly as possible.
//!
//! A pool with another eviction policy (SLRU, ARC) is held to the same model
//! in everything but the order free blocks are handed out: the model takes
//! the blocks the pool handed out (which must be free there, and the ones
//! the pool's `free_queue` said come next), and the free queues are compared
//! as sets; keys, reference counts, lookups, events and invariants (the
//! segments' included) must match exactly.
//!
//! Random op sequences are interpreted against the model state (indices are taken
//! modulo what exists), so every generated sequence is valid and shrinks well.
// Short names (`m`, `n`, `k`, `b`) follow the model's notation.
#![allow(clippy::many_single_char_names)]

mod support;

use support::ref_pool::RefPool;

use pagedkv_core::{BlockHash, BlockPool, CacheKey, Eviction, KvEvent};
use proptest::prelude::*;
use proptest::sample::Index;

const NUM_HASHES: u8 = 5;
const NUM_GROUPS: u32 = 2;

fn key(h: u8, group: u32) -> CacheKey {
    CacheKey {
        hash: BlockHash::from_slice(&[h + 1, 0x5a, h ^ 0x33]).expect("valid digest"),
        group,
    }
}

fn all_keys() -> Vec<CacheKey> {
    (0..NUM_HASHES)
        .flat_map(|h| (0..NUM_GROUPS).map(move |g| key(h, g)))
        .collect()
}

#[derive(Clone, Debug)]
enum Op {
    /// `get_new_blocks(n)`, `n` possibly larger than the free count.
    GetNew(u32),
    /// `touch` of arbitrary ids (null block included).
    Touch(Vec<Index>),
    /// `free_blocks` of a random ordered selection of currently held references.
    Free { picks: Vec<Index>, with_null: bool },
    /// `cache_block(id, key)` on any block (null and already-keyed included).
    Cache(Index, u8, u32),
    /// `maybe_evict(id)` on any block.
    Evict(Index),
    /// `reset_prefix_cache()`.
    Reset,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u32..8).prop_map(Op::GetNew),
        2 => prop::collection::vec(any::<Index>(), 0..5).prop_map(Op::Touch),
        4 => (prop::collection::vec(any::<Index>(), 0..8), prop::bool::weighted(0.2))
            .prop_map(|(picks, with_null)| Op::Free { picks, with_null }),
        4 => (any::<Index>(), 0..NUM_HASHES, 0..NUM_GROUPS)
            .prop_map(|(i, h, g)| Op::Cache(i, h, g)),
        2 => any::<Index>().prop_map(Op::Evict),
        1 => Just(Op::Reset),
    ]
}

/// The reference pool with the events the real pool publishes for it.
#[derive(Debug)]
struct Model {
    pool: RefPool<CacheKey>,
    /// LRU: the free queue is compared in order.
    ordered: bool,
    events_on: bool,
    events: Vec<KvEvent>,
}

impl Model {
    fn new(num_blocks: u32, caching: bool, events_on: bool) -> Self {
        Self {
            pool: RefPool::new(num_blocks, caching),
            ordered: true,
            events_on,
            events: Vec::new(),
        }
    }

    /// Turns the pool's evictions into `BlockRemoved` events.
    fn publish_evictions(&mut self) {
        for k in self.pool.evicted.drain(..) {
            if self.events_on {
                self.events.push(KvEvent::BlockRemoved {
                    block_hashes: vec![k.hash],
                    group_idx: k.group,
                });
            }
        }
    }

    fn evict(&mut self, id: u32) -> bool {
        let evicted = self.pool.evict(id);
        self.publish_evictions();
        evicted
    }

    fn get_new(&mut self, n: u32) -> Option<Vec<u32>> {
        let got = self.pool.get_new(n as usize);
        self.publish_evictions();
        got
    }

    /// The blocks a pool with another eviction order handed out.
    fn take(&mut self, ids: &[u32]) {
        self.pool.take(ids);
        self.publish_evictions();
    }

    fn reset(&mut self) -> bool {
        if !self.pool.reset() {
            return false;
        }
        if self.events_on {
            self.events.push(KvEvent::AllBlocksCleared);
        }
        true
    }
}

fn assert_same(pool: &mut BlockPool, m: &mut Model, ctx: &str) -> Result<(), TestCaseError> {
    support::ref_pool::check_same_free_blocks_and_refs(pool, &m.pool, m.ordered, ctx)?;
    for b in 1..m.pool.n as u32 {
        prop_assert_eq!(
            pool.block_key(b),
            m.pool.key[b as usize],
            "{}: key of {}",
            ctx,
            b
        );
        prop_assert_eq!(
            pool.is_evictable(b),
            m.pool.refs[b as usize] == 0,
            "{}: evictable {}",
            ctx,
            b
        );
    }
    prop_assert_eq!(pool.block_key(0), None, "{}: null block is cached", ctx);
    prop_assert!(!pool.is_evictable(0), "{}: null block evictable", ctx);
    for k in all_keys() {
        let want = m.pool.map.get(&k).cloned().unwrap_or_default();
        prop_assert_eq!(
            pool.cached_blocks(&k),
            want.clone(),
            "{}: cached_blocks({:?})",
            ctx,
            k
        );
        prop_assert_eq!(
            pool.cached_block(&k),
            want.first().copied(),
            "{}: cached_block",
            ctx
        );
    }
    prop_assert_eq!(
        pool.num_cached_keys(),
        m.pool.map.len(),
        "{}: num_cached_keys",
        ctx
    );
    let mut expected_refs = m.pool.refs.clone();
    expected_refs[0] = pool.ref_cnt(0);
    if let Err(e) = pool.check_invariants(Some(&expected_refs)) {
        return Err(TestCaseError::fail(format!("{ctx}: check_invariants: {e}")));
    }
    prop_assert_eq!(
        pool.take_events(),
        std::mem::take(&mut m.events),
        "{}: events",
        ctx
    );
    Ok(())
}

/// `get_new_blocks(k)` on both; under SLRU / ARC the model takes the blocks
/// the pool handed out, which must be those its `free_queue` listed first.
fn get_new(pool: &mut BlockPool, m: &mut Model, k: u32, ctx: &str) -> Result<(), TestCaseError> {
    let sentinel = vec![u32::MAX - 1];
    let mut out = sentinel.clone();
    let next = pool.free_queue();
    let ok = pool.get_new_blocks(k, &mut out);
    if ok && !m.ordered {
        prop_assert_eq!(
            &out[1..],
            &next[..k as usize],
            "{}: handed out other blocks than free_queue said",
            ctx
        );
        m.take(&out[1..]);
    }
    let want = if m.ordered || !ok {
        m.get_new(k)
    } else {
        Some(out[1..].to_vec())
    };
    match want {
        None => {
            prop_assert!(!ok, "{}: succeeded past the free count", ctx);
            prop_assert_eq!(out, sentinel, "{}: failed call appended", ctx);
        }
        Some(want) => {
            prop_assert!(ok, "{}: failed with enough free blocks", ctx);
            prop_assert_eq!(&out[..1], &sentinel[..], "{}: clobbered out", ctx);
            prop_assert_eq!(&out[1..], &want[..], "{}: allocated ids", ctx);
        }
    }
    Ok(())
}

fn run_ops(
    num_blocks: u32,
    caching: bool,
    events_on: bool,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    run_ops_evicting(num_blocks, caching, events_on, Eviction::Lru, ops)
}

fn run_ops_evicting(
    num_blocks: u32,
    caching: bool,
    events_on: bool,
    policy: Eviction,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let mut pool = BlockPool::new(num_blocks, caching, events_on).with_eviction(policy);
    let mut m = Model::new(num_blocks, caching, events_on);
    m.ordered = pool.eviction() == Eviction::Lru;
    prop_assert_eq!(pool.enable_caching(), caching);
    prop_assert_eq!(pool.events_enabled(), events_on);
    assert_same(&mut pool, &mut m, "fresh pool")?;
    let n = m.pool.n;
    for (step, op) in ops.iter().enumerate() {
        let epoch_before = pool.epoch();
        let keys_before = m.pool.key.iter().filter(|k| k.is_some()).count();
        let ctx = format!("step {step} {op:?}");
        match op {
            Op::GetNew(k) => get_new(&mut pool, &mut m, *k, &ctx)?,
            Op::Touch(idx) => {
                let ids: Vec<u32> = idx.iter().map(|i| i.index(n) as u32).collect();
                pool.touch(&ids);
                m.pool.touch(&ids);
            }
            Op::Free { picks, with_null } => {
                let mut held = m.pool.held_refs();
                let mut ordered = Vec::new();
                for p in picks {
                    if held.is_empty() {
                        break;
                    }
                    ordered.push(held.swap_remove(p.index(held.len())));
                }
                if *with_null {
                    let at = picks.first().map_or(0, |p| p.index(ordered.len() + 1));
                    ordered.insert(at, 0);
                }
                pool.free_blocks(ordered.iter().copied());
                m.pool.free(&ordered);
            }
            Op::Cache(i, h, g) => {
                let id = i.index(n) as u32;
                let k = key(*h, *g);
                let got = pool.cache_block(id, k);
                prop_assert_eq!(got, m.pool.cache(id, k), "{}: cache_block result", ctx);
            }
            Op::Evict(i) => {
                let id = i.index(n) as u32;
                prop_assert_eq!(
                    pool.maybe_evict(id),
                    m.evict(id),
                    "{}: maybe_evict result",
                    ctx
                );
            }
            Op::Reset => {
                prop_assert_eq!(
                    pool.reset_prefix_cache(),
                    m.reset(),
                    "{}: reset result",
                    ctx
                );
            }
        }
        let keys_after = m.pool.key.iter().filter(|k| k.is_some()).count();
        prop_assert!(pool.epoch() >= epoch_before, "{}: epoch went back", ctx);
        // Only cache_block adds keys and no op both adds and drops them, so fewer
        // keyed blocks means one lost its key: earlier lookups must be re-validated.
        if keys_after < keys_before {
            prop_assert!(
                pool.epoch() > epoch_before,
                "{}: a key was lost but the epoch stayed",
                ctx
            );
        }
        assert_same(&mut pool, &mut m, &ctx)?;
    }
    // Releasing every held reference returns the pool to all-free.
    let held = m.pool.held_refs();
    pool.free_blocks(held.iter().rev().copied());
    m.pool.free(&held.iter().rev().copied().collect::<Vec<_>>());
    assert_same(&mut pool, &mut m, "final release")?;
    prop_assert_eq!(pool.num_free_blocks() as usize, n - 1);
    prop_assert!(pool.reset_prefix_cache());
    prop_assert_eq!(pool.num_cached_keys(), 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn block_pool_matches_naive_queue_refcount_and_map_model(
        num_blocks in 1u32..20,
        caching in any::<bool>(),
        events_on in any::<bool>(),
        ops in prop::collection::vec(op_strategy(), 0..60),
    ) {
        run_ops(num_blocks, caching, events_on, &ops)?;
    }

    /// Small pools with caching on, where duplicates, eviction on reuse and LRU
    /// ordering interact the most.
    #[test]
    fn block_pool_with_caching_on_small_pools_matches_model(
        num_blocks in 2u32..6,
        ops in prop::collection::vec(op_strategy(), 0..60),
    ) {
        run_ops(num_blocks, true, true, &ops)?;
    }

    /// SLRU and ARC: the model's pool in everything but the hand-out order,
    /// their segments' invariants after every op.
    #[test]
    fn block_pool_under_slru_and_arc_matches_model_but_for_eviction_order(
        num_blocks in 1u32..20,
        caching in prop::bool::weighted(0.85),
        events_on in any::<bool>(),
        arc in any::<bool>(),
        ops in prop::collection::vec(op_strategy(), 0..80),
    ) {
        let policy = if arc { Eviction::Arc } else { Eviction::Slru };
        run_ops_evicting(num_blocks, caching, events_on, policy, &ops)?;
    }

    /// The same on small pools, where segments, demotions and ghost hits
    /// interact the most.
    #[test]
    fn small_pools_under_slru_and_arc_match_model_but_for_eviction_order(
        num_blocks in 2u32..7,
        arc in any::<bool>(),
        ops in prop::collection::vec(op_strategy(), 0..80),
    ) {
        let policy = if arc { Eviction::Arc } else { Eviction::Slru };
        run_ops_evicting(num_blocks, true, true, policy, &ops)?;
    }
}

#[test]
fn zero_block_pool_behaves_like_a_pool_of_only_the_null_block() {
    let mut pool = BlockPool::new(0, true, false);
    assert_eq!(pool.num_blocks(), 1);
    assert_eq!(pool.num_free_blocks(), 0);
    assert!(pool.free_queue().is_empty());
    let mut out = Vec::new();
    assert!(pool.get_new_blocks(0, &mut out));
    assert!(!pool.get_new_blocks(1, &mut out));
    assert!(out.is_empty());
    assert!(pool.usage().abs() < f64::EPSILON);
    assert!(pool.reset_prefix_cache());
    assert!(pool.check_invariants(None).is_ok());
}

#[test]
fn freeing_a_block_twice_in_one_call_releases_it_once_at_its_last_position() {
    // ref 2 on block 1: the first occurrence only decrements, the second queues it.
    let mut pool = BlockPool::new(5, true, false);
    let mut out = Vec::new();
    assert!(pool.get_new_blocks(3, &mut out));
    pool.touch(&[1]);
    pool.free_blocks([1, 3, 1, 2]);
    // Unhashed blocks reaching 0 in order 3, 1, 2 are prepended as one run.
    assert_eq!(pool.free_queue(), vec![3, 1, 2, 4]);
    assert!(pool.check_invariants(None).is_ok());
}

#[test]
fn mixed_free_prepends_unhashed_run_and_appends_hashed_run_in_given_order() {
    let mut pool = BlockPool::new(8, true, false);
    let mut out = Vec::new();
    assert!(pool.get_new_blocks(6, &mut out));
    assert!(pool.cache_block(2, key(0, 0)));
    assert!(pool.cache_block(4, key(1, 0)));
    // Tail-first free of [1..=6]: unhashed 6,5,3,1 to the front, hashed 4,2 to the back.
    pool.free_blocks([6, 5, 4, 3, 2, 1]);
    assert_eq!(pool.free_queue(), vec![6, 5, 3, 1, 7, 4, 2]);
    assert!(pool.check_invariants(None).is_ok());
}

#[test]
fn caching_off_prepends_even_hashed_blocks_and_never_evicts_on_reuse() {
    let mut pool = BlockPool::new(5, false, false);
    let mut out = Vec::new();
    assert!(pool.get_new_blocks(2, &mut out));
    assert!(pool.cache_block(1, key(0, 0)));
    pool.free_blocks([2, 1]);
    assert_eq!(pool.free_queue(), vec![2, 1, 3, 4]);
    out.clear();
    assert!(pool.get_new_blocks(2, &mut out));
    assert_eq!(out, vec![2, 1]);
    // get_new_blocks evicts only with caching on.
    assert_eq!(pool.cached_block(&key(0, 0)), Some(1));
    assert!(pool.check_invariants(None).is_ok());
}

#[test]
fn duplicate_key_lookup_returns_first_inserted_until_it_is_evicted() {
    let mut pool = BlockPool::new(6, true, false);
    let mut out = Vec::new();
    assert!(pool.get_new_blocks(5, &mut out));
    let k = key(3, 1);
    assert!(pool.cache_block(4, k));
    assert!(pool.cache_block(2, k));
    assert!(pool.cache_block(5, k));
    assert_eq!(pool.cached_block(&k), Some(4));
    assert!(pool.maybe_evict(4));
    assert_eq!(pool.cached_block(&k), Some(2));
    assert_eq!(pool.cached_blocks(&k), vec![2, 5]);
    // Same hash, other group: a different key.
    assert_eq!(pool.cached_block(&key(3, 0)), None);
    assert!(pool.check_invariants(None).is_ok());
}
