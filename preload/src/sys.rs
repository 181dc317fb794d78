//! The library's own system calls, each a thin wrapper that returns the raw result.
//!
//! Functions this library exports (`read`, `write`, `close`, `writev`, …) must never be called
//! from inside it: they would resolve to its own wrappers. Those it needs go through
//! `libc::syscall`; the rest (`fstat`, `fcntl`, `lseek`, `posix_fadvise`, `mmap`, …) are glibc's,
//! which it does not export. All of them are async-signal-safe: no allocation, no locks.

use libc::{c_int, c_void};
use lightfoot_record::{Cachestat, CachestatRange, SYS_CACHESTAT};

/// `errno` now.
pub fn errno() -> c_int {
    // SAFETY: __errno_location returns this thread's errno, valid for the thread's life.
    unsafe { *libc::__errno_location() }
}

pub fn set_errno(e: c_int) {
    // SAFETY: as in `errno`.
    unsafe { *libc::__errno_location() = e }
}

/// Pages of `[off, off+len)` in the page cache, or the errno (`EPERM`: the caller may not
/// write the file and does not own it; `ENOSYS`: a kernel before 6.5).
pub fn cached_pages(fd: c_int, off: u64, len: u64) -> Result<u64, c_int> {
    let range = CachestatRange { off, len };
    let mut cs = Cachestat::default();
    loop {
        // SAFETY: both pointers are to live `repr(C)` values laid out as the kernel expects.
        let r = unsafe {
            libc::syscall(SYS_CACHESTAT, fd, &range as *const CachestatRange, &mut cs as *mut Cachestat, 0)
        };
        match r {
            0 => return Ok(cs.nr_cache),
            _ if errno() == libc::EINTR => continue,
            _ => return Err(errno()),
        }
    }
}

/// `fstat`, or `None`.
pub fn fstat(fd: c_int) -> Option<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a live, writable `stat` for the call.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some(st)
}

/// The file status flags (`F_GETFL`), or `None`.
pub fn status_flags(fd: c_int) -> Option<c_int> {
    // SAFETY: F_GETFL takes no argument and touches no memory.
    let f = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    (f >= 0).then_some(f)
}

/// The file position, or `None` (not seekable).
pub fn position(fd: c_int) -> Option<u64> {
    // SAFETY: lseek touches no memory.
    let p = unsafe { libc::lseek(fd, 0, libc::SEEK_CUR) };
    (p >= 0).then_some(p as u64)
}

/// `POSIX_FADV_DONTNEED` over `[off, off+len)` (`len == 0`: to the end of the file): drops the
/// clean, unmapped pages there and starts writeback of the dirty ones. Errors are ignored: the
/// pages then stay, which is the safe side.
pub fn drop_pages(fd: c_int, off: u64, len: u64) {
    // SAFETY: touches no memory.
    unsafe { libc::posix_fadvise(fd, off as libc::off_t, len as libc::off_t, libc::POSIX_FADV_DONTNEED) };
}

/// An anonymous private mapping of `len` bytes (zeroed), or null.
pub fn map(len: usize) -> *mut u8 {
    // SAFETY: a new anonymous mapping; no existing memory is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        std::ptr::null_mut()
    } else {
        p as *mut u8
    }
}

/// A shared mapping of the first `len` bytes of the file at `path` (NUL-terminated), or null.
pub fn map_file(path: &[u8], len: usize) -> *mut u8 {
    if path.last() != Some(&0) {
        return std::ptr::null_mut();
    }
    // SAFETY: a NUL-terminated path; raw syscall, so not through the library's own `open`.
    let fd = unsafe {
        libc::syscall(libc::SYS_openat, libc::AT_FDCWD, path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0)
    } as c_int;
    if fd < 0 {
        return std::ptr::null_mut();
    }
    // SAFETY: a new shared mapping of the file just opened; no existing memory is touched.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
    };
    close_own(fd);
    if p == libc::MAP_FAILED {
        std::ptr::null_mut()
    } else {
        p as *mut u8
    }
}

/// Unmaps what [`map`] returned.
///
/// # Safety
/// `p` and `len` are a mapping of [`map`]'s that nothing uses any more.
pub unsafe fn unmap(p: *mut u8, len: usize) {
    // SAFETY: the caller's promise.
    unsafe { libc::munmap(p as *mut c_void, len) };
}

/// `/proc/self/fd/FD`, NUL-terminated (zeroes past the digits), without allocating.
fn fd_link(fd: c_int) -> [u8; 32] {
    let mut link = [0u8; 32];
    const PREFIX: &[u8] = b"/proc/self/fd/";
    link[..PREFIX.len()].copy_from_slice(PREFIX);
    let mut digits = [0u8; 11];
    let (mut n, mut v) = (0, fd as u32);
    loop {
        digits[n] = b'0' + (v % 10) as u8;
        n += 1;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    for i in 0..n {
        link[PREFIX.len() + i] = digits[n - 1 - i];
    }
    link
}

/// The path `/proc/self/fd/FD` links to, into `buf`; its length (0 if unknown).
pub fn path_of(fd: c_int, buf: &mut [u8]) -> usize {
    let link = fd_link(fd);
    // SAFETY: `link` is NUL-terminated (the array's tail is zeroes), `buf` is writable for its length.
    let r = unsafe {
        libc::readlink(link.as_ptr() as *const libc::c_char, buf.as_mut_ptr() as *mut libc::c_char, buf.len())
    };
    if r < 0 {
        0
    } else {
        r as usize
    }
}

/// Appends `parts` to the file at `path` (NUL-terminated) in one `writev` with `O_APPEND`:
/// appends to a regular file hold its inode lock, so records of several processes never
/// interleave. Best effort.
pub fn append(path: &[u8], parts: &[&[u8]]) {
    // SAFETY: `path` is NUL-terminated (the caller's buffer), the call reads it only.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat,
            libc::AT_FDCWD,
            path.as_ptr(),
            libc::O_WRONLY | libc::O_APPEND | libc::O_CLOEXEC,
            0,
        )
    } as c_int;
    if fd < 0 {
        return;
    }
    let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 4];
    let n = parts.len().min(iov.len());
    for (v, p) in iov.iter_mut().zip(parts) {
        *v = libc::iovec { iov_base: p.as_ptr() as *mut c_void, iov_len: p.len() };
    }
    // SAFETY: every iovec points into a live slice of the caller's for the call.
    unsafe { libc::syscall(libc::SYS_writev, fd, iov.as_ptr(), n as c_int) };
    // SAFETY: closes the descriptor opened above, which nothing else knows of.
    unsafe { libc::syscall(libc::SYS_close, fd) };
}

/// This process's id, by system call (glibc's cache would be stale in a `vfork` child).
pub fn pid() -> u32 {
    // SAFETY: getpid touches no memory.
    (unsafe { libc::syscall(libc::SYS_getpid) }) as u32
}

/// The file of `fd` opened again (`/proc/self/fd/FD`, read-only, close-on-exec): a new open
/// file description of the library's own, moved to 512 or above where the limit allows, so
/// the program's next `open` gets the number it would have got.
pub fn reopen(fd: c_int) -> Option<c_int> {
    let link = fd_link(fd);
    // SAFETY: `link` is NUL-terminated (zeroes past the digits); the call only reads it.
    let o = unsafe {
        libc::syscall(libc::SYS_openat, libc::AT_FDCWD, link.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC, 0)
    } as c_int;
    if o < 0 {
        return None;
    }
    // SAFETY: F_DUPFD_CLOEXEC touches no memory.
    let high = unsafe { libc::fcntl(o, libc::F_DUPFD_CLOEXEC, 512) };
    if high < 0 {
        return Some(o);
    }
    close_own(o);
    Some(high)
}

/// Closes a descriptor of the library's own (around the exported `close`).
pub fn close_own(fd: c_int) {
    // SAFETY: the descriptor is the library's, which nothing else uses.
    unsafe { libc::syscall(libc::SYS_close, fd) };
}

/// Waits until `[off, off+len)` is written back (starting what is dirty): `sync_file_range`
/// with WAIT_BEFORE, WRITE and WAIT_AFTER. Errors are left to the program's own `fsync`.
pub fn wait_written(fd: c_int, off: u64, len: u64) {
    let flags =
        libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    // SAFETY: touches no memory.
    unsafe { libc::sync_file_range(fd, off as libc::off64_t, len as libc::off64_t, flags) };
}
