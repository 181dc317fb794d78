//! `PolicyFile`: a file or block device whose reads and writes follow a cache policy.
//!
//! This is where `--cache=MODE` becomes system calls. The backends (`backend::file`) add the
//! rest of the backend contract (zero, trim, extents) on top of it.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::evict::{self, EvictBehind};
use super::footprint;
use super::policy::{choose, CacheMode, Choice, Fadvise, Probe, ReadMech, Tuning, WriteMech};
use super::sys::{self, Advice, AlignedBuf, CacheStat};
use super::writebehind::WriteBehind;
use crate::error::{io_message, Error, ErrorKind, Op, Result, Sticky};

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

/// Does RWF_DONTCACHE work on this file? A one-byte read of its first page with the flag.
/// With a note when the read failed for another reason.
fn probe_dontcache(fd: BorrowedFd<'_>) -> (bool, Option<String>) {
    // Readahead off while probing: a one-byte read would otherwise load a readahead window
    // that the evict-behind residency check would then take for pre-cached pages.
    let _ = sys::fadvise(fd, 0, 0, Advice::Random);
    match sys::pread(fd, &mut [0u8; 1], 0, sys::RWF_DONTCACHE) {
        Ok(_) => (true, None),
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => (false, None),
        // The kernel checks the flag before any I/O: another error (an unreadable first
        // block) means the flag was accepted.
        Err(e) => (true, Some(format!("probe read failed ({}); RWF_DONTCACHE was accepted", io_message(&e)))),
    }
}

impl PolicyFile {
    pub fn open(path: &Path, opts: OpenOptions, mode: CacheMode, tuning: &Tuning) -> Result<PolicyFile> {
        Self::open_shared(path, opts, mode, tuning, Arc::default())
    }

    /// Opens another fd on a file, sharing the error latch and block locks with the other
    /// opens that got the same `shared`.
    pub fn open_shared(
        path: &Path,
        opts: OpenOptions,
        mode: CacheMode,
        tuning: &Tuning,
        shared: Arc<FileJob>,
    ) -> Result<PolicyFile> {
        let open_err = |e: io::Error| Error::io(Op::Open, e).path(path);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(opts.write)
            .create(opts.create)
            .truncate(opts.truncate)
            .open(path)
            .map_err(open_err)?;
        let meta = file.metadata().map_err(open_err)?;
        let is_block = meta.file_type().is_block_device();
        // Fewer blocks than bytes: holes somewhere (or a file being written). Fully written
        // files count as whole even when a few extents are preallocated (unwritten).
        if !is_block && meta.blocks() * 512 < meta.len() {
            shared.holes.store(true, Ordering::Relaxed);
        }
        if !is_block && !meta.is_file() {
            return Err(Error::new(ErrorKind::InvalidInput, Op::Open)
                .path(path)
                .detail("not a regular file or block device"));
        }
        let fd = file.as_fd();
        let mut pre_notes = Vec::new();
        let (dontcache, note) = shared.dontcache_probe.get_or_init(|| probe_dontcache(fd)).clone();
        pre_notes.extend(note);
        let cachestat = match sys::cachestat(fd, 0, 4096) {
            Ok(_) => true,
            // Kernels before 6.5: mincore instead ([`sys::cached_pages`]), where it tells the
            // truth (for files this user may not write it reports every page cached).
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) && sys::mincore_is_truthful(fd) => {
                pre_notes.push("no cachestat on this kernel: residency from mincore".to_string());
                true
            }
            Err(e) => {
                let why = if e.raw_os_error() == Some(libc::EPERM) {
                    "cachestat denied (the file is not writable by this user): residency unknown".to_string()
                } else {
                    format!("cachestat unavailable ({}): residency unknown", io_message(&e))
                };
                tracing::info!("{}: {why}", path.display());
                pre_notes.push(why);
                false
            }
        };
        let probe = Probe { is_block, dontcache, cachestat };
        let Choice { mut read, write, mut fadvise, mut notes } = choose(mode, probe, tuning);
        notes.splice(0..0, pre_notes);

        let wants_direct =
            read == ReadMech::Direct || write == WriteMech::Direct || read == ReadMech::DontCache;
        let direct = if wants_direct {
            match std::fs::OpenOptions::new()
                .read(true)
                .write(opts.write)
                .custom_flags(libc::O_DIRECT)
                .open(path)
            {
                Ok(f) => Some(f),
                Err(e) if read == ReadMech::DontCache && write != WriteMech::Direct => {
                    notes.push(format!(
                        "O_DIRECT unavailable ({}): no fallback if DONTCACHE fails",
                        io_message(&e)
                    ));
                    None
                }
                // O_DIRECT chosen for speed, not forced (squashfs and iso9660 refuse it):
                // DONTCACHE instead where it works, else evict-behind where residency is known.
                Err(e)
                    if read == ReadMech::Direct
                        && mode == CacheMode::Neutral
                        && tuning.read.is_none()
                        && write != WriteMech::Direct =>
                {
                    if dontcache && !tuning.no_dontcache {
                        read = ReadMech::DontCache;
                        notes.push(format!(
                            "O_DIRECT unavailable ({}): reading with DONTCACHE",
                            io_message(&e)
                        ));
                    } else if cachestat && !tuning.no_cachestat {
                        read = ReadMech::EvictBehind;
                        fadvise = tuning.fadvise.unwrap_or(Fadvise::Random);
                        notes.push(format!(
                            "O_DIRECT and RWF_DONTCACHE unavailable ({}): reading with evict-behind",
                            io_message(&e)
                        ));
                    } else {
                        return Err(Error::io(Op::Open, e).path(path).detail(
                            "O_DIRECT; with neither RWF_DONTCACHE nor cachestat here, a read cannot \
                             leave the page cache as it found it: use --cache drop or --cache keep",
                        ));
                    }
                    None
                }
                Err(e) => return Err(Error::io(Op::Open, e).path(path).detail("O_DIRECT")),
            }
        } else {
            None
        };
        let align = direct
            .as_ref()
            .and_then(|f| sys::dio_alignment(f.as_fd()))
            .map(|(mem, off)| u64::from(mem.max(off)))
            .unwrap_or(sys::BUF_ALIGN as u64)
            .clamp(512, sys::BUF_ALIGN as u64);
        let advice = match fadvise {
            Fadvise::Normal => Advice::Normal,
            Fadvise::Sequential => Advice::Sequential,
            Fadvise::Random => Advice::Random,
        };
        let _ = sys::fadvise(fd, 0, 0, advice);
        tracing::debug!("{}: read {read}, write {write}, fadvise {fadvise}", path.display());
        let guard_reads = match read {
            ReadMech::EvictBehind => true,
            ReadMech::DontCache if cachestat && !tuning.no_cachestat => true,
            ReadMech::DontCache => {
                notes.push("readahead spill past the last read cannot be checked without cachestat".into());
                false
            }
            _ => false,
        };
        let meta_dev = if is_block { meta.rdev() } else { meta.dev() };
        // Readahead runs at most two windows ahead of the reader (the async window starts inside
        // the current one); twice that leaves a margin for the other workers' requests.
        let lookahead = (4 * read_ahead_bytes(meta_dev)).clamp(evict::BLOCK, 64 << 20);

        let has_direct = direct.is_some();
        let residency = cachestat && !tuning.no_cachestat;
        Ok(PolicyFile {
            path: path.to_path_buf(),
            direct,
            align,
            fs_block: meta.blksize(),
            is_block,
            mode,
            read_mech: AtomicU8::new(read as u8),
            write_mech: AtomicU8::new(write as u8),
            fadvise,
            // Outside neutral mode (drop, or a mechanism forced in keep or direct mode) guarded
            // reads evict every block they bring in, as write-behind then does: only neutral
            // mode classifies, on both sides.
            evict: EvictBehind::new(
                mode != CacheMode::Neutral,
                EVICT_BEHIND_MAX,
                lookahead,
                shared.classes.clone(),
            ),
            guard_reads,
            residency,
            direct_small: AtomicBool::new(
                has_direct && residency && mode == CacheMode::Neutral && sys::page_size() as u64 == PAGE,
            ),
            write_behind: WriteBehind::new(write == WriteMech::DontCache, shared.classes.clone()),
            shared,
            notes: Mutex::new(notes),
            touched_lo: AtomicU64::new(u64::MAX),
            touched_hi: AtomicU64::new(0),
            finished: AtomicBool::new(false),
            file,
        })
    }

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

    /// Reads into `buf` at `offset`; returns `buf.len()`, or fewer only at end of file.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let len = buf.len() as u64;
        let err = |e: io::Error| Error::io(Op::Read, e).path(&self.path).at(offset, len);
        self.touch(offset, len);
        loop {
            let mech = self.read_mech();
            let res = match mech {
                ReadMech::Buffered => read_full(self.fd(), buf, offset, 0),
                ReadMech::Direct => self.read_direct(buf, offset),
                ReadMech::DontCache | ReadMech::EvictBehind => {
                    let flags = if mech == ReadMech::DontCache { sys::RWF_DONTCACHE } else { 0 };
                    if !self.guard_reads {
                        read_full(self.fd(), buf, offset, flags)
                    } else {
                        if let Err(e) = self.evict.before_read(self.fd(), offset, len) {
                            if self.direct.is_some() {
                                self.read_mech.store(ReadMech::Direct as u8, Ordering::Relaxed);
                                self.note(format!(
                                    "cachestat failed ({}): switching reads to O_DIRECT",
                                    io_message(&e)
                                ));
                                continue;
                            }
                            // No O_DIRECT here (squashfs, iso9660): the blocks it could not
                            // check count as cached before (never evicted), and the read goes on.
                            self.note(format!(
                                "residency check failed ({e}): unchecked blocks are left cached"
                            ));
                        }
                        let res = read_full(self.fd(), buf, offset, flags);
                        if let (Ok(n), ReadMech::DontCache) = (&res, mech) {
                            footprint::dontcache_read(self.evict.ours_within(offset, *n as u64));
                        }
                        self.evict.after_read(self.fd(), offset, len);
                        res
                    }
                }
            };
            match res {
                Err(e)
                    if mech == ReadMech::DontCache
                        && e.raw_os_error() == Some(libc::EOPNOTSUPP)
                        && self.direct.is_some() =>
                {
                    self.read_mech.store(ReadMech::Direct as u8, Ordering::Relaxed);
                    self.note("DONTCACHE read refused: switching reads to O_DIRECT".into());
                }
                other => return other.map_err(err),
            }
        }
    }

    fn direct_fd(&self) -> io::Result<BorrowedFd<'_>> {
        self.direct.as_ref().map(|f| f.as_fd()).ok_or_else(|| io::Error::from_raw_os_error(libc::EOPNOTSUPP))
    }

    fn is_aligned(&self, ptr: *const u8, offset: u64, len: usize) -> bool {
        let a = self.align;
        offset.is_multiple_of(a) && (len as u64).is_multiple_of(a) && (ptr as u64).is_multiple_of(a)
    }

    fn read_direct(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let fd = self.direct_fd()?;
        if self.is_aligned(buf.as_ptr(), offset, buf.len()) {
            return read_full(fd, buf, offset, 0);
        }
        // Bounce through an aligned buffer covering the request.
        let start = offset / self.align * self.align;
        let end = (offset + buf.len() as u64).div_ceil(self.align) * self.align;
        let mut bounce = AlignedBuf::new((end - start) as usize);
        let n = read_full(fd, &mut bounce[..(end - start) as usize], start, 0)?;
        let skip = (offset - start) as usize;
        let got = n.saturating_sub(skip).min(buf.len());
        buf[..got].copy_from_slice(&bounce[skip..skip + got]);
        Ok(got)
    }

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
                Err(e) if mech == WriteMech::DontCache && e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                    self.switch_to_write_behind("DONTCACHE write refused");
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
                        self.switch_to_write_behind("DONTCACHE writes left pages cached after writeback");
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
            pages.iter().flatten().map(|p| super::spread(p / PAGE, PAGE_LOCK_BITS)).collect();
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

    fn switch_to_write_behind(&self, why: &str) {
        self.write_mech.store(WriteMech::WriteBehind as u8, Ordering::Relaxed);
        self.write_behind.stop_verifying();
        self.note(format!("{why}: switching writes to write-behind"));
    }

    fn write_direct(&self, buf: &[u8], offset: u64, dsync: i32) -> io::Result<()> {
        let fd = self.direct_fd()?;
        if self.is_aligned(buf.as_ptr(), offset, buf.len()) {
            return write_full(fd, buf, offset, dsync);
        }
        let a = self.align;
        if offset.is_multiple_of(a) && (buf.len() as u64).is_multiple_of(a) {
            // Only the buffer is unaligned: copied into an aligned one, nothing to read and
            // nothing rounded past the request.
            let mut bounce = AlignedBuf::new(buf.len());
            bounce[..buf.len()].copy_from_slice(buf);
            return write_full(fd, &bounce[..buf.len()], offset, dsync);
        }
        let start = offset / a * a;
        let end = (offset + buf.len() as u64).div_ceil(a) * a;
        // An aligned write past the end of a regular file would grow it: write such a tail
        // through the cache instead, then wait for it and evict it.
        if !self.is_block && end > self.file.metadata()?.len() {
            write_full(self.fd(), buf, offset, dsync)?;
            sys::sync_file_range(
                self.fd(),
                offset,
                buf.len() as u64,
                sys::SFR_WAIT_BEFORE | sys::SFR_WRITE | sys::SFR_WAIT_AFTER,
            )?;
            footprint::drop_range(self.fd(), start, end - start);
            return Ok(());
        }
        // Read-modify-write of the partial head and tail blocks, under per-block locks so two
        // unaligned writes sharing a block do not undo each other.
        let head = offset / a;
        let tail = (end - 1) / a;
        // Hashed like the page locks: `% 64` put writers a power of two apart on one lock.
        let (i, j) = (super::spread(head, RMW_LOCK_BITS), super::spread(tail, RMW_LOCK_BITS));
        let _g1 = self.shared.rmw_locks[i.min(j)].lock().unwrap();
        let _g2 = if i != j { Some(self.shared.rmw_locks[i.max(j)].lock().unwrap()) } else { None };
        let mut bounce = AlignedBuf::new((end - start) as usize);
        let bounce = &mut bounce[..(end - start) as usize];
        if offset != start {
            read_full(fd, &mut bounce[..a as usize], start, 0)?;
        }
        let last = bounce.len() - a as usize;
        if !(offset + buf.len() as u64).is_multiple_of(a) && (last > 0 || offset == start) {
            read_full(fd, &mut bounce[last..], end - a, 0)?;
        }
        let skip = (offset - start) as usize;
        bounce[skip..skip + buf.len()].copy_from_slice(buf);
        write_full(fd, bounce, start, dsync)
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

/// The readahead window of the device behind `dev` (`queue/read_ahead_kb`), 8 MiB if unknown.
pub(crate) fn read_ahead_bytes(dev: u64) -> u64 {
    let base = format!("/sys/dev/block/{}:{}", libc::major(dev), libc::minor(dev));
    for p in [format!("{base}/queue/read_ahead_kb"), format!("{base}/../queue/read_ahead_kb")] {
        if let Some(kb) = std::fs::read_to_string(p).ok().and_then(|s| s.trim().parse::<u64>().ok()) {
            return kb << 10;
        }
    }
    8 << 20
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

#[cfg(test)]
mod probe_tests {
    use super::*;

    /// Read system calls made by this thread so far.
    fn reads() -> u64 {
        let io = std::fs::read_to_string("/proc/thread-self/io").unwrap();
        let line = io.lines().find(|l| l.starts_with("syscr:")).unwrap();
        line[6..].trim().parse().unwrap()
    }

    /// Only the first open of a file shared between opens (a server's connections) reads it
    /// to probe RWF_DONTCACHE: a later open's probe would cache the first page for a moment
    /// while other connections write there.
    #[test]
    fn later_opens_reuse_the_first_opens_probe() {
        let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![1u8; 1 << 20]).unwrap();
        let shared: Arc<FileJob> = Arc::default();
        let opts = OpenOptions { write: true, create: false, truncate: false };
        // Read system calls of one open, with `shared` or (None) a `FileJob` of its own.
        let reads_of_open = |shared: Option<&Arc<FileJob>>| {
            let before = reads();
            let shared = shared.cloned().unwrap_or_default();
            let f =
                PolicyFile::open_shared(&path, opts, CacheMode::Neutral, &Tuning::default(), shared).unwrap();
            let n = reads() - before;
            drop(f);
            n
        };
        let open = || reads_of_open(Some(&shared));
        // Opens of files with their own `FileJob` each probe.
        let (first, second, third, own) = (open(), open(), open(), reads_of_open(None));
        assert!(shared.dontcache_probe.get().is_some());
        assert_eq!((first - second, second, own), (1, third, first), "read system calls per open");
    }
}
