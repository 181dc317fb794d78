//! This process and its children: exit with the parent, signals (SIGUSR1; a child's process
//! group), the effective user id, and directory locks between lightfoot processes.

use std::io;

use super::check;

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

/// An exclusive `flock` on a directory, held until dropped: serialises lightfoot processes
/// that change the same directory entries (replacing a stale socket file). Gives up with
/// `TimedOut` after `wait`: lightfoot holds it for microseconds, so a lock held longer is
/// someone else's, and waiting for it for ever would hang the start.
pub fn lock_dir(dir: &std::path::Path, wait: std::time::Duration) -> io::Result<std::fs::File> {
    let f = std::fs::File::open(dir)?;
    let deadline = std::time::Instant::now() + wait;
    while !super::try_flock(std::os::fd::AsFd::as_fd(&f), true)? {
        if std::time::Instant::now() >= deadline {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "held by another process"));
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    Ok(f)
}

/// The signals `lightfoot run` passes on to its command when they are sent to lightfoot itself.
pub const FORWARDED: [libc::c_int; 6] =
    [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGQUIT, libc::SIGUSR1, libc::SIGUSR2];

fn forwarded_set() -> libc::sigset_t {
    // SAFETY: an all-zero sigset_t is a valid value for sigemptyset to initialise.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a live sigset_t; sigemptyset/sigaddset only write into it.
    unsafe {
        libc::sigemptyset(&mut set);
        for s in FORWARDED {
            libc::sigaddset(&mut set, s);
        }
    }
    set
}

/// Blocks [`FORWARDED`] in the calling thread (and the threads it starts afterwards), so that
/// they wait for [`next_forwarded`] instead of ending lightfoot. Call it before any thread is
/// started. A child spawned by std starts with an empty mask of its own.
pub fn block_forwarded() -> io::Result<()> {
    let set = forwarded_set();
    // SAFETY: `set` is initialised; the old mask is not wanted (null).
    let r = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(())
}

/// Waits for one of [`FORWARDED`] (blocked by [`block_forwarded`]); the signal, and whether a
/// process sent it (`kill`, `sigqueue`: si_code ≤ 0) rather than the kernel (a terminal's
/// Ctrl-C, which reaches the whole foreground process group, the command included, on its own).
pub fn next_forwarded() -> (libc::c_int, bool) {
    let set = forwarded_set();
    loop {
        // SAFETY: an all-zero siginfo_t is valid for the kernel to fill in.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` and `info` are live for the call.
        let s = unsafe { libc::sigwaitinfo(&set, &mut info) };
        if s > 0 {
            return (s, info.si_code <= 0);
        }
    }
}

/// Sends `sig` to the process `pid`.
pub fn send_signal(pid: u32, sig: libc::c_int) -> io::Result<()> {
    // SAFETY: kill touches no memory.
    if unsafe { libc::kill(pid as libc::pid_t, sig) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Has `cmd`'s child unblock [`FORWARDED`] before it executes its program: a blocked signal
/// mask is inherited across `exec`, and a command that cannot get SIGTERM is not the command
/// the user ran.
pub fn unblock_forwarded_on_exec(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    let set = forwarded_set();
    // SAFETY: the closure runs in the child between fork and exec and calls only
    // pthread_sigmask, which is async-signal-safe; `set` is a copy owned by the closure.
    unsafe {
        cmd.pre_exec(move || {
            let r = libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
            if r != 0 {
                return Err(io::Error::from_raw_os_error(r));
            }
            Ok(())
        })
    };
}

/// A descriptor of this process's own (close-on-exec) for `fd`, one the caller handed down
/// (`--progress=FD`); `EBADF` if `fd` is not open. The copy leaves the caller's descriptor and
/// its flags as they were.
pub fn dup_inherited(fd: std::os::fd::RawFd) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: fcntl with integer arguments; F_DUPFD_CLOEXEC returns a new descriptor, which
    // nothing else owns, so taking ownership of it is sound.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    check(new as libc::c_long)?;
    // SAFETY: as above: the descriptor was just made and is ours alone.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(new) })
}
