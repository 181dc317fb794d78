//! The files CMD's tree holds, followed every tick: where its descriptors are, which blocks
//! of CMD's fall outside every window and are dropped, and each file's report at the end.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::mpsc;

use lightfoot_record::{BLOCK, SHIFT};

use crate::io::sys::{self, Advice};
use crate::run::{finish_file, finish_open, FileReport, Record, Renamed};

use super::process::Msg;
use super::{Watched, TICK};

/// A file of the tree's, as the scanner keeps it.
pub(super) struct Tracked {
    record: Record,
    /// The watcher's own descriptor (None once the file is done with and closed).
    file: Option<File>,
    /// A close event came: once no process of the tree holds it, it is dropped whole.
    closed: bool,
    written: bool,
    /// Blocks of CMD's seen resident outside every window at the last tick.
    waiting: HashSet<u64>,
    /// What it held when the watcher let go of it (bytes), for files the end cannot reopen.
    left_when_closed: Option<u64>,
    /// Pages the ticks' drops took out (cachestat before and after each).
    evicted: u64,
    opens: usize,
}

/// The scanner: drops what CMD's tree brings in as it goes; returns the files once the
/// handler has ended and its last messages are read.
pub(super) fn scan(rx: mpsc::Receiver<Msg>, bounded: bool) -> Vec<Tracked> {
    let mut files: HashMap<(u64, u64), Tracked> = HashMap::new();
    let mut order = Vec::new();
    let mut pids: HashSet<u32> = HashSet::new();
    let ahead = 2 * read_ahead_bytes() + BLOCK;
    let mut handler_gone = false;
    while !handler_gone {
        let deadline = std::time::Instant::now() + TICK;
        loop {
            let msg = match rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now())) {
                Ok(m) => m,
                Err(mpsc::RecvTimeoutError::Timeout) => break,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    handler_gone = true;
                    break;
                }
            };
            match msg {
                Msg::Seen(s) => {
                    let key = (s.record.header.dev, s.record.header.ino);
                    pids.insert(s.record.header.pid);
                    order.push(key);
                    files.insert(
                        key,
                        Tracked {
                            record: s.record,
                            file: Some(File::from(s.fd)),
                            closed: false,
                            written: false,
                            waiting: HashSet::new(),
                            left_when_closed: None,
                            evicted: 0,
                            opens: 1,
                        },
                    );
                }
                Msg::Opened { key, fd, pid } => {
                    pids.insert(pid);
                    if let Some(t) = files.get_mut(&key) {
                        t.opens += 1;
                        t.closed = false;
                        if t.file.is_none() {
                            t.file = Some(File::from(fd));
                        }
                    }
                }
                Msg::Closed { key } => {
                    if let Some(t) = files.get_mut(&key) {
                        t.closed = true;
                    }
                }
            }
        }
        let windows = positions(&mut pids, &files);
        for (key, t) in files.iter_mut() {
            if t.file.is_some() {
                step(t, windows.get(key), ahead, bounded);
            }
        }
    }
    order.into_iter().filter_map(|k| files.remove(&k)).collect()
}

/// The readahead window of the root file system's device (8 MiB if unknown).
pub(super) fn read_ahead_bytes() -> u64 {
    std::fs::metadata("/").map_or(8 << 20, |m| crate::io::file::read_ahead_bytes(m.dev()))
}

/// The file positions of every descriptor the tree's processes hold on a tracked file;
/// processes that ended are forgotten.
pub(super) fn positions(
    pids: &mut HashSet<u32>,
    files: &HashMap<(u64, u64), Tracked>,
) -> HashMap<(u64, u64), Vec<u64>> {
    let mut out: HashMap<(u64, u64), Vec<u64>> = HashMap::new();
    pids.retain(|&pid| {
        let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
        for e in dir.flatten() {
            let Ok(m) = std::fs::metadata(e.path()) else { continue };
            let key = (m.dev(), m.ino());
            if !m.is_file() || !files.contains_key(&key) {
                continue;
            }
            let info =
                std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", e.file_name().to_string_lossy()));
            let pos = info.ok().and_then(|s| {
                s.lines().find_map(|l| l.strip_prefix("pos:").and_then(|v| v.trim().parse().ok()))
            });
            out.entry(key).or_default().push(pos.unwrap_or(0));
        }
        true
    });
    out
}

/// One tick of one file: drop CMD's blocks outside every window, start the writeback of
/// dirty ones; let go of a file nobody in the tree holds once nothing of CMD's is left in it.
/// `bounded` (`--max-cache`): clean blocks outside every window go at once, and dirty ones are
/// waited for (on the watcher's own descriptor: no error of the program's is taken) and
/// dropped.
pub(super) fn step(t: &mut Tracked, window: Option<&Vec<u64>>, ahead: u64, bounded: bool) {
    let Some(file) = t.file.as_ref() else { return };
    if !t.record.covered() {
        if t.closed && window.is_none() {
            t.file = None;
        }
        return;
    }
    let size = file.metadata().map_or(0, |m| m.len());
    let blocks = size.div_ceil(BLOCK);
    let mut held_pages = Vec::new();
    for (start, end) in t.record.new_runs(blocks) {
        if let Ok(c) = sys::cachestat(file.as_fd(), start << SHIFT, (end - start) << SHIFT) {
            let _ = resident(file, start, end, c, |b, c| held_pages.push((b, c)));
        }
    }
    let held =
        |b: u64| window.is_some_and(|w| w.iter().any(|&p| b + 1 >= p >> SHIFT && b <= (p + ahead) >> SHIFT));
    let mut left = 0;
    let mut waiting = HashSet::new();
    for (b, c) in held_pages {
        if held(b) {
            continue;
        }
        let fd = file.as_fd();
        let mut drop_block = || {
            let _ = sys::fadvise(fd, b << SHIFT, BLOCK, Advice::DontNeed);
            if let Ok(after) = sys::cachestat(fd, b << SHIFT, BLOCK) {
                t.evicted += c.cached.saturating_sub(after.cached);
            }
        };
        if bounded && c.dirty + c.writeback > 0 {
            t.written = true;
            let wait = sys::SFR_WAIT_BEFORE | sys::SFR_WRITE | sys::SFR_WAIT_AFTER;
            let _ = sys::sync_file_range(fd, b << SHIFT, BLOCK, wait);
            drop_block();
        } else if c.dirty > 0 {
            t.written = true;
            let _ = sys::sync_file_range(fd, b << SHIFT, BLOCK, sys::SFR_WRITE);
            left += 1;
        } else if c.writeback > 0 {
            t.written = true;
            left += 1;
        } else if bounded || window.is_none() || t.waiting.contains(&b) {
            drop_block();
        } else {
            waiting.insert(b);
            left += 1;
        }
    }
    t.waiting = waiting;
    if t.closed && window.is_none() && left == 0 {
        t.left_when_closed =
            sys::cachestat(file.as_fd(), 0, 0).ok().map(|c| c.cached * sys::page_size() as u64);
        if let Some(p) = path_of(file) {
            t.record.path = p;
        }
        t.file = None;
    }
}

/// Calls `found` for each block in `[lo, hi)`, whose counts are `c`, that holds pages, with its
/// counts (`lightfoot_record::scan`); false if a look failed (those blocks are then not
/// reported).
pub(super) fn resident(
    file: &File,
    lo: u64,
    hi: u64,
    c: sys::CacheStat,
    mut found: impl FnMut(u64, sys::CacheStat),
) -> bool {
    let mut look = |off, len| sys::cachestat(file.as_fd(), off, len).ok();
    lightfoot_record::scan(lo, hi, c, &mut look, &mut found)
}

impl lightfoot_record::Counts for sys::CacheStat {
    fn cached(&self) -> u64 {
        self.cached
    }
}

/// The end: every file written back and dropped to its first sight, and measured.
pub(super) fn finish_all(files: Vec<Tracked>) -> Vec<Watched> {
    let page = sys::page_size() as u64;
    let mut renamed = Renamed::new();
    files
        .into_iter()
        .map(|t| {
            let r = &t.record;
            let mut report = FileReport {
                path: r.path.clone(),
                opens: t.opens,
                written: t.written,
                size_at_first_sight: r.header.size,
                cached_before: r.header.cached_pages * page,
                cached_after: t.left_when_closed,
                bytes_read: None,
                bytes_written: None,
                evicted: r.covered().then_some(t.evicted * page),
                mechanism: match r.why_not_covered() {
                    Some(why) => format!("not covered: {why}"),
                    None => "watcher".into(),
                },
                note: None,
            };
            let done = match &t.file {
                Some(file) => {
                    if let Some(p) = path_of(file) {
                        report.path = p;
                    }
                    finish_open(file, &report.path, r, t.written)
                }
                None => finish_file(r, t.written, &mut renamed).map(|(p, after, evicted)| {
                    report.path = p;
                    (after, evicted)
                }),
            };
            match done {
                Ok((after, evicted)) => {
                    if after.is_some() {
                        report.cached_after = after;
                    }
                    report.add_evicted(evicted);
                }
                Err(e) => report.note = Some(e.to_string()),
            }
            Watched { dev: r.header.dev, ino: r.header.ino, report }
        })
        .collect()
}

/// Where a file the watcher holds is now (renamed since: its new name).
pub(super) fn path_of(file: &File) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).ok()
}
