//! The page cache of a file: what of it is cached (`cachestat`, or `mmap` + `mincore` on
//! kernels before 6.5) and getting it out (`posix_fadvise`, `sync_file_range`).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::block::block_size_bytes;
use super::mem::{page_size, FileMapping};
use super::{check, retry};
use lightfoot_record::{Cachestat, CachestatRange, SYS_CACHESTAT};

/// Page-cache counters of a byte range, in pages, as `cachestat(2)` reports them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct CacheStat {
    pub cached: u64,
    pub dirty: u64,
    pub writeback: u64,
    pub evicted: u64,
    pub recently_evicted: u64,
}

/// `cachestat(2)` (Linux 6.5) of `[offset, offset + len)`; `len == 0` means to the end of file.
/// Since 2025 it answers EPERM for files the caller could not write (KERNEL-NOTES).
pub fn cachestat(fd: BorrowedFd, offset: u64, len: u64) -> io::Result<CacheStat> {
    if NO_CACHESTAT.load(std::sync::atomic::Ordering::Relaxed) {
        return Err(io::Error::from_raw_os_error(libc::ENOSYS));
    }
    let range = CachestatRange { off: offset, len };
    let mut raw = Cachestat::default();
    retry(|| {
        // SAFETY: both pointers are to live, properly laid out `repr(C)` values for the call.
        let ret = unsafe {
            libc::syscall(
                SYS_CACHESTAT,
                fd.as_raw_fd(),
                &range as *const CachestatRange,
                &mut raw as *mut Cachestat,
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
        let vec = FileMapping::new(fd, at, n)?.residency()?;
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
    // SAFETY: stat is plain data; all zeroes is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes one stat into `st`, which outlives the call, about a borrowed fd.
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
