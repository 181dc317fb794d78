//! One error type for the whole library: a kind, the failing operation with its context
//! (what, where, how much) and the underlying source.
//!
//! The kind is what callers branch on (and what the NBD server maps to an errno,
//! `proto::errno`); the operation is an [`Op`], so code that branches on it is checked by the
//! compiler; the context is what a user needs to act on the message. Only the binary turns
//! errors into text and exit codes. A failure that ends something for good (a write that may
//! have lost data, a broken connection, a lost lease) is kept in a [`Sticky`].
//!
//! `thiserror` is not used: there is one error type, and its message is assembled from
//! optional parts (path, range, detail, cause), which a derive's format string cannot express
//! without calling back into a hand-written formatter like the one below.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// What went wrong, independent of where.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// An I/O error from the device or filesystem (EIO and everything unclassified).
    Io,
    /// No space left (ENOSPC, EDQUOT, EFBIG) or a write past the end of a fixed-size target.
    NoSpace,
    /// A request or argument that cannot be honoured as given (EINVAL).
    InvalidInput,
    /// Writing to something read-only, or a permission the caller lacks (EPERM, EACCES, EROFS).
    Permission,
    /// The operation is not supported by this backend (EOPNOTSUPP).
    NotSupported,
    /// The file, device or socket does not exist (ENOENT).
    NotFound,
    /// The job was interrupted (Ctrl-C, shutdown).
    Interrupted,
    /// The data ended before the expected size (a source that shrank, a short pipe).
    UnexpectedEof,
}

impl ErrorKind {
    /// Classifies an OS error.
    pub fn from_io(err: &io::Error) -> ErrorKind {
        match err.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => ErrorKind::NoSpace,
            Some(libc::EINVAL) => ErrorKind::InvalidInput,
            Some(libc::EPERM) | Some(libc::EACCES) | Some(libc::EROFS) => ErrorKind::Permission,
            Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => ErrorKind::NotSupported,
            Some(libc::ENOENT) | Some(libc::ENXIO) => ErrorKind::NotFound,
            Some(libc::EINTR) => ErrorKind::Interrupted,
            _ => match err.kind() {
                io::ErrorKind::UnexpectedEof => ErrorKind::UnexpectedEof,
                io::ErrorKind::NotFound => ErrorKind::NotFound,
                io::ErrorKind::PermissionDenied => ErrorKind::Permission,
                io::ErrorKind::Interrupted => ErrorKind::Interrupted,
                _ => ErrorKind::Io,
            },
        }
    }
}

/// The operation an error happened in: what the message starts with ("read", "open", ...),
/// and what code that must tell operations apart matches on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Open,
    Create,
    Stat,
    Size,
    Truncate,
    Preallocate,
    Read,
    Write,
    Zero,
    Trim,
    Flush,
    /// Passing held or written-behind bytes down (`--coalesce`, write-behind).
    Writeback,
    /// NBD_CMD_CACHE: asking the storage to prefetch.
    Cache,
    /// Reading the allocation map (SEEK_DATA/SEEK_HOLE, a backend's extents).
    Extents,
    /// NBD_CMD_BLOCK_STATUS, as the NBD client sends it.
    BlockStatus,
    Seek,
    Ioctl,
    Cachestat,
    Mincore,
    Evict,
    Walk,
    Copy,
    Connect,
    /// Sending on a connection.
    Send,
    /// Receiving on a connection.
    Receive,
    /// Closing a connection on purpose: what later requests on it fail with.
    Disconnect,
    Tls,
    Listen,
    Accept,
    /// An NBD server's negotiation with a client.
    Handshake,
    Serve,
    StartServer,
    WritePidFile,
    List,
    Delete,
    /// Keeping an object store image's lease.
    Lease,
    Sweep,
    /// `lightfoot run`'s watcher process (fanotify).
    Watch,
    /// Reading, changing or keeping a dirty bitmap file.
    Bitmap,
    /// Reading what the user gave: an option's value, a URI, a size, a configuration file.
    /// Its messages start with the detail, which names the input.
    Parse,
    /// A test's comparison of what came back with what should have.
    Check,
}

impl Op {
    /// The operation as messages name it.
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Open => "open",
            Op::Create => "create",
            Op::Stat => "stat",
            Op::Size => "size",
            Op::Truncate => "truncate",
            Op::Preallocate => "preallocate",
            Op::Read => "read",
            Op::Write => "write",
            Op::Zero => "zero",
            Op::Trim => "trim",
            Op::Flush => "flush",
            Op::Writeback => "writeback",
            Op::Cache => "cache",
            Op::Extents => "extents",
            Op::BlockStatus => "block status",
            Op::Seek => "seek",
            Op::Ioctl => "ioctl",
            Op::Cachestat => "cachestat",
            Op::Mincore => "mincore",
            Op::Evict => "evict",
            Op::Walk => "walk",
            Op::Copy => "copy",
            Op::Connect => "connect",
            Op::Send => "sending",
            Op::Receive => "receiving",
            Op::Disconnect => "disconnected",
            Op::Tls => "tls",
            Op::Listen => "listen on",
            Op::Accept => "accept",
            Op::Handshake => "handshake",
            Op::Serve => "serve",
            Op::StartServer => "start server",
            Op::WritePidFile => "write pid file",
            Op::List => "list",
            Op::Delete => "delete",
            Op::Lease => "lease",
            Op::Sweep => "sweep",
            Op::Watch => "watcher",
            Op::Bitmap => "dirty bitmap",
            Op::Parse => "parse",
            Op::Check => "check",
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error with its kind, the operation and its context, and what caused it: an OS error, or
/// an earlier error this one follows from (a flush after a failed write, a request on a
/// connection that broke). Cloning is cheap: the causes are shared.
#[derive(Debug, Clone)]
pub struct Error {
    kind: ErrorKind,
    op: Op,
    path: Option<PathBuf>,
    range: Option<(u64, u64)>,
    detail: Option<String>,
    source: Option<Source>,
}

#[derive(Debug, Clone)]
enum Source {
    Os(Arc<io::Error>),
    Earlier(Arc<Error>),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A new error of `kind` while doing `op`.
    pub fn new(kind: ErrorKind, op: Op) -> Error {
        Error { kind, op, path: None, range: None, detail: None, source: None }
    }

    /// An error from an OS call; the kind is derived from the errno.
    pub fn io(op: Op, source: io::Error) -> Error {
        let kind = ErrorKind::from_io(&source);
        Error { kind, op, path: None, range: None, detail: None, source: Some(Source::Os(Arc::new(source))) }
    }

    /// An error of `op` that follows from `earlier`, and has its kind.
    pub fn after(op: Op, earlier: &Error) -> Error {
        let source = Some(Source::Earlier(Arc::new(earlier.clone())));
        Error { kind: earlier.kind, op, path: None, range: None, detail: None, source }
    }

    /// A request or argument that cannot be honoured as given, with why.
    pub fn invalid(op: Op, detail: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidInput, op).detail(detail)
    }

    /// The file, device or URI the operation was on.
    pub fn path(mut self, path: impl AsRef<Path>) -> Error {
        self.path = Some(path.as_ref().to_path_buf());
        self
    }

    /// The byte range the operation was on.
    pub fn at(mut self, offset: u64, len: u64) -> Error {
        self.range = Some((offset, len));
        self
    }

    /// A short lowercase explanation when there is no OS error, or one to add to it.
    pub fn detail(mut self, detail: impl Into<String>) -> Error {
        self.detail = Some(detail.into());
        self
    }

    /// The same error with another kind (an error below that means something else here).
    pub fn kind_as(mut self, kind: ErrorKind) -> Error {
        self.kind = kind;
        self
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn op(&self) -> Op {
        self.op
    }

    pub fn offset(&self) -> Option<u64> {
        self.range.map(|r| r.0)
    }

    pub fn file(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The OS error behind this one, if any (its own or an earlier error's).
    pub fn os_error(&self) -> Option<&io::Error> {
        match &self.source {
            Some(Source::Os(e)) => Some(e),
            Some(Source::Earlier(e)) => e.os_error(),
            None => None,
        }
    }

    /// Adds a path if the error has none yet (inner layers often do not know it).
    pub fn or_path(mut self, path: impl AsRef<Path>) -> Error {
        if self.path.is_none() {
            self.path = Some(path.as_ref().to_path_buf());
        }
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A parse error's detail names the input it is about: no operation to say first.
        let mut sep = "";
        if self.op != Op::Parse {
            f.write_str(self.op.as_str())?;
            sep = ": ";
        }
        if let Some(path) = &self.path {
            write!(f, " {}", path.display())?;
        }
        if let Some((offset, len)) = self.range {
            write!(f, " at offset {offset} (length {len})")?;
        }
        if let Some(d) = &self.detail {
            write!(f, "{sep}{d}")?;
            sep = ": ";
        }
        match &self.source {
            Some(Source::Os(e)) => write!(f, "{sep}{}", io_message(e)),
            Some(Source::Earlier(e)) => write!(f, "{sep}{e}"),
            None => Ok(()),
        }
    }
}

/// An OS error as lightfoot's messages carry it: "No space left on device (os error 28)" →
/// "no space left on device". For the few messages that hold an `io::Error` without being an
/// [`Error`] (the binary's own: a listening address, a pid file, a command to start).
pub fn io_message(err: &io::Error) -> String {
    let text = err.to_string();
    let text = match text.find(" (os error") {
        Some(i) => &text[..i],
        None => &text,
    };
    let mut chars = text.chars();
    match chars.next() {
        Some(c) => c.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.source {
            Some(Source::Os(e)) => Some(&**e),
            Some(Source::Earlier(e)) => Some(&**e),
            None => None,
        }
    }
}

/// The first failure of something that cannot go on after it, kept so that everything later
/// fails with it as the cause. Reading it is one atomic load, cheap on the data path. Six
/// places keep one:
///
/// - the write latches: `io::PolicyFile`, one for every open of a file in a job (a failed
///   `fdatasync`, or a writeback error that write-behind found; the kernel reports such an
///   error once per open file description); `server::Export` (a failed FLUSH or FUA request
///   on any connection); `--coalesce` (a failed write-back of bytes already acknowledged).
///   Every later flush and FUA request fails: acknowledged data may be lost.
/// - an NBD client connection that broke (every request after it fails at once);
/// - an object store image's lease that was lost (writes stop);
/// - a served connection whose client stopped reading (the reader stops taking requests).
#[derive(Debug, Default)]
pub struct Sticky(OnceLock<Error>);

/// The detail of an error that follows a failed write (see [`Sticky`]).
pub const WRITE_LOST: &str = "an earlier write failed; data may be lost";

impl Sticky {
    /// Keeps `err` if nothing is kept yet; true if it was kept.
    pub fn set(&self, err: &Error) -> bool {
        self.0.set(err.clone()).is_ok()
    }

    pub fn is_set(&self) -> bool {
        self.0.get().is_some()
    }

    /// The failure kept, if any.
    pub fn get(&self) -> Option<&Error> {
        self.0.get()
    }

    /// Fails `op` with `detail` and the kept failure as its cause (and its kind), if one is kept.
    pub fn check(&self, op: Op, detail: &'static str) -> Result<()> {
        match self.0.get() {
            None => Ok(()),
            Some(first) => Err(Error::after(op, first).detail(detail)),
        }
    }

    /// For a write latch: fails the flush or FUA request `op` on `name` if a write failed.
    pub fn check_writes(&self, op: Op, name: impl AsRef<Path>) -> Result<()> {
        self.check(op, WRITE_LOST).map_err(|e| e.path(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_names_what_and_where() {
        let e = Error::io(Op::Write, io::Error::from_raw_os_error(libc::ENOSPC)).path("/tmp/x").at(4096, 512);
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        assert_eq!(e.to_string(), "write /tmp/x at offset 4096 (length 512): no space left on device");
    }

    #[test]
    fn a_parse_error_is_its_detail() {
        let e = Error::invalid(Op::Parse, "'x': not a URI");
        assert_eq!(e.to_string(), "'x': not a URI");
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
    }

    #[test]
    fn sticky_keeps_the_first_error_and_its_kind() {
        let l = Sticky::default();
        assert!(l.check(Op::Flush, WRITE_LOST).is_ok() && !l.is_set());
        assert!(l.set(&Error::io(Op::Write, io::Error::from_raw_os_error(libc::ENOSPC)).path("f")));
        assert!(!l.set(&Error::io(Op::Write, io::Error::from_raw_os_error(libc::EIO)).path("f")));
        let e = l.check(Op::Flush, WRITE_LOST).unwrap_err().path("f");
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        assert_eq!(e.os_error().and_then(io::Error::raw_os_error), Some(libc::ENOSPC));
        assert_eq!(
            e.to_string(),
            "flush f: an earlier write failed; data may be lost: write f: no space left on device"
        );
        let source = std::error::Error::source(&e).unwrap();
        assert_eq!(source.to_string(), "write f: no space left on device");
    }

    #[test]
    fn kinds_map_to_nbd_errnos() {
        use crate::proto::{errno, EIO, EPERM, ESHUTDOWN};
        assert_eq!(errno(ErrorKind::from_io(&io::Error::from_raw_os_error(libc::EROFS))), EPERM);
        assert_eq!(errno(ErrorKind::from_io(&io::Error::from_raw_os_error(libc::EIO))), EIO);
        assert_eq!(errno(ErrorKind::Interrupted), ESHUTDOWN);
    }
}
