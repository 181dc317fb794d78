//! Faults end to end, with every filter stack `lightfoot serve` builds: injected EIO, ENOSPC,
//! short and slow operations below the stack reach the client as the right NBD error, the
//! server goes on serving, no flushed write is lost, and `lightfoot copy` reading through the
//! server fails cleanly, naming the offset.
//!
//! The server runs in-process over a fault-injecting memory store; clients are lightfoot's own
//! NBD client (which maps NBD errors back to error kinds) and the `lightfoot copy` binary.

mod common;

use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use lightfoot::backend::{Backend, MemoryBackend, NbdBackend};
use lightfoot::testing::fault::{Fault, FaultInjector, Op, Rule};
use lightfoot::ErrorKind;

const SIZE: u64 = 8 * MIB;
// Where each fault sits (1 MiB apart, so read-ahead of one never reaches the next).
const READ_EIO: u64 = MIB;
const SHORT_READ: u64 = 2 * MIB;
const SLOW_READ: u64 = 3 * MIB;
const WRITE_ENOSPC: u64 = 4 * MIB;
const TORN_WRITE: u64 = 5 * MIB;
/// Written and flushed before anything fails: must survive everything after.
const FLUSHED: u64 = 6 * MIB;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Stack {
    Plain,
    Prefetch,
    Coalesce,
    Both,
}

impl Stack {
    fn holds_writes(self) -> bool {
        matches!(self, Stack::Coalesce | Stack::Both)
    }

    fn prefetch(self) -> bool {
        matches!(self, Stack::Prefetch | Stack::Both)
    }
}

fn rules() -> Vec<Rule> {
    vec![
        Rule::new(Op::Read, Fault::Fail(ErrorKind::Io)).at(READ_EIO, 4096),
        Rule::new(Op::Read, Fault::Short).at(SHORT_READ, 4096),
        Rule::new(Op::Read, Fault::Slow(Duration::from_secs(2))).at(SLOW_READ, 4096),
        Rule::new(Op::Write, Fault::Fail(ErrorKind::NoSpace)).at(WRITE_ENOSPC, 4096),
        Rule::new(Op::Write, Fault::Short).at(TORN_WRITE, 4096),
    ]
}

/// A server of `stack` over a fault-injecting memory store.
struct Rig {
    srv: InProcess,
    store: Arc<MemoryBackend>,
    faults: Arc<FaultInjector>,
}

impl Rig {
    fn start(stack: Stack) -> Rig {
        let store = Arc::new(MemoryBackend::new(SIZE));
        // All data: a hole would be skipped by copy's extent lookups, never read.
        let mut image = vec![0u8; SIZE as usize];
        lightfoot::testing::conformance::Rng::new(SIZE).fill(&mut image);
        store.write(&image, 0, false).unwrap();
        let faults = Arc::new(FaultInjector::new(store.clone(), rules()));
        let faulty: Arc<dyn Backend> = faults.clone();
        let srv = InProcess::start(stack_opener(faulty, stack.prefetch(), stack.holds_writes()), |_| {});
        Rig { srv, store, faults }
    }

    fn client(&self) -> NbdBackend {
        let s = UnixStream::connect(&self.srv.sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        NbdBackend::from_stream(Box::new(s), "", "faults").unwrap()
    }
}

fn kind(r: lightfoot::Result<()>) -> Option<ErrorKind> {
    r.err().map(|e| e.kind())
}

fn read(b: &NbdBackend, len: usize, at: u64) -> lightfoot::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    lightfoot::backend::read_exact(b, &mut buf, at)?;
    Ok(buf)
}

fn still_serving(rig: &Rig, want: &[u8]) {
    let b = rig.client();
    assert_eq!(read(&b, want.len(), FLUSHED).unwrap(), want, "the server stopped serving good reads");
}

fn faults_through(stack: Stack) {
    let dir = scratch();
    let rig = Rig::start(stack);
    let a = rig.client();
    let b = rig.client();
    let mut flushed = vec![0u8; 256 << 10];
    lightfoot::testing::conformance::Rng::new(7).fill(&mut flushed);
    a.write(&flushed, FLUSHED, false).unwrap();
    a.flush().unwrap();

    // Reads: EIO and a short read are EIO to the client; the connection goes on.
    assert_eq!(kind(read(&a, 4096, READ_EIO).map(drop)), Some(ErrorKind::Io), "{stack:?}: read EIO");
    assert_eq!(kind(read(&a, 4096, SHORT_READ).map(drop)), Some(ErrorKind::Io), "{stack:?}: short read");
    assert_eq!(read(&a, flushed.len(), FLUSHED).unwrap(), flushed, "{stack:?}: after failed reads");

    // A slow read holds up neither another connection nor the same connection's other requests.
    // (The slow read's rule is the third: see `rules`.)
    let slowed = rig.faults.fired()[2];
    let slow = std::thread::scope(|s| {
        let t = s.spawn(|| read(&a, 4096, SLOW_READ).map(drop));
        // Once the slow read is held in the store.
        wait_until("the slow read to reach the store", Duration::from_secs(10), || {
            rig.faults.fired()[2] > slowed
        });
        let start = Instant::now();
        assert_eq!(read(&b, 4096, FLUSHED).unwrap(), flushed[..4096], "{stack:?}");
        let other = start.elapsed();
        (t.join().unwrap(), other)
    });
    assert!(slow.0.is_ok(), "{stack:?}: a slow read must still succeed: {:?}", slow.0);
    assert!(
        slow.1 < Duration::from_millis(1500),
        "{stack:?}: another connection waited {:?} on a slow read",
        slow.1
    );

    // Writes. Without coalescing the write itself fails; with it the write is held and its
    // write-back fails, so the FLUSH after it reports the error, and every later one too.
    let w1 = a.write(&[1u8; 4096], WRITE_ENOSPC, false);
    if stack.holds_writes() {
        assert!(w1.is_ok(), "{stack:?}: the held write");
        assert_eq!(kind(a.flush()), Some(ErrorKind::NoSpace), "{stack:?}: flush after a failed write-back");
        assert!(a.flush().is_err() && b.flush().is_err(), "{stack:?}: latched for every connection");
    } else {
        assert_eq!(kind(w1), Some(ErrorKind::NoSpace), "{stack:?}: write ENOSPC");
        let torn = a.write(&[2u8; 4096], TORN_WRITE, false);
        assert_eq!(kind(torn), Some(ErrorKind::Io), "{stack:?}: torn write");
        // A FUA write that fails may have lost data: latched, so later flushes fail too.
        assert!(a.write(&[3u8; 4096], TORN_WRITE, true).is_err(), "{stack:?}: torn FUA write");
        assert!(b.flush().is_err(), "{stack:?}: latched after a failed FUA write");
    }

    // What was flushed before is intact, through the server and in the store itself.
    still_serving(&rig, &flushed);
    let mut held = vec![0u8; flushed.len()];
    rig.store.read(&mut held, FLUSHED).unwrap();
    assert_eq!(held, flushed, "{stack:?}: flushed bytes lost from the store");

    // lightfoot copy through the server stops at the bad sector and names it.
    let out = lightfoot(&["copy", &rig.srv.uri(), dir.path().join("out.img").to_str().unwrap()]);
    assert!(!out.status.success(), "{stack:?}: copy over a bad sector succeeded");
    let msg = text(&out);
    let named = [READ_EIO, SHORT_READ].iter().any(|o| msg.contains(&format!("offset {o}")));
    assert!(named && msg.contains("incomplete"), "{stack:?}: copy's message names no offset:\n{msg}");

    // The shutdown's final flush: a write the coalesce filter could never write back is an
    // error there too, not silently dropped.
    drop((a, b));
    let end = rig.srv.stop();
    assert_eq!(end.is_err(), stack.holds_writes(), "{stack:?}: shutdown: {end:?}");
}

#[test]
fn faults_plain() {
    faults_through(Stack::Plain);
}

#[test]
fn faults_through_prefetch() {
    faults_through(Stack::Prefetch);
}

#[test]
fn faults_through_coalesce() {
    faults_through(Stack::Coalesce);
}

#[test]
fn faults_through_prefetch_and_coalesce() {
    faults_through(Stack::Both);
}
