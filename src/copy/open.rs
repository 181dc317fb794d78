//! Opening an [`Endpoint`] as a backend for a copy: [`open_source`], and [`open_destination`]
//! with [`DestOptions`] (a new file is created at the source's size, an NBD export or an image
//! in object storage is checked and zeroed up front where it can be). Each gives an
//! [`Opened`]: the backend, what the copy engine must know of it (does it read as zeroes?),
//! and, for a file or device, what the checks after the copy need.

use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::Endpoint;
use crate::backend::s3::{S3Options, S3Uri};
use crate::backend::{Backend, FileBackend, NbdBackend, NullBackend, PipeBackend, S3Backend, ZeroFlags};
use crate::error::{Error, ErrorKind, Op, Result};
use crate::io::{CacheMode, OpenOptions, Tuning};

/// An endpoint opened for a copy. What the CLI reports of it (mechanism, page cache, requests
/// to object storage, how a captive server ended) it asks the backend through the [`Backend`]
/// trait.
pub struct Opened {
    pub backend: Arc<dyn Backend>,
    /// The destination file did not exist before the job.
    pub created: bool,
    /// The destination reads as zeroes where not written.
    pub zeroed: bool,
    /// What the endpoint is on this machine, when it is a file or block device (standard
    /// input included): see [`identity`].
    pub id: Option<(u64, u64)>,
    /// A file or device: what the checks after the copy need.
    on_disk: Option<OnDisk>,
    /// A block device destination held open with `O_EXCL` for the whole copy: the kernel then
    /// refuses to mount it (and refused the copy if it was mounted).
    _claim: Option<std::fs::File>,
    /// An NBD source's dirty bitmap (`--bitmap`): its name, its epoch and the one before, when
    /// the server says them (a lightfoot server).
    pub epoch: Option<(String, u64, u64)>,
    /// An `s3://` block image destination of an incremental copy: where its epoch record is.
    s3: Option<Arc<S3Backend>>,
}

/// The extended attribute of an incremental copy's destination file that records the epoch
/// of bitmap `name` whose changes it holds (hex).
fn epoch_xattr(name: &str) -> String {
    format!("user.lightfoot.epoch.{name}")
}

impl Opened {
    /// After an incremental copy into a regular file: records the source bitmap's epoch in it,
    /// so that the next one can tell it is the copy that epoch's successor applies to (or,
    /// from a server that says no epoch, removes a stale record). Filesystems without user
    /// extended attributes keep none: later copies are then not checked.
    pub fn record_epoch(&self, src: &Opened, bitmap: &str) -> Result<()> {
        if let Some(b) = &self.s3 {
            return b.record_epoch(bitmap, src.epoch.as_ref().map(|e| e.1));
        }
        let Some(OnDisk { path, .. }) = &self.on_disk else { return Ok(()) };
        if !std::fs::metadata(path).is_ok_and(|m| m.is_file()) {
            return Ok(());
        }
        let done = match &src.epoch {
            Some((_, epoch, _)) => {
                crate::io::sys::set_xattr(path, &epoch_xattr(bitmap), format!("{epoch:016x}").as_bytes())
            }
            None => crate::io::sys::remove_xattr(path, &epoch_xattr(bitmap)),
        };
        match done {
            Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => Ok(()),
            r => r.map_err(|e| Error::io(Op::Write, e).path(path).detail("recording the bitmap's epoch")),
        }
    }
}

/// A file or device endpoint as [`Opened::check_size_unchanged`] and [`Opened::sync_parent`]
/// need it: its path, and a descriptor of its own onto the backend's open file (a dup, so it
/// is the file copied even if the path now leads elsewhere).
struct OnDisk {
    path: PathBuf,
    file: std::fs::File,
}

/// Which file or device `meta` describes: a block device by its device number (two device
/// nodes for one disk are the same disk), anything else by device and inode.
pub fn identity(meta: &std::fs::Metadata) -> (u64, u64) {
    if meta.file_type().is_block_device() {
        (u64::MAX, meta.rdev())
    } else {
        (meta.dev(), meta.ino())
    }
}

impl Opened {
    fn plain(backend: Arc<dyn Backend>, zeroed: bool) -> Opened {
        Opened {
            backend,
            created: false,
            zeroed,
            id: None,
            on_disk: None,
            _claim: None,
            epoch: None,
            s3: None,
        }
    }

    fn file(file: FileBackend, created: bool, zeroed: bool) -> Result<Opened> {
        let path = file.policy().path().to_path_buf();
        let dup = file.policy().file().try_clone().map_err(|e| Error::io(Op::Open, e).path(&path))?;
        let meta = dup.metadata().map_err(|e| Error::io(Op::Stat, e).path(&path))?;
        Ok(Opened {
            id: Some(identity(&meta)),
            created,
            on_disk: Some(OnDisk { path, file: dup }),
            ..Opened::plain(Arc::new(file), zeroed)
        })
    }

    /// For a regular file source: fails if the file is now shorter than the `size` that was
    /// copied. Its vanished end read as a hole (SEEK_DATA finds nothing past the end of a
    /// file), so zeroes were copied for bytes it no longer has. A file that grew is only
    /// warned about: the copy holds its first `size` bytes.
    pub fn check_size_unchanged(&self, size: Option<u64>) -> Result<()> {
        let (Some(OnDisk { path, file }), Some(size)) = (&self.on_disk, size) else { return Ok(()) };
        let meta = file.metadata().map_err(|e| Error::io(Op::Stat, e).path(path))?;
        if !meta.is_file() {
            return Ok(());
        }
        let now = meta.len();
        if now < size {
            return Err(Error::new(ErrorKind::UnexpectedEof, Op::Copy).path(path).detail(format!(
                "the source shrank during the copy, from {size} to {now} bytes: the destination \
                 does not match it"
            )));
        }
        if now > size {
            tracing::warn!(
                "{}: grew during the copy, from {size} to {now} bytes; only the first {size} were copied",
                path.display()
            );
        }
        Ok(())
    }

    /// After a new file was made durable: makes its directory entry durable too.
    pub fn sync_parent(&self) -> Result<()> {
        let Some(OnDisk { path, .. }) = &self.on_disk else { return Ok(()) };
        if !self.created {
            return Ok(());
        }
        // The entry made is where the path leads: through a symlink, another directory.
        let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.clone());
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let dir = std::fs::File::open(parent).map_err(|e| Error::io(Op::Open, e).path(parent))?;
        dir.sync_all().map_err(|e| Error::io(Op::Flush, e).path(parent))
    }
}

/// Opens the source. `connections` is for NBD servers that advertise multi-conn; `s3`
/// gives the geometry of an `s3://` block image that has no manifest (one nbdkit made);
/// `bitmap` names a dirty bitmap an NBD source must export (`copy --bitmap`).
pub fn open_source(
    ep: &Endpoint,
    mode: CacheMode,
    tuning: &Tuning,
    connections: usize,
    s3: &S3Options,
    bitmap: Option<&str>,
) -> Result<Opened> {
    if let (Some(_), false) = (bitmap, matches!(ep, Endpoint::Nbd(_))) {
        return Err(Error::new(ErrorKind::InvalidInput, Op::Open).path(ep.to_string()).detail(
            "--bitmap needs an NBD source: dirty bitmaps come from an NBD server (qemu-nbd -B NAME)",
        ));
    }
    match ep {
        Endpoint::S3(u) => Ok(Opened::plain(
            Arc::new(S3Backend::open(u, &S3Options { writable: false, ..s3.clone() })?),
            false,
        )),
        Endpoint::Nbd(t) => {
            let b = NbdBackend::open_with_bitmap(t, connections, bitmap)?;
            let epoch = bitmap.zip(b.info().epoch).map(|(name, (e, p))| (name.to_string(), e, p));
            Ok(Opened { epoch, ..Opened::plain(Arc::new(b.keeping_extents()), false) })
        }
        Endpoint::Stdio => {
            let mut o = Opened::plain(Arc::new(PipeBackend::stdin()?), false);
            // Standard input redirected from a file or device: known, so that it is never
            // also the destination (`lightfoot copy - img < img` truncated img).
            if let Ok(fd) = std::io::stdin().as_fd().try_clone_to_owned() {
                if let Ok(m) = std::fs::File::from(fd).metadata() {
                    if m.is_file() || m.file_type().is_block_device() {
                        o.id = Some(identity(&m));
                    }
                }
            }
            Ok(o)
        }
        Endpoint::Null(None) => Err(Error::new(ErrorKind::InvalidInput, Op::Open)
            .path("null:")
            .detail("a null: source needs a size (null:SIZE, e.g. null:1G)")),
        Endpoint::Null(size) => Ok(Opened::plain(Arc::new(NullBackend::new(*size)), false)),
        Endpoint::Path(p) => {
            let meta = std::fs::metadata(p).map_err(|e| Error::io(Op::Open, e).path(p))?;
            if meta.is_dir() {
                return Err(Error::new(ErrorKind::InvalidInput, Op::Open).path(p).detail("is a directory"));
            }
            if meta.file_type().is_fifo() || meta.file_type().is_char_device() {
                let f = std::fs::File::open(p).map_err(|e| Error::io(Op::Open, e).path(p))?;
                return Ok(Opened::plain(
                    Arc::new(PipeBackend::from_file(&p.display().to_string(), f, false)),
                    false,
                ));
            }
            let fb = FileBackend::open(p, OpenOptions::default(), mode, tuning)?;
            Opened::file(fb, false, false)
        }
    }
}

/// How to prepare a destination.
#[derive(Debug, Clone, Default)]
pub struct DestOptions {
    /// Allocate the whole destination file before copying (`--preallocate`).
    pub preallocate: bool,
    /// The user promises a block device or NBD export already reads as zeroes
    /// (`--destination-is-zero`).
    pub destination_is_zero: bool,
    /// Holes may be left as holes (not `--no-sparse`): an NBD destination is then zeroed
    /// up front with one fast zero if it can do that.
    pub sparse: bool,
    /// Connections to an NBD server that advertises multi-conn.
    pub connections: usize,
    /// How an `s3://` destination is laid out (`--object-size`).
    pub s3: S3Options,
    /// The destination holds the previous copy and only changed blocks are written into it
    /// (`copy --bitmap`): it must exist and be the source's size, and is opened as it is (no
    /// truncation, no zeroing up front).
    pub in_place: bool,
}

/// An `s3://` destination: one object, uploaded in parts; or block objects of
/// `--object-size` (a new image reads as zeroes, so holes are skipped; in an existing one they
/// are zeroed, which deletes whole objects, unless `--destination-is-zero`).
fn open_s3_destination(u: &S3Uri, size: Option<u64>, opts: &DestOptions) -> Result<Opened> {
    let Some(object_size) = opts.s3.object_size else {
        // One object: every byte is sent, zeroes included (it does not read as zeroes).
        return Ok(Opened::plain(Arc::new(S3Backend::create_object(u, size, &opts.s3)?), false));
    };
    let Some(size) = size else {
        return Err(Error::new(ErrorKind::InvalidInput, Op::Open)
            .path(u.to_string())
            .detail("a block image needs the source's size in advance (a pipe has none)"));
    };
    if !size.is_multiple_of(object_size) {
        return Err(Error::new(ErrorKind::InvalidInput, Op::Open).path(u.to_string()).detail(format!(
            "the source's size ({size}) is not a multiple of --object-size ({object_size}): \
             a block image holds whole objects"
        )));
    }
    let b = S3Backend::open(
        u,
        &S3Options { writable: true, size: Some(size), object_size: Some(object_size), ..opts.s3.clone() },
    )?;
    let zeroed = opts.destination_is_zero || b.is_empty();
    Ok(Opened::plain(Arc::new(b), zeroed))
}

/// Opens the destination. A regular file is created or truncated to `size` (so it reads as
/// zeroes); a block device is opened as it is and must be large enough; so must an NBD
/// export, which is then zeroed with one fast zero where the server offers it.
pub fn open_destination(
    ep: &Endpoint,
    src: &Opened,
    size: Option<u64>,
    mode: CacheMode,
    tuning: &Tuning,
    opts: DestOptions,
) -> Result<Opened> {
    if opts.in_place {
        return open_in_place(ep, src, size, mode, tuning, &opts);
    }
    match ep {
        Endpoint::Stdio => Ok(Opened::plain(Arc::new(PipeBackend::stdout()?), false)),
        Endpoint::Null(n) => Ok(Opened::plain(Arc::new(NullBackend::new(*n)), true)),
        Endpoint::S3(u) => open_s3_destination(u, size, &opts),
        Endpoint::Nbd(t) => {
            let b = NbdBackend::open(t, opts.connections)?;
            let zeroed = prepare_nbd_destination(&b, size, opts)?;
            Ok(Opened::plain(Arc::new(b), zeroed))
        }
        Endpoint::Path(p) => {
            let existing = match std::fs::metadata(p) {
                Ok(m) => Some(m),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(Error::io(Op::Open, e).path(p)),
            };
            if let (Some(m), Some(id)) = (&existing, src.id) {
                if identity(m) == id {
                    return Err(Error::new(ErrorKind::InvalidInput, Op::Copy)
                        .path(p)
                        .detail("source and destination are the same file"));
                }
            }
            match &existing {
                Some(m) if m.is_dir() => {
                    return Err(Error::new(ErrorKind::InvalidInput, Op::Open)
                        .path(p)
                        .detail("is a directory"))
                }
                Some(m) if m.file_type().is_block_device() => {
                    let claim = claim_device(p)?;
                    let opts_o = OpenOptions { write: true, create: false, truncate: false };
                    let fb = FileBackend::open(p, opts_o, mode, tuning)?;
                    let mut o = Opened::file(fb, false, opts.destination_is_zero)?;
                    o._claim = Some(claim);
                    return Ok(o);
                }
                Some(m) if m.file_type().is_fifo() || m.file_type().is_char_device() => {
                    let f = std::fs::OpenOptions::new()
                        .write(true)
                        .open(p)
                        .map_err(|e| Error::io(Op::Open, e).path(p))?;
                    return Ok(Opened::plain(
                        Arc::new(PipeBackend::from_file(&p.display().to_string(), f, true)),
                        false,
                    ));
                }
                _ => {}
            }
            let opts_o = OpenOptions { write: true, create: true, truncate: true };
            let fb = FileBackend::open(p, opts_o, mode, tuning)?;
            if let Some(size) = size {
                if opts.preallocate && !fb.preallocate(size)? {
                    tracing::warn!(
                        "--preallocate: {}: the filesystem cannot allocate in advance: copying without it",
                        p.display()
                    );
                }
                fb.set_len(size)?;
            }
            Opened::file(fb, existing.is_none(), true)
        }
    }
}

/// Opens block device `p` with `O_EXCL`: refused while it is mounted or claimed (as mkfs
/// does), and it cannot be mounted while the returned file is held.
fn claim_device(p: &Path) -> Result<std::fs::File> {
    std::fs::OpenOptions::new().write(true).custom_flags(libc::O_EXCL).open(p).map_err(|e| {
        match e.raw_os_error() {
            Some(libc::EBUSY) => Error::new(ErrorKind::Permission, Op::Open)
                .path(p)
                .detail("the device is in use (mounted, or held by another program)"),
            _ => Error::io(Op::Open, e).path(p),
        }
    })
}

/// A destination that holds the previous copy ([`DestOptions::in_place`]): opened as it is,
/// and refused, untouched, unless it exists and is exactly the source's size.
fn open_in_place(
    ep: &Endpoint,
    src: &Opened,
    size: Option<u64>,
    mode: CacheMode,
    tuning: &Tuning,
    opts: &DestOptions,
) -> Result<Opened> {
    let refuse = |kind, detail: String| Err(Error::new(kind, Op::Open).path(ep.to_string()).detail(detail));
    let Some(size) = size else {
        return refuse(ErrorKind::InvalidInput, "an incremental copy needs a source of known size".into());
    };
    let opened = match ep {
        Endpoint::Null(_) => return Ok(Opened::plain(Arc::new(NullBackend::new(Some(size))), false)),
        Endpoint::Stdio => {
            return refuse(
                ErrorKind::InvalidInput,
                "an incremental copy writes into the previous copy: standard output cannot hold one".into(),
            )
        }
        // A block image's geometry comes from its manifest (or --object-size and --size for one
        // nbdkit made); an image in one object refuses to open for writing.
        Endpoint::S3(u) => {
            let b = Arc::new(S3Backend::open(u, &S3Options { writable: true, ..opts.s3.clone() })?);
            if let Some((name, epoch, parent)) = &src.epoch {
                if let Some(r) = b.epoch_record(name)?.filter(|r| r != epoch && r != parent) {
                    return refuse(ErrorKind::InvalidInput, wrong_base(name, r, *epoch, *parent));
                }
            }
            Opened { s3: Some(b.clone()), ..Opened::plain(b, false) }
        }
        Endpoint::Nbd(t) => Opened::plain(Arc::new(NbdBackend::open(t, opts.connections)?), false),
        Endpoint::Path(p) => {
            let meta =
                match std::fs::metadata(p) {
                    Ok(m) => m,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return refuse(
                        ErrorKind::NotFound,
                        "no such file: an incremental copy writes into the previous copy, which must exist"
                            .into(),
                    ),
                    Err(e) => return Err(Error::io(Op::Open, e).path(p)),
                };
            if !(meta.is_file() || meta.file_type().is_block_device()) {
                return refuse(
                    ErrorKind::InvalidInput,
                    "not a regular file or block device: it cannot hold the previous copy".into(),
                );
            }
            if src.id == Some(identity(&meta)) {
                return refuse(ErrorKind::InvalidInput, "source and destination are the same file".into());
            }
            // The copy the bitmap's epoch applies to: one recorded as brought up to that
            // epoch (a retry) or to the one before it (the last backup). No record: unknown.
            if let (Some((name, epoch, parent)), true) = (&src.epoch, meta.is_file()) {
                let record = crate::io::sys::get_xattr(p, &epoch_xattr(name))
                    .map_err(|e| Error::io(Op::Open, e).path(p).detail("reading its bitmap epoch"))?;
                let record = record.and_then(|r| u64::from_str_radix(&String::from_utf8_lossy(&r), 16).ok());
                if let Some(r) = record.filter(|r| r != epoch && r != parent) {
                    return refuse(ErrorKind::InvalidInput, wrong_base(name, r, *epoch, *parent));
                }
            }
            let claim = if meta.file_type().is_block_device() { Some(claim_device(p)?) } else { None };
            let fb = FileBackend::open(
                p,
                OpenOptions { write: true, create: false, truncate: false },
                mode,
                tuning,
            )?;
            let mut o = Opened::file(fb, false, false)?;
            o._claim = claim;
            o
        }
    };
    match opened.backend.size() {
        Some(have) if have == size => {}
        Some(have) => {
            return refuse(
                ErrorKind::InvalidInput,
                format!(
                    "is {have} bytes, the source {size}: not a copy of it (an incremental copy writes \
                     into the previous copy of the same source)"
                ),
            )
        }
        None => {
            return refuse(
                ErrorKind::InvalidInput,
                "its size is not known: it cannot hold the previous copy".into(),
            )
        }
    }
    if opened.backend.caps().read_only {
        return refuse(ErrorKind::Permission, "destination is read-only".into());
    }
    Ok(opened)
}

/// Why a destination recorded as brought up to epoch `record` is not the base of bitmap
/// `name`'s changes (those since `parent`; its own epoch `epoch`, for a retry).
fn wrong_base(name: &str, record: u64, epoch: u64, parent: u64) -> String {
    format!(
        "not the copy bitmap '{name}' started from: it holds the changes up to epoch {record:016x}, and \
         the bitmap records those since epoch {parent:016x} (its own is {epoch:016x}); copy in full, or \
         into that copy"
    )
}

/// Checks an NBD destination before anything is written to it, and makes it read as zeroes
/// if one fast zero can: true when it then does (or the user says it already does).
fn prepare_nbd_destination(b: &NbdBackend, size: Option<u64>, opts: DestOptions) -> Result<bool> {
    // The fast zero below writes: check first what the copy would refuse anyway.
    super::check_destination(b, size.unwrap_or(0))?;
    if opts.destination_is_zero {
        return Ok(true);
    }
    let Some(size) = size.filter(|&s| s > 0 && opts.sparse && b.caps().can_fast_zero) else {
        return Ok(false);
    };
    // A fast zero either is quick or fails with ENOTSUP at once (the spec's promise); then
    // the copy zeroes the holes it meets with WRITE_ZEROES instead.
    match b.zero(0, size, ZeroFlags { may_trim: true, fast: true, fua: false }) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == ErrorKind::NotSupported => {
            tracing::info!("{}: fast zero refused; holes will be zeroed one by one", b.name());
            Ok(false)
        }
        Err(e) => Err(e),
    }
}
