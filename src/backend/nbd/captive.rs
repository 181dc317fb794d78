//! Captive servers: `[ qemu-nbd -f qcow2 disk.qcow2 ]` on the command line. lightfoot binds a
//! Unix socket in a private directory, starts the command with that socket passed by systemd
//! socket activation (fd 3, `LISTEN_FDS=1`, `LISTEN_PID` = the child), connects to it, and
//! stops the server (SIGTERM, then SIGKILL) when the job ends. qemu-nbd, nbdkit and
//! `lightfoot serve` all understand socket activation.
//!
//! `LISTEN_PID` must be the child's own pid, which only the child knows: the command runs under
//! `sh -c 'LISTEN_PID=$$; export LISTEN_PID; exec "$@"'`, which sets it and then becomes the
//! server (same pid). Setting environment variables between fork and exec is not
//! async-signal-safe in a threaded parent; this is.

use std::os::fd::AsFd;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Op, Result};

/// How long a server gets to exit after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

pub struct Captive {
    /// `[ cmd args ]`, for messages.
    pub display: String,
    child: Mutex<Option<Child>>,
    /// How the server ended, when it ended before [`Captive::stop`] (it died, or quit).
    ended: Mutex<Option<ExitStatus>>,
    dir: PathBuf,
    socket: PathBuf,
}

impl Captive {
    /// Starts `argv` with a listening socket passed to it.
    pub fn start(argv: &[String]) -> Result<Captive> {
        let display = format!("[ {} ]", argv.join(" "));
        let fail = |kind, detail: String| Error::new(kind, Op::StartServer).path(&display).detail(detail);
        let Some(program) = argv.first() else {
            return Err(fail(ErrorKind::InvalidInput, "no command between [ and ]".into()));
        };
        if !on_path(program) {
            return Err(fail(ErrorKind::NotFound, format!("command '{program}' not found")));
        }
        let dir = private_dir().map_err(|e| Error::io(Op::StartServer, e).path(&display))?;
        let socket = dir.join("nbd.sock");
        let spawned = (|| {
            let listener = UnixListener::bind(&socket)?;
            let mut cmd = Command::new("/bin/sh");
            cmd.arg("-c")
                .arg(r#"LISTEN_PID=$$; export LISTEN_PID; exec "$@""#)
                .arg("lightfoot-captive")
                .args(argv)
                .env("LISTEN_FDS", "1")
                .env_remove("LISTEN_FDNAMES")
                .stdin(Stdio::null())
                // Never let the server write on our standard output: it may be the copy's
                // destination (`-`).
                .stdout(std::io::stderr().as_fd().try_clone_to_owned()?);
            crate::io::sys::activate_socket(&mut cmd, listener.as_fd());
            let child = cmd.spawn()?;
            // Only the child holds the listening socket now: if it dies, connecting fails
            // instead of waiting forever.
            drop(listener);
            Ok::<_, std::io::Error>(child)
        })();
        match spawned {
            Ok(child) => {
                Ok(Captive { display, child: Mutex::new(Some(child)), ended: Mutex::new(None), dir, socket })
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                Err(Error::io(Op::StartServer, e).path(&display))
            }
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// If the server has exited (waiting up to `patience` for it to), how: for messages
    /// after a failed connection.
    pub fn exited(&self, patience: Duration) -> Option<ExitStatus> {
        let mut guard = self.child.lock().unwrap();
        let child = guard.as_mut()?;
        let deadline = Instant::now() + patience;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => {
                    *self.ended.lock().unwrap() = Some(status);
                    return Some(status);
                }
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                _ => return None,
            }
        }
    }

    /// How the server ended if it ended on its own (not stopped by [`Captive::stop`]), as
    /// far as [`Captive::exited`] or `stop` saw.
    pub fn ended(&self) -> Option<ExitStatus> {
        *self.ended.lock().unwrap()
    }

    /// Stops the server: SIGTERM, then SIGKILL after a grace period. Idempotent.
    pub fn stop(&self) {
        let Some(mut child) = self.child.lock().unwrap().take() else { return };
        let running = match child.try_wait() {
            Ok(Some(status)) => {
                *self.ended.lock().unwrap() = Some(status);
                false
            }
            Ok(None) => true,
            Err(_) => false,
        };
        // The whole group, even when the child itself has exited: a server started by a
        // wrapper script without `exec`, or one that forked, is not the child.
        let _ = crate::io::sys::signal_group(&child, libc::SIGTERM);
        if running {
            let deadline = Instant::now() + STOP_GRACE;
            loop {
                match child.try_wait() {
                    Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                    Ok(None) => {
                        tracing::warn!(
                            "{}: still running {STOP_GRACE:?} after SIGTERM; killing it",
                            self.display
                        );
                        let _ = crate::io::sys::signal_group(&child, libc::SIGKILL);
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                    _ => break,
                }
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for Captive {
    fn drop(&mut self) {
        self.stop();
    }
}

/// True when `program` names an executable, directly or through `$PATH`.
fn on_path(program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let executable =
        |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if program.contains('/') {
        return executable(Path::new(program));
    }
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| executable(&dir.join(program))))
}

/// A new directory only we can enter, for the socket.
fn private_dir() -> std::io::Result<PathBuf> {
    static N: AtomicU64 = AtomicU64::new(0);
    let base = std::env::temp_dir();
    loop {
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = base.join(format!("lightfoot-{}-{n}", std::process::id()));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}
