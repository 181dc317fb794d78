//! `serve --dirty-bitmap` and `lightfoot bitmap`: writes through lightfoot's own server are
//! tracked, and `copy --bitmap` from it (read-only, after the writer stopped) brings the
//! previous copy level with the image, through the plain server and `--coalesce`, after a
//! kill -9 at any point, and after another program wrote the image. Bad input fails clearly
//! and leaves the image and the bitmap file as they were.

mod common;

use std::path::{Path, PathBuf};

use common::*;

const SIZE: u64 = 16 * MIB;
const GRAIN: u64 = 64 << 10;

/// Changes through the server: data at odd offsets across 64 KiB blocks and the sample's
/// data/hole edges, zeroes over data (unaligned), a discard, data into a hole.
const CHANGES: &[(&str, u64, u64)] = &[
    ("write -P 0x5a", 1000, 70_000),
    ("write -P 0xa5", 3_145_000, 200_001),
    ("write -z", 6_300_000, 150_000),
    ("discard", 12_582_912, 1_048_576),
    ("write -P 0x33", 9_437_300, 5000),
];

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The bytes a 64 KiB-granularity bitmap marks for these changes.
fn marked(changes: &[(&str, u64, u64)]) -> u64 {
    let mut blocks = std::collections::BTreeSet::new();
    for &(_, off, len) in changes {
        blocks.extend(off / GRAIN..=(off + len - 1) / GRAIN);
    }
    blocks.len() as u64 * GRAIN
}

/// `qemu-io` on the raw export at `uri`: each change, in order.
fn qemu_io(uri: &str, changes: &[(&str, u64, u64)]) {
    let mut c = tool("qemu-io", "qemu-utils");
    c.args(["-f", "raw"]);
    for (cmd, off, len) in changes {
        c.args(["-c", &format!("{cmd} {off} {len}")]);
    }
    let out = c.arg(uri).output().unwrap();
    assert!(out.status.success(), "qemu-io: {}", text(&out));
}

/// An image with data and holes, and a full copy of it: the previous backup.
fn image_and_backup(dir: &Path) -> (PathBuf, PathBuf) {
    let (img, backup) = (dir.join("disk.img"), dir.join("backup.img"));
    sample(&img, SIZE, MIB);
    std::fs::copy(&img, &backup).unwrap();
    (img, backup)
}

/// `copy --bitmap NAME` from a read-only server of `img` into `backup`: the bytes it
/// counted changed, and its stderr (warnings of the server at open included).
fn incremental(img: &Path, backup: &Path, name: &str) -> (u64, String) {
    let ro = Served::start(img, &["-r", "--dirty-bitmap", name]);
    let out = lightfoot(&["copy", "--json", "--bitmap", name, &ro.uri(), s(backup)]);
    let (status, server_err) = ro.stop();
    assert!(status.success(), "read-only server: {server_err}");
    let json: serde_json::Value = serde_json::from_str(&ok(out)).unwrap();
    (json["changed"].as_u64().unwrap(), server_err)
}

fn list(img: &Path) -> serde_json::Value {
    serde_json::from_str(&ok(lightfoot(&["bitmap", "list", "--json", s(img)]))).unwrap()
}

#[test]
fn writes_through_the_server_are_copied_incrementally() {
    for extra in [&[][..], &["--coalesce"][..]] {
        let dir = scratch();
        let (img, backup) = image_and_backup(dir.path());
        let mut args = vec!["--dirty-bitmap", "nightly"];
        args.extend_from_slice(extra);
        let w = Served::start(&img, &args);
        qemu_io(&w.uri(), CHANGES);
        let (status, err) = w.stop();
        assert!(status.success(), "{extra:?}: {err}");
        assert!(!same_contents(&img, &backup), "the changes reached the image");
        let l = list(&img);
        assert_eq!(l["state"], "clean", "{l}");
        assert_eq!(l["bitmaps"][0]["changed"], marked(CHANGES), "{extra:?}: {l}");

        // libnbd reads the same marks from lightfoot's server as from qemu-nbd's.
        let ro = Served::start(&img, &["-r", "--dirty-bitmap", "nightly"]);
        let map = tool("nbdinfo", "libnbd-bin")
            .args(["--map=qemu:dirty-bitmap:nightly", &ro.uri()])
            .output()
            .unwrap();
        assert!(map.status.success(), "nbdinfo: {}", text(&map));
        let dirty: u64 = String::from_utf8(map.stdout)
            .unwrap()
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .filter(|f| f[2] == "1")
            .map(|f| f[1].parse::<u64>().unwrap())
            .sum();
        assert_eq!(dirty, marked(CHANGES));
        assert!(ro.stop().0.success());

        let (changed, _) = incremental(&img, &backup, "nightly");
        assert_eq!(changed, marked(CHANGES), "{extra:?}");
        assert!(same_contents(&img, &backup), "{extra:?}: the incremental copy equals the image");

        // A new epoch: only what changes next is copied.
        ok(lightfoot(&["bitmap", "clear", s(&img), "nightly"]));
        let w = Served::start(&img, &args);
        let next = [("write -P 0x77", 5 * MIB + 3, 10)];
        qemu_io(&w.uri(), &next);
        assert!(w.stop().0.success());
        let (changed, _) = incremental(&img, &backup, "nightly");
        assert_eq!(changed, GRAIN);
        assert!(same_contents(&img, &backup), "{extra:?}: second epoch");
    }
}

/// A libnbd client that writes pseudo-random pieces for ever, saying "n" after each
/// acknowledged write, until the server goes.
const WRITER: &str = r#"
import nbd, os, random, sys
h = nbd.NBD()
h.connect_uri(os.environ["URI"])
size = h.get_size()
r = random.Random(int(os.environ["SEED"]))
n = 0
while True:
    off = r.randrange(0, size - 300000)
    ln = r.randrange(1, 300000)
    try:
        if n % 5 == 4:
            h.zero(ln, off)
        else:
            h.pwrite(bytes([r.randrange(256)]) * ln, off)
        if n % 7 == 6:
            h.flush()
    except nbd.Error:
        break
    n += 1
    print(n, flush=True)
"#;

/// Epochs: each incremental records in its destination the epoch it brought it up to; the
/// next is refused into a copy that is not the one its epoch applies to (an older backup),
/// before anything is written, and accepted into the right one, and again as a retry.
#[test]
fn an_incremental_into_the_wrong_base_is_refused() {
    let dir = scratch();
    let (img, backup) = image_and_backup(dir.path());
    ok(lightfoot(&["bitmap", "add", s(&img), "nightly"]));
    let epoch = || -> String { list(&img)["bitmaps"][0]["epoch"].as_str().unwrap().to_string() };
    let day = |changes: &[(&str, u64, u64)]| {
        let w = Served::start(&img, &["--dirty-bitmap", "nightly"]);
        qemu_io(&w.uri(), changes);
        assert!(w.stop().0.success());
    };
    day(&CHANGES[..2]);
    incremental(&img, &backup, "nightly");
    let first = epoch();
    ok(lightfoot(&["bitmap", "clear", s(&img), "nightly"]));
    // An older backup: the copy as of the first epoch, record and all.
    let old = dir.path().join("old.img");
    let cp =
        std::process::Command::new("cp").args(["--preserve=xattr", s(&backup), s(&old)]).status().unwrap();
    assert!(cp.success());
    day(&CHANGES[2..]);
    incremental(&img, &backup, "nightly");
    assert!(same_contents(&img, &backup));
    ok(lightfoot(&["bitmap", "clear", s(&img), "nightly"]));
    day(&[("write -P 0x77", 5 * MIB, 10)]);

    let before = std::fs::read(&old).unwrap();
    let ro = Served::start(&img, &["-r", "--dirty-bitmap", "nightly"]);
    let out = lightfoot(&["copy", "--bitmap", "nightly", &ro.uri(), s(&old)]);
    fails_with(&out, &["old.img", "not the copy bitmap 'nightly' started from", &first]);
    assert_eq!(std::fs::read(&old).unwrap(), before, "the wrong base is untouched");
    // The right one, twice (a retry of an epoch is its own base too).
    for _ in 0..2 {
        ok(lightfoot(&["copy", "--bitmap", "nightly", &ro.uri(), s(&backup)]));
        assert!(same_contents(&img, &backup));
    }
    assert!(ro.stop().0.success());
}

/// Kill -9 at several points (before any write, after some, with --coalesce holding some):
/// the restarted server counts every block changed, and the incremental copy still brings
/// the backup level with the image.
#[test]
fn kill_9_at_any_point_leaves_the_next_incremental_complete() {
    use std::io::BufRead;
    let dir = scratch();
    let (img, backup) = image_and_backup(dir.path());
    for (round, writes) in [0usize, 1, 40, 200].into_iter().enumerate() {
        for extra in [&[][..], &["--coalesce"][..]] {
            let mut args = vec!["--dirty-bitmap", "nightly"];
            args.extend_from_slice(extra);
            let w = Served::start(&img, &args);
            let mut writer = libnbd_command(120, WRITER, &w.uri())
                .env("SEED", (round * 2 + extra.len()).to_string())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            let mut lines = std::io::BufReader::new(writer.stdout.take().unwrap()).lines();
            for _ in 0..writes {
                lines.next().expect("the writer goes on").unwrap();
            }
            w.kill9();
            writer.wait().unwrap();
            // The killed server's socket file is left: the next one must not be taken for
            // listening before it does.
            std::fs::remove_file(img.with_extension("sock")).unwrap();
            assert!(list(&img)["in_use"].as_bool().unwrap(), "left in use");
            let (changed, warned) = incremental(&img, &backup, "nightly");
            assert_eq!(changed, SIZE, "round {round} {extra:?}: all counted changed");
            assert!(warned.contains("did not close it cleanly"), "{warned}");
            assert!(same_contents(&img, &backup), "round {round} {extra:?}");
            ok(lightfoot(&["bitmap", "clear", s(&img), "nightly"]));
        }
    }
}

/// Another program writes the image between two tracked servers: the next incremental
/// copies everything, and says why.
#[test]
fn an_untracked_writer_makes_the_bitmap_all_dirty() {
    use std::os::unix::fs::FileExt;
    let dir = scratch();
    let (img, backup) = image_and_backup(dir.path());
    let w = Served::start(&img, &["--dirty-bitmap", "nightly"]);
    qemu_io(&w.uri(), &CHANGES[..1]);
    assert!(w.stop().0.success());
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .write_all_at(b"behind its back", 7 * MIB)
        .unwrap();
    let l = list(&img);
    assert!(l["state"].as_str().unwrap().contains("image changed"), "{l}");
    let (changed, warned) = incremental(&img, &backup, "nightly");
    assert_eq!(changed, SIZE);
    assert!(warned.contains("the image changed since its last clean close"), "{warned}");
    assert!(same_contents(&img, &backup));
    // Without a change in between, the next tracked server starts clean.
    ok(lightfoot(&["bitmap", "clear", s(&img), "nightly"]));
    let w = Served::start(&img, &["--dirty-bitmap", "nightly"]);
    assert!(w.stop().0.success());
    assert_eq!(list(&img)["bitmaps"][0]["changed"], 0);
}

/// What a libnbd client negotiates and reads: both contexts listed and selected, one
/// chunk each per BLOCK_STATUS, one descriptor each with REQ_ONE, a bitmap alone selected.
const CONTEXTS: &str = r#"
import nbd, os
def listed(query):
    h = nbd.NBD()
    h.set_opt_mode(True)
    h.connect_uri(os.environ["URI"])
    names = []
    if query:
        h.add_meta_context(query)
    h.opt_list_meta_context(lambda n: names.append(n) or 0)
    h.opt_abort()
    return sorted(names)
print("all", listed(None))
print("qemu:", listed("qemu:"))
for want in (["base:allocation", "qemu:dirty-bitmap:nightly"], ["qemu:dirty-bitmap:nightly"]):
    h = nbd.NBD()
    for c in want:
        h.add_meta_context(c)
    h.connect_uri(os.environ["URI"])
    for flags in (0, nbd.CMD_FLAG_REQ_ONE):
        got = {}
        h.block_status(1 << 20, 0, lambda ctx, off, ents, err: got.setdefault(ctx, []).append(ents) or 0, flags)
        print("one" if flags else "all", sorted((c, len(e), len(e[0]) // 2, e[0][:2]) for c, e in got.items()))
"#;

#[test]
fn clients_select_and_read_each_context() {
    let dir = scratch();
    let (img, _) = image_and_backup(dir.path());
    let w = Served::start(&img, &["--dirty-bitmap", "nightly"]);
    qemu_io(&w.uri(), &[("write -P 1", 65536, 1)]);
    let out = libnbd(CONTEXTS, &w.uri());
    let got = ok(out);
    let want = [
        "all ['base:allocation', 'qemu:dirty-bitmap:nightly']",
        "qemu: ['qemu:dirty-bitmap:nightly']",
        // (context, chunks, descriptors, first descriptor): one chunk per context; the
        // first MiB is data, the bitmap's runs 64 KiB clean, 64 KiB changed, the rest clean.
        "all [('base:allocation', 1, 1, [1048576, 0]), ('qemu:dirty-bitmap:nightly', 1, 3, [65536, 0])]",
        "one [('base:allocation', 1, 1, [1048576, 0]), ('qemu:dirty-bitmap:nightly', 1, 1, [65536, 0])]",
        "all [('qemu:dirty-bitmap:nightly', 1, 3, [65536, 0])]",
        "one [('qemu:dirty-bitmap:nightly', 1, 1, [65536, 0])]",
    ];
    assert_eq!(got.lines().collect::<Vec<_>>(), want, "{got}");
    assert!(w.stop().0.success());
}

/// Differential backups: a disabled bitmap keeps an epoch, merge adds epochs together,
/// show prints the marked ranges, remove takes one away.
#[test]
fn bitmap_commands_keep_epochs_and_merge_them() {
    let dir = scratch();
    let (img, _) = image_and_backup(dir.path());
    ok(lightfoot(&["bitmap", "add", s(&img), "monday"]));
    let w = Served::start(&img, &["--dirty-bitmap", "monday"]);
    qemu_io(&w.uri(), &CHANGES[..2]);
    assert!(w.stop().0.success());
    ok(lightfoot(&["bitmap", "disable", s(&img), "monday"]));
    ok(lightfoot(&["bitmap", "add", s(&img), "tuesday", "--granularity", "4K"]));
    let w = Served::start(&img, &["--dirty-bitmap", "tuesday"]);
    qemu_io(&w.uri(), &CHANGES[4..]);
    assert!(w.stop().0.success());
    let l = list(&img);
    assert_eq!(l["bitmaps"][0]["changed"], marked(&CHANGES[..2]), "monday kept its epoch: {l}");
    assert_eq!(l["bitmaps"][1]["changed"], 8192, "tuesday at 4K: {l}");
    ok(lightfoot(&["bitmap", "merge", s(&img), "week", "monday", "tuesday"]));
    let shown = ok(lightfoot(&["bitmap", "show", s(&img), "week"]));
    let ranges: Vec<(u64, u64)> = shown
        .lines()
        .map(|l| {
            let (o, n) = l.split_once(' ').unwrap();
            (o.parse().unwrap(), n.parse().unwrap())
        })
        .collect();
    assert_eq!(ranges, [(0, 2 * GRAIN), (3_145_728 - GRAIN, 5 * GRAIN), (9_437_184, 8192)], "{shown}");
    let l = list(&img);
    assert_eq!(l["bitmaps"][2]["name"], "week");
    assert_eq!(l["bitmaps"][2]["enabled"], false, "added disabled: {l}");
    ok(lightfoot(&["bitmap", "remove", s(&img), "monday"]));
    let names: Vec<_> = list(&img)["bitmaps"].as_array().unwrap().iter().map(|b| b["name"].clone()).collect();
    assert_eq!(names, ["tuesday", "week"]);
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let dir = scratch();
    let (img, _) = image_and_backup(dir.path());
    let before = std::fs::read(&img).unwrap();
    let sidecar = dir.path().join("disk.img.bitmaps");

    // Read-only without a bitmap file; an unknown bitmap; two files for one export.
    let out = lightfoot(&["serve", "-r", "--dirty-bitmap", "x", "--unix", "/nonexistent/s", s(&img)]);
    fails_with(&out, &["disk.img.bitmaps", "no such file"]);
    let out = lightfoot(&["serve", "--dirty-bitmap", "a=f1", "--dirty-bitmap", "b=f2", s(&img)]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));

    // A bad name makes no file; a server that fails to start leaves the file clean.
    let out = lightfoot(&["bitmap", "add", s(&img), "a=b"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(!sidecar.exists(), "a refused add made the file");
    let out = lightfoot(&["serve", "--dirty-bitmap", "nightly", "--unix", "/nonexistent/s", s(&img)]);
    fails_with(&out, &["listen on /nonexistent/s"]);
    assert_eq!(list(&img)["state"], "clean", "a server that took no change leaves it clean");

    let w = Served::start(&img, &["--dirty-bitmap", "nightly"]);
    // While it writes through the file: a second tracked server (the same file or another),
    // a bitmap command.
    let sock2 = dir.path().join("two.sock");
    let out = lightfoot(&["serve", "--dirty-bitmap", "nightly", "--unix", s(&sock2), s(&img)]);
    fails_with(&out, &["another server tracks changes to this image"]);
    let elsewhere = format!("nightly={}", dir.path().join("elsewhere.bitmaps").display());
    let out = lightfoot(&["serve", "--dirty-bitmap", &elsewhere, "--unix", s(&sock2), s(&img)]);
    fails_with(&out, &["disk.img", "another server tracks changes to this image"]);
    fails_with(&lightfoot(&["bitmap", "clear", s(&img), "nightly"]), &["in use"]);
    let l = list(&img);
    assert!(l["state"].as_str().unwrap().contains("running server"), "{l}");
    // A client asking for a bitmap the server does not have is told which ones it has.
    let out = lightfoot(&["copy", "--bitmap", "weekly", &w.uri(), s(&dir.path().join("backup.img"))]);
    fails_with(&out, &["weekly", "qemu:dirty-bitmap:nightly"]);
    assert!(w.stop().0.success());

    let out = lightfoot(&["serve", "-r", "--dirty-bitmap", "weekly", "--unix", s(&sock2), s(&img)]);
    fails_with(&out, &["no bitmap named 'weekly' (it holds: nightly)"]);
    fails_with(&lightfoot(&["bitmap", "show", s(&img), "weekly"]), &["no bitmap named 'weekly'"]);
    fails_with(&lightfoot(&["bitmap", "add", s(&img), "nightly"]), &["exists already"]);
    let out = lightfoot(&["bitmap", "add", s(&img), "n", "--granularity", "3K"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("power of two"), "{}", text(&out));

    // A damaged file, and one for another size of image.
    let good = std::fs::read(&sidecar).unwrap();
    let mut bad = good.clone();
    bad[30] ^= 1;
    std::fs::write(&sidecar, &bad).unwrap();
    let out = lightfoot(&["serve", "--dirty-bitmap", "nightly", "--unix", s(&sock2), s(&img)]);
    fails_with(&out, &["disk.img.bitmaps", "checksum mismatch"]);
    fails_with(&lightfoot(&["bitmap", "list", s(&img)]), &["checksum mismatch"]);
    assert_eq!(std::fs::read(&sidecar).unwrap(), bad, "a damaged file is left for the user");
    std::fs::write(&sidecar, &good).unwrap();
    let other = dir.path().join("other.img");
    std::fs::File::create(&other).unwrap().set_len(SIZE * 2).unwrap();
    let arg = format!("nightly={}", sidecar.display());
    let out = lightfoot(&["serve", "--dirty-bitmap", &arg, "--unix", s(&sock2), s(&other)]);
    fails_with(&out, &["for an image of 16777216 bytes, this one has 33554432"]);
    assert_eq!(std::fs::read(&img).unwrap(), before, "the image is untouched");
    assert_eq!(std::fs::read(&sidecar).unwrap(), good);
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(!left.iter().any(|n| n.to_string_lossy().contains(".new.")), "no temporary file left: {left:?}");
}

/// An `s3://` block image: its bitmaps are the object `KEY/lightfoot.bitmaps`, beside its
/// blocks. Writes through the server (plain and `--coalesce`) are copied incrementally; a
/// server killed with -9 (restarted with --break-lease) or a writer keeping no bitmap makes
/// the next incremental a full one; `lightfoot bitmap` works on the object; what cannot be
/// tracked is refused.
#[test]
fn an_s3_block_image_keeps_its_bitmaps_beside_its_blocks() {
    use common::s3::{Gateway, S3Served, Seaweed};
    let w = Seaweed::start();
    w.bucket("disks");
    let dir = scratch();
    let d = dir.path();
    let (img, backup) = image_and_backup(d);
    let uri = "s3://disks/vm";
    let lf = |args: &[&str]| {
        let out = w.lightfoot(120, args);
        assert!(out.status.success(), "{args:?}: {}", text(&out));
        String::from_utf8(out.stdout).unwrap()
    };
    lf(&["copy", "--object-size=1M", s(&img), uri]);
    // A second backup, in the store: its epoch record is an object beside its blocks.
    let bk = "s3://disks/bk";
    lf(&["copy", "--object-size=256K", s(&img), bk]);
    let list =
        || -> serde_json::Value { serde_json::from_str(&lf(&["bitmap", "list", "--json", uri])).unwrap() };
    // The incremental from a read-only server into `backup` and `bk`: what it counted
    // changed; both equal the image after it.
    let incremental = || -> u64 {
        let ro = S3Served::start(&w, d, uri, &["-r", "--dirty-bitmap", "nightly"]);
        let out: serde_json::Value =
            serde_json::from_str(&lf(&["copy", "--json", "--bitmap", "nightly", &ro.uri(), s(&backup)]))
                .unwrap();
        lf(&["copy", "--bitmap", "nightly", &ro.uri(), bk]);
        ro.stop();
        let (now, bk_now) = (d.join("now.img"), d.join("bk.img"));
        lf(&["copy", uri, s(&now)]);
        lf(&["copy", bk, s(&bk_now)]);
        assert!(same_contents(&now, &backup), "the incremental copy equals the image");
        assert!(same_contents(&now, &bk_now), "the incremental copy in the store equals the image");
        out["changed"].as_u64().unwrap()
    };

    for extra in [&[][..], &["--coalesce"][..]] {
        let args = [&["--dirty-bitmap", "nightly"][..], extra].concat();
        let srv = S3Served::start(&w, d, uri, &args);
        qemu_io(&srv.uri(), CHANGES);
        srv.stop();
        let l = list();
        assert_eq!(l["state"], "clean", "{extra:?}: {l}");
        assert_eq!(l["file"], "s3://disks/vm/lightfoot.bitmaps", "{l}");
        assert_eq!(l["bitmaps"][0]["changed"], marked(CHANGES), "{extra:?}: {l}");
        assert_eq!(incremental(), marked(CHANGES), "{extra:?}");
        lf(&["bitmap", "clear", uri, "nightly"]);
        assert_eq!(list()["bitmaps"][0]["changed"], 0);
    }
    assert!(w.list("disks", "vm/").contains(&"vm/lightfoot.bitmaps".to_string()));

    // Killed after writing: the lease stays until it expires (broken here), the bitmaps
    // stay in use, and the next server counts everything changed.
    let srv = S3Served::start(&w, d, uri, &["--dirty-bitmap", "nightly", "--coalesce"]);
    qemu_io(&srv.uri(), &CHANGES[..2]);
    srv.kill9();
    // Its lease is live until it expires: its bitmaps count as held by a writer.
    let held = ["vm/lightfoot.bitmaps", "in use by a server writing through it"];
    fails_with(&w.lightfoot(60, &["bitmap", "show", uri, "nightly"]), &held);
    fails_with(&w.lightfoot(60, &["serve", "-r", "--dirty-bitmap", "nightly", uri]), &held);
    let srv = S3Served::start(&w, d, uri, &["--dirty-bitmap", "nightly", "--break-lease"]);
    qemu_io(&srv.uri(), &CHANGES[2..3]);
    let err = srv.stop();
    assert!(err.contains("did not close it cleanly"), "{err}");
    assert_eq!(incremental(), SIZE);
    lf(&["bitmap", "clear", uri, "nightly"]);

    // Another lightfoot writing without a bitmap changes the image's objects: seen.
    let srv = S3Served::start(&w, d, uri, &[]);
    qemu_io(&srv.uri(), &[("write -P 0x44", 7 * MIB, 100)]);
    srv.stop();
    assert!(list()["state"].as_str().unwrap().contains("image changed"), "{}", list());
    assert_eq!(incremental(), SIZE);

    // The store's backup records the epoch it was brought up to; one recorded with another
    // is refused before anything is written to it.
    let epoch = list()["bitmaps"][0]["epoch"].as_str().unwrap().to_string();
    let (code, record) = w.request("GET", "/disks/bk/lightfoot.epochs", b"").unwrap();
    assert_eq!((code, record), (200, format!(r#"{{"nightly":"{epoch}"}}"#)));
    let srv = S3Served::start(&w, d, uri, &["--dirty-bitmap", "nightly"]);
    qemu_io(&srv.uri(), &[("write -P 0x45", 3 * MIB, 100)]);
    srv.stop();
    w.request("PUT", "/disks/bk/lightfoot.epochs", br#"{"nightly":"0000000000000001"}"#).unwrap();
    let objects = w.list("disks", "bk/");
    let bk_before = d.join("bk-before.img");
    lf(&["copy", bk, s(&bk_before)]);
    let ro = S3Served::start(&w, d, uri, &["-r", "--dirty-bitmap", "nightly"]);
    let out = w.lightfoot(60, &["copy", "--bitmap", "nightly", &ro.uri(), bk]);
    ro.stop();
    fails_with(&out, &[bk, "not the copy bitmap 'nightly' started from", "0000000000000001"]);
    let bk_after = d.join("bk-after.img");
    lf(&["copy", bk, s(&bk_after)]);
    assert!(same_contents(&bk_before, &bk_after), "the wrong base is untouched");
    assert_eq!(w.list("disks", "bk/"), objects);

    // What cannot be tracked: refused, nothing made.
    let refused = |args: &[&str], words: &[&str]| fails_with(&w.lightfoot(60, args), words);
    let out = w.lightfoot(60, &["serve", "--dirty-bitmap", "n=/tmp/x.bitmaps", uri]);
    assert_eq!(out.status.code(), Some(2), "a usage error: {}", text(&out));
    assert!(
        text(&out).contains("beside its blocks (KEY/lightfoot.bitmaps), not in a FILE"),
        "{}",
        text(&out)
    );
    refused(&["serve", "--without-lease", "--dirty-bitmap", "n", uri], &["needs the image's lease"]);
    refused(&["bitmap", "list", "--bitmaps", "/tmp/x", uri], &["no --bitmaps"]);
    lf(&["copy", s(&img), "s3://disks/one"]);
    refused(&["serve", "-r", "--dirty-bitmap", "n", "s3://disks/one"], &["needs a block image"]);
    refused(&["bitmap", "add", "s3://disks/one", "n"], &["in one object"]);
    assert!(!w.list("disks", "one/").iter().any(|k| k.contains("bitmaps")));
    // A read-only server's bitmaps must exist.
    refused(
        &["serve", "-r", "--dirty-bitmap", "other", uri],
        &["no bitmap named 'other' (it holds: nightly)"],
    );
}

/// A block device: its bitmaps need a FILE; writes through the server are copied
/// incrementally into another block device holding the previous copy.
#[test]
fn a_block_device_is_tracked_and_copied_into_another() {
    if !root_or_skip("needs root for losetup") {
        return;
    }
    let dir = scratch();
    let d = dir.path();
    let (img, _) = image_and_backup(d);
    let (src, dst) = (Loop::new(SIZE), Loop::new(SIZE));
    // The device under a name in the scratch folder, so the server's socket is made there.
    let dev = d.join("disk");
    std::os::unix::fs::symlink(&src.dev, &dev).unwrap();
    ok(lightfoot(&["copy", s(&img), &src.dev]));
    ok(lightfoot(&["copy", &src.dev, &dst.dev]));
    let out = lightfoot(&["serve", "--dirty-bitmap", "nightly", s(&dev)]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("a block device's bitmaps need a FILE"), "{}", text(&out));

    let file = d.join("disk.bitmaps");
    let arg = format!("nightly={}", file.display());
    let w = Served::start(&dev, &["--dirty-bitmap", &arg]);
    qemu_io(&w.uri(), CHANGES);
    let (status, err) = w.stop();
    assert!(status.success(), "{err}");
    let l: serde_json::Value =
        serde_json::from_str(&ok(lightfoot(&["bitmap", "list", "--json", "--bitmaps", s(&file), s(&dev)])))
            .unwrap();
    assert_eq!(l["state"], "clean", "{l}");
    assert_eq!(l["bitmaps"][0]["changed"], marked(CHANGES), "{l}");
    assert_ne!(std::fs::read(&src.dev).unwrap(), std::fs::read(&dst.dev).unwrap());

    let ro = Served::start(&dev, &["-r", "--dirty-bitmap", &arg]);
    let out = lightfoot(&["copy", "--json", "--bitmap", "nightly", &ro.uri(), &dst.dev]);
    assert!(ro.stop().0.success());
    let json: serde_json::Value = serde_json::from_str(&ok(out)).unwrap();
    assert_eq!(json["changed"].as_u64(), Some(marked(CHANGES)), "{json}");
    assert!(std::fs::read(&src.dev).unwrap() == std::fs::read(&dst.dev).unwrap(), "the devices differ");
}
