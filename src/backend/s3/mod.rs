//! Disk images in object storage (`s3://BUCKET/KEY`). [`S3Backend`] is the one backend the
//! rest of lightfoot sees; at open it picks one of three images over one [`Store`], and
//! forwards to it what differs between them (the [`Image`] trait):
//!
//! - [`ObjectImage`] (`object`): `KEY` is the image, read-only, read with range GETs pinned
//!   to the ETag seen at open.
//! - [`BlockImage`] (`blocks`): block objects `KEY/%016x` as nbdkit's S3 plugin lays them out,
//!   readable and writable by one writer at a time ([`lease`]). Its manifest ([`MANIFEST`])
//!   or `--size` with `--object-size` asks for it (`manifest`).
//! - [`Upload`] (`upload`): one object being written by a copy, a multipart upload that
//!   appears whole when it completes.
//!
//! Every write is stored (its PUT answered) before it is acknowledged, so FLUSH has nothing
//! left to do and FUA is free; `--coalesce` above turns small writes into whole-object PUTs.
//!
//! The requests themselves are in [`store`]; where settings come from is in [`config`].

mod blocks;
pub mod config;
pub mod epochs;
pub mod lease;
pub mod manifest;
mod object;
pub mod store;
mod upload;

use std::sync::Arc;

pub use config::{S3Config, S3Uri};
pub use manifest::MANIFEST;
pub use store::{Limits, Requests, Store};

use super::{Backend, BlockSizes, CacheInfo, Caps, Extent, Report, ZeroFlags};
use crate::error::{Error, ErrorKind, Op, Result};
use blocks::BlockImage;
use manifest::Geometry;
use object::ObjectImage;
use upload::Upload;

/// Requests in flight at once for one call (a large READ spans many objects).
const IN_FLIGHT: usize = 64;

/// How an `s3://` endpoint is opened.
#[derive(Debug, Clone, Default)]
pub struct S3Options {
    pub writable: bool,
    /// Image size (block layout; with `object_size`, as nbdkit's `size=`).
    pub size: Option<u64>,
    /// Bytes per block object (nbdkit's `object-size=`): asks for the block layout.
    pub object_size: Option<u64>,
    pub limits: Limits,
    /// Take the lease of a writable block image even from a live writer (`--break-lease`).
    pub break_lease: bool,
    /// Write a block image without a lease, on a store that does not enforce conditional
    /// writes (`--without-lease`).
    pub without_lease: bool,
    /// Where the store is and who we are to it; `None`: from this process's environment
    /// and the shared AWS files ([`S3Config::from_env`]).
    pub config: Option<S3Config>,
}

/// What dirty bitmaps need of a block image ([`S3Backend::tracking`]).
pub struct Tracking {
    pub store: Arc<Store>,
    pub key: String,
    /// This open holds the lease: the one writer.
    pub leased: bool,
    /// Opened read-only while another writer holds the lease.
    pub written_elsewhere: bool,
}

/// What tells the three images apart. [`S3Backend`] does what they share: the checks of
/// range and of writing, the capabilities, and the operations that are the same for all.
trait Image: Send + Sync {
    /// `None` only for an upload of a size not known in advance, which takes what comes.
    fn size(&self) -> Option<u64>;

    fn writable(&self) -> bool;

    /// Reads consecutive bytes from `offset` into `bufs` in turn, all of them, inside the
    /// image (straight from the answers' bodies into `bufs`).
    fn read(&self, bufs: Vec<&mut [u8]>, offset: u64) -> Result<()>;

    /// Writes `data` at `offset` (`None`: `len` zeroes), on a writable image. With `partial ==
    /// false` (TRIM), a block image leaves the objects the range covers only in part alone.
    fn change(&self, offset: u64, len: u64, data: Option<&[u8]>, partial: bool) -> Result<()>;

    /// FLUSH and the end of the job: an upload completes.
    fn complete(&self) -> Result<()>;

    /// The block image, for what only it has (a map of its objects, a lease).
    fn blocks(&self) -> Option<&BlockImage>;
}

/// An `s3://` image as a [`Backend`]: an [`ObjectImage`], a [`BlockImage`] or an [`Upload`],
/// picked at open.
pub struct S3Backend {
    name: String,
    store: Arc<Store>,
    image: Box<dyn Image>,
}

impl S3Backend {
    /// Opens `uri` with the settings of this process's environment (see [`config`]). Fails
    /// at once on a wrong credential, a missing bucket or object, or an object of the wrong
    /// size, naming it.
    pub fn open(uri: &S3Uri, opts: &S3Options) -> Result<S3Backend> {
        let name = uri.to_string();
        let cfg = config_of(opts, &name)?;
        for s in &cfg.sources {
            tracing::debug!("{name}: {s}");
        }
        let store = Arc::new(Store::open(uri, &cfg, opts.limits)?);
        let key = &uri.key;
        let image: Box<dyn Image> = match Geometry::find(&store, key, &name, opts.size, opts.object_size)? {
            None => Box::new(ObjectImage::open(store.clone(), key, &name, opts.writable)?),
            Some(g) => Box::new(BlockImage::open(store.clone(), key, &name, g, opts)?),
        };
        Ok(S3Backend { name, store, image })
    }

    /// Starts writing `uri` as one object of `size` bytes (`None`: as many as are written),
    /// for a copy. The object appears, whole, when every byte was written and the copy
    /// flushes or finishes; until then the old one (if any) stays.
    pub fn create_object(uri: &S3Uri, size: Option<u64>, opts: &S3Options) -> Result<S3Backend> {
        let name = uri.to_string();
        let cfg = config_of(opts, &name)?;
        let store = Arc::new(Store::open(uri, &cfg, opts.limits)?);
        let image = Box::new(Upload::start(store.clone(), &uri.key, size)?);
        Ok(S3Backend { name, store, image })
    }

    /// The end of all writing (a server shutting down): the lease of a block image is
    /// released, and writes fail from then on. Also done on drop.
    pub fn release(&self) {
        if let Some(b) = self.image.blocks() {
            b.release();
        }
    }

    /// A block image with no objects (new, or wholly trimmed): it reads as zeroes.
    pub fn is_empty(&self) -> bool {
        self.image.blocks().is_some_and(BlockImage::is_empty)
    }

    /// The block image's store and key, whether this open holds its lease, and what it is now
    /// (`BlockImage::identity`): where and how its dirty bitmaps are kept. `None` for an
    /// image in one object.
    pub fn tracking(&self) -> Option<Tracking> {
        self.image.blocks().map(|b| Tracking {
            store: self.store.clone(),
            key: b.key().to_string(),
            leased: b.leased(),
            written_elsewhere: !b.map_current(),
        })
    }

    /// The epoch of the source's bitmap `bitmap` an incremental copy brought this block image
    /// up to ([`epochs`]); `None` when none is recorded or it is one object.
    pub fn epoch_record(&self, bitmap: &str) -> Result<Option<u64>> {
        match self.image.blocks() {
            Some(b) => epochs::get(&self.store, b.key(), bitmap),
            None => Ok(None),
        }
    }

    /// Records it after an incremental copy (`None`: removes a stale one).
    pub fn record_epoch(&self, bitmap: &str, epoch: Option<u64>) -> Result<()> {
        match self.image.blocks() {
            Some(b) => epochs::set(&self.store, b.key(), bitmap, epoch),
            None => Ok(()),
        }
    }

    /// What a block image is now (see [`S3Backend::tracking`]); `None` for one object.
    pub fn identity(&self) -> Option<String> {
        self.image.blocks().map(BlockImage::identity)
    }

    /// The object size of a block image, `None` for one object.
    pub fn object_size(&self) -> Option<u64> {
        self.image.blocks().map(BlockImage::object_size)
    }

    fn check_writable(&self, op: Op) -> Result<()> {
        if !self.image.writable() {
            return Err(read_only(&self.name, op));
        }
        Ok(())
    }
}

impl Backend for S3Backend {
    fn name(&self) -> &str {
        &self.name
    }

    fn size(&self) -> Option<u64> {
        self.image.size()
    }

    fn caps(&self) -> Caps {
        let object = self.object_size();
        let writable = self.image.writable();
        Caps {
            read_only: !writable,
            // Every write is stored before it is acknowledged.
            can_flush: true,
            can_fua: true,
            can_trim: writable,
            can_zero: writable,
            // Zeroing part of an object reads and rewrites it.
            can_fast_zero: false,
            can_extents: self.image.blocks().is_some_and(BlockImage::map_current),
            sequential: false,
            growable: self.image.size().is_none(),
            rotational: false,
            block: BlockSizes {
                minimum: 1,
                preferred: object.map_or(4096, |o| o.min(32 << 20) as u32),
                maximum: 32 << 20,
            },
            // `--coalesce` fills the gaps of the objects it writes, so that each is one PUT.
            alloc_unit: object.and_then(|o| u32::try_from(o).ok()),
            at_hand: false,
        }
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let n = buf.len();
        self.read_parts(vec![buf], offset)?;
        Ok(n)
    }

    /// One range GET for all the parts of one object piece (the prefetcher's read-ahead
    /// units), their bodies written straight into the parts.
    fn read_parts(&self, parts: Vec<&mut [u8]>, offset: u64) -> Result<()> {
        let len: u64 = parts.iter().map(|p| p.len() as u64).sum();
        if len == 0 {
            return Ok(());
        }
        let size = self.image.size().unwrap_or(0);
        if offset.checked_add(len).is_none_or(|e| e > size) {
            return Err(Error::new(ErrorKind::InvalidInput, Op::Read)
                .path(&self.name)
                .at(offset, len)
                .detail(format!("past the end of the image ({size} bytes)")));
        }
        self.image.read(parts, offset)
    }

    /// Every read is a round trip.
    fn read_at_hand(&self, _buf: &mut [u8], _offset: u64) -> Option<Result<usize>> {
        None
    }

    fn write(&self, buf: &[u8], offset: u64, _fua: bool) -> Result<()> {
        self.check_writable(Op::Write)?;
        self.image.change(offset, buf.len() as u64, Some(buf), true)
    }

    // A round trip to the store, which keeps no pages of ours.
    super::writes_leave_at_once!();

    fn zero(&self, offset: u64, len: u64, _flags: ZeroFlags) -> Result<()> {
        self.check_writable(Op::Zero)?;
        // Whole objects are deleted whether or not the range may be deallocated: a missing
        // object reads as zeroes, and that is what NO_HOLE's "reads as zero" asks.
        self.image.change(offset, len, None, true)
    }

    fn trim(&self, offset: u64, len: u64, _fua: bool) -> Result<()> {
        self.check_writable(Op::Trim)?;
        self.image.change(offset, len, None, false)
    }

    /// Block objects and one object read: nothing is held, every acknowledged write was
    /// stored before its reply. An upload completes (every byte must have been written).
    fn flush(&self) -> Result<()> {
        self.image.complete()
    }

    fn cache(&self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }

    /// A block image's map of its objects (a missing object is a hole); all data otherwise.
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        Ok(match self.image.blocks() {
            Some(b) => b.extents(offset, len),
            None => vec![Extent::data(len)],
        })
    }

    fn cache_info(&self) -> Option<CacheInfo> {
        None
    }

    /// The requests made so far.
    fn report(&self) -> Report {
        Report { requests: Some(self.store.counters.snapshot()), server_ended: None }
    }

    /// An upload completes if every byte was written (a copy with `--no-flush`), and is
    /// abandoned otherwise (a failed or interrupted copy, when it is dropped): no half object
    /// appears. Not the lease: `finish` ends one open (a server's connection) and all opens
    /// share this backend; [`S3Backend::release`] and drop release it.
    fn finish(&self) -> Result<()> {
        self.image.complete()
    }
}

/// The configuration `opts` gives, or the environment's.
fn config_of(opts: &S3Options, name: &str) -> Result<S3Config> {
    match &opts.config {
        Some(c) => Ok(c.clone()),
        None => S3Config::from_env().map_err(|e| Error::after(Op::Open, &e).path(name)),
    }
}

fn read_only(name: &str, op: Op) -> Error {
    Error::new(ErrorKind::Permission, op).path(name).detail("opened read-only")
}
