//! Every backend and filter stack against the same conformance suite (`lightfoot::testing`).

mod common;

use std::path::Path;
use std::sync::Arc;

use lightfoot::backend::{Backend, FileBackend, MemoryBackend, NbdBackend, NullBackend};
use lightfoot::filters::FaultInjector;
use lightfoot::io::{CacheMode, OpenOptions, ReadMech, Tuning, WriteMech};
use lightfoot::testing::conformance::{run, run_parallel, Expect};

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
fn memory() {
    run(&MemoryBackend::new(SIZE), Expect::Store, 1).unwrap();
    run_parallel(Arc::new(MemoryBackend::new(SIZE)), 4, 2).unwrap();
}

#[test]
fn null() {
    run(&NullBackend::new(Some(SIZE)), Expect::Zeroes, 3).unwrap();
}

#[test]
fn file_in_every_cache_mode() {
    let dir = tempfile::tempdir().unwrap();
    for mode in [CacheMode::Neutral, CacheMode::Keep, CacheMode::Drop, CacheMode::Direct] {
        let fb = new_file(dir.path(), mode.name(), mode, &Tuning::default());
        run(&fb, Expect::Store, 10).unwrap_or_else(|e| panic!("--cache={mode}: {e}"));
        fb.finish().unwrap();
        let fb = Arc::new(new_file(dir.path(), mode.name(), mode, &Tuning::default()));
        run_parallel(fb, 4, 11).unwrap_or_else(|e| panic!("--cache={mode}, parallel: {e}"));
    }
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

/// A loop device over a file: the block-device paths (BLKGETSIZE64, BLKZEROOUT, BLKDISCARD).
#[test]
fn block_device() {
    if !common::root_or_skip("block_device: needs root for losetup") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("loop.img");
    std::fs::File::create(&img).unwrap().set_len(4 << 20).unwrap();
    let out =
        std::process::Command::new("losetup").args(["-f", "--show"]).arg(&img).output().expect("run losetup");
    assert!(out.status.success(), "losetup failed: {}", String::from_utf8_lossy(&out.stderr));
    let dev = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let result = std::panic::catch_unwind(|| {
        for mode in [CacheMode::Neutral, CacheMode::Keep, CacheMode::Direct] {
            let opts = OpenOptions { write: true, create: false, truncate: false };
            let fb = FileBackend::open(Path::new(&dev), opts, mode, &Tuning::default()).unwrap();
            assert!(fb.is_block());
            assert_eq!(fb.size(), Some(4 << 20));
            // A fresh device reads as zeroes: zero it first.
            fb.zero(0, 4 << 20, Default::default()).unwrap();
            run(&fb, Expect::Store, 50).unwrap_or_else(|e| panic!("{dev} --cache={mode}: {e}"));
            fb.finish().unwrap();
        }
        // Coalescing over the device: gaps inside written 4 KiB units are read from it.
        use lightfoot::filters::coalesce::{Coalesce, CoalesceConfig};
        let opts = OpenOptions { write: true, create: false, truncate: false };
        let fb = FileBackend::open(Path::new(&dev), opts, CacheMode::Neutral, &Tuning::default()).unwrap();
        fb.zero(0, 4 << 20, Default::default()).unwrap();
        let c = Coalesce::new(Arc::new(fb), CoalesceConfig::default());
        run(&c, Expect::Store, 51).unwrap_or_else(|e| panic!("{dev} with coalesce: {e}"));
        c.finish().unwrap();
    });
    let _ = std::process::Command::new("losetup").args(["-d", &dev]).status();
    result.unwrap();
}

/// Serves `backend` in-process from a `lightfoot serve` server over a socket pair and returns
/// the NBD client backend connected to it: the suite then covers client, wire and server.
fn over_nbd(backend: Arc<dyn Backend>, multi_conn: bool) -> Arc<dyn Backend> {
    over_nbd_with(move || Ok(backend.clone()), multi_conn)
}

/// [`over_nbd`] with a backend from `open` for each connection (and for the export's probe,
/// which the server finishes at once).
fn over_nbd_with(
    open: impl Fn() -> lightfoot::Result<Arc<dyn Backend>> + Send + Sync + 'static,
    multi_conn: bool,
) -> Arc<dyn Backend> {
    use lightfoot::server::{Export, Server};
    let export = Export::new("e", None, multi_conn, open).unwrap();
    let server = Arc::new(Server::new(export, 4, 8));
    let (client, serving) = std::os::unix::net::UnixStream::pair().unwrap();
    std::thread::spawn(move || server.connection(Box::new(serving)));
    Arc::new(NbdBackend::from_stream(Box::new(client), "e", "nbd-test").unwrap())
}

#[test]
fn nbd_client_through_the_server_to_memory() {
    let nbd = over_nbd(Arc::new(MemoryBackend::new(SIZE)), true);
    run(&*nbd, Expect::Store, 40).unwrap();
    run_parallel(over_nbd(Arc::new(MemoryBackend::new(SIZE)), true), 4, 41).unwrap();
    nbd.finish().unwrap();
}

#[test]
fn nbd_client_through_the_server_to_a_neutral_file() {
    let dir = tempfile::tempdir().unwrap();
    for mode in [CacheMode::Neutral, CacheMode::Direct] {
        let file: Arc<dyn Backend> = Arc::new(new_file(dir.path(), mode.name(), mode, &Tuning::default()));
        let nbd = over_nbd(file.clone(), true);
        run(&*nbd, Expect::Store, 42).unwrap_or_else(|e| panic!("--cache={mode}: {e}"));
        nbd.finish().unwrap();
        let file: Arc<dyn Backend> = Arc::new(new_file(dir.path(), mode.name(), mode, &Tuning::default()));
        run_parallel(over_nbd(file, true), 4, 43).unwrap_or_else(|e| panic!("--cache={mode}: {e}"));
    }
}

#[test]
fn nbd_client_against_nbdkit() {
    use lightfoot::backend::nbd::Target;
    let argv = ["nbdkit", "memory", &SIZE.to_string()].map(String::from).to_vec();
    let nbd = NbdBackend::open(&Target::Captive(argv.clone()), 1).unwrap();
    assert!(nbd.caps().can_extents && nbd.caps().can_fast_zero, "{:?}", nbd.caps());
    run(&nbd, Expect::Store, 44).unwrap();
    nbd.finish().unwrap();
    // nbdkit advertises multi-conn for memory: writers on 4 connections at once.
    let nbd = Arc::new(NbdBackend::open(&Target::Captive(argv), 4).unwrap());
    assert_eq!(nbd.connections(), 4);
    run_parallel(nbd.clone(), 4, 45).unwrap();
    nbd.finish().unwrap();
}

/// The suite's sequential readers made the filter find streams and serve reads it had read
/// ahead: the checks ran against buffered data, not only past the filter.
fn assert_prefetched(p: &lightfoot::filters::prefetch::Prefetch, what: &str) {
    let st = p.stats();
    assert!(st.streams_found >= 2 && st.buffer.hits > 0 && st.buffer.prefetched > 0, "{what}: {st:?}");
}

#[test]
fn prefetch_stacks() {
    use lightfoot::filters::prefetch::{Prefetch, PrefetchConfig};
    // Small reads pass through the filter: let reads up to 1 MiB go through it too.
    let cfg = PrefetchConfig { max_request: 1 << 20, ..PrefetchConfig::default() };
    let p = Prefetch::new(Arc::new(MemoryBackend::new(SIZE)), cfg);
    run(&p, Expect::Store, 60).unwrap();
    assert_prefetched(&p, "memory");
    p.finish().unwrap();
    run_parallel(Arc::new(Prefetch::new(Arc::new(MemoryBackend::new(SIZE)), cfg)), 4, 61).unwrap();
    let dir = tempfile::tempdir().unwrap();
    for mode in [CacheMode::Neutral, CacheMode::Direct] {
        let file = Arc::new(new_file(dir.path(), mode.name(), mode, &Tuning::default()));
        let p = Prefetch::new(file, cfg);
        run(&p, Expect::Store, 62).unwrap_or_else(|e| panic!("--cache={mode}: {e}"));
        assert_prefetched(&p, mode.name());
        p.finish().unwrap();
    }
    // Under the NBD server, as `serve --prefetch` stacks it: a front per connection (the
    // server finishes a connection's backend when it ends, and finishing the filter itself
    // would stop its read-ahead for every connection).
    let mem: Arc<dyn Backend> = Arc::new(MemoryBackend::new(SIZE));
    let p = Arc::new(Prefetch::new(mem.clone(), cfg));
    let front = p.clone();
    let nbd = over_nbd_with(move || Ok(Arc::new(front.front(mem.clone())) as Arc<dyn Backend>), true);
    run(&*nbd, Expect::Store, 63).unwrap();
    assert_prefetched(&p, "under the NBD server");
}

#[test]
fn coalesce_stacks() {
    use lightfoot::filters::coalesce::{Coalesce, CoalesceConfig};
    use lightfoot::filters::prefetch::{Prefetch, PrefetchConfig};
    use std::time::Duration;
    let cfg = CoalesceConfig::default();
    // Small bound and age too, so write-back under pressure and by age runs amid the checks.
    let busy = CoalesceConfig { size: 256 << 10, age: Duration::from_millis(5), ..cfg };
    for (i, cfg) in [cfg, busy].into_iter().enumerate() {
        let c = Coalesce::new(Arc::new(MemoryBackend::new(SIZE)), cfg);
        run(&c, Expect::Store, 70 + i as u64).unwrap_or_else(|e| panic!("config {i}: {e}"));
        c.finish().unwrap();
        run_parallel(Arc::new(Coalesce::new(Arc::new(MemoryBackend::new(SIZE)), cfg)), 4, 72).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    for mode in [CacheMode::Neutral, CacheMode::Keep, CacheMode::Drop, CacheMode::Direct] {
        let file = Arc::new(new_file(dir.path(), mode.name(), mode, &Tuning::default()));
        let c = Coalesce::new(file, busy);
        run(&c, Expect::Store, 73).unwrap_or_else(|e| panic!("--cache={mode}: {e}"));
        c.finish().unwrap();
        let file = Arc::new(new_file(dir.path(), mode.name(), mode, &Tuning::default()));
        run_parallel(Arc::new(Coalesce::new(file, cfg)), 4, 74)
            .unwrap_or_else(|e| panic!("--cache={mode}, parallel: {e}"));
    }
    // Under the NBD server, through a front per connection, with prefetch above as
    // `serve --prefetch --coalesce` stacks them.
    let mem: Arc<dyn Backend> = Arc::new(MemoryBackend::new(SIZE));
    let c = Arc::new(Coalesce::new(mem.clone(), cfg));
    let pcfg = PrefetchConfig { max_request: 1 << 20, ..PrefetchConfig::default() };
    let p = Arc::new(Prefetch::new(Arc::new(c.front(mem.clone())), pcfg));
    let nbd = over_nbd(Arc::new(p.front(Arc::new(c.front(mem.clone())))), true);
    run(&*nbd, Expect::Store, 75).unwrap();
    assert_prefetched(&p, "over coalesce, under the NBD server");
    nbd.finish().unwrap();
    let c = Arc::new(Coalesce::new(mem.clone(), busy));
    run_parallel(over_nbd(Arc::new(c.front(mem)), true), 4, 76).unwrap();
}
