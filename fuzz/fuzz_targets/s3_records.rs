//! cargo-fuzz wrapper; the harness is `lightfoot::testing::fuzz::s3_records`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| lightfoot::testing::fuzz::s3_records::run(data));
