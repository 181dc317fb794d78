//! The watcher process's work ([`Watch`]): marks on the mounts or file systems, the fanotify
//! events answered, and the first sight of each file CMD's tree opens.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use lightfoot_record::{Header, ALL_CACHED, BLOCK};

use crate::error::{io_message, Error, ErrorKind, Op, Result};
use crate::io::sys::{self, FanEvent, Fanotify};
use crate::run::Record;

use super::track::{finish_all, path_of, resident, scan, Tracked};
use super::{Marks, Outcome, SKIPPED_TYPES};

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
pub(super) fn mark_filesystems(fan: &Fanotify, whole: bool) -> (Vec<PathBuf>, Vec<String>) {
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
pub(super) fn unescape(s: &str) -> String {
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
pub(super) enum Msg {
    /// A file's first sight, with the watcher's own descriptor of it.
    Seen(Box<Sight>),
    /// A process of the tree opened a file seen before.
    Opened { key: (u64, u64), fd: OwnedFd, pid: u32 },
    /// A seen file was closed by someone.
    Closed { key: (u64, u64) },
}

pub(super) struct Sight {
    pub(super) record: Record,
    pub(super) fd: OwnedFd,
}

/// Answers every open on the watched file systems; takes the first sight of files the tree
/// opens. Returns when `stop` is set (dropping the group removes the marks; opens still
/// waiting are let through by the kernel).
pub(super) fn handle_events(
    fan: Fanotify,
    parent: u32,
    tx: mpsc::Sender<Msg>,
    stop: &AtomicBool,
) -> Result<()> {
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
pub(super) fn look(fd: &OwnedFd, pid: u32, known: &mut HashSet<(u64, u64)>) -> Option<Msg> {
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
pub(super) struct Tree {
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
pub(super) fn stat(pid: u32) -> Option<(u32, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    Some((f.get(1)?.parse().ok()?, f.get(19)?.parse().ok()?))
}

/// The first sight of a file through the watcher's own descriptor.
pub(super) fn first_sight(fd: OwnedFd, pid: u32) -> Sight {
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
