//! Transmission replies, both ways: simple replies and structured reply chunks, with the
//! payloads of `OFFSET_DATA`, `OFFSET_HOLE`, `BLOCK_STATUS` and error chunks. The server
//! encodes them ([`Reply`] frames the replies to one request, simple or structured); the NBD
//! client backend checks and decodes them.
//!
//! Decoding goes in the steps a reader takes on a socket: the header ([`parse_chunk_header`]),
//! what the header announces, checked before a byte of payload is read
//! ([`ChunkHeader::payload`]), then the fixed-size part of the payload. The data of an
//! `OFFSET_DATA` chunk never passes through here: the client reads it straight into the
//! caller's buffer, and the server sends it from its own buffer behind an encoded header.

use super::*;

/// Size of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Size of a structured reply chunk header.
pub const CHUNK_HEADER_LEN: usize = 20;
/// Size of an `OFFSET_DATA` chunk's header and offset: the data follows.
pub const DATA_CHUNK_HEADER_LEN: usize = CHUNK_HEADER_LEN + 8;
/// Size of an `OFFSET_HOLE` chunk's payload (offset and hole size).
pub const HOLE_PAYLOAD_LEN: usize = 12;
/// Size of the fields every error chunk starts with (errno, message length).
pub const ERROR_HEAD_LEN: usize = 6;
/// Size of a block status descriptor.
pub const DESCRIPTOR_LEN: usize = 8;
/// The longest error message the spec allows (its limit on every string).
pub const MAX_ERROR_MESSAGE: usize = 4096;

/// A chunk that breaks the layout its type prescribes: the spec's answer is a hard
/// disconnect. The text says what was wrong, for the error that ends the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed(pub &'static str);

/// A simple reply header (16 bytes); the data of a successful simple READ follows it.
pub fn simple_reply(cookie: u64, error: u32) -> [u8; SIMPLE_REPLY_LEN] {
    let mut b = [0u8; SIMPLE_REPLY_LEN];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// Parses a simple reply header: `(cookie, error)`, or `None` when the magic is not the
/// simple reply's (it may be a structured chunk: see [`parse_chunk_header`]).
pub fn parse_simple_reply(b: &[u8; SIMPLE_REPLY_LEN]) -> Option<(u64, u32)> {
    (be32(&b[0..4]) == SIMPLE_REPLY_MAGIC).then(|| (be64(&b[8..16]), be32(&b[4..8])))
}

/// A structured reply chunk header (20 bytes); `len` bytes of payload follow.
pub fn chunk_header(flags: u16, ty: u16, cookie: u64, len: u32) -> [u8; CHUNK_HEADER_LEN] {
    let mut b = [0u8; CHUNK_HEADER_LEN];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&ty.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

/// A structured reply chunk header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    pub flags: u16,
    pub ty: u16,
    pub cookie: u64,
    pub len: u32,
}

/// Parses a structured reply chunk header; `None` when the magic is wrong.
pub fn parse_chunk_header(b: &[u8; CHUNK_HEADER_LEN]) -> Option<ChunkHeader> {
    (be32(&b[0..4]) == STRUCTURED_REPLY_MAGIC).then(|| ChunkHeader {
        flags: be16(&b[4..6]),
        ty: be16(&b[6..8]),
        cookie: be64(&b[8..16]),
        len: be32(&b[16..20]),
    })
}

/// What a chunk header announces, once its length was checked against its type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payload {
    /// `NONE`: nothing follows, and the reply is complete.
    None,
    /// `OFFSET_DATA`: an 8-byte offset ([`parse_data_offset`]), then `len` bytes of data (at
    /// least one).
    Data { len: u32 },
    /// `OFFSET_HOLE`: [`HOLE_PAYLOAD_LEN`] bytes ([`parse_hole`]).
    Hole,
    /// `BLOCK_STATUS`: `len` bytes, a context id and at least one descriptor
    /// ([`parse_block_status`]).
    BlockStatus { len: u32 },
    /// An error chunk, of a type known or not (bit 15 set): [`ERROR_HEAD_LEN`] bytes
    /// ([`parse_error_head`]) come first.
    Error,
    /// Not an error chunk, and not a type this side knows: the spec says to disconnect.
    Unknown(u16),
}

impl ChunkHeader {
    /// Whether this is the last chunk of its reply.
    pub fn done(&self) -> bool {
        self.flags & REPLY_FLAG_DONE != 0
    }

    /// Checks the length against the layout of the type, before any payload is read (a
    /// short chunk must not make the reader wait for bytes that will never come).
    pub fn payload(&self) -> Result<Payload, Malformed> {
        let len = self.len;
        match self.ty {
            REPLY_TYPE_NONE if len != 0 || !self.done() => {
                Err(Malformed("a none chunk with a payload or not the last"))
            }
            REPLY_TYPE_NONE => Ok(Payload::None),
            REPLY_TYPE_OFFSET_DATA if len < 9 => Err(Malformed("data chunk too short")),
            REPLY_TYPE_OFFSET_DATA => Ok(Payload::Data { len: len - 8 }),
            REPLY_TYPE_OFFSET_HOLE if len as usize != HOLE_PAYLOAD_LEN => {
                Err(Malformed("hole chunk of the wrong length"))
            }
            REPLY_TYPE_OFFSET_HOLE => Ok(Payload::Hole),
            REPLY_TYPE_BLOCK_STATUS if !block_status_len_ok(len as usize) => {
                Err(Malformed("block status chunk of the wrong length"))
            }
            REPLY_TYPE_BLOCK_STATUS => Ok(Payload::BlockStatus { len }),
            ty if ty & (1 << 15) != 0 => {
                if (len as usize) < error_fixed_len(ty) {
                    return Err(Malformed("error chunk too short"));
                }
                Ok(Payload::Error)
            }
            ty => Ok(Payload::Unknown(ty)),
        }
    }
}

/// A context id and at least one whole descriptor.
fn block_status_len_ok(len: usize) -> bool {
    len >= 4 + DESCRIPTOR_LEN && (len - 4).is_multiple_of(DESCRIPTOR_LEN)
}

/// The fixed fields of an error chunk of type `ty`: errno and message length, and for
/// `ERROR_OFFSET` the offset after the message. Unknown error types have at least the first
/// two (the spec: every error chunk starts with them).
fn error_fixed_len(ty: u16) -> usize {
    ERROR_HEAD_LEN + if ty == REPLY_TYPE_ERROR_OFFSET { 8 } else { 0 }
}

/// The header and offset of an `OFFSET_DATA` chunk of `len` bytes of data, which follow.
pub fn data_chunk_header(flags: u16, cookie: u64, offset: u64, len: u32) -> [u8; DATA_CHUNK_HEADER_LEN] {
    let mut b = [0u8; DATA_CHUNK_HEADER_LEN];
    b[..CHUNK_HEADER_LEN].copy_from_slice(&chunk_header(flags, REPLY_TYPE_OFFSET_DATA, cookie, 8 + len));
    b[CHUNK_HEADER_LEN..].copy_from_slice(&offset.to_be_bytes());
    b
}

/// The offset that starts an `OFFSET_DATA` payload.
pub fn parse_data_offset(b: &[u8; 8]) -> u64 {
    be64(b)
}

/// An `OFFSET_HOLE` payload: `len` bytes at `offset` read as zeroes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hole {
    pub offset: u64,
    pub len: u32,
}

/// A whole `OFFSET_HOLE` chunk, header and payload.
pub fn hole_chunk(
    flags: u16,
    cookie: u64,
    offset: u64,
    len: u32,
) -> [u8; CHUNK_HEADER_LEN + HOLE_PAYLOAD_LEN] {
    let mut b = [0u8; CHUNK_HEADER_LEN + HOLE_PAYLOAD_LEN];
    b[..CHUNK_HEADER_LEN].copy_from_slice(&chunk_header(
        flags,
        REPLY_TYPE_OFFSET_HOLE,
        cookie,
        HOLE_PAYLOAD_LEN as u32,
    ));
    b[20..28].copy_from_slice(&offset.to_be_bytes());
    b[28..32].copy_from_slice(&len.to_be_bytes());
    b
}

pub fn parse_hole(b: &[u8; HOLE_PAYLOAD_LEN]) -> Hole {
    Hole { offset: be64(&b[0..8]), len: be32(&b[8..12]) }
}

/// One block status descriptor: `len` bytes in the state `flags` (`STATE_*` for
/// `base:allocation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    pub len: u32,
    pub flags: u32,
}

impl Descriptor {
    /// A `base:allocation` descriptor.
    pub fn allocation(len: u32, hole: bool, zero: bool) -> Descriptor {
        Descriptor { len, flags: if hole { STATE_HOLE } else { 0 } | if zero { STATE_ZERO } else { 0 } }
    }

    /// A `qemu:dirty-bitmap:` descriptor.
    pub fn dirty_bitmap(len: u32, dirty: bool) -> Descriptor {
        Descriptor { len, flags: if dirty { STATE_DIRTY } else { 0 } }
    }

    pub fn hole(&self) -> bool {
        self.flags & STATE_HOLE != 0
    }

    pub fn zero(&self) -> bool {
        self.flags & STATE_ZERO != 0
    }

    /// A `qemu:dirty-bitmap:` descriptor's state.
    pub fn dirty(&self) -> bool {
        self.flags & STATE_DIRTY != 0
    }
}

/// A whole `BLOCK_STATUS` chunk: header, context id and descriptors.
pub fn block_status_chunk(flags: u16, cookie: u64, context: u32, descriptors: &[Descriptor]) -> Vec<u8> {
    let len = 4 + DESCRIPTOR_LEN * descriptors.len();
    let mut v = Vec::with_capacity(CHUNK_HEADER_LEN + len);
    v.extend_from_slice(&chunk_header(flags, REPLY_TYPE_BLOCK_STATUS, cookie, len as u32));
    v.extend_from_slice(&context.to_be_bytes());
    for d in descriptors {
        v.extend_from_slice(&d.len.to_be_bytes());
        v.extend_from_slice(&d.flags.to_be_bytes());
    }
    v
}

/// A `BLOCK_STATUS` payload: the context it reports on and its descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockStatus<'a> {
    pub context: u32,
    descriptors: &'a [u8],
}

impl<'a> BlockStatus<'a> {
    /// In order. Zero lengths are passed on: the spec forbids them, and the reader of the
    /// context they belong to says so.
    pub fn descriptors(&self) -> impl Iterator<Item = Descriptor> + 'a {
        self.descriptors
            .chunks_exact(DESCRIPTOR_LEN)
            .map(|d| Descriptor { len: be32(&d[0..4]), flags: be32(&d[4..8]) })
    }
}

pub fn parse_block_status(payload: &[u8]) -> Result<BlockStatus<'_>, Malformed> {
    if !block_status_len_ok(payload.len()) {
        return Err(Malformed("block status chunk of the wrong length"));
    }
    Ok(BlockStatus { context: be32(&payload[0..4]), descriptors: &payload[4..] })
}

/// The fields every error chunk starts with, and where the rest of it lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorHead {
    pub errno: u32,
    /// Bytes of message that follow (UTF-8 by the spec; a reader should not trust it).
    pub message_len: u16,
    /// Bytes after the message: fields of the chunk type's own (`ERROR_OFFSET`'s offset).
    pub rest: u32,
}

/// The start of error chunk `c`'s payload; `Err` when the message would not fit in the chunk
/// beside the type's fixed fields.
pub fn parse_error_head(c: &ChunkHeader, b: &[u8; ERROR_HEAD_LEN]) -> Result<ErrorHead, Malformed> {
    let message_len = be16(&b[4..6]);
    let room = (c.len as usize).checked_sub(error_fixed_len(c.ty));
    if room.is_none_or(|room| usize::from(message_len) > room) {
        return Err(Malformed("error message longer than its chunk"));
    }
    let rest = c.len - ERROR_HEAD_LEN as u32 - u32::from(message_len);
    Ok(ErrorHead { errno: be32(&b[0..4]), message_len, rest })
}

/// The message of an error chunk, cut to the spec's limit at a character boundary.
fn error_message(message: &str) -> &[u8] {
    let mut n = message.len().min(MAX_ERROR_MESSAGE);
    while !message.is_char_boundary(n) {
        n -= 1;
    }
    &message.as_bytes()[..n]
}

/// The most a reply puts before the bytes its sender holds: an `OFFSET_HOLE` chunk, whole.
const REPLY_HEADER_MAX: usize = CHUNK_HEADER_LEN + HOLE_PAYLOAD_LEN;

/// What a reply, or one chunk of it, sends before the bytes the sender holds in buffers of
/// its own (a READ's data, an error message). A value of fixed size: building one allocates
/// nothing, on the server's hot path.
#[derive(Clone, Copy)]
pub struct ReplyHeader {
    bytes: [u8; REPLY_HEADER_MAX],
    len: u8,
}

impl ReplyHeader {
    fn new(b: &[u8]) -> ReplyHeader {
        let mut bytes = [0u8; REPLY_HEADER_MAX];
        bytes[..b.len()].copy_from_slice(b);
        ReplyHeader { bytes, len: b.len() as u8 }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl std::ops::Deref for ReplyHeader {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl std::fmt::Debug for ReplyHeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ReplyHeader").field(&self.as_bytes()).finish()
    }
}

/// The replies to one request, framed as the connection negotiated: simple replies, or
/// structured reply chunks. Each method yields the [`ReplyHeader`] that goes before what the
/// sender holds, so that header and data leave together (one `writev`) without the data
/// being copied.
#[derive(Debug, Clone, Copy)]
pub struct Reply {
    cookie: u64,
    structured: bool,
}

impl Reply {
    /// The reply to the request with `cookie`, in structured chunks or not.
    pub fn new(cookie: u64, structured: bool) -> Reply {
        Reply { cookie, structured }
    }

    /// Success, with nothing more to send: a simple reply, or a `NONE` chunk.
    pub fn done(&self) -> ReplyHeader {
        if self.structured {
            ReplyHeader::new(&chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_NONE, self.cookie, 0))
        } else {
            ReplyHeader::new(&simple_reply(self.cookie, 0))
        }
    }

    /// Before `len` bytes of data read at `offset`: a simple reply (the data is then the
    /// whole READ, and `last` is true), or an `OFFSET_DATA` chunk, the last of the reply if
    /// `last`.
    pub fn data(&self, offset: u64, len: u32, last: bool) -> ReplyHeader {
        if self.structured {
            ReplyHeader::new(&data_chunk_header(done_flag(last), self.cookie, offset, len))
        } else {
            debug_assert!(last, "a simple reply carries the whole READ");
            ReplyHeader::new(&simple_reply(self.cookie, 0))
        }
    }

    /// An `OFFSET_HOLE` chunk: `len` bytes at `offset` read as zeroes (nothing follows it).
    /// Structured replies only: a simple reply has no way to say it.
    pub fn hole(&self, offset: u64, len: u32, last: bool) -> ReplyHeader {
        debug_assert!(self.structured, "a hole in a simple reply");
        ReplyHeader::new(&hole_chunk(done_flag(last), self.cookie, offset, len))
    }

    /// An error, which ends the reply: a simple reply, or an `ERROR` chunk followed by the
    /// message this returns beside it (cut to the spec's limit at a character boundary; empty
    /// for a simple reply, which has no room for one).
    pub fn error<'m>(&self, errno: u32, message: &'m str) -> (ReplyHeader, &'m [u8]) {
        if !self.structured {
            return (ReplyHeader::new(&simple_reply(self.cookie, errno)), &[]);
        }
        let msg = error_message(message);
        let len = (ERROR_HEAD_LEN + msg.len()) as u32;
        let mut b = [0u8; CHUNK_HEADER_LEN + ERROR_HEAD_LEN];
        b[..CHUNK_HEADER_LEN].copy_from_slice(&chunk_header(
            REPLY_FLAG_DONE,
            REPLY_TYPE_ERROR,
            self.cookie,
            len,
        ));
        b[20..24].copy_from_slice(&errno.to_be_bytes());
        b[24..26].copy_from_slice(&(msg.len() as u16).to_be_bytes());
        (ReplyHeader::new(&b), msg)
    }
}

fn done_flag(last: bool) -> u16 {
    if last {
        REPLY_FLAG_DONE
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error chunk as it goes on the wire: header, then message.
    fn error_chunk(cookie: u64, errno: u32, message: &str) -> Vec<u8> {
        let (h, msg) = Reply::new(cookie, true).error(errno, message);
        [h.as_bytes(), msg].concat()
    }

    fn header(b: &[u8]) -> ChunkHeader {
        parse_chunk_header(b[..CHUNK_HEADER_LEN].try_into().unwrap()).unwrap()
    }

    #[test]
    fn reply_headers_round_trip() {
        assert_eq!(parse_simple_reply(&simple_reply(7, EIO)), Some((7, EIO)));
        let c = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_HOLE, 9, 12);
        assert_eq!(
            parse_chunk_header(&c),
            Some(ChunkHeader { flags: REPLY_FLAG_DONE, ty: REPLY_TYPE_OFFSET_HOLE, cookie: 9, len: 12 })
        );
        assert_eq!(parse_simple_reply(c[..16].try_into().unwrap()), None);
        assert_eq!(parse_chunk_header(&[0; 20]), None);
        assert_eq!(parse_chunk_header(&[0xff; 20]), None);
    }

    #[test]
    fn replies_have_the_spec_layout() {
        let s = simple_reply(7, EIO);
        assert_eq!(&s[0..4], &[0x67, 0x44, 0x66, 0x98]);
        assert_eq!(be32(&s[4..8]), 5);
        assert_eq!(be64(&s[8..16]), 7);
        let e = error_chunk(9, EINVAL, "bad");
        assert_eq!(&e[0..4], &[0x66, 0x8e, 0x33, 0xef]);
        assert_eq!(be16(&e[4..6]), REPLY_FLAG_DONE);
        assert_eq!(be16(&e[6..8]), REPLY_TYPE_ERROR);
        assert_eq!(be64(&e[8..16]), 9);
        assert_eq!(be32(&e[16..20]), 9);
        assert_eq!(be32(&e[20..24]), EINVAL);
        assert_eq!(be16(&e[24..26]), 3);
        assert_eq!(&e[26..], b"bad");
        let d = data_chunk_header(0, 3, 1 << 33, 4096);
        assert_eq!(be16(&d[6..8]), 1);
        assert_eq!(be32(&d[16..20]), 8 + 4096);
        assert_eq!(be64(&d[20..28]), 1 << 33);
        let h = hole_chunk(REPLY_FLAG_DONE, 3, 512, 1024);
        assert_eq!(be16(&h[6..8]), 2);
        assert_eq!(be32(&h[16..20]), 12);
        assert_eq!((be64(&h[20..28]), be32(&h[28..32])), (512, 1024));
        let b = block_status_chunk(REPLY_FLAG_DONE, 3, 1, &[Descriptor::allocation(4096, true, true)]);
        assert_eq!(be16(&b[6..8]), 5);
        assert_eq!(be32(&b[16..20]), 12);
        assert_eq!((be32(&b[20..24]), be32(&b[24..28]), be32(&b[28..32])), (1, 4096, 3));
    }

    #[test]
    fn chunks_round_trip() {
        let d = data_chunk_header(REPLY_FLAG_DONE, 5, 1 << 40, 100);
        let c = header(&d);
        assert!(c.done());
        assert_eq!((c.cookie, c.payload()), (5, Ok(Payload::Data { len: 100 })));
        assert_eq!(parse_data_offset(d[20..].try_into().unwrap()), 1 << 40);

        let h = hole_chunk(0, 6, 4096, 8192);
        assert_eq!(header(&h).payload(), Ok(Payload::Hole));
        assert!(!header(&h).done());
        assert_eq!(parse_hole(h[20..].try_into().unwrap()), Hole { offset: 4096, len: 8192 });

        let descs = [Descriptor::allocation(4096, false, false), Descriptor::allocation(1 << 20, true, true)];
        let b = block_status_chunk(REPLY_FLAG_DONE, 7, 42, &descs);
        assert_eq!(header(&b).payload(), Ok(Payload::BlockStatus { len: 20 }));
        let s = parse_block_status(&b[20..]).unwrap();
        assert_eq!(s.context, 42);
        assert_eq!(s.descriptors().collect::<Vec<_>>(), descs);
        assert_eq!(descs.map(|d| (d.hole(), d.zero())), [(false, false), (true, true)]);

        let e = error_chunk(8, ENOSPC, "full");
        let c = header(&e);
        assert_eq!(c.payload(), Ok(Payload::Error));
        let head = parse_error_head(&c, e[20..26].try_into().unwrap()).unwrap();
        assert_eq!(head, ErrorHead { errno: ENOSPC, message_len: 4, rest: 0 });
        assert_eq!(&e[26..], b"full");

        let none = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_NONE, 9, 0);
        assert_eq!(header(&none).payload(), Ok(Payload::None));
    }

    #[test]
    fn error_messages_are_cut_at_a_character_boundary() {
        // 4095 bytes, then a 2-byte character across the limit.
        let long = format!("{}é", "x".repeat(MAX_ERROR_MESSAGE - 1));
        let e = error_chunk(1, EIO, &long);
        assert_eq!(e.len(), 26 + MAX_ERROR_MESSAGE - 1);
        let head = parse_error_head(&header(&e), e[20..26].try_into().unwrap()).unwrap();
        assert_eq!(usize::from(head.message_len), MAX_ERROR_MESSAGE - 1);
    }

    #[test]
    fn malformed_chunks_are_refused_before_their_payload() {
        let bad = |flags, ty, len| ChunkHeader { flags, ty, cookie: 1, len }.payload();
        let done = REPLY_FLAG_DONE;
        assert!(bad(done, REPLY_TYPE_NONE, 4).is_err());
        assert!(bad(0, REPLY_TYPE_NONE, 0).is_err());
        assert!(bad(done, REPLY_TYPE_OFFSET_DATA, 8).is_err());
        assert_eq!(bad(done, REPLY_TYPE_OFFSET_DATA, 9), Ok(Payload::Data { len: 1 }));
        assert!(bad(done, REPLY_TYPE_OFFSET_HOLE, 11).is_err());
        assert!(bad(done, REPLY_TYPE_OFFSET_HOLE, 13).is_err());
        assert!(bad(done, REPLY_TYPE_BLOCK_STATUS, 4).is_err());
        assert!(bad(done, REPLY_TYPE_BLOCK_STATUS, 13).is_err());
        assert!(bad(done, REPLY_TYPE_ERROR, 5).is_err());
        assert!(bad(done, REPLY_TYPE_ERROR_OFFSET, 13).is_err());
        assert_eq!(bad(done, REPLY_TYPE_ERROR_OFFSET, 14), Ok(Payload::Error));
        // Unknown error types need only the common fields; other unknown types are for the
        // reader to refuse.
        assert_eq!(bad(done, (1 << 15) | 9, 6), Ok(Payload::Error));
        assert_eq!(bad(done, 6, 4), Ok(Payload::Unknown(6)));
        assert!(bad(done, REPLY_TYPE_ERROR, u32::MAX).is_ok());
        assert!(parse_block_status(&[]).is_err());
        assert!(parse_block_status(&[0; 11]).is_err());
        assert!(parse_block_status(&[0; 13]).is_err());
    }

    #[test]
    fn error_messages_must_fit_their_chunk() {
        let head = |len: u16| {
            let mut b = [0u8; ERROR_HEAD_LEN];
            b[0..4].copy_from_slice(&EIO.to_be_bytes());
            b[4..6].copy_from_slice(&len.to_be_bytes());
            b
        };
        let c = |ty, len| ChunkHeader { flags: REPLY_FLAG_DONE, ty, cookie: 1, len };
        assert!(parse_error_head(&c(REPLY_TYPE_ERROR, 8), &head(3)).is_err());
        assert_eq!(
            parse_error_head(&c(REPLY_TYPE_ERROR, 8), &head(2)),
            Ok(ErrorHead { errno: EIO, message_len: 2, rest: 0 })
        );
        // ERROR_OFFSET keeps 8 bytes for its offset, after the message.
        assert!(parse_error_head(&c(REPLY_TYPE_ERROR_OFFSET, 16), &head(3)).is_err());
        assert_eq!(parse_error_head(&c(REPLY_TYPE_ERROR_OFFSET, 16), &head(2)).unwrap().rest, 8);
        // Unknown error types: whatever is not message is theirs.
        assert_eq!(parse_error_head(&c((1 << 15) | 9, 14), &head(5)).unwrap().rest, 3);
        // A header too short for the fields themselves (not checked by payload() first).
        assert!(parse_error_head(&c(REPLY_TYPE_ERROR, 2), &head(0)).is_err());
        assert!(parse_error_head(&c(REPLY_TYPE_ERROR, u32::MAX), &head(u16::MAX)).is_ok());
    }

    /// Whatever the bytes, decoding answers `None` or `Err`: it never panics.
    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut rng = crate::testing::conformance::Rng::new(0x2545_f491_4f6c_dd1d);
        for i in 0..20_000 {
            let mut b = [0u8; 40];
            rng.fill(&mut b);
            // Mostly a good magic and a type near the known ones, so that the checks after
            // the magic run; small lengths, so that they are near the limits.
            if i % 4 != 0 {
                b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
                b[6] = if i % 3 == 0 { 0x80 } else { 0 };
                b[7] %= 8;
                b[16..19].fill(0);
            }
            let _ = parse_simple_reply(b[..16].try_into().unwrap());
            if let Some(c) = parse_chunk_header(b[..20].try_into().unwrap()) {
                let _ = c.payload();
                let _ = parse_error_head(&c, b[20..26].try_into().unwrap());
            }
            let _ = parse_hole(b[20..32].try_into().unwrap());
            let _ = parse_data_offset(b[20..28].try_into().unwrap());
            if let Ok(s) = parse_block_status(&b[..rng.below(41) as usize]) {
                assert!(s.descriptors().count() >= 1);
            }
        }
    }

    #[test]
    fn reply_builds_simple_replies_or_chunks() {
        let simple = Reply::new(7, false);
        assert_eq!(*simple.done(), simple_reply(7, 0));
        assert_eq!(*simple.data(4096, 512, true), simple_reply(7, 0));
        let (h, msg) = simple.error(EIO, "lost");
        assert_eq!((&*h, msg), (&simple_reply(7, EIO)[..], &b""[..]));

        let chunks = Reply::new(7, true);
        assert_eq!(*chunks.done(), chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_NONE, 7, 0));
        assert_eq!(*chunks.data(4096, 512, true), data_chunk_header(REPLY_FLAG_DONE, 7, 4096, 512));
        assert_eq!(*chunks.data(4096, 512, false), data_chunk_header(0, 7, 4096, 512));
        assert_eq!(*chunks.hole(0, 4096, false), hole_chunk(0, 7, 0, 4096));
        assert_eq!(*chunks.hole(0, 4096, true), hole_chunk(REPLY_FLAG_DONE, 7, 0, 4096));
        let (h, msg) = chunks.error(ENOSPC, "full");
        assert_eq!(msg, b"full");
        let c = header(&h);
        assert_eq!((c.cookie, c.done(), c.payload()), (7, true, Ok(Payload::Error)));
        let head = parse_error_head(&c, h[20..26].try_into().unwrap()).unwrap();
        assert_eq!(head, ErrorHead { errno: ENOSPC, message_len: 4, rest: 0 });
    }
}
