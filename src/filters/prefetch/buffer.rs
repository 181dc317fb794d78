//! The prefetch buffer: chunks read ahead for streams, each dropped as soon as it has been
//! read through, within a byte limit.
//!
//! A chunk remembers which of its 4 KiB pieces a client has read (a piece counts once a read
//! covers its last byte, so 512-byte readers count too) and goes when all have: read from the
//! buffer, or read from below by a read the buffer could not serve whole (one that ran into a
//! chunk still being read ahead), or read by its stream before the chunk arrived. To make room,
//! the least recently filled or read chunk goes first, so a stream that went quiet cannot pin
//! the buffer. [`Buffer::keeping`] keeps chunks once read through, first to go for room, as
//! [`Buffer::insert_kept`] does for one chunk.

use std::collections::BTreeMap;

use crate::io::AlignedBuf;

/// Bytes per chunk: the unit of read-ahead and of eviction.
pub const CHUNK: u64 = 256 << 10;
const PIECE: u64 = 4096;
const PIECES: u32 = (CHUNK / PIECE) as u32;

/// The bytes of one chunk: an aligned buffer (O_DIRECT reads land in it without a bounce
/// buffer) holding `len` bytes (less than a chunk only at the end of the export).
pub struct Data {
    buf: AlignedBuf,
    len: usize,
}

impl Data {
    /// A chunk-sized buffer for read-ahead: a spare one if there is one (see
    /// [`Buffer::spare`]), else a new one.
    pub fn new(spare: Option<AlignedBuf>, len: usize) -> Data {
        debug_assert!(len as u64 <= CHUNK);
        Data { buf: spare.unwrap_or_else(|| AlignedBuf::new(CHUNK as usize)), len }
    }

    pub fn into_spare(self) -> AlignedBuf {
        self.buf
    }
}

impl std::ops::Deref for Data {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl std::ops::DerefMut for Data {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf[..self.len]
    }
}

/// Spare chunk buffers kept for reuse. A fresh 256 KiB allocation is an mmap, 64 page faults
/// and a munmap on release, and these VMs make fresh pages dearer still (KERNEL-NOTES).
const SPARES: usize = 8;

struct Chunk {
    data: Data,
    /// The stream it was read ahead for (a tag the caller chooses), if any.
    owner: Option<u64>,
    /// Stays once read through (first to go for room).
    keep: bool,
    /// Pieces read by a client (bit i: bytes [i*PIECE, (i+1)*PIECE)).
    read: u64,
    last_use: u64,
}

impl Chunk {
    fn done(&self) -> bool {
        let full = if PIECES == 64 { u64::MAX } else { (1u64 << PIECES) - 1 };
        let last = (self.data.len() as u64).div_ceil(PIECE) as u32;
        let mask = if last >= 64 { full } else { (1u64 << last) - 1 };
        self.read & mask == mask
    }
}

/// Counters for `--stats`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct BufferStats {
    pub hits: u64,
    pub misses: u64,
    /// Bytes read ahead and kept.
    pub prefetched: u64,
    /// Bytes read ahead and evicted or invalidated before a client read them.
    pub wasted: u64,
    /// Bytes of read-ahead not read at all: their stream had stopped by the time their turn
    /// came.
    pub dropped: u64,
    /// Reads that met their chunks on the way (read ahead, not yet landed) and were served
    /// from them once they landed, instead of reading the bytes again from below.
    pub joined: u64,
}

pub struct Buffer {
    chunks: BTreeMap<u64, Chunk>,
    /// Chunks read through stay (first to go when room is needed): see [`Buffer::keeping`].
    keep: bool,
    spares: Vec<AlignedBuf>,
    /// Spares kept whatever the limit (see [`Buffer::spares_for`]).
    in_flight: usize,
    /// Owners of chunks evicted for room before anyone read them (see [`Buffer::take_unread`]).
    unread: Vec<u64>,
    bytes: u64,
    limit: u64,
    tick: u64,
    pub stats: BufferStats,
}

impl Buffer {
    pub fn new(limit: u64) -> Buffer {
        Buffer {
            chunks: BTreeMap::new(),
            keep: false,
            spares: Vec::new(),
            in_flight: 0,
            unread: Vec::new(),
            bytes: 0,
            limit: limit.max(CHUNK),
            tick: 0,
            stats: Default::default(),
        }
    }

    /// Keeps chunks once read through, for reads that come back (metadata, over object
    /// storage, where each miss is a round trip); they are the first to go for room.
    pub fn keeping(self) -> Buffer {
        Buffer { keep: true, ..self }
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Keeps up to `chunks` spares whatever the limit: as many as read-ahead has in flight at
    /// most, which it holds anyway while reading. Once the buffer is full, each fill then
    /// reuses the buffer of the chunk the last one evicted, instead of allocating one that
    /// another thread frees: that churn of 256 KiB blocks through malloc's per-thread arenas
    /// kept twice the buffer resident (bench runs in docs/benchmarks/runs/s3-memory.md).
    pub fn spares_for(self, chunks: usize) -> Buffer {
        Buffer { in_flight: chunks, ..self }
    }

    /// A buffer from a chunk that was dropped, for the next read-ahead.
    pub fn spare(&mut self) -> Option<AlignedBuf> {
        self.spares.pop()
    }

    /// Keeps a dropped chunk's buffer for reuse: as many as fills can have in flight (see
    /// [`Buffer::spares_for`]), or up to [`SPARES`] while the chunks and the spares together
    /// stay within the limit (so a small `--prefetch-size` is not 2 MiB of spares more).
    pub fn recycle(&mut self, data: Data) {
        let spares = self.spares.len() as u64 + 1;
        if self.spares.len() < self.in_flight
            || (self.spares.len() < SPARES && self.bytes + spares * CHUNK <= self.limit)
        {
            self.spares.push(data.into_spare());
        }
    }

    pub fn contains(&self, start: u64) -> bool {
        self.chunks.contains_key(&start)
    }

    /// True if chunks hold all of `[offset, offset+len)`.
    pub fn covers(&self, offset: u64, len: u64) -> bool {
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let start = at / CHUNK * CHUNK;
            match self.chunks.get(&start) {
                Some(c) if start + (c.data.len() as u64) > at => at = (start + c.data.len() as u64).min(end),
                _ => return false,
            }
        }
        true
    }

    /// Copies `[offset, offset+buf.len())` out of the buffer if chunks hold all of it. If they
    /// do not, the read goes to the layer below; the pieces it covers in chunks that are here
    /// count as read all the same (the client has those bytes).
    pub fn serve(&mut self, buf: &mut [u8], offset: u64) -> bool {
        let end = offset + buf.len() as u64;
        // Check the whole range first: a partial hit still goes to the backend.
        if !self.covers(offset, buf.len() as u64) {
            self.stats.misses += 1;
            let held: Vec<u64> = self.chunks.range(offset / CHUNK * CHUNK..end).map(|(&s, _)| s).collect();
            for start in held {
                let len = self.chunks[&start].data.len() as u64;
                let (from, to) = (offset.max(start), end.min(start + len));
                if from < to {
                    self.mark_read(start, (from - start) as usize, (to - from) as usize);
                }
            }
            return false;
        }
        self.tick += 1;
        let mut at = offset;
        while at < end {
            let start = at / CHUNK * CHUNK;
            let c = self.chunks.get_mut(&start).expect("checked above");
            let from = (at - start) as usize;
            let n = (c.data.len() - from).min((end - at) as usize);
            let dst = (at - offset) as usize;
            buf[dst..dst + n].copy_from_slice(&c.data[from..from + n]);
            self.mark_read(start, from, n);
            at += n as u64;
        }
        self.stats.hits += 1;
        true
    }

    /// Counts the pieces of chunk `start` whose last byte `[from, from+n)` covers as read,
    /// and drops the chunk once all are.
    fn mark_read(&mut self, start: u64, from: usize, n: usize) {
        self.tick += 1;
        let c = self.chunks.get_mut(&start).expect("a held chunk");
        c.read |= pieces_ending_in(from as u64, (from + n) as u64, c.data.len() as u64);
        c.last_use = self.tick;
        if c.done() && !c.keep {
            let c = self.chunks.remove(&start).expect("just used");
            self.bytes -= c.data.len() as u64;
            self.recycle(c.data);
        }
    }

    /// Adds a chunk read ahead (`start` is chunk-aligned) for `owner`, evicting others to make
    /// room. `read`: the pieces clients already have (they read them from below before or
    /// while the chunk was on its way: see [`pieces_read`]): they count as read, and a chunk
    /// read all of is not kept (counted as wasted).
    pub fn insert(&mut self, start: u64, data: Data, owner: Option<u64>, read: u64) {
        self.put(start, data, owner, read, self.keep)
    }

    /// Adds a chunk that stays once read through, as all do when [`Buffer::keeping`].
    pub fn insert_kept(&mut self, start: u64, data: Data, read: u64) {
        self.put(start, data, None, read, true)
    }

    /// Whether a chunk that stays once read through holds part of `[offset, offset+len)`.
    pub fn kept(&self, offset: u64, len: u64) -> bool {
        self.chunks.range(offset / CHUNK * CHUNK..offset.saturating_add(len)).any(|(_, c)| c.keep)
    }

    fn put(&mut self, start: u64, data: Data, owner: Option<u64>, read: u64, keep: bool) {
        debug_assert_eq!(start % CHUNK, 0);
        let len = data.len() as u64;
        if let Some(old) = self.chunks.remove(&start) {
            self.bytes -= old.data.len() as u64;
            self.recycle(old.data);
        }
        let chunk = Chunk { data, owner, keep, read, last_use: 0 };
        if chunk.done() && !keep {
            self.stats.prefetched += len;
            self.stats.wasted += len;
            self.recycle(chunk.data);
            return;
        }
        while self.bytes + len > self.limit && !self.chunks.is_empty() {
            self.evict_one();
        }
        self.tick += 1;
        self.bytes += len;
        self.stats.prefetched += len;
        self.chunks.insert(start, Chunk { last_use: self.tick, ..chunk });
        // Spares give way to chunks, down to those kept for fills in flight: dropping those
        // would have every fill of a full buffer fault in fresh pages.
        while self.spares.len() > self.in_flight
            && self.bytes + self.spares.len() as u64 * CHUNK > self.limit
            && self.spares.pop().is_some()
        {}
    }

    fn evict_one(&mut self) {
        // Chunks read through (kept only when keeping) first; then the least recently filled
        // or read. Partly read chunks do not outrank fresh read-ahead: a stream that moved on
        // leaves behind chunks it read part of (the rest is another file's), which would
        // otherwise fill the buffer and have each new chunk evicted as it lands.
        let victim =
            self.chunks.iter().min_by_key(|(_, c)| (!c.done(), c.last_use)).map(|(&s, c)| (s, c.read == 0));
        if let Some((s, untouched)) = victim {
            let c = self.chunks.remove(&s).unwrap();
            self.bytes -= c.data.len() as u64;
            if untouched {
                self.stats.wasted += c.data.len() as u64;
                self.unread.extend(c.owner);
            }
            self.recycle(c.data);
        }
    }

    /// Owners whose chunks were evicted unread since the last call: their read-ahead outruns
    /// their reading. (Chunks dropped by writes do not count: that is not the reader's doing.)
    pub fn take_unread(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.unread)
    }

    /// Drops every chunk overlapping `[offset, offset+len)` (the data there changed).
    pub fn invalidate(&mut self, offset: u64, len: u64) {
        let first = offset / CHUNK * CHUNK;
        let gone: Vec<u64> = self.chunks.range(first..offset.saturating_add(len)).map(|(&s, _)| s).collect();
        for s in gone {
            let c = self.chunks.remove(&s).unwrap();
            self.bytes -= c.data.len() as u64;
            if c.read == 0 {
                self.stats.wasted += c.data.len() as u64;
            }
            self.recycle(c.data);
        }
    }
}

/// The pieces of chunk `start` (of `len` bytes) that a client read of `[offset, end)` counts
/// as read, as a mask for [`Buffer::insert`].
pub fn pieces_read(start: u64, len: u64, offset: u64, end: u64) -> u64 {
    let (from, to) = (offset.clamp(start, start + len), end.clamp(start, start + len));
    if from >= to {
        return 0;
    }
    pieces_ending_in(from - start, to - start, len)
}

/// The pieces of a chunk of `len` bytes whose last byte lies in `[from, to)`, as a mask.
fn pieces_ending_in(from: u64, to: u64, len: u64) -> u64 {
    let mut mask = 0;
    let mut piece = from / PIECE;
    while piece < u64::from(PIECES) {
        let piece_last = ((piece + 1) * PIECE).min(len) - 1;
        if piece_last >= to {
            break;
        }
        if piece_last >= from {
            mask |= 1 << piece;
        }
        piece += 1;
    }
    mask
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(fill: u8) -> Data {
        let mut d = Data::new(None, CHUNK as usize);
        d.fill(fill);
        d
    }

    #[test]
    fn a_chunk_goes_once_read_through() {
        let mut b = Buffer::new(4 * CHUNK);
        b.insert(0, chunk(7), None, 0);
        let mut buf = [0u8; 4096];
        for i in 0..(CHUNK / 4096) {
            assert!(b.serve(&mut buf, i * 4096));
            assert_eq!(buf, [7u8; 4096]);
        }
        assert_eq!(b.bytes(), 0);
        assert!(!b.serve(&mut buf, 0));
    }

    #[test]
    fn dropped_chunks_leave_their_buffers_for_reuse() {
        let mut b = Buffer::new(2 * CHUNK);
        b.insert(0, chunk(1), None, 0);
        let mut buf = vec![0u8; CHUNK as usize];
        assert!(b.serve(&mut buf, 0));
        let spare = b.spare().expect("the read-through chunk's buffer");
        assert_eq!(spare.len() as u64, CHUNK);
        b.insert(0, Data::new(Some(spare), 4096), None, 0);
        b.insert(CHUNK, chunk(2), None, 0);
        b.insert(2 * CHUNK, chunk(3), None, 0);
        assert!(b.spare().is_none(), "no room beside two chunks");
        // The two chunks read through: both buffers kept, within the limit.
        assert!(b.serve(&mut buf, CHUNK) && b.serve(&mut buf, 2 * CHUNK));
        assert_eq!(b.bytes(), 0);
        assert!(b.spare().is_some() && b.spare().is_some());
        assert!(b.spare().is_none());
    }

    /// Spare buffers count against the limit with the chunks: a full buffer keeps none, and
    /// a chunk coming in pushes them out. Before, up to 8 (2 MiB) came on top of any limit.
    #[test]
    fn spares_stay_within_the_limit() {
        let mut b = Buffer::new(4 * CHUNK);
        let mut buf = vec![0u8; CHUNK as usize];
        for i in 0..4 {
            b.insert(i * CHUNK, chunk(1), None, 0);
        }
        for i in 0..4 {
            assert!(b.serve(&mut buf, i * CHUNK));
        }
        assert_eq!(b.spares.len(), 4);
        for i in 0..3 {
            b.insert(i * CHUNK, chunk(2), None, 0);
            assert!(b.bytes() + b.spares.len() as u64 * CHUNK <= 4 * CHUNK, "chunk {i}");
        }
        assert_eq!(b.spares.len(), 1);
    }

    #[test]
    fn spares_for_fills_in_flight_are_kept_over_the_limit() {
        let mut b = Buffer::new(2 * CHUNK).spares_for(3);
        for i in 0..2 {
            b.insert(i * CHUNK, chunk(1), None, 0);
        }
        for _ in 0..4 {
            b.recycle(chunk(2));
        }
        assert_eq!(b.spares.len(), 3, "as many as fills in flight, the buffer being full");
        // A chunk landing in the full buffer evicts one and leaves the spares be.
        b.insert(2 * CHUNK, chunk(3), None, 0);
        assert_eq!((b.bytes(), b.spares.len()), (2 * CHUNK, 3));
    }

    #[test]
    fn small_reads_count_when_they_reach_a_piece_end() {
        let mut b = Buffer::new(4 * CHUNK);
        b.insert(0, chunk(1), None, 0);
        let mut buf = [0u8; 512];
        for i in 0..(CHUNK / 512) - 1 {
            assert!(b.serve(&mut buf, i * 512));
        }
        assert_eq!(b.bytes(), CHUNK, "one 512-byte piece left to read");
        assert!(b.serve(&mut buf, CHUNK - 512));
        assert_eq!(b.bytes(), 0);
    }

    #[test]
    fn reads_spanning_chunks_and_partial_hits() {
        let mut b = Buffer::new(4 * CHUNK);
        b.insert(0, chunk(1), None, 0);
        b.insert(CHUNK, chunk(2), None, 0);
        let mut buf = vec![0u8; 8192];
        assert!(b.serve(&mut buf, CHUNK - 4096));
        assert_eq!(&buf[..4096], &[1u8; 4096][..]);
        assert_eq!(&buf[4096..], &[2u8; 4096][..]);
        // Past the last chunk: a miss, and nothing is consumed by it.
        assert!(!b.serve(&mut buf, 2 * CHUNK - 4096));
        assert_eq!(b.stats.misses, 1);
    }

    /// The least recently filled or read chunk goes first, partly read or not: a stream that
    /// moved on must not leave its half-read chunks to crowd out new read-ahead.
    #[test]
    fn the_least_recently_used_chunk_goes_first() {
        let mut b = Buffer::new(2 * CHUNK);
        b.insert(0, chunk(1), None, 0);
        let mut buf = [0u8; 4096];
        assert!(b.serve(&mut buf, 0));
        b.insert(CHUNK, chunk(2), None, 0);
        b.insert(2 * CHUNK, chunk(3), None, 0);
        assert!(!b.contains(0), "the partly read chunk, used longest ago, goes");
        assert_eq!(b.stats.wasted, 0, "it was read from");
        assert!(b.serve(&mut buf, CHUNK));
        b.insert(3 * CHUNK, chunk(4), None, 0);
        assert!(b.contains(CHUNK) && !b.contains(2 * CHUNK) && b.contains(3 * CHUNK));
        assert_eq!(b.stats.wasted, CHUNK, "chunk 2 went unread");
        assert!(b.bytes() <= 2 * CHUNK);
    }

    /// Keeping, chunks read through stay, and are the first to go for room.
    #[test]
    fn kept_chunks_read_through_go_first() {
        let mut b = Buffer::new(2 * CHUNK).keeping();
        b.insert(0, chunk(1), None, 0);
        b.insert(CHUNK, chunk(2), None, 0);
        let mut buf = vec![0u8; CHUNK as usize];
        assert!(b.serve(&mut buf, CHUNK));
        assert!(b.serve(&mut buf, CHUNK), "read through, and still held");
        b.insert(2 * CHUNK, chunk(3), None, 0);
        assert!(b.contains(0) && !b.contains(CHUNK) && b.contains(2 * CHUNK));
    }

    #[test]
    fn owners_of_chunks_evicted_unread_are_reported() {
        let mut b = Buffer::new(2 * CHUNK);
        b.insert(0, chunk(1), Some(7), 0);
        b.insert(CHUNK, chunk(2), Some(8), 0);
        b.invalidate(CHUNK, 1);
        assert!(b.take_unread().is_empty(), "a write's invalidation is not the reader's fault");
        b.insert(CHUNK, chunk(2), Some(8), 0);
        b.insert(2 * CHUNK, chunk(3), Some(9), 0);
        assert_eq!(b.take_unread(), vec![7]);
        assert!(b.take_unread().is_empty());
    }

    #[test]
    fn invalidation_drops_overlapping_chunks() {
        let mut b = Buffer::new(8 * CHUNK);
        for i in 0..4 {
            b.insert(i * CHUNK, chunk(i as u8), None, 0);
        }
        b.invalidate(CHUNK + 10, 1);
        assert!(b.contains(0) && !b.contains(CHUNK) && b.contains(2 * CHUNK));
        b.invalidate(0, 4 * CHUNK);
        assert_eq!(b.bytes(), 0);
    }

    /// Bytes the client read from below count as read: a read that ran past the held chunk
    /// into one not here (a miss), and a stream that read past a chunk before it arrived.
    #[test]
    fn pieces_read_from_below_count_as_read() {
        let mut b = Buffer::new(4 * CHUNK);
        b.insert(0, chunk(1), None, 0);
        let mut buf = vec![0u8; 8192];
        // The chunk's last piece and the next chunk's first: a miss, but the piece is read.
        assert!(!b.serve(&mut buf, CHUNK - 4096));
        let mut piece = [0u8; 4096];
        for i in 0..(CHUNK / 4096 - 1) {
            assert!(b.serve(&mut piece, i * 4096));
        }
        assert!(!b.contains(0), "read through (its last piece from below) but kept");

        // Arriving after its stream read half of it: only the other half is left to read.
        b.insert(CHUNK, chunk(2), Some(3), pieces_read(CHUNK, CHUNK, 0, CHUNK + CHUNK / 2));
        for i in 0..(CHUNK / 2 / 4096) {
            assert!(b.serve(&mut piece, CHUNK + CHUNK / 2 + i * 4096));
        }
        assert!(!b.contains(CHUNK));
        assert_eq!(b.stats.wasted, 0);

        // Arriving after its stream read all of it: not kept, read ahead in vain.
        b.insert(2 * CHUNK, chunk(3), Some(3), pieces_read(2 * CHUNK, CHUNK, 0, 3 * CHUNK + 4096));
        assert!(!b.contains(2 * CHUNK));
        assert_eq!((b.bytes(), b.stats.wasted), (0, CHUNK));
    }
}
