//! [`Bits`]: one bit per block of `granularity` bytes, set when any byte of the block changed.
//! Marked by many connections at once without a lock (atomic words).

use std::sync::atomic::{AtomicU64, Ordering};

/// One dirty bitmap's bits over an image of `size` bytes.
#[derive(Debug)]
pub struct Bits {
    size: u64,
    granularity: u64,
    words: Vec<AtomicU64>,
}

impl Bits {
    /// All clean. `granularity` is a power of two.
    pub fn new(size: u64, granularity: u64) -> Bits {
        debug_assert!(granularity.is_power_of_two());
        let blocks = size.div_ceil(granularity);
        Bits { size, granularity, words: (0..blocks.div_ceil(64)).map(|_| AtomicU64::new(0)).collect() }
    }

    /// From [`Bits::to_bytes`]'s form: `None` if `bytes` has the wrong length or sets a bit
    /// past the last block.
    pub fn from_bytes(size: u64, granularity: u64, bytes: &[u8]) -> Option<Bits> {
        let blocks = size.div_ceil(granularity);
        if bytes.len() as u64 != blocks.div_ceil(8) {
            return None;
        }
        let b = Bits::new(size, granularity);
        for (i, chunk) in bytes.chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            b.words[i].store(u64::from_le_bytes(w), Ordering::Relaxed);
        }
        let tail = blocks % 64;
        let last = b.words.last().map(|w| w.load(Ordering::Relaxed)).unwrap_or(0);
        if tail != 0 && last >> tail != 0 {
            return None;
        }
        Some(b)
    }

    /// Block `i`'s bit is bit `i % 8` of byte `i / 8`; the last byte's unused bits are 0.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v: Vec<u8> =
            self.words.iter().flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes()).collect();
        v.truncate(self.blocks().div_ceil(8) as usize);
        v
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    fn blocks(&self) -> u64 {
        self.size.div_ceil(self.granularity)
    }

    fn get(&self, block: u64) -> bool {
        self.words[(block / 64) as usize].load(Ordering::Relaxed) >> (block % 64) & 1 == 1
    }

    /// Sets blocks `first..=last`.
    fn set_blocks(&self, first: u64, last: u64) {
        let (fw, lw) = (first / 64, last / 64);
        for w in fw..=lw {
            let lo = if w == fw { first % 64 } else { 0 };
            let hi = if w == lw { last % 64 } else { 63 };
            let mask = (u64::MAX >> (63 - hi)) & (u64::MAX << lo);
            let word = &self.words[w as usize];
            // Most marks land on blocks already dirty: a load is cheaper than a locked or.
            if word.load(Ordering::Relaxed) & mask != mask {
                word.fetch_or(mask, Ordering::Relaxed);
            }
        }
    }

    /// Marks every block that `offset..offset + len` touches (clipped to the image).
    pub fn mark(&self, offset: u64, len: u64) {
        let end = offset.saturating_add(len).min(self.size);
        if end > offset {
            self.set_blocks(offset / self.granularity, (end - 1) / self.granularity);
        }
    }

    /// Marks the whole image.
    pub fn mark_all(&self) {
        self.mark(0, self.size);
    }

    pub fn clear(&self) {
        for w in &self.words {
            w.store(0, Ordering::Relaxed);
        }
    }

    /// Marks every block with a byte that `other` (any granularity, same size) has dirty.
    pub fn merge(&self, other: &Bits) {
        debug_assert_eq!(self.size, other.size);
        let mut at = 0;
        for (len, dirty) in other.extents(0, other.size, usize::MAX) {
            if dirty {
                self.mark(at, len);
            }
            at += len;
        }
    }

    /// Bytes in dirty blocks (the last block counts up to the image's end).
    pub fn dirty_bytes(&self) -> u64 {
        let whole: u64 = self.words.iter().map(|w| u64::from(w.load(Ordering::Relaxed).count_ones())).sum();
        let blocks = self.blocks();
        if blocks > 0 && self.get(blocks - 1) {
            // The last block counts only up to the image's end.
            let last = self.size - (blocks - 1) * self.granularity;
            (whole - 1) * self.granularity + last
        } else {
            whole * self.granularity
        }
    }

    /// Runs of `(length, dirty)` covering `offset..offset + len` (clipped to the image) from
    /// `offset` on, at most `max` of them (then they cover less).
    pub fn extents(&self, offset: u64, len: u64, max: usize) -> Vec<(u64, bool)> {
        let end = offset.saturating_add(len).min(self.size);
        let mut runs: Vec<(u64, bool)> = Vec::new();
        let mut at = offset;
        // Runs are looked for no further than the range: a small request in a long uniform
        // stretch costs what the request covers, not the rest of the image.
        let end_block = end.div_ceil(self.granularity);
        while at < end && runs.len() < max {
            let block = at / self.granularity;
            let dirty = self.get(block);
            let next = self.run_end(block, dirty, end_block).saturating_mul(self.granularity).min(end);
            runs.push((next - at, dirty));
            at = next;
        }
        runs
    }

    /// The first block after `block` whose bit differs from `dirty`, or `limit` (at most the
    /// block count) if none before it.
    fn run_end(&self, block: u64, dirty: bool, limit: u64) -> u64 {
        let blocks = self.blocks().min(limit);
        let mut b = block + 1;
        while b < blocks {
            let w = self.words[(b / 64) as usize].load(Ordering::Relaxed);
            let w = if dirty { !w } else { w } >> (b % 64);
            if w != 0 {
                return (b + u64::from(w.trailing_zeros())).min(blocks);
            }
            b = (b / 64 + 1) * 64;
        }
        blocks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain model: one bool per block.
    fn model(size: u64, g: u64, marks: &[(u64, u64)]) -> Vec<bool> {
        let mut m = vec![false; size.div_ceil(g) as usize];
        for &(o, l) in marks {
            for b in 0..m.len() as u64 {
                let (s, e) = (b * g, ((b + 1) * g).min(size));
                if l > 0 && o < e && o + l > s {
                    m[b as usize] = true;
                }
            }
        }
        m
    }

    #[test]
    fn marks_runs_and_bytes_agree_with_a_model() {
        let g = 4096;
        let size = 200 * g + 100; // a short last block
        let marks = [(0, 1), (g - 1, 2), (5 * g, 64 * g), (130 * g + 7, 0), (199 * g, 5000), (size - 1, 1)];
        let b = Bits::new(size, g);
        for &(o, l) in &marks {
            b.mark(o, l);
        }
        let m = model(size, g, &marks);
        let runs = b.extents(0, size, usize::MAX);
        assert_eq!(runs.iter().map(|r| r.0).sum::<u64>(), size);
        let mut at = 0;
        for (len, dirty) in &runs {
            for x in (at..at + len).step_by(512) {
                assert_eq!(m[(x / g) as usize], *dirty, "byte {x}");
            }
            at += len;
        }
        let want: u64 =
            m.iter().enumerate().filter(|(_, d)| **d).map(|(i, _)| g.min(size - i as u64 * g)).sum();
        assert_eq!(b.dirty_bytes(), want);
        // From an unaligned offset, clipped, and bounded in count.
        let r = b.extents(g + 10, 10 * g, usize::MAX);
        assert_eq!(r, vec![(g - 10, true), (3 * g, false), (6 * g + 10, true)]);
        assert_eq!(b.extents(0, size, 2).len(), 2);
        // The bytes form round-trips, and stray bits past the end are refused.
        let bytes = b.to_bytes();
        assert_eq!(bytes.len(), 201usize.div_ceil(8));
        let back = Bits::from_bytes(size, g, &bytes).unwrap();
        assert_eq!(back.extents(0, size, usize::MAX), runs);
        let mut bad = bytes.clone();
        *bad.last_mut().unwrap() |= 0x80;
        assert!(Bits::from_bytes(size, g, &bad).is_none());
        assert!(Bits::from_bytes(size, g, &bytes[1..]).is_none());
    }

    #[test]
    fn merge_takes_any_granularity() {
        let size = 1 << 20;
        let fine = Bits::new(size, 4096);
        fine.mark(70_000, 1);
        let coarse = Bits::new(size, 65536);
        coarse.merge(&fine);
        assert_eq!(coarse.extents(0, size, 9), vec![(65536, false), (65536, true), (size - 131072, false)]);
        coarse.mark_all();
        assert_eq!(coarse.dirty_bytes(), size);
        coarse.clear();
        assert_eq!(coarse.dirty_bytes(), 0);
        assert_eq!(Bits::new(0, 4096).extents(0, 10, 9), vec![]);
    }
}
