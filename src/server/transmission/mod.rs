//! The transmission phase of one connection: a reader that parses and validates requests,
//! a few workers that carry them out in parallel against the connection's backend, and
//! replies written whole (one `writev`) under a lock, in whatever order they complete. Every
//! reply is framed by [`Reply`] (simple or structured, as negotiated): its headers are
//! values on the stack, sent ahead of the data in the worker's buffer without a copy.
//! Small reads whose bytes the backend has at hand (prefetch hits), and writes it takes
//! without waiting (`--coalesce`), are carried out by the reader itself: for them the
//! hand-off to a worker was most of the cost.
//!
//! Reads that continue one another and arrive together (a client with many requests in
//! flight, like nbdcopy's 64 × 256 KiB) are merged into one backend read of up to
//! [`MERGE_MAX`], as a block-layer plug would: the device serves one 4 MiB read faster than
//! sixteen 256 KiB ones. Only requests already received are merged, so nothing waits for it.
//!
//! - [`reader`]: the reader's loop: requests read, validated, answered there or handed out;
//! - [`job`]: what is handed out ([`Job`]), and the bytes a connection may have in flight;
//! - [`commands`]: each command carried out and answered;
//! - [`cork`]: replies written whole, and those of the reader gathered into one write.

mod commands;
mod cork;
mod job;
mod reader;

use std::io::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::handshake::Agreed;
use super::inbox::Inbox;
use super::validate::Limits;
use super::Server;
use crate::backend::Backend;
use crate::error::{Error, Op, Result, Sticky};
use crate::io::AlignedBuf;
use job::{Budget, Job};

/// Largest backend read that adjacent READ requests are merged into. nbdcopy keeps
/// 64 × 256 KiB in flight per connection: 4 workers each reading 4 MiB keep all of it at the
/// device as few large reads (the kernel splits them at `max_sectors_kb`). 4 GiB `nbdcopy URI
/// null:` from an uncached file, 11 paired runs, median: 1 MiB 2.74 and 3.11 s, 2 MiB 2.96 s,
/// 4 MiB 2.61 and 2.68 s; `--threads 8` with 1 MiB was slower (3.27 s): more, smaller reads
/// out of order merge less in the block layer.
const MERGE_MAX: u64 = 4 << 20;

/// What the reader buffers of the socket ([`Inbox`]): many requests arrive in one system
/// call. WRITE payloads up to half of it are read into it and written from there.
const READER_BUFFER: usize = 64 << 10;

/// The largest request the reader carries out itself (see [`reader`]): the hand-off it
/// saves matters for small requests, and a large one would hold up the reading of the next.
const INLINE_MAX: u64 = 64 << 10;

/// A worker's read buffer above this size is given back after the request: a client that
/// sent one 32 MiB READ should not leave each worker holding 32 MiB for good. Merged reads
/// fit: `--threads` × 4 MiB per connection at most.
const KEEP_BUFFER_MAX: usize = MERGE_MAX as usize;

/// Serves a connection's requests from the end of its handshake to its disconnect.
pub fn run(
    server: &Server,
    backend: Arc<dyn Backend>,
    agreed: Agreed,
    reader: super::inbox::Incoming,
    writer: Box<dyn Write + Send>,
    closer: crate::stream::Closer,
) -> Result<()> {
    let mut reader = Inbox::new(reader, READER_BUFFER);
    let caps = backend.caps();
    let export = &server.export;
    let limits = Limits {
        size: export.size,
        read_only: export.read_only,
        block_sizes_agreed: agreed.block_sizes,
        min_block: caps.block.minimum,
        max_payload: super::validate::max_payload(agreed.block_sizes, caps.block.maximum),
        structured: agreed.structured,
        meta_context: agreed.meta_context || agreed.bitmaps != 0,
        can_trim: caps.can_trim,
        can_zero: caps.can_zero,
        can_fast_zero: caps.can_fast_zero,
        can_flush: caps.can_flush,
        can_cache: true,
    };
    let writer = Mutex::new(writer);
    let broken = Sticky::default();
    // Each worker waits on the channel itself (crossbeam's receivers are shared): behind a
    // Mutex<Receiver> the worker holding the lock sleeps in recv while the others sleep on
    // the lock, two wake-ups per job.
    let (tx, rx) = crossbeam_channel::bounded::<Job<'static>>(server.threads * 2);
    let budget = Budget::default();
    let conn = Conn {
        backend: &*backend,
        agreed,
        bitmaps: export.bitmaps.as_deref(),
        writer: &writer,
        broken: &broken,
        latch: &export.latch,
        budget: &budget,
        at_hand: caps.at_hand,
        in_flight: AtomicUsize::new(0),
        recent_ns: AtomicU64::new(u64::MAX),
    };

    let result = std::thread::scope(|s| {
        for _ in 0..server.threads {
            // Named, so that a profile, `top -H` or a test tells the workers from the reader.
            let worker = std::thread::Builder::new().name(WORKER_THREAD.into());
            let spawned = worker.spawn_scoped(s, || {
                // One read buffer per worker, reused: a fresh allocation per request costs
                // page faults and zeroing on every read.
                let mut buf = AlignedBuf::new(0);
                loop {
                    let job = rx.recv();
                    match job {
                        Ok(job) => {
                            conn.serve_job(server, job, &mut buf, &closer);
                            conn.in_flight.fetch_sub(1, Ordering::Release);
                        }
                        Err(_) => return,
                    }
                }
            });
            // No thread to be had (the host's limit): the connection ends, the server goes on.
            if let Err(e) = spawned {
                drop(tx);
                return Err(Error::io(Op::Serve, e));
            }
        }
        let r = reader::read_requests(server, &limits, &conn, &mut reader, &tx, &closer);
        drop(tx);
        r
    });
    // Every request has been answered; the clean-up of the cache policy runs now.
    if let Err(e) = backend.finish() {
        tracing::warn!("{e}");
    }
    result
}

/// What the reader and the workers of one connection share.
struct Conn<'a> {
    backend: &'a dyn Backend,
    agreed: Agreed,
    /// The export's dirty bitmaps (`--dirty-bitmap`), if it has any.
    bitmaps: Option<&'a crate::bitmap::Tracker>,
    writer: &'a Mutex<Box<dyn Write + Send>>,
    /// Why the connection ends: a reply could not be written (the client is gone), or a
    /// request's handling panicked.
    broken: &'a Sticky,
    latch: &'a Sticky,
    budget: &'a Budget,
    /// The backend may answer reads or writes at hand (`Caps::at_hand`): asked once, here.
    at_hand: bool,
    /// Jobs handed to the workers and not yet served.
    in_flight: AtomicUsize,
    /// Recent service time of small READs and WRITEs, in ns (an average over about the last
    /// eight); `u64::MAX` before the first.
    recent_ns: AtomicU64,
}

/// The name of a connection's worker threads (within the kernel's 15 characters, so that
/// `top -H` shows it whole).
pub const WORKER_THREAD: &str = "lf-worker";

/// Small READs and WRITEs that take less than this (on average, recently) are carried out by
/// the reader even for a client that pipelines: a hand-off to a worker costs about this much
/// CPU (bench/limits.sh: 7 µs a request at depth 16 against 6.5 without hand-offs).
const FAST_NS: u64 = 15_000;

/// Small READs and WRITEs that take less than this are carried out by the reader for a client
/// that pipelines when nothing else is in flight: a local disk's (a 4 KiB read here: 29 µs),
/// not object storage's or a busy spinning disk's, whose wait a request sent meanwhile should
/// not share.
const QUICK_NS: u64 = 1_000_000;

impl Conn<'_> {
    fn fast(&self) -> bool {
        self.recent_ns.load(Ordering::Relaxed) < FAST_NS
    }

    fn quick(&self) -> bool {
        self.recent_ns.load(Ordering::Relaxed) < QUICK_NS
    }

    /// A small READ or WRITE took `t`.
    fn took(&self, t: std::time::Duration) {
        let t = t.as_nanos().min(u128::from(u64::MAX / 2)) as u64;
        let old = self.recent_ns.load(Ordering::Relaxed);
        let new = if old == u64::MAX { t } else { old - old / 8 + t / 8 };
        self.recent_ns.store(new, Ordering::Relaxed);
    }

    /// Serves one job (a worker's, or the reader's own), gives back its budget, and times it
    /// if it is a small READ or WRITE ([`Conn::took`]). A panic below (a bug) ends the
    /// connection: the request has no answer and one may be half sent, so the client sees the
    /// connection close rather than wait for ever, and the server goes on.
    fn serve_job(&self, server: &Server, job: Job<'_>, buf: &mut AlignedBuf, closer: &crate::stream::Closer) {
        let started = job.is_small_io().then(std::time::Instant::now);
        let weight = job.weight();
        let (req, arrived, merged) = (job.req, job.arrived, !job.merged.is_empty());
        // `Some(ok)` for a request of its own; merged READs are recorded one by one inside.
        let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if merged {
                self.read_merged(server, job, buf);
                None
            } else {
                Some(self.handle(job, buf))
            }
        }));
        // One clock read for the statistics and the timing of small requests.
        let now = std::time::Instant::now();
        if let Ok(Some(ok)) = served {
            server.stats.record(req.cmd, req.len, now - arrived, ok);
        }
        if served.is_err() {
            tracing::error!(
                "internal error serving {} at {}+{}: closing the connection",
                super::stats::command_name(req.cmd),
                req.offset,
                req.len
            );
            let why = Error::new(crate::ErrorKind::Io, Op::Serve).detail("internal error: connection closed");
            self.broken.set(&why);
            closer();
            *buf = AlignedBuf::new(0);
        }
        self.budget.give(weight);
        if buf.len() > KEEP_BUFFER_MAX {
            *buf = AlignedBuf::new(0);
        }
        if let Some(started) = started {
            self.took(now - started);
        }
    }
}
