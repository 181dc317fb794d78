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

use std::borrow::Cow;
use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::handshake::{Agreed, BASE_ALLOCATION_ID};
use super::inbox::Inbox;
use super::validate::{check, Limits, Verdict};
use super::Server;
use crate::backend::{Backend, ZeroFlags};
use crate::error::{Error, Op, Result, Sticky};
use crate::io::AlignedBuf;
use crate::proto::*;
use crate::stream::write_all_vectored;

/// Smallest READ for which holes are looked up and sent as `OFFSET_HOLE` chunks.
const HOLE_LOOKUP_MIN: usize = 64 << 10;

/// Most base:allocation descriptors in one reply.
const MAX_DESCRIPTORS: usize = 1 << 16;

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

/// The largest request the reader carries out itself (see `read_requests`): the hand-off it
/// saves matters for small requests, and a large one would hold up the reading of the next.
const INLINE_MAX: u64 = 64 << 10;

/// Replies the reader gathers before writing them together (see [`Cork`]); a reply larger
/// than this goes out at once, with what was gathered before it.
const CORK_MAX: usize = 16 << 10;

std::thread_local! {
    /// The reader thread's gathered replies ([`Cork`]); `None` on the workers, which write
    /// each reply as it is ready.
    static CORKED: std::cell::RefCell<Option<Vec<u8>>> = const { std::cell::RefCell::new(None) };
}

/// Bytes of READ and WRITE requests one connection may have in flight (read, not yet
/// answered). Beyond it the reader stops reading requests until replies go out, and TCP
/// pushes back on the client: without it one client could make the server hold its queue's
/// worth of 64 MiB payloads (16 of them per connection). One request is always let in, so a
/// request up to the maximum payload is never refused by it. Refused requests weigh nothing:
/// a refused WRITE's payload is thrown away as it is read.
const IN_FLIGHT_MAX: u64 = 64 << 20;

/// A worker's read buffer above this size is given back after the request: a client that
/// sent one 32 MiB READ should not leave each worker holding 32 MiB for good. Merged reads
/// fit: `--threads` × 4 MiB per connection at most.
const KEEP_BUFFER_MAX: usize = MERGE_MAX as usize;

/// Request bytes in flight on one connection (see [`IN_FLIGHT_MAX`]).
#[derive(Default)]
struct Budget {
    state: Mutex<BudgetState>,
    freed: std::sync::Condvar,
}

#[derive(Default)]
struct BudgetState {
    used: u64,
    /// The reader is waiting in `take` (only the reader takes: one waiter at most): only
    /// then does `give` wake it. A notification costs a futex system call whether anyone
    /// waits or not (std's condition variable does not count waiters), one per request
    /// otherwise.
    waiting: bool,
}

impl Budget {
    fn try_take(&self, n: u64) -> bool {
        let mut st = self.state.lock().unwrap();
        if st.used == 0 || st.used + n <= IN_FLIGHT_MAX {
            st.used += n;
            return true;
        }
        false
    }

    fn take(&self, n: u64) {
        let mut st = self.state.lock().unwrap();
        while st.used != 0 && st.used + n > IN_FLIGHT_MAX {
            st.waiting = true;
            st = self.freed.wait(st).unwrap();
        }
        st.waiting = false;
        st.used += n;
    }

    fn give(&self, n: u64) {
        if n > 0 {
            let mut st = self.state.lock().unwrap();
            st.used -= n;
            if st.waiting {
                self.freed.notify_one();
            }
        }
    }
}

/// The bytes of a request that count against the budget.
fn weight(req: &Request) -> u64 {
    if matches!(req.cmd, CMD_READ | CMD_WRITE) {
        req.len
    } else {
        0
    }
}

/// A request to carry out. A WRITE's payload is its own (a job for the workers), or borrowed
/// from the reader's buffer (a small WRITE the reader carries out itself: no allocation or
/// copy).
struct Job<'p> {
    req: Request,
    payload: Option<Cow<'p, [u8]>>,
    /// When the request was read, for the latency figures.
    arrived: std::time::Instant,
    /// READs that continue `req` (and one another), merged into one backend read.
    merged: Vec<(Request, std::time::Instant)>,
}

impl Job<'_> {
    /// The job with a payload of its own, for the workers.
    fn into_owned(self) -> Job<'static> {
        let Job { req, payload, arrived, merged } = self;
        Job { req, payload: payload.map(|p| Cow::Owned(p.into_owned())), arrived, merged }
    }

    /// A READ or WRITE of at most [`INLINE_MAX`] bytes, not merged.
    fn is_small_io(&self) -> bool {
        matches!(self.req.cmd, CMD_READ | CMD_WRITE) && self.req.len <= INLINE_MAX && self.merged.is_empty()
    }

    fn end(&self) -> u64 {
        self.merged.last().map_or(self.req.offset + self.req.len, |(r, _)| r.offset + r.len)
    }

    fn weight(&self) -> u64 {
        weight(&self.req) + self.merged.iter().map(|(r, _)| weight(r)).sum::<u64>()
    }

    fn merged_len(&self) -> u64 {
        self.end() - self.req.offset
    }

    /// Whether `req` is a READ that continues this one within [`MERGE_MAX`]. Empty READs are
    /// never merged: the merged reply gives each request an `OFFSET_DATA` chunk, which must
    /// hold at least one byte; alone, an empty READ gets `NBD_REPLY_TYPE_NONE` (found by the
    /// `connection` fuzz target).
    fn can_merge(&self, req: &Request) -> bool {
        self.req.cmd == CMD_READ
            && req.cmd == CMD_READ
            && self.req.len > 0
            && req.len > 0
            && req.flags == self.req.flags
            && req.offset == self.end()
            && self.merged_len() + req.len <= MERGE_MAX
    }
}

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
        meta_context: agreed.meta_context,
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
        writer: &writer,
        broken: &broken,
        latch: &export.latch,
        budget: &budget,
        in_flight: AtomicUsize::new(0),
        recent_ns: AtomicU64::new(u64::MAX),
    };

    let result = std::thread::scope(|s| {
        for _ in 0..server.threads {
            s.spawn(|| {
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
        }
        let r = read_requests(server, &limits, &conn, &mut reader, &tx, &closer);
        drop(tx);
        r
    });
    // Every request has been answered; the clean-up of the cache policy runs now.
    if let Err(e) = backend.finish() {
        tracing::warn!("{e}");
    }
    result
}

/// A failed read of the client's requests.
fn received(e: io::Error) -> Error {
    Error::io(Op::Receive, e)
}

fn read_requests(
    server: &Server,
    limits: &Limits,
    conn: &Conn,
    reader: &mut Inbox,
    tx: &crossbeam_channel::Sender<Job<'static>>,
    closer: &crate::stream::Closer,
) -> Result<()> {
    // The reader's own buffer for reads it answers itself.
    let mut at_hand = AlignedBuf::new(HOLE_LOOKUP_MIN);
    // The reader's buffer for the small READs and WRITEs it carries out itself (below).
    let mut own = AlignedBuf::new(0);
    let cork = Cork::new(conn);
    let send = |job: Job<'static>| {
        conn.in_flight.fetch_add(1, Ordering::Acquire);
        match tx.try_send(job) {
            Ok(()) => true,
            // The workers are all busy and the queue is full: the reader will wait, so what
            // it gathered goes first.
            Err(crossbeam_channel::TrySendError::Full(job)) => {
                cork.flush();
                tx.send(job).is_ok()
            }
            Err(crossbeam_channel::TrySendError::Disconnected(_)) => false,
        }
    };
    // A READ held back in case the next request continues it.
    let mut held: Option<Job<'static>> = None;
    // A request came while another was in flight: the client pipelines, and the reader hands
    // its jobs to the workers from then on (but for fast ones: [`Conn::fast`]).
    let mut pipelined = false;
    loop {
        // No whole request is left in the buffer: what is held goes now, and the gathered
        // replies before the reader waits ([`Cork`]).
        if reader.buffer().len() < REQUEST_LEN {
            if let Some(job) = held.take() {
                if !send(job) {
                    return Ok(());
                }
            }
            // A client that vanishes between requests is a normal end.
            if !reader
                .fill_to(REQUEST_LEN, pipelined && cork.holds_replies(), || cork.flush())
                .map_err(received)?
            {
                return Ok(());
            }
        }
        let arrived = std::time::Instant::now();
        let h: &[u8; REQUEST_LEN] =
            reader.buffer()[..REQUEST_LEN].try_into().expect("a whole header is held");
        let Some(req) = parse_request(h) else {
            return Err(Error::invalid(Op::Receive, "bad request magic"));
        };
        reader.consume(REQUEST_LEN);
        // A request that arrives while another is still being served: the client pipelines.
        pipelined |= held.is_some() || conn.in_flight.load(Ordering::Acquire) > 0;
        if req.cmd == CMD_DISC {
            // Requests before the disconnect are still answered.
            if let Some(job) = held.take() {
                let _ = send(job);
            }
            return Ok(());
        }
        let verdict = check(&req, limits);
        if verdict == Verdict::Disconnect {
            return Err(Error::invalid(Op::Receive, format!("write of {} bytes", req.len)));
        }
        // Room for this request in the connection's budget, given back when it is answered
        // (or below, when it is answered here). A held READ goes first if there is no room:
        // it cannot be answered while it waits here. A refused request holds nothing.
        let refused = matches!(verdict, Verdict::Error(_));
        let weight = if refused { 0 } else { weight(&req) };
        if !conn.budget.try_take(weight) {
            if let Some(job) = held.take() {
                if !send(job) {
                    return Ok(());
                }
            }
            cork.flush();
            conn.budget.take(weight);
        }
        // A WRITE's payload is always read, so the stream stays in step even when refused:
        // a refused one is thrown away as it is read. A small one is read into the reader's
        // buffer, where it stays until the request is served (below), and is taken from there:
        // a WRITE the reader carries out itself is written straight from the buffer, and one
        // for the workers is copied out. A larger one is read into a buffer of its own. The
        // gathered replies are written before the reader waits for any of it ([`Cork`]).
        let len = req.len as usize;
        let buffered = req.cmd == CMD_WRITE && !refused && len <= reader.capacity() / 2;
        let payload = match req.cmd {
            CMD_WRITE if refused => {
                reader.skip(req.len, || cork.flush()).map_err(received)?;
                None
            }
            CMD_WRITE if buffered => {
                if !reader
                    .fill_to(len, pipelined && cork.holds_replies(), || cork.flush())
                    .map_err(received)?
                {
                    return Err(received(super::inbox::cut_short()));
                }
                None
            }
            CMD_WRITE => {
                let mut p = vec![0u8; len];
                reader.read_exact(&mut p, || cork.flush()).map_err(received)?;
                Some(Cow::Owned(p))
            }
            _ => None,
        };
        // Every way through this block ends with the buffered payload taken (after it).
        'served: {
            let payload = if buffered { Some(Cow::Borrowed(&reader.buffer()[..len])) } else { payload };
            // What the buffer holds beyond this request.
            let after = reader.buffer().len() - if buffered { len } else { 0 };
            if let Some(e) = conn.broken.get() {
                return Err(e.clone());
            }
            let errno = match verdict {
                Verdict::Error(e) => Some(e),
                _ if server.is_shutting_down() => Some(ESHUTDOWN),
                _ => None,
            };
            if let Some(e) = errno {
                conn.reply_error(&req, e, "request refused");
                conn.budget.give(weight);
                server.stats.record(req.cmd, 0, arrived.elapsed(), false);
                break 'served;
            }
            if req.cmd == CMD_WRITE && req.flags & CMD_FLAG_FUA == 0 {
                if let Some(ok) = conn.write_at_hand(&req, payload.as_deref().unwrap_or_default()) {
                    conn.budget.give(weight);
                    server.stats.record(req.cmd, req.len, arrived.elapsed(), ok);
                    break 'served;
                }
            }
            if req.cmd == CMD_READ {
                if let Some(ok) = conn.read_at_hand(&req, &mut at_hand) {
                    conn.budget.give(weight);
                    server.stats.record(req.cmd, req.len, arrived.elapsed(), ok);
                    break 'served;
                }
            }
            if let Some(job) = held.as_mut() {
                if job.can_merge(&req) {
                    job.merged.push((req, arrived));
                    break 'served;
                }
            }
            let job = Job { req, payload, arrived, merged: Vec::new() };
            // A small READ or WRITE is carried out here, with no hand-off to a worker (a wake-up
            // and two context switches, which took most of the server's CPU for 4 KiB requests),
            // where no parallelism is lost: the connection has never had two requests in flight
            // (a client that waits for each reply, as fio's jobs at depth 1 do: its next request
            // cannot come before this one's reply), and nothing else is waiting in the buffer.
            // Until a pipelining client is found out, only its first small request can hold up
            // the reading of the next ones (by one request's time).
            //
            // A client that pipelines has its small READs and WRITEs carried out here too while
            // they take less than a hand-off costs (pages in the cache, tmpfs: a few µs against
            // about 10 µs of wake-ups and switches), as measured by the recent ones (`Conn::took`);
            // once they take longer (the disk), they go to the workers, which run them in parallel.
            // Other commands (FLUSH: with it here, `--coalesce` lost 18 % on strided writes) and
            // larger requests always go to the workers.
            let depth_one = !pipelined
                && held.is_none()
                && conn.in_flight.load(Ordering::Acquire) == 0
                && after < REQUEST_LEN;
            if job.is_small_io() && (depth_one || conn.fast()) {
                conn.serve_job(server, job, &mut own, closer);
                if let Some(e) = conn.broken.get() {
                    return Err(e.clone());
                }
                break 'served;
            }
            let job = job.into_owned();
            let job = if job.req.cmd == CMD_READ { held.replace(job) } else { Some(job) };
            if let Some(job) = job {
                if !send(job) {
                    return Ok(());
                }
            }
        }
        if buffered {
            reader.consume(len);
        }
    }
}

/// The reader's gathered replies. Replies to the requests the reader answers itself (small
/// READs and WRITEs, refusals) are written together once no whole request is left in what
/// it has read of the socket, rather than one write each: a client with many requests in
/// flight sends several in one go, and each reply written alone cost a system call (with the
/// wake-up of the client) of about a third of the request's CPU (4 KiB writes at depth 16 on
/// tmpfs: 2.2 system calls a request, 1 of them the reply). For a client that pipelines they
/// also wait while more of its bytes have already arrived on the socket, a request or the
/// rest of one ([`Inbox::fill_to`]): the reader took about 2 requests per read of the socket,
/// and writes went from 0.45 to 0.1 per request (5 % less CPU per request). A gathered reply
/// waits only for the reader's own work on requests already sent: the cork is written before
/// the reader can wait for anything (the socket, the rest of a payload, the connection's
/// budget, a full queue) and when the reader ends.
struct Cork<'c, 'a>(&'c Conn<'a>);

impl<'c, 'a> Cork<'c, 'a> {
    fn new(conn: &'c Conn<'a>) -> Self {
        CORKED.with_borrow_mut(|c| *c = Some(Vec::with_capacity(CORK_MAX)));
        Cork(conn)
    }

    fn flush(&self) {
        self.0.flush_cork();
    }

    fn holds_replies(&self) -> bool {
        CORKED.with_borrow(|c| c.as_ref().is_some_and(|c| !c.is_empty()))
    }
}

impl Drop for Cork<'_, '_> {
    fn drop(&mut self) {
        self.0.flush_cork();
        CORKED.with_borrow_mut(|c| *c = None);
    }
}

/// On the reader thread, adds a reply to the gathered ones if it fits in the cork; false on
/// the workers, or for a reply that does not fit.
fn gather(bufs: &[&[u8]]) -> bool {
    CORKED.with_borrow_mut(|c| {
        let Some(c) = c else { return false };
        if c.len() + bufs.iter().map(|b| b.len()).sum::<usize>() > CORK_MAX {
            return false;
        }
        bufs.iter().for_each(|b| c.extend_from_slice(b));
        true
    })
}

/// The gathered replies, taken out to be written (`None` on the workers).
fn take_gathered() -> Option<Vec<u8>> {
    CORKED.with_borrow_mut(|c| c.as_mut().map(std::mem::take))
}

/// Puts the gathering buffer back, emptied, for the next replies (it never grows: nothing is
/// gathered past [`CORK_MAX`]).
fn give_back(mut v: Vec<u8>) {
    v.clear();
    CORKED.with_borrow_mut(|c| *c = Some(v));
}

struct Conn<'a> {
    backend: &'a dyn Backend,
    agreed: Agreed,
    writer: &'a Mutex<Box<dyn Write + Send>>,
    /// Why the connection ends: a reply could not be written (the client is gone), or a
    /// request's handling panicked.
    broken: &'a Sticky,
    latch: &'a crate::error::Sticky,
    budget: &'a Budget,
    /// Jobs handed to the workers and not yet served.
    in_flight: AtomicUsize,
    /// Recent service time of small READs and WRITEs, in ns (an average over about the last
    /// eight); `u64::MAX` before the first.
    recent_ns: AtomicU64,
}

/// Small READs and WRITEs that take less than this (on average, recently) are carried out by
/// the reader even for a client that pipelines: a hand-off to a worker costs about this much
/// CPU (bench/limits.sh: 7 µs a request at depth 16 against 6.5 without hand-offs).
const FAST_NS: u64 = 15_000;

impl Conn<'_> {
    fn fast(&self) -> bool {
        self.recent_ns.load(Ordering::Relaxed) < FAST_NS
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

    /// Writes a reply whole, or on the reader thread adds it to the gathered replies
    /// ([`Cork`]); a large one goes out at once in one write with what was gathered.
    fn send(&self, bufs: &[&[u8]]) {
        if gather(bufs) {
            return;
        }
        match take_gathered() {
            Some(before) => {
                let mut all = Vec::with_capacity(bufs.len() + 1);
                all.push(&before[..]);
                all.extend_from_slice(bufs);
                self.write_out(&all);
                give_back(before);
            }
            None => self.write_out(bufs),
        }
    }

    /// Writes what the reader has gathered.
    fn flush_cork(&self) {
        let Some(before) = take_gathered() else { return };
        if !before.is_empty() {
            self.write_out(&[&before]);
        }
        give_back(before);
    }

    fn write_out(&self, bufs: &[&[u8]]) {
        let mut w = self.writer.lock().unwrap();
        if let Err(e) = write_all_vectored(&mut **w, bufs) {
            let e = Error::io(Op::Send, e).detail("client stopped reading");
            tracing::debug!("reply not sent: {e}");
            self.broken.set(&e);
        }
    }

    /// How the reply to `req` is framed: in structured chunks for READ and BLOCK_STATUS once
    /// the client negotiated them (the spec forbids a simple reply to a READ then, and a
    /// block status reply is a chunk), in simple replies otherwise (the other commands have
    /// no payload to carry, and every client reads simple replies).
    fn reply(&self, req: &Request) -> Reply {
        Reply::new(req.cookie, self.agreed.structured && matches!(req.cmd, CMD_READ | CMD_BLOCK_STATUS))
    }

    fn reply_error(&self, req: &Request, errno: u32, msg: &str) {
        let (header, msg) = self.reply(req).error(errno, msg);
        self.send(&[&header, msg]);
    }

    fn reply_ok(&self, req: &Request) {
        self.send(&[&self.reply(req).done()]);
    }

    /// Carries out a request and replies; false if the reply was an error.
    fn handle(&self, job: Job<'_>, buf: &mut AlignedBuf) -> bool {
        let req = job.req;
        let fua = req.flags & CMD_FLAG_FUA != 0;
        let b = self.backend;
        let res = match req.cmd {
            CMD_READ => {
                if buf.len() < req.len as usize {
                    *buf = AlignedBuf::new(req.len as usize);
                }
                return self.read(&req, &mut buf[..req.len as usize]);
            }
            CMD_BLOCK_STATUS => return self.block_status(&req),
            CMD_WRITE => b.write(job.payload.as_deref().unwrap_or_default(), req.offset, fua),
            CMD_FLUSH => b.flush(),
            CMD_TRIM => b.trim(req.offset, req.len, fua),
            CMD_CACHE => b.cache(req.offset, req.len),
            CMD_WRITE_ZEROES => {
                let flags = ZeroFlags {
                    may_trim: req.flags & CMD_FLAG_NO_HOLE == 0,
                    fast: req.flags & CMD_FLAG_FAST_ZERO != 0,
                    fua,
                };
                b.zero(req.offset, req.len, flags)
            }
            _ => unreachable!("validated"),
        };
        // A flush or FUA request promises durability: not after a write error was latched.
        let durable =
            req.cmd == CMD_FLUSH || (fua && matches!(req.cmd, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES));
        let res =
            res.and_then(|()| if durable { self.latch.check_writes(Op::Flush, b.name()) } else { Ok(()) });
        if let Err(e) = &res {
            if e.kind() == crate::ErrorKind::Io && (durable || matches!(e.op(), Op::Writeback | Op::Flush)) {
                self.latch.set(e);
            }
        }
        match res {
            Ok(()) => {
                self.reply_ok(&req);
                true
            }
            Err(e) => self.fail(&req, &e),
        }
    }

    fn fail(&self, req: &Request, e: &Error) -> bool {
        // Fast-zero refusals are part of the protocol, not failures worth a warning.
        if e.kind() != crate::ErrorKind::NotSupported {
            tracing::warn!("{e}");
        }
        self.reply_error(req, errno(e.kind()), &e.to_string());
        false
    }

    /// Answers a small READ on the reader thread if the backend has its bytes at hand (a
    /// prefetch hit: see [`Backend::read_at_hand`]); `None` sends it to a worker. Only reads
    /// below [`HOLE_LOOKUP_MIN`]: their reply is one data chunk, with no extent lookup.
    fn read_at_hand(&self, req: &Request, buf: &mut [u8]) -> Option<bool> {
        let len = req.len as usize;
        if len == 0 || len > buf.len().min(HOLE_LOOKUP_MIN - 1) {
            return None;
        }
        let data = &mut buf[..len];
        match self.backend.read_at_hand(data, req.offset)? {
            Ok(n) if n == len => {
                self.send_data(req, data);
                Some(true)
            }
            // A short read: the worker's path reports it.
            Ok(_) => None,
            Err(e) => Some(self.fail(req, &e)),
        }
    }

    /// Carries out a WRITE (without FUA) on the reader thread if the backend takes it without
    /// waiting (`--coalesce` holding it: see [`Backend::write_at_hand`]); `None` sends it to
    /// a worker. With `--coalesce` every small write took a worker hand-off (a wake-up and
    /// two context switches) for a copy of a few KiB.
    fn write_at_hand(&self, req: &Request, data: &[u8]) -> Option<bool> {
        match self.backend.write_at_hand(data, req.offset)? {
            Ok(()) => {
                self.reply_ok(req);
                Some(true)
            }
            Err(e) => Some(self.fail(req, &e)),
        }
    }

    /// The reply to a READ whose bytes are all data: a simple reply, or one `OFFSET_DATA`
    /// chunk flagged done, then the data.
    fn send_data(&self, req: &Request, data: &[u8]) {
        self.send(&[&self.data_header(req), data]);
    }

    /// What goes before the data of a READ reply that is all data.
    fn data_header(&self, req: &Request) -> ReplyHeader {
        self.reply(req).data(req.offset, req.len as u32, true)
    }

    /// Carries out READs merged by the reader: one backend read for all of them when their
    /// bytes are all data, then a reply each. Holes, or an error, send each request down the
    /// ordinary path, so every request gets its own chunks or its own error.
    fn read_merged(&self, server: &Server, job: Job<'_>, buf: &mut AlignedBuf) {
        let start = job.req.offset;
        let total = job.merged_len() as usize;
        if buf.len() < total {
            *buf = AlignedBuf::new(total);
        }
        let reqs: Vec<(Request, std::time::Instant)> =
            std::iter::once((job.req, job.arrived)).chain(job.merged).collect();
        let all_data = !self.agreed.structured
            || !self.backend.caps().can_extents
            || self
                .backend
                .extents(start, total as u64)
                .is_ok_and(|e| e.first().is_some_and(|e| !e.zero && e.len >= total as u64));
        if all_data && crate::backend::read_exact(self.backend, &mut buf[..total], start).is_ok() {
            let headers: Vec<ReplyHeader> = reqs.iter().map(|(req, _)| self.data_header(req)).collect();
            let mut bufs: Vec<&[u8]> = Vec::with_capacity(reqs.len() * 2);
            for (i, (req, _)) in reqs.iter().enumerate() {
                let at = (req.offset - start) as usize;
                bufs.push(&headers[i]);
                bufs.push(&buf[at..at + req.len as usize]);
            }
            server.stats.reads_merged.fetch_add(reqs.len() as u64 - 1, Ordering::Relaxed);
            self.send(&bufs);
            for (req, arrived) in &reqs {
                server.stats.record(req.cmd, req.len, arrived.elapsed(), true);
            }
            return;
        }
        for (req, arrived) in reqs {
            let ok = self.read(&req, &mut buf[..req.len as usize]);
            server.stats.record(req.cmd, req.len, arrived.elapsed(), ok);
        }
    }

    fn read(&self, req: &Request, buf: &mut [u8]) -> bool {
        let len = req.len as usize;
        if !self.agreed.structured {
            return match crate::backend::read_exact(self.backend, &mut buf[..len], req.offset) {
                Ok(()) => {
                    self.send_data(req, &buf[..len]);
                    true
                }
                Err(e) => self.fail(req, &e),
            };
        }
        let reply = self.reply(req);
        if len == 0 {
            self.send(&[&reply.done()]);
            return true;
        }
        match self.read_chunks(req, reply, buf) {
            Ok(chunks) => {
                let mut bufs: Vec<&[u8]> = Vec::with_capacity(chunks.len() * 2);
                for (header, data) in &chunks {
                    bufs.push(header);
                    if let Some(r) = data {
                        bufs.push(&buf[r.clone()]);
                    }
                }
                self.send(&bufs);
                true
            }
            Err(e) => self.fail(req, &e),
        }
    }

    /// Reads a structured READ into `buf` and builds its chunks: holes as `OFFSET_HOLE`,
    /// data as `OFFSET_DATA` (each header with the part of `buf` that follows it), the last
    /// one flagged done.
    fn read_chunks(
        &self,
        req: &Request,
        reply: Reply,
        buf: &mut [u8],
    ) -> crate::Result<Vec<(ReplyHeader, Option<std::ops::Range<usize>>)>> {
        let len = req.len as usize;
        let mut chunks = Vec::new();
        // Holes are worth a lookup only for large reads: for small ones the extent query
        // (two lseeks on a file) costs more than the zeroes it would save on the wire.
        let can_extents = self.backend.caps().can_extents && len >= HOLE_LOOKUP_MIN;
        let mut at = 0usize;
        while at < len {
            let off = req.offset + at as u64;
            let exts = if can_extents {
                self.backend.extents(off, (len - at) as u64)?
            } else {
                vec![crate::backend::Extent::data((len - at) as u64)]
            };
            for e in exts {
                let n = (e.len as usize).min(len - at);
                if n == 0 {
                    continue;
                }
                let off = req.offset + at as u64;
                // The chunk that reaches the end of the read is the last.
                let last = at + n == len;
                if e.zero {
                    chunks.push((reply.hole(off, n as u32, last), None));
                } else {
                    crate::backend::read_exact(self.backend, &mut buf[at..at + n], off)?;
                    chunks.push((reply.data(off, n as u32, last), Some(at..at + n)));
                }
                at += n;
            }
        }
        Ok(chunks)
    }

    fn block_status(&self, req: &Request) -> bool {
        let one = req.flags & CMD_FLAG_REQ_ONE != 0;
        let exts = match self.backend.extents(req.offset, req.len) {
            Ok(e) => e,
            Err(e) => return self.fail(req, &e),
        };
        let mut descriptors = Vec::new();
        let mut total = 0u64;
        for e in exts.iter().take(if one { 1 } else { MAX_DESCRIPTORS }) {
            // Descriptor lengths are 32 bits: a longer extent is reported in part.
            let n = e.len.min(req.len - total).min(u64::from(u32::MAX) & !0xfff);
            if n == 0 {
                break;
            }
            descriptors.push(Descriptor::allocation(n as u32, e.hole, e.zero));
            total += n;
            if total >= req.len || n < e.len {
                break;
            }
        }
        self.send(&[&block_status_chunk(REPLY_FLAG_DONE, req.cookie, BASE_ALLOCATION_ID, &descriptors)]);
        true
    }
}
