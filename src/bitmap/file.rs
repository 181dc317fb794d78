//! The bitmap file on disk ([`BitmapFile`]): found beside the image (`IMAGE.bitmaps`) or
//! where the user says, locked while in use, replaced whole on every save.
//!
//! - **Locks**: a server writing through the bitmaps, and every command that changes them,
//!   holds an exclusive `flock`; a read-only server a shared one. A second writer is refused
//!   at once rather than left waiting.
//! - **Saves** write a new file beside the old one, `fsync` it, lock it, and rename it over
//!   the old (then `fsync` the directory): a crash leaves the old file or the new one, never
//!   a mixture. The lock moves with the rename, so another process that opened the old file
//!   and then got its lock finds it replaced and opens the new one.
//! - **What happened while nobody tracked** ([`BitmapFile::resolve`]): a file still marked in
//!   use (its writer was killed) or an image that changed since the last clean close (written
//!   by something keeping no bitmap) has every enabled bitmap counted all dirty.

use std::io::Write;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::bits::Bits;
use super::format::{self, Bitmap, Sidecar};
use crate::error::{Error, ErrorKind, Op, Result};

/// The granularity of a bitmap made without one given: qemu's default too. A 1 TiB image
/// takes 2 MiB of bits.
pub const DEFAULT_GRANULARITY: u64 = 64 << 10;

/// Where an image's bitmaps are kept unless the user says otherwise: `IMAGE.bitmaps`.
pub fn default_path(image: &Path) -> PathBuf {
    let mut p = image.as_os_str().to_owned();
    p.push(".bitmaps");
    PathBuf::from(p)
}

/// What an image is now, compared at open with what it was at the last clean close: a
/// regular file's device, inode, size and change time (every write moves the change time;
/// ext4 since Linux 6.13 makes it fine-grained once it has been looked at, as here); a block
/// device's number and size only (writes through another path cannot be seen: docs).
pub fn identity(image: &Path, size: u64) -> Result<String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let m = std::fs::metadata(image).map_err(|e| Error::io(Op::Stat, e).path(image))?;
    Ok(if m.file_type().is_block_device() {
        format!("device:{}:{size}", m.rdev())
    } else {
        format!("file:{}:{}:{}:{}.{:09}", m.dev(), m.ino(), m.len(), m.ctime(), m.ctime_nsec())
    })
}

/// [`identity`] for recording at a close: first waits until the clock has left the tick of the
/// image's last change, so that a later write by another program cannot share its change time
/// (coarse timestamps: a few ms on kernels and filesystems without fine-grained ones).
pub fn settled_identity(image: &Path, size: u64) -> Result<String> {
    use std::os::unix::fs::MetadataExt;
    const TICK: std::time::Duration = std::time::Duration::from_millis(20);
    if let Ok(m) = std::fs::metadata(image) {
        let changed =
            std::time::UNIX_EPOCH + std::time::Duration::new(m.ctime().max(0) as u64, m.ctime_nsec() as u32);
        if let Ok(ago) = std::time::SystemTime::now().duration_since(changed) {
            if ago < TICK {
                std::thread::sleep(TICK - ago);
            }
        }
    }
    identity(image, size)
}

/// A random number for a new epoch.
pub fn new_epoch() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos(),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// A bitmap file, read and locked.
pub struct BitmapFile {
    path: PathBuf,
    /// The open file whose `flock` this process holds.
    lock: std::fs::File,
    exclusive: bool,
    pub sidecar: Sidecar,
}

impl BitmapFile {
    /// Opens and locks the file at `path` (exclusive to change it); `Ok(None)` if there is
    /// none. Held by another process: an error saying so.
    pub fn open(path: &Path, exclusive: bool) -> Result<Option<BitmapFile>> {
        loop {
            let f = match std::fs::File::open(path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(Error::io(Op::Bitmap, e).path(path)),
            };
            let locked = crate::io::sys::try_flock(f.as_fd(), exclusive)
                .map_err(|e| Error::io(Op::Bitmap, e).path(path).detail("lock"))?;
            if !locked {
                return Err(Error::new(ErrorKind::Permission, Op::Bitmap).path(path).detail(if exclusive {
                    "in use by another lightfoot (a server or a bitmap command)"
                } else {
                    "in use by a server writing through it"
                }));
            }
            // A save renamed a new file into place between the open and the lock: that one.
            if !same_file(&f, path) {
                continue;
            }
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut &f, &mut bytes)
                .map_err(|e| Error::io(Op::Bitmap, e).path(path))?;
            let sidecar = decode(path, &bytes)?;
            return Ok(Some(BitmapFile { path: path.to_path_buf(), lock: f, exclusive, sidecar }));
        }
    }

    /// Reads the file without a lock (a listing): what its last save wrote.
    pub fn peek(path: &Path) -> Result<Sidecar> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(Op::Bitmap, e).path(path))?;
        decode(path, &bytes)
    }

    /// A new file with no bitmaps, for an image of `size` bytes that is `image` now: made
    /// whole, locked exclusively. Another process making it first wins; this one then opens
    /// theirs.
    pub fn create(path: &Path, size: u64, image: String) -> Result<BitmapFile> {
        let sidecar = Sidecar { size, in_use: false, image, bitmaps: Vec::new() };
        let (tmp, f) = write_new(path, &format::encode(&sidecar))?;
        match crate::io::sys::rename_noreplace(&tmp, path) {
            Ok(()) => {
                sync_dir(path)?;
                Ok(BitmapFile { path: path.to_path_buf(), lock: f, exclusive: true, sidecar })
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                if e.raw_os_error() == Some(libc::EEXIST) {
                    if let Some(theirs) = BitmapFile::open(path, true)? {
                        return Ok(theirs);
                    }
                }
                Err(Error::io(Op::Bitmap, e).path(path))
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the bitmaps as they are now, durably (see the module's note on saves).
    pub fn save(&mut self) -> Result<()> {
        debug_assert!(self.exclusive, "saved under a shared lock");
        let (tmp, f) = write_new(&self.path, &format::encode(&self.sidecar))?;
        if let Err(e) = std::fs::rename(&tmp, &self.path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(Error::io(Op::Bitmap, e).path(&self.path));
        }
        self.lock = f;
        sync_dir(&self.path)
    }

    /// Accounts for writes no bitmap saw (see the module's note), given what the image is
    /// now: every enabled bitmap all dirty, and why, if there were any.
    pub fn resolve(&mut self, image_now: &str) -> Option<&'static str> {
        let s = &mut self.sidecar;
        let why = if s.in_use {
            "its last writer did not close it cleanly"
        } else if !s.image.is_empty() && s.image != image_now {
            "the image changed since its last clean close, written by something keeping no bitmap"
        } else {
            s.image = image_now.to_string();
            return None;
        };
        for b in s.bitmaps.iter().filter(|b| b.enabled) {
            b.bits.mark_all();
        }
        s.in_use = false;
        s.image = image_now.to_string();
        Some(why)
    }

    /// Adds an empty, enabled bitmap.
    pub fn add(&mut self, name: &str, granularity: u64) -> Result<()> {
        format::check_name(name).map_err(|e| self.invalid(e))?;
        format::check_granularity(granularity).map_err(|e| self.invalid(e))?;
        if self.sidecar.get(name).is_some() {
            return Err(self.invalid(format!("a bitmap named '{name}' exists already")));
        }
        if self.sidecar.bitmaps.len() >= format::MAX_BITMAPS {
            return Err(
                self.invalid(format!("{} bitmaps already, the most one file holds", format::MAX_BITMAPS))
            );
        }
        let bits = Arc::new(Bits::new(self.sidecar.size, granularity));
        self.sidecar.bitmaps.push(Bitmap {
            name: name.to_string(),
            enabled: true,
            epoch: new_epoch(),
            parent: 0,
            bits,
        });
        Ok(())
    }

    /// The bitmap named `name`, or an error naming the ones there are.
    pub fn get(&self, name: &str) -> Result<&Bitmap> {
        self.sidecar.get(name).ok_or_else(|| missing(&self.path, &self.sidecar, name))
    }

    pub fn get_mut(&mut self, name: &str) -> Result<&mut Bitmap> {
        let path = &self.path;
        let s = &mut self.sidecar;
        let err = missing(path, s, name);
        s.bitmaps.iter_mut().find(|b| b.name == name).ok_or(err)
    }

    fn invalid(&self, why: String) -> Error {
        Error::new(ErrorKind::InvalidInput, Op::Bitmap).path(&self.path).detail(why)
    }
}

/// "no bitmap 'x'", with the names there are.
pub fn missing(path: &Path, s: &Sidecar, name: &str) -> Error {
    let there = match s.names() {
        n if n.is_empty() => "it holds none".to_string(),
        n => format!("it holds: {}", n.join(", ")),
    };
    Error::new(ErrorKind::NotFound, Op::Bitmap)
        .path(path)
        .detail(format!("no bitmap named '{name}' ({there})"))
}

/// The file at `path`'s bytes read, or an error naming it and what is wrong.
fn decode(path: &Path, bytes: &[u8]) -> Result<Sidecar> {
    format::decode(bytes)
        .map_err(|why| Error::new(ErrorKind::InvalidInput, Op::Bitmap).path(path).detail(why))
}

fn same_file(f: &std::fs::File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (f.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Writes `bytes` to a new file beside `path`, durably, and locks it: its name and the file.
fn write_new(path: &Path, bytes: &[u8]) -> Result<(PathBuf, std::fs::File)> {
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".new.{}.{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed)));
    let tmp = PathBuf::from(tmp);
    let written = (|| {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        if !crate::io::sys::try_flock(f.as_fd(), true)? {
            return Err(std::io::Error::new(
                std::io::ErrorKind::WouldBlock,
                "new file locked by another process",
            ));
        }
        Ok(f)
    })();
    match written {
        Ok(f) => Ok((tmp, f)),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(Error::io(Op::Bitmap, e).path(path))
        }
    }
}

fn sync_dir(path: &Path) -> Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io(Op::Bitmap, e).path(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saves_are_whole_and_locks_follow_them() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("img.bitmaps");
        assert!(BitmapFile::open(&p, true).unwrap().is_none());
        let mut f = BitmapFile::create(&p, 1 << 20, "file:a".into()).unwrap();
        f.add("n", 4096).unwrap();
        f.get("n").unwrap().bits.mark(5000, 1);
        f.save().unwrap();
        // Locked across the save: others are refused, shared or not.
        let e = BitmapFile::open(&p, false).err().unwrap();
        assert!(e.to_string().contains("in use"), "{e}");
        assert!(BitmapFile::open(&p, true).is_err());
        assert_eq!(BitmapFile::peek(&p).unwrap().get("n").unwrap().bits.dirty_bytes(), 4096);
        drop(f);
        let f = BitmapFile::open(&p, false).unwrap().unwrap();
        let g = BitmapFile::open(&p, false).unwrap().unwrap(); // shared with a reader
        assert!(BitmapFile::open(&p, true).is_err());
        let e = f.get("m").err().unwrap().to_string();
        assert!(e.contains("no bitmap named 'm' (it holds: n)"), "{e}");
        drop((f, g));
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["img.bitmaps"], "no temporary file left");
    }

    #[test]
    fn unseen_writes_make_enabled_bitmaps_all_dirty() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("img.bitmaps");
        let mut f = BitmapFile::create(&p, 1 << 20, "file:a".into()).unwrap();
        f.add("on", 65536).unwrap();
        f.add("off", 65536).unwrap();
        f.get_mut("off").unwrap().enabled = false;
        assert_eq!(f.resolve("file:a"), None);
        assert_eq!(f.get("on").unwrap().bits.dirty_bytes(), 0);
        // Another writer changed the image.
        assert!(f.resolve("file:b").unwrap().contains("changed"));
        assert_eq!(f.get("on").unwrap().bits.dirty_bytes(), 1 << 20);
        assert_eq!(f.get("off").unwrap().bits.dirty_bytes(), 0, "a closed epoch is kept");
        assert_eq!(f.sidecar.image, "file:b");
        // A writer that never closed.
        f.get("on").unwrap().bits.clear();
        f.sidecar.in_use = true;
        assert!(f.resolve("file:b").unwrap().contains("cleanly"));
        assert!(!f.sidecar.in_use && f.get("on").unwrap().bits.dirty_bytes() == 1 << 20);
    }
}
