//! `lightfoot serve FILE|DEVICE`.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use lightfoot::backend::s3::S3Uri;
use lightfoot::backend::{Backend, FileBackend, S3Backend};
use lightfoot::bitmap::{Location, Tracker};
use lightfoot::copy::endpoint::parse_size;
use lightfoot::error::{io_message, Op};
use lightfoot::filters::coalesce::CoalesceConfig;
use lightfoot::filters::prefetch::PrefetchConfig;
use lightfoot::filters::{Stack, StackConfig};
use lightfoot::io::{CacheMode, Fadvise, FileJob, OpenOptions};
use lightfoot::server::{Export, Listener, Server};
use lightfoot::tls::ServerTls;
use lightfoot::ErrorKind;

use super::parse_enum;

const AFTER_HELP: &str = "\
Serves FILE (a raw image: for qcow2, put qemu-nbd in front) or a block device over NBD, with
the fixed newstyle handshake, structured replies, base:allocation block status, and several
requests in flight per connection. Each connection opens FILE itself (readahead state is per
open file); write errors and block locks are shared by all connections, so the export
advertises CAN_MULTI_CONN.

URIs: nbd://127.0.0.1:10809/NAME over TCP, nbd+unix:///NAME?socket=PATH over a Unix socket.
The empty export name always reaches the export too.

TLS (STARTTLS, X.509): --tls=require --tls-certificates DIR, where DIR holds server-cert.pem
and server-key.pem, and ca-cert.pem for --tls-verify-peer (the layout qemu-nbd and nbdkit
read). Clients then use
nbds:// or nbds+unix:// URIs, e.g.
  nbdinfo 'nbds://localhost:10809/?tls-certificates=/etc/pki/client'
  qemu-img info --object tls-creds-x509,id=tls0,endpoint=client,dir=/etc/pki/client \\
      --image-opts driver=nbd,host=localhost,port=10809,tls-creds=tls0
TLS-PSK is not supported (rustls has no external PSK). See docs/tls.md.

Object storage: FILE may be s3://BUCKET/KEY (AWS_* variables and ~/.aws files as the AWS tools
read them). One object is served read-only; block objects (--object-size, nbdkit's S3 layout)
are writable, by one writer at a time (a lease object; --break-lease, --without-lease). Every
write is stored before it is acknowledged. See docs/object-storage.md.

--run 'CMD' runs CMD through sh with $uri (nbds:// with --tls=require), $unixsocket (for
--unix) and $port (for TCP) set, stops serving when it exits and exits with its status. CMD
reaches the server's own listener: without --unix that is TCP, which every local user can
reach too. Example:
  lightfoot serve --unix /tmp/s disk.img --run 'nbdcopy \"$uri\" backup.img'

Socket activation: started by systemd from a socket unit with Accept=no (LISTEN_PID and
LISTEN_FDS set, the listening socket on fd 3), it serves on that socket and ignores --unix
and --listen; a connection passed instead (Accept=yes) is refused. Also:
  systemd-socket-activate -l /run/lightfoot/disk.sock lightfoot serve disk.img
Units to start from: examples/systemd/ in the source, docs/recipes.md.

TCP connections use keepalive: a client that vanishes without closing (its host died, the
network went) is dropped after about 90 s of silence (probes after 30 s, every 10 s, 6
unanswered), or after TCP's retransmission limit (~15 min) if replies to it were still
unacknowledged; LIGHTFOOT_TCP_KEEPALIVE=IDLE,INTERVAL,COUNT (seconds, seconds, probes)
changes the probes. An idle
client that is alive is never dropped.

Environment: LIGHTFOOT_NO_DONTCACHE=1 is --no-dontcache; RUST_LOG (e.g. lightfoot=debug)
overrides -v.

Exit status: 0 after a clean shutdown (Ctrl-C, SIGTERM; also when --exit-with-parent finds
the parent already gone), 1 on failure (FILE cannot be opened, the address cannot be bound,
the socket systemd passed is not listening, TLS certificates cannot be loaded, --run cannot
start CMD, the pid file cannot be written, or write-back of held writes fails at exit), 2
usage error; with --run, the status of CMD. See docs/serve.md, docs/cache-policy.md and, for
every error, docs/errors.md.";

/// Serve a file or block device over NBD, leaving the page cache as it was.
#[derive(Args)]
#[command(after_long_help = AFTER_HELP)]
pub struct ServeArgs {
    /// The file or block device to export, or an image in object storage (s3://BUCKET/KEY:
    /// see --object-size and docs/object-storage.md).
    #[arg(value_name = "FILE")]
    file: PathBuf,

    #[command(flatten)]
    s3: super::S3Args,

    /// Listen on this Unix socket instead of TCP. The file appears only once the server
    /// accepts connections (waiting for it to exist is enough); a stale socket file is
    /// replaced, a live server's is not ("address in use"); removed at exit.
    #[arg(long, value_name = "PATH", conflicts_with = "listen")]
    unix: Option<PathBuf>,

    /// TCP address and port to listen on.
    #[arg(long, value_name = "ADDR:PORT", default_value = "127.0.0.1:10809")]
    listen: String,

    /// The export's name (clients may also ask for the empty name).
    #[arg(long, value_name = "NAME", default_value = "")]
    export_name: String,

    /// A description sent to clients that ask (NBD_INFO_DESCRIPTION).
    #[arg(long, value_name = "TEXT")]
    description: Option<String>,

    /// Refuse writes, trims and zeroes (EPERM); FILE is opened read-only.
    #[arg(short, long)]
    read_only: bool,

    /// Page-cache policy: neutral, keep, drop or direct.
    #[arg(long, value_name = "MODE", default_value = "neutral", value_parser = parse_enum::<CacheMode>)]
    cache: CacheMode,

    /// Readahead advice for FILE: normal, sequential or random (default: chosen with the
    /// read mechanism).
    #[arg(long, value_name = "ADVICE", value_parser = parse_enum::<Fadvise>)]
    fadvise: Option<Fadvise>,

    /// Read ahead for sequential streams of small reads (several interleaved ones, on any
    /// connection) into a bounded buffer of lightfoot's own, not the page cache. On by
    /// default, except with --cache=keep (the page cache reads ahead then, and keeps what it
    /// read); this flag turns it on there too. A small read that misses near recent reads
    /// reads its whole 256K chunk into the buffer, for as long as such chunks are read
    /// (docs/serve.md, "Read-around").
    #[arg(long, overrides_with = "no_prefetch")]
    prefetch: bool,

    /// No read-ahead: every read goes to FILE as it comes, at the client's size.
    #[arg(long, overrides_with = "prefetch")]
    no_prefetch: bool,

    /// With prefetch on: the buffer's bound, at least one 256K chunk (K, M, G or T suffix),
    /// buffers kept for reuse included. Read-ahead in flight comes on top: 512K from a file
    /// or device, 16M over s3://.
    #[arg(long, value_name = "SIZE", default_value = "64M", value_parser = parse_prefetch_size)]
    prefetch_size: u64,

    /// With prefetch on: reads larger than this pass straight through (K, M, G or T suffix; not
    /// 0).
    #[arg(long, value_name = "SIZE", default_value = "128K", value_parser = parse_nonzero_size)]
    prefetch_max_request: u64,

    /// Hold small writes (up to --coalesce-block) in memory, from every connection, and write
    /// them back merged: neighbouring writes in one block become one request where the gaps
    /// between them lie inside filesystem blocks they write (4 KiB at most; e.g. 1 KiB every
    /// 4 KiB), the gaps read from FILE first; other writes go down as they are. Reads and
    /// block status see the held data. Written back on FLUSH (before it replies), FUA,
    /// --coalesce-size, --coalesce-age, as soon as a writer has moved past a block, and at
    /// clean shutdown; a write-back error fails every later FLUSH and FUA. A kill -9 loses
    /// what was not flushed, as a power loss would. Does nothing with --read-only.
    #[arg(long)]
    coalesce: bool,

    /// With --coalesce: most bytes held, counting 96 bytes of bookkeeping for each run of
    /// held bytes; writers wait above it (K, M, G or T suffix; not 0).
    #[arg(long, value_name = "SIZE", default_value = "64M", value_parser = parse_nonzero_size)]
    coalesce_size: u64,

    /// With --coalesce: held writes older than this are written back (e.g. 500ms, 1s, 0 for
    /// as soon as possible; at most 24h).
    #[arg(long, value_name = "TIME", default_value = "1s", value_parser = parse_coalesce_age)]
    coalesce_age: std::time::Duration,

    /// With --coalesce: the block, the most one write-back request spans; writes up to this
    /// size are held (a multiple of 4K, at most 16M; K or M suffix).
    #[arg(long, value_name = "SIZE", default_value = "64K", value_parser = parse_coalesce_block)]
    coalesce_block: u64,

    /// Keep the dirty bitmap NAME for incremental copies (repeat for more): every write,
    /// zero and trim marks the blocks it touches, and clients read the marks as the meta
    /// context qemu:dirty-bitmap:NAME (lightfoot copy --bitmap NAME, nbdinfo --map). The
    /// bitmaps live in FILE (default: IMAGE.bitmaps beside the image; given once for all;
    /// needed for a block device),
    /// which is made if missing, as is NAME (64K granularity; other bitmaps there are kept
    /// and offered too, the enabled ones marked). Saved at a clean exit; a server killed
    /// before leaves them counting the whole image changed. With --read-only the file and
    /// NAME must exist. An s3:// block image keeps its bitmaps in the object
    /// KEY/lightfoot.bitmaps (no =FILE; not with --without-lease). See lightfoot bitmap and
    /// docs/bitmap.md.
    #[arg(long, value_name = "NAME[=FILE]")]
    dirty_bitmap: Vec<String>,

    /// TLS: off (STARTTLS refused), on (offered; plaintext clients still served) or require
    /// (only STARTTLS and ABORT are accepted before TLS: every other option gets
    /// NBD_REP_ERR_TLS_REQD, NBD_OPT_EXPORT_NAME closes the connection). on and require need
    /// --tls-certificates.
    #[arg(long, value_name = "MODE", value_enum, default_value = "off")]
    tls: TlsMode,

    /// With --tls: the directory holding server-cert.pem (the server's certificate, then any
    /// intermediates, PEM), server-key.pem (its private key: PKCS#8, PKCS#1 or SEC1 PEM) and,
    /// for --tls-verify-peer, ca-cert.pem (the CA that signs client certificates).
    #[arg(long, value_name = "DIR")]
    tls_certificates: Option<PathBuf>,

    /// With --tls: require every client to present a certificate signed by ca-cert.pem
    /// (from client-cert.pem in qemu's and libnbd's layout); others fail the TLS handshake.
    #[arg(long)]
    tls_verify_peer: bool,

    /// Worker threads per connection (requests carried out in parallel; 1 to 256).
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=256))]
    threads: u16,

    /// Connections served at once (at least 1); more are closed on arrival.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: u32,

    /// Run CMD (with $uri, $unixsocket, $port set) and stop serving when it exits.
    #[arg(long, value_name = "CMD")]
    run: Option<String>,

    /// Print request counts, bytes, errors, latency percentiles and the cache footprint at
    /// exit and on SIGUSR1 (to stderr); with prefetch (on by default) or --coalesce, one more line each
    /// with the filter's counters (docs/serve.md).
    #[arg(long)]
    stats: bool,

    /// With --stats: print JSON instead of a table.
    #[arg(long, requires = "stats")]
    json: bool,

    /// Write the server's process id to PATH once it is listening (removed at exit).
    #[arg(long, value_name = "PATH")]
    pid_file: Option<PathBuf>,

    /// Exit when the parent process exits.
    #[arg(long)]
    exit_with_parent: bool,

    /// Log connections and the mechanisms chosen (-vv: more).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,

    #[command(flatten)]
    mechanisms: super::MechanismArgs,
}

/// `--tls`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum TlsMode {
    Off,
    On,
    Require,
}

pub fn run(a: ServeArgs) -> i32 {
    super::init_logging(a.verbose);
    let tls = match (a.tls, &a.tls_certificates) {
        (TlsMode::Off, None) if !a.tls_verify_peer => None,
        (TlsMode::Off, _) => {
            return super::usage_error(
                "serve",
                "--tls-certificates and --tls-verify-peer need --tls=on or --tls=require",
            )
        }
        (_, None) => {
            return super::usage_error("serve", "--tls=on and --tls=require need --tls-certificates DIR")
        }
        (mode, Some(dir)) => match ServerTls::load(dir, a.tls_verify_peer, mode == TlsMode::Require) {
            Ok(t) => Some(t),
            Err(e) => {
                super::report(&e);
                return 1;
            }
        },
    };
    let tuning = a.mechanisms.tuning(a.fadvise, true);
    let shared = Arc::new(FileJob::default());
    let (path, mode) = (a.file.clone(), a.cache);
    let coalesce = CoalesceConfig {
        size: a.coalesce_size,
        age: a.coalesce_age,
        block: a.coalesce_block,
        max_request: a.coalesce_block,
        ..CoalesceConfig::default()
    };
    let prefetch = PrefetchConfig {
        size: a.prefetch_size,
        max_request: a.prefetch_max_request,
        ..PrefetchConfig::default()
    };
    let bitmaps = match dirty_bitmaps(&a.dirty_bitmap, &a.file) {
        Ok(b) => b,
        Err(e) => return super::usage_error("serve", e),
    };
    let s3 = match path.to_str().filter(|p| S3Uri::is_s3(p)) {
        None if a.s3.object_size.is_some() => {
            return super::usage_error("serve", "--object-size and --size are for s3:// images")
        }
        None => None,
        Some(uri) => {
            let uri: S3Uri = match uri.parse() {
                Ok(u) => u,
                Err(e) => return super::usage_error("serve", e),
            };
            let opts = a.s3.options(!a.read_only);
            match S3Backend::open(&uri, &opts) {
                Ok(b) => Some(Arc::new(b)),
                Err(e) => {
                    super::report(&e);
                    return 1;
                }
            }
        }
    };
    let remote = s3.is_some();
    let cfg = StackConfig {
        read_only: a.read_only,
        prefetch: (a.prefetch || (!a.no_prefetch && a.cache != CacheMode::Keep))
            .then_some(prefetch)
            .map(|p| if remote { p.for_round_trips() } else { p }),
        coalesce: a.coalesce.then_some(coalesce).map(|c| if remote { c.for_round_trips() } else { c }),
    };
    let to_release = s3.clone();
    // Every open is a file of its own (readahead state and writeback errors are per open
    // file), sharing the export's error latch and block locks. An image in object storage is
    // one backend for all: its object locks and map of objects are shared.
    let open = move |write: bool| -> lightfoot::Result<Arc<dyn Backend>> {
        if let Some(b) = &s3 {
            return Ok(b.clone());
        }
        let opts = OpenOptions { write, create: false, truncate: false };
        Ok(Arc::new(FileBackend::open_shared(&path, opts, mode, &tuning, shared.clone())?))
    };
    // FILE is opened for writing unless --read-only: say so where that is what failed.
    let open_failed = |e: lightfoot::Error| {
        if e.kind() == ErrorKind::Permission && !a.read_only && !remote {
            super::report(&format!("{e} (--read-only serves it without writing)"));
        } else {
            super::report(&e);
        }
        1
    };
    let stack = match Stack::new(cfg, open) {
        Ok(s) => Arc::new(s),
        Err(e) => return open_failed(e),
    };
    let s = stack.clone();
    let opener = move || s.open();
    let mut export = match Export::new(&a.export_name, a.description.clone(), true, opener) {
        Ok(e) => e,
        Err(e) => return open_failed(e),
    };
    let size = export.size;
    // One tracking server per image, whatever bitmap file it uses: another one's writes
    // would be missing from this one's bitmaps (held until exit).
    let _image_lock = match &bitmaps {
        Some(_) if !a.read_only && !remote => match lock_image(&a.file) {
            Ok(l) => Some(l),
            Err(e) => {
                super::report(&e);
                return 1;
            }
        },
        _ => None,
    };
    let tracker = match &bitmaps {
        None => None,
        Some((names, path)) => {
            let opened = match &to_release {
                Some(b) => s3_tracking(b, !a.read_only)
                    .and_then(|(at, now)| Tracker::open(&at, size, &now, names, !a.read_only)),
                None => lightfoot::bitmap::identity(&a.file, size).and_then(|now| {
                    Tracker::open(&Location::File(path.clone()), size, &now, names, !a.read_only)
                }),
            };
            match opened {
                Ok(t) => Some(Arc::new(t)),
                Err(e) => {
                    super::report(&e);
                    return 1;
                }
            }
        }
    };
    if let Some(t) = &tracker {
        export = export.with_bitmaps(t.clone());
    }
    if a.exit_with_parent {
        match lightfoot::io::sys::exit_with_parent() {
            Ok(true) => {}
            Ok(false) => return 0,
            Err(e) => {
                super::report(&format!("--exit-with-parent: {}", io_message(&e)));
                return 1;
            }
        }
    }
    // systemd socket activation takes precedence over --unix and --listen.
    let listener = match (Listener::from_activation(), &a.unix) {
        (Some(Err(e)), _) => {
            super::report(&e);
            return 1;
        }
        (Some(Ok(l)), _) => Ok(l),
        (None, Some(p)) => Listener::unix(p),
        (None, None) => Listener::tcp(&a.listen),
    };
    let listener = match listener {
        Ok(l) => l,
        Err(e) => {
            // A port below 1024 is refused to all but root (CAP_NET_BIND_SERVICE).
            let low = a.unix.is_none()
                && a.listen
                    .rsplit_once(':')
                    .and_then(|(_, p)| p.parse::<u16>().ok())
                    .is_some_and(|p| p < 1024);
            let hint = if low && e.kind() == lightfoot::ErrorKind::Permission {
                " (ports below 1024 need root)"
            } else {
                ""
            };
            super::report(&format!("{e}{hint}"));
            return 1;
        }
    };
    let mut server = Server::new(export, a.threads as usize, a.max_connections as usize);
    let tls_required = tls.as_ref().is_some_and(|t| t.required);
    if let Some(t) = tls {
        server = server.with_tls(t);
    }
    let server = Arc::new(server);
    let uri = listener.uri(&a.export_name, tls_required);
    tracing::info!("serving {} at {uri}", a.file.display());
    {
        let s = server.clone();
        let _ = ctrlc::set_handler(move || s.shutdown());
    }
    // Before --run starts CMD, so that a failure here leaves nothing running.
    if let Some(p) = &a.pid_file {
        if let Err(e) = std::fs::write(p, format!("{}\n", std::process::id())) {
            super::report(&lightfoot::Error::io(Op::WritePidFile, e).path(p));
            return 1;
        }
    }
    let status = Arc::new(std::sync::Mutex::new(0));
    if let Some(cmd) = &a.run {
        let mut c = std::process::Command::new("sh");
        c.arg("-c").arg(cmd).env("uri", &uri);
        match &listener {
            Listener::Unix(_, p, _) => {
                c.env("unixsocket", p);
            }
            Listener::Tcp(l) => {
                if let Ok(addr) = l.local_addr() {
                    c.env("port", addr.port().to_string());
                }
            }
        }
        let mut child = match c.spawn() {
            Ok(ch) => ch,
            Err(e) => {
                super::report(&format!("--run '{cmd}': {}", io_message(&e)));
                if let Some(p) = &a.pid_file {
                    let _ = std::fs::remove_file(p);
                }
                return 1;
            }
        };
        let (s, st) = (server.clone(), status.clone());
        std::thread::spawn(move || {
            let code = match child.wait() {
                Ok(es) => es.code().unwrap_or(1),
                Err(_) => 1,
            };
            *st.lock().unwrap() = code;
            s.shutdown();
        });
    }
    if a.stats {
        let _ = lightfoot::io::sys::catch_sigusr1();
        let (s, json, st) = (server.clone(), a.json, stack.clone());
        std::thread::spawn(move || loop {
            std::thread::sleep(std::time::Duration::from_millis(100));
            if lightfoot::io::sys::take_sigusr1() {
                print_stats(&s, &st, json);
            }
        });
    }
    let served = server.serve(&listener);
    drop(listener);
    if let Some(p) = &a.pid_file {
        let _ = std::fs::remove_file(p);
    }
    // Clean shutdown: read-ahead stops, then held writes are written back and flushed; then
    // an image in object storage is free for another writer.
    let finished = stack.finish();
    // Clean only if every write reached the image: otherwise the next open counts all
    // changed. Saved while an s3:// image's lease is still held.
    let kept = tracker.as_ref().map(|t| {
        let clean = served.is_ok() && finished.is_ok();
        let now = match &to_release {
            Some(b) => b.identity(),
            None => lightfoot::bitmap::file::settled_identity(&a.file, size).ok(),
        };
        t.close(clean, now)
    });
    if let Some(b) = &to_release {
        b.release();
    }
    if a.stats {
        print_stats(&server, &stack, a.json);
    }
    if let Err(e) = served {
        super::report(&e);
        return 1;
    }
    if let Err(e) = finished {
        super::report(&format!("at exit: {e}"));
        return 1;
    }
    if let Some(Err(e)) = kept {
        super::report(&format!("at exit: {e}"));
        return 1;
    }
    let code = *status.lock().unwrap();
    code
}

/// The image's `flock` that a server tracking its changes holds.
fn lock_image(image: &std::path::Path) -> lightfoot::Result<std::fs::File> {
    let f = std::fs::File::open(image).map_err(|e| lightfoot::Error::io(Op::Open, e).path(image))?;
    match lightfoot::io::sys::try_flock(std::os::fd::AsFd::as_fd(&f), true) {
        Ok(true) => Ok(f),
        Ok(false) => Err(lightfoot::Error::new(ErrorKind::Permission, Op::Bitmap)
            .path(image)
            .detail("another server tracks changes to this image")),
        Err(e) => Err(lightfoot::Error::io(Op::Bitmap, e).path(image).detail("lock")),
    }
}

/// Where an `s3://` image's bitmaps are and what the image is now; an error if it cannot be
/// tracked: one object (read-only), or written without the lease. (Read-only while another
/// server writes it, the bitmaps refuse to open, as a locked file does.)
fn s3_tracking(b: &S3Backend, writable: bool) -> lightfoot::Result<(Location, String)> {
    let refused = |why: &str| {
        Err(lightfoot::Error::new(ErrorKind::InvalidInput, Op::Bitmap).path(b.name()).detail(why.to_string()))
    };
    let (Some(t), Some(now)) = (b.tracking(), b.identity()) else {
        return refused("--dirty-bitmap needs a block image (this one is one object, read-only)");
    };
    if writable && !t.leased {
        return refused(
            "--dirty-bitmap needs the image's lease, to be its only writer (not --without-lease)",
        );
    }
    Ok((Location::beside(t.store, &t.key, t.written_elsewhere), now))
}

/// `--dirty-bitmap NAME[=FILE]`s: the names and the one file, `None` without any.
fn dirty_bitmaps(
    given: &[String],
    image: &std::path::Path,
) -> Result<Option<(Vec<String>, PathBuf)>, String> {
    let mut names = Vec::new();
    let mut file: Option<PathBuf> = None;
    for g in given {
        let (name, f) = match g.split_once('=') {
            Some((n, f)) => (n, Some(PathBuf::from(f))),
            None => (g.as_str(), None),
        };
        lightfoot::bitmap::format::check_name(name).map_err(|e| format!("--dirty-bitmap '{g}': {e}"))?;
        if f.as_ref().is_some_and(|f| f.as_os_str().is_empty()) {
            return Err(format!("--dirty-bitmap '{g}': FILE is empty"));
        }
        if let Some(f) = f {
            if file.as_ref().is_some_and(|have| *have != f) {
                return Err("--dirty-bitmap: every bitmap of an export lives in one FILE".into());
            }
            file = Some(f);
        }
        if !names.iter().any(|n| n == name) {
            names.push(name.to_string());
        }
    }
    if names.is_empty() {
        return Ok(None);
    }
    if image.to_str().is_some_and(S3Uri::is_s3) {
        if file.is_some() {
            return Err("--dirty-bitmap NAME=FILE: an s3:// image's bitmaps live beside its blocks \
                        (KEY/lightfoot.bitmaps), not in a FILE"
                .into());
        }
        return Ok(Some((names, PathBuf::new())));
    }
    use std::os::unix::fs::FileTypeExt;
    let device = std::fs::metadata(image).is_ok_and(|m| m.file_type().is_block_device());
    if device && file.is_none() {
        return Err("--dirty-bitmap NAME=FILE: a block device's bitmaps need a FILE on a filesystem \
                    (beside the device, in /dev, it would not outlive a reboot)"
            .into());
    }
    Ok(Some((names, file.unwrap_or_else(|| lightfoot::bitmap::default_path(image)))))
}

/// A size that must not be 0 (`--prefetch-size`, `--prefetch-max-request`, `--coalesce-size`):
/// 0 would leave the filter on but doing nothing.
fn parse_nonzero_size(s: &str) -> Result<u64, String> {
    match parse_size(s).map_err(|e| e.to_string())? {
        0 => Err(format!("'{s}': must be more than 0")),
        n => Ok(n),
    }
}

fn parse_prefetch_size(s: &str) -> Result<u64, String> {
    match parse_size(s).map_err(|e| e.to_string())? {
        n if n < lightfoot::filters::prefetch::buffer::CHUNK => {
            Err(format!("'{s}': at least 256K (one chunk)"))
        }
        n => Ok(n),
    }
}

fn parse_coalesce_age(s: &str) -> Result<std::time::Duration, String> {
    match super::human::parse_duration(s)? {
        d if d > std::time::Duration::from_secs(24 * 3600) => Err(format!("'{s}': at most 24h")),
        d => Ok(d),
    }
}

fn parse_coalesce_block(s: &str) -> Result<u64, String> {
    let n = parse_size(s).map_err(|e| e.to_string())?;
    if n == 0 || n % 4096 != 0 || n > lightfoot::filters::coalesce::MAX_BLOCK {
        return Err(format!("'{s}': a multiple of 4K, at most 16M"));
    }
    Ok(n)
}

fn print_stats(server: &Server, stack: &Stack, json: bool) {
    let snap = server.stats_snapshot();
    let pstats = stack.prefetch().map(|p| p.stats());
    let cstats = stack.coalesce().map(|c| c.stats());
    if json {
        let mut v = serde_json::to_value(&snap).expect("stats serialise");
        if let Some(p) = pstats {
            v["prefetch"] = serde_json::to_value(p).expect("stats serialise");
        }
        if let Some(c) = cstats {
            v["coalesce"] = serde_json::to_value(c).expect("stats serialise");
        }
        eprintln!("{v}");
        return;
    }
    let cache = snap.cache.map(super::human::bytes).unwrap_or_else(|| "not visible".into());
    let row = |cells: [&str; 7]| {
        let [command, requests, errors, bytes, p50, p90, p99] = cells;
        format!("{command:<13} {requests:>10} {errors:>7} {bytes:>11} {p50:>9} {p90:>9} {p99:>9}\n")
    };
    let mut t = format!(
        "lightfoot serve: {:.1} s, {} connections, page cache {cache}\n",
        snap.seconds, snap.connections
    );
    t += &row(["command", "requests", "errors", "bytes", "p50 µs", "p90 µs", "p99 µs"]);
    for c in snap.commands.iter().filter(|c| c.requests > 0) {
        let counts = [c.requests, c.errors].map(|n| n.to_string());
        let times = [c.p50_us, c.p90_us, c.p99_us].map(|n| n.to_string());
        let bytes = super::human::bytes(c.bytes);
        t += &row([c.command, &counts[0], &counts[1], &bytes, &times[0], &times[1], &times[2]]);
    }
    if snap.reads_merged > 0 {
        t += &format!("{} reads merged into the backend read before them\n", snap.reads_merged);
    }
    if let Some(r) = &snap.requests {
        t += &format!("{}\n", super::human::requests(r));
    }
    if let Some(p) = pstats {
        t += &format!(
            "prefetch: {} streams, {} hits ({} waited for read-ahead on its way), {} misses, {} read ahead, {} of it unread, {} dropped unread (stream stopped), {} held\n",
            p.streams_found,
            p.buffer.hits,
            p.buffer.joined,
            p.buffer.misses,
            super::human::bytes(p.buffer.prefetched),
            super::human::bytes(p.buffer.wasted),
            super::human::bytes(p.buffer.dropped),
            super::human::bytes(p.held)
        );
    }
    if let Some(c) = cstats {
        t += &format!(
            "coalesce: {} client writes ({} held), {} backend writes, {} written, {} read to fill gaps in {} reads, {} flushes ({} below; each {} µs writing back and {} µs below on average), {} write-back errors, {} held (at most {})\n",
            c.client_writes,
            c.absorbed,
            c.backend_writes,
            super::human::bytes(c.bytes_written),
            super::human::bytes(c.bytes_filled),
            c.fill_reads,
            c.flushes,
            c.backend_flushes,
            c.flush_write_back_us / c.flushes.max(1),
            c.flush_below_us / c.flushes.max(1),
            c.errors,
            super::human::bytes(c.held),
            super::human::bytes(c.peak_held)
        );
    }
    eprint!("{t}");
}
