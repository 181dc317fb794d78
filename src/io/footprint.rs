//! What a job has dropped from the page cache so far (`copy --footprint`, the progress bar).
//!
//! Counted only once [`enable`] is called: each drop then costs a `cachestat` before and
//! after it, and each RWF_DONTCACHE request one before it. That is nothing beside a copy's
//! 2 MiB drops and 4 MiB requests, but would be felt by a server answering 4 KiB requests, so
//! `serve` leaves it off.
//!
//! - A DONTNEED drop ([`drop_range`]) counts the pages it took out (cached before, less cached
//!   after).
//! - An RWF_DONTCACHE read counts its bytes in blocks of the job's own (no page cached when
//!   evict-behind first looked at the block, [`dontcache_read`]): the kernel drops those
//!   itself once read. (A look just before each read would not do: the previous read's
//!   readahead has brought the pages in by then.)
//! - An RWF_DONTCACHE write ([`dontcache_before`], [`dontcache_done`]) counts its pages that
//!   were not cached before it: the kernel drops those once written back, so they are counted
//!   a moment before they go. Where the kernel leaves some (the file is then switched to
//!   write-behind), write-behind's drop counts them again.

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use super::sys::{self, Advice};

static ON: AtomicBool = AtomicBool::new(false);
static EVICTED: AtomicU64 = AtomicU64::new(0);

/// Starts counting (for the rest of the process).
pub fn enable() {
    ON.store(true, Relaxed);
}

/// Bytes dropped so far (0 while counting is off).
pub fn evicted() -> u64 {
    EVICTED.load(Relaxed)
}

fn cached(fd: BorrowedFd, off: u64, len: u64) -> Option<u64> {
    sys::cachestat(fd, off, len).ok().map(|c| c.cached)
}

/// `POSIX_FADV_DONTNEED` on `[off, off+len)` (`len` 0: to the end), counting what went.
/// Eviction is advice: a failure changes nothing that was promised, so it is ignored.
pub fn drop_range(fd: BorrowedFd, off: u64, len: u64) {
    if !ON.load(Relaxed) {
        let _ = sys::fadvise(fd, off, len, Advice::DontNeed);
        return;
    }
    let before = cached(fd, off, len);
    let _ = sys::fadvise(fd, off, len, Advice::DontNeed);
    if let (Some(b), Some(a)) = (before, cached(fd, off, len)) {
        EVICTED.fetch_add(b.saturating_sub(a) * sys::page_size() as u64, Relaxed);
    }
}

/// An RWF_DONTCACHE read brought in `ours` bytes that were not cached before the job.
pub fn dontcache_read(ours: u64) {
    if ON.load(Relaxed) {
        EVICTED.fetch_add(ours, Relaxed);
    }
}

/// Before an RWF_DONTCACHE write on `[off, off+len)`: the pages of it cached now (None:
/// counting is off, or cachestat cannot say).
pub fn dontcache_before(fd: BorrowedFd, off: u64, len: u64) -> Option<u64> {
    if ON.load(Relaxed) {
        cached(fd, off, len)
    } else {
        None
    }
}

/// After an RWF_DONTCACHE write of `n` bytes at `off`, with `before` from
/// [`dontcache_before`]: its pages that were not cached before are counted.
pub fn dontcache_done(off: u64, n: u64, before: Option<u64>) {
    if let Some(b) = before {
        let page = sys::page_size() as u64;
        let pages = (off + n).div_ceil(page) - off / page;
        EVICTED.fetch_add(pages.saturating_sub(b) * page, Relaxed);
    }
}
