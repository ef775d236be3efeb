//! `SplitMix64`: the one deterministic random stream of the workspace's tests and benches.
//!
//! The core's randomized tests, the fuzz driver's regression tests and the
//! benches (their token ids, and the oracle's trace, which they regenerate
//! exactly as `pagedkv._oracle.trace.generate` does through
//! `pagedkv._util.SplitMix64`) all draw from fixed seeds: the sequence this
//! produces is part of their expectations and must never change.
//!
//! A crate of its own so that every user can depend on it: `pagedkv-core`'s
//! integration tests (a dev-dependency, leaving the core's API as it is), the
//! fuzz driver's tests and the benches crate.

/// The generator; `SplitMix64(seed)` starts the stream of `seed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// Added to the state before every draw (the golden ratio in 64 bits).
    pub const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

    /// The next 64-bit draw.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(Self::GAMMA);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A draw in `0..n`: the next draw modulo `n` (as the Python copy takes it).
    ///
    /// # Panics
    /// If `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// A draw in `lo..=hi`: `lo + below(hi - lo + 1)`.
    ///
    /// # Panics
    /// If `hi < lo`, or the range is all of `u64`.
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::SplitMix64;

    /// The reference stream of seed 0 (Vigna's `splitmix64.c`), and the same
    /// draws `pagedkv._util.SplitMix64` makes.
    #[test]
    fn the_stream_is_splitmix64() {
        let mut r = SplitMix64(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(r.next_u64(), 0x06C4_5D18_8009_454F);
        // The state after one draw of seed 0 is GAMMA: that stream is one behind.
        let mut r = SplitMix64(SplitMix64::GAMMA);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn below_and_between_take_the_remainder() {
        let mut r = SplitMix64(7);
        let below: [u64; 5] = core::array::from_fn(|_| r.below(1000));
        assert_eq!(below, [487, 804, 346, 203, 674]);
        let between: [u64; 3] = core::array::from_fn(|_| r.between(16, 512));
        assert_eq!(between, [141, 168, 324]);
    }
}
