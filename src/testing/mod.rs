//! Test support shipped with the library so integration tests (and later filter crates) can
//! use it: the conformance suite and its reference model.

pub mod conformance;
