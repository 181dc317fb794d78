//! The bitmap file ([`BitmapFile`]): found beside the image (`IMAGE.bitmaps`) or where the
//! user says, locked while in use, replaced whole on every save. An `s3://` block image's is
//! an object beside its blocks ([`Location::Object`]); its lease stands in for the locks.
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

use bytes::Bytes;

use super::bits::Bits;
use super::format::{self, Bitmap, Sidecar};
use crate::backend::s3::store::replacing;
use crate::backend::s3::Store;
use crate::error::{Error, ErrorKind, Op, Result};

/// The bitmaps of an `s3://` block image: the object `KEY/lightfoot.bitmaps`, beside its
/// blocks (sorts after them, so nbdkit's TRIM leaves it, as the manifest).
pub const OBJECT: &str = "lightfoot.bitmaps";

/// Where a bitmap file is kept.
#[derive(Clone)]
pub enum Location {
    /// A file, `flock`ed while in use (see the module's note).
    File(PathBuf),
    /// An object beside an `s3://` block image's blocks. One writer at a time by the image's
    /// lease, which a writing server and every command that changes the bitmaps hold;
    /// saves are conditional on the version read, so a writer without it fails. `busy`:
    /// another server holds the lease, its marks in its memory (as a file's lock held).
    Object { store: Arc<Store>, key: String, busy: bool },
}

impl Location {
    /// The bitmaps of the `s3://` block image under `image_key`; `busy` as above.
    pub fn beside(store: Arc<Store>, image_key: &str, busy: bool) -> Location {
        Location::Object { store, key: format!("{image_key}/{OBJECT}"), busy }
    }

    /// What messages call it: the file's path, or the object's URI.
    pub fn name(&self) -> PathBuf {
        match self {
            Location::File(p) => p.clone(),
            Location::Object { store, key, .. } => PathBuf::from(store.uri(key)),
        }
    }
}

/// What this process holds of an open bitmap file.
enum Held {
    /// The open file whose `flock` it holds.
    Lock(std::fs::File),
    /// The object and the ETag of the version read or last saved (`None`: the store gives
    /// none).
    Object { store: Arc<Store>, key: String, etag: Option<String> },
}

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
    /// What messages call it ([`Location::name`]).
    path: PathBuf,
    held: Held,
    exclusive: bool,
    pub sidecar: Sidecar,
}

impl BitmapFile {
    /// Opens the bitmap file at `at` (a file: locked, exclusively to change it); `Ok(None)`
    /// if there is none. A file held by another process: an error saying so.
    pub fn open(at: &Location, exclusive: bool) -> Result<Option<BitmapFile>> {
        match at {
            Location::File(path) => BitmapFile::open_file(path, exclusive),
            Location::Object { store, key, busy } => {
                let path = at.name();
                if *busy {
                    return Err(in_use(&path, exclusive));
                }
                let Some((bytes, meta)) = store.run(store.get(key, None, None))? else { return Ok(None) };
                let sidecar = decode(&path, &bytes)?;
                let held = Held::Object { store: store.clone(), key: key.clone(), etag: meta.etag };
                Ok(Some(BitmapFile { path, held, exclusive, sidecar }))
            }
        }
    }

    fn open_file(path: &Path, exclusive: bool) -> Result<Option<BitmapFile>> {
        loop {
            let f = match std::fs::File::open(path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(Error::io(Op::Bitmap, e).path(path)),
            };
            let locked = crate::io::sys::try_flock(f.as_fd(), exclusive)
                .map_err(|e| Error::io(Op::Bitmap, e).path(path).detail("lock"))?;
            if !locked {
                return Err(in_use(path, exclusive));
            }
            // A save renamed a new file into place between the open and the lock: that one.
            if !same_file(&f, path) {
                continue;
            }
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut &f, &mut bytes)
                .map_err(|e| Error::io(Op::Bitmap, e).path(path))?;
            let sidecar = decode(path, &bytes)?;
            return Ok(Some(BitmapFile {
                path: path.to_path_buf(),
                held: Held::Lock(f),
                exclusive,
                sidecar,
            }));
        }
    }

    /// Reads the file without a lock (a listing): what its last save wrote.
    pub fn peek(at: &Location) -> Result<Sidecar> {
        let path = at.name();
        let bytes = match at {
            Location::File(p) => std::fs::read(p).map_err(|e| Error::io(Op::Bitmap, e).path(p))?,
            Location::Object { store, key, .. } => match store.run(store.get(key, None, None))? {
                Some((bytes, _)) => bytes.to_vec(),
                None => return Err(no_file(&path)),
            },
        };
        decode(&path, &bytes)
    }

    /// A new file with no bitmaps, for an image of `size` bytes that is `image` now: made
    /// whole, locked exclusively. Another process making it first wins; this one then opens
    /// theirs.
    pub fn create(at: &Location, size: u64, image: String) -> Result<BitmapFile> {
        let sidecar = Sidecar { size, in_use: false, image, bitmaps: Vec::new() };
        let path = at.name();
        let made = match at {
            Location::File(p) => {
                let (tmp, f) = write_new(p, &format::encode(&sidecar))?;
                match crate::io::sys::rename_noreplace(&tmp, p) {
                    Ok(()) => {
                        sync_dir(p)?;
                        Some(Held::Lock(f))
                    }
                    Err(e) => {
                        let _ = std::fs::remove_file(&tmp);
                        if e.raw_os_error() != Some(libc::EEXIST) {
                            return Err(Error::io(Op::Bitmap, e).path(p));
                        }
                        None
                    }
                }
            }
            Location::Object { store, key, .. } => {
                let body = Bytes::from(format::encode(&sidecar));
                store.run(store.put(key, body, replacing(None)))?.map(|(etag, _)| Held::Object {
                    store: store.clone(),
                    key: key.clone(),
                    etag,
                })
            }
        };
        match made {
            Some(held) => Ok(BitmapFile { path, held, exclusive: true, sidecar }),
            None => BitmapFile::open(at, true)?.ok_or_else(|| {
                Error::new(ErrorKind::Io, Op::Bitmap)
                    .path(&path)
                    .detail("made and removed at once by another process")
            }),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the bitmaps as they are now, durably (see the module's note on saves).
    /// An object is replaced only if it is still the version read or last saved: one PUT,
    /// stored whole once answered.
    pub fn save(&mut self) -> Result<()> {
        debug_assert!(self.exclusive, "saved under a shared lock");
        let bytes = format::encode(&self.sidecar);
        match &mut self.held {
            Held::Lock(lock) => {
                let (tmp, f) = write_new(&self.path, &bytes)?;
                if let Err(e) = std::fs::rename(&tmp, &self.path) {
                    let _ = std::fs::remove_file(&tmp);
                    return Err(Error::io(Op::Bitmap, e).path(&self.path));
                }
                *lock = f;
                sync_dir(&self.path)
            }
            Held::Object { store, key, etag } => {
                match store.run(store.put(key, Bytes::from(bytes), replacing(Some(etag))))? {
                    Some((new, _)) => {
                        *etag = new;
                        Ok(())
                    }
                    None => Err(Error::new(ErrorKind::Io, Op::Bitmap).path(&self.path).detail(
                        "replaced by another writer since it was read (one without the image's lease?): not saved",
                    )),
                }
            }
        }
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

    /// Its bitmaps cover an image of `size` bytes: else an error (the image was resized, or
    /// the file is another image's).
    pub fn check_size(&self, size: u64) -> Result<()> {
        if self.sidecar.size == size {
            return Ok(());
        }
        Err(self.invalid(format!(
            "its bitmaps are for an image of {} bytes, this one has {size} (remove the file and start again \
             from a full copy)",
            self.sidecar.size
        )))
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

/// Held by another process: one writing through the bitmaps (or, `exclusive`, any holder).
fn in_use(path: &Path, exclusive: bool) -> Error {
    Error::new(ErrorKind::Permission, Op::Bitmap).path(path).detail(if exclusive {
        "in use by another lightfoot (a server or a bitmap command)"
    } else {
        "in use by a server writing through it"
    })
}

/// "no such file", for a bitmap file that does not exist.
pub fn no_file(path: &Path) -> Error {
    Error::new(ErrorKind::NotFound, Op::Bitmap).path(path).detail("no such file")
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
        let p = Location::File(dir.path().join("img.bitmaps"));
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
        let p = Location::File(dir.path().join("img.bitmaps"));
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
