//! The recipes of docs/recipes.md, run with the commands the page shows. Each command a test
//! runs must be a line of the page as written (the test fails otherwise, so the page cannot
//! drift from what was tested); it runs through `sh` in a scratch directory that also stands
//! in for `/run/lightfoot` and `/var/lib/lightfoot`, with the lightfoot under test first on
//! PATH. The tests check the bytes and, where a recipe says cache-neutral, that the files it
//! reads and writes are not left in the page cache. A missing tool skips its test with a line
//! naming it (common::skip; as root it fails the test: scripts/install-deps.sh installs them
//! all).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use common::*;

const PAGE: &str = include_str!("../docs/recipes.md");
const SIZE: u64 = 32 * MIB;

/// Whether every tool is on PATH; otherwise the test is skipped ([`tool_or_skip`]: as root a
/// missing tool fails it instead).
fn tools_or_skip(tools: &[(&str, &str)]) -> bool {
    tools.iter().all(|(name, package)| tool_or_skip(name, package))
}

/// A recipe's working directory: a scratch directory that is the current directory of its
/// commands and stands in for the directories the page names under /run and /var/lib.
struct Recipe {
    dir: tempfile::TempDir,
    path: String,
}

impl Recipe {
    fn new() -> Recipe {
        let dir = scratch();
        // The page says `lightfoot`: the binary under test, first on PATH.
        let bin_dir = dir.path().join(".bin");
        std::fs::create_dir(&bin_dir).unwrap();
        std::os::unix::fs::symlink(bin(), bin_dir.join("lightfoot")).unwrap();
        let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
        Recipe { dir, path }
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `line`, which must be a line of docs/recipes.md, with the page's system directories
    /// replaced by the scratch directory.
    fn local(&self, line: &str) -> String {
        assert!(
            PAGE.lines().any(|l| l.trim_end() == line),
            "docs/recipes.md no longer has the line the test runs:\n{line}"
        );
        let here = self.dir.path().to_str().unwrap();
        line.replace("/run/lightfoot", here).replace("/var/lib/lightfoot", here)
    }

    fn sh(&self, script: &str) -> Command {
        let mut c = Command::new("sh");
        c.arg("-c").arg(script).current_dir(self.dir.path()).env("PATH", &self.path);
        c
    }

    /// Runs a line of the page to completion (under `timeout 300`); asserts it succeeded and
    /// returns its output.
    #[track_caller]
    fn run(&self, line: &str) -> String {
        let out = self
            .sh(&format!("timeout -k 10 300 sh -c '{}'", self.local(line).replace('\'', r"'\''")))
            .output()
            .unwrap();
        assert!(out.status.success(), "{line}\n{}", text(&out));
        text(&out)
    }

    /// Starts a line of the page that runs on (a server), in place of `sh` (`exec`), so that
    /// a signal to the child reaches the server itself.
    fn spawn(&self, line: &str) -> Running {
        let child = self
            .sh(&format!("exec {}", self.local(line)))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        Running(Some(child))
    }
}

/// A server a recipe started; killed if the test ends early.
struct Running(Option<Child>);

impl Running {
    /// SIGTERM, as Ctrl-C or `systemctl stop` would stop it: its exit status and stderr.
    fn stop(mut self) -> Output {
        let child = self.0.take().unwrap();
        let _ = Command::new("kill").arg(child.id().to_string()).status();
        child.wait_with_output().unwrap()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn qemu_img(dir: &Path, args: &[&str]) {
    let out = Command::new("qemu-img").args(args).current_dir(dir).output().unwrap();
    assert!(out.status.success(), "qemu-img {args:?}: {}", text(&out));
}

#[track_caller]
fn assert_uncached(r: &Recipe, names: &[&str], after: &str) {
    for name in names {
        let left = cached(&r.file(name), 0, None);
        assert_eq!(left, 0, "{after}: {left} bytes of {name} left in the page cache");
    }
}

#[test]
fn qcow2_out_and_back_through_a_captive_qemu_nbd() {
    if !tools_or_skip(&[("qemu-nbd", "qemu-utils")]) {
        return;
    }
    let r = Recipe::new();
    let d = r.dir.path();
    sample(&r.file("orig.raw"), SIZE, MIB);
    qemu_img(d, &["convert", "-f", "raw", "-O", "qcow2", "orig.raw", "vm.qcow2"]);
    evict(&r.file("vm.qcow2"));
    evict(&r.file("orig.raw"));

    r.run("lightfoot copy -- [ qemu-nbd -r -f qcow2 --cache=none vm.qcow2 ] vm.raw");
    assert_uncached(&r, &["vm.qcow2", "vm.raw"], "qcow2 to raw");
    assert!(same_contents(&r.file("orig.raw"), &r.file("vm.raw")), "vm.raw differs from the image");
    assert!(allocated(&r.file("vm.raw")) <= allocated(&r.file("orig.raw")), "vm.raw lost its holes");

    // Back into a qcow2 that holds other data everywhere: all of it must go.
    random_file(&r.file("other.raw"), SIZE);
    qemu_img(d, &["convert", "-f", "raw", "-O", "qcow2", "other.raw", "vm.qcow2"]);
    let full = allocated(&r.file("vm.qcow2"));
    for f in ["vm.qcow2", "vm.raw", "orig.raw"] {
        evict(&r.file(f));
    }
    r.run("lightfoot copy -- vm.raw [ qemu-nbd -f qcow2 --cache=none --discard=unmap vm.qcow2 ]");
    assert_uncached(&r, &["vm.qcow2", "vm.raw"], "raw into the qcow2");
    qemu_img(d, &["compare", "-q", "-T", "none", "-f", "raw", "-F", "qcow2", "orig.raw", "vm.qcow2"]);
    // --discard=unmap: the holes freed the old data's clusters (metadata is well under 1 MiB).
    let kept = allocated(&r.file("vm.qcow2"));
    assert!(
        kept <= allocated(&r.file("orig.raw")) + MIB,
        "the restored qcow2 keeps {kept} bytes allocated (with the old data: {full})"
    );

    // The check can fail: without --cache=none, qemu-nbd leaves the qcow2 cached.
    evict(&r.file("vm.qcow2"));
    let bare = r.sh("lightfoot copy -- [ qemu-nbd -r -f qcow2 vm.qcow2 ] null:").output().unwrap();
    assert!(bare.status.success(), "{}", text(&bare));
    assert!(cached(&r.file("vm.qcow2"), 0, None) > 0, "qemu-nbd without --cache=none left nothing cached");
}

#[test]
fn raw_to_qcow2_through_a_captive_qemu_nbd() {
    if !tools_or_skip(&[("qemu-nbd", "qemu-utils")]) {
        return;
    }
    let r = Recipe::new();
    sample(&r.file("vm.raw"), SIZE, MIB);

    r.run(r#"qemu-img create -f qcow2 vm.qcow2 "$(stat -c %s vm.raw)""#);
    let metadata = cached(&r.file("vm.qcow2"), 0, None);
    r.run("lightfoot copy -- vm.raw [ qemu-nbd -f qcow2 --cache=none vm.qcow2 ]");
    let out = r.run("qemu-img compare -T none -f raw -F qcow2 vm.raw vm.qcow2");
    assert!(out.contains("Images are identical."), "{out}");

    assert_uncached(&r, &["vm.raw"], "the conversion and the compare");
    let left = cached(&r.file("vm.qcow2"), 0, None);
    assert!(left <= metadata, "vm.qcow2: {left} bytes cached, more than qemu-img create's {metadata}");
    // Holes of the raw file are not allocated in the qcow2 (its metadata is well under 1 MiB).
    assert!(allocated(&r.file("vm.qcow2")) <= allocated(&r.file("vm.raw")) + MIB);
}

#[test]
fn an_export_as_the_backing_file_of_a_qcow2_overlay() {
    if !tools_or_skip(&[("qemu-nbd", "qemu-utils"), ("qemu-io", "qemu-utils")]) {
        return;
    }
    let r = Recipe::new();
    let base = r.file("base.raw");
    sample(&base, SIZE, MIB);
    let original = std::fs::read(&base).unwrap();
    evict(&base);

    r.run("mkdir -p -m 0700 /run/lightfoot");
    let server = r.spawn("lightfoot serve --read-only --unix /run/lightfoot/base.sock base.raw");
    assert!(within(10, || r.file("base.sock").exists()), "the server made no socket");
    r.run("qemu-img create -f qcow2 -b 'nbd+unix:///?socket=/run/lightfoot/base.sock' -F raw overlay.qcow2");
    r.run("qemu-io -c 'write -P 0xab 1M 4k' overlay.qcow2");
    let read = r.run("qemu-io -c 'read -P 0xab 1M 4k' overlay.qcow2");
    assert!(read.contains("read 4096/4096 bytes at offset 1048576"), "{read}");
    r.run("lightfoot copy -- [ qemu-nbd -r -f qcow2 --cache=none overlay.qcow2 ] merged.raw");
    let stopped = server.stop();
    assert!(stopped.status.success(), "the server: {}", text(&stopped));

    assert_uncached(&r, &["base.raw", "merged.raw"], "the overlay's use and its flattening");
    assert!(std::fs::read(&base).unwrap() == original, "the base was modified");
    let mut want = original;
    want[MIB as usize..MIB as usize + 4096].fill(0xab);
    assert!(
        std::fs::read(r.file("merged.raw")).unwrap() == want,
        "merged.raw is not the base with the write"
    );
}

/// `KEY=value` of a unit file (the first).
fn unit_value(unit: &str, key: &str) -> String {
    let prefix = format!("{key}=");
    unit.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {key}= in the unit"))
        .to_string()
}

#[test]
fn a_systemd_socket_unit() {
    if !tools_or_skip(&[("systemd-analyze", "systemd"), ("systemd-socket-activate", "systemd")]) {
        return;
    }
    let units = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/systemd");
    let socket = std::fs::read_to_string(units.join("lightfoot-nbd.socket")).unwrap();
    let service = std::fs::read_to_string(units.join("lightfoot-nbd.service")).unwrap();
    assert_eq!(unit_value(&socket, "Accept"), "no", "lightfoot serve takes the listening socket");
    let listen = unit_value(&socket, "ListenStream");
    let exec = unit_value(&service, "ExecStart");
    let installed = "/usr/local/bin/lightfoot";
    assert!(exec.starts_with(installed), "ExecStart= runs {exec}, not what make install puts in {installed}");
    let r = Recipe::new();

    // systemd-analyze verify, on the files as shipped but for the binary's path (it checks
    // that the program exists) and with the man pages the unit names generated from this
    // binary (it runs `man` on Documentation=). A unit that must pass shows first whether
    // systemd-analyze can run here at all.
    let verify_dir = r.file("units");
    std::fs::create_dir(&verify_dir).unwrap();
    std::fs::write(verify_dir.join("lightfoot-nbd.socket"), &socket).unwrap();
    std::fs::write(verify_dir.join("lightfoot-nbd.service"), service.replace(installed, bin())).unwrap();
    std::fs::write(verify_dir.join("probe.service"), "[Service]\nExecStart=/bin/true\n").unwrap();
    let man = r.file("man");
    std::fs::create_dir_all(man.join("man1")).unwrap();
    ok(lightfoot(&["__generate", "man", "--date", "2026-01-01", man.join("man1").to_str().unwrap()]));
    let verify = |names: &[&str]| {
        Command::new("systemd-analyze")
            .arg("verify")
            .args(names.iter().map(|n| verify_dir.join(n)))
            .env("MANPATH", &man)
            .output()
            .unwrap()
    };
    let probe = verify(&["probe.service"]);
    if probe.status.success() {
        let out = verify(&["lightfoot-nbd.socket", "lightfoot-nbd.service"]);
        assert!(
            out.status.success() && text(&out).trim().is_empty(),
            "systemd-analyze verify: {}",
            text(&out)
        );
    } else {
        skip(&format!(
            "systemd-analyze verify cannot run here (a unit that must pass fails: {}): the units were \
             not verified",
            text(&probe).trim()
        ));
    }

    // The unit's command under systemd-socket-activate, as docs/recipes.md shows it.
    let image = r.file("disk.img");
    sample(&image, SIZE, MIB);
    let line = format!("systemd-socket-activate -l {listen} {}", exec.replacen(installed, "lightfoot", 1));
    let server = r.spawn(&line);
    let sock = PathBuf::from(r.local(&line).split_whitespace().nth(2).unwrap());
    assert!(within(10, || sock.exists()), "systemd-socket-activate made no socket");
    r.run("lightfoot copy 'nbd+unix:///disk?socket=/run/lightfoot/disk.sock' disk-copy.img");
    let stopped = server.stop();
    assert!(stopped.status.success(), "the server after SIGTERM: {}", text(&stopped));
    assert!(sock.exists(), "the server removed the socket systemd-socket-activate made");

    assert_uncached(&r, &["disk.img", "disk-copy.img"], "serving from the socket unit's command");
    assert!(same_contents(&image, &r.file("disk-copy.img")), "the copy differs from the image");
}
