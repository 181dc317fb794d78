//! Read-around: a small read that misses in a chunk other reads touched lately reads the
//! whole chunk into the buffer, and the chunk stays there after it is read through.
//!
//! A guest's file system reads its metadata (inode tables, directories, extent blocks) and
//! its small files 4-16 KiB at a time, near what it read a moment before but too scattered
//! for a stream: on a whole-filesystem scan, 2,582 of 38,000 reads missed the buffer that
//! way, each a device round trip, where the host page cache under a peer hit. Reading the
//! chunk around such a miss serves the next ones from memory.
//!
//! It pays only where the reads come back to the chunk: on random small files the chunk
//! around each file is mostly read in vain (traces: 154 MiB read around to save 14 % of
//! 3,193 misses, on 25 MiB the guest read). So read-around spends credit, as the kernel's mmap
//! read-around backs off on misses: each chunk costs the bytes the read did not ask for,
//! each byte later served from such a chunk earns [`GAIN`] bytes back, and it stops while
//! the credit is spent. It breaks even when a fifth of what it reads is used: random reads
//! over data 8 times the buffer's size find an eighth of it there by chance, and at 8 bytes a
//! byte they kept read-around going (420 chunks in a 5 s fio run, for 4 % of hits).

use std::collections::VecDeque;

use super::buffer::CHUNK;

/// Chunks remembered as touched by recent reads.
const RECENT: usize = 64;
/// Bytes of credit earned per byte served from a chunk read around.
pub const GAIN: i64 = 5;
/// Credit at the start, and its cap: four chunks' worth to try with, and no more than 32
/// chunks of read-around in a row that nobody reads.
const START: i64 = 4 * CHUNK as i64;
const CAP: i64 = 32 * CHUNK as i64;

pub struct ReadAround {
    /// Chunk starts touched by recent reads, the latest last; distinct.
    recent: VecDeque<u64>,
    credit: i64,
    /// Chunks read around so far (for `--stats`).
    pub chunks: u64,
}

impl Default for ReadAround {
    fn default() -> Self {
        ReadAround { recent: VecDeque::with_capacity(RECENT), credit: START, chunks: 0 }
    }
}

impl ReadAround {
    /// Whether a read of `[offset, offset+len)` that misses should read its chunks whole:
    /// recent reads touched every one of them, and read-around has credit left.
    pub fn wants(&self, offset: u64, len: u64) -> bool {
        self.credit > 0 && chunks(offset, len).all(|c| self.recent.contains(&c))
    }

    /// Records that a read touched the chunks of `[offset, offset+len)`.
    pub fn touch(&mut self, offset: u64, len: u64) {
        for c in chunks(offset, len) {
            // From the latest: a stream's next read is most often in the chunk it just read.
            if self.recent.back() == Some(&c) {
                continue;
            }
            if let Some(i) = self.recent.iter().rposition(|&r| r == c) {
                self.recent.remove(i);
            } else if self.recent.len() == RECENT {
                self.recent.pop_front();
            }
            self.recent.push_back(c);
        }
    }

    /// A chunk of `len` bytes read around a read that wanted `wanted` of them.
    pub fn spend(&mut self, len: u64, wanted: u64) {
        self.chunks += 1;
        self.credit -= len.saturating_sub(wanted) as i64;
    }

    /// `len` bytes served from chunks read around.
    pub fn earn(&mut self, len: u64) {
        self.credit = (self.credit + GAIN * len as i64).min(CAP);
    }
}

/// The chunk starts `[offset, offset+len)` lies in.
fn chunks(offset: u64, len: u64) -> impl Iterator<Item = u64> {
    let first = offset / CHUNK;
    let last = (offset + len.max(1) - 1) / CHUNK;
    (first..=last).map(|c| c * CHUNK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_chunks_touched_lately_are_read_around() {
        let mut a = ReadAround::default();
        assert!(!a.wants(0, 4096), "nothing touched yet");
        a.touch(8192, 4096);
        assert!(a.wants(0, 4096));
        assert!(!a.wants(CHUNK - 4096, 8192), "crosses into a chunk not touched");
        for i in 1..=RECENT as u64 {
            a.touch(i * CHUNK, 4096);
        }
        assert!(!a.wants(0, 4096), "touched, but {RECENT} chunks ago");
        assert!(a.wants(RECENT as u64 * CHUNK + 100, 1));
    }

    #[test]
    fn read_around_stops_when_it_is_not_read_and_resumes_when_it_is() {
        let mut a = ReadAround::default();
        a.touch(0, 4096);
        let mut tries = 0;
        while a.wants(0, 4096) {
            a.spend(CHUNK, 4096);
            tries += 1;
        }
        assert_eq!(tries, 5, "4 chunks of credit, each costing a little less than a chunk");
        // What is read from chunks read around pays for them again, up to the cap.
        a.earn(CHUNK / GAIN as u64);
        assert!(a.wants(0, 4096));
        a.earn(1 << 40);
        let mut tries = 0;
        while a.wants(0, 4096) {
            a.spend(CHUNK, 0);
            tries += 1;
        }
        assert_eq!(tries, 32);
    }
}
