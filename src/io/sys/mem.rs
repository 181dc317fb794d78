//! Memory: the page size, buffers aligned for O_DIRECT (huge pages for large ones), and
//! read-only mappings of a file.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// A heap buffer aligned for O_DIRECT (4 KiB covers every logical block size we meet).
///
/// Buffers of [`MAP_BUF_MIN`] and more are mapped on their own, never taken from malloc:
/// glibc raises its mmap threshold to the size of each mapped block freed, after which blocks
/// of that size come from its per-thread arenas, and blocks allocated on one thread and freed
/// on another (a prefetch chunk, a GET's body) left those arenas holding up to twice what was
/// in use (docs/benchmarks/runs/s3-memory.md).
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

/// Smallest buffer mapped on its own: glibc's own initial mmap threshold.
pub const MAP_BUF_MIN: usize = 128 << 10;

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
        } else if cap >= MAP_BUF_MIN {
            if let Some(buf) = Self::map(cap) {
                return buf;
            }
        }
        let layout = std::alloc::Layout::from_size_align(cap, BUF_ALIGN).expect("buffer layout");
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len: cap, mapped: false }
    }

    /// `cap` bytes (a multiple of 4 KiB) of fresh anonymous memory (zeroed by the kernel).
    fn map(cap: usize) -> Option<AlignedBuf> {
        let base = anonymous(cap)?;
        Some(AlignedBuf { ptr: std::ptr::NonNull::new(base.cast())?, len: cap, mapped: true })
    }

    /// `cap` bytes (a multiple of 4 KiB) of fresh anonymous memory (zeroed by the kernel),
    /// starting on a 2 MiB boundary, advised to use huge pages before anything touches it.
    fn map_huge(cap: usize) -> Option<AlignedBuf> {
        let span = cap + HUGE_BUF_MIN;
        let base = anonymous(span)?;
        // SAFETY: the parts of the fresh mapping outside the aligned window are unmapped at
        // once, and the window is owned by the returned buffer.
        unsafe {
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

/// A fresh private anonymous mapping of `len` bytes, `None` if the kernel refused it.
fn anonymous(len: usize) -> Option<*mut libc::c_void> {
    // SAFETY: a new mapping at an address the kernel chooses overlaps no memory of ours.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    (base != libc::MAP_FAILED).then_some(base)
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: the window mapped in `map` or `map_huge`, owned by this buffer.
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

/// A read-only shared mapping of part of a file, unmapped when dropped: for `mincore`, and
/// for tests that hold a page of a file mapped. Its bytes are never lent out as a slice: the
/// file may change under the mapping (a write through another fd), which memory behind a
/// `&[u8]` must not do; [`FileMapping::read_byte`] reads one byte at a time instead.
pub struct FileMapping {
    addr: *mut libc::c_void,
    len: usize,
}

// SAFETY: a mapping belongs to the process, not to a thread: it may be read and unmapped from
// any thread, and this value owns it exclusively.
unsafe impl Send for FileMapping {}

impl FileMapping {
    /// Maps `len` bytes (more than 0) of `fd` from `offset` (a multiple of the page size).
    pub fn new(fd: BorrowedFd, offset: u64, len: usize) -> io::Result<FileMapping> {
        // SAFETY: a fresh read-only shared mapping at an address the kernel chooses, so it
        // overlaps no memory of ours; owned by the value returned, whose drop unmaps it.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(FileMapping { addr, len })
    }

    /// Which pages of the mapping are in the page cache (`mincore`): bit 0 of one byte per
    /// page.
    pub fn residency(&self) -> io::Result<Vec<u8>> {
        let mut vec = vec![0u8; self.len.div_ceil(page_size())];
        // SAFETY: `addr` maps `len` bytes; `vec` has one byte per page of it.
        let ret = unsafe { libc::mincore(self.addr, self.len, vec.as_mut_ptr()) };
        if ret != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(vec)
    }

    /// Byte `i` of the mapping, read through it (faulting its page in).
    pub fn read_byte(&self, i: usize) -> u8 {
        assert!(i < self.len, "byte {i} of a mapping of {}", self.len);
        // SAFETY: `i` is inside the live, readable mapping. A volatile read through a raw
        // pointer: no reference to bytes the file may change. (A page past the end of the file
        // raises SIGBUS, which ends the process, not undefined behaviour.)
        unsafe { std::ptr::read_volatile(self.addr.cast::<u8>().add(i)) }
    }
}

impl Drop for FileMapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `new` mapped, once; nothing borrows from it.
        unsafe { libc::munmap(self.addr, self.len) };
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buffers_are_zeroed_aligned_and_writable() {
        for len in [
            1,
            4096,
            MAP_BUF_MIN - 1,
            MAP_BUF_MIN,
            256 << 10,
            HUGE_BUF_MIN - 1,
            HUGE_BUF_MIN,
            3 << 20,
            4 << 20,
        ] {
            let mut b = AlignedBuf::new(len);
            assert!(b.len() >= len && b.len().is_multiple_of(BUF_ALIGN), "{len}: {}", b.len());
            let align = if b.len() >= HUGE_BUF_MIN { HUGE_BUF_MIN } else { BUF_ALIGN };
            assert!((b.as_ptr() as usize).is_multiple_of(align), "{len}: {:p}", b.as_ptr());
            assert!(b.iter().all(|&x| x == 0), "{len}: not zeroed");
            assert_eq!(b.mapped, b.len() >= MAP_BUF_MIN, "{len}");
            b.fill(0xa5);
            assert!(b[b.len() - 1] == 0xa5);
        }
    }
}
