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
//! threads lent it.)
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
use crate::backend::Extent;
use crate::error::{Error, ErrorKind, Result};
use crate::proto::*;
use crate::stream::{write_all_vectored, Closer, Stream};

/// A reply header read by whoever held the turn.
#[derive(Debug, Clone, Copy)]
enum Header {
    Simple { cookie: u64, error: u32 },
    Chunk(ChunkHeader),
}

impl Header {
    fn cookie(&self) -> u64 {
        match self {
            Header::Simple { cookie, .. } => *cookie,
            Header::Chunk(c) => c.cookie,
        }
    }
}

#[derive(Default)]
struct State {
    /// Some thread has the read turn.
    reading: bool,
    /// A header read for another thread; the turn goes with it.
    handoff: Option<Header>,
    /// Cookies sent and not yet fully answered.
    outstanding: HashSet<u64>,
    /// Why the connection is unusable.
    dead: Option<String>,
    /// Cookies whose threads are blocked waiting (candidates for a released turn).
    waiting: HashSet<u64>,
}

/// Where the reply to one request goes.
enum Target<'a> {
    None,
    Read(&'a mut [u8]),
    Status(&'a mut Vec<Extent>),
}

/// What the replies to one request said.
#[derive(Default)]
struct Answer {
    error: Option<(u32, String)>,
    /// Bytes of a structured READ covered by data and hole chunks.
    covered: u64,
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
    /// Waiting threads sleep on the slot of their cookie (`cookie % SLOTS`).
    slots: Vec<Condvar>,
    cookies: AtomicU64,
    closer: Closer,
}

impl Connection {
    /// Takes a negotiated stream into the transmission phase.
    pub fn new(stream: Box<dyn Stream>, info: ExportInfo, who: &str) -> Result<Connection> {
        let closer = stream.closer().map_err(|e| Error::io("connect", e).path(who))?;
        let (r, w) = stream.split().map_err(|e| Error::io("connect", e).path(who))?;
        Ok(Connection {
            who: who.to_string(),
            info,
            writer: Mutex::new(w),
            reader: Mutex::new(r),
            state: Mutex::new(State::default()),
            slots: (0..SLOTS).map(|_| Condvar::new()).collect(),
            cookies: AtomicU64::new(1),
            closer,
        })
    }

    pub fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        self.request("read", CMD_READ, 0, offset, len, &[], Target::Read(buf))
    }

    pub fn write(&self, buf: &[u8], offset: u64, flags: u16) -> Result<()> {
        self.request("write", CMD_WRITE, flags, offset, buf.len() as u64, buf, Target::None)
    }

    /// A command without payload either way: FLUSH, TRIM, WRITE_ZEROES, CACHE.
    pub fn command(&self, op: &'static str, cmd: u16, flags: u16, offset: u64, len: u64) -> Result<()> {
        self.request(op, cmd, flags, offset, len, &[], Target::None)
    }

    /// `base:allocation` extents from `offset`, as the server reports them (possibly fewer
    /// bytes than `len`, or more in the last extent).
    pub fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let mut extents = Vec::new();
        self.request("block status", CMD_BLOCK_STATUS, 0, offset, len, &[], Target::Status(&mut extents))?;
        Ok(extents)
    }

    /// Sends `NBD_CMD_DISC` (no reply comes) and closes the connection.
    pub fn disconnect(&self) {
        if self.state.lock().unwrap().dead.is_none() {
            let r = Request { flags: 0, cmd: CMD_DISC, cookie: 0, offset: 0, len: 0 };
            let _ = write_all_vectored(&mut **self.writer.lock().unwrap(), &[&encode_request(&r)]);
        }
        self.kill("disconnected".into());
    }

    /// Marks the connection unusable and wakes everyone.
    fn kill(&self, why: String) {
        let mut st = self.state.lock().unwrap();
        st.dead.get_or_insert(why);
        st.reading = false;
        st.handoff = None;
        drop(st);
        (self.closer)();
        self.slots.iter().for_each(Condvar::notify_all);
    }

    fn slot(&self, cookie: u64) -> &Condvar {
        &self.slots[(cookie % SLOTS) as usize]
    }

    #[allow(clippy::too_many_arguments)]
    fn request(
        &self,
        op: &'static str,
        cmd: u16,
        flags: u16,
        offset: u64,
        len: u64,
        payload: &[u8],
        mut target: Target,
    ) -> Result<()> {
        let lost = |why: &str| {
            Error::new(ErrorKind::Io, op)
                .path(&self.who)
                .at(offset, len)
                .detail(format!("connection lost: {why}"))
        };
        let cookie = self.cookies.fetch_add(1, Ordering::Relaxed);
        {
            let mut st = self.state.lock().unwrap();
            if let Some(why) = &st.dead {
                return Err(lost(why));
            }
            st.outstanding.insert(cookie);
        }
        let header = encode_request(&Request { flags, cmd, cookie, offset, len });
        let sent = write_all_vectored(&mut **self.writer.lock().unwrap(), &[&header, payload]);
        if let Err(e) = sent {
            self.kill(format!("sending: {e}"));
            self.state.lock().unwrap().outstanding.remove(&cookie);
            return Err(lost(&format!("sending: {e}")));
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
        if cmd == CMD_READ && self.info.structured && answer.covered != len {
            self.kill("short structured read".into());
            return Err(lost("the server's read reply did not cover the request"));
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
    ) -> Result<(), String> {
        let mut st = self.state.lock().unwrap();
        loop {
            if let Some(why) = &st.dead {
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
    ) -> Result<bool, String> {
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
                    return Err(format!("protocol error: reply for unknown cookie {}", h.cookie()));
                }
                st.handoff = Some(h);
                drop(st);
                self.slot(h.cookie()).notify_all();
                return Ok(false);
            }
            if self.consume(&mut **reader, h, offset, len, target, answer)? {
                return Ok(true);
            }
        }
    }

    /// Reads the payload of one reply or chunk of ours; true when the reply is complete.
    fn consume(
        &self,
        r: &mut dyn Read,
        h: Header,
        offset: u64,
        len: u64,
        target: &mut Target,
        answer: &mut Answer,
    ) -> Result<bool, String> {
        let io = |e: std::io::Error| format!("receiving: {e}");
        let c = match h {
            Header::Simple { error, .. } => {
                if error != 0 {
                    answer.error = Some((error, String::new()));
                } else if let Target::Read(buf) = target {
                    r.read_exact(buf).map_err(io)?;
                    answer.covered = len;
                }
                return Ok(true);
            }
            Header::Chunk(c) => c,
        };
        let bad = |what: &str| Err(format!("protocol error: {what}"));
        match c.ty {
            REPLY_TYPE_NONE if c.len == 0 => {}
            REPLY_TYPE_OFFSET_DATA => {
                let Target::Read(buf) = target else { return bad("data chunk for a request without data") };
                if c.len < 8 {
                    return bad("data chunk too short");
                }
                let at = read_u64(r).map_err(io)?;
                let n = u64::from(c.len - 8);
                if at < offset || at + n > offset + len {
                    return bad("data chunk outside the request");
                }
                let start = (at - offset) as usize;
                r.read_exact(&mut buf[start..start + n as usize]).map_err(io)?;
                answer.covered += n;
            }
            REPLY_TYPE_OFFSET_HOLE => {
                let Target::Read(buf) = target else { return bad("hole chunk for a request without data") };
                if c.len != 12 {
                    return bad("hole chunk of the wrong length");
                }
                let at = read_u64(r).map_err(io)?;
                let n = u64::from(read_u32(r).map_err(io)?);
                if at < offset || at + n > offset + len {
                    return bad("hole chunk outside the request");
                }
                let start = (at - offset) as usize;
                buf[start..start + n as usize].fill(0);
                answer.covered += n;
            }
            REPLY_TYPE_BLOCK_STATUS => {
                let Target::Status(extents) = target else { return bad("block status for another command") };
                if c.len < 4 || (c.len - 4) % 8 != 0 {
                    return bad("block status chunk of the wrong length");
                }
                let mut data = vec![0u8; c.len as usize];
                r.read_exact(&mut data).map_err(io)?;
                if Some(be32(&data[0..4])) == self.info.allocation {
                    for d in data[4..].chunks_exact(8) {
                        let (n, flags) = (u64::from(be32(&d[0..4])), be32(&d[4..8]));
                        extents.push(Extent {
                            len: n,
                            hole: flags & STATE_HOLE != 0,
                            zero: flags & STATE_ZERO != 0,
                        });
                    }
                }
            }
            ty if ty & (1 << 15) != 0 => {
                // Error chunks: errno, message length, message (and an offset we do not need).
                if c.len < 6 {
                    return bad("error chunk too short");
                }
                let mut data = vec![0u8; c.len as usize];
                r.read_exact(&mut data).map_err(io)?;
                let errno = be32(&data[0..4]);
                let n = (be16(&data[4..6]) as usize).min(data.len() - 6);
                let msg = String::from_utf8_lossy(&data[6..6 + n]).into_owned();
                answer.error.get_or_insert((if errno == 0 { EIO } else { errno }, msg));
            }
            _ => {
                // An informational chunk we do not know: the spec lets clients skip it.
                std::io::copy(&mut r.take(u64::from(c.len)), &mut std::io::sink()).map_err(io)?;
            }
        }
        Ok(c.flags & REPLY_FLAG_DONE != 0)
    }
}

fn read_header(r: &mut dyn Read) -> Result<Header, String> {
    let mut b = [0u8; 20];
    r.read_exact(&mut b[..16]).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => "the server closed the connection".to_string(),
        _ => format!("receiving: {e}"),
    })?;
    if let Some((cookie, error)) = parse_simple_reply(b[..16].try_into().unwrap()) {
        return Ok(Header::Simple { cookie, error });
    }
    r.read_exact(&mut b[16..]).map_err(|e| format!("receiving: {e}"))?;
    parse_chunk_header(&b).map(Header::Chunk).ok_or_else(|| "protocol error: bad reply magic".to_string())
}

fn read_u64(r: &mut dyn Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

fn read_u32(r: &mut dyn Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

/// The error kind and name of an NBD errno.
fn kind_of(errno: u32) -> (ErrorKind, &'static str) {
    match errno {
        EPERM => (ErrorKind::Permission, "EPERM"),
        EIO => (ErrorKind::Io, "EIO"),
        ENOMEM => (ErrorKind::Io, "ENOMEM"),
        EINVAL => (ErrorKind::InvalidInput, "EINVAL"),
        ENOSPC => (ErrorKind::NoSpace, "ENOSPC"),
        EOVERFLOW => (ErrorKind::InvalidInput, "EOVERFLOW"),
        ENOTSUP => (ErrorKind::NotSupported, "ENOTSUP"),
        ESHUTDOWN => (ErrorKind::Io, "ESHUTDOWN (the server is shutting down)"),
        _ => (ErrorKind::Io, "an unknown error"),
    }
}
