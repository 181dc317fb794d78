//! `--prefetch`: read-ahead for sequential streams into a small bounded buffer, so
//! small sequential reads on uncached storage stop paying a device round trip each.
//!
//! - [`detect`]: finding streams among an export's reads (interleaved, reordered, amid random
//!   reads); one detector per filter, so per export and shared by its connections.
//! - [`buffer`]: 256 KiB chunks read ahead, each dropped once read through, within a byte
//!   bound; unread chunks are evicted first, then the least recently used.
//! - [`Prefetch`]: the filter, over one backend; [`Front`](super::Front)s share one `Prefetch` between
//!   users with backends of their own (the server's connections, each with its own open
//!   file), so a stream is followed whichever connection its reads arrive on. Read-ahead
//!   always goes through the `Prefetch`'s own backend.
//!
//! A read of at most `max_request` bytes is shown to the detector and served from the buffer
//! when the buffer holds all of it, from the layer below otherwise. A read of a stream queues
//! read-ahead of the chunks from its frontier on for background threads; the stream's window
//! starts at 2 chunks, doubles (to 16) each time the stream is served from the buffer, and
//! halves (to 1) each time a chunk read ahead for it is evicted before it was read, and never
//! reaches further ahead than the stream has read. A stream that stops reading stops getting
//! read-ahead; its chain ages out of the detector. A read whose chunks are on their way waits
//! for them (or reads a queued one itself) rather than read the bytes a second time.
//!
//! Coherence: a write, zero or trim goes to the layer below and then drops the chunks it
//! overlaps, bumps a generation counter and logs its range; read-ahead that started before it
//! and overlaps that range is discarded when it completes (all of it, if the log no longer
//! reaches back to its start). So once a write has returned, no read returns the old bytes,
//! and writes elsewhere leave read-ahead alone: with one counter for the whole export, a 4 KiB
//! write anywhere threw away every fill in flight (their chunks then missed for good: the
//! streams' windows had moved past them).
//!
//! A small read that misses near recent reads reads its whole chunk while that pays
//! ([`around`]).
//!
//! NBD CACHE requests fill the same buffer (up to its bound) instead of the page cache.
//!
//! Benchmark: bench/serve.sh `PRESET=prefetch` (docs/benchmarks.md).

pub mod around;
pub mod buffer;
pub mod detect;

pub use detect::{DetectConfig, Detector, Observation};

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};

use super::Filter;
use crate::backend::{Backend, Caps, Extent, ZeroFlags};
use crate::error::Result;
use buffer::{Buffer, BufferStats, CHUNK};
use detect::ChainId;

/// Tuning of the filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefetchConfig {
    /// Buffer bound in bytes (`--prefetch-size`).
    pub size: u64,
    /// Reads larger than this pass straight through (`--prefetch-max-request`).
    pub max_request: u64,
    /// Read-ahead window of a new stream, and its limit, in chunks.
    pub window_min: u32,
    pub window_max: u32,
    /// Background threads doing the read-ahead.
    pub threads: usize,
    /// Chunks one read-ahead read fetches at most, when a stream's next chunks are queued
    /// together: one request for several, where each request costs far more than its bytes.
    /// Read-ahead threads read at most `threads × fill_chunks` chunks at once.
    pub fill_chunks: usize,
    /// A long stream's read-ahead reads grow to this many chunks (see
    /// [`PrefetchConfig::unit_for`]); at least `fill_chunks`.
    pub fill_chunks_max: usize,
    /// Small reads that miss read their whole chunks into the buffer, and chunks stay once
    /// read through (the first to go for room): a chunk cache, for backends where a round
    /// trip costs far more than the bytes it carries.
    pub whole_chunks: bool,
    /// A small read that misses near recent reads reads its whole chunk, while that pays
    /// ([`around`]); `whole_chunks` does it for every small read that misses.
    pub read_around: bool,
    pub detect: DetectConfig,
}

impl PrefetchConfig {
    /// Whether misses near recent reads read their chunk whole by [`around`]'s rule (with
    /// `whole_chunks` every small miss does, and every chunk stays).
    fn reads_around(&self) -> bool {
        self.read_around && !self.whole_chunks
    }

    /// Chunks read ahead at a time for a stream that has read `covered` bytes: `fill_chunks`,
    /// doubled while that stays within a quarter of `covered` and `fill_chunks_max` (so
    /// what a unit reads past a stream's end stays small beside what the stream read).
    fn unit_for(&self, covered: u64) -> usize {
        let (mut unit, max) = (self.fill_chunks.max(1), self.fill_chunks_max.min(self.budget()));
        while unit * 2 <= max && (unit * 2) as u64 * CHUNK * 4 <= covered {
            unit *= 2;
        }
        unit
    }

    /// Chunks read-ahead threads read at most at once (and spare buffers kept for them).
    fn budget(&self) -> usize {
        self.threads.max(1) * self.fill_chunks.max(1)
    }

    /// Whether units can outgrow `fill_chunks`: only then can the threads' reads together
    /// exceed [`PrefetchConfig::budget`], and need counting.
    fn units_grow(&self) -> bool {
        self.unit_for(u64::MAX) > self.fill_chunks.max(1)
    }

    /// For a backend where every read is a network round trip of milliseconds (object
    /// storage): 16 fills in flight rather than 2 (two threads each fetching a 256 KiB chunk
    /// per round trip cap a stream at 2 chunks a round trip, about 50 MB/s at 10 ms; a local
    /// device needs no more than two to stay busy); 4 chunks per read-ahead request and up to
    /// 32 ahead (SeaweedFS here answers about 520 range GETs of 256 KiB a second; bench/qd1.sh
    /// over s3:// went from 138 to 176 MiB/s; 8 per request reached 196-207 but reads up to
    /// 2 MiB past each of a guest's streams' ends); units growing to 8 MiB on long streams
    /// with up to 32 MiB ahead (SeaweedFS spends about 2.5 ms of CPU per GET whatever its
    /// size: qd1 over s3:// from 273-317 to 361-447 MiB/s, docs/benchmarks/runs/s3-get-size.md);
    /// and whole chunks: a guest's metadata reads, 4 KiB each near one another, then cost a
    /// round trip a chunk, not one a read.
    pub fn for_round_trips(self) -> PrefetchConfig {
        PrefetchConfig {
            threads: 16,
            fill_chunks: 4,
            fill_chunks_max: 32,
            window_max: 128,
            whole_chunks: true,
            ..self
        }
    }
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        PrefetchConfig {
            size: 64 << 20,
            max_request: 128 << 10,
            window_min: 2,
            window_max: 16,
            threads: 2,
            fill_chunks: 1,
            fill_chunks_max: 1,
            whole_chunks: false,
            read_around: true,
            detect: DetectConfig::default(),
        }
    }
}

/// Counters for `--stats`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct PrefetchStats {
    #[serde(flatten)]
    pub buffer: BufferStats,
    pub streams_found: u64,
    /// Chunks read whole around a small read that missed ([`around`]).
    pub read_around: u64,
    /// Bytes held now.
    pub held: u64,
}

/// Per stream: how far ahead to read, and where read-ahead got to.
struct Window {
    chunks: u32,
    next: u64,
}

/// A chunk queued or being read ahead. Its `ticket` names the job that reads it: a client
/// read that meets the chunk still queued takes the job over (reads the chunk itself, under
/// a new ticket), and the queued job, finding another ticket, is skipped.
#[derive(Clone, Copy)]
struct Flight {
    ticket: u64,
    started: bool,
    owner: Option<ChainId>,
    /// Pieces clients have read from below already ([`buffer::pieces_read`]).
    read: u64,
    /// Pieces client reads waiting for the chunk want: never counted as read when it lands.
    wanted: u64,
}

struct State {
    detector: Detector,
    windows: HashMap<ChainId, Window>,
    buffer: Buffer,
    around: around::ReadAround,
    in_flight: HashMap<u64, Flight>,
    tickets: u64,
    /// Bumped by every write, zero and trim.
    generation: u64,
    /// The latest writes' (generation, offset, length), at most [`WRITE_LOG`]: read-ahead that
    /// started before one of them and overlaps it is discarded.
    writes: VecDeque<(u64, u64, u64)>,
    /// Read-ahead queued or in flight for CACHE requests: at most the buffer's worth, however
    /// many requests ask.
    cache_jobs: usize,
    /// Chunks read-ahead threads are reading: at most [`PrefetchConfig::budget`].
    reading: usize,
}

/// Writes remembered for read-ahead in flight: far more than can complete during one 256 KiB
/// read; a fill that started before the oldest of them is discarded whatever it overlaps.
const WRITE_LOG: usize = 1024;

impl State {
    /// Whether `[start, start+len)` may have changed since generation `since`.
    fn written_since(&self, since: u64, start: u64, len: u64) -> bool {
        if self.generation == since {
            return false;
        }
        let reaches_back = self.writes.front().is_some_and(|&(g, _, _)| g <= since + 1);
        !reaches_back || self.writes.iter().any(|&(g, o, l)| g > since && o < start + len && start < o + l)
    }
}

struct Job {
    start: u64,
    len: u64,
    /// The stream it reads ahead for (none for CACHE requests).
    owner: Option<ChainId>,
    ticket: u64,
    /// Read around a miss: stays once read through.
    keep: bool,
}

struct ReadAhead {
    /// Set when the filter stops: queued read-ahead is skipped.
    stopping: std::sync::atomic::AtomicBool,
    inner: Arc<dyn Backend>,
    cfg: PrefetchConfig,
    size: u64,
    state: Mutex<State>,
    /// Signalled whenever a chunk's read ends (landed, discarded or failed): client reads
    /// waiting for it look again.
    landed: Condvar,
}

/// The prefetch filter: a [`Filter`] over a [`Backend`] of its own, for read-ahead.
pub struct Prefetch {
    shared: Arc<ReadAhead>,
    jobs: Mutex<Option<mpsc::Sender<Vec<Job>>>>,
    workers: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl Prefetch {
    pub fn new(inner: Arc<dyn Backend>, cfg: PrefetchConfig) -> Prefetch {
        let size = inner.size().unwrap_or(0);
        let state = State {
            detector: Detector::new(cfg.detect),
            windows: HashMap::new(),
            buffer: {
                let b = Buffer::new(cfg.size).spares_for(cfg.budget());
                if cfg.whole_chunks {
                    b.keeping()
                } else {
                    b
                }
            },
            around: Default::default(),
            in_flight: HashMap::new(),
            tickets: 0,
            generation: 0,
            writes: VecDeque::new(),
            cache_jobs: 0,
            reading: 0,
        };
        let shared = Arc::new(ReadAhead {
            stopping: Default::default(),
            inner,
            cfg,
            size,
            state: Mutex::new(state),
            landed: Condvar::new(),
        });
        let (tx, rx) = mpsc::channel::<Vec<Job>>();
        let rx = Arc::new(Mutex::new(rx));
        let workers = (0..cfg.threads.max(1))
            .map(|_| {
                let (shared, rx) = (shared.clone(), rx.clone());
                std::thread::spawn(move || loop {
                    let job = rx.lock().unwrap().recv();
                    match job {
                        Ok(jobs) => shared.run_jobs(jobs),
                        Err(_) => return,
                    }
                })
            })
            .collect();
        Prefetch { shared, jobs: Mutex::new(Some(tx)), workers: Mutex::new(workers) }
    }

    pub fn stats(&self) -> PrefetchStats {
        let st = self.shared.state.lock().unwrap();
        PrefetchStats {
            buffer: st.buffer.stats,
            streams_found: st.detector.streams_found(),
            read_around: st.around.chunks,
            held: st.buffer.bytes(),
        }
    }

    /// Forgets what is buffered over `[offset, offset+len)`: called after the data changed.
    fn invalidate(&self, offset: u64, len: u64) {
        let mut st = self.shared.state.lock().unwrap();
        st.generation += 1;
        let g = st.generation;
        st.writes.push_back((g, offset, len));
        if st.writes.len() > WRITE_LOG {
            st.writes.pop_front();
        }
        st.buffer.invalidate(offset, len);
    }

    /// Queues jobs for the read-ahead threads: runs of consecutive chunks for one owner go
    /// together, within aligned units of `unit` chunks, to be read with one request.
    fn submit(&self, jobs: Vec<Job>, unit: usize) {
        // Most reads queue nothing: they leave the queue's lock alone.
        if jobs.is_empty() {
            return;
        }
        let guard = self.jobs.lock().unwrap();
        let Some(tx) = guard.as_ref() else { return };
        let unit_bytes = unit.max(1) as u64 * CHUNK;
        let mut run: Vec<Job> = Vec::new();
        for j in jobs {
            let follows = run.last().is_some_and(|l| l.start + l.len == j.start && l.owner == j.owner);
            if !run.is_empty() && (!follows || j.start % unit_bytes == 0) {
                let _ = tx.send(std::mem::take(&mut run));
            }
            run.push(j);
        }
        if !run.is_empty() {
            let _ = tx.send(run);
        }
    }
}

impl ReadAhead {
    /// The read-ahead a read of a stream calls for, and the chunks to read at a time.
    fn plan(&self, st: &mut State, v: &Observation, hit: bool) -> (Vec<Job>, usize) {
        let (chain, frontier) = (v.chain, v.frontier);
        let cfg = &self.cfg;
        // From the chunk the frontier is in, not the next one: the stream's next reads are in
        // it. Over a round trip of milliseconds, leaving it out made each of the up to 63 reads
        // left in it (4 KiB each) a miss of a round trip, at every stream's start. The part of
        // it already read is marked read when it lands.
        let first = frontier / CHUNK * CHUNK;
        let w = st.windows.entry(chain).or_insert(Window { chunks: cfg.window_min, next: first });
        if hit {
            // The stream reads what was read ahead: look further.
            w.chunks = (w.chunks * 2).min(cfg.window_max);
        }
        // No further ahead than the stream has read so far (a chunk at least): the files a
        // guest reads end, and read-ahead past their ends is read in vain.
        let ahead = (u64::from(w.chunks) * CHUNK).min(v.covered.max(CHUNK));
        // Whole fill units (aligned), so that a stream's next chunks are queued, and read,
        // several at a time.
        let chunks = cfg.unit_for(v.covered);
        let unit = CHUNK * chunks as u64;
        let until = frontier.saturating_add(ahead).div_ceil(unit).saturating_mul(unit).min(self.size);
        let from = w.next.max(first);
        let (jobs, s) = self.queue(st, from, until, usize::MAX, Some(chain));
        let w = st.windows.get_mut(&chain).unwrap();
        w.next = w.next.max(s);
        if st.windows.len() > 2 * cfg.detect.history {
            let detector = &st.detector;
            st.windows.retain(|id, _| detector.is_live(*id));
        }
        (jobs, chunks)
    }

    /// Read-ahead jobs for the chunks from `from` (chunk-aligned) below `until` that are neither
    /// held nor in flight, at most `limit` of them; also where the walk stopped.
    fn queue(
        &self,
        st: &mut State,
        from: u64,
        until: u64,
        limit: usize,
        owner: Option<ChainId>,
    ) -> (Vec<Job>, u64) {
        let mut jobs = Vec::new();
        let mut s = from;
        while s < until && jobs.len() < limit {
            if !st.buffer.contains(s) && !st.in_flight.contains_key(&s) {
                st.tickets += 1;
                let len = CHUNK.min(self.size - s);
                st.in_flight
                    .insert(s, Flight { ticket: st.tickets, started: false, owner, read: 0, wanted: 0 });
                jobs.push(Job { start: s, len, owner, ticket: st.tickets, keep: false });
            }
            s += CHUNK;
        }
        (jobs, s)
    }

    /// Runs queued read-ahead jobs for consecutive chunks (on a background thread): those a
    /// client read did not take over meanwhile, each unbroken run of them with one read.
    fn run_jobs(&self, jobs: Vec<Job>) {
        // Within the budget of chunks read at once (one run alone may exceed it). Without
        // growing units, runs of at most `fill_chunks` on `threads` threads cannot exceed it.
        let counted = if self.cfg.units_grow() { jobs.len() } else { 0 };
        if counted > 0 {
            let mut st = self.state.lock().unwrap();
            while st.reading > 0 && st.reading + counted > self.cfg.budget() {
                st = self.landed.wait(st).unwrap();
            }
            st.reading += counted;
        }
        let claimed: Vec<bool> = jobs.iter().map(|j| self.claim(j)).collect();
        let mut i = 0;
        while i < jobs.len() {
            let n = claimed[i..].iter().take_while(|&&c| c).count();
            if n > 0 {
                // A failed read-ahead is nobody's error: the client's read of those bytes
                // meets it again (and reports it).
                if let Err(e) = self.fill(&jobs[i..i + n]) {
                    tracing::debug!("prefetch: {e}")
                }
            }
            i += n.max(1);
        }
        // CACHE jobs count until done, so that all of them together stay within the buffer.
        let cache = jobs.iter().filter(|j| j.owner.is_none()).count();
        if cache > 0 || counted > 0 {
            let mut st = self.state.lock().unwrap();
            st.cache_jobs -= cache;
            st.reading -= counted;
        }
        if counted > 0 {
            // Threads waiting for room in the budget look again.
            self.landed.notify_all();
        }
    }

    /// Marks a queued job's chunk as being read, unless a client read took it over or it is
    /// not worth reading any more; false: skip it.
    fn claim(&self, job: &Job) -> bool {
        let mut st = self.state.lock().unwrap();
        let ours = st.in_flight.get(&job.start).is_some_and(|f| f.ticket == job.ticket);
        if !ours {
            return false;
        }
        let gone = self.stopping.load(std::sync::atomic::Ordering::Relaxed);
        // A stream that stopped while its read-ahead waited in the queue gets none of it.
        let stale = job.owner.is_some_and(|c| !st.detector.is_live(c));
        if gone || stale {
            st.in_flight.remove(&job.start);
            if stale && !gone {
                st.buffer.stats.dropped += job.len;
            }
            drop(st);
            self.landed.notify_all();
            return false;
        }
        st.in_flight.get_mut(&job.start).expect("checked above").started = true;
        true
    }

    /// Reads consecutive chunks (each marked started in `in_flight` under its job's ticket)
    /// into the buffer with one read, on whichever thread: a read-ahead worker, or a client
    /// read that took a job over. The read's error, if it failed.
    fn fill(&self, jobs: &[Job]) -> Result<()> {
        // The generation when the read starts (not when it was queued: a write while it
        // waited changed nothing it will read).
        let (spares, since) = {
            let mut st = self.state.lock().unwrap();
            (jobs.iter().map(|_| st.buffer.spare()).collect::<Vec<_>>(), st.generation)
        };
        let mut datas: Vec<buffer::Data> =
            jobs.iter().zip(spares).map(|(j, spare)| buffer::Data::new(spare, j.len as usize)).collect();
        // One read for all.
        let read = self.inner.read_parts(datas.iter_mut().map(|d| &mut d[..]).collect(), jobs[0].start);
        let mut st = self.state.lock().unwrap();
        for (job, data) in jobs.iter().zip(datas) {
            let flight = st.in_flight.remove(&job.start);
            match &read {
                // Data read while a write over it completed may be stale: drop it.
                Ok(()) if !st.written_since(since, job.start, job.len) => {
                    // What clients have of it already: what its stream has read past (from
                    // below, or before it was queued) and what other reads took from below
                    // meanwhile; but not what reads waiting for it want.
                    let passed = job.owner.and_then(|c| st.detector.frontier(c)).unwrap_or(0);
                    let (read, wanted) = flight.map_or((0, 0), |f| (f.read, f.wanted));
                    let done = (buffer::pieces_read(job.start, job.len, 0, passed) | read) & !wanted;
                    if job.keep {
                        st.buffer.insert_kept(job.start, data, done);
                    } else {
                        st.buffer.insert(job.start, data, job.owner.map(|c| c.0), done);
                    }
                }
                // Stale, or failed: the client's own read of this range will meet and report
                // the error.
                _ => st.buffer.recycle(data),
            }
        }
        // Streams whose read-ahead was evicted unread read more slowly than they are read
        // ahead for: halve their windows.
        for owner in st.buffer.take_unread() {
            if let Some(w) = st.windows.get_mut(&ChainId(owner)) {
                w.chunks = (w.chunks / 2).max(1);
            }
        }
        drop(st);
        self.landed.notify_all();
        read
    }
}

/// See [`Prefetch::on_the_way`].
enum OnTheWay {
    Take(u64),
    Reading,
}

impl Prefetch {
    /// Whether a read is small enough to be shown to the detector and served from the buffer.
    fn small(&self, len: u64) -> bool {
        len != 0 && len <= self.shared.cfg.max_request
    }

    /// Shows a small read to the detector, queues the read-ahead its stream calls for, and
    /// serves it from the buffer if the buffer holds all of it. With `only_hits`, a read the
    /// buffer cannot serve is left alone, unrecorded (it comes again through `read`).
    ///
    /// A read whose chunks are all held or on their way is served from the buffer: it waits
    /// for chunks being read, and reads a chunk still queued itself (taking its job over).
    /// Reading those bytes again from below would double the device's work for them, and
    /// with guest reads overtaking read-ahead that was most of the over-read.
    ///
    /// `Err`: a chunk this read fetched itself could not be read (over object storage, after
    /// the store's retries): that is the read's error, not a reason to fetch it again.
    fn serve(&self, buf: &mut [u8], offset: u64, only_hits: bool) -> Result<bool> {
        let len = buf.len() as u64;
        let shared = &self.shared;
        let mut st = shared.state.lock().unwrap();
        if only_hits && !st.buffer.covers(offset, len) {
            return Ok(false);
        }
        let reads_around = shared.cfg.reads_around();
        // Decided before this read counts as touching its chunks.
        let around =
            reads_around && !only_hits && !st.buffer.covers(offset, len) && st.around.wants(offset, len);
        if reads_around {
            st.around.touch(offset, len);
        }
        let v = st.detector.observe(offset, len);
        let (mut joined, mut fetched) = (false, false);
        if !only_hits {
            while let Some(next) = Self::on_the_way(&st, offset, len, shared.cfg.whole_chunks || around) {
                match next {
                    OnTheWay::Take(start) => {
                        st.tickets += 1;
                        let ticket = st.tickets;
                        let fresh = !st.in_flight.contains_key(&start);
                        (fetched, joined) = (fetched | fresh, joined | !fresh);
                        let f = st.in_flight.entry(start).or_insert(Flight {
                            ticket,
                            started: true,
                            owner: None,
                            read: 0,
                            wanted: 0,
                        });
                        (f.ticket, f.started) = (ticket, true);
                        let job_len = CHUNK.min(shared.size - start);
                        let job = Job { start, len: job_len, owner: f.owner, ticket, keep: around && fresh };
                        if job.keep {
                            let wanted = (offset + len).min(start + job_len) - offset.max(start);
                            st.around.spend(job_len, wanted);
                        }
                        Self::mark_flights(&mut st, offset, len, shared.size, |f| &mut f.wanted);
                        drop(st);
                        shared.fill(std::slice::from_ref(&job))?;
                        st = shared.state.lock().unwrap();
                    }
                    OnTheWay::Reading => {
                        joined = true;
                        Self::mark_flights(&mut st, offset, len, shared.size, |f| &mut f.wanted);
                        st = shared.landed.wait(st).unwrap();
                    }
                }
            }
        }
        let from_kept = reads_around && st.buffer.kept(offset, len);
        let hit = st.buffer.serve(buf, offset);
        if hit && from_kept && !fetched {
            st.around.earn(len);
        }
        if hit && fetched {
            // Served, but after reading from below: a miss for the statistics.
            st.buffer.stats.hits -= 1;
            st.buffer.stats.misses += 1;
        } else if hit && joined {
            st.buffer.stats.joined += 1;
        }
        if !hit {
            // The read goes below: the pieces it covers of chunks on their way count as read.
            Self::mark_flights(&mut st, offset, len, shared.size, |f| &mut f.read);
        }
        let (jobs, unit) = if v.stream { shared.plan(&mut st, &v, hit) } else { (Vec::new(), 1) };
        drop(st);
        self.submit(jobs, unit);
        Ok(hit)
    }

    /// Adds the pieces a read of `[offset, offset+len)` covers to `mask` (read, or wanted) of
    /// each of its chunks on their way.
    fn mark_flights(st: &mut State, offset: u64, len: u64, size: u64, mask: fn(&mut Flight) -> &mut u64) {
        let mut c = offset / CHUNK * CHUNK;
        while c < offset + len {
            if let Some(f) = st.in_flight.get_mut(&c) {
                *mask(f) |= buffer::pieces_read(c, CHUNK.min(size - c), offset, offset + len);
            }
            c += CHUNK;
        }
    }

    /// What stands between a read and a hit: a chunk to read now (one still queued, which the
    /// read takes over, or with `whole` one neither held nor on its way), else one being read
    /// (to wait for). `None`: the buffer covers the read, or (without `whole`) some chunk of it
    /// is neither held nor on its way, and the read goes below.
    fn on_the_way(st: &State, offset: u64, len: u64, whole: bool) -> Option<OnTheWay> {
        let mut reading = false;
        let mut take = None;
        let mut c = offset / CHUNK * CHUNK;
        while c < offset + len {
            if !st.buffer.contains(c) {
                match st.in_flight.get(&c) {
                    None if !whole => return None,
                    Some(f) if f.started => reading = true,
                    _ => {
                        take.get_or_insert(c);
                    }
                }
            }
            c += CHUNK;
        }
        match take {
            Some(start) => Some(OnTheWay::Take(start)),
            None => reading.then_some(OnTheWay::Reading),
        }
    }

    /// Stops read-ahead: the workers end when the queue closes.
    fn stop(&self) {
        self.shared.stopping.store(true, std::sync::atomic::Ordering::Relaxed);
        drop(self.jobs.lock().unwrap().take());
        for w in self.workers.lock().unwrap().drain(..) {
            let _ = w.join();
        }
    }
}

/// Reads through the connection's own backend (`below`) unless the buffer serves them;
/// read-ahead through the filter's own. Every change of data goes to `below` and then drops
/// what it overlaps from the buffer.
impl Filter for Prefetch {
    fn caps(&self, below: &dyn Backend) -> Caps {
        Caps { at_hand: true, ..below.caps() }
    }

    fn read(&self, below: &dyn Backend, buf: &mut [u8], offset: u64) -> Result<usize> {
        if self.small(buf.len() as u64) && self.serve(buf, offset, false)? {
            return Ok(buf.len());
        }
        below.read(buf, offset)
    }

    fn read_at_hand(&self, below: &dyn Backend, buf: &mut [u8], offset: u64) -> Option<Result<usize>> {
        if !self.small(buf.len() as u64) {
            return below.read_at_hand(buf, offset);
        }
        // Only a hit is served here: nothing is read from below, so nothing fails.
        self.serve(buf, offset, true).ok()?.then_some(Ok(buf.len()))
    }

    fn write(&self, below: &dyn Backend, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let r = below.write(buf, offset, fua);
        self.invalidate(offset, buf.len() as u64);
        r
    }

    /// When the layer below takes the write at once (`--coalesce`).
    fn write_at_hand(&self, below: &dyn Backend, buf: &[u8], offset: u64) -> Option<Result<()>> {
        let r = below.write_at_hand(buf, offset)?;
        self.invalidate(offset, buf.len() as u64);
        Some(r)
    }

    fn write_merged(&self, below: &dyn Backend, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let r = below.write_merged(buf, offset, fua);
        self.invalidate(offset, buf.len() as u64);
        r
    }

    /// A hint about the layer below's pages: the buffer has nothing to prepare.
    fn will_write(&self, below: &dyn Backend, offset: u64, len: u64) {
        below.will_write(offset, len)
    }

    fn zero(&self, below: &dyn Backend, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        let r = below.zero(offset, len, flags);
        self.invalidate(offset, len);
        r
    }

    fn trim(&self, below: &dyn Backend, offset: u64, len: u64, fua: bool) -> Result<()> {
        let r = below.trim(offset, len, fua);
        self.invalidate(offset, len);
        r
    }

    fn flush(&self, below: &dyn Backend) -> Result<()> {
        below.flush()
    }

    /// NBD CACHE: reads `[offset, offset+len)` ahead into the buffer (as much of it as the
    /// buffer holds), instead of into the page cache.
    fn cache(&self, _below: &dyn Backend, offset: u64, len: u64) -> Result<()> {
        let shared = &self.shared;
        let mut st = shared.state.lock().unwrap();
        let end = offset.saturating_add(len).min(shared.size);
        // The buffer's worth in all, for every CACHE request together: more would only evict
        // itself, and queue work that runs on after its client has gone.
        let room = ((shared.cfg.size / CHUNK) as usize).saturating_sub(st.cache_jobs);
        let (jobs, _) = shared.queue(&mut st, offset / CHUNK * CHUNK, end, room, None);
        st.cache_jobs += jobs.len();
        drop(st);
        self.submit(jobs, shared.cfg.fill_chunks);
        Ok(())
    }

    fn extents(&self, below: &dyn Backend, offset: u64, len: u64) -> Result<Vec<Extent>> {
        below.extents(offset, len)
    }

    fn own(&self) -> &Arc<dyn Backend> {
        &self.shared.inner
    }

    fn finish(&self) -> Result<()> {
        // Stop read-ahead before the layer below cleans up its cache.
        self.stop();
        self.shared.inner.finish()
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MemoryBackend;
    use crate::filters::Front;
    use crate::testing::fault::{Fault, FaultInjector, Op, Rule};
    use std::time::{Duration, Instant};

    const MIB: u64 = 1 << 20;
    const K4: u64 = 4096;
    /// 4 KiB reads in a row that make a stream (64 KiB: `DetectConfig::min_run`).
    const STREAM: u64 = 16;

    /// A memory backend whose every 4 KiB block holds its own number (mod 251).
    fn patterned(size: u64) -> Arc<dyn Backend> {
        let m = MemoryBackend::new(size);
        let buf: Vec<u8> = (0..size).map(|i| (i / K4 % 251) as u8).collect();
        m.write(&buf, 0, false).unwrap();
        Arc::new(m)
    }

    /// Reads blocks `0..blocks` of a [`patterned`] export in order, 4 KiB each, checking
    /// them, and lets read-ahead finish every 16 blocks: never overtaken, each unit it
    /// queues is read by one request.
    fn read_behind_read_ahead(p: &Front<Prefetch>, blocks: u64) {
        let idle = || p.shared.state.lock().unwrap().in_flight.is_empty();
        let mut buf = [0u8; 4096];
        for i in 0..blocks {
            p.read(&mut buf, i * K4).unwrap();
            assert!(buf == [(i % 251) as u8; 4096], "block {i}");
            if i % 16 == 15 {
                wait_until("read-ahead", idle);
            }
        }
    }

    fn wait_until(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_sequential_reader_is_served_from_the_buffer() {
        let inner = patterned(8 * MIB);
        let p = Front::whole(Prefetch::new(inner.clone(), PrefetchConfig::default()));
        let (mut got, mut want) = ([0u8; 4096], [0u8; 4096]);
        for i in 0..8 * MIB / K4 {
            if i == STREAM {
                // The stream was found at the 16th read (64 KiB): its read-ahead is queued.
                wait_until("read-ahead", || p.shared.state.lock().unwrap().in_flight.is_empty());
            }
            p.read(&mut got, i * K4).unwrap();
            inner.read(&mut want, i * K4).unwrap();
            assert_eq!(got, want, "block {i}");
        }
        let s = p.stats();
        assert_eq!(s.streams_found, 1);
        assert!(s.buffer.hits >= CHUNK / K4, "{s:?}");
        assert!(s.held <= PrefetchConfig::default().size);
        p.finish().unwrap();
    }

    /// A stream is read ahead no further than it has read: a new one (64 KiB read) gets the
    /// chunk it is in and the next, however large its window; one that has read 1 MiB, more.
    #[test]
    fn read_ahead_reaches_no_further_than_the_stream_has_read() {
        let cfg = PrefetchConfig { window_min: 16, ..Default::default() };
        let p = Front::whole(Prefetch::new(patterned(16 * MIB), cfg));
        let idle = || p.shared.state.lock().unwrap().in_flight.is_empty();
        let mut buf = [0u8; 4096];
        for i in 0..STREAM {
            p.read(&mut buf, i * K4).unwrap();
        }
        wait_until("read-ahead", idle);
        let held = |c: u64| p.shared.state.lock().unwrap().buffer.contains(c * CHUNK);
        assert!(held(0) && held(1) && !held(2), "{:?}", p.stats());
        for i in STREAM..MIB / K4 {
            p.read(&mut buf, i * K4).unwrap();
        }
        wait_until("read-ahead", idle);
        assert!(held(4) && held(7) && !held(9), "{:?}", p.stats());
    }

    #[test]
    fn reads_at_hand_are_hits_only_and_misses_leave_no_trace() {
        let inner = patterned(8 * MIB);
        let p = Front::whole(Prefetch::new(inner.clone(), PrefetchConfig::default()));
        let (mut got, mut want) = ([0u8; 4096], [0u8; 4096]);
        // Nothing buffered: no answer, and nothing seen (the detector finds no stream in
        // reads that never reached it).
        for i in 0..8 {
            assert!(p.read_at_hand(&mut got, i * K4).is_none());
        }
        assert_eq!((p.stats().streams_found, p.stats().buffer.misses), (0, 0));
        for i in 0..STREAM {
            p.read(&mut got, i * K4).unwrap();
        }
        wait_until("read-ahead", || p.shared.state.lock().unwrap().in_flight.is_empty());
        // Read-ahead starts at the chunk the stream's frontier is in: the very next read is
        // a hit, and so is every one up to the end of the next chunk (a new stream's reach).
        for i in STREAM..2 * CHUNK / K4 {
            let n = p.read_at_hand(&mut got, i * K4).expect("a hit").unwrap();
            inner.read(&mut want, i * K4).unwrap();
            assert_eq!((n, got), (4096, want), "block {i}");
        }
        // Large reads are the layer below's to answer: a memory backend has them at hand.
        let mut big = vec![0u8; 1 << 20];
        assert!(p.read_at_hand(&mut big, 0).is_some());
    }

    #[test]
    fn random_reads_are_not_read_ahead() {
        let p = Front::whole(Prefetch::new(Arc::new(MemoryBackend::new(4 << 30)), PrefetchConfig::default()));
        let mut rng = crate::testing::conformance::Rng::new(9);
        let mut buf = [0u8; 4096];
        for _ in 0..5000 {
            p.read(&mut buf, rng.below((4 << 30) / K4) * K4).unwrap();
        }
        let s = p.stats();
        assert_eq!(s.streams_found, 0, "{s:?}");
        // Now and then a read lands in a chunk another touched lately: read around until the
        // starting credit is spent, and never again, since nothing reads those chunks.
        assert!((1..=5).contains(&s.read_around), "{s:?}");
        assert_eq!(s.buffer.prefetched, s.read_around * CHUNK, "{s:?}");
    }

    /// Scattered small reads that come back to the same chunks (a file system's metadata):
    /// the second read in a chunk reads it whole, the rest are hits, and it stays once read.
    #[test]
    fn reads_near_recent_ones_read_their_chunk_whole() {
        let inner = patterned(4 * MIB);
        let count = Rule::new(Op::Read, Fault::Slow(Duration::ZERO));
        let faults = Arc::new(FaultInjector::new(inner.clone(), vec![count]));
        let p = Front::whole(Prefetch::new(faults.clone(), PrefetchConfig::default()));
        let (mut got, mut want) = ([0u8; 4096], [0u8; 4096]);
        // Descending, 8 KiB apart: never a stream. Chunks 0 and 2, alternating.
        let blocks: Vec<u64> = (0..32).rev().flat_map(|i| [2 * i, 2 * CHUNK / K4 + 2 * i]).collect();
        for pass in 0..2 {
            for &b in &blocks {
                p.read(&mut got, b * K4).unwrap();
                inner.read(&mut want, b * K4).unwrap();
                assert_eq!(got, want, "block {b}, pass {pass}");
            }
        }
        let s = p.stats();
        assert_eq!(s.read_around, 2, "{s:?}");
        // The first read of each chunk, then each chunk whole: and nothing more, though the
        // second pass came after the first had read every piece it asked for.
        assert_eq!(faults.fired()[0], 4, "{s:?}");
        assert_eq!(s.buffer.hits, 4 * 32 - 4, "{s:?}");
        assert_eq!(s.streams_found, 0);
    }

    #[test]
    fn cache_requests_fill_the_buffer() {
        let inner = patterned(4 * MIB);
        let p = Front::whole(Prefetch::new(inner.clone(), PrefetchConfig::default()));
        p.cache(MIB + 100, MIB).unwrap();
        // All of it: chunks land in any order, so "1 MiB held" could be the wrong four.
        wait_until("the cached range", || p.shared.state.lock().unwrap().in_flight.is_empty());
        assert!(p.stats().held >= MIB);
        let (mut got, mut want) = ([0u8; 4096], [0u8; 4096]);
        for i in 0..MIB / K4 {
            p.read(&mut got, MIB + i * K4).unwrap();
            inner.read(&mut want, MIB + i * K4).unwrap();
            assert_eq!(got, want);
        }
        assert!(p.stats().buffer.hits >= MIB / K4);
        // Never more than the bound, however much is asked for.
        let small = Front::whole(Prefetch::new(
            patterned(4 * MIB),
            PrefetchConfig { size: CHUNK * 2, ..Default::default() },
        ));
        small.cache(0, 4 * MIB).unwrap();
        wait_until("the jobs", || small.shared.state.lock().unwrap().in_flight.is_empty());
        assert!(small.stats().held <= 2 * CHUNK);
    }

    #[test]
    fn a_stream_whose_read_ahead_goes_unread_gets_a_smaller_window() {
        // Room for two chunks, what a new stream reads ahead (the chunk it is in and the next):
        // stream B's read-ahead evicts stream A's, the next of which A never read.
        let cfg = PrefetchConfig { size: 2 * CHUNK, read_around: false, ..PrefetchConfig::default() };
        let p = Front::whole(Prefetch::new(patterned(8 * MIB), cfg));
        let idle = || p.shared.state.lock().unwrap().in_flight.is_empty();
        let window_below = |limit: u64| {
            let st = p.shared.state.lock().unwrap();
            st.windows.values().find(|w| w.next < limit).map(|w| w.chunks)
        };
        let mut buf = [0u8; 4096];
        for i in 0..STREAM {
            p.read(&mut buf, i * K4).unwrap();
        }
        wait_until("A's read-ahead", idle);
        assert_eq!(window_below(MIB), Some(cfg.window_min));
        for i in 0..STREAM {
            p.read(&mut buf, 6 * MIB + i * K4).unwrap();
        }
        wait_until("B's read-ahead", idle);
        assert_eq!(window_below(MIB), Some(cfg.window_min / 2), "{:?}", p.stats());
        assert!(p.stats().buffer.wasted >= CHUNK);
    }

    #[test]
    fn large_reads_pass_through() {
        let p = Front::whole(Prefetch::new(patterned(8 * MIB), PrefetchConfig::default()));
        let mut buf = vec![0u8; 1 << 20];
        for i in 0..8 {
            p.read(&mut buf, i << 20).unwrap();
        }
        assert_eq!(p.stats().streams_found, 0);
    }

    /// A stream's read-ahead with chunk 1's read done but answered 300 ms late: returned once
    /// that read has begun below (and its fill has taken its generation), and 20 ms more for
    /// the memory read itself, with the answer still about 280 ms away.
    fn late_chunk_1() -> Front<Prefetch> {
        let mem = patterned(4 * MIB);
        let late = Rule::new(Op::Read, Fault::Late(Duration::from_millis(300))).at(CHUNK, CHUNK).times(1);
        let faults = Arc::new(FaultInjector::new(mem, vec![late]));
        let p = Front::whole(Prefetch::new(faults.clone(), PrefetchConfig::default()));
        let mut buf = [0u8; 4096];
        for i in 0..STREAM {
            p.read(&mut buf, i * K4).unwrap();
        }
        wait_until("chunk 1's read below", || faults.fired()[0] == 1);
        std::thread::sleep(Duration::from_millis(20));
        assert!(p.shared.state.lock().unwrap().in_flight.contains_key(&CHUNK));
        p
    }

    /// A read that meets its chunk on the way reads nothing from below: a chunk still queued
    /// it reads itself (the queued job is then skipped), one being read it waits for.
    #[test]
    fn reads_meeting_read_ahead_on_its_way_join_it() {
        // The reads must come while chunk 0's read-ahead is held up (300 ms): on a machine
        // that stalls the test longer, nothing is on its way any more and the scenario is run
        // again. Whatever the timing, no chunk is read twice.
        let joined_both = (0..5).any(|_| {
            let (fired, s) = join_read_ahead_once();
            assert_eq!(fired[..2], [STREAM + 1, 1], "reads of chunks 0 and 1 below: {s:?}");
            assert_eq!(s.buffer.hits, 2, "{s:?}");
            s.buffer.joined == 2
        });
        assert!(joined_both, "no run of five had both reads join read-ahead on its way");
    }

    /// One run of the scenario above: the reads below (per rule) and the statistics.
    fn join_read_ahead_once() -> (Vec<u64>, PrefetchStats) {
        // One read-ahead thread, held up 300 ms by chunk 0 (the read after the stream's own 16).
        let count = |at: u64| Rule::new(Op::Read, Fault::Slow(Duration::ZERO)).at(at, CHUNK);
        let slow =
            Rule::new(Op::Read, Fault::Slow(Duration::from_millis(300))).at(0, CHUNK).every(1, 16).times(1);
        let faults = Arc::new(FaultInjector::new(patterned(4 * MIB), vec![count(0), count(CHUNK), slow]));
        let cfg = PrefetchConfig { threads: 1, read_around: false, ..Default::default() };
        let p = Front::whole(Prefetch::new(faults.clone(), cfg));
        let mut buf = [0u8; 4096];
        for i in 0..STREAM {
            p.read(&mut buf, i * K4).unwrap();
        }
        wait_until("chunk 0's read-ahead", || faults.fired()[2] == 1);
        // Chunk 1 waits in the queue behind chunk 0: taken over.
        p.read(&mut buf, CHUNK + K4).unwrap();
        assert_eq!(buf, [((CHUNK + K4) / K4 % 251) as u8; 4096]);
        // Chunk 0 is being read: waited for.
        p.read(&mut buf, STREAM * K4).unwrap();
        assert_eq!(buf, [(STREAM % 251) as u8; 4096]);
        wait_until("the queue", || p.shared.state.lock().unwrap().in_flight.is_empty());
        (faults.fired(), p.stats())
    }

    /// With whole chunks (object storage), a small read that misses reads its whole chunk;
    /// the next reads in it, and reads that come back after it was read through, are hits.
    #[test]
    fn whole_chunks_serve_reads_near_one_another_from_one_read_below() {
        let count = Rule::new(Op::Read, Fault::Slow(Duration::ZERO));
        let faults = Arc::new(FaultInjector::new(patterned(4 * MIB), vec![count]));
        let cfg = PrefetchConfig { whole_chunks: true, ..Default::default() };
        let p = Front::whole(Prefetch::new(faults.clone(), cfg));
        let mut buf = [0u8; 4096];
        // Scattered over one chunk, backwards (no stream: no read-ahead), then all of it
        // backwards, then once more: one read below.
        for i in (0..CHUNK / K4).rev().step_by(3).chain((0..CHUNK / K4).rev()).chain([0]) {
            p.read(&mut buf, MIB + i * K4).unwrap();
            assert!(buf == [((MIB + i * K4) / K4 % 251) as u8; 4096], "block {i}");
        }
        assert_eq!(faults.fired(), [1], "{:?}", p.stats());
        let s = p.stats().buffer;
        assert_eq!((s.misses, s.hits), (1, (CHUNK / K4).div_ceil(3) - 1 + CHUNK / K4 + 1), "{s:?}");
        // A write drops it: the next read reads the chunk again, with the new bytes.
        p.write(&[0xeeu8; 4096], MIB + K4, false).unwrap();
        p.read(&mut buf, MIB + K4).unwrap();
        assert!(buf == [0xeeu8; 4096]);
        assert_eq!(faults.fired(), [2]);
    }

    /// A chunk a read fetches itself (whole chunks) that cannot be read is that read's
    /// error, after one read below: not fetched again and again (each retry, over object
    /// storage, is the store's whole retry bound), and no hang. The next read tries anew.
    #[test]
    fn a_chunk_that_fails_is_the_reads_error() {
        let fail = Rule::new(Op::Read, Fault::Fail(crate::error::ErrorKind::Io)).times(2);
        let faults = Arc::new(FaultInjector::new(patterned(4 * MIB), vec![fail]));
        let cfg = PrefetchConfig { whole_chunks: true, ..Default::default() };
        let p = Front::whole(Prefetch::new(faults.clone(), cfg));
        let mut buf = [0u8; 4096];
        for n in 1..=2 {
            let e = p.read(&mut buf, MIB + K4).unwrap_err();
            assert_eq!(e.kind(), crate::error::ErrorKind::Io, "{e}");
            assert_eq!(faults.fired(), [n]);
        }
        p.read(&mut buf, MIB + K4).unwrap();
        assert!(buf == [((MIB + K4) / K4 % 251) as u8; 4096]);
    }

    /// With `fill_chunks`, a stream's read-ahead is queued in aligned units of that many
    /// chunks and each unit is read with one request.
    #[test]
    fn read_ahead_reads_whole_units_at_once() {
        let count = Rule::new(Op::Read, Fault::Slow(Duration::ZERO)).at(MIB, MIB);
        let faults = Arc::new(FaultInjector::new(patterned(4 * MIB), vec![count]));
        let cfg = PrefetchConfig { fill_chunks: 4, ..Default::default() };
        let p = Front::whole(Prefetch::new(faults.clone(), cfg));
        read_behind_read_ahead(&p, 2 * MIB / K4);
        assert_eq!(faults.fired(), [1], "the second MiB in one read: {:?}", p.stats());
        assert!(p.stats().buffer.hits >= (2 * MIB - 64 * K4) / K4, "{:?}", p.stats());
    }

    /// A long stream's read-ahead reads grow with it, up to `fill_chunks_max`: [24, 28) MiB
    /// of a 28 MiB stream in four 1 MiB reads (sixteen of a chunk without growth).
    #[test]
    fn a_long_streams_read_ahead_reads_grow() {
        for (max, want) in [(4, 4), (1, 16)] {
            let count = Rule::new(Op::Read, Fault::Slow(Duration::ZERO)).at(24 * MIB, 4 * MIB);
            let faults = Arc::new(FaultInjector::new(patterned(32 * MIB), vec![count]));
            let cfg =
                PrefetchConfig { threads: 4, fill_chunks_max: max, window_max: 32, ..Default::default() };
            let p = Front::whole(Prefetch::new(faults.clone(), cfg));
            read_behind_read_ahead(&p, 28 * MIB / K4);
            assert_eq!(faults.fired(), [want], "fill_chunks_max {max}: {:?}", p.stats());
        }
    }

    /// Read-ahead threads read at most `threads × fill_chunks` chunks at once, whatever the
    /// units: 4 threads with 8 units of 4 chunks queued read 4 chunks at a time, not 16.
    #[test]
    fn read_ahead_reads_within_its_budget() {
        let slow = Rule::new(Op::Read, Fault::Slow(Duration::from_millis(5)));
        let faults = Arc::new(FaultInjector::new(patterned(32 * MIB), vec![slow]));
        let cfg = PrefetchConfig { threads: 4, fill_chunks_max: 4, window_max: 32, ..Default::default() };
        let budget = cfg.budget();
        let p = Front::whole(Prefetch::new(faults.clone(), cfg));
        let (mut most, mut buf) = (0, [0u8; 4096]);
        for i in 0..24 * MIB / K4 {
            p.read(&mut buf, i * K4).unwrap();
            assert!(buf == [(i % 251) as u8; 4096], "block {i}");
            most = most.max(p.shared.state.lock().unwrap().reading);
        }
        assert!(most > 1 && most <= budget, "{most} chunks read at once, budget {budget}");
    }

    /// A write elsewhere while read-ahead is in flight leaves it alone: chunk 1 (answered
    /// 300 ms late) is buffered although a write 3 MiB away completed meanwhile. Before, any
    /// write discarded every fill in flight.
    #[test]
    fn writes_elsewhere_keep_read_ahead_in_flight() {
        let p = late_chunk_1();
        let mut buf = [0u8; 4096];
        p.write(&[0xeeu8; 4096], 3 * MIB, false).unwrap();
        wait_until("the late read-ahead", || p.shared.state.lock().unwrap().in_flight.is_empty());
        assert!(p.shared.state.lock().unwrap().buffer.contains(CHUNK), "{:?}", p.stats());
        p.read(&mut buf, CHUNK + 2 * K4).unwrap();
        assert_eq!(buf, [((CHUNK + 2 * K4) / K4 % 251) as u8; 4096]);
    }

    /// More writes during a fill than the log remembers: the fill cannot tell whether one of
    /// the forgotten ones overlapped it, and is discarded.
    #[test]
    fn read_ahead_older_than_the_write_log_is_discarded() {
        let p = late_chunk_1();
        for i in 0..WRITE_LOG as u64 + 1 {
            p.write(&[0xeeu8; 512], 3 * MIB + i % 64 * 512, false).unwrap();
        }
        wait_until("the late read-ahead", || p.shared.state.lock().unwrap().in_flight.is_empty());
        assert!(!p.shared.state.lock().unwrap().buffer.contains(CHUNK), "{:?}", p.stats());
    }

    /// Many CACHE requests at once queue the buffer's worth of read-ahead in all, not each.
    #[test]
    fn cache_requests_together_queue_at_most_the_buffer() {
        let slow = Rule::new(Op::Read, Fault::Slow(Duration::from_millis(20)));
        let inner = Arc::new(FaultInjector::new(patterned(8 * MIB), vec![slow]));
        let p = Front::whole(Prefetch::new(inner, PrefetchConfig { size: 2 * CHUNK, ..Default::default() }));
        for i in 0..16 {
            p.cache(i * 2 * CHUNK, 2 * CHUNK).unwrap();
            assert!(p.shared.state.lock().unwrap().in_flight.len() <= 2, "request {i}");
        }
        // A job leaves `in_flight` when its chunks land and stops counting a moment later.
        wait_until("the jobs", || {
            let st = p.shared.state.lock().unwrap();
            st.in_flight.is_empty() && st.cache_jobs == 0
        });
        // And once they are done, room again.
        p.cache(6 * MIB, CHUNK).unwrap();
        wait_until("the last job", || p.shared.state.lock().unwrap().in_flight.is_empty());
        assert!(p.shared.state.lock().unwrap().buffer.contains(6 * MIB));
    }

    #[test]
    fn writes_win_over_read_ahead_that_raced_them() {
        // The read-ahead of chunk 1 reads the old bytes, then answers 300 ms late.
        let p = late_chunk_1();
        let mut buf = [0u8; 4096];
        let new = [0xeeu8; 4096];
        p.write(&new, CHUNK + 2 * K4, false).unwrap();
        wait_until("the late read-ahead", || p.shared.state.lock().unwrap().in_flight.is_empty());
        p.read(&mut buf, CHUNK + 2 * K4).unwrap();
        assert_eq!(buf, new, "a read after the write returned the read-ahead's stale bytes");

        // Chunk 2, buffered (by a CACHE request) before its write: the write drops it.
        p.cache(2 * CHUNK, CHUNK).unwrap();
        wait_until("chunk 2", || p.shared.state.lock().unwrap().buffer.contains(2 * CHUNK));
        p.zero(2 * CHUNK + K4, K4, ZeroFlags::default()).unwrap();
        p.read(&mut buf, 2 * CHUNK + K4).unwrap();
        assert_eq!(buf, [0u8; 4096]);
        p.read(&mut buf, 2 * CHUNK).unwrap();
        assert_eq!(buf, [(2 * CHUNK / K4 % 251) as u8; 4096]);
    }
}
