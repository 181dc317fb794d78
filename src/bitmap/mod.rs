//! Dirty bitmaps: which blocks of an image changed since a point in time (an epoch's start),
//! so that the next backup copies only those (`copy --bitmap`, docs/incremental.md).
//!
//! - [`Bits`]: one bit per block of a granularity (64 KiB unless chosen), marked lock-free.
//! - [`format`]: the bitmap file's bytes, checked field by field (a fuzz target).
//! - [`BitmapFile`]: the file beside the image (`IMAGE.bitmaps`; an object beside an `s3://`
//!   block image's blocks), held by one writer, saved whole; at open it accounts for writes
//!   no bitmap saw ([`BitmapFile::resolve`]).
//! - [`Tracker`]: a server's bitmaps while it runs (`serve --dirty-bitmap`): marked by every
//!   change, read by clients as `qemu:dirty-bitmap:NAME`, saved at a clean close.
//!
//! The offline commands (`lightfoot bitmap list|add|clear|…`) work on a [`BitmapFile`].

mod bits;
pub mod file;
pub mod format;
mod tracker;

pub use bits::Bits;
pub use file::{default_path, identity, BitmapFile, Location, DEFAULT_GRANULARITY};
pub use tracker::Tracker;
