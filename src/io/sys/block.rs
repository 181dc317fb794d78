//! Block-device ioctls: size, logical block size, zero-out and discard.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::{check, retry};

const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const BLKSSZGET: libc::c_ulong = 0x1268;
const BLKDISCARD: libc::c_ulong = 0x1277;
const BLKZEROOUT: libc::c_ulong = 0x127f;

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
