//! What `copy` shows while it runs:
//!
//! - `--progress`: a bar on a terminal, with the page cache the job holds and has evicted.
//! - `--progress=FD`: lines `N/100` on a descriptor the caller handed down, in the format
//!   nbdcopy writes there (virt-v2v, KubeVirt's importer and migratekit parse it): `0/100`
//!   first, then each whole percent as it is reached (never going back, at most `99/100`
//!   while the copy runs), and `100/100` once the copy has succeeded. Where SRC's size is not
//!   known in advance (a pipe), only `0/100` and `100/100`.
//! - `--footprint=FD`: JSON lines on a descriptor: the page cache of SRC and DST now and
//!   before the job, what the job holds and what it has evicted ([`Footprint`]), every
//!   500 ms and once more at the end.
//!
//! A descriptor that is closed, or whose reader goes away, never fails the copy: its lines
//! stop.

use std::fs::File;
use std::io::Write;
use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lightfoot::copy::{Endpoint, Progress};
use lightfoot::io::{footprint, residency, sys};

use super::human;

/// How often the bar and the progress lines look at the copy.
const TICK: Duration = Duration::from_millis(100);
/// Footprint lines every this many ticks.
const FOOTPRINT_TICKS: u32 = 5;

/// Lines on a descriptor the caller handed down, through a close-on-exec copy of it.
pub struct FdOut {
    out: File,
    option: &'static str,
    broken: bool,
}

impl FdOut {
    /// Takes `fd` over for `option` (`--progress`, `--footprint`): done before SRC and DST
    /// are opened, so the number cannot name one of lightfoot's own files, and a captive
    /// server does not inherit it. `Ok(None)` (after a warning) when it is not open; an error
    /// when the lines would go into the copy's data.
    pub fn open(option: &'static str, fd: RawFd, data_on_stdout: bool) -> Result<Option<FdOut>, String> {
        if fd == 1 && data_on_stdout {
            return Err(format!(
                "{option}=1: standard output carries the copy's data (DST is -); give another \
                 descriptor, e.g. {option}=2"
            ));
        }
        match sys::dup_inherited(fd) {
            Ok(own) => Ok(Some(FdOut { out: own.into(), option, broken: false })),
            Err(e) => {
                let e = lightfoot::error::io_message(&e);
                tracing::warn!(
                    "{option}={fd}: descriptor {fd} cannot be used ({e}): nothing is written to it"
                );
                Ok(None)
            }
        }
    }

    fn line(&mut self, text: &str) {
        if self.broken {
            return;
        }
        if let Err(e) = self.out.write_all(format!("{text}\n").as_bytes()) {
            let e = lightfoot::error::io_message(&e);
            tracing::warn!("{}: writing failed ({e}): no more is written", self.option);
            self.broken = true;
        }
    }
}

/// The `N/100` lines.
struct Percent {
    out: FdOut,
    last: Option<u32>,
}

impl Percent {
    /// Writes `pct/100` if it is above the last line written.
    fn put(&mut self, pct: u32) {
        if self.last.is_none_or(|l| pct > l) {
            self.last = Some(pct);
            self.out.line(&format!("{pct}/100"));
        }
    }
}

/// SRC or DST where it is a file or block device: a descriptor of the reporter's own, to
/// measure its page cache, and what it held before the job.
struct Side {
    file: File,
    path: PathBuf,
    before: u64,
}

impl Side {
    fn open(ep: &Endpoint, before: Option<u64>) -> Option<Side> {
        let Endpoint::Path(p) = ep else { return None };
        let file = residency::open(p).ok()?;
        Some(Side { file, path: p.clone(), before: before.unwrap_or(0) })
    }

    fn cached(&self) -> Option<u64> {
        residency::measure(&self.file, &self.path, 0, None).ok().map(|r| r.cached_bytes())
    }
}

/// The page cache of the job's files: SRC and DST now and before, what the job holds (above
/// what each held before) and what it has evicted so far (`io::footprint`).
pub struct Footprint {
    src: Option<Side>,
    dst: Option<Side>,
    out: Option<FdOut>,
    started: Instant,
}

struct Sample {
    src: Option<u64>,
    dst: Option<u64>,
    held: u64,
    evicted: u64,
}

impl Footprint {
    /// After SRC and DST are opened, with what they held before (`None`: DST is new).
    pub fn new(
        src: (&Endpoint, Option<u64>),
        dst: (&Endpoint, Option<u64>),
        out: Option<FdOut>,
        started: Instant,
    ) -> Footprint {
        footprint::enable();
        Footprint { src: Side::open(src.0, src.1), dst: Side::open(dst.0, dst.1), out, started }
    }

    fn sample(&self) -> Sample {
        let src = self.src.as_ref().and_then(Side::cached);
        let dst = self.dst.as_ref().and_then(Side::cached);
        let held = [(&self.src, src), (&self.dst, dst)]
            .iter()
            .filter_map(|(side, now)| Some(now.as_ref()?.saturating_sub(side.as_ref()?.before)))
            .sum();
        Sample { src, dst, held, evicted: footprint::evicted() }
    }

    fn write(&mut self, done: u64, end: bool) {
        if self.out.is_none() {
            return;
        }
        let s = self.sample();
        let side = |side: &Option<Side>, now: Option<u64>| match (side, now) {
            (Some(sd), Some(n)) => {
                serde_json::json!({ "path": sd.path, "cached_before": sd.before, "cached": n })
            }
            _ => serde_json::Value::Null,
        };
        let v = serde_json::json!({
            "seconds": (self.started.elapsed().as_secs_f64() * 1000.0).round() / 1000.0,
            "done": done,
            "held": s.held,
            "evicted": s.evicted,
            "source": side(&self.src, s.src),
            "destination": side(&self.dst, s.dst),
            "end": end,
        });
        if let Some(o) = self.out.as_mut() {
            o.line(&v.to_string());
        }
    }

    /// The last line, once the job has ended and let go of its files.
    pub fn end(mut self, done: u64) {
        self.write(done, true);
    }
}

/// The bar and the lines, updated by a thread of their own while the copy runs.
pub struct Reporter {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<(Option<Percent>, Option<Footprint>)>>,
    bar: Option<indicatif::ProgressBar>,
}

impl Reporter {
    /// Starts showing `progress` (of `size` bytes, if known): the bar when `bar` (the caller
    /// has checked that stderr is a terminal), the percent lines on `percent`, the footprint
    /// when given.
    pub fn start(
        bar: bool,
        percent: Option<FdOut>,
        footprint: Option<Footprint>,
        size: Option<u64>,
        progress: Arc<Progress>,
    ) -> Reporter {
        let bar = bar.then(|| new_bar(size));
        let stop = Arc::new(AtomicBool::new(false));
        let mut percent = percent.map(|out| Percent { out, last: None });
        if let Some(p) = percent.as_mut() {
            p.put(0);
        }
        let mut footprint = footprint;
        if bar.is_none() && percent.is_none() && footprint.is_none() {
            return Reporter { stop, thread: None, bar };
        }
        let (b, st) = (bar.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut tick = 0u32;
            while !st.load(Ordering::Relaxed) {
                let done = progress.done.load(Ordering::Relaxed);
                if let Some(b) = &b {
                    b.set_position(done);
                    if let Some(f) = &footprint {
                        let s = f.sample();
                        b.set_message(format!(
                            "cache: {} held, {} evicted",
                            human::bytes(s.held),
                            human::bytes(s.evicted)
                        ));
                    }
                }
                if let (Some(p), Some(size)) = (percent.as_mut(), size.filter(|&s| s > 0)) {
                    p.put((done.saturating_mul(100) / size).min(99) as u32);
                }
                if tick.is_multiple_of(FOOTPRINT_TICKS) {
                    if let Some(f) = footprint.as_mut() {
                        f.write(done, false);
                    }
                }
                tick += 1;
                std::thread::sleep(TICK);
            }
            (percent, footprint)
        });
        Reporter { stop, thread: Some(thread), bar }
    }

    /// Stops showing; `100/100` goes out if the copy succeeded. The footprint, for its last
    /// line once the job has let go of its files.
    pub fn finish(mut self, ok: bool) -> Option<Footprint> {
        self.stop.store(true, Ordering::Relaxed);
        let (percent, footprint) = self.thread.take().and_then(|t| t.join().ok()).unwrap_or((None, None));
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
        if let (Some(mut p), true) = (percent, ok) {
            p.put(100);
        }
        footprint
    }
}

fn new_bar(size: Option<u64>) -> indicatif::ProgressBar {
    let bar = match size {
        Some(s) => indicatif::ProgressBar::new(s),
        None => indicatif::ProgressBar::new_spinner(),
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}  {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar
}
