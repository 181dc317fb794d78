//! What `lightfoot run`'s watcher needs from the kernel: fanotify (which files a process tree
//! opens and closes, and holding each open until its first sight is taken), becoming the
//! subreaper of a process tree, and reaping any child.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;

use super::{check, retry};

/// A fanotify group of class `FAN_CLASS_CONTENT`: it may hold opens (`FAN_OPEN_PERM`).
pub struct Fanotify(OwnedFd);

/// One event read from a [`Fanotify`] group.
pub enum FanEvent {
    /// A process asks to open the file; it waits until [`Fanotify::allow`] answers.
    OpenPerm { fd: OwnedFd, pid: u32 },
    /// A file was closed (the last reference to an open file description went away).
    Close { fd: OwnedFd, pid: u32 },
    /// The kernel dropped events (cannot happen with an unlimited queue, but is handled).
    Overflow,
}

impl Fanotify {
    /// A new group; needs CAP_SYS_ADMIN. The descriptors events carry are opened read-only
    /// without updating the access time, each a new open file description of lightfoot's own.
    pub fn new() -> io::Result<Self> {
        let flags = libc::FAN_CLASS_CONTENT | libc::FAN_CLOEXEC | libc::FAN_UNLIMITED_QUEUE;
        let f_flags =
            (libc::O_RDONLY | libc::O_LARGEFILE | libc::O_CLOEXEC | libc::O_NOATIME) as libc::c_uint;
        // SAFETY: integer arguments only; a non-negative result is a new descriptor we own.
        let fd = check(unsafe { libc::fanotify_init(flags, f_flags) } as libc::c_long)?;
        // SAFETY: `fd` was just returned by fanotify_init and nothing else owns it.
        Ok(Fanotify(unsafe { OwnedFd::from_raw_fd(fd as i32) }))
    }

    /// Watches the whole file system `path` is on (`whole`), or only the mount `path` is on
    /// (in this process's mount namespace): opens (held) and closes.
    pub fn mark(&self, path: &Path, whole: bool) -> io::Result<()> {
        let c = std::ffi::CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let mask = libc::FAN_OPEN_PERM | libc::FAN_CLOSE_WRITE | libc::FAN_CLOSE_NOWRITE;
        let flags = libc::FAN_MARK_ADD | if whole { libc::FAN_MARK_FILESYSTEM } else { libc::FAN_MARK_MOUNT };
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        let r = unsafe { libc::fanotify_mark(self.0.as_raw_fd(), flags, mask, libc::AT_FDCWD, c.as_ptr()) };
        check(r as libc::c_long).map(drop)
    }

    /// Waits up to `timeout_ms` for events and reads what is queued.
    pub fn read(&self, buf: &mut [u8], timeout_ms: i32) -> io::Result<Vec<FanEvent>> {
        if !super::net::wait_readable(self.0.as_fd(), timeout_ms)? {
            return Ok(Vec::new());
        }
        let len = retry(|| {
            // SAFETY: `buf` is writable for its whole length.
            check(
                unsafe { libc::read(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) } as libc::c_long
            )
        })?;
        let meta = std::mem::size_of::<libc::fanotify_event_metadata>();
        let mut out = Vec::new();
        let mut at = 0;
        while len - at >= meta {
            // SAFETY: at least `meta` bytes from `at` were filled by the kernel; read_unaligned
            // copies them whatever the buffer's alignment.
            let m: libc::fanotify_event_metadata =
                unsafe { std::ptr::read_unaligned(buf[at..].as_ptr().cast()) };
            if (m.event_len as usize) < meta || at + m.event_len as usize > len {
                break;
            }
            at += m.event_len as usize;
            if m.mask & libc::FAN_Q_OVERFLOW != 0 || m.fd < 0 {
                out.push(FanEvent::Overflow);
                continue;
            }
            // SAFETY: the kernel installed this descriptor in our table for this event; it is
            // ours to close.
            let fd = unsafe { OwnedFd::from_raw_fd(m.fd) };
            let pid = m.pid as u32;
            out.push(if m.mask & libc::FAN_OPEN_PERM != 0 {
                FanEvent::OpenPerm { fd, pid }
            } else {
                FanEvent::Close { fd, pid }
            });
        }
        Ok(out)
    }

    /// Lets the open that `fd` (from a [`FanEvent::OpenPerm`]) stands for go ahead.
    pub fn allow(&self, fd: &OwnedFd) -> io::Result<()> {
        let r = libc::fanotify_response { fd: fd.as_raw_fd(), response: libc::FAN_ALLOW };
        let size = std::mem::size_of::<libc::fanotify_response>();
        retry(|| {
            // SAFETY: `r` is a live fanotify_response of `size` bytes.
            check(unsafe {
                libc::write(self.0.as_raw_fd(), (&r as *const libc::fanotify_response).cast(), size)
            } as libc::c_long)
        })
        .map(drop)
    }
}

/// Moves this process into a mount namespace of its own, a copy of the one it was in (same
/// mounts, new mount objects): marks on its mounts see only the opens made through them.
/// Fails (EINVAL) once the process has more than one thread.
pub fn unshare_mounts() -> io::Result<()> {
    // SAFETY: unshare with a flag only.
    check(unsafe { libc::unshare(libc::CLONE_NEWNS) } as libc::c_long).map(drop)
}

/// Makes this process the subreaper of its descendants: a process whose parent ends is
/// re-parented here rather than to init, so every process CMD starts stays a descendant.
pub fn become_subreaper() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    check(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) } as libc::c_long)
        .map(drop)
}

/// Waits for any child to end and reaps it: its pid and how it ended.
pub fn wait_any_child() -> io::Result<(u32, std::process::ExitStatus)> {
    let mut status = 0;
    // SAFETY: `status` is a live int for the kernel to fill.
    let pid = retry(|| check(unsafe { libc::waitpid(-1, &mut status, 0) } as libc::c_long))?;
    Ok((pid as u32, std::process::ExitStatus::from_raw(status)))
}

/// Reaps every child that has ended, without waiting.
pub fn reap_ended_children() {
    let mut status = 0;
    // SAFETY: as in `wait_any_child`; WNOHANG returns 0 when no child has ended.
    while unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) } > 0 {}
}
