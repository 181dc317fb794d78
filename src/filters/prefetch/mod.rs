//! `--prefetch` (issue 5): read-ahead for sequential streams into a small bounded buffer, so
//! small sequential reads on uncached storage stop paying a device round trip each.
//!
//! Built in steps. Present:
//! - [`detect`]: finding streams among an export's reads (interleaved, reordered, amid random
//!   reads), shared by its connections.
//!
//! Still to come (issue 5): the per-stream read-ahead window, the bounded chunk buffer with its
//! eviction rules, coherence with writes, and the filter itself (`Prefetch`, a `Backend`
//! around a `Backend`). Until then `lightfoot serve` has no `--prefetch` option.

pub mod detect;

pub use detect::{DetectConfig, Detector, Verdict};
