//! What memory alone costs the offload tier as it grows: one random lookup in a
//! hash map of 64-byte keys holding 10^3 .. 10^6 entries (the tier keeps one
//! such entry a chunk), against the same lookups in a map that fits the caches.
//!
//! `cargo run --release -p pagedkv-benches --example offload_dram_floor`

use std::hint::black_box;
use std::time::Instant;

use pagedkv_core::offload::OffloadKey;
use rustc_hash::FxHashMap;

fn key(i: u64) -> OffloadKey {
    let mut h = [0u8; 32];
    h[..8].copy_from_slice(&i.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes());
    OffloadKey::new(&h, 0).expect("32-byte hash")
}

fn main() {
    let lookups = 2_000_000u64;
    for n in [1_000u64, 10_000, 100_000, 1_000_000] {
        let map: FxHashMap<OffloadKey, u64> = (0..n).map(|i| (key(i), i)).collect();
        let probes: Vec<OffloadKey> = {
            let mut x = 0x2545_F491_4F6C_DD1Du64;
            (0..4096)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    key(x % n)
                })
                .collect()
        };
        let t = Instant::now();
        let mut s = 0u64;
        let mut x = 1u64;
        for i in 0..lookups {
            // a fresh random key each time (not the 4096 warm ones) for the cold figure
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            s += map.get(&key(x % n)).copied().unwrap_or(0) + (i & 1);
        }
        let cold = t.elapsed().as_nanos() as f64 / lookups as f64;
        let t = Instant::now();
        for i in 0..lookups {
            s += map.get(&probes[(i % 4096) as usize]).copied().unwrap_or(0);
        }
        let warm = t.elapsed().as_nanos() as f64 / lookups as f64;
        println!("{n:>9} keys: {cold:6.1} ns a random lookup, {warm:5.1} ns for 4096 warm keys");
        black_box(s);
    }
}
