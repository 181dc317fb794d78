//! Opening a [`PolicyFile`]: the probe of what this kernel, filesystem and file support,
//! and the one choice of mechanisms made from it ([`choose`]).

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use super::{FileJob, OpenOptions, PolicyFile, EVICT_BEHIND_MAX, PAGE};
use crate::error::{io_message, Error, ErrorKind, Op, Result};
use crate::io::evict::{self, EvictBehind};
use crate::io::policy::{choose, CacheMode, Choice, Fadvise, Probe, ReadMech, Tuning, WriteMech};
use crate::io::sys::{self, Advice};
use crate::io::writebehind::WriteBehind;

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

/// Does cachestat answer for this file? Kernels before 6.5 have none: mincore stands in
/// ([`sys::cached_pages`]) where it tells the truth (for files this user may not write it
/// reports every page cached). Notes why not.
fn probe_cachestat(fd: BorrowedFd<'_>, path: &Path, notes: &mut Vec<String>) -> bool {
    match sys::cachestat(fd, 0, 4096) {
        Ok(_) => true,
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) && sys::mincore_is_truthful(fd) => {
            notes.push("no cachestat on this kernel: residency from mincore".to_string());
            true
        }
        Err(e) => {
            let why = if e.raw_os_error() == Some(libc::EPERM) {
                "cachestat denied (the file is not writable by this user): residency unknown".to_string()
            } else {
                format!("cachestat unavailable ({}): residency unknown", io_message(&e))
            };
            tracing::info!("{}: {why}", path.display());
            notes.push(why);
            false
        }
    }
}

/// An O_DIRECT descriptor on the file: the probe of whether O_DIRECT works here, made only
/// when a mechanism chosen wants it ([`choose`]).
fn open_direct(path: &Path, opts: OpenOptions) -> io::Result<File> {
    std::fs::OpenOptions::new().read(true).write(opts.write).custom_flags(libc::O_DIRECT).open(path)
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
            let what = if meta.is_dir() { "is a directory" } else { "not a regular file or block device" };
            return Err(Error::new(ErrorKind::InvalidInput, Op::Open).path(path).detail(what));
        }
        let fd = file.as_fd();
        let mut notes = Vec::new();
        let (dontcache, note) = shared.dontcache_probe.get_or_init(|| probe_dontcache(fd)).clone();
        notes.extend(note);
        let cachestat = probe_cachestat(fd, path, &mut notes);
        let mut direct = None;
        let open_direct = || {
            let f = open_direct(path, opts).map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
            direct = Some(f);
            Ok(())
        };
        let probe = Probe { is_block, dontcache, cachestat };
        let Choice { read, write, fadvise, notes: chosen, .. } =
            choose(mode, probe, tuning, open_direct).map_err(|e| e.path(path))?;
        notes.extend(chosen);
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
