//! Every backend and filter stack against the same conformance suite (`lightfoot::testing`):
//! memory, `null:`, files in each cache mode, loop devices, the NBD client, and block images
//! in object storage (a SeaweedFS the cell starts).
//!
//! The matrix at the end generates one test per backend × filter stack (`memory::plain`,
//! `file_direct::prefetch_coalesce`, …). Each builds its stack with
//! [`lightfoot::filters::Stack`], as `serve` does, and runs the suite three times on a fresh
//! backend: through one front, with four writer threads at once, and through lightfoot's own
//! NBD server and client (the stack behind the server, a front per connection). Stacks with
//! prefetch must have found streams and served reads from their buffer.
//!
//! The rest are the paths the matrix does not reach: forced mechanisms, no cachestat, the
//! fault injector.

mod common;

use std::path::Path;
use std::sync::Arc;

use std::time::Duration;

use common::s3::Gateway;
use lightfoot::backend::s3::{S3Config, S3Options, S3Uri};
use lightfoot::backend::{Backend, FileBackend, MemoryBackend, NbdBackend, NullBackend, S3Backend};
use lightfoot::filters::coalesce::CoalesceConfig;
use lightfoot::filters::prefetch::PrefetchConfig;
use lightfoot::filters::{Stack, StackConfig};
use lightfoot::io::{CacheMode, OpenOptions, ReadMech, Tuning, WriteMech};
use lightfoot::testing::conformance::{run, run_parallel, Expect};
use lightfoot::testing::fault::FaultInjector;

/// Not a multiple of any block size, so the last block is partial.
const SIZE: u64 = (3 << 20) + 4097;

fn new_file(dir: &Path, name: &str, mode: CacheMode, tuning: &Tuning) -> FileBackend {
    let path = dir.join(name);
    let opts = OpenOptions { write: true, create: true, truncate: true };
    let fb = FileBackend::open(&path, opts, mode, tuning).expect("open test file");
    fb.set_len(SIZE).unwrap();
    fb
}

#[test]
fn file_with_every_mechanism_forced() {
    let dir = tempfile::tempdir().unwrap();
    let reads = [ReadMech::Buffered, ReadMech::DontCache, ReadMech::Direct, ReadMech::EvictBehind];
    let writes = [WriteMech::Buffered, WriteMech::DontCache, WriteMech::WriteBehind, WriteMech::Direct];
    for (r, w) in reads.into_iter().zip(writes) {
        for no_dontcache in [false, true] {
            let tuning = Tuning { read: Some(r), write: Some(w), no_dontcache, ..Tuning::default() };
            let fb = new_file(dir.path(), "forced", CacheMode::Neutral, &tuning);
            let mech = fb.policy().mechanism();
            run(&fb, Expect::Store, 20)
                .unwrap_or_else(|e| panic!("{r}/{w} (no_dontcache {no_dontcache}, got {mech:?}): {e}"));
            fb.finish().unwrap();
        }
    }
}

#[test]
fn file_without_cachestat() {
    let dir = tempfile::tempdir().unwrap();
    let tuning = Tuning {
        no_cachestat: true,
        no_dontcache: true,
        read: Some(ReadMech::EvictBehind),
        ..Tuning::default()
    };
    let fb = new_file(dir.path(), "nocachestat", CacheMode::Neutral, &tuning);
    // Without residency, evict-behind must not run in neutral mode.
    assert_eq!(fb.policy().mechanism().read, ReadMech::Direct);
    run(&fb, Expect::Store, 30).unwrap();
}

#[test]
fn fault_injector_without_rules_is_transparent() {
    let inner: Arc<dyn Backend> = Arc::new(MemoryBackend::new(SIZE));
    run(&FaultInjector::new(inner, vec![]), Expect::Store, 40).unwrap();
}

/// Where the bytes live in a cell of the matrix.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Memory,
    /// `null:` (writes discarded, reads return zeroes).
    Null,
    /// A regular file in a cache mode; each open is a file of its own, as in `serve`.
    File(CacheMode),
    /// A loop device over a file (root only: BLKGETSIZE64, BLKZEROOUT, BLKDISCARD).
    Loop(CacheMode),
    /// lightfoot's NBD client to `nbdkit memory`.
    Nbd,
    /// A block image in object storage (SeaweedFS, started for the cell), in objects of an
    /// odd size: [`S3_OBJECT`] bytes, 25 of them.
    S3,
}

/// [`SIZE`] is 25 objects of this size (it has no larger power-of-two factor).
const S3_OBJECT: u64 = SIZE / 25;

/// Opens one more backend onto a cell's data (what [`Stack::new`] takes).
type Opener = Arc<dyn Fn(bool) -> lightfoot::Result<Arc<dyn Backend>> + Send + Sync>;

static STARTED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// `nbdkit memory` on a Unix socket, killed on drop.
struct Nbdkit(std::process::Child, String);

impl Nbdkit {
    fn start(dir: &Path) -> Nbdkit {
        common::need("nbdkit", "nbdkit");
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (sock, pid) = (dir.join(format!("nbdkit-{n}.sock")), dir.join(format!("nbdkit-{n}.pid")));
        let child = std::process::Command::new("nbdkit")
            .args(["-f", "-U"])
            .arg(&sock)
            .arg("-P")
            .arg(&pid)
            .args(["memory", &SIZE.to_string()])
            .spawn()
            .expect("start nbdkit");
        // The pid file, not the socket: nbdkit writes it once it accepts connections, and
        // the socket file exists a moment before (a connect then is refused).
        assert!(common::within(10, || pid.exists()), "nbdkit did not start on {}", sock.display());
        Nbdkit(child, format!("nbd+unix:///?socket={}", sock.display()))
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A cell's backends: [`Fixture::fresh`] gives an opener onto data that reads as zeroes.
struct Fixture {
    kind: Kind,
    dir: tempfile::TempDir,
    device: Option<common::Loop>,
    store: Option<common::s3::Seaweed>,
    made: std::sync::atomic::AtomicU32,
}

impl Fixture {
    /// `None`, skipped (`common::root_or_skip`), where the cell cannot run here (a loop device
    /// without root).
    fn new(kind: Kind) -> Option<Fixture> {
        let device = match kind {
            Kind::Loop(_) if !common::root_or_skip(&format!("{kind:?}: needs root for losetup")) => {
                return None
            }
            Kind::Loop(_) => Some(common::Loop::new(4 << 20)),
            _ => None,
        };
        let store = matches!(kind, Kind::S3).then(|| {
            let w = common::s3::Seaweed::start();
            w.bucket("cells");
            w
        });
        Some(Fixture { kind, dir: tempfile::tempdir().unwrap(), device, store, made: Default::default() })
    }

    /// What reads must return: under a filter that holds writes, `null:` returns the held
    /// bytes until they are passed down, and zeroes after.
    fn expect(&self, holds_writes: bool) -> Expect {
        match self.kind {
            Kind::Null if holds_writes => Expect::Unkept,
            Kind::Null => Expect::Zeroes,
            _ => Expect::Store,
        }
    }

    fn fresh(&self) -> Opener {
        match self.kind {
            Kind::Memory => {
                let m: Arc<dyn Backend> = Arc::new(MemoryBackend::new(SIZE));
                Arc::new(move |_| Ok(m.clone()))
            }
            Kind::Null => {
                let n: Arc<dyn Backend> = Arc::new(NullBackend::new(Some(SIZE)));
                Arc::new(move |_| Ok(n.clone()))
            }
            Kind::Nbd => {
                // A new nbdkit for fresh data; each open is a client of its own (4 connections:
                // nbdkit advertises multi-conn for memory), as each open of a file is its own.
                use lightfoot::backend::nbd::Target;
                let server = Arc::new(Nbdkit::start(self.dir.path()));
                Arc::new(move |_| {
                    let n = NbdBackend::open(&Target::Uri(server.1.parse().unwrap()), 4)?;
                    assert_eq!(n.connections(), 4);
                    assert!(n.caps().can_extents && n.caps().can_fast_zero, "{:?}", n.caps());
                    Ok(Arc::new(n))
                })
            }
            Kind::S3 => {
                // A new image for fresh data; every open shares one backend, as in `serve`.
                let i = self.made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let w = self.store.as_ref().unwrap();
                let config = S3Config {
                    access_key_id: Some("lightfoot-test".into()),
                    secret_access_key: Some(lightfoot::backend::s3::config::Secret::new(
                        "lightfoot-test-secret",
                    )),
                    endpoint: Some(w.endpoint.clone()),
                    ..S3Config::default()
                };
                let opts = S3Options {
                    writable: true,
                    size: Some(SIZE),
                    object_size: Some(S3_OBJECT),
                    config: Some(config),
                    ..S3Options::default()
                };
                let uri: S3Uri = format!("s3://cells/image-{i}").parse().unwrap();
                let b: Arc<dyn Backend> = Arc::new(S3Backend::open(&uri, &opts).unwrap());
                assert!(b.caps().can_extents, "{:?}", b.caps());
                Arc::new(move |_| Ok(b.clone()))
            }
            Kind::File(mode) => {
                let i = self.made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let name = format!("{}-{i}", mode.name());
                new_file(self.dir.path(), &name, mode, &Tuning::default()).finish().unwrap();
                reopen(self.dir.path().join(name), mode)
            }
            Kind::Loop(mode) => {
                let dev = std::path::PathBuf::from(&self.device.as_ref().unwrap().dev);
                let opts = OpenOptions { write: true, create: false, truncate: false };
                let fb = FileBackend::open(&dev, opts, mode, &Tuning::default()).unwrap();
                assert!(fb.is_block());
                fb.zero(0, 4 << 20, Default::default()).unwrap();
                fb.finish().unwrap();
                reopen(dev, mode)
            }
        }
    }
}

/// Each open is the file opened again, sharing the export's latch and locks, as in `serve`.
fn reopen(path: std::path::PathBuf, mode: CacheMode) -> Opener {
    let shared = Arc::new(lightfoot::io::FileJob::default());
    Arc::new(move |write| {
        let opts = OpenOptions { write, create: false, truncate: false };
        Ok(Arc::new(FileBackend::open_shared(&path, opts, mode, &Tuning::default(), shared.clone())?))
    })
}

/// Which filters a cell stacks.
#[derive(Debug, Clone, Copy)]
struct Filters {
    prefetch: bool,
    coalesce: bool,
}

impl Filters {
    /// Small reads pass through prefetch: let reads up to 1 MiB go through it too. With
    /// `busy`, coalesce has a small bound and age, so write-back under pressure and by age
    /// runs amid the checks.
    fn config(self, busy: bool) -> StackConfig {
        let ccfg = CoalesceConfig::default();
        let ccfg = if busy {
            CoalesceConfig { size: 256 << 10, age: Duration::from_millis(5), ..ccfg }
        } else {
            ccfg
        };
        StackConfig {
            read_only: false,
            prefetch: self
                .prefetch
                .then_some(PrefetchConfig { max_request: 1 << 20, ..PrefetchConfig::default() }),
            coalesce: self.coalesce.then_some(ccfg),
        }
    }
}

/// With prefetch: the suite's sequential readers made the filter find streams and read ahead,
/// and reads of a range asked for with CACHE are served from its buffer, with the bytes below.
/// (Whether the suite's own reads hit depends on the backend's speed: they never wait for
/// read-ahead, and the writes ahead of them drop what it read. On a loop device with O_DIRECT
/// they all missed.) Where written bytes are unspecified (`null:` under `--coalesce`: the
/// buffer may hold, read around before the flush, what `null:` forgot when it went down) only
/// the hits are checked.
fn assert_prefetched(stack: &Stack, front: &dyn Backend, below: &dyn Backend, expect: Expect, what: &str) {
    let Some(p) = stack.prefetch() else { return };
    let st = p.stats();
    assert!(st.streams_found >= 2 && st.buffer.prefetched > 0, "{what}: {st:?}");
    // Held writes go down first, so that `below` has every byte.
    front.flush().unwrap();
    let (off, len) = (256 << 10, 512 << 10);
    let hits = p.stats().buffer.hits;
    let (mut got, mut want) = (vec![0u8; 4096], vec![0u8; 4096]);
    // CACHE, then the range read, until a read is served from the buffer: the read-ahead CACHE
    // starts lands in the background, and reads never wait for it.
    let served = common::within(10, || {
        front.cache(off, len).unwrap();
        for at in (off..off + len).step_by(4096) {
            front.read(&mut got, at).unwrap();
            below.read(&mut want, at).unwrap();
            assert!(
                expect == Expect::Unkept || got == want,
                "{what}: a read at {at} after CACHE differs from the bytes below"
            );
        }
        p.stats().buffer.hits > hits
    });
    assert!(served, "{what}: no read after CACHE was served from the buffer: {:?}", p.stats());
}

/// One cell of the matrix (see the module doc).
fn cell(kind: Kind, filters: Filters, seed: u64) {
    let Some(fx) = Fixture::new(kind) else { return };
    let what = format!("{kind:?} with {filters:?}");
    let expect = fx.expect(filters.coalesce);
    let open = fx.fresh();
    let below = open(false).unwrap();
    let stack = Stack::new(filters.config(true), move |w| open(w)).unwrap();
    let front = stack.open().unwrap();
    run(&*front, expect, seed).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_prefetched(&stack, &*front, &*below, expect, &what);
    front.finish().unwrap();
    stack.finish().unwrap();

    if expect == Expect::Store {
        let open = fx.fresh();
        let stack = Stack::new(filters.config(false), move |w| open(w)).unwrap();
        run_parallel(stack.open().unwrap(), 4, seed + 1).unwrap_or_else(|e| panic!("{what}, parallel: {e}"));
        stack.finish().unwrap();
    }

    // Under lightfoot's NBD server, as `serve` stacks it: a front per connection (the server
    // finishes a connection's backend when it ends, and the stack's filters live on).
    let open = fx.fresh();
    let below = open(false).unwrap();
    let stack = Arc::new(Stack::new(filters.config(false), move |w| open(w)).unwrap());
    let nbd = over_nbd(stack.clone());
    run(&nbd, expect, seed + 2).unwrap_or_else(|e| panic!("{what}, over NBD: {e}"));
    assert_prefetched(&stack, &nbd, &*below, expect, &format!("{what}, over NBD"));
    nbd.finish().unwrap();
}

/// Serves `stack` in-process from a `lightfoot serve` server over a socket pair and returns
/// the NBD client backend connected to it: the suite then covers client, wire and server.
fn over_nbd(stack: Arc<Stack>) -> NbdBackend {
    use lightfoot::server::{Export, Server};
    let export = Export::new("e", None, true, move || stack.open()).unwrap();
    let server = Arc::new(Server::new(export, 4, 8));
    let (client, serving) = std::os::unix::net::UnixStream::pair().unwrap();
    std::thread::spawn(move || server.connection(Box::new(serving)));
    NbdBackend::from_stream(Box::new(client), "e", "nbd-test").unwrap()
}

/// One module per backend, one test per stack in it.
macro_rules! matrix {
    ($($name:ident: $kind:expr, $seed:expr;)*) => {$(
        mod $name {
            use super::*;
            const KIND: Kind = $kind;

            #[test]
            fn plain() {
                cell(KIND, Filters { prefetch: false, coalesce: false }, $seed);
            }

            #[test]
            fn prefetch() {
                cell(KIND, Filters { prefetch: true, coalesce: false }, $seed + 10);
            }

            #[test]
            fn coalesce() {
                cell(KIND, Filters { prefetch: false, coalesce: true }, $seed + 20);
            }

            #[test]
            fn prefetch_coalesce() {
                cell(KIND, Filters { prefetch: true, coalesce: true }, $seed + 30);
            }
        }
    )*};
}

matrix! {
    memory: Kind::Memory, 100;
    null: Kind::Null, 200;
    file_neutral: Kind::File(CacheMode::Neutral), 300;
    file_keep: Kind::File(CacheMode::Keep), 400;
    file_drop: Kind::File(CacheMode::Drop), 500;
    file_direct: Kind::File(CacheMode::Direct), 600;
    loop_neutral: Kind::Loop(CacheMode::Neutral), 700;
    loop_keep: Kind::Loop(CacheMode::Keep), 800;
    loop_direct: Kind::Loop(CacheMode::Direct), 900;
    nbd_client: Kind::Nbd, 1000;
    object_storage: Kind::S3, 1100;
}
