//! What `lightfoot run`'s two sides both need to agree on, written once: the preload library
//! (`preload/`, loaded into the command) and lightfoot itself (`src/run`, its watcher and final
//! sweep; `src/io`'s eviction).
//!
//! - [`BLOCK`] (as [`SHIFT`]): the unit of residency and of eviction.
//! - [`Header`], [`records`]: the record of a file's first sight (which blocks held pages
//!   before the command touched it) that the library appends to the run's log and
//!   `lightfoot run` reads back, with its bitmap ([`bitmap_len`], [`is_set`], [`set`]).
//! - [`scan`]: finding which blocks of a file hold pages, halving ranges that hold some.
//! - [`Cachestat`], [`CachestatRange`], [`SYS_CACHESTAT`]: `cachestat(2)`'s uapi layout.
//!
//! The preload library runs inside arbitrary programs, in signal handlers too: nothing here
//! allocates, takes a lock or panics, and nothing is `unsafe`. `no_std` keeps it so.

#![cfg_attr(not(test), no_std)]
#![forbid(unsafe_code)]

mod cachestat;
mod format;
mod scan;

pub use cachestat::{Cachestat, CachestatRange, SYS_CACHESTAT};

pub use format::{
    bitmap_len, is_set, not_covered, records, set, Entry, Header, Records, ALL_CACHED, DONE, MAGIC,
    NOT_COVERED, NOT_COVERED_EPERM, NOT_COVERED_NOSYS, NOT_COVERED_OTHER, WRITABLE,
};
pub use scan::{scan, Counts};

/// The unit of the residency record and of eviction, as a shift: DONTNEED drops only whole
/// folios, and readahead builds folios of up to 2 MiB, naturally aligned (KERNEL-NOTES: a
/// smaller range drops nothing).
pub const SHIFT: u32 = 21;
/// [`SHIFT`] in bytes: 2 MiB.
pub const BLOCK: u64 = 1 << SHIFT;
