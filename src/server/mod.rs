//! The NBD server: one export, served over TCP or a Unix socket to many connections.
//!
//! - [`Server`] holds the export and the shared state (shutdown flag, connection count) and
//!   runs the accept loop ([`Server::serve`]); each connection gets a thread.
//! - [`handshake`]: the fixed newstyle handshake, over any [`crate::stream::Stream`]; with
//!   [`Server::with_tls`], STARTTLS turns the connection into a [`crate::tls::TlsStream`].
//! - [`transmission`]: requests read and validated ([`validate`]) by one thread, carried out
//!   by `threads` workers against the connection's own backend, replies out of order.
//! - [`Export`]: what is served, and how to open one backend per connection (one fd each:
//!   readahead state belongs to the open file; errors and block locks are shared).
//!
//! Every byte on the wire is encoded and decoded by [`crate::proto`]; this module moves the
//! bytes and decides what to answer. A malformed handshake or garbage on the wire ends that
//! connection only.

use std::io;
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::{Backend, Caps};
use crate::error::{Error, Op, Result};
use crate::proto::*;

pub mod handshake;
pub mod inbox;
pub mod stats;
pub mod transmission;
pub mod validate;

type Opener = Box<dyn Fn() -> crate::Result<Arc<dyn Backend>> + Send + Sync>;

/// What is served.
pub struct Export {
    pub name: String,
    pub description: Option<String>,
    pub read_only: bool,
    pub size: u64,
    pub caps: Caps,
    /// Everything the export holds is shared by its connections (one page cache, one error
    /// latch, flushes are per inode), so `CAN_MULTI_CONN` is true.
    pub multi_conn: bool,
    /// The first write error that may have lost acknowledged data (a failed flush or FUA
    /// write, a writeback error), on any connection: every later flush and FUA request fails
    /// with it. Kept here, not per connection, because the kernel reports a writeback error
    /// only once per open file, and each connection has its own.
    pub latch: crate::error::Sticky,
    /// Dirty bitmaps (`--dirty-bitmap`): marked by every change, offered to clients as
    /// `qemu:dirty-bitmap:NAME` meta contexts.
    pub bitmaps: Option<Arc<crate::bitmap::Tracker>>,
    open: Opener,
}

impl Export {
    /// `open` is called once now (to learn the size and capabilities) and once per
    /// connection.
    pub fn new(
        name: &str,
        description: Option<String>,
        multi_conn: bool,
        open: impl Fn() -> crate::Result<Arc<dyn Backend>> + Send + Sync + 'static,
    ) -> crate::Result<Export> {
        let probe = open()?;
        let size = probe.size().ok_or_else(|| {
            crate::Error::new(crate::ErrorKind::InvalidInput, Op::Serve)
                .path(probe.name())
                .detail("size unknown: only files, devices and memory can be served")
        })?;
        let caps = probe.caps();
        probe.finish()?;
        Ok(Export {
            name: name.to_string(),
            description,
            read_only: caps.read_only,
            size,
            caps,
            multi_conn,
            latch: Default::default(),
            bitmaps: None,
            open: Box::new(open),
        })
    }

    /// Tracks changes in `bitmaps` and offers them to clients.
    pub fn with_bitmaps(mut self, bitmaps: Arc<crate::bitmap::Tracker>) -> Export {
        self.bitmaps = Some(bitmaps);
        self
    }

    /// A backend for one more connection.
    pub fn open(&self) -> crate::Result<Arc<dyn Backend>> {
        (self.open)()
    }

    /// The client's name for it: its own, or the empty "default export" name.
    pub fn matches(&self, name: &str) -> bool {
        name == self.name || name.is_empty()
    }

    /// Transmission flags.
    pub fn flags(&self) -> u16 {
        let c = &self.caps;
        let mut f = TF_HAS_FLAGS | TF_SEND_FUA | TF_SEND_CACHE;
        let set = |f: &mut u16, cond: bool, bit: u16| {
            if cond {
                *f |= bit
            }
        };
        set(&mut f, self.read_only, TF_READ_ONLY);
        set(&mut f, c.can_flush, TF_SEND_FLUSH);
        set(&mut f, c.rotational, TF_ROTATIONAL);
        set(&mut f, !self.read_only && c.can_trim, TF_SEND_TRIM);
        set(&mut f, !self.read_only && c.can_zero, TF_SEND_WRITE_ZEROES);
        set(&mut f, !self.read_only && c.can_zero && c.can_fast_zero, TF_SEND_FAST_ZERO);
        set(&mut f, self.multi_conn, TF_CAN_MULTI_CONN);
        f
    }
}

/// Where to listen.
pub enum Listener {
    Tcp(TcpListener),
    /// A Unix socket, with the device and inode of the socket file when lightfoot created it
    /// (not when systemd did): removed at exit if it is still that file.
    Unix(UnixListener, PathBuf, Option<(u64, u64)>),
}

impl Listener {
    /// Binds a Unix socket; a stale socket file nobody listens on is replaced.
    ///
    /// The socket file appears only once it accepts connections: it is bound and listening
    /// under a temporary name in the same directory, then renamed into place (without
    /// replacing anything there: a live server's socket still gives "address in use"). Bound
    /// at its own name, it would exist between `bind` and `listen`, and a client that waits
    /// for the file (scripts, the tests) could connect in between and be refused.
    pub fn unix(path: &std::path::Path) -> Result<Listener> {
        Self::bind_unix(path).map_err(|e| Error::io(Op::Listen, e).path(path))
    }

    fn bind_unix(path: &std::path::Path) -> io::Result<Listener> {
        // The temporary name is never removed first: if it is taken (a file of that name, the
        // same PID in another PID namespace), the socket is bound at its own name, as it
        // also is when the temporary name is too long for a socket address or the
        // filesystem has no RENAME_NOREPLACE.
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".{}.{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed)));
        let tmp = PathBuf::from(tmp);
        let direct = |why: &dyn std::fmt::Display| {
            tracing::debug!("{}: bound in place ({why})", path.display());
            // Bound in place, the file exists before the socket listens: another server
            // looking at it then would find it refusing, stale. The lock is held from before
            // the bind until it listens.
            let lock = lock_dir_of(path);
            let l = replacing_stale(path, libc::EADDRINUSE, Some(lock), || UnixListener::bind(path))?;
            Ok(Listener::Unix(l, path.to_path_buf(), file_id(path)))
        };
        let l = match UnixListener::bind(&tmp) {
            Ok(l) => l,
            Err(e) => return direct(&e),
        };
        // The inode moves with the rename: taken here, it is surely this socket's.
        let id = file_id(&tmp);
        match replacing_stale(path, libc::EEXIST, None, || crate::io::sys::rename_noreplace(&tmp, path)) {
            Ok(()) => Ok(Listener::Unix(l, path.to_path_buf(), id)),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                drop(l);
                // No RENAME_NOREPLACE here: bound in place. Anything else is the answer.
                match e.raw_os_error() {
                    Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP) => direct(&e),
                    _ => Err(e),
                }
            }
        }
    }

    /// The socket systemd passed (socket activation), if any; an error if it is not a
    /// listening socket (`Accept=yes`).
    pub fn from_activation() -> Option<Result<Listener>> {
        let (fd, domain) = match crate::io::sys::socket_activation()? {
            Ok(passed) => passed,
            Err(e) => return Some(Err(Error::io(Op::Listen, e).path("the socket systemd passed"))),
        };
        Some(Ok(if domain == libc::AF_UNIX {
            let l = UnixListener::from(fd);
            let path = l
                .local_addr()
                .ok()
                .and_then(|a| a.as_pathname().map(|p| p.to_path_buf()))
                .unwrap_or_default();
            Listener::Unix(l, path, None)
        } else {
            Listener::Tcp(TcpListener::from(fd))
        }))
    }

    pub fn tcp(addr: &str) -> Result<Listener> {
        let l = TcpListener::bind(addr).map_err(|e| Error::io(Op::Listen, e).path(addr))?;
        Ok(Listener::Tcp(l))
    }

    /// The NBD URI clients use to reach the export (`nbds` schemes when TLS is required).
    pub fn uri(&self, export: &str, tls: bool) -> String {
        let s = if tls { "s" } else { "" };
        match self {
            Listener::Tcp(l) => match l.local_addr() {
                Ok(a) if a.is_ipv6() => format!("nbd{s}://[{}]:{}/{}", a.ip(), a.port(), export),
                Ok(a) => format!("nbd{s}://{}:{}/{}", a.ip(), a.port(), export),
                Err(_) => String::new(),
            },
            Listener::Unix(_, p, _) => format!("nbd{s}+unix:///{}?socket={}", export, p.display()),
        }
    }
}

/// Puts a socket at `path` with `put` (which fails with `taken` while something is there);
/// if a stale socket file is in the way, removes it and tries once more. Anything else there
/// is "address in use". A socket file is stale when connecting to it is refused: any other
/// failure (permissions, a full backlog) may be a live server's.
///
/// The stale check and the removal are made under a lock on the directory (`held`, if the
/// caller took it already): two servers starting together over one stale file would
/// otherwise both find it stale, and the later removal could take the first server's new,
/// live socket. A `put` that never shows a socket before it listens (a rename into place)
/// needs no lock itself.
fn replacing_stale<T>(
    path: &std::path::Path,
    taken: i32,
    held: Option<Option<std::fs::File>>,
    put: impl Fn() -> io::Result<T>,
) -> io::Result<T> {
    let in_use = || {
        io::Error::new(
            io::ErrorKind::AddrInUse,
            "address in use (a server listens there, or the file is not a socket)",
        )
    };
    match put() {
        Err(e) if e.raw_os_error() == Some(taken) => {}
        r => return r,
    }
    let _lock = held.unwrap_or_else(|| lock_dir_of(path));
    use std::os::unix::fs::FileTypeExt;
    let socket = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket());
    let refused = crate::io::sys::unix_connect_nonblocking(path)
        .is_err_and(|e| e.raw_os_error() == Some(libc::ECONNREFUSED));
    if !(socket && refused) {
        return Err(in_use());
    }
    match std::fs::remove_file(path) {
        Ok(()) => tracing::debug!("{}: replaced a stale socket file", path.display()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(io::Error::new(
                e.kind(),
                format!("cannot remove the stale socket file: {}", crate::error::io_message(&e)),
            ))
        }
    }
    put().map_err(|e| if e.raw_os_error() == Some(taken) { in_use() } else { e })
}

/// The device and inode of the file at `path` (not following a symlink).
fn file_id(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// The lock [`replacing_stale`] holds: on the socket's directory, `None` (logged) where it
/// cannot be taken (an unreadable directory, a filesystem without flock).
fn lock_dir_of(path: &std::path::Path) -> Option<std::fs::File> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    crate::io::sys::lock_dir(dir, std::time::Duration::from_secs(5))
        .map_err(|e| {
            // A missing directory needs no warning: the bind that follows fails and says so.
            if e.kind() != io::ErrorKind::NotFound {
                let e = crate::error::io_message(&e);
                tracing::warn!("{}: no lock for replacing a stale socket: {e}", dir.display())
            }
        })
        .ok()
}

impl std::os::fd::AsFd for Listener {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self {
            Listener::Tcp(l) => l.as_fd(),
            Listener::Unix(l, _, _) => l.as_fd(),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Only the file this listener created: if it was removed meanwhile and another server
        // put its socket there, that one stays.
        if let Listener::Unix(_, p, Some(id)) = self {
            if file_id(p) == Some(*id) {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

pub struct Server {
    pub export: Export,
    /// Workers per connection.
    pub threads: usize,
    pub max_connections: usize,
    /// How long a client may take over the handshake, from connecting to choosing the
    /// export: a client that connects and says nothing must not hold a connection slot.
    pub handshake_timeout: Duration,
    pub stats: stats::Stats,
    /// STARTTLS offered (`--tls=on`) or required (`--tls=require`); `None`: `--tls=off`.
    pub tls: Option<crate::tls::ServerTls>,
    shutdown: AtomicBool,
    active: AtomicUsize,
    /// Closers of the open connections, by connection number.
    closers: std::sync::Mutex<std::collections::HashMap<u64, crate::stream::Closer>>,
    /// When each connection still negotiating must have chosen its export.
    handshakes: std::sync::Mutex<std::collections::HashMap<u64, Instant>>,
    next_id: std::sync::atomic::AtomicU64,
}

/// How long a shutdown lets clients finish (new requests get ESHUTDOWN meanwhile) before
/// their connections are cut.
const GRACE: Duration = Duration::from_secs(5);
/// How long cut connections get to run their cache clean-up.
const CLEANUP: Duration = Duration::from_secs(5);
/// The send buffer asked for on Unix-socket connections: one merged read's reply
/// (`transmission::MERGE_MAX`), so the worker that sends it is back at the disk while the client
/// reads it. `nbdcopy URI null:` of a cold 2 GiB file: 1914-2155 MB/s with the default
/// (`net.core.wmem_default`, 208 KiB here), 2164-2435 with 4 MiB (3 alternating runs).
/// Kernel memory of the socket, not page cache: at most this much per connection (the kernel
/// counts it double and caps it at `net.core.wmem_max`).
const UNIX_SEND_BUFFER: usize = 4 << 20;
/// The default [`Server::handshake_timeout`] (qemu-nbd's handshake limit is 10 s too).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

impl Server {
    pub fn new(export: Export, threads: usize, max_connections: usize) -> Server {
        Server {
            export,
            threads: threads.max(1),
            max_connections,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            stats: Default::default(),
            tls: None,
            shutdown: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            closers: Default::default(),
            handshakes: Default::default(),
            next_id: Default::default(),
        }
    }

    /// Offers (or requires) TLS to clients.
    pub fn with_tls(mut self, tls: crate::tls::ServerTls) -> Server {
        self.tls = Some(tls);
        self
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutdown.load(Ordering::Relaxed)
    }

    /// Stops accepting; negotiating clients get `NBD_REP_ERR_SHUTDOWN`, new requests
    /// `ESHUTDOWN`, requests in flight complete.
    pub fn shutdown(&self) {
        self.shutdown.store(true, Ordering::Relaxed);
    }

    /// The figures of `--stats`, with what the export's backend tells through the [`Backend`]
    /// trait: its page-cache footprint and its requests to object storage.
    pub fn stats_snapshot(&self) -> stats::Snapshot {
        let mut snap = self.stats.snapshot();
        if let Ok(b) = self.export.open() {
            snap.cache = b.cache_info().and_then(|c| Some(c.stat?.cached * c.page_size));
            snap.requests = b.report().requests;
        }
        snap
    }

    pub fn active_connections(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Accepts connections until [`Server::shutdown`], then waits (up to a few seconds) for
    /// the open ones to finish.
    pub fn serve(self: &Arc<Self>, listener: &Listener) -> Result<()> {
        match listener {
            Listener::Tcp(l) => l.set_nonblocking(true),
            Listener::Unix(l, _, _) => l.set_nonblocking(true),
        }
        .map_err(|e| Error::io(Op::Serve, e).detail("the listening socket"))?;
        while !self.is_shutting_down() {
            self.reap_handshakes();
            let accepted: io::Result<Box<dyn crate::stream::Stream>> = match listener {
                Listener::Tcp(l) => l.accept().and_then(|(s, _)| {
                    s.set_nonblocking(false)?;
                    s.set_nodelay(true)?;
                    // A client that vanishes between requests is found out, and its
                    // connection's threads end.
                    crate::io::sys::tcp_keepalive(std::os::fd::AsFd::as_fd(&s))?;
                    Ok(Box::new(s) as Box<dyn crate::stream::Stream>)
                }),
                Listener::Unix(l, _, _) => l.accept().and_then(|(s, _)| {
                    s.set_nonblocking(false)?;
                    // Room for a whole merged read's reply (transmission::MERGE_MAX).
                    crate::io::sys::unix_send_buffer(std::os::fd::AsFd::as_fd(&s), UNIX_SEND_BUFFER)?;
                    Ok(Box::new(s) as Box<dyn crate::stream::Stream>)
                }),
            };
            match accepted {
                Ok(s) => self.spawn_connection(s),
                // Wait for the next connection, waking at once when it comes (a client such as
                // nbdcopy opens its connections one after another: a fixed sleep here added
                // ~28 ms to every nbdcopy run) and every 20 ms to look at shutdown.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if crate::io::sys::wait_readable(std::os::fd::AsFd::as_fd(listener), 20).is_err() {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // EMFILE and friends: keep serving the others.
                    tracing::warn!("accept: {}", crate::error::io_message(&e));
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
        self.wait_idle(GRACE);
        // Cut whoever is left, so their threads end and run the cache clean-up.
        for close in self.closers.lock().unwrap().values() {
            close();
        }
        self.wait_idle(CLEANUP);
        // Whatever clients wrote and did not flush is made durable before exiting.
        if !self.export.read_only {
            let flushed = self.export.open().and_then(|b| {
                let r = b.flush();
                b.finish().and(r)
            });
            if let Err(e) = flushed {
                // Said once, by the binary, which reports this error.
                return Err(Error::after(Op::Serve, &e).detail("final flush"));
            }
        }
        Ok(())
    }

    fn wait_idle(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.active_connections() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Cuts connections whose handshake has outlasted [`Server::handshake_timeout`]. Called
    /// by the accept loop, which wakes at least every 20 ms.
    fn reap_handshakes(&self) {
        let now = Instant::now();
        let mut late = Vec::new();
        self.handshakes.lock().unwrap().retain(|id, deadline| {
            if *deadline <= now {
                late.push(*id);
            }
            *deadline > now
        });
        for id in late {
            tracing::warn!("connection {id}: handshake not finished in {:?}, closed", self.handshake_timeout);
            if let Some(close) = self.closers.lock().unwrap().get(&id) {
                close();
            }
        }
    }

    fn spawn_connection(self: &Arc<Self>, s: Box<dyn crate::stream::Stream>) {
        if self.active.fetch_add(1, Ordering::SeqCst) >= self.max_connections {
            self.active.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!("connection refused: {} connections already", self.max_connections);
            return;
        }
        self.stats.connections.fetch_add(1, Ordering::Relaxed);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        if let Ok(c) = s.closer() {
            self.closers.lock().unwrap().insert(id, c);
            self.handshakes.lock().unwrap().insert(id, Instant::now() + self.handshake_timeout);
        }
        let server = self.clone();
        std::thread::spawn(move || {
            // A panic (a bug) ends this connection only, and still runs the bookkeeping below,
            // which drops the last handle on the socket: the client sees it closed.
            let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                server.connection_numbered(s, Some(id))
            }));
            match served {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::info!("connection ended: {e}"),
                Err(_) => tracing::error!("internal error: a connection's thread panicked; it is closed"),
            }
            server.closers.lock().unwrap().remove(&id);
            server.handshakes.lock().unwrap().remove(&id);
            server.active.fetch_sub(1, Ordering::SeqCst);
        });
    }

    /// Serves one connection from handshake to disconnect.
    pub fn connection(&self, s: Box<dyn crate::stream::Stream>) -> Result<()> {
        self.connection_numbered(s, None)
    }

    /// [`Server::connection`] of accepted connection `id`, whose handshake is timed (see
    /// [`Server::reap_handshakes`]) until the client has chosen its export. The closer taken
    /// at accept shuts the socket under any TLS session, so the deadline covers STARTTLS too.
    fn connection_numbered(&self, s: Box<dyn crate::stream::Stream>, id: Option<u64>) -> Result<()> {
        let (agreed, backend, s) =
            match handshake::negotiate(self, s).map_err(|e| Error::io(Op::Handshake, e))? {
                handshake::Outcome::Go(a, b, s) => (a, b, s),
                handshake::Outcome::Close => return Ok(()),
            };
        if let Some(id) = id {
            self.handshakes.lock().unwrap().remove(&id);
        }
        // Ends the connection after a panic in a worker (see transmission::run). Without one
        // (no descriptor for a second handle), such a panic leaves the client waiting.
        let closer = s.closer().unwrap_or_else(|e| {
            tracing::debug!("no closer for this connection: {e}");
            Box::new(|| {})
        });
        let arrived = s.arrived();
        let (r, w) = s.split().map_err(|e| Error::io(Op::Serve, e))?;
        let r = inbox::Incoming::new(r, arrived);
        transmission::run(self, backend, agreed, r, w, closer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Servers starting together over one stale socket file: exactly one gets the address and
    /// is the one clients reach; the others are told it is in use. (Replacing the stale file
    /// without a lock let a later server remove the first one's new, live socket.)
    #[test]
    fn one_of_several_servers_replaces_a_stale_socket() {
        let dir = tempfile::tempdir().unwrap();
        several_servers_over_a_stale_socket(&dir, &dir.path().join("s.sock"));
        // A path so long that the temporary name does not fit a socket address: bound in
        // place, under the lock from before the bind until it listens.
        let name = "s".repeat(100 - dir.path().as_os_str().len() - 1);
        let long = dir.path().join(name);
        assert_eq!(long.as_os_str().len(), 100);
        several_servers_over_a_stale_socket(&dir, &long);
    }

    /// A server removes its socket file at exit only if it is still its own.
    #[test]
    fn a_server_leaves_another_servers_socket_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let first = Listener::unix(&path).unwrap();
        std::fs::remove_file(&path).unwrap(); // by hand, while it runs
        let second = Listener::unix(&path).unwrap();
        drop(first);
        std::os::unix::net::UnixStream::connect(&path).expect("the second server's socket is still there");
        drop(second);
        assert!(!path.exists(), "the second server removes its own socket");
    }

    /// The directory lock gives up after its wait (a lock held for long is not lightfoot's),
    /// and is free again once dropped.
    #[test]
    fn the_directory_lock_waits_a_bounded_time() {
        let dir = tempfile::tempdir().unwrap();
        let held = crate::io::sys::lock_dir(dir.path(), Duration::from_secs(1)).unwrap();
        let t = Instant::now();
        let e = crate::io::sys::lock_dir(dir.path(), Duration::from_millis(50)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(t.elapsed() < Duration::from_secs(1), "waited {:?}", t.elapsed());
        drop(held);
        crate::io::sys::lock_dir(dir.path(), Duration::ZERO).expect("free once dropped");
    }

    fn several_servers_over_a_stale_socket(dir: &tempfile::TempDir, path: &std::path::Path) {
        let path = path.to_path_buf();
        for round in 0..100 {
            drop(UnixListener::bind(&path).unwrap()); // leaves the file: stale
            let start = Arc::new(std::sync::Barrier::new(6));
            let tries: Vec<_> = (0..6)
                .map(|_| {
                    let (path, start) = (path.clone(), start.clone());
                    std::thread::spawn(move || {
                        start.wait();
                        Listener::unix(&path)
                    })
                })
                .collect();
            let mut won = Vec::new();
            for t in tries {
                match t.join().unwrap() {
                    Ok(l) => won.push(l),
                    Err(e) => assert_eq!(
                        e.os_error().map(io::Error::kind),
                        Some(io::ErrorKind::AddrInUse),
                        "round {round}: {e}"
                    ),
                }
            }
            assert_eq!(won.len(), 1, "round {round}: {} servers think they listen", won.len());
            let Listener::Unix(l, ..) = &won[0] else { unreachable!() };
            let _c = std::os::unix::net::UnixStream::connect(&path).expect("the winner is reachable");
            l.set_nonblocking(true).unwrap();
            l.accept().expect("the winner's own socket took the connection");
            drop(won);
            assert!(!path.exists(), "round {round}: the winner removes its socket");
            let left: Vec<_> =
                std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
            assert!(left.is_empty(), "round {round}: left behind: {left:?}");
        }
    }
}
