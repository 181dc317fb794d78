//! An image in one object (`KEY` is the image): [`ObjectImage`], read-only, read with range
//! GETs of up to [`PIECE`] bytes, concurrently. Each GET is pinned to the ETag seen at open
//! (`If-Match`), so an image replaced underneath fails loudly instead of serving a mix of two.
//! A copy writes such an object with an upload instead ([`super::upload`]).

use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};

use super::blocks::BlockImage;
use super::store::Store;
use super::{read_only, Image, IN_FLIGHT};
use crate::backend::carve;
use crate::error::{Error, ErrorKind, Op, Result};

/// Largest piece of the object fetched by one range GET.
const PIECE: u64 = 8 << 20;

pub struct ObjectImage {
    name: String,
    key: String,
    store: Arc<Store>,
    size: u64,
    /// The version seen at open; `None`: the store gave none.
    etag: Option<String>,
}

impl ObjectImage {
    /// The object `key`, which must exist. It is served read-only: `writable` fails.
    pub fn open(store: Arc<Store>, key: &str, name: &str, writable: bool) -> Result<ObjectImage> {
        let meta = store.run(store.head(key))?.ok_or_else(|| {
            Error::new(ErrorKind::NotFound, Op::Open).path(name).detail(format!(
                "no such object, and no block image under {name}/ (a new block image needs --size and --object-size)"
            ))
        })?;
        if writable {
            return Err(Error::new(ErrorKind::Permission, Op::Open).path(name).detail(
                "an image in one object is served read-only (give --object-size and --size to write a block image)",
            ));
        }
        Ok(ObjectImage { name: name.into(), key: key.into(), store, size: meta.size, etag: meta.etag })
    }
}

impl Image for ObjectImage {
    fn size(&self) -> Option<u64> {
        Some(self.size)
    }

    fn writable(&self) -> bool {
        false
    }

    fn read(&self, bufs: Vec<&mut [u8]>, offset: u64) -> Result<()> {
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        let starts = (0..total).step_by(PIECE as usize);
        let pieces = carve(bufs, starts.clone().map(|p| PIECE.min(total - p) as usize));
        let etag = self.etag.as_deref();
        self.store.run(
            futures::stream::iter(starts.zip(pieces).map(|(p, piece)| async move {
                let (at, n) = (offset + p, PIECE.min(total - p));
                match self
                    .store
                    .get_into(&self.key, Some(at..at + n), etag, piece, |_| Ok(()))
                    .await
                    .map_err(|e| e.at(at, n))?
                {
                    Some((got, _)) if got == n => Ok(()),
                    Some((got, meta)) => Err(Error::new(ErrorKind::Io, Op::Read)
                        .path(&self.name)
                        .at(at, n)
                        .detail(format!("got {got} bytes of {n} (the object is now {} bytes)", meta.size))),
                    None => Err(Error::new(ErrorKind::NotFound, Op::Read)
                        .path(&self.name)
                        .at(at, n)
                        .detail("the object was deleted while being served")),
                }
            }))
            .buffer_unordered(IN_FLIGHT)
            .try_collect::<()>(),
        )
    }

    /// Never called: [`super::S3Backend`] refuses writes to a read-only image.
    fn change(&self, _offset: u64, _len: u64, _data: Option<&[u8]>, _partial: bool) -> Result<()> {
        Err(read_only(&self.name, Op::Write))
    }

    /// Nothing is held.
    fn complete(&self) -> Result<()> {
        Ok(())
    }

    fn blocks(&self) -> Option<&BlockImage> {
        None
    }
}
