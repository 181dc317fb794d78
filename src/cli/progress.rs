//! What `copy --progress` shows while the copy runs: a bar on a terminal (`--progress`), or,
//! with `--progress=FD`, lines `N/100` on a descriptor the caller handed down, in the format
//! nbdcopy writes there (virt-v2v, KubeVirt's importer and migratekit parse it).
//!
//! The FD lines: `0/100` first, then each whole percent as it is reached (never going back,
//! at most `99/100` while the copy runs), and `100/100` once the copy has succeeded, so a
//! reader that sees 100 knows the copy is done. Where SRC's size is not known in advance (a
//! pipe), only `0/100` and `100/100` are written. A descriptor that is closed, or whose
//! reader goes away, never fails the copy: the lines stop.

use std::io::{IsTerminal, Write};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lightfoot::copy::Progress;
use lightfoot::io::sys;

/// How often the bar and the FD lines look at the copy's progress.
const TICK: Duration = Duration::from_millis(100);

/// The lines for `--progress=FD`, on a descriptor of lightfoot's own.
pub struct FdLines {
    out: std::fs::File,
    last: Option<u32>,
    broken: bool,
}

impl FdLines {
    /// Takes `fd` over (a close-on-exec copy of it, so a captive server does not inherit
    /// it): done before SRC and DST are opened, so the number cannot name one of lightfoot's
    /// own files. `Ok(None)` (after a warning) when it is not open; an error when it would
    /// mix the lines into the copy's data.
    pub fn open(fd: RawFd, data_on_stdout: bool) -> Result<Option<FdLines>, String> {
        if fd == 1 && data_on_stdout {
            return Err("--progress=1: standard output carries the copy's data (DST is -); \
                        give another descriptor, e.g. --progress=2"
                .into());
        }
        match sys::dup_inherited(fd) {
            Ok(own) => Ok(Some(FdLines { out: own.into(), last: None, broken: false })),
            Err(e) => {
                tracing::warn!(
                    "--progress={fd}: descriptor {fd} cannot be used ({e}): no progress is written"
                );
                Ok(None)
            }
        }
    }

    /// Writes `pct/100` if it is above the last line written.
    fn put(&mut self, pct: u32) {
        if self.broken || self.last.is_some_and(|l| pct <= l) {
            return;
        }
        self.last = Some(pct);
        if let Err(e) = self.out.write_all(format!("{pct}/100\n").as_bytes()) {
            tracing::warn!("--progress: writing the progress failed ({e}): no more is written");
            self.broken = true;
        }
    }
}

/// The bar or the FD lines, updated by a thread of their own while the copy runs.
pub struct Reporter {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Option<FdLines>>>,
    bar: Option<indicatif::ProgressBar>,
}

impl Reporter {
    /// Starts showing `progress` (of `size` bytes, if known): the bar when `bar` is asked and
    /// stderr is a terminal, the lines when `lines` is given.
    pub fn start(bar: bool, lines: Option<FdLines>, size: Option<u64>, progress: Arc<Progress>) -> Reporter {
        let bar = (bar && std::io::stderr().is_terminal()).then(|| new_bar(size));
        let stop = Arc::new(AtomicBool::new(false));
        if bar.is_none() && lines.is_none() {
            return Reporter { stop, thread: None, bar };
        }
        let (b, st) = (bar.clone(), stop.clone());
        let mut lines = lines;
        if let Some(l) = lines.as_mut() {
            l.put(0);
        }
        let thread = std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                let done = progress.done.load(Ordering::Relaxed);
                if let Some(b) = &b {
                    b.set_position(done);
                }
                if let (Some(l), Some(size)) = (lines.as_mut(), size.filter(|&s| s > 0)) {
                    l.put((done.saturating_mul(100) / size).min(99) as u32);
                }
                std::thread::sleep(TICK);
            }
            lines
        });
        Reporter { stop, thread: Some(thread), bar }
    }

    /// Stops showing; `100/100` goes out if the copy succeeded.
    pub fn finish(mut self, ok: bool) {
        self.stop.store(true, Ordering::Relaxed);
        let lines = self.thread.take().and_then(|t| t.join().ok()).flatten();
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
        if let (Some(mut l), true) = (lines, ok) {
            l.put(100);
        }
    }
}

fn new_bar(size: Option<u64>) -> indicatif::ProgressBar {
    let bar = match size {
        Some(s) => indicatif::ProgressBar::new(s),
        None => indicatif::ProgressBar::new_spinner(),
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar
}
