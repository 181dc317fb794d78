//! Regular files and block devices, through a cache policy ([`PolicyFile`]).
//!
//! Zeroing and trimming use the cheapest call that gives the promised result: hole punching
//! and `FALLOC_FL_ZERO_RANGE` on files, `BLKZEROOUT` and `BLKDISCARD` on devices. Extents come
//! from `SEEK_DATA`/`SEEK_HOLE` on files; a device reports all data.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Backend, BlockSizes, CacheInfo, Caps, Extent, Report, ZeroFlags};
use crate::error::{Error, ErrorKind, Op, Result};
use crate::io::{sys, CacheMode, FileJob, OpenOptions, PolicyFile, Tuning};

/// Extents reported by one call at most; callers ask again for the rest.
const MAX_EXTENTS: usize = 1024;

pub struct FileBackend {
    name: String,
    file: PolicyFile,
    size: AtomicU64,
    read_only: bool,
    rotational: bool,
    logical_block: u32,
    /// [`Caps::alloc_unit`]: the filesystem's block for a regular file ([`alloc_unit_of`]);
    /// none for a device.
    alloc_unit: Option<u32>,
}

impl FileBackend {
    pub fn open(path: &Path, opts: OpenOptions, mode: CacheMode, tuning: &Tuning) -> Result<FileBackend> {
        Self::open_shared(path, opts, mode, tuning, Default::default())
    }

    /// Another open of the same file for another connection: its own fd (readahead state is
    /// per open file), the export's shared error latch and block locks.
    pub fn open_shared(
        path: &Path,
        opts: OpenOptions,
        mode: CacheMode,
        tuning: &Tuning,
        shared: std::sync::Arc<FileJob>,
    ) -> Result<FileBackend> {
        let file = PolicyFile::open_shared(path, opts, mode, tuning, shared)?;
        let size = file.size()?;
        let meta = file.file().metadata().map_err(|e| Error::io(Op::Stat, e).path(path))?;
        let (rotational, logical_block) = if file.is_block() {
            let lbs = sys::block_logical_size(file.fd()).map_err(|e| Error::io(Op::Ioctl, e).path(path))?;
            (rotational(meta.rdev()), lbs)
        } else {
            (rotational(meta.dev()), 1)
        };
        let alloc_unit = match file.is_block() {
            true => None,
            false => Some(alloc_unit_of(sys::fs_block_size(file.fd()).ok())),
        };
        Ok(FileBackend {
            alloc_unit,
            name: path.display().to_string(),
            file,
            size: AtomicU64::new(size),
            read_only: !opts.write,
            rotational,
            logical_block,
        })
    }

    pub fn policy(&self) -> &PolicyFile {
        &self.file
    }

    pub fn is_block(&self) -> bool {
        self.file.is_block()
    }

    /// Sets the size of a regular file (a copy destination is truncated to its source size).
    pub fn set_len(&self, len: u64) -> Result<()> {
        self.file.set_len(len).map_err(|e| Error::io(Op::Truncate, e).path(self.file.path()).at(0, len))?;
        self.size.store(len, Ordering::Relaxed);
        Ok(())
    }

    /// Allocates `[0, len)` on disk (`--preallocate`). False, with nothing changed, where the
    /// filesystem cannot allocate in advance (ext2, or ext4 files without extents: EOPNOTSUPP);
    /// any other failure, such as ENOSPC, is an error.
    pub fn preallocate(&self, len: u64) -> Result<bool> {
        if len == 0 {
            return Ok(true);
        }
        match self.file.allocate(len) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => return Ok(false),
            Err(e) => return Err(Error::io(Op::Preallocate, e).path(self.file.path()).at(0, len)),
        }
        self.size.fetch_max(len, Ordering::Relaxed);
        Ok(true)
    }

    fn err(&self, op: Op, offset: u64, len: u64) -> impl Fn(std::io::Error) -> Error + '_ {
        move |e| Error::io(op, e).path(self.file.path()).at(offset, len)
    }

    /// The whole logical blocks inside `[offset, offset+len)`, as `(start, end)`.
    fn inner_blocks(&self, offset: u64, len: u64) -> (u64, u64) {
        let lbs = u64::from(self.logical_block.max(1));
        (offset.div_ceil(lbs) * lbs, (offset + len) / lbs * lbs)
    }

    fn fua(&self, fua: bool) -> Result<()> {
        if fua {
            self.file.sync()
        } else {
            Ok(())
        }
    }
}

/// `/sys/dev/block/MAJ:MIN/queue/rotational`, looking through a partition to its disk.
fn rotational(dev: u64) -> bool {
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let base = format!("/sys/dev/block/{major}:{minor}");
    for p in [format!("{base}/queue/rotational"), format!("{base}/../queue/rotational")] {
        if let Ok(s) = std::fs::read_to_string(p) {
            return s.trim() == "1";
        }
    }
    false
}

impl Backend for FileBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn size(&self) -> Option<u64> {
        Some(self.size.load(Ordering::Relaxed))
    }

    fn caps(&self) -> Caps {
        let block = self.is_block();
        let direct = self.file.mode() == CacheMode::Direct;
        let minimum = if block {
            self.logical_block
        } else if direct {
            self.file.align() as u32
        } else {
            1
        };
        Caps {
            read_only: self.read_only,
            can_flush: true,
            can_fua: true,
            can_trim: !self.read_only,
            can_zero: !self.read_only,
            can_fast_zero: !self.read_only && !block,
            can_extents: !block,
            sequential: false,
            growable: !block,
            rotational: self.rotational,
            block: BlockSizes { minimum, preferred: 4096.max(minimum), maximum: 32 << 20 },
            alloc_unit: self.alloc_unit,
            at_hand: false,
        }
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        self.file.read_at(buf, offset)
    }

    /// Even a cached page may need a device read: never at hand.
    fn read_at_hand(&self, _buf: &mut [u8], _offset: u64) -> Option<Result<usize>> {
        None
    }

    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        debug_assert!(!self.read_only);
        self.file.write_at(buf, offset, fua)
    }

    /// A write may wait for the device (a page read before a partial overwrite, writeback
    /// throttling): never at hand.
    fn write_at_hand(&self, _buf: &[u8], _offset: u64) -> Option<Result<()>> {
        None
    }

    fn write_merged(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        debug_assert!(!self.read_only);
        self.file.write_merged_at(buf, offset, fua)
    }

    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        debug_assert!(!self.read_only);
        if len == 0 {
            return Ok(());
        }
        let fd = self.file.fd();
        let res = if self.is_block() {
            if flags.fast {
                return Err(Error::new(ErrorKind::NotSupported, Op::Zero)
                    .path(self.file.path())
                    .at(offset, len)
                    .detail("a device cannot promise fast zeroing"));
            }
            // BLKZEROOUT takes whole logical blocks: write the unaligned edges as zeroes.
            let (start, end) = self.inner_blocks(offset, len);
            if start >= end {
                return super::write_zeroes(self, offset, len, flags.fua);
            }
            super::write_zeroes(self, offset, start - offset, false)?;
            super::write_zeroes(self, end, offset + len - end, false)?;
            sys::block_zeroout(fd, start, end - start)
        } else if flags.may_trim {
            self.file.punch_hole(offset, len)
        } else {
            self.file.zero_range(offset, len)
        };
        match res {
            Ok(()) => self.fua(flags.fua),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP) | Some(libc::EINVAL)) => {
                if flags.fast {
                    // Not fast here: ENOTSUP to an NBD client, which then writes zeroes its
                    // own way (an EINVAL from fallocate would read as a bad request).
                    return Err(Error::new(ErrorKind::NotSupported, Op::Zero)
                        .path(self.file.path())
                        .at(offset, len)
                        .detail(format!("no fast zero here ({})", crate::error::io_message(&e))));
                }
                super::write_zeroes(self, offset, len, flags.fua)
            }
            Err(e) => Err(self.err(Op::Zero, offset, len)(e)),
        }
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        debug_assert!(!self.read_only);
        if len == 0 {
            return Ok(());
        }
        let fd = self.file.fd();
        let res = if self.is_block() {
            // BLKDISCARD takes whole logical blocks; the partial edges simply keep their data.
            let (start, end) = self.inner_blocks(offset, len);
            if start >= end {
                return self.fua(fua);
            }
            sys::block_discard(fd, start, end - start)
        } else {
            self.file.punch_hole(offset, len)
        };
        match res {
            // Trimming is advisory: where it is unsupported the data simply stays.
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => self.fua(fua),
            Err(e) => Err(self.err(Op::Trim, offset, len)(e)),
            Ok(()) => self.fua(fua),
        }
    }

    fn flush(&self) -> Result<()> {
        self.file.sync()
    }

    fn will_write(&self, offset: u64, len: u64) {
        self.file.will_write(offset, len);
    }

    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        // Only `keep` may leave pages behind. The prefetch filter gives CACHE a meaning in
        // the other modes (its bounded buffer).
        if self.file.mode() == CacheMode::Keep {
            sys::fadvise(self.file.fd(), offset, len, sys::Advice::WillNeed).map_err(self.err(
                Op::Cache,
                offset,
                len,
            ))?;
        }
        Ok(())
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        if self.is_block() || len == 0 {
            return Ok(vec![Extent::data(len)]);
        }
        let known = self.file.known_data();
        if known.covers(offset, len) {
            return Ok(vec![Extent::data(len)]);
        }
        let fd = self.file.fd();
        let end = offset + len;
        let mut out = Vec::new();
        let mut at = offset;
        while at < end && out.len() < MAX_EXTENTS {
            let data = match sys::seek_data(fd, at) {
                Ok(d) => d,
                // Filesystems without SEEK_DATA: everything is data.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::EOPNOTSUPP)) => {
                    out.push(Extent::data(end - at));
                    break;
                }
                Err(e) => return Err(self.err(Op::Seek, at, end - at)(e)),
            };
            match data {
                None => {
                    out.push(Extent::hole(end - at));
                    break;
                }
                Some(d) if d > at => {
                    let d = d.min(end);
                    out.push(Extent::hole(d - at));
                    at = d;
                }
                Some(_) => {
                    let h = sys::seek_hole(fd, at).map_err(self.err(Op::Seek, at, end - at))?.unwrap_or(end);
                    // A hole at `at` right after SEEK_DATA said data: the file changed under us.
                    let h = h.max(at + 1);
                    known.learn(at..h);
                    let h = h.min(end);
                    out.push(Extent::data(h - at));
                    at = h;
                }
            }
        }
        Ok(out)
    }

    fn cache_info(&self) -> Option<CacheInfo> {
        let stat = self.file.cache_stat();
        Some(CacheInfo { page_size: sys::page_size() as u64, stat, mechanism: self.file.mechanism() })
    }

    fn report(&self) -> Report {
        Report::default()
    }

    fn finish(&self) -> Result<()> {
        self.file.finish()
    }
}

/// The allocation unit of a file on a filesystem with blocks of `fs_block` bytes (`None`: a
/// failed statfs): the block where it is a power of two up to 4 KiB (ext4 made with
/// `-b 1024`, XFS with 1 or 2 KiB blocks), else 4 KiB. Never more than 4 KiB: a filesystem
/// whose `f_bsize` is larger (a network filesystem's transfer size, say) may still allocate in
/// smaller pieces, and a unit taken too large would make `--coalesce` fill gaps over holes.
pub fn alloc_unit_of(fs_block: Option<u64>) -> u32 {
    match fs_block {
        Some(b) if b.is_power_of_two() && (512..4096).contains(&b) => b as u32,
        _ => 4096,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unit_is_the_filesystems_block_up_to_4k() {
        assert_eq!(alloc_unit_of(Some(1024)), 1024);
        assert_eq!(alloc_unit_of(Some(2048)), 2048);
        assert_eq!(alloc_unit_of(Some(512)), 512);
        for other in [Some(4096), Some(65536), Some(1 << 20), Some(3000), Some(256), Some(0), None] {
            assert_eq!(alloc_unit_of(other), 4096, "{other:?}");
        }
    }
}
