//! cargo-fuzz wrapper; the harness is `lightfoot::testing::fuzz::bitmap`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| lightfoot::testing::fuzz::bitmap::run(data));
