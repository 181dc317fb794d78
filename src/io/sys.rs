//! Every system call lightfoot makes outside `std`: the only `unsafe` in the crate.
//!
//! Each wrapper takes a borrowed fd and returns `io::Result`, so callers never touch raw errno.
//! Constants the `libc` crate or Debian's headers may lack are defined here (KERNEL-NOTES:
//! define RWF_DONTCACHE yourself).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// `RWF_DONTCACHE` (Linux 6.14): drop the pages a read or write brought in once done.
pub const RWF_DONTCACHE: i32 = 0x80;
/// `RWF_DSYNC`: this write is durable when the call returns (our FUA).
pub const RWF_DSYNC: i32 = 0x2;

const SYS_CACHESTAT: libc::c_long = 451;

const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const BLKSSZGET: libc::c_ulong = 0x1268;
const BLKDISCARD: libc::c_ulong = 0x1277;
const BLKZEROOUT: libc::c_ulong = 0x127f;

fn check(ret: libc::c_long) -> io::Result<usize> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as usize)
    }
}

/// Retries a call interrupted by a signal (Ctrl-C is handled by a flag, not by EINTR).
fn retry<T>(mut f: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    loop {
        match f() {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// `preadv2` of one buffer with `flags`; returns the bytes read (0 at end of file).
pub fn pread(fd: BorrowedFd, buf: &mut [u8], offset: u64, flags: i32) -> io::Result<usize> {
    let iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    retry(|| {
        // SAFETY: `iov` points into `buf`, which is exclusively borrowed for the whole call.
        let ret = unsafe { libc::preadv2(fd.as_raw_fd(), &iov, 1, offset as libc::off_t, flags) };
        check(ret as libc::c_long)
    })
}

/// `pwritev2` of one buffer with `flags`; returns the bytes written.
pub fn pwrite(fd: BorrowedFd, buf: &[u8], offset: u64, flags: i32) -> io::Result<usize> {
    let iov = libc::iovec { iov_base: buf.as_ptr() as *mut _, iov_len: buf.len() };
    retry(|| {
        // SAFETY: `iov` points into `buf`, borrowed for the whole call; the kernel only reads it.
        let ret = unsafe { libc::pwritev2(fd.as_raw_fd(), &iov, 1, offset as libc::off_t, flags) };
        check(ret as libc::c_long)
    })
}

/// Page-cache counters of a byte range, in pages, as `cachestat(2)` reports them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct CacheStat {
    pub cached: u64,
    pub dirty: u64,
    pub writeback: u64,
    pub evicted: u64,
    pub recently_evicted: u64,
}

#[repr(C)]
struct CachestatRange {
    off: u64,
    len: u64,
}

#[repr(C)]
#[derive(Default)]
struct RawCachestat {
    nr_cache: u64,
    nr_dirty: u64,
    nr_writeback: u64,
    nr_evicted: u64,
    nr_recently_evicted: u64,
}

/// `cachestat(2)` (Linux 6.5) of `[offset, offset + len)`; `len == 0` means to the end of file.
/// Since 2025 it answers EPERM for files the caller could not write (KERNEL-NOTES).
pub fn cachestat(fd: BorrowedFd, offset: u64, len: u64) -> io::Result<CacheStat> {
    if NO_CACHESTAT.load(std::sync::atomic::Ordering::Relaxed) {
        return Err(io::Error::from_raw_os_error(libc::ENOSYS));
    }
    let range = CachestatRange { off: offset, len };
    let mut raw = RawCachestat::default();
    retry(|| {
        // SAFETY: both pointers are to live, properly laid out `repr(C)` values for the call.
        let ret = unsafe {
            libc::syscall(
                SYS_CACHESTAT,
                fd.as_raw_fd(),
                &range as *const CachestatRange,
                &mut raw as *mut RawCachestat,
                0u32,
            )
        };
        check(ret)
    })?;
    Ok(CacheStat {
        cached: raw.nr_cache,
        dirty: raw.nr_dirty,
        writeback: raw.nr_writeback,
        evicted: raw.nr_evicted,
        recently_evicted: raw.nr_recently_evicted,
    })
}

/// Set by [`pretend_no_cachestat`].
static NO_CACHESTAT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes [`cachestat`] answer ENOSYS from now on, as kernels before 6.5 do: for tests of the
/// mincore fallback (`LIGHTFOOT_NO_CACHESTAT_SYSCALL=1`, read by the binary).
pub fn pretend_no_cachestat() {
    NO_CACHESTAT.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Pages of `[offset, offset+len)` in the page cache: [`cachestat`], or on kernels without it
/// [`mincore_cached_pages`], which is truthful only for files the caller may write (callers
/// check that once per file, `PolicyFile::open`).
pub fn cached_pages(fd: BorrowedFd, offset: u64, len: u64) -> io::Result<u64> {
    match cachestat(fd, offset, len) {
        Ok(s) => Ok(s.cached),
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => mincore_cached_pages(fd, offset, len),
        Err(e) => Err(e),
    }
}

/// The advice values of `posix_fadvise` that lightfoot uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advice {
    Normal,
    Sequential,
    Random,
    WillNeed,
    DontNeed,
}

/// `posix_fadvise`; `len == 0` means to the end of file.
pub fn fadvise(fd: BorrowedFd, offset: u64, len: u64, advice: Advice) -> io::Result<()> {
    let advice = match advice {
        Advice::Normal => libc::POSIX_FADV_NORMAL,
        Advice::Sequential => libc::POSIX_FADV_SEQUENTIAL,
        Advice::Random => libc::POSIX_FADV_RANDOM,
        Advice::WillNeed => libc::POSIX_FADV_WILLNEED,
        Advice::DontNeed => libc::POSIX_FADV_DONTNEED,
    };
    // SAFETY: plain syscall on a borrowed fd; no memory is passed.
    let ret =
        unsafe { libc::posix_fadvise(fd.as_raw_fd(), offset as libc::off_t, len as libc::off_t, advice) };
    // posix_fadvise returns the error number instead of setting errno.
    if ret != 0 {
        return Err(io::Error::from_raw_os_error(ret));
    }
    Ok(())
}

/// `sync_file_range` flags.
pub const SFR_WAIT_BEFORE: u32 = libc::SYNC_FILE_RANGE_WAIT_BEFORE;
pub const SFR_WRITE: u32 = libc::SYNC_FILE_RANGE_WRITE;
pub const SFR_WAIT_AFTER: u32 = libc::SYNC_FILE_RANGE_WAIT_AFTER;

/// `sync_file_range`: starts and/or waits for writeback. Not a durability primitive (no
/// metadata, no device cache flush); its errors are real write errors.
pub fn sync_file_range(fd: BorrowedFd, offset: u64, len: u64, flags: u32) -> io::Result<()> {
    retry(|| {
        // SAFETY: plain syscall on a borrowed fd; no memory is passed.
        let ret = unsafe {
            libc::sync_file_range(fd.as_raw_fd(), offset as libc::off64_t, len as libc::off64_t, flags)
        };
        check(ret as libc::c_long).map(drop)
    })
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

/// Size of a block device in bytes (`BLKGETSIZE64`).
pub fn block_size_bytes(fd: BorrowedFd) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 into `size`, which lives for the call.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    check(ret as libc::c_long)?;
    Ok(size)
}

/// Logical block size of a block device (`BLKSSZGET`).
pub fn block_logical_size(fd: BorrowedFd) -> io::Result<u32> {
    let mut size: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int into `size`, which lives for the call.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), BLKSSZGET, &mut size as *mut libc::c_int) };
    check(ret as libc::c_long)?;
    Ok(size as u32)
}

/// `BLKZEROOUT`: the device writes (or unmaps, where that reads back as zeroes) a range.
pub fn block_zeroout(fd: BorrowedFd, offset: u64, len: u64) -> io::Result<()> {
    block_range_ioctl(fd, BLKZEROOUT, offset, len)
}

/// `BLKDISCARD`: the device may forget a range.
pub fn block_discard(fd: BorrowedFd, offset: u64, len: u64) -> io::Result<()> {
    block_range_ioctl(fd, BLKDISCARD, offset, len)
}

fn block_range_ioctl(fd: BorrowedFd, request: libc::c_ulong, offset: u64, len: u64) -> io::Result<()> {
    let range: [u64; 2] = [offset, len];
    retry(|| {
        // SAFETY: the ioctl reads two u64 from `range`, which lives for the call.
        let ret = unsafe { libc::ioctl(fd.as_raw_fd(), request, range.as_ptr()) };
        check(ret as libc::c_long).map(drop)
    })
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

/// A heap buffer aligned for O_DIRECT (4 KiB covers every logical block size we meet).
///
/// Buffers of [`HUGE_BUF_MIN`] and more are mapped on their own, 2 MiB aligned, and asked
/// for transparent huge pages (`MADV_HUGEPAGE`; THP is commonly in `madvise` mode). An
/// O_DIRECT read is split into device requests at the queue's segment limit, and each 4 KiB
/// page of the buffer is a segment unless its neighbours are physically contiguous: virtio-blk
/// here takes 254 segments, so a 4 MiB read into 4 KiB pages reached the device as requests
/// of at most 1016 KiB (744-956 KiB on average), and one into huge pages as whole ones.
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    /// Mapped with `mmap` (unmapped on drop) rather than allocated.
    mapped: bool,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only give out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

pub const BUF_ALIGN: usize = 4096;

/// Smallest buffer mapped with huge pages: one huge page.
pub const HUGE_BUF_MIN: usize = 2 << 20;

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (rounded up to the alignment, at least one block).
    pub fn new(len: usize) -> AlignedBuf {
        let cap = len.max(1).div_ceil(BUF_ALIGN) * BUF_ALIGN;
        if cap >= HUGE_BUF_MIN {
            if let Some(buf) = Self::map_huge(cap) {
                return buf;
            }
        }
        let layout = std::alloc::Layout::from_size_align(cap, BUF_ALIGN).expect("buffer layout");
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len: cap, mapped: false }
    }

    /// `cap` bytes (a multiple of 4 KiB) of fresh anonymous memory (zeroed by the kernel),
    /// starting on a 2 MiB boundary, advised to use huge pages before anything touches it.
    fn map_huge(cap: usize) -> Option<AlignedBuf> {
        let span = cap + HUGE_BUF_MIN;
        // SAFETY: a fresh private anonymous mapping; the parts outside the aligned window
        // are unmapped at once and the window is owned by the returned buffer.
        unsafe {
            let base = libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if base == libc::MAP_FAILED {
                return None;
            }
            let start = (base as usize).div_ceil(HUGE_BUF_MIN) * HUGE_BUF_MIN;
            let head = start - base as usize;
            if head > 0 {
                libc::munmap(base, head);
            }
            let tail = span - head - cap;
            if tail > 0 {
                libc::munmap((start + cap) as *mut libc::c_void, tail);
            }
            // Advice only: without THP the buffer works as before.
            libc::madvise(start as *mut libc::c_void, cap, libc::MADV_HUGEPAGE);
            Some(AlignedBuf { ptr: std::ptr::NonNull::new(start as *mut u8)?, len: cap, mapped: true })
        }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: the window mapped in `map_huge`, owned by this buffer.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
            return;
        }
        let layout = std::alloc::Layout::from_size_align(self.len, BUF_ALIGN).expect("buffer layout");
        // SAFETY: allocated in `new` with this exact layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised (zeroed) bytes while self lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// Resident pages of `[offset, offset+len)` by `mmap` + `mincore`: the fallback for `cache stat`
/// on kernels without cachestat. Only meaningful for files the caller may write (KERNEL-NOTES:
/// since 5.2 mincore reports every page of other files as resident).
pub fn mincore_cached_pages(fd: BorrowedFd, offset: u64, len: u64) -> io::Result<u64> {
    let page = page_size() as u64;
    let start = offset / page * page;
    let end = offset + len;
    let mut cached = 0u64;
    // Map in 1 GiB pieces to keep the residency vector small.
    let piece = 1u64 << 30;
    let mut at = start;
    while at < end {
        let n = piece.min(end - at) as usize;
        // SAFETY: a fresh read-only shared mapping of the fd; unmapped below; never dereferenced.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                n,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                at as libc::off_t,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let mut vec = vec![0u8; n.div_ceil(page as usize)];
        // SAFETY: `addr` maps `n` bytes; `vec` has one byte per page of it.
        let ret = unsafe { libc::mincore(addr, n, vec.as_mut_ptr()) };
        let err = io::Error::last_os_error();
        // SAFETY: unmapping exactly what was mapped above.
        unsafe { libc::munmap(addr, n) };
        if ret != 0 {
            return Err(err);
        }
        cached += vec.iter().filter(|&&b| b & 1 != 0).count() as u64;
        at += n as u64;
    }
    Ok(cached)
}

/// Whether mincore tells the truth about this file's pages: it reports every page of a file
/// the caller may not write (and does not own) as resident, so a page past the end of the
/// file, which cannot be cached, shows who answers. False if the file cannot be mapped.
pub fn mincore_is_truthful(fd: BorrowedFd) -> bool {
    let page = page_size() as u64;
    // SAFETY: fstat fills a plain struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return false;
    }
    let size = if st.st_mode & libc::S_IFMT == libc::S_IFBLK {
        // st_size is 0 for a device.
        match block_size_bytes(fd) {
            Ok(n) => n,
            Err(_) => return false,
        }
    } else {
        st.st_size as u64
    };
    let past_end = size.div_ceil(page) * page;
    matches!(mincore_cached_pages(fd, past_end, page), Ok(0))
}

pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory effects.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 {
        size as usize
    } else {
        4096
    }
}

/// Asks the kernel to send SIGTERM to this process when its parent exits
/// (`PR_SET_PDEATHSIG`, for `--exit-with-parent`). Returns false if the parent is already gone.
pub fn exit_with_parent() -> io::Result<bool> {
    // SAFETY: prctl with integer arguments only.
    let ret = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0) };
    check(ret as libc::c_long)?;
    // The parent may have exited before the call: then we were reparented already.
    // SAFETY: getppid has no memory effects.
    Ok(unsafe { libc::getppid() } != 1)
}

/// `rename(from, to)` that fails with `EEXIST` instead of replacing `to` (renameat2
/// `RENAME_NOREPLACE`; `EINVAL` where the filesystem does not support it).
pub fn rename_noreplace(from: &std::path::Path, to: &std::path::Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &std::path::Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
    };
    let (f, t) = (c(from)?, c(to)?);
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

/// Tries to connect to the Unix socket at `path` without blocking: `Ok` when a server
/// accepted (or will: the connection is dropped at once), `ECONNREFUSED` when nobody listens
/// on the file, `EAGAIN` when a server listens with a full backlog (a blocking connect would
/// wait for it, for ever without a timeout).
pub fn unix_connect_nonblocking(path: &std::path::Path) -> io::Result<()> {
    let (addr, len) = sockaddr_un(path)?;
    let fd = nonblocking_socket(libc::AF_UNIX)?;
    // SAFETY: `addr` holds a valid sockaddr of `len` bytes for the duration of the call.
    let r = unsafe { libc::connect(fd.as_raw_fd(), (&raw const addr).cast(), len) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `path` as a `sockaddr_un` and its length: a name starting with a NUL byte is in the
/// abstract namespace, anything else a file.
fn sockaddr_un(path: &std::path::Path) -> io::Result<(libc::sockaddr_storage, libc::socklen_t)> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: sockaddr_storage is plain data; all zeroes is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    // SAFETY: sockaddr_storage is large and aligned enough for a sockaddr_un.
    let un: &mut libc::sockaddr_un = unsafe { &mut *(&raw mut ss).cast() };
    let bytes = path.as_os_str().as_bytes();
    let abstract_name = bytes.first() == Some(&0);
    let name = if abstract_name { &bytes[1..] } else { bytes };
    // A path needs its terminating NUL; an abstract name is counted by the length.
    if bytes.len() + usize::from(!abstract_name) > un.sun_path.len() || name.contains(&0) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "socket path too long or with a NUL byte"));
    }
    un.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in un.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + bytes.len() + usize::from(!abstract_name);
    Ok((ss, len as libc::socklen_t))
}

/// A non-blocking, close-on-exec stream socket of `family`.
fn nonblocking_socket(family: libc::c_int) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: plain system call; the fd is owned (and closed) below.
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// How often a connection that is still being made asks whether to give up.
const CONNECT_POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// A blocking TCP connection to `addr`, made the way `TcpStream::connect` makes it (the
/// kernel's own timeout: about two minutes of SYN retries to a host that drops them), except
/// that it asks `cancel` every 100 ms while it waits and gives up with
/// `io::ErrorKind::Interrupted` when `cancel` says so. A plain blocking `connect` cannot be
/// interrupted by a flag: Ctrl-C went unheard while a firewalled or overloaded host held the
/// connect.
pub fn tcp_connect(
    addr: &std::net::SocketAddr,
    cancel: &dyn Fn() -> bool,
) -> io::Result<std::net::TcpStream> {
    // SAFETY: sockaddr_storage is plain data; all zeroes is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        std::net::SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is large and aligned enough for any sockaddr.
            unsafe { std::ptr::write((&raw mut ss).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        std::net::SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above.
            unsafe { std::ptr::write((&raw mut ss).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    let fd = connect_cancellable(ss.ss_family.into(), &ss, len as libc::socklen_t, cancel)?;
    Ok(std::net::TcpStream::from(fd))
}

/// A blocking connection to the Unix socket at `path` (a name starting with a NUL byte is
/// in the abstract namespace), as `UnixStream::connect` makes it, except that it gives up
/// when `cancel` says so (see [`tcp_connect`]): a blocking connect to a server whose listen
/// queue is full waits for room in it, for ever.
pub fn unix_connect(
    path: &std::path::Path,
    cancel: &dyn Fn() -> bool,
) -> io::Result<std::os::unix::net::UnixStream> {
    let (addr, len) = sockaddr_un(path)?;
    let fd = connect_cancellable(libc::AF_UNIX, &addr, len, cancel)?;
    Ok(std::os::unix::net::UnixStream::from(fd))
}

/// The connect of [`tcp_connect`] and [`unix_connect`]: a non-blocking socket whose connect
/// is waited for in [`CONNECT_POLL`] slices, made blocking again once connected.
fn connect_cancellable(
    family: libc::c_int,
    addr: &libc::sockaddr_storage,
    len: libc::socklen_t,
    cancel: &dyn Fn() -> bool,
) -> io::Result<std::os::fd::OwnedFd> {
    let interrupted = || io::Error::new(io::ErrorKind::Interrupted, "interrupted while connecting");
    let fd = nonblocking_socket(family)?;
    loop {
        // SAFETY: `addr` holds a valid sockaddr of `len` bytes for the duration of the call.
        if unsafe { libc::connect(fd.as_raw_fd(), (addr as *const libc::sockaddr_storage).cast(), len) } == 0
        {
            break;
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            // TCP: the handshake is under way (also after a signal: POSIX has it go on
            // asynchronously); wait until the socket is writable, then read how it ended.
            Some(libc::EINPROGRESS | libc::EINTR) if family != libc::AF_UNIX => {
                loop {
                    if cancel() {
                        return Err(interrupted());
                    }
                    let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
                    // SAFETY: one valid pollfd for the duration of the call.
                    let n = unsafe { libc::poll(&mut p, 1, CONNECT_POLL.as_millis() as libc::c_int) };
                    if n > 0 {
                        break;
                    }
                    if n < 0 {
                        let e = io::Error::last_os_error();
                        if e.kind() != io::ErrorKind::Interrupted {
                            return Err(e);
                        }
                    }
                }
                let mut err: libc::c_int = 0;
                let mut elen = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
                // SAFETY: `err` and `elen` outlive the call and describe an int.
                let r = unsafe {
                    libc::getsockopt(
                        fd.as_raw_fd(),
                        libc::SOL_SOCKET,
                        libc::SO_ERROR,
                        (&raw mut err).cast(),
                        &mut elen,
                    )
                };
                if r < 0 {
                    return Err(io::Error::last_os_error());
                }
                if err != 0 {
                    return Err(io::Error::from_raw_os_error(err));
                }
                break;
            }
            // Unix: the server's listen queue is full. A blocking connect would wait for
            // room; try again shortly (a Unix socket cannot be polled for that).
            Some(libc::EAGAIN) if family == libc::AF_UNIX => {
                if cancel() {
                    return Err(interrupted());
                }
                std::thread::sleep(CONNECT_POLL / 10);
            }
            Some(libc::EINTR) => continue,
            _ => return Err(e),
        }
    }
    // SAFETY: plain fcntl calls on an owned descriptor.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Seconds a TCP connection may be silent before keepalive probes start ([`tcp_keepalive`]).
pub const KEEPALIVE_IDLE: u32 = 30;
/// Seconds between unanswered probes.
pub const KEEPALIVE_INTERVAL: u32 = 10;
/// Unanswered probes that end the connection: a peer that vanished without closing (a host
/// that died, a cable pulled) is found out within 30 + 6 × 10 = 90 s of silence.
pub const KEEPALIVE_COUNT: u32 = 6;

/// The keepalive times in use: the defaults above, or `LIGHTFOOT_TCP_KEEPALIVE=IDLE,INTERVAL,COUNT`
/// (seconds, seconds, probes), which the tests use to find a vanished peer in
/// seconds. A malformed value is ignored with a warning.
pub fn keepalive_times() -> (u32, u32, u32) {
    static TIMES: std::sync::OnceLock<(u32, u32, u32)> = std::sync::OnceLock::new();
    *TIMES.get_or_init(|| {
        let default = (KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT);
        let Ok(v) = std::env::var("LIGHTFOOT_TCP_KEEPALIVE") else { return default };
        parse_keepalive(&v).unwrap_or_else(|| {
            tracing::warn!(
                "LIGHTFOOT_TCP_KEEPALIVE={v:?} ignored: want IDLE,INTERVAL,COUNT (1-32767 s, 1-32767 s, 1-127)"
            );
            default
        })
    })
}

/// `IDLE,INTERVAL,COUNT`: whole numbers within what Linux takes (seconds 1-32767, probes
/// 1-127; past them every `setsockopt` would fail and no connection could be made).
fn parse_keepalive(v: &str) -> Option<(u32, u32, u32)> {
    let n = v.split(',').map(|x| x.trim().parse::<u32>().ok()).collect::<Option<Vec<u32>>>()?;
    match n[..] {
        [idle, interval, count]
            if (1..=32767).contains(&idle)
                && (1..=32767).contains(&interval)
                && (1..=127).contains(&count) =>
        {
            Some((idle, interval, count))
        }
        _ => None,
    }
}

/// Turns on TCP keepalive for a connection, so that a blocked read on it fails (ETIMEDOUT)
/// once the peer has gone without a word, rather than waiting for ever: an NBD client
/// waiting for replies, or a server waiting for the next request, sends nothing of its own
/// and would never notice. A peer that is alive answers the probes, however long it is idle
/// or busy. Not covered: a peer that vanishes while our own data to it is unacknowledged;
/// TCP's retransmissions give up on that after `tcp_retries2` (about 15 minutes by default).
/// No `TCP_USER_TIMEOUT` to shorten it: it also governs zero-window probing, where the peer is
/// alive but not reading (a server holding back a client's writes while its disk catches
/// up), and how kernels treat that case has changed between versions.
pub fn tcp_keepalive(fd: BorrowedFd) -> io::Result<()> {
    let set = |level: libc::c_int, name: libc::c_int, value: u32| {
        let v = value as libc::c_int;
        // SAFETY: plain system call; `v` outlives it and the length is its size.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                level,
                name,
                (&raw const v).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    };
    let (idle, interval, count) = keepalive_times();
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, idle)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, interval)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, count)?;
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)
}

/// An exclusive `flock` on a directory, held until dropped: serialises lightfoot processes
/// that change the same directory entries (replacing a stale socket file). Gives up with
/// `TimedOut` after `wait`: lightfoot holds it for microseconds, so a lock held longer is
/// someone else's, and waiting for it for ever would hang the start.
pub fn lock_dir(dir: &std::path::Path, wait: std::time::Duration) -> io::Result<std::fs::File> {
    let f = std::fs::File::open(dir)?;
    let deadline = std::time::Instant::now() + wait;
    loop {
        // SAFETY: plain system call on an fd we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(f);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EWOULDBLOCK) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Some(libc::EWOULDBLOCK) => {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "held by another process"))
            }
            _ => return Err(e),
        }
    }
}

/// The first socket passed by systemd socket activation (`LISTEN_PID` is this process and
/// `LISTEN_FDS` ≥ 1: fd 3), with its address family (`AF_UNIX` or `AF_INET`/`AF_INET6`).
pub fn socket_activation() -> Option<(std::os::fd::OwnedFd, i32)> {
    let pid: u32 = std::env::var("LISTEN_PID").ok()?.parse().ok()?;
    let fds: u32 = std::env::var("LISTEN_FDS").ok()?.parse().ok()?;
    if pid != std::process::id() || fds < 1 {
        return None;
    }
    let mut domain: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: SO_DOMAIN writes one int into `domain`; `len` says how large it is.
    let ret = unsafe {
        libc::getsockopt(
            3,
            libc::SOL_SOCKET,
            libc::SO_DOMAIN,
            (&mut domain as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if ret != 0 {
        return None;
    }
    // SAFETY: systemd passed fd 3 to us and nothing else in the process owns it; taking it
    // once (the variables are removed) keeps it owned exactly once.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(3) };
    // SAFETY: removing environment variables before any other thread reads them (called at
    // start-up, before threads are spawned).
    unsafe {
        std::env::remove_var("LISTEN_PID");
        std::env::remove_var("LISTEN_FDS");
    }
    Some((fd, domain))
}

/// Prepares `cmd` for systemd socket activation: the child gets `listener` as fd 3 (the
/// caller sets `LISTEN_FDS` and `LISTEN_PID`), its own process group (so a Ctrl-C meant for
/// lightfoot does not kill it mid-copy: lightfoot stops it), and SIGTERM if the spawning
/// thread dies first (`PR_SET_PDEATHSIG` follows the thread, so spawn from the main thread).
pub fn activate_socket(cmd: &mut std::process::Command, listener: std::os::fd::BorrowedFd) {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let fd = listener.as_raw_fd();
    cmd.process_group(0);
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (fcntl, dup2, prctl) on integers; it allocates nothing.
    // `fd` stays open in the parent until spawn returns, so it is valid in the child.
    unsafe {
        cmd.pre_exec(move || {
            if fd == 3 {
                // dup2 onto itself would keep close-on-exec set: clear it instead.
                let flags = libc::fcntl(3, libc::F_GETFD);
                if flags < 0 || libc::fcntl(3, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                    return Err(io::Error::last_os_error());
                }
            } else if libc::dup2(fd, 3) < 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Sends `sig` to the process group a child leads (spawned with `process_group(0)`): the
/// child and whatever it started (a wrapper script's server, a forked daemon) that stayed in
/// its group.
pub fn signal_group(child: &std::process::Child, sig: libc::c_int) -> io::Result<()> {
    // SAFETY: kill with integer arguments. The group id is our child's pid; the kernel does
    // not hand out a pid again while a process group of that id still has members, and once
    // it has none the call fails with ESRCH.
    check(unsafe { libc::kill(-(child.id() as libc::pid_t), sig) } as libc::c_long).map(drop)
}

static USR1: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_usr1(_: libc::c_int) {
    USR1.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Installs a SIGUSR1 handler that only sets a flag (read with [`take_sigusr1`]).
pub fn catch_sigusr1() -> io::Result<()> {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe; the
    // sigaction struct is fully initialised before the call.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_usr1 as *const () as libc::sighandler_t;
        sa.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        check(libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()) as libc::c_long)?;
    }
    Ok(())
}

/// True once after each SIGUSR1.
pub fn take_sigusr1() -> bool {
    USR1.swap(false, std::sync::atomic::Ordering::Relaxed)
}

/// The effective user id (TLS clients look for certificates in root's or the user's place).
pub fn euid() -> u32 {
    // SAFETY: geteuid takes no arguments, touches no memory and cannot fail.
    unsafe { libc::geteuid() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sockopt(fd: BorrowedFd, level: libc::c_int, name: libc::c_int) -> libc::c_int {
        let mut v: libc::c_int = -1;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: `v` and `len` outlive the call; `len` is `v`'s size.
        let r = unsafe { libc::getsockopt(fd.as_raw_fd(), level, name, (&raw mut v).cast(), &raw mut len) };
        assert_eq!(r, 0, "{}", io::Error::last_os_error());
        v
    }

    #[test]
    fn keepalive_times_parse_three_positive_numbers_only() {
        assert_eq!(parse_keepalive("1,1,2"), Some((1, 1, 2)));
        assert_eq!(parse_keepalive(" 30, 10 ,6"), Some((30, 10, 6)));
        assert_eq!(parse_keepalive("32767,32767,127"), Some((32767, 32767, 127)));
        for bad in ["32768,1,1", "1,1,128", "4294967295,1,1"] {
            assert_eq!(parse_keepalive(bad), None, "{bad:?}");
        }
        for bad in ["", "1,1", "1,1,2,3", "1,0,2", "1,x,2", "-1,1,2", "1,,2"] {
            assert_eq!(parse_keepalive(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn tcp_keepalive_is_set_on_both_ends() {
        use std::os::fd::AsFd;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (a, _) = l.accept().unwrap();
        for s in [&c, &a] {
            assert_eq!(sockopt(s.as_fd(), libc::SOL_SOCKET, libc::SO_KEEPALIVE), 0, "off by default");
            tcp_keepalive(s.as_fd()).unwrap();
            assert_eq!(sockopt(s.as_fd(), libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
            let (idle, interval, count) = keepalive_times();
            assert_eq!(sockopt(s.as_fd(), libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), idle as i32);
            assert_eq!(sockopt(s.as_fd(), libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), interval as i32);
            assert_eq!(sockopt(s.as_fd(), libc::IPPROTO_TCP, libc::TCP_KEEPCNT), count as i32);
        }
    }

    /// The connects answer as the blocking ones do: a blocking socket, connected (v4 and v6
    /// over loopback, a Unix path and an abstract name), or the same error.
    #[test]
    fn cancellable_connects_connect_and_fail_like_blocking_ones() {
        use std::io::{Read, Write};
        use std::os::linux::net::SocketAddrExt;
        use std::os::unix::net::{SocketAddr, UnixListener};
        let never = || false;
        for host in ["127.0.0.1:0", "[::1]:0"] {
            let Ok(l) = std::net::TcpListener::bind(host) else { continue }; // no IPv6 here
            let mut c = tcp_connect(&l.local_addr().unwrap(), &never).unwrap();
            let (mut a, _) = l.accept().unwrap();
            c.write_all(b"x").unwrap();
            let mut got = [0u8; 1];
            a.read_exact(&mut got).unwrap();
            // Blocking again: a read with nothing sent times out instead of failing at once.
            c.set_read_timeout(Some(std::time::Duration::from_millis(50))).unwrap();
            let e = c.read(&mut got).unwrap_err();
            assert!(matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut), "{e}");
        }
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let e = tcp_connect(&closed, &never).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let l = UnixListener::bind(&path).unwrap();
        let mut c = unix_connect(&path, &never).unwrap();
        c.write_all(b"y").unwrap();
        let mut got = [0u8; 1];
        l.accept().unwrap().0.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"y");
        let name = format!("lightfoot-test-{}", std::process::id());
        let l = UnixListener::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        let abstract_path = std::path::PathBuf::from(format!("\0{name}"));
        unix_connect(&abstract_path, &never).unwrap();
        l.accept().unwrap();
        let e = unix_connect(&dir.path().join("none.sock"), &never).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
        let long = dir.path().join("x".repeat(200));
        assert_eq!(unix_connect(&long, &never).unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn mincore_tells_the_truth_about_a_file_of_ours() {
        use std::io::Write;
        use std::os::fd::AsFd;
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[1u8; 8192]).unwrap();
        assert!(mincore_is_truthful(f.as_fd()));
        // Written through the cache: its pages are there.
        assert_eq!(mincore_cached_pages(f.as_fd(), 0, 8192).unwrap(), 2);
    }

    #[test]
    fn aligned_buffers_are_zeroed_aligned_and_writable() {
        for len in [1, 4096, 256 << 10, HUGE_BUF_MIN - 1, HUGE_BUF_MIN, 3 << 20, 4 << 20] {
            let mut b = AlignedBuf::new(len);
            assert!(b.len() >= len && b.len().is_multiple_of(BUF_ALIGN), "{len}: {}", b.len());
            let align = if b.len() >= HUGE_BUF_MIN { HUGE_BUF_MIN } else { BUF_ALIGN };
            assert!((b.as_ptr() as usize).is_multiple_of(align), "{len}: {:p}", b.as_ptr());
            assert!(b.iter().all(|&x| x == 0), "{len}: not zeroed");
            b.fill(0xa5);
            assert!(b[b.len() - 1] == 0xa5);
        }
    }
}
