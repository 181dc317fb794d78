//! Evict-behind for buffered reads: residency checked per 2 MiB block just before the first
//! read in it, and the blocks the job brought into the cache evicted once read.
//!
//! Why 2 MiB-aligned blocks: `POSIX_FADV_DONTNEED` drops only whole folios and readahead builds
//! folios up to 2 MiB, so smaller ranges often drop nothing (KERNEL-NOTES). A block that held
//! any page before the job is never evicted: a pre-cached region may leak up to one block of
//! the job's pages at each edge, but never loses its own.
//!
//! Why a check just before the first read of each block rather than one snapshot at start:
//! blocks another process caches during a long job, before the job reaches them, are then
//! respected too. It only works with readahead off (`POSIX_FADV_RANDOM`), otherwise our own
//! readahead would already have loaded the block. The verdict is recorded once per file and
//! job ([`Classes`], shared with write-behind and with a server's other connections) and never
//! taken again: a block read again after it was evicted, or read by another connection, holds
//! the job's own pages then and must not pass for pre-cached (a server's connections left 9-18
//! MiB of a 256 MiB file behind that way).
//!
//! `POSIX_FADV_RANDOM` does not stop everything, though: reading a folio that another
//! reader's readahead marked (PG_readahead) still starts an asynchronous readahead window,
//! and the pages of the window past our last read stay cached (measured: 12 MiB left after a
//! DONTCACHE copy of a file whose first 16 MiB `dd` had read). So the blocks up to one
//! readahead window (`lookahead`) past each read are checked too: any that are empty before
//! the read are ours, and evicted once the reader has moved on. The same tracker therefore
//! guards DONTCACHE reads, whose own pages the kernel drops.

use std::collections::BTreeMap;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex};

use super::writebehind::Classes;

/// Eviction granularity: the largest folio readahead builds (one definition for lightfoot and
/// its preload library).
pub use lightfoot_record::BLOCK;

pub struct EvictBehind {
    /// Evict every block touched, cached before or not (`--cache=drop`).
    evict_foreign: bool,
    /// Bytes past each read checked for readahead spill.
    lookahead: u64,
    /// Most blocks of ours kept cached at once before the oldest is evicted (bounds the
    /// footprint of random readers that never finish a block).
    max_blocks: usize,
    /// Which blocks held pages before the job (one record per file and job).
    classes: Arc<Classes>,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Blocks the job brought into the cache and has not evicted yet, with the last time (a
    /// counter) they were touched.
    ours: BTreeMap<u64, u64>,
    clock: u64,
}

impl EvictBehind {
    pub fn new(evict_foreign: bool, max_bytes: u64, lookahead: u64, classes: Arc<Classes>) -> EvictBehind {
        EvictBehind {
            evict_foreign,
            lookahead,
            max_blocks: (max_bytes / BLOCK).max(2) as usize,
            classes,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn ours(&self, block: u64) -> bool {
        self.evict_foreign || self.classes.ours(block)
    }

    /// Call before reading `[offset, offset+len)`: classifies the blocks seen for the first
    /// time. `Err` only if cachestat fails (the caller then stops using this mechanism).
    pub fn before_read(&self, fd: BorrowedFd, offset: u64, len: u64) -> std::io::Result<()> {
        if !self.evict_foreign {
            self.classes.classify(fd, offset, len + self.lookahead)?;
        }
        let mut inner = self.inner.lock().unwrap();
        inner.clock += 1;
        let now = inner.clock;
        for block in blocks(offset, len + self.lookahead) {
            if self.ours(block) {
                inner.ours.insert(block, now);
            }
        }
        Ok(())
    }

    /// Call after the read: evicts the blocks of ours whose last byte this read reached, and
    /// the least recently touched ones beyond the limit. Another request may have evicted a
    /// block while this one was reading into it or past its end: the block is held again, so
    /// that the pages this read brought in go too. (squashfs rounds a read that ends on one
    /// of its blocks up by one more block: with two workers, 128 KiB at the start of the next
    /// 2 MiB block stayed behind when the other worker had already read and evicted it.)
    pub fn after_read(&self, fd: BorrowedFd, offset: u64, len: u64) {
        let end = offset + len;
        let mut evict = Vec::new();
        {
            let mut inner = self.inner.lock().unwrap();
            inner.clock += 1;
            let now = inner.clock;
            for block in blocks(offset, len + self.lookahead) {
                if !self.ours(block) {
                    continue;
                }
                if (block + 1) * BLOCK <= end {
                    inner.ours.remove(&block);
                    evict.push(block);
                } else {
                    inner.ours.insert(block, now);
                }
            }
            while inner.ours.len() > self.max_blocks {
                let oldest = inner.ours.iter().min_by_key(|(_, t)| **t).map(|(b, _)| *b).unwrap();
                inner.ours.remove(&oldest);
                evict.push(oldest);
            }
        }
        evict_blocks(fd, evict);
    }

    /// Evicts every block of ours still cached (end of job, error, Ctrl-C).
    pub fn finish(&self, fd: BorrowedFd) {
        let blocks: Vec<u64> = std::mem::take(&mut self.inner.lock().unwrap().ours).into_keys().collect();
        evict_blocks(fd, blocks);
    }

    /// Bytes of `[offset, offset+len)` in blocks of the job's own (classified by
    /// [`before_read`](Self::before_read)): what an RWF_DONTCACHE read of that range brings
    /// in for the kernel to drop.
    pub fn ours_within(&self, offset: u64, len: u64) -> u64 {
        blocks(offset, len)
            .filter(|&b| self.ours(b))
            .map(|b| (offset + len).min((b + 1) * BLOCK) - offset.max(b * BLOCK))
            .sum()
    }

    pub fn blocks_held(&self) -> usize {
        self.inner.lock().unwrap().ours.len()
    }
}

/// Block indexes touched by a byte range.
fn blocks(offset: u64, len: u64) -> std::ops::Range<u64> {
    if len == 0 {
        return 0..0;
    }
    offset / BLOCK..(offset + len).div_ceil(BLOCK)
}

/// DONTNEED on blocks, coalesced into runs of adjacent blocks (one call per run).
/// Eviction is advice: failures change nothing that was promised, so they are ignored.
fn evict_blocks(fd: BorrowedFd, mut blocks: Vec<u64>) {
    blocks.sort_unstable();
    let mut i = 0;
    while i < blocks.len() {
        let start = blocks[i];
        let mut end = start + 1;
        i += 1;
        while i < blocks.len() && blocks[i] == end {
            end += 1;
            i += 1;
        }
        super::footprint::drop_range(fd, start * BLOCK, (end - start) * BLOCK);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_range() {
        assert_eq!(blocks(0, 1), 0..1);
        assert_eq!(blocks(BLOCK - 1, 2), 0..2);
        assert_eq!(blocks(BLOCK, BLOCK), 1..2);
        assert_eq!(blocks(5, 0), 0..0);
    }
}
