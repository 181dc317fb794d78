//! Copy engine tests over memory backends, with faults injected where the error paths are.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::backend::{Backend, CacheInfo, Caps, Extent, MemoryBackend, Report};
use crate::testing::conformance::Rng;
use crate::testing::fault::{Fault, FaultInjector, Op, Rule};

const SIZE: u64 = (20 << 20) + 12345;

/// A source with data, holes and an all-zero data region.
fn source() -> Arc<MemoryBackend> {
    let m = Arc::new(MemoryBackend::new(SIZE));
    let mut rng = Rng::new(7);
    for (off, len) in [(0u64, 1 << 20), ((5 << 20) + 17, 3 << 20), (SIZE - 5000, 5000)] {
        let mut buf = vec![0u8; len as usize];
        rng.fill(&mut buf);
        m.write(&buf, off, false).unwrap();
    }
    // Allocated but zero: must be detected and skipped.
    m.write(&vec![0u8; 2 << 20], 12 << 20, false).unwrap();
    m
}

fn contents(b: &dyn Backend) -> Vec<u8> {
    let mut buf = vec![0u8; b.size().unwrap() as usize];
    b.read(&mut buf, 0).unwrap();
    buf
}

fn opts(workers: usize) -> CopyOptions {
    CopyOptions {
        workers,
        request_size: 1 << 20,
        destination_is_zero: true,
        sparse: true,
        flush: true,
        interleave: false,
        changed_only: false,
        whole_units: None,
    }
}

fn run(src: &dyn Backend, dst: &dyn Backend, o: &CopyOptions) -> Result<Stats, Failure> {
    copy(src, dst, o, &Progress::default(), &AtomicBool::new(false))
}

#[test]
fn copies_identically_and_sparsely() {
    for workers in [1, 2, 8] {
        let src = source();
        let dst = MemoryBackend::new(SIZE);
        let stats = run(&*src, &dst, &opts(workers)).unwrap();
        assert_eq!(stats.bytes, SIZE);
        assert_eq!(contents(&*src), contents(&dst), "workers {workers}");
        // Only the non-zero data was written: holes and the zero region were skipped.
        assert!(dst.allocated() < src.allocated(), "{} vs {}", dst.allocated(), src.allocated());
        assert!(stats.written <= (4 << 20) + 5000 + (128 << 10), "wrote {}", stats.written);
    }
}

/// Interleaved, every chunk is still copied once: 21 chunks of 1 MiB are not a whole number
/// of groups (2 × workers), so the last group names chunks past the end.
#[test]
fn copies_identically_when_interleaved() {
    for workers in [1, 3, 8] {
        let src = source();
        let dst = MemoryBackend::new(SIZE);
        let stats = run(&*src, &dst, &CopyOptions { interleave: true, ..opts(workers) }).unwrap();
        assert_eq!(stats.bytes, SIZE, "workers {workers}");
        assert_eq!(contents(&*src), contents(&dst), "workers {workers}");
    }
}

/// Each group is handed out evens first, then odds: every chunk once, and the first half of
/// a group (as many as the workers, all in flight together) a chunk apart from each other.
#[test]
fn interleaved_order() {
    assert_eq!((0..8).map(|t| interleaved(t, 4)).collect::<Vec<_>>(), [0, 2, 1, 3, 4, 6, 5, 7]);
    assert_eq!((0..5).map(|t| interleaved(t, 1)).collect::<Vec<_>>(), [0, 1, 2, 3, 4]);
    for group in [2u64, 4, 32, 128] {
        let mut seen: Vec<u64> = (0..group * 3).map(|t| interleaved(t, group)).collect();
        let evens = &seen[..(group / 2) as usize];
        assert!(evens.windows(2).all(|w| w[1] == w[0] + 2), "group {group}: {evens:?}");
        seen.sort_unstable();
        assert_eq!(seen, (0..group * 3).collect::<Vec<_>>(), "group {group}");
    }
}

#[test]
fn zeroes_holes_on_a_destination_that_is_not_zero() {
    let src = source();
    let dst = MemoryBackend::new(SIZE);
    let mut junk = vec![0u8; SIZE as usize];
    Rng::new(9).fill(&mut junk);
    dst.write(&junk, 0, false).unwrap();
    let o = CopyOptions { destination_is_zero: false, ..opts(2) };
    run(&*src, &dst, &o).unwrap();
    assert_eq!(contents(&*src), contents(&dst));
}

#[test]
fn destination_too_small_is_refused_before_writing() {
    let src = source();
    let dst = MemoryBackend::new(SIZE - 1);
    let f = run(&*src, &dst, &opts(2)).unwrap_err();
    assert_eq!(f.error.kind(), ErrorKind::NoSpace);
    assert!(f.error.to_string().contains("smaller than the source"), "{}", f.error);
    assert_eq!(dst.allocated(), 0);
}

fn faulty(inner: Arc<dyn Backend>, rule: Rule) -> FaultInjector {
    FaultInjector::new(inner, vec![rule])
}

#[test]
fn read_error_names_the_offset() {
    let src = faulty(source(), Rule::new(Op::Read, Fault::Fail(ErrorKind::Io)).at(5 << 20, 1));
    let dst = MemoryBackend::new(SIZE);
    let f = run(&src, &dst, &opts(2)).unwrap_err();
    assert_eq!(f.error.kind(), ErrorKind::Io);
    let msg = f.error.to_string();
    assert!(
        msg.starts_with("read memory:") && msg.contains("at offset 5") && msg.contains("input/output error"),
        "{msg}"
    );
}

#[test]
fn enospc_on_write_is_reported_as_such() {
    let src = source();
    let dst = faulty(
        Arc::new(MemoryBackend::new(SIZE)),
        Rule::new(Op::Write, Fault::Fail(ErrorKind::NoSpace)).every(1, 2),
    );
    let f = run(&*src, &dst, &opts(2)).unwrap_err();
    assert_eq!(f.error.kind(), ErrorKind::NoSpace);
    assert!(f.error.to_string().contains("no space left"), "{}", f.error);
}

#[test]
fn short_read_is_an_unexpected_end() {
    let src = faulty(source(), Rule::new(Op::Read, Fault::Short).times(1));
    let dst = MemoryBackend::new(SIZE);
    let f = run(&src, &dst, &opts(1)).unwrap_err();
    assert_eq!(f.error.kind(), ErrorKind::UnexpectedEof);
}

#[test]
fn torn_write_fails_the_copy() {
    let src = source();
    let dst = faulty(Arc::new(MemoryBackend::new(SIZE)), Rule::new(Op::Write, Fault::Short).times(1));
    assert_eq!(run(&*src, &dst, &opts(2)).unwrap_err().error.kind(), ErrorKind::Io);
}

#[test]
fn flush_error_fails_the_copy() {
    let src = source();
    let dst = faulty(Arc::new(MemoryBackend::new(SIZE)), Rule::new(Op::Flush, Fault::Fail(ErrorKind::Io)));
    let f = run(&*src, &dst, &opts(2)).unwrap_err();
    assert_eq!(f.error.op(), Op::Flush);
    // Without a flush requested, the same destination succeeds.
    let o = CopyOptions { flush: false, ..opts(2) };
    run(&*src, &dst, &o).unwrap();
}

#[test]
fn extents_error_fails_the_copy() {
    let src = faulty(source(), Rule::new(Op::Extents, Fault::Fail(ErrorKind::Io)).every(3, 1));
    let dst = MemoryBackend::new(SIZE);
    assert_eq!(run(&src, &dst, &opts(2)).unwrap_err().error.op(), Op::Extents);
}

#[test]
fn slow_operations_still_copy_correctly() {
    let src = faulty(source(), Rule::new(Op::Read, Fault::Slow(Duration::from_millis(5))).every(2, 0));
    let dst = MemoryBackend::new(SIZE);
    run(&src, &dst, &opts(4)).unwrap();
    assert_eq!(contents(&src), contents(&dst));
}

#[test]
fn cancel_stops_with_interrupted() {
    let src = faulty(source(), Rule::new(Op::Read, Fault::Slow(Duration::from_millis(20))));
    let dst = MemoryBackend::new(SIZE);
    let cancel = AtomicBool::new(false);
    let f = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(30));
            cancel.store(true, Ordering::Relaxed);
        });
        copy(&src, &dst, &opts(2), &Progress::default(), &cancel).unwrap_err()
    });
    assert_eq!(f.error.kind(), ErrorKind::Interrupted);
    assert!(f.done < SIZE);
}

/// Counts `finish` calls, to show clean-up runs on failure too.
struct CountFinish(Arc<dyn Backend>, AtomicUsize);

impl Backend for CountFinish {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn size(&self) -> Option<u64> {
        self.0.size()
    }
    fn caps(&self) -> Caps {
        self.0.caps()
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        self.0.read(buf, offset)
    }
    fn read_at_hand(&self, buf: &mut [u8], offset: u64) -> Option<Result<usize>> {
        self.0.read_at_hand(buf, offset)
    }

    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.0.write(buf, offset, fua)
    }
    fn write_at_hand(&self, buf: &[u8], offset: u64) -> Option<Result<()>> {
        self.0.write_at_hand(buf, offset)
    }
    fn write_merged(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.0.write_merged(buf, offset, fua)
    }
    fn will_write(&self, offset: u64, len: u64) {
        self.0.will_write(offset, len)
    }
    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.0.zero(offset, len, flags)
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.0.trim(offset, len, fua)
    }
    fn flush(&self) -> Result<()> {
        self.0.flush()
    }
    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        self.0.cache(offset, len)
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.0.extents(offset, len)
    }
    fn cache_info(&self) -> Option<CacheInfo> {
        None
    }
    fn report(&self) -> Report {
        Report::default()
    }
    fn finish(&self) -> Result<()> {
        self.1.fetch_add(1, Ordering::Relaxed);
        self.0.finish()
    }
}

#[test]
fn finish_runs_on_both_sides_after_an_error() {
    let src = CountFinish(
        Arc::new(faulty(source(), Rule::new(Op::Read, Fault::Fail(ErrorKind::Io)))),
        AtomicUsize::new(0),
    );
    let dst = CountFinish(Arc::new(MemoryBackend::new(SIZE)), AtomicUsize::new(0));
    run(&src, &dst, &opts(2)).unwrap_err();
    assert_eq!(src.1.load(Ordering::Relaxed), 1);
    assert_eq!(dst.1.load(Ordering::Relaxed), 1);
}

#[test]
fn stream_source_is_read_to_its_end() {
    use crate::backend::PipeBackend;
    let mut data = vec![0u8; (3 << 20) + 99];
    Rng::new(3).fill(&mut data);
    let src = PipeBackend::from_file("pipe", tempfile_with(&data), false);
    let dst = MemoryBackend::new(4 << 20);
    let stats = run(&src, &dst, &opts(2)).unwrap();
    assert_eq!(stats.bytes, data.len() as u64);
    assert_eq!(&contents(&dst)[..data.len()], &data[..]);
    // Too small a destination fails once the stream passes its end.
    let src = PipeBackend::from_file("pipe", tempfile_with(&data), false);
    let small = MemoryBackend::new(1 << 20);
    assert_eq!(run(&src, &small, &opts(1)).unwrap_err().error.kind(), ErrorKind::NoSpace);
}

fn tempfile_with(data: &[u8]) -> std::fs::File {
    use std::io::{Seek, Write};
    let mut f = tempfile::tempfile().unwrap();
    f.write_all(data).unwrap();
    f.rewind().unwrap();
    f
}

/// A memory backend that records the ranges read from and written to it. With `dirty`
/// (start, len) ranges it is a source whose dirty bitmap marks them changed: its extents say
/// clean elsewhere, as an NBD source opened with `--bitmap` does.
struct Watched {
    inner: Arc<MemoryBackend>,
    dirty: Option<Vec<(u64, u64)>>,
    reads: std::sync::Mutex<Vec<(u64, u64)>>,
    writes: std::sync::Mutex<Vec<(u64, u64)>>,
}

impl Watched {
    fn new(inner: Arc<MemoryBackend>, dirty: Option<Vec<(u64, u64)>>) -> Watched {
        Watched { inner, dirty, reads: Default::default(), writes: Default::default() }
    }

    /// The allocation map cut at the bitmap's edges; a changed run may hold holes and zeroes.
    fn marked(&self, dirty: &[(u64, u64)], offset: u64, len: u64) -> Result<Vec<Extent>> {
        let mut out = Vec::new();
        let mut at = offset;
        for e in self.inner.extents(offset, len)? {
            let end = at + e.len;
            while at < end {
                let (clean, to) = match dirty.iter().find(|&&(s, l)| at >= s && at < s + l) {
                    Some(&(s, l)) => (false, (s + l).min(end)),
                    None => {
                        let next = dirty.iter().map(|&(s, _)| s).filter(|&s| s > at).min();
                        (true, next.unwrap_or(u64::MAX).min(end))
                    }
                };
                out.push(Extent { len: to - at, clean, ..e });
                at = to;
            }
        }
        Ok(out)
    }
}

impl Backend for Watched {
    fn name(&self) -> &str {
        "watched"
    }
    fn size(&self) -> Option<u64> {
        self.inner.size()
    }
    fn caps(&self) -> Caps {
        self.inner.caps()
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        self.reads.lock().unwrap().push((offset, buf.len() as u64));
        self.inner.read(buf, offset)
    }
    fn read_at_hand(&self, _: &mut [u8], _: u64) -> Option<Result<usize>> {
        None
    }
    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.writes.lock().unwrap().push((offset, buf.len() as u64));
        self.inner.write(buf, offset, fua)
    }
    crate::backend::writes_leave_at_once!();
    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.writes.lock().unwrap().push((offset, len));
        self.inner.zero(offset, len, flags)
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.writes.lock().unwrap().push((offset, len));
        self.inner.trim(offset, len, fua)
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    fn cache(&self, _: u64, _: u64) -> Result<()> {
        Ok(())
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        match &self.dirty {
            Some(dirty) => self.marked(dirty, offset, len),
            None => self.inner.extents(offset, len),
        }
    }
    crate::backend::nothing_to_report!();
    fn finish(&self) -> Result<()> {
        Ok(())
    }
}

/// The source, its previous copy in `dst`, then changes: new data at odd offsets, data zeroed,
/// a region punched, across request boundaries. Returns the source and the changed ranges
/// rounded out to 64 KiB, as QEMU's bitmap would mark them.
fn changed_since(dst: &dyn Backend) -> (Arc<MemoryBackend>, Vec<(u64, u64)>) {
    let src = source();
    run(&*src, dst, &opts(2)).unwrap();
    let mut rng = Rng::new(11);
    let mut buf = vec![0u8; 300_000];
    rng.fill(&mut buf);
    src.write(&buf, (1 << 20) - 1000, false).unwrap();
    src.zero((5 << 20) + 100_000, 200_000, ZeroFlags::default()).unwrap();
    src.trim(7 << 20, 1 << 20, false).unwrap();
    src.write(&buf[..5000], SIZE - 5000, false).unwrap();
    let g = 64 << 10;
    let round = |s: u64, l: u64| (s / g * g, ((s + l).div_ceil(g) * g).min(SIZE) - s / g * g);
    let dirty = vec![
        round((1 << 20) - 1000, 300_000),
        round((5 << 20) + 100_000, 200_000),
        round(7 << 20, 1 << 20),
        round(SIZE - 5000, 5000),
    ];
    (src, dirty)
}

#[test]
fn changed_only_into_whole_units_writes_each_changed_unit_once() {
    let unit = 256u64 << 10;
    let dst = Watched::new(Arc::new(MemoryBackend::new(SIZE)), None);
    let (src, dirty) = changed_since(&dst);
    dst.writes.lock().unwrap().clear();
    let b = Watched::new(src.clone(), Some(dirty.clone()));
    let o =
        CopyOptions { destination_is_zero: false, changed_only: true, whole_units: Some(unit), ..opts(4) };
    let stats = run(&b, &dst, &o).unwrap();
    assert_eq!(contents(&*src), contents(&*dst.inner));
    assert_eq!(stats.bytes, dirty.iter().map(|d| d.1).sum::<u64>());
    // The units the changes touch, and those they cover only in part.
    let mut touched = std::collections::BTreeMap::new();
    for &(s, l) in &dirty {
        for u in s / unit..(s + l).div_ceil(unit) {
            let (u0, u1) = (u * unit, ((u + 1) * unit).min(SIZE));
            *touched.entry(u0).or_insert(0) += (s + l).min(u1) - s.max(u0);
        }
    }
    let partly: Vec<u64> =
        touched.iter().filter(|&(&u0, &c)| c < unit.min(SIZE - u0)).map(|(&u, _)| u).collect();
    // Each touched unit written once, whole; read first only where covered in part.
    let mut writes = dst.writes.lock().unwrap().clone();
    writes.sort_unstable();
    let want: Vec<(u64, u64)> = touched.keys().map(|&u0| (u0, unit.min(SIZE - u0))).collect();
    assert_eq!(writes, want);
    let mut reads: Vec<u64> = dst.reads.lock().unwrap().iter().map(|r| r.0).collect();
    reads.sort_unstable();
    assert_eq!(reads, partly);
    assert!(!partly.is_empty() && partly.len() < want.len(), "{partly:?} of {want:?}");
    assert!(b.writes.lock().unwrap().is_empty(), "wrote to the source");
}

#[test]
fn changed_only_copies_what_the_bitmap_marks_into_the_previous_copy() {
    let dst = MemoryBackend::new(SIZE);
    let (src, dirty) = changed_since(&dst);
    let marked: u64 = dirty.iter().map(|d| d.1).sum();
    let b = Watched::new(src.clone(), Some(dirty.clone()));
    assert_eq!(changed_bytes(&b, SIZE, &AtomicBool::new(false)).unwrap(), marked);
    for workers in [1, 4] {
        b.reads.lock().unwrap().clear();
        let o = CopyOptions { destination_is_zero: false, changed_only: true, ..opts(workers) };
        let stats = run(&b, &dst, &o).unwrap();
        assert_eq!(contents(&*src), contents(&dst), "workers {workers}");
        assert_eq!(stats.bytes, marked);
        // Only changed bytes were read.
        for &(off, len) in b.reads.lock().unwrap().iter() {
            assert!(
                dirty.iter().any(|&(s, l)| off >= s && off + len <= s + l),
                "read {off}+{len} outside {dirty:?}"
            );
        }
    }
    // Nothing changed: nothing read, nothing written.
    let none = Watched::new(src.clone(), Some(vec![]));
    let o = CopyOptions { destination_is_zero: false, changed_only: true, ..opts(2) };
    let stats = run(&none, &dst, &o).unwrap();
    assert_eq!((stats.bytes, stats.written, stats.zero), (0, 0, 0));
    assert!(none.reads.lock().unwrap().is_empty());
    // Nothing was ever written to the source.
    assert!(b.writes.lock().unwrap().is_empty() && none.writes.lock().unwrap().is_empty());
}
