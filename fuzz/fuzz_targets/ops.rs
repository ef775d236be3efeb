//! cargo-fuzz target: random operation sequences against `KvCacheManager`
//! (see `src/driver.rs` for what is checked after every call).
#![no_main]

#[path = "../src/driver.rs"]
mod driver;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    driver::run(data);
});
