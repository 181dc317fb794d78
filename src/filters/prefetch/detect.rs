//! Finding sequential streams among an export's reads.
//!
//! A bounded history of recent reads, shared by all connections of an export (under
//! multi-conn one stream may arrive over several), ordered by offset for lookup and evicted
//! first-in first-out. A read *continues* a recent read when it starts after that read's start
//! and no further than `slack` past its end: exactly at the end for a client reading in order,
//! a little past it when requests in flight are answered out of order (queue depth > 1), or
//! inside it when a later request overtook an earlier one. Continuations form chains; a chain
//! whose frontier (the furthest byte read) has advanced `links` times, has come at least
//! `min_run` bytes from where the chain began, and has read most of the bytes in between
//! (`min_dense` per cent), is a stream, and stays one while it continues. The byte bound is
//! what keeps short runs among random reads from being taken for streams: with 4 KiB reads of
//! which 30 % continue the previous one, three links happen every few dozen reads, and each
//! false stream costs two 256 KiB chunks of read-ahead (a 2 s benchmark run wasted ~1 GiB that
//! way); sixteen 4 KiB links in a row practically never happen by chance. The density bound
//! keeps a guest's scattered reads from being taken for streams: a file system's metadata, or
//! small files a few hundred KiB apart, continue each other within the slack, but read-ahead
//! over them would mostly fetch the gaps.
//!
//! What it does not do, on purpose: descending reads never continue anything (prefetching
//! ahead of a reader going backwards would only waste reads), and an isolated random read
//! starts a chain of one that ages out with the history. A stream that restarts elsewhere (a
//! second pass from offset 0) is a new chain; the old one ages out.
//!
//! The history is small (64 reads by default), so lookups stay cheap, and one interleaved
//! stream needs only its last read in it to be followed. Each chain keeps only its last
//! [`PER_CHAIN`] reads there: a fast stream (served from the prefetch buffer) would otherwise
//! push a slower one's reads out and have it forgotten and found again and again (61 streams
//! "found" for 4 fio readers before this cap).

use std::collections::{BTreeMap, HashMap, VecDeque};

/// Tuning of stream detection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DetectConfig {
    /// Recent reads remembered (the history bound).
    pub history: usize,
    /// Frontier advances that make a chain a stream...
    pub links: u32,
    /// ...together with this many bytes between the chain's first read and its frontier.
    pub min_run: u64,
    /// How far past a read's end the next one may start and still continue it: the larger of
    /// this and `slack_reads` times the new read's length.
    pub slack_min: u64,
    pub slack_reads: u64,
    /// Per cent of the bytes between a chain's start and its frontier that its reads must
    /// have covered for it to be a stream.
    pub min_dense: u64,
}

impl Default for DetectConfig {
    fn default() -> Self {
        DetectConfig {
            history: 64,
            links: 3,
            min_run: 64 << 10,
            slack_min: 64 << 10,
            slack_reads: 8,
            min_dense: 75,
        }
    }
}

/// A chain of reads; a stream once it has enough links.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChainId(pub u64);

/// What one read turned out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observation {
    pub chain: ChainId,
    /// The chain is a stream: prefetching past `frontier` is worthwhile.
    pub stream: bool,
    /// The furthest byte the chain has read (exclusive end).
    pub frontier: u64,
    /// Bytes the chain's reads have covered: what it has consumed so far.
    pub covered: u64,
    /// This read made the chain a stream.
    pub became_stream: bool,
}

#[derive(Debug, Clone, Copy)]
struct Recent {
    end: u64,
    chain: u64,
}

#[derive(Debug, Clone)]
struct Chain {
    links: u32,
    /// Where its first read started.
    start: u64,
    frontier: u64,
    /// Bytes its reads covered, counted once per read and capped at `frontier - start`.
    covered: u64,
    /// It met the bounds once: a stream stays one while it continues (a reader that skips
    /// a gap later, as tar does between files, keeps its read-ahead).
    stream: bool,
    /// Its reads still in the history, oldest first; when none are left the chain is
    /// forgotten.
    members: VecDeque<(u64, u64)>,
}

impl Chain {
    fn is_stream(&self, cfg: &DetectConfig) -> bool {
        let run = self.frontier - self.start;
        self.stream
            || (self.links >= cfg.links && run >= cfg.min_run && self.covered * 100 >= run * cfg.min_dense)
    }
}

/// Reads of one chain kept in the history: enough to find predecessors under reordering.
pub const PER_CHAIN: usize = 8;

/// The per-export detector. Callers serialise access (one lock per export).
#[derive(Debug)]
pub struct Detector {
    cfg: DetectConfig,
    /// Recent reads by (start, sequence number).
    by_offset: BTreeMap<(u64, u64), Recent>,
    /// The same keys in arrival order, for eviction (may also hold keys already evicted as
    /// a chain's oldest; they are skipped).
    order: VecDeque<(u64, u64)>,
    chains: HashMap<u64, Chain>,
    seq: u64,
    next_chain: u64,
    streams_found: u64,
}

/// Candidates below a read's offset that are looked at: reordering within a queue depth of a
/// few requests puts the predecessor among the nearest ones.
const CANDIDATES: usize = 8;

impl Detector {
    pub fn new(cfg: DetectConfig) -> Detector {
        assert!(cfg.history > 0 && cfg.links > 0);
        Detector {
            cfg,
            by_offset: BTreeMap::new(),
            order: VecDeque::new(),
            chains: HashMap::new(),
            seq: 0,
            next_chain: 0,
            streams_found: 0,
        }
    }

    /// Records a read of `[offset, offset+len)` and says which chain it belongs to.
    pub fn observe(&mut self, offset: u64, len: u64) -> Observation {
        debug_assert!(len > 0);
        self.seq += 1;
        let end = offset.saturating_add(len);
        let slack = self.cfg.slack_min.max(len.saturating_mul(self.cfg.slack_reads));
        let predecessor = self
            .by_offset
            .range(..(offset, 0))
            .rev()
            .take(CANDIDATES)
            .find(|(_, r)| offset <= r.end.saturating_add(slack))
            .map(|(_, r)| r.chain);

        let (id, became_stream) = match predecessor {
            Some(id) => {
                let cfg = self.cfg;
                let c = self.chains.get_mut(&id).expect("recent reads name live chains");
                let was_stream = c.is_stream(&cfg);
                // A request that overtook the chain's first one moves its start back.
                c.start = c.start.min(offset);
                if end > c.frontier {
                    c.frontier = end;
                    c.links = c.links.saturating_add(1);
                }
                c.covered = (c.covered + len).min(c.frontier - c.start);
                c.stream = c.is_stream(&cfg);
                (id, !was_stream && c.stream)
            }
            None => {
                let id = self.next_chain;
                self.next_chain += 1;
                let mut c = Chain {
                    links: 1,
                    start: offset,
                    frontier: end,
                    covered: len,
                    stream: false,
                    members: VecDeque::new(),
                };
                c.stream = c.is_stream(&self.cfg);
                let stream = c.stream;
                self.chains.insert(id, c);
                (id, stream)
            }
        };
        if became_stream {
            self.streams_found += 1;
        }
        let key = (offset, self.seq);
        self.by_offset.insert(key, Recent { end, chain: id });
        self.order.push_back(key);
        let c = self.chains.get_mut(&id).expect("just found or made");
        c.members.push_back(key);
        if c.members.len() > PER_CHAIN {
            let old = c.members.pop_front().unwrap();
            self.by_offset.remove(&old);
        }
        while self.by_offset.len() > self.cfg.history {
            self.evict_oldest();
        }
        if self.order.len() > 4 * self.cfg.history {
            let live = &self.by_offset;
            self.order.retain(|k| live.contains_key(k));
        }
        let c = &self.chains[&id];
        Observation {
            chain: ChainId(id),
            stream: c.stream,
            frontier: c.frontier,
            covered: c.covered,
            became_stream,
        }
    }

    /// Drops the oldest read still in the history (and its chain, if it was the last).
    fn evict_oldest(&mut self) {
        while let Some(key) = self.order.pop_front() {
            let Some(r) = self.by_offset.remove(&key) else { continue };
            if let Some(c) = self.chains.get_mut(&r.chain) {
                c.members.retain(|k| *k != key);
                if c.members.is_empty() {
                    self.chains.remove(&r.chain);
                }
            }
            return;
        }
    }

    /// The furthest byte chain `id` has read to, while it is followed.
    pub fn frontier(&self, id: ChainId) -> Option<u64> {
        self.chains.get(&id.0).map(|c| c.frontier)
    }

    /// Is `id` still followed (some of its reads are in the history)?
    pub fn is_live(&self, id: ChainId) -> bool {
        self.chains.contains_key(&id.0)
    }

    /// Chains currently followed (bounded by the history).
    pub fn chains(&self) -> usize {
        self.chains.len()
    }

    /// Streams recognised so far (for `--stats`).
    pub fn streams_found(&self) -> u64 {
        self.streams_found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::conformance::Rng;

    const K4: u64 = 4096;

    fn detector() -> Detector {
        Detector::new(DetectConfig::default())
    }

    #[test]
    fn a_stream_takes_three_links_and_64_kib() {
        // 4 KiB reads: the 16th reaches 64 KiB.
        let mut d = detector();
        let v: Vec<Observation> = (0..20).map(|i| d.observe(i * K4, K4)).collect();
        assert!(v[..15].iter().all(|x| !x.stream), "{v:?}");
        assert!(v[15].stream && v[15].became_stream);
        assert!(v[16..].iter().all(|x| x.stream && !x.became_stream && x.chain == v[0].chain));
        assert_eq!(v[19].frontier, 20 * K4);
        assert_eq!(d.streams_found(), 1);
        // 64 KiB reads: the third.
        let mut d = detector();
        let v: Vec<Observation> = (0..3).map(|i| d.observe(i << 16, 1 << 16)).collect();
        assert!(!v[0].stream && !v[1].stream && v[2].became_stream);
    }

    #[test]
    fn short_runs_among_random_reads_are_not_streams() {
        // 70 % random 4 KiB reads, 30 % continuing the previous read (fio's
        // percentage_random=70), from four readers at once.
        let found = |cfg: DetectConfig| {
            let mut d = Detector::new(cfg);
            let mut rng = Rng::new(11);
            let mut at = [0u64; 4];
            for i in 0..40_000 {
                let r = i % 4;
                at[r] = if rng.below(10) < 3 { at[r] + K4 } else { rng.below((4u64 << 30) / K4) * K4 };
                d.observe(at[r], K4);
            }
            d.streams_found()
        };
        // Links alone: hundreds of false streams. With the byte bound, a handful at most (a
        // random read landing within the slack of a recent one, then a continuation).
        let links_only = found(DetectConfig { min_run: 0, ..DetectConfig::default() });
        assert!(links_only > 500, "{links_only}");
        let n = found(DetectConfig::default());
        assert!(n <= 8, "{n} false streams in 40000 reads");
    }

    #[test]
    fn interleaved_streams_are_told_apart() {
        let mut d = detector();
        let bases = [100 * K4, 300 * K4, 700 * K4];
        let mut last = Vec::new();
        for i in 0..20 {
            for b in bases {
                last.push(d.observe(b + i * K4, K4));
            }
        }
        let tail = &last[last.len() - 3..];
        assert!(tail.iter().all(|v| v.stream));
        assert_ne!(tail[0].chain, tail[1].chain);
        assert_ne!(tail[1].chain, tail[2].chain);
        assert_eq!(tail[2].frontier, 700 * K4 + 20 * K4);
        assert_eq!(d.streams_found(), 3);
    }

    #[test]
    fn reordered_requests_still_form_a_stream() {
        // Queue depth 4: each group of four blocks arrives in reverse.
        let mut d = detector();
        let mut verdicts = Vec::new();
        for group in 0..8u64 {
            for j in (0..4u64).rev() {
                verdicts.push(d.observe((group * 4 + j) * K4, K4));
            }
        }
        let first = verdicts[0].chain;
        // The fifth group's first read takes the frontier to 80 KiB.
        assert!(verdicts[16..].iter().all(|v| v.stream && v.chain == first), "{verdicts:?}");
        assert_eq!(verdicts.last().unwrap().frontier, 32 * K4);
        assert_eq!(d.streams_found(), 1);
    }

    #[test]
    fn reading_backwards_is_not_a_stream() {
        let mut d = detector();
        for i in (0..200u64).rev() {
            assert!(!d.observe(1000 * K4 + i * K4, K4).stream, "block {i}");
        }
        assert_eq!(d.streams_found(), 0);
    }

    #[test]
    fn random_reads_never_make_a_stream() {
        let mut d = detector();
        let mut rng = Rng::new(5);
        for _ in 0..20_000 {
            let block = rng.below((4u64 << 30) / K4);
            assert!(!d.observe(block * K4, K4).stream);
        }
        assert_eq!(d.streams_found(), 0);
        assert!(d.chains() <= DetectConfig::default().history);
    }

    #[test]
    fn a_stream_among_random_noise_is_found() {
        let mut d = detector();
        let mut rng = Rng::new(6);
        let mut found = false;
        for i in 0..40u64 {
            for _ in 0..3 {
                d.observe(rng.below(1 << 20) * K4 + (8 << 30), K4);
            }
            found |= d.observe((1 << 20) + i * K4, K4).stream;
        }
        assert!(found);
        assert_eq!(d.streams_found(), 1);
    }

    #[test]
    fn a_restart_is_a_new_stream_and_the_old_one_ages_out() {
        let mut d = detector();
        let first: Vec<_> = (0..100u64).map(|i| d.observe(i * K4, K4)).collect();
        let old = first[0].chain;
        let again: Vec<_> = (0..100u64).map(|i| d.observe(i * K4, K4)).collect();
        assert_ne!(again[0].chain, old, "a restart at 0 does not continue the old frontier");
        assert!(again[15].stream && again[15].became_stream);
        assert_eq!(d.streams_found(), 2);
        // The old chain is quiet: once a history's worth of other reads came, it is gone.
        assert!(d.is_live(old));
        let mut rng = Rng::new(8);
        for _ in 0..DetectConfig::default().history {
            d.observe((1 << 32) + rng.below(1 << 20) * (1 << 20), K4);
        }
        assert!(!d.is_live(old), "the old chain's reads left the history");
        assert!(d.chains() <= DetectConfig::default().history);
    }

    #[test]
    fn a_fast_stream_does_not_push_a_slow_one_out() {
        // Stream A reads 100 blocks for every block stream B reads (more than the history).
        let mut d = detector();
        let (mut a, mut b) = (0u64, 1 << 30);
        for _ in 0..40 {
            for _ in 0..100 {
                d.observe(a, K4);
                a += K4;
            }
            d.observe(b, K4);
            b += K4;
        }
        assert_eq!(d.streams_found(), 2);
        assert!(d.chains() <= 2);
    }

    #[test]
    fn larger_reads_get_proportionally_more_slack() {
        // 1 MiB reads with a 256 KiB gap (a reader skipping a hole) still continue, and are
        // dense enough for a stream.
        let mut d = detector();
        let v: Vec<_> = (0..4u64).map(|i| d.observe(i * (5 << 18), 1 << 20)).collect();
        assert!(v[3].stream && v[3].chain == v[0].chain);
        assert_eq!(d.chains[&v[3].chain.0].covered, 4 << 20);
        // With 2 MiB gaps they continue one chain but read a third of it: no stream.
        let mut d = detector();
        let v: Vec<_> = (0..8u64).map(|i| d.observe(i * (3 << 20), 1 << 20)).collect();
        assert!(v.iter().all(|o| o.chain == v[0].chain && !o.stream), "{v:?}");
        // 4 KiB reads 1 MiB apart are separate.
        let mut d = detector();
        assert!((0..10u64).all(|i| !d.observe(i * (1 << 20), K4).stream));
    }

    #[test]
    fn scattered_reads_within_the_slack_are_not_a_stream() {
        // A guest's metadata walk: 4 KiB reads 16-48 KiB apart, ascending. They continue each
        // other (within the 64 KiB slack) but cover a sixth of the range.
        let found = |cfg: DetectConfig| {
            let mut d = Detector::new(cfg);
            let (mut at, mut rng) = (0, Rng::new(3));
            for _ in 0..200 {
                d.observe(at, K4);
                at += (4 + rng.below(9)) * K4;
            }
            d.streams_found()
        };
        assert_eq!(
            found(DetectConfig { min_dense: 0, ..DetectConfig::default() }),
            1,
            "links and bytes alone"
        );
        assert_eq!(found(DetectConfig::default()), 0);
    }
}
