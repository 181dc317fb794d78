//! One client connection in the transmission phase, shared by many threads, each with one
//! request in flight.
//!
//! Sending is a mutex around the writing half: a request header and its payload leave in one
//! `writev`. Receiving has no thread of its own. Whichever waiting thread holds the *read
//! turn* reads the next reply header; if the reply is its own it reads the payload straight
//! into its own buffer, and otherwise it hands the header, and the turn with it, to the
//! thread the reply belongs to and goes back to waiting. Every payload is thus read by the
//! thread that owns the destination buffer: no copy, no shared buffers, no `unsafe`. (A
//! dedicated reader thread would have to copy each payload, or write into buffers other
//! threads lent it.) Reading one reply, and the checks that refuse a hostile server's, are
//! `reply`'s job; this module decides who reads and when.
//!
//! Why this cannot deadlock: a reply only arrives after its whole request was sent, and a
//! thread starts waiting right after sending, so the thread a header is handed to is already
//! waiting or about to. While any thread waits, someone reads, so the server is never stuck
//! on a full socket. Each thread keeps at most one request in flight for this to hold: large
//! requests are split and sent one piece at a time.
//!
//! Wake-ups are targeted: a thread waits on the condition variable of its cookie's slot, a
//! hand-off wakes only the owner's slot, and a released turn wakes one waiting thread. (One
//! shared condition variable woke every waiter on every reply: with 32 workers that doubled
//! the client's system time.)
//!
//! Any protocol violation or I/O error kills the connection: every waiting request fails with
//! the reason, and later ones fail at once.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

use super::handshake::ExportInfo;
use super::interrupt::Registered;
use super::reply::{kind_of, protocol, read_header, Answer, Header, Status, Target};
use crate::backend::Extent;
use crate::error::{Error, ErrorKind, Op, Result, Sticky};
use crate::proto::*;
use crate::stream::{write_all_vectored, Stream};

#[derive(Default)]
struct State {
    /// Some thread has the read turn.
    reading: bool,
    /// A header read for another thread; the turn goes with it.
    handoff: Option<Header>,
    /// Cookies sent and not yet fully answered.
    outstanding: HashSet<u64>,
    /// Cookies whose threads are blocked waiting (candidates for a released turn).
    waiting: HashSet<u64>,
}

/// Condition variables per connection; threads whose cookies share a slot see each other's
/// wake-ups, which only costs a spurious check.
const SLOTS: u64 = 64;

pub struct Connection {
    who: String,
    pub info: ExportInfo,
    writer: Mutex<Box<dyn Write + Send>>,
    /// Locked only by the thread holding the read turn.
    reader: Mutex<Box<dyn Read + Send>>,
    state: Mutex<State>,
    /// Why the connection is unusable: set once, before waiters are woken.
    dead: Sticky,
    /// Waiting threads sleep on the slot of their cookie (`cookie % SLOTS`).
    slots: Vec<Condvar>,
    cookies: AtomicU64,
    /// Ends the connection: ours ([`Self::kill`]), or Ctrl-C's from outside
    /// ([`super::interrupt_all`]).
    registered: Registered,
}

impl Connection {
    /// Takes a negotiated stream into the transmission phase; `registered` is its socket's
    /// place among those Ctrl-C ends.
    pub(super) fn new(
        stream: Box<dyn Stream>,
        info: ExportInfo,
        who: &str,
        registered: Registered,
    ) -> Result<Connection> {
        let (r, w) = stream.split().map_err(|e| Error::io(Op::Connect, e).path(who))?;
        Ok(Connection {
            who: who.to_string(),
            info,
            writer: Mutex::new(w),
            reader: Mutex::new(r),
            state: Mutex::new(State::default()),
            dead: Sticky::default(),
            slots: (0..SLOTS).map(|_| Condvar::new()).collect(),
            cookies: AtomicU64::new(1),
            registered,
        })
    }

    pub fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        self.request(Op::Read, CMD_READ, 0, offset, len, &[], Target::Read(buf))
    }

    pub fn write(&self, buf: &[u8], offset: u64, flags: u16) -> Result<()> {
        self.request(Op::Write, CMD_WRITE, flags, offset, buf.len() as u64, buf, Target::None)
    }

    /// A command without payload either way: FLUSH, TRIM, WRITE_ZEROES, CACHE.
    pub fn command(&self, op: Op, cmd: u16, flags: u16, offset: u64, len: u64) -> Result<()> {
        self.request(op, cmd, flags, offset, len, &[], Target::None)
    }

    /// Extents from `offset`, as the server reports them (possibly fewer bytes than `len`, or
    /// more in the last extent): `base:allocation`'s, with the dirty bitmap's verdict where
    /// one was agreed (then as far as both contexts' answers reach; all data without an
    /// allocation map).
    pub fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let mut status = Status::default();
        self.request(Op::BlockStatus, CMD_BLOCK_STATUS, 0, offset, len, &[], Target::Status(&mut status))?;
        if self.info.bitmap.is_none() {
            return Ok(status.allocation);
        }
        if self.info.allocation.is_none() {
            status.allocation = vec![Extent::data(u64::MAX)];
        }
        Ok(with_dirty(&status.allocation, &status.dirty))
    }

    /// The connection broke (or was closed) and takes no more requests.
    pub fn is_dead(&self) -> bool {
        self.dead.is_set()
    }

    /// Sends `NBD_CMD_DISC` (no reply comes) and closes the connection.
    pub fn disconnect(&self) {
        if !self.dead.is_set() {
            let r = Request { flags: 0, cmd: CMD_DISC, cookie: 0, offset: 0, len: 0 };
            let _ = write_all_vectored(&mut **self.writer.lock().unwrap(), &[&encode_request(&r)]);
        }
        self.kill(Error::new(ErrorKind::Io, Op::Disconnect));
    }

    /// Marks the connection unusable and wakes everyone.
    fn kill(&self, why: Error) {
        self.dead.set(&why);
        let mut st = self.state.lock().unwrap();
        st.reading = false;
        st.handoff = None;
        drop(st);
        self.registered.close();
        self.slots.iter().for_each(Condvar::notify_all);
    }

    fn slot(&self, cookie: u64) -> &Condvar {
        &self.slots[(cookie % SLOTS) as usize]
    }

    #[allow(clippy::too_many_arguments)]
    fn request(
        &self,
        op: Op,
        cmd: u16,
        flags: u16,
        offset: u64,
        len: u64,
        payload: &[u8],
        mut target: Target,
    ) -> Result<()> {
        let lost = |why: &Error| {
            // Ctrl-C ended the connection ([`super::interrupt_all`]): the server had not answered.
            let e = if super::interrupted() {
                Error::new(ErrorKind::Interrupted, op).detail("interrupted while waiting for the server")
            } else {
                Error::after(op, why).kind_as(ErrorKind::Io).detail("connection lost")
            };
            e.path(&self.who).at(offset, len)
        };
        let cookie = self.cookies.fetch_add(1, Ordering::Relaxed);
        {
            let mut st = self.state.lock().unwrap();
            if let Some(why) = self.dead.get() {
                return Err(lost(why));
            }
            st.outstanding.insert(cookie);
        }
        let header = encode_request(&Request { flags, cmd, cookie, offset, len });
        let sent = write_all_vectored(&mut **self.writer.lock().unwrap(), &[&header, payload]);
        if let Err(e) = sent {
            let why = Error::io(Op::Send, e);
            self.kill(why.clone());
            self.state.lock().unwrap().outstanding.remove(&cookie);
            return Err(lost(&why));
        }

        let mut answer = Answer::default();
        let result = self.await_reply(cookie, offset, len, &mut target, &mut answer);
        self.state.lock().unwrap().outstanding.remove(&cookie);
        if let Err(why) = result {
            return Err(lost(&why));
        }
        if let Some((errno, msg)) = answer.error {
            let (kind, name) = kind_of(errno);
            let detail = if msg.is_empty() {
                format!("the server replied {name}")
            } else {
                format!("the server replied {name}: {msg}")
            };
            return Err(Error::new(kind, op).path(&self.who).at(offset, len).detail(detail));
        }
        if cmd == CMD_READ && self.info.structured && answer.covered() != len {
            let why = protocol("the server's read reply did not cover the request".into());
            self.kill(why.clone());
            return Err(lost(&why));
        }
        Ok(())
    }

    /// Waits for this request's reply, taking the read turn when it is free. `Err` means the
    /// connection died (the reason).
    fn await_reply(
        &self,
        cookie: u64,
        offset: u64,
        len: u64,
        target: &mut Target,
        answer: &mut Answer,
    ) -> Result<()> {
        let mut st = self.state.lock().unwrap();
        loop {
            if let Some(why) = self.dead.get() {
                return Err(why.clone());
            }
            let mine = st.handoff.is_some_and(|h| h.cookie() == cookie);
            if mine || !st.reading {
                let handed = if mine { st.handoff.take() } else { None };
                st.reading = true;
                drop(st);
                match self.take_turn(cookie, handed, offset, len, target, answer) {
                    Ok(true) => {
                        let mut st = self.state.lock().unwrap();
                        st.reading = false;
                        // With the turn: a duplicate reply read by the next holder must find
                        // this cookie gone (a protocol error), not be handed to nobody.
                        st.outstanding.remove(&cookie);
                        // Someone else must read the socket now.
                        let next = st.waiting.iter().next().copied();
                        drop(st);
                        if let Some(c) = next {
                            self.slot(c).notify_all();
                        }
                        return Ok(());
                    }
                    // Handed the turn on; wait for the next reply of ours.
                    Ok(false) => {}
                    Err(why) => {
                        self.kill(why.clone());
                        return Err(why);
                    }
                }
                st = self.state.lock().unwrap();
                continue;
            }
            st.waiting.insert(cookie);
            st = self.slot(cookie).wait(st).unwrap();
            st.waiting.remove(&cookie);
        }
    }

    /// Holding the read turn: processes `first` (a header handed to us) and then reads headers
    /// until this request's reply is complete (`Ok(true)`) or a header for another request
    /// came and the turn went with it (`Ok(false)`).
    fn take_turn(
        &self,
        cookie: u64,
        first: Option<Header>,
        offset: u64,
        len: u64,
        target: &mut Target,
        answer: &mut Answer,
    ) -> Result<bool> {
        let mut reader = self.reader.lock().unwrap();
        let mut next = first;
        loop {
            let h = match next.take() {
                Some(h) => h,
                None => read_header(&mut **reader)?,
            };
            if h.cookie() != cookie {
                let mut st = self.state.lock().unwrap();
                if !st.outstanding.contains(&h.cookie()) {
                    return Err(protocol(format!("reply for unknown cookie {}", h.cookie())));
                }
                st.handoff = Some(h);
                drop(st);
                self.slot(h.cookie()).notify_all();
                return Ok(false);
            }
            let contexts = [self.info.allocation, self.info.bitmap];
            if answer.consume(&mut **reader, h, offset, len, target, contexts)? {
                return Ok(true);
            }
        }
    }
}

/// `allocation`'s extents cut where `dirty`'s runs change, each marked clean where its run is
/// not dirty; as far as the shorter of the two reaches.
fn with_dirty(allocation: &[Extent], dirty: &[(u64, bool)]) -> Vec<Extent> {
    let mut out: Vec<Extent> = Vec::new();
    let (mut a, mut d) = (allocation.iter().copied(), dirty.iter().copied());
    let (mut ext, mut run) = (a.next(), d.next());
    while let (Some(mut e), Some((n, is_dirty))) = (ext, run) {
        let len = e.len.min(n);
        let piece = Extent { len, clean: !is_dirty, ..e };
        match out.last_mut() {
            Some(last) if Extent { len: last.len, ..piece } == *last => last.len += len,
            _ => out.push(piece),
        }
        e.len -= len;
        ext = if e.len == 0 { a.next() } else { Some(e) };
        run = if n == len { d.next() } else { Some((n - len, is_dirty)) };
    }
    out
}

#[cfg(test)]
mod tests {
    //! A scripted server on the other end of a socket pair: each test answers the client's
    //! requests with replies a broken or hostile server might send.
    use super::*;
    use crate::backend::nbd::handshake::DEFAULT_BLOCK;
    use std::os::unix::net::UnixStream;
    use std::sync::Arc;

    const SIZE: u64 = 1 << 20;
    const CONTEXT: u32 = 7;

    const BITMAP: u32 = 9;

    fn connection() -> (Arc<Connection>, UnixStream) {
        connection_with(Some(CONTEXT), None)
    }

    fn connection_with(allocation: Option<u32>, bitmap: Option<u32>) -> (Arc<Connection>, UnixStream) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        theirs.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
        let info = ExportInfo {
            size: SIZE,
            flags: TF_HAS_FLAGS,
            block: DEFAULT_BLOCK,
            structured: true,
            allocation,
            bitmap,
            epoch: None,
        };
        let registered = super::super::interrupt::register(ours.closer().unwrap());
        (Arc::new(Connection::new(Box::new(ours), info, "test", registered).unwrap()), theirs)
    }

    /// The next request the client sent (header only).
    fn request(s: &mut UnixStream) -> Request {
        let mut b = [0u8; REQUEST_LEN];
        s.read_exact(&mut b).unwrap();
        parse_request(&b).unwrap()
    }

    fn data_chunk(flags: u16, cookie: u64, at: u64, data: &[u8]) -> Vec<u8> {
        let mut v = data_chunk_header(flags, cookie, at, data.len() as u32).to_vec();
        v.extend_from_slice(data);
        v
    }

    fn status_chunk(flags: u16, cookie: u64, extents: &[(u32, u32)]) -> Vec<u8> {
        context_chunk(flags, cookie, CONTEXT, extents)
    }

    fn context_chunk(flags: u16, cookie: u64, context: u32, extents: &[(u32, u32)]) -> Vec<u8> {
        let descriptors: Vec<_> = extents.iter().map(|&(len, flags)| Descriptor { len, flags }).collect();
        block_status_chunk(flags, cookie, context, &descriptors)
    }

    /// A read of `len` at `offset` answered with `reply(cookie)`: the client's result and what
    /// it read.
    fn read_with(offset: u64, len: usize, reply: impl FnOnce(u64) -> Vec<u8>) -> (Result<()>, Vec<u8>) {
        let (c, mut srv) = connection();
        let t = std::thread::spawn(move || {
            let mut buf = vec![0xEEu8; len];
            (c.read(&mut buf, offset), buf)
        });
        let r = request(&mut srv);
        assert_eq!((r.cmd, r.offset, r.len), (CMD_READ, offset, len as u64));
        srv.write_all(&reply(r.cookie)).unwrap();
        t.join().unwrap()
    }

    fn protocol_error(r: &Result<()>, says: &str) {
        let e = r.as_ref().expect_err("accepted");
        let text = e.to_string();
        assert!(text.contains("protocol error") && text.contains(says), "{text}");
    }

    #[test]
    fn well_formed_chunks_in_any_order_fill_the_buffer() {
        let (r, buf) = read_with(4096, 12288, |c| {
            let mut v = data_chunk(0, c, 4096 + 8192, &[3u8; 4096]);
            v.extend(hole_chunk(0, c, 4096 + 4096, 4096));
            v.extend(data_chunk(REPLY_FLAG_DONE, c, 4096, &[1u8; 4096]));
            v
        });
        r.unwrap();
        assert!(buf[..4096].iter().all(|&b| b == 1));
        assert!(buf[4096..8192].iter().all(|&b| b == 0));
        assert!(buf[8192..].iter().all(|&b| b == 3));
    }

    /// An offset near 2^64 wrapped the bounds check and panicked the thread holding the read
    /// turn, which hung every other request.
    #[test]
    fn a_chunk_offset_that_would_wrap_is_refused() {
        let (r, _) = read_with(0, 65536, |c| data_chunk(REPLY_FLAG_DONE, c, u64::MAX - 7, &[0u8; 16]));
        protocol_error(&r, "outside the request");
        let (r, _) = read_with(0, 65536, |c| hole_chunk(REPLY_FLAG_DONE, c, u64::MAX - 7, 16).to_vec());
        protocol_error(&r, "outside the request");
    }

    /// The same chunk twice summed to the request's length: the rest of the buffer (stale
    /// bytes of an earlier request) passed for data.
    #[test]
    fn overlapping_chunks_are_refused() {
        let (r, _) = read_with(0, 8192, |c| {
            let mut v = data_chunk(0, c, 0, &[1u8; 4096]);
            v.extend(data_chunk(REPLY_FLAG_DONE, c, 0, &[1u8; 4096]));
            v
        });
        protocol_error(&r, "overlapping");
        let (r, _) = read_with(0, 8192, |c| {
            let mut v = data_chunk(0, c, 0, &[1u8; 6000]);
            v.extend(hole_chunk(REPLY_FLAG_DONE, c, 4096, 4096));
            v
        });
        protocol_error(&r, "overlapping");
        let (r, _) = read_with(0, 8192, |c| hole_chunk(REPLY_FLAG_DONE, c, 0, 0).to_vec());
        protocol_error(&r, "no length");
    }

    /// The chunks here break the spec on purpose, which proto's encoders cannot: their
    /// payloads are written out by hand.
    #[test]
    fn malformed_chunks_hang_up() {
        // An unknown type that is not an error chunk (6: BLOCK_STATUS_EXT, never negotiated).
        let (r, _) = read_with(0, 4096, |c| {
            let mut v = chunk_header(REPLY_FLAG_DONE, 6, c, 4).to_vec();
            v.extend_from_slice(&[0; 4]);
            v
        });
        protocol_error(&r, "unknown type 6");
        // A NONE chunk with a payload, or not the last.
        let (r, _) = read_with(0, 4096, |c| {
            let mut v = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_NONE, c, 4).to_vec();
            v.extend_from_slice(&[0; 4]);
            v
        });
        protocol_error(&r, "none chunk");
        let (r, _) = read_with(0, 4096, |c| chunk_header(0, REPLY_TYPE_NONE, c, 0).to_vec());
        protocol_error(&r, "none chunk");
        // An error message longer than its chunk.
        let (r, _) = read_with(0, 4096, |c| {
            let mut v = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, c, 8).to_vec();
            v.extend_from_slice(&EIO.to_be_bytes());
            v.extend_from_slice(&100u16.to_be_bytes());
            v.extend_from_slice(b"ab");
            v
        });
        protocol_error(&r, "longer than its chunk");
        // An ERROR_OFFSET chunk without room for its offset.
        let (r, _) = read_with(0, 4096, |c| {
            let mut v = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_ERROR_OFFSET, c, 6).to_vec();
            v.extend_from_slice(&EIO.to_be_bytes());
            v.extend_from_slice(&0u16.to_be_bytes());
            v
        });
        protocol_error(&r, "too short");
    }

    #[test]
    fn error_chunks_of_any_type_fail_the_request_and_keep_the_connection() {
        let (c, mut srv) = connection();
        let c2 = c.clone();
        let t = std::thread::spawn(move || {
            let mut buf = vec![0u8; 4096];
            let first = c2.read(&mut buf, 0);
            (first, c2.read(&mut buf, 0))
        });
        // An unknown error type (bit 15) with a message and a field of its own (written by
        // hand: proto encodes only the types lightfoot sends), then a good reply to the next
        // request.
        let r = request(&mut srv);
        let mut v = chunk_header(REPLY_FLAG_DONE, (1 << 15) | 9, r.cookie, 6 + 5 + 3).to_vec();
        v.extend_from_slice(&ENOSPC.to_be_bytes());
        v.extend_from_slice(&5u16.to_be_bytes());
        v.extend_from_slice(b"full!xyz");
        srv.write_all(&v).unwrap();
        let r = request(&mut srv);
        srv.write_all(&data_chunk(REPLY_FLAG_DONE, r.cookie, 0, &[9u8; 4096])).unwrap();
        let (first, second) = t.join().unwrap();
        let e = first.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
        assert!(e.to_string().contains("full!"), "{e}");
        second.unwrap();
    }

    fn status_with(reply: impl FnOnce(u64) -> Vec<u8>) -> Result<Vec<Extent>> {
        let (c, mut srv) = connection();
        let t = std::thread::spawn(move || c.block_status(0, 65536));
        let r = request(&mut srv);
        assert_eq!(r.cmd, CMD_BLOCK_STATUS);
        srv.write_all(&reply(r.cookie)).unwrap();
        t.join().unwrap()
    }

    #[test]
    fn block_status_takes_one_chunk_per_context_of_nonzero_extents() {
        let ok =
            status_with(|c| status_chunk(REPLY_FLAG_DONE, c, &[(4096, 0), (61440, STATE_HOLE | STATE_ZERO)]));
        assert_eq!(ok.unwrap().len(), 2);
        // A second chunk for the same context shifted the map: 64K..128K read as zero.
        let two = status_with(|c| {
            let mut v = status_chunk(0, c, &[(65536, 0)]);
            v.extend(status_chunk(REPLY_FLAG_DONE, c, &[(65536, STATE_HOLE | STATE_ZERO)]));
            v
        });
        protocol_error(&two.map(drop), "two block status chunks");
        let empty = status_with(|c| status_chunk(REPLY_FLAG_DONE, c, &[(0, 0)]));
        protocol_error(&empty.map(drop), "no length");
        // A length announcing 4 GiB is refused before anything is allocated.
        let huge =
            status_with(|c| chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, c, u32::MAX - 3).to_vec());
        protocol_error(&huge.map(drop), "2^20 extents");
    }

    fn status_of(allocation: Option<u32>, reply: impl FnOnce(u64) -> Vec<u8>) -> Result<Vec<Extent>> {
        let (c, mut srv) = connection_with(allocation, Some(BITMAP));
        let t = std::thread::spawn(move || c.block_status(0, 65536));
        let r = request(&mut srv);
        srv.write_all(&reply(r.cookie)).unwrap();
        t.join().unwrap()
    }

    #[test]
    fn a_dirty_bitmap_marks_the_allocation_map_clean_where_unchanged() {
        const HZ: u32 = STATE_HOLE | STATE_ZERO;
        // The bitmap's chunk first, an unknown context's between, the allocation's last; the
        // bitmap answers for less than the allocation map: the merge stops where it does.
        let got = status_of(Some(CONTEXT), |c| {
            let mut v = context_chunk(0, c, BITMAP, &[(8192, 0), (16384, STATE_DIRTY), (8192, 0)]);
            v.extend(context_chunk(0, c, 77, &[(65536, 1)]));
            v.extend(status_chunk(REPLY_FLAG_DONE, c, &[(12288, 0), (53248, HZ)]));
            v
        })
        .unwrap();
        let ext = |len, hole, clean| Extent { len, hole, zero: hole, clean };
        assert_eq!(
            got,
            vec![
                ext(8192, false, true),
                ext(4096, false, false),
                ext(12288, true, false),
                ext(8192, true, true)
            ]
        );
        // Without an allocation map: the bitmap's runs, as data.
        let bare =
            status_of(None, |c| context_chunk(REPLY_FLAG_DONE, c, BITMAP, &[(4096, 1), (4096, 0)])).unwrap();
        assert_eq!(bare, vec![ext(4096, false, false), ext(4096, false, true)]);
        // A reply without the bitmap's chunk describes nothing; two of them break the protocol.
        let missing = status_of(Some(CONTEXT), |c| status_chunk(REPLY_FLAG_DONE, c, &[(65536, 0)])).unwrap();
        assert!(missing.is_empty());
        let twice = status_of(Some(CONTEXT), |c| {
            let mut v = context_chunk(0, c, BITMAP, &[(65536, 1)]);
            v.extend(context_chunk(REPLY_FLAG_DONE, c, BITMAP, &[(65536, 0)]));
            v
        });
        protocol_error(&twice.map(drop), "two block status chunks");
    }

    /// A duplicate reply read by the next holder of the read turn, in the moment after its
    /// request finished and before the request left the outstanding set, was handed to a
    /// thread that had gone, and every later request hung. Two threads, a reply for one, a
    /// duplicate, then the other's reply, many times: the duplicate must kill the connection
    /// (a reply for an unknown cookie), never hang it. (A race: the old code hung in some
    /// rounds only.)
    #[test]
    fn a_duplicate_reply_kills_the_connection_instead_of_hanging_it() {
        for _ in 0..200 {
            let (c, mut srv) = connection();
            let (tx, rx) = std::sync::mpsc::channel();
            for at in [0u64, 4096] {
                let (c, tx) = (c.clone(), tx.clone());
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 4096];
                    let _ = tx.send((at, c.read(&mut buf, at).map_err(|e| e.to_string())));
                });
            }
            let (r1, r2) = (request(&mut srv), request(&mut srv));
            let reply = data_chunk(REPLY_FLAG_DONE, r1.cookie, r1.offset, &[1u8; 4096]);
            srv.write_all(&reply).unwrap();
            srv.write_all(&reply).unwrap();
            // The client may have hung up already.
            let _ = srv.write_all(&data_chunk(REPLY_FLAG_DONE, r2.cookie, r2.offset, &[2u8; 4096]));
            let mut results = Vec::new();
            for _ in 0..2 {
                let got = rx.recv_timeout(std::time::Duration::from_secs(10));
                results.push(got.expect("a request hung after a duplicate reply"));
            }
            results.sort_by_key(|r| if r.0 == r1.offset { 0 } else { 1 });
            assert!(results[0].1.is_ok(), "{:?}", results[0]);
            let e = results[1].1.as_ref().expect_err("the reply after a duplicate was taken");
            assert!(e.contains("unknown cookie"), "{e}");
        }
    }
}
