//! The prefix map: cache key -> blocks, laid out for a pool of 10^7 blocks.
//!
//! Every `(key, block)` pair is an entry in one arena (a cache line each: the
//! full key, the block, the tokens the key covers, its stamp, the next entry
//! under the same key). The table holds only 4-byte entry numbers and 2-byte
//! tags, eight pairs per 64-byte bucket (about 13 bytes of table per key it is
//! sized for), so a probe reads one cache line and a hit one more (the entry,
//! which also names the block). The eight tags are matched at once, as eight
//! 16-bit lanes ([`pagedkv_arch::lanes_equal`]); a 15-bit tag sends a probe to
//! a wrong entry once in ~5,000 probes of a table at its fullest (a 7-bit one
//! did so once in ~30, a DRAM miss each at 10^7 blocks). A key usually maps to
//! one block; equal content computed twice maps to several, chained in
//! insertion order from the entry the table points to.
//!
//! Collisions: linear probing over buckets. Each bucket counts the keys whose
//! home it is but that live further on (`overflow`), so a lookup stops at the
//! first bucket that does not hold the key and has no overflow, and a removal
//! needs no tombstone (F14's scheme).
//!
//! Staged lookups: [`PrefixMap::warm_bucket`] and [`PrefixMap::warm_candidate`]
//! read the line a later probe needs without depending on it, so the lookups,
//! evictions and insertions of one call have their cache misses in flight
//! together instead of one after another.

use std::hint::black_box;

mod ghost_lanes;
pub(crate) use ghost_lanes::GhostRecord;
use ghost_lanes::is_ghost;

use pagedkv_arch::{lanes_equal, prefetch};

use super::{BlockId, CacheKey};
use crate::hash::BlockHash;

const NIL: u32 = u32::MAX;
/// Most keys [`PrefixMap::first_blocks_run_staged`] takes at once.
pub(crate) const STAGED_RUN: usize = 32;
const LANES: usize = 8;

/// One entry: a key and one block it maps to. 64 bytes, one cache line.
#[derive(Clone, Copy, Debug)]
#[repr(align(64))]
pub(crate) struct KeyEntry {
    pub(crate) key: CacheKey,
    /// The block, `NIL` while the entry is free.
    pub(crate) block: BlockId,
    /// Tokens covered by the key (full block, or a partial prefix).
    pub(crate) tokens: u32,
    /// Next entry under the same key (`NIL` at the end); the next free entry
    /// while free.
    next: u32,
    /// When the key was given (a fresh number per caching).
    pub(crate) stamp: u64,
}

/// Words per bucket (64 bytes): the eight lanes' 16-bit tags (words 0 to 3),
/// their entry numbers (words 4 to 11), the overflow count (word 12) and three
/// unused words.
const WORDS: usize = 16;
const ENTRIES: usize = 4;
const OVERFLOW: usize = 12;
/// Words allocated past the buckets, so that they can start on a 64-byte
/// boundary.
const ALIGN_SLACK: usize = 16;

/// The table slot of a key found in the map.
#[derive(Clone, Copy)]
struct Slot {
    bucket: usize,
    lane: usize,
}

/// Cache key -> entries (see the module docs).
#[derive(Debug)]
pub(crate) struct PrefixMap {
    /// The buckets, `WORDS` words each, from `base` (the first 64-byte
    /// boundary of the allocation). Allocated zeroed: the pages of a large
    /// table are only backed once used.
    table: Vec<u32>,
    base: usize,
    num_buckets: usize,
    /// Keys in the table (not entries: a key with several blocks counts once).
    len: usize,
    entries: Vec<KeyEntry>,
    free_entry: u32,
    /// Ghost lanes per list (ARC's B1 / B2: `ghost_lanes`).
    ghosts: [u32; 2],
}

/// Buckets are filled to at most 4/5 of their lanes before the table doubles.
fn max_keys(num_buckets: usize) -> usize {
    num_buckets * LANES * 4 / 5
}

/// A table for `keys` keys fills 3/5 of its lanes (any number of buckets, at
/// least two): the same load whatever the pool's size, where a power of two
/// would leave it anywhere from 2/5 to 4/5, and probes past the home bucket
/// grow quickly towards 4/5.
fn buckets_for(keys: usize) -> usize {
    (keys.saturating_mul(5) / (LANES * 3) + 1).max(2)
}

/// The bucket after `b` in a table of `n`.
fn next_bucket(b: usize, n: usize) -> usize {
    if b + 1 == n { 0 } else { b + 1 }
}

/// The key's 64-bit hash: digests are uniform, but test keys and short
/// non-cryptographic digests need mixing (and the group must move the bucket).
fn mix(key: &CacheKey) -> u64 {
    mix_parts(&key.hash, key.group)
}

fn mix_parts(hash: &BlockHash, group: u32) -> u64 {
    let x = hash.fingerprint() ^ u64::from(group).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let h = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h ^ (h >> 29)
}

/// The key's tag: 15 bits of its hash (not those that choose the bucket),
/// and a set high bit, so that no tag is 0 (an empty lane).
fn tag(h: u64) -> u16 {
    (h as u16) | 0x8000
}

/// A bit per lane that holds tag `t` (an empty lane: `t == 0`), nothing else:
/// lane `i` is bit `2 * i` (see [`first_lane`]), the eight tags compared at
/// once ([`pagedkv_arch::lanes_equal`]).
fn matching_lanes(bucket: &[u32], t: u16) -> u32 {
    let lo = u64::from(bucket[0]) | (u64::from(bucket[1]) << 32);
    let hi = u64::from(bucket[2]) | (u64::from(bucket[3]) << 32);
    lanes_equal([lo, hi], t)
}

/// The next lane in a `matching_lanes` mask.
fn first_lane(hits: u32) -> usize {
    (hits.trailing_zeros() / 2) as usize
}

fn overflow(bucket: &[u32]) -> u32 {
    bucket[OVERFLOW]
}

fn tag_at(bucket: &[u32], lane: usize) -> u16 {
    (bucket[lane / 2] >> (lane % 2 * 16)) as u16
}

fn set_tag(bucket: &mut [u32], lane: usize, t: u16) {
    let shift = lane % 2 * 16;
    let w = &mut bucket[lane / 2];
    *w = (*w & !(0xffff << shift)) | (u32::from(t) << shift);
}

/// Whether a table of `n` buckets can be allocated (a failed `vec!` aborts
/// the process; `try_reserve` reports instead).
fn table_fits(n: usize) -> bool {
    let mut probe: Vec<u32> = Vec::new();
    let fits = n
        .checked_mul(WORDS)
        .and_then(|w| w.checked_add(ALIGN_SLACK))
        .is_some_and(|words| probe.try_reserve_exact(words).is_ok());
    // The allocation must happen: an unused one may be assumed to succeed.
    black_box(probe.as_ptr());
    fits
}

/// A zeroed table of `n` buckets and the word where the first one starts.
fn zeroed_table(n: usize) -> (Vec<u32>, usize) {
    let table = vec![0u32; n * WORDS + ALIGN_SLACK];
    let misaligned = (table.as_ptr() as usize) % 64;
    let base = ((64 - misaligned) % 64) / 4;
    (table, base)
}

impl PrefixMap {
    /// An empty map sized for `keys` keys without growing; the arena reserves
    /// `entries` entries up front.
    ///
    /// # Panics
    /// When the table cannot be allocated ([`Self::try_with_capacity`] says so
    /// instead).
    #[cfg(test)]
    pub(crate) fn with_capacity(keys: usize, entries: usize) -> Self {
        Self::try_with_capacity(keys, entries).unwrap_or_else(|| panic!("table too large"))
    }

    /// [`Self::with_capacity`], or `None` when the table cannot be allocated.
    pub(crate) fn try_with_capacity(keys: usize, entries: usize) -> Option<Self> {
        let n = buckets_for(keys);
        if !table_fits(n) {
            return None;
        }
        let (table, base) = zeroed_table(n);
        let mut arena = Vec::new();
        let _ = arena.try_reserve_exact(entries);
        Some(Self {
            table,
            base,
            num_buckets: n,
            len: 0,
            entries: arena,
            free_entry: NIL,
            ghosts: [0, 0],
        })
    }

    /// Whether the table and its entries outgrow the caches a lookup can count
    /// on (2 MiB): staged lookups pay off only then.
    pub(crate) fn is_large(&self) -> bool {
        self.num_buckets * WORDS * 4 + self.entries.len() * 64 > (2 << 20)
    }

    /// Keys in the map.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn entry(&self, e: u32) -> &KeyEntry {
        &self.entries[e as usize]
    }

    /// A key's home bucket: its hash's high bits scaled to the table (the tag
    /// takes the low ones).
    fn home(&self, h: u64) -> usize {
        ((u128::from(h) * self.num_buckets as u128) >> 64) as usize
    }

    fn bucket(&self, b: usize) -> &[u32] {
        let at = self.base + b * WORDS;
        &self.table[at..at + WORDS]
    }

    fn bucket_mut(&mut self, b: usize) -> &mut [u32] {
        let at = self.base + b * WORDS;
        &mut self.table[at..at + WORDS]
    }

    fn find(&self, key: &CacheKey) -> Option<(Slot, u32)> {
        self.find_hashed(key, mix(key))
    }

    /// The slot holding `key` and its head entry.
    #[inline]
    fn find_hashed(&self, key: &CacheKey, h: u64) -> Option<(Slot, u32)> {
        self.probe(h, |k| k == key)
    }

    /// The slot and head entry of the key hashing to `h` that `is_key` accepts.
    /// Inlined everywhere: as a call, lookups and admissions take 1–5 % more
    /// instructions.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn probe(&self, h: u64, is_key: impl Fn(&CacheKey) -> bool) -> Option<(Slot, u32)> {
        let t = tag(h);
        let buckets = self.num_buckets;
        let mut b = self.home(h);
        let table = &self.table[self.base..];
        for _ in 0..buckets {
            let bucket = table.get(b * WORDS..(b + 1) * WORDS)?;
            let mut hits = matching_lanes(bucket, t);
            while hits != 0 {
                let lane = first_lane(hits);
                let e = bucket[ENTRIES + lane];
                if self.entries.get(e as usize).is_some_and(|x| is_key(&x.key)) {
                    return Some((Slot { bucket: b, lane }, e));
                }
                hits &= hits - 1;
            }
            if overflow(bucket) == 0 {
                return None;
            }
            b = next_bucket(b, buckets);
        }
        None
    }

    /// The first block under `(hash, group)`: [`Self::head`] without building
    /// the key, its parts compared one by one (a lookup loop's probe).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn first_block(&self, hash: &BlockHash, group: u32) -> Option<BlockId> {
        let h = mix_parts(hash, group);
        self.probe(h, |k| k.hash == *hash && k.group == group)
            .map(|(_, e)| self.entries[e as usize].block)
    }

    /// Appends the first block under each of `hashes` in `group` to `out`,
    /// stopping at the first key the map lacks; returns how many it appended.
    ///
    /// `out` grows once, at the first hit, for every key left: a miss at the
    /// first key allocates nothing.
    pub(crate) fn first_blocks_run<'a>(
        &self,
        hashes: impl ExactSizeIterator<Item = &'a BlockHash>,
        group: u32,
        out: &mut Vec<BlockId>,
    ) -> usize {
        self.probe_run(
            hashes.map(|hash| (mix_parts(hash, group), hash)),
            group,
            out,
        )
    }

    /// The run of [`Self::first_blocks_run`] over keys whose hashes are mixed
    /// (`(mix, hash)` pairs): probes until the first miss, growing `out` once,
    /// at the first hit, for every key left.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    fn probe_run<'a>(
        &self,
        mut keys: impl ExactSizeIterator<Item = (u64, &'a BlockHash)>,
        group: u32,
        out: &mut Vec<BlockId>,
    ) -> usize {
        let mut n = 0;
        while let Some((h, hash)) = keys.next() {
            let Some((_, e)) = self.probe(h, |k| k.hash == *hash && k.group == group) else {
                break;
            };
            if n == 0 {
                out.reserve(keys.len() + 1);
            }
            out.push(self.entries[e as usize].block);
            n += 1;
        }
        n
    }

    /// [`Self::first_blocks_run`] over at most `STAGED_RUN` keys of a map
    /// larger than the caches, staged: each key's hash is mixed once, its
    /// bucket prefetched; then each bucket is read and the entry its tag
    /// names prefetched; then the run is probed. The misses of the window are
    /// in flight together, and a hot window pays for the staging with two
    /// tag matches per key, not three hash mixes.
    pub(crate) fn first_blocks_run_staged<'a>(
        &self,
        hashes: impl ExactSizeIterator<Item = &'a BlockHash> + Clone,
        group: u32,
        out: &mut Vec<BlockId>,
    ) -> usize {
        debug_assert!(hashes.len() <= STAGED_RUN, "a window longer than the stage");
        let mut mixed = [0u64; STAGED_RUN];
        let n = hashes.len().min(STAGED_RUN);
        for (m, hash) in mixed.iter_mut().zip(hashes.clone()) {
            *m = mix_parts(hash, group);
            self.prefetch_home(*m);
        }
        for &h in &mixed[..n] {
            self.prefetch_candidate(h);
        }
        self.probe_run(mixed[..n].iter().copied().zip(hashes), group, out)
    }

    /// Prefetches the bucket a lookup of `key` starts at (a staged lookup's
    /// first stage).
    pub(crate) fn warm_bucket(&self, key: &CacheKey) {
        self.prefetch_home(mix(key));
    }

    /// Prefetches the entry a lookup of `key` would compare first (its bucket
    /// should be in flight already: the second stage).
    pub(crate) fn warm_candidate(&self, key: &CacheKey) {
        self.prefetch_candidate(mix(key));
    }

    /// Prefetches the home bucket of the key hashing to `h`.
    #[inline]
    fn prefetch_home(&self, h: u64) {
        if let Some(word) = self.table.get(self.base + self.home(h) * WORDS) {
            prefetch(word);
        }
    }

    /// Reads the home bucket of the key hashing to `h` and prefetches the
    /// entry of the first lane whose tag matches.
    #[inline]
    fn prefetch_candidate(&self, h: u64) {
        let bucket = self.bucket(self.home(h));
        let hits = matching_lanes(bucket, tag(h));
        if hits != 0
            && let Some(entry) = self
                .entries
                .get(bucket[ENTRIES + first_lane(hits)] as usize)
        {
            prefetch(entry);
        }
    }

    /// The first entry under `key`.
    pub(crate) fn head(&self, key: &CacheKey) -> Option<u32> {
        self.find(key).map(|(_, e)| e)
    }

    /// The entries under `key`, in insertion order.
    pub(crate) fn chain(&self, key: &CacheKey) -> impl Iterator<Item = u32> + '_ {
        let mut e = self.head(key).unwrap_or(NIL);
        std::iter::from_fn(move || {
            (e != NIL).then(|| {
                let cur = e;
                e = self.entries[cur as usize].next;
                cur
            })
        })
    }

    fn alloc_entry(&mut self, entry: KeyEntry) -> u32 {
        // Entry numbers stay below a ghost word's bit (2^31 entries: 128 GiB).
        debug_assert!(
            self.entries.len() < 1 << 31,
            "entry numbers reach the ghost bit"
        );
        if self.free_entry == NIL {
            self.entries.push(entry);
            (self.entries.len() - 1) as u32
        } else {
            let e = self.free_entry;
            self.free_entry = self.entries[e as usize].next;
            self.entries[e as usize] = entry;
            e
        }
    }

    fn release_entry(&mut self, e: u32) {
        let x = &mut self.entries[e as usize];
        x.block = NIL;
        x.next = self.free_entry;
        self.free_entry = e;
    }

    /// Adds `(key, block)` after the entries already under `key`; returns the
    /// new entry.
    pub(crate) fn insert(&mut self, key: CacheKey, block: BlockId, tokens: u32, stamp: u64) -> u32 {
        self.insert_taking_ghost(key, block, tokens, stamp).0
    }

    /// [`Self::insert`]; a key new to the map that is a ghost takes the
    /// ghost's lane, and the list the ghost was in comes back (`true`: B2).
    pub(crate) fn insert_taking_ghost(
        &mut self,
        key: CacheKey,
        block: BlockId,
        tokens: u32,
        stamp: u64,
    ) -> (u32, Option<bool>) {
        let e = self.alloc_entry(KeyEntry {
            key,
            block,
            tokens,
            next: NIL,
            stamp,
        });
        let h = mix(&key);
        if let Some((_, head)) = self.find_hashed(&key, h) {
            let mut last = head;
            while self.entries[last as usize].next != NIL {
                last = self.entries[last as usize].next;
            }
            self.entries[last as usize].next = e;
            return (e, None);
        }
        if self.len + 1 > max_keys(self.num_buckets) {
            self.grow();
        }
        let hit = if self.ghosts == [0, 0] {
            None
        } else {
            self.take_ghost(h, e)
        };
        if hit.is_none() {
            self.place(h, e);
        }
        self.len += 1;
        (e, hit)
    }

    /// Puts a key known to be absent into the table.
    #[inline]
    fn place(&mut self, h: u64, e: u32) {
        let n = self.num_buckets;
        let mut b = self.home(h);
        loop {
            let bucket = self.bucket_mut(b);
            let empty = matching_lanes(bucket, 0);
            if empty != 0 {
                let lane = first_lane(empty);
                set_tag(bucket, lane, tag(h));
                bucket[ENTRIES + lane] = e;
                return;
            }
            if self.ghosts != [0, 0]
                && let Some(lane) = self.drop_a_ghost(b)
            {
                let bucket = self.bucket_mut(b);
                set_tag(bucket, lane, tag(h));
                bucket[ENTRIES + lane] = e;
                return;
            }
            self.bucket_mut(b)[OVERFLOW] += 1;
            b = next_bucket(b, n);
        }
    }

    fn grow(&mut self) {
        let old = std::mem::take(&mut self.table);
        let old_base = self.base;
        let old_n = self.num_buckets;
        let n = old_n * 2;
        (self.table, self.base) = zeroed_table(n);
        self.num_buckets = n;
        // Ghosts do not move: they keep too little of their hash to find their
        // new homes.
        self.ghosts = [0, 0];
        for b in 0..old_n {
            let at = old_base + b * WORDS;
            for lane in 0..LANES {
                let e = old[at + ENTRIES + lane];
                if tag_at(&old[at..at + WORDS], lane) != 0 && !is_ghost(e) {
                    self.place(mix(&self.entries[e as usize].key), e);
                }
            }
        }
    }

    /// Removes `(key, block)`; whether it was there.
    pub(crate) fn remove(&mut self, key: &CacheKey, block: BlockId) -> bool {
        self.remove_leaving_ghost(key, block, None).0
    }

    /// [`Self::remove`]; when that takes the key out of the map and `ghost`
    /// names a list and a ring slot, the key stays behind as a ghost of that
    /// list (`ghost_lanes`), and its record comes back (none when the key
    /// keeps other blocks, or its home bucket has no lane for it).
    #[inline]
    pub(crate) fn remove_leaving_ghost(
        &mut self,
        key: &CacheKey,
        block: BlockId,
        ghost: Option<(usize, usize)>,
    ) -> (bool, Option<GhostRecord>) {
        let h = mix(key);
        let Some((s, head)) = self.find_hashed(key, h) else {
            return (false, None);
        };
        if self.entries[head as usize].block == block {
            let next = self.entries[head as usize].next;
            self.release_entry(head);
            if next != NIL {
                self.bucket_mut(s.bucket)[ENTRIES + s.lane] = next;
                return (true, None);
            }
            if let Some((list, slot)) = ghost {
                return (true, self.leave_ghost(h, s, list, slot));
            }
            self.remove_slot(h, s);
            return (true, None);
        }
        let mut prev = head;
        loop {
            let cur = self.entries[prev as usize].next;
            if cur == NIL {
                return (false, None);
            }
            if self.entries[cur as usize].block == block {
                self.entries[prev as usize].next = self.entries[cur as usize].next;
                self.release_entry(cur);
                return (true, None);
            }
            prev = cur;
        }
    }

    fn remove_slot(&mut self, h: u64, s: Slot) {
        let n = self.num_buckets;
        let mut b = self.home(h);
        while b != s.bucket {
            self.bucket_mut(b)[OVERFLOW] -= 1;
            b = next_bucket(b, n);
        }
        set_tag(self.bucket_mut(s.bucket), s.lane, 0);
        self.len -= 1;
    }

    /// Empties the map, keeping its memory.
    pub(crate) fn clear(&mut self) {
        self.table.fill(0);
        self.entries.clear();
        self.free_entry = NIL;
        self.len = 0;
        self.ghosts = [0, 0];
    }

    /// The keys in the table with their head entries.
    fn slots(&self) -> impl Iterator<Item = (usize, u16, u32)> + '_ {
        (0..self.num_buckets).flat_map(move |b| {
            let bucket = self.bucket(b);
            (0..LANES)
                .filter(move |&lane| tag_at(bucket, lane) != 0 && !is_ghost(bucket[ENTRIES + lane]))
                .map(move |lane| (b, tag_at(bucket, lane), bucket[ENTRIES + lane]))
        })
    }

    /// Every key with its blocks in insertion order (for invariant checks).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (CacheKey, Vec<BlockId>)> + '_ {
        self.slots().map(move |(_, _, head)| {
            let mut ids = Vec::new();
            let mut e = head;
            while e != NIL {
                ids.push(self.entries[e as usize].block);
                e = self.entries[e as usize].next;
            }
            (self.entries[head as usize].key, ids)
        })
    }

    /// Structural checks of the table itself: every key reachable from its
    /// home, overflow counts exact, tags matching the keys.
    pub(crate) fn check(&self) -> Result<(), String> {
        let n = self.num_buckets;
        let mut expected = vec![0u32; self.num_buckets];
        let mut keys = 0usize;
        for (b, t, head) in self.slots() {
            keys += 1;
            let h = mix(&self.entries[head as usize].key);
            if tag(h) != t {
                return Err("prefix map tag does not match its key".into());
            }
            let mut x = self.home(h);
            while x != b {
                expected[x] += 1;
                x = next_bucket(x, n);
            }
        }
        if keys != self.len {
            return Err(format!("prefix map counts {} keys, holds {keys}", self.len));
        }
        self.check_ghosts()?;
        if (0..self.num_buckets).any(|b| overflow(self.bucket(b)) != expected[b]) {
            return Err("prefix map overflow counts are wrong".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
