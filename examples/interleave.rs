//! interleave: several sequential streams of small reads, interleaved on one NBD connection.
//!
//! The `interleave3` workload of `bench/serve.sh` (issue 5, `serve --prefetch`): the export,
//! from `--start` on, is cut into `--streams` equal regions; each stream reads its region
//! from the beginning, one `--block` at a time; the streams take turns, round-robin, one
//! request in flight in all, for `--seconds` or until the streams reach the ends of their
//! regions (they advance in step, so they all get there together), whichever comes first.
//! With `--wrap`, a stream that reaches the end of its region starts it again (counted in
//! `wraps`) and the run lasts `--seconds`; a re-read may then be served from a cache, which
//! is why it is not the default.
//!
//!     cargo build --release --examples
//!     target/release/examples/interleave nbd+unix:///?socket=/tmp/s --streams 3 --seconds 20
//!
//! Prints one JSON object on stdout: requests, bytes, elapsed seconds, IOPS, MiB/s, why it
//! stopped (`"ended"`: `"time"` or `"end"`), wraps and the client's own CPU time (user +
//! system), so that its cost can be checked against a server that answers from memory
//! (`nbdkit memory`).
//!
//! It uses lightfoot's own NBD client (`NbdBackend`, one connection): a request is one
//! `writev` and the reply is read straight into the buffer by the calling thread, with no
//! thread hand-off, so the client adds little to each round trip.

// Outside the library's `deny(unsafe_code)`: `getrusage` (std has none) needs `unsafe`; each
// block says why it is sound.
#![deny(clippy::undocumented_unsafe_blocks)]

use std::process::ExitCode;
use std::time::{Duration, Instant};

use lightfoot::backend::nbd::{NbdBackend, Target, Uri};
use lightfoot::backend::Backend;

struct Args {
    uri: Uri,
    streams: u64,
    block: u64,
    seconds: f64,
    start: u64,
    wrap: bool,
}

const USAGE: &str =
    "usage: interleave URI [--streams N (3)] [--block BYTES (4096)] [--seconds S (20)]\n       [--start BYTES (0)] [--wrap]";

fn parse_args() -> Result<Args, String> {
    let mut args = std::env::args().skip(1);
    let (mut uri, mut streams, mut block, mut seconds, mut start, mut wrap) =
        (None, 3u64, 4096u64, 20f64, 0u64, false);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        match a.as_str() {
            "--streams" => streams = value("--streams")?.parse().map_err(|e| format!("--streams: {e}"))?,
            "--block" => block = value("--block")?.parse().map_err(|e| format!("--block: {e}"))?,
            "--seconds" => seconds = value("--seconds")?.parse().map_err(|e| format!("--seconds: {e}"))?,
            "--start" => start = value("--start")?.parse().map_err(|e| format!("--start: {e}"))?,
            "--wrap" => wrap = true,
            "-h" | "--help" => return Err(USAGE.into()),
            s if s.starts_with('-') => return Err(format!("unknown option {s}\n{USAGE}")),
            s if uri.is_none() => uri = Some(s.parse::<Uri>().map_err(|e| e.to_string())?),
            s => return Err(format!("unexpected argument {s}\n{USAGE}")),
        }
    }
    let uri = uri.ok_or_else(|| USAGE.to_string())?;
    if streams == 0 || block == 0 || !seconds.is_finite() || seconds <= 0.0 {
        return Err("--streams, --block and --seconds must be positive".into());
    }
    Ok(Args { uri, streams, block, seconds, start, wrap })
}

/// User + system CPU seconds of this process so far.
fn cpu_seconds() -> f64 {
    // SAFETY: rusage is plain data; all zeroes is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes one rusage into `ru`, which outlives the call.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return f64::NAN;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn run(a: &Args) -> Result<(), String> {
    let nbd = NbdBackend::open(&Target::Uri(a.uri.clone()), 1).map_err(|e| e.to_string())?;
    let size = nbd.size().unwrap_or(0);
    // Each stream's region: an equal share of the export from --start, in whole blocks.
    let region = size.saturating_sub(a.start) / a.streams / a.block * a.block;
    if region == 0 {
        return Err(format!(
            "{}: {size} bytes from {} is too little for {} streams of {}-byte reads",
            a.uri, a.start, a.streams, a.block
        ));
    }
    let mut buf = vec![0u8; a.block as usize];
    let mut pos = vec![0u64; a.streams as usize]; // offset within each stream's region
    let (mut ios, mut wraps) = (0u64, 0u64);
    let limit = Duration::from_secs_f64(a.seconds);
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    let (elapsed, ended) = 'run: loop {
        for (i, p) in pos.iter_mut().enumerate() {
            let offset = a.start + i as u64 * region + *p;
            nbd.read(&mut buf, offset).map_err(|e| e.to_string())?;
            ios += 1;
            *p += a.block;
            let e = t0.elapsed();
            if e >= limit {
                break 'run (e, "time");
            }
            if *p == region {
                *p = 0;
                wraps += u64::from(a.wrap);
            }
        }
        // The streams advance in step: the last one has just finished its region.
        if !a.wrap && pos[0] == 0 {
            break (t0.elapsed(), "end");
        }
    };
    let cpu = cpu_seconds() - cpu0;
    let secs = elapsed.as_secs_f64();
    let bytes = ios * a.block;
    println!(
        "{{\"streams\":{},\"block\":{},\"region\":{region},\"ios\":{ios},\"bytes\":{bytes},\"seconds\":{secs:.6},\"iops\":{:.1},\"mib_s\":{:.1},\"ended\":\"{ended}\",\"wraps\":{wraps},\"client_cpu_s\":{cpu:.3}}}",
        a.streams,
        a.block,
        ios as f64 / secs,
        bytes as f64 / secs / (1 << 20) as f64
    );
    nbd.finish().map_err(|e| e.to_string())?;
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("interleave: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("interleave: {e}");
            ExitCode::FAILURE
        }
    }
}
