//! The block-hash memo: `sha256_cbor` digests of recent blocks by their whole
//! input, so a block hashed before (a shared system prompt, the earlier turns
//! of a conversation) is looked up instead of hashed again.
//!
//! An entry holds a block's full input (the parent digest and every token)
//! beside its digest, and a lookup returns the digest only when the input
//! matches in full: the result is the digest SHA-256 gives, never a guess. An
//! entry's set is chosen by the block's tokens alone, not its parent, so the
//! sets of a prompt's blocks are known before any of them is hashed and are
//! loaded ahead of the chain ([`HashMemo::prefetch`]); a chain only waits for
//! its digests. Two entries to a set: a new block displaces the older. (Every
//! block of a memo has the same number of tokens, its width.)

use pagedkv_arch::prefetch;

/// A cache line of the table: two 32-byte chunks.
#[derive(Clone, Copy, Debug, Default)]
#[repr(align(64))]
struct Line([[u8; 32]; 2]);

/// Digests of hashed blocks by their input.
#[derive(Clone, Debug)]
pub(crate) struct HashMemo {
    /// Entries of `lines` cache lines: the parent digest and the digest (all
    /// zeros in an empty entry, a digest SHA-256 gives with the odds of a
    /// collision), then the tokens' little-endian bytes, eight to a 32-byte
    /// chunk (zeros past the last). Allocated and zeroed when first written.
    table: Vec<Line>,
    lines: usize,
    /// Tokens of the blocks it holds (the manager's hash block size).
    width: usize,
    /// Entries, a power of two.
    entries: usize,
    /// Lookups that found the block, and that did not.
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    /// The table could not be allocated: the memo stays empty.
    unavailable: bool,
}

/// Entries a block may be in (a set's): a block whose set is full displaces
/// the set's older entry.
const WAYS: usize = 2;
/// Most entries a memo may be asked for.
const MAX_ENTRIES: usize = 1 << 40;
/// Most tokens of a block the memo holds.
const MAX_WIDTH: usize = 64;
/// An odd constant of well-mixed bits.
const MIX: u64 = 0x9e37_79b9_7f4a_7c15;
/// An odd multiplier per token of a block, 32-bit so that each product is
/// one widening multiply.
const MULTIPLIERS: [u32; 16] = [
    0x9e37_79b1,
    0x85eb_ca77,
    0xc2b2_ae3d,
    0x27d4_eb2f,
    0x1656_67b1,
    0xd3a2_646d,
    0xfd70_46c5,
    0xb55a_4f09,
    0x6a09_e667,
    0xbb67_ae85,
    0x3c6e_f373,
    0xa54f_f53b,
    0x510e_527f,
    0x9b05_688d,
    0x1f83_d9ab,
    0x5be0_cd19,
];

/// Whether a chunk holds these (up to eight) tokens' little-endian bytes
/// (compared in place: a chunk built on the stack and compared would wait for
/// its own stores).
#[inline]
fn holds(chunk: &[u8; 32], tokens: &[u32]) -> bool {
    chunk
        .as_chunks::<4>()
        .0
        .iter()
        .zip(tokens)
        .fold(true, |same, (b, &t)| same & (u32::from_le_bytes(*b) == t))
}

/// Writes up to eight tokens' little-endian bytes into a chunk, zeros past
/// the last.
#[inline]
fn write(chunk: &mut [u8; 32], tokens: &[u32]) {
    let words = chunk.as_chunks_mut::<4>().0;
    for (i, w) in words.iter_mut().enumerate() {
        *w = tokens.get(i).map_or([0; 4], |t| t.to_le_bytes());
    }
}

impl HashMemo {
    /// A memo of `entries` blocks (rounded up to a power of two, at least a
    /// set) of `width` tokens; `None` when either is 0, blocks are over 64
    /// tokens or entries over 2**40 (whose slot arithmetic could overflow).
    pub(crate) fn new(width: usize, entries: usize) -> Option<Self> {
        if width == 0 || width > MAX_WIDTH || entries == 0 || entries > MAX_ENTRIES {
            return None;
        }
        // Two digests and the tokens, in whole lines.
        let chunks = 2 + width.div_ceil(8);
        Some(Self {
            table: Vec::new(),
            lines: chunks.div_ceil(2),
            width,
            entries: entries.max(WAYS).checked_next_power_of_two()?,
            hits: 0,
            misses: 0,
            unavailable: false,
        })
    }

    /// Tokens of the blocks it holds.
    pub(crate) fn width(&self) -> usize {
        self.width
    }

    /// Bytes it holds once used.
    pub(crate) fn bytes(&self) -> usize {
        self.entries
            .saturating_mul(self.lines)
            .saturating_mul(size_of::<Line>())
    }

    /// The first line of the set of entries a block with these tokens may be
    /// in.
    #[inline]
    fn slot(&self, tokens: &[u32]) -> usize {
        // Each token multiplied by its own odd constant and summed (no
        // multiply waits for another), then mixed; the top bits pick the
        // set. An input crafted to collide only costs hashing.
        let mut h = 0u64;
        for (i, &t) in tokens.iter().enumerate() {
            h = h.wrapping_add(u64::from(t) * u64::from(MULTIPLIERS[i % MULTIPLIERS.len()]));
        }
        h = (h ^ (h >> 29)).wrapping_mul(MIX);
        let bits = (self.entries / WAYS).trailing_zeros();
        let set = if bits == 0 {
            0
        } else {
            (h >> (64 - bits)) as usize
        };
        set * WAYS * self.lines
    }

    /// Starts loading the entry of a block with these tokens.
    #[inline]
    pub(crate) fn prefetch(&self, tokens: &[u32]) {
        let set = self.slot(tokens);
        if let Some(lines) = self.table.get(set..set + WAYS * self.lines) {
            lines.iter().for_each(prefetch);
        }
    }

    /// The digest of the block `(parent, tokens)` if the memo holds it;
    /// `Err(slot)` otherwise, for [`Self::store`].
    #[inline]
    pub(crate) fn lookup(&self, parent: &[u8; 32], tokens: &[u32]) -> Result<[u8; 32], usize> {
        let set = self.slot(tokens);
        let Some(lines) = self.table.get(set..set + WAYS * self.lines) else {
            return Err(set);
        };
        for entry in lines.chunks_exact(self.lines) {
            let [stored_parent, digest] = &entry[0].0;
            if digest != &[0; 32]
                && stored_parent == parent
                && tokens
                    .chunks(8)
                    .enumerate()
                    .all(|(c, ts)| holds(&entry[1 + c / 2].0[c % 2], ts))
            {
                return Ok(*digest);
            }
        }
        Err(set)
    }

    /// Records the digest of `(parent, tokens)` in the set `set` (from a
    /// missed [`Self::lookup`] of the same block): first in the set, the
    /// entry that was first moved second, the second's block forgotten.
    pub(crate) fn store(
        &mut self,
        set: usize,
        parent: &[u8; 32],
        tokens: &[u32],
        digest: &[u8; 32],
    ) {
        if self.table.is_empty() && !self.allocate() {
            return;
        }
        let lines = &mut self.table[set..set + WAYS * self.lines];
        let (first, second) = lines.split_at_mut(self.lines);
        second.copy_from_slice(first);
        first[0].0 = [*parent, *digest];
        for (c, ts) in tokens.chunks(8).enumerate() {
            write(&mut first[1 + c / 2].0[c % 2], ts);
        }
    }

    /// Allocates the table (zeroed: every entry empty); `false`, the memo
    /// staying empty and every block hashed, if the memory cannot be had.
    #[cold]
    fn allocate(&mut self) -> bool {
        if self.unavailable {
            return false;
        }
        let mut table = Vec::new();
        let Some(n) = self.entries.checked_mul(self.lines) else {
            self.unavailable = true;
            return false;
        };
        if table.try_reserve_exact(n).is_err() {
            self.unavailable = true;
            return false;
        }
        table.resize(n, Line::default());
        self.table = table;
        true
    }

    /// Forgets every block (the memory is returned).
    pub(crate) fn clear(&mut self) {
        self.table = Vec::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(b: u8) -> [u8; 32] {
        let mut d = [b; 32];
        d[31] = 1;
        d
    }

    /// A lookup answers only for the exact input stored: another parent,
    /// another token (first, last, the odd one out of a pair) or an empty
    /// memo misses; a block displaced from its slot misses.
    #[test]
    fn answers_only_the_exact_input() {
        for width in [1, 15, 16] {
            let mut m = HashMemo::new(width, 4).unwrap_or_else(|| panic!("memo"));
            let tokens: Vec<u32> = (0..width as u32).map(|t| t * 7 + 3).collect();
            let parent = digest(9);
            let Err(slot) = m.lookup(&parent, &tokens) else {
                panic!("an empty memo holds nothing");
            };
            m.store(slot, &parent, &tokens, &digest(5));
            assert_eq!(m.lookup(&parent, &tokens), Ok(digest(5)));
            assert!(m.lookup(&digest(8), &tokens).is_err(), "another parent");
            let mut other = parent;
            other[17] ^= 1;
            assert!(m.lookup(&other, &tokens).is_err(), "one parent bit");
            for i in [0, width - 1] {
                let mut t = tokens.clone();
                t[i] ^= 1 << 31;
                assert!(m.lookup(&parent, &t).is_err(), "token {i} of {width}");
            }
            m.clear();
            assert!(m.lookup(&parent, &tokens).is_err(), "cleared");
        }
        assert!(HashMemo::new(0, 4).is_none() && HashMemo::new(16, 0).is_none());
        assert!(HashMemo::new(65, 4).is_none() && HashMemo::new(16, (1 << 40) + 1).is_none());
        // 16 tokens: the inputs and digests fill two cache lines; a set of
        // two entries at least.
        assert_eq!(HashMemo::new(16, 1).map(|m| m.bytes()), Some(256));
        assert_eq!(HashMemo::new(16, 5).map(|m| m.bytes()), Some(8 * 128));
    }

    /// A table that cannot be allocated leaves the memo empty: every lookup
    /// misses, nothing is recorded, nothing panics.
    #[test]
    fn a_table_that_cannot_be_had_leaves_the_memo_empty() {
        let mut m = HashMemo::new(16, 1 << 40).unwrap_or_else(|| panic!("memo"));
        let tokens: Vec<u32> = (0..16).collect();
        for _ in 0..2 {
            let set = m.lookup(&digest(1), &tokens).unwrap_err();
            m.store(set, &digest(1), &tokens, &digest(2));
        }
        assert!(m.lookup(&digest(1), &tokens).is_err());
        assert!(m.unavailable && m.table.is_empty());
    }

    /// With one set every block maps to it: a third block displaces the
    /// older of the two it holds.
    #[test]
    fn a_block_displaces_the_older_of_its_set() {
        let mut m = HashMemo::new(4, 1).unwrap_or_else(|| panic!("memo"));
        let (a, b, c) = ([1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]);
        for (t, d) in [(&a, 2), (&b, 3)] {
            let set = m.lookup(&digest(1), t).unwrap_err();
            m.store(set, &digest(1), t, &digest(d));
        }
        assert_eq!(m.lookup(&digest(1), &a), Ok(digest(2)));
        assert_eq!(m.lookup(&digest(1), &b), Ok(digest(3)));
        let set = m.lookup(&digest(1), &c).unwrap_err();
        m.store(set, &digest(1), &c, &digest(4));
        assert!(m.lookup(&digest(1), &a).is_err(), "the older displaced");
        assert_eq!(m.lookup(&digest(1), &b), Ok(digest(3)));
        assert_eq!(m.lookup(&digest(1), &c), Ok(digest(4)));
    }
}
