//! Test support, built only for tests and the fuzz targets (`cfg(test)`, or the `testing`
//! feature, which the crate's own dev-dependency on itself and fuzz/Cargo.toml turn on), so
//! none of it is in the release binary: the conformance suite and its reference model, a
//! fault injector, a device that can lose power, an in-memory duplex stream, and the fuzz
//! harnesses (run by cargo-fuzz from `fuzz/`, replayed by `tests/fuzz_replay.rs`).

pub mod conformance;
pub mod duplex;
pub mod fault;
pub mod fuzz;
pub mod powerloss;
