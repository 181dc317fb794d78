//! Requests the server's minimum block size does not divide. A server that advertised a
//! minimum (qemu-nbd or `lightfoot serve --cache=direct` over O_DIRECT: 512 or 4096) may
//! reject anything else with EINVAL, so the client widens reads, and writes partial blocks by
//! read-modify-write under a per-block lock: two unaligned writes that share a block (and
//! nothing else) must not undo each other. An aligned write can only share a block with an
//! unaligned one by overlapping it, where the order is the caller's business anyway.
//!
//! The copy engine's requests are aligned (whole 64 KiB blocks, up to the end of the export),
//! so this path costs copies nothing; it keeps the backend byte-addressable for everyone else.

use std::sync::Mutex;

use super::NbdBackend;
use crate::error::{Error, ErrorKind, Op, Result};

/// Lock stripes for read-modify-write, by block number.
pub(super) struct BlockLocks(Vec<Mutex<()>>);

impl Default for BlockLocks {
    fn default() -> Self {
        BlockLocks((0..64).map(|_| Mutex::new(())).collect())
    }
}

impl NbdBackend {
    fn min_block(&self) -> u64 {
        u64::from(self.info.block.minimum)
    }

    /// True when `[offset, offset+len)` starts on a block and ends on one or at the end.
    pub(super) fn aligned(&self, offset: u64, len: u64) -> bool {
        let m = self.min_block();
        let end = offset + len;
        offset.is_multiple_of(m) && (end.is_multiple_of(m) || end == self.info.size)
    }

    /// The smallest aligned range covering `[offset, offset+len)`, within the export.
    pub(super) fn widen(&self, offset: u64, len: u64) -> (u64, u64) {
        let m = self.min_block();
        let start = offset / m * m;
        let end = (offset + len).div_ceil(m).saturating_mul(m).min(self.info.size);
        (start, end - start)
    }

    pub(super) fn read_unaligned(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let (start, len) = self.widen(offset, buf.len() as u64);
        let mut tmp = vec![0u8; len as usize];
        self.read_pieces(&mut tmp, start)?;
        let skip = (offset - start) as usize;
        buf.copy_from_slice(&tmp[skip..skip + buf.len()]);
        Ok(())
    }

    pub(super) fn write_unaligned(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let end = offset + buf.len() as u64;
        let (mid_start, mid_len) = self.shrink(offset, buf.len() as u64);
        let mid_end = mid_start + mid_len;
        if mid_start > offset {
            self.modify_block(&buf[..(mid_start - offset) as usize], offset, fua)?;
        }
        if mid_len > 0 {
            self.write_pieces(
                &buf[(mid_start - offset) as usize..(mid_end - offset) as usize],
                mid_start,
                fua,
            )?;
        }
        if mid_end < end {
            self.modify_block(&buf[(mid_end - offset) as usize..], mid_end, fua)?;
        }
        Ok(())
    }

    /// Writes `data` into the one block that holds it, by reading and rewriting that block.
    fn modify_block(&self, data: &[u8], offset: u64, fua: bool) -> Result<()> {
        let (start, len) = self.widen(offset, data.len() as u64);
        debug_assert!(len <= self.min_block());
        let stripe = (start / self.min_block()) as usize % self.locks.0.len();
        let _guard = self.locks.0[stripe].lock().unwrap();
        let mut block = vec![0u8; len as usize];
        self.read_pieces(&mut block, start)?;
        let at = (offset - start) as usize;
        block[at..at + data.len()].copy_from_slice(data);
        self.write_pieces(&block, start, fua)
    }

    /// Zeroes the partial blocks at either end by writing zeroes; returns the aligned middle
    /// (possibly empty) for WRITE_ZEROES.
    pub(super) fn zero_edges(&self, offset: u64, len: u64, fast: bool, fua: bool) -> Result<(u64, u64)> {
        let end = offset + len;
        let (mid_start, mid_len) = self.shrink(offset, len);
        let mid_end = mid_start + mid_len;
        if (mid_start > offset || mid_end < end) && fast {
            return Err(Error::new(ErrorKind::NotSupported, Op::Zero)
                .path(&self.name)
                .at(offset, len)
                .detail("no fast zero of partial blocks"));
        }
        let zeroes = vec![0u8; self.min_block() as usize];
        if mid_start > offset {
            self.write_unaligned(&zeroes[..(mid_start - offset) as usize], offset, fua)?;
        }
        if mid_end < end {
            self.write_unaligned(&zeroes[..(end - mid_end) as usize], mid_end, fua)?;
        }
        Ok((mid_start, mid_end - mid_start))
    }

    /// The whole blocks inside `[offset, offset+len)` (a block cut by the export's end counts
    /// as whole): the part a trim covers, and the aligned middle of writes and zeroes.
    pub(super) fn shrink(&self, offset: u64, len: u64) -> (u64, u64) {
        let m = self.min_block();
        let end = offset + len;
        let start = offset.div_ceil(m).saturating_mul(m).min(end);
        let stop = if end == self.info.size { end } else { (end / m * m).max(start) };
        (start, stop - start)
    }
}
