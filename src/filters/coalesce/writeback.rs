//! Write-back: of one block (gaps filled only where safe, see [`super::dirty::plan`]), of
//! everything on FLUSH (several threads, block order), of old blocks and under memory pressure
//! (the background thread), and the flushes below. Errors are latched here.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{mpsc, Arc, Condvar, Mutex, TryLockError};
use std::time::{Duration, Instant};

use super::dirty::{self, Block};
use super::stripes::Locked;
use super::HeldWrites;

/// Blocks a write-back thread takes at a time: neighbours, so the file sees runs of
/// ascending offsets.
const BATCH: usize = 4;

/// Most passed blocks queued for the background thread; beyond it they wait for a FLUSH or
/// the age bound (the queue only moves write-back earlier).
const PASSED_MAX: usize = 4096;

/// One FLUSH's write-back, shared with the helper threads.
pub(super) struct Job {
    keys: Vec<u64>,
    next: AtomicUsize,
    /// Helpers working on it.
    active: Mutex<usize>,
    idle: Condvar,
    first_err: Mutex<Option<Error>>,
}

impl Job {
    fn work(&self, sh: &HeldWrites) {
        loop {
            let i = self.next.fetch_add(BATCH, SeqCst);
            if i >= self.keys.len() {
                return;
            }
            for &b in &self.keys[i..(i + BATCH).min(self.keys.len())] {
                if let Err(e) = sh.write_back_one(b) {
                    self.first_err.lock().unwrap().get_or_insert(e);
                }
            }
        }
    }
}
use crate::error::{Error, Op, Result};

impl HeldWrites {
    /// Fails with the latched write-back error, if any: for FLUSH and FUA.
    pub(super) fn check_latch(&self, op: Op) -> Result<()> {
        self.latch.check_writes(op, self.inner.name())
    }

    pub(super) fn set_latch(&self, e: &Error) {
        self.counters.errors.fetch_add(1, SeqCst);
        if self.latch.set(e) {
            tracing::warn!("coalesce: write-back failed: {e}");
        }
    }

    /// [`Self::release`] of `freed` (from [`Block::write`] or [`Block::discard`]); less than
    /// 0 takes that much more, without waiting (the bytes are held already).
    pub(super) fn give_back(&self, freed: i64) {
        if freed >= 0 {
            self.release(freed as u64);
        } else {
            let now = self.held.fetch_add(freed.unsigned_abs(), SeqCst) + freed.unsigned_abs();
            self.peak.fetch_max(now, SeqCst);
        }
    }

    pub(super) fn release(&self, bytes: u64) {
        if bytes > 0 {
            self.held.fetch_sub(bytes, SeqCst);
            let _g = self.signal.lock().unwrap();
            self.room.notify_all();
        }
    }

    /// Writes `buf` at `offset` below: every write the filter sends down goes through here, so
    /// that the range leaves the map of known zeroes first (also if the write fails: part of it
    /// may have landed). `merged`: `buf` joins several client writes
    /// ([`crate::backend::Backend::write_merged`]).
    pub(super) fn write_below(&self, buf: &[u8], offset: u64, fua: bool, merged: bool) -> Result<()> {
        self.zeroes.lock().unwrap().forget(offset, buf.len() as u64);
        if merged {
            self.inner.write_merged(buf, offset, fua)?;
        } else {
            self.inner.write(buf, offset, fua)?;
        }
        self.counters.backend_writes.fetch_add(1, SeqCst);
        self.counters.bytes_written.fetch_add(buf.len() as u64, SeqCst);
        Ok(())
    }

    /// How block `b` is to be written back ([`dirty::plan`]): by its write-back, and by
    /// [`Self::write_back_all`] for its hints beforehand. Whether a gap is a hole or data does
    /// not change the plan: no extent lookup.
    fn plan(&self, b: u64, block: &Block) -> Vec<dirty::Run> {
        let ranges: Vec<Range<u32>> = block.ranges().collect();
        let limit = self.size.saturating_sub(b * self.cfg.block).min(self.cfg.block) as u32;
        dirty::plan(&ranges, self.cfg.unit, limit)
    }

    /// Writes back the dirty data of block `b` (its stripe write-locked by the caller).
    /// Bytes are dropped from `block` as they reach the layer below; on error the rest stays
    /// dirty and the error is latched.
    pub(super) fn write_back(&self, b: u64, block: &mut Block, fua: bool) -> Result<()> {
        let base = b * self.cfg.block;
        for run in self.plan(b, block) {
            let (s, e) = (run.range.start, run.range.end);
            let r = if run.fill { self.write_filled(block, base, s..e, fua) } else { Err(None) };
            let r = match r {
                Ok(()) => Ok(()),
                Err(Some(e)) => Err(e),
                // Not filled (a gap over a unit nobody wrote, or the gap read failed): the exact
                // ranges.
                Err(None) => {
                    let mut r = Ok(());
                    for (rs, d) in block.runs().iter().filter(|(rs, _)| *rs >= s && *rs < e) {
                        r = self.write_below(d, base + u64::from(*rs), fua, false);
                        if r.is_err() {
                            break;
                        }
                    }
                    r
                }
            };
            if let Err(err) = r {
                self.set_latch(&err);
                return Err(err);
            }
            let dropped = block.discard(s, e - s);
            self.give_back(dropped);
        }
        Ok(())
    }

    /// Writes `range` of a block as one request, its gaps read from below first, unless they
    /// are known to read as zeroes (see [`super::zeroes`]). `Err(None)` when the gaps could not
    /// be read (write the exact ranges instead). The caller holds the block's stripe: nothing
    /// else writes into the block meanwhile.
    pub(super) fn write_filled(
        &self,
        block: &Block,
        base: u64,
        range: Range<u32>,
        fua: bool,
    ) -> std::result::Result<(), Option<Error>> {
        let mut buf = vec![0u8; range.len()];
        let at = base + u64::from(range.start);
        let inside = |r: &Range<u32>| r.start >= range.start && r.end <= range.end;
        // Gaps in a range known to read as zeroes are zeroes already in `buf`: reading them
        // (O_DIRECT reads of holes, under ext4's locks against the write-backs and flushes)
        // cost 15-20 % of sparse strided IOPS.
        let over_holes = self.zeroes.lock().unwrap().covers(at, buf.len() as u64);
        // Writes joined over holes go down as one merged write: a file keeps it out of the
        // cache (RWF_DONTCACHE drops pages that fill holes once they are written), so it is on
        // its way to the disk before the FLUSH and nothing is left to evict after it (strided
        // 1 KiB writes into a sparse file, 10 alternating pairs: 1.085x). Over data, ext4 on
        // 6.18 keeps overwritten pages cached anyway (KERNEL-NOTES), and the hint cost random
        // 1 KiB writes within 64 MiB of a written file 5 % (9 pairs): written as before.
        let merged = over_holes && block.ranges().filter(inside).nth(1).is_some();
        if !over_holes {
            if let Err(e) = crate::backend::read_exact(&*self.inner, &mut buf, at) {
                tracing::debug!("coalesce: gap read failed, writing exact ranges: {e}");
                return Err(None);
            }
            let dirty: u64 = block.ranges().filter(inside).map(|r| r.len() as u64).sum();
            self.counters.fill_reads.fetch_add(1, SeqCst);
            self.counters.bytes_filled.fetch_add(range.len() as u64 - dirty, SeqCst);
        }
        block.overlay(&mut buf, range.start);
        self.write_below(&buf, at, fua, merged).map_err(Some)
    }

    /// Writes back block `b`, if it is still dirty, and forgets it once written.
    pub(super) fn write_back_one(&self, b: u64) -> Result<()> {
        let mut map = self.stripes[Self::stripe_of(b)].write().unwrap();
        let Some(block) = map.get_mut(&b) else { return Ok(()) };
        match self.write_back(b, block, false) {
            Ok(()) => {
                map.remove(&b);
                Ok(())
            }
            Err(e) => {
                // Latched; tried again at the next flush or once it is old again.
                block.since = Instant::now();
                Err(e)
            }
        }
    }

    /// Writes back everything dirty: in block order (the file sees ascending offsets), in
    /// batches of neighbouring blocks shared between the caller and up to `threads - 1`
    /// helpers. A stripe another thread holds (a block being written back by the background
    /// thread or another FLUSH, the stripe locked across the write) is listed after the others
    /// are written back, not waited for first: listing every stripe in turn waited about 100 µs
    /// a FLUSH for such a write, idle, in front of its own (strided 1 KiB writes, 0.55 busy
    /// stripes a FLUSH).
    pub(super) fn write_back_all(&self) -> Result<()> {
        if self.held.load(SeqCst) == 0 {
            return Ok(());
        }
        let mut keys: Vec<u64> = Vec::new();
        let mut busy: Vec<usize> = Vec::new();
        for (i, s) in self.stripes.iter().enumerate() {
            match s.try_read() {
                Ok(map) => self.list(&map, &mut keys),
                Err(TryLockError::WouldBlock) => busy.push(i),
                Err(TryLockError::Poisoned(e)) => panic!("coalesce: a stripe lock is poisoned: {e}"),
            }
        }
        let first = self.write_back_listed(keys);
        let mut keys: Vec<u64> = Vec::new();
        for i in busy {
            self.list(&self.stripes[i].read().unwrap(), &mut keys);
        }
        let then = self.write_back_listed(keys);
        first.and(then)
    }

    /// Adds the dirty blocks of one stripe to `keys`, and hints the kernel about the pages the
    /// exact ranges among them will overwrite in part: read now, all at once, rather than one
    /// by one inside each write (under the inode's lock). Ranges joined into a filled run are
    /// not hinted: their gaps are filled by one read of the run (a hint per range of a strided
    /// block, 16 a block, cost more system calls than it saved).
    fn list(&self, map: &HashMap<u64, Block>, keys: &mut Vec<u64>) {
        let bs = self.cfg.block;
        for (b, blk) in map.iter() {
            keys.push(*b);
            for run in self.plan(*b, blk).iter().filter(|r| !r.fill) {
                self.inner.will_write(b * bs + u64::from(run.range.start), run.range.len() as u64);
            }
        }
    }

    /// Writes back the blocks `keys` (those still dirty), sorted, with the helpers.
    fn write_back_listed(&self, mut keys: Vec<u64>) -> Result<()> {
        if keys.is_empty() {
            // Also when bytes are counted: a zero or trim drops blocks just before it
            // subtracts their bytes.
            return Ok(());
        }
        keys.sort_unstable();
        let helpers = self.cfg.threads.min(keys.len().div_ceil(BATCH)).saturating_sub(1);
        let job = Arc::new(Job {
            keys,
            next: AtomicUsize::new(0),
            active: Mutex::new(0),
            idle: Condvar::new(),
            first_err: Mutex::new(None),
        });
        if helpers > 0 {
            if let Some(tx) = self.helpers.lock().unwrap().as_ref() {
                for _ in 0..helpers {
                    let _ = tx.send(job.clone());
                }
            }
        }
        job.work(self);
        // Helpers that took the job finish their batches; those that come later find it done.
        let mut active = job.active.lock().unwrap();
        while *active > 0 {
            active = job.idle.wait(active).unwrap();
        }
        drop(active);
        let first_err = job.first_err.lock().unwrap().take();
        first_err.map_or(Ok(()), Err)
    }

    /// A write-back helper thread: takes part in FLUSHes' write-backs until the filter stops.
    pub(super) fn helper(&self, jobs: &Mutex<mpsc::Receiver<Arc<Job>>>) {
        loop {
            let job = jobs.lock().unwrap().recv();
            let Ok(job) = job else { return };
            *job.active.lock().unwrap() += 1;
            job.work(self);
            let mut active = job.active.lock().unwrap();
            *active -= 1;
            if *active == 0 {
                job.idle.notify_all();
            }
        }
    }

    /// Called when a write enters block `p + 1` while it was clean: if `p` is dirty in its last
    /// page (or allocation unit, where smaller), a writer going forward has passed it (strided or sequential
    /// writes), and nothing more is likely to come to it before the next FLUSH. It is queued
    /// for the background thread, which writes it back while the client goes on writing:
    /// otherwise the FLUSH would, while the client waits (a strided writer flushing every 64
    /// writes fills 4 blocks of 64 KiB between flushes, and 3 of them are passed by then).
    /// Random writes rarely meet the condition; when they do, the block is written back a bit
    /// early and may be dirtied again, which costs one more write and nothing else. `p`'s
    /// stripe is looked at without waiting (the caller holds other stripes: waiting here
    /// could deadlock) and is skipped if busy.
    pub(super) fn passed<G: std::ops::Deref<Target = HashMap<u64, Block>>>(&self, locks: &Locked<G>, p: u64) {
        // With a write-back error latched, blocks wait for the FLUSH that reports it rather
        // than fail again one by one in the background.
        if self.counters.errors.load(SeqCst) > 0 {
            return;
        }
        // Dirty in its last page (or unit, where smaller): a unit as large as the block (an
        // object of an image in object storage) would count every dirty block as passed, and
        // write back objects still being filled, each one more read-modify-write.
        let tail = (self.cfg.block - u64::from(self.cfg.unit.min(4096))) as u32;
        let reaches_tail = |m: &HashMap<u64, Block>| m.get(&p).and_then(Block::end).is_some_and(|e| e > tail);
        let s = Self::stripe_of(p);
        let yes = if locks.holds(s) {
            reaches_tail(locks.map(s))
        } else {
            self.stripes[s].try_read().is_ok_and(|m| reaches_tail(&m))
        };
        if !yes {
            return;
        }
        {
            let mut q = self.passed.lock().unwrap();
            if q.len() >= PASSED_MAX {
                return;
            }
            q.push(p);
            // The background thread takes the whole queue at once: only the first block
            // queued since it last looked needs to wake it.
            if q.len() > 1 {
                return;
            }
        }
        let _g = self.signal.lock().unwrap();
        self.work.notify_one();
    }

    /// Writes back the blocks older than the age bound, and the oldest ones while more than
    /// 3/4 of the size bound is dirty. Returns when a block can next be too old (no need to
    /// look before then unless the bound is passed).
    pub(super) fn write_back_old(&self) -> Instant {
        let start = Instant::now();
        let mut all: Vec<(Instant, u64)> = Vec::new();
        for s in &self.stripes {
            all.extend(s.read().unwrap().iter().map(|(b, blk)| (blk.since, *b)));
        }
        all.sort_unstable();
        let old = start.checked_sub(self.cfg.age);
        let mut earliest = start;
        for (since, b) in all {
            let too_old = old.is_some_and(|o| since <= o);
            if !too_old && !self.under_pressure() {
                // The oldest block left; blocks written back and failed restart their clock.
                earliest = earliest.min(since);
                break;
            }
            // Errors are latched; the block is tried again later.
            let _ = self.write_back_one(b);
        }
        earliest + self.cfg.age
    }

    /// Where write-back under memory pressure stops: 3/4 of the bound, and low enough that the
    /// largest write held fits (a writer waiting for more room than the last quarter would
    /// otherwise wait for the age bound: `--coalesce-size 128K` with 64 KiB writes).
    fn low_mark(&self) -> u64 {
        let size = self.cfg.size;
        (size / 4 * 3).min(size - self.cfg.max_request.min(size))
    }

    /// More is held than the low mark, and writing back can help: with a write-back error
    /// latched, held blocks fail again (each holding its stripe across the failing I/O), and
    /// writers go straight down instead of waiting (see [`Self::wait_for_room`]); they are
    /// retried at the next FLUSH or once too old.
    fn under_pressure(&self) -> bool {
        self.held.load(SeqCst) > self.low_mark() && !self.latch.is_set()
    }

    /// The background thread: wakes when a writer is over the bound, and when a block may have
    /// grown too old (looking every `tick` whether either happened; listing every block on each
    /// tick would cost milliseconds with many blocks held).
    pub(super) fn background(&self) {
        let tick = (self.cfg.age / 4).clamp(Duration::from_millis(1), Duration::from_millis(100));
        let mut due = Instant::now() + self.cfg.age;
        loop {
            {
                let g = self.signal.lock().unwrap();
                if self.stopping.load(SeqCst) {
                    return;
                }
                // Looked at under `signal`: a block queued after this finds the thread
                // waiting, and its notification wakes it.
                if self.passed.lock().unwrap().is_empty() {
                    let _ = self.work.wait_timeout(g, tick).unwrap();
                }
            }
            if self.stopping.load(SeqCst) {
                return;
            }
            let passed = std::mem::take(&mut *self.passed.lock().unwrap());
            for b in passed {
                // Errors are latched; the block stays dirty for the next FLUSH or the age bound.
                let _ = self.write_back_one(b);
            }
            let held = self.held.load(SeqCst);
            if self.under_pressure() || (held > 0 && Instant::now() >= due) {
                due = self.write_back_old();
            } else if held == 0 {
                // Blocks dirtied from now on are due an age from now at the earliest.
                due = due.max(Instant::now() + self.cfg.age);
            }
        }
    }

    /// Makes every write below that completed before the call durable. Concurrent callers
    /// each flush below, at once, and the kernel shares the work between them (a journalled
    /// ext4's fdatasync joins a running commit; the block layer merges device flushes). A
    /// group commit here was slower: docs/benchmarks/runs/code-notes.md#flush_below.
    pub(super) fn flush_below(&self) -> Result<()> {
        if !self.inner.caps().can_flush {
            // Nothing below to flush (as `finish` does): only errors latched so far.
            return self.check_latch(Op::Flush);
        }
        self.counters.backend_flushes.fetch_add(1, SeqCst);
        if let Err(e) = self.inner.flush() {
            self.set_latch(&e);
            return Err(e);
        }
        // An error another thread's write-back latched fails this flush too.
        self.check_latch(Op::Flush)
    }

    /// Counts `len` more bytes as held if that stays within the bound. A writer takes its room
    /// before its stripes and gives back what it overwrote once its bytes are in: writers that
    /// only compared `held` with the bound could pass it together, each seeing room for itself.
    pub(super) fn reserve(&self, len: u64) -> bool {
        let mut cur = self.held.load(SeqCst);
        loop {
            if cur + len > self.cfg.size {
                return false;
            }
            match self.held.compare_exchange_weak(cur, cur + len, SeqCst, SeqCst) {
                Ok(_) => {
                    self.peak.fetch_max(cur + len, SeqCst);
                    return true;
                }
                Err(now) => cur = now,
            }
        }
    }

    /// Backpressure: waits until `len` bytes fit within the bound and takes that room
    /// ([`Self::reserve`]). Returns false, taking nothing, when the write should go straight
    /// down instead (a write-back error is latched, so room may never come).
    pub(super) fn wait_for_room(&self, len: u64) -> bool {
        loop {
            if self.reserve(len) {
                return true;
            }
            if self.latch.is_set() {
                return false;
            }
            if self.stopping.load(SeqCst) {
                // No background thread: make room here, once; no room then, straight down.
                self.write_back_old();
                return self.reserve(len);
            }
            let g = self.signal.lock().unwrap();
            self.work.notify_one();
            let _ = self.room.wait_timeout(g, Duration::from_millis(10)).unwrap();
        }
    }
}
