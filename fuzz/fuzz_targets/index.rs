//! cargo-fuzz target: random event batches and queries against `PrefixIndex`
//! (see `rust/pagedkv-fuzz-driver/src/index.rs` for what is checked after every
//! call).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    pagedkv_fuzz_driver::run_index(data);
});
