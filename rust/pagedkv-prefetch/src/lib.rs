//! Software prefetch behind a safe function.
//!
//! `pagedkv-core` forbids unsafe code, and the prefetch instructions are only
//! reachable through `unsafe` intrinsics. A prefetch is a hint: it never faults,
//! never changes memory, and has no effect a program can observe except timing,
//! so starting one for the line of a live reference is sound.
//!
//! Why the core wants it: a staged lookup reads ahead the lines its later steps
//! will need. A plain read of a line (kept alive with `black_box`) overlaps with
//! other reads, but it must complete before it retires, so a window of misses
//! stalls the core's reorder buffer; a prefetch retires at once and lets the
//! work in between proceed.
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

#[cfg(test)]
mod tests {
    #[test]
    fn prefetching_leaves_the_value_as_it_was() {
        let v = [7u64; 64];
        for x in &v {
            super::prefetch(x);
        }
        assert!(v.iter().all(|&x| x == 7));
    }
}
