//! Disk images in object storage (`s3://BUCKET/KEY`), in one of two layouts:
//!
//! - **One object** (`KEY` is the image): read-only, with range GETs pinned to the ETag seen
//!   at open (`If-Match`), so an image replaced underneath fails loudly instead of serving a
//!   mix of two. A copy writes one with a multipart upload ([`upload`]).
//! - **Block objects**, as nbdkit's S3 plugin lays them out: `KEY/%016x` (the block number in
//!   16 hex digits) of exactly `object_size` bytes each; a missing object reads as zeroes.
//!   Readable and writable. lightfoot keeps the geometry in `KEY/lightfoot.json` (see
//!   [`MANIFEST`]) so later opens need no flags.
//!
//! Every write is stored (its PUT answered) before it is acknowledged, so FLUSH has nothing
//! left to do and FUA is free; `--coalesce` above turns small writes into whole-object PUTs.
//! Writes into an object take that object's lock for the whole read-modify-write, in every
//! connection (they share this backend), so two connections writing different bytes of one
//! object never lose each other's.
//!
//! The requests themselves are in [`store`]; where settings come from is in [`config`].

pub mod config;
pub mod lease;
pub mod store;
mod upload;

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use futures::{StreamExt, TryStreamExt};
use object_store::{PutMode, UpdateVersion};

pub use config::{S3Config, S3Uri};
pub use store::{Limits, Requests, Store};

use super::{Backend, BlockSizes, CacheInfo, Caps, Extent, Report, ZeroFlags};
use crate::error::{Error, ErrorKind, Op, Result};

/// The manifest of a block image, `KEY/lightfoot.json`. Named so that nbdkit's S3 plugin never
/// deletes it: its TRIM deletes what it lists under `KEY/` from the first block's name up to
/// (not including) the name of the block after the last, and `l` sorts after every hex digit.
/// lightfoot itself deletes only names of the form `KEY/` + 16 hex digits.
pub const MANIFEST: &str = "lightfoot.json";

/// Requests in flight at once for one call (a large READ spans many objects).
const IN_FLIGHT: usize = 64;

/// Largest piece of a one-object image fetched by one range GET.
const PIECE: u64 = 8 << 20;

/// Stripes of the per-object write locks: 2^10.
const LOCK_BITS: u32 = 10;

/// The stripe of the write lock of block `b`.
fn lock_stripe(b: u64) -> usize {
    crate::io::spread(b, LOCK_BITS)
}

/// Block number → ETag of the existing objects of a block image.
type Present = BTreeMap<u64, Option<String>>;

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

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Manifest {
    format: String,
    version: u32,
    size: u64,
    object_size: u64,
}

const FORMAT: &str = "lightfoot-s3-blocks";

enum Layout {
    Object {
        etag: Option<String>,
    },
    /// One object being written (a copy's destination).
    Upload(upload::Upload),
    Blocks {
        object_size: u64,
        /// The blocks that exist, with the ETag of the version this process last saw (`None`:
        /// the store gave none), from a LIST at open kept current by this process's own
        /// writes and deletes (see [`S3Backend::extents`] and [`S3Backend::change`]).
        present: Mutex<Present>,
        /// No other writer can change the image behind the map: this process holds the
        /// lease, or nobody did when it was opened read-only.
        map_current: bool,
        /// The writer's lease (`None` read-only, or with `--without-lease`).
        lease: Option<lease::Lease>,
        locks: Vec<tokio::sync::Mutex<()>>,
    },
}

pub struct S3Backend {
    name: String,
    key: String,
    store: Arc<Store>,
    layout: Layout,
    size: u64,
    writable: bool,
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
        let key = uri.key.clone();
        let manifest_key = format!("{key}/{MANIFEST}");
        let manifest = match store.run(store.get(&manifest_key, None, None))? {
            None => None,
            Some((bytes, _)) => Some(serde_json::from_slice::<Manifest>(&bytes).map_err(|e| {
                Error::new(ErrorKind::InvalidInput, Op::Open)
                    .path(store.uri(&manifest_key))
                    .detail(format!("not a manifest: {e}"))
            })?),
        };
        let geometry = match (&manifest, opts.size, opts.object_size) {
            (Some(m), size, osize) => {
                if m.format != FORMAT || m.version != 1 {
                    return Err(bad(
                        &store.uri(&manifest_key),
                        format!("unknown format {} version {}", m.format, m.version),
                    ));
                }
                if size.is_some_and(|s| s != m.size) || osize.is_some_and(|o| o != m.object_size) {
                    return Err(bad(
                        &name,
                        format!(
                            "the image is {} bytes in objects of {} (its manifest says so): --size and --object-size differ",
                            m.size, m.object_size
                        ),
                    ));
                }
                Some((m.size, m.object_size))
            }
            (None, Some(s), Some(o)) => Some((s, o)),
            (None, None, Some(_)) => {
                return Err(bad(
                    &name,
                    "--object-size needs --size (the image's size) for a new block image".into(),
                ))
            }
            (None, Some(_), None) => {
                return Err(bad(&name, "--size needs --object-size (the block layout's object size)".into()))
            }
            (None, None, None) => None,
        };
        let Some((size, object_size)) = geometry else {
            // One object.
            let meta = store.run(store.head(&key))?.ok_or_else(|| {
                Error::new(ErrorKind::NotFound, Op::Open).path(&name).detail(format!(
                    "no such object, and no block image under {name}/ (a new block image needs --size and --object-size)"
                ))
            })?;
            if opts.writable {
                return Err(Error::new(ErrorKind::Permission, Op::Open).path(&name).detail(
                    "an image in one object is served read-only (give --object-size and --size to write a block image)",
                ));
            }
            return Ok(S3Backend {
                name,
                key,
                store,
                layout: Layout::Object { etag: meta.etag },
                size: meta.size,
                writable: false,
            });
        };
        if object_size == 0 || size % object_size != 0 || object_size > 1 << 30 {
            return Err(bad(
                &name,
                format!(
                    "the size ({size}) must be a multiple of the object size ({object_size}), at most 1 GiB"
                ),
            ));
        }
        let blocks = size / object_size;
        // The lease first: the map below must not change behind this writer's back.
        let (lease, map_current) = if !opts.writable {
            match lease::held_by_other(&store, &key)? {
                Some(holder) => {
                    tracing::info!(
                        "{name}: {holder} is writing the image: block status reports it all as data"
                    );
                    (None, false)
                }
                None => (None, true),
            }
        } else if !lease::probe_conditional_writes(&store, &key)? {
            if !opts.without_lease {
                return Err(Error::new(ErrorKind::NotSupported, Op::Open).path(&name).detail(
                    "the store does not enforce conditional writes (a second create of one name succeeded), \
                     so lightfoot cannot make sure it is the image's only writer; --without-lease writes anyway",
                ));
            }
            tracing::warn!("{name}: --without-lease on a store without conditional writes: nothing stops a second writer");
            (None, true)
        } else if opts.without_lease {
            tracing::warn!("{name}: --without-lease: nothing stops a second writer");
            (None, true)
        } else {
            (Some(lease::Lease::take(store.clone(), &key, opts.break_lease)?), true)
        };
        // Which blocks exist, and that each is whole.
        let listed = store.run(store.list(&key))?;
        let mut present = Present::new();
        for (k, meta) in listed {
            let len = meta.size;
            let Some(b) = block_number(&key, &k) else { continue };
            if b >= blocks {
                tracing::warn!("{}: beyond the image's {blocks} objects: ignored", store.uri(&k));
                continue;
            }
            if len != object_size {
                return Err(Error::new(ErrorKind::InvalidInput, Op::Open).path(store.uri(&k)).detail(
                    format!("the object is {len} bytes, not the image's object size {object_size}"),
                ));
            }
            present.insert(b, meta.etag);
        }
        if opts.writable && manifest.is_none() {
            let m = Manifest { format: FORMAT.into(), version: 1, size, object_size };
            let body = Bytes::from(serde_json::to_vec_pretty(&m).expect("manifest serializes"));
            // Created only if absent: two first opens racing agree or one fails above next time.
            if let Some((_, version)) = store.run(store.put(&manifest_key, body, PutMode::Create))? {
                lease::warn_if_versioned(&store, &manifest_key, version.as_deref());
            }
        }
        Ok(S3Backend {
            name,
            key,
            store,
            layout: Layout::Blocks {
                object_size,
                present: Mutex::new(present),
                map_current,
                lease,
                locks: (0..1 << LOCK_BITS).map(|_| tokio::sync::Mutex::new(())).collect(),
            },
            size,
            writable: opts.writable,
        })
    }

    /// Starts writing `uri` as one object of `size` bytes (`None`: as many as are written),
    /// for a copy. The object appears, whole, when every byte was written and the copy
    /// flushes or finishes; until then the old one (if any) stays.
    pub fn create_object(uri: &S3Uri, size: Option<u64>, opts: &S3Options) -> Result<S3Backend> {
        let name = uri.to_string();
        let cfg = config_of(opts, &name)?;
        let store = Arc::new(Store::open(uri, &cfg, opts.limits)?);
        let up = upload::Upload::start(&store, &uri.key, size)?;
        Ok(S3Backend {
            name,
            key: uri.key.clone(),
            store,
            layout: Layout::Upload(up),
            // Unused: the upload keeps its own (see `Backend::size`).
            size: size.unwrap_or(0),
            writable: true,
        })
    }

    /// The end of all writing (a server shutting down): the lease of a block image is
    /// released, and writes fail from then on. Also done on drop.
    pub fn release(&self) {
        if let Layout::Blocks { lease: Some(l), .. } = &self.layout {
            l.release();
        }
    }

    /// A block image with no objects (new, or wholly trimmed): it reads as zeroes.
    pub fn is_empty(&self) -> bool {
        match &self.layout {
            Layout::Blocks { present, .. } => present.lock().unwrap().is_empty(),
            Layout::Object { .. } | Layout::Upload(_) => false,
        }
    }

    /// The object size of a block image, `None` for one object.
    pub fn object_size(&self) -> Option<u64> {
        match &self.layout {
            Layout::Blocks { object_size, .. } => Some(*object_size),
            Layout::Object { .. } | Layout::Upload(_) => None,
        }
    }

    fn block_key(&self, b: u64) -> String {
        format!("{}/{b:016x}", self.key)
    }

    fn read_only_error(&self, op: Op) -> Error {
        Error::new(ErrorKind::Permission, op).path(&self.name).detail("opened read-only")
    }

    /// Reads `[offset, offset+buf.len())` of block image: one GET a touched object that may
    /// exist, concurrently.
    fn read_blocks(
        &self,
        buf: &mut [u8],
        offset: u64,
        object_size: u64,
        present: &Mutex<Present>,
    ) -> Result<()> {
        let pieces = split(offset, buf.len() as u64, object_size);
        let want: Vec<(u64, Range<u64>, usize)> = {
            let p = present.lock().unwrap();
            let mut at = 0usize;
            let mut v = Vec::new();
            for (b, r) in pieces {
                let n = (r.end - r.start) as usize;
                if p.contains_key(&b) {
                    v.push((b, r, at));
                } else {
                    buf[at..at + n].fill(0);
                }
                at += n;
            }
            v
        };
        let results: Vec<(Range<u64>, usize, Option<Bytes>)> = self.store.run(
            futures::stream::iter(want.into_iter().map(|(b, r, at)| async move {
                let key = self.block_key(b);
                let whole = r.start == 0 && r.end == object_size;
                let got = self
                    .store
                    .get(&key, (!whole).then(|| r.clone()), None)
                    .await
                    .map_err(|e| in_image(e, b, &r, object_size))?;
                if let Some((_, meta)) = &got {
                    if meta.size != object_size {
                        return Err(wrong_size(&self.store.uri(&key), meta.size, object_size));
                    }
                }
                Ok::<_, Error>((r, at, got.map(|g| g.0)))
            }))
            .buffer_unordered(IN_FLIGHT)
            .try_collect(),
        )?;
        for (r, at, got) in results {
            let n = (r.end - r.start) as usize;
            match got {
                Some(bytes) if bytes.len() == n => buf[at..at + n].copy_from_slice(&bytes),
                Some(bytes) => {
                    return Err(Error::new(ErrorKind::Io, Op::Read)
                        .path(&self.name)
                        .at(offset + at as u64, n as u64)
                        .detail(format!("the store answered {} bytes for {n}", bytes.len())))
                }
                // Deleted since the LIST (by another writer): zeroes, as nbdkit reads it.
                None => buf[at..at + n].fill(0),
            }
        }
        Ok(())
    }

    fn read_object(&self, buf: &mut [u8], offset: u64, etag: Option<&str>) -> Result<()> {
        let pieces: Vec<(u64, usize)> =
            (0..buf.len() as u64).step_by(PIECE as usize).map(|p| (offset + p, p as usize)).collect();
        let total = buf.len() as u64;
        let results: Vec<(usize, Bytes)> = self.store.run(
            futures::stream::iter(pieces.into_iter().map(|(at, i)| async move {
                let n = PIECE.min(total - i as u64);
                match self.store.get(&self.key, Some(at..at + n), etag).await.map_err(|e| e.at(at, n))? {
                    Some((b, _)) if b.len() as u64 == n => Ok((i, b)),
                    Some((b, meta)) => {
                        Err(Error::new(ErrorKind::Io, Op::Read).path(&self.name).at(at, n).detail(format!(
                            "got {} bytes of {n} (the object is now {} bytes)",
                            b.len(),
                            meta.size
                        )))
                    }
                    None => Err(Error::new(ErrorKind::NotFound, Op::Read)
                        .path(&self.name)
                        .at(at, n)
                        .detail("the object was deleted while being served")),
                }
            }))
            .buffer_unordered(IN_FLIGHT)
            .try_collect(),
        )?;
        for (i, b) in results {
            buf[i..i + b.len()].copy_from_slice(&b);
        }
        Ok(())
    }

    /// Changes the block objects `[offset, offset+len)` covers: `data` gives the new bytes
    /// (`None`: zeroes). Objects wholly covered are PUT (or deleted, for zeroes); partly
    /// covered ones are read, patched and PUT, under their lock; with `partial == false`,
    /// partly covered objects are left alone (TRIM).
    fn change(&self, offset: u64, len: u64, data: Option<&[u8]>, partial: bool) -> Result<()> {
        if let Layout::Upload(up) = &self.layout {
            return up.write(&self.store, &self.key, data, offset, len);
        }
        let Layout::Blocks { object_size, present, locks, lease, .. } = &self.layout else {
            return Err(self.read_only_error(Op::Write));
        };
        if let Some(l) = lease {
            l.check()?;
        }
        let os = *object_size;
        if offset.checked_add(len).is_none_or(|e| e > self.size) {
            return Err(Error::new(ErrorKind::NoSpace, Op::Write)
                .path(&self.name)
                .at(offset, len)
                .detail(format!("past the end of the image ({} bytes)", self.size)));
        }
        let mut deletes = Vec::new();
        let mut updates = Vec::new();
        let mut at = 0usize;
        for (b, r) in split(offset, len, os) {
            let n = (r.end - r.start) as usize;
            let piece = data.map(|d| &d[at..at + n]);
            at += n;
            let whole = n as u64 == os;
            let zero = piece.is_none_or(super::is_zero);
            if whole && zero {
                deletes.push(b);
            } else if whole || partial {
                updates.push((b, r, piece));
            }
        }

        let store = &self.store;
        // Deletes first, batched, under the locks of their objects (taken in stripe order:
        // no two callers wait on each other).
        if !deletes.is_empty() {
            let known: Vec<u64> = {
                let p = present.lock().unwrap();
                deletes.iter().copied().filter(|b| p.contains_key(b)).collect()
            };
            if !known.is_empty() {
                let mut stripes: Vec<usize> = known.iter().map(|&b| lock_stripe(b)).collect();
                stripes.sort_unstable();
                stripes.dedup();
                store.run(async {
                    let mut guards = Vec::with_capacity(stripes.len());
                    for s in stripes {
                        guards.push(locks[s].lock().await);
                    }
                    let res = store.delete(known.iter().map(|&b| self.block_key(b)).collect()).await;
                    // Gone or not after a failure: keep them "present" (reads then GET them,
                    // and a 404 reads as zeroes), never the other way round.
                    if res.is_ok() {
                        let mut p = present.lock().unwrap();
                        for b in &known {
                            p.remove(b);
                        }
                    }
                    res
                })?;
            }
        }
        store.run(
            futures::stream::iter(updates.into_iter().map(|(b, r, piece)| async move {
                let key = self.block_key(b);
                let here = |e: Error| in_image(e, b, &r, os);
                let _g = locks[lock_stripe(b)].lock().await;
                let whole = r.start == 0 && r.end == os;
                // Every PUT is conditional on the version it was based on (If-Match, or
                // If-None-Match: * for an object we know not to exist). A write of ours that
                // the store still carries out after we gave up on it (a timed-out request can
                // land later) then cannot replace a later one, and an object someone else
                // changed is read again rather than overwritten unseen.
                // `known`: None, no object; Some(etag), the version this write builds on.
                let mut known: Option<Option<String>> = present.lock().unwrap().get(&b).cloned();
                for _ in 0..3 {
                    let body = if whole {
                        Bytes::copy_from_slice(piece.expect("a whole object of zeroes is deleted"))
                    } else {
                        if known.is_none() && piece.is_none() {
                            // Zeroing part of a missing object: it reads as zeroes already.
                            return Ok(());
                        }
                        let mut obj = BytesMut::zeroed(os as usize);
                        if known.is_some() {
                            known = match store.get(&key, None, None).await.map_err(here)? {
                                Some((old, meta)) if meta.size == os && old.len() as u64 == os => {
                                    obj.copy_from_slice(&old);
                                    Some(meta.etag)
                                }
                                Some((_, meta)) => return Err(wrong_size(&store.uri(&key), meta.size, os)),
                                None => None,
                            };
                        }
                        let dst = &mut obj[r.start as usize..r.end as usize];
                        match piece {
                            Some(p) => dst.copy_from_slice(p),
                            None => dst.fill(0),
                        }
                        obj.freeze()
                    };
                    let mode = match &known {
                        None => PutMode::Create,
                        Some(Some(e)) => {
                            PutMode::Update(UpdateVersion { e_tag: Some(e.clone()), version: None })
                        }
                        // A store that gives no ETags: nothing to be conditional on.
                        Some(None) => PutMode::Overwrite,
                    };
                    if let Some((etag, _)) = store.put(&key, body, mode).await.map_err(here)? {
                        present.lock().unwrap().insert(b, etag);
                        return Ok(());
                    }
                    // Changed behind this write: learn what is there now, and go again.
                    tracing::debug!("{}: changed by another request: written again", store.uri(&key));
                    known = store.head(&key).await.map_err(here)?.map(|m| m.etag);
                    let mut p = present.lock().unwrap();
                    match &known {
                        Some(e) => p.insert(b, e.clone()),
                        None => p.remove(&b),
                    };
                }
                Err(here(Error::new(ErrorKind::Io, Op::Write).path(store.uri(&key)).detail(
                    "the object kept changing while it was being written (another writer without the lease?)",
                )))
            }))
            .buffer_unordered(IN_FLIGHT)
            .try_collect::<Vec<()>>(),
        )?;
        Ok(())
    }
}

impl Backend for S3Backend {
    fn name(&self) -> &str {
        &self.name
    }

    fn size(&self) -> Option<u64> {
        match &self.layout {
            Layout::Upload(up) => up.size(),
            _ => Some(self.size),
        }
    }

    fn caps(&self) -> Caps {
        let object = self.object_size();
        Caps {
            read_only: !self.writable,
            // Every write is stored before it is acknowledged.
            can_flush: true,
            can_fua: true,
            can_trim: self.writable,
            can_zero: self.writable,
            // Zeroing part of an object reads and rewrites it.
            can_fast_zero: false,
            can_extents: matches!(self.layout, Layout::Blocks { map_current: true, .. }),
            sequential: false,
            // An upload of a size not known in advance takes what comes.
            growable: matches!(&self.layout, Layout::Upload(up) if up.size().is_none()),
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
        if buf.is_empty() {
            return Ok(0);
        }
        let end = offset.checked_add(buf.len() as u64).filter(|&e| e <= self.size);
        if end.is_none() {
            return Err(Error::new(ErrorKind::InvalidInput, Op::Read)
                .path(&self.name)
                .at(offset, buf.len() as u64)
                .detail(format!("past the end of the image ({} bytes)", self.size)));
        }
        match &self.layout {
            Layout::Object { etag } => self.read_object(buf, offset, etag.as_deref())?,
            Layout::Blocks { object_size, present, .. } => {
                self.read_blocks(buf, offset, *object_size, present)?
            }
            Layout::Upload(_) => {
                return Err(Error::new(ErrorKind::NotSupported, Op::Read)
                    .path(&self.name)
                    .detail("an object being uploaded cannot be read"))
            }
        }
        Ok(buf.len())
    }

    /// Every read is a round trip.
    fn read_at_hand(&self, _buf: &mut [u8], _offset: u64) -> Option<Result<usize>> {
        None
    }

    fn write(&self, buf: &[u8], offset: u64, _fua: bool) -> Result<()> {
        if !self.writable {
            return Err(self.read_only_error(Op::Write));
        }
        self.change(offset, buf.len() as u64, Some(buf), true)
    }

    // A round trip to the store, which keeps no pages of ours.
    super::writes_leave_at_once!();

    fn zero(&self, offset: u64, len: u64, _flags: ZeroFlags) -> Result<()> {
        if !self.writable {
            return Err(self.read_only_error(Op::Zero));
        }
        // Whole objects are deleted whether or not the range may be deallocated: a missing
        // object reads as zeroes, and that is what NO_HOLE's "reads as zero" asks.
        self.change(offset, len, None, true)
    }

    fn trim(&self, offset: u64, len: u64, _fua: bool) -> Result<()> {
        if !self.writable {
            return Err(self.read_only_error(Op::Trim));
        }
        self.change(offset, len, None, false)
    }

    /// Block objects: nothing is held, every acknowledged write was stored before its
    /// reply. One object: the upload completes (every byte must have been written).
    fn flush(&self) -> Result<()> {
        match &self.layout {
            Layout::Upload(up) => up.complete(&self.store, &self.key),
            _ => Ok(()),
        }
    }

    fn cache(&self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }

    /// From the map of existing objects: a missing object is a hole. The map is the LIST
    /// made at open, kept current by this process's writes and deletes; it can be wrong only
    /// if another program writes the image meanwhile (one writer per image).
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let Layout::Blocks { object_size, present, map_current: true, .. } = &self.layout else {
            return Ok(vec![Extent::data(len)]);
        };
        let p = present.lock().unwrap();
        let mut out: Vec<Extent> = Vec::new();
        for (b, r) in split(offset, len.min(self.size.saturating_sub(offset)), *object_size) {
            let e = if p.contains_key(&b) {
                Extent::data(r.end - r.start)
            } else {
                Extent::hole(r.end - r.start)
            };
            match out.last_mut() {
                Some(last) if last.hole == e.hole => last.len += e.len,
                _ => out.push(e),
            }
        }
        if out.is_empty() {
            out.push(Extent::data(len));
        }
        Ok(out)
    }

    fn cache_info(&self) -> Option<CacheInfo> {
        None
    }

    /// The requests made so far.
    fn report(&self) -> Report {
        Report { requests: Some(self.store.counters.snapshot()), server_ended: None }
    }

    /// An upload completes if every byte was written (a copy with `--no-flush`), and is
    /// abandoned otherwise (a failed or interrupted copy): no half object appears. Not the
    /// lease: `finish` ends one open (a server's connection) and all opens share this
    /// backend; [`S3Backend::release`] and drop release it.
    fn finish(&self) -> Result<()> {
        match &self.layout {
            Layout::Upload(up) => up.complete(&self.store, &self.key),
            _ => Ok(()),
        }
    }
}

impl Drop for S3Backend {
    fn drop(&mut self) {
        if let Layout::Upload(up) = &self.layout {
            up.abort(&self.store);
        }
    }
}

/// `(block, range within it)` of each object `[offset, offset+len)` touches.
fn split(offset: u64, len: u64, object_size: u64) -> Vec<(u64, Range<u64>)> {
    let mut v = Vec::new();
    let mut at = offset;
    while at < offset + len {
        let b = at / object_size;
        let start = at - b * object_size;
        let end = object_size.min(start + (offset + len - at));
        v.push((b, start..end));
        at += end - start;
    }
    v
}

/// The block number of `name` when it is `key/` + 16 hex digits.
fn block_number(key: &str, name: &str) -> Option<u64> {
    let hex = name.strip_prefix(key)?.strip_prefix('/')?;
    if hex.len() != 16 || !hex.bytes().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()) {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// The configuration `opts` gives, or the environment's.
fn config_of(opts: &S3Options, name: &str) -> Result<S3Config> {
    match &opts.config {
        Some(c) => Ok(c.clone()),
        None => S3Config::from_env().map_err(|e| Error::after(Op::Open, &e).path(name)),
    }
}

/// `e`, a failed request for block `b`, with the part of the image the caller asked for in it
/// (`range` within that block): the store's error names the object, and a user (or `copy`'s
/// message) wants the offset in the image too, as every other backend gives it.
fn in_image(e: Error, b: u64, range: &Range<u64>, object_size: u64) -> Error {
    e.at(b * object_size + range.start, range.end - range.start)
}

fn bad(name: &str, detail: String) -> Error {
    Error::new(ErrorKind::InvalidInput, Op::Open).path(name).detail(detail)
}

fn wrong_size(uri: &str, got: u64, want: u64) -> Error {
    Error::new(ErrorKind::Io, Op::Read)
        .path(uri)
        .detail(format!("the object is {got} bytes, not the image's object size {want}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_and_names() {
        assert_eq!(split(100, 200, 128), vec![(0, 100..128), (1, 0..128), (2, 0..44)]);
        assert_eq!(split(256, 128, 128), vec![(2, 0..128)]);
        assert_eq!(block_number("d/img", "d/img/000000000000001f"), Some(31));
        for other in ["d/img/lightfoot.json", "d/img/000000000000001F", "d/img/1f", "d/imgx/000000000000001f"]
        {
            assert_eq!(block_number("d/img", other), None, "{other}");
        }
        assert!(MANIFEST > "ffffffffffffffff" && MANIFEST > "0");
    }
}
