//! Looking at and dropping what a file has in the page cache (`lightfoot cache stat|evict`,
//! and the footprint figures of `copy --json`).

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use super::sys::{self, Advice, CacheStat};
use crate::error::{Error, ErrorKind, Op, Result};

/// Where residency figures came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Cachestat,
    /// mmap + mincore, on kernels without cachestat: counts cached pages only.
    Mincore,
}

/// Page-cache state of a byte range of one file.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Residency {
    pub offset: u64,
    pub len: u64,
    pub page_size: u64,
    /// Pages in the range.
    pub pages: u64,
    pub stat: CacheStat,
    pub source: Source,
}

impl Residency {
    pub fn cached_bytes(&self) -> u64 {
        self.stat.cached * self.page_size
    }
}

/// Opens `path` the way `cache stat|evict` and `run`'s sweep need it: read-only.
///
/// cachestat (and mincore before it) shows residency through a read-only descriptor when the
/// caller owns the file or could open it for writing, so a writable descriptor gains nothing,
/// and holding one costs others: an executable open for writing cannot be run meanwhile
/// (ETXTBSY, seen when `run`'s sweep met a program another process was starting), leases
/// break, and file watchers are told the file was written. fadvise and sync_file_range need
/// no write access either.
///
/// Only regular files and block devices, looked at before they are opened: a directory's page
/// cache says nothing about the data under it (ext4 keeps directory blocks in the device's
/// cache), and opening a FIFO would wake the program at its other end and then leave it (it
/// could read an empty pipe and finish, or be killed by SIGPIPE); a tape device would rewind.
pub fn open(path: &Path) -> Result<File> {
    let kind = std::fs::metadata(path).map_err(|e| Error::io(Op::Open, e).path(path))?.file_type();
    if kind.is_dir() {
        return Err(Error::new(ErrorKind::InvalidInput, Op::Open)
            .path(path)
            .detail("a directory: name the files in it (for example DIR/*)"));
    }
    if !kind.is_file() && !kind.is_block_device() {
        return Err(Error::new(ErrorKind::InvalidInput, Op::Open)
            .path(path)
            .detail("not a regular file or block device"));
    }
    File::open(path).map_err(|e| Error::io(Op::Open, e).path(path))
}

/// Size of a regular file or block device.
pub fn file_size(file: &File, path: &Path) -> Result<u64> {
    let meta = file.metadata().map_err(|e| Error::io(Op::Stat, e).path(path))?;
    if meta.file_type().is_block_device() {
        sys::block_size_bytes(file.as_fd()).map_err(|e| Error::io(Op::Size, e).path(path))
    } else {
        Ok(meta.len())
    }
}

/// The part of `[offset, offset+len)` (`len == None`: to the end) inside a file of `size`
/// bytes: the range [`measure`] reports on.
pub fn clamp(size: u64, offset: u64, len: Option<u64>) -> (u64, u64) {
    let offset = offset.min(size);
    (offset, len.unwrap_or(size - offset).min(size - offset))
}

/// Whether an error of [`measure`] means the file's residency is not visible to this user
/// (cachestat's EPERM, or no cachestat and a file mincore would lie about), rather than a
/// failure: the figures are unknown, not zero.
pub fn not_visible(err: &Error) -> bool {
    err.op() == Op::Cachestat && matches!(err.kind(), ErrorKind::Permission | ErrorKind::NotSupported)
}

/// Residency of `[offset, offset+len)` (`len == None`: to the end).
pub fn measure(file: &File, path: &Path, offset: u64, len: Option<u64>) -> Result<Residency> {
    let (offset, len) = clamp(file_size(file, path)?, offset, len);
    let page_size = sys::page_size() as u64;
    let pages = (offset + len).div_ceil(page_size) - offset / page_size;
    let fd = file.as_fd();
    if len == 0 {
        return Ok(Residency {
            offset,
            len,
            page_size,
            pages: 0,
            stat: CacheStat::default(),
            source: Source::Cachestat,
        });
    }
    match sys::cachestat(fd, offset, len) {
        Ok(stat) => Ok(Residency { offset, len, page_size, pages, stat, source: Source::Cachestat }),
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => Err(Error::io(Op::Cachestat, e)
            .path(path)
            .detail("residency of a file this user cannot write is not visible (and mincore would report every page cached)")),
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
            // Kernels before 6.5. mincore is only truthful for files we may write.
            let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap_or_default();
            if !sys::can_write(&c) {
                return Err(Error::new(ErrorKind::NotSupported, Op::Cachestat)
                    .path(path)
                    .detail("no cachestat on this kernel, and mincore is meaningless for files this user cannot write"));
            }
            let cached = sys::mincore_cached_pages(fd, offset, len).map_err(|e| Error::io(Op::Mincore, e).path(path))?;
            let stat = CacheStat { cached, ..CacheStat::default() };
            Ok(Residency { offset, len, page_size, pages, stat, source: Source::Mincore })
        }
        Err(e) => Err(Error::io(Op::Cachestat, e).path(path)),
    }
}

/// Drops the clean pages of `[offset, offset+len)`; with `sync`, writes dirty ones back first.
pub fn evict(file: &File, path: &Path, offset: u64, len: Option<u64>, sync: bool) -> Result<()> {
    let fd = file.as_fd();
    let len = len.unwrap_or(0);
    if sync {
        // Wait for writeback of the range, then for anything already under writeback.
        sys::sync_file_range(fd, offset, len, sys::SFR_WAIT_BEFORE | sys::SFR_WRITE | sys::SFR_WAIT_AFTER)
            .map_err(|e| Error::io(Op::Writeback, e).path(path))?;
    }
    sys::fadvise(fd, offset, len, Advice::DontNeed).map_err(|e| Error::io(Op::Evict, e).path(path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::PermissionsExt;

    /// A program whose file `open` holds can still be started: a descriptor open for writing
    /// would make exec fail with ETXTBSY.
    #[test]
    fn an_open_executable_can_still_run() {
        let dir = tempfile::tempdir().unwrap();
        let prog = dir.path().join("true");
        std::fs::copy("/bin/true", &prog).unwrap();
        std::fs::set_permissions(&prog, std::fs::Permissions::from_mode(0o755)).unwrap();
        let file = open(&prog).unwrap();
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", file.as_raw_fd())).unwrap();
        let flags = info.lines().find_map(|l| l.strip_prefix("flags:")).unwrap().trim();
        let flags = i32::from_str_radix(flags, 8).unwrap();
        assert_eq!(flags & libc::O_ACCMODE, libc::O_RDONLY, "{info}");
        let status = std::process::Command::new(&prog).status().unwrap();
        assert!(status.success());
        assert!(measure(&file, &prog, 0, None).is_ok());
    }
}
