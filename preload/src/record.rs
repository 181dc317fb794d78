//! The records the library leaves for `lightfoot run`: one per file descriptor it looked at
//! (its first sight), one more when the descriptor is finished (what it moved), appended to
//! `$LIGHTFOOT_RUN_DIR/files` in one `writev` each. The format is `lightfoot_record`'s
//! (`record/`), which `lightfoot run` reads them back with.

use libc::c_int;
use lightfoot_record::Header;

/// Appends the record of `fd` (best effort: without a run directory, or if the append fails,
/// the final sweep misses this file and the library's own eviction is all it gets).
pub fn write(fd: c_int, st: &libc::stat, size: u64, cached_pages: u64, flags: u32, bits: &[u8]) {
    let Some(log) = crate::log_path() else { return };
    let mut path = [0u8; 4096];
    let n = crate::sys::path_of(fd, &mut path);
    let mut h = Header::new(flags, crate::sys::pid(), fd, st.st_dev, st.st_ino, n, bits.len());
    (h.size, h.cached_pages) = (size, cached_pages);
    crate::sys::append(log, &[&h.encode(), &path[..n], bits]);
}

/// Appends the [`lightfoot_record::DONE`] record of a descriptor of the file (`dev`, `ino`)
/// that read and wrote these many bytes and evicted these many pages.
pub fn done(dev: u64, ino: u64, read: u64, written: u64, evicted: u64) {
    let Some(log) = crate::log_path() else { return };
    let mut h = Header::new(lightfoot_record::DONE, crate::sys::pid(), -1, dev, ino, 0, 0);
    (h.size, h.cached_pages) = (read, written);
    h.evicted_pages = u32::try_from(evicted).unwrap_or(u32::MAX);
    crate::sys::append(log, &[&h.encode()]);
}
