//! The naive reference pool shared by the model tests (`pool_model`,
//! `manager_model`): a `VecDeque` free queue, a `Vec` of reference counts, a
//! per-block optional key and a key -> blocks map kept in insertion order. It
//! encodes vLLM 0.33's `BlockPool` / `FreeKVCacheBlockQueue` semantics:
//! allocation pops from the head and (with caching) lazily evicts, `touch`
//! pulls ref-0 blocks out of the queue, `free` releases in the given order with
//! unhashed blocks prepended as one run and hashed ones appended (caching off:
//! everything prepended), one key may map to several blocks (first inserted
//! wins). Everything is O(n): obviously right, never fast.
//!
//! The key type is the caller's: the pool test keys blocks by `CacheKey`, the
//! manager test by (group, token prefix). Evicted keys are queued in
//! `evicted` for the caller to turn into its own events.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

use pagedkv_core::BlockPool;
use proptest::prelude::*;

/// The reference pool; block 0 is the null block.
#[derive(Debug)]
pub struct RefPool<K> {
    /// Blocks, the null block included.
    pub n: usize,
    /// Prefix caching on (lazy eviction, hashed blocks freed to the back).
    pub caching: bool,
    /// The free queue, head first.
    pub queue: VecDeque<u32>,
    /// Reference count per block.
    pub refs: Vec<u32>,
    /// Cache key per block.
    pub key: Vec<Option<K>>,
    /// Key -> blocks, in insertion order.
    pub map: HashMap<K, Vec<u32>>,
    /// Keys of evicted blocks, in eviction order, until the caller drains them.
    pub evicted: Vec<K>,
}

impl<K: Clone + Eq + Hash> RefPool<K> {
    /// A fresh pool of `num_blocks` blocks (at least the null block).
    pub fn new(num_blocks: u32, caching: bool) -> Self {
        let n = num_blocks.max(1) as usize;
        Self {
            n,
            caching,
            queue: (1..n as u32).collect(),
            refs: vec![0; n],
            key: vec![None; n],
            map: HashMap::new(),
            evicted: Vec::new(),
        }
    }

    /// Drops the block's key from the cache; whether it had one.
    pub fn evict(&mut self, id: u32) -> bool {
        let Some(k) = self.key[id as usize].take() else {
            return false;
        };
        let list = self.map.get_mut(&k).expect("keyed block is listed");
        list.retain(|&b| b != id);
        if list.is_empty() {
            self.map.remove(&k);
        }
        self.evicted.push(k);
        true
    }

    /// Pops `n` blocks from the head (evicting them lazily), or `None` when
    /// fewer are free.
    pub fn get_new(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.queue.len() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.queue.pop_front().expect("checked length");
            if self.caching {
                self.evict(id);
            }
            assert_eq!(
                self.refs[id as usize], 0,
                "model: popped a referenced block"
            );
            self.refs[id as usize] = 1;
            out.push(id);
        }
        Some(out)
    }

    /// Takes the given free blocks (the ones a pool with another eviction
    /// order handed out), evicting them lazily as [`Self::get_new`] does.
    pub fn take(&mut self, ids: &[u32]) {
        for &id in ids {
            let pos = self
                .queue
                .iter()
                .position(|&b| b == id)
                .expect("model: handed out a block that is not free");
            self.queue.remove(pos);
            if self.caching {
                self.evict(id);
            }
            self.refs[id as usize] = 1;
        }
    }

    /// Takes one more reference on each block, pulling ref-0 blocks out of the
    /// queue; the null block is skipped.
    pub fn touch(&mut self, ids: &[u32]) {
        for &id in ids {
            if id == 0 {
                continue;
            }
            if self.refs[id as usize] == 0 {
                let pos = self
                    .queue
                    .iter()
                    .position(|&b| b == id)
                    .expect("ref-0 block is queued");
                self.queue.remove(pos);
            }
            self.refs[id as usize] += 1;
        }
    }

    /// vLLM's `free_blocks`: drops one reference each, in the given order;
    /// blocks reaching 0 go to the front (unhashed, or caching off) as one run,
    /// or to the back (hashed).
    pub fn free(&mut self, ordered: &[u32]) {
        let mut first = Vec::new();
        let mut last = Vec::new();
        for &id in ordered {
            if id == 0 {
                continue;
            }
            self.refs[id as usize] -= 1;
            if self.refs[id as usize] == 0 {
                if self.key[id as usize].is_none() || !self.caching {
                    first.push(id);
                } else {
                    last.push(id);
                }
            }
        }
        for &id in first.iter().rev() {
            self.queue.push_front(id);
        }
        self.queue.extend(last);
    }

    /// Caches an uncached real block under `k`; whether it was cached now.
    pub fn cache(&mut self, id: u32, k: K) -> bool {
        if id == 0 || self.key[id as usize].is_some() {
            return false;
        }
        self.key[id as usize] = Some(k.clone());
        self.map.entry(k).or_default().push(id);
        true
    }

    /// Clears the cache when no block is held; whether it did.
    pub fn reset(&mut self) -> bool {
        if self.queue.len() != self.n - 1 {
            return false;
        }
        self.map.clear();
        self.key.iter_mut().for_each(|k| *k = None);
        true
    }

    /// Every held reference, one entry per reference (block `b` appears
    /// `refs[b]` times).
    pub fn held_refs(&self) -> Vec<u32> {
        (1..self.n as u32)
            .flat_map(|b| std::iter::repeat_n(b, self.refs[b as usize] as usize))
            .collect()
    }
}

/// The real pool's free queue, free count, usage and reference counts equal the
/// reference pool's.
pub fn check_same_queue_and_refs<K>(
    pool: &BlockPool,
    m: &RefPool<K>,
    ctx: &str,
) -> Result<(), TestCaseError> {
    check_same_free_blocks_and_refs(pool, m, true, ctx)
}

/// [`check_same_queue_and_refs`], the free queue compared in order or (a pool
/// with another eviction order) as a set.
pub fn check_same_free_blocks_and_refs<K>(
    pool: &BlockPool,
    m: &RefPool<K>,
    ordered: bool,
    ctx: &str,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(pool.num_blocks() as usize, m.n, "{}: num_blocks", ctx);
    let mut got = pool.free_queue();
    let mut want = m.queue.iter().copied().collect::<Vec<_>>();
    if !ordered {
        got.sort_unstable();
        want.sort_unstable();
    }
    prop_assert_eq!(got, want, "{}: free queue", ctx);
    prop_assert_eq!(
        pool.num_free_blocks() as usize,
        m.queue.len(),
        "{}: num_free",
        ctx
    );
    let usage = if m.n > 1 {
        1.0 - m.queue.len() as f64 / (m.n - 1) as f64
    } else {
        0.0
    };
    prop_assert!((pool.usage() - usage).abs() < 1e-12, "{}: usage", ctx);
    for b in 1..m.n as u32 {
        prop_assert_eq!(
            pool.ref_cnt(b),
            m.refs[b as usize],
            "{}: ref_cnt of block {}",
            ctx,
            b
        );
    }
    Ok(())
}
