//! Filters: backends that wrap another backend and change how requests reach it. They never
//! know which backend is below them.
//!
//! - [`fault`]: injects errors, short and slow operations (tests only).
//!
//! Coming with later issues: `prefetch` (multi-stream read-ahead into a bounded buffer) and
//! `coalesce` (safe write coalescing).

pub mod fault;

pub use fault::FaultInjector;
