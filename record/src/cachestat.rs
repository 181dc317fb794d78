//! `cachestat(2)` (Linux 6.5) as the kernel's uapi lays it out: the arguments both sides pass
//! to the system call. The calls themselves, `unsafe`, stay with each caller (`src/io/sys`,
//! `preload/src/sys.rs`), whose SAFETY comments rest on these `repr(C)` layouts.

/// The system call's number (the generic table: x86-64 and arm64 alike).
pub const SYS_CACHESTAT: libc::c_long = 451;

/// `struct cachestat_range`: the byte range asked about (`len == 0`: to the end of file).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CachestatRange {
    pub off: u64,
    pub len: u64,
}

/// `struct cachestat`: the range's page-cache counters, in pages.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct Cachestat {
    pub nr_cache: u64,
    pub nr_dirty: u64,
    pub nr_writeback: u64,
    pub nr_evicted: u64,
    pub nr_recently_evicted: u64,
}
