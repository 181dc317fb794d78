//! Test support shipped with the library so integration tests (and later filter crates) can
//! use it: the conformance suite and its reference model, a device that can lose power, an
//! in-memory duplex stream, and the fuzz harnesses (run by cargo-fuzz from `fuzz/`, replayed
//! by `tests/fuzz_replay.rs`).

pub mod conformance;
pub mod duplex;
pub mod fuzz;
pub mod powerloss;
