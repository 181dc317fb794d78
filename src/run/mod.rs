//! `lightfoot run -- CMD`: what the preload library (`preload/`, loaded into CMD and its
//! children with `LD_PRELOAD`) left in the run directory, and the final sweep after CMD ends.
//!
//! The library drops what CMD's reads and writes bring in as CMD goes (evict-behind, at
//! `close`); it also appends a record per file it looked at to `DIR/files` (in the format of
//! `lightfoot_record`, `record/`, which both sides use). The sweep makes the end state right
//! whatever CMD did: for each file, from its first record (its first sight), it writes back
//! what is dirty, drops every 2 MiB block that held no page at first sight, and measures what
//! is left. That covers files CMD never closed, processes ended by `_exit` or a signal, dirty
//! pages the library could not drop while their writeback ran, and stdio's reads and writes
//! between `fopen` and `fclose`.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use lightfoot_record::{
    Header, ALL_CACHED, DONE, NOT_COVERED_EPERM, NOT_COVERED_NOSYS, NOT_COVERED_OTHER, WRITABLE,
};

use crate::error::{Error, ErrorKind, Op, Result};
use crate::io::residency;
use crate::io::sys::{self, Advice};

pub mod watch;

/// One record of the library's (or a first sight of the watcher's), with its path and bitmap
/// of its own.
#[derive(Debug, Clone)]
pub struct Record {
    pub header: Header,
    pub path: PathBuf,
    /// Blocks that held pages at first sight (bit `b % 8` of byte `b / 8`); empty when none
    /// did (or the file was not covered).
    pub bits: Vec<u8>,
}

impl Record {
    pub(crate) fn covered(&self) -> bool {
        self.header.covered()
    }

    /// Whether block `b` held pages at first sight.
    pub(crate) fn was_cached(&self, b: u64) -> bool {
        if self.header.flags & ALL_CACHED != 0 {
            return true;
        }
        lightfoot_record::is_set(&self.bits, b)
    }

    /// The runs `[start, end)` of blocks below `blocks` that held no page at first sight
    /// (blocks past the first sight's end held none).
    pub(crate) fn new_runs(&self, blocks: u64) -> Vec<(u64, u64)> {
        let mut runs = Vec::new();
        let mut b = 0;
        while b < blocks {
            if self.was_cached(b) {
                b += 1;
                continue;
            }
            let start = b;
            while b < blocks && !self.was_cached(b) {
                b += 1;
            }
            runs.push((start, b));
        }
        runs
    }

    pub(crate) fn why_not_covered(&self) -> Option<&'static str> {
        if self.header.flags & NOT_COVERED_EPERM != 0 {
            Some("cachestat refused the file (this user may not write it): its residency is unknown, so nothing of it is dropped")
        } else if self.header.flags & NOT_COVERED_NOSYS != 0 {
            Some("no cachestat on this kernel (Linux 6.5 and later have it)")
        } else if self.header.flags & NOT_COVERED_OTHER != 0 {
            Some("cachestat failed on it")
        } else {
            None
        }
    }
}

/// The records in `bytes`, in the order they were written (as far as they are whole).
pub fn parse(bytes: &[u8]) -> Vec<Record> {
    lightfoot_record::records(bytes)
        .map(|e| Record {
            header: e.header,
            path: PathBuf::from(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(e.path)),
            bits: e.bits.to_vec(),
        })
        .collect()
}

/// What the run did to one file.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct FileReport {
    /// Where the file is when the sweep ends (renamed since: its new name).
    pub path: PathBuf,
    /// Processes that looked at it (records).
    pub opens: usize,
    pub written: bool,
    pub size_at_first_sight: u64,
    pub cached_before: u64,
    /// Cached when the sweep ended (None: could not be measured).
    pub cached_after: Option<u64>,
    /// Bytes read from it and written to it through the library's descriptors (None: only
    /// the watcher saw it, which cannot count them).
    pub bytes_read: Option<u64>,
    pub bytes_written: Option<u64>,
    /// Bytes of CMD's pages that lightfoot dropped while CMD ran and at the end (evict-behind,
    /// the watcher, the final sweep), each drop measured by cachestat before and after (None:
    /// the file was not covered).
    pub evicted: Option<u64>,
    /// How it was covered: "evict-behind" (the library), or why it was not.
    pub mechanism: String,
    /// A problem the sweep met (the file gone or replaced, a writeback error).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl FileReport {
    /// Adds `bytes` to what was evicted, where the file is covered (else it stays unknown).
    fn add_evicted(&mut self, bytes: u64) {
        if let Some(e) = self.evicted.as_mut() {
            *e += bytes;
        }
    }
}

/// The sweep over the records in `dir`: one report per file, in the order of first sight.
/// Files the watcher saw (`watched`, its first sights taken at the open, so before any of the
/// library's) are the watcher's: done already, only the library's opens are added to them.
pub fn sweep(dir: &Path, watched: Vec<watch::Watched>) -> Result<Vec<FileReport>> {
    let log = dir.join("files");
    let bytes = std::fs::read(&log).map_err(|e| Error::io(Op::Read, e).path(&log))?;
    let (done, records): (Vec<Record>, Vec<Record>) =
        parse(&bytes).into_iter().partition(|r| r.header.flags & DONE != 0);
    let page = sys::page_size() as u64;
    // (read, written, evicted) bytes per file.
    let mut moved: HashMap<(u64, u64), (u64, u64, u64)> = HashMap::new();
    for d in done {
        let m = moved.entry((d.header.dev, d.header.ino)).or_default();
        m.0 += d.header.size;
        m.1 += d.header.cached_pages;
        m.2 += u64::from(d.header.evicted_pages) * page;
    }
    let mut order: Vec<(u64, u64)> = Vec::new();
    let mut by_file: HashMap<(u64, u64), Vec<Record>> = HashMap::new();
    for r in records {
        let key = (r.header.dev, r.header.ino);
        if !by_file.contains_key(&key) {
            order.push(key);
        }
        by_file.entry(key).or_default().push(r);
    }
    let mut renamed = Renamed::new();
    let mut reports = Vec::with_capacity(watched.len() + order.len());
    for mut w in watched {
        if let Some(recs) = by_file.remove(&(w.dev, w.ino)) {
            w.report.opens += recs.len();
            w.report.written |= recs.iter().any(|r| r.header.flags & WRITABLE != 0);
            w.report.mechanism.push_str(" and evict-behind");
            let (r, wr, ev) = moved.get(&(w.dev, w.ino)).copied().unwrap_or_default();
            (w.report.bytes_read, w.report.bytes_written) = (Some(r), Some(wr));
            w.report.add_evicted(ev);
            // The library's first sight came later, at the first read or write: after an
            // O_TRUNC that the watcher's (at the open) preceded. A block empty at either
            // sight is CMD's, so the blocks empty at the library's go too.
            if recs[0].covered() {
                if let Ok((_, after, ev)) = finish_file(&recs[0], w.report.written, &mut renamed) {
                    if after.is_some() {
                        w.report.cached_after = after;
                    }
                    w.report.add_evicted(ev);
                }
            }
        }
        reports.push(w.report);
    }
    order.retain(|k| by_file.contains_key(k));
    reports.extend(order.into_iter().map(|key| {
        let recs = &by_file[&key];
        let first = &recs[0];
        let written = recs.iter().any(|r| r.header.flags & WRITABLE != 0);
        let mut report = FileReport {
            path: first.path.clone(),
            opens: recs.len(),
            written,
            size_at_first_sight: first.header.size,
            cached_before: first.header.cached_pages * page,
            cached_after: None,
            bytes_read: Some(moved.get(&key).map_or(0, |m| m.0)),
            bytes_written: Some(moved.get(&key).map_or(0, |m| m.1)),
            evicted: first.covered().then(|| moved.get(&key).map_or(0, |m| m.2)),
            mechanism: "evict-behind".into(),
            note: None,
        };
        if let Some(why) = first.why_not_covered() {
            report.mechanism = format!("not covered: {why}");
        }
        match finish_file(first, written, &mut renamed) {
            Ok((path, after, ev)) => {
                report.path = path;
                report.cached_after = after;
                report.add_evicted(ev);
            }
            Err(e) => report.note = Some(e.to_string()),
        }
        report
    }));
    Ok(reports)
}

/// Where each file of a directory is now, by (device, inode): read once per directory the
/// sweep needs it for.
pub(crate) type Renamed = HashMap<PathBuf, HashMap<(u64, u64), PathBuf>>;

/// The file of a record: at its path, or, when that name is gone or names another file, under
/// the name it was renamed to in the same directory (rsync, tar and editors write a temporary
/// name and rename it over the real one once it is written: the record has the temporary one).
fn locate(first: &Record, renamed: &mut Renamed) -> Option<PathBuf> {
    let same = |p: &Path| {
        std::fs::symlink_metadata(p).is_ok_and(|m| (m.dev(), m.ino()) == (first.header.dev, first.header.ino))
    };
    if same(&first.path) {
        return Some(first.path.clone());
    }
    let dir = first.path.parent()?.to_path_buf();
    let entries = renamed.entry(dir.clone()).or_insert_with(|| {
        std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let m = e.metadata().ok().filter(|m| m.is_file())?;
                Some(((m.dev(), m.ino()), e.path()))
            })
            .collect()
    });
    entries.get(&(first.header.dev, first.header.ino)).cloned()
}

/// Writes back and drops what one file holds beyond its first sight; where it is, what it
/// holds after (`None`: the file is gone, nothing of it is left to drop) and the bytes the
/// drop took out.
pub(crate) fn finish_file(
    first: &Record,
    written: bool,
    renamed: &mut Renamed,
) -> Result<(PathBuf, Option<u64>, u64)> {
    let Some(path) = locate(first, renamed) else { return Ok((first.path.clone(), None, 0)) };
    let at = |(after, evicted): (Option<u64>, u64)| Ok((path.clone(), after, evicted));
    let path = &path;
    let file = residency::open(path)?;
    let meta = file.metadata().map_err(|e| Error::io(Op::Stat, e).path(path))?;
    if (meta.dev(), meta.ino()) != (first.header.dev, first.header.ino) {
        return Err(Error::new(crate::error::ErrorKind::InvalidInput, Op::Sweep)
            .path(path)
            .detail("replaced by another file while the sweep looked at it: left alone"));
    }
    at(finish_open(&file, path, first, written)?)
}

/// Writes back and drops what an open file holds beyond its first sight (a file not covered
/// is only measured); what it holds after (None: could not be measured) and the bytes the
/// drop took out.
pub(crate) fn finish_open(
    file: &File,
    path: &Path,
    first: &Record,
    written: bool,
) -> Result<(Option<u64>, u64)> {
    let mut evicted = 0;
    if first.covered() {
        if written {
            write_back(file, path)?;
        }
        evicted = drop_new_blocks(file, first) * sys::page_size() as u64;
    }
    Ok((residency::measure(file, path, 0, None).ok().map(|r| r.cached_bytes()), evicted))
}

/// Waits until the file's dirty pages are written back, on a descriptor of lightfoot's own (the
/// command has ended: its descriptors, and the errors they were owed, are gone with it).
fn write_back(file: &File, path: &Path) -> Result<()> {
    sys::sync_file_range(file.as_fd(), 0, 0, sys::SFR_WAIT_BEFORE | sys::SFR_WRITE | sys::SFR_WAIT_AFTER)
        .map_err(|e| Error::io(Op::Writeback, e).path(path))
}

/// Drops every block that held no page at first sight, in runs, and all past the first sight's
/// end, until none of them holds a page. Readahead the command started just before it ended
/// can still be in flight: its pages are locked while the read runs, a drop skips them, and they
/// land afterwards (a `head` that stopped at 28.6 MiB left 30-36 MiB behind that way). So the
/// drop is repeated while pages are left, every 20 ms for up to 2 s. Returns the pages it took
/// out (what the runs held before, less what they hold after).
fn drop_new_blocks(file: &File, first: &Record) -> u64 {
    let shift = first.header.block_shift;
    let blocks = first.header.size.div_ceil(1 << shift);
    // (offset, len), len 0: to the end; a run reaching the first sight's end goes on to it.
    let mut runs: Vec<(u64, u64)> =
        first.new_runs(blocks).into_iter().map(|(s, e)| (s << shift, (e - s) << shift)).collect();
    match runs.last_mut() {
        Some(last) if last.0 + last.1 == blocks << shift => last.1 = 0,
        _ => runs.push((blocks << shift, 0)),
    }
    let fd = file.as_fd();
    let held =
        || runs.iter().map(|&(off, len)| sys::cachestat(fd, off, len).map_or(0, |c| c.cached)).sum::<u64>();
    let before = held();
    let mut left = before;
    for _ in 0..100 {
        if left == 0 {
            break;
        }
        for &(off, len) in &runs {
            let _ = sys::fadvise(fd, off, len, Advice::DontNeed);
        }
        left = held();
        if left > 0 {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    before.saturating_sub(left)
}

/// Where the preload library is: `$LIGHTFOOT_PRELOAD`, beside this binary (a cargo build), or
/// in `../lib/lightfoot/` from it (`make install`).
pub fn find_preload() -> Result<PathBuf> {
    const NAME: &str = "liblightfoot_preload.so";
    let mut tried = Vec::new();
    if let Some(p) = std::env::var_os("LIGHTFOOT_PRELOAD") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        let why = format!("LIGHTFOOT_PRELOAD names {}, which is not a file", p.display());
        return Err(Error::new(ErrorKind::NotFound, Op::Parse).detail(why));
    }
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.canonicalize().ok())
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        for p in [dir.join(NAME), dir.join("../lib/lightfoot").join(NAME)] {
            if p.is_file() {
                return Ok(p.canonicalize().unwrap_or(p));
            }
            tried.push(p.display().to_string());
        }
    }
    Err(Error::new(ErrorKind::NotFound, Op::Open)
        .path(NAME)
        .detail(format!("not in any of {} (`make` builds it, `make install` installs it)", tried.join(", "))))
}

/// A private directory for one run's records: in /dev/shm (memory, never written back to a
/// disk), else the temporary directory; mode 0700.
pub fn make_run_dir() -> Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    for i in 0..100u32 {
        let dir = base.join(format!("lightfoot-run-{}-{nanos}-{i}", std::process::id()));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {
                let log = dir.join("files");
                std::fs::File::create(&log).map_err(|e| Error::io(Op::Create, e).path(&log))?;
                return Ok(dir);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(Error::io(Op::Create, e).path(&dir)),
        }
    }
    Err(Error::new(crate::error::ErrorKind::InvalidInput, Op::Create)
        .path(&base)
        .detail("no free name for a run directory"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(flags: u32, path: &str, bits: &[u8]) -> Vec<u8> {
        let mut h = lightfoot_record::Header::new(flags, 42, 7, 3, 99, path.len(), bits.len());
        (h.size, h.cached_pages) = (6 << 20, 10);
        [&h.encode()[..], path.as_bytes(), bits].concat()
    }

    #[test]
    fn records_parse_back_in_order_and_a_torn_tail_is_ignored() {
        let mut bytes = record(WRITABLE, "/a/b", &[0b101]);
        bytes.extend(record(NOT_COVERED_EPERM, "/c", &[]));
        let whole = bytes.len();
        bytes.extend(&record(0, "/torn", &[1])[..20]);
        let r = parse(&bytes);
        assert_eq!(r.len(), 2, "{whole}");
        assert_eq!(
            (r[0].path.to_str(), r[0].header.pid, r[0].header.dev, r[0].header.ino, r[0].header.size),
            (Some("/a/b"), 42, 3, 99, 6 << 20)
        );
        assert!(r[0].was_cached(0) && !r[0].was_cached(1) && r[0].was_cached(2) && !r[0].was_cached(3));
        assert_eq!(r[0].new_runs(5), vec![(1, 2), (3, 5)]);
        assert_eq!(r[0].new_runs(3), vec![(1, 2)]);
        assert!(r[0].covered() && !r[1].covered());
        assert!(r[1].why_not_covered().unwrap().contains("cachestat refused"));
        let all = Record { header: Header { flags: ALL_CACHED, ..r[1].header }, ..r[1].clone() };
        assert!(all.was_cached(1000));
    }
}
