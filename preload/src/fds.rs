//! What the library knows of each file descriptor, in a fixed table of atomics: no allocation
//! and no lock on the data path, so a wrapper called from a signal handler, or in a thread while
//! another is inside one, never waits or corrupts anything. Every race can only leave pages
//! cached that could have been dropped, never drop pages that were cached before.
//!
//! A descriptor is looked at on its first data call (not at `open`: descriptors inherited
//! across `exec`, made by a shell's redirection or by `dup` are never seen opened). A regular
//! file opened without `O_DIRECT` is *tracked*: the blocks of [`BLOCK`] bytes that held any page
//! then are recorded in a bitmap (the first sight, before the program's first read or write
//! brings anything in), and a record goes to the run's log for `lightfoot run`'s final sweep.
//! Everything else (pipes, sockets, terminals, directories, O_DIRECT files) passes through.
//!
//! Evict-behind: when a call moves a descriptor off a block, that block's pages are dropped
//! unless it held pages at first sight. With writes, the pages of a block are dirty when it is
//! left; the drop starts their writeback, and once [`LAG`] blocks it left are pending (or the
//! run's `--max-cache` is reached) the writer waits for the writeback of the oldest and drops it
//! (write-behind, on a descriptor of the library's own: [`Slot::wait_and_drop`]). At `close` every block of the file not cached
//! at first sight is dropped (what readahead brought in past the last read included).

use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering::*};

use libc::c_int;
use lightfoot_record::{bitmap_len, BLOCK, SHIFT};

use crate::record;
use crate::sys;

/// How many blocks a writer has left whose writeback it has not waited for yet, at most: 8 MiB
/// of writeback in flight, enough to keep the device busy, little enough to bound what a writer
/// holds.
const LAG: usize = 4;

/// Write-behind's pending blocks (left by a writer, not yet waited for and dropped): counted
/// across every process of the run in a mapping of `LIGHTFOOT_RUN_DIR/pending` when
/// `--max-cache` is given ([`set_budget`]), else in this process.
static PENDING_LOCAL: AtomicU64 = AtomicU64::new(0);
static PENDING_SHARED: AtomicUsize = AtomicUsize::new(0);
/// `--max-cache` in blocks: when more are pending, a writer waits for its oldest first.
static BUDGET: AtomicU64 = AtomicU64::new(u64::MAX);

/// Sets the run's budget of pending blocks, and the shared counter (a mapping of at least
/// 8 bytes, 8-aligned, that lives as long as the process) if there is one.
pub fn set_budget(blocks: u64, shared: *mut u8) {
    if !shared.is_null() {
        PENDING_SHARED.store(shared as usize, Release);
    }
    BUDGET.store(blocks, Release);
}

fn pending() -> &'static AtomicU64 {
    let p = PENDING_SHARED.load(Acquire);
    if p == 0 {
        return &PENDING_LOCAL;
    }
    // SAFETY: set_budget's caller promised a live, aligned mapping of at least 8 bytes for the
    // process's lifetime; a shared mapping's atomics are atomic across processes.
    unsafe { &*(p as *const AtomicU64) }
}

/// One fewer pending block (never below zero: a race on a descriptor's ring can only make
/// writers wait sooner, not let the count wrap).
fn pending_done(n: u64) {
    let _ = pending().fetch_update(AcqRel, Acquire, |v| Some(v.saturating_sub(n)));
}

/// Descriptors at or above this pass through untracked.
pub const MAX_FDS: usize = 65536;

const UNKNOWN: u32 = 0;
const PASS: u32 = 1;
const TRACKED: u32 = 2;
/// Being looked at by another thread (or by the code a signal interrupted): pass through.
const BUSY: u32 = 3;

pub struct Slot {
    state: AtomicU32,
    dev: AtomicU64,
    ino: AtomicU64,
    /// The bitmap of blocks cached at first sight (an anonymous mapping of [`map_len`] bytes).
    map: AtomicUsize,
    /// Blocks at first sight: those at or past it held nothing then.
    blocks: AtomicU64,
    /// 1 + the block the last data call ended in; 0 before the first.
    cur: AtomicU64,
    /// A write went through this descriptor.
    wrote: AtomicU32,
    /// 1 + a descriptor of the library's own on the same file (0: none yet), for waiting on
    /// writeback: see [`Slot::wait_and_drop`].
    own: AtomicI32,
    /// Pages were cached at first sight but no bitmap could be made: every block counts as
    /// cached.
    all_cached: AtomicU32,
    /// The blocks this writer left and has not waited for, oldest first: 1 + block at
    /// `ring[i % LAG]` for `tail <= i < head`.
    ring: [AtomicU64; LAG],
    head: AtomicU64,
    tail: AtomicU64,
    /// Bytes read and written through this descriptor since its first sight.
    read: AtomicU64,
    written: AtomicU64,
    /// Pages this descriptor's drops took out of the cache (cachestat before and after each).
    evicted: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)] // only as the table's initialiser
const EMPTY: Slot = Slot {
    state: AtomicU32::new(UNKNOWN),
    dev: AtomicU64::new(0),
    ino: AtomicU64::new(0),
    map: AtomicUsize::new(0),
    blocks: AtomicU64::new(0),
    cur: AtomicU64::new(0),
    wrote: AtomicU32::new(0),
    own: AtomicI32::new(0),
    all_cached: AtomicU32::new(0),
    ring: [const { AtomicU64::new(0) }; LAG],
    head: AtomicU64::new(0),
    tail: AtomicU64::new(0),
    read: AtomicU64::new(0),
    written: AtomicU64::new(0),
    evicted: AtomicU64::new(0),
};

static SLOTS: [Slot; MAX_FDS] = [EMPTY; MAX_FDS];

fn slot(fd: c_int) -> Option<&'static Slot> {
    SLOTS.get(usize::try_from(fd).ok()?)
}

impl Slot {
    /// Whether `block` held pages at first sight.
    fn was_cached(&self, block: u64) -> bool {
        if block >= self.blocks.load(Relaxed) {
            return false;
        }
        let map = self.map.load(Relaxed) as *const u8;
        if map.is_null() {
            // No bitmap: nothing was cached at first sight, or the mapping failed (then keep
            // everything).
            return self.all_cached.load(Relaxed) != 0;
        }
        // SAFETY: `block < blocks` and the mapping holds `blocks` bits, so the bytes up to
        // `block`'s are in it; it stays mapped while the slot is TRACKED, and only `forget` (on
        // this descriptor's close) unmaps it.
        let bits = unsafe { std::slice::from_raw_parts(map, bitmap_len(block + 1)) };
        lightfoot_record::is_set(bits, block)
    }

    /// Drops the pages of `block` unless it held pages at first sight.
    fn drop_block(&self, fd: c_int, block: u64) {
        if !self.was_cached(block) {
            self.evict(fd, block << SHIFT, BLOCK);
        }
    }

    /// Drops the pages of `[off, off+len)` (`len` 0: to the end), counting what went: two
    /// cachestat calls a drop, about a microsecond each for 2 MiB.
    fn evict(&self, fd: c_int, off: u64, len: u64) {
        let before = sys::cached_pages(fd, off, len);
        sys::drop_pages(fd, off, len);
        if let (Ok(b), Ok(a)) = (before, sys::cached_pages(fd, off, len)) {
            self.evicted.fetch_add(b.saturating_sub(a), Relaxed);
        }
    }

    /// Drops every block of the file not cached at first sight, in runs, and everything past
    /// the blocks at first sight.
    fn drop_all(&self, fd: c_int) {
        let blocks = self.blocks.load(Relaxed);
        let mut run: Option<u64> = None;
        for b in 0..blocks {
            match (self.was_cached(b), run) {
                (false, None) => run = Some(b),
                (true, Some(s)) => {
                    self.evict(fd, s << SHIFT, (b - s) << SHIFT);
                    run = None;
                }
                _ => {}
            }
        }
        self.evict(fd, run.unwrap_or(blocks) << SHIFT, 0);
    }

    /// Waits for the writeback of `block` and drops it, unless it held pages at first sight.
    /// The wait runs on a descriptor of the library's own (the file reopened through
    /// `/proc/self/fd`): waiting reports a writeback error to the open file description it
    /// waits on and marks the error seen there, so on the program's own descriptor it would
    /// take from the program the error its `fsync` must get. On another description the
    /// program's is untouched. Where the file cannot be reopened (a mode that forbids reading
    /// to a user who is not root, no /proc), there is no wait: the pages stay until the final
    /// sweep.
    fn wait_and_drop(&self, fd: c_int, block: u64) {
        if self.was_cached(block) {
            return;
        }
        let mut own = self.own.load(Acquire);
        if own == 0 {
            let Some(o) = sys::reopen(fd) else { return };
            own = match self.own.compare_exchange(0, o + 1, AcqRel, Acquire) {
                Ok(_) => o + 1,
                Err(other) => {
                    sys::close_own(o);
                    other
                }
            };
        }
        sys::wait_written(own - 1, block << SHIFT, BLOCK);
        self.evict(own - 1, block << SHIFT, BLOCK);
    }

    /// Write-behind after a writer left `block` (its writeback started by the drop): it joins
    /// the blocks pending; the oldest is waited for and dropped when [`LAG`] are, and while
    /// the run has more pending than `--max-cache` allows.
    fn behind(&self, fd: c_int, block: u64) {
        if self.was_cached(block) {
            return;
        }
        if self.head.load(Relaxed) - self.tail.load(Relaxed) >= LAG as u64 {
            self.wait_oldest(fd);
        }
        let h = self.head.load(Relaxed);
        self.ring[h as usize % LAG].store(block + 1, Relaxed);
        self.head.store(h + 1, Relaxed);
        pending().fetch_add(1, AcqRel);
        while pending().load(Acquire) > BUDGET.load(Relaxed)
            && self.head.load(Relaxed) > self.tail.load(Relaxed)
        {
            self.wait_oldest(fd);
        }
    }

    fn wait_oldest(&self, fd: c_int) {
        let t = self.tail.load(Relaxed);
        if t >= self.head.load(Relaxed) {
            return;
        }
        let b = self.ring[t as usize % LAG].swap(0, Relaxed);
        self.tail.store(t + 1, Relaxed);
        pending_done(1);
        if b != 0 {
            self.wait_and_drop(fd, b - 1);
        }
    }

    /// Back to unknown, the bitmap unmapped (`unmap`) or left mapped: where another thread may
    /// be reading it right now (a descriptor found to name another file mid-run), a few KiB are
    /// leaked rather than risk that.
    fn forget(&self, unmap: bool) {
        // Pending blocks are the close's to drop (and the final sweep's, if their writeback
        // still runs): they leave the count.
        let (h, t) = (self.head.swap(0, Relaxed), self.tail.swap(0, Relaxed));
        pending_done(h.saturating_sub(t));
        let map = self.map.swap(0, AcqRel);
        if map != 0 && unmap {
            // SAFETY: the mapping was made by `adopt` for this slot, of the length `map_len`
            // gives for its blocks, and nothing reads it once the pointer is swapped out
            // (readers load it afresh each time).
            unsafe { sys::unmap(map as *mut u8, map_len(self.blocks.load(Relaxed))) };
        }
        self.cur.store(0, Relaxed);
        self.wrote.store(0, Relaxed);
        let own = self.own.swap(0, AcqRel);
        if own > 0 {
            sys::close_own(own - 1);
        }
        self.state.store(UNKNOWN, Release);
    }
}

/// The slot of `fd` if the descriptor is tracked, looking at it first if it is new.
pub fn tracked(fd: c_int) -> Option<&'static Slot> {
    let s = slot(fd)?;
    match s.state.load(Acquire) {
        TRACKED => Some(s),
        UNKNOWN => adopt(fd, s).then_some(s),
        _ => None,
    }
}

/// Looks at a descriptor seen for the first time; whether it is now tracked.
fn adopt(fd: c_int, s: &Slot) -> bool {
    if !crate::active() || s.state.compare_exchange(UNKNOWN, BUSY, Acquire, Relaxed).is_err() {
        return false;
    }
    let verdict = look(fd, s);
    s.state.store(if verdict { TRACKED } else { PASS }, Release);
    verdict
}

fn look(fd: c_int, s: &Slot) -> bool {
    let Some(st) = sys::fstat(fd) else { return false };
    let Some(flags) = sys::status_flags(fd) else { return false };
    if st.st_mode & libc::S_IFMT != libc::S_IFREG || flags & (libc::O_DIRECT | libc::O_PATH) != 0 {
        return false;
    }
    let size = st.st_size.max(0) as u64;
    let blocks = size.div_ceil(BLOCK);
    let writable = flags & libc::O_ACCMODE != libc::O_RDONLY;
    // One look at the whole file first: a file with nothing cached (the common case) needs no
    // more, nor a bitmap.
    let cached = match sys::cached_pages(fd, 0, 0) {
        Ok(n) => n,
        Err(e) => {
            record::write(fd, &st, size, 0, lightfoot_record::not_covered(e, writable), &[]);
            return false;
        }
    };
    let mut map = std::ptr::null_mut::<u8>();
    if cached > 0 && blocks > 0 {
        let len = map_len(blocks);
        map = sys::map(len);
        if !map.is_null() {
            // SAFETY: `map` is a fresh, zeroed, writable mapping of `len` bytes, ours alone.
            let bits = unsafe { std::slice::from_raw_parts_mut(map, len) };
            classify(fd, bits, blocks, cached, size);
        }
    }
    s.dev.store(st.st_dev, Relaxed);
    s.ino.store(st.st_ino, Relaxed);
    s.blocks.store(blocks, Relaxed);
    s.map.store(map as usize, Release);
    s.cur.store(0, Relaxed);
    s.wrote.store(0, Relaxed);
    s.read.store(0, Relaxed);
    s.written.store(0, Relaxed);
    s.evicted.store(0, Relaxed);
    s.all_cached.store(u32::from(map.is_null() && cached > 0), Relaxed);
    let bits: &[u8] = if map.is_null() {
        &[]
    } else {
        // SAFETY: as above; read only from here on.
        unsafe { std::slice::from_raw_parts(map, bitmap_len(blocks)) }
    };
    let flags = if writable { lightfoot_record::WRITABLE } else { 0 }
        | if map.is_null() && cached > 0 { lightfoot_record::ALL_CACHED } else { 0 };
    record::write(fd, &st, size, cached, flags, bits);
    true
}

/// Sets the bits of the file's blocks that hold pages (`cached` in all), by
/// `lightfoot_record::scan`. A failed look counts as one page cached: the halving goes on and
/// the blocks are taken for cached (their pages kept).
fn classify(fd: c_int, bits: &mut [u8], blocks: u64, cached: u64, size: u64) {
    // Clipped to the file: a length of 0 would mean "to the end" to cachestat.
    let mut look = |off: u64, len: u64| {
        let len = (off + len).min(size).saturating_sub(off).max(1);
        Some(sys::cached_pages(fd, off, len).unwrap_or(1))
    };
    lightfoot_record::scan(0, blocks, cached, &mut look, &mut |b, _| lightfoot_record::set(bits, b));
}

/// After a data call on a tracked descriptor that moved bytes `[start, end)`: the blocks it is
/// done with are dropped. The call ends in block `last`, which stays; the block the previous
/// call ended in is left unless it is `last` (a read straddling a boundary leaves the block it
/// began in), and so are the blocks the call went through whole before `last`.
pub fn moved(fd: c_int, s: &Slot, start: u64, end: u64, write: bool) {
    if end <= start {
        return;
    }
    if write {
        s.wrote.store(1, Relaxed);
        s.written.fetch_add(end - start, Relaxed);
    } else {
        s.read.fetch_add(end - start, Relaxed);
    }
    let (first, last) = (start >> SHIFT, (end - 1) >> SHIFT);
    let prev = s.cur.swap(last + 1, Relaxed);
    let left_prev = prev != 0 && prev - 1 != last;
    if !left_prev && first == last {
        return;
    }
    // A block boundary (once per 2 MiB for a sequential reader): check that the descriptor is
    // still the file first seen. A close the library did not see (glibc's internal ones) may
    // have given the number to another file, whose cached pages the old bitmap knows nothing of.
    if !same_file(fd, s) {
        s.forget(false);
        return;
    }
    let wrote = s.wrote.load(Relaxed) != 0;
    let left = left_prev
        .then(|| prev - 1)
        .into_iter()
        .chain((first..last).filter(|&b| !(left_prev && b == prev - 1)));
    for b in left {
        // Clean pages go; dirty ones start their writeback.
        s.drop_block(fd, b);
        // Write-behind: a writer waits for the writeback of the blocks it left, oldest first,
        // so its dirty pages stay within LAG blocks (and the run's within --max-cache)
        // instead of piling up.
        if wrote {
            s.behind(fd, b);
        }
    }
}

/// The length of the bitmap mapping for `blocks` blocks: a bit each, in whole pages.
fn map_len(blocks: u64) -> usize {
    bitmap_len(blocks).next_multiple_of(4096)
}

fn same_file(fd: c_int, s: &Slot) -> bool {
    sys::fstat(fd).is_some_and(|st| st.st_dev == s.dev.load(Relaxed) && st.st_ino == s.ino.load(Relaxed))
}

/// Before `fd` is closed (or replaced by `dup2`): drops every block of its file not cached at
/// first sight, and forgets it.
pub fn finish(fd: c_int) {
    let Some(s) = slot(fd) else { return };
    match s.state.load(Acquire) {
        TRACKED => {
            if s.state.compare_exchange(TRACKED, BUSY, Acquire, Relaxed).is_err() {
                return;
            }
            if same_file(fd, s) {
                s.drop_all(fd);
            }
            let (read, written) = (s.read.load(Relaxed), s.written.load(Relaxed));
            let evicted = s.evicted.load(Relaxed);
            if read + written + evicted > 0 {
                record::done(s.dev.load(Relaxed), s.ino.load(Relaxed), read, written, evicted);
            }
            s.forget(true);
        }
        PASS => s.state.store(UNKNOWN, Release),
        _ => {}
    }
}

/// At exit: every descriptor still tracked is finished (programs often leave them open).
pub fn finish_all() {
    for (fd, s) in SLOTS.iter().enumerate() {
        if s.state.load(Relaxed) == TRACKED {
            finish(fd as c_int);
        }
    }
}
