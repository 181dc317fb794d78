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

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{BufRead, Read};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use lightfoot_record::{Header, ALL_CACHED, BLOCK, SHIFT};

use super::{FileReport, Record};
use crate::error::{io_message, Error, ErrorKind, Op, Result};
use crate::io::sys::{self, Advice, FanEvent, Fanotify};

/// The hidden subcommand the watcher process runs as.
pub const COMMAND: &str = "__watch";

/// The start of the watcher's first line once it watches: the mount points follow, as JSON.
pub const READY: &str = "ready ";
/// The start of its first line when it could not start: the error follows.
pub const FAILED: &str = "error: ";

/// How often the watcher looks at the files CMD has open.
pub const TICK: Duration = Duration::from_millis(20);

/// File system types with no page cache worth watching (or none at all).
const SKIPPED_TYPES: &[&str] = &[
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

/// The watcher process at work: its marks, the thread that answers opens and the one that
/// drops what CMD's tree brings in.
pub struct Watch {
    filesystems: Vec<PathBuf>,
    notes: Vec<String>,
    stop: Arc<AtomicBool>,
    handler: std::thread::JoinHandle<Result<()>>,
    scanner: std::thread::JoinHandle<Vec<Tracked>>,
}

impl Watch {
    /// Starts watching the tree of `parent` (`lightfoot run`): the first sight of the files it
    /// holds as its standard streams, then the marks, then the two threads. `bounded`:
    /// `--max-cache` was given. Fails if fanotify is refused (it needs root) or no file system
    /// could be marked.
    pub fn start(parent: u32, marks: Marks, bounded: bool) -> Result<Watch> {
        let fan =
            Fanotify::new().map_err(|e| Error::io(Op::Watch, e).detail("fanotify, which needs root"))?;
        // The files CMD inherits from `lightfoot run` (shell redirections) are never opened by
        // it: their first sight is now, before the marks (opening them afterwards would wait on
        // ourselves).
        let mut inherited = Vec::new();
        for n in 0..3 {
            if let Ok(f) = File::open(format!("/proc/{parent}/fd/{n}")) {
                if f.metadata().is_ok_and(|m| m.is_file()) {
                    inherited.push(first_sight(OwnedFd::from(f), parent));
                }
            }
        }
        let (filesystems, notes) = mark_filesystems(&fan, marks == Marks::Filesystems);
        if filesystems.is_empty() {
            return Err(Error::new(ErrorKind::NotFound, Op::Watch)
                .detail(format!("no file system could be watched: {}", notes.join("; "))));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        for s in inherited {
            let _ = tx.send(Msg::Seen(Box::new(s)));
        }
        let handler = {
            let stop = stop.clone();
            std::thread::spawn(move || handle_events(fan, parent, tx, &stop))
        };
        // The scanner ends when the handler has ended and its messages are read.
        let scanner = std::thread::spawn(move || scan(rx, bounded));
        Ok(Watch { filesystems, notes, stop, handler, scanner })
    }

    /// The mount points whose file systems are watched.
    pub fn filesystems(&self) -> &[PathBuf] {
        &self.filesystems
    }

    /// Stops watching (CMD has ended): the marks go, opens still waiting are let through, and
    /// every file is written back and dropped to its first sight; the report.
    pub fn finish(self) -> Outcome {
        let Watch { filesystems, mut notes, stop, handler, scanner } = self;
        stop.store(true, Ordering::Release);
        match handler.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => notes.push(e.to_string()),
            Err(_) => notes.push("the event handler panicked".into()),
        }
        let files = scanner.join().map(finish_all).unwrap_or_else(|_| {
            notes.push("the scanner panicked".into());
            Vec::new()
        });
        Outcome { filesystems, notes, files }
    }
}

/// Marks every file system with a page cache, once each (`whole`), or every mount of one in
/// this mount namespace; what was marked and what failed.
fn mark_filesystems(fan: &Fanotify, whole: bool) -> (Vec<PathBuf>, Vec<String>) {
    let mut marked = Vec::new();
    let mut notes = Vec::new();
    let mut seen = HashSet::new();
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for line in info.lines() {
        let Some((left, right)) = line.split_once(" - ") else { continue };
        let f: Vec<&str> = left.split(' ').collect();
        let fstype = right.split(' ').next().unwrap_or_default();
        // FUSE file systems (`fuse.sshfs`, …) are served by a process that could be CMD's.
        if f.len() < 5 || SKIPPED_TYPES.contains(&fstype) || fstype.starts_with("fuse.") {
            continue;
        }
        if whole && !seen.insert(f[2].to_string()) {
            continue;
        }
        let mount = PathBuf::from(unescape(f[4]));
        match fan.mark(&mount, whole) {
            Ok(()) => marked.push(mount),
            Err(e) => notes.push(format!("{} ({fstype}) not watched: {}", mount.display(), io_message(&e))),
        }
    }
    (marked, notes)
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// What the event handler tells the scanner.
enum Msg {
    /// A file's first sight, with the watcher's own descriptor of it.
    Seen(Box<Sight>),
    /// A process of the tree opened a file seen before.
    Opened { key: (u64, u64), fd: OwnedFd, pid: u32 },
    /// A seen file was closed by someone.
    Closed { key: (u64, u64) },
}

struct Sight {
    record: Record,
    fd: OwnedFd,
}

/// Answers every open on the watched file systems; takes the first sight of files the tree
/// opens. Returns when `stop` is set (dropping the group removes the marks; opens still
/// waiting are let through by the kernel).
fn handle_events(fan: Fanotify, parent: u32, tx: mpsc::Sender<Msg>, stop: &AtomicBool) -> Result<()> {
    let own = std::process::id();
    let mut tree = Tree::new(parent, own);
    let mut known: HashSet<(u64, u64)> = HashSet::new();
    let mut buf = vec![0u8; 64 << 10];
    while !stop.load(Ordering::Acquire) {
        let events =
            fan.read(&mut buf, 100).map_err(|e| Error::io(Op::Watch, e).detail("reading fanotify events"))?;
        for ev in events {
            match ev {
                FanEvent::OpenPerm { fd, pid } => {
                    if pid != own && pid != parent && tree.contains(pid) {
                        if let Some(msg) = look(&fd, pid, &mut known) {
                            let _ = tx.send(msg);
                        }
                    }
                    // Always answered, whatever happened above: the opener waits for it.
                    fan.allow(&fd).map_err(|e| Error::io(Op::Watch, e).detail("answering fanotify"))?;
                }
                FanEvent::Close { fd, .. } => {
                    if let Ok(m) = std::fs::File::from(fd).metadata() {
                        let key = (m.dev(), m.ino());
                        if known.contains(&key) {
                            let _ = tx.send(Msg::Closed { key });
                        }
                    }
                }
                FanEvent::Overflow => {}
            }
        }
    }
    Ok(())
}

/// What an open by the tree means: a first sight, another open of a file seen before, or
/// nothing (not a regular file).
fn look(fd: &OwnedFd, pid: u32, known: &mut HashSet<(u64, u64)>) -> Option<Msg> {
    let file = File::from(fd.try_clone().ok()?);
    let m = file.metadata().ok().filter(|m| m.is_file())?;
    let key = (m.dev(), m.ino());
    Some(if known.insert(key) {
        Msg::Seen(Box::new(first_sight(OwnedFd::from(file), pid)))
    } else {
        Msg::Opened { key, fd: OwnedFd::from(file), pid }
    })
}

/// Which processes are CMD's tree: those whose parent chain reaches `lightfoot run`.
struct Tree {
    parent: u32,
    own: u32,
    /// pid → (start time, in the tree), so a reused pid is looked at again.
    known: HashMap<u32, (u64, bool)>,
}

impl Tree {
    fn new(parent: u32, own: u32) -> Self {
        Tree { parent, own, known: HashMap::new() }
    }

    fn contains(&mut self, pid: u32) -> bool {
        let mut chain = Vec::new();
        let mut p = pid;
        let verdict = loop {
            if p == self.own || p <= 1 || chain.len() > 256 {
                break false;
            }
            let Some((ppid, start)) = stat(p) else { break false };
            if let Some(&(s, v)) = self.known.get(&p) {
                if s == start {
                    break v;
                }
            }
            chain.push((p, start));
            if ppid == self.parent {
                break true;
            }
            p = ppid;
        };
        for (p, s) in chain {
            self.known.insert(p, (s, verdict));
        }
        verdict
    }
}

/// A process's parent and start time, from `/proc/PID/stat`.
fn stat(pid: u32) -> Option<(u32, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    Some((f.get(1)?.parse().ok()?, f.get(19)?.parse().ok()?))
}

/// The first sight of a file through the watcher's own descriptor.
fn first_sight(fd: OwnedFd, pid: u32) -> Sight {
    let file = File::from(fd);
    let meta = file.metadata();
    let (dev, ino, size) = meta.as_ref().map_or((0, 0, 0), |m| (m.dev(), m.ino(), m.len()));
    let path = path_of(&file).unwrap_or_default();
    let blocks = size.div_ceil(BLOCK);
    let mut bits = vec![0u8; lightfoot_record::bitmap_len(blocks)];
    let mut flags = 0;
    let mut cached_pages = 0;
    match sys::cachestat(file.as_fd(), 0, 0) {
        Ok(c) => {
            cached_pages = c.cached;
            // A failed look: taken for cached, so nothing of the file is ever dropped.
            if !resident(&file, 0, blocks.max(1), c, |b, _| lightfoot_record::set(&mut bits, b)) {
                flags |= ALL_CACHED;
            }
        }
        Err(e) => flags |= lightfoot_record::not_covered(e.raw_os_error().unwrap_or(0), false),
    }
    // As the library would record it (the descriptor: the watcher's own).
    let mut header = Header::new(flags, pid, file.as_raw_fd(), dev, ino, path.as_os_str().len(), bits.len());
    (header.size, header.cached_pages) = (size, cached_pages);
    Sight { record: Record { header, path, bits }, fd: OwnedFd::from(file) }
}

/// A file of the tree's, as the scanner keeps it.
struct Tracked {
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
fn scan(rx: mpsc::Receiver<Msg>, bounded: bool) -> Vec<Tracked> {
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
fn read_ahead_bytes() -> u64 {
    std::fs::metadata("/").map_or(8 << 20, |m| crate::io::file::read_ahead_bytes(m.dev()))
}

/// The file positions of every descriptor the tree's processes hold on a tracked file;
/// processes that ended are forgotten.
fn positions(pids: &mut HashSet<u32>, files: &HashMap<(u64, u64), Tracked>) -> HashMap<(u64, u64), Vec<u64>> {
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
fn step(t: &mut Tracked, window: Option<&Vec<u64>>, ahead: u64, bounded: bool) {
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
fn resident(
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
fn finish_all(files: Vec<Tracked>) -> Vec<Watched> {
    let page = sys::page_size() as u64;
    let mut renamed = super::Renamed::new();
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
                    super::finish_open(file, &report.path, r, t.written)
                }
                None => super::finish_file(r, t.written, &mut renamed).map(|(p, after, evicted)| {
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
fn path_of(file: &File) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape(r"/mnt/a\040b\011c\134d"), "/mnt/a b\tc\\d");
        assert_eq!(unescape("/plain"), "/plain");
        assert_eq!(unescape(r"/end\04"), r"/end\04");
    }

    #[test]
    fn this_process_is_in_its_parents_tree_and_not_in_its_own() {
        let me = std::process::id();
        let parent = stat(me).unwrap().0;
        assert!(Tree::new(parent, 0).contains(me));
        assert!(!Tree::new(me, 0).contains(parent));
        assert!(!Tree::new(parent, me).contains(me), "the watcher's own opens are never held for it");
    }
}
