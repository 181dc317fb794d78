//! Reads, writes and metadata of regular files: `preadv2`/`pwritev2` with per-call flags,
//! `fdatasync`, `fallocate`, `SEEK_DATA`/`SEEK_HOLE`, the filesystem's block size and O_DIRECT
//! alignment, `access(W_OK)` and `renameat2(RENAME_NOREPLACE)`.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::{check, retry};

/// `RWF_DONTCACHE` (Linux 6.14): drop the pages a read or write brought in once done.
pub const RWF_DONTCACHE: i32 = 0x80;
/// `RWF_DSYNC`: this write is durable when the call returns (our FUA).
pub const RWF_DSYNC: i32 = 0x2;

/// One positional transfer of one buffer: without flags the plain call (`pread`, `pwrite`),
/// which skips the kernel's import of an iovec (about 1 % of a small request's CPU on tmpfs),
/// with flags the `v2` call.
fn one_buffer(
    flags: i32,
    plain: impl Fn() -> libc::ssize_t,
    vectored: impl Fn() -> libc::ssize_t,
) -> io::Result<usize> {
    retry(|| check((if flags == 0 { plain() } else { vectored() }) as libc::c_long))
}

/// `preadv2` of one buffer with `flags`; returns the bytes read (0 at end of file).
pub fn pread(fd: BorrowedFd, buf: &mut [u8], offset: u64, flags: i32) -> io::Result<usize> {
    let (fd, off) = (fd.as_raw_fd(), offset as libc::off_t);
    let iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    one_buffer(
        flags,
        // SAFETY: `iov` points into `buf`, which is exclusively borrowed for the whole call.
        || unsafe { libc::pread(fd, iov.iov_base, iov.iov_len, off) },
        // SAFETY: as for `pread` just above.
        || unsafe { libc::preadv2(fd, &iov, 1, off, flags) },
    )
}

/// `pwritev2` of one buffer with `flags`; returns the bytes written.
pub fn pwrite(fd: BorrowedFd, buf: &[u8], offset: u64, flags: i32) -> io::Result<usize> {
    let (fd, off) = (fd.as_raw_fd(), offset as libc::off_t);
    let iov = libc::iovec { iov_base: buf.as_ptr() as *mut _, iov_len: buf.len() };
    one_buffer(
        flags,
        // SAFETY: `iov` points into `buf`, borrowed for the whole call; the kernel only reads it.
        || unsafe { libc::pwrite(fd, iov.iov_base, iov.iov_len, off) },
        // SAFETY: as for `pwrite` just above.
        || unsafe { libc::pwritev2(fd, &iov, 1, off, flags) },
    )
}

/// `fdatasync`.
pub fn fdatasync(fd: BorrowedFd) -> io::Result<()> {
    retry(|| {
        // SAFETY: plain syscall on a borrowed fd.
        let ret = unsafe { libc::fdatasync(fd.as_raw_fd()) };
        check(ret as libc::c_long).map(drop)
    })
}

/// The filesystem's block size (`fstatfs` `f_bsize`): its unit of allocation for the
/// filesystems lightfoot serves from (ext4, XFS, btrfs), whose holes come in whole blocks.
pub fn fs_block_size(fd: BorrowedFd) -> io::Result<u64> {
    // SAFETY: statfs is plain data; all zeroes is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: plain system call; `st` outlives it.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_bsize as u64)
}

/// `fallocate` modes used here.
pub const FALLOC_KEEP_SIZE: i32 = libc::FALLOC_FL_KEEP_SIZE;
pub const FALLOC_PUNCH_HOLE: i32 = libc::FALLOC_FL_PUNCH_HOLE;
pub const FALLOC_ZERO_RANGE: i32 = libc::FALLOC_FL_ZERO_RANGE;

pub fn fallocate(fd: BorrowedFd, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    retry(|| {
        // SAFETY: plain syscall on a borrowed fd.
        let ret = unsafe { libc::fallocate(fd.as_raw_fd(), mode, offset as libc::off_t, len as libc::off_t) };
        check(ret as libc::c_long).map(drop)
    })
}

/// Where `lseek(SEEK_DATA / SEEK_HOLE)` lands; `None` when there is no more data (ENXIO).
pub fn seek_data(fd: BorrowedFd, offset: u64) -> io::Result<Option<u64>> {
    seek(fd, offset, libc::SEEK_DATA)
}

pub fn seek_hole(fd: BorrowedFd, offset: u64) -> io::Result<Option<u64>> {
    seek(fd, offset, libc::SEEK_HOLE)
}

fn seek(fd: BorrowedFd, offset: u64, whence: i32) -> io::Result<Option<u64>> {
    // SAFETY: plain syscall on a borrowed fd. The file position it moves is never used for
    // I/O: all reads and writes are positional.
    let ret = unsafe { libc::lseek(fd.as_raw_fd(), offset as libc::off_t, whence) };
    if ret < 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ENXIO) {
            return Ok(None);
        }
        return Err(err);
    }
    Ok(Some(ret as u64))
}

/// O_DIRECT alignment from `statx(STATX_DIOALIGN)`: (memory, offset), or None where the kernel
/// or filesystem does not say.
pub fn dio_alignment(fd: BorrowedFd) -> Option<(u32, u32)> {
    const STATX_DIOALIGN: u32 = 0x2000;
    // SAFETY: statx fills the zero-initialised struct; the empty path with AT_EMPTY_PATH means
    // "this fd".
    unsafe {
        let mut stx: libc::statx = std::mem::zeroed();
        let ret = libc::statx(fd.as_raw_fd(), c"".as_ptr(), libc::AT_EMPTY_PATH, STATX_DIOALIGN, &mut stx);
        if ret != 0 || stx.stx_mask & STATX_DIOALIGN == 0 || stx.stx_dio_offset_align == 0 {
            return None;
        }
        Some((stx.stx_dio_mem_align, stx.stx_dio_offset_align))
    }
}

/// Whether the calling user may write the file at `path` (`access(W_OK)` with the real ids).
pub fn can_write(path: &std::ffi::CStr) -> bool {
    // SAFETY: `path` is a valid NUL-terminated string for the call.
    unsafe { libc::access(path.as_ptr(), libc::W_OK) == 0 }
}

/// `rename(from, to)` that fails with `EEXIST` instead of replacing `to` (renameat2
/// `RENAME_NOREPLACE`; `EINVAL` where the filesystem does not support it).
pub fn rename_noreplace(from: &std::path::Path, to: &std::path::Path) -> io::Result<()> {
    let (f, t) = (c_string(from)?, c_string(to)?);
    // SAFETY: two NUL-terminated paths that outlive the call.
    let r = unsafe {
        libc::renameat2(libc::AT_FDCWD, f.as_ptr(), libc::AT_FDCWD, t.as_ptr(), libc::RENAME_NOREPLACE)
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A `flock` on `fd` without waiting, shared or exclusive: `Ok(false)` if another open file
/// holds a conflicting one.
pub fn try_flock(fd: BorrowedFd, exclusive: bool) -> io::Result<bool> {
    let op = if exclusive { libc::LOCK_EX } else { libc::LOCK_SH } | libc::LOCK_NB;
    loop {
        // SAFETY: plain system call on a borrowed fd.
        if unsafe { libc::flock(fd.as_raw_fd(), op) } == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EWOULDBLOCK) => return Ok(false),
            _ => return Err(e),
        }
    }
}

/// A path or name as the C calls take it (`InvalidInput` if it holds a NUL byte).
fn c_string(s: impl AsRef<std::ffi::OsStr>) -> io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(s.as_ref().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// The extended attribute `name` of the file at `path`; `None` if it has none of that name
/// (or the filesystem keeps none).
pub fn get_xattr(path: &std::path::Path, name: &str) -> io::Result<Option<Vec<u8>>> {
    let (p, n) = (c_string(path)?, c_string(name)?);
    let mut buf = vec![0u8; 256];
    // SAFETY: two NUL-terminated strings and a buffer of buf.len() bytes, all live for the call.
    let r = unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENODATA) | Some(libc::ENOTSUP) => Ok(None),
            _ => Err(e),
        };
    }
    buf.truncate(r as usize);
    Ok(Some(buf))
}

/// Sets the extended attribute `name` of the file at `path` to `value`.
pub fn set_xattr(path: &std::path::Path, name: &str, value: &[u8]) -> io::Result<()> {
    let (p, n) = (c_string(path)?, c_string(name)?);
    // SAFETY: two NUL-terminated strings and `value`, all live for the call; read only.
    let r = unsafe { libc::setxattr(p.as_ptr(), n.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Removes the extended attribute `name` of the file at `path` (none there is no error).
pub fn remove_xattr(path: &std::path::Path, name: &str) -> io::Result<()> {
    let (p, n) = (c_string(path)?, c_string(name)?);
    // SAFETY: two NUL-terminated strings, live for the call.
    let r = unsafe { libc::removexattr(p.as_ptr(), n.as_ptr()) };
    match r {
        0 => Ok(()),
        _ => match io::Error::last_os_error() {
            e if matches!(e.raw_os_error(), Some(libc::ENODATA) | Some(libc::ENOTSUP)) => Ok(()),
            e => Err(e),
        },
    }
}
