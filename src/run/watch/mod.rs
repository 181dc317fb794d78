//! The watcher: what the preload library cannot see (statically linked programs, Go programs
//! such as restic, mmap, io_uring, programs that clear their environment, setuid programs).
//!
//! It runs as a process of its own (`lightfoot __watch PARENT mounts|filesystems [MAX_CACHE]`,
//! src/cli/watch.rs), started by `lightfoot run` before CMD, in a process group of its own: a
//! terminal's Ctrl-Z stops CMD and `lightfoot run`, never the watcher, which CMD's opens wait
//! for. [`Watcher`] is `lightfoot run`'s end of it, [`Watch`] the work the process does. They
//! talk through the process's stdout: a first line, [`READY`] and the watched mount points as
//! JSON once the marks are in place (or [`FAILED`] and why), and when `lightfoot run` closes
//! its stdin, the [`Outcome`] as one line of JSON.
//!
//! - **Which files.** `lightfoot run` (and so CMD) has a mount namespace of its own, a copy of
//!   the caller's. A fanotify group marks each of its mounts that has a page cache of its own
//!   (not proc, sysfs, tmpfs, …) for `FAN_OPEN_PERM` and close events, so only opens made in
//!   that namespace reach the watcher (`filesystems`: whole file systems, when the namespace
//!   could not be made, and then every open on the host waits). An open by a process of CMD's
//!   tree (its parent chain reaches `lightfoot run`, which is the tree's subreaper, so orphans
//!   stay in it) is held until the watcher has taken the file's first sight; any other is let
//!   through at once (the cost: one look at `/proc/PID/stat` per step of its parent chain).
//! - **First sight.** As the preload's: which 2 MiB blocks hold any page (`cachestat`,
//!   halving ranges that hold some). Taken while the opener waits, so it is exact: a late look
//!   would take the pages the program's first reads brought in for pages cached before, and a
//!   small file would be left cached whole.
//! - **While CMD runs**, every [`TICK`]: the position of each descriptor the tree has on a
//!   watched file (`/proc/PID/fdinfo`) keeps a window of one block behind and two readahead
//!   windows ahead. A block of CMD's (no page at first sight) outside every window is dropped
//!   once it has been seen there on two ticks in a row (a `pread` or mmap reader has no
//!   moving position: its pages get one tick to be used); dirty ones get their writeback
//!   started (`SYNC_FILE_RANGE_WRITE`, no wait: the program's write errors stay its own) and
//!   are dropped once clean. A file no process of the tree holds any more is dropped whole.
//! - **At the end** (`lightfoot run` closes the watcher's stdin when CMD has ended), each file
//!   is written back and dropped as in the final sweep, through the watcher's own descriptor
//!   (so files renamed to another directory, as restic does with its packs, are still found),
//!   and reported.
//!
//! - this file: the constants of the protocol and [`Watcher`], `lightfoot run`'s end;
//! - `process`: [`Watch`], the watcher process's work: the marks, the fanotify events, first
//!   sights;
//! - `track`: the files CMD's tree holds, followed every tick and dropped behind it.

mod process;
mod track;

use std::io::{BufRead, Read};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use crate::error::{Error, ErrorKind, Op, Result};

use super::FileReport;

pub use process::Watch;

/// The hidden subcommand the watcher process runs as.
pub const COMMAND: &str = "__watch";

/// The start of the watcher's first line once it watches: the mount points follow, as JSON.
pub const READY: &str = "ready ";

/// The start of its first line when it could not start: the error follows.
pub const FAILED: &str = "error: ";

/// How often the watcher looks at the files CMD has open.
pub const TICK: Duration = Duration::from_millis(20);

/// File system types with no page cache worth watching (or none at all).
pub(super) const SKIPPED_TYPES: &[&str] = &[
    "proc",
    "sysfs",
    "tmpfs",
    "devtmpfs",
    "devpts",
    "cgroup",
    "cgroup2",
    "mqueue",
    "debugfs",
    "tracefs",
    "securityfs",
    "pstore",
    "bpf",
    "autofs",
    "hugetlbfs",
    "configfs",
    "fusectl",
    "binfmt_misc",
    "ramfs",
    "nsfs",
    "efivarfs",
    "rpc_pipefs",
    "nfsd",
    "selinuxfs",
];

/// One file the watcher saw, as it reports it to `lightfoot run`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Watched {
    pub dev: u64,
    pub ino: u64,
    pub report: FileReport,
}

/// What the watcher reports when CMD has ended.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Outcome {
    /// The mount points whose file systems were watched.
    pub filesystems: Vec<PathBuf>,
    /// File systems that could not be watched, and other problems.
    pub notes: Vec<String>,
    pub files: Vec<Watched>,
}

/// `lightfoot run`'s end of a running watcher.
pub struct Watcher {
    child: Child,
    stdin: Option<ChildStdin>,
    pub filesystems: Vec<PathBuf>,
}

impl Watcher {
    /// Starts the watcher for the process tree under this process, and waits until its marks
    /// are in place. Needs root (CAP_SYS_ADMIN).
    /// `private`: this process has a mount namespace of its own (which CMD inherits), so the
    /// watcher marks its mounts, and only opens made in it wait; else whole file systems.
    pub fn start(max_cache: Option<u64>, private: bool) -> Result<Watcher> {
        let exe = std::env::current_exe()
            .map_err(|e| Error::io(Op::Watch, e).detail("cannot find lightfoot's own binary"))?;
        let mut child = Command::new(exe)
            .arg(COMMAND)
            .arg(std::process::id().to_string())
            .arg(if private { Marks::Mounts } else { Marks::Filesystems }.as_str())
            .args(max_cache.map(|m| m.to_string()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .process_group(0)
            .spawn()
            .map_err(|e| Error::io(Op::Watch, e).detail("cannot start it"))?;
        let mut line = String::new();
        let mut out = std::io::BufReader::new(child.stdout.as_mut().expect("piped"));
        let _ = out.read_line(&mut line);
        let Some(list) = line.strip_prefix(READY) else {
            let _ = child.kill();
            let _ = child.wait();
            let why = line.trim().strip_prefix(FAILED).unwrap_or("it ended before it was ready");
            // The watcher's error names its operation already ("watcher: …"): not twice.
            let why = why.strip_prefix(Op::Watch.as_str()).and_then(|w| w.strip_prefix(": ")).unwrap_or(why);
            return Err(Error::new(ErrorKind::Io, Op::Watch).detail(why));
        };
        let filesystems = serde_json::from_str(list).unwrap_or_default();
        let stdin = child.stdin.take();
        Ok(Watcher { child, stdin, filesystems })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Tells the watcher CMD has ended, and takes its report. `reaped`: the watcher already
    /// ended and was reaped by `lightfoot run`'s wait for any child.
    pub fn finish(mut self, reaped: bool) -> Result<Outcome> {
        drop(self.stdin.take());
        let mut text = String::new();
        let _ = self.child.stdout.as_mut().expect("piped").read_to_string(&mut text);
        if !reaped {
            let _ = self.child.wait();
        }
        let json = text.lines().last().unwrap_or_default();
        serde_json::from_str(json).map_err(|_| {
            let e = Error::new(ErrorKind::Io, Op::Watch);
            if reaped {
                e.detail("it ended before CMD did: files CMD opened afterwards were not watched")
            } else {
                e.detail(format!(
                    "its report is unreadable: {:?}",
                    text.chars().take(200).collect::<String>()
                ))
            }
        })
    }
}

/// What the watcher marks (its second argument).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marks {
    /// Every mount with a page cache of this mount namespace, one of `lightfoot run`'s own:
    /// only the opens made in it wait for the watcher.
    Mounts,
    /// Every file system with a page cache, once each (no mount namespace could be made):
    /// every open on the host waits.
    Filesystems,
}

impl Marks {
    pub fn as_str(self) -> &'static str {
        match self {
            Marks::Mounts => "mounts",
            Marks::Filesystems => "filesystems",
        }
    }
}

impl std::str::FromStr for Marks {
    type Err = Error;

    fn from_str(s: &str) -> Result<Marks> {
        match s {
            "mounts" => Ok(Marks::Mounts),
            "filesystems" => Ok(Marks::Filesystems),
            _ => Err(Error::invalid(Op::Parse, format!("'{s}': not mounts or filesystems"))),
        }
    }
}
