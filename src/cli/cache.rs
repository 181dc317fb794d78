//! `lightfoot cache stat|evict FILE…`: the named files here, directory trees (`-r`) in
//! [`tree`].

use std::fs::File;
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use lightfoot::copy::endpoint::parse_size;
use lightfoot::io::residency::{self, Residency};
use lightfoot::io::walk::WalkOptions;

use super::human;

mod tree;

/// See and control what files have in the page cache.
#[derive(Subcommand)]
pub enum CacheCommand {
    /// Show cached, dirty, writeback and evicted pages per file, or of directory trees with
    /// -r (from cachestat(2)).
    #[command(after_long_help = STAT_HELP)]
    Stat(StatArgs),
    /// Drop the clean cached pages of files, or of directory trees with -r
    /// (POSIX_FADV_DONTNEED).
    #[command(after_long_help = EVICT_HELP)]
    Evict(EvictArgs),
}

const STAT_HELP: &str = "\
Columns: the size of the range, then bytes cached (and the share of the range), dirty (not yet
written back), under writeback, evicted (pages of the range the cache dropped and still keeps
a trace of) and recently evicted (of those, dropped recently enough that reading them again
would count as thrashing).

Figures come from cachestat(2) (Linux 6.5), which since 2025 needs write access to the file
(or ownership, or root). For other files the figures are not visible: lightfoot says so rather
than guess (mincore would report every page of them cached). On kernels without cachestat,
mincore is used for files the user may write: cached bytes only, the other columns show ?.

With -r, each DIR is walked: a row per regular file as it is found (FILE last), then a total
row and a line telling what the walk passed over. Symlinks inside a tree are not followed
(-L follows them), the walk stays on each DIR's file system (--cross-mounts leaves it), and a
file with several hard links is counted once. FIFOs, sockets and devices are counted, never
opened. Files whose residency is not visible show ? and are counted apart as unknown: not a
failure. --json then writes one object per line and a last {\"total\": …} object.

Exit status: 0 if every file was shown, 1 otherwise (an error names its file; with -r the walk
goes on), 2 usage error. See docs/cache.md.";

const EVICT_HELP: &str = "\
Only clean pages can be dropped; with --sync, dirty pages are written back first. Pages
mapped by a running program, and whole large folios straddling the edges of --range, stay.
Eviction needs only read access.

With -r, each DIR is walked as for `cache stat -r` (same rules for symlinks, mounts and hard
links) and every regular file in it is evicted: a line per file, then a total.

Exit status: 0 if every file was evicted, 1 otherwise (an error names its file; with -r the
walk goes on), 2 usage error. See docs/cache.md.";

#[derive(Args)]
pub struct StatArgs {
    /// Regular files or block devices; with -r, directories too (refused without it).
    #[arg(required = true, value_name = "FILE")]
    files: Vec<PathBuf>,

    /// Only this byte range: OFFSET:LENGTH, OFFSET: (to the end) or :LENGTH, with K, M, G or T
    /// suffixes.
    #[arg(long, value_name = "OFF:LEN", value_parser = parse_range)]
    range: Option<(u64, Option<u64>)>,

    /// Print JSON instead of a table: one array, an object per file; with -r, one object per
    /// line (a file each, as the walk finds them) and a last {"total": …} object.
    #[arg(long)]
    json: bool,

    #[command(flatten)]
    walk: WalkArgs,
}

#[derive(Args)]
pub struct EvictArgs {
    /// Regular files or block devices; with -r, directories too (refused without it).
    #[arg(required = true, value_name = "FILE")]
    files: Vec<PathBuf>,

    /// Only this byte range: OFFSET:LENGTH, OFFSET: (to the end) or :LENGTH, with K, M, G or T
    /// suffixes.
    #[arg(long, value_name = "OFF:LEN", value_parser = parse_range)]
    range: Option<(u64, Option<u64>)>,

    /// Write dirty pages back (and wait) before evicting, so they can go too.
    #[arg(long)]
    sync: bool,

    /// Print JSON (one array, an object per file: file, cached_before, cached_after in bytes,
    /// and error for a file that failed) instead of a line per file; with -r, one object per
    /// line and a last {"total": …} object.
    #[arg(long)]
    json: bool,

    #[command(flatten)]
    walk: WalkArgs,
}

/// The options of `cache stat|evict -r` (docs/cache.md, "Directory trees").
#[derive(Args)]
#[command(next_help_heading = "Directory trees")]
pub struct WalkArgs {
    /// Walk each directory named: every regular file under it, each counted once (hard
    /// links too). A symlink named on the command line is followed.
    #[arg(short = 'r', long)]
    recursive: bool,

    /// Follow symlinks found in the trees too (as du -L and find -L do), reporting loops.
    /// Without it they are counted, not followed.
    #[arg(short = 'L', long, visible_alias = "dereference", requires = "recursive")]
    follow_symlinks: bool,

    /// Enter directories on other file systems (mount points). Without it the walk stays on
    /// the file system of each directory named, as du -x and find -xdev do.
    #[arg(long, requires = "recursive")]
    cross_mounts: bool,

    /// Print the total only: its row (and the line under it), or with --json the one
    /// {"total": …} object.
    #[arg(long, requires = "recursive")]
    summary: bool,
}

impl WalkArgs {
    fn tree(&self, roots: Vec<PathBuf>, range: Option<(u64, Option<u64>)>, json: bool) -> tree::Tree {
        tree::Tree {
            roots,
            walk: WalkOptions { follow_symlinks: self.follow_symlinks, cross_mounts: self.cross_mounts },
            range: range.unwrap_or((0, None)),
            json,
            summary: self.summary,
        }
    }
}

/// [`residency::open`] for a file named without -r, telling how to see a directory.
fn open_named(path: &Path) -> lightfoot::Result<File> {
    residency::open(path).map_err(|e| {
        if path.is_dir() {
            e.detail("a directory: walk it with -r, or name the files in it")
        } else {
            e
        }
    })
}

fn parse_range(s: &str) -> Result<(u64, Option<u64>), String> {
    let (off, len) = s.split_once(':').ok_or("expected OFFSET:LENGTH")?;
    let off = if off.is_empty() { 0 } else { parse_size(off).map_err(|e| e.to_string())? };
    let len = if len.is_empty() { None } else { Some(parse_size(len).map_err(|e| e.to_string())?) };
    Ok((off, len))
}

pub fn run(cmd: CacheCommand) -> i32 {
    super::init_logging(0);
    match cmd {
        CacheCommand::Stat(a) if a.walk.recursive => tree::stat(a.walk.tree(a.files, a.range, a.json)),
        CacheCommand::Stat(a) => stat(a),
        CacheCommand::Evict(a) if a.walk.recursive => {
            tree::evict(a.walk.tree(a.files, a.range, a.json), a.sync)
        }
        CacheCommand::Evict(a) => evict_files(a),
    }
}

#[derive(serde::Serialize)]
struct StatRow {
    file: String,
    #[serde(flatten)]
    residency: Option<Residency>,
    cached_bytes: Option<u64>,
    error: Option<String>,
}

fn stat(a: StatArgs) -> i32 {
    let (off, len) = a.range.unwrap_or((0, None));
    let mut rows = Vec::new();
    let mut status = 0;
    for path in &a.files {
        let r = open_named(path).and_then(|f| residency::measure(&f, path, off, len));
        match r {
            Ok(r) => rows.push(StatRow {
                file: path.display().to_string(),
                cached_bytes: Some(r.cached_bytes()),
                residency: Some(r),
                error: None,
            }),
            Err(e) => {
                status = 1;
                if !a.json {
                    super::report(&e);
                }
                rows.push(StatRow {
                    file: path.display().to_string(),
                    residency: None,
                    cached_bytes: None,
                    error: Some(e.to_string()),
                });
            }
        }
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows).expect("rows serialise"));
        return status;
    }
    let ok: Vec<_> = rows.iter().filter_map(|r| r.residency.as_ref().map(|res| (r, res))).collect();
    if ok.is_empty() {
        return status;
    }
    let width = ok.iter().map(|(r, _)| r.file.len()).max().unwrap_or(4).max(4);
    println!(
        "{:<width$}  {:>10}  {:>18}  {:>10}  {:>10}  {:>10}  {:>10}",
        "FILE", "SIZE", "CACHED", "DIRTY", "WRITEBACK", "EVICTED", "RECENT"
    );
    for (row, r) in ok {
        let mincore = r.source == residency::Source::Mincore;
        let figures = tree::stat_figures(r.len, Some((&r.stat, r.pages, r.page_size)), mincore);
        println!("{:<width$}  {figures}", row.file);
    }
    status
}

#[derive(serde::Serialize)]
struct EvictRow {
    file: String,
    cached_before: Option<u64>,
    cached_after: Option<u64>,
    error: Option<String>,
}

fn evict_files(a: EvictArgs) -> i32 {
    let (off, len) = a.range.unwrap_or((0, None));
    let mut status = 0;
    let mut rows = Vec::new();
    for path in &a.files {
        let f = match open_named(path) {
            Ok(f) => f,
            Err(e) => {
                status = 1;
                super::report(&e);
                rows.push(EvictRow {
                    file: path.display().to_string(),
                    cached_before: None,
                    cached_after: None,
                    error: Some(e.to_string()),
                });
                continue;
            }
        };
        let before = residency::measure(&f, path, off, len).ok().map(|r| r.cached_bytes());
        let res = residency::evict(&f, path, off, len, a.sync);
        let after = residency::measure(&f, path, off, len).ok().map(|r| r.cached_bytes());
        let error = res.as_ref().err().map(|e| e.to_string());
        match &res {
            Err(e) => {
                status = 1;
                super::report(e);
            }
            Ok(()) if !a.json => match (before, after) {
                (Some(b), Some(af)) => {
                    println!("{}: {} → {} cached", path.display(), human::bytes(b), human::bytes(af))
                }
                _ => println!("{}: evicted (residency not visible to this user)", path.display()),
            },
            Ok(()) => {}
        }
        rows.push(EvictRow {
            file: path.display().to_string(),
            cached_before: before,
            cached_after: after,
            error,
        });
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows).expect("rows serialise"));
    }
    status
}
