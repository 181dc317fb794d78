//! Filters: backends that wrap another backend and change how requests reach it. They never
//! know which backend is below them.
//!
//! - [`fault`]: injects errors, short and slow operations (tests only).
//! - [`prefetch`]: multi-stream read-ahead into a bounded buffer.
//! - [`coalesce`]: safe write coalescing of small scattered writes (issue 6).

pub mod coalesce;
pub mod fault;
pub mod prefetch;

pub use fault::FaultInjector;
