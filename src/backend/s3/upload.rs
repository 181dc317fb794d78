//! Writing an image into one object: [`Upload`], a multipart upload, for
//! `copy … s3://BUCKET/KEY`. It is written only: it cannot be read back.
//!
//! The object appears only when the upload completes, at FLUSH (or the end of the job) with
//! every byte of it written; until then readers see the old object or none. A copy that fails
//! or is interrupted aborts the upload, so no half object appears and no parts are left to pay
//! for. A process killed outright cannot abort: a bucket lifecycle rule
//! (`AbortIncompleteMultipartUpload`, docs/object-storage.md) cleans up after it.
//!
//! Parts are numbered by offset, so writes may come in any order: a part is sent once all of
//! its bytes are written (zeroes included: the copy zeroes holes here, as on any destination
//! that does not read as zeroes) and every part before it was sent, since parts are numbered
//! in the order they are sent. Part size: at least 8 MiB, and large enough that the image fits
//! in S3's 10,000 parts (for a 1 TiB image, 105 MiB); 64 MiB when the size is not known in
//! advance (a pipe), so streams up to 625 GiB fit. Every part is the same size but the last, as
//! some stores (R2) require.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use object_store::path::Path;
use object_store::{MultipartUpload, ObjectStoreExt, PutPayload};
use tokio::task::JoinHandle;

use super::blocks::BlockImage;
use super::store::Store;
use super::Image;
use crate::error::{Error, ErrorKind, Op, Result};

/// S3's limit on the parts of one upload.
const MAX_PARTS: u64 = 10_000;
const MIN_PART: u64 = 8 << 20;
const STREAM_PART: u64 = 64 << 20;
/// Parts held beyond this many bytes, on their way or full and waiting for one before them,
/// make writers wait for the oldest on its way. Counting only those on their way (128 MiB,
/// then 64) left the ones waiting unbounded: when one of the copy's 8 workers fell behind,
/// the others filled up to 8 parts after its own, and a 1 GiB upload peaked at 211-267 MiB
/// RSS (bench/s3.sh, 5 rounds). Uploads to the store here are bound by the store, not by
/// what is in flight (the same rate at 0 and 10 ms of latency).
const HELD_BYTES: u64 = 64 << 20;

pub struct Upload {
    store: Arc<Store>,
    key: String,
    part_size: u64,
    /// Known in advance (a file or device source), else learnt from the writes.
    size: Option<u64>,
    buffers: Buffers,
    state: Mutex<State>,
}

/// Part buffers come back here once their part is sent, for the parts after it: no more are
/// ever allocated than were live at once, whatever the allocator.
///
/// Allocated for each part and freed once it was sent, they stayed with glibc's malloc: each
/// of the copy's workers allocates from an arena of its own, and a part freed back to one
/// worker's arena is not reused by the others, so each arena kept a part or more. With at
/// most 4 kept here and the rest freed, 1 GiB uploads peaked at 211-235 MiB RSS; with all
/// kept, at 156-179 (8 workers' 8 MiB buffers, 9 parts on their way, those waiting).
#[derive(Clone, Default)]
struct Buffers(Arc<Mutex<Vec<Vec<u8>>>>);

impl Buffers {
    /// A part of `len` bytes of zeroes.
    fn take(&self, len: usize) -> Vec<u8> {
        let kept = self.0.lock().unwrap().pop();
        match kept {
            Some(mut buf) => {
                buf.clear();
                buf.resize(len, 0);
                buf
            }
            None => vec![0u8; len],
        }
    }

    /// `buf` as a part's payload, whose buffer comes back here once the part is sent (when
    /// the store's client drops the last copy of the payload).
    fn payload(&self, buf: Vec<u8>) -> PutPayload {
        PutPayload::from(Bytes::from_owner(Sent { buf, home: self.clone() }))
    }

    fn give_back(&self, buf: Vec<u8>) {
        self.0.lock().unwrap().push(buf);
    }
}

/// A part's bytes on their way; see [`Buffers`].
struct Sent {
    buf: Vec<u8>,
    home: Buffers,
}

impl AsRef<[u8]> for Sent {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Sent {
    fn drop(&mut self) {
        self.home.give_back(std::mem::take(&mut self.buf));
    }
}

#[derive(Default)]
struct State {
    upload: Option<Box<dyn MultipartUpload>>,
    /// Parts being filled: their bytes, and how many of them were written.
    filling: BTreeMap<u64, (Vec<u8>, u64)>,
    /// Full parts waiting for the ones before them.
    full: BTreeMap<u64, Vec<u8>>,
    next: u64,
    /// Parts on their way: number, length, and the task sending it.
    sending: Vec<(u64, u64, JoinHandle<object_store::Result<()>>)>,
    /// The end of the highest write (for a size not known in advance).
    end: u64,
    done: bool,
}

impl Upload {
    /// Starts the upload of `key`, of `size` bytes (`None`: as many as are written).
    pub fn start(store: Arc<Store>, key: &str, size: Option<u64>) -> Result<Upload> {
        let part_size = match size {
            Some(s) => MIN_PART.max(s.div_ceil(MAX_PARTS).div_ceil(1 << 20) << 20),
            None => STREAM_PART,
        };
        let upload = store
            .run(store.s3().put_multipart(&Path::from(key)))
            .map_err(|e| store.error(Op::Write, key, &e))?;
        Ok(Upload {
            store,
            key: key.into(),
            part_size,
            size,
            buffers: Buffers::default(),
            state: Mutex::new(State { upload: Some(upload), ..State::default() }),
        })
    }

    fn part_len(&self, p: u64, end: u64) -> u64 {
        self.part_size.min(end - p * self.part_size)
    }

    /// Writes `data` (`None`: zeroes) at `offset`, sending the parts it completes.
    fn write(&self, data: Option<&[u8]>, offset: u64, len: u64) -> Result<()> {
        let (store, key) = (&self.store, &self.key);
        let end = offset + len;
        if let Some(size) = self.size {
            if end > size {
                return Err(Error::new(ErrorKind::NoSpace, Op::Write)
                    .path(store.uri(key))
                    .at(offset, len)
                    .detail(format!("past the end of the image ({size} bytes)")));
            }
        }
        if end.div_ceil(self.part_size) > MAX_PARTS {
            return Err(Error::new(ErrorKind::NoSpace, Op::Write)
                .path(store.uri(key))
                .at(offset, len)
                .detail(format!(
                    "one object takes at most {MAX_PARTS} parts of {} bytes here",
                    self.part_size
                )));
        }
        let mut st = self.state.lock().unwrap();
        if st.done {
            return Err(Error::new(ErrorKind::InvalidInput, Op::Write)
                .path(store.uri(key))
                .detail("the upload has ended"));
        }
        st.end = st.end.max(end);
        let limit = self.size.unwrap_or(u64::MAX);
        let mut at = offset;
        while at < end {
            let p = at / self.part_size;
            let start = p * self.part_size;
            let plen = self.part_size.min(limit - start) as usize;
            let n = (end - at).min(start + plen as u64 - at);
            let entry = st.filling.entry(p).or_insert_with(|| (self.buffers.take(plen), 0));
            let dst = &mut entry.0[(at - start) as usize..(at - start + n) as usize];
            match data {
                Some(d) => dst.copy_from_slice(&d[(at - offset) as usize..(at - offset + n) as usize]),
                None => dst.fill(0),
            }
            entry.1 += n;
            // A part of unknown size is full at the part size; the last one, shorter, is
            // known to be full only at the end.
            if entry.1 >= plen as u64 {
                let (buf, _) = st.filling.remove(&p).expect("just filled");
                st.full.insert(p, buf);
            }
            at += n;
        }
        self.send_ready(&mut st)
    }

    /// Sends the full parts that are next in line, then waits for the oldest sends while
    /// the parts held (on their way, or full and waiting) take more than [`HELD_BYTES`].
    /// Only a send is waited for, never a write: the writer of the part next in line may be
    /// the very one waiting for the lock here, and a writer that fails never comes. The
    /// last send on its way is waited for only while full parts wait too: a part alone over
    /// the budget (images over 625 GiB) stays on its way while the next one fills.
    fn send_ready(&self, st: &mut State) -> Result<()> {
        while let Some(buf) = st.full.remove(&st.next) {
            let len = buf.len() as u64;
            let upload = st.upload.as_mut().expect("an upload in progress");
            let handle = self.store.spawn(upload.put_part(self.buffers.payload(buf)));
            self.store.counters.put.fetch_add(1, Relaxed);
            let p = st.next;
            st.sending.push((p, len, handle));
            st.next += 1;
        }
        // Sends left on their way however much is held: one, unless full parts wait too.
        let left = usize::from(st.full.is_empty());
        while (st.sending.len() + st.full.len()) as u64 * self.part_size > HELD_BYTES
            && st.sending.len() > left
        {
            let (p, len, h) = st.sending.remove(0);
            self.wait_part(p, len, h)?;
        }
        Ok(())
    }

    fn wait_part(&self, p: u64, len: u64, h: JoinHandle<object_store::Result<()>>) -> Result<()> {
        let (store, key) = (&self.store, &self.key);
        let at = p * self.part_size;
        match store.run(h) {
            Ok(Ok(())) => {
                store.counters.bytes_put.fetch_add(len, Relaxed);
                Ok(())
            }
            Ok(Err(e)) => Err(store.error(Op::Write, key, &e).at(at, len)),
            Err(e) => Err(Error::new(ErrorKind::Io, Op::Write)
                .path(store.uri(key))
                .at(at, len)
                .detail(e.to_string())),
        }
    }

    fn abort_locked(&self, st: &mut State) {
        let store = &self.store;
        for (_, _, h) in std::mem::take(&mut st.sending) {
            h.abort();
        }
        st.filling.clear();
        st.full.clear();
        if let Some(mut u) = st.upload.take() {
            if let Err(e) = store.run(u.abort()) {
                tracing::warn!("abandoning the upload: {}", store.scrub(&e.to_string()));
            }
        }
    }
}

impl Image for Upload {
    fn size(&self) -> Option<u64> {
        self.size
    }

    fn writable(&self) -> bool {
        true
    }

    fn read(&self, _bufs: Vec<&mut [u8]>, _offset: u64) -> Result<()> {
        Err(Error::new(ErrorKind::NotSupported, Op::Read)
            .path(self.store.uri(&self.key))
            .detail("an object being uploaded cannot be read"))
    }

    /// TRIM (`partial == false`) writes zeroes, as ZERO does: every byte must be written.
    fn change(&self, offset: u64, len: u64, data: Option<&[u8]>, _partial: bool) -> Result<()> {
        self.write(data, offset, len)
    }

    /// Completes the upload, at FLUSH or at the end of the job: every byte of the image must
    /// have been written. The object then appears, whole. Without every byte, the upload is
    /// aborted and this fails.
    fn complete(&self) -> Result<()> {
        let (store, key) = (&self.store, &self.key);
        let mut st = self.state.lock().unwrap();
        if st.done {
            return Ok(());
        }
        let end = self.size.unwrap_or(st.end);
        let parts = end.div_ceil(self.part_size);
        // With the size learnt from the writes, parts are full only now.
        let filling = std::mem::take(&mut st.filling);
        for (p, (mut buf, written)) in filling {
            if p < parts && written >= self.part_len(p, end) {
                buf.truncate(self.part_len(p, end) as usize);
                st.full.insert(p, buf);
            } else {
                st.filling.insert(p, (buf, written));
            }
        }
        let res = self.send_ready(&mut st).and_then(|()| {
            if st.next < parts || !st.filling.is_empty() {
                let missing = st.filling.keys().next().copied().unwrap_or(st.next);
                return Err(Error::new(ErrorKind::UnexpectedEof, Op::Write)
                    .path(store.uri(key))
                    .at(missing * self.part_size, self.part_size)
                    .detail("not every byte of the object was written: the upload is abandoned"));
            }
            for (p, len, h) in std::mem::take(&mut st.sending) {
                self.wait_part(p, len, h)?;
            }
            let upload = st.upload.as_mut().expect("an upload in progress");
            if parts == 0 {
                // An empty image: S3 wants at least one part.
                let h = store.spawn(upload.put_part(PutPayload::default()));
                self.wait_part(0, 0, h)?;
            }
            store.counters.put.fetch_add(1, Relaxed);
            store.run(upload.complete()).map_err(|e| store.error(Op::Write, key, &e))?;
            Ok(())
        });
        st.done = true;
        if res.is_err() {
            self.abort_locked(&mut st);
        } else {
            st.upload = None;
        }
        res
    }

    fn blocks(&self) -> Option<&BlockImage> {
        None
    }
}

/// Abandons an upload not completed (the job failed or was interrupted): the parts sent are
/// deleted and no object appears.
impl Drop for Upload {
    fn drop(&mut self) {
        let mut st = self.state.lock().unwrap();
        st.done = true;
        self.abort_locked(&mut st);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reused_part_buffer_holds_only_zeroes() {
        let buffers = Buffers::default();
        let payload = buffers.payload(vec![0xa5; 1000]);
        assert_eq!(buffers.0.lock().unwrap().len(), 0, "kept while the payload lives");
        let copy = payload.clone();
        drop(payload);
        assert_eq!(buffers.0.lock().unwrap().len(), 0, "kept while a copy lives");
        drop(copy);
        assert_eq!(buffers.0.lock().unwrap().len(), 1, "back once sent");
        let again = buffers.take(600);
        assert!(again.len() == 600 && again.iter().all(|&b| b == 0));
        assert!(again.capacity() >= 1000, "the same allocation");
        let longer = buffers.take(2000);
        assert!(longer.len() == 2000 && longer.iter().all(|&b| b == 0));
    }

    #[test]
    fn no_more_buffers_than_were_live_at_once() {
        let buffers = Buffers::default();
        let sent: Vec<_> = (0..3).map(|_| buffers.payload(buffers.take(10))).collect();
        drop(sent);
        assert_eq!(buffers.0.lock().unwrap().len(), 3);
        let live: Vec<_> = (0..3).map(|_| buffers.take(10)).collect();
        assert_eq!(buffers.0.lock().unwrap().len(), 0, "all three reused");
        drop(live);
    }
}
