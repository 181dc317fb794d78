//! The dirty data of one block: exact byte ranges the client wrote and nobody has written
//! back yet, merged when they touch or overlap (a later write wins over an earlier one).
//!
//! Only bytes a client wrote are held, never the gaps between them: a block with 1 KiB dirty
//! costs 1 KiB and one run's overhead ([`RUN_COST`]), so the memory bound counts what clients
//! sent, not blocks, and tiny writes far apart cannot hold many times the bound in
//! bookkeeping. The gaps are read from below at write-back time, under the block's lock, and
//! only where the layer below holds data there ([`plan`]).

use std::ops::Range;
use std::time::Instant;

use crate::backend::Extent;

/// What the memory bound charges for each run beyond its bytes: its entry in the block's
/// vector (32 bytes), its heap allocation's header and rounding (16-32), and a share of the
/// block's entry in its stripe's map, which holds at least one run. Without it, 1-byte writes
/// 2 bytes apart (a run each) held 64 MiB of data in several GiB.
pub const RUN_COST: u64 = 96;

/// The dirty runs of one block, offsets relative to the block's start.
#[derive(Debug, Clone)]
pub struct Block {
    /// Sorted, disjoint and never touching: two runs always have a gap between them.
    runs: Vec<(u32, Vec<u8>)>,
    /// When the block was first dirtied since it was last clean: the age bound's clock.
    pub since: Instant,
}

impl Block {
    pub fn new(now: Instant) -> Block {
        Block { runs: Vec::new(), since: now }
    }

    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// Dirty bytes held.
    pub fn bytes(&self) -> u64 {
        self.runs.iter().map(|(_, d)| d.len() as u64).sum()
    }

    /// What the memory bound counts for this block: its bytes and [`RUN_COST`] per run.
    pub fn cost(&self) -> u64 {
        self.bytes() + self.runs.len() as u64 * RUN_COST
    }

    /// The dirty ranges, in order.
    pub fn ranges(&self) -> impl Iterator<Item = Range<u32>> + '_ {
        self.runs.iter().map(|(s, d)| *s..*s + d.len() as u32)
    }

    /// Where the last dirty range ends; `None` when nothing is dirty.
    pub fn end(&self) -> Option<u32> {
        self.runs.last().map(|(s, d)| s + d.len() as u32)
    }

    /// The dirty runs with their bytes, in order.
    pub fn runs(&self) -> &[(u32, Vec<u8>)] {
        &self.runs
    }

    /// Records `data` written at `at`; returns how much its [`Self::cost`] grew: at most
    /// `data.len() + RUN_COST`, and less than 0 when the write joins runs.
    pub fn write(&mut self, at: u32, data: &[u8]) -> i64 {
        if data.is_empty() {
            return 0;
        }
        let (s, e) = (at, at + data.len() as u32);
        // Runs that overlap or touch [s, e): from the first ending at or after s to the last
        // starting at or before e.
        let first = self.runs.partition_point(|(rs, d)| rs + (d.len() as u32) < s);
        let last = self.runs.partition_point(|(rs, _)| *rs <= e);
        let before = self.cost_of(first..last);
        if first == last {
            self.runs.insert(first, (s, data.to_vec()));
            return (data.len() as u64 + RUN_COST) as i64;
        }
        let fs = self.runs[first].0;
        let le = self.runs[last - 1].0 + self.runs[last - 1].1.len() as u32;
        let (ns, ne) = (fs.min(s), le.max(e));
        if last - first == 1 && fs <= s && e >= le {
            // The common case of sequential small writes: extend the run in place.
            let run = &mut self.runs[first].1;
            run.truncate((s - fs) as usize);
            run.extend_from_slice(data);
        } else {
            let mut merged = vec![0u8; (ne - ns) as usize];
            for (rs, d) in &self.runs[first..last] {
                let o = (rs - ns) as usize;
                merged[o..o + d.len()].copy_from_slice(d);
            }
            let o = (s - ns) as usize;
            merged[o..o + data.len()].copy_from_slice(data);
            self.runs.splice(first..last, [(ns, merged)]);
        }
        (u64::from(ne - ns) + RUN_COST) as i64 - before as i64
    }

    fn cost_of(&self, r: Range<usize>) -> u64 {
        self.runs[r].iter().map(|(_, d)| d.len() as u64 + RUN_COST).sum()
    }

    /// Forgets the dirty bytes of `[at, at+len)` (they were superseded below: a trim, a
    /// zero, a write that went straight through; or written back); returns how much its
    /// [`Self::cost`] fell: less than 0 when a few bytes out of a run's middle split it in two.
    pub fn discard(&mut self, at: u32, len: u32) -> i64 {
        let (s, e) = (at, at + len);
        let first = self.runs.partition_point(|(rs, d)| rs + (d.len() as u32) <= s);
        let last = self.runs.partition_point(|(rs, _)| *rs < e);
        if first >= last {
            return 0;
        }
        let before = self.cost_of(first..last);
        let mut keep = Vec::new();
        for (rs, d) in self.runs.drain(first..last) {
            let re = rs + d.len() as u32;
            if rs < s {
                keep.push((rs, d[..(s - rs) as usize].to_vec()));
            }
            if re > e {
                keep.push((e, d[(e - rs) as usize..].to_vec()));
            }
        }
        let after: u64 = keep.iter().map(|(_, d)| d.len() as u64 + RUN_COST).sum();
        self.runs.splice(first..first, keep);
        before as i64 - after as i64
    }

    /// Copies the dirty bytes that fall in `[at, at+buf.len())` over `buf`.
    pub fn overlay(&self, buf: &mut [u8], at: u32) {
        let end = at + buf.len() as u32;
        for (rs, d) in &self.runs {
            let re = rs + d.len() as u32;
            if re <= at {
                continue;
            }
            if *rs >= end {
                break;
            }
            let (s, e) = ((*rs).max(at), re.min(end));
            buf[(s - at) as usize..(e - at) as usize]
                .copy_from_slice(&d[(s - rs) as usize..(e - rs) as usize]);
        }
    }

    /// True when every byte of `[at, at+len)` is dirty (a read needs nothing from below).
    pub fn covers(&self, at: u32, len: u32) -> bool {
        // Runs never touch, so one run must hold it all.
        let i = self.runs.partition_point(|(rs, d)| rs + (d.len() as u32) <= at);
        self.runs.get(i).is_some_and(|(rs, d)| *rs <= at && rs + d.len() as u32 >= at + len)
    }
}

/// One request of a write-back: `range` of the block, written as one request. With `fill`,
/// it spans gaps between dirty runs that must first be read from below.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub range: Range<u32>,
    pub fill: bool,
}

/// How to write back dirty `ranges` (sorted, disjoint) given the filesystem's allocation
/// `unit` and the block's length `limit`: neighbouring ranges become one request when every
/// allocation unit of the gap between them holds dirty bytes (in practice: a gap shorter than
/// a unit, as with 1 KiB written every 4 KiB). The gap is then read from below (or known to
/// read as zeroes) and written back unchanged.
///
/// Over a hole, filling a gap in a unit nobody wrote would allocate space for zeroes nobody
/// wrote (and can fail with ENOSPC); inside a unit that holds dirty bytes it changes neither a
/// byte nor the allocation, as the filesystem allocates that unit whole when the dirty bytes
/// land. Over data, the exact ranges' writes would read their partial units anyway (the page
/// cache fills a page before a partial write), so the gap read costs nothing more; a unit
/// nobody wrote would be read only to be written back unchanged. That read is a synchronous
/// device round trip in the FLUSH's path, which made FLUSHes slower than writing the ranges
/// separately (docs/benchmarks/runs/code-notes.md#plan). Whether a gap is a hole or data
/// does not matter to the plan, so no extent lookup is made for it. A filled run is also widened to whole units (the edge
/// units hold dirty bytes, so the same argument holds): an aligned write spares the kernel a
/// read of a partial page.
pub fn plan(ranges: &[Range<u32>], unit: u32, limit: u32) -> Vec<Run> {
    debug_assert!(unit > 0);
    // Is unit `u` touched by a dirty range?
    let touched = |u: u32| {
        let (s, e) = (u * unit, u * unit + unit);
        let i = ranges.partition_point(|r| r.end <= s);
        ranges.get(i).is_some_and(|r| r.start < e)
    };
    // Ranges never touch, so a gap is never empty.
    let fillable = |gap: Range<u32>| (gap.start / unit..=(gap.end - 1) / unit).all(touched);
    let mut runs: Vec<Run> = Vec::new();
    for r in ranges {
        if let Some(last) = runs.last_mut() {
            if fillable(last.range.end..r.start) {
                last.range.end = r.end;
                last.fill = true;
                continue;
            }
        }
        runs.push(Run { range: r.clone(), fill: false });
    }
    for run in runs.iter_mut().filter(|r| r.fill) {
        run.range.start = run.range.start / unit * unit;
        run.range.end = run.range.end.div_ceil(unit).saturating_mul(unit).min(limit);
    }
    runs
}

/// The extents of the layer below, starting at `offset`, with the `dirty` ranges (absolute,
/// sorted, disjoint) marked as data: the layer below does not know about bytes not yet
/// written back, and a client that skips holes would skip them.
pub fn mark_data(below: &[Extent], offset: u64, dirty: &[Range<u64>]) -> Vec<Extent> {
    let mut out: Vec<Extent> = Vec::with_capacity(below.len());
    let mut push = |e: Extent| match out.last_mut() {
        Some(l) if l.hole == e.hole && l.zero == e.zero => l.len += e.len,
        _ => out.push(e),
    };
    let mut at = offset;
    let mut d = dirty.iter().peekable();
    for e in below {
        let end = at + e.len;
        let mut pos = at;
        while pos < end {
            // Skip dirty ranges entirely before pos.
            while d.peek().is_some_and(|r| r.end <= pos) {
                d.next();
            }
            match d.peek() {
                Some(r) if r.start <= pos => {
                    let n = r.end.min(end) - pos;
                    push(Extent::data(n));
                    pos += n;
                }
                Some(r) if r.start < end => {
                    push(Extent { len: r.start - pos, ..*e });
                    pos = r.start;
                }
                _ => {
                    push(Extent { len: end - pos, ..*e });
                    pos = end;
                }
            }
        }
        at = end;
    }
    out
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one-range lists are lists here
mod tests {
    use super::*;
    use crate::testing::conformance::Rng;

    fn ranges(b: &Block) -> Vec<Range<u32>> {
        b.ranges().collect()
    }

    #[test]
    fn touching_writes_merge_and_gaps_stay() {
        let mut b = Block::new(Instant::now());
        let run = RUN_COST as i64;
        assert_eq!(b.write(0, &[1; 1024]), 1024 + run);
        assert_eq!(b.write(4096, &[2; 1024]), 1024 + run);
        assert_eq!(ranges(&b), [0..1024, 4096..5120]);
        // Touching on both sides: one run, one run's cost less.
        assert_eq!(b.write(1024, &[3; 3072]), 3072 - run);
        assert_eq!(ranges(&b), [0..5120]);
        // An overwrite holds no more bytes.
        assert_eq!(b.write(100, &[4; 10]), 0);
        assert_eq!(b.bytes(), 5120);
        assert_eq!(b.cost(), 5120 + RUN_COST);
        // A byte between two runs one byte apart joins them.
        let mut j = Block::new(Instant::now());
        j.write(0, &[1]);
        j.write(2, &[1]);
        assert_eq!(j.write(1, &[1]), 1 - run);
        let mut buf = [0u8; 8];
        b.overlay(&mut buf, 98);
        assert_eq!(buf, [1, 1, 4, 4, 4, 4, 4, 4]);
    }

    #[test]
    fn discard_splits_runs() {
        let mut b = Block::new(Instant::now());
        b.write(0, &[1; 100]);
        b.write(200, &[2; 100]);
        let run = RUN_COST as i64;
        assert_eq!(b.discard(50, 200), 100);
        assert_eq!(ranges(&b), [0..50, 250..300]);
        // Out of the middle: two runs where there was one.
        assert_eq!(b.discard(10, 20), 20 - run);
        assert_eq!(b.discard(0, 1000), 80 + 3 * run);
        assert!(b.is_empty());
        assert_eq!(b.cost(), 0);
    }

    #[test]
    fn covers_needs_one_run() {
        let mut b = Block::new(Instant::now());
        b.write(10, &[1; 10]);
        b.write(30, &[1; 10]);
        assert!(b.covers(10, 10) && b.covers(12, 3) && !b.covers(15, 20) && !b.covers(0, 5));
    }

    /// Random writes and discards against a byte model of one block.
    #[test]
    fn matches_a_byte_model() {
        const N: usize = 8192;
        for seed in 1..20 {
            let mut rng = Rng::new(seed);
            let mut b = Block::new(Instant::now());
            let mut model: Vec<Option<u8>> = vec![None; N];
            for step in 0..300 {
                let at = rng.below(N as u64) as usize;
                let len = 1 + rng.below((N - at).min(700) as u64) as usize;
                if rng.below(4) == 0 {
                    let before = b.cost() as i64;
                    let dropped = b.discard(at as u32, len as u32);
                    model[at..at + len].fill(None);
                    assert_eq!(before - dropped, b.cost() as i64);
                } else {
                    let mut data = vec![0u8; len];
                    rng.fill(&mut data);
                    let before = b.cost() as i64;
                    let added = b.write(at as u32, &data);
                    assert_eq!(before + added, b.cost() as i64);
                    assert!(added <= (len as u64 + RUN_COST) as i64);
                    for (i, x) in data.iter().enumerate() {
                        model[at + i] = Some(*x);
                    }
                }
                assert_eq!(
                    b.bytes(),
                    model.iter().filter(|x| x.is_some()).count() as u64,
                    "seed {seed} {step}"
                );
                let rs = ranges(&b);
                for w in rs.windows(2) {
                    assert!(w[0].end < w[1].start, "runs touch: {rs:?}");
                }
                let mut buf = vec![0xaau8; N];
                b.overlay(&mut buf, 0);
                for i in 0..N {
                    if let Some(x) = model[i] {
                        assert_eq!(buf[i], x, "seed {seed} step {step} byte {i}");
                    } else {
                        assert_eq!(buf[i], 0xaa, "seed {seed} step {step} byte {i} not dirty");
                    }
                }
            }
        }
    }

    #[test]
    fn plan_fills_gaps_only_inside_written_units() {
        // 1 KiB every 4 KiB: every gap lies in a unit that holds dirty bytes. One request,
        // widened to whole 4 KiB units ...
        let r = [0..1024, 5120..6144, 9216..10240, 13312..14336];
        assert_eq!(plan(&r, 4096, 65536), [Run { range: 0..16384, fill: true }]);
        // ... but never past the block's end.
        assert_eq!(plan(&r, 4096, 15000), [Run { range: 0..15000, fill: true }]);
        // A gap that spans units nobody wrote (4096..12288) is not filled, hole or data.
        let r2 = [0..1024, 13312..14336];
        assert_eq!(
            plan(&r2, 4096, 65536),
            [Run { range: 0..1024, fill: false }, Run { range: 13312..14336, fill: false }]
        );
        // One untouched unit is enough to split: 4 KiB written every 8 KiB.
        let r3 = [0..4096, 8192..12288, 16384..20480];
        assert_eq!(
            plan(&r3, 4096, 65536),
            [
                Run { range: 0..4096, fill: false },
                Run { range: 8192..12288, fill: false },
                Run { range: 16384..20480, fill: false }
            ]
        );
        // A gap across a unit boundary, both units touched: filled.
        let r4 = [0..3000, 5000..6000];
        assert_eq!(plan(&r4, 4096, 65536), [Run { range: 0..8192, fill: true }]);
        // Mixed: the first two join, the third stands alone.
        let r5 = [0..1024, 2048..3072, 40960..41984];
        assert_eq!(
            plan(&r5, 4096, 65536),
            [Run { range: 0..4096, fill: true }, Run { range: 40960..41984, fill: false }]
        );
        // One range: written as it is.
        assert_eq!(plan(&r[..1], 4096, 65536), [Run { range: 0..1024, fill: false }]);
    }

    #[test]
    fn dirty_ranges_are_data_in_extents() {
        let below = [Extent::hole(100), Extent::data(100), Extent::hole(100)];
        let got = mark_data(&below, 1000, &[1010..1020, 1090..1110, 1250..1400]);
        assert_eq!(
            got,
            [
                Extent::hole(10),
                Extent::data(10),
                Extent::hole(70),
                Extent::data(110),
                Extent::hole(50),
                Extent::data(50)
            ]
        );
        assert_eq!(got.iter().map(|e| e.len).sum::<u64>(), 300);
        // Nothing dirty: unchanged.
        assert_eq!(mark_data(&below, 1000, &[]), below);
    }
}
