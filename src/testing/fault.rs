//! A fault-injecting filter for tests: fails, shortens or slows chosen operations, at chosen
//! offsets or every n-th time, so every error path can be exercised without a broken disk.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::backend::{Backend, Caps, Extent, ZeroFlags};
/// Which operations a rule applies to: `Read`, `Write`, `Zero`, `Trim`, `Flush` or `Extents`
/// (the error's operation, so a fired rule's error names the operation it failed).
pub use crate::error::Op;
use crate::error::{Error, ErrorKind, Result};

/// What happens when a rule fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Fail with this kind (`Io` stands for EIO, `NoSpace` for ENOSPC).
    Fail(ErrorKind),
    /// Reads return half the bytes (as at an unexpected end of data); writes store the first
    /// half and then fail with EIO (a torn write).
    Short,
    /// Sleep, then carry out the operation.
    Slow(Duration),
    /// Carry out the operation, then sleep before returning: an answer that arrives late,
    /// whose data may be stale by then (races with writes). Reads and writes only.
    Late(Duration),
    /// Panic, as a bug in a layer would: what the layers above do about it.
    Panic,
}

/// One rule: `fault` on `ops` overlapping `range`, on every `every`-th match after skipping
/// the first `skip`, at most `times` times.
#[derive(Debug, Clone)]
pub struct Rule {
    pub ops: Vec<Op>,
    pub range: Option<(u64, u64)>,
    pub skip: u64,
    pub every: u64,
    pub times: Option<u64>,
    pub fault: Fault,
}

impl Rule {
    /// `fault` on every request of `op`.
    pub fn new(op: Op, fault: Fault) -> Rule {
        Rule { ops: vec![op], range: None, skip: 0, every: 1, times: None, fault }
    }

    /// Only requests overlapping `[offset, offset+len)`.
    pub fn at(mut self, offset: u64, len: u64) -> Rule {
        self.range = Some((offset, len));
        self
    }

    /// Only every n-th matching request (n ≥ 1), after skipping `skip` of them.
    pub fn every(mut self, n: u64, skip: u64) -> Rule {
        self.every = n.max(1);
        self.skip = skip;
        self
    }

    /// At most `n` times.
    pub fn times(mut self, n: u64) -> Rule {
        self.times = Some(n);
        self
    }
}

pub struct FaultInjector {
    inner: Arc<dyn Backend>,
    rules: Vec<(Rule, AtomicU64, AtomicU64)>,
    /// The name of the thread that carried out each read, in order ("" for an unnamed one),
    /// once asked for ([`FaultInjector::recording_threads`]).
    read_threads: Mutex<Option<Vec<String>>>,
}

impl FaultInjector {
    pub fn new(inner: Arc<dyn Backend>, rules: Vec<Rule>) -> FaultInjector {
        let rules = rules.into_iter().map(|r| (r, AtomicU64::new(0), AtomicU64::new(0))).collect();
        FaultInjector { inner, rules, read_threads: Mutex::default() }
    }

    /// Records the name of the thread that carries out each read from now on
    /// ([`FaultInjector::read_threads`]).
    pub fn recording_threads(mut self) -> FaultInjector {
        self.read_threads = Mutex::new(Some(Vec::new()));
        self
    }

    /// The names of the threads that carried out the reads recorded so far, in order (""
    /// for an unnamed thread): which of a server's threads served a request.
    pub fn read_threads(&self) -> Vec<String> {
        self.read_threads.lock().unwrap().clone().unwrap_or_default()
    }

    /// How many times the rules fired, in order.
    pub fn fired(&self) -> Vec<u64> {
        self.rules.iter().map(|(_, _, f)| f.load(Ordering::Relaxed)).collect()
    }

    /// The fault to inject for this request, if any (sleeps for `Slow` itself).
    fn check(&self, op: Op, offset: u64, len: u64) -> Option<Fault> {
        for (rule, seen, fired) in &self.rules {
            if !rule.ops.contains(&op) {
                continue;
            }
            if let Some((o, l)) = rule.range {
                let overlaps = offset < o + l && o < offset + len.max(1);
                if !overlaps && op != Op::Flush {
                    continue;
                }
            }
            let n = seen.fetch_add(1, Ordering::Relaxed);
            if n < rule.skip || (n - rule.skip) % rule.every != 0 {
                continue;
            }
            if rule.times.is_some_and(|t| fired.load(Ordering::Relaxed) >= t) {
                continue;
            }
            fired.fetch_add(1, Ordering::Relaxed);
            match rule.fault {
                Fault::Slow(d) => std::thread::sleep(d),
                Fault::Panic => panic!("fault injected: a panic in {op:?} at {offset}+{len}"),
                other => return Some(other),
            }
        }
        None
    }

    fn fail(&self, kind: ErrorKind, op: Op, offset: u64, len: u64) -> Error {
        let errno = match kind {
            ErrorKind::NoSpace => libc::ENOSPC,
            ErrorKind::Permission => libc::EPERM,
            ErrorKind::NotSupported => libc::EOPNOTSUPP,
            ErrorKind::InvalidInput => libc::EINVAL,
            _ => libc::EIO,
        };
        Error::io(op, std::io::Error::from_raw_os_error(errno))
            .path(self.inner.name())
            .at(offset, len)
            .detail("injected")
    }
}

impl FaultInjector {
    /// A write (`below` carries it out) with the write rules applied.
    fn write_with(
        &self,
        buf: &[u8],
        offset: u64,
        fua: bool,
        below: impl Fn(&[u8], u64, bool) -> Result<()>,
    ) -> Result<()> {
        match self.check(Op::Write, offset, buf.len() as u64) {
            Some(Fault::Fail(k)) => Err(self.fail(k, Op::Write, offset, buf.len() as u64)),
            Some(Fault::Short) => {
                let half = buf.len() / 2;
                below(&buf[..half], offset, fua)?;
                Err(self.fail(ErrorKind::Io, Op::Write, offset + half as u64, (buf.len() - half) as u64))
            }
            Some(Fault::Late(d)) => late(d, below(buf, offset, fua)),
            _ => below(buf, offset, fua),
        }
    }
}

/// Returns `r` after sleeping `d`.
fn late<T>(d: Duration, r: T) -> T {
    std::thread::sleep(d);
    r
}

impl Backend for FaultInjector {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn size(&self) -> Option<u64> {
        self.inner.size()
    }

    fn caps(&self) -> Caps {
        self.inner.caps()
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        if let Some(threads) = self.read_threads.lock().unwrap().as_mut() {
            threads.push(std::thread::current().name().unwrap_or_default().to_string());
        }
        match self.check(Op::Read, offset, buf.len() as u64) {
            Some(Fault::Fail(k)) => Err(self.fail(k, Op::Read, offset, buf.len() as u64)),
            Some(Fault::Short) => {
                let half = buf.len() / 2;
                self.inner.read(&mut buf[..half], offset)
            }
            Some(Fault::Late(d)) => late(d, self.inner.read(buf, offset)),
            _ => self.inner.read(buf, offset),
        }
    }

    /// Reads with a rule go through `read`, where the rule applies; others are the inner
    /// backend's.
    fn read_at_hand(&self, buf: &mut [u8], offset: u64) -> Option<Result<usize>> {
        if self.rules.iter().any(|(r, _, _)| r.ops.contains(&Op::Read)) {
            return None;
        }
        self.inner.read_at_hand(buf, offset)
    }

    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.write_with(buf, offset, fua, |b, o, f| self.inner.write(b, o, f))
    }

    /// Writes with a rule go through `write`, where the rule applies; others are the inner
    /// backend's.
    fn write_at_hand(&self, buf: &[u8], offset: u64) -> Option<Result<()>> {
        if self.rules.iter().any(|(r, _, _)| r.ops.contains(&Op::Write)) {
            return None;
        }
        self.inner.write_at_hand(buf, offset)
    }

    /// The write rules apply to merged writes too (a coalesce write-back is torn this way).
    fn write_merged(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.write_with(buf, offset, fua, |b, o, f| self.inner.write_merged(b, o, f))
    }

    fn will_write(&self, offset: u64, len: u64) {
        self.inner.will_write(offset, len)
    }

    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        match self.check(Op::Zero, offset, len) {
            Some(Fault::Fail(k)) => Err(self.fail(k, Op::Zero, offset, len)),
            Some(Fault::Short) => {
                self.inner.zero(offset, len / 2, flags)?;
                Err(self.fail(ErrorKind::Io, Op::Zero, offset + len / 2, len - len / 2))
            }
            _ => self.inner.zero(offset, len, flags),
        }
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        match self.check(Op::Trim, offset, len) {
            Some(Fault::Fail(k)) => Err(self.fail(k, Op::Trim, offset, len)),
            _ => self.inner.trim(offset, len, fua),
        }
    }

    fn flush(&self) -> Result<()> {
        match self.check(Op::Flush, 0, 0) {
            Some(Fault::Fail(k)) => Err(self.fail(k, Op::Flush, 0, 0)),
            _ => self.inner.flush(),
        }
    }

    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.cache(offset, len)
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        match self.check(Op::Extents, offset, len) {
            Some(Fault::Fail(k)) => Err(self.fail(k, Op::Extents, offset, len)),
            _ => self.inner.extents(offset, len),
        }
    }

    crate::backend::reports_of!(inner);

    fn finish(&self) -> Result<()> {
        self.inner.finish()
    }
}
