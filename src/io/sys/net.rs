//! Sockets: connects that a flag can cancel, TCP keepalive, and both ends of systemd socket
//! activation (taking the socket passed to us; passing one to a child).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Tries to connect to the Unix socket at `path` without blocking: `Ok` when a server
/// accepted (or will: the connection is dropped at once), `ECONNREFUSED` when nobody listens
/// on the file, `EAGAIN` when a server listens with a full backlog (a blocking connect would
/// wait for it, for ever without a timeout).
pub fn unix_connect_nonblocking(path: &std::path::Path) -> io::Result<()> {
    let (addr, len) = sockaddr_un(path)?;
    let fd = nonblocking_socket(libc::AF_UNIX)?;
    // SAFETY: `addr` holds a valid sockaddr of `len` bytes for the duration of the call.
    let r = unsafe { libc::connect(fd.as_raw_fd(), (&raw const addr).cast(), len) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `path` as a `sockaddr_un` and its length: a name starting with a NUL byte is in the
/// abstract namespace, anything else a file.
fn sockaddr_un(path: &std::path::Path) -> io::Result<(libc::sockaddr_storage, libc::socklen_t)> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: sockaddr_storage is plain data; all zeroes is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    // SAFETY: sockaddr_storage is large and aligned enough for a sockaddr_un.
    let un: &mut libc::sockaddr_un = unsafe { &mut *(&raw mut ss).cast() };
    let bytes = path.as_os_str().as_bytes();
    let abstract_name = bytes.first() == Some(&0);
    let name = if abstract_name { &bytes[1..] } else { bytes };
    // A path needs its terminating NUL; an abstract name is counted by the length.
    if bytes.len() + usize::from(!abstract_name) > un.sun_path.len() || name.contains(&0) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "socket path too long or with a NUL byte"));
    }
    un.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in un.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + bytes.len() + usize::from(!abstract_name);
    Ok((ss, len as libc::socklen_t))
}

/// A non-blocking, close-on-exec stream socket of `family`.
fn nonblocking_socket(family: libc::c_int) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: plain system call; the fd is owned (and closed) below.
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// How often a connection that is still being made asks whether to give up.
const CONNECT_POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// A blocking TCP connection to `addr`, made the way `TcpStream::connect` makes it (the
/// kernel's own timeout: about two minutes of SYN retries to a host that drops them), except
/// that it asks `cancel` every 100 ms while it waits and gives up with
/// `io::ErrorKind::Interrupted` when `cancel` says so. A plain blocking `connect` cannot be
/// interrupted by a flag: Ctrl-C went unheard while a firewalled or overloaded host held the
/// connect.
pub fn tcp_connect(
    addr: &std::net::SocketAddr,
    cancel: &dyn Fn() -> bool,
) -> io::Result<std::net::TcpStream> {
    // SAFETY: sockaddr_storage is plain data; all zeroes is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        std::net::SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is large and aligned enough for any sockaddr.
            unsafe { std::ptr::write((&raw mut ss).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        std::net::SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above.
            unsafe { std::ptr::write((&raw mut ss).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    let fd = connect_cancellable(ss.ss_family.into(), &ss, len as libc::socklen_t, cancel)?;
    Ok(std::net::TcpStream::from(fd))
}

/// A blocking connection to the Unix socket at `path` (a name starting with a NUL byte is
/// in the abstract namespace), as `UnixStream::connect` makes it, except that it gives up
/// when `cancel` says so (see [`tcp_connect`]): a blocking connect to a server whose listen
/// queue is full waits for room in it, for ever.
pub fn unix_connect(
    path: &std::path::Path,
    cancel: &dyn Fn() -> bool,
) -> io::Result<std::os::unix::net::UnixStream> {
    let (addr, len) = sockaddr_un(path)?;
    let fd = connect_cancellable(libc::AF_UNIX, &addr, len, cancel)?;
    Ok(std::os::unix::net::UnixStream::from(fd))
}

/// The connect of [`tcp_connect`] and [`unix_connect`]: a non-blocking socket whose connect
/// is waited for in [`CONNECT_POLL`] slices, made blocking again once connected.
fn connect_cancellable(
    family: libc::c_int,
    addr: &libc::sockaddr_storage,
    len: libc::socklen_t,
    cancel: &dyn Fn() -> bool,
) -> io::Result<std::os::fd::OwnedFd> {
    let interrupted = || io::Error::new(io::ErrorKind::Interrupted, "interrupted while connecting");
    let fd = nonblocking_socket(family)?;
    loop {
        // SAFETY: `addr` holds a valid sockaddr of `len` bytes for the duration of the call.
        if unsafe { libc::connect(fd.as_raw_fd(), (addr as *const libc::sockaddr_storage).cast(), len) } == 0
        {
            break;
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            // TCP: the handshake is under way (also after a signal: POSIX has it go on
            // asynchronously); wait until the socket is writable, then read how it ended.
            Some(libc::EINPROGRESS | libc::EINTR) if family != libc::AF_UNIX => {
                loop {
                    if cancel() {
                        return Err(interrupted());
                    }
                    let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
                    // SAFETY: one valid pollfd for the duration of the call.
                    let n = unsafe { libc::poll(&mut p, 1, CONNECT_POLL.as_millis() as libc::c_int) };
                    if n > 0 {
                        break;
                    }
                    if n < 0 {
                        let e = io::Error::last_os_error();
                        if e.kind() != io::ErrorKind::Interrupted {
                            return Err(e);
                        }
                    }
                }
                let mut err: libc::c_int = 0;
                let mut elen = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
                // SAFETY: `err` and `elen` outlive the call and describe an int.
                let r = unsafe {
                    libc::getsockopt(
                        fd.as_raw_fd(),
                        libc::SOL_SOCKET,
                        libc::SO_ERROR,
                        (&raw mut err).cast(),
                        &mut elen,
                    )
                };
                if r < 0 {
                    return Err(io::Error::last_os_error());
                }
                if err != 0 {
                    return Err(io::Error::from_raw_os_error(err));
                }
                break;
            }
            // Unix: the server's listen queue is full. A blocking connect would wait for
            // room; try again shortly (a Unix socket cannot be polled for that).
            Some(libc::EAGAIN) if family == libc::AF_UNIX => {
                if cancel() {
                    return Err(interrupted());
                }
                std::thread::sleep(CONNECT_POLL / 10);
            }
            Some(libc::EINTR) => continue,
            _ => return Err(e),
        }
    }
    // SAFETY: F_GETFL on a descriptor we own: integers in and out, no memory passed.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    // SAFETY: F_SETFL on a descriptor we own: integers in and out, no memory passed.
    if flags < 0 || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Seconds a TCP connection may be silent before keepalive probes start ([`tcp_keepalive`]).
pub const KEEPALIVE_IDLE: u32 = 30;
/// Seconds between unanswered probes.
pub const KEEPALIVE_INTERVAL: u32 = 10;
/// Unanswered probes that end the connection: a peer that vanished without closing (a host
/// that died, a cable pulled) is found out within 30 + 6 × 10 = 90 s of silence.
pub const KEEPALIVE_COUNT: u32 = 6;

/// The keepalive times in use: the defaults above, or `LIGHTFOOT_TCP_KEEPALIVE=IDLE,INTERVAL,COUNT`
/// (seconds, seconds, probes), which the tests use to find a vanished peer in
/// seconds. A malformed value is ignored with a warning.
pub fn keepalive_times() -> (u32, u32, u32) {
    static TIMES: std::sync::OnceLock<(u32, u32, u32)> = std::sync::OnceLock::new();
    *TIMES.get_or_init(|| {
        let default = (KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT);
        let Ok(v) = std::env::var("LIGHTFOOT_TCP_KEEPALIVE") else { return default };
        parse_keepalive(&v).unwrap_or_else(|| {
            tracing::warn!(
                "LIGHTFOOT_TCP_KEEPALIVE={v:?} ignored: want IDLE,INTERVAL,COUNT (1-32767 s, 1-32767 s, 1-127)"
            );
            default
        })
    })
}

/// `IDLE,INTERVAL,COUNT`: whole numbers within what Linux takes (seconds 1-32767, probes
/// 1-127; past them every `setsockopt` would fail and no connection could be made).
fn parse_keepalive(v: &str) -> Option<(u32, u32, u32)> {
    let n = v.split(',').map(|x| x.trim().parse::<u32>().ok()).collect::<Option<Vec<u32>>>()?;
    match n[..] {
        [idle, interval, count]
            if (1..=32767).contains(&idle)
                && (1..=32767).contains(&interval)
                && (1..=127).contains(&count) =>
        {
            Some((idle, interval, count))
        }
        _ => None,
    }
}

/// Turns on TCP keepalive for a connection, so that a blocked read on it fails (ETIMEDOUT)
/// once the peer has gone without a word, rather than waiting for ever: an NBD client
/// waiting for replies, or a server waiting for the next request, sends nothing of its own
/// and would never notice. A peer that is alive answers the probes, however long it is idle
/// or busy. Not covered: a peer that vanishes while our own data to it is unacknowledged;
/// TCP's retransmissions give up on that after `tcp_retries2` (about 15 minutes by default).
/// No `TCP_USER_TIMEOUT` to shorten it: it also governs zero-window probing, where the peer is
/// alive but not reading (a server holding back a client's writes while its disk catches
/// up), and how kernels treat that case has changed between versions.
pub fn tcp_keepalive(fd: BorrowedFd) -> io::Result<()> {
    let (idle, interval, count) = keepalive_times();
    set_int_sockopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, idle as libc::c_int)?;
    set_int_sockopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, interval as libc::c_int)?;
    set_int_sockopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT, count as libc::c_int)?;
    set_int_sockopt(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)
}

/// `setsockopt` of one `int` option.
fn set_int_sockopt(fd: BorrowedFd, level: libc::c_int, name: libc::c_int, v: libc::c_int) -> io::Result<()> {
    // SAFETY: plain system call; `v` outlives it and the length is its size.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&raw const v).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Reads from a socket only what has already arrived (`recv` with `MSG_DONTWAIT`): `None`
/// when nothing has (or a signal came first), `Some(0)` at the end of the stream.
pub fn recv_arrived(fd: BorrowedFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    // SAFETY: `buf` is exclusively borrowed for the call and its length is passed with it.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
    if n >= 0 {
        return Ok(Some(n as usize));
    }
    match io::Error::last_os_error() {
        e if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => Ok(None),
        e => Err(e),
    }
}

/// Waits up to `timeout_ms` for `fd` to be readable (a listening socket: a connection to
/// accept; a fanotify group: events). False on timeout or a signal.
pub fn wait_readable(fd: BorrowedFd, timeout_ms: i32) -> io::Result<bool> {
    let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one live pollfd for the call.
    match unsafe { libc::poll(&mut p, 1, timeout_ms) } {
        n if n > 0 => Ok(true),
        0 => Ok(false),
        _ => match io::Error::last_os_error() {
            e if e.kind() == io::ErrorKind::Interrupted => Ok(false),
            e => Err(e),
        },
    }
}

/// Asks for a send buffer of `bytes` on a Unix stream socket (the kernel caps it at
/// `net.core.wmem_max`; a smaller grant is not an error). On a Unix socket the sender's buffer
/// is the only one: a reply larger than it makes `writev` wait for the client to read, and a
/// worker waiting there reads nothing from the disk meanwhile. Not for TCP, where setting it
/// would turn off the kernel's own sizing.
pub fn unix_send_buffer(fd: BorrowedFd, bytes: usize) -> io::Result<()> {
    let v = bytes.min(libc::c_int::MAX as usize) as libc::c_int;
    set_int_sockopt(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, v)
}

/// The first socket passed by systemd socket activation (`LISTEN_PID` is this process and
/// `LISTEN_FDS` ≥ 1: fd 3), with its address family (`AF_UNIX` or `AF_INET`/`AF_INET6`).
/// `None` without activation. An error when fd 3 is a connection rather than a listening
/// socket, as a socket unit with `Accept=yes` passes: accepting on it fails with `EINVAL`
/// every time, and the server would warn every 100 ms and serve nobody.
pub fn socket_activation() -> Option<io::Result<(std::os::fd::OwnedFd, i32)>> {
    let pid: u32 = std::env::var("LISTEN_PID").ok()?.parse().ok()?;
    let fds: u32 = std::env::var("LISTEN_FDS").ok()?.parse().ok()?;
    if pid != std::process::id() || fds < 1 {
        return None;
    }
    let domain = int_sockopt(3, libc::SO_DOMAIN)?;
    // SAFETY: systemd passed fd 3 to us and nothing else in the process owns it; taking it
    // once (the variables are removed) keeps it owned exactly once.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(3) };
    // SAFETY: changing the environment races with any other thread reading it. This runs at
    // start-up on the main thread, before the server listens: the only other threads then are
    // the idle workers of `--coalesce` and `--prefetch`, which do not read the environment
    // (lightfoot reads it on the main thread, or on connections, none of which exist yet).
    unsafe {
        std::env::remove_var("LISTEN_PID");
        std::env::remove_var("LISTEN_FDS");
    }
    // Passed without FD_CLOEXEC (it had to survive systemd's exec): set it, as sd_listen_fds
    // does, so the listening socket does not leak into the command `--run` starts.
    // SAFETY: fcntl on fd 3, which `fd` owns, with integer arguments only.
    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    if int_sockopt(fd.as_raw_fd(), libc::SO_ACCEPTCONN) == Some(0) {
        return Some(Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "fd 3 is a connection, not a listening socket (a socket unit with Accept=yes): use Accept=no",
        )));
    }
    Some(Ok((fd, domain)))
}

/// An integer socket option of `fd` at `SOL_SOCKET`; `None` when `fd` is no socket.
fn int_sockopt(fd: libc::c_int, name: libc::c_int) -> Option<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: the option writes one int into `v`; `len` says how large it is.
    let ret = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, name, (&raw mut v).cast(), &raw mut len) };
    (ret == 0).then_some(v)
}

/// Prepares `cmd` for systemd socket activation: the child gets `listener` as fd 3 (the
/// caller sets `LISTEN_FDS` and `LISTEN_PID`), its own process group (so a Ctrl-C meant for
/// lightfoot does not kill it mid-copy: lightfoot stops it), and SIGTERM if the spawning
/// thread dies first (`PR_SET_PDEATHSIG` follows the thread, so spawn from the main thread).
pub fn activate_socket(cmd: &mut std::process::Command, listener: std::os::fd::BorrowedFd) {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let fd = listener.as_raw_fd();
    cmd.process_group(0);
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (fcntl, dup2, prctl) on integers; it allocates nothing.
    // `fd` stays open in the parent until spawn returns, so it is valid in the child.
    unsafe {
        cmd.pre_exec(move || {
            if fd == 3 {
                // dup2 onto itself would keep close-on-exec set: clear it instead.
                let flags = libc::fcntl(3, libc::F_GETFD);
                if flags < 0 || libc::fcntl(3, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                    return Err(io::Error::last_os_error());
                }
            } else if libc::dup2(fd, 3) < 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sockopt(fd: BorrowedFd, level: libc::c_int, name: libc::c_int) -> libc::c_int {
        let mut v: libc::c_int = -1;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: `v` and `len` outlive the call; `len` is `v`'s size.
        let r = unsafe { libc::getsockopt(fd.as_raw_fd(), level, name, (&raw mut v).cast(), &raw mut len) };
        assert_eq!(r, 0, "{}", io::Error::last_os_error());
        v
    }

    #[test]
    fn keepalive_times_parse_three_positive_numbers_only() {
        assert_eq!(parse_keepalive("1,1,2"), Some((1, 1, 2)));
        assert_eq!(parse_keepalive(" 30, 10 ,6"), Some((30, 10, 6)));
        assert_eq!(parse_keepalive("32767,32767,127"), Some((32767, 32767, 127)));
        for bad in ["32768,1,1", "1,1,128", "4294967295,1,1"] {
            assert_eq!(parse_keepalive(bad), None, "{bad:?}");
        }
        for bad in ["", "1,1", "1,1,2,3", "1,0,2", "1,x,2", "-1,1,2", "1,,2"] {
            assert_eq!(parse_keepalive(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn tcp_keepalive_is_set_on_both_ends() {
        use std::os::fd::AsFd;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (a, _) = l.accept().unwrap();
        for s in [&c, &a] {
            assert_eq!(sockopt(s.as_fd(), libc::SOL_SOCKET, libc::SO_KEEPALIVE), 0, "off by default");
            tcp_keepalive(s.as_fd()).unwrap();
            assert_eq!(sockopt(s.as_fd(), libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
            let (idle, interval, count) = keepalive_times();
            assert_eq!(sockopt(s.as_fd(), libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), idle as i32);
            assert_eq!(sockopt(s.as_fd(), libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), interval as i32);
            assert_eq!(sockopt(s.as_fd(), libc::IPPROTO_TCP, libc::TCP_KEEPCNT), count as i32);
        }
    }

    /// The connects answer as the blocking ones do: a blocking socket, connected (v4 and v6
    /// over loopback, a Unix path and an abstract name), or the same error.
    #[test]
    fn cancellable_connects_connect_and_fail_like_blocking_ones() {
        use std::io::{Read, Write};
        use std::os::linux::net::SocketAddrExt;
        use std::os::unix::net::{SocketAddr, UnixListener};
        let never = || false;
        for host in ["127.0.0.1:0", "[::1]:0"] {
            let Ok(l) = std::net::TcpListener::bind(host) else { continue }; // no IPv6 here
            let mut c = tcp_connect(&l.local_addr().unwrap(), &never).unwrap();
            let (mut a, _) = l.accept().unwrap();
            c.write_all(b"x").unwrap();
            let mut got = [0u8; 1];
            a.read_exact(&mut got).unwrap();
            // Blocking again: a read with nothing sent times out instead of failing at once.
            c.set_read_timeout(Some(std::time::Duration::from_millis(50))).unwrap();
            let e = c.read(&mut got).unwrap_err();
            assert!(matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut), "{e}");
        }
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let e = tcp_connect(&closed, &never).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let l = UnixListener::bind(&path).unwrap();
        let mut c = unix_connect(&path, &never).unwrap();
        c.write_all(b"y").unwrap();
        let mut got = [0u8; 1];
        l.accept().unwrap().0.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"y");
        let name = format!("lightfoot-test-{}", std::process::id());
        let l = UnixListener::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        let abstract_path = std::path::PathBuf::from(format!("\0{name}"));
        unix_connect(&abstract_path, &never).unwrap();
        l.accept().unwrap();
        let e = unix_connect(&dir.path().join("none.sock"), &never).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
        let long = dir.path().join("x".repeat(200));
        assert_eq!(unix_connect(&long, &never).unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }
}
