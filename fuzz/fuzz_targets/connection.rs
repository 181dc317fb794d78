//! cargo-fuzz wrapper; the harness is `lightfoot::testing::fuzz::connection`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| lightfoot::testing::fuzz::connection::run(data));
