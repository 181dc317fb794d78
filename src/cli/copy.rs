//! `lightfoot copy SRC DST`.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use lightfoot::backend::s3::Requests;
use lightfoot::copy::endpoint::{parse_endpoints, parse_size};
use lightfoot::copy::open::{open_destination, open_source, DestOptions};
use lightfoot::copy::plan::Asked;
use lightfoot::copy::{changed_bytes, copy, Endpoint, Opened, Plan, Progress};
use lightfoot::io::residency;
use lightfoot::io::{CacheMode, CacheStat, Fadvise, Mechanism};

use super::parse_enum;
use lightfoot::ErrorKind;

use super::{human, progress};

const AFTER_HELP: &str = "\
ENDPOINTS:
  PATH        a regular file or a block device
  -           standard input (as SRC) or standard output (as DST); sequential
  null:[SIZE] reads zeroes, discards writes (as SRC: null:SIZE, SIZE bytes; as DST: null:)
  nbd://HOST[:PORT]/EXPORT
  nbd+unix:///EXPORT?socket=PATH
              an export on an NBD server
  nbds://HOST[:PORT]/EXPORT?tls-certificates=DIR
  nbds+unix:///EXPORT?socket=PATH&tls-certificates=DIR
              the same over TLS (STARTTLS, X.509; required, never downgraded). DIR holds
              ca-cert.pem (the CA the server's certificate must be signed by) and, if the
              server asks for one, client-cert.pem and client-key.pem. Without
              tls-certificates, libnbd's default directories are used. The server's
              certificate must name HOST (or tls-hostname=NAME); over a Unix socket only
              the CA is checked unless tls-hostname is given. tls-verify-peer=0 skips all
              checks (encryption without authentication). TLS-PSK is not supported.
  [ CMD ARGS ]
              a captive NBD server: lightfoot starts CMD with a listening socket (systemd
              socket activation), uses it, and stops it at the end. Put -- before the
              endpoints when CMD has options:
                lightfoot copy -- [ qemu-nbd -f qcow2 disk.qcow2 ] disk.raw
                lightfoot copy -- disk.raw [ nbdkit file out.raw ]
  s3://BUCKET/KEY
              an image in object storage (AWS_* variables and ~/.aws files as the AWS
              tools read them): as SRC, one object or a block image; as DST, one object
              (a multipart upload that appears whole at the end, or not at all), or with
              --object-size block objects KEY/%016x as nbdkit's S3 plugin lays them out.
              See docs/object-storage.md.

NBD: requests stay within the server's advertised block sizes; several are in flight at once
(--workers; with 8 or more, seldom two neighbours at once, which the block layer would merge).
Holes come from the server's base:allocation map. An NBD DST must be at least as large as SRC;
unless --no-sparse, it is first zeroed with one fast zero (NBD_CMD_WRITE_ZEROES with FAST_ZERO)
if the server offers it, and then only data is written; otherwise holes are zeroed with
WRITE_ZEROES. TRIM is never used to make zeroes. DST is flushed (NBD_CMD_FLUSH) before success
is reported, unless --no-flush.

Incremental copies (--bitmap NAME): SRC must be an NBD export with the dirty bitmap NAME (the
meta context qemu:dirty-bitmap:NAME, e.g. qemu-nbd -r -B NAME). The changed bytes are counted
first (the job's size for progress and the summary); then only changed ranges are read, and
written into DST as it is (it must exist and be SRC's size: the previous copy); changed ranges
that read as zeroes are zeroed. See docs/incremental.md.

A regular-file DST is created, or truncated and then extended to the size of SRC, so holes in
SRC stay holes. A block-device DST is written in full: holes are zeroed (BLKZEROOUT) unless
--destination-is-zero. DST is made durable (fdatasync, and its directory for a new file)
before success is reported, unless --no-flush.

Cache modes (--cache):
  neutral  pages of SRC cached before the job stay cached; pages the job brings in (SRC and
           DST) are gone when it ends; the footprint stays within tens of MiB meanwhile
  keep     plain buffered I/O: the kernel keeps what it likes
  drop     evict every page the job touched, including ones cached before
  direct   O_DIRECT for both sides

Ctrl-C stops the copy at the next request and cleans up (exit 130); 2 s later every NBD
connection is shut down, also one still connecting, so a server that stopped answering or a
host that drops connects cannot hold the copy. A second Ctrl-C exits at once, without the
clean-up.

Exit status: 0 success, 1 failure (DST may be incomplete: the message says so), 2 usage
error, 130 interrupted, 141 DST is - and its reader closed it early (quiet, as for cat).
Environment: LIGHTFOOT_NO_DONTCACHE=1 is --no-dontcache. LIGHTFOOT_TCP_KEEPALIVE=IDLE,INTERVAL,COUNT
sets the TCP keepalive of NBD connections (seconds of silence before probes, 1-32767;
seconds between probes, 1-32767; unanswered probes, 1-127; default 30,10,6, and a malformed
value is ignored with a warning: a server gone silent without closing fails the copy after
about 90 s, or after TCP's retransmission limit, ~15 min, if it went while lightfoot was
sending it data; one that is alive but slow is waited for). RUST_LOG (e.g. lightfoot=debug)
overrides -v. See docs/copy.md, docs/cache-policy.md and, for every error, docs/errors.md.";

/// Copy a file, block device, stream or NBD export, leaving the page cache as it was.
#[derive(Args)]
#[command(
    after_long_help = AFTER_HELP,
    override_usage = "lightfoot copy [OPTIONS] SRC DST\n       lightfoot copy [OPTIONS] -- [ CMD ARGS ] DST\n       lightfoot copy [OPTIONS] -- SRC [ CMD ARGS ]"
)]
pub struct CopyArgs {
    /// SRC then DST. Source: a file, a block device, `-` (standard input), `null:SIZE`, an NBD
    /// URI, `[ CMD ARGS ]` or `s3://BUCKET/KEY`. Destination: a file (created or truncated), a
    /// block device, `-` (standard output), `null:`, an NBD URI, `[ CMD ARGS ]` or
    /// `s3://BUCKET/KEY` with --object-size.
    #[arg(value_name = "ENDPOINT", num_args = 2.., required = true)]
    endpoints: Vec<String>,

    /// Page-cache policy for both sides: neutral, keep, drop or direct (see below).
    #[arg(long, value_name = "MODE", default_value = "neutral", value_parser = parse_enum::<CacheMode>)]
    cache: CacheMode,

    /// Parallel workers, each with one request in flight (1 to 64) [default: 2; 16 when SRC or
    /// DST is NBD, to hide the network round trips].
    #[arg(short = 'j', long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=64))]
    workers: Option<u16>,

    /// Bytes per request (K, M or G suffix; at least 64K, at most 256M) [default: 4M; 256K
    /// when SRC or DST is NBD]. Lowered to the largest request an endpoint takes (32M for
    /// files, the advertised maximum for NBD).
    #[arg(long, value_name = "SIZE", value_parser = parse_request_size)]
    request_size: Option<usize>,

    /// Connections to an NBD server that advertises multi-conn (CAN_MULTI_CONN); a server
    /// that does not gets one (1 to 16) [default: 4 for URIs, 1 for captive servers].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=16))]
    connections: Option<u16>,

    /// Write every byte: zeroes in SRC are written (or allocated) in DST rather than left as
    /// holes.
    #[arg(long)]
    no_sparse: bool,

    /// Allocate the whole DST file before copying, so that a lack of room shows before any
    /// data is written (regular files, when SRC's size is known in advance, on a filesystem
    /// that can allocate in advance; otherwise a warning says it was not done).
    #[arg(long)]
    preallocate: bool,

    /// DST (a block device or NBD export) already reads as zeroes: skip zeroing its holes.
    #[arg(long)]
    destination_is_zero: bool,

    /// Do not make DST durable at the end (eviction still waits for writeback).
    #[arg(long)]
    no_flush: bool,

    /// Incremental copy: copy only the blocks the NBD source's dirty bitmap NAME marks
    /// changed (the meta context qemu:dirty-bitmap:NAME, as `qemu-nbd -B NAME` exports it)
    /// into DST, which must hold the previous copy: it must exist and be SRC's size, and is
    /// written in place (no truncation, no zeroing). Changed ranges that read as zeroes are
    /// zeroed with WRITE_ZEROES. A source without the bitmap is an error listing the contexts
    /// it offers. From lightfoot serve --dirty-bitmap, a file or s3:// block image DST records
    /// the bitmap's epoch, and a later incremental into one that is not the copy its epoch
    /// applies to is refused (docs/bitmap.md).
    #[arg(long, value_name = "NAME", conflicts_with_all = ["preallocate", "destination_is_zero"])]
    bitmap: Option<String>,

    /// Show a progress bar on a terminal. With =FD (attached with '='), write the progress to
    /// file descriptor FD instead, as nbdcopy does: lines N/100, 0/100 first, each whole
    /// percent as it is reached, 100/100 once the copy has succeeded. A closed FD, or one
    /// whose reader goes away, never fails the copy.
    #[arg(short = 'p', long, value_name = "FD", num_args = 0..=1, require_equals = true)]
    progress: Option<Option<i32>>,

    /// Write the page cache the job holds and has evicted to file descriptor FD, as JSON
    /// lines, every 500 ms and once at the end (attached with '='): seconds, bytes done, held
    /// (above what SRC and DST held before), evicted, and SRC's and DST's cache before and now.
    /// A closed FD, or one whose reader goes away, never fails the copy.
    #[arg(long, value_name = "FD", require_equals = true)]
    footprint: Option<i32>,

    /// Print a JSON summary: bytes, seconds, MiB/s, mechanisms, page-cache footprint of SRC
    /// and DST before and after.
    #[arg(long)]
    json: bool,

    /// Say which mechanisms were chosen and why (-vv: more).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,

    #[command(flatten)]
    mechanisms: super::MechanismArgs,

    #[command(flatten)]
    s3: super::S3Args,

    /// Readahead advice for SRC: normal, sequential or random (default: normal, or random
    /// where readahead would defeat the mechanism: evict-behind, or DONTCACHE without
    /// cachestat to clean up the readahead past the last read).
    #[arg(long, value_name = "ADVICE", help_heading = "Advanced", value_parser = parse_enum::<Fadvise>)]
    fadvise: Option<Fadvise>,
}

fn parse_request_size(s: &str) -> Result<usize, String> {
    let n = parse_size(s).map_err(|e| e.to_string())?;
    if !(64 << 10..=256 << 20).contains(&n) {
        return Err(format!("request size must be between 64K and 256M, not {s}"));
    }
    Ok(n as usize)
}

/// Ctrl-C: the first one stops the copy at the next request (so the cache is cleaned up), a
/// second one exits at once.
static CANCEL: AtomicBool = AtomicBool::new(false);

/// How long requests already sent to an NBD server get to complete after the first Ctrl-C.
/// A server that answers at all answers a request within milliseconds; one that has not
/// answered by then (stopped, wedged, or busy with a FLUSH the user no longer wants) has its
/// connections shut down, so the copy ends and cleans up without a second Ctrl-C.
const INTERRUPT_GRACE: Duration = Duration::from_secs(2);

/// Reports an endpoint that could not be opened; the exit status (130 when Ctrl-C ended a
/// handshake, 1 otherwise).
fn open_failed(e: &lightfoot::Error) -> i32 {
    super::report(e);
    if e.kind() == ErrorKind::Interrupted {
        super::EXIT_INTERRUPTED
    } else {
        1
    }
}

#[derive(serde::Serialize)]
struct Side {
    name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    mechanism: Option<Mechanism>,
    /// Cached bytes before and after the job (null where not known).
    cached_before: Option<u64>,
    cached_after: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stat_after: Option<CacheStat>,
    /// Requests made to object storage, by type, and bytes moved (`s3://` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    requests: Option<Requests>,
}

#[derive(serde::Serialize)]
struct Summary {
    ok: bool,
    bytes: u64,
    /// `--bitmap`: the bitmap, and the bytes it marked changed (the job's size; `bytes` is
    /// how many of them were copied).
    #[serde(skip_serializing_if = "Option::is_none")]
    bitmap: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    changed: Option<u64>,
    written: u64,
    zero: u64,
    seconds: f64,
    mib_per_second: f64,
    cache: CacheMode,
    workers: u16,
    request_size: usize,
    source: Side,
    destination: Side,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

impl Side {
    /// `opened`'s side of the summary: its cache figures before the job and after it (what
    /// [`cached_of`] gives), and its requests to object storage (from its `report`).
    fn of(
        opened: &Opened,
        before: Option<u64>,
        after: (Option<u64>, Option<CacheStat>, Option<Mechanism>),
        requests: Option<Requests>,
    ) -> Side {
        Side {
            name: opened.backend.name().to_string(),
            mechanism: after.2,
            cached_before: before,
            cached_after: after.0,
            stat_after: after.1,
            requests,
        }
    }
}

fn cached_now(ep: &Endpoint) -> Option<u64> {
    let Endpoint::Path(p) = ep else { return None };
    // Regular files and block devices only (residency::open refuses the rest unopened).
    let f = residency::open(p).ok()?;
    residency::measure(&f, p, 0, None).ok().map(|r| r.cached_bytes())
}

fn cached_of(opened: &Opened) -> (Option<u64>, Option<CacheStat>, Option<Mechanism>) {
    match opened.backend.cache_info() {
        Some(ci) => (ci.stat.map(|s| s.cached * ci.page_size), ci.stat, Some(ci.mechanism)),
        None => (None, None, None),
    }
}

pub fn run(args: CopyArgs) -> i32 {
    super::init_logging(args.verbose);
    let parsed = parse_endpoints(&args.endpoints).map_err(|e| e.to_string()).and_then(|eps| {
        <[Endpoint; 2]>::try_from(eps)
            .map_err(|eps| format!("expected SRC and DST, got {} endpoints", eps.len()))
    });
    let [src_ep, dst_ep] = match parsed {
        Ok(pair) => pair,
        Err(e) => return super::usage_error("copy", e),
    };
    if src_ep == Endpoint::Null(None) {
        return super::usage_error("copy", "null: as SRC needs a size: null:SIZE (e.g. null:1G)");
    }
    // Before anything is opened: the descriptor's number cannot name a file of our own yet.
    let to_stdout = dst_ep == Endpoint::Stdio;
    let fd_out =
        |option, fd: Option<i32>| fd.map(|fd| progress::FdOut::open(option, fd, to_stdout)).transpose();
    let (percent, footprint_out) =
        match (fd_out("--progress", args.progress.flatten()), fd_out("--footprint", args.footprint)) {
            (Ok(p), Ok(f)) => (p.flatten(), f.flatten()),
            (Err(e), _) | (_, Err(e)) => return super::usage_error("copy", e),
        };
    let asked = Asked {
        workers: args.workers,
        request_size: args.request_size,
        connections: args.connections,
        object_size: args.s3.object_size,
    };
    let plan = match Plan::new(&src_ep, &dst_ep, asked) {
        Ok(p) => p,
        Err(e) => {
            super::report(&e);
            return 1;
        }
    };
    let _ = ctrlc::set_handler(|| {
        if CANCEL.swap(true, Ordering::SeqCst) {
            std::process::exit(super::EXIT_INTERRUPTED);
        }
        std::thread::spawn(|| {
            std::thread::sleep(INTERRUPT_GRACE);
            lightfoot::backend::nbd::interrupt_all();
        });
    });
    let tuning = args.mechanisms.tuning(args.fadvise, plan.many_in_flight);

    let started = std::time::Instant::now();
    let src_before = cached_now(&src_ep);
    let dst_before = cached_now(&dst_ep);
    let s3 = args.s3.options(false);
    let src =
        match open_source(&src_ep, args.cache, &tuning, plan.src_connections, &s3, args.bitmap.as_deref()) {
            Ok(s) => s,
            Err(e) => return open_failed(&e),
        };
    // Ctrl-C while SRC was being opened (a slow handshake that finished within the grace):
    // stop before DST is created, truncated or zeroed.
    if CANCEL.load(Ordering::SeqCst) {
        super::report(&"copy: interrupted before the destination was opened");
        return super::EXIT_INTERRUPTED;
    }
    let size = src.backend.size();
    if args.preallocate {
        // Only a regular file (new, or one that is truncated) is allocated in advance.
        let regular =
            matches!(&dst_ep, Endpoint::Path(p) if std::fs::metadata(p).map_or(true, |m| m.is_file()));
        if !regular {
            tracing::warn!("--preallocate: {dst_ep} is not a regular file: nothing to preallocate");
        } else if size.is_none() {
            tracing::warn!(
                "--preallocate: the size of {src_ep} is not known in advance: {dst_ep} is not preallocated"
            );
        }
    }
    let dest_opts = DestOptions {
        preallocate: args.preallocate,
        destination_is_zero: args.destination_is_zero,
        sparse: !args.no_sparse,
        connections: plan.dst_connections,
        s3,
        in_place: args.bitmap.is_some(),
    };
    let dst = match open_destination(&dst_ep, &src, size, args.cache, &tuning, dest_opts) {
        Ok(d) => d,
        Err(e) => return open_failed(&e),
    };
    // An incremental copy's size: what the bitmap marks changed, counted before copying.
    let changed = match (&args.bitmap, size) {
        (Some(_), Some(size)) => match changed_bytes(&*src.backend, size, &CANCEL) {
            Ok(n) => Some(n),
            Err(e) => return open_failed(&e),
        },
        _ => None,
    };
    let job_size = changed.or(size);
    let mut opts = plan.options(dst.zeroed, !args.no_sparse, !args.no_flush, args.bitmap.is_some());
    if let (Endpoint::S3(_), Some(_)) = (&dst_ep, &args.bitmap) {
        // Each object with changed bytes written once, whole.
        opts.whole_units = dst.backend.caps().alloc_unit.map(u64::from);
    }
    let progress = Arc::new(Progress::default());
    let bar = args.progress == Some(None) && std::io::stderr().is_terminal();
    let footprint = (bar || footprint_out.is_some()).then(|| {
        progress::Footprint::new((&src_ep, src_before), (&dst_ep, dst_before), footprint_out, started)
    });
    let reporter = progress::Reporter::start(bar, percent, footprint, job_size, progress.clone());
    let result = copy(&*src.backend, &*dst.backend, &opts, &progress, &CANCEL);
    let result = result.and_then(|stats| {
        src.check_size_unchanged(size)
            .map_err(|error| lightfoot::copy::Failure { error, done: stats.bytes })?;
        if opts.flush {
            dst.sync_parent().map_err(|error| lightfoot::copy::Failure { error, done: stats.bytes })?;
        }
        // Only once every changed byte is in DST: a failed copy keeps the old record, so a
        // retry is still checked against the right base.
        if let Some(name) = &args.bitmap {
            dst.record_epoch(&src, name)
                .map_err(|error| lightfoot::copy::Failure { error, done: stats.bytes })?;
        }
        Ok(stats)
    });
    let footprint = reporter.finish(result.is_ok());

    // A captive server that died mid-copy shows as a lost connection: say how it ended. The
    // engine's finish has stopped the server by now; Captive kept how it ended if that was
    // before the stop.
    let (src_report, dst_report) = (src.backend.report(), dst.backend.report());
    let ended: Vec<String> = if result.is_err() {
        [&src_report, &dst_report].into_iter().filter_map(|r| r.server_ended.clone()).collect()
    } else {
        Vec::new()
    };
    let (src_after, _, src_mech) = cached_of(&src);
    let (dst_after, dst_stat, dst_mech) = cached_of(&dst);
    let (ok, bytes, written, zero, seconds, error) = match &result {
        Ok(s) => (true, s.bytes, s.written, s.zero, s.seconds, None),
        Err(f) => {
            let error = std::iter::once(f.error.to_string()).chain(ended.iter().cloned()).collect::<Vec<_>>();
            (false, f.done, 0, 0, 0.0, Some(error.join("; ")))
        }
    };
    let summary = Summary {
        ok,
        bytes,
        bitmap: args.bitmap.clone(),
        changed,
        written,
        zero,
        seconds,
        mib_per_second: if seconds > 0.0 { bytes as f64 / seconds / 1048576.0 } else { 0.0 },
        cache: args.cache,
        workers: plan.workers,
        request_size: plan.request_size,
        source: Side::of(&src, src_before, (src_after, None, src_mech), src_report.requests),
        destination: Side::of(&dst, dst_before, (dst_after, dst_stat, dst_mech), dst_report.requests),
        error,
    };
    drop(src);
    drop(dst);
    if let Some(f) = footprint {
        f.end(bytes);
    }

    if args.json {
        let text = serde_json::to_string_pretty(&summary).expect("summary serialises");
        if to_stdout {
            eprintln!("{text}")
        } else {
            super::print_out(&format!("{text}\n"))
        }
    }
    match result {
        Ok(_) => {
            if !args.json {
                print_summary(&summary, args.verbose > 0, to_stdout);
            }
            0
        }
        Err(f) => {
            // A reader that closed our stdout early (`| head`): quiet, as for `cat`, but not
            // success, since the copy is incomplete. The status a SIGPIPE death gives, so
            // `set -o pipefail` treats it the way it treats every other tool in the pipe.
            if to_stdout
                && std::error::Error::source(&f.error)
                    .and_then(|s| s.downcast_ref::<std::io::Error>())
                    .is_some_and(|e| e.raw_os_error() == Some(libc::EPIPE))
            {
                return super::EXIT_BROKEN_PIPE;
            }
            super::report(&f.error);
            for e in &ended {
                eprintln!("lightfoot: {e}");
            }
            if !matches!(dst_ep, Endpoint::Null(_)) {
                let total = job_size.map(|s| format!(" of {}", human::bytes(s))).unwrap_or_default();
                eprintln!(
                    "lightfoot: {} is incomplete: {} copied{total} before the failure",
                    summary.destination.name,
                    human::bytes(f.done)
                );
            }
            if f.error.kind() == ErrorKind::Interrupted {
                super::EXIT_INTERRUPTED
            } else {
                1
            }
        }
    }
}

fn print_summary(s: &Summary, verbose: bool, to_stderr: bool) {
    let cache = |before: Option<u64>, after: Option<u64>| match (before, after) {
        (Some(b), Some(a)) => format!("{} → {}", human::bytes(b), human::bytes(a)),
        (None, Some(a)) => format!("(new) → {}", human::bytes(a)),
        _ => "not visible".to_string(),
    };
    let changed = match (&s.bitmap, s.changed) {
        (Some(name), Some(_)) => format!(" changed (bitmap {name})"),
        _ => String::new(),
    };
    let mut text = format!(
        "copied {}{changed} in {:.2} s ({:.0} MiB/s); {} written, {} zero\npage cache: source {}, destination {}\n",
        human::bytes(s.bytes),
        s.seconds,
        s.mib_per_second,
        human::bytes(s.written),
        human::bytes(s.zero),
        cache(s.source.cached_before, s.source.cached_after),
        cache(s.destination.cached_before, s.destination.cached_after),
    );
    for (what, side) in [("source", &s.source), ("destination", &s.destination)] {
        if let Some(r) = &side.requests {
            text += &format!("{what}: {}\n", human::requests(r));
        }
    }
    if verbose {
        for (what, side, reads) in [("source", &s.source, true), ("destination", &s.destination, false)] {
            if let Some(m) = &side.mechanism {
                text += &match reads {
                    true => format!("{what}: read {}, fadvise {}", m.read, m.fadvise),
                    false => format!("{what}: write {}", m.write),
                };
                for n in &m.notes {
                    text += &format!("; {n}");
                }
                text += "\n";
            }
        }
    }
    if to_stderr {
        eprint!("{text}")
    } else {
        super::print_out(&text)
    }
}
