//! O_DIRECT reads and writes: aligned requests as they are, others through an aligned
//! bounce buffer, with a read-modify-write of partial blocks under per-block locks.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use super::{footprint, read_full, write_full, PolicyFile, RMW_LOCK_BITS};
use crate::io::sys::{self, AlignedBuf};

impl PolicyFile {
    fn direct_fd(&self) -> io::Result<BorrowedFd<'_>> {
        self.direct.as_ref().map(|f| f.as_fd()).ok_or_else(|| io::Error::from_raw_os_error(libc::EOPNOTSUPP))
    }

    fn is_aligned(&self, ptr: *const u8, offset: u64, len: usize) -> bool {
        let a = self.align;
        offset.is_multiple_of(a) && (len as u64).is_multiple_of(a) && (ptr as u64).is_multiple_of(a)
    }

    pub(super) fn read_direct(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
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

    pub(super) fn write_direct(&self, buf: &[u8], offset: u64, dsync: i32) -> io::Result<()> {
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
        let (i, j) = (crate::io::spread(head, RMW_LOCK_BITS), crate::io::spread(tail, RMW_LOCK_BITS));
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
}
