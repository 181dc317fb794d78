//! The commands: each request carried out against the connection's backend and answered,
//! on a worker or on the reader (small READs whose bytes are at hand, WRITEs taken without
//! waiting).

use std::sync::atomic::Ordering;

use super::{Conn, Job, Server};
use crate::backend::ZeroFlags;
use crate::error::{Error, Op};
use crate::io::AlignedBuf;
use crate::proto::*;
use crate::server::handshake::{BASE_ALLOCATION_ID, BITMAP_ID_BASE};

/// Smallest READ for which holes are looked up and sent as `OFFSET_HOLE` chunks.
pub(super) const HOLE_LOOKUP_MIN: usize = 64 << 10;

/// Largest READ answered on the reader thread when the backend has its bytes at hand: the
/// prefetch buffer's reads, up to the default `--prefetch-max-request`. A guest's 128 KiB
/// reads (a tenth of a scan's, most of its bytes) hit there too; with a worker hand-off each
/// waited for a wake-up on 2 cores the guest's emulation keeps busy.
pub(super) const AT_HAND_MAX: usize = 128 << 10;

/// Most base:allocation descriptors in one reply.
const MAX_DESCRIPTORS: usize = 1 << 16;

impl Conn<'_> {
    /// How the reply to `req` is framed: in structured chunks for READ and BLOCK_STATUS once
    /// the client negotiated them (the spec forbids a simple reply to a READ then, and a
    /// block status reply is a chunk), in simple replies otherwise (the other commands have
    /// no payload to carry, and every client reads simple replies).
    fn reply(&self, req: &Request) -> Reply {
        Reply::new(req.cookie, self.agreed.structured && matches!(req.cmd, CMD_READ | CMD_BLOCK_STATUS))
    }

    pub(super) fn reply_error(&self, req: &Request, errno: u32, msg: &str) {
        let (header, msg) = self.reply(req).error(errno, msg);
        self.send(&[&header, msg]);
    }

    pub(super) fn reply_ok(&self, req: &Request) {
        self.send(&[&self.reply(req).done()]);
    }

    /// Carries out a request and replies; false if the reply was an error.
    pub(super) fn handle(&self, job: Job<'_>, buf: &mut AlignedBuf) -> bool {
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

    /// Answers a READ of up to [`AT_HAND_MAX`] on the reader thread if the backend has its
    /// bytes at hand (a prefetch hit: see [`Backend::read_at_hand`]); `None` sends it to a
    /// worker. The reply is one data chunk: bytes already in memory are not worth an extent
    /// lookup to send a hole's zeroes as a hole.
    pub(super) fn read_at_hand(&self, req: &Request, buf: &mut [u8]) -> Option<bool> {
        let len = req.len as usize;
        if len == 0 || len > buf.len() {
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
    pub(super) fn write_at_hand(&self, req: &Request, data: &[u8]) -> Option<bool> {
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
    pub(super) fn read_merged(&self, server: &Server, job: Job<'_>, buf: &mut AlignedBuf) {
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

    /// One chunk per context the client selected: `base:allocation` first, then its dirty
    /// bitmaps; the last flagged done.
    fn block_status(&self, req: &Request) -> bool {
        let max = if req.flags & CMD_FLAG_REQ_ONE != 0 { 1 } else { MAX_DESCRIPTORS };
        let mut chunks: Vec<(u32, Vec<Descriptor>)> = Vec::new();
        if self.agreed.meta_context {
            let exts = match self.backend.extents(req.offset, req.len) {
                Ok(e) => e,
                Err(e) => return self.fail(req, &e),
            };
            let runs = exts.iter().map(|e| (e.len, Descriptor::allocation(0, e.hole, e.zero).flags));
            chunks.push((BASE_ALLOCATION_ID, descriptors(runs, req.len, max)));
        }
        if let Some(t) = self.bitmaps {
            for i in (0..t.names().len()).filter(|i| self.agreed.bitmaps >> i & 1 == 1) {
                let runs = t.bits(i).extents(req.offset, req.len, max).into_iter();
                let runs = runs.map(|(len, dirty)| (len, Descriptor::dirty_bitmap(0, dirty).flags));
                chunks.push((BITMAP_ID_BASE + i as u32, descriptors(runs, req.len, max)));
            }
        }
        let last = chunks.len() - 1;
        let chunks: Vec<Vec<u8>> = chunks
            .iter()
            .enumerate()
            .map(|(i, (id, d))| {
                block_status_chunk(if i == last { REPLY_FLAG_DONE } else { 0 }, req.cookie, *id, d)
            })
            .collect();
        self.send(&chunks.iter().map(Vec::as_slice).collect::<Vec<_>>());
        true
    }
}

/// Descriptors for `runs` of `(length, flags)`, at most `max`, covering at most `len` bytes.
fn descriptors(runs: impl Iterator<Item = (u64, u32)>, len: u64, max: usize) -> Vec<Descriptor> {
    let mut out = Vec::new();
    let mut total = 0u64;
    for (run, flags) in runs.take(max) {
        // Descriptor lengths are 32 bits: a longer run is reported in part.
        let n = run.min(len - total).min(u64::from(u32::MAX) & !0xfff);
        if n == 0 {
            break;
        }
        out.push(Descriptor { len: n as u32, flags });
        total += n;
        if total >= len || n < run {
            break;
        }
    }
    out
}
