//! Fuzz harnesses, as plain functions of the fuzzer's bytes: `fuzz/fuzz_targets/*.rs` are thin
//! cargo-fuzz wrappers around them, and `tests/fuzz_replay.rs` replays the kept corpus and
//! every crash found through the same functions on stable Rust (`make test`). Each panics
//! when an invariant breaks; that is what the fuzzer reports.
//!
//! - [`handshake`]: arbitrary client bytes into the negotiation over an in-memory stream;
//!   every reply is checked against what the spec asks for the options sent (a reference
//!   reading of the client's bytes written here, independent of the server's parser), and the
//!   handshake must end exactly where the spec says it ends.
//! - [`request`]: request header decoding and validation (`parse_request`,
//!   `validate::check`): every accepted request is in bounds, allowed and fits the limits;
//!   only an oversized WRITE closes the connection.
//! - [`connection`]: a structured decoder turns the bytes into NBD commands (well-formed and
//!   malformed, single and in bursts) sent to a real `Server::connection` over the memory
//!   backend with each filter stack (none, prefetch, coalesce, both), over
//!   [`super::duplex`]; every reply is checked against a byte-vector model of the image and
//!   the errors the spec names, and the image is compared with the model at the end.
//! - [`bitmap`]: the dirty bitmap file's reader: never a panic, only what the writer writes
//!   accepted, and what is accepted consistent.
//! - [`s3_records`]: an `s3://` block image's manifest and lease records, read from any bytes.

pub mod bitmap;
pub mod connection;
pub mod handshake;
pub mod request;
pub mod s3_records;

/// Reads the fuzzer's bytes as numbers; past the end everything reads as zero, so every input
/// decodes to something.
pub struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Input<'a> {
        Input(data)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Up to `n` bytes (fewer at the end).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        head
    }

    fn fixed<const N: usize>(&mut self) -> [u8; N] {
        let mut b = [0u8; N];
        let got = self.bytes(N);
        b[..got.len()].copy_from_slice(got);
        b
    }

    pub fn u8(&mut self) -> u8 {
        self.fixed::<1>()[0]
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.fixed())
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.fixed())
    }

    pub fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.fixed())
    }
}
