//! One reply, as the thread holding the read turn reads it (see [`super::conn`]): its header
//! ([`read_header`]: simple, or a structured reply's chunk), then its payload straight into
//! the request's own buffer ([`Answer::consume`] into a [`Target`]), checked as it comes. A
//! reply that breaks the protocol (a chunk outside the request or overlapping another, a
//! second status chunk, an unknown chunk type) is an error that kills the connection
//! ([`protocol`]); an error the server reports fails the request only ([`kind_of`] names it).

use std::collections::BTreeMap;
use std::io::Read;

use crate::backend::Extent;
use crate::error::{Error, ErrorKind, Op, Result};
use crate::proto::*;

/// A reply header read by whoever held the turn.
#[derive(Debug, Clone, Copy)]
pub(super) enum Header {
    Simple { cookie: u64, error: u32 },
    Chunk(ChunkHeader),
}

impl Header {
    pub(super) fn cookie(&self) -> u64 {
        match self {
            Header::Simple { cookie, .. } => *cookie,
            Header::Chunk(c) => c.cookie,
        }
    }
}

/// Where the reply to one request goes.
pub(super) enum Target<'a> {
    None,
    Read(&'a mut [u8]),
    Status(&'a mut Status),
}

/// A `BLOCK_STATUS` reply: the extents of each context the connection agreed to, from the
/// request's offset.
#[derive(Debug, Default)]
pub(super) struct Status {
    pub(super) allocation: Vec<Extent>,
    /// The dirty bitmap's runs: length, dirty.
    pub(super) dirty: Vec<(u64, bool)>,
}

/// The context ids a connection agreed to: `base:allocation`, and the dirty bitmap.
pub(super) type Contexts = [Option<u32>; 2];

/// What the replies to one request said.
#[derive(Default)]
pub(super) struct Answer {
    pub(super) error: Option<(u32, String)>,
    /// The parts of a READ its reply covered (start to end, relative to the request,
    /// neighbours merged; a simple reply covers it whole). Kept as ranges, not a byte count:
    /// the spec forbids overlapping chunks, and a server that sent one chunk twice would
    /// otherwise pass for one that covered the request.
    content: BTreeMap<u64, u64>,
    /// The status chunk of each of [`Contexts`] came (a reply holds one per context).
    status: [bool; 2],
}

/// Disjoint pieces a read's chunks may leave before the server counts as hostile (chunks in
/// order, or in reverse, merge into one).
const MAX_PIECES: usize = 1 << 16;

/// The largest block status chunk taken: 2^20 extents, the most the spec lets a server send.
const MAX_STATUS_CHUNK: u32 = 4 + 8 * (1 << 20);

impl Answer {
    /// Checks a content chunk `[at, at+n)` of a read of `[offset, offset+len)`: non-empty,
    /// inside the request, overlapping no earlier chunk. Returns where it starts in the
    /// caller's buffer.
    fn place(&mut self, offset: u64, len: u64, at: u64, n: u64, what: &str) -> Result<usize> {
        let bad = |why: &str| Err(protocol(format!("{what} chunk {why}")));
        let start = match at.checked_sub(offset) {
            Some(s) if s < len && n <= len - s => s,
            _ => return bad("outside the request"),
        };
        if n == 0 {
            return bad("of no length");
        }
        let mut end = start + n;
        let mut from = start;
        if let Some((&s, &e)) = self.content.range(..end).next_back() {
            if e > start {
                return bad("overlapping an earlier one");
            }
            if e == start {
                self.content.remove(&s);
                from = s;
            }
        }
        if let Some(e) = self.content.remove(&end) {
            end = e;
        }
        self.content.insert(from, end);
        if self.content.len() > MAX_PIECES {
            return bad("splitting the read into too many pieces");
        }
        Ok(start as usize)
    }

    /// Bytes of the READ the reply covered.
    pub(super) fn covered(&self) -> u64 {
        self.content.iter().map(|(s, e)| e - s).sum()
    }

    /// Reads the payload of one reply or chunk of ours; true when the reply is complete.
    pub(super) fn consume(
        &mut self,
        r: &mut dyn Read,
        h: Header,
        offset: u64,
        len: u64,
        target: &mut Target,
        contexts: Contexts,
    ) -> Result<bool> {
        let io = |e: std::io::Error| Error::io(Op::Receive, e);
        let c = match h {
            Header::Simple { error, .. } => {
                if error != 0 {
                    self.error = Some((error, String::new()));
                } else if let Target::Read(buf) = target {
                    r.read_exact(buf).map_err(io)?;
                    self.content.insert(0, len);
                }
                return Ok(true);
            }
            Header::Chunk(c) => c,
        };
        let bad = |what: &str| Err(protocol(what.to_string()));
        let payload = c.payload().map_err(malformed)?;
        match payload {
            Payload::None => {}
            Payload::Data { len: n } => {
                let Target::Read(buf) = target else { return bad("data chunk for a request without data") };
                let mut b = [0u8; 8];
                r.read_exact(&mut b).map_err(io)?;
                let n = u64::from(n);
                let start = self.place(offset, len, parse_data_offset(&b), n, "data")?;
                r.read_exact(&mut buf[start..start + n as usize]).map_err(io)?;
            }
            Payload::Hole => {
                let Target::Read(buf) = target else { return bad("hole chunk for a request without data") };
                let mut b = [0u8; HOLE_PAYLOAD_LEN];
                r.read_exact(&mut b).map_err(io)?;
                let hole = parse_hole(&b);
                let n = u64::from(hole.len);
                let start = self.place(offset, len, hole.offset, n, "hole")?;
                buf[start..start + n as usize].fill(0);
            }
            Payload::BlockStatus { len: n } => {
                let Target::Status(extents) = target else { return bad("block status for another command") };
                if n > MAX_STATUS_CHUNK {
                    return bad("block status chunk of more than 2^20 extents");
                }
                let mut data = vec![0u8; n as usize];
                r.read_exact(&mut data).map_err(io)?;
                let status = parse_block_status(&data).map_err(malformed)?;
                // Chunks for contexts not asked about are passed over.
                let Some(which) = contexts.iter().position(|&c| c == Some(status.context)) else {
                    return Ok(c.done());
                };
                if std::mem::replace(&mut self.status[which], true) {
                    return bad("two block status chunks for one context");
                }
                if status.descriptors().any(|d| d.len == 0) {
                    return bad("an extent of no length");
                }
                for d in status.descriptors() {
                    let len = u64::from(d.len);
                    match which {
                        0 => extents.allocation.push(Extent {
                            len,
                            hole: d.hole(),
                            zero: d.zero(),
                            clean: false,
                        }),
                        _ => extents.dirty.push((len, d.dirty())),
                    }
                }
            }
            Payload::Error => {
                // Error chunks, known or not: errno, message length, message, then fields of
                // their own (an offset for ERROR_OFFSET, which we do not need).
                let mut b = [0u8; ERROR_HEAD_LEN];
                r.read_exact(&mut b).map_err(io)?;
                let head = parse_error_head(&c, &b).map_err(malformed)?;
                let mut msg = vec![0u8; usize::from(head.message_len)];
                r.read_exact(&mut msg).map_err(io)?;
                std::io::copy(&mut r.take(u64::from(head.rest)), &mut std::io::sink()).map_err(io)?;
                msg.truncate(MAX_ERROR_MESSAGE);
                let msg = String::from_utf8_lossy(&msg).into_owned();
                let errno = if head.errno == 0 { EIO } else { head.errno };
                self.error.get_or_insert((errno, msg));
            }
            Payload::Unknown(ty) => {
                // The spec: a client that meets an unknown or unexpected type that is not an
                // error chunk must disconnect.
                return Err(protocol(format!("reply chunk of unknown type {ty}")));
            }
        }
        Ok(c.done())
    }
}

/// What breaks the connection when a reply breaks the protocol.
pub(super) fn protocol(what: String) -> Error {
    Error::new(ErrorKind::Io, Op::Receive).detail(format!("protocol error: {what}"))
}

fn malformed(Malformed(what): Malformed) -> Error {
    protocol(what.to_string())
}

pub(super) fn read_header(r: &mut dyn Read) -> Result<Header> {
    let mut b = [0u8; 20];
    r.read_exact(&mut b[..16]).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => {
            Error::new(ErrorKind::Io, Op::Receive).detail("the server closed the connection")
        }
        _ => Error::io(Op::Receive, e),
    })?;
    if let Some((cookie, error)) = parse_simple_reply(b[..16].try_into().unwrap()) {
        return Ok(Header::Simple { cookie, error });
    }
    r.read_exact(&mut b[16..]).map_err(|e| Error::io(Op::Receive, e))?;
    parse_chunk_header(&b).map(Header::Chunk).ok_or_else(|| protocol("bad reply magic".into()))
}

/// The error kind and name of an NBD errno.
pub(super) fn kind_of(errno: u32) -> (ErrorKind, &'static str) {
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
