//! The preload library of `lightfoot run` (docs/run.md): loaded into a program with
//! `LD_PRELOAD`, it sees the program's reads and writes of regular files and leaves the page
//! cache as it found it: blocks that held pages before the program first touched them keep
//! them, the rest are dropped once the program has moved past them, and at `close`.
//!
//! - [`fds`]: what is known of each descriptor, the first sight of a file's blocks, and the
//!   eviction (async-signal-safe: a fixed table of atomics, no allocation, no lock).
//! - [`record`]: one record per file looked at, for `lightfoot run`'s final sweep, which
//!   writes back and drops what the program left (dirty pages, files never closed, processes
//!   that ended by `_exit` or a signal). The records' format, the 2 MiB block and the scan
//!   that finds a file's cached blocks are `lightfoot_record`'s (`record/`), which lightfoot
//!   reads the records with.
//! - [`sys`]: the library's own system calls (never through the functions it exports).
//!
//! Every exported function calls the real one (found with `dlsym(RTLD_NEXT)`), keeps its result
//! and `errno`, and only then does its own bookkeeping: the program sees exactly what it would
//! have seen without the library. A failure of the library's own (cachestat refused, a mapping
//! that could not be made) leaves pages cached, never the program's call failing.
//!
//! Not covered here (the watcher is for those): static binaries, `mmap`, io_uring,
//! stdio's reads and writes between `fopen` and `fclose` (glibc calls its internal functions;
//! the file is looked at at `fopen`, or at start for standard streams that are regular files,
//! and finished at `fclose` or exit), programs that clear their
//! environment, setuid programs (the loader drops `LD_PRELOAD`).

// Exporting C functions takes `unsafe` (no_mangle, raw pointers); each block says why it is
// sound.
#![deny(clippy::undocumented_unsafe_blocks)]
#![deny(unsafe_op_in_unsafe_fn)]

mod fds;
mod record;
mod sys;

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::*};

use libc::{c_char, c_int, c_uint, c_void, iovec, off64_t, off_t, size_t, ssize_t, FILE};

// ---- set-up --------------------------------------------------------------------------------

/// `$LIGHTFOOT_RUN_DIR/files`, NUL-terminated, set once by the constructor.
static LOG: AtomicUsize = AtomicUsize::new(0);
static LOG_BUF: PathBuf = PathBuf::new();
/// The process the tables belong to: a `vfork` child shares them and must not touch them.
static OWNER: AtomicU32 = AtomicU32::new(0);

/// A fixed buffer for the log's path, written once by the constructor before any other use.
struct PathBuf(std::cell::UnsafeCell<[u8; 4096]>);
// SAFETY: written only by the constructor, before any thread of the program can read it (the
// constructor runs before `main` and before any other thread exists); read-only afterwards.
unsafe impl Sync for PathBuf {}
impl PathBuf {
    const fn new() -> Self {
        PathBuf(std::cell::UnsafeCell::new([0; 4096]))
    }
}

/// The log's path, if the library runs under `lightfoot run`.
pub(crate) fn log_path() -> Option<&'static [u8]> {
    let n = LOG.load(Acquire);
    // SAFETY: LOG_BUF was filled before LOG was set (Release/Acquire) and is never written again.
    (n > 0).then(|| unsafe { &(&*LOG_BUF.0.get())[..n] })
}

/// Whether this process may use the tables (not a `vfork` child of the process that owns them).
pub(crate) fn active() -> bool {
    OWNER.load(Relaxed) == sys::pid()
}

extern "C" fn init() {
    OWNER.store(sys::pid(), Relaxed);
    // SAFETY: getenv before `main`, with no other thread yet; the string is copied at once.
    let dir = unsafe { libc::getenv(c"LIGHTFOOT_RUN_DIR".as_ptr()) };
    if !dir.is_null() {
        // SAFETY: getenv returned a NUL-terminated string.
        let dir = unsafe { std::ffi::CStr::from_ptr(dir) }.to_bytes();
        const NAME: &[u8] = b"/files\0";
        if !dir.is_empty() && dir.len() + NAME.len() <= 4096 {
            // SAFETY: the constructor is the only writer, before any reader (see PathBuf).
            let buf = unsafe { &mut *LOG_BUF.0.get() };
            buf[..dir.len()].copy_from_slice(dir);
            buf[dir.len()..dir.len() + NAME.len()].copy_from_slice(NAME);
            LOG.store(dir.len() + NAME.len(), Release);
        }
    }
    // `--max-cache`: the budget of write-behind's pending blocks, counted across the run in
    // `$LIGHTFOOT_RUN_DIR/pending` (made by lightfoot run).
    // SAFETY: getenv before `main`, with no other thread yet.
    let max = unsafe { libc::getenv(c"LIGHTFOOT_MAX_CACHE".as_ptr()) };
    if !max.is_null() {
        // SAFETY: getenv returned a NUL-terminated string.
        let max = unsafe { std::ffi::CStr::from_ptr(max) }.to_bytes();
        if let Some(bytes) = std::str::from_utf8(max).ok().and_then(|m| m.parse::<u64>().ok()) {
            let mut path = [0u8; 4096];
            let shared = match log_path() {
                Some(log) if log.len() + 2 <= path.len() => {
                    // ".../files\0" → ".../pending\0"
                    let dir = &log[..log.len() - b"files\0".len()];
                    const NAME: &[u8] = b"pending\0";
                    path[..dir.len()].copy_from_slice(dir);
                    path[dir.len()..dir.len() + NAME.len()].copy_from_slice(NAME);
                    sys::map_file(&path[..dir.len() + NAME.len()], 4096)
                }
                _ => std::ptr::null_mut(),
            };
            fds::set_budget(bytes >> lightfoot_record::SHIFT, shared);
        }
    }
    // The standard streams, where they are regular files (a shell's `< in` and `> out`): stdio
    // moves their data through glibc's internal calls, which no preload sees, so like a stream
    // from `fopen` they are looked at now, before the program's first read or write, and
    // finished at `fclose` or at exit (what stdio flushes after that is the final sweep's).
    let e = sys::errno();
    for fd in 0..=2 {
        let _ = fds::tracked(fd);
    }
    sys::set_errno(e);
    extern "C" fn child() {
        OWNER.store(sys::pid(), Relaxed);
    }
    // SAFETY: registers a handler that only stores an integer.
    unsafe { libc::pthread_atfork(None, None, Some(child)) };
}

extern "C" fn fini() {
    if active() {
        fds::finish_all();
    }
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

#[used]
#[link_section = ".fini_array"]
static FINI: extern "C" fn() = fini;

// ---- the real functions ------------------------------------------------------------------------

/// The next definition of `name` after this library (glibc's), resolved on first use and kept.
fn real(cache: &AtomicUsize, name: &std::ffi::CStr) -> usize {
    let f = cache.load(Relaxed);
    if f != 0 {
        return f;
    }
    // SAFETY: dlsym with a NUL-terminated name; RTLD_NEXT skips this library.
    let f = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
    if f == 0 {
        // No such function below us: nothing sensible to call. The program linked against it,
        // so this cannot happen with glibc.
        // SAFETY: abort is always safe to call.
        unsafe { libc::abort() };
    }
    cache.store(f, Relaxed);
    f
}

/// Calls the real `$name` with `$args`, typed `$ty`.
macro_rules! call_real {
    ($name:expr, $ty:ty, $($arg:expr),*) => {{
        static CACHE: AtomicUsize = AtomicUsize::new(0);
        let f = real(&CACHE, $name);
        // SAFETY: `f` is the address of the C function `$name`, whose prototype is `$ty`.
        let f: $ty = unsafe { std::mem::transmute::<usize, $ty>(f) };
        // SAFETY: the arguments are the caller's own, passed on unchanged.
        unsafe { f($($arg),*) }
    }};
}

// ---- bookkeeping around a data call -------------------------------------------------------

/// Runs the real call `f` for a data call on `fd` and then the bookkeeping: `at` is the call's
/// offset (`None`: the file position, read back after the call), `write` whether it wrote.
/// The result and `errno` reach the program unchanged.
fn data_call(fd: c_int, at: Option<u64>, write: bool, f: impl FnOnce() -> ssize_t) -> ssize_t {
    let slot = tracked(fd);
    let r = f();
    account(fd, slot, at, write, r);
    r
}

/// The slot of `fd` if this process may use the tables and the descriptor is tracked.
fn tracked(fd: c_int) -> Option<&'static fds::Slot> {
    if active() {
        fds::tracked(fd)
    } else {
        None
    }
}

/// The bookkeeping after a call on `fd` (its `slot`, looked up before the call) that moved `r`
/// bytes at `at` (`None`: ending at the file position); `errno` is kept as the call left it.
fn account(fd: c_int, slot: Option<&'static fds::Slot>, at: Option<u64>, write: bool, r: ssize_t) {
    let Some(s) = slot else { return };
    if r <= 0 {
        return;
    }
    let e = sys::errno();
    let n = r as u64;
    if let Some(start) = at.or_else(|| sys::position(fd).and_then(|p| p.checked_sub(n))) {
        fds::moved(fd, s, start, start + n, write);
    }
    sys::set_errno(e);
}

/// An explicit offset, or `None` for -1 (the `preadv2` family's "use the file position").
fn offset(o: off64_t) -> Option<u64> {
    u64::try_from(o).ok()
}

// ---- exports: reads and writes -------------------------------------------------------------

/// Defines an exported data call: `name(args) -> ssize_t`, the real `name` called through
/// [`data_call`] with `at` (the call's offset, or `None` for the file position) and whether it
/// writes. Every name glibc exports for these calls gets one: a program binds whichever its
/// headers chose (`pread` or `pread64`, the fortified `__read_chk`).
macro_rules! data_export {
    ($(#[doc = $doc:literal])* $name:ident($fd:ident: c_int $(, $arg:ident: $ty:ty)*), at: $at:expr, write: $write:expr) => {
        $(#[doc = $doc])*
        ///
        /// # Safety
        /// As the C function of this name: the caller's pointers are passed on unchanged.
        #[no_mangle]
        pub unsafe extern "C" fn $name($fd: c_int $(, $arg: $ty)*) -> ssize_t {
            data_call($fd, $at, $write, || {
                call_real!(
                    match_name!($name),
                    unsafe extern "C" fn(c_int $(, $ty)*) -> ssize_t,
                    $fd
                    $(, $arg)*
                )
            })
        }
    };
}

/// The C name of an identifier, as a `&CStr` literal.
macro_rules! match_name {
    ($name:ident) => {
        // SAFETY: concat! of an identifier and "\0" is a NUL-terminated string with no other NUL.
        unsafe { std::ffi::CStr::from_bytes_with_nul_unchecked(concat!(stringify!($name), "\0").as_bytes()) }
    };
}

data_export!(read(fd: c_int, buf: *mut c_void, n: size_t), at: None, write: false);
data_export!(__read_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t), at: None, write: false);
data_export!(pread(fd: c_int, buf: *mut c_void, n: size_t, off: off_t), at: offset(off), write: false);
data_export!(pread64(fd: c_int, buf: *mut c_void, n: size_t, off: off64_t), at: offset(off), write: false);
data_export!(__pread_chk(fd: c_int, buf: *mut c_void, n: size_t, off: off_t, buflen: size_t), at: offset(off), write: false);
data_export!(__pread64_chk(fd: c_int, buf: *mut c_void, n: size_t, off: off64_t, buflen: size_t), at: offset(off), write: false);
data_export!(readv(fd: c_int, iov: *const iovec, cnt: c_int), at: None, write: false);
data_export!(preadv(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t), at: offset(off), write: false);
data_export!(preadv64(fd: c_int, iov: *const iovec, cnt: c_int, off: off64_t), at: offset(off), write: false);
data_export!(preadv2(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t, flags: c_int), at: offset(off), write: false);
data_export!(preadv64v2(fd: c_int, iov: *const iovec, cnt: c_int, off: off64_t, flags: c_int), at: offset(off), write: false);
data_export!(write(fd: c_int, buf: *const c_void, n: size_t), at: None, write: true);
data_export!(pwrite(fd: c_int, buf: *const c_void, n: size_t, off: off_t), at: offset(off), write: true);
data_export!(pwrite64(fd: c_int, buf: *const c_void, n: size_t, off: off64_t), at: offset(off), write: true);
data_export!(writev(fd: c_int, iov: *const iovec, cnt: c_int), at: None, write: true);
data_export!(pwritev(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t), at: offset(off), write: true);
data_export!(pwritev64(fd: c_int, iov: *const iovec, cnt: c_int, off: off64_t), at: offset(off), write: true);
data_export!(pwritev2(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t, flags: c_int), at: offset(off), write: true);
data_export!(pwritev64v2(fd: c_int, iov: *const iovec, cnt: c_int, off: off64_t, flags: c_int), at: offset(off), write: true);

// ---- exports: copies inside the kernel -----------------------------------------------------------

/// At most this much per in-kernel copy (`copy_file_range`, `sendfile`): `cp` asks for the
/// whole file in one call, which would bring all of it into the cache (both ends) before the
/// library could drop anything. Both calls may copy less than asked (their callers loop), so a
/// smaller count changes nothing else; a reflink of each piece still shares the blocks.
const COPY_PIECE: size_t = 8 << 20;

/// The real call first (a reflink or a server-side copy keeps working), at most [`COPY_PIECE`]
/// at a time, then both ends are accounted as a read and a write.
///
/// # Safety
/// As `copy_file_range(2)`.
#[no_mangle]
pub unsafe extern "C" fn copy_file_range(
    fd_in: c_int,
    off_in: *mut off64_t,
    fd_out: c_int,
    off_out: *mut off64_t,
    len: size_t,
    flags: c_uint,
) -> ssize_t {
    // SAFETY: the caller's pointers, valid for reading if not null (as the real call needs).
    let (in_at, out_at) = unsafe { (at(off_in), at(off_out)) };
    let out_slot = tracked(fd_out);
    let r = data_call(fd_in, in_at, false, || {
        call_real!(
            c"copy_file_range",
            unsafe extern "C" fn(c_int, *mut off64_t, c_int, *mut off64_t, size_t, c_uint) -> ssize_t,
            fd_in,
            off_in,
            fd_out,
            off_out,
            if active() { len.min(COPY_PIECE) } else { len },
            flags
        )
    });
    account(fd_out, out_slot, out_at, true, r);
    r
}

/// # Safety
/// As `sendfile(2)`.
#[no_mangle]
pub unsafe extern "C" fn sendfile(out_fd: c_int, in_fd: c_int, off: *mut off_t, count: size_t) -> ssize_t {
    // SAFETY: the caller's pointer, valid for reading if not null.
    let in_at = unsafe { at(off) };
    let out_slot = tracked(out_fd);
    let r = data_call(in_fd, in_at, false, || {
        call_real!(
            c"sendfile",
            unsafe extern "C" fn(c_int, c_int, *mut off_t, size_t) -> ssize_t,
            out_fd,
            in_fd,
            off,
            count.min(COPY_PIECE)
        )
    });
    account(out_fd, out_slot, None, true, r);
    r
}

/// # Safety
/// As `sendfile64`.
#[no_mangle]
pub unsafe extern "C" fn sendfile64(
    out_fd: c_int,
    in_fd: c_int,
    off: *mut off64_t,
    count: size_t,
) -> ssize_t {
    // SAFETY: the caller's pointer, valid for reading if not null.
    let in_at = unsafe { at(off) };
    let out_slot = tracked(out_fd);
    let r = data_call(in_fd, in_at, false, || {
        call_real!(
            c"sendfile64",
            unsafe extern "C" fn(c_int, c_int, *mut off64_t, size_t) -> ssize_t,
            out_fd,
            in_fd,
            off,
            count.min(COPY_PIECE)
        )
    });
    account(out_fd, out_slot, None, true, r);
    r
}

/// The offset a pointer argument holds before the call, if given.
///
/// # Safety
/// `p` is null or valid for reading.
unsafe fn at<T: Copy + Into<i64>>(p: *const T) -> Option<u64> {
    // SAFETY: the caller's promise.
    (!p.is_null()).then(|| unsafe { *p }.into()).and_then(|o| u64::try_from(o).ok())
}

// ---- exports: the ends of a descriptor -----------------------------------------------------------

/// # Safety
/// As `close(2)`.
#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if active() {
        let e = sys::errno();
        fds::finish(fd);
        sys::set_errno(e);
    }
    call_real!(c"close", unsafe extern "C" fn(c_int) -> c_int, fd)
}

/// # Safety
/// As `dup2(2)`.
#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    if active() && old != new {
        let e = sys::errno();
        fds::finish(new);
        sys::set_errno(e);
    }
    call_real!(c"dup2", unsafe extern "C" fn(c_int, c_int) -> c_int, old, new)
}

/// # Safety
/// As `dup3(2)`.
#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    if active() && old != new {
        let e = sys::errno();
        fds::finish(new);
        sys::set_errno(e);
    }
    call_real!(c"dup3", unsafe extern "C" fn(c_int, c_int, c_int) -> c_int, old, new, flags)
}

/// # Safety
/// As `close_range(2)`.
#[no_mangle]
pub unsafe extern "C" fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    if active() && flags & libc::CLOSE_RANGE_CLOEXEC as c_int == 0 {
        let e = sys::errno();
        let end = (last as u64).min(fds::MAX_FDS as u64 - 1);
        for fd in first as u64..=end {
            fds::finish(fd as c_int);
        }
        sys::set_errno(e);
    }
    call_real!(c"close_range", unsafe extern "C" fn(c_uint, c_uint, c_int) -> c_int, first, last, flags)
}

// ---- exports: stdio ------------------------------------------------------------------------

/// Looks at the stream's file at once: stdio's own reads and writes go through glibc's internal
/// functions, which no preload sees, so the first sight must happen here.
fn opened(f: *mut FILE) -> *mut FILE {
    if !f.is_null() && active() {
        let e = sys::errno();
        // SAFETY: a stream fopen just returned.
        let fd = unsafe { libc::fileno(f) };
        let _ = fds::tracked(fd);
        sys::set_errno(e);
    }
    f
}

/// # Safety
/// As `fopen(3)`.
#[no_mangle]
pub unsafe extern "C" fn fopen(path: *const c_char, mode: *const c_char) -> *mut FILE {
    opened(call_real!(c"fopen", unsafe extern "C" fn(*const c_char, *const c_char) -> *mut FILE, path, mode))
}

/// # Safety
/// As `fopen64`.
#[no_mangle]
pub unsafe extern "C" fn fopen64(path: *const c_char, mode: *const c_char) -> *mut FILE {
    opened(call_real!(
        c"fopen64",
        unsafe extern "C" fn(*const c_char, *const c_char) -> *mut FILE,
        path,
        mode
    ))
}

/// Flushes the stream's buffer first, so that its last writes are in the file when the file's
/// blocks are dropped (dirty ones start their writeback), then closes it as the real `fclose`.
///
/// # Safety
/// As `fclose(3)`.
#[no_mangle]
pub unsafe extern "C" fn fclose(f: *mut FILE) -> c_int {
    if !f.is_null() && active() {
        let e = sys::errno();
        // SAFETY: the caller's open stream.
        let fd = unsafe { libc::fileno(f) };
        if fd >= 0 {
            // SAFETY: as above; fflush of an open stream.
            unsafe { libc::fflush(f) };
            fds::finish(fd);
        }
        sys::set_errno(e);
    }
    call_real!(c"fclose", unsafe extern "C" fn(*mut FILE) -> c_int, f)
}
