//! The conformance suite: one set of checks every backend and every filter stack must pass.
//!
//! Each check drives the backend and a simple in-memory [`Model`] with the same requests
//! (reads, writes, zeroes, trims, flushes, extents, requests at the edges) and compares what
//! the backend returns with what the model says. The backend must be fresh (reading as
//! zeroes) and writable, and its size should not be a multiple of any block size so the edges
//! get exercised (e.g. 3 MiB + 4097 bytes).

use std::sync::Arc;

use crate::backend::{Backend, ZeroFlags};
use crate::error::{Error, ErrorKind, Op, Result};

/// What the backend is expected to behave like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Storage: reads return what was written.
    Store,
    /// `null:`: writes are discarded, reads return zeroes.
    Zeroes,
    /// `null:` under a filter that holds writes (`--coalesce`): a written byte reads back as
    /// written while the filter holds it and as zero once passed down, so it is unspecified
    /// (as after a trim); zeroed bytes read as zeroes.
    Unkept,
}

/// The reference: a byte vector, plus which bytes are unspecified (after a trim).
pub struct Model {
    data: Vec<u8>,
    known: Vec<bool>,
    expect: Expect,
}

impl Model {
    pub fn new(size: usize, expect: Expect) -> Model {
        Model { data: vec![0; size], known: vec![true; size], expect }
    }

    pub fn write(&mut self, buf: &[u8], offset: u64) {
        let o = offset as usize;
        match self.expect {
            Expect::Store => {
                self.data[o..o + buf.len()].copy_from_slice(buf);
                self.known[o..o + buf.len()].fill(true);
            }
            Expect::Unkept => self.known[o..o + buf.len()].fill(false),
            Expect::Zeroes => {}
        }
    }

    pub fn zero(&mut self, offset: u64, len: u64) {
        let (o, n) = (offset as usize, len as usize);
        self.data[o..o + n].fill(0);
        self.known[o..o + n].fill(true);
    }

    pub fn trim(&mut self, offset: u64, len: u64) {
        if self.expect != Expect::Zeroes {
            let (o, n) = (offset as usize, len as usize);
            self.known[o..o + n].fill(false);
        }
    }

    /// Compares what the backend returned for `[offset, offset+got.len())` with the model.
    pub fn check(&self, got: &[u8], offset: u64, what: &str) -> Result<()> {
        let o = offset as usize;
        for (i, &b) in got.iter().enumerate() {
            if self.known[o + i] && self.data[o + i] != b {
                return Err(fail(format!(
                    "{what}: byte at offset {} is {b:#04x}, expected {:#04x}",
                    o + i,
                    self.data[o + i]
                )));
            }
        }
        Ok(())
    }
}

/// A small deterministic generator (xorshift64*), so failures replay from the seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// A backend's error during check `what`.
fn err(what: &str) -> impl Fn(Error) -> Error + '_ {
    move |e| Error::after(Op::Check, &e).detail(what)
}

/// A check that found the backend differing from the model.
fn fail(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::Io, Op::Check).detail(what)
}

/// Reads the whole backend and compares it with the model.
fn check_all(b: &dyn Backend, m: &Model, what: &str) -> Result<()> {
    let size = m.data.len();
    let piece = 1 << 20;
    let mut buf = vec![0u8; piece];
    let mut at = 0;
    while at < size {
        let n = piece.min(size - at);
        let got = b.read(&mut buf[..n], at as u64).map_err(err(what))?;
        if got != n {
            return Err(fail(format!("{what}: read at {at} returned {got} of {n} bytes")));
        }
        m.check(&buf[..n], at as u64, what)?;
        at += n;
    }
    Ok(())
}

fn write(b: &dyn Backend, m: &mut Model, rng: &mut Rng, offset: u64, len: usize, fua: bool) -> Result<()> {
    let mut buf = vec![0u8; len];
    rng.fill(&mut buf);
    b.write(&buf, offset, fua).map_err(err(&format!("write {offset}+{len}")))?;
    m.write(&buf, offset);
    Ok(())
}

/// Runs every check; returns the first failure, described.
pub fn run(b: &dyn Backend, expect: Expect, seed: u64) -> Result<()> {
    let size = b.size().ok_or_else(|| fail("a conformance backend needs a size"))?;
    let caps = b.caps();
    if caps.read_only {
        return Err(fail("a conformance backend must be writable"));
    }
    let mut m = Model::new(size as usize, expect);
    let mut rng = Rng::new(seed);
    check_all(b, &m, "fresh backend reads as zeroes")?;

    // Writes at the edges: start, unaligned, across 4 KiB and 64 KiB boundaries, last byte,
    // a block ending exactly at the end.
    let edges: [(u64, usize); 7] = [
        (0, 512),
        (1, 1),
        (4095, 2),
        ((64 << 10) - 3, 4096 + 7),
        (size - 1, 1),
        (size - 4096, 4096),
        (size / 2 + 13, 100_000),
    ];
    for (off, len) in edges {
        write(b, &mut m, &mut rng, off, len, false)?;
    }
    check_all(b, &m, "writes at the edges")?;

    // Reads at the edges return exactly what was asked.
    for (off, len) in [(0u64, 1usize), (size - 1, 1), (size - 7777, 7777), (3, 65536 + 5)] {
        let mut buf = vec![0u8; len];
        let got = b.read(&mut buf, off).map_err(err("edge read"))?;
        if got != len {
            return Err(fail(format!("edge read at {off}: got {got} of {len} bytes")));
        }
        m.check(&buf, off, "edge read")?;
    }

    // FUA writes and flushes succeed and keep the data.
    write(b, &mut m, &mut rng, 8192, 4096, true)?;
    b.flush().map_err(err("flush"))?;
    check_all(b, &m, "after flush")?;

    // Zeroes, with and without permission to deallocate, aligned and not.
    if caps.can_zero {
        for (off, len, may_trim) in
            [(0u64, 4096u64, true), (1, 10, false), (65536 - 5, 70_000, true), (size - 3, 3, false)]
        {
            b.zero(off, len, ZeroFlags { may_trim, fast: false, fua: false })
                .map_err(err(&format!("zero {off}+{len}")))?;
            m.zero(off, len);
        }
        check_all(b, &m, "after zeroes")?;
    }

    // Trims leave the range unspecified; the rest must be untouched.
    if caps.can_trim {
        b.trim(128 << 10, 256 << 10, false).map_err(err("trim"))?;
        m.trim(128 << 10, 256 << 10);
        b.trim(size - 1000, 1000, true).map_err(err("trim at end"))?;
        m.trim(size - 1000, 1000);
        check_all(b, &m, "after trims")?;
    }

    check_extents(b, &m)?;

    // CACHE is advice: it succeeds and changes nothing.
    b.cache(0, size).map_err(err("cache"))?;
    b.cache(size - 1, 1).map_err(err("cache at end"))?;
    check_all(b, &m, "after cache")?;

    // A random mix, checked against the model every few operations.
    for i in 0..300 {
        let off = rng.below(size);
        let len = 1 + rng.below((size - off).min(300_000));
        match rng.below(10) {
            0..=5 => {
                let fua = rng.below(8) == 0;
                write(b, &mut m, &mut rng, off, len as usize, fua)?
            }
            6 if caps.can_zero => {
                let may_trim = rng.below(2) == 0;
                b.zero(off, len, ZeroFlags { may_trim, fast: false, fua: false })
                    .map_err(err("random zero"))?;
                m.zero(off, len);
            }
            7 if caps.can_trim => {
                b.trim(off, len, false).map_err(err("random trim"))?;
                m.trim(off, len);
            }
            8 => b.flush().map_err(err("random flush"))?,
            _ => {
                let mut buf = vec![0u8; len as usize];
                let got = b.read(&mut buf, off).map_err(err("random read"))?;
                if got as u64 != len {
                    return Err(fail(format!("random read at {off}: got {got} of {len}")));
                }
                m.check(&buf, off, &format!("random read #{i} at {off}+{len}"))?;
            }
        }
        if i % 50 == 49 {
            check_all(b, &m, &format!("after random op #{i}"))?;
            check_extents(b, &m)?;
        }
    }
    streams(b, &mut m, &mut rng)?;
    check_all(b, &m, "after the sequential readers")
}

/// Two sequential readers taking 4 KiB at a time, interleaved, with writes, zeroes and trims
/// landing 64-320 KiB ahead of them, where a read-ahead filter (`--prefetch`) has data
/// buffered or being read: every read must see every change made before it.
fn streams(b: &dyn Backend, m: &mut Model, rng: &mut Rng) -> Result<()> {
    const STEP: u64 = 4096;
    let caps = b.caps();
    let size = m.data.len() as u64;
    let span = (size / 4).min(1 << 20);
    let mut pos = [size / 8, size / 2];
    for i in 0..span / STEP {
        for (s, p) in pos.iter_mut().enumerate() {
            let len = STEP.min(size - *p);
            let mut buf = vec![0u8; len as usize];
            let got = b.read(&mut buf, *p).map_err(err("sequential read"))?;
            if got as u64 != len {
                return Err(fail(format!("sequential read at {p}: got {got} of {len}")));
            }
            m.check(&buf, *p, &format!("reader {s}, read #{i} at {p}"))?;
            *p += len;
            if i % 16 != 7 {
                continue;
            }
            let ahead = *p + (64 << 10) + rng.below(256 << 10);
            if ahead >= size {
                continue;
            }
            let len = (1 + rng.below(20_000)).min(size - ahead);
            match (i / 16 + s as u64) % 3 {
                1 if caps.can_zero => {
                    b.zero(ahead, len, ZeroFlags { may_trim: true, fast: false, fua: false })
                        .map_err(err("zero ahead of a reader"))?;
                    m.zero(ahead, len);
                }
                2 if caps.can_trim => {
                    b.trim(ahead, len, false).map_err(err("trim ahead of a reader"))?;
                    m.trim(ahead, len);
                }
                _ => write(b, m, rng, ahead, len as usize, false)?,
            }
        }
    }
    Ok(())
}

/// Extents cover the request contiguously from its start, and what they call zero reads as
/// zeroes.
fn check_extents(b: &dyn Backend, m: &Model) -> Result<()> {
    let size = m.data.len() as u64;
    for (off, len) in [(0, size), (1, size - 1), (size / 3, 70_000), (size - 1, 1)] {
        let exts = b.extents(off, len).map_err(err("extents"))?;
        if exts.is_empty() {
            return Err(fail(format!("extents {off}+{len}: none returned")));
        }
        let total: u64 = exts.iter().map(|e| e.len).sum();
        if total == 0 || total > len {
            return Err(fail(format!("extents {off}+{len}: cover {total} bytes")));
        }
        let mut at = off;
        for e in exts {
            if e.zero {
                let mut buf = vec![0u8; e.len as usize];
                b.read(&mut buf, at).map_err(err("read of a zero extent"))?;
                if let Some(i) = buf.iter().position(|&x| x != 0) {
                    return Err(fail(format!(
                        "extent at {at}+{} says zero but byte {} is not",
                        e.len,
                        at + i as u64
                    )));
                }
            }
            at += e.len;
        }
    }
    Ok(())
}

/// Several threads write disjoint ranges at once; every byte must land.
pub fn run_parallel(b: Arc<dyn Backend>, threads: usize, seed: u64) -> Result<()> {
    let size = b.size().ok_or_else(|| fail("needs a size"))?;
    let slice = size / threads as u64;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let b = b.clone();
            std::thread::spawn(move || -> Result<Vec<u8>> {
                let mut rng = Rng::new(seed + t as u64);
                let mut buf = vec![0u8; slice as usize];
                rng.fill(&mut buf);
                // Written in uneven pieces so requests from threads interleave.
                let mut at = 0usize;
                while at < buf.len() {
                    let n = (1 + rng.below(50_000) as usize).min(buf.len() - at);
                    b.write(&buf[at..at + n], t as u64 * slice + at as u64, false)
                        .map_err(err("parallel write"))?;
                    at += n;
                }
                Ok(buf)
            })
        })
        .collect();
    let mut m = Model::new(size as usize, Expect::Store);
    // Untouched tail bytes are whatever they were: only check the written slices.
    for (t, h) in handles.into_iter().enumerate() {
        let buf = h.join().map_err(|_| fail("a writer thread panicked"))??;
        m.write(&buf, t as u64 * slice);
        let mut got = vec![0u8; buf.len()];
        b.read(&mut got, t as u64 * slice).map_err(err("parallel read back"))?;
        m.check(&got, t as u64 * slice, "parallel writes")?;
    }
    Ok(())
}
