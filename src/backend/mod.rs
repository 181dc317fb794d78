//! Backends: where bytes live. One trait, [`Backend`], for everything a copy can read from or
//! write to and a server can export: files and block devices ([`FileBackend`]), an in-memory
//! sparse store ([`MemoryBackend`]), `null:` ([`NullBackend`]), pipes ([`PipeBackend`]) and
//! exports on NBD servers ([`NbdBackend`]).
//! Filters (`crate::filters`) implement the same trait around another backend.
//!
//! Contract for callers: requests are validated before they get here (in range, non-empty
//! where it matters, write only when not read-only); backends check the same invariants with
//! `debug_assert!` only. Data-path methods have no default bodies on purpose: adding an
//! operation must make every filter decide what to do with it.

use crate::error::{Error, ErrorKind, Op, Result};
use crate::io::{CacheStat, Mechanism};

pub mod file;
pub mod memory;
pub mod nbd;
pub mod null;
pub mod pipe;
pub mod s3;

pub use file::FileBackend;
pub use memory::MemoryBackend;
pub use nbd::NbdBackend;
pub use null::NullBackend;
pub use pipe::PipeBackend;
pub use s3::S3Backend;

/// One run of an extent map: `len` bytes that are data, or read as zero, or are unallocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub len: u64,
    /// Not allocated (NBD `HOLE`).
    pub hole: bool,
    /// Reads as zeroes (NBD `ZERO`).
    pub zero: bool,
    /// Unchanged since a dirty bitmap started recording: only from an NBD source opened with
    /// one (`copy --bitmap`); `false` everywhere else.
    pub clean: bool,
}

impl Extent {
    pub fn data(len: u64) -> Extent {
        Extent { len, hole: false, zero: false, clean: false }
    }

    /// Unallocated and reading as zeroes.
    pub fn hole(len: u64) -> Extent {
        Extent { len, hole: true, zero: true, clean: false }
    }
}

/// How a zeroing request may be carried out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZeroFlags {
    /// The range may be deallocated (punched) rather than written (NBD: no `NO_HOLE`).
    pub may_trim: bool,
    /// Fail with `NotSupported` rather than fall back to writing zeroes (NBD `FAST_ZERO`).
    pub fast: bool,
    /// Durable on return (NBD `FUA`).
    pub fua: bool,
}

/// Preferred and limiting request sizes, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct BlockSizes {
    pub minimum: u32,
    pub preferred: u32,
    /// The largest request advertised to clients that ask. Every backend and filter must
    /// still take requests of any length: the server serves up to 64 MiB to clients that did
    /// not ask (`server::validate::UNNEGOTIATED_MAX`), and the copy engine may ask for more.
    pub maximum: u32,
}

/// What a backend can do. Filters compute theirs from the layer below.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Caps {
    pub read_only: bool,
    pub can_flush: bool,
    pub can_fua: bool,
    pub can_trim: bool,
    pub can_zero: bool,
    /// Zeroing is always quick (a punch or an unmap), so `ZeroFlags::fast` can succeed.
    pub can_fast_zero: bool,
    /// `extents` reports real holes and zeroes (otherwise it reports one data extent).
    pub can_extents: bool,
    /// Only sequential access at the current position (pipes).
    pub sequential: bool,
    /// Writes past the end extend it (regular files, pipes): `size` is no limit for writing.
    pub growable: bool,
    pub rotational: bool,
    pub block: BlockSizes,
    /// The unit a backend allocates, or reads and rewrites, whole when part of it is written,
    /// where there is such a thing: a file's filesystem block (at most 4 KiB, see
    /// `file::alloc_unit_of`), an object of a block image in object storage. `--coalesce`
    /// fills gaps only inside units that hold written bytes, and writes such a unit whole.
    pub alloc_unit: Option<u32>,
    /// Some reads or writes may be answered without waiting ([`Backend::read_at_hand`],
    /// [`Backend::write_at_hand`]): memory, and the filters that hold bytes. When false every
    /// answer is `None`, and the server's reader does not ask.
    pub at_hand: bool,
}

impl Caps {
    /// A store whose bytes are in memory (memory, `null:`, the tests' power-loss device):
    /// writable, fixed in size, every operation supported and quick, real extents.
    pub fn in_memory() -> Caps {
        Caps {
            read_only: false,
            can_flush: true,
            can_fua: true,
            can_trim: true,
            can_zero: true,
            can_fast_zero: true,
            can_extents: true,
            sequential: false,
            growable: false,
            rotational: false,
            block: BlockSizes { minimum: 1, preferred: 4096, maximum: 32 << 20 },
            alloc_unit: None,
            at_hand: true,
        }
    }
}

/// The three write hooks of [`Backend`] for a backend whose writes leave this machine or
/// this process at once (an NBD server, a pipe's reader): no write is at hand (the other
/// side may be slow), nothing tells merged writes apart (they are [`Backend::write`]), and
/// there are no pages of ours to prepare. Written out in each `impl` by name rather than as
/// default bodies in the trait, so that a backend which has a cache of its own cannot
/// inherit them unnoticed.
macro_rules! writes_leave_at_once {
    () => {
        fn write_at_hand(&self, _buf: &[u8], _offset: u64) -> Option<$crate::error::Result<()>> {
            None
        }

        fn write_merged(&self, buf: &[u8], offset: u64, fua: bool) -> $crate::error::Result<()> {
            self.write(buf, offset, fua)
        }

        fn will_write(&self, _offset: u64, _len: u64) {}
    };
}
pub(crate) use writes_leave_at_once;

/// The two reporting hooks of [`Backend`] for a backend with neither a page cache of its own
/// nor figures of its own to give (memory, `null:`, a pipe): no [`CacheInfo`], an empty
/// [`Report`]. Written out by name, as [`writes_leave_at_once`] is.
macro_rules! nothing_to_report {
    () => {
        fn cache_info(&self) -> Option<$crate::backend::CacheInfo> {
            None
        }

        fn report(&self) -> $crate::backend::Report {
            $crate::backend::Report::default()
        }
    };
}
pub(crate) use nothing_to_report;

/// The two reporting hooks of [`Backend`] for a wrapper that reports what the backend it
/// wraps (`self.$inner`) reports (the tests' fault injector and wrappers).
#[cfg(any(test, feature = "testing"))]
macro_rules! reports_of {
    ($inner:ident) => {
        fn cache_info(&self) -> Option<$crate::backend::CacheInfo> {
            self.$inner.cache_info()
        }

        fn report(&self) -> $crate::backend::Report {
            self.$inner.report()
        }
    };
}
#[cfg(any(test, feature = "testing"))]
pub(crate) use reports_of;

/// How a backend's file goes through the page cache, where it has one.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CacheInfo {
    pub page_size: u64,
    /// The file's page-cache footprint, where the kernel tells (`cachestat`, Linux 6.5).
    pub stat: Option<CacheStat>,
    pub mechanism: Mechanism,
}

/// What a backend has to tell the user besides its bytes and its page cache
/// ([`Backend::report`]): the CLI prints it after a copy and with `serve --stats`.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Requests made to object storage, by type, and bytes moved (`s3://`).
    pub requests: Option<s3::Requests>,
    /// How a captive NBD server ended, if it ended on its own. Worth saying after a failed
    /// job only, where a server that died shows as a lost connection otherwise (after a job
    /// that went well, a server may have quit on its own once the client left, as qemu-nbd
    /// does).
    pub server_ended: Option<String>,
}

/// Everything that holds bytes. All methods take `&self`: backends are shared between
/// threads and do their own (fine-grained) locking.
pub trait Backend: Send + Sync {
    /// What the user typed to name it (a path, `null:`, `-`).
    fn name(&self) -> &str;

    /// Size in bytes; `None` for a stream whose end is not known in advance.
    fn size(&self) -> Option<u64>;

    fn caps(&self) -> Caps;

    /// Reads into `buf` at `offset`. Returns `buf.len()`, or fewer only when the data ends
    /// inside the request (a pipe at end of input, or a file that shrank).
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<usize>;

    /// Reads `parts.len()` consecutive runs of bytes from `offset` into `parts` in turn, all of
    /// them or an error. A backend whose reads are one request (object storage) makes one for
    /// all; the others read into one buffer and copy.
    fn read_parts(&self, mut parts: Vec<&mut [u8]>, offset: u64) -> Result<()> {
        if let [one] = &mut parts[..] {
            return read_exact(self, one, offset);
        }
        let total = parts.iter().map(|p| p.len()).sum();
        let mut whole = crate::io::AlignedBuf::new(total);
        // The buffer may be longer than asked for (rounded up): read only what the parts take.
        read_exact(self, &mut whole[..total], offset)?;
        let mut at = 0;
        for p in parts {
            p.copy_from_slice(&whole[at..at + p.len()]);
            at += p.len();
        }
        Ok(())
    }

    /// Reads only if the bytes are at hand in memory (a prefetch-buffer hit, a memory
    /// backend): `None` means the read could wait for a device, so call [`Backend::read`]
    /// from a thread that may block. The server's reader thread answers hits itself this
    /// way; handing a 4 KiB hit to a worker thread cost more than the copy (a wake-up and two
    /// context switches per request). Must not record anything when it returns `None`: the
    /// same read arrives again through `read`.
    fn read_at_hand(&self, buf: &mut [u8], offset: u64) -> Option<Result<usize>>;

    /// Writes `buf` at `offset`; with `fua`, durable on return.
    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()>;

    /// Writes (without FUA) only if that cannot wait: for a device, for a lock another
    /// request holds, or for memory to be freed (`--coalesce` taking a small write into its
    /// dirty map). `None` means nothing was done or recorded: call [`Backend::write`] from a
    /// thread that may block. The server's reader thread carries out such writes itself, as
    /// it answers prefetch hits (see [`Backend::read_at_hand`]). `None` is always correct; a
    /// filter forwards it only if it keeps its own promises when the layer below takes the
    /// write this way.
    fn write_at_hand(&self, buf: &[u8], offset: u64) -> Option<Result<()>>;

    /// Writes `buf` at `offset` as [`Backend::write`] does, for a caller that has already
    /// merged several small writes into this one (`--coalesce` writing back a block with the
    /// gaps between its writes filled). A file in neutral mode keeps such a write out of the
    /// page cache as it does a large one, rather than caching it until the next flush as it
    /// does small writes (see `io::file::SMALL_WRITE`). Where nothing tells merged writes
    /// apart, it is [`Backend::write`].
    fn write_merged(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()>;

    /// A hint: `[offset, offset+len)` is about to be written, and its first or last page only
    /// in part. A file may start reading those pages now, all at once, rather than one at a
    /// time inside each write (the kernel reads a page it must partly overwrite). Only if the
    /// pages will leave the cache as written pages do. Where there are no such pages, it does
    /// nothing.
    fn will_write(&self, offset: u64, len: u64);

    /// Makes `[offset, offset+len)` read as zeroes.
    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()>;

    /// Tells the backend `[offset, offset+len)` is no longer needed. Afterwards the range
    /// reads as unspecified data (zeroes for files, which punch holes).
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()>;

    /// Makes every completed write durable.
    fn flush(&self) -> Result<()>;

    /// Advises that `[offset, offset+len)` will be read soon (NBD `CACHE`). Never changes
    /// data; must not leave pages behind in neutral mode.
    fn cache(&self, offset: u64, len: u64) -> Result<()>;

    /// The allocation map of `[offset, offset+len)`: contiguous extents starting at
    /// `offset`, at least one, together no longer than `len`.
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>>;

    /// The mechanism and page-cache footprint, for backends over a file.
    fn cache_info(&self) -> Option<CacheInfo>;

    /// What there is to tell the user besides bytes and cache ([`Report`]). Asked at any
    /// time; how a captive server ended is known once [`Backend::finish`] has run.
    fn report(&self) -> Report;

    /// End of the job: waits for and evicts what the cache policy says must go. Also done
    /// on drop; calling it reports the errors.
    fn finish(&self) -> Result<()>;
}

/// Reads exactly `buf.len()` bytes or fails with `UnexpectedEof`.
pub fn read_exact<B: Backend + ?Sized>(b: &B, buf: &mut [u8], offset: u64) -> Result<()> {
    let n = b.read(buf, offset)?;
    if n < buf.len() {
        return Err(Error::new(ErrorKind::UnexpectedEof, Op::Read)
            .path(b.name())
            .at(offset, buf.len() as u64)
            .detail(format!("data ended after {n} bytes")));
    }
    Ok(())
}

/// `bufs` (one run of bytes in several slices) cut into consecutive runs of `lens` bytes, each
/// run as the slices that hold it. The lengths must add up to at most the slices' total.
pub fn carve<'a>(bufs: Vec<&'a mut [u8]>, lens: impl IntoIterator<Item = usize>) -> Vec<Vec<&'a mut [u8]>> {
    let mut rest = bufs.into_iter();
    let mut cur: &'a mut [u8] = &mut [];
    let mut runs = Vec::new();
    for len in lens {
        let (mut need, mut run) = (len, Vec::new());
        while need > 0 {
            while cur.is_empty() {
                cur = rest.next().expect("carve: runs longer than the slices");
            }
            let n = need.min(cur.len());
            let (head, tail) = std::mem::take(&mut cur).split_at_mut(n);
            need -= head.len();
            run.push(head);
            cur = tail;
        }
        runs.push(run);
    }
    runs
}

/// Zeroes `[offset, offset+len)` by writing zero buffers (the fallback for backends or
/// filesystems without a native zeroing call).
pub fn write_zeroes(b: &dyn Backend, offset: u64, len: u64, fua: bool) -> Result<()> {
    const PIECE: u64 = 1 << 20;
    let zeroes = vec![0u8; PIECE.min(len) as usize];
    let mut at = offset;
    while at < offset + len {
        let n = PIECE.min(offset + len - at);
        let last = at + n == offset + len;
        b.write(&zeroes[..n as usize], at, fua && last)?;
        at += n;
    }
    Ok(())
}

/// True when every byte of `buf` is zero. OR-folding 64-byte pieces lets the compiler use wide
/// registers; a non-zero piece stops the scan.
pub fn is_zero(buf: &[u8]) -> bool {
    let mut pieces = buf.chunks_exact(64);
    pieces.all(|p| p.iter().fold(0u8, |acc, &b| acc | b) == 0) && pieces.remainder().iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carve_cuts_runs_across_slices() {
        let (mut a, mut b, mut c) = ([0u8; 3], [0u8; 0], [0u8; 5]);
        let runs = carve(vec![&mut a, &mut b, &mut c], [2, 4, 2]);
        let lens: Vec<Vec<usize>> = runs.iter().map(|r| r.iter().map(|s| s.len()).collect()).collect();
        assert_eq!(lens, vec![vec![2], vec![1, 3], vec![2]]);
        for (i, run) in runs.into_iter().enumerate() {
            run.into_iter().for_each(|s| s.fill(i as u8 + 1));
        }
        assert_eq!((a, c), ([1, 1, 2], [2, 2, 2, 3, 3]));
    }

    #[test]
    fn read_parts_fills_each_part_in_turn() {
        let m = crate::backend::memory::MemoryBackend::new(16);
        m.write(&(0..16).collect::<Vec<u8>>(), 0, false).unwrap();
        let (mut a, mut b) = ([0u8; 3], [0u8; 6]);
        m.read_parts(vec![&mut a, &mut b], 5).unwrap();
        assert_eq!((a, b), ([5, 6, 7], [8, 9, 10, 11, 12, 13]));
    }
}
