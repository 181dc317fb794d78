//! Test support shipped with the library so integration tests (and later filter crates) can
//! use it: the conformance suite and its reference model, and a device that can lose power.

pub mod conformance;
pub mod powerloss;
