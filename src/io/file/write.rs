//! Writes by the chosen mechanism (small neutral-mode writes through the cache, or straight
//! to the disk where that saves a page read), changes the filesystem makes in place (holes,
//! zeroed ranges), and the one fallback when the write mechanism fails for good.

use std::io;
use std::sync::atomic::Ordering;

use super::{
    footprint, partial_pages, partial_units, write_full, PolicyFile, PAGE, PAGE_LOCK_BITS, SMALL_WRITE,
};
use crate::error::{Error, Op, Result};
use crate::io::policy::{write_fallback, CacheMode, WriteMech};
use crate::io::sys;

impl PolicyFile {
    /// Starts reading the pages a coming write of `[offset, offset+len)` overwrites only in
    /// part ([`crate::backend::Backend::will_write`]). Not for O_DIRECT writes, which read
    /// nothing; the pages read leave the cache with the write, by the write mechanism's own
    /// eviction (and, should the write not come, by `finish`, which covers touched ranges).
    pub fn will_write(&self, offset: u64, len: u64) {
        if len == 0 || self.write_mech() == WriteMech::Direct {
            return;
        }
        let pages = partial_pages(offset, len);
        // Nor for a small write that will go direct: the read is what it saves.
        if self.direct_pays(self.small_partial_pages(self.write_mech(), offset, len), offset, len) {
            return;
        }
        // Before the pages are read: blocks holding none now are the job's, and write-behind
        // evicts them (the read-ahead pages with the written ones).
        self.classify_before_write(offset, len);
        for p in pages.into_iter().flatten() {
            self.touch(p, PAGE);
            let _ = sys::fadvise(self.fd(), p, PAGE, sys::Advice::WillNeed);
        }
    }

    /// The pages a neutral-mode write below [`SMALL_WRITE`] through the cache with `mech`
    /// covers in part: the candidates for [`Self::direct_pays`]; none otherwise.
    fn small_partial_pages(&self, mech: WriteMech, offset: u64, len: u64) -> [Option<u64>; 2] {
        let buffered = matches!(mech, WriteMech::WriteBehind | WriteMech::DontCache);
        if buffered && self.mode == CacheMode::Neutral && len < SMALL_WRITE as u64 {
            partial_pages(offset, len)
        } else {
            [None; 2]
        }
    }

    /// In neutral mode with an evicting write mechanism, records which 2 MiB blocks of
    /// `[offset, offset+len)` hold pages now (cached before the job: never evicted), before
    /// anything of the job's lands there.
    fn classify_before_write(&self, offset: u64, len: u64) {
        if self.mode == CacheMode::Neutral
            && self.residency
            && matches!(self.write_mech(), WriteMech::DontCache | WriteMech::WriteBehind)
        {
            self.write_behind.classify(self.fd(), offset, len);
        }
    }

    /// Writes all of `buf` at `offset`; with `fua`, durably.
    ///
    /// Neutral mode writes with RWF_DONTCACHE, except writes below [`SMALL_WRITE`]: those go
    /// through the cache, or straight to the disk where that saves reading a page
    /// ([`Self::direct_pays`]).
    pub fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.write_sized(buf, offset, fua, false)
    }

    /// [`Self::write_at`] for a write that merges several small ones (`--coalesce` writing
    /// back a block): in neutral mode it is not cached until the next flush as a small write
    /// is, but written with RWF_DONTCACHE whatever its size. Writes that merged neighbours
    /// are few and carry many writes' bytes, so what [`SMALL_WRITE`] saves small writes
    /// (starting writeback in each one) costs little here, and the data is on its way to the
    /// disk before the FLUSH that usually follows, with nothing left to evict after it.
    pub fn write_merged_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.write_sized(buf, offset, fua, true)
    }

    fn write_sized(&self, buf: &[u8], offset: u64, fua: bool, merged: bool) -> Result<()> {
        if buf.is_empty() {
            // Nothing to write (an NBD client may send a zero-length WRITE). Under O_DIRECT
            // an unaligned one would otherwise read and rewrite its whole block.
            return Ok(());
        }
        let len = buf.len() as u64;
        let err = |e: io::Error| Error::io(Op::Write, e).path(&self.path).at(offset, len);
        self.touch(offset, len);
        let dsync = if fua { sys::RWF_DSYNC } else { 0 };
        self.classify_before_write(offset, len);
        loop {
            let mech = self.write_mech();
            // Small writes go through the cache even when DONTCACHE is the mechanism, and are
            // evicted by write-behind (see [`SMALL_WRITE`]); merged ones do not.
            let small = mech == WriteMech::DontCache && buf.len() < SMALL_WRITE && !merged;
            // Every write through the cache that covers part of a page holds the page's lock
            // in neutral mode, where small writes may go direct (see [`FileJob::page_locks`]).
            let pages = if self.mode == CacheMode::Neutral && mech != WriteMech::Direct {
                partial_pages(offset, len)
            } else {
                [None; 2]
            };
            let _locks = self.lock_pages(pages);
            if self.direct_pays(self.small_partial_pages(mech, offset, len), offset, len) {
                match self.write_direct(buf, offset, dsync) {
                    Ok(()) => return Ok(()),
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                        self.direct_small.store(false, Ordering::Relaxed);
                        self.note(format!(
                            "O_DIRECT refused a small write ({e}): small writes stay buffered"
                        ));
                    }
                    Err(e) => return Err(err(e)),
                }
            }
            let res = match mech {
                WriteMech::Buffered => write_full(self.fd(), buf, offset, dsync),
                WriteMech::DontCache if small => write_full(self.fd(), buf, offset, dsync),
                WriteMech::DontCache => {
                    let pre = footprint::dontcache_before(self.fd(), offset, len);
                    let res = write_full(self.fd(), buf, offset, dsync | sys::RWF_DONTCACHE);
                    if res.is_ok() {
                        footprint::dontcache_done(offset, len, pre);
                    }
                    res
                }
                WriteMech::WriteBehind => write_full(self.fd(), buf, offset, dsync),
                WriteMech::Direct => self.write_direct(buf, offset, dsync),
            };
            drop(_locks);
            match res {
                Err(e)
                    if mech == WriteMech::DontCache
                        && e.raw_os_error() == Some(libc::EOPNOTSUPP)
                        && self.demote_writes(mech, "DONTCACHE write refused") =>
                {
                    continue;
                }
                Err(e) => return Err(err(e)),
                Ok(()) => {}
            }
            if matches!(mech, WriteMech::DontCache | WriteMech::WriteBehind) {
                // No write below SMALL_WRITE is counted for the DONTCACHE check, merged or
                // not: merged ones were not checked before they were merged, and the many more
                // windows they touch would only add chances for a page whose drop the kernel
                // skipped to switch the file to write-behind. Evicted alike.
                let unchecked = mech == WriteMech::WriteBehind || buf.len() < SMALL_WRITE;
                match self.write_behind.after_write(self.fd(), offset, len, unchecked) {
                    Ok(o) if o.pages_left && self.write_mech() == WriteMech::DontCache => {
                        self.demote_writes(
                            WriteMech::DontCache,
                            "DONTCACHE writes left pages cached after writeback",
                        );
                    }
                    Ok(_) => {}
                    Err(e) => {
                        let e = Error::io(Op::Writeback, e).path(&self.path);
                        self.shared.latch.set(&e);
                        return Err(e);
                    }
                }
            }
            return Ok(());
        }
    }

    /// Runs `op`, a change the filesystem makes to `[offset, offset+len)` itself (fallocate
    /// punching a hole or zeroing a range), within the cache policy. A range that starts or
    /// ends inside a page makes the kernel read that page (if it was not cached) and zero part
    /// of it in the cache: 16 unaligned trims and zeroes left 32 pages cached. So those edge
    /// pages are classified first (cached before the job: left alone), locked like a partial
    /// write's (a direct small write into one must not race the kernel's buffered zeroing,
    /// see [`FileJob::page_locks`]), and handed to write-behind afterwards, which writes and
    /// evicts them with the job's other buffered writes.
    fn change_in_place(&self, offset: u64, len: u64, op: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        self.touch(offset, len);
        let mech = self.write_mech();
        // The kernel zeroes partial filesystem blocks through the cache, in whole pages.
        // (st_blksize is a preferred I/O size: capped at the largest block size filesystems
        // use, 64 KiB.)
        let unit = (sys::page_size() as u64).max(self.fs_block.min(64 << 10)).max(PAGE);
        let edges = if self.is_block || !matches!(mech, WriteMech::DontCache | WriteMech::WriteBehind) {
            [None; 2]
        } else {
            partial_units(offset, len, unit)
        };
        for &p in edges.iter().flatten() {
            self.classify_before_write(p, unit);
        }
        let locks = if self.mode == CacheMode::Neutral { self.lock_pages(edges) } else { Vec::new() };
        let res = op();
        drop(locks);
        // Also after a failure: the filesystem may have zeroed the edges before it failed.
        let mut first_err = None;
        for &p in edges.iter().flatten() {
            if let Err(e) = self.write_behind.after_write(self.fd(), p, unit, true) {
                first_err.get_or_insert(e);
            }
        }
        res?;
        if let Some(e) = first_err {
            let raw = e.raw_os_error().unwrap_or(libc::EIO);
            self.shared.latch.set(&Error::io(Op::Writeback, e).path(&self.path));
            return Err(io::Error::from_raw_os_error(raw));
        }
        Ok(())
    }

    /// The locks of `pages` (see [`FileJob::page_locks`]), taken in index order.
    fn lock_pages(&self, pages: [Option<u64>; 2]) -> Vec<std::sync::MutexGuard<'_, ()>> {
        let mut idx: Vec<usize> =
            pages.iter().flatten().map(|p| crate::io::spread(p / PAGE, PAGE_LOCK_BITS)).collect();
        idx.sort_unstable();
        idx.dedup();
        idx.into_iter().map(|i| self.shared.page_locks[i].lock().unwrap()).collect()
    }

    /// Whether a neutral-mode small write of part of a page (`pages`, from
    /// [`Self::small_partial_pages`]) goes straight to the disk (O_DIRECT) instead of through
    /// the cache. Through the cache, the kernel first reads a page that is not cached,
    /// synchronously and under the inode's lock: for 1 KiB writes over a written, uncached
    /// file that made the plain server 2-3x slower than qemu-nbd `--cache=none`
    /// (docs/benchmarks/runs/coalesce.md). Direct when the write is aligned for O_DIRECT and
    /// - the file has no holes ([`FileJob::holes`]): a page in a hole needs no read, while a
    ///   direct write of part of an unallocated block makes ext4 zero the rest and wait;
    /// - and no page of the write is cached, whole or in part (one cachestat): a cached page
    ///   needs no read, and must stay cached, while a direct write drops every cached page of
    ///   its range.
    ///
    /// Holes are judged for the whole file, not page by page: SEEK_DATA, SEEK_HOLE and FIEMAP,
    /// asked for each write, took a strided write over a sparse file from 33k to 23-26k IOPS
    /// (4 writers; ext4 answers them under locks the writers and writeback take).
    fn direct_pays(&self, pages: [Option<u64>; 2], offset: u64, len: u64) -> bool {
        if pages == [None; 2]
            || !self.direct_small.load(Ordering::Relaxed)
            || self.shared.holes.load(Ordering::Relaxed)
        {
            return false;
        }
        if !offset.is_multiple_of(self.align) || !len.is_multiple_of(self.align) {
            return false;
        }
        let (start, end) = (offset / PAGE * PAGE, (offset + len).div_ceil(PAGE) * PAGE);
        matches!(sys::cached_pages(self.fd(), start, end - start), Ok(0))
    }

    /// Deallocates `[offset, offset+len)` of a regular file (`FALLOC_FL_PUNCH_HOLE`), which
    /// then reads as zeroes.
    pub fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        self.made_holes();
        let flags = sys::FALLOC_PUNCH_HOLE | sys::FALLOC_KEEP_SIZE;
        self.change_in_place(offset, len, || sys::fallocate(self.fd(), flags, offset, len))?;
        self.known_data().forget(offset, len);
        Ok(())
    }

    /// Zeroes `[offset, offset+len)` of a regular file as unwritten extents
    /// (`FALLOC_FL_ZERO_RANGE`): like holes, they need no read before a write into them.
    pub fn zero_range(&self, offset: u64, len: u64) -> io::Result<()> {
        self.made_holes();
        let flags = sys::FALLOC_ZERO_RANGE | sys::FALLOC_KEEP_SIZE;
        self.change_in_place(offset, len, || sys::fallocate(self.fd(), flags, offset, len))
    }

    /// Allocates `[0, len)` of a regular file as unwritten extents (`--preallocate`), which
    /// need no read before a write either: like holes.
    pub fn allocate(&self, len: u64) -> io::Result<()> {
        self.made_holes();
        sys::fallocate(self.fd(), 0, 0, len)
    }

    /// Sets the size of a regular file; bytes past the old end are a hole.
    pub fn set_len(&self, len: u64) -> io::Result<()> {
        let grows = self.file.metadata()?.len() < len;
        self.file.set_len(len)?;
        if grows {
            self.made_holes();
        }
        self.known_data().forget(len, u64::MAX);
        Ok(())
    }

    /// Says that the file may have holes from now on (a zero or trim, a file extended or
    /// preallocated): small writes stay buffered.
    fn made_holes(&self) {
        self.shared.holes.store(true, Ordering::Relaxed);
    }

    /// Falls back from write mechanism `from` for good ([`write_fallback`]), saying `why`;
    /// false if there is nothing to fall back to.
    fn demote_writes(&self, from: WriteMech, why: &str) -> bool {
        let Some(to) = write_fallback(from) else { return false };
        self.write_mech.store(to as u8, Ordering::Relaxed);
        self.write_behind.stop_verifying();
        self.note(format!("{why}: switching writes to {to}"));
        true
    }
}
