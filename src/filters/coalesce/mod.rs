//! `--coalesce` (issue 6): safe write coalescing. Built in steps; so far the dirty map.
//!
//! - [`dirty`]: the dirty data of one block (exact byte ranges, merged when they touch), the
//!   write-back [`dirty::plan`] and the extents overlay.

pub mod dirty;
