//! `--stats`: per-command request counts, bytes, errors and latency percentiles, with what the
//! export's backend tells of itself (page cache, requests to object storage).
//!
//! Latencies go into a log-linear histogram (8 buckets per power of two of microseconds), so
//! recording is a few atomic adds and percentiles are accurate to within 12.5 %.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::proto::*;

const SUB: usize = 8;
const BUCKETS: usize = 40 * SUB;

/// The commands counted, in display order.
pub const COMMANDS: [(u16, &str); 7] = [
    (CMD_READ, "read"),
    (CMD_WRITE, "write"),
    (CMD_FLUSH, "flush"),
    (CMD_TRIM, "trim"),
    (CMD_WRITE_ZEROES, "zero"),
    (CMD_CACHE, "cache"),
    (CMD_BLOCK_STATUS, "block-status"),
];

/// The name of command `cmd` as `--stats` prints it.
pub fn command_name(cmd: u16) -> &'static str {
    COMMANDS.iter().find(|(c, _)| *c == cmd).map_or("a request", |(_, n)| n)
}

struct PerCommand {
    count: AtomicU64,
    errors: AtomicU64,
    bytes: AtomicU64,
    hist: Vec<AtomicU64>,
}

pub struct Stats {
    start: Instant,
    commands: Vec<PerCommand>,
    pub connections: AtomicU64,
    /// READ requests served by a backend read merged with the request before them.
    pub reads_merged: AtomicU64,
}

impl Default for Stats {
    fn default() -> Stats {
        Stats {
            start: Instant::now(),
            commands: COMMANDS
                .iter()
                .map(|_| PerCommand {
                    count: AtomicU64::new(0),
                    errors: AtomicU64::new(0),
                    bytes: AtomicU64::new(0),
                    hist: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
                })
                .collect(),
            connections: AtomicU64::new(0),
            reads_merged: AtomicU64::new(0),
        }
    }
}

fn bucket(us: u64) -> usize {
    if us < SUB as u64 {
        return us as usize;
    }
    let octave = 63 - us.leading_zeros() as usize; // ≥ 3
    let frac = ((us >> (octave - 3)) & (SUB as u64 - 1)) as usize;
    ((octave - 2) * SUB + frac).min(BUCKETS - 1)
}

/// The upper bound, in µs, of a bucket.
fn bucket_upper(b: usize) -> u64 {
    if b < SUB {
        return b as u64 + 1;
    }
    let octave = b / SUB + 2;
    let frac = (b % SUB) as u64;
    ((SUB as u64 + frac + 1) << (octave - 3)).max(1)
}

impl Stats {
    pub fn record(&self, cmd: u16, bytes: u64, latency: Duration, ok: bool) {
        let Some(i) = COMMANDS.iter().position(|(c, _)| *c == cmd) else { return };
        let c = &self.commands[i];
        c.count.fetch_add(1, Ordering::Relaxed);
        if ok {
            c.bytes.fetch_add(bytes, Ordering::Relaxed);
        } else {
            c.errors.fetch_add(1, Ordering::Relaxed);
        }
        c.hist[bucket(latency.as_micros() as u64)].fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> Snapshot {
        let commands = COMMANDS
            .iter()
            .zip(&self.commands)
            .map(|((_, name), c)| {
                let hist: Vec<u64> = c.hist.iter().map(|h| h.load(Ordering::Relaxed)).collect();
                let total: u64 = hist.iter().sum();
                let pct = |p: f64| -> u64 {
                    let want = ((total as f64) * p).ceil().max(1.0) as u64;
                    let mut seen = 0;
                    for (b, n) in hist.iter().enumerate() {
                        seen += n;
                        if seen >= want {
                            return bucket_upper(b);
                        }
                    }
                    0
                };
                CommandSnapshot {
                    command: name,
                    requests: c.count.load(Ordering::Relaxed),
                    errors: c.errors.load(Ordering::Relaxed),
                    bytes: c.bytes.load(Ordering::Relaxed),
                    p50_us: if total > 0 { pct(0.5) } else { 0 },
                    p90_us: if total > 0 { pct(0.9) } else { 0 },
                    p99_us: if total > 0 { pct(0.99) } else { 0 },
                }
            })
            .collect();
        Snapshot {
            seconds: self.start.elapsed().as_secs_f64(),
            connections: self.connections.load(Ordering::Relaxed),
            reads_merged: self.reads_merged.load(Ordering::Relaxed),
            commands,
            cache: None,
            requests: None,
        }
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct CommandSnapshot {
    pub command: &'static str,
    pub requests: u64,
    pub errors: u64,
    pub bytes: u64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Snapshot {
    pub seconds: f64,
    /// Connections accepted so far.
    pub connections: u64,
    /// READ requests whose bytes came with the previous request's backend read.
    pub reads_merged: u64,
    pub commands: Vec<CommandSnapshot>,
    /// Bytes of the export in the page cache, where visible.
    pub cache: Option<u64>,
    /// Requests the export's backend made to object storage (`s3://`).
    #[serde(rename = "s3", skip_serializing_if = "Option::is_none")]
    pub requests: Option<crate::backend::s3::Requests>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_ordered_and_tight() {
        let mut last = 0;
        for us in [0u64, 1, 7, 8, 9, 15, 16, 100, 1000, 123_456, 10_000_000] {
            let b = bucket(us);
            assert!(b >= last);
            last = b;
            let up = bucket_upper(b);
            assert!(up > us && (up as f64) <= (us.max(1) as f64) * 1.125 + 1.0, "{us} -> {up}");
        }
    }

    #[test]
    fn percentiles() {
        let s = Stats::default();
        for i in 0..100 {
            s.record(CMD_READ, 4096, Duration::from_micros(if i < 90 { 10 } else { 1000 }), true);
        }
        s.record(CMD_WRITE, 4096, Duration::from_micros(5), false);
        let snap = s.snapshot();
        let r = &snap.commands[0];
        assert_eq!((r.requests, r.bytes, r.errors), (100, 409_600, 0));
        assert!(r.p50_us >= 10 && r.p50_us <= 12, "{r:?}");
        assert!(r.p99_us >= 1000 && r.p99_us <= 1125, "{r:?}");
        assert_eq!(snap.commands[1].errors, 1);
    }
}
