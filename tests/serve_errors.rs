//! Errors through the server: each backend error reaches the client as the right NBD error,
//! and a lost write is latched for the whole export. The server runs in-process over a
//! fault-injecting backend; the client is libnbd's Python module.

mod common;

use std::sync::Arc;

use common::*;
use lightfoot::backend::{Backend, MemoryBackend};
use lightfoot::testing::fault::{Fault, FaultInjector, Op, Rule};
use lightfoot::ErrorKind;

/// Serves `rules` over one memory store shared by all connections; runs `script` with $URI.
fn with_server(rules: Vec<Rule>, script: &str) -> std::process::Output {
    let store: Arc<dyn Backend> = Arc::new(MemoryBackend::new(4 * MIB));
    // One injector shared by every connection, so rule counters are per export.
    let faulty: Arc<dyn Backend> = Arc::new(FaultInjector::new(store, rules));
    let srv = InProcess::start(move || Ok(faulty.clone()), |_| {});
    libnbd(script, &srv.uri())
}

const PRELUDE: &str = r#"
import errno, os, nbd
def connect():
    h = nbd.NBD()
    h.set_strict_mode(0)
    h.connect_uri(os.environ["URI"])
    return h
def err(f):
    try:
        f()
    except nbd.Error as e:
        return e.errno if isinstance(e.errno, str) else errno.errorcode.get(e.errno, str(e.errno))
    return "ok"
"#;

#[test]
fn backend_errors_reach_the_client_as_nbd_errors() {
    let rules = vec![
        Rule::new(Op::Read, Fault::Fail(ErrorKind::Io)).at(MIB, 4096),
        Rule::new(Op::Write, Fault::Fail(ErrorKind::NoSpace)).at(2 * MIB, 4096),
        Rule::new(Op::Write, Fault::Fail(ErrorKind::Permission)).at(3 * MIB, 4096),
        Rule::new(Op::Zero, Fault::Fail(ErrorKind::NotSupported)).at(0, 4096),
        Rule::new(Op::Trim, Fault::Fail(ErrorKind::Io)).at(0, 4096),
        Rule::new(Op::Extents, Fault::Fail(ErrorKind::Io)).at(MIB, 1),
    ];
    let script = format!(
        "{PRELUDE}{}",
        r#"
h = connect()
assert err(lambda: h.pread(4096, 1 << 20)) == "EIO"
assert err(lambda: h.pread(4096, 0)) == "ok"
assert err(lambda: h.pwrite(b"x" * 4096, 2 << 20)) == "ENOSPC"
assert err(lambda: h.pwrite(b"x" * 4096, 3 << 20)) == "EPERM"
assert err(lambda: h.zero(4096, 0, nbd.CMD_FLAG_FAST_ZERO)) == "ENOTSUP"
assert err(lambda: h.trim(4096, 0)) == "EIO"
assert err(lambda: h.pwrite(b"y" * 4096, 8192)) == "ok"
assert h.pread(4096, 8192) == b"y" * 4096
print("ok")
"#
    );
    let out = with_server(rules, &script);
    assert!(out.status.success() && text(&out).contains("ok"), "{}", text(&out));
}

/// A panic below (a bug) while serving a request ends that connection: the client sees it
/// closed instead of waiting for a reply for ever (the worker thread died with the request,
/// before), and the server goes on serving other connections.
#[test]
fn a_panic_below_closes_the_connection_and_the_server_goes_on() {
    let rules = vec![Rule::new(Op::Read, Fault::Panic).at(MIB, 4096).times(1)];
    let script = format!(
        "{PRELUDE}{}",
        r#"
h = connect()
h.pwrite(b"y" * 4096, 0)
assert err(lambda: h.pread(4096, 1 << 20)) != "ok"
assert not h.aio_is_ready()
h2 = connect()
assert h2.pread(4096, 0) == b"y" * 4096
print("ok")
"#
    );
    let out = with_server(rules, &script);
    assert!(out.status.success() && text(&out).contains("ok"), "{:?}: {}", out.status, text(&out));
}

#[test]
fn a_failed_flush_is_latched_for_every_connection() {
    // The first flush fails (as fdatasync does once after a writeback error); the backend
    // would let later ones succeed.
    let rules = vec![Rule::new(Op::Flush, Fault::Fail(ErrorKind::Io)).times(1)];
    let script = format!(
        "{PRELUDE}{}",
        r#"
a, b = connect(), connect()
a.pwrite(b"x" * 4096, 0)
assert err(lambda: a.flush()) == "EIO"
assert err(lambda: a.flush()) == "EIO", "latched on the same connection"
assert err(lambda: b.flush()) == "EIO", "latched on another connection"
assert err(lambda: b.pwrite(b"z" * 512, 0, nbd.CMD_FLAG_FUA)) == "EIO", "FUA cannot promise durability"
c = connect()
assert err(lambda: c.flush()) == "EIO", "latched for connections opened after the error"
assert err(lambda: c.pwrite(b"w" * 512, 4096)) == "ok", "plain writes still work"
assert c.pread(512, 4096) == b"w" * 512
print("ok")
"#
    );
    let out = with_server(rules, &script);
    assert!(out.status.success() && text(&out).contains("ok"), "{}", text(&out));
}

#[test]
fn pipelined_reads_over_data_holes_and_a_bad_sector() {
    // 64 reads of 32 KiB in flight at once, over data, holes (structured replies send them as
    // OFFSET_HOLE) and one failing sector: the server may merge neighbours into one backend
    // read, but every reply carries its own bytes, and only the bad sector's read fails.
    let rules = vec![Rule::new(Op::Read, Fault::Fail(ErrorKind::Io)).at(MIB + 12 * 32768 + 512, 1)];
    let script = format!(
        "{PRELUDE}{}",
        r#"
h = connect()
assert h.get_structured_replies_negotiated()
M = 1 << 20
want = bytearray(2 * M)
# The first 24 pieces of 32 KiB are data, then every third; the rest are holes.
for i in [i for i in range(64) if i < 24 or i % 3 == 0]:
    piece = bytes([i + 1]) * 32768
    h.pwrite(piece, M + i * 32768)
    want[i * 32768:(i + 1) * 32768] = piece
bufs = [nbd.Buffer(32768) for _ in range(64)]
cookies = [h.aio_pread(bufs[i], M + i * 32768) for i in range(64)]
while h.aio_in_flight() > 0:
    h.poll(-1)
failed = []
for i, c in enumerate(cookies):
    try:
        h.aio_command_completed(c)
    except nbd.Error as e:
        failed.append(i)
        continue
    assert bufs[i].to_bytearray() == want[i * 32768:(i + 1) * 32768], i
assert failed == [12], failed
print("ok")
"#
    );
    let out = with_server(rules, &script);
    assert!(out.status.success() && text(&out).contains("ok"), "{}", text(&out));
}
