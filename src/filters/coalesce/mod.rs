//! `--coalesce`: safe write coalescing. Small scattered writes are held in memory
//! and written back later, merged, as fewer and larger requests.
//!
//! - [`dirty`]: the dirty data of one block (exact byte ranges, merged when they touch), the
//!   write-back [`dirty::plan`] and the extents overlay.
//! - `stripes`: the locks (blocks hash onto 256 stripes).
//! - `writeback`: write-back of a block, of everything (FLUSH), of old blocks and under
//!   memory pressure (a background thread); flushes below; the error latch.
//! - [`Coalesce`]: the filter, over one backend that does every write-back, gap-fill read,
//!   pass-through write, zero and trim. [`Front`](super::Front)s share one `Coalesce` between
//!   users with backends of their own (the server's connections, each with its own open file), which
//!   they use for reads only: every connection sees every connection's dirty data.
//!
//! Data flow. A WRITE of at most `max_request` bytes is copied into the dirty map and answered
//! (with FUA: its blocks are written back with FUA first). A larger one, and every ZERO and
//! TRIM, goes straight down and then drops the dirty bytes it superseded, so a write after a
//! trim wins and a trim after a write discards it. READs read from below and lay the dirty
//! bytes over the result; BLOCK_STATUS marks dirty ranges as data (the file's SEEK_HOLE does
//! not know about them, and nbdcopy or qemu-img would skip them).
//!
//! Write-back of a block, under its lock. Runs separated by gaps are joined into one request
//! only when every allocation unit (the filesystem block, at most 4 KiB) of the gap holds
//! dirty bytes, like 1 KiB written every 4 KiB (see [`dirty::plan`]): the gap is read from
//! below under the lock (or known to read as zeroes) and written back unchanged. So no byte is
//! ever written that a client did not write unless it was just read from the same place (the
//! FreeBSD 2013 NFS change widened dirty ranges without that read and could write stale bytes
//! over another writer's data), and no gap over a hole in a unit nobody wrote is filled (that
//! would allocate space for zeroes nobody wrote, and can fail with ENOSPC). Dirty bytes are
//! dropped only once written; a failed write-back keeps them (reads still see them) and
//! latches the error: every later FLUSH and FUA fails.
//!
//! Locks: blocks hash onto 256 stripes, each a `RwLock` over its blocks' dirty data. Reads and
//! BLOCK_STATUS hold the read locks of their blocks' stripes across the read below and the
//! overlay (so a write-back cannot slip between them); writes into the map, write-backs,
//! pass-through writes, zeroes and trims hold write locks (ascending order, no deadlock).
//! Write-backs hold their stripe across the I/O, which is what makes a gap read equal to
//! disk: nothing else changes that block below meanwhile (every writer of the export goes
//! through this filter). Rejected: one lock for the map (nbdkit's cache filter, which
//! serialises everything), and a lock per block created on demand (a trim over a range nobody
//! wrote would have to create a lock per block, and blocks created after it started would race
//! its write below).
//!
//! Write-back happens on FLUSH (everything, from all connections, in block order on several
//! threads, then a flush below), on FUA, when more than `size`
//! bytes are dirty (writers wait while the background thread writes back the oldest blocks),
//! when a block is older than `age`, when a writer has moved past a block (the background
//! thread, so that the next FLUSH finds less to do), and on `finish` or drop.

pub mod dirty;
mod stripes;
mod writeback;
mod zeroes;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, RwLock, RwLockWriteGuard};
use std::time::{Duration, Instant};

use super::Filter;
use crate::backend::{Backend, Caps, Extent, ZeroFlags};
use crate::error::{Op, Result, Sticky};
use dirty::Block;
use stripes::STRIPES;

/// Tuning of the filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoalesceConfig {
    /// Most dirty bytes held (`--coalesce-size`); writers wait above it.
    pub size: u64,
    /// Oldest dirty data kept before it is written back (`--coalesce-age`).
    pub age: Duration,
    /// Block size: the most one write-back request spans (`--coalesce-block`). 64 KiB: no
    /// size from 32 KiB to 256 KiB measured differently, and 64 KiB merges a strided
    /// 1-in-4 KiB writer's 16 writes into one request while holding less per block than
    /// larger sizes (docs/benchmarks/runs/code-notes.md#coalesce-block).
    pub block: u64,
    /// The allocation unit below: a gap is filled only inside units that hold dirty bytes
    /// (see [`dirty::plan`]). 4 KiB by default, the block of ext4 and XFS as made by default;
    /// [`crate::filters::Stack`] takes the backend's ([`crate::backend::Caps::alloc_unit`]:
    /// a file's block, an object of an image in object storage). A larger real unit only
    /// means fewer gaps filled; a smaller one taken as 4 KiB would mean gaps filled across
    /// blocks nobody wrote.
    pub unit: u32,
    /// Writes larger than this go straight down.
    pub max_request: u64,
    /// Threads writing back in parallel on FLUSH. Without coalescing, 4 connections × 4
    /// workers have up to 16 small writes in flight; a flush that wrote back its 256 blocks
    /// one at a time would be slower than that. Not yet tuned by the benchmark.
    pub threads: usize,
}

impl Default for CoalesceConfig {
    fn default() -> Self {
        CoalesceConfig {
            size: 64 << 20,
            age: Duration::from_secs(1),
            block: 64 << 10,
            unit: 4096,
            max_request: 64 << 10,
            threads: 8,
        }
    }
}

impl CoalesceConfig {
    /// For a backend where every write is a network round trip of milliseconds (object
    /// storage: a PUT, or a GET and a PUT): 32 write-back threads rather than 8, so that a
    /// FLUSH of hundreds of objects takes a few round trips, not hundreds divided by 8.
    pub fn for_round_trips(self) -> CoalesceConfig {
        CoalesceConfig { threads: 32, ..self }
    }
}

/// The largest [`CoalesceConfig::block`] (`--coalesce-block`): one write-back request.
pub const MAX_BLOCK: u64 = 16 << 20;

/// Counters for `--stats`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct CoalesceStats {
    /// WRITE requests from clients.
    pub client_writes: u64,
    /// Of those, held in memory rather than passed down.
    pub absorbed: u64,
    /// Write requests sent to the layer below (write-backs and pass-through).
    pub backend_writes: u64,
    pub bytes_written: u64,
    /// Reads of gaps between dirty ranges, and their bytes.
    pub fill_reads: u64,
    pub bytes_filled: u64,
    /// FLUSH requests from clients, and flushes sent below (one for each).
    pub flushes: u64,
    pub backend_flushes: u64,
    /// Time FLUSHes spent writing back what was held, and flushing below, in all (µs): where
    /// a client's FLUSH waits.
    pub flush_write_back_us: u64,
    pub flush_below_us: u64,
    /// Write-backs that failed (latched).
    pub errors: u64,
    /// Dirty bytes held now, with [`dirty::RUN_COST`] for each run of them: what the memory
    /// bound counts.
    pub held: u64,
    /// The most `held` has been (counting room taken by writes on their way in): never more
    /// than `--coalesce-size`, but for a run's cost or two while a trim or zero that split
    /// runs is held ([`Coalesce::pass`]).
    pub peak_held: u64,
}

#[derive(Default)]
struct Counters {
    client_writes: AtomicU64,
    absorbed: AtomicU64,
    backend_writes: AtomicU64,
    bytes_written: AtomicU64,
    fill_reads: AtomicU64,
    bytes_filled: AtomicU64,
    flushes: AtomicU64,
    backend_flushes: AtomicU64,
    flush_write_back_us: AtomicU64,
    flush_below_us: AtomicU64,
    errors: AtomicU64,
}

type Stripe = RwLock<HashMap<u64, Block>>;

struct HeldWrites {
    inner: Arc<dyn Backend>,
    cfg: CoalesceConfig,
    /// The size of the layer below: write-back never reads or writes past it.
    size: u64,
    stripes: Vec<Stripe>,
    /// Dirty bytes held, over all stripes, and room taken by writes on their way in
    /// ([`HeldWrites::reserve`]). Decremented only after the bytes are below.
    held: AtomicU64,
    /// The most `held` has been.
    peak: AtomicU64,
    /// The first write-back error. Never cleared.
    latch: Sticky,
    counters: Counters,
    /// Set by `finish`: the background thread ends, writers over the bound write back
    /// themselves.
    stopping: AtomicBool,
    /// Wakes the background thread (writers over the bound) and writers waiting for room.
    signal: Mutex<()>,
    work: Condvar,
    room: Condvar,
    /// Hands FLUSH write-backs to the helper threads; `None` once stopped.
    helpers: Mutex<Option<std::sync::mpsc::Sender<Arc<writeback::Job>>>>,
    /// Blocks a writer has moved past, for the background thread to write back now rather
    /// than at the next FLUSH (see [`HeldWrites::passed`]).
    passed: Mutex<Vec<u64>>,
    /// Ranges known to read as zeroes below (holes when the filter started, not written since).
    zeroes: Mutex<zeroes::Zeroes>,
}

/// The write-coalescing filter: a [`Filter`] over a [`Backend`] of its own, which every change
/// of data goes through.
pub struct Coalesce {
    shared: Arc<HeldWrites>,
    /// The background thread and the write-back helpers.
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    finished: AtomicBool,
}

impl Coalesce {
    pub fn new(inner: Arc<dyn Backend>, mut cfg: CoalesceConfig) -> Coalesce {
        // Deadlines are `Instant`s: an age they cannot hold would panic the background
        // thread. A year is as good as never here.
        cfg.age = cfg.age.min(Duration::from_secs(365 * 24 * 3600));
        debug_assert!(cfg.block > 0 && cfg.block <= u32::MAX as u64);
        debug_assert!(
            cfg.unit > 0 && cfg.block.is_multiple_of(u64::from(cfg.unit)),
            "blocks are whole units"
        );
        let size = inner.size().unwrap_or(0);
        let zeroes = zeroes::Zeroes::of(&*inner, size);
        let shared = Arc::new(HeldWrites {
            inner,
            cfg,
            size,
            stripes: (0..STRIPES).map(|_| RwLock::new(HashMap::new())).collect(),
            held: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            latch: Sticky::default(),
            counters: Counters::default(),
            stopping: AtomicBool::new(false),
            signal: Mutex::new(()),
            work: Condvar::new(),
            room: Condvar::new(),
            helpers: Mutex::new(None),
            passed: Mutex::new(Vec::new()),
            zeroes: Mutex::new(zeroes),
        });
        let s = shared.clone();
        let mut threads = vec![std::thread::Builder::new()
            .name("coalesce".into())
            .spawn(move || s.background())
            .expect("spawn the write-back thread")];
        // Helpers for FLUSH, started once: spawning them per FLUSH cost a few percent of a
        // core at hundreds of flushes a second.
        let (tx, rx) = std::sync::mpsc::channel();
        let rx = Arc::new(Mutex::new(rx));
        for _ in 1..cfg.threads.max(1) {
            let (s, rx) = (shared.clone(), rx.clone());
            threads.push(
                std::thread::Builder::new()
                    .name("coalesce-wb".into())
                    .spawn(move || s.helper(&rx))
                    .expect("spawn a write-back helper"),
            );
        }
        *shared.helpers.lock().unwrap() = Some(tx);
        Coalesce { shared, threads: Mutex::new(threads), finished: AtomicBool::new(false) }
    }

    pub fn stats(&self) -> CoalesceStats {
        let c = &self.shared.counters;
        CoalesceStats {
            client_writes: c.client_writes.load(SeqCst),
            absorbed: c.absorbed.load(SeqCst),
            backend_writes: c.backend_writes.load(SeqCst),
            bytes_written: c.bytes_written.load(SeqCst),
            fill_reads: c.fill_reads.load(SeqCst),
            bytes_filled: c.bytes_filled.load(SeqCst),
            flushes: c.flushes.load(SeqCst),
            backend_flushes: c.backend_flushes.load(SeqCst),
            flush_write_back_us: c.flush_write_back_us.load(SeqCst),
            flush_below_us: c.flush_below_us.load(SeqCst),
            errors: c.errors.load(SeqCst),
            held: self.shared.held.load(SeqCst),
            peak_held: self.shared.peak.load(SeqCst),
        }
    }

    /// Stops the background thread and the helpers; what is dirty stays dirty.
    fn stop(&self) {
        self.shared.stopping.store(true, SeqCst);
        {
            let _g = self.shared.signal.lock().unwrap();
            self.shared.work.notify_all();
            self.shared.room.notify_all();
        }
        // Helpers end when the queue closes (a FLUSH in progress finishes its job alone).
        drop(self.shared.helpers.lock().unwrap().take());
        for t in self.threads.lock().unwrap().drain(..) {
            let _ = t.join();
        }
    }
}

impl Coalesce {
    /// Reads with `below` and lays the held bytes over the result, holding the stripes'
    /// read locks across both (a write-back cannot slip between them). Reads that held bytes
    /// cover entirely do not call `below`. Without `wait`, `None` if a stripe is locked.
    fn overlaid(
        &self,
        buf: &mut [u8],
        offset: u64,
        wait: bool,
        below: impl FnOnce(&mut [u8]) -> Option<Result<usize>>,
    ) -> Option<Result<usize>> {
        let sh = &self.shared;
        let len = buf.len() as u64;
        // Nothing dirty: every completed write is below (bytes are counted until written).
        if len == 0 || sh.held.load(SeqCst) == 0 {
            return below(buf);
        }
        let locks = if wait { sh.read_locks(offset, len) } else { sh.try_read_locks(offset, len)? };
        let dirty = sh.dirty_in(&locks, offset, len);
        let bs = sh.cfg.block;
        let block = |b: u64| &locks.map(HeldWrites::stripe_of(b))[&b];
        // Entirely dirty: nothing to read from below.
        let covered = sh.block_of(offset + len - 1) - sh.block_of(offset) + 1 == dirty.len() as u64
            && dirty.iter().all(|(b, r)| block(*b).covers(r.start, r.len() as u32));
        let n = if covered {
            buf.len()
        } else {
            match below(buf)? {
                Ok(n) => n,
                Err(e) => return Some(Err(e)),
            }
        };
        for (b, r) in dirty {
            let blk = block(b);
            let at = (b * bs + u64::from(r.start) - offset) as usize;
            if at >= n {
                break;
            }
            let end = (at + r.len()).min(n);
            blk.overlay(&mut buf[at..end], r.start);
        }
        Some(Ok(n))
    }

    /// Whether a write of `len` bytes at `offset` is held (rather than sent straight down).
    /// Not past the size the filter was made with: write-back never writes there (a file that
    /// grew while served would have its new bytes dropped), so such writes go straight down.
    fn holds(&self, offset: u64, len: u64) -> bool {
        let sh = &self.shared;
        !self.finished.load(SeqCst)
            && len <= sh.cfg.max_request
            && offset.checked_add(len).is_some_and(|end| end <= sh.size)
            && self.charge(offset, len) <= sh.cfg.size
    }

    /// The room a write of `len` bytes at `offset` takes within the memory bound before it is
    /// absorbed: its bytes and a run's cost for each block it touches, the most it can add
    /// ([`Block::write`]).
    fn charge(&self, offset: u64, len: u64) -> u64 {
        let sh = &self.shared;
        let blocks = if len == 0 { 0 } else { sh.block_of(offset + len - 1) - sh.block_of(offset) + 1 };
        len + blocks * dirty::RUN_COST
    }

    /// Copies `buf` into the dirty map under `locks` (the stripes of its blocks). Its room,
    /// `room` ([`Self::charge`]), was taken beforehand ([`HeldWrites::reserve`]); what it did not
    /// add (it overwrote held bytes, or joined runs) is given back.
    fn absorb(
        &self,
        locks: &mut stripes::Locked<RwLockWriteGuard<'_, HashMap<u64, Block>>>,
        buf: &[u8],
        offset: u64,
        room: u64,
    ) {
        let sh = &self.shared;
        let (bs, len) = (sh.cfg.block, buf.len() as u64);
        let now = Instant::now();
        let mut at = offset;
        let mut added: i64 = 0;
        while at < offset + len {
            let b = sh.block_of(at);
            let n = ((b + 1) * bs).min(offset + len) - at;
            let piece = &buf[(at - offset) as usize..(at - offset + n) as usize];
            let map = locks.get(HeldWrites::stripe_of(b));
            let entered = !map.contains_key(&b);
            added += map.entry(b).or_insert_with(|| Block::new(now)).write((at - b * bs) as u32, piece);
            if entered && b > 0 {
                // Also when b - 1 is this write's own previous block, filled to its end.
                sh.passed(locks, b - 1);
            }
            at += n;
        }
        debug_assert!(added <= room as i64, "a write adds at most its own bytes and a run per block");
        sh.give_back(room as i64 - added);
        sh.counters.absorbed.fetch_add(1, SeqCst);
    }

    fn write_small(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let sh = &self.shared;
        let len = buf.len() as u64;
        let room = self.charge(offset, len);
        if !sh.wait_for_room(room) {
            // Straight down (a write-back error is latched, so room may never come).
            return self.write_through(buf, offset, fua);
        }
        let mut locks = sh.write_locks(offset, len);
        if self.finished.load(SeqCst) {
            // `finish` began after `holds` said yes (this writer waited for room or for its
            // stripes meanwhile), and its write-back may have passed these stripes already:
            // nothing would write the bytes back. Looked at under the locks, so a `finish`
            // that begins after this look lists the block once the locks are free.
            drop(locks);
            sh.release(room);
            return self.write_through(buf, offset, fua);
        }
        self.absorb(&mut locks, buf, offset, room);
        if fua {
            // Durable before the reply: write back the blocks it touched, with FUA.
            for b in sh.block_of(offset)..=sh.block_of(offset + len - 1) {
                let map = locks.get(HeldWrites::stripe_of(b));
                let block = map.get_mut(&b).expect("just written");
                sh.write_back(b, block, true)?;
                map.remove(&b);
            }
            drop(locks);
            sh.check_latch(Op::Write)?;
        }
        Ok(())
    }

    /// Carries out `op` on `[offset, offset+len)` below with the stripes locked, and then
    /// drops the dirty bytes it superseded (kept if it failed: they were acknowledged).
    fn pass(&self, offset: u64, len: u64, op: impl FnOnce() -> Result<()>) -> Result<()> {
        let sh = &self.shared;
        if len == 0 {
            // Supersedes nothing (a discard of nothing would split a run in two).
            return op();
        }
        // Locked even when nothing is dirty: a block dirtied while `op` runs must not have
        // its gaps read before `op` and written back after it.
        let mut locks = sh.write_locks(offset, len);
        op()?;
        let dirty = sh.dirty_in(&locks, offset, len);
        let mut dropped = 0;
        for (b, r) in dirty {
            let map = locks.get(HeldWrites::stripe_of(b));
            let blk = map.get_mut(&b).expect("dirty block");
            dropped += blk.discard(r.start, r.len() as u32);
            if blk.is_empty() {
                map.remove(&b);
            }
        }
        drop(locks);
        // Less than 0 if it split runs (a few bytes out of their middles): a run's cost more
        // each, past the bound for as long as they are held, at most two (its two ends).
        sh.give_back(dropped);
        Ok(())
    }

    /// A write that is not held: straight down, dropping the held bytes it supersedes. A FUA
    /// one still reports a latched write-back error, as every FUA does.
    fn write_through(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let sh = &self.shared;
        self.pass(offset, buf.len() as u64, || sh.write_below(buf, offset, fua, false))?;
        if fua {
            sh.check_latch(Op::Write)?;
        }
        Ok(())
    }

    /// FLUSH: every write completed before it, from any connection, is written back and made
    /// durable below.
    fn flush_all(&self) -> Result<()> {
        let sh = &self.shared;
        let c = &sh.counters;
        c.flushes.fetch_add(1, SeqCst);
        let start = Instant::now();
        let r = sh.write_back_all();
        let written = Instant::now();
        c.flush_write_back_us.fetch_add((written - start).as_micros() as u64, SeqCst);
        r?;
        let r = sh.flush_below();
        c.flush_below_us.fetch_add(written.elapsed().as_micros() as u64, SeqCst);
        r
    }

    /// Clean shutdown: stop the background thread, write back everything, flush.
    fn finish_all(&self) -> Result<()> {
        let sh = &self.shared;
        if self.finished.swap(true, SeqCst) {
            return sh.check_latch(Op::Flush);
        }
        self.stop();
        sh.write_back_all()?;
        if sh.inner.caps().can_flush {
            sh.inner.flush()?;
        }
        sh.check_latch(Op::Flush)
    }
}

/// Reads, BLOCK_STATUS and CACHE through the front's own backend (`below`) with the held
/// bytes laid over; every change of data, held or not, and every flush through the filter's
/// own backend, which every writer of the export shares.
impl Filter for Coalesce {
    fn caps(&self, _below: &dyn Backend) -> Caps {
        Caps { at_hand: true, ..self.shared.inner.caps() }
    }

    fn read(&self, below: &dyn Backend, buf: &mut [u8], offset: u64) -> Result<usize> {
        self.overlaid(buf, offset, true, |buf| Some(below.read(buf, offset))).expect("read always answers")
    }

    /// A read of what is at hand: held bytes, laid over what the layer below has at hand.
    /// `None` (and nothing recorded) when the layer below would have to wait for a device, or
    /// a stripe is locked (a write-back holds it across device I/O).
    fn read_at_hand(&self, below: &dyn Backend, buf: &mut [u8], offset: u64) -> Option<Result<usize>> {
        self.overlaid(buf, offset, false, |buf| below.read_at_hand(buf, offset))
    }

    fn write(&self, _below: &dyn Backend, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let sh = &self.shared;
        sh.counters.client_writes.fetch_add(1, SeqCst);
        if buf.is_empty() {
            // Nothing to write, but a FUA write still reports a latched error, as every FUA
            // does (a zero-length ZERO or TRIM with FUA does too, through `pass`).
            return if fua { sh.check_latch(Op::Write) } else { Ok(()) };
        }
        // After `finish` nothing would write held bytes back: write through.
        if self.holds(offset, buf.len() as u64) {
            return self.write_small(buf, offset, fua);
        }
        self.write_through(buf, offset, fua)
    }

    /// A write held without waiting: `None` (nothing recorded) if it would go straight down,
    /// if there is no room for it, or if a stripe is locked (a write-back holds it across
    /// device I/O).
    fn write_at_hand(&self, _below: &dyn Backend, buf: &[u8], offset: u64) -> Option<Result<()>> {
        let sh = &self.shared;
        let len = buf.len() as u64;
        if len == 0 || !self.holds(offset, len) {
            return None;
        }
        // After `holds`: it checked that the range does not wrap.
        let room = self.charge(offset, len);
        if !sh.reserve(room) {
            return None;
        }
        let Some(mut locks) = sh.try_write_locks(offset, len) else {
            sh.release(room);
            return None;
        };
        if self.finished.load(SeqCst) {
            // `finish` began after `holds` (see `write_small`): not held.
            drop(locks);
            sh.release(room);
            return None;
        }
        sh.counters.client_writes.fetch_add(1, SeqCst);
        self.absorb(&mut locks, buf, offset, room);
        Some(Ok(()))
    }

    /// As any write: held if it is small enough. (Only a filter's write-back merges writes,
    /// and none stacks above this one.)
    fn write_merged(&self, below: &dyn Backend, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        Filter::write(self, below, buf, offset, fua)
    }

    /// Nothing: the pages of held writes are the filter's to prepare when it writes them back
    /// (it hints its own writes below then), and a pass-through write needs no hint.
    fn will_write(&self, _below: &dyn Backend, _offset: u64, _len: u64) {}

    fn zero(&self, _below: &dyn Backend, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        let sh = &self.shared;
        self.pass(offset, len, || sh.inner.zero(offset, len, flags))?;
        if flags.fua {
            sh.check_latch(Op::Zero)?;
        }
        Ok(())
    }

    fn trim(&self, _below: &dyn Backend, offset: u64, len: u64, fua: bool) -> Result<()> {
        let sh = &self.shared;
        self.pass(offset, len, || sh.inner.trim(offset, len, fua))?;
        if fua {
            sh.check_latch(Op::Trim)?;
        }
        Ok(())
    }

    fn flush(&self, _below: &dyn Backend) -> Result<()> {
        self.flush_all()
    }

    fn cache(&self, below: &dyn Backend, offset: u64, len: u64) -> Result<()> {
        below.cache(offset, len)
    }

    fn extents(&self, below: &dyn Backend, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let sh = &self.shared;
        if sh.held.load(SeqCst) == 0 {
            return below.extents(offset, len);
        }
        let locks = sh.read_locks(offset, len);
        let found = below.extents(offset, len)?;
        let total: u64 = found.iter().map(|e| e.len).sum();
        let (bs, unit) = (sh.cfg.block, u64::from(sh.cfg.unit));
        let mut ranges: Vec<Range<u64>> = Vec::new();
        // Dirty bytes in the units the request touches (the same blocks: blocks are whole
        // units), so that the answer does not depend on where a request starts.
        let (lo, hi) = (offset / unit * unit, (offset + total).div_ceil(unit) * unit);
        let dirty = sh.dirty_in(&locks, lo, hi.min(sh.size) - lo);
        for (b, r) in dirty {
            let blk = &locks.map(HeldWrites::stripe_of(b))[&b];
            for d in blk.ranges().filter(|d| d.start < r.end && r.start < d.end) {
                // Whole units: clients read in aligned pieces, and qemu rounds an unaligned
                // extent so that a hole's status covers the dirty bytes sharing its 512-byte
                // sector (it then reads them as zeroes). Data is the safe answer for the rest
                // of the unit, which the filesystem allocates with the dirty bytes anyway.
                let s = ((b * bs + u64::from(d.start)) / unit * unit).max(offset);
                let e = (b * bs + u64::from(d.end)).div_ceil(unit).saturating_mul(unit).min(offset + total);
                match ranges.last_mut() {
                    Some(last) if last.end >= s => last.end = last.end.max(e),
                    _ => ranges.push(s..e),
                }
            }
        }
        Ok(dirty::mark_data(&found, offset, &ranges))
    }

    fn own(&self) -> &Arc<dyn Backend> {
        &self.shared.inner
    }

    fn finish(&self) -> Result<()> {
        let r = self.finish_all();
        let f = self.shared.inner.finish();
        r.and(f)
    }
}

impl Drop for Coalesce {
    fn drop(&mut self) {
        // Clean shutdown without `finish`: still write everything back.
        if self.finished.load(SeqCst) {
            return;
        }
        if let Err(e) = self.finish_all() {
            tracing::warn!("coalesce: at exit: {e}");
        }
    }
}

#[cfg(test)]
mod tests;
