//! The CPU instructions `pagedkv-core` uses, behind safe functions.
//!
//! The core forbids unsafe code, and these instructions are only reachable
//! through `unsafe` intrinsics (an intrinsic is safe to call only from a
//! function that names its target feature, which the core's inlined hot paths
//! cannot). Each function here has a portable equivalent, used on other
//! targets and checked against the intrinsic one in the tests.
//!
//! - [`prefetch`]: a software prefetch. A staged lookup reads ahead the lines
//!   its later steps will need. A plain read of a line (kept alive with
//!   `black_box`) overlaps with other reads, but it must complete before it
//!   retires, so a window of misses stalls the reorder buffer; a prefetch
//!   retires at once and lets the work in between proceed.
//! - [`lanes_equal`]: which of eight 16-bit lanes hold a value, the prefix
//!   map's probe of a bucket's tags: one SSE2 compare instead of a dozen
//!   integer operations per word.
#![no_std]
#![allow(unsafe_code)]

/// Starts loading the cache line holding `*r` into all cache levels. Returns at
/// once; does nothing on targets without a stable prefetch instruction.
#[inline(always)]
#[allow(clippy::inline_always)]
pub fn prefetch<T>(r: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` is a hint that cannot fault or write memory; the
    // address comes from a live reference. SSE is part of the x86_64 baseline.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
            core::ptr::from_ref(r).cast::<i8>(),
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = r;
}

/// The 16-bit lanes of `lanes` (lanes 0 to 3 in `lanes[0]`, 4 to 7 in
/// `lanes[1]`, each from the low end) that equal `value`: bit `2 * i` of the
/// result for lane `i`, every other bit clear. The next lane of a mask `m` is
/// `m.trailing_zeros() / 2`.
#[inline(always)]
#[allow(clippy::inline_always)]
#[must_use]
pub fn lanes_equal(lanes: [u64; 2], value: u16) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        lanes_equal_sse2(lanes, value)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        lanes_equal_portable(lanes, value)
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::inline_always)]
fn lanes_equal_sse2(lanes: [u64; 2], value: u16) -> u32 {
    use core::arch::x86_64::{_mm_cmpeq_epi16, _mm_movemask_epi8, _mm_set_epi64x, _mm_set1_epi16};
    // SAFETY: SSE2 is part of the x86_64 baseline, and these intrinsics take
    // no pointers: they only compute on the values passed.
    let mask = unsafe {
        _mm_movemask_epi8(_mm_cmpeq_epi16(
            _mm_set_epi64x(lanes[1].cast_signed(), lanes[0].cast_signed()),
            _mm_set1_epi16(value.cast_signed()),
        ))
    };
    // Two mask bits per equal lane (one per byte); the even one stands for it.
    mask.cast_unsigned() & 0x5555
}

/// [`lanes_equal`] in integer arithmetic, four lanes of a word at a time.
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn lanes_equal_portable(lanes: [u64; 2], value: u16) -> u32 {
    const LOW15: u64 = 0x7fff_7fff_7fff_7fff;
    // The high bit of each lane of `w` that is zero, nothing else (exact: no
    // carries cross lanes).
    let zero_lanes = |w: u64| !(((w & LOW15) + LOW15) | w | LOW15);
    let spread = u64::from(value) * 0x0001_0001_0001_0001;
    let mut out = 0;
    for (word, lanes) in lanes.iter().enumerate() {
        let z = zero_lanes(lanes ^ spread);
        for lane in 0..4 {
            if z >> (16 * lane + 15) & 1 == 1 {
                out |= 1 << (2 * (4 * word + lane));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{lanes_equal, lanes_equal_portable};

    #[test]
    fn prefetching_leaves_the_value_as_it_was() {
        let v = [7u64; 64];
        for x in &v {
            super::prefetch(x);
        }
        assert!(v.iter().all(|&x| x == 7));
    }

    fn pack(tags: [u16; 8]) -> [u64; 2] {
        let word = |t: &[u16]| t.iter().rev().fold(0u64, |w, &x| (w << 16) | u64::from(x));
        [word(&tags[..4]), word(&tags[4..])]
    }

    /// Lane by lane, against a plain loop: every lane pattern of a few values
    /// (0, the empty lane, among them) and the values around the lanes' high
    /// bit, where a carry between lanes would show.
    #[test]
    fn lanes_equal_marks_exactly_the_equal_lanes() {
        let values = [0u16, 1, 0x7fff, 0x8000, 0x8001, 0xffff];
        let mut state = 0x9e37_79b9_u32;
        for _ in 0..20_000 {
            let mut tags = [0u16; 8];
            for t in &mut tags {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                *t = values[(state >> 24) as usize % values.len()];
            }
            for &v in &values {
                let expected = (0..8)
                    .filter(|&i| tags[i] == v)
                    .fold(0u32, |m, i| m | 1 << (2 * i));
                assert_eq!(lanes_equal(pack(tags), v), expected, "{tags:x?} {v:#x}");
                assert_eq!(
                    lanes_equal_portable(pack(tags), v),
                    expected,
                    "{tags:x?} {v:#x}"
                );
            }
        }
    }
}
