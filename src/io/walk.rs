//! The files of directory trees, for `lightfoot cache stat|evict -r` (docs/cache.md,
//! "Directory trees").
//!
//! [`Walk`] goes through its roots one after the other (with the `walkdir` crate) and yields
//! each regular file once, opened read-only, or an error that names the path it happened at;
//! what it passes over it counts in [`Skipped`]. The rules:
//!
//! - A symlink inside a tree is counted, not followed, unless [`WalkOptions::follow_symlinks`]
//!   (du -L, find -L; walkdir then reports loops back to an ancestor instead of going round).
//!   A root that is a symlink is always followed (du -H): the user named it.
//! - The walk stays on the file system of each root (du -x, find -xdev) unless
//!   [`WalkOptions::cross_mounts`]; mount points it does not enter are counted.
//! - A file reached twice is counted once, by `(st_dev, st_ino)`: files with more than one
//!   link, and every file when symlinks are followed or there are several roots, since then
//!   any file may be reached twice. The set holds only those files; nothing else of the tree
//!   is kept (walkdir holds one open directory per level).
//! - FIFOs, sockets and devices are counted from their directory entry, never opened: opening
//!   a FIFO would block, or wake the program at its other end. A regular file is opened with
//!   `O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC` and checked again with `fstat`, so one swapped for a
//!   FIFO or a symlink since its directory was read is counted as such, without a hang.
//!   A block device is looked at only when named as a root.
//!
//! Not closed: walkdir opens directories by path, so a directory replaced by a symlink between
//! its parent's read and its own open would be followed. The walk writes nothing and reads no
//! data, so the most that race changes is which files are measured or evicted; an
//! `openat`-based walk would close it, at the cost of a walker of our own.
//!
//! Files are opened read-only, as [`super::residency::open`] does, for the reasons given
//! there.

use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorKind, Op, Result};

/// How to walk.
#[derive(Debug, Clone, Copy, Default)]
pub struct WalkOptions {
    /// Follow symlinks found in the trees (roots that are symlinks are followed anyway).
    pub follow_symlinks: bool,
    /// Enter directories on other file systems than their root's.
    pub cross_mounts: bool,
}

/// What a walk passed over, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Skipped {
    /// FIFOs, sockets and devices (and block devices inside a tree): never opened.
    pub not_regular: u64,
    /// Symlinks not followed.
    pub symlinks: u64,
    /// Directories on another file system, not entered.
    pub mounts: u64,
    /// Files reached again (another hard link, a second path through a followed symlink or
    /// an overlapping root): counted once.
    pub duplicates: u64,
}

/// A regular file the walk found (or a block device named as a root), opened read-only.
#[derive(Debug)]
pub struct Found {
    pub path: PathBuf,
    pub file: File,
}

/// The regular files under some roots, each once (see the module's rules).
pub struct Walk {
    opts: WalkOptions,
    roots: std::vec::IntoIter<PathBuf>,
    tree: Option<walkdir::IntoIter>,
    /// `st_dev` of the current root, to count the mount points walkdir does not enter.
    root_dev: Option<u64>,
    seen: HashSet<(u64, u64)>,
    /// Whether every file goes into `seen`, not only those with several links.
    record_all: bool,
    skipped: Skipped,
}

impl Walk {
    pub fn new(roots: Vec<PathBuf>, opts: WalkOptions) -> Walk {
        let record_all = opts.follow_symlinks || roots.len() > 1;
        Walk {
            opts,
            roots: roots.into_iter(),
            tree: None,
            root_dev: None,
            seen: HashSet::new(),
            record_all,
            skipped: Skipped::default(),
        }
    }

    /// What the walk has passed over so far.
    pub fn skipped(&self) -> Skipped {
        self.skipped
    }

    fn start(&mut self, root: PathBuf) {
        // Up to 64 directories open at once: past that depth walkdir reads the rest of the
        // oldest open one into memory (10 by default; a deep tree with a huge directory near
        // the top would then hold all its names).
        let tree = walkdir::WalkDir::new(root)
            .follow_links(self.opts.follow_symlinks)
            .follow_root_links(true)
            .same_file_system(!self.opts.cross_mounts)
            .max_open(64);
        self.tree = Some(tree.into_iter());
        self.root_dev = None;
    }

    /// What to yield for one entry of the tree, if anything.
    fn visit(&mut self, entry: walkdir::DirEntry) -> Option<Result<Found>> {
        let path = entry.path();
        let mut kind = entry.file_type();
        if entry.depth() == 0 {
            // A root: followed if it is a symlink, and the file system the walk stays on.
            let meta = match std::fs::metadata(path) {
                Ok(m) => m,
                Err(e) => return Some(Err(Error::io(Op::Walk, e).path(path))),
            };
            self.root_dev = Some(meta.dev());
            kind = meta.file_type();
            if kind.is_block_device() {
                return self.open(path, true, true).transpose();
            }
        }
        if kind.is_dir() {
            if entry.depth() > 0 && !self.opts.cross_mounts {
                // walkdir leaves it unentered if it is on another file system: count it.
                match entry.metadata() {
                    Ok(m) if Some(m.dev()) != self.root_dev => self.skipped.mounts += 1,
                    Ok(_) => {}
                    Err(e) => return Some(Err(walk_error(e))),
                }
            }
            return None;
        }
        if kind.is_symlink() {
            // Only here when symlinks are not followed (walkdir resolves them otherwise).
            self.skipped.symlinks += 1;
            return None;
        }
        if !kind.is_file() {
            self.skipped.not_regular += 1;
            return None;
        }
        let follow = entry.depth() == 0 || entry.path_is_symlink();
        self.open(path, follow, false).transpose()
    }

    /// Opens a file the directory entry says is regular (or a block device named as a root);
    /// `None` when it is not one after all, or was already counted.
    fn open(&mut self, path: &Path, follow: bool, block_ok: bool) -> Result<Option<Found>> {
        let file = match open_entry(path, follow) {
            Ok(f) => f,
            // O_NOFOLLOW's answer: replaced by a symlink since its directory was read.
            Err(e) if !follow && e.raw_os_error() == Some(libc::ELOOP) => {
                self.skipped.symlinks += 1;
                return Ok(None);
            }
            Err(e) => return Err(Error::io(Op::Open, e).path(path)),
        };
        let meta = file.metadata().map_err(|e| Error::io(Op::Stat, e).path(path))?;
        let kind = meta.file_type();
        if !(kind.is_file() || block_ok && kind.is_block_device()) {
            self.skipped.not_regular += 1;
            return Ok(None);
        }
        if (self.record_all || meta.nlink() > 1) && !self.seen.insert((meta.dev(), meta.ino())) {
            self.skipped.duplicates += 1;
            return Ok(None);
        }
        Ok(Some(Found { path: path.to_path_buf(), file }))
    }
}

impl Iterator for Walk {
    type Item = Result<Found>;

    fn next(&mut self) -> Option<Result<Found>> {
        loop {
            let Some(tree) = self.tree.as_mut() else {
                let root = self.roots.next()?;
                self.start(root);
                continue;
            };
            match tree.next() {
                None => self.tree = None,
                Some(Err(e)) => return Some(Err(walk_error(e))),
                Some(Ok(entry)) => {
                    if let Some(found) = self.visit(entry) {
                        return Some(found);
                    }
                }
            }
        }
    }
}

/// Opens a file read-only without blocking (a FIFO would wait for a writer; a file under
/// another program's lease would wait for the lease to be broken) and, unless `follow`,
/// without following a symlink. `O_CLOEXEC` is std's default; named for the reader.
fn open_entry(path: &Path, follow: bool) -> std::io::Result<File> {
    let nofollow = if follow { 0 } else { libc::O_NOFOLLOW };
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | nofollow)
        .open(path)
}

/// walkdir's error as ours: the path, and a loop or the OS error.
fn walk_error(e: walkdir::Error) -> Error {
    let path = e.path().map(Path::to_path_buf).unwrap_or_default();
    if let Some(ancestor) = e.loop_ancestor() {
        let detail = format!("a symlink loop back to {}: not followed", ancestor.display());
        return Error::new(ErrorKind::InvalidInput, Op::Walk).path(path).detail(detail);
    }
    match e.into_io_error() {
        Some(io) => Error::io(Op::Walk, io).path(path),
        None => Error::new(ErrorKind::Io, Op::Walk).path(path),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A FIFO where a regular file was listed: the open returns at once and the fstat check
    /// counts it, where a blocking open would wait for a writer forever.
    #[test]
    fn a_fifo_in_place_of_a_file_is_counted_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut walk = Walk::new(vec![], WalkOptions::default());
            let got = walk.open(&fifo, false, false).map(|f| f.is_none());
            let _ = tx.send((got, walk.skipped()));
        });
        let (got, skipped) =
            rx.recv_timeout(std::time::Duration::from_secs(10)).expect("opening a FIFO blocked");
        assert!(got.unwrap(), "a FIFO was taken for a regular file");
        assert_eq!(skipped.not_regular, 1);
    }

    /// A symlink where a regular file was listed is not followed: O_NOFOLLOW refuses it.
    #[test]
    fn a_symlink_in_place_of_a_file_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("target"), b"x").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink("target", &link).unwrap();
        let mut walk = Walk::new(vec![], WalkOptions::default());
        assert!(walk.open(&link, false, false).unwrap().is_none());
        assert_eq!(walk.skipped().symlinks, 1);
        assert!(walk.open(&link, true, false).unwrap().is_some(), "a root symlink is followed");
    }
}
