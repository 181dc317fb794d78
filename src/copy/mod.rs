//! The copy engine: moves every byte of a source backend to a destination backend.
//!
//! The source is split into requests of `request_size` bytes taken in order by `workers`
//! threads (positional I/O, so they share each fd without a lock). For each request the
//! source's extent map says what is data; holes, and data that turns out to be all zeroes,
//! are skipped when the destination is known to read as zeroes already, and zeroed on it
//! otherwise. A sequential endpoint (a pipe) gets one worker, so requests stay in order; a
//! source of unknown size is read until it ends. With [`CopyOptions::interleave`] the requests
//! in flight at once are mostly kept from being neighbours ([`interleaved`]).
//!
//! [`Endpoint`] is what the user names ([`endpoint`]: the syntax); [`open`] opens endpoints as
//! backends ([`Opened`]); [`Plan`] chooses workers, request size, connections and interleaving
//! from the endpoints.
//!
//! The engine knows nothing of files or cache policies: those live in the backends. It is
//! cancelled through a flag (Ctrl-C), and always calls `finish` on both backends so their
//! cache clean-up runs on success and failure alike.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use crate::backend::{is_zero, Backend, Extent, ZeroFlags};
use crate::error::{Error, ErrorKind, Op, Result};
use crate::io::AlignedBuf;

pub mod endpoint;
pub mod open;
pub mod plan;

pub use endpoint::Endpoint;
pub use open::Opened;
pub use plan::Plan;

/// Granularity of zero detection in data extents: runs of zero bytes this long (and aligned)
/// are not written to a destination that already reads as zeroes.
pub const ZERO_BLOCK: usize = 64 << 10;

#[derive(Debug, Clone)]
pub struct CopyOptions {
    /// Worker threads (each with one request in flight).
    pub workers: usize,
    /// Bytes per request.
    pub request_size: usize,
    /// The destination reads as zeroes where not written (a new or truncated file, or
    /// `--destination-is-zero`): holes are skipped rather than zeroed.
    pub destination_is_zero: bool,
    /// Skip zero runs (when the destination reads as zeroes) and punch rather than write
    /// zeroes; `false` (`--no-sparse`) allocates every byte.
    pub sparse: bool,
    /// Make the destination durable before reporting success.
    pub flush: bool,
    /// Hand out the chunks so that requests in flight together are seldom neighbours
    /// ([`interleaved`]); `false`: in order. For many workers over NBD, where local reads are
    /// O_DIRECT: with readahead, a chunk skipped for a moment would be read ahead and left
    /// cached.
    pub interleave: bool,
    /// Copy only what the source's dirty bitmap marks changed (extents not
    /// [`Extent::clean`]) into a destination that holds the previous copy (`copy --bitmap`).
    ///
    /// [`Extent::clean`]: crate::backend::Extent::clean
    pub changed_only: bool,
    /// With `changed_only`: the destination rewrites a unit of this many bytes whole when part
    /// of it is written (an `s3://` block image's objects), so each unit holding changed bytes
    /// is written once, whole ([`copy_changed_units`]).
    pub whole_units: Option<u64>,
}

impl Default for CopyOptions {
    fn default() -> Self {
        CopyOptions {
            workers: 2,
            request_size: 4 << 20,
            destination_is_zero: false,
            sparse: true,
            flush: true,
            interleave: false,
            changed_only: false,
            whole_units: None,
        }
    }
}

/// Counters the caller can watch while the copy runs.
#[derive(Debug, Default)]
pub struct Progress {
    /// Bytes of the source dealt with (copied, skipped or zeroed; with
    /// [`CopyOptions::changed_only`], changed bytes only).
    pub done: AtomicU64,
    /// Bytes actually written to the destination.
    pub written: AtomicU64,
    /// Bytes zeroed or skipped as zero.
    pub zero: AtomicU64,
}

/// What a finished copy did.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Stats {
    pub bytes: u64,
    pub written: u64,
    pub zero: u64,
    pub seconds: f64,
}

/// A failed copy: the error, and how far it got.
#[derive(Debug)]
pub struct Failure {
    pub error: Error,
    /// Bytes of the source dealt with before the failure (not necessarily a prefix).
    pub done: u64,
}

/// Copies `src` to `dst`. `cancel` stops it at the next request boundary.
pub fn copy(
    src: &dyn Backend,
    dst: &dyn Backend,
    opts: &CopyOptions,
    progress: &Progress,
    cancel: &AtomicBool,
) -> Result<Stats, Failure> {
    let start = Instant::now();
    let res = match src.size() {
        Some(size) => copy_sized(src, dst, size, opts, progress, cancel),
        None => copy_stream(src, dst, opts, progress, cancel),
    };
    // Flush before finishing: finish evicts, and eviction of clean pages is cheap after the
    // flush wrote them. Clean-up runs whatever happened; the first error wins.
    let res = res.and_then(|()| if opts.flush { dst.flush() } else { Ok(()) });
    let fin_dst = dst.finish();
    let fin_src = src.finish();
    let res = res.and(fin_dst).and(fin_src);
    let done = progress.done.load(Ordering::Relaxed);
    match res {
        Ok(()) => Ok(Stats {
            bytes: done,
            written: progress.written.load(Ordering::Relaxed),
            zero: progress.zero.load(Ordering::Relaxed),
            seconds: start.elapsed().as_secs_f64(),
        }),
        Err(error) => Err(Failure { error, done }),
    }
}

/// The request size: what was asked, within both sides' maximum (an NBD server's advertised
/// limit), in whole zero-detection blocks.
fn request_size(src: &dyn Backend, dst: &dyn Backend, asked: usize) -> usize {
    let max = src.caps().block.maximum.min(dst.caps().block.maximum) as usize;
    (asked.min(max) / ZERO_BLOCK * ZERO_BLOCK).max(ZERO_BLOCK)
}

/// Refuses a destination that cannot take `size` bytes: read-only, or of a fixed size
/// smaller than that. Checked before anything is written to it.
pub fn check_destination(dst: &dyn Backend, size: u64) -> Result<()> {
    check_room(dst, size)?;
    if dst.caps().read_only {
        return Err(Error::new(ErrorKind::Permission, Op::Copy)
            .path(dst.name())
            .detail("destination is read-only"));
    }
    Ok(())
}

fn check_room(dst: &dyn Backend, size: u64) -> Result<()> {
    match dst.size() {
        Some(room) if room < size => Err(Error::new(ErrorKind::NoSpace, Op::Copy)
            .path(dst.name())
            .detail(format!("destination is smaller than the source ({room} < {size} bytes)"))),
        _ => Ok(()),
    }
}

fn copy_sized(
    src: &dyn Backend,
    dst: &dyn Backend,
    size: u64,
    opts: &CopyOptions,
    progress: &Progress,
    cancel: &AtomicBool,
) -> Result<()> {
    check_destination(dst, size)?;
    let mut req = request_size(src, dst, opts.request_size) as u64;
    let mut workers = opts.workers.clamp(1, 64) as u64;
    if let Some(unit) = units(opts) {
        // Requests of whole units, so no two workers write into one; buffers within 512 MiB.
        req = (req / unit).max(1) * unit;
        workers = workers.min(((512 << 20) / req).max(1));
    }
    let chunks = size.div_ceil(req);
    let sequential = src.caps().sequential || dst.caps().sequential;
    let workers = if sequential { 1 } else { workers }.min(chunks.max(1));
    let next = AtomicU64::new(0);
    // Handed out in groups of twice the workers (see [`interleaved`]); the last group may
    // name chunks past the end, which are skipped.
    let group = if opts.interleave { 2 * workers } else { 1 };
    let takes = chunks.div_ceil(group) * group;
    let stop = AtomicBool::new(false);
    let first_error: std::sync::Mutex<Option<Error>> = Default::default();

    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                let mut buf = AlignedBuf::new(req as usize);
                loop {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    if cancel.load(Ordering::Relaxed) {
                        first_error.lock().unwrap().get_or_insert(
                            Error::new(ErrorKind::Interrupted, Op::Copy).detail("interrupted"),
                        );
                        stop.store(true, Ordering::Relaxed);
                        return;
                    }
                    let t = next.fetch_add(1, Ordering::Relaxed);
                    if t >= takes {
                        return;
                    }
                    let i = interleaved(t, group);
                    if i >= chunks {
                        continue;
                    }
                    let off = i * req;
                    let len = req.min(size - off);
                    if let Err(e) = copy_chunk(src, dst, off, len, &mut buf, opts, progress) {
                        first_error.lock().unwrap().get_or_insert(e);
                        stop.store(true, Ordering::Relaxed);
                        return;
                    }
                }
            });
        }
    });
    match first_error.into_inner().unwrap() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The chunk handed out `t`-th when each group of `group` chunks (an even number) is handed
/// out evens first, then odds: 0, 2, 4 … 1, 3, 5 … With `group` twice the workers, the
/// evens in flight together are a chunk apart; an odd can meet a neighbouring even still in
/// flight, and the last chunk of a group the first of the next, so neighbours are rarer, not
/// gone. Handed out in order, 16 workers' requests are neighbours, and the block layer merges
/// them into 1-3 MiB requests, which made a pull from an NBD server slower than nbdcopy's on
/// this VM's disk (docs/benchmarks/runs/code-notes.md#interleaved).
/// Chunks are still taken from one counter, so a slow request delays nobody. `group` < 2:
/// in order.
pub fn interleaved(t: u64, group: u64) -> u64 {
    if group < 2 {
        return t;
    }
    debug_assert!(group.is_multiple_of(2));
    let (g, k) = (t / group, t % group);
    let half = group / 2;
    g * group + if k < half { 2 * k } else { 2 * (k - half) + 1 }
}

/// Copies `[off, off+len)`: walks the source's extents, reads data, writes what is not zero.
fn copy_chunk(
    src: &dyn Backend,
    dst: &dyn Backend,
    off: u64,
    len: u64,
    buf: &mut [u8],
    opts: &CopyOptions,
    progress: &Progress,
) -> Result<()> {
    if let Some(unit) = units(opts) {
        return copy_changed_units(src, dst, off, len, unit, buf, progress);
    }
    each_extent(src, off, off + len, |at, n, e| {
        if opts.changed_only && e.clean {
            return Ok(());
        }
        // Zeroes, changed or not, are written as zeroes (never a TRIM alone: it need not
        // read back as zeroes): `zero_range` asks for WRITE_ZEROES, which may punch.
        if e.zero {
            zero_range(dst, at, n, opts)?;
            progress.zero.fetch_add(n, Ordering::Relaxed);
        } else {
            let data = &mut buf[..n as usize];
            read_all(src, data, at, "source")?;
            write_data(dst, at, data, opts, progress)?;
        }
        progress.done.fetch_add(n, Ordering::Relaxed);
        Ok(())
    })
}

/// Calls `f(at, n, extent)` for the extents of `src` over `[off, end)` in order, each clipped
/// to the range (a backend may describe fewer bytes than asked, or more in its last extent).
fn each_extent(
    src: &dyn Backend,
    off: u64,
    end: u64,
    mut f: impl FnMut(u64, u64, Extent) -> Result<()>,
) -> Result<()> {
    let mut at = off;
    while at < end {
        let before = at;
        for e in src.extents(at, end - at)? {
            let n = e.len.min(end - at);
            if n == 0 {
                continue;
            }
            f(at, n, e)?;
            at += n;
        }
        if at == before {
            return Err(Error::new(ErrorKind::Io, Op::BlockStatus)
                .path(src.name())
                .at(at, end - at)
                .detail("the source described no extent"));
        }
    }
    Ok(())
}

/// Bytes of `src`'s first `size` that its dirty bitmap marks changed (extents not
/// [`Extent::clean`]): an incremental copy's size, known before it starts. Asks in windows of
/// 64 MiB, so memory stays bounded whatever the number of extents.
///
/// [`Extent::clean`]: crate::backend::Extent::clean
pub fn changed_bytes(src: &dyn Backend, size: u64, cancel: &AtomicBool) -> Result<u64> {
    const WINDOW: u64 = 64 << 20;
    let (mut at, mut changed) = (0u64, 0u64);
    while at < size {
        if cancel.load(Ordering::Relaxed) {
            return Err(Error::new(ErrorKind::Interrupted, Op::Copy).detail("interrupted"));
        }
        let end = (at + WINDOW).min(size);
        each_extent(src, at, end, |_, n, e| {
            if !e.clean {
                changed += n;
            }
            Ok(())
        })?;
        at = end;
    }
    Ok(changed)
}

/// The unit size when an incremental copy writes whole units ([`CopyOptions::whole_units`]).
fn units(opts: &CopyOptions) -> Option<u64> {
    opts.whole_units.filter(|&u| opts.changed_only && u > 0)
}

/// Reads all of `buf` from `b` (`side`: "source" or "destination") at `at`; a short read is
/// an unexpected end.
fn read_all(b: &dyn Backend, buf: &mut [u8], at: u64, side: &str) -> Result<()> {
    let got = b.read(buf, at)?;
    if got < buf.len() {
        return Err(Error::new(ErrorKind::UnexpectedEof, Op::Read)
            .path(b.name())
            .at(at + got as u64, (buf.len() - got) as u64)
            .detail(format!("the {side} ended early (did it shrink during the copy?)")));
    }
    Ok(())
}

/// An incremental copy of `[off, off+len)` (whole units of `unit` bytes, the last perhaps
/// shorter) into a destination that rewrites a unit whole when part of it is written: each unit
/// with changed bytes is assembled and written once, from the source where the changes cover
/// it, else read from the destination and patched. So an `s3://` block image's object costs one
/// PUT (or DELETE, when it ends up all zeroes) and at most one GET, never one per changed piece.
fn copy_changed_units(
    src: &dyn Backend,
    dst: &dyn Backend,
    off: u64,
    len: u64,
    unit: u64,
    buf: &mut [u8],
    progress: &Progress,
) -> Result<()> {
    let end = off + len;
    let mut u0 = off;
    while u0 < end {
        let n = unit.min(end - u0);
        // The unit's changed pieces: (start within the unit, length, reads as zeroes).
        let mut pieces = Vec::new();
        each_extent(src, u0, u0 + n, |at, m, e| {
            if !e.clean {
                pieces.push((at - u0, m, e.zero));
            }
            Ok(())
        })?;
        let changed: u64 = pieces.iter().map(|p| p.1).sum();
        if changed > 0 {
            let whole = &mut buf[..n as usize];
            if changed < n {
                read_all(dst, whole, u0, "destination")?;
            }
            for &(s, m, zero) in &pieces {
                let piece = &mut whole[s as usize..(s + m) as usize];
                if zero {
                    piece.fill(0);
                    progress.zero.fetch_add(m, Ordering::Relaxed);
                } else {
                    read_all(src, piece, u0 + s, "source")?;
                    progress.written.fetch_add(m, Ordering::Relaxed);
                }
            }
            dst.write(whole, u0, false)?;
            progress.done.fetch_add(changed, Ordering::Relaxed);
        }
        u0 += n;
    }
    Ok(())
}

/// Makes `[at, at+n)` of the destination read as zeroes, if it does not already.
fn zero_range(dst: &dyn Backend, at: u64, n: u64, opts: &CopyOptions) -> Result<()> {
    if opts.destination_is_zero && opts.sparse {
        return Ok(());
    }
    dst.zero(at, n, ZeroFlags { may_trim: opts.sparse, fast: false, fua: false })
}

/// Writes a data buffer, leaving out aligned zero blocks where the destination is zero.
fn write_data(
    dst: &dyn Backend,
    at: u64,
    data: &[u8],
    opts: &CopyOptions,
    progress: &Progress,
) -> Result<()> {
    if !(opts.sparse && opts.destination_is_zero) {
        dst.write(data, at, false)?;
        progress.written.fetch_add(data.len() as u64, Ordering::Relaxed);
        return Ok(());
    }
    // Runs of non-zero blocks are written in one request each.
    let mut run_start: Option<usize> = None;
    let mut i = 0;
    while i <= data.len() {
        let block_end = (i + ZERO_BLOCK).min(data.len());
        let zero = i == data.len() || is_zero(&data[i..block_end]);
        match (zero, run_start) {
            (false, None) => run_start = Some(i),
            (true, Some(s)) => {
                dst.write(&data[s..i], at + s as u64, false)?;
                progress.written.fetch_add((i - s) as u64, Ordering::Relaxed);
                run_start = None;
            }
            _ => {}
        }
        if zero && i < data.len() {
            progress.zero.fetch_add((block_end - i) as u64, Ordering::Relaxed);
        }
        if i == data.len() {
            break;
        }
        i = block_end;
    }
    Ok(())
}

/// A source of unknown size (a pipe): read in order until it ends.
fn copy_stream(
    src: &dyn Backend,
    dst: &dyn Backend,
    opts: &CopyOptions,
    progress: &Progress,
    cancel: &AtomicBool,
) -> Result<()> {
    let req = request_size(src, dst, opts.request_size);
    let mut buf = AlignedBuf::new(req);
    let room = if dst.caps().growable { None } else { dst.size() };
    let mut at = 0u64;
    loop {
        if cancel.load(Ordering::Relaxed) {
            return Err(Error::new(ErrorKind::Interrupted, Op::Copy).detail("interrupted"));
        }
        let n = src.read(&mut buf[..req], at)?;
        if n == 0 {
            // Ctrl-C while a read waited: the writer of the pipe (in the terminal's process
            // group) got the signal too, and its end of the data is not the stream's.
            if cancel.load(Ordering::Relaxed) {
                return Err(Error::new(ErrorKind::Interrupted, Op::Copy).detail("interrupted"));
            }
            return Ok(());
        }
        if room.is_some_and(|r| at + n as u64 > r) {
            check_room(dst, at + n as u64)?;
        }
        // The destination's size is not known to cover this range, so everything is written.
        dst.write(&buf[..n], at, false)?;
        at += n as u64;
        progress.written.fetch_add(n as u64, Ordering::Relaxed);
        progress.done.fetch_add(n as u64, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests;
