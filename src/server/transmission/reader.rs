//! The reader: one thread per connection that takes requests from the socket's buffer
//! ([`Inbox`]), validates them, and either carries a request out itself (a refusal, a small
//! READ or WRITE, see [`Reader::serve`]) or hands it to the workers, holding a READ back in
//! case the next request continues it.

use std::borrow::Cow;
use std::io;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::cork::Cork;
use super::job::{weight, Job};
use super::{Conn, Server};
use crate::error::{Error, Op, Result};
use crate::io::AlignedBuf;
use crate::proto::*;
use crate::server::inbox::{cut_short, Inbox};
use crate::server::validate::{check, Limits, Verdict};
use crate::stream::Closer;

/// Whether the reader goes on after a request.
enum Flow {
    Next,
    /// The workers are gone (a worker panicked and the channel closed): the reader ends too.
    End,
}

/// Where a WRITE's payload is once its request has been read.
enum Payload {
    None,
    /// In the reader's buffer, right after the request: taken from there, then consumed.
    Buffered,
    Owned(Vec<u8>),
}

/// The reader's state between requests.
struct Reader<'r, 'a> {
    server: &'r Server,
    conn: &'r Conn<'a>,
    tx: &'r crossbeam_channel::Sender<Job<'static>>,
    closer: &'r Closer,
    cork: Cork<'r, 'a>,
    /// The buffer for reads answered from bytes at hand.
    at_hand: AlignedBuf,
    /// The buffer for the small READs and WRITEs carried out here.
    own: AlignedBuf,
    /// A READ held back in case the next request continues it.
    held: Option<Job<'static>>,
    /// A request came while another was in flight: the client pipelines, and the reader hands
    /// its jobs to the workers from then on (but for fast ones: [`Conn::fast`]).
    pipelined: bool,
}

/// A failed read of the client's requests.
fn received(e: io::Error) -> Error {
    Error::io(Op::Receive, e)
}

/// Reads and dispatches requests until the client disconnects or breaks the protocol.
pub(super) fn read_requests(
    server: &Server,
    limits: &Limits,
    conn: &Conn,
    inbox: &mut Inbox,
    tx: &crossbeam_channel::Sender<Job<'static>>,
    closer: &Closer,
) -> Result<()> {
    let mut r = Reader {
        server,
        conn,
        tx,
        closer,
        cork: Cork::new(conn),
        at_hand: AlignedBuf::new(super::commands::AT_HAND_MAX),
        own: AlignedBuf::new(0),
        held: None,
        pipelined: false,
    };
    loop {
        // No whole request is left in the buffer: what is held goes now, and the gathered
        // replies before the reader waits ([`Cork`]).
        if inbox.buffer().len() < REQUEST_LEN {
            if !r.send_held() {
                return Ok(());
            }
            // A client that vanishes between requests is a normal end.
            if !inbox.fill_to(REQUEST_LEN, r.look_first(), || r.cork.flush()).map_err(received)? {
                return Ok(());
            }
        }
        let arrived = Instant::now();
        let h: &[u8; REQUEST_LEN] = inbox.buffer()[..REQUEST_LEN].try_into().expect("a whole header is held");
        let Some(req) = parse_request(h) else {
            return Err(Error::invalid(Op::Receive, "bad request magic"));
        };
        inbox.consume(REQUEST_LEN);
        // A request that arrives while another is still being served: the client pipelines.
        r.pipelined |= r.held.is_some() || conn.in_flight.load(Ordering::Acquire) > 0;
        if req.cmd == CMD_DISC {
            // Requests before the disconnect are still answered.
            r.send_held();
            return Ok(());
        }
        let verdict = check(&req, limits);
        if verdict == Verdict::Disconnect {
            return Err(Error::invalid(Op::Receive, format!("write of {} bytes", req.len)));
        }
        // A refused request holds nothing of the budget.
        let refused = matches!(verdict, Verdict::Error(_));
        let weight = if refused { 0 } else { weight(&req) };
        if !r.reserve(weight) {
            return Ok(());
        }
        let len = req.len as usize;
        let payload = match r.read_payload(inbox, &req, refused)? {
            Payload::None => None,
            Payload::Buffered => Some(Cow::Borrowed(&inbox.buffer()[..len])),
            Payload::Owned(p) => Some(Cow::Owned(p)),
        };
        let buffered = matches!(payload, Some(Cow::Borrowed(_)));
        // What the buffer holds beyond this request.
        let after = inbox.buffer().len() - if buffered { len } else { 0 };
        let flow = r.serve(req, arrived, verdict, weight, payload, after)?;
        if buffered {
            inbox.consume(len);
        }
        if let Flow::End = flow {
            return Ok(());
        }
    }
}

impl Reader<'_, '_> {
    /// Whether a wait for more of the socket should first look at what has already arrived
    /// (and leave the gathered replies unwritten if something has): for a client that
    /// pipelines, with replies gathered.
    fn look_first(&self) -> bool {
        self.pipelined && self.cork.holds_replies()
    }

    /// Hands `job` to the workers; false if they are gone. With the queue full the reader
    /// will wait, so what it gathered goes first.
    fn send(&self, job: Job<'static>) -> bool {
        self.conn.in_flight.fetch_add(1, Ordering::Acquire);
        match self.tx.try_send(job) {
            Ok(()) => true,
            Err(crossbeam_channel::TrySendError::Full(job)) => {
                self.cork.flush();
                self.tx.send(job).is_ok()
            }
            Err(crossbeam_channel::TrySendError::Disconnected(_)) => false,
        }
    }

    /// Hands the held READ, if any, to the workers; false if they are gone.
    fn send_held(&mut self) -> bool {
        match self.held.take() {
            Some(job) => self.send(job),
            None => true,
        }
    }

    /// Takes room for a request of `weight` bytes in the connection's budget, given back when
    /// it is answered. With no room, the held READ goes first (it cannot be answered while it
    /// waits here) and the gathered replies, then the reader waits. False if the workers are
    /// gone.
    fn reserve(&mut self, weight: u64) -> bool {
        if !self.conn.budget.try_take(weight) {
            if !self.send_held() {
                return false;
            }
            self.cork.flush();
            self.conn.budget.take(weight);
        }
        true
    }

    /// Reads a WRITE's payload. It is always read, so the stream stays in step even when the
    /// request is refused: a refused one is thrown away as it is read. A small one is read
    /// into the reader's buffer and taken from there: a WRITE carried out here is written
    /// straight from the buffer, one for the workers copied out. A larger one is read into a
    /// buffer of its own. The gathered replies are written before the reader waits for any
    /// of it ([`Cork`]).
    fn read_payload(&self, inbox: &mut Inbox, req: &Request, refused: bool) -> Result<Payload> {
        if req.cmd != CMD_WRITE {
            return Ok(Payload::None);
        }
        let len = req.len as usize;
        if refused {
            inbox.skip(req.len, || self.cork.flush()).map_err(received)?;
            Ok(Payload::None)
        } else if len <= inbox.capacity() / 2 {
            if !inbox.fill_to(len, self.look_first(), || self.cork.flush()).map_err(received)? {
                return Err(received(cut_short()));
            }
            Ok(Payload::Buffered)
        } else {
            let mut p = vec![0u8; len];
            inbox.read_exact(&mut p, || self.cork.flush()).map_err(received)?;
            Ok(Payload::Owned(p))
        }
    }

    /// Answers a request here (a refusal, bytes at hand, a small READ or WRITE that pays to
    /// carry out here), merges a READ into the held one, or hands it to the workers.
    /// `after`: bytes of further requests already in the buffer.
    fn serve(
        &mut self,
        req: Request,
        arrived: Instant,
        verdict: Verdict,
        weight: u64,
        payload: Option<Cow<'_, [u8]>>,
        after: usize,
    ) -> Result<Flow> {
        let (conn, server) = (self.conn, self.server);
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
            return Ok(Flow::Next);
        }
        // Marked before the change goes down (held by --coalesce or not): a bitmap may say
        // changed where a failed write changed nothing, never the other way round.
        if let Some(t) = conn.bitmaps {
            if matches!(req.cmd, CMD_WRITE | CMD_WRITE_ZEROES | CMD_TRIM) {
                t.mark(req.offset, req.len);
            }
        }
        let at_hand = match req.cmd {
            _ if !conn.at_hand => None,
            CMD_WRITE if req.flags & CMD_FLAG_FUA == 0 => {
                conn.write_at_hand(&req, payload.as_deref().unwrap_or_default())
            }
            CMD_READ => conn.read_at_hand(&req, &mut self.at_hand),
            _ => None,
        };
        if let Some(ok) = at_hand {
            conn.budget.give(weight);
            server.stats.record(req.cmd, req.len, arrived.elapsed(), ok);
            return Ok(Flow::Next);
        }
        if let Some(job) = self.held.as_mut() {
            if job.can_merge(&req) {
                job.merged.push((req, arrived));
                return Ok(Flow::Next);
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
        // Yet when nothing else is in flight or waiting (a guest reading one small file after
        // another), a request the local disk answers soon ([`Conn::quick`]) is carried out
        // here too: a request sent meanwhile waits at most that long, and the hand-off, under
        // a guest's emulation, cost more than that wait. Other commands (FLUSH: carried out
        // here, it cost `--coalesce` on strided writes) and larger requests always go to the
        // workers.
        let depth_one = self.held.is_none()
            && conn.in_flight.load(Ordering::Acquire) == 0
            && after < REQUEST_LEN
            && (!self.pipelined || conn.quick());
        if job.is_small_io() && (depth_one || conn.fast()) {
            conn.serve_job(server, job, &mut self.own, self.closer);
            if let Some(e) = conn.broken.get() {
                return Err(e.clone());
            }
            return Ok(Flow::Next);
        }
        let job = job.into_owned();
        let job = if job.req.cmd == CMD_READ { self.held.replace(job) } else { Some(job) };
        let sent = job.is_none_or(|job| self.send(job));
        Ok(if sent { Flow::Next } else { Flow::End })
    }
}
