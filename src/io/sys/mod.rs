//! Every system call lightfoot makes outside `std`: the only `unsafe` in the crate.
//!
//! Each wrapper takes a borrowed fd and returns `io::Result`, so callers never touch raw errno.
//! Constants the `libc` crate or Debian's headers may lack are defined here (KERNEL-NOTES:
//! define RWF_DONTCACHE yourself).
//!
//! By topic, one file each; everything is re-exported here, so callers write `sys::pread` or
//! `sys::tcp_connect` whichever file holds it:
//!
//! - `file.rs`: reads and writes with per-call flags (`preadv2`/`pwritev2`, RWF_DONTCACHE,
//!   RWF_DSYNC), `fdatasync`, `fallocate`, `SEEK_DATA`/`SEEK_HOLE`, block size and O_DIRECT
//!   alignment, `access`, `renameat2`.
//! - `cache.rs`: the page cache of a file: [`cachestat`] (or `mincore` before Linux 6.5),
//!   [`fadvise`], [`sync_file_range`].
//! - `block.rs`: block-device ioctls (size, logical block size, zero-out, discard).
//! - `mem.rs`: [`AlignedBuf`], the O_DIRECT buffer (huge pages for large ones), the page size,
//!   and [`FileMapping`], a read-only mapping of a file.
//! - `net.rs`: connects a flag can cancel ([`tcp_connect`], [`unix_connect`]), TCP keepalive,
//!   and both ends of systemd socket activation.
//! - `process.rs`: `--exit-with-parent`, signals (SIGUSR1, a child's process group), the
//!   effective user id, and directory locks between lightfoot processes.
//! - `watch.rs`: fanotify, the subreaper, reaping any child (`lightfoot run`'s watcher).

// The one exception to the crate root's `deny(unsafe_code)`: calling libc and managing raw
// memory need it. Every block says why it is sound (`// SAFETY:`, which clippy's
// `undocumented_unsafe_blocks`, denied at the root, insists on).
#![allow(unsafe_code)]

use std::io;

mod block;
mod cache;
mod file;
mod mem;
mod net;
mod process;
mod watch;

pub use block::{block_discard, block_logical_size, block_size_bytes, block_zeroout};
pub use cache::{
    cached_pages, cachestat, fadvise, mincore_cached_pages, mincore_is_truthful, pretend_no_cachestat,
    sync_file_range, Advice, CacheStat, SFR_WAIT_AFTER, SFR_WAIT_BEFORE, SFR_WRITE,
};
pub use file::{
    can_write, dio_alignment, fallocate, fdatasync, fs_block_size, get_xattr, pread, pwrite, remove_xattr,
    rename_noreplace, seek_data, seek_hole, set_xattr, try_flock, FALLOC_KEEP_SIZE, FALLOC_PUNCH_HOLE,
    FALLOC_ZERO_RANGE, RWF_DONTCACHE, RWF_DSYNC,
};
pub use mem::{page_size, AlignedBuf, FileMapping, BUF_ALIGN, HUGE_BUF_MIN};
pub use net::{
    activate_socket, keepalive_times, recv_arrived, socket_activation, tcp_connect, tcp_keepalive,
    unix_connect, unix_connect_nonblocking, unix_send_buffer, wait_readable, KEEPALIVE_COUNT, KEEPALIVE_IDLE,
    KEEPALIVE_INTERVAL,
};
pub use process::{
    block_forwarded, catch_sigusr1, dup_inherited, euid, exit_with_parent, lock_dir, next_forwarded,
    send_signal, signal_group, take_sigusr1, unblock_forwarded_on_exec, FORWARDED,
};
pub use watch::{become_subreaper, reap_ended_children, unshare_mounts, wait_any_child, FanEvent, Fanotify};

fn check(ret: libc::c_long) -> io::Result<usize> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as usize)
    }
}

/// Retries a call interrupted by a signal (Ctrl-C is handled by a flag, not by EINTR).
pub(crate) fn retry<T>(mut f: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    loop {
        match f() {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}
