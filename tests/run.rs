//! `lightfoot run -- CMD`: the command's output, status and signals are its own, and what its
//! reads and writes bring into the page cache is gone when it ends while what was cached
//! before stays (docs/run.md).

// Signals by kill(2) where starting kill(1) would itself wait (marked at the call); each
// `unsafe` block says why it is sound.
#![deny(clippy::undocumented_unsafe_blocks)]

mod common;

use std::io::{BufRead, Write};
use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::*;

const MIB: u64 = 1 << 20;

/// `lightfoot run ARGS…`, stdout and stderr captured.
fn run(args: &[&str]) -> Output {
    Command::new(bin()).arg("run").args(args).output().unwrap()
}

/// `sh -c SCRIPT` under `lightfoot run --json --watch never` (the preload library alone), in
/// `dir`; asserts success; the JSON summary.
fn run_sh(dir: &Path, script: &str) -> serde_json::Value {
    run_sh_watch(dir, script, "never")
}

/// `sh -c SCRIPT` under `lightfoot run --json --watch WATCH`, in `dir`; asserts success; the
/// JSON summary.
fn run_sh_watch(dir: &Path, script: &str, watch: &str) -> serde_json::Value {
    let out = Command::new(bin())
        .args(["run", "--json", "--watch", watch, "--", "sh", "-c", script])
        .current_dir(dir)
        .output()
        .unwrap();
    summary_of(&out, script)
}

/// The JSON summary `lightfoot run --json` printed last on stderr, once `what` succeeded.
fn summary_of(out: &Output, what: &str) -> serde_json::Value {
    assert!(out.status.success(), "{what}: {}", text(out));
    let err = String::from_utf8_lossy(&out.stderr);
    let last = err.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{what}: no JSON summary ({e}): {err}"))
}

/// What a `/usr/bin/python3 -c SCRIPT` run in `dir` printed, as a number: bare, or under
/// `lightfoot run`.
fn printed_by(dir: &Path, script: &str, under: bool) -> u64 {
    let mut c = Command::new(if under { bin() } else { "/usr/bin/python3" });
    if under {
        c.args(["run", "--watch", "never", "--", "/usr/bin/python3"]);
    }
    let out = c.args(["-c", script]).current_dir(dir).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// The files of a summary that name `name`.
fn reported<'a>(summary: &'a serde_json::Value, name: &str) -> Vec<&'a serde_json::Value> {
    summary["files"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["path"].as_str().unwrap().ends_with(name))
        .collect()
}

#[test]
fn the_command_keeps_its_output_and_status() {
    let dir = scratch();
    let d = dir.path();
    random_file(&d.join("f"), 24 * MIB);
    std::fs::create_dir(d.join("tree")).unwrap();
    for i in 0..50 {
        random_file(&d.join(format!("tree/{i}")), 4096 * (i + 1));
    }
    for (name, script) in [
        ("cat", "cat f"),
        ("tar", "tar cf - tree | cat"),
        ("dd", "dd if=f bs=1M status=none"),
        ("cp", "cp f g && cat g && rm g"),
        ("head", "head -c 5000000 f | md5sum"),
    ] {
        let bare = Command::new("sh").args(["-c", script]).current_dir(d).output().unwrap();
        let under =
            Command::new(bin()).args(["run", "--", "sh", "-c", script]).current_dir(d).output().unwrap();
        assert!(bare.status.success(), "{name}: {}", text(&bare));
        assert_eq!(under.status.code(), Some(0), "{name}: {}", text(&under));
        assert!(under.stdout == bare.stdout, "{name}: the output differs under lightfoot run");
        assert_eq!(String::from_utf8_lossy(&under.stderr), "", "{name}");
    }
    // Statuses: its own, 128+N for a signal, 127 not found, 126 not executable.
    assert_eq!(run(&["--", "sh", "-c", "exit 7"]).status.code(), Some(7));
    assert_eq!(run(&["--", "sh", "-c", "kill -TERM $$"]).status.code(), Some(143));
    let out = run(&["--", "/no/such/command"]);
    assert_eq!(out.status.code(), Some(127), "{}", text(&out));
    assert!(text(&out).contains("/no/such/command: command not found"), "{}", text(&out));
    assert_eq!(run(&["--", d.join("f").to_str().unwrap()]).status.code(), Some(126));
    // An error the command meets is its own, word for word.
    let bare = Command::new("cat").arg(d.join("missing")).output().unwrap();
    let under = run(&["--", "cat", d.join("missing").to_str().unwrap()]);
    assert_eq!((under.status.code(), &under.stderr), (bare.status.code(), &bare.stderr));
    // The user's own preload stays first; ours follows.
    let out = Command::new(bin())
        .args(["run", "--", "sh", "-c", "echo \"$LD_PRELOAD\""])
        .env("LD_PRELOAD", "/lib/x86_64-linux-gnu/libc.so.6")
        .output()
        .unwrap();
    let seen = String::from_utf8_lossy(&out.stdout);
    assert!(
        seen.starts_with("/lib/x86_64-linux-gnu/libc.so.6:")
            && seen.trim_end().ends_with("liblightfoot_preload.so"),
        "{seen}"
    );
    // Without the library, a clear error and 125 before anything runs.
    let out = Command::new(bin())
        .args(["run", "--", "touch", d.join("ran").to_str().unwrap()])
        .env("LIGHTFOOT_PRELOAD", d.join("nowhere.so"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125), "{}", text(&out));
    assert!(text(&out).contains("nowhere.so, which is not a file"), "{}", text(&out));
    assert!(!d.join("ran").exists(), "the command ran without the library");
}

/// A TERM sent to lightfoot reaches the command, whose own status comes back.
#[test]
fn signals_sent_to_lightfoot_reach_the_command() {
    let mut child = Command::new(bin())
        .args(["run", "--", "sh", "-c", "trap 'exit 42' TERM; echo ready; while :; do sleep 0.1; done"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line)
        .unwrap();
    assert_eq!(line, "ready\n");
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let st = child.wait().unwrap();
    assert_eq!(st.code(), Some(42), "{st}");
}

/// Readers (cat, dd, tar through a pipe, a child in the background) leave a 64 MiB file as
/// they found it: the 8 MiB cached before stay, nothing else does. The same reads without
/// lightfoot leave most of the file cached: the check can fail.
#[test]
fn readers_leave_the_cache_as_they_found_it() {
    let dir = scratch();
    let d = dir.path();
    let f = d.join("f");
    let size = 64 * MIB;
    random_file(&f, size);
    // The working set: [16, 24) MiB, 2 MiB-aligned as the first-sight record is.
    let (ws, wlen) = (16 * MIB, 8 * MIB);
    let prepare = || {
        evict(&f);
        warm(&f, ws, wlen);
    };
    prepare();
    Command::new("sh").args(["-c", "cat f > /dev/null"]).current_dir(d).status().unwrap();
    let bare = cached(&f, 0, None);
    assert!(bare > size / 2, "bare cat left only {bare} bytes cached: the test could not fail");
    for script in [
        "cat f > /dev/null",
        "dd if=f of=/dev/null bs=64K status=none",
        "tar cf - f | cat > /dev/null",
        "cat f > /dev/null & wait",
        "tail -c 1000000 f > /dev/null; head -c 30000000 f > /dev/null",
    ] {
        let mut summary = serde_json::Value::Null;
        let kept = kept_despite_host_reclaim(d, wlen, script, || {
            prepare();
            summary = run_sh(d, script);
            cached(&f, ws, Some(wlen))
        });
        assert_kept(kept, wlen, script);
        let rest = cached(&f, 0, Some(ws)) + cached(&f, ws + wlen, None);
        assert!(rest <= size / 100, "{script}: {rest} bytes left cached outside the working set: {summary}");
        let files = reported(&summary, "/f");
        assert!(!files.is_empty(), "{script}: f not in the summary: {summary}");
        assert_eq!(files[0]["mechanism"], "evict-behind", "{summary}");
        assert_eq!(files[0]["cached_before"], wlen, "{summary}");
        // What was evicted is what the reads brought in: never the working set, and most of
        // the rest for the readers of the whole file (the host's own reclaim may take a little
        // first).
        let evicted = files.iter().map(|x| x["evicted"].as_u64().unwrap()).sum::<u64>();
        assert!(evicted <= size - wlen, "{script}: evicted {evicted}: {summary}");
        let least = if script.starts_with("tail") { 16 * MIB } else { (size - wlen) / 2 };
        assert!(evicted >= least, "{script}: evicted {evicted}: {summary}");
    }
}

/// Writers (cp, dd, a shell's redirection) leave nothing of what they wrote cached, and the
/// bytes are all there.
#[test]
fn writers_leave_nothing_cached() {
    let dir = scratch();
    let d = dir.path();
    let f = d.join("f");
    random_file(&f, 48 * MIB);
    // Without lightfoot, a copy stays in the cache: the check below can fail.
    evict(&f);
    Command::new("sh").args(["-c", "cat f > k"]).current_dir(d).status().unwrap();
    assert!(cached(&d.join("k"), 0, None) > 24 * MIB, "a bare copy left its output uncached");
    for (script, out) in [
        ("cp f g", "g"),
        ("dd if=f of=h bs=1M status=none", "h"),
        ("cat f > i", "i"),
        ("cat f | dd of=j bs=256K status=none", "j"),
        // rsync writes a temporary name, then renames it: the record has the temporary one.
        ("rsync f r", "r"),
    ] {
        evict(&f);
        let summary = run_sh(d, script);
        let o = d.join(out);
        assert!(
            cached(&o, 0, None) <= 48 * MIB / 100,
            "{script}: {} bytes of {out} left cached: {summary}",
            cached(&o, 0, None)
        );
        assert!(cached(&f, 0, None) <= 48 * MIB / 100, "{script}: the source left cached");
        // Last: comparing reads both files into the cache.
        assert!(same_contents(&f, &o), "{script}: the copy differs");
        let w = reported(&summary, &format!("/{out}"));
        assert!(w.first().is_some_and(|x| x["written"] == true), "{script}: {summary}");
        assert_eq!(w[0]["bytes_written"], 48 * MIB, "{script}: {summary}");
        assert_eq!(reported(&summary, "/f")[0]["bytes_read"], 48 * MIB, "{script}: {summary}");
        let evicted = w.iter().map(|x| x["evicted"].as_u64().unwrap()).sum::<u64>();
        assert!((47 * MIB..=48 * MIB).contains(&evicted), "{script}: evicted {evicted} of {out}: {summary}");
    }
    // stdio to a redirected stdout (`head -c` writes with fwrite, which no preload sees): the
    // library looks at its standard streams when the program starts, and drops at exit.
    evict(&f);
    let summary = run_sh(d, "head -c 48M f > s");
    let o = d.join("s");
    assert!(
        cached(&o, 0, None) <= 48 * MIB / 100,
        "{} bytes of s left cached: {summary}",
        cached(&o, 0, None)
    );
    assert!(same_contents(&f, &o), "head: the copy differs");
    let w = reported(&summary, "/s");
    assert!(w.first().is_some_and(|x| x["written"] == true && x["cached_before"] == 0), "{summary}");
}

/// Pipes, sockets and O_DIRECT files pass through untouched: not looked at, not reported,
/// and what O_DIRECT leaves of the cache is as it was.
#[test]
fn pipes_and_o_direct_pass_through() {
    let dir = scratch();
    let d = dir.path();
    let out = Command::new(bin())
        .args(["run", "--json", "--watch", "never", "--", "sh", "-c", "head -c 64M /dev/zero | cat | wc -c"])
        .output()
        .unwrap();
    let summary = summary_of(&out, "a pipeline");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "67108864");
    assert_eq!(summary["files"].as_array().unwrap().len(), 0, "a pipe or /dev/zero was looked at: {summary}");
    // A socket: 8 MiB through a socket pair, sent and received with write(2) and read(2).
    let summary = run_sh(
        d,
        "/usr/bin/python3 -c \"import os, socket, threading\na, b = socket.socketpair()\nt = threading.Thread(target=lambda: [os.write(a.fileno(), b'x' * 65536) for _ in range(128)])\nt.start()\nn = 0\nwhile n < 8 << 20:\n    n += len(os.read(b.fileno(), 65536))\nt.join()\nprint(n)\"",
    );
    let sockets: Vec<_> = summary["files"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| {
            f["path"].as_str().unwrap().contains("socket:") || f["bytes_read"].as_u64() >= Some(8 << 20)
        })
        .collect();
    assert!(sockets.is_empty(), "a socket was looked at: {sockets:?}");
    let f = d.join("f");
    random_file(&f, 16 * MIB);
    evict(&f);
    warm(&f, 0, 8 * MIB);
    let summary = run_sh(d, "dd if=f iflag=direct of=/dev/null bs=1M status=none");
    assert!(reported(&summary, "/f").is_empty(), "an O_DIRECT file was looked at: {summary}");
    assert_kept(cached(&f, 0, Some(8 * MIB)), 8 * MIB, "O_DIRECT reader");
}

/// While a reader runs, what it read stays behind it only a block or two (plus the kernel's
/// readahead ahead of it), not the whole of what it read: a reader that has read 40 MB of a
/// 64 MiB file in 10 KiB calls (as tar reads), holding the file open, has at most 16 MiB of it
/// cached. The bare reader has all 40 MB: the check can fail.
#[test]
fn a_reader_holds_little_while_it_runs() {
    let dir = scratch();
    let d = dir.path();
    let f = d.join("f");
    random_file(&f, 64 * MIB);
    let script = format!(
        "import os, subprocess\nfd = os.open('f', os.O_RDONLY)\nn = 0\nwhile n < 40_000_000:\n    n += len(os.read(fd, 10240))\n\
         out = subprocess.run(['{}', 'cache', 'stat', '--json', 'f'], capture_output=True, env={{}}).stdout\nprint(__import__('json').loads(out)[0]['cached_bytes'])\n",
        bin()
    );
    let held = |under: bool| -> u64 {
        evict(&f);
        printed_by(d, &script, under)
    };
    let bare = held(false);
    assert!(bare >= 38 * MIB, "a bare reader held only {bare} bytes: the check could not fail");
    let under = held(true);
    assert!(under <= 16 * MIB, "a reader under lightfoot run held {under} bytes of the 40 MB it read");
}

/// An in-kernel copy of a whole file in one call (`cp` asks for that with `copy_file_range`) is
/// done a piece at a time, so the pages of both ends can be dropped as it goes: one call
/// copies at most 8 MiB under lightfoot run (the call may always copy less than asked; its
/// callers loop), and the source and the copy hold little while the copy runs.
#[test]
fn in_kernel_copies_go_a_piece_at_a_time() {
    let dir = scratch();
    let d = dir.path();
    let f = d.join("f");
    random_file(&f, 64 * MIB);
    evict(&f);
    let script = format!(
        "import os, subprocess\nsrc = os.open('f', os.O_RDONLY)\ndst = os.open('g', os.O_WRONLY | os.O_CREAT, 0o644)\n\
         first = os.copy_file_range(src, dst, 1 << 40)\nn = first\nwhile n < 40_000_000:\n    n += os.copy_file_range(src, dst, 1 << 40)\n\
         out = subprocess.run(['{}', 'cache', 'stat', '--json', 'f'], capture_output=True, env={{}}).stdout\n\
         print(first, __import__('json').loads(out)[0]['cached_bytes'])\n",
        bin()
    );
    let out = Command::new(bin())
        .args(["run", "--watch", "never", "--", "/usr/bin/python3", "-c", &script])
        .current_dir(d)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let got = String::from_utf8_lossy(&out.stdout);
    let v: Vec<u64> = got.split_whitespace().map(|x| x.parse().unwrap()).collect();
    assert_eq!(v[0], 8 * MIB, "one copy_file_range call copied {} bytes", v[0]);
    assert!(v[1] <= 16 * MIB, "the source held {} bytes while the copy ran", v[1]);
    assert!(
        cached(&d.join("g"), 0, None) <= MIB,
        "the copy left {} bytes cached",
        cached(&d.join("g"), 0, None)
    );
    let bare = Command::new("/usr/bin/python3")
        .args(["-c", "import os; s = os.open('f', os.O_RDONLY); d = os.open('h', os.O_WRONLY | os.O_CREAT, 0o644); print(os.copy_file_range(s, d, 1 << 40))"])
        .current_dir(d)
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&bare.stdout).trim(), (64 * MIB).to_string(), "bare: {}", text(&bare));
}

/// Write-behind: a writer that has written 256 MiB in 1 MiB calls, its file still open, has at
/// most 16 MiB of it in the cache (it waits for the writeback of the block 8 MiB behind and
/// drops it). The bare writer has all of it cached: the check can fail. This writer is too slow
/// to show the difference the wait makes over a drop that only starts writeback (that one
/// passes here too); bench/run.sh shows it: `cp` of 1 GiB peaked at 937 MiB without the wait
/// and 51 MiB with it.
#[test]
fn a_writer_holds_little_while_it_runs() {
    let dir = scratch();
    let d = dir.path();
    let script = format!(
        "import os, subprocess\nfd = os.open('g', os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)\nbuf = os.urandom(1 << 20)\n\
         for _ in range(256):\n    os.write(fd, buf)\n\
         out = subprocess.run(['{}', 'cache', 'stat', '--json', 'g'], capture_output=True, env={{}}).stdout\n\
         print(__import__('json').loads(out)[0]['cached_bytes'])\nos.fsync(fd)\n",
        bin()
    );
    let held = |under: bool| printed_by(d, &script, under);
    let bare = held(false);
    assert!(bare >= 250 * MIB, "a bare writer held only {bare} bytes: the check could not fail");
    evict(&d.join("g"));
    let under = held(true);
    assert!(under <= 16 * MIB, "a writer under lightfoot run held {under} bytes of the 256 MiB it wrote");
    assert!(cached(&d.join("g"), 0, None) <= MIB, "the written file was left cached");
}

/// A statically linked reader and writer, which no preload library can enter: `scat [-p N]
/// FILE…` copies the files to stdout with read(2) and write(2); with `-p N` it says `r` on
/// stderr after N bytes and waits for a byte on stdin before going on. Built once per test
/// binary (gcc -static, libc6-dev).
fn static_cat() -> &'static str {
    static BUILT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| {
        let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("static-cat");
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("scat.c");
        std::fs::write(
            &src,
            r#"#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static char buf[1 << 16];
int main(int argc, char **argv) {
    long long pause_at = -1, done = 0;
    int i = 1;
    if (argc > 2 && strcmp(argv[1], "-p") == 0) { pause_at = atoll(argv[2]); i = 3; }
    for (; i < argc; i++) {
        int fd = open(argv[i], O_RDONLY);
        if (fd < 0) return 2;
        ssize_t n;
        while ((n = read(fd, buf, sizeof buf)) > 0) {
            if (write(1, buf, n) != n) return 3;
            done += n;
            if (pause_at >= 0 && done >= pause_at) {
                char c;
                pause_at = -1;
                if (write(2, "r\n", 2) != 2 || read(0, &c, 1) < 0) return 4;
            }
        }
        if (n < 0 || close(fd) != 0) return 5;
    }
    return 0;
}
"#,
        )
        .unwrap();
        let exe = dir.join("scat");
        let out =
            Command::new("gcc").args(["-O2", "-static", "-o"]).arg(&exe).arg(&src).output().expect("run gcc");
        assert!(out.status.success(), "gcc -static (needs libc6-dev): {}", text(&out));
        exe.to_str().unwrap().to_string()
    })
}

/// The watcher (root) covers what the preload library cannot see: a statically linked reader
/// and writer, the same in a background child, and a reader that maps the file. The working
/// set cached before stays, the rest goes. With the watcher off the static reader leaves the
/// file cached: the check can fail.
#[test]
fn the_watcher_covers_static_programs_and_mmap() {
    if !root_or_skip("fanotify needs root") {
        return;
    }
    let dir = scratch();
    let d = dir.path();
    let f = d.join("f");
    let size = 64 * MIB;
    random_file(&f, size);
    let scat = static_cat();
    let (ws, wlen) = (16 * MIB, 8 * MIB);
    let prepare = || {
        evict(&f);
        warm(&f, ws, wlen);
    };
    prepare();
    let off = run_sh_watch(d, &format!("{scat} f > /dev/null"), "never");
    assert!(cached(&f, 0, None) > size / 2, "without the watcher a static reader left little cached: {off}");
    let mmap = "/usr/bin/python3 -c \"import mmap, sys; f = open('f', 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); f.close(); print(sum(m[i] for i in range(0, len(m), 4096)), file=sys.stderr)\"";
    for script in [
        format!("{scat} f > /dev/null"),
        format!("{scat} f > /dev/null & wait"),
        format!("sh -c '{scat} f | {scat} /dev/stdin > /dev/null'"),
        mmap.to_string(),
    ] {
        let mut summary = serde_json::Value::Null;
        let kept = kept_despite_host_reclaim(d, wlen, &script, || {
            prepare();
            summary = run_sh_watch(d, &script, "always");
            cached(&f, ws, Some(wlen))
        });
        assert_kept(kept, wlen, &script);
        let rest = cached(&f, 0, Some(ws)) + cached(&f, ws + wlen, None);
        assert!(rest <= size / 100, "{script}: {rest} bytes left cached outside the working set: {summary}");
        assert_eq!(summary["watcher"]["on"], true, "{summary}");
        let files = reported(&summary, "/f");
        assert!(!files.is_empty(), "{script}: f not in the summary: {summary}");
        assert!(files[0]["mechanism"].as_str().unwrap().starts_with("watcher"), "{summary}");
        assert_eq!(files[0]["cached_before"], wlen, "{summary}");
        let evicted = files.iter().map(|x| x["evicted"].as_u64().unwrap()).sum::<u64>();
        assert!(
            (size - wlen) / 2 <= evicted && evicted <= size - wlen,
            "{script}: evicted {evicted}: {summary}"
        );
    }
    // A static writer behind a shell's redirection: its output is not left cached, and whole.
    evict(&f);
    let summary = run_sh_watch(d, &format!("{scat} f > g"), "always");
    let g = d.join("g");
    assert!(cached(&g, 0, None) <= size / 100, "{} bytes of g left cached: {summary}", cached(&g, 0, None));
    assert!(cached(&f, 0, None) <= size / 100, "the source left cached: {summary}");
    assert!(same_contents(&f, &g), "the static copy differs");
}

/// While a static reader runs, the watcher keeps what it has read behind it small: after
/// 40 MB of a 64 MiB file, with the file still open, at most 24 MiB of it is cached (one block
/// behind, two readahead windows ahead, and what a tick lets through). Bare, all 40 MB stay:
/// the check can fail.
#[test]
fn the_watcher_holds_a_static_reader_to_little() {
    if !root_or_skip("fanotify needs root") {
        return;
    }
    let dir = scratch();
    let d = dir.path();
    let f = d.join("f");
    random_file(&f, 64 * MIB);
    let scat = static_cat();
    let held = |cmd: &mut Command| -> u64 {
        evict(&f);
        let mut child = cmd
            .current_dir(d)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stderr.as_mut().unwrap()), &mut line)
            .unwrap();
        assert_eq!(line, "r\n");
        // Two ticks of the watcher's, and some: the bound is on what the watcher leaves after
        // that long, the same wait for the bare reader that has no watcher. Waiting for the
        // cache to shrink instead would turn the bound into "some time", and the bare run
        // would have nothing to wait for.
        std::thread::sleep(std::time::Duration::from_millis(200));
        let n = cached(&f, 0, None);
        std::io::Write::write_all(child.stdin.as_mut().unwrap(), b"x").unwrap();
        assert!(child.wait().unwrap().success());
        n
    };
    let bare = held(Command::new(scat).args(["-p", "40000000", "f"]));
    assert!(bare >= 38 * MIB, "a bare reader held only {bare} bytes: the check could not fail");
    let under =
        held(Command::new(bin()).args(["run", "--watch", "always", "--", scat, "-p", "40000000", "f"]));
    assert!(under <= 24 * MIB, "a static reader under the watcher held {under} bytes of the 40 MB it read");
}

/// restic (a Go program: its own system calls, so no preload) backing up a tree under the
/// watcher leaves neither the tree nor its repository cached, and the backup restores the
/// same bytes. Without the watcher it leaves the tree cached: the check can fail.
#[test]
fn restic_backup_leaves_the_cache_as_it_found_it() {
    if !root_or_skip("fanotify needs root") {
        return;
    }
    need("restic", "restic");
    let dir = scratch();
    let d = dir.path();
    std::fs::create_dir(d.join("tree")).unwrap();
    random_file(&d.join("tree/big"), 48 * MIB);
    for i in 0..40 {
        random_file(&d.join(format!("tree/small{i}")), 64 << 10);
    }
    let moved = 48 * MIB + 40 * (64 << 10);
    let files = |sub: &str| -> Vec<std::path::PathBuf> {
        let mut out = Vec::new();
        let mut stack = vec![d.join(sub)];
        while let Some(p) = stack.pop() {
            for e in std::fs::read_dir(&p).unwrap().flatten() {
                let t = e.file_type().unwrap();
                if t.is_dir() {
                    stack.push(e.path());
                } else if t.is_file() {
                    out.push(e.path());
                }
            }
        }
        out
    };
    let left = |sub: &str| files(sub).iter().map(|p| cached(p, 0, None)).sum::<u64>();
    let backup = |watch: &str| -> serde_json::Value {
        let _ = std::fs::remove_dir_all(d.join("repo"));
        let init = Command::new("restic")
            .args(["init", "-q", "-r", "repo"])
            .env("RESTIC_PASSWORD", "x")
            .current_dir(d)
            .output()
            .unwrap();
        assert!(init.status.success(), "{}", text(&init));
        for p in files("tree") {
            evict(&p);
        }
        let out = Command::new(bin())
            .args(["run", "--json", "--watch", watch, "--", "restic", "-q", "-r", "repo", "backup", "tree"])
            .env("RESTIC_PASSWORD", "x")
            .current_dir(d)
            .output()
            .unwrap();
        summary_of(&out, "restic backup")
    };
    backup("never");
    assert!(left("tree") > moved / 2, "without the watcher restic left only {} bytes cached", left("tree"));
    let summary = backup("always");
    let (tree, repo) = (left("tree"), left("repo"));
    assert!(
        tree + repo <= moved / 100,
        "restic left {tree} bytes of the tree and {repo} of the repository cached: {summary}"
    );
    let out = Command::new("restic")
        .args(["-q", "-r", "repo", "restore", "latest", "--target", "restored"])
        .env("RESTIC_PASSWORD", "x")
        .current_dir(d)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let restored = d.join("restored/tree/big");
    assert!(same_contents(&d.join("tree/big"), &restored), "the backup does not restore the same bytes");
}

/// The watcher runs in a process group of its own: stopping `lightfoot run`'s group (a
/// terminal's Ctrl-Z) stops CMD but not the watcher, which every open on the watched file
/// systems waits for while CMD runs, so the host's opens go on.
#[test]
fn a_stopped_run_does_not_hold_the_hosts_opens() {
    if !root_or_skip("fanotify needs root") {
        return;
    }
    use std::os::unix::process::CommandExt;
    let dir = scratch();
    let f = dir.path().join("f");
    std::fs::write(&f, b"hello").unwrap();
    let (mut child, _out, line) = spawn_until_line(
        Command::new(bin())
            .args(["run", "--watch", "always", "--", "sh", "-c", "echo ready; exec sleep 30"])
            .process_group(0),
    );
    assert_eq!(line, "ready\n");
    // Signals by kill(2), not kill(1): starting a program opens files, which would wait too.
    let group = -(child.id() as i32);
    // SAFETY: kill with integer arguments.
    assert_eq!(unsafe { libc::kill(group, libc::SIGSTOP) }, 0);
    let (tx, rx) = std::sync::mpsc::channel();
    let g = f.clone();
    std::thread::spawn(move || tx.send(std::fs::read(&g).map(|b| b.len())).unwrap());
    let got = rx.recv_timeout(std::time::Duration::from_secs(10));
    // SAFETY: as above.
    unsafe {
        libc::kill(group, libc::SIGCONT);
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let st = child.wait().unwrap();
    assert!(matches!(got, Ok(Ok(5))), "an open waited while lightfoot run was stopped: {got:?}");
    assert_eq!(st.code(), Some(143), "{st}");
}

/// Without root there is no watcher: -v says so and what that leaves out; `--watch always`
/// refuses to run CMD.
#[test]
fn without_root_the_watcher_is_off_and_says_what_is_not_covered() {
    if !root_or_skip("needs root to switch to nobody") {
        return;
    }
    let dir = scratch();
    let as_nobody = |args: &[&str]| {
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", bin(), "run"])
            .args(args)
            .current_dir(dir.path())
            .output()
            .unwrap()
    };
    let out = as_nobody(&["-v", "--", "true"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains(
            "watcher: off: it needs root (fanotify); statically linked programs, Go programs (restic), mmap"
        ),
        "{}",
        text(&out)
    );
    let out = as_nobody(&["--watch", "always", "--", "touch", "ran"]);
    assert_eq!(out.status.code(), Some(125), "{}", text(&out));
    assert!(text(&out).contains("--watch always, but the watcher is off: it needs root"), "{}", text(&out));
    assert!(!dir.path().join("ran").exists(), "the command ran without the watcher it was asked for");
}

/// A write error met by write-behind still reaches the program's `fsync`: write-behind waits
/// for writeback on a file description of the library's own, and writeback errors are
/// reported once per description, so waiting on the program's own would take the error away.
///
/// The layout makes the check able to fail. An ext4 image lives on a tmpfs with room for
/// 4 MiB of data, plus a 32 MiB ballast file. The program writes 20 MiB: write-behind writes
/// back and waits for the first blocks, and most of them fail. The test then removes the
/// ballast, and the program writes 20 MiB more, which now fit: every block still dirty at its
/// `fsync` is written back without error. So `fsync` fails only if the error met earlier was
/// kept for the program's description.
///
/// The control run (bare, the program waiting for its own writeback with `sync_file_range` as
/// a write-behind on its descriptor would) shows that on this kernel its `fsync` then returns
/// success: the error was taken. A probe descriptor, asking with WAIT_BEFORE (which starts no
/// writeback), shows that the errors were met before `fsync`, not by it.
#[test]
fn a_write_error_under_write_behind_reaches_fsync() {
    if !root_or_skip("needs root for mount and losetup") {
        return;
    }
    let dir = scratch();
    let script = r#"
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
def sfr(fd, flags):
    return 0 if libc.sync_file_range(fd, 0, 0, flags) == 0 else ctypes.get_errno()
own = sys.argv[1] == 'own'
fd = os.open('g', os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
probe = os.open('g', os.O_RDONLY)
buf = os.urandom(1 << 20)
for _ in range(20):
    os.write(fd, buf)
    if own:
        sfr(fd, 7)
print('early', sfr(probe, 1), flush=True)
sys.stdin.readline()
for _ in range(20):
    os.write(fd, buf)
    if own:
        sfr(fd, 7)
try:
    os.fsync(fd)
    print('fsync 0')
except OSError as e:
    print('fsync', e.errno)
"#;
    let runs: [(&str, &[&str], &str); 4] = [
        ("bare, waiting on its own descriptor", &[], "own"),
        ("bare", &[], "plain"),
        ("lightfoot run --watch never", &["run", "--watch", "never", "--"], "plain"),
        ("lightfoot run --watch always", &["run", "--watch", "always", "--"], "plain"),
    ];
    for (i, (what, how, mode)) in runs.into_iter().enumerate() {
        // A new image on a new tmpfs each time (the blocks of a deleted file stay on the tmpfs,
        // and ext4 would reuse them): room for what mkfs wrote, 4 MiB of data and the ballast.
        let tmp = Mount::new(dir.path(), &format!("t{i}"), &["-t", "tmpfs", "-o", "size=64m", "tmpfs"]);
        let image = tmp.path.join("fs.img");
        std::fs::File::create(&image).unwrap().set_len(64 * MIB).unwrap();
        // Everything mkfs will ever write, written now: what is left on the tmpfs is for data.
        let out = Command::new("mkfs.ext4")
            .args(["-q", "-F", "-O", "^has_journal", "-E", "lazy_itable_init=0,lazy_journal_init=0"])
            .arg(&image)
            .output()
            .unwrap();
        assert!(out.status.success(), "mkfs.ext4: {}", text(&out));
        let o = Command::new("du").args(["-s", "--block-size=1"]).arg(&image).output().unwrap();
        let used: u64 =
            String::from_utf8_lossy(&o.stdout).split_whitespace().next().unwrap().parse().unwrap();
        let size = format!("remount,size={}k", (used + 36 * MIB).div_ceil(1024) + 64);
        assert!(Command::new("mount").args(["-o", &size]).arg(&tmp.path).status().unwrap().success());
        std::fs::write(tmp.path.join("ballast"), vec![1u8; 32 << 20]).unwrap();
        let fs = Mount::new(dir.path(), &format!("m{i}"), &["-o", "loop", image.to_str().unwrap()]);
        let mut c = if how.is_empty() { Command::new("/usr/bin/python3") } else { Command::new(bin()) };
        if !how.is_empty() {
            c.args(how).arg("/usr/bin/python3");
        }
        let mut child = c
            .args(["-c", script, mode])
            .current_dir(&fs.path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let early = lines.next().map(|l| l.unwrap()).unwrap_or_default();
        std::fs::remove_file(tmp.path.join("ballast")).unwrap();
        writeln!(child.stdin.as_mut().unwrap()).unwrap();
        let fsync = lines.next().map(|l| l.unwrap()).unwrap_or_default();
        let out = child.wait_with_output().unwrap();
        let said = format!("{what}: {early} / {fsync} / {}", text(&out));
        eprintln!("{said}");
        match mode {
            "own" => {
                assert_ne!(early, "early 0", "{said}: the layout met no write error");
                assert_eq!(
                    fsync, "fsync 0",
                    "{said}: this kernel reported the error twice; the check below could not fail"
                );
            }
            _ if how.is_empty() => {
                assert_eq!(early, "early 0", "{said}: writeback ran before fsync without write-behind")
            }
            _ => {
                assert_ne!(early, "early 0", "{said}: write-behind met no error before fsync");
                assert_ne!(fsync, "fsync 0", "{said}: the program's fsync did not see the write error");
                assert!(fsync.starts_with("fsync "), "{said}");
            }
        }
        drop(fs);
        drop(tmp);
    }
}

/// btrfs refuses RWF_DONTCACHE (EOPNOTSUPP on 6.18). The library never uses it (buffered reads
/// with evict-behind measured faster: docs/run.md, bench/run_mechanism.sh), so a reader and a
/// writer on a loop-mounted btrfs leave the cache as they found it, under the library alone
/// and under the watcher. Bare, they leave the file cached: the check can fail.
#[test]
fn a_file_system_without_dontcache_is_covered_the_same() {
    if !root_or_skip("needs root for mount") {
        return;
    }
    need("mkfs.btrfs", "btrfs-progs");
    let dir = scratch();
    let fs = Mount::made(dir.path(), "btrfs", 512 * MIB, &["mkfs.btrfs", "-q", "-f"]);
    let d = &fs.path;
    let f = d.join("f");
    let size = 64 * MIB;
    random_file(&f, size);
    let dontcache = Command::new("/usr/bin/python3")
        .args(["-c", "import os; fd = os.open('f', os.O_RDONLY)\ntry:\n    os.preadv(fd, [bytearray(4096)], 0, 0x80); print('accepted')\nexcept OSError as e:\n    print(e.errno)"])
        .current_dir(d)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&dontcache.stdout).trim(),
        "95",
        "btrfs took RWF_DONTCACHE here: {}",
        text(&dontcache)
    );
    evict(&f);
    Command::new("sh").args(["-c", "cat f > /dev/null"]).current_dir(d).status().unwrap();
    assert!(
        cached(&f, 0, None) > size / 2,
        "a bare cat left little cached on btrfs: the check could not fail"
    );
    for watch in ["never", "always"] {
        evict(&f);
        warm(&f, 16 * MIB, 8 * MIB);
        let summary =
            run_sh_watch(d, "cat f > /dev/null && dd if=f of=g bs=1M status=none && sync -f g", watch);
        assert_kept(cached(&f, 16 * MIB, Some(8 * MIB)), 8 * MIB, watch);
        let rest = cached(&f, 0, Some(16 * MIB)) + cached(&f, 24 * MIB, None);
        let g = cached(&d.join("g"), 0, None);
        assert!(
            rest + g <= 2 * size / 100,
            "--watch {watch}: {rest} bytes of f and {g} of g left: {summary}"
        );
        assert!(same_contents(&f, &d.join("g")), "--watch {watch}: the copy differs");
    }
}

/// `--max-cache` bounds write-behind across the run: four writers in one process, 48 MiB each
/// in 1 MiB calls round robin, hold the blocks they left until their writeback is waited for,
/// up to four each (about 40 MiB together) by default, and at most 4 MiB of them beyond each
/// writer's current block with `--max-cache 4M`. The default run holding more is checked: the
/// bound can fail.
#[test]
fn max_cache_bounds_what_writers_hold() {
    let dir = scratch();
    let d = dir.path();
    let script = format!(
        "import os, subprocess, json\nfds = [os.open(f'w{{i}}', os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for i in range(4)]\n\
         buf = os.urandom(1 << 20)\nfor _ in range(48):\n    for fd in fds:\n        os.write(fd, buf)\n\
         out = subprocess.run(['{}', 'cache', 'stat', '--json', 'w0', 'w1', 'w2', 'w3'], capture_output=True, env={{}}).stdout\n\
         print(sum(x['cached_bytes'] for x in json.loads(out)))\n",
        bin()
    );
    let held = |extra: &[&str]| -> u64 {
        let out = Command::new(bin())
            .args(["run", "--watch", "never"])
            .args(extra)
            .args(["--", "/usr/bin/python3", "-c", &script])
            .current_dir(d)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
        for i in 0..4 {
            let w = d.join(format!("w{i}"));
            assert!(cached(&w, 0, None) <= MIB, "{extra:?}: w{i} left cached");
            assert_eq!(std::fs::metadata(&w).unwrap().len(), 48 * MIB);
        }
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    };
    let default = held(&[]);
    assert!(
        default >= 24 * MIB,
        "four writers held only {default} bytes by default: the check could not fail"
    );
    let bounded = held(&["--max-cache", "4M"]);
    // 4 MiB pending, plus each writer's current block (up to 2 MiB each).
    assert!(
        bounded <= 12 * MIB + MIB,
        "with --max-cache 4M four writers held {bounded} bytes (default {default})"
    );
}

/// The watcher marks the mounts of a mount namespace that CMD (and lightfoot run) get of
/// their own, a copy of the caller's: only opens made there wait for it. With the watcher
/// itself stopped, another process's open goes through at once (with whole file systems
/// marked it would wait: the first version did); CMD sees the same mount points as its
/// caller, and goes on once the watcher is let go.
#[test]
fn only_cmds_opens_wait_for_the_watcher() {
    if !root_or_skip("fanotify needs root") {
        return;
    }
    let dir = scratch();
    let f = dir.path().join("f");
    std::fs::write(&f, b"hello").unwrap();
    let mounts = |out: &[u8]| -> Vec<String> {
        let mut m: Vec<String> = String::from_utf8_lossy(out)
            .lines()
            .map(|l| l.split(' ').nth(4).unwrap_or_default().to_string())
            .collect();
        m.sort();
        m
    };
    let bare = Command::new("cat").arg("/proc/self/mountinfo").output().unwrap();
    let under = run(&["--watch", "always", "--", "cat", "/proc/self/mountinfo"]);
    assert!(under.status.success(), "{}", text(&under));
    assert_eq!(mounts(&under.stdout), mounts(&bare.stdout), "CMD sees other mount points");
    let (mut child, mut out, line) = spawn_until_line(
        Command::new(bin())
            .args(["run", "--watch", "always", "--", "sh", "-c", "echo ready; read x; cat f"])
            .current_dir(dir.path()),
    );
    assert_eq!(line, "ready\n");
    let lf = child.id();
    let children = std::fs::read_to_string(format!("/proc/{lf}/task/{lf}/children")).unwrap();
    let watcher: i32 = children
        .split_whitespace()
        .find(|p| {
            std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| c.windows(7).any(|w| w == b"__watch"))
        })
        .expect("no watcher process")
        .parse()
        .unwrap();
    // SAFETY: kill with integer arguments (kill(1) would open files: see above).
    assert_eq!(unsafe { libc::kill(watcher, libc::SIGSTOP) }, 0);
    let (tx, rx) = std::sync::mpsc::channel();
    let g = f.clone();
    std::thread::spawn(move || tx.send(std::fs::read(&g).map(|b| b.len())).unwrap());
    let got = rx.recv_timeout(std::time::Duration::from_secs(10));
    // SAFETY: as above.
    unsafe { libc::kill(watcher, libc::SIGCONT) };
    assert!(matches!(got, Ok(Ok(5))), "an open outside CMD waited for a stopped watcher: {got:?}");
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), b"go\n").unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert!(child.wait().unwrap().success());
    assert_eq!(rest, "hello");
}

/// `--max-cache` is one budget for the whole run, not one per process: two processes with two
/// writers each (48 MiB apiece in 1 MiB calls), both stopped at the end together, hold the
/// budget's 4 MiB of write-behind plus each writer's current 2 MiB block (12 MiB); a budget
/// per process would let them hold 16 MiB, and the default holds about 40.
#[test]
fn max_cache_is_one_budget_across_processes() {
    let dir = scratch();
    let d = dir.path();
    // Each process writes, says so with a file, waits for the other's, and the first one
    // measures; both then wait for `done`.
    let writer = format!(
        "import os, sys, time, subprocess, json\nme = sys.argv[1]\nfds = [os.open(f'w{{me}}{{i}}', os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for i in range(2)]\n\
         buf = os.urandom(1 << 20)\nfor _ in range(48):\n    for fd in fds:\n        os.write(fd, buf)\n\
         open(f'ready{{me}}', 'w').close()\nwhile not all(os.path.exists(f'ready{{p}}') for p in 'ab'):\n    time.sleep(0.01)\n\
         if me == 'a':\n    out = subprocess.run(['{}', 'cache', 'stat', '--json', 'wa0', 'wa1', 'wb0', 'wb1'], capture_output=True, env={{}}).stdout\n\
         \x20   print(sum(x['cached_bytes'] for x in json.loads(out)))\n    open('done', 'w').close()\n\
         while not os.path.exists('done'):\n    time.sleep(0.01)\n",
        bin()
    );
    std::fs::write(d.join("writer.py"), writer).unwrap();
    let held = |extra: &[&str]| -> u64 {
        for f in ["readya", "readyb", "done"] {
            let _ = std::fs::remove_file(d.join(f));
        }
        let out = Command::new(bin())
            .args(["run", "--watch", "never"])
            .args(extra)
            .args(["--", "sh", "-c", "/usr/bin/python3 writer.py a & /usr/bin/python3 writer.py b; wait"])
            .current_dir(d)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    };
    let default = held(&[]);
    assert!(
        default >= 24 * MIB,
        "two writer processes held only {default} bytes by default: the check could not fail"
    );
    let bounded = held(&["--max-cache", "4M"]);
    assert!(
        bounded <= 13 * MIB,
        "with --max-cache 4M two processes held {bounded} bytes: a budget per process? (default {default})"
    );
}
