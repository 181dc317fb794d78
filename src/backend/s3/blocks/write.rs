//! Writing a block image: objects wholly covered by a write are PUT, wholly zeroed ones
//! deleted (a missing object reads as zeroes), partly covered ones read, patched and PUT under
//! their lock. Every PUT is conditional on the version it builds on, and each answer updates
//! the map of existing objects.

use std::ops::Range;

use crate::backend::s3::store::replacing;
use bytes::{Bytes, BytesMut};
use futures::{StreamExt, TryStreamExt};

use super::{in_image, lock_stripe, split, wrong_size, BlockImage};
use crate::backend::s3::IN_FLIGHT;
use crate::error::{Error, ErrorKind, Op, Result};

/// The version a write into one object builds on: `None`, no object; `Some(etag)`, the one
/// with that ETag (`Some(None)`: the store gives no ETags).
type Known = Option<Option<String>>;

impl BlockImage {
    /// Changes the objects `[offset, offset+len)` covers: `data` gives the new bytes (`None`:
    /// zeroes). With `partial == false`, partly covered objects are left alone (TRIM).
    pub(super) fn write(&self, offset: u64, len: u64, data: Option<&[u8]>, partial: bool) -> Result<()> {
        if let Some(l) = &self.lease {
            l.check()?;
        }
        if offset.checked_add(len).is_none_or(|e| e > self.size) {
            return Err(Error::new(ErrorKind::NoSpace, Op::Write)
                .path(&self.name)
                .at(offset, len)
                .detail(format!("past the end of the image ({} bytes)", self.size)));
        }
        let mut deletes = Vec::new();
        let mut updates = Vec::new();
        let mut at = 0usize;
        for (b, r) in split(offset, len, self.object_size) {
            let n = (r.end - r.start) as usize;
            let piece = data.map(|d| &d[at..at + n]);
            at += n;
            let whole = n as u64 == self.object_size;
            let zero = piece.is_none_or(crate::backend::is_zero);
            if whole && zero {
                deletes.push(b);
            } else if whole || partial {
                updates.push((b, r, piece));
            }
        }
        self.delete(&deletes)?;
        self.store.run(
            futures::stream::iter(updates.into_iter().map(|(b, r, piece)| self.put(b, r, piece)))
                .buffer_unordered(IN_FLIGHT)
                .try_collect::<Vec<()>>(),
        )?;
        Ok(())
    }

    /// Deletes the objects of `blocks` that exist, batched, under their locks (taken in
    /// stripe order: no two callers wait on each other).
    fn delete(&self, blocks: &[u64]) -> Result<()> {
        let known: Vec<u64> = {
            let p = self.present.lock().unwrap();
            blocks.iter().copied().filter(|b| p.contains_key(b)).collect()
        };
        if known.is_empty() {
            return Ok(());
        }
        let mut stripes: Vec<usize> = known.iter().map(|&b| lock_stripe(b)).collect();
        stripes.sort_unstable();
        stripes.dedup();
        self.store.run(async {
            let mut guards = Vec::with_capacity(stripes.len());
            for s in stripes {
                guards.push(self.locks[s].lock().await);
            }
            let res = self.store.delete(known.iter().map(|&b| self.block_key(b)).collect()).await;
            // Gone or not after a failure: keep them "present" (reads then GET them, and a
            // 404 reads as zeroes), never the other way round.
            if res.is_ok() {
                let mut p = self.present.lock().unwrap();
                for b in &known {
                    p.remove(b);
                }
            }
            res
        })
    }

    /// Writes `piece` (`None`: zeroes) at `r` within block `b`, under the object's lock.
    ///
    /// Every PUT is conditional on the version it was based on (If-Match, or If-None-Match: *
    /// for an object we know not to exist). A write of ours that the store still carries out
    /// after we gave up on it (a timed-out request can land later) then cannot replace a later
    /// one, and an object someone else changed is read again rather than overwritten unseen.
    async fn put(&self, b: u64, r: Range<u64>, piece: Option<&[u8]>) -> Result<()> {
        let store = &self.store;
        let key = self.block_key(b);
        let here = |e: Error| in_image(e, b, &r, self.object_size);
        let _g = self.locks[lock_stripe(b)].lock().await;
        let mut known: Known = self.present.lock().unwrap().get(&b).cloned();
        for _ in 0..3 {
            let Some(body) = self.body(b, &r, piece, &mut known).await? else {
                // Zeroing part of a missing object: it reads as zeroes already.
                return Ok(());
            };
            if let Some((etag, _)) = store.put(&key, body, replacing(known.as_ref())).await.map_err(here)? {
                self.present.lock().unwrap().insert(b, etag);
                return Ok(());
            }
            // Changed behind this write: learn what is there now, and go again.
            tracing::debug!("{}: changed by another request: written again", store.uri(&key));
            known = store.head(&key).await.map_err(here)?.map(|m| m.etag);
            let mut p = self.present.lock().unwrap();
            match &known {
                Some(e) => p.insert(b, e.clone()),
                None => p.remove(&b),
            };
        }
        Err(here(Error::new(ErrorKind::Io, Op::Write).path(store.uri(&key)).detail(
            "the object kept changing while it was being written (another writer without the lease?)",
        )))
    }

    /// The new bytes of block `b`: `piece` itself when it covers the object, else the object
    /// as it is (read again, and `known` set to the version read) with `piece` at `r`.
    /// `None`: nothing to write (zeroes into an object that does not exist).
    async fn body(
        &self,
        b: u64,
        r: &Range<u64>,
        piece: Option<&[u8]>,
        known: &mut Known,
    ) -> Result<Option<Bytes>> {
        let os = self.object_size;
        if r.start == 0 && r.end == os {
            return Ok(Some(Bytes::copy_from_slice(piece.expect("a whole object of zeroes is deleted"))));
        }
        if known.is_none() && piece.is_none() {
            return Ok(None);
        }
        let mut obj = BytesMut::zeroed(os as usize);
        if known.is_some() {
            let key = self.block_key(b);
            *known = match self.store.get(&key, None, None).await.map_err(|e| in_image(e, b, r, os))? {
                Some((old, meta)) if meta.size == os && old.len() as u64 == os => {
                    obj.copy_from_slice(&old);
                    Some(meta.etag)
                }
                Some((_, meta)) => return Err(wrong_size(&self.store.uri(&key), meta.size, os)),
                None => None,
            };
        }
        let dst = &mut obj[r.start as usize..r.end as usize];
        match piece {
            Some(p) => dst.copy_from_slice(p),
            None => dst.fill(0),
        }
        Ok(Some(obj.freeze()))
    }
}
