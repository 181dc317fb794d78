//! `lightfoot cache stat|evict -r`: a row per file as the walk ([`lightfoot::io::walk`])
//! finds it, then a total.
//!
//! A tree may hold millions of files, so rows are written as they come and nothing of the
//! tree is kept: the table puts FILE last (as du and fincore do: no column width can be known
//! beforehand), `--json` writes one object per line and then `{"total": {…}}`. `--summary`
//! writes the total alone. An error names its path on stderr (and is a row of the JSON
//! stream), the walk goes on, and the exit status is 1 at the end. A file whose residency
//! this user may not see is a row of unknowns, counted apart in the total: not a failure.

use lightfoot::Op;
use std::io::Write;
use std::path::PathBuf;

use lightfoot::io::residency::{self, Residency, Source};
use lightfoot::io::walk::{Skipped, Walk, WalkOptions};
use lightfoot::io::CacheStat;
use lightfoot::Error;

use super::super::{human, report, EXIT_BROKEN_PIPE};

/// One `cache stat|evict -r` job.
pub struct Tree {
    pub roots: Vec<PathBuf>,
    pub walk: WalkOptions,
    pub range: (u64, Option<u64>),
    pub json: bool,
    pub summary: bool,
}

/// Why a row stands for unknowns, in the JSON stream.
const NOT_VISIBLE: &str = "residency not visible to this user";

/// `cache stat -r`'s rows, in JSON.
#[derive(serde::Serialize)]
#[serde(untagged)]
enum StatRow<'a> {
    Seen {
        file: String,
        #[serde(flatten)]
        residency: &'a Residency,
        cached_bytes: u64,
    },
    Unknown {
        file: String,
        offset: u64,
        len: u64,
        cached_bytes: Option<u64>,
        unknown: &'static str,
    },
    Failed {
        file: String,
        cached_bytes: Option<u64>,
        error: String,
    },
}

/// `cache stat -r`'s total: `pages`, `stat` and `cached_bytes` are over the files whose
/// residency is visible; `len` over every file.
#[derive(serde::Serialize)]
struct StatTotal {
    files: u64,
    len: u64,
    page_size: u64,
    pages: u64,
    stat: CacheStat,
    cached_bytes: u64,
    source: Source,
    unknown: u64,
    unknown_len: u64,
    errors: u64,
    skipped: Skipped,
}

/// The last JSON line: `{"total": {…}}`.
#[derive(serde::Serialize)]
struct Total<'a, T> {
    total: &'a T,
}

/// Where rows go: stdout, a line at a time. A reader that went away ends the job with the
/// status SIGPIPE would give; another write error is reported.
struct Out(std::io::StdoutLock<'static>);

impl Out {
    fn line(&mut self, line: std::fmt::Arguments) -> Result<(), i32> {
        self.0.write_fmt(format_args!("{line}\n")).map_err(|e| {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                EXIT_BROKEN_PIPE
            } else {
                report(&Error::io(Op::Write, e).path("stdout"));
                1
            }
        })
    }

    fn json(&mut self, v: &impl serde::Serialize) -> Result<(), i32> {
        self.line(format_args!("{}", serde_json::to_string(v).expect("rows serialise")))
    }
}

/// `cache stat -r`.
pub fn stat(t: Tree) -> i32 {
    match stat_rows(t) {
        Ok(status) | Err(status) => status,
    }
}

fn stat_rows(t: Tree) -> Result<i32, i32> {
    let (off, len) = t.range;
    let mut out = Out(std::io::stdout().lock());
    let mut total = StatTotal {
        files: 0,
        len: 0,
        page_size: lightfoot::io::sys::page_size() as u64,
        pages: 0,
        stat: CacheStat::default(),
        cached_bytes: 0,
        source: Source::Cachestat,
        unknown: 0,
        unknown_len: 0,
        errors: 0,
        skipped: Skipped::default(),
    };
    let mut mincore = false;
    if !t.json {
        out.line(format_args!(
            "{:>10}  {:>18}  {:>10}  {:>10}  {:>10}  {:>10}  FILE",
            "SIZE", "CACHED", "DIRTY", "WRITEBACK", "EVICTED", "RECENT"
        ))?;
    }
    let mut walk = Walk::new(t.roots, t.walk);
    for found in &mut walk {
        let (path, r) = match found {
            Ok(f) => {
                let r = residency::measure(&f.file, &f.path, off, len).map_err(|e| (f.file, e));
                (f.path, r)
            }
            Err(e) => {
                total.errors += 1;
                report(&e);
                if t.json && !t.summary {
                    out.json(&StatRow::Failed {
                        file: path_of(&e),
                        cached_bytes: None,
                        error: e.to_string(),
                    })?;
                }
                continue;
            }
        };
        let file = path.display().to_string();
        match r {
            Ok(r) => {
                total.files += 1;
                total.len += r.len;
                total.pages += r.pages;
                add(&mut total.stat, &r.stat);
                total.cached_bytes += r.cached_bytes();
                if r.source == Source::Mincore {
                    total.source = Source::Mincore;
                    mincore = true;
                }
                if t.json && !t.summary {
                    out.json(&StatRow::Seen { file, residency: &r, cached_bytes: r.cached_bytes() })?;
                } else if !t.summary {
                    let figures = stat_figures(r.len, Some((&r.stat, r.pages, r.page_size)), mincore);
                    out.line(format_args!("{figures}  {file}"))?;
                }
            }
            Err((f, e)) if residency::not_visible(&e) => {
                let (offset, len) = match residency::file_size(&f, &path) {
                    Ok(size) => residency::clamp(size, off, len),
                    Err(e) => {
                        total.errors += 1;
                        report(&e);
                        continue;
                    }
                };
                total.files += 1;
                total.len += len;
                total.unknown += 1;
                total.unknown_len += len;
                if t.json && !t.summary {
                    out.json(&StatRow::Unknown {
                        file,
                        offset,
                        len,
                        cached_bytes: None,
                        unknown: NOT_VISIBLE,
                    })?;
                } else if !t.summary {
                    out.line(format_args!("{}  {file}", stat_figures(len, None, false)))?;
                }
            }
            Err((_, e)) => {
                total.errors += 1;
                report(&e);
                if t.json && !t.summary {
                    out.json(&StatRow::Failed { file, cached_bytes: None, error: e.to_string() })?;
                }
            }
        }
    }
    total.skipped = walk.skipped();
    if t.json {
        out.json(&Total { total: &total })?;
    } else {
        let figures = stat_figures(total.len, Some((&total.stat, total.pages, total.page_size)), mincore);
        let mut what = format!("total: {}", count(total.files, "file", "files"));
        if total.unknown > 0 {
            what += &format!(" ({} unknown: {NOT_VISIBLE})", total.unknown);
        }
        out.line(format_args!("{figures}  {what}"))?;
        tail(&mut out, total.errors, &total.skipped)?;
    }
    Ok(if total.errors > 0 { 1 } else { 0 })
}

/// The columns before FILE: size, then the figures (`None`: not visible, all `?`); the share
/// of cached pages is of `pages`. With `mincore` only the cached count is known. The plain
/// `cache stat FILE` table has the same columns, after FILE.
pub(super) fn stat_figures(len: u64, r: Option<(&CacheStat, u64, u64)>, mincore: bool) -> String {
    let Some((stat, pages, page_size)) = r else {
        return format!(
            "{:>10}  {:>18}  {:>10}  {:>10}  {:>10}  {:>10}",
            human::bytes(len),
            "?",
            "?",
            "?",
            "?",
            "?"
        );
    };
    let page = |n: u64| if mincore { "?".to_string() } else { human::bytes(n * page_size) };
    let share = if pages > 0 { 100.0 * stat.cached as f64 / pages as f64 } else { 0.0 };
    let cached = format!("{} ({share:.1}%)", human::bytes(stat.cached * page_size));
    format!(
        "{:>10}  {:>18}  {:>10}  {:>10}  {:>10}  {:>10}",
        human::bytes(len),
        cached,
        page(stat.dirty),
        page(stat.writeback),
        page(stat.evicted),
        page(stat.recently_evicted)
    )
}

fn add(sum: &mut CacheStat, s: &CacheStat) {
    sum.cached += s.cached;
    sum.dirty += s.dirty;
    sum.writeback += s.writeback;
    sum.evicted += s.evicted;
    sum.recently_evicted += s.recently_evicted;
}

/// `cache evict -r`'s rows, in JSON (`null`: residency not visible).
#[derive(serde::Serialize)]
struct EvictRow {
    file: String,
    cached_before: Option<u64>,
    cached_after: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// `cache evict -r`'s total: bytes cached before and after, over the files whose residency
/// is visible.
#[derive(Default, serde::Serialize)]
struct EvictTotal {
    files: u64,
    cached_before: u64,
    cached_after: u64,
    unknown: u64,
    errors: u64,
    skipped: Skipped,
}

/// `cache evict -r`; `sync` as `cache evict --sync`.
pub fn evict(t: Tree, sync: bool) -> i32 {
    match evict_rows(t, sync) {
        Ok(status) | Err(status) => status,
    }
}

fn evict_rows(t: Tree, sync: bool) -> Result<i32, i32> {
    let (off, len) = t.range;
    let mut out = Out(std::io::stdout().lock());
    let mut total = EvictTotal::default();
    let mut walk = Walk::new(t.roots, t.walk);
    for found in &mut walk {
        let f = match found {
            Ok(f) => f,
            Err(e) => {
                total.errors += 1;
                report(&e);
                if t.json && !t.summary {
                    let error = Some(e.to_string());
                    out.json(&EvictRow {
                        file: path_of(&e),
                        cached_before: None,
                        cached_after: None,
                        error,
                    })?;
                }
                continue;
            }
        };
        let cached = || residency::measure(&f.file, &f.path, off, len).ok().map(|r| r.cached_bytes());
        let before = cached();
        let done = residency::evict(&f.file, &f.path, off, len, sync);
        let after = cached();
        let file = f.path.display().to_string();
        if let Err(e) = &done {
            total.errors += 1;
            report(e);
        } else {
            total.files += 1;
            match (before, after) {
                (Some(b), Some(a)) => {
                    total.cached_before += b;
                    total.cached_after += a;
                }
                _ => total.unknown += 1,
            }
        }
        if t.json && !t.summary {
            let error = done.err().map(|e| e.to_string());
            out.json(&EvictRow { file, cached_before: before, cached_after: after, error })?;
        } else if done.is_ok() && !t.summary {
            match (before, after) {
                (Some(b), Some(a)) => {
                    out.line(format_args!("{file}: {} → {} cached", human::bytes(b), human::bytes(a)))?
                }
                _ => out.line(format_args!("{file}: evicted ({NOT_VISIBLE})"))?,
            }
        }
    }
    total.skipped = walk.skipped();
    if t.json {
        out.json(&Total { total: &total })?;
    } else {
        let mut line = format!(
            "total: {}, {} → {} cached",
            count(total.files, "file", "files"),
            human::bytes(total.cached_before),
            human::bytes(total.cached_after)
        );
        if total.unknown > 0 {
            line += &format!(" ({} unknown: {NOT_VISIBLE})", total.unknown);
        }
        out.line(format_args!("{line}"))?;
        tail(&mut out, total.errors, &total.skipped)?;
    }
    Ok(if total.errors > 0 { 1 } else { 0 })
}

/// The line under a table's total: errors and what the walk passed over, if any.
fn tail(out: &mut Out, errors: u64, s: &Skipped) -> Result<(), i32> {
    let parts: Vec<String> = [
        (errors, "error (above)", "errors (above)"),
        (
            s.duplicates,
            "file reached again (hard link) counted once",
            "files reached again (hard links) counted once",
        ),
        (s.symlinks, "symlink not followed", "symlinks not followed"),
        (s.mounts, "mount point not crossed", "mount points not crossed"),
        (s.not_regular, "not regular file", "not regular files"),
    ]
    .into_iter()
    .filter(|(n, _, _)| *n > 0)
    .map(|(n, one, many)| count(n, one, many))
    .collect();
    if parts.is_empty() {
        return Ok(());
    }
    out.line(format_args!("{}", parts.join(", ")))
}

/// `1 file`, `3 files`.
fn count(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// The path an error names, for its JSON row.
fn path_of(e: &Error) -> String {
    e.file().map(|p| p.display().to_string()).unwrap_or_default()
}
