//! The records the library leaves for `lightfoot run`: one per file descriptor it looked at,
//! appended to `$LIGHTFOOT_RUN_DIR/files` in one `writev` each (so the records of every process
//! of the run follow each other whole, in the order the looks happened).
//!
//! A record is a [`Header`] (native byte order: written and read on one machine), the path
//! (`path_len` bytes, as `/proc/self/fd/N` names it), then the bitmap of the blocks that held
//! pages at first sight (`ceil(blocks / 8)` bytes, bit `b % 8` of byte `b / 8`), absent when no
//! page of the file was cached then. `lightfoot run` (src/run/records.rs) reads them back: the
//! first record of a file (device, inode) is its first sight.

use libc::c_int;

/// "LFR1".
pub const MAGIC: u32 = u32::from_le_bytes(*b"LFR1");

/// The descriptor could write.
pub const WRITABLE: u32 = 1;
/// Not covered: cachestat refused the file (EPERM: not writable by the caller, nor owned).
pub const NOT_COVERED_EPERM: u32 = 2;
/// Not covered: no cachestat on this kernel (before 6.5).
pub const NOT_COVERED_NOSYS: u32 = 4;
/// Not covered: another cachestat error.
pub const NOT_COVERED_OTHER: u32 = 8;
/// Some pages were cached but no bitmap could be made: every block counts as cached.
pub const ALL_CACHED: u32 = 16;
/// Not a first sight: what a descriptor moved, written when it is finished (closed). `size`
/// holds the bytes read, `cached_pages` the bytes written, `evicted_pages` the pages its drops
/// took out of the cache; no path, no bitmap.
pub const DONE: u32 = 32;

#[repr(C)]
pub struct Header {
    pub magic: u32,
    /// Header, path and bitmap.
    pub len: u32,
    pub flags: u32,
    pub pid: u32,
    pub fd: i32,
    pub path_len: u32,
    pub dev: u64,
    pub ino: u64,
    /// Bytes at first sight.
    pub size: u64,
    /// Pages cached at first sight.
    pub cached_pages: u64,
    /// Block size, as a shift (21: 2 MiB).
    pub block_shift: u32,
    /// In a [`DONE`] record: the pages the descriptor's drops took out (saturating; 16 TiB).
    pub evicted_pages: u32,
}

/// The flag for a cachestat error.
pub fn not_covered(errno: c_int, writable: bool) -> u32 {
    let w = if writable { WRITABLE } else { 0 };
    w | match errno {
        libc::EPERM => NOT_COVERED_EPERM,
        libc::ENOSYS => NOT_COVERED_NOSYS,
        _ => NOT_COVERED_OTHER,
    }
}

/// Appends the record of `fd` (best effort: without a run directory, or if the append fails,
/// the final sweep misses this file and the library's own eviction is all it gets).
pub fn write(fd: c_int, st: &libc::stat, size: u64, cached_pages: u64, flags: u32, bits: &[u8]) {
    let Some(log) = crate::log_path() else { return };
    let mut path = [0u8; 4096];
    let n = crate::sys::path_of(fd, &mut path);
    let h = Header {
        magic: MAGIC,
        len: (std::mem::size_of::<Header>() + n + bits.len()) as u32,
        flags,
        pid: crate::sys::pid(),
        fd,
        path_len: n as u32,
        dev: st.st_dev,
        ino: st.st_ino,
        size,
        cached_pages,
        block_shift: crate::fds::SHIFT,
        evicted_pages: 0,
    };
    // SAFETY: `Header` is `repr(C)` of plain integers with no padding (4×6 + 8×4 + 4×2 bytes):
    // every byte of it is initialised.
    let head = unsafe {
        std::slice::from_raw_parts(&h as *const Header as *const u8, std::mem::size_of::<Header>())
    };
    crate::sys::append(log, &[head, &path[..n], bits]);
}

/// Appends the [`DONE`] record of a descriptor of the file (`dev`, `ino`) that read and wrote
/// these many bytes and evicted these many pages.
pub fn done(dev: u64, ino: u64, read: u64, written: u64, evicted: u64) {
    let Some(log) = crate::log_path() else { return };
    let h = Header {
        magic: MAGIC,
        len: std::mem::size_of::<Header>() as u32,
        flags: DONE,
        pid: crate::sys::pid(),
        fd: -1,
        path_len: 0,
        dev,
        ino,
        size: read,
        cached_pages: written,
        block_shift: crate::fds::SHIFT,
        evicted_pages: u32::try_from(evicted).unwrap_or(u32::MAX),
    };
    // SAFETY: as in `write`: a `repr(C)` header of plain integers, every byte initialised.
    let head = unsafe {
        std::slice::from_raw_parts(&h as *const Header as *const u8, std::mem::size_of::<Header>())
    };
    crate::sys::append(log, &[head]);
}
