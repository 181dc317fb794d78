//! A Linux guest under QEMU on lightfoot's exports, the client lightfoot exists for: its
//! kernel's ext4 and readahead behind QEMU's NBD driver, with the guest's own FLUSHes and TRIMs
//! (scripts/guest/: build.sh makes the guest, boot.sh boots it with pinned drive options, the
//! jobs are shell scripts in it). The file systems are made and checked on the host
//! (`mkfs.ext4 -d`, `e2fsck`, `debugfs`): busybox has neither.
//!
//! Guests run one at a time (TCG takes a core each) and each boot costs a few seconds of
//! emulated kernel, so the tests are few and each checks much.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Mutex;
use std::time::Duration;

use common::s3::{Gateway, S3Served, Seaweed};
use common::*;

/// One guest at a time in this binary: two emulated CPUs on two cores would starve the servers.
static ONE_GUEST: Mutex<()> = Mutex::new(());

fn guest_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/guest")
}

/// Whether a guest can be booted here: QEMU and busybox present (`make test` installs them,
/// so as root their absence fails the test), and the guest built (its kernel fetched once).
fn can_boot() -> bool {
    if !tool_or_skip("qemu-system-x86_64", "qemu-system-x86") || !tool_or_skip("cpio", "cpio") {
        return false;
    }
    let busybox = Command::new("dpkg-query").args(["-W", "-f", "${Status}", "busybox-static"]).output();
    if !busybox.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("ok installed")) {
        assert!(euid() != 0, "busybox-static is missing: as root `make test` installs it");
        skip("needs a static busybox for the guest (Debian package busybox-static)");
        return false;
    }
    let out = Command::new(guest_dir().join("build.sh")).output().expect("run scripts/guest/build.sh");
    assert!(out.status.success(), "scripts/guest/build.sh: {}", text(&out));
    true
}

/// This test's turn to boot a guest (held until the guard drops), or `None` when no guest can
/// boot here (skipped).
fn guest_turn() -> Option<std::sync::MutexGuard<'static, ()>> {
    let turn = ONE_GUEST.lock().unwrap_or_else(|e| e.into_inner());
    can_boot().then_some(turn)
}

/// [`tree`] in `dir`/tree, and an ext4 image of it, `dir`/fs.img.
fn tree_image(dir: &Path) -> (PathBuf, PathBuf) {
    let (root, img) = (dir.join("tree"), dir.join("fs.img"));
    tree(&root);
    ext4(&img, "96M", Some(&root));
    (root, img)
}

/// A booted guest: QEMU itself (boot.sh execs it), its console going to `log`.
struct Guest {
    child: Child,
    log: PathBuf,
}

impl Guest {
    /// Boots the guest running `job` with `arg` on these NBD sockets (the first is /dev/vda).
    fn boot(dir: &Path, job: &str, arg: &str, disks: &[&Path], env: &[(&str, &str)]) -> Guest {
        let log = dir.join(format!("guest-{job}.log"));
        let console = std::fs::File::create(&log).unwrap();
        // QEMU's own messages (stderr) land in the same file, after the console so far.
        let child = Command::new(guest_dir().join("boot.sh"))
            .arg(job)
            .arg(arg)
            .args(disks)
            .envs(env.iter().copied())
            .stdout(console.try_clone().unwrap())
            .stderr(console)
            .spawn()
            .expect("run scripts/guest/boot.sh");
        Guest { child, log }
    }

    fn console(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the console has a line starting with `prefix`.
    fn has_line(&self, prefix: &str) -> bool {
        self.console().lines().any(|l| l.starts_with(prefix))
    }

    /// Waits until the console shows a line starting with `prefix`; fails the test (with the
    /// console) if the guest ends first or `secs` pass.
    fn wait_line(&mut self, prefix: &str, secs: u64) {
        let mut ended = false;
        within(secs, || {
            ended = !matches!(self.child.try_wait(), Ok(None));
            ended || self.has_line(prefix)
        });
        let why = if ended { "the guest ended" } else { "timed out" };
        assert!(self.has_line(prefix), "no console line {prefix:?} ({why}):\n{}", self.console());
    }

    /// Waits for the guest to power off (within `secs`) and asserts its job succeeded;
    /// the console.
    fn finish(mut self, job: &str, secs: u64) -> String {
        let ended = within(secs, || !matches!(self.child.try_wait(), Ok(None)));
        if !ended {
            let _ = self.child.kill();
        }
        let status = self.child.wait().unwrap();
        let console = self.console();
        assert!(ended, "the guest did not power off within {secs} s:\n{console}");
        assert!(status.success(), "qemu: {status}:\n{console}");
        assert!(self.has_line(&format!("lf: end {job} rc=0 ")), "job {job} failed:\n{console}");
        console
    }

    /// SIGKILL: the guest stops between two instructions, as a host crash would stop it.
    fn kill(mut self) -> String {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        self.console()
    }
}

/// A tree of files made from a seed: nested directories, sizes from empty to 8 MiB (a few
/// large, most small, as a root file system has them), one name with a space. About 40 MiB.
fn tree(root: &Path) {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for i in 0..240u64 {
        let dir = root.join(format!("d{}/e{}", i % 7, i % 3));
        std::fs::create_dir_all(&dir).unwrap();
        let size = match i {
            0 => 0,
            _ if i % 60 == 1 => 8 << 20,
            _ => next() % (1 << (8 + next() % 10)),
        };
        let mut data = vec![0u8; size as usize];
        for chunk in data.chunks_mut(8) {
            let v = next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
        let name = if i == 5 { "a name with spaces".to_string() } else { format!("f{i}") };
        std::fs::write(dir.join(name), data).unwrap();
    }
}

/// `HASH  ./PATH` per file of `root`, by path.
fn host_sums(root: &Path) -> BTreeMap<String, String> {
    let out = Command::new("sh")
        .arg("-c")
        .arg("find . -type f -print0 | sort -z | xargs -0 sha256sum")
        .current_dir(root)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    sums(&String::from_utf8(out.stdout).unwrap(), "")
}

/// The `HASH  PATH` lines of `text` after `prefix`, as PATH -> HASH.
fn sums(text: &str, prefix: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.trim_end_matches('\r').strip_prefix(prefix))
        .filter_map(|l| l.split_once("  "))
        .map(|(hash, path)| (path.to_string(), hash.to_string()))
        .collect()
}

/// An ext4 image of `size` holding `root` (or empty), made by the host's mkfs.
fn ext4(img: &Path, size: &str, root: Option<&Path>) {
    let mut cmd = Command::new("mkfs.ext4");
    cmd.args(["-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0"]);
    if let Some(root) = root {
        cmd.arg("-d").arg(root);
    }
    let out = cmd.arg(img).arg(size).output().unwrap();
    assert!(out.status.success(), "mkfs.ext4: {}", text(&out));
}

/// Replays the journal (`e2fsck -fy`), then checks again read-only: the second pass must find
/// nothing to fix.
fn assert_fsck_clean(img: &Path, what: &str) {
    let replay = Command::new("e2fsck").args(["-fy"]).arg(img).output().unwrap();
    assert!(replay.status.code().is_some_and(|c| c <= 1), "{what}: e2fsck -fy: {}", text(&replay));
    let check = Command::new("e2fsck").args(["-fn"]).arg(img).output().unwrap();
    assert!(check.status.success(), "{what}: e2fsck -fn after the replay: {}", text(&check));
}

/// The SHA-256 of `path` inside the ext4 image `img`, read by debugfs.
fn sum_in_image(img: &Path, path: &str, scratch: &Path) -> String {
    let out_file = scratch.join("dumped");
    let _ = std::fs::remove_file(&out_file);
    let dump = Command::new("debugfs")
        .arg("-R")
        .arg(format!("dump /{path} {}", out_file.display()))
        .arg(img)
        .output()
        .unwrap();
    assert!(out_file.exists(), "debugfs dump /{path}: {}", text(&dump));
    let out = Command::new("sha256sum").arg(&out_file).output().unwrap();
    String::from_utf8(out.stdout).unwrap().split_whitespace().next().unwrap().to_string()
}

/// A guest mounts a file system served by plain `serve`, reads every file and its checksums
/// match the host's; the server leaves the image uncached.
#[test]
fn guest_reads_every_file_as_written() {
    let Some(_one) = guest_turn() else { return };
    let dir = scratch();
    let (root, img) = tree_image(dir.path());
    evict(&img);
    let server = Served::start(&img, &[]);
    let console = Guest::boot(dir.path(), "check", "", &[&server.sock], &[]).finish("check", 180);
    let (status, err) = server.stop();
    assert!(status.success(), "serve: {status}: {err}");
    let want = host_sums(&root);
    let got = sums(&console, "lf: sum ");
    assert_eq!(got.len(), want.len(), "files seen by the guest:\n{console}");
    assert_eq!(got, want, "checksums differ");
    let left = cached(&img, 0, None);
    assert!(left <= 8 * MIB, "the server left {} KiB of the image cached", left >> 10);
}

/// A guest writes files (and TRIMs a deleted one) on three disks at once, through plain
/// `serve`, `serve --coalesce` and an `s3://` block image, `sync`s, and is killed while it
/// goes on writing, and the servers are killed after it: on each, the host's fsck is clean
/// after the journal replay and every synced file has the contents the guest checksummed.
#[test]
fn synced_guest_writes_survive_a_kill() {
    let Some(_one) = guest_turn() else { return };
    let dir = scratch();
    let plain = dir.path().join("plain.img");
    let coalesce = dir.path().join("coalesce.img");
    let s3 = dir.path().join("s3.img");
    for img in [&plain, &coalesce, &s3] {
        ext4(img, "64M", None);
    }
    let w = Seaweed::start();
    w.bucket("guest");
    ok(w.lightfoot(120, &["copy", s3.to_str().unwrap(), "s3://guest/disk", "--object-size", "64K"]));
    let served_plain = Served::start(&plain, &[]);
    let served_coalesce = Served::start(&coalesce, &["--coalesce"]);
    let served_s3 = S3Served::start(&w, dir.path(), "s3://guest/disk", &[]);
    let mut guest = Guest::boot(
        dir.path(),
        "write",
        "vda,vdb,vdc",
        &[&served_plain.sock, &served_coalesce.sock, &served_s3.sock],
        &[],
    );
    guest.wait_line("lf: synced", 300);
    let console = guest.kill();
    assert!(!console.contains("lf: note:"), "{console}");
    // The servers are killed too: what the guest synced was flushed, and a flushed write is on
    // storage whatever happens to the server after (`--coalesce` holds no flushed write back).
    served_plain.kill9();
    served_coalesce.kill9();
    served_s3.kill9();
    std::fs::remove_file(&s3).unwrap();
    ok(w.lightfoot(120, &["copy", "s3://guest/disk", s3.to_str().unwrap()]));
    for (img, disk, what) in
        [(&plain, "vda", "plain serve"), (&coalesce, "vdb", "--coalesce"), (&s3, "vdc", "s3://")]
    {
        assert_fsck_clean(img, what);
        let synced = sums(&console, &format!("lf: sum {disk} "));
        assert_eq!(synced.len(), 8, "{what}: files the guest synced:\n{console}");
        for (path, hash) in &synced {
            assert_eq!(&sum_in_image(img, path, dir.path()), hash, "{what}: {path} differs after the kill");
        }
    }
}

/// The server is killed and started again while a guest reads through it (QEMU's NBD
/// reconnect-delay): the guest's reads wait, carry on once it is back, and every file still
/// checks.
#[test]
fn guest_carries_on_when_its_server_restarts() {
    let Some(_one) = guest_turn() else { return };
    let dir = scratch();
    let (root, img) = tree_image(dir.path());
    let server = Served::start(&img, &[]);
    let guest = Guest::boot(dir.path(), "check", "", &[&server.sock], &[("GUEST_RECONNECT", "20")]);
    // A few files in: most of the tree is still to be read when the server goes.
    wait_until("the guest's fifth file", Duration::from_secs(120), || {
        guest.console().matches("lf: sum ").count() >= 5
    });
    server.kill9();
    let during = guest.console();
    assert!(!during.contains("lf: files"), "the guest read everything before the server went:\n{during}");
    let again = Served::start(&img, &[]);
    let console = guest.finish("check", 180);
    let (status, err) = again.stop();
    assert!(status.success(), "serve: {status}: {err}");
    assert_eq!(sums(&console, "lf: sum "), host_sums(&root), "checksums differ after the restart");
}
