//! Write-behind windows: the way to write through the page cache without filling it.
//!
//! After data lands in a window, writeback of that window is started with
//! `sync_file_range(WRITE)` once a few newer windows are dirty; a few windows further on it is
//! waited for (`WAIT_BEFORE|WRITE|WAIT_AFTER`) and evicted with `POSIX_FADV_DONTNEED`. Works on
//! every kernel and filesystem; windows are 2 MiB-aligned so DONTNEED drops whole folios
//! (KERNEL-NOTES). `sync_file_range` is not a durability primitive (no metadata, no device
//! flush): FLUSH and FUA still need `fdatasync`. Its errors are real write errors and are
//! returned to the caller, which latches them.
//!
//! Pages that were cached before the job are not the job's to evict (`--cache=neutral`): the
//! first write into each 2 MiB block checks it with cachestat ([`WriteBehind::classify`]),
//! and blocks that held pages are skipped when windows are evicted. They keep their pages,
//! with the new contents.
//!
//! The same tracker checks RWF_DONTCACHE writes (`verify`): when a window waited on still has
//! pages cached, DONTCACHE is leaving them (ext4 overwrites on 6.18) and the caller falls back.

use std::collections::VecDeque;
use std::io;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::sys::{self, Advice};

pub const WINDOW: u64 = 8 << 20;

pub struct WriteBehind {
    /// Dirty windows allowed before the oldest one's writeback is started.
    max_dirty: usize,
    /// Windows under writeback allowed before the oldest one is waited for and evicted.
    max_writeback: usize,
    /// Writes were made with RWF_DONTCACHE: writeback is already started by the kernel, and
    /// pages found after it are reported.
    verify: AtomicBool,
    inner: Mutex<Inner>,
    /// 2 MiB blocks seen by `classify`, and those of them that held pages before: bitmaps.
    seen: Mutex<Vec<u64>>,
    precached: Mutex<Vec<u64>>,
    /// `classify` is in use: only blocks it saw empty are evicted.
    guarded: AtomicBool,
}

/// Granularity of the pre-cached check: the largest folio (DONTNEED drops whole folios).
const BLOCK: u64 = 2 << 20;

fn bit(map: &[u64], i: u64) -> bool {
    map.get((i / 64) as usize).is_some_and(|w| w & (1 << (i % 64)) != 0)
}

fn set_bit(map: &mut Vec<u64>, i: u64) {
    let w = (i / 64) as usize;
    if map.len() <= w {
        map.resize(w + 1, 0);
    }
    map[w] |= 1 << (i % 64);
}

#[derive(Default)]
struct Inner {
    dirty: VecDeque<u64>,
    writeback: VecDeque<u64>,
}

/// What `after_write` found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// Pages were still cached in a window after its writeback completed (`verify` only).
    pub pages_left: bool,
}

impl WriteBehind {
    pub fn new(verify: bool) -> WriteBehind {
        WriteBehind {
            max_dirty: 2,
            max_writeback: 2,
            verify: AtomicBool::new(verify),
            inner: Mutex::new(Inner::default()),
            seen: Mutex::new(Vec::new()),
            precached: Mutex::new(Vec::new()),
            guarded: AtomicBool::new(false),
        }
    }

    /// Call before writing `[offset, offset+len)` when pages cached before the job must
    /// stay: remembers which of its 2 MiB blocks already held pages. Without cachestat
    /// (EPERM) nothing is remembered and every window is evicted.
    pub fn classify(&self, fd: BorrowedFd, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        self.guarded.store(true, Ordering::Relaxed);
        let mut seen = self.seen.lock().unwrap();
        for b in offset / BLOCK..(offset + len).div_ceil(BLOCK) {
            if bit(&seen, b) {
                continue;
            }
            set_bit(&mut seen, b);
            if sys::cachestat(fd, b * BLOCK, BLOCK).is_ok_and(|s| s.cached > 0) {
                set_bit(&mut self.precached.lock().unwrap(), b);
            }
        }
    }

    /// Call after each successful write of `[offset, offset+len)`.
    pub fn after_write(&self, fd: BorrowedFd, offset: u64, len: u64) -> io::Result<Outcome> {
        let (start, wait) = {
            let mut inner = self.inner.lock().unwrap();
            for w in windows(offset, len) {
                if !inner.dirty.contains(&w) {
                    inner.dirty.push_back(w);
                }
            }
            let mut start = Vec::new();
            while inner.dirty.len() > self.max_dirty {
                let w = inner.dirty.pop_front().unwrap();
                start.push(w);
                if !inner.writeback.contains(&w) {
                    inner.writeback.push_back(w);
                }
            }
            let mut wait = Vec::new();
            while inner.writeback.len() > self.max_writeback {
                wait.push(inner.writeback.pop_front().unwrap());
            }
            (start, wait)
        };
        // With DONTCACHE the kernel has started writeback already; this then finds nothing
        // dirty and returns at once.
        for w in start {
            sys::sync_file_range(fd, w * WINDOW, WINDOW, sys::SFR_WRITE)?;
        }
        self.wait_and_evict(fd, wait)
    }

    /// Stops checking for pages left behind (the caller has switched away from DONTCACHE).
    pub fn stop_verifying(&self) {
        self.verify.store(false, Ordering::Relaxed);
    }

    /// Waits for and evicts every window (end of job, flush, error, Ctrl-C).
    pub fn drain(&self, fd: BorrowedFd) -> io::Result<Outcome> {
        let all: Vec<u64> = {
            let mut inner = self.inner.lock().unwrap();
            let mut all: Vec<u64> = inner.writeback.drain(..).collect();
            all.extend(inner.dirty.drain(..));
            all.sort_unstable();
            all.dedup();
            all
        };
        self.wait_and_evict(fd, all)
    }

    fn wait_and_evict(&self, fd: BorrowedFd, windows: Vec<u64>) -> io::Result<Outcome> {
        let mut outcome = Outcome::default();
        let mut first_err = None;
        for w in windows {
            // Every window is evicted even after an error, so the cache is cleaned up anyway.
            let res = sys::sync_file_range(
                fd,
                w * WINDOW,
                WINDOW,
                sys::SFR_WAIT_BEFORE | sys::SFR_WRITE | sys::SFR_WAIT_AFTER,
            );
            if let Err(e) = res {
                first_err.get_or_insert(e);
            }
            // With classification on, the job's blocks are the ones it wrote into that held
            // no pages before; the rest of the window (pre-cached, or never written by us)
            // is not ours to evict.
            let guarded = self.guarded.load(Ordering::Relaxed);
            let (seen, precached) = (self.seen.lock().unwrap(), self.precached.lock().unwrap());
            let ours = |b: u64| !guarded || (bit(&seen, b) && !bit(&precached, b));
            let blocks = w * WINDOW / BLOCK..(w + 1) * WINDOW / BLOCK;
            let mut b = blocks.start;
            while b < blocks.end {
                if !ours(b) {
                    b += 1;
                    continue;
                }
                let start = b;
                while b < blocks.end && ours(b) {
                    b += 1;
                }
                let (off, len) = (start * BLOCK, (b - start) * BLOCK);
                if self.verify.load(Ordering::Relaxed)
                    && sys::cachestat(fd, off, len).is_ok_and(|s| s.cached > 0)
                {
                    outcome.pages_left = true;
                }
                let _ = sys::fadvise(fd, off, len, Advice::DontNeed);
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(outcome),
        }
    }
}

fn windows(offset: u64, len: u64) -> std::ops::Range<u64> {
    if len == 0 {
        return 0..0;
    }
    offset / WINDOW..(offset + len).div_ceil(WINDOW)
}
