//! The io layer: everything that talks to the kernel about files and the page cache.
//!
//! - [`sys`]: the system calls (preadv2/pwritev2 with RWF_DONTCACHE, cachestat,
//!   sync_file_range, fadvise, fallocate, block-device ioctls), the crate's only `unsafe`: so
//!   it also holds the few calls of the layers above that `std` lacks (cancellable connects,
//!   keepalive, socket activation, signals, directory locks). One file per topic.
//! - [`policy`]: `--cache=MODE` and the choice of mechanism per file ([`policy::choose`]).
//! - [`PolicyFile`]: a file or block device whose reads and writes follow the chosen
//!   mechanism, with runtime fallbacks and a latched write error.
//! - [`evict`] and [`writebehind`]: the two eviction engines for buffered reads and writes;
//!   [`footprint`] counts what they (and RWF_DONTCACHE) drop, when asked.
//! - [`residency`]: what a file has in the page cache, and eviction on request
//!   (`lightfoot cache`); [`walk`], the files of directory trees (`lightfoot cache -r`).
//!
//! Data flow of a neutral copy on Linux 6.14+: reads `preadv2(RWF_DONTCACHE)` with readahead
//! off; writes buffered, then `sync_file_range` windows evicted a few windows behind;
//! `fdatasync` at the end. Facts behind each choice: `../shared/KERNEL-NOTES.md` and
//! `docs/cache-policy.md`.

pub mod evict;
pub mod file;
pub mod footprint;
pub mod policy;
pub mod residency;
pub mod sys;
pub mod walk;
pub mod writebehind;

/// Spreads `x` over `2^bits` slots (Fibonacci hashing: the top `bits` bits of the product
/// with 2^64/φ), for lock stripes. Not `x % slots`: clients working at the same pace in
/// regions a power of two apart (fio's jobs, each in its own quarter of a disk) would meet on
/// one slot at every step.
pub(crate) fn spread(x: u64, bits: u32) -> usize {
    (x.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - bits)) as usize
}

pub use file::{FileJob, Mechanism, OpenOptions, PolicyFile};
pub use policy::{CacheMode, Fadvise, ReadMech, Tuning, WriteMech};
pub use sys::{AlignedBuf, CacheStat};
