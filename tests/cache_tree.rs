//! `lightfoot cache stat|evict -r`: directory trees end to end (docs/cache.md, "Directory
//! trees"). Every run is under `timeout 60`: a walk that opened the tree's FIFO would block
//! there for ever, and a loop followed round would never end.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;

/// A tree of every kind of entry the walk has a rule for, in a scratch directory:
///
/// ```text
/// tree/a               4 MiB, the first 1 MiB cached
/// tree/hard            a hard link to a: counted once
/// tree/sub/b           2 MiB, all cached
/// tree/sub/deep/c      1 MiB, nothing cached
/// tree/sparse          8 MiB of holes but 1 MiB of data at 4 MiB, that 1 MiB cached
/// tree/out          -> ../outside (1 MiB outside the tree, all cached)
/// tree/loop1        -> loop2, tree/loop2 -> loop1
/// tree/sub/up       -> .. (back to tree: a cycle when followed)
/// tree/fifo            a FIFO (never opened), tree/sock a listening Unix socket
/// tree/mnt/m           with `mount`, as root: 1 MiB on a tmpfs mounted on tree/mnt
/// ```
///
/// Not followed, not crossed: 4 files (15 MiB, 4 MiB cached), 1 duplicate, 4 symlinks, 2 not
/// regular files (and 1 mount point).
struct Tree {
    /// Unmounted before the scratch directory goes (fields drop in order).
    mount: Option<Mount>,
    _sock: std::os::unix::net::UnixListener,
    root: PathBuf,
    outside: PathBuf,
    _dir: tempfile::TempDir,
}

impl Tree {
    fn new(mount: bool) -> Tree {
        let dir = scratch();
        let root = dir.path().join("tree");
        std::fs::create_dir_all(root.join("sub/deep")).unwrap();
        let file = |rel: &str, size: u64, cached: u64| {
            let p = root.join(rel);
            random_file(&p, size);
            evict(&p);
            warm(&p, 0, cached);
        };
        file("a", 4 * MIB, MIB);
        file("sub/b", 2 * MIB, 2 * MIB);
        file("sub/deep/c", MIB, 0);
        let sparse = root.join("sparse");
        let f = std::fs::File::create(&sparse).unwrap();
        f.set_len(8 * MIB).unwrap();
        let mut data = vec![0u8; MIB as usize];
        lightfoot::testing::conformance::Rng::new(3).fill(&mut data);
        f.write_all_at(&data, 4 * MIB).unwrap();
        f.sync_all().unwrap();
        assert!(allocated(&sparse) < 2 * MIB, "the sparse file has no holes here");
        evict(&sparse);
        warm(&sparse, 4 * MIB, MIB);
        std::fs::hard_link(root.join("a"), root.join("hard")).unwrap();
        let outside = dir.path().join("outside");
        random_file(&outside, MIB);
        evict(&outside);
        warm(&outside, 0, MIB);
        let link = |target: &str, at: &str| std::os::unix::fs::symlink(target, root.join(at)).unwrap();
        link("../outside", "out");
        link("loop2", "loop1");
        link("loop1", "loop2");
        link("..", "sub/up");
        assert!(Command::new("mkfifo").arg(root.join("fifo")).status().unwrap().success());
        let sock = std::os::unix::net::UnixListener::bind(root.join("sock")).unwrap();
        let mount = mount.then(|| {
            let m = Mount::new(&root, "mnt", &["-t", "tmpfs", "-o", "size=4m", "tmpfs"]);
            random_file(&m.path.join("m"), MIB);
            m
        });
        Tree { mount, _sock: sock, root, outside, _dir: dir }
    }

    fn arg(&self) -> &str {
        self.root.to_str().unwrap()
    }

    /// The tree's own regular files, one name per inode.
    fn files(&self) -> Vec<PathBuf> {
        ["a", "sub/b", "sub/deep/c", "sparse"].iter().map(|f| self.root.join(f)).collect()
    }
}

/// Runs lightfoot under `timeout 60` (status 124: it hung).
fn walk(args: &[&str]) -> Output {
    let out = Command::new("timeout").args(["-k", "5", "60"]).arg(bin()).args(args).output().unwrap();
    assert_ne!(out.status.code(), Some(124), "lightfoot {args:?} hung: {}", text(&out));
    out
}

/// [`walk`] as user nobody (as root only).
fn walk_as_nobody(args: &[&str]) -> Output {
    let out = Command::new("timeout")
        .args(["-k", "5", "60", "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", bin()])
        .args(args)
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(124), "lightfoot {args:?} hung: {}", text(&out));
    out
}

/// The lines of a `--json -r` run, each parsed on its own: the rows by path relative to
/// `root`, and the total, which must be the last line and the only one.
fn json_lines(out: &Output, root: &Path) -> (BTreeMap<String, serde_json::Value>, serde_json::Value) {
    let stdout = String::from_utf8(out.stdout.clone()).unwrap();
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: a line is not JSON: {l}")))
        .collect();
    let (total, rows) = lines.split_last().unwrap_or_else(|| panic!("no output: {}", text(out)));
    let total =
        total.get("total").unwrap_or_else(|| panic!("the last line is not the total: {stdout}")).clone();
    let mut by_path = BTreeMap::new();
    for row in rows {
        assert!(row.get("total").is_none(), "a total before the end: {stdout}");
        let file = row["file"].as_str().unwrap_or_else(|| panic!("a row without a file: {row}"));
        let rel = Path::new(file).strip_prefix(root).unwrap_or(Path::new(file));
        assert!(by_path.insert(rel.display().to_string(), row.clone()).is_none(), "{file} twice: {stdout}");
    }
    (by_path, total)
}

/// `got` is `want` bytes cached but for the pages the host's background reclaim may take
/// from files that sit idle (it took 2 pages of a 1 MiB file once, more than
/// common::lost_few's 1 in 256): up to a sixteenth. Every wrong count this test looks for
/// (a file twice, a file missed, a symlink followed) is off by whole MiB.
#[track_caller]
fn about(got: &serde_json::Value, want: u64, what: &str) {
    let got = got.as_u64().unwrap_or_else(|| panic!("{what}: not a number: {got}"));
    assert!(got <= want && want - got <= want / 16, "{what}: {got} bytes cached, not {want}");
}

#[test]
fn stat_r_counts_each_file_once_and_follows_no_symlink() {
    // Without root, the rest of the test runs without the nested mount.
    let mounted = root_or_skip("the nested mount: needs root to mount a tmpfs");
    let t = Tree::new(mounted);
    let out = walk(&["cache", "stat", "-r", "--json", t.arg()]);
    assert!(out.status.success(), "{}", text(&out));
    let (rows, total) = json_lines(&out, &t.root);
    // a and hard are one file: whichever came first is its row.
    let a = if rows.contains_key("a") { "a" } else { "hard" };
    let names: Vec<&str> = rows.keys().map(String::as_str).collect();
    assert_eq!(names, {
        let mut n = vec![a, "sparse", "sub/b", "sub/deep/c"];
        n.sort();
        n
    });
    about(&rows[a]["cached_bytes"], MIB, "a");
    assert_eq!(rows[a]["len"], 4 * MIB);
    about(&rows["sub/b"]["cached_bytes"], 2 * MIB, "sub/b");
    assert_eq!(rows["sub/deep/c"]["cached_bytes"], 0);
    assert_eq!(rows["sparse"]["len"], 8 * MIB);
    about(&rows["sparse"]["cached_bytes"], MIB, "sparse");
    assert_eq!(rows["sparse"]["source"], "cachestat");

    assert_eq!(total["files"], 4, "{total}");
    assert_eq!(total["len"], 15 * MIB, "{total}");
    about(&total["cached_bytes"], 4 * MIB, "total");
    let sum: u64 = rows.values().map(|r| r["cached_bytes"].as_u64().unwrap()).sum();
    assert_eq!(total["cached_bytes"], sum, "the total is not the sum of the rows");
    assert_eq!((total["unknown"].clone(), total["errors"].clone()), (0.into(), 0.into()), "{total}");
    let skipped = &total["skipped"];
    assert_eq!(skipped["duplicates"], 1, "the hard link was counted twice: {total}");
    assert_eq!(skipped["symlinks"], 4, "{total}");
    assert_eq!(skipped["not_regular"], 2, "{total}");
    assert_eq!(skipped["mounts"], u64::from(mounted), "{total}");

    // The table: FILE last, a total row, then what the walk passed over.
    let out = walk(&["cache", "stat", "-r", t.arg()]);
    assert!(out.status.success(), "{}", text(&out));
    let table = String::from_utf8(out.stdout.clone()).unwrap();
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 1 + 4 + 2, "{table}");
    assert!(lines[0].ends_with("RECENT  FILE"), "{table}");
    let sparse = lines.iter().find(|l| l.ends_with("/tree/sparse")).unwrap_or_else(|| panic!("{table}"));
    // Its size, and a cached share (the figure itself is checked with a margin above: the
    // host's own paging may take a page between the two looks).
    assert!(sparse.contains("8.0 MiB") && sparse.contains("%)"), "{table}");
    assert!(lines[5].contains("15.0 MiB") && lines[5].ends_with("total: 4 files"), "{table}");
    let mut tail = "1 file reached again (hard link) counted once, 4 symlinks not followed, ".to_string();
    if mounted {
        tail += "1 mount point not crossed, ";
    }
    tail += "2 not regular files";
    assert_eq!(lines[6], tail, "{table}");

    // --summary: the total alone, in both forms.
    let out = walk(&["cache", "stat", "-r", "--summary", t.arg()]);
    let summary = String::from_utf8(out.stdout.clone()).unwrap();
    assert_eq!(summary.lines().collect::<Vec<_>>(), [lines[0], lines[5], lines[6]], "{summary}");
    let out = walk(&["cache", "stat", "-r", "--summary", "--json", t.arg()]);
    assert!(out.status.success(), "{}", text(&out));
    let (rows, again) = json_lines(&out, &t.root);
    assert!(rows.is_empty(), "--summary printed rows: {rows:?}");
    assert_eq!((again["files"].clone(), again["skipped"].clone()), (total["files"].clone(), skipped.clone()));
}

#[test]
fn stat_r_follows_symlinks_when_asked_and_reports_loops() {
    let t = Tree::new(false);
    let out = walk(&["cache", "stat", "-r", "-L", "--json", t.arg()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    let root = t.arg();
    for loop_link in ["loop1", "loop2"] {
        assert!(err.contains(&format!("{root}/{loop_link}: too many levels of symbolic links")), "{err}");
    }
    assert!(err.contains(&format!("{root}/sub/up: a symlink loop back to {root}")), "{err}");
    let (rows, total) = json_lines(&out, &t.root);
    about(&rows["out"]["cached_bytes"], MIB, "the file outside, through tree/out");
    assert!(rows["loop1"]["error"].is_string(), "{rows:?}");
    assert_eq!(total["files"], 5, "{total}");
    about(&total["cached_bytes"], 5 * MIB, "total");
    assert_eq!(total["errors"], 3, "{total}");
    assert_eq!(total["skipped"]["symlinks"], 0, "{total}");
    // Each file still once: a and hard, and a second way to everything through sub/up (refused).
    assert_eq!(total["skipped"]["duplicates"], 1, "{total}");
    // The alias du users know.
    let out = walk(&["cache", "stat", "-r", "--dereference", "--summary", "--json", t.arg()]);
    assert_eq!(json_lines(&out, &t.root).1["files"], 5);
}

#[test]
fn a_nested_mount_is_crossed_only_when_asked() {
    if !root_or_skip("needs root to mount a tmpfs") {
        return;
    }
    let t = Tree::new(true);
    assert!(t.mount.is_some());
    let (rows, total) = json_lines(&walk(&["cache", "stat", "-r", "--json", t.arg()]), &t.root);
    assert!(!rows.contains_key("mnt/m"), "crossed into the mount: {rows:?}");
    assert_eq!(total["skipped"]["mounts"], 1, "{total}");
    let out = walk(&["cache", "stat", "-r", "--cross-mounts", "--json", t.arg()]);
    assert!(out.status.success(), "{}", text(&out));
    let (rows, total) = json_lines(&out, &t.root);
    assert_eq!(rows["mnt/m"]["cached_bytes"], MIB, "tmpfs pages are all in the cache");
    assert_eq!((total["files"].clone(), total["skipped"]["mounts"].clone()), (5.into(), 0.into()), "{total}");
}

#[test]
fn without_r_a_directory_is_refused_with_a_hint() {
    let t = Tree::new(false);
    for cmd in ["stat", "evict"] {
        let out = walk(&["cache", cmd, t.arg()]);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        assert!(text(&out).contains(&format!("{}: a directory: walk it with -r", t.arg())), "{}", text(&out));
        // The walk's options mean nothing without -r: a usage error.
        for opt in ["-L", "--cross-mounts", "--summary"] {
            let out = walk(&["cache", cmd, opt, t.arg()]);
            assert_eq!(out.status.code(), Some(2), "{opt}: {}", text(&out));
        }
    }
    // A plain FILE's --json is still one array.
    let a = t.root.join("a");
    let out = walk(&["cache", "stat", "--json", a.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    about(&v[0]["cached_bytes"], MIB, "a");
}

/// A bare read leaves the tree's files cached (so the check below can fail); `evict -r` leaves
/// none of them cached, and not the file outside the tree that a symlink points to.
#[test]
fn evict_r_leaves_the_tree_uncached_and_follows_no_symlink() {
    let t = Tree::new(false);
    let read_all = || {
        for f in t.files() {
            let len = std::fs::metadata(&f).unwrap().len();
            warm(&f, 0, len);
            assert!(lost_few(cached(&f, 0, None), len), "a bare read left {} uncached", f.display());
        }
    };
    read_all();
    let out = walk(&["cache", "evict", "-r", "--json", t.arg()]);
    assert!(out.status.success(), "{}", text(&out));
    let (rows, total) = json_lines(&out, &t.root);
    assert_eq!(rows.len(), 4, "{rows:?}");
    for f in t.files() {
        assert_eq!(cached(&f, 0, None), 0, "{} still cached after evict -r", f.display());
    }
    about(&cached(&t.outside, 0, None).into(), MIB, "the file outside the tree (symlink followed?)");
    about(&total["cached_before"], 15 * MIB, "total before");
    assert_eq!(total["cached_after"], 0, "{total}");
    assert_eq!(total["files"], 4, "{total}");
    assert!(rows.values().all(|r| r["cached_after"] == 0), "{rows:?}");

    read_all();
    let out = walk(&["cache", "evict", "-r", t.arg()]);
    assert!(out.status.success(), "{}", text(&out));
    let t_out = text(&out);
    assert!(t_out.contains(&format!("{}/sub/b: 2.0 MiB → 0 B cached", t.arg())), "{t_out}");
    assert!(t_out.contains("total: 4 files, 15.0 MiB → 0 B cached"), "{t_out}");
    for f in t.files() {
        assert_eq!(cached(&f, 0, None), 0, "{} still cached after evict -r", f.display());
    }
}

/// As user nobody, who may read the tree but write only sub/b: cachestat answers EPERM for the
/// others, and their residency is unknown (never 0); an unreadable directory is an error that
/// names it, and the walk goes on.
#[test]
fn unknown_residency_is_never_zero_and_errors_do_not_stop_the_walk() {
    if !root_or_skip("needs root to switch to nobody") {
        return;
    }
    let t = Tree::new(false);
    std::os::unix::fs::chown(t.root.join("sub/b"), Some(65534), Some(65534)).unwrap();
    let out = walk_as_nobody(&["cache", "stat", "-r", "--json", t.arg()]);
    assert!(out.status.success(), "unknown residency is not a failure: {}", text(&out));
    let (rows, total) = json_lines(&out, &t.root);
    about(&rows["sub/b"]["cached_bytes"], 2 * MIB, "sub/b, nobody's own");
    for (name, row) in &rows {
        if name != "sub/b" {
            assert!(row["cached_bytes"].is_null() && row["unknown"].is_string(), "{name}: {row}");
        }
    }
    assert_eq!(total["unknown"], 3, "{total}");
    assert_eq!(total["unknown_len"], 13 * MIB, "{total}");
    assert_eq!(total["len"], 15 * MIB, "{total}");
    about(&total["cached_bytes"], 2 * MIB, "total of what nobody may see");

    let out = walk_as_nobody(&["cache", "stat", "-r", t.arg()]);
    let table = String::from_utf8(out.stdout.clone()).unwrap();
    let sparse = table.lines().find(|l| l.ends_with("/tree/sparse")).unwrap_or_else(|| panic!("{table}"));
    assert!(sparse.contains('?') && !sparse.contains("0 B"), "unknown shown as a figure: {table}");
    assert!(table.contains("total: 4 files (3 unknown: residency not visible to this user)"), "{table}");

    // A directory nobody may not read: named, the rest still evicted, exit 1.
    let private = t.root.join("sub/private");
    std::fs::create_dir(&private).unwrap();
    random_file(&private.join("p"), MIB);
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    warm(&t.root.join("a"), 0, 4 * MIB);
    let out = walk_as_nobody(&["cache", "evict", "-r", t.arg()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let said = text(&out);
    assert!(said.contains(&format!("walk {}: permission denied", private.display())), "{said}");
    assert!(said.contains(&format!("{}/sparse: evicted (residency not visible", t.arg())), "{said}");
    assert!(said.contains("1 error (above)"), "{said}");
    assert_eq!(cached(&t.root.join("a"), 0, None), 0, "the walk stopped at the error");
}

/// `evict -r --sync` writes dirty pages back first, through the read-only descriptors the
/// walk opens, so they can go too.
#[test]
fn evict_r_sync_writes_dirty_pages_back_first() {
    let dir = scratch();
    let f = dir.path().join("sub/dirty");
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    std::fs::write(&f, vec![7u8; 4 * MIB as usize]).unwrap();
    let root = dir.path().to_str().unwrap();
    let (rows, _) = json_lines(&walk(&["cache", "stat", "-r", "--json", root]), dir.path());
    let stat = &rows["sub/dirty"]["stat"];
    assert!(stat["dirty"].as_u64().unwrap() + stat["writeback"].as_u64().unwrap() > 0, "{stat}");
    let out = walk(&["cache", "evict", "-r", "--sync", root]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(cached(&f, 0, None), 0, "dirty pages left after evict -r --sync");
    assert_eq!(std::fs::read(&f).unwrap(), vec![7u8; 4 * MIB as usize]);
}
