//! Write-behind windows: the way to write through the page cache without filling it.
//!
//! After data lands in a window, writeback of that window is started with
//! `sync_file_range(WRITE)` once newer windows hold enough written pages; once enough are under
//! writeback, the oldest is waited for (`WAIT_BEFORE|WRITE|WAIT_AFTER`) and evicted with
//! `POSIX_FADV_DONTNEED`. Works on every kernel and filesystem; windows are 2 MiB-aligned so
//! DONTNEED drops whole folios (KERNEL-NOTES).
//!
//! The bounds count pages written into each window, not windows: a sequential stream fills
//! windows one after another and starts the oldest when a third begins, as a count of two
//! windows would; scattered small writes (a guest's, or the coalesce filter's write-back) touch
//! a new window nearly every time, and counting windows made nearly every such write wait for
//! an older window's writeback (22 ms per 64-write FLUSH with --coalesce, 256 µs per 1 KiB
//! write without). Counted in pages, they stay dirty until the next flush, whose `fdatasync`
//! writes them in one pass, and `drain` evicts them. `sync_file_range` is not a durability primitive (no metadata, no device
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

use std::collections::{HashSet, VecDeque};
use std::io;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

// The granularity of the pre-cached check: the largest folio (DONTNEED drops whole folios).
use lightfoot_record::BLOCK;

use super::sys;

pub const WINDOW: u64 = 8 << 20;

pub struct WriteBehind {
    /// Bytes written (in whole pages) into dirty windows before the oldest one's writeback
    /// is started.
    max_dirty: u64,
    /// Bytes in windows under writeback before the oldest one is waited for and evicted.
    max_writeback: u64,
    /// Writes were made with RWF_DONTCACHE: writeback is already started by the kernel, and
    /// pages found after it are reported.
    verify: AtomicBool,
    inner: Mutex<Inner>,
    /// Which blocks held pages before the job: one record per file and job, shared by every
    /// open of it (a server's connections).
    classes: Arc<Classes>,
}

/// 2 MiB blocks seen by [`Classes::classify`] (before the job's first write into them, and
/// before evict-behind's first read), and those of them that held pages then. Shared by all
/// opens of a file in one job, reads and writes alike: with one record per connection, a
/// block connection A wrote or read first looked pre-cached to connection B (A's pages were
/// there), and B never evicted it.
#[derive(Default)]
pub struct Classes {
    // Sets, not bitmaps: a bitmap is sized by the highest block, and one write near the end of
    // a huge sparse file would have asked for gigabytes.
    seen: Mutex<HashSet<u64>>,
    precached: Mutex<HashSet<u64>>,
    /// `classify` is in use: only blocks it saw empty are evicted.
    guarded: AtomicBool,
}

impl Classes {
    /// Checks the 2 MiB blocks of `[offset, offset+len)` not seen before with cachestat and
    /// records them; from then on only the blocks it found empty are [`Classes::ours`]. A
    /// block the check failed on counts as cached before (the safe side: never evicted), and
    /// the first error is returned.
    pub fn classify(&self, fd: BorrowedFd, offset: u64, len: u64) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.guarded.store(true, Ordering::Relaxed);
        let mut seen = self.seen.lock().unwrap();
        let mut first_err = None;
        for b in offset / BLOCK..(offset + len).div_ceil(BLOCK) {
            if !seen.insert(b) {
                continue;
            }
            match sys::cached_pages(fd, b * BLOCK, BLOCK) {
                Ok(n) if n > 0 => {
                    self.precached.lock().unwrap().insert(b);
                }
                Ok(_) => {}
                Err(e) => {
                    self.precached.lock().unwrap().insert(b);
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Whether the job may evict 2 MiB block `b`: `classify` saw it empty (every block while
    /// `classify` is not in use).
    pub fn ours(&self, b: u64) -> bool {
        !self.guarded.load(Ordering::Relaxed)
            || (self.seen.lock().unwrap().contains(&b) && !self.precached.lock().unwrap().contains(&b))
    }
}

/// A window with the bytes written into it (in whole pages: a 1 KiB write caches a page),
/// and whether any of them were written without RWF_DONTCACHE (its pages are then expected
/// in the cache until evicted, and say nothing about DONTCACHE).
#[derive(Clone, Copy)]
struct Entry {
    window: u64,
    bytes: u64,
    buffered: bool,
}

/// Windows in the order they were first written.
#[derive(Default)]
struct Queue {
    windows: VecDeque<Entry>,
    bytes: u64,
}

impl Queue {
    fn add(&mut self, e: Entry) {
        match self.windows.iter_mut().find(|x| x.window == e.window) {
            Some(x) => {
                x.bytes += e.bytes;
                x.buffered |= e.buffered;
            }
            None => self.windows.push_back(e),
        }
        self.bytes += e.bytes;
    }

    /// Puts `window` first in line (or marks it buffered where it is queued already).
    fn requeue(&mut self, window: u64) {
        match self.windows.iter_mut().find(|x| x.window == window) {
            Some(x) => x.buffered = true,
            None => self.windows.push_front(Entry { window, bytes: 0, buffered: true }),
        }
    }

    fn pop(&mut self) -> Option<Entry> {
        let e = self.windows.pop_front()?;
        self.bytes -= e.bytes;
        Some(e)
    }

    fn take_all(&mut self) -> impl Iterator<Item = Entry> + '_ {
        self.bytes = 0;
        self.windows.drain(..)
    }
}

#[derive(Default)]
struct Inner {
    dirty: Queue,
    writeback: Queue,
}

/// What `after_write` found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// Pages were still cached in a window after its writeback completed (`verify` only).
    pub pages_left: bool,
}

impl WriteBehind {
    pub fn new(verify: bool, classes: Arc<Classes>) -> WriteBehind {
        WriteBehind {
            max_dirty: 2 * WINDOW,
            max_writeback: 2 * WINDOW,
            verify: AtomicBool::new(verify),
            inner: Mutex::new(Inner::default()),
            classes,
        }
    }

    /// Call before writing `[offset, offset+len)` when pages cached before the job must
    /// stay: remembers which of its 2 MiB blocks already held pages. Without cachestat
    /// (EPERM) nothing is remembered and every window is evicted.
    pub fn classify(&self, fd: BorrowedFd, offset: u64, len: u64) {
        // A block that could not be checked is left alone (Classes::classify).
        let _ = self.classes.classify(fd, offset, len);
    }

    /// Call after each successful write of `[offset, offset+len)`; `buffered` when it was
    /// written without RWF_DONTCACHE.
    pub fn after_write(&self, fd: BorrowedFd, offset: u64, len: u64, buffered: bool) -> io::Result<Outcome> {
        let (start, wait) = {
            let mut inner = self.inner.lock().unwrap();
            let page = sys::page_size() as u64;
            for window in windows(offset, len) {
                let (s, e) = (offset.max(window * WINDOW), (offset + len).min((window + 1) * WINDOW));
                inner.dirty.add(Entry { window, bytes: (e.div_ceil(page) - s / page) * page, buffered });
            }
            // The newest window stays dirty whatever it holds: a stream is still filling it.
            let mut start = Vec::new();
            while inner.dirty.bytes > self.max_dirty && inner.dirty.windows.len() > 1 {
                let e = inner.dirty.pop().unwrap();
                start.push(e.window);
                // Written again while under writeback: started again, listed once.
                inner.writeback.add(e);
            }
            let mut wait = Vec::new();
            while inner.writeback.bytes > self.max_writeback {
                wait.push(inner.writeback.pop().unwrap());
            }
            (start, wait)
        };
        // With DONTCACHE the kernel has started writeback already; this then finds nothing
        // dirty and returns at once.
        // An error still lets the windows already taken off the queue be waited for and
        // evicted (nothing else would); the first error is returned.
        let mut first_err = None;
        for w in start {
            if let Err(e) = sys::sync_file_range(fd, w * WINDOW, WINDOW, sys::SFR_WRITE) {
                first_err.get_or_insert(e);
            }
        }
        let waited = self.wait_and_evict(fd, wait);
        match first_err {
            Some(e) => Err(e),
            None => waited,
        }
    }

    /// Stops checking for pages left behind (the caller has switched away from DONTCACHE).
    pub fn stop_verifying(&self) {
        self.verify.store(false, Ordering::Relaxed);
    }

    /// Waits for and evicts every window (flush, error). A window whose pages outlived the
    /// eviction is queued again (see [`Self::wait_and_evict`]).
    pub fn drain(&self, fd: BorrowedFd) -> io::Result<Outcome> {
        let all: Vec<Entry> = {
            let mut inner = self.inner.lock().unwrap();
            let mut all: Vec<Entry> = inner.writeback.take_all().collect();
            all.extend(inner.dirty.take_all());
            all.sort_unstable_by_key(|e| e.window);
            all.dedup_by(|b, a| {
                let same = a.window == b.window;
                if same {
                    a.buffered |= b.buffered;
                }
                same
            });
            all
        };
        self.wait_and_evict(fd, all)
    }

    /// [`Self::drain`] at the end of a job (also on error and Ctrl-C): drains again, a few
    /// milliseconds apart, while windows are queued again because pages outlived their
    /// eviction. Returns the first pass's outcome.
    pub fn drain_at_end(&self, fd: BorrowedFd) -> io::Result<Outcome> {
        let first = self.drain(fd);
        for pause_ms in [1, 4, 16] {
            if self.inner.lock().unwrap().dirty.windows.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(pause_ms));
            let _ = self.drain(fd);
        }
        first
    }

    /// Waits for each window's writeback and evicts the job's pages in it. DONTNEED leaves a
    /// page it cannot drop at that moment (locked, mapped or otherwise referenced; seen with
    /// `--coalesce`, whose FLUSHes evict windows the background write-back is writing into:
    /// docs/benchmarks/runs/code-notes.md#wait_and_evict), so each evicted range is looked at
    /// again (cachestat) and a window with pages left is queued again, for the next drain.
    /// Without cachestat nothing is looked at.
    fn wait_and_evict(&self, fd: BorrowedFd, windows: Vec<Entry>) -> io::Result<Outcome> {
        let mut outcome = Outcome::default();
        let mut first_err = None;
        let mut stuck = Vec::new();
        for Entry { window: w, buffered, .. } in windows {
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
            let ours = |b: u64| self.classes.ours(b);
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
                    && !buffered
                    && sys::cachestat(fd, off, len).is_ok_and(|s| s.cached > 0)
                {
                    outcome.pages_left = true;
                }
                super::footprint::drop_range(fd, off, len);
                if stuck.last() != Some(&w) && sys::cachestat(fd, off, len).is_ok_and(|s| s.cached > 0) {
                    stuck.push(w);
                }
            }
        }
        if !stuck.is_empty() {
            // Queued as buffered (pages found there later say nothing about DONTCACHE), and
            // first in line: they are older than anything queued, and the newest window, which
            // a stream may still be filling, must stay last.
            let mut inner = self.inner.lock().unwrap();
            for window in stuck {
                inner.dirty.requeue(window);
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn queued(wb: &WriteBehind) -> (Vec<u64>, Vec<u64>) {
        let inner = wb.inner.lock().unwrap();
        let ids = |q: &Queue| q.windows.iter().map(|e| e.window).collect();
        (ids(&inner.dirty), ids(&inner.writeback))
    }

    #[test]
    fn a_block_that_cannot_be_checked_counts_as_cached_before() {
        // cachestat fails on an O_PATH descriptor (EBADF): the job must not take the block
        // for its own.
        use std::os::unix::fs::OpenOptionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let opath = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_PATH).open(&path).unwrap();
        let c = Classes::default();
        assert!(c.classify(opath.as_fd(), 0, 4096).is_err());
        assert!(!c.ours(0), "an unchecked block would be evicted");
        // A block checked empty is the job's.
        let f = tempfile::tempfile().unwrap();
        f.set_len(8 << 20).unwrap();
        c.classify(f.as_fd(), 4 << 20, 4096).unwrap();
        assert!(c.ours(2));
    }

    #[test]
    fn a_stream_starts_a_window_when_the_third_begins_and_waits_two_behind() {
        let f = tempfile::tempfile().unwrap();
        let wb = WriteBehind::new(false, Default::default());
        let chunk = vec![1u8; 1 << 20];
        let mut at = 0;
        let mut write_through = |end: u64| {
            while at < end {
                std::os::unix::fs::FileExt::write_all_at(&f, &chunk, at).unwrap();
                wb.after_write(f.as_fd(), at, chunk.len() as u64, true).unwrap();
                at += chunk.len() as u64;
            }
        };
        write_through(2 * WINDOW);
        assert_eq!(queued(&wb), (vec![0, 1], vec![]));
        write_through(2 * WINDOW + (1 << 20));
        assert_eq!(queued(&wb), (vec![1, 2], vec![0]));
        write_through(4 * WINDOW + (1 << 20));
        assert_eq!(queued(&wb), (vec![3, 4], vec![1, 2]), "window 0 waited for and evicted");
    }

    #[test]
    fn scattered_small_writes_wait_for_nothing_until_their_pages_add_up() {
        let f = tempfile::tempfile().unwrap();
        let wb = WriteBehind::new(false, Default::default());
        // 1 KiB into each of 64 windows (512 MiB apart from first to last): 64 pages.
        for i in 0..64u64 {
            let at = i * WINDOW + 3072;
            std::os::unix::fs::FileExt::write_all_at(&f, &[2u8; 1024], at).unwrap();
            wb.after_write(f.as_fd(), at, 1024, true).unwrap();
        }
        let (dirty, writeback) = queued(&wb);
        assert_eq!((dirty.len(), writeback.len()), (64, 0));
        wb.drain(f.as_fd()).unwrap();
        assert_eq!(queued(&wb), (vec![], vec![]));
    }
    /// A temporary file on a filesystem where DONTNEED drops clean written pages (not tmpfs,
    /// which keeps them): `None` where it does not, or without cachestat.
    fn evictable_tempfile() -> Option<std::fs::File> {
        let f = tempfile::tempfile().unwrap();
        f.set_len(2 * WINDOW).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &[1u8; 4096], 0).unwrap();
        f.sync_data().unwrap();
        sys::fadvise(f.as_fd(), 0, 4096, sys::Advice::DontNeed).unwrap();
        if !matches!(sys::cached_pages(f.as_fd(), 0, 4096), Ok(0)) {
            eprintln!("skipped: written pages cannot be evicted here (or no cachestat)");
            return None;
        }
        Some(f)
    }

    /// Maps the page at `at` and reads it in (DONTNEED leaves mapped pages alone: it stands in
    /// for a page a write or a DONTCACHE completion holds for a moment).
    fn map_page(f: &std::fs::File, at: u64) -> sys::FileMapping {
        let map = sys::FileMapping::new(f.as_fd(), at, 4096).unwrap();
        assert_eq!(map.read_byte(0), 3);
        map
    }

    /// A write of one page into window 1 through a fresh tracker, and that page mapped:
    /// (file, tracker, its offset, the mapping).
    fn held_page() -> Option<(std::fs::File, WriteBehind, u64, sys::FileMapping)> {
        let f = evictable_tempfile()?;
        let wb = WriteBehind::new(false, Default::default());
        let at = WINDOW + 8192;
        std::os::unix::fs::FileExt::write_all_at(&f, &[3u8; 4096], at).unwrap();
        wb.after_write(f.as_fd(), at, 4096, true).unwrap();
        let map = map_page(&f, at);
        Some((f, wb, at, map))
    }

    /// A window whose pages outlive the eviction is queued again, first in line, and evicted
    /// by a later drain.
    #[test]
    fn a_window_with_pages_left_after_eviction_is_evicted_later() {
        let Some((f, wb, at, map)) = held_page() else { return };
        wb.drain(f.as_fd()).unwrap();
        assert_eq!(sys::cached_pages(f.as_fd(), at, 4096).unwrap(), 1, "the mapped page was evicted");
        assert_eq!(queued(&wb), (vec![1], vec![]), "the window was not queued again");
        // A later write into window 0 queues behind it: the re-queued window is the older.
        std::os::unix::fs::FileExt::write_all_at(&f, &[4u8; 4096], 4096).unwrap();
        wb.after_write(f.as_fd(), 4096, 4096, true).unwrap();
        assert_eq!(queued(&wb), (vec![1, 0], vec![]));
        drop(map); // unmaps the page
        wb.drain(f.as_fd()).unwrap();
        assert_eq!(sys::cached_pages(f.as_fd(), 0, 2 * WINDOW).unwrap(), 0, "pages left after the drain");
        assert_eq!(queued(&wb), (vec![], vec![]));
    }

    /// At the end of a job, a page held during the first drain is evicted by a retry once it
    /// is let go: here another thread unmaps it as soon as the first drain has queued its
    /// window again.
    #[test]
    fn the_last_drain_retries_pages_held_for_a_moment() {
        let Some((f, wb, _, map)) = held_page() else { return };
        std::thread::scope(|s| {
            s.spawn(|| {
                // Queued again: an entry of no bytes (the first one had the write's). Given up
                // after 10 s, so that a drain that never queues again fails, not hangs.
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while !wb.inner.lock().unwrap().dirty.windows.iter().any(|e| e.bytes == 0)
                    && std::time::Instant::now() < deadline
                {
                    std::thread::yield_now();
                }
                drop(map); // unmaps the page
            });
            wb.drain_at_end(f.as_fd()).unwrap();
        });
        assert_eq!(sys::cached_pages(f.as_fd(), 0, 2 * WINDOW).unwrap(), 0, "pages left at the end");
        assert_eq!(queued(&wb), (vec![], vec![]));
    }
}
