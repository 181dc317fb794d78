//! The cache policy: what the user asks for (`--cache=MODE`) and the mechanism that delivers
//! it on this kernel, filesystem and file.
//!
//! The choice is made per file at open time, here and only here ([`choose`]), from a probe
//! (does RWF_DONTCACHE work here? does cachestat answer? does O_DIRECT open? is it a block
//! device?), and can fall back once at run time ([`read_fallback`], [`write_fallback`]: a
//! DONTCACHE call or a residency check that starts failing, DONTCACHE writes that leave pages
//! behind). Every decision is recorded as a note so `--verbose` and JSON output can say what
//! was used and why.

use std::fmt;
use std::io;
use std::str::FromStr;

use crate::error::{io_message, Error, Op, Result};

/// `--cache=MODE`: the contract with the user.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheMode {
    /// Leave the page cache as found: pages cached before stay, pages the job brought in go.
    #[default]
    Neutral,
    /// Plain buffered I/O: the kernel decides.
    Keep,
    /// Evict everything the job touched, including pages that were cached before.
    Drop,
    /// O_DIRECT for reads and writes, alignment handled with bounce buffers.
    Direct,
}

/// How reads are done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReadMech {
    /// Plain `pread` (`keep`).
    Buffered,
    /// `preadv2(RWF_DONTCACHE)`: the kernel keeps what was cached and drops what it read in.
    DontCache,
    /// O_DIRECT: adds no pages, leaves cached ones alone.
    Direct,
    /// Buffered reads with readahead off, a cachestat residency check of each 2 MiB block
    /// before reading it, and eviction of the blocks the job brought in once read.
    EvictBehind,
}

/// How writes are done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WriteMech {
    /// Plain `pwrite` (`keep`).
    Buffered,
    /// `pwritev2(RWF_DONTCACHE)`, checked with cachestat after writeback.
    DontCache,
    /// Buffered writes, writeback started per window with `sync_file_range`, windows waited on
    /// and evicted a few windows behind.
    WriteBehind,
    /// O_DIRECT, with read-modify-write of unaligned heads and tails.
    Direct,
}

/// Overrides of the automatic choice, for benchmarks, tests and kernels that misbehave.
#[derive(Debug, Clone, Default)]
pub struct Tuning {
    /// Never use RWF_DONTCACHE (`--no-dontcache`, or `LIGHTFOOT_NO_DONTCACHE=1`).
    pub no_dontcache: bool,
    /// Behave as if cachestat answered EPERM (tests of the unprivileged path).
    pub no_cachestat: bool,
    /// Force the read mechanism (`--read-mechanism`).
    pub read: Option<ReadMech>,
    /// Force the write mechanism (`--write-mechanism`).
    pub write: Option<WriteMech>,
    /// Readahead advice for the fd (`--fadvise`); default: chosen with the mechanism.
    pub fadvise: Option<Fadvise>,
    /// The driver keeps many requests in flight (the server): neutral reads then prefer
    /// O_DIRECT, which measured faster there than DONTCACHE (docs/cache-policy.md).
    pub many_in_flight: bool,
}

impl Tuning {
    /// Applies `LIGHTFOOT_NO_DONTCACHE=1` and `LIGHTFOOT_NO_CACHESTAT=1` from the environment,
    /// and `LIGHTFOOT_NO_CACHESTAT_SYSCALL=1` (behave as a kernel without cachestat, before
    /// 6.5: residency then comes from mincore).
    /// Only the binary calls this; the library never reads the environment by itself.
    pub fn with_env(mut self) -> Tuning {
        let set = |name: &str| std::env::var(name).map(|v| v != "0" && !v.is_empty()).unwrap_or(false);
        self.no_dontcache |= set("LIGHTFOOT_NO_DONTCACHE");
        self.no_cachestat |= set("LIGHTFOOT_NO_CACHESTAT");
        // Process-wide, like the kernel it stands for.
        if set("LIGHTFOOT_NO_CACHESTAT_SYSCALL") {
            super::sys::pretend_no_cachestat();
        }
        self
    }
}

/// `--fadvise`: the readahead advice given for the whole file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Fadvise {
    Normal,
    Sequential,
    Random,
}

/// What the probe found out about one open file.
#[derive(Debug, Clone, Copy)]
pub struct Probe {
    pub is_block: bool,
    /// RWF_DONTCACHE accepted by a one-byte read.
    pub dontcache: bool,
    /// cachestat answers for this file (false: EPERM or a kernel without it).
    pub cachestat: bool,
}

/// The mechanisms chosen for a file, with the reasons.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Choice {
    pub read: ReadMech,
    pub write: WriteMech,
    pub fadvise: Fadvise,
    /// Keep an O_DIRECT descriptor: a mechanism uses it, or DONTCACHE reads fall back to it.
    pub direct: bool,
    pub notes: Vec<String>,
}

/// Chooses the mechanisms for `mode` given what the probe found.
///
/// Neutral: RWF_DONTCACHE for reads and writes where a one-byte probe read accepts it (with
/// two workers, DONTCACHE writes beat write-behind in 7 of 7 paired 4 GiB runs, by 2-15 %; at
/// four workers they were even). Without it: O_DIRECT reads, which are neutral by construction
/// and need no residency information, and write-behind windows, which work on every kernel
/// and filesystem. Evict-behind only when forced: it needs cachestat and measured slower than
/// O_DIRECT (docs/cache-policy.md). DONTCACHE writes that leave pages cached after writeback
/// are caught at run time and switched to write-behind ([`write_fallback`]).
///
/// Where O_DIRECT was chosen for speed (neutral reads) and the file refuses it: DONTCACHE
/// reads where they work, else evict-behind where residency is known, else an error (no
/// read could leave the cache as it found it). Where O_DIRECT was asked for, its refusal is
/// an error. The error has no path: the caller adds it.
///
/// `open_direct` is the O_DIRECT probe: it opens the file with O_DIRECT (`Err`: the errno it
/// was refused with; squashfs and iso9660 refuse it), called only when a mechanism chosen
/// wants O_DIRECT, so a job that needs none opens no second descriptor.
pub fn choose(
    mode: CacheMode,
    probe: Probe,
    tuning: &Tuning,
    open_direct: impl FnOnce() -> std::result::Result<(), i32>,
) -> Result<Choice> {
    let mut notes = Vec::new();
    let dontcache = probe.dontcache && !tuning.no_dontcache;
    if probe.dontcache && tuning.no_dontcache {
        notes.push("RWF_DONTCACHE disabled by request".to_string());
    } else if !probe.dontcache {
        notes.push("RWF_DONTCACHE not supported here".to_string());
    }
    let cachestat = probe.cachestat && !tuning.no_cachestat;
    let (mut read, mut write) = match mode {
        CacheMode::Keep => (ReadMech::Buffered, WriteMech::Buffered),
        CacheMode::Direct => (ReadMech::Direct, WriteMech::Direct),
        CacheMode::Drop => (ReadMech::EvictBehind, WriteMech::WriteBehind),
        CacheMode::Neutral => {
            let write = if dontcache { WriteMech::DontCache } else { WriteMech::WriteBehind };
            let read =
                if dontcache && !tuning.many_in_flight { ReadMech::DontCache } else { ReadMech::Direct };
            (read, write)
        }
    };
    if let Some(r) = tuning.read {
        read = r;
    }
    if let Some(w) = tuning.write {
        write = w;
    }
    if read == ReadMech::DontCache && !dontcache {
        notes.push("DONTCACHE reads unavailable: using O_DIRECT".to_string());
        read = ReadMech::Direct;
    }
    if write == WriteMech::DontCache && !dontcache {
        notes.push("DONTCACHE writes unavailable: using write-behind".to_string());
        write = WriteMech::WriteBehind;
    }
    // Evict-behind decides what to evict from residency; without cachestat it cannot know
    // what was cached before, so it must not run in neutral mode (drop mode evicts all).
    if read == ReadMech::EvictBehind && mode != CacheMode::Drop && !cachestat {
        notes.push("residency unknown (cachestat unavailable or EPERM): reading with O_DIRECT instead of evict-behind".to_string());
        read = if dontcache { ReadMech::DontCache } else { ReadMech::Direct };
    }
    let wants_direct = matches!(read, ReadMech::Direct | ReadMech::DontCache) || write == WriteMech::Direct;
    let direct = if wants_direct { open_direct() } else { Ok(()) };
    if let Err(errno) = direct {
        let refused = || io::Error::from_raw_os_error(errno);
        let why = io_message(&refused());
        if read == ReadMech::DontCache && write != WriteMech::Direct {
            notes.push(format!("O_DIRECT unavailable ({why}): no fallback if DONTCACHE fails"));
        } else if read == ReadMech::Direct
            && mode == CacheMode::Neutral
            && tuning.read.is_none()
            && write != WriteMech::Direct
        {
            if dontcache {
                read = ReadMech::DontCache;
                notes.push(format!("O_DIRECT unavailable ({why}): reading with DONTCACHE"));
            } else if cachestat {
                read = ReadMech::EvictBehind;
                notes.push(format!(
                    "O_DIRECT and RWF_DONTCACHE unavailable ({why}): reading with evict-behind"
                ));
            } else {
                return Err(Error::io(Op::Open, refused()).detail(
                    "O_DIRECT; with neither RWF_DONTCACHE nor cachestat here, a read cannot \
                     leave the page cache as it found it: use --cache drop or --cache keep",
                ));
            }
        } else {
            return Err(Error::io(Op::Open, refused()).detail("O_DIRECT"));
        }
    }
    let fadvise = tuning.fadvise.unwrap_or(match read {
        // Kernel readahead keeps a single reader's device busy while it copies (measured:
        // one worker with readahead off took 6.4-7.0 s for 4 GiB, with it 3.4-3.8 s, as fast
        // as the reference loop). The pages it reads past the last request are caught by the
        // spill guard, which needs cachestat; without cachestat readahead goes off instead.
        ReadMech::DontCache if cachestat => Fadvise::Normal,
        // Evict-behind checks residency before each read: readahead would load blocks before
        // the check sees them.
        ReadMech::DontCache | ReadMech::EvictBehind => Fadvise::Random,
        ReadMech::Buffered | ReadMech::Direct => Fadvise::Normal,
    });
    Ok(Choice { read, write, fadvise, direct: wants_direct && direct.is_ok(), notes })
}

/// What reads fall back to at run time when `mech` fails for good (DONTCACHE refused, a
/// residency check that fails): O_DIRECT, which needs neither, where the file has an O_DIRECT
/// descriptor. `None`: nothing to fall back to.
pub fn read_fallback(mech: ReadMech, has_direct: bool) -> Option<ReadMech> {
    match mech {
        ReadMech::DontCache | ReadMech::EvictBehind if has_direct => Some(ReadMech::Direct),
        _ => None,
    }
}

/// What writes fall back to at run time when `mech` fails for good (DONTCACHE refused, or
/// leaving pages cached after writeback): write-behind, which works on every kernel and
/// filesystem. `None`: nothing to fall back to.
pub fn write_fallback(mech: WriteMech) -> Option<WriteMech> {
    match mech {
        WriteMech::DontCache => Some(WriteMech::WriteBehind),
        _ => None,
    }
}

macro_rules! names {
    ($ty:ty { $($variant:ident = $name:literal),* $(,)? }) => {
        impl $ty {
            pub const NAMES: &'static [&'static str] = &[$($name),*];
            pub fn name(self) -> &'static str {
                match self { $(<$ty>::$variant => $name),* }
            }
        }
        impl FromStr for $ty {
            type Err = crate::Error;
            fn from_str(s: &str) -> crate::Result<Self> {
                match s {
                    $($name => Ok(<$ty>::$variant),)*
                    _ => Err(crate::Error::invalid(
                        crate::Op::Parse,
                        format!("expected one of: {}", Self::NAMES.join(", ")),
                    )),
                }
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

names!(CacheMode { Neutral = "neutral", Keep = "keep", Drop = "drop", Direct = "direct" });
names!(ReadMech { Buffered = "buffered", DontCache = "dontcache", Direct = "direct", EvictBehind = "evict-behind" });
names!(WriteMech { Buffered = "buffered", DontCache = "dontcache", WriteBehind = "write-behind", Direct = "direct" });
names!(Fadvise { Normal = "normal", Sequential = "sequential", Random = "random" });

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: Probe = Probe { is_block: false, dontcache: true, cachestat: true };

    /// The O_DIRECT probe of a file that opens with it.
    fn opens() -> std::result::Result<(), i32> {
        Ok(())
    }

    /// The O_DIRECT probe of a file that refuses it (squashfs, iso9660).
    fn refuses() -> std::result::Result<(), i32> {
        Err(libc::EINVAL)
    }

    #[test]
    fn neutral_prefers_dontcache() {
        let c = choose(CacheMode::Neutral, ALL, &Tuning::default(), opens).unwrap();
        let want = (ReadMech::DontCache, WriteMech::DontCache, Fadvise::Normal);
        assert_eq!((c.read, c.write, c.fadvise), want);
        // Without cachestat the readahead spill cannot be cleaned up: readahead goes off.
        let c =
            choose(CacheMode::Neutral, Probe { cachestat: false, ..ALL }, &Tuning::default(), opens).unwrap();
        assert_eq!((c.read, c.fadvise), (ReadMech::DontCache, Fadvise::Random));
    }

    #[test]
    fn neutral_without_dontcache_reads_direct_and_writes_behind() {
        let probe = Probe { dontcache: false, ..ALL };
        let c = choose(CacheMode::Neutral, probe, &Tuning::default(), opens).unwrap();
        assert_eq!((c.read, c.write), (ReadMech::Direct, WriteMech::WriteBehind));
        let forced = Tuning { no_dontcache: true, ..Tuning::default() };
        assert_eq!(choose(CacheMode::Neutral, ALL, &forced, opens).unwrap().read, ReadMech::Direct);
    }

    #[test]
    fn forced_dontcache_falls_back_where_missing() {
        let probe = Probe { dontcache: false, ..ALL };
        let t = Tuning {
            read: Some(ReadMech::DontCache),
            write: Some(WriteMech::DontCache),
            ..Tuning::default()
        };
        let c = choose(CacheMode::Neutral, probe, &t, opens).unwrap();
        assert_eq!((c.read, c.write), (ReadMech::Direct, WriteMech::WriteBehind));
        assert!(c.notes.iter().any(|n| n.contains("unavailable")));
    }

    #[test]
    fn evict_behind_needs_cachestat_in_neutral_mode() {
        let t = Tuning { read: Some(ReadMech::EvictBehind), no_cachestat: true, ..Tuning::default() };
        let c = choose(CacheMode::Neutral, Probe { dontcache: false, ..ALL }, &t, opens).unwrap();
        assert_eq!(c.read, ReadMech::Direct);
        let t = Tuning { read: Some(ReadMech::EvictBehind), ..Tuning::default() };
        assert_eq!(choose(CacheMode::Neutral, ALL, &t, opens).unwrap().read, ReadMech::EvictBehind);
        // Drop mode evicts everything, so it needs no residency.
        let t = Tuning { no_cachestat: true, ..Tuning::default() };
        assert_eq!(choose(CacheMode::Drop, ALL, &t, opens).unwrap().read, ReadMech::EvictBehind);
    }

    #[test]
    fn many_requests_in_flight_read_direct() {
        let t = Tuning { many_in_flight: true, ..Tuning::default() };
        let c = choose(CacheMode::Neutral, ALL, &t, opens).unwrap();
        assert_eq!((c.read, c.write), (ReadMech::Direct, WriteMech::DontCache));
    }

    /// O_DIRECT refused (squashfs, iso9660): neutral reads go DONTCACHE, else evict-behind,
    /// else the open fails; where O_DIRECT was asked for, it fails; keep mode never needs it.
    #[test]
    fn without_o_direct_neutral_reads_fall_back_in_one_place() {
        let many = Tuning { many_in_flight: true, ..Tuning::default() };
        let c = choose(CacheMode::Neutral, ALL, &many, refuses).unwrap();
        assert_eq!((c.read, c.direct), (ReadMech::DontCache, false));
        let c = choose(CacheMode::Neutral, Probe { dontcache: false, ..ALL }, &many, refuses).unwrap();
        assert_eq!(
            (c.read, c.write, c.fadvise),
            (ReadMech::EvictBehind, WriteMech::WriteBehind, Fadvise::Random)
        );
        let bare = Probe { dontcache: false, cachestat: false, ..ALL };
        let e = choose(CacheMode::Neutral, bare, &many, refuses).unwrap_err();
        assert!(e.to_string().contains("--cache drop or --cache keep"), "{e}");
        assert!(choose(CacheMode::Direct, ALL, &Tuning::default(), refuses).is_err());
        let forced = Tuning { read: Some(ReadMech::Direct), ..Tuning::default() };
        assert!(choose(CacheMode::Neutral, ALL, &forced, refuses).is_err());
        let probed = |what| move || -> std::result::Result<(), i32> { panic!("{what} opened O_DIRECT") };
        let c = choose(CacheMode::Keep, ALL, &Tuning::default(), probed("keep mode")).unwrap();
        assert_eq!((c.read, c.direct), (ReadMech::Buffered, false));
        // DONTCACHE reads keep O_DIRECT as their fallback where it opens.
        assert!(choose(CacheMode::Neutral, ALL, &Tuning::default(), opens).unwrap().direct);
    }

    #[test]
    fn run_time_fallbacks() {
        assert_eq!(read_fallback(ReadMech::DontCache, true), Some(ReadMech::Direct));
        assert_eq!(read_fallback(ReadMech::EvictBehind, true), Some(ReadMech::Direct));
        assert_eq!(read_fallback(ReadMech::DontCache, false), None);
        assert_eq!(read_fallback(ReadMech::Direct, true), None);
        assert_eq!(write_fallback(WriteMech::DontCache), Some(WriteMech::WriteBehind));
        assert_eq!(write_fallback(WriteMech::WriteBehind), None);
    }

    #[test]
    fn keep_and_direct_are_what_they_say() {
        let c = choose(CacheMode::Keep, ALL, &Tuning::default(), opens).unwrap();
        assert_eq!((c.read, c.write), (ReadMech::Buffered, WriteMech::Buffered));
        let c = choose(CacheMode::Direct, ALL, &Tuning::default(), opens).unwrap();
        assert_eq!((c.read, c.write), (ReadMech::Direct, WriteMech::Direct));
    }

    #[test]
    fn names_round_trip() {
        for n in ReadMech::NAMES {
            assert_eq!(n.parse::<ReadMech>().unwrap().name(), *n);
        }
        assert!("bogus".parse::<CacheMode>().unwrap_err().to_string().contains("neutral"));
    }
}
