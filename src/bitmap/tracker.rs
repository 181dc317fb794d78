//! [`Tracker`]: the bitmaps of a server while it runs. Every WRITE, WRITE_ZEROES and TRIM
//! marks the enabled ones before it reaches the layers below (so `--coalesce`'s later
//! write-back is covered by the mark of the write it holds); clients read them all as
//! `qemu:dirty-bitmap:NAME`.
//!
//! Never a missed write: before the first write is taken, the file is saved marked in use
//! (durably); only a clean close saves it unmarked. Killed in between, the next open finds it
//! in use and counts every enabled bitmap all dirty ([`BitmapFile::resolve`]). Marks cost a
//! bit set in memory, never a write of their own.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::bits::Bits;
use super::file::{BitmapFile, Location, DEFAULT_GRANULARITY};
use crate::error::Result;

pub struct Tracker {
    file: Mutex<BitmapFile>,
    /// Every bitmap in the file, as clients see them, in the file's order.
    names: Vec<String>,
    bits: Vec<Arc<Bits>>,
    /// Each one's epoch and parent (see `format::Bitmap`).
    epochs: Vec<(u64, u64)>,
    /// The enabled ones: what writes mark.
    enabled: Vec<Arc<Bits>>,
    writable: bool,
    /// A change was marked: from then on only [`Tracker::close`] may call the file clean.
    marked: AtomicBool,
    closed: AtomicBool,
}

impl Tracker {
    /// Opens the bitmap file at `at` for an image of `size` bytes that is `image_now`
    /// (`file::identity`, `BlockImage::identity`). Writable: made if missing, the bitmaps in `names` added if
    /// missing, then saved marked in use. Read-only: the file and the bitmaps must exist.
    pub fn open(
        at: &Location,
        size: u64,
        image_now: &str,
        names: &[String],
        writable: bool,
    ) -> Result<Tracker> {
        let path = &at.name();
        let mut file = match BitmapFile::open(at, writable)? {
            Some(f) => f,
            None if writable => {
                tracing::warn!(
                    "{}: no bitmap file: made, its bitmaps record changes from now on (take a full copy \
                     now for the next incremental to start from)",
                    path.display()
                );
                BitmapFile::create(at, size, image_now.to_string())?
            }
            None => {
                return Err(
                    super::file::no_file(path).detail("no such file (a server without --read-only makes it)")
                )
            }
        };
        file.check_size(size)?;
        if let Some(why) = file.resolve(image_now) {
            tracing::warn!(
                "{}: {why}: every block of its enabled bitmaps counts as changed (the next incremental copy \
                 is a full one)",
                path.display()
            );
        }
        for name in names {
            if file.sidecar.get(name).is_none() {
                if !writable {
                    return Err(super::file::missing(path, &file.sidecar, name));
                }
                file.add(name, DEFAULT_GRANULARITY)?;
                tracing::info!("{}: bitmap '{name}' made, changes from now on", path.display());
            }
            if writable && file.sidecar.get(name).is_some_and(|b| !b.enabled) {
                tracing::warn!(
                    "{}: bitmap '{name}' is disabled: it is offered, not marked (lightfoot bitmap enable)",
                    path.display()
                );
            }
        }
        if writable {
            file.sidecar.in_use = true;
            file.save()?;
        }
        let s = &file.sidecar;
        Ok(Tracker {
            names: s.bitmaps.iter().map(|b| b.name.clone()).collect(),
            bits: s.bitmaps.iter().map(|b| b.bits.clone()).collect(),
            epochs: s.bitmaps.iter().map(|b| (b.epoch, b.parent)).collect(),
            enabled: s.bitmaps.iter().filter(|b| b.enabled).map(|b| b.bits.clone()).collect(),
            writable,
            marked: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            file: Mutex::new(file),
        })
    }

    /// The bitmaps clients can read, by index.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Bitmap `i` of [`Tracker::names`].
    pub fn bits(&self, i: usize) -> &Bits {
        &self.bits[i]
    }

    /// Bitmap `i`'s epoch and the one before it (0: none).
    pub fn epoch(&self, i: usize) -> (u64, u64) {
        self.epochs[i]
    }

    /// Records a change of `offset..offset + len` in every enabled bitmap.
    pub fn mark(&self, offset: u64, len: u64) {
        debug_assert!(self.writable);
        if !self.marked.load(Ordering::Relaxed) {
            self.marked.store(true, Ordering::Relaxed);
        }
        for b in &self.enabled {
            b.mark(offset, len);
        }
    }

    /// Saves the marks. `clean` (every write reached the image and was flushed) also clears
    /// the in-use mark and records `image_now`, what the image is after this server; without
    /// it the file stays in use, and the next open counts everything changed.
    pub fn close(&self, clean: bool, image_now: Option<String>) -> Result<()> {
        if !self.writable {
            return Ok(());
        }
        self.closed.store(true, Ordering::Relaxed);
        let mut f = self.file.lock().unwrap();
        if clean {
            if let Some(now) = image_now {
                f.sidecar.in_use = false;
                f.sidecar.image = now;
            }
        }
        f.save()
    }
}

/// A server that ends before it took any change (a failed start: the address in use, a pid
/// file it could not write) leaves the file as clean as it found it, not in use: nothing can
/// have been missed, and the next backup need not be a full one.
impl Drop for Tracker {
    fn drop(&mut self) {
        if !self.writable || self.closed.load(Ordering::Relaxed) || self.marked.load(Ordering::Relaxed) {
            return;
        }
        let mut f = self.file.lock().unwrap();
        f.sidecar.in_use = false;
        if let Err(e) = f.save() {
            tracing::warn!("{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_that_never_closes_leaves_everything_dirty() {
        let dir = tempfile::tempdir().unwrap();
        let p = Location::File(dir.path().join("i.bitmaps"));
        let names = vec!["a".to_string()];
        let e = Tracker::open(&p, 1 << 20, "x", &names, false).err().unwrap();
        assert!(e.to_string().contains("no such file"), "{e}");
        let t = Tracker::open(&p, 1 << 20, "x", &names, true).unwrap();
        assert!(BitmapFile::peek(&p).unwrap().in_use, "in use on disk before any write");
        t.mark(0, 1);
        t.close(true, Some("y".into())).unwrap();
        drop(t);
        let s = BitmapFile::peek(&p).unwrap();
        assert!(!s.in_use && s.image == "y" && s.get("a").unwrap().bits.dirty_bytes() == 65536);
        // Read-only: what was saved; an unknown name or another size is an error.
        let r = Tracker::open(&p, 1 << 20, "y", &names, false).unwrap();
        assert_eq!(r.bits(0).dirty_bytes(), 65536);
        drop(r);
        let e = Tracker::open(&p, 1 << 20, "y", &["b".to_string()], false).err().unwrap();
        assert!(e.to_string().contains("no bitmap named 'b' (it holds: a)"), "{e}");
        let e = Tracker::open(&p, 2 << 20, "y", &names, true).err().unwrap();
        assert!(e.to_string().contains("for an image of 1048576 bytes"), "{e}");
        // Opened and dropped without a change (a failed start): clean, as it was.
        drop(Tracker::open(&p, 1 << 20, "y", &names, true).unwrap());
        assert!(!BitmapFile::peek(&p).unwrap().in_use);
        // Opened, marked, never closed (killed): all dirty next time.
        let t = Tracker::open(&p, 1 << 20, "y", &names, true).unwrap();
        t.mark(0, 1);
        drop(t); // marked, not closed: as after a kill -9, the file stays in use
        let t = Tracker::open(&p, 1 << 20, "y", &names, true).unwrap();
        assert_eq!(t.bits(0).dirty_bytes(), 1 << 20);
    }
}
