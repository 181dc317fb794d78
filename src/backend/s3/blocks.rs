//! A block image, as nbdkit's S3 plugin lays one out: [`BlockImage`], objects `KEY/%016x`
//! (the block number in 16 hex digits) of exactly `object_size` bytes each, its
//! [`Geometry`] in a manifest. A missing object reads as zeroes. Readable, and writable by
//! one writer at a time (its [`Lease`]).
//!
//! At open, a LIST makes the map of the objects that exist, with their ETags; reads GET only
//! objects on the map, and `extents` reports the others as holes. This process's own writes
//! and deletes keep the map current ([`write`]); another writer would make it wrong, which is
//! what the lease prevents.

mod write;

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use futures::{StreamExt, TryStreamExt};

use super::lease::{self, Lease};
use super::manifest::Geometry;
use super::store::Store;
use super::{Image, S3Options, IN_FLIGHT};
use crate::backend::{carve, Extent};
use crate::error::{Error, ErrorKind, Op, Result};

/// Stripes of the per-object write locks: 2^10.
const LOCK_BITS: u32 = 10;

/// The stripe of the write lock of block `b`.
fn lock_stripe(b: u64) -> usize {
    crate::io::spread(b, LOCK_BITS)
}

/// Block number → ETag of the existing objects of a block image.
type Present = BTreeMap<u64, Option<String>>;

pub struct BlockImage {
    name: String,
    key: String,
    store: Arc<Store>,
    size: u64,
    object_size: u64,
    writable: bool,
    /// The blocks that exist, with the ETag of the version this process last saw (`None`: the
    /// store gave none), from a LIST at open kept current by this process's own writes and
    /// deletes.
    present: Mutex<Present>,
    /// No other writer can change the image behind the map: this process holds the lease, or
    /// nobody did when it was opened read-only.
    map_current: bool,
    /// The writer's lease (`None` read-only, or with `--without-lease`).
    lease: Option<Lease>,
    /// Writes into an object hold its lock for the whole read-modify-write, in every
    /// connection (they share this image), so two connections writing different bytes of one
    /// object never lose each other's.
    locks: Vec<tokio::sync::Mutex<()>>,
}

impl BlockImage {
    /// The block image of geometry `g` under `key`: the lease first when writable (the map
    /// must not change behind this writer's back), then the map, and a new image's manifest.
    pub fn open(
        store: Arc<Store>,
        key: &str,
        name: &str,
        g: Geometry,
        opts: &S3Options,
    ) -> Result<BlockImage> {
        let (lease, map_current) = lease::at_open(&store, key, name, opts)?;
        let present = list(&store, key, &g)?;
        if opts.writable && !g.stored {
            g.save(&store, key)?;
        }
        Ok(BlockImage {
            name: name.into(),
            key: key.into(),
            store,
            size: g.size,
            object_size: g.object_size,
            writable: opts.writable,
            present: Mutex::new(present),
            map_current,
            lease,
            locks: (0..1 << LOCK_BITS).map(|_| tokio::sync::Mutex::new(())).collect(),
        })
    }

    pub fn object_size(&self) -> u64 {
        self.object_size
    }

    /// Whether [`Self::extents`] tells holes from data: nobody else writes the image.
    pub fn map_current(&self) -> bool {
        self.map_current
    }

    /// No objects (new, or wholly trimmed): the image reads as zeroes.
    pub fn is_empty(&self) -> bool {
        self.present.lock().unwrap().is_empty()
    }

    /// This open holds the image's lease: no other lightfoot writes it.
    pub fn leased(&self) -> bool {
        self.lease.is_some()
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// What the image is now, for a dirty bitmap's check at its next open: the objects that
    /// exist and their ETags, hashed. Any other writer's PUT or DELETE changes it. With no
    /// ETags from the store it names nothing and is never equal to another.
    pub fn identity(&self) -> String {
        let p = self.present.lock().unwrap();
        if p.values().any(Option::is_none) {
            return format!("s3:no-etags:{:016x}", crate::bitmap::file::new_epoch());
        }
        let mut d = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc64Nvme);
        for (b, etag) in p.iter() {
            d.update(&b.to_le_bytes());
            d.update(etag.as_deref().unwrap_or_default().as_bytes());
            d.update(&[0]);
        }
        format!("s3:{}:{:016x}", p.len(), d.finalize())
    }

    /// Releases the lease, if this open holds it: writes fail from then on.
    pub fn release(&self) {
        if let Some(l) = &self.lease {
            l.release();
        }
    }

    /// From the map of existing objects: a missing object is a hole. All data when the map
    /// may be wrong (another writer holds the lease).
    pub fn extents(&self, offset: u64, len: u64) -> Vec<Extent> {
        let mut out: Vec<Extent> = Vec::new();
        if self.map_current {
            let p = self.present.lock().unwrap();
            for (b, r) in split(offset, len.min(self.size.saturating_sub(offset)), self.object_size) {
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
        }
        if out.is_empty() {
            out.push(Extent::data(len));
        }
        out
    }

    fn block_key(&self, b: u64) -> String {
        format!("{}/{b:016x}", self.key)
    }
}

impl Image for BlockImage {
    fn size(&self) -> Option<u64> {
        Some(self.size)
    }

    fn writable(&self) -> bool {
        self.writable
    }

    /// One GET for each touched object that may exist, concurrently.
    fn read(&self, bufs: Vec<&mut [u8]>, offset: u64) -> Result<()> {
        let object_size = self.object_size;
        let len = bufs.iter().map(|b| b.len() as u64).sum();
        let pieces = split(offset, len, object_size);
        let parts = carve(bufs, pieces.iter().map(|(_, r)| (r.end - r.start) as usize));
        let mut want = Vec::new();
        {
            let p = self.present.lock().unwrap();
            for ((b, r), mut part) in pieces.into_iter().zip(parts) {
                if p.contains_key(&b) {
                    want.push((b, r, part));
                } else {
                    part.iter_mut().for_each(|s| s.fill(0));
                }
            }
        }
        self.store.run(
            futures::stream::iter(want.into_iter().map(|(b, r, mut part)| async move {
                let key = self.block_key(b);
                let whole = r.start == 0 && r.end == object_size;
                let n = r.end - r.start;
                let at = b * object_size + r.start;
                // The body goes into `part`, and its slices are wanted again for zeroes:
                // hand the GET reborrows.
                let got = self
                    .store
                    .get_into(
                        &key,
                        (!whole).then(|| r.clone()),
                        None,
                        part.iter_mut().map(|s| &mut **s).collect(),
                        |meta| match meta.size {
                            size if size != object_size => {
                                Err(wrong_size(&self.store.uri(&key), size, object_size))
                            }
                            _ => Ok(()),
                        },
                    )
                    .await
                    .map_err(|e| in_image(e, b, &r, object_size))?;
                match got {
                    Some((got, _)) if got == n => Ok(()),
                    Some((got, _)) => Err(Error::new(ErrorKind::Io, Op::Read)
                        .path(&self.name)
                        .at(at, n)
                        .detail(format!("the store answered {got} bytes for {n}"))),
                    // Deleted since the LIST (by another writer): zeroes, as nbdkit reads it.
                    None => {
                        part.iter_mut().for_each(|s| s.fill(0));
                        Ok(())
                    }
                }
            }))
            .buffer_unordered(IN_FLIGHT)
            .try_collect::<()>(),
        )
    }

    fn change(&self, offset: u64, len: u64, data: Option<&[u8]>, partial: bool) -> Result<()> {
        self.write(offset, len, data, partial)
    }

    /// Nothing is held: every acknowledged write was stored before its reply.
    fn complete(&self) -> Result<()> {
        Ok(())
    }

    fn blocks(&self) -> Option<&BlockImage> {
        Some(self)
    }
}

/// The map of the blocks under `key` that exist, checking that each is whole.
fn list(store: &Store, key: &str, g: &Geometry) -> Result<Present> {
    let blocks = g.blocks();
    let mut present = Present::new();
    for (k, meta) in store.run(store.list(key))? {
        let len = meta.size;
        let Some(b) = block_number(key, &k) else { continue };
        if b >= blocks {
            tracing::warn!("{}: beyond the image's {blocks} objects: ignored", store.uri(&k));
            continue;
        }
        if len != g.object_size {
            return Err(Error::new(ErrorKind::InvalidInput, Op::Open).path(store.uri(&k)).detail(format!(
                "the object is {len} bytes, not the image's object size {}",
                g.object_size
            )));
        }
        present.insert(b, meta.etag);
    }
    Ok(present)
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

/// `e`, a failed request for block `b`, with the part of the image the caller asked for in it
/// (`range` within that block): the store's error names the object, and a user (or `copy`'s
/// message) wants the offset in the image too, as every other backend gives it.
fn in_image(e: Error, b: u64, range: &Range<u64>, object_size: u64) -> Error {
    e.at(b * object_size + range.start, range.end - range.start)
}

fn wrong_size(uri: &str, got: u64, want: u64) -> Error {
    Error::new(ErrorKind::Io, Op::Read)
        .path(uri)
        .detail(format!("the object is {got} bytes, not the image's object size {want}"))
}

#[cfg(test)]
mod tests {
    use super::super::MANIFEST;
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
