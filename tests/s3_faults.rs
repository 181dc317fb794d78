//! Faults of the object store under `lightfoot serve` and `lightfoot copy`, against SeaweedFS
//! run as separate processes (`common::s3::Cluster`: a master with replication 001, two volume
//! servers each holding a replica of every object, a filer, an S3 gateway) killed and
//! restarted one at a time:
//!
//! - reads go on with either volume server killed, through `serve` and `copy`;
//! - writes with one of the two down fail with EIO within the retry bound, never hang, and
//!   the same server takes writes again once it is back;
//! - with no data readable, then with the gateway down, `copy` fails naming the object
//!   (and the offset, once past the open) and `serve` answers EIO, both within the bound, and
//!   `serve` keeps running;
//! - what a client flushed survives a kill -9 of the server.
//!
//! The bound: store::Limits retries a request for at most 10 s (and 20 retries), an attempt
//! for at most 20 s. Every wait here is bounded; a hang fails its test. Each test starts a
//! cluster of its own: about 15 s until a bucket takes writes (see `Cluster::start`).

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use common::s3::{Cluster, Gateway, S3Served};
use common::*;

/// The image every test but the last starts with: random bytes in 32 objects of 64 KiB.
const IMAGE: &str = "s3://disks/img";
const SIZE: u64 = 2 * MIB;
const OBJECT: u64 = 64 << 10;

/// How long a failing request may take to reach the client: the retry bound (10 s) plus an
/// attempt (20 s) with room for a loaded machine. A hang check, not a speed test.
const BOUND: Duration = Duration::from_secs(60);

/// What a lightfoot or client process may take before `timeout` kills it: beyond [`BOUND`], so
/// that a slow failure shows as one (the time is asserted), a hang as status 124.
const PROCESS_SECS: u64 = 120;

/// Python run before each client script: `h` is a libnbd handle connected to `$URI`;
/// `attempt(f, *args)` calls `f` and says how it went, as JSON: the errno's name (`None` when
/// it worked) and the seconds it took.
const PRELUDE: &str = r#"
import errno, json, os, sys, time, nbd
h = nbd.NBD()
h.connect_uri(os.environ["URI"])
def attempt(f, *args):
    t = time.monotonic()
    try:
        f(*args)
        e = None
    except nbd.Error as x:
        e = errno.errorcode.get(x.errno, str(x.errno))
    return {"error": e, "secs": time.monotonic() - t}
"#;

/// Runs `script` after [`PRELUDE`] against `served`; the last line it printed, as JSON (null
/// when it printed nothing).
fn client(served: &S3Served, script: &str) -> serde_json::Value {
    let out = libnbd_within(PROCESS_SECS, &format!("{PRELUDE}{script}"), &served.uri());
    assert!(out.status.success(), "client: {}\nserver: {}", text(&out), served.stderr());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or("null");
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// Python that reads all of the image into the file `out`.
fn read_all_into(out: &Path) -> String {
    format!("open({:?}, 'wb').write(h.pread(h.get_size(), 0))\n", out.display().to_string())
}

/// A cluster with bucket `disks` holding [`IMAGE`], copied there from the file returned.
fn cluster_with_image(dir: &Path) -> (Cluster, PathBuf) {
    let c = Cluster::start();
    c.bucket("disks");
    let src = dir.join("src.img");
    random_file(&src, SIZE);
    ok(c.lightfoot(PROCESS_SECS, &["copy", src.to_str().unwrap(), IMAGE, "--object-size", "64K"]));
    (c, src)
}

/// Runs `lightfoot ARGS` with the cluster's environment; its output and how long it took.
fn timed(c: &Cluster, args: &[&str]) -> (Output, Duration) {
    let t = Instant::now();
    let out = c.lightfoot(PROCESS_SECS, args);
    (out, t.elapsed())
}

/// Either volume server alone serves the whole image: SeaweedFS's master drops a killed
/// volume server at once (its heartbeat stream breaks), and reads go to the replica left.
#[test]
fn reads_go_on_with_a_volume_server_killed() {
    let dir = scratch();
    let (mut c, src) = cluster_with_image(dir.path());
    for i in 0..2 {
        c.kill_volume(i);
        let s = S3Served::start(&c, dir.path(), IMAGE, &["--read-only"]);
        let served = dir.path().join("served.img");
        client(&s, &read_all_into(&served));
        assert!(same_contents(&src, &served), "read through serve with volume server {i} down differs");
        s.stop();
        let copied = dir.path().join("copied.img");
        ok(c.lightfoot(PROCESS_SECS, &["copy", IMAGE, copied.to_str().unwrap()]));
        assert!(same_contents(&src, &copied), "read through copy with volume server {i} down differs");
        c.restart_volume(i);
    }
}

/// With one of two volume servers down, SeaweedFS takes no writes: with replication 001 the
/// master drops the dead server's replicas at once, which leaves no volume writable, and it
/// cannot grow one on a single server. Its gateway does not say so at once: the filer retries
/// the volume assignment ("volume growth in progress") for 30 s before answering 500 (at once
/// only when no volume slot is free anywhere: "no free volumes left"). lightfoot's attempt
/// times out first, at 20 s, past its 10 s retry bound, so the client gets EIO after about 20 s,
/// for a whole object (one PUT) and for part of one (GET, patch, PUT) alike. Reads go on, the
/// image is left as it was, and the server runs on.
///
/// Once the volume server is back, the same server takes writes again, stored on both
/// replicas. The PUTs that failed are not over: the gateway goes on assigning for the rest of
/// its 30 s and stores them if the volume server is back by then, after their EIO. Their
/// bytes are left out of the comparisons (a failed write leaves its range unspecified), and
/// the writes after the restart go to other objects.
///
/// The lease's renewals fail the same way, and land late the same way, changing the lease's
/// ETag behind the writer's back. The volume server comes back 33 s after the open, while
/// the first renewal (sent at 10 s, given up by lightfoot at 30 s) is still being assigned
/// by the gateway (until 40 s): it lands, and the next renewal (at 40 s) finds an ETag it
/// never saw. It must not take the lease for lost, or no write would ever work again.
#[test]
fn a_volume_server_down_fails_writes_with_eio_until_it_is_back() {
    let dir = scratch();
    let (mut c, src) = cluster_with_image(dir.path());
    let mut s = S3Served::start(&c, dir.path(), IMAGE, &[]);
    let opened = Instant::now();
    c.kill_volume(1);
    // (offset, length, byte): a whole object, and part of one.
    let failed = [(OBJECT, OBJECT, 0xaa), (3 * OBJECT + 1000, 512, 0xbb)];
    let resumed = [(5 * OBJECT, OBJECT, 0xcc), (7 * OBJECT + 1000, 512, 0xdd)];
    let during = dir.path().join("during.img");
    // Both at once, each on a connection of its own: each waits out the bound.
    let r = client(
        &s,
        &format!(
            r#"
import threading
r = {{}}
def write(name, off, ln, byte):
    g = nbd.NBD()
    g.connect_uri(os.environ["URI"])
    r[name] = attempt(g.pwrite, bytes([byte]) * ln, off)
ts = [threading.Thread(target=write, args=(n,) + w) for n, w in zip(("whole", "part"), {failed:?})]
[t.start() for t in ts]
[t.join() for t in ts]
{read}print(json.dumps(r))
"#,
            read = read_all_into(&during),
        ),
    );
    eprintln!("with a replica down: {r}");
    for w in ["whole", "part"] {
        assert_eq!(r[w]["error"], "EIO", "{w} write with a replica down: {r}\nserver: {}", s.stderr());
        let secs = r[w]["secs"].as_f64().unwrap();
        assert!(secs < BOUND.as_secs_f64(), "{w} write took {secs} s to fail");
    }
    assert!(same_contents(&src, &during), "failed writes changed the image, or reads failed");
    assert!(s.alive(), "the server exited: {}", s.stderr());

    // Between 30 s and 40 s after the open (see above): a point on the lease's clock, set by
    // lightfoot's 30 s give-up and the gateway's 40 s, not an event a condition could see.
    std::thread::sleep(Duration::from_secs(33).saturating_sub(opened.elapsed()));
    c.restart_volume(1);
    // The master may take a moment to count the volumes writable again, and the lease must
    // be renewed (at 40 s): try until a write works, within the bound.
    let r = client(
        &s,
        &format!(
            r#"
(w, p) = {resumed:?}
r = {{"tries": 0}}
t = time.monotonic()
while True:
    r["whole"] = attempt(h.pwrite, bytes([w[2]]) * w[1], w[0])
    r["tries"] += 1
    if r["whole"]["error"] is None or time.monotonic() - t > {bound}:
        break
    time.sleep(0.2)
r["part"] = attempt(h.pwrite, bytes([p[2]]) * p[1], p[0])
r["flush"] = attempt(h.flush)
r["secs"] = time.monotonic() - t
print(json.dumps(r))
"#,
            bound = BOUND.as_secs(),
        ),
    );
    eprintln!("after the restart: {r}");
    for w in ["whole", "part", "flush"] {
        assert!(
            r[w]["error"].is_null(),
            "{w} after the volume server came back: {r}\nserver: {}",
            s.stderr()
        );
    }
    let mut want = std::fs::read(&src).unwrap();
    for (off, len, byte) in resumed {
        want[off as usize..(off + len) as usize].fill(byte);
    }
    // What `got` holds where it must hold `want`, but for the failed writes' ranges, which
    // may hold their bytes instead.
    let agrees = |got: &[u8]| {
        let mut want = want.clone();
        for (off, len, byte) in failed {
            let range = off as usize..(off + len) as usize;
            if got[range.clone()].iter().all(|&b| b == byte) {
                want[range].fill(byte);
            }
        }
        got == want
    };
    let served = dir.path().join("served.img");
    client(&s, &read_all_into(&served));
    assert!(agrees(&std::fs::read(&served).unwrap()), "the server reads back other bytes after the restart");
    s.stop();
    // Both replicas took those writes: the other volume server down, the restarted one alone
    // serves them.
    c.kill_volume(0);
    let copied = dir.path().join("copied.img");
    ok(c.lightfoot(PROCESS_SECS, &["copy", IMAGE, copied.to_str().unwrap()]));
    assert!(agrees(&std::fs::read(&copied).unwrap()), "the restarted replica lacks the writes made after");
}

/// The store failing in two steps under a server opened before, each failure reaching
/// `copy` and the server's client within the bound (retries of failures this fast end after
/// 20 retries, 3 to 6 s here), the server running on:
///
/// 1. Both volume servers down: the filer still answers LISTs, and 404s from its metadata,
///    but every GET of data gets 500 at once. An image without a manifest (as nbdkit's plugin
///    writes them) opens from its LIST alone, so `copy` gets as far as the blocks and fails
///    naming the object and its offset in the image. A read gets EIO.
/// 2. The volume servers back, the gateway killed (every connection refused): `copy` fails
///    at open naming the object it could not read. A read gets EIO.
#[test]
fn a_failing_store_fails_copy_and_reads_within_the_bound() {
    let dir = scratch();
    let (mut c, _src) = cluster_with_image(dir.path());
    let mut s = S3Served::start(&c, dir.path(), IMAGE, &["--read-only"]);
    let (code, body) = c.request("DELETE", "/disks/img/lightfoot.json", b"").unwrap();
    assert_eq!(code, 204, "{body}");
    c.kill_volume(0);
    c.kill_volume(1);
    let msg = copy_and_read_fail(&c, &mut s, dir.path());
    // "read s3://disks/img/000000000000000b at offset 720896 (length 65536): …"
    let named = msg.split("read s3://disks/img/").nth(1).unwrap_or_else(|| panic!("no object named: {msg}"));
    let block = u64::from_str_radix(&named[..16], 16).unwrap_or_else(|e| panic!("{e}: {msg}"));
    let at = format!(" at offset {} (length {OBJECT})", block * OBJECT);
    assert!(named[16..].starts_with(&at), "wanted '{at}' after the object's name: {msg}");

    // The gateway alone: with the volume servers back, everything but it works.
    c.restart_volume(0);
    c.restart_volume(1);
    c.kill_gateway();
    let msg = copy_and_read_fail(&c, &mut s, dir.path());
    assert!(msg.contains("s3://disks/img/"), "the message names no object: {msg}");
}

/// Copies [`IMAGE`] (its geometry given: it has no manifest) and reads from `s` at once,
/// each waiting out the same retry bound; asserts that both fail within it, the read with
/// EIO, and that the server runs on. The copy's message.
fn copy_and_read_fail(c: &Cluster, s: &mut S3Served, dir: &Path) -> String {
    let back = dir.join("back.img");
    let args = ["copy", IMAGE, back.to_str().unwrap(), "--size", "2M", "--object-size", "64K"];
    let (read, (out, took)) = std::thread::scope(|t| {
        let read = t.spawn(|| client(s, "print(json.dumps(attempt(h.pread, 4096, 5000)))\n"));
        let copy = timed(c, &args);
        (read.join().unwrap(), copy)
    });
    let msg = text(&out);
    eprintln!("read {read}; copy failed in {took:?}: {msg}");
    assert_eq!(read["error"], "EIO", "read: {read}\nserver: {}", s.stderr());
    assert!(read["secs"].as_f64().unwrap() < BOUND.as_secs_f64(), "the read took {read}");
    assert!(s.alive(), "the server exited: {}", s.stderr());
    assert!(!out.status.success() && out.status.code() != Some(124), "copy: {:?}: {msg}", out.status);
    assert!(took < BOUND, "copy took {took:?} to fail");
    msg
}

/// A client writes (whole objects, parts of objects, across objects), FLUSHes, and stays
/// connected while the server is SIGKILLed; a new server reads back exactly what was flushed.
/// Plain, every write is stored before its reply; with `--coalesce` (held for an hour, so that
/// only the FLUSH writes them back) the FLUSH must have written back what it held.
#[test]
fn flushed_writes_survive_kill_9() {
    let dir = scratch();
    let c = Cluster::start();
    c.bucket("disks");
    for (key, extra) in [("plain", &[][..]), ("coalesced", &["--coalesce", "--coalesce-age", "1h"][..])] {
        let uri = format!("s3://disks/{key}");
        let s = S3Served::start(
            &c,
            dir.path(),
            &uri,
            &[&["--size", "1M", "--object-size", "64K"], extra].concat(),
        );
        let model = dir.path().join(format!("{key}.model"));
        let script = format!(
            r#"{PRELUDE}
import random
rng = random.Random(29)
size = h.get_size()
model = bytearray(size)
for n in range(60):
    ln = rng.choice([1, 512, 4096, 65536, 70000])
    off = rng.randrange(0, size - ln)
    data = bytes(rng.randrange(1, 256) for _ in range(ln))
    h.pwrite(data, off)
    model[off:off + ln] = data
h.flush()
open({model:?}, "wb").write(model)
print("flushed", flush=True)
sys.stdin.read()
"#,
            model = model.display().to_string(),
        );
        let (mut writer, _, line) = spawn_until_line(&mut libnbd_command(PROCESS_SECS, &script, &s.uri()));
        let stderr = s.stderr();
        s.kill9();
        // The client goes only now, after the kill: its disconnect would make the server flush.
        drop(writer.stdin.take());
        let out = writer.wait_with_output().unwrap();
        assert_eq!(
            line.trim(),
            "flushed",
            "{key}: the client did not flush: {}\nserver: {stderr}",
            text(&out)
        );

        // Read-only: the killed server's lease stays live for its 30 s.
        let s = S3Served::start(&c, dir.path(), &uri, &["--read-only"]);
        let back = dir.path().join(format!("{key}.back"));
        client(&s, &read_all_into(&back));
        assert!(same_contents(&model, &back), "{key}: what was flushed before the kill differs after it");
        s.stop();
    }
}
