//! Images in object storage, against a real store the tests start (SeaweedFS, see
//! `common::s3`): copies both ways in both layouts, the NBD protocol over block objects from
//! several connections, compatibility with nbdkit's S3 plugin both ways, bad input, and
//! secrets that never show.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::s3::{Gateway, S3Served, Seaweed};
use common::*;

const KIB: u64 = 1 << 10;

fn lf(w: &Seaweed, args: &[&str]) -> Output {
    w.lightfoot(300, args)
}

/// The JSON summary a successful `copy --json` printed.
fn json_of(out: Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", text(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Block objects of `key` in `bucket`, as block numbers.
fn blocks(w: &Seaweed, bucket: &str, key: &str) -> Vec<u64> {
    let mut v: Vec<u64> = w
        .list(bucket, &format!("{key}/"))
        .iter()
        .filter_map(|k| k.strip_prefix(&format!("{key}/")).and_then(|h| u64::from_str_radix(h, 16).ok()))
        .collect();
    v.sort_unstable();
    v
}

/// A file to file copy through a block image and through one object; holes are not uploaded
/// into a new image, and what comes back is what went.
#[test]
fn copies_to_and_from_both_layouts() {
    let w = Seaweed::start();
    w.bucket("disks");
    let dir = scratch();
    let src = dir.path().join("src.img");
    // 8 MiB: data and holes in alternate 1 MiB pieces, one allocated piece of zeroes.
    sample(&src, 8 * MIB, MIB);
    let json = json_of(lf(
        &w,
        &["copy", "--json", src.to_str().unwrap(), "s3://disks/disk", "--object-size", "64K"],
    ));
    let present = blocks(&w, "disks", "disk");
    let want: Vec<u64> = (0..128).filter(|b| (b / 16) % 2 == 0 && b / 16 != 2).collect();
    assert_eq!(present, want, "only blocks with data are uploaded");
    assert!(w.list("disks", "disk/").contains(&"disk/lightfoot.json".to_string()));
    // One PUT per object with data, and the manifest's, the lease's and the two of the
    // conditional-write probe; no GET but the manifest's.
    let r = &json["destination"]["requests"];
    assert_eq!((r["put"].as_u64(), r["get"].as_u64()), (Some(want.len() as u64 + 4), Some(1)), "{r}");
    let back = dir.path().join("back.img");
    let json = json_of(lf(&w, &["copy", "--json", "s3://disks/disk", back.to_str().unwrap()]));
    assert!(same_contents(&src, &back), "block image round trip differs");
    // The holes are not asked for: one GET per object that exists (and the manifest's and
    // the lease's, which says whether another writer may change the image).
    let r = &json["source"]["requests"];
    assert_eq!((r["get"].as_u64(), r["put"].as_u64()), (Some(want.len() as u64 + 2), Some(0)), "{r}");
    // The destination's holes stayed holes: the map of objects said so.
    assert!(allocated(&back) <= 4 * MIB + 64 * KIB, "allocated {}", allocated(&back));

    // One object, put there by another program.
    let data = std::fs::read(&src).unwrap();
    let (code, _) = w.request("PUT", "/disks/one.img", &data).unwrap();
    assert_eq!(code, 200);
    let back1 = dir.path().join("back1.img");
    ok(lf(&w, &["copy", "s3://disks/one.img", back1.to_str().unwrap()]));
    assert!(same_contents(&src, &back1));

    // Into one object, uploaded in parts: from the file (holes sent as zeroes) and from a
    // pipe (size not known in advance).
    ok(lf(&w, &["copy", src.to_str().unwrap(), "s3://disks/up.img"]));
    ok(lf(&w, &["copy", "s3://disks/up.img", back1.to_str().unwrap()]));
    assert!(same_contents(&src, &back1), "one-object upload round trip differs");
    let piped = w
        .command("sh")
        .arg("-c")
        .arg(format!("cat {} | timeout 300 {} copy - s3://disks/piped.img", src.display(), bin()))
        .output()
        .unwrap();
    assert!(piped.status.success(), "{}", text(&piped));
    ok(lf(&w, &["copy", "s3://disks/piped.img", back1.to_str().unwrap()]));
    assert!(same_contents(&src, &back1), "piped upload round trip differs");
    // Five 8 MiB parts, the later ones in buffers of parts already sent: a reused buffer
    // holds none of the part before it.
    let big = dir.path().join("big.img");
    sample(&big, 40 * MIB, MIB);
    ok(lf(&w, &["copy", big.to_str().unwrap(), "s3://disks/big.img"]));
    let big_back = dir.path().join("big-back.img");
    ok(lf(&w, &["copy", "s3://disks/big.img", big_back.to_str().unwrap()]));
    assert!(same_contents(&big, &big_back), "five-part upload round trip differs");

    // Into an existing image: the source's zeroes delete the objects that held data.
    let zeros = dir.path().join("zeros.img");
    std::fs::File::create(&zeros).unwrap().set_len(8 * MIB).unwrap();
    ok(lf(&w, &["copy", zeros.to_str().unwrap(), "s3://disks/disk", "--object-size", "64K"]));
    assert_eq!(blocks(&w, "disks", "disk"), Vec::<u64>::new(), "zeroes delete whole objects");
    ok(lf(&w, &["copy", "s3://disks/disk", back.to_str().unwrap()]));
    assert!(std::fs::read(&back).unwrap().iter().all(|&b| b == 0));
}

/// READ, WRITE (aligned or not, across objects), TRIM, WRITE_ZEROES and FLUSH from two
/// connections at once over 4 KiB objects, checked against a model; the image then reopens
/// from its manifest alone and holds the same bytes.
#[test]
fn serves_block_objects_to_several_connections() {
    let w = Seaweed::start();
    w.bucket("disks");
    let dir = scratch();
    let s = S3Served::start(&w, dir.path(), "s3://disks/vm", &["--object-size", "4K", "--size", "1M"]);
    let script = r#"
import os, nbd, random, threading
uri = os.environ["URI"]
size = 1 << 20
model = bytearray(size)
lock = threading.Lock()
# Two connections write the interleaved halves of every 512-byte piece of the first 64 KiB:
# each object sees read-modify-writes from both at once, and none may lose the other's.
def half(which):
    h = nbd.NBD()
    h.connect_uri(uri)
    for i in range(which, 128, 2):
        data = bytes([i % 251 + 1]) * 512
        h.pwrite(data, i * 512)
        with lock:
            model[i * 512:(i + 1) * 512] = data
    h.flush()
ts = [threading.Thread(target=half, args=(k,)) for k in (0, 1)]
[t.start() for t in ts]
[t.join() for t in ts]
h = nbd.NBD()
h.add_meta_context("base:allocation")
h.connect_uri(uri)
rng = random.Random(5)
for n in range(200):
    off = rng.randrange(0, size - 20000)
    op = rng.random()
    ln = rng.choice([1, 511, 4096, 4097, 9000, 20000])
    if op < 0.6:
        data = bytes(rng.randrange(256) for _ in range(ln))
        h.pwrite(data, off)
        model[off:off + ln] = data
    elif op < 0.8:
        h.zero(ln, off)
        model[off:off + ln] = bytes(ln)
    else:
        # TRIM leaves bytes unspecified: only whole objects go, and they read as zeroes.
        h.trim(ln, off)
        first = (off + 4095) // 4096
        last = (off + ln) // 4096
        for b in range(first, last):
            model[b * 4096:(b + 1) * 4096] = bytes(4096)
h.flush()
got = h.pread(size, 0)
assert got == model, "image differs from the model"
# Block status: objects that do not exist are holes.
holes = []
def cb(meta, off, entries, err):
    pos = off
    for i in range(0, len(entries), 2):
        if entries[i + 1] & nbd.STATE_HOLE:
            holes.append((pos, entries[i]))
        pos += entries[i]
h.block_status(size, 0, cb)
for off, ln in holes:
    assert model[off:off + ln] == bytes(ln), f"hole at {off}+{ln} holds data"
assert holes, "an image with trimmed objects reports no holes"
open(os.environ["OUT"], "wb").write(model)
print("ok")
"#;
    let model = dir.path().join("model.img");
    let out = Command::new("timeout")
        .args(["-k", "10", "300", "/usr/bin/python3", "-c", script])
        .env("URI", s.uri())
        .env("OUT", &model)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    s.stop();
    // Reopened with no flags: the manifest gives the geometry.
    let back = dir.path().join("back.img");
    ok(lf(&w, &["copy", "s3://disks/vm", back.to_str().unwrap()]));
    assert!(same_contents(&model, &back), "the image read back after a restart differs");
}

/// An image lightfoot wrote reads the same through nbdkit's S3 plugin, and one nbdkit wrote
/// reads the same through lightfoot (given its geometry, as nbdkit is).
#[test]
fn nbdkit_s3_plugin_reads_ours_and_we_read_its() {
    let plugin = Path::new("/usr/lib/x86_64-linux-gnu/nbdkit/plugins/nbdkit-S3-plugin");
    assert!(
        plugin.exists(),
        "nbdkit's S3 plugin is missing: `make test` installs nbdkit-plugin-python and python3-boto3"
    );
    need("nbdcopy", "libnbd-bin");
    let w = Seaweed::start();
    w.bucket("disks");
    let dir = scratch();
    let src = dir.path().join("src.img");
    sample(&src, 4 * MIB, 512 * KIB);
    ok(lf(&w, &["copy", src.to_str().unwrap(), "s3://disks/ours", "--object-size", "64K"]));
    let nbdkit = |key: &str, run: &str| {
        w.command("timeout")
            .args(["-k", "10", "300", "nbdkit", "-U", "-", "S3"])
            .arg(format!("endpoint-url={}", w.endpoint))
            .args(["access-key=lightfoot-test", "secret-key=lightfoot-test-secret", "bucket=disks"])
            .arg(format!("key={key}"))
            .args(["size=4M", "object-size=64K", "--run", run])
            // nbdsh is the system interpreter's (python3-libnbd).
            .env("PATH", format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default()))
            .output()
            .unwrap()
    };
    let via_nbdkit = dir.path().join("via-nbdkit.img");
    ok(nbdkit("ours", &format!("nbdcopy \"$uri\" {}", via_nbdkit.display())));
    assert!(same_contents(&src, &via_nbdkit), "nbdkit reads our image differently");

    ok(nbdkit("theirs", &format!("nbdcopy {} \"$uri\"", src.display())));
    let via_us = dir.path().join("via-us.img");
    ok(lf(
        &w,
        &["copy", "s3://disks/theirs", via_us.to_str().unwrap(), "--object-size", "64K", "--size", "4M"],
    ));
    assert!(same_contents(&src, &via_us), "we read nbdkit's image differently");
    // Writing through lightfoot into nbdkit's image, then a TRIM through nbdkit of all of
    // it: our manifest (now there) survives nbdkit's delete of the blocks.
    let s = S3Served::start(&w, dir.path(), "s3://disks/theirs", &["--object-size", "64K", "--size", "4M"]);
    let out = libnbd("import os, nbd\nh = nbd.NBD()\nh.connect_uri(os.environ['URI'])\nh.pwrite(b'x' * 100, 70000)\nh.flush()\n", &s.uri());
    assert!(out.status.success(), "{}", text(&out));
    s.stop();
    ok(nbdkit("theirs", "nbdsh -u \"$uri\" -c 'h.trim(h.get_size(), 0)'"));
    assert_eq!(w.list("disks", "theirs/"), vec!["theirs/lightfoot.json".to_string()]);
}

/// A copy into one object that fails half way (its source returns EIO) leaves no object and
/// no upload behind; the object it would have replaced is still whole.
#[test]
fn a_failed_upload_leaves_nothing() {
    need("nbdkit", "nbdkit");
    let w = Seaweed::start();
    w.bucket("disks");
    let (code, _) = w.request("PUT", "/disks/kept.img", &[5u8; 4096]).unwrap();
    assert_eq!(code, 200);
    for key in ["gone.img", "kept.img"] {
        let out = lf(
            &w,
            &[
                "copy",
                // 256 reads of 256 KiB, each failing with a chance of 1 in 20: the copy fails
                // (all 256 succeed once in 500,000 tries; at 1 in 50, as before, once in 180),
                // most often a few MiB in.
                "--request-size",
                "256K",
                "--",
                "[",
                "nbdkit",
                "--filter=error",
                "pattern",
                "64M",
                "error-pread=EIO",
                "error-pread-rate=0.05",
                "]",
                &format!("s3://disks/{key}"),
            ],
        );
        assert!(!out.status.success(), "a copy from a failing source succeeded: {}", text(&out));
        assert!(text(&out).contains("Input/output error") || text(&out).contains("EIO"), "{}", text(&out));
    }
    assert_eq!(w.request("HEAD", "/disks/gone.img", b"").unwrap().0, 404, "a half object appeared");
    let (_, body) = w.request("GET", "/disks/kept.img", b"").unwrap();
    assert_eq!(body.len(), 4096, "the object a failed copy would have replaced changed");
    let (code, uploads) = w.request("GET", "/disks?uploads", b"").unwrap();
    assert_eq!(code, 200, "{uploads}");
    assert!(!uploads.contains("<Upload>"), "parts left behind: {uploads}");
}

/// --coalesce over block objects: each object a FLUSH writes back is one PUT, with no GET
/// where the client's writes cover it and one where they cover part of an object that
/// exists; an object that does not exist is not read.
#[test]
fn coalesce_writes_each_object_once() {
    let w = Seaweed::start();
    w.bucket("disks");
    let dir = scratch();
    let geometry = ["--object-size", "64K", "--size", "4M"];
    // Object 9 exists (its first 4 KiB written).
    let s = S3Served::start(&w, dir.path(), "s3://disks/co", &geometry);
    let out = libnbd(
        "import os, nbd\nh = nbd.NBD()\nh.connect_uri(os.environ['URI'])\nh.pwrite(b'z' * 4096, 9 * 65536)\n",
        &s.uri(),
    );
    assert!(out.status.success(), "{}", text(&out));
    s.stop();
    let s = S3Served::start(&w, dir.path(), "s3://disks/co", &["--coalesce", "--stats", "--json"]);
    let script = r#"
import os, nbd, random
h = nbd.NBD()
h.connect_uri(os.environ["URI"])
# Objects 1-4 covered whole by 4 KiB writes in random order; 1 KiB into object 9 (exists)
# and into object 20 (does not).
offs = [o * 65536 + i * 4096 for o in range(1, 5) for i in range(16)]
random.Random(3).shuffle(offs)
for off in offs:
    h.pwrite(bytes([off // 65536]) * 4096, off)
h.pwrite(b"y" * 1024, 9 * 65536 + 8192)
h.pwrite(b"x" * 1024, 20 * 65536 + 100)
h.flush()
"#;
    let out = libnbd(script, &s.uri());
    assert!(out.status.success(), "{}", text(&out));
    let err = s.stop();
    let stats: serde_json::Value =
        serde_json::from_str(err.lines().rev().find(|l| l.starts_with('{')).unwrap()).unwrap();
    let r = &stats["s3"];
    // At open: the manifest's GET, the probe's two PUTs and the lease's.
    let (get_open, put_open) = (1, 3);
    assert_eq!(r["put"].as_u64().unwrap() - put_open, 6, "one PUT per object touched: {r}");
    assert_eq!(r["get"].as_u64().unwrap() - get_open, 1, "a GET only for object 9: {r}");
    let back = dir.path().join("back.img");
    ok(lf(&w, &["copy", "s3://disks/co", back.to_str().unwrap()]));
    let img = std::fs::read(&back).unwrap();
    let at = |off: u64, len: usize| &img[off as usize..off as usize + len];
    assert!(
        at(9 * 65536, 4096).iter().all(|&b| b == b'z')
            && at(9 * 65536 + 8192, 1024).iter().all(|&b| b == b'y')
    );
    assert!(at(20 * 65536 + 100, 1024).iter().all(|&b| b == b'x'));
    for o in 1..5u64 {
        assert!(at(o * 65536, 65536).iter().all(|&b| b == o as u8), "object {o}");
    }
}

/// `--prefetch` over object storage is a chunk cache: scattered 4 KiB reads (no stream) over
/// two 256 KiB chunks, each read several times, cost one range GET per chunk, and return the
/// object's bytes.
#[test]
fn prefetch_fetches_each_chunk_once() {
    let w = Seaweed::start();
    w.bucket("disks");
    let dir = scratch();
    let src = dir.path().join("src.img");
    random_file(&src, 2 << 20);
    ok(lf(&w, &["copy", src.to_str().unwrap(), "s3://disks/one"]));
    let s = S3Served::start(&w, dir.path(), "s3://disks/one", &["-r", "--prefetch", "--stats", "--json"]);
    let script = r#"
import os, nbd
h = nbd.NBD()
h.connect_uri(os.environ["URI"])
src = open(os.environ["SRC"], "rb").read()
# Backwards in steps of 3 blocks over chunk 0 and chunk 5, three times: never a stream.
for _ in range(3):
    for base in (0, 5 * 262144):
        for i in range(63, -1, -3):
            off = base + i * 4096
            assert h.pread(4096, off) == src[off:off + 4096], off
"#;
    let out = libnbd_command(120, script, &s.uri()).env("SRC", &src).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let err = s.stop();
    let stats: serde_json::Value =
        serde_json::from_str(err.lines().rev().find(|l| l.starts_with('{')).unwrap()).unwrap();
    // At open, a GET of the block layout's manifest (there is none), then one per chunk.
    assert_eq!(stats["s3"]["get"].as_u64(), Some(1 + 2), "one GET per chunk: {}", stats["s3"]);
    assert_eq!(stats["s3"]["bytes_got"].as_u64(), Some(2 * 256 * KIB), "{}", stats["s3"]);
    assert_eq!(stats["prefetch"]["misses"].as_u64(), Some(2), "{}", stats["prefetch"]);
}

/// Read-ahead over object storage fetches units of several chunks with one GET each, its body
/// written straight into the chunks: a sequential read of either layout (an object, and block
/// objects whose edges fall inside chunks, one of them never written) returns every byte
/// right, and fetches none twice.
#[test]
fn prefetch_units_read_right_from_both_layouts() {
    let w = Seaweed::start();
    w.bucket("disks");
    let dir = scratch();
    let src = dir.path().join("src.img");
    random_file(&src, 12 * 384 * KIB);
    // Zeroes the block image stores no object for: its object 3.
    let mut data = std::fs::read(&src).unwrap();
    data[3 * 384 * KIB as usize..4 * 384 * KIB as usize].fill(0);
    std::fs::write(&src, &data).unwrap();
    ok(lf(&w, &["copy", src.to_str().unwrap(), "s3://disks/one"]));
    let script = r#"
import os, nbd
h = nbd.NBD()
h.connect_uri(os.environ["URI"])
src = open(os.environ["SRC"], "rb").read()
for off in range(0, len(src), 65536):
    got = h.pread(65536, off)
    assert got == src[off:off + 65536], off
"#;
    ok(lf(&w, &["copy", src.to_str().unwrap(), "s3://disks/blocks", "--object-size", "384K"]));
    let present = blocks(&w, "disks", "blocks");
    assert_eq!(
        present,
        (0..12).filter(|&b| b != 3).collect::<Vec<u64>>(),
        "the zeroes' object is not stored"
    );
    // Every byte of the objects once: all of the one object; the 11 block objects and the
    // manifest (under 4 KiB).
    for (key, stored) in [("one", 12 * 384 * KIB), ("blocks", 11 * 384 * KIB)] {
        let s = S3Served::start(
            &w,
            dir.path(),
            &format!("s3://disks/{key}"),
            &["-r", "--prefetch", "--stats", "--json"],
        );
        let out = libnbd_command(120, script, &s.uri()).env("SRC", &src).output().unwrap();
        assert!(out.status.success(), "{key}: {}", text(&out));
        let err = s.stop();
        let stats: serde_json::Value =
            serde_json::from_str(err.lines().rev().find(|l| l.starts_with('{')).unwrap()).unwrap();
        let got = stats["s3"]["bytes_got"].as_u64().unwrap();
        assert!(
            (stored..stored + 4096).contains(&got),
            "{key}: {got} bytes fetched for {stored}: {}",
            stats["s3"]
        );
        assert!(stats["prefetch"]["prefetched"].as_u64().unwrap() > 0, "{key}: {}", stats["prefetch"]);
    }
}

/// Writes are conditional on the version they build on: an object created behind the server's
/// back (by a writer that ignores the lease, as nbdkit's plugin does) is read and patched,
/// not replaced by zeroes around the server's bytes.
#[test]
fn an_object_changed_behind_the_server_is_not_overwritten_unseen() {
    let w = Seaweed::start();
    w.bucket("disks");
    let dir = scratch();
    let s = S3Served::start(&w, dir.path(), "s3://disks/cw", &["--object-size", "4K", "--size", "64K"]);
    // Object 5 did not exist at open; someone else writes it whole.
    let (code, _) = w.request("PUT", "/disks/cw/0000000000000005", &[b'o'; 4096]).unwrap();
    assert_eq!(code, 200);
    let script = r#"
import os, nbd
h = nbd.NBD()
h.connect_uri(os.environ["URI"])
h.pwrite(b"n" * 100, 5 * 4096 + 1000)
h.flush()
got = h.pread(4096, 5 * 4096)
assert got == b"o" * 1000 + b"n" * 100 + b"o" * 2996, got[:1200]
"#;
    let out = libnbd(script, &s.uri());
    assert!(out.status.success(), "{}", text(&out));
    s.stop();
}

/// One writer per block image: a second writer is refused while the first holds the lease,
/// a reader sees the image as all data then (its map of objects could go stale), and
/// --break-lease takes the image over: the first writer's writes fail with EIO from its next
/// renewal on, well before the lease could have expired. A clean exit releases the lease.
#[test]
fn one_writer_per_image() {
    let w = Seaweed::start();
    w.bucket("disks");
    let dir = scratch();
    let geometry = ["--object-size", "64K", "--size", "1M"];
    let a = S3Served::start(&w, dir.path(), "s3://disks/vm", &geometry);
    let write = "import os, nbd\nh = nbd.NBD()\nh.connect_uri(os.environ['URI'])\nh.pwrite(b'a' * 100, 70000)\nh.flush()\n";
    let out = libnbd(write, &a.uri());
    assert!(out.status.success(), "{}", text(&out));
    assert!(w.list("disks", "vm/").contains(&"vm/lightfoot.lease".to_string()));

    let second = w
        .command("timeout")
        .args(["-k", "10", "60", bin(), "serve", "--unix"])
        .arg(dir.path().join("second.sock"))
        .arg("s3://disks/vm")
        .output()
        .unwrap();
    assert!(!second.status.success(), "a second writer was let in");
    assert!(
        text(&second).contains("has a writer") && text(&second).contains("--break-lease"),
        "{}",
        text(&second)
    );
    let src = dir.path().join("src.img");
    random_file(&src, MIB);
    let out = lf(&w, &["copy", src.to_str().unwrap(), "s3://disks/vm", "--object-size", "64K"]);
    assert!(!out.status.success() && text(&out).contains("has a writer"), "{}", text(&out));

    // A reader while the writer runs: every byte is data in block status.
    let r = S3Served::start(&w, dir.path(), "s3://disks/vm", &["-r"]);
    let status = r#"
import os, nbd
h = nbd.NBD()
h.add_meta_context("base:allocation")
h.connect_uri(os.environ["URI"])
holes = []
h.block_status(1 << 20, 0, lambda m, o, e, err: holes.extend(e[i] for i in range(0, len(e), 2) if e[i + 1] & 1))
assert not holes, holes
"#;
    let out = libnbd(status, &r.uri());
    assert!(out.status.success(), "{}", text(&out));
    r.stop();

    // Taken over: the first writer stops writing at its next renewal (10 s at most).
    let b = S3Served::start(&w, dir.path(), "s3://disks/vm", &["--break-lease"]);
    let probe = r#"
import os, nbd, time
h = nbd.NBD()
h.connect_uri(os.environ["URI"])
end = time.time() + 30
while time.time() < end:
    try:
        h.pwrite(b"b" * 100, 0)
    except nbd.Error as e:
        assert "(EIO)" in str(e), e
        print("stopped")
        break
    time.sleep(0.25)
"#;
    let out = libnbd(probe, &a.uri());
    assert!(
        out.status.success() && text(&out).contains("stopped"),
        "the first writer went on writing: {}",
        text(&out)
    );
    let out = libnbd(write, &b.uri());
    assert!(out.status.success(), "{}", text(&out));
    b.stop();
    a.stop();
    assert!(
        !w.list("disks", "vm/").contains(&"vm/lightfoot.lease".to_string()),
        "the lease outlived its writer"
    );
}

/// A store with identities: a wrong secret is a clear error at open (and the secret stays
/// out of it), a caller that may not read gets an error, never zeroes (S3 answers 403 where a
/// missing key is not to be told apart from a forbidden one), and a skewed clock is named.
#[test]
fn refused_requests_are_errors_not_zeroes() {
    let config = r#"{"identities": [
        {"name": "anonymous", "actions": ["Admin", "Read", "Write", "List"]},
        {"name": "writer", "credentials": [{"accessKey": "writer", "secretKey": "writer-secret-0123"}],
         "actions": ["Admin", "Read", "Write", "List"]},
        {"name": "blind", "credentials": [{"accessKey": "blind", "secretKey": "blind-secret-4567"}],
         "actions": ["Write"]}
    ]}"#;
    let w = Seaweed::start_with(Some(config));
    w.bucket("disks");
    let dir = scratch();
    let src = dir.path().join("src.img");
    random_file(&src, 256 * KIB);
    let as_ = |id: &str, secret: &str, args: &[&str]| {
        w.command("timeout")
            .args(["-k", "10", "60", bin()])
            .args(args)
            .env("AWS_ACCESS_KEY_ID", id)
            .env("AWS_SECRET_ACCESS_KEY", secret)
            .output()
            .unwrap()
    };
    let s = src.to_str().unwrap();
    let out = as_("writer", "writer-secret-0123", &["copy", s, "s3://disks/img", "--object-size", "64K"]);
    assert!(out.status.success(), "{}", text(&out));
    let back = dir.path().join("back.img");
    let b = back.to_str().unwrap();
    let out = as_("writer", "wrong-secret-89ab", &["copy", "s3://disks/img", b]);
    assert!(!out.status.success(), "a wrong secret was let in");
    assert!(
        text(&out).contains("s3://disks/img") && !text(&out).contains("wrong-secret-89ab"),
        "{}",
        text(&out)
    );
    assert!(text(&out).contains("wrong credentials"), "{}", text(&out));
    let out = as_("blind", "blind-secret-4567", &["copy", "s3://disks/img", b]);
    assert!(!out.status.success(), "a caller that may not read got data (or zeroes): {}", text(&out));
    assert!(text(&out).contains("AccessDenied: these credentials may not do this"), "{}", text(&out));
    // A clock a year off: the store refuses the signature's date, and that is what is said.
    let skewed = format!("http://127.0.0.1:{}", common::s3::skewing_proxy(w.s3_port()));
    let out = w
        .command("timeout")
        .args(["-k", "10", "60", bin(), "copy", "s3://disks/img", b])
        .env("AWS_ENDPOINT_URL", &skewed)
        .env("AWS_ACCESS_KEY_ID", "writer")
        .env("AWS_SECRET_ACCESS_KEY", "writer-secret-0123")
        .output()
        .unwrap();
    assert!(!out.status.success(), "a request dated a year ago was let in: {}", text(&out));
    assert!(text(&out).contains("RequestTimeTooSkewed: this machine's clock"), "{}", text(&out));
    assert!(!back.exists(), "a failed copy created its destination");
}

/// A store with a certificate of its own CA: trusted through AWS_CA_BUNDLE, refused without
/// it (the system's CAs do not know it), and no warning about plain HTTP either way.
#[test]
fn https_with_a_ca_bundle() {
    let certs = certs::Certs::new();
    let (cert, key) = (certs.server.join("server-cert.pem"), certs.server.join("server-key.pem"));
    let w = Seaweed::start_full(None, Some((&cert, &key)));
    w.bucket("disks");
    let https = w.https_endpoint.clone().unwrap();
    let dir = scratch();
    let src = dir.path().join("src.img");
    random_file(&src, 256 * KIB);
    let run = |args: &[&str], ca: Option<&Path>| {
        let mut c = w.command("timeout");
        c.args(["-k", "10", "60", bin()]).args(args).env("AWS_ENDPOINT_URL", &https);
        if let Some(ca) = ca {
            c.env("AWS_CA_BUNDLE", ca);
        }
        c.output().unwrap()
    };
    let ca = certs.server.join("ca-cert.pem");
    let up = run(&["copy", src.to_str().unwrap(), "s3://disks/tls.img"], Some(&ca));
    assert!(up.status.success(), "{}", text(&up));
    assert!(!text(&up).contains("plain HTTP"), "{}", text(&up));
    let back = dir.path().join("back.img");
    let down = run(&["copy", "s3://disks/tls.img", back.to_str().unwrap()], Some(&ca));
    assert!(down.status.success() && same_contents(&src, &back), "{}", text(&down));
    let refused = run(&["copy", "s3://disks/tls.img", back.to_str().unwrap()], None);
    assert!(!refused.status.success(), "a certificate of an unknown CA was accepted");
    assert!(text(&refused).contains("certificate is not trusted here: AWS_CA_BUNDLE"), "{}", text(&refused));
}

/// What goes wrong is said clearly, with a failing exit and nothing written.
#[test]
fn bad_input_gets_a_clear_error() {
    let w = Seaweed::start();
    w.bucket("disks");
    let dir = scratch();
    let dst = dir.path().join("x.img");
    let d = dst.to_str().unwrap();
    let fails = |args: &[&str], says: &str| {
        let out = lf(&w, args);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(text(&out).contains(says), "{args:?}: wanted '{says}' in: {}", text(&out));
    };
    fails(&["copy", "s3://disks/none", d], "no such object");
    fails(&["copy", "s3://nobucket/x", d], "no such bucket");
    fails(&["copy", "s3://AKIAX:hunter2@b/x", d], "credentials in an s3:// URI are refused");
    // An object of the wrong size in a block image.
    let (code, _) = w.request("PUT", "/disks/odd/0000000000000003", &[7u8; 1000]).unwrap();
    assert_eq!(code, 200);
    fails(
        &["copy", "s3://disks/odd", d, "--object-size", "4K", "--size", "64K"],
        "1000 bytes, not the image's object size 4096",
    );
    // A geometry that contradicts the manifest.
    let src = dir.path().join("src.img");
    random_file(&src, 256 * KIB);
    ok(lf(&w, &["copy", src.to_str().unwrap(), "s3://disks/img", "--object-size", "64K"]));
    fails(&["copy", "s3://disks/img", d, "--object-size", "4K", "--size", "256K"], "manifest says so");
    fails(
        &["copy", src.to_str().unwrap(), "s3://disks/img2", "--object-size", "96K"],
        "not a multiple of --object-size",
    );
    // A one-object image is read-only.
    let (code, _) = w.request("PUT", "/disks/single", &[1u8; 4096]).unwrap();
    assert_eq!(code, 200);
    let out = w
        .command("timeout")
        .args(["-k", "10", "60", bin(), "serve", "--unix"])
        .arg(dir.path().join("never.sock"))
        .arg("s3://disks/single")
        .output()
        .unwrap();
    assert!(!out.status.success() && text(&out).contains("read-only"), "{}", text(&out));
    assert!(!dst.exists(), "a failed copy created its destination");
}

/// Canary secrets at the highest verbosity, with --json and --stats, through a failure too:
/// they appear in no output and in no object lightfoot wrote.
#[test]
fn secrets_never_show() {
    let w = Seaweed::start();
    w.bucket("disks");
    let dir = scratch();
    let src = dir.path().join("src.img");
    random_file(&src, 256 * KIB);
    let canary = ["CANARYSECRETf00dfeed", "CANARYTOKENbeefcafe"];
    let run = |args: &[&str]| {
        w.command("timeout")
            .args(["-k", "10", "60", bin()])
            .args(args)
            .env("AWS_SECRET_ACCESS_KEY", canary[0])
            .env("AWS_SESSION_TOKEN", canary[1])
            .env("RUST_LOG", "trace")
            .output()
            .unwrap()
    };
    let mut seen = String::new();
    for args in [
        vec!["copy", "-vv", "--json", src.to_str().unwrap(), "s3://disks/c", "--object-size", "64K"],
        vec!["copy", "-vv", "--json", "s3://disks/c", dir.path().join("back").to_str().unwrap()],
        vec!["copy", "-vv", "s3://disks/missing", dir.path().join("back2").to_str().unwrap()],
        vec!["copy", "-vv", "s3://nobucket/x", dir.path().join("back3").to_str().unwrap()],
    ] {
        let out = run(&args);
        seen += &text(&out);
    }
    let sock = dir.path().join("c.sock");
    let server = w
        .command(bin())
        .args(["serve", "-vv", "--stats", "--unix"])
        .arg(&sock)
        .arg("s3://disks/c")
        .env("AWS_SECRET_ACCESS_KEY", canary[0])
        .env("AWS_SESSION_TOKEN", canary[1])
        .env("RUST_LOG", "trace")
        .stderr(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    assert!(within(30, || sock.exists()));
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let client = libnbd("import os, nbd\nh = nbd.NBD()\nh.connect_uri(os.environ['URI'])\nh.pwrite(b'y' * 5000, 1000)\nh.pread(9000, 0)\nh.flush()\n", &uri);
    // Stopped before anything is asserted: a failed assertion must not leave it running.
    let _ = Command::new("kill").arg(server.id().to_string()).status();
    let out = server.wait_with_output().unwrap();
    assert!(client.status.success(), "{}", text(&client));
    seen += &text(&client);
    assert!(text(&out).contains("object storage: "), "--stats counts no requests: {}", text(&out));
    seen += &text(&out);
    assert!(seen.contains("TRACE") || seen.contains("DEBUG"), "ran without verbose output: {seen}");
    for c in canary {
        assert!(!seen.contains(c), "a secret appeared in the output");
    }
    for k in w.list("disks", "") {
        let (_, body) = w.request("GET", &format!("/disks/{k}"), b"").unwrap();
        for c in canary {
            assert!(!body.contains(c), "a secret appeared in object {k}");
        }
    }
}
