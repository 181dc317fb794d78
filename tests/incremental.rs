//! `lightfoot copy --bitmap NAME`: incremental copies from a QEMU dirty bitmap exported by
//! `qemu-nbd -B NAME`, into the previous copy (a file, or a qcow2 overlay behind qemu-nbd).
//! The changes are made with `qemu-io` (data at odd offsets, `write -z`, `discard`, across the
//! bitmap's 64 KiB granularity); the result is compared byte for byte with the source, and
//! bad input must fail before the destination is touched.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;

const SIZE: u64 = 24 * MIB;

/// Changes after the bitmap starts: data at odd offsets (one across the 3 MiB data/hole edge
/// and 64 KiB blocks), zeroes over data and a discard of data, both unaligned, data into a hole.
const CHANGES: &[&str] = &[
    "write -P 0x5a 1000 70000",
    "write -P 0xa5 3145000 200001",
    "write -z 6300000 150000",
    "discard 12582912 1048576",
    "write -P 0x33 9437300 5000",
];

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", text(&out));
}

fn qemu_img(args: &[&str]) {
    run(tool("qemu-img", "qemu-utils").args(args));
}

/// `qemu-io` commands on a qcow2 image, in order.
fn qemu_io(img: &Path, cmds: &[&str]) {
    let mut c = tool("qemu-io", "qemu-utils");
    c.args(["-f", "qcow2"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    run(c.arg(img));
}

/// The captive read-only export of `img` with bitmap `bitmap`, as copy's endpoint words.
fn export<'a>(img: &'a Path, bitmap: &'a str) -> Vec<&'a str> {
    vec!["[", "qemu-nbd", "-r", "-f", "qcow2", "-B", bitmap, s(img), "]"]
}

fn copy(args: &[&str]) -> std::process::Output {
    let mut all = vec!["copy"];
    let (opts, eps): (Vec<&str>, Vec<&str>) = args.iter().partition(|a| a.starts_with("--"));
    all.extend(opts);
    all.push("--");
    all.extend(eps);
    lightfoot(&all)
}

/// Bytes `nbdinfo --map` says the bitmap marks dirty (libnbd's reading, not ours).
fn dirty_bytes(img: &Path, bitmap: &str) -> u64 {
    dirty_extents(img, bitmap).iter().map(|e| e.1).sum()
}

/// The (offset, length) extents `nbdinfo --map` says the bitmap marks dirty.
fn dirty_extents(img: &Path, bitmap: &str) -> Vec<(u64, u64)> {
    let map = format!("--map=qemu:dirty-bitmap:{bitmap}");
    let out = tool("nbdinfo", "libnbd-bin")
        .args([&map, "--", "[", "qemu-nbd", "-r", "-f", "qcow2", "-B", bitmap, s(img), "]"])
        .output()
        .unwrap();
    assert!(out.status.success(), "nbdinfo: {}", text(&out));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (off, len) = (f.first()?.parse::<u64>().ok()?, f.get(1)?.parse::<u64>().ok()?);
            let ty = f.get(2)?.parse::<u32>().ok()?;
            (ty & 1 != 0).then_some((off, len))
        })
        .collect()
}

/// A sample (data and holes, `common::sample`) in `dir`, raw and as a qcow2: (raw, qcow2).
fn qcow2_source(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let raw = dir.join("sample.raw");
    sample(&raw, SIZE, 3 * MIB);
    let src = dir.join("src.qcow2");
    qemu_img(&["convert", "-q", "-f", "raw", "-O", "qcow2", s(&raw), s(&src)]);
    (raw, src)
}

/// A qcow2 source with data and holes, its first full copy as a raw file, then a bitmap
/// `b0` started and changes made through it. Returns (source, full copy).
fn source_and_full_copy(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let (_, src) = qcow2_source(dir);
    let full = dir.join("full.raw");
    let mut eps = vec!["[", "qemu-nbd", "-r", "-f", "qcow2", s(&src), "]"];
    eps.push(s(&full));
    ok(copy(&eps));
    qemu_img(&["bitmap", "--add", "--enable", s(&src), "b0"]);
    qemu_io(&src, &[CHANGES, &["write -P 0x44 25160824 5000"]].concat());
    (src, full)
}

#[test]
fn an_incremental_copy_into_a_file_reproduces_the_source() {
    let dir = scratch();
    let (src, full) = source_and_full_copy(dir.path());
    // A canary in the copy where nothing changed: an incremental copy must leave it (a full
    // one would overwrite it).
    let canary_at = 18 * MIB;
    let mut copy_bytes = std::fs::read(&full).unwrap();
    copy_bytes[canary_at as usize..canary_at as usize + 4096].fill(0xee);
    std::fs::write(&full, &copy_bytes).unwrap();
    evict(&full);

    let mut args = vec!["--bitmap=b0", "--json"];
    args.extend(export(&src, "b0"));
    args.push(s(&full));
    let out = copy(&args);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(cached(&full, 0, None), 0, "the copy left the destination cached");
    let json: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out)));
    let want = dirty_bytes(&src, "b0");
    assert!(want > 0 && want < SIZE / 4, "dirty {want}");
    assert_eq!(json["changed"].as_u64(), Some(want), "{json}");
    assert_eq!(json["bytes"].as_u64(), Some(want), "{json}");
    assert_eq!(json["bitmap"].as_str(), Some("b0"), "{json}");

    let reference = dir.path().join("ref.raw");
    qemu_img(&["convert", "-q", "-f", "qcow2", "-O", "raw", s(&src), s(&reference)]);
    let mut got = std::fs::read(&full).unwrap();
    let canary = canary_at as usize..canary_at as usize + 4096;
    assert!(got[canary.clone()].iter().all(|&b| b == 0xee), "the unchanged canary was overwritten");
    let want_bytes = std::fs::read(&reference).unwrap();
    got[canary.clone()].copy_from_slice(&want_bytes[canary]);
    assert!(got == want_bytes, "the incremental copy differs from the source");
}

#[test]
fn an_incremental_copy_into_a_qcow2_overlay_makes_a_chain() {
    let dir = scratch();
    let d = dir.path();
    let (_, src) = qcow2_source(d);
    // The full backup: a qcow2 of its own, through a captive qemu-nbd on each side.
    let base = d.join("full.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&base), &SIZE.to_string()]);
    ok(copy(&[
        "[",
        "qemu-nbd",
        "-r",
        "-f",
        "qcow2",
        s(&src),
        "]",
        "[",
        "qemu-nbd",
        "-f",
        "qcow2",
        s(&base),
        "]",
    ]));
    qemu_img(&["bitmap", "--add", "--enable", s(&src), "b0"]);
    qemu_io(&src, &["write -P 0x77 5000000 300000", "write -z 1048576 65536", "discard 20971520 2097152"]);
    // The incremental: an overlay on the full backup, written through qemu-nbd.
    let inc = d.join("inc1.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", "-b", s(&base), "-F", "qcow2", s(&inc)]);
    let mut args = vec!["--bitmap=b0"];
    args.extend(export(&src, "b0"));
    args.extend(["[", "qemu-nbd", "-f", "qcow2", s(&inc), "]"]);
    ok(copy(&args));
    run(tool("qemu-img", "qemu-utils").args(["compare", "-q", s(&src), s(&inc)]));
    // The overlay holds the changed clusters only, not a second full copy.
    let top = qemu_img_map_allocated(&inc);
    let changed = dirty_bytes(&src, "b0");
    assert!(top <= changed + MIB, "the overlay holds {top} bytes for {changed} changed");
}

/// Bytes a qcow2 overlay's own layer describes (`qemu-img map`: entries at depth 0, data or
/// zero clusters; what it leaves to its backing file shows at depth 1).
fn qemu_img_map_allocated(img: &Path) -> u64 {
    let out = tool("qemu-img", "qemu-utils").args(["map", "--output=json", s(img)]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let map: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    map.as_array()
        .unwrap()
        .iter()
        .filter(|e| e["depth"] == 0 && e["present"] != false)
        .map(|e| e["length"].as_u64().unwrap())
        .sum()
}

#[test]
fn bad_incremental_copies_leave_the_destination_alone() {
    let dir = scratch();
    let d = dir.path();
    let (src, full) = source_and_full_copy(d);
    let before = std::fs::read(&full).unwrap();
    let with = |bitmap: &str, dst: &str| {
        let flag = format!("--bitmap={bitmap}");
        let mut args = vec![flag.as_str()];
        args.extend(export(&src, "b0"));
        args.push(dst);
        copy(&args)
    };
    // No previous copy: nothing is created.
    let missing = d.join("missing.raw");
    fails_with(&with("b0", s(&missing)), &["missing.raw", "must exist"]);
    assert!(!missing.exists());
    // A copy of another size.
    let other = d.join("other.raw");
    std::fs::write(&other, vec![7u8; (SIZE + MIB) as usize]).unwrap();
    fails_with(&with("b0", s(&other)), &["other.raw", "not a copy"]);
    assert!(std::fs::read(&other).unwrap().iter().all(|&b| b == 7));
    // A bitmap the server does not have: the contexts it offers are listed.
    fails_with(
        &with("nope", s(&full)),
        &["qemu:dirty-bitmap:nope", "'qemu:dirty-bitmap:b0'", "'base:allocation'"],
    );
    // Standard output cannot hold a previous copy.
    fails_with(&with("b0", "-"), &["standard output"]);
    assert!(std::fs::read(&full).unwrap() == before, "a failed incremental copy changed the destination");

    // A server without dirty bitmaps (lightfoot's: base:allocation only), and one without
    // meta contexts at all (nbdkit without structured replies).
    let raw = d.join("plain.raw");
    sample(&raw, SIZE, MIB);
    let plain = lightfoot_args(&["--bitmap", "b0", "--", "[", bin(), "serve", "-r", s(&raw), "]", s(&full)]);
    fails_with(&plain, &["qemu:dirty-bitmap:b0", "'base:allocation'"]);
    need("nbdkit", "nbdkit");
    let no_sr =
        lightfoot_args(&["--bitmap", "b0", "--", "[", "nbdkit", "--no-sr", "file", s(&raw), "]", s(&full)]);
    fails_with(&no_sr, &["no meta contexts"]);
    // A source that is not NBD.
    fails_with(&lightfoot_args(&["--bitmap", "b0", s(&raw), s(&full)]), &["needs an NBD source"]);
    assert!(std::fs::read(&full).unwrap() == before, "a failed incremental copy changed the destination");
}

fn lightfoot_args(args: &[&str]) -> std::process::Output {
    let mut all = vec!["copy"];
    all.extend_from_slice(args);
    lightfoot(&all)
}

/// Into an `s3://` block image (256 KiB objects, its geometry read from its manifest): only
/// objects holding changed bytes are touched, each with one PUT or a delete, after a GET only
/// where the changes cover it in part; the image then reads back as the source.
#[test]
fn an_incremental_copy_into_an_s3_block_image_touches_changed_objects_only() {
    use common::s3::{Gateway, Seaweed};
    const OBJECT: u64 = 256 << 10;
    let w = Seaweed::start();
    w.bucket("backups");
    let dir = scratch();
    let d = dir.path();
    let (raw, src) = qcow2_source(d);
    let lf = |args: &[&str]| {
        let out = w.lightfoot(300, args);
        assert!(out.status.success(), "{}", text(&out));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let full =
        ["copy", "--json", "--object-size=256K", "--", "[", "qemu-nbd", "-r", "-f", "qcow2", s(&src), "]"];
    lf(&[&full[..], &["s3://backups/vm"]].concat());
    qemu_img(&["bitmap", "--add", "--enable", s(&src), "b0"]);
    qemu_io(
        &src,
        &[
            CHANGES,
            &[
                // Two changes in one object: data then zeroes (into a hole), and two pieces apart
                // (in data): each object must still be written once.
                "write -P 0x10 4194304 65536",
                "write -z 4259840 65536",
                "write -P 0x11 13631488 4096",
                "write -P 0x12 13836288 4096",
            ],
        ]
        .concat(),
    );
    // A bitmap that recorded nothing: what opening and closing the image costs.
    qemu_img(&["bitmap", "--add", s(&src), "nothing"]);
    let objects =
        |prefix: &str| w.list("backups", prefix).into_iter().collect::<std::collections::BTreeSet<_>>();
    let before = objects("vm/0");
    let incremental = |bitmap: &str| {
        let flag = format!("--bitmap={bitmap}");
        let args =
            ["copy", "--json", &flag, "--", "[", "qemu-nbd", "-r", "-f", "qcow2", "-B", bitmap, s(&src), "]"];
        lf(&[&args[..], &["s3://backups/vm"]].concat())
    };
    let idle = incremental("nothing");
    assert_eq!(idle["changed"].as_u64(), Some(0), "{idle}");
    let json = incremental("b0");
    let after = objects("vm/0");

    let key = |b: u64| format!("vm/{b:016x}");
    let mut cover = std::collections::BTreeMap::new();
    for (off, len) in dirty_extents(&src, "b0") {
        for b in off / OBJECT..(off + len).div_ceil(OBJECT) {
            *cover.entry(b).or_insert(0) += (off + len).min((b + 1) * OBJECT) - off.max(b * OBJECT);
        }
    }
    let partly = cover.values().filter(|&&c| c < OBJECT).count() as u64;
    let req = |j: &serde_json::Value, k: &str| j["destination"]["requests"][k].as_u64().unwrap();
    let puts = req(&json, "put") - req(&idle, "put");
    let gets = req(&json, "get") - req(&idle, "get");
    let deleted =
        cover.keys().filter(|&&b| before.contains(&key(b)) && !after.contains(&key(b))).count() as u64;
    // An object that did not exist (reads as zeroes) and ends up all zeroes needs no request.
    let absent =
        cover.keys().filter(|&&b| !before.contains(&key(b)) && !after.contains(&key(b))).count() as u64;
    assert_eq!(
        puts + deleted + absent,
        cover.len() as u64,
        "PUTs {puts} + deleted {deleted} + left absent {absent} for {} objects touched",
        cover.len()
    );
    assert!(puts > 0 && deleted > 0, "PUTs {puts}, deleted {deleted}");
    assert!(gets <= partly, "{gets} GETs for {partly} objects covered in part");
    // Objects the changes did not touch are all still there; no others appeared.
    let untouched = |set: &std::collections::BTreeSet<String>| {
        set.iter().filter(|k| !cover.keys().any(|&b| **k == key(b))).cloned().collect::<Vec<_>>()
    };
    assert_eq!(untouched(&before), untouched(&after));

    let reference = d.join("ref.raw");
    qemu_img(&["convert", "-q", "-f", "qcow2", "-O", "raw", s(&src), s(&reference)]);
    let back = d.join("back.raw");
    lf(&["copy", "--json", "s3://backups/vm", s(&back)]);
    assert!(same_contents(&reference, &back), "the image differs from the source after the incremental");

    // An image of one object cannot be changed in place: refused, left as it was.
    lf(&["copy", "--json", s(&raw), "s3://backups/one"]);
    let args = [
        "copy",
        "--bitmap=b0",
        "--",
        "[",
        "qemu-nbd",
        "-r",
        "-f",
        "qcow2",
        "-B",
        "b0",
        s(&src),
        "]",
        "s3://backups/one",
    ];
    let out = w.lightfoot(300, &args);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("in one object is served read-only"), "{}", text(&out));
    let again = d.join("one.raw");
    lf(&["copy", "--json", "s3://backups/one", s(&again)]);
    assert!(same_contents(&raw, &again));
}

const PAGE: &str = include_str!("../docs/incremental.md");

/// Runs `script` through `sh` in `dir`, with the lightfoot under test first on PATH and the
/// page's `/run/` in `dir`. `script` must be in docs/incremental.md as written (the test
/// fails otherwise, so the page cannot drift from what was run).
fn recipe(dir: &Path, script: &str) {
    assert!(PAGE.contains(script), "docs/incremental.md no longer has what the test runs:\n{script}");
    let bin_dir = dir.join(".bin");
    if !bin_dir.exists() {
        std::fs::create_dir(&bin_dir).unwrap();
        std::os::unix::fs::symlink(bin(), bin_dir.join("lightfoot")).unwrap();
    }
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    let script = script.replace("/run/", &format!("{}/", dir.display()));
    run(Command::new("sh").args(["-ec", &script]).current_dir(dir).env("PATH", path));
}

/// The page's cycle with qemu-nbd, its overlay chain with a restore, and its differential,
/// as written; each result compared with the disk.
#[test]
fn the_recipes_of_incremental_md_run_as_written() {
    let dir = scratch();
    let d = dir.path();
    qemu_img(&["create", "-q", "-f", "qcow2", s(&d.join("disk.qcow2")), "20G"]);
    qemu_io(&d.join("disk.qcow2"), &["write -P 0x11 0 3M", "write -P 0x22 19G 1M"]);
    recipe(
        d,
        "qemu-img bitmap --add --enable disk.qcow2 since-0
lightfoot copy -- [ qemu-nbd -r -f qcow2 disk.qcow2 ] backup.raw",
    );
    recipe(
        d,
        "qemu-img create -f qcow2 full.qcow2 20G
lightfoot copy -- [ qemu-nbd -r -f qcow2 disk.qcow2 ] [ qemu-nbd -f qcow2 full.qcow2 ]",
    );
    qemu_io(&d.join("disk.qcow2"), CHANGES);
    recipe(
        d,
        "qemu-img create -f qcow2 -b full.qcow2 -F qcow2 inc1.qcow2
lightfoot copy --bitmap since-0 -- [ qemu-nbd -r -f qcow2 -B since-0 disk.qcow2 ] [ qemu-nbd -f qcow2 inc1.qcow2 ]",
    );
    qemu_img(&["compare", "-q", s(&d.join("disk.qcow2")), s(&d.join("inc1.qcow2"))]);
    recipe(d, "lightfoot copy -- [ qemu-nbd -r -f qcow2 inc1.qcow2 ] restored.raw");
    qemu_img(&["compare", "-q", s(&d.join("disk.qcow2")), s(&d.join("restored.raw"))]);
    // Day 1 of the cycle (since-0 is dropped in it: the overlay above read it first).
    // (std::fs::copy would write the 20 GiB of holes out as zeroes.)
    run(Command::new("cp").args(["--sparse=always", "backup.raw", "full-copy.raw"]).current_dir(d));
    recipe(
        d,
        "qemu-img bitmap --add --enable disk.qcow2 since-1
qemu-img bitmap --disable disk.qcow2 since-0
lightfoot copy --bitmap since-0 -- [ qemu-nbd -r -f qcow2 -B since-0 disk.qcow2 ] backup.raw",
    );
    qemu_img(&["compare", "-q", s(&d.join("disk.qcow2")), s(&d.join("backup.raw"))]);
    // A differential over the two epochs, into a copy of the day-0 backup.
    qemu_io(&d.join("disk.qcow2"), &["write -P 0x66 5G 64K"]);
    recipe(
        d,
        "qemu-img bitmap --add disk.qcow2 diff
qemu-img bitmap --merge since-0 disk.qcow2 diff
qemu-img bitmap --merge since-1 disk.qcow2 diff
lightfoot copy --bitmap diff -- [ qemu-nbd -r -f qcow2 -B diff disk.qcow2 ] full-copy.raw",
    );
    qemu_img(&["compare", "-q", s(&d.join("disk.qcow2")), s(&d.join("full-copy.raw"))]);
    recipe(d, "qemu-img bitmap --remove disk.qcow2 since-0");
}

/// The page's cycle with lightfoot's own server keeping the bitmap, as written.
#[test]
fn the_lightfoot_server_recipe_of_incremental_md_runs_as_written() {
    let dir = scratch();
    let d = dir.path();
    sample(&d.join("disk.img"), SIZE, 3 * MIB);
    recipe(
        d,
        "lightfoot copy disk.img backup.img                       # day 0: the full backup
lightfoot bitmap add disk.img nightly                    # changes from now on",
    );
    let line = "lightfoot serve --unix /run/vm1.sock --dirty-bitmap nightly disk.img    # while the VM runs";
    assert!(PAGE.contains(line));
    let vm = Served::start(&d.join("disk.img"), &["--dirty-bitmap", "nightly"]);
    let mut c = tool("qemu-io", "qemu-utils");
    c.args(["-f", "raw"]);
    for cmd in CHANGES {
        c.args(["-c", cmd]);
    }
    run(c.arg(vm.uri()));
    assert!(vm.stop().0.success());
    assert!(!same_contents(&d.join("disk.img"), &d.join("backup.img")));
    recipe(
        d,
        "lightfoot serve -r --unix /run/vm1-ro.sock --dirty-bitmap nightly disk.img \\
    --run 'lightfoot copy --bitmap nightly \"$uri\" backup.img'           # after it stopped
lightfoot bitmap clear disk.img nightly                  # the next epoch",
    );
    assert!(same_contents(&d.join("disk.img"), &d.join("backup.img")));
}
