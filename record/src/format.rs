//! The records the preload library leaves for `lightfoot run`: one per file descriptor it
//! looked at, appended to `$LIGHTFOOT_RUN_DIR/files` in one `writev` each (so the records of
//! every process of the run follow each other whole, in the order the looks happened).
//!
//! A record is a [`Header`] ([`Header::LEN`] bytes, native byte order: written and read on one
//! machine), the path (`path_len` bytes, as `/proc/self/fd/N` names it), then the bitmap of the
//! blocks that held pages at first sight ([`bitmap_len`] bytes, bit `b % 8` of byte `b / 8`),
//! absent when no page of the file was cached then. The first record of a file (device, inode)
//! is its first sight.

/// "LFR1".
pub const MAGIC: u32 = u32::from_le_bytes(*b"LFR1");

/// The descriptor could write.
pub const WRITABLE: u32 = 1;
/// Not covered: cachestat refused the file (EPERM: not writable by the caller, nor owned).
pub const NOT_COVERED_EPERM: u32 = 2;
/// Not covered: no cachestat on this kernel (before 6.5).
pub const NOT_COVERED_NOSYS: u32 = 4;
/// Not covered: another cachestat error.
pub const NOT_COVERED_OTHER: u32 = 8;
/// Any of the reasons a file is not covered (its residency is unknown: nothing is dropped).
pub const NOT_COVERED: u32 = NOT_COVERED_EPERM | NOT_COVERED_NOSYS | NOT_COVERED_OTHER;
/// Some pages were cached but no bitmap could be made: every block counts as cached.
pub const ALL_CACHED: u32 = 16;
/// Not a first sight: what a descriptor moved, written when it is finished (closed). `size`
/// holds the bytes read, `cached_pages` the bytes written, `evicted_pages` the pages its drops
/// took out of the cache; no path, no bitmap.
pub const DONE: u32 = 32;

/// The flags of a file whose first look, by cachestat, failed with `errno`.
pub fn not_covered(errno: i32, writable: bool) -> u32 {
    let w = if writable { WRITABLE } else { 0 };
    w | match errno {
        libc::EPERM => NOT_COVERED_EPERM,
        libc::ENOSYS => NOT_COVERED_NOSYS,
        _ => NOT_COVERED_OTHER,
    }
}

/// The fixed part of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub magic: u32,
    /// Header, path and bitmap.
    pub len: u32,
    pub flags: u32,
    pub pid: u32,
    /// -1 in a [`DONE`] record.
    pub fd: i32,
    pub path_len: u32,
    pub dev: u64,
    pub ino: u64,
    /// Bytes at first sight.
    pub size: u64,
    /// Pages cached at first sight.
    pub cached_pages: u64,
    /// Block size, as a shift ([`crate::SHIFT`]).
    pub block_shift: u32,
    /// In a [`DONE`] record: the pages the descriptor's drops took out (saturating; 16 TiB).
    pub evicted_pages: u32,
}

/// Where each field of [`Header`] is: six 4-byte fields, four 8-byte ones, two 4-byte ones,
/// as a `repr(C)` struct of them would lay them out (no padding).
const U32S: [usize; 6] = [0, 4, 8, 12, 16, 20];
const U64S: [usize; 4] = [24, 32, 40, 48];
const TAIL: [usize; 2] = [56, 60];

impl Header {
    /// Bytes of a header.
    pub const LEN: usize = 64;

    /// A header of `flags` for what process `pid`'s descriptor `fd` saw of the file (`dev`,
    /// `ino`), followed by a path of `path_len` bytes and a bitmap of `bitmap_len` bytes.
    pub fn new(
        flags: u32,
        pid: u32,
        fd: i32,
        dev: u64,
        ino: u64,
        path_len: usize,
        bitmap_len: usize,
    ) -> Header {
        Header {
            magic: MAGIC,
            len: (Header::LEN + path_len + bitmap_len) as u32,
            flags,
            pid,
            fd,
            path_len: path_len as u32,
            dev,
            ino,
            size: 0,
            cached_pages: 0,
            block_shift: crate::SHIFT,
            evicted_pages: 0,
        }
    }

    /// The header as it is written.
    pub fn encode(&self) -> [u8; Header::LEN] {
        let mut b = [0u8; Header::LEN];
        let u32s = [self.magic, self.len, self.flags, self.pid, self.fd as u32, self.path_len];
        for (at, v) in U32S.into_iter().zip(u32s) {
            b[at..at + 4].copy_from_slice(&v.to_ne_bytes());
        }
        for (at, v) in U64S.into_iter().zip([self.dev, self.ino, self.size, self.cached_pages]) {
            b[at..at + 8].copy_from_slice(&v.to_ne_bytes());
        }
        for (at, v) in TAIL.into_iter().zip([self.block_shift, self.evicted_pages]) {
            b[at..at + 4].copy_from_slice(&v.to_ne_bytes());
        }
        b
    }

    /// The header at the start of `b`, or `None` if `b` is shorter than one.
    pub fn decode(b: &[u8]) -> Option<Header> {
        let b: &[u8; Header::LEN] = b.get(..Header::LEN)?.try_into().ok()?;
        let u32_at = |at: usize| u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let u64_at = |at: usize| {
            let mut v = [0u8; 8];
            v.copy_from_slice(&b[at..at + 8]);
            u64::from_ne_bytes(v)
        };
        Some(Header {
            magic: u32_at(U32S[0]),
            len: u32_at(U32S[1]),
            flags: u32_at(U32S[2]),
            pid: u32_at(U32S[3]),
            fd: u32_at(U32S[4]) as i32,
            path_len: u32_at(U32S[5]),
            dev: u64_at(U64S[0]),
            ino: u64_at(U64S[1]),
            size: u64_at(U64S[2]),
            cached_pages: u64_at(U64S[3]),
            block_shift: u32_at(TAIL[0]),
            evicted_pages: u32_at(TAIL[1]),
        })
    }

    /// Whether the file's residency was seen (else nothing of it is dropped).
    pub fn covered(&self) -> bool {
        self.flags & NOT_COVERED == 0
    }
}

/// One record read back: its header, path and bitmap, borrowed from the log.
#[derive(Debug, Clone, Copy)]
pub struct Entry<'a> {
    pub header: Header,
    pub path: &'a [u8],
    pub bits: &'a [u8],
}

/// The records in `log`, in the order they were written.
pub fn records(log: &[u8]) -> Records<'_> {
    Records { log }
}

/// The iterator of [`records`]: it stops at the first bytes that are not a whole record (a torn
/// tail cannot come from a process killed mid-append, as the append is one `writev`, but a
/// log that ends early is read as far as it goes).
pub struct Records<'a> {
    log: &'a [u8],
}

impl<'a> Iterator for Records<'a> {
    type Item = Entry<'a>;

    fn next(&mut self) -> Option<Entry<'a>> {
        let h = Header::decode(self.log)?;
        let (len, path_len) = (h.len as usize, h.path_len as usize);
        if h.magic != MAGIC || len < Header::LEN || len > self.log.len() || Header::LEN + path_len > len {
            self.log = &[];
            return None;
        }
        let (record, rest) = self.log.split_at(len);
        self.log = rest;
        let (path, bits) = record[Header::LEN..].split_at(path_len);
        Some(Entry { header: h, path, bits })
    }
}

/// Bytes of the bitmap of `blocks` blocks.
pub const fn bitmap_len(blocks: u64) -> usize {
    blocks.div_ceil(8) as usize
}

/// Whether block `b`'s bit is set in `bits` (false past its end).
pub fn is_set(bits: &[u8], b: u64) -> bool {
    usize::try_from(b / 8).ok().and_then(|i| bits.get(i)).is_some_and(|byte| byte >> (b % 8) & 1 == 1)
}

/// Sets block `b`'s bit in `bits` (nothing past its end).
pub fn set(bits: &mut [u8], b: u64) {
    if let Some(byte) = usize::try_from(b / 8).ok().and_then(|i| bits.get_mut(i)) {
        *byte |= 1 << (b % 8);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(flags: u32, path: &str, bits: &[u8]) -> Vec<u8> {
        let mut h = Header::new(flags, 42, 7, 3, 99, path.len(), bits.len());
        (h.size, h.cached_pages, h.evicted_pages) = (6 << 20, 10, 5);
        let mut v = h.encode().to_vec();
        v.extend_from_slice(path.as_bytes());
        v.extend_from_slice(bits);
        v
    }

    #[test]
    fn the_header_is_laid_out_as_a_repr_c_struct_of_its_fields() {
        let mut h = Header::new(WRITABLE | ALL_CACHED, 0x0102_0304, -1, u64::MAX - 1, 2, 5, 3);
        (h.size, h.cached_pages, h.evicted_pages) = (1 << 40, 7, 9);
        let b = h.encode();
        assert_eq!(&b[0..4], b"LFR1");
        assert_eq!(u32::from_ne_bytes(b[4..8].try_into().unwrap()), 64 + 5 + 3);
        assert_eq!(i32::from_ne_bytes(b[16..20].try_into().unwrap()), -1);
        assert_eq!(u64::from_ne_bytes(b[24..32].try_into().unwrap()), u64::MAX - 1);
        assert_eq!(u64::from_ne_bytes(b[40..48].try_into().unwrap()), 1 << 40);
        assert_eq!(u32::from_ne_bytes(b[56..60].try_into().unwrap()), 21);
        assert_eq!(u32::from_ne_bytes(b[60..64].try_into().unwrap()), 9);
        assert_eq!(Header::decode(&b), Some(h));
        assert_eq!(Header::decode(&b[..63]), None);
    }

    #[test]
    fn records_read_back_in_order_and_a_torn_tail_is_ignored() {
        let mut log = record(WRITABLE, "/a/b", &[0b101]);
        log.extend(record(NOT_COVERED_EPERM, "/c", &[]));
        log.extend(&record(0, "/torn", &[1])[..68]);
        let r: Vec<Entry> = records(&log).collect();
        assert_eq!(r.len(), 2);
        assert_eq!(
            (r[0].path, r[0].bits, r[0].header.pid, r[0].header.size),
            (&b"/a/b"[..], &[0b101][..], 42, 6 << 20)
        );
        assert_eq!((r[1].path, r[1].bits), (&b"/c"[..], &[][..]));
        assert!(r[0].header.covered() && !r[1].header.covered());
        let mut bad = record(0, "/x", &[]);
        bad[0] = b'X';
        assert_eq!(records(&bad).count(), 0);
        let mut long_path = record(0, "/x", &[]);
        long_path[20] = 200;
        assert_eq!(records(&long_path).count(), 0);
    }

    #[test]
    fn bitmap_bits_are_b_mod_8_of_byte_b_div_8() {
        let mut bits = [0u8; 2];
        for b in [0, 2, 9, 16] {
            set(&mut bits, b);
        }
        assert_eq!(bits, [0b101, 0b10]);
        assert!(is_set(&bits, 0) && !is_set(&bits, 1) && is_set(&bits, 9) && !is_set(&bits, 16));
        assert_eq!((bitmap_len(0), bitmap_len(1), bitmap_len(8), bitmap_len(9)), (0, 1, 1, 2));
    }

    #[test]
    fn a_failed_look_maps_to_the_reason_it_is_not_covered() {
        assert_eq!(not_covered(libc::EPERM, true), WRITABLE | NOT_COVERED_EPERM);
        assert_eq!(not_covered(libc::ENOSYS, false), NOT_COVERED_NOSYS);
        assert_eq!(not_covered(libc::EIO, false), NOT_COVERED_OTHER);
    }
}
