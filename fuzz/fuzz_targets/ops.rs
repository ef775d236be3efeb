//! cargo-fuzz target: random operation sequences against `KvCacheManager`
//! (see `rust/pagedkv-fuzz-driver` for what is checked after every call).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    pagedkv_fuzz_driver::run(data);
});
