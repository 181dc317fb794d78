//! The bitmap file's reader (`bitmap::format::decode`) on any bytes: it never panics, it
//! accepts only what `encode` would write (re-encoding gives the same bytes back), and what it
//! accepts is consistent (each bitmap covers the image exactly, its changed bytes are the
//! sum of its dirty runs).
//!
//! An input whose first byte is odd has the rest of it checked with a CRC-32 appended first,
//! so the fuzzer gets past the checksum to the fields behind it; even, the bytes go in as
//! they are (the checksum's own refusals).

use crate::bitmap::format::{crc32, decode, encode};

pub fn run(data: &[u8]) {
    let fixed;
    let bytes = match data.split_first() {
        Some((mode, rest)) if mode & 1 == 1 => {
            fixed = [rest, &crc32(rest).to_le_bytes()[..]].concat();
            &fixed[..]
        }
        Some((_, rest)) => rest,
        None => data,
    };
    let Ok(s) = decode(bytes) else { return };
    assert_eq!(encode(&s), bytes, "accepted bytes re-encode to themselves");
    for b in &s.bitmaps {
        let runs = b.bits.extents(0, s.size, usize::MAX);
        assert_eq!(runs.iter().map(|r| r.0).sum::<u64>(), s.size, "{}: runs cover the image", b.name);
        let dirty: u64 = runs.iter().filter(|r| r.1).map(|r| r.0).sum();
        assert_eq!(dirty, b.bits.dirty_bytes(), "{}: changed bytes", b.name);
        assert!(runs.windows(2).all(|w| w[0].1 != w[1].1), "{}: runs alternate", b.name);
    }
}
