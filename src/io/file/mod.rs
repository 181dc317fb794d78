//! `PolicyFile`: a file or block device whose reads and writes follow a cache policy.
//!
//! This is where `--cache=MODE` becomes system calls. The backends (`backend::file`) add the
//! rest of the backend contract (zero, trim, extents) on top of it.
//!
//! - [`open`](self::open): the probe (RWF_DONTCACHE, cachestat, O_DIRECT) and the one choice of
//!   mechanisms it feeds ([`super::policy::choose`]);
//! - `read`: reads by the chosen mechanism, and the fallback when it fails for good;
//! - `write`: writes, zeroes and trims in place, and the write fallback;
//! - `direct`: O_DIRECT reads and writes, with bounce buffers and read-modify-write.
//!
//! What every open of one file shares is a [`FileJob`]. A mechanism changes after the open
//! only through [`super::policy::read_fallback`] and [`super::policy::write_fallback`].

mod direct;
mod open;
mod read;
mod write;

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::evict::{self, EvictBehind};
use super::footprint;
use super::policy::{CacheMode, Fadvise, ReadMech, WriteMech};
use super::sys::{self, CacheStat};
use super::writebehind::WriteBehind;
use crate::error::{Error, Op, Result, Sticky};

pub(crate) use open::read_ahead_bytes;

/// Most bytes of blocks the evict-behind tracker holds before evicting the least recently
/// used (readers that never finish a block, readahead spill): the neutral footprint bound.
const EVICT_BEHIND_MAX: u64 = 96 << 20;

/// How to open a `PolicyFile`.
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenOptions {
    pub write: bool,
    pub create: bool,
    pub truncate: bool,
}

/// Writes smaller than this are made without RWF_DONTCACHE in neutral mode, and write-behind
/// evicts them (by the next flush at the latest). DONTCACHE starts writeback in the writer,
/// under ext4's inode lock, on every write: 1 KiB writes 1 in 4 KiB ran at 19k IOPS
/// with it and 39k without (4 fio jobs, flush every 64 writes), random 1 KiB and 4 KiB at
/// 15-17k and 19-22k. Large writes keep DONTCACHE: a 4 GiB nbdcopy of 256 KiB writes took
/// 3.5-3.8 s with it and 3.9-4.6 s with write-behind.
pub const SMALL_WRITE: usize = 64 << 10;

/// The page size the page-granular decisions assume (the kernel's on x86-64 and most arm64).
const PAGE: u64 = 4096;

/// [`FileJob::page_locks`]: 2^6 of them.
const PAGE_LOCK_BITS: u32 = 6;

/// [`FileJob::rmw_locks`], held over the read-modify-write of an unaligned `O_DIRECT` write: 2^6.
const RMW_LOCK_BITS: u32 = 6;

/// The pages a write of `[offset, offset+len)` covers only in part: the first and the last,
/// each where the write does not cover it whole (`None` otherwise, or when both are one page).
fn partial_pages(offset: u64, len: u64) -> [Option<u64>; 2] {
    partial_units(offset, len, PAGE)
}

/// The starts of the `unit`-aligned pieces `[offset, offset+len)` covers only in part.
fn partial_units(offset: u64, len: u64, unit: u64) -> [Option<u64>; 2] {
    let end = offset + len;
    if len == 0 {
        return [None; 2];
    }
    let head = (!offset.is_multiple_of(unit)).then_some(offset / unit * unit);
    let tail_unit = (end - 1) / unit * unit;
    let tail = (!end.is_multiple_of(unit) && Some(tail_unit) != head).then_some(tail_unit);
    [head, tail]
}

/// What every open of one file in one job shares: the latched write error, the locks
/// that serialise read-modify-write of a block (a server opens one fd per connection; these
/// must still be one per export), the locks of pages written in part, and the last data
/// extent found.
pub struct FileJob {
    latch: Sticky,
    rmw_locks: Vec<Mutex<()>>,
    /// Held over a neutral-mode write of part of a page, buffered or direct
    /// ([`PolicyFile::write_at`]; 2^[`PAGE_LOCK_BITS`] locks, one chosen by [`super::spread`]
    /// of the page number): a buffered write that read the page while a direct write
    /// to another part of it was in flight would cache (and later write back) the bytes the
    /// direct write replaced.
    page_locks: Vec<Mutex<()>>,
    /// The file may have holes (it had fewer blocks than its size when opened, or a zero or
    /// trim went through it since): no direct small writes ([`PolicyFile::direct_pays`]).
    holes: AtomicBool,
    known_data: KnownData,
    /// Which 2 MiB blocks held pages before the job (write-behind's record, one for all opens).
    classes: Arc<super::writebehind::Classes>,
    /// The first open's answer to the RWF_DONTCACHE probe (accepted, and a note if the read
    /// failed), reused by the later opens: each probe reads the file's first page, which stays
    /// cached for a moment, and a write that found it cached while other connections opened
    /// took its 2 MiB block for one cached before the job, and left it cached at exit
    /// (docs/benchmarks/runs/code-notes.md#dontcache_probe).
    dontcache_probe: OnceLock<(bool, Option<String>)>,
}

impl Default for FileJob {
    fn default() -> FileJob {
        FileJob {
            latch: Sticky::default(),
            rmw_locks: (0..1 << RMW_LOCK_BITS).map(|_| Mutex::new(())).collect(),
            page_locks: (0..1 << PAGE_LOCK_BITS).map(|_| Mutex::new(())).collect(),
            holes: AtomicBool::new(false),
            known_data: KnownData::default(),
            classes: Default::default(),
            dontcache_probe: OnceLock::new(),
        }
    }
}

/// The last data extent `SEEK_HOLE` reported, so that reads of a file that is all data do
/// not seek twice each. `SEEK_HOLE` costs a walk of the extent tree on ext4 and of every
/// cached page up to the next hole on tmpfs (4 GiB of pages per call for a full image), and
/// takes the file position lock that the fd's other users wait on.
///
/// Remembering data is always safe: a range that became a hole since reads back as zeroes,
/// which "data" allows. Holes are never remembered (a write fills them). Our own hole
/// punching forgets the range, so the server's answers stay exact for its own trims.
#[derive(Default)]
pub struct KnownData(Mutex<std::ops::Range<u64>>);

impl KnownData {
    /// Whether `[offset, offset + len)` lies inside the remembered data extent.
    pub fn covers(&self, offset: u64, len: u64) -> bool {
        let r = self.0.lock().unwrap();
        r.start <= offset && offset.saturating_add(len) <= r.end
    }

    pub fn learn(&self, data: std::ops::Range<u64>) {
        *self.0.lock().unwrap() = data;
    }

    /// Forgets the extent if it overlaps `[offset, offset + len)` (a hole was punched).
    pub fn forget(&self, offset: u64, len: u64) {
        let mut r = self.0.lock().unwrap();
        if offset < r.end && r.start < offset.saturating_add(len) {
            *r = 0..0;
        }
    }
}

/// Which mechanisms a file ended up using, and why (for `--verbose` and JSON output).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Mechanism {
    pub read: ReadMech,
    pub write: WriteMech,
    pub fadvise: Fadvise,
    pub notes: Vec<String>,
}

pub struct PolicyFile {
    path: PathBuf,
    file: File,
    /// An O_DIRECT fd on the same file, where a mechanism needs it.
    direct: Option<File>,
    /// O_DIRECT offset and length alignment.
    align: u64,
    /// The filesystem's block size (st_blksize): fallocate zeroes partial blocks in the cache.
    fs_block: u64,
    is_block: bool,
    mode: CacheMode,
    read_mech: AtomicU8,
    write_mech: AtomicU8,
    fadvise: Fadvise,
    evict: EvictBehind,
    /// Reads go through `evict` (evict-behind, or DONTCACHE with its readahead-spill guard).
    guard_reads: bool,
    /// cachestat answers for this file: pre-cached blocks can be told apart and kept.
    residency: bool,
    /// Small writes into part of an uncached page may go direct ([`Self::direct_pays`]): an
    /// O_DIRECT fd, cachestat, neutral mode and 4 KiB pages; off for good if O_DIRECT
    /// refuses one (EINVAL).
    direct_small: AtomicBool,
    write_behind: WriteBehind,
    shared: Arc<FileJob>,
    notes: Mutex<Vec<String>>,
    /// Lowest and highest byte touched (for `drop` mode's final eviction).
    touched_lo: AtomicU64,
    touched_hi: AtomicU64,
    finished: AtomicBool,
}

impl PolicyFile {
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn is_block(&self) -> bool {
        self.is_block
    }

    /// O_DIRECT alignment (also the natural block size to advertise).
    pub fn align(&self) -> u64 {
        self.align
    }

    pub fn mode(&self) -> CacheMode {
        self.mode
    }

    pub fn latch(&self) -> &Sticky {
        &self.shared.latch
    }

    /// The export's remembered data extent (see [`KnownData`]).
    pub fn known_data(&self) -> &KnownData {
        &self.shared.known_data
    }

    pub fn mechanism(&self) -> Mechanism {
        Mechanism {
            read: self.read_mech(),
            write: self.write_mech(),
            fadvise: self.fadvise,
            notes: self.notes.lock().unwrap().clone(),
        }
    }

    fn read_mech(&self) -> ReadMech {
        match self.read_mech.load(Ordering::Relaxed) {
            x if x == ReadMech::DontCache as u8 => ReadMech::DontCache,
            x if x == ReadMech::Direct as u8 => ReadMech::Direct,
            x if x == ReadMech::EvictBehind as u8 => ReadMech::EvictBehind,
            _ => ReadMech::Buffered,
        }
    }

    fn write_mech(&self) -> WriteMech {
        match self.write_mech.load(Ordering::Relaxed) {
            x if x == WriteMech::DontCache as u8 => WriteMech::DontCache,
            x if x == WriteMech::WriteBehind as u8 => WriteMech::WriteBehind,
            x if x == WriteMech::Direct as u8 => WriteMech::Direct,
            _ => WriteMech::Buffered,
        }
    }

    fn note(&self, note: String) {
        tracing::info!("{}: {note}", self.path.display());
        self.notes.lock().unwrap().push(note);
    }

    fn touch(&self, offset: u64, len: u64) {
        self.touched_lo.fetch_min(offset, Ordering::Relaxed);
        self.touched_hi.fetch_max(offset + len, Ordering::Relaxed);
    }

    /// Makes every completed write durable (`fdatasync`), or reports the error latched since.
    pub fn sync(&self) -> Result<()> {
        if let Err(e) = sys::fdatasync(self.fd()) {
            let e = Error::io(Op::Flush, e).path(&self.path);
            self.shared.latch.set(&e);
            return Err(e);
        }
        self.shared.latch.check_writes(Op::Flush, &self.path)?;
        // Everything is clean now: evicting the windows costs nothing and keeps the footprint
        // low between flushes.
        if let Err(e) = self.write_behind.drain(self.fd()) {
            let e = Error::io(Op::Writeback, e).path(&self.path);
            self.shared.latch.set(&e);
            return Err(e);
        }
        Ok(())
    }

    /// Waits for and evicts everything the policy says must go. Idempotent; also run on drop
    /// so errors and Ctrl-C clean up too.
    pub fn finish(&self) -> Result<()> {
        if self.finished.swap(true, Ordering::Relaxed) {
            return Ok(());
        }
        let drained = self.write_behind.drain_at_end(self.fd());
        self.evict.finish(self.fd());
        if self.mode == CacheMode::Drop {
            let lo = self.touched_lo.load(Ordering::Relaxed);
            let hi = self.touched_hi.load(Ordering::Relaxed);
            if lo < hi {
                // Round out to whole folios and cover the readahead window past the end.
                let start = lo / evict::BLOCK * evict::BLOCK;
                let end = hi.div_ceil(evict::BLOCK) * evict::BLOCK + (32 << 20);
                let _ = sys::sync_file_range(
                    self.fd(),
                    start,
                    end - start,
                    sys::SFR_WAIT_BEFORE | sys::SFR_WRITE | sys::SFR_WAIT_AFTER,
                );
                footprint::drop_range(self.fd(), start, end - start);
            }
        }
        drained.map(drop).map_err(|e| {
            let e = Error::io(Op::Writeback, e).path(&self.path);
            self.shared.latch.set(&e);
            e
        })
    }

    /// What the page cache holds of the whole file: cachestat, or on kernels without it the
    /// resident pages from mincore (only counted for files whose residency is visible). `None`
    /// where residency is unknown.
    pub fn cache_stat(&self) -> Option<CacheStat> {
        match sys::cachestat(self.fd(), 0, 0) {
            Ok(s) => Some(s),
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) && self.residency => {
                let cached = sys::mincore_cached_pages(self.fd(), 0, self.size().ok()?).ok()?;
                Some(CacheStat { cached, ..CacheStat::default() })
            }
            Err(_) => None,
        }
    }

    /// The size of the file or device now.
    pub fn size(&self) -> Result<u64> {
        if self.is_block {
            sys::block_size_bytes(self.fd()).map_err(|e| Error::io(Op::Size, e).path(&self.path))
        } else {
            Ok(self.file.metadata().map_err(|e| Error::io(Op::Stat, e).path(&self.path))?.len())
        }
    }
}

impl Drop for PolicyFile {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// Reads until `buf` is full or end of file.
fn read_full(fd: BorrowedFd, buf: &mut [u8], offset: u64, flags: i32) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        let n = sys::pread(fd, &mut buf[done..], offset + done as u64, flags)?;
        if n == 0 {
            break;
        }
        done += n;
    }
    Ok(done)
}

/// Writes all of `buf`.
fn write_full(fd: BorrowedFd, buf: &[u8], offset: u64, flags: i32) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let n = sys::pwrite(fd, &buf[done..], offset + done as u64, flags)?;
        if n == 0 {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        done += n;
    }
    Ok(())
}

#[cfg(test)]
mod known_data_tests {
    use super::KnownData;

    #[test]
    fn remembers_one_extent_and_forgets_it_on_overlap_only() {
        let k = KnownData::default();
        assert!(!k.covers(0, 1), "nothing is known at first");
        k.learn(4096..65536);
        assert!(k.covers(4096, 4096) && k.covers(8192, 57344));
        assert!(!k.covers(0, 8192) && !k.covers(60000, 8192));
        k.forget(65536, 4096);
        assert!(k.covers(4096, 4096), "a punch beside the extent keeps it");
        k.forget(60000, 1);
        assert!(!k.covers(4096, 4096), "a punch inside forgets it");
        k.learn(0..1 << 20);
        k.forget(u64::MAX - 1, u64::MAX);
        assert!(k.covers(0, 4096), "no overflow at the far end");
    }
}
