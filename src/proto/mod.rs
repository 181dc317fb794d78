//! The NBD wire format, the whole of it and both ways: every byte the server and the NBD
//! client backend exchange is encoded and decoded here (the server parses requests and
//! encodes replies; the client does the opposite). No sockets, no threads, no policy:
//! `crate::server` and `crate::backend::nbd` move these bytes and decide what to send.
//! Decoders take byte slices or fixed-size arrays and answer `None` or `Err` on malformed
//! input, never a panic.
//!
//! - here: the constants, the request header ([`Request`]), big-endian field readers.
//! - [`handshake`]: the greeting, the client's flags, option requests, their data and their
//!   replies, the answer to `NBD_OPT_EXPORT_NAME`.
//! - [`reply`] (its items re-exported here): simple replies and structured reply chunks, with
//!   their payloads (`OFFSET_DATA`, `OFFSET_HOLE`, `BLOCK_STATUS` descriptors, errors).
//!   [`Reply`] frames the replies to one request, simple or structured, as fixed-size
//!   [`ReplyHeader`]s that go out ahead of the data without the data being copied.
//!
//! Written from the protocol specification (`../shared/reference/nbd-proto.md`): fixed
//! newstyle handshake, simple and structured replies, `base:allocation`. Extended headers
//! (64-bit lengths) are not implemented: [`Request`] already carries a 64-bit length and the
//! header parsers are per format, so adding them means a second parser and a second reply
//! header, nothing else.

pub mod handshake;
pub mod reply;

pub use reply::*;

/// `NBDMAGIC`, the first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: newstyle negotiation, and the magic of every option request.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of every option reply.
pub const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

/// Handshake flags (server).
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flags.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

/// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
const REP_ERR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERR | 1;
pub const REP_ERR_POLICY: u32 = REP_ERR | 2;
pub const REP_ERR_INVALID: u32 = REP_ERR | 3;
pub const REP_ERR_PLATFORM: u32 = REP_ERR | 4;
pub const REP_ERR_TLS_REQD: u32 = REP_ERR | 5;
pub const REP_ERR_UNKNOWN: u32 = REP_ERR | 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_ERR | 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_ERR | 8;
pub const REP_ERR_TOO_BIG: u32 = REP_ERR | 9;

/// Information types (`NBD_REP_INFO`).
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags.
pub const TF_HAS_FLAGS: u16 = 1 << 0;
pub const TF_READ_ONLY: u16 = 1 << 1;
pub const TF_SEND_FLUSH: u16 = 1 << 2;
pub const TF_SEND_FUA: u16 = 1 << 3;
pub const TF_ROTATIONAL: u16 = 1 << 4;
pub const TF_SEND_TRIM: u16 = 1 << 5;
pub const TF_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TF_SEND_DF: u16 = 1 << 7;
pub const TF_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TF_SEND_CACHE: u16 = 1 << 10;
pub const TF_SEND_FAST_ZERO: u16 = 1 << 11;

/// Request and reply magics.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Commands.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

/// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

/// Structured reply chunk flags and types.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) | 2;

/// `base:allocation` flags.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

/// `qemu:dirty-bitmap:NAME` flag: the extent changed since the bitmap started recording.
pub const STATE_DIRTY: u32 = 1 << 0;

/// The metadata context lightfoot serves.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// QEMU's dirty bitmaps as meta contexts: this prefix, then the bitmap's name.
pub const DIRTY_BITMAP_PREFIX: &str = "qemu:dirty-bitmap:";
/// lightfoot's own namespace, listed only (never selected): `lightfoot:epoch:NAME:E:P` says
/// that dirty bitmap NAME's epoch is E (16 hex digits) and the one before it P (0: none), so
/// that `copy --bitmap` can tell whether its destination is the copy the epoch applies to.
pub const EPOCH_PREFIX: &str = "lightfoot:epoch:";

/// `lightfoot:epoch:NAME:E:P` for bitmap `name`.
pub fn epoch_context(name: &str, epoch: u64, parent: u64) -> String {
    format!("{EPOCH_PREFIX}{name}:{epoch:016x}:{parent:016x}")
}

/// The epoch and parent of bitmap `name` from a listed context, if it is its epoch context.
pub fn parse_epoch_context(context: &str, name: &str) -> Option<(u64, u64)> {
    let rest = context.strip_prefix(EPOCH_PREFIX)?.strip_prefix(name)?.strip_prefix(':')?;
    let (e, p) = rest.split_once(':')?;
    if e.len() != 16 || p.len() != 16 {
        return None;
    }
    Some((u64::from_str_radix(e, 16).ok()?, u64::from_str_radix(p, 16).ok()?))
}

/// Error values (the spec fixes them; they equal Linux's).
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// The NBD error for a library error kind.
pub fn errno(kind: crate::ErrorKind) -> u32 {
    use crate::ErrorKind as K;
    match kind {
        K::Io | K::UnexpectedEof | K::NotFound => EIO,
        K::NoSpace => ENOSPC,
        K::InvalidInput => EINVAL,
        K::Permission => EPERM,
        K::NotSupported => ENOTSUP,
        K::Interrupted => ESHUTDOWN,
    }
}

/// Size of a compact request header.
pub const REQUEST_LEN: usize = 28;

/// A transmission request, whatever header format carried it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub cmd: u16,
    pub cookie: u64,
    pub offset: u64,
    /// 32 bits on the wire with compact headers; 64 with extended headers.
    pub len: u64,
}

/// Parses a compact request header; `None` when the magic is wrong (the connection is then
/// beyond repair and must be closed).
pub fn parse_request(b: &[u8; REQUEST_LEN]) -> Option<Request> {
    if be32(&b[0..4]) != REQUEST_MAGIC {
        return None;
    }
    Some(Request {
        flags: be16(&b[4..6]),
        cmd: be16(&b[6..8]),
        cookie: be64(&b[8..16]),
        offset: be64(&b[16..24]),
        len: u64::from(be32(&b[24..28])),
    })
}

/// Encodes a compact request header (the NBD client, and tests).
pub fn encode_request(r: &Request) -> [u8; REQUEST_LEN] {
    let mut b = [0u8; REQUEST_LEN];
    b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&r.flags.to_be_bytes());
    b[6..8].copy_from_slice(&r.cmd.to_be_bytes());
    b[8..16].copy_from_slice(&r.cookie.to_be_bytes());
    b[16..24].copy_from_slice(&r.offset.to_be_bytes());
    b[24..28].copy_from_slice(&(r.len as u32).to_be_bytes());
    b
}

pub fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

pub fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}

pub fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips() {
        let r =
            Request { flags: CMD_FLAG_FUA, cmd: CMD_WRITE, cookie: 0xdead_beef, offset: 1 << 40, len: 4096 };
        assert_eq!(parse_request(&encode_request(&r)), Some(r));
        let mut bad = encode_request(&r);
        bad[0] ^= 1;
        assert_eq!(parse_request(&bad), None);
    }
}
