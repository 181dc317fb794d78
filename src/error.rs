//! One error type for the whole library: a kind, the failing operation with its context
//! (what, where, how much) and the underlying source.
//!
//! The kind is what callers branch on (and what the NBD server maps to an errno,
//! `proto::errno`); the context is what a user needs to act on the message. Only the binary
//! turns errors into text and exit codes.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

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

/// An error with its kind, the operation and its context, and the OS error if there is one.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    op: &'static str,
    path: Option<PathBuf>,
    range: Option<(u64, u64)>,
    detail: Option<String>,
    source: Option<io::Error>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A new error of `kind` while doing `op` ("read", "open", "flush", ...).
    pub fn new(kind: ErrorKind, op: &'static str) -> Error {
        Error { kind, op, path: None, range: None, detail: None, source: None }
    }

    /// An error from an OS call; the kind is derived from the errno.
    pub fn io(op: &'static str, source: io::Error) -> Error {
        let kind = ErrorKind::from_io(&source);
        Error { kind, op, path: None, range: None, detail: None, source: Some(source) }
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

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn op(&self) -> &'static str {
        self.op
    }

    pub fn offset(&self) -> Option<u64> {
        self.range.map(|r| r.0)
    }

    pub fn file(&self) -> Option<&Path> {
        self.path.as_deref()
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
        f.write_str(self.op)?;
        if let Some(path) = &self.path {
            write!(f, " {}", path.display())?;
        }
        if let Some((offset, len)) = self.range {
            write!(f, " at offset {offset} (length {len})")?;
        }
        match (&self.detail, &self.source) {
            (Some(d), Some(s)) => write!(f, ": {d}: {}", io_message(s)),
            (Some(d), None) => write!(f, ": {d}"),
            (None, Some(s)) => write!(f, ": {}", io_message(s)),
            (None, None) => Ok(()),
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
        self.source.as_ref().map(|e| e as _)
    }
}

/// The first write error that may have lost acknowledged data, kept so that every later flush
/// and FUA request fails with it. The kernel reports a writeback error once per open file
/// description, and a write-back of held bytes fails long after their writes were answered:
/// whoever answered the writes keeps the latch. Three do:
///
/// - `io::PolicyFile`, one latch for every open of a file in a job: a failed `fdatasync`, or a
///   writeback error that write-behind found;
/// - `server::Export`: a failed FLUSH or FUA request on any connection (each connection has a
///   file of its own, and the kernel told only that one);
/// - `--coalesce`: a failed write-back of held bytes, acknowledged to clients but not below.
#[derive(Debug, Default)]
pub struct WriteLatch(Mutex<Option<(ErrorKind, String)>>);

impl WriteLatch {
    /// Keeps `err` if nothing is latched yet; true if it was kept.
    pub fn set(&self, err: &Error) -> bool {
        let mut slot = self.0.lock().unwrap();
        let first = slot.is_none();
        if first {
            *slot = Some((err.kind(), err.to_string()));
        }
        first
    }

    pub fn is_set(&self) -> bool {
        self.0.lock().unwrap().is_some()
    }

    /// Fails `op` on `name` with the latched error's kind, if one is latched.
    pub fn check(&self, op: &'static str, name: impl AsRef<Path>) -> Result<()> {
        match &*self.0.lock().unwrap() {
            None => Ok(()),
            Some((kind, first)) => Err(Error::new(*kind, op)
                .path(name)
                .detail(format!("an earlier write failed ({first}); data may be lost"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_names_what_and_where() {
        let e = Error::io("write", io::Error::from_raw_os_error(libc::ENOSPC)).path("/tmp/x").at(4096, 512);
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        assert_eq!(e.to_string(), "write /tmp/x at offset 4096 (length 512): no space left on device");
    }

    #[test]
    fn a_latch_keeps_the_first_error_and_its_kind() {
        let l = WriteLatch::default();
        assert!(l.check("flush", "f").is_ok() && !l.is_set());
        assert!(l.set(&Error::io("write", io::Error::from_raw_os_error(libc::ENOSPC)).path("f")));
        assert!(!l.set(&Error::io("write", io::Error::from_raw_os_error(libc::EIO)).path("f")));
        let e = l.check("flush", "f").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        assert_eq!(
            e.to_string(),
            "flush f: an earlier write failed (write f: no space left on device); data may be lost"
        );
    }

    #[test]
    fn kinds_map_to_nbd_errnos() {
        use crate::proto::{errno, EIO, EPERM, ESHUTDOWN};
        assert_eq!(errno(ErrorKind::from_io(&io::Error::from_raw_os_error(libc::EROFS))), EPERM);
        assert_eq!(errno(ErrorKind::from_io(&io::Error::from_raw_os_error(libc::EIO))), EIO);
        assert_eq!(errno(ErrorKind::Interrupted), ESHUTDOWN);
    }
}
