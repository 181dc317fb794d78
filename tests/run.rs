//! `lightfoot run -- CMD`: the command's output, status and signals are its own, and what its
//! reads and writes bring into the page cache is gone when it ends while what was cached
//! before stays (docs/run.md).

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::*;

const MIB: u64 = 1 << 20;

/// `lightfoot run ARGS…`, stdout and stderr captured.
fn run(args: &[&str]) -> Output {
    Command::new(bin()).arg("run").args(args).output().unwrap()
}

/// `sh -c SCRIPT` under `lightfoot run --json`, in `dir`; asserts success; the JSON summary.
fn run_sh(dir: &Path, script: &str) -> serde_json::Value {
    let out = Command::new(bin())
        .args(["run", "--json", "--", "sh", "-c", script])
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{script}: {}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    let last = err.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{script}: no JSON summary ({e}): {err}"))
}

/// What a `/usr/bin/python3 -c SCRIPT` run in `dir` printed, as a number: bare, or under
/// `lightfoot run`.
fn printed_by(dir: &Path, script: &str, under: bool) -> u64 {
    let mut c = Command::new(if under { bin() } else { "/usr/bin/python3" });
    if under {
        c.args(["run", "--", "/usr/bin/python3"]);
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
    }
}

/// Pipes, sockets and O_DIRECT files pass through untouched: not looked at, not reported,
/// and what O_DIRECT leaves of the cache is as it was.
#[test]
fn pipes_and_o_direct_pass_through() {
    let dir = scratch();
    let d = dir.path();
    let out = Command::new(bin())
        .args(["run", "--json", "--", "sh", "-c", "head -c 64M /dev/zero | cat | wc -c"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "67108864");
    let err = String::from_utf8_lossy(&out.stderr);
    let summary: serde_json::Value = serde_json::from_str(err.lines().last().unwrap()).unwrap();
    assert_eq!(summary["files"].as_array().unwrap().len(), 0, "a pipe or /dev/zero was looked at: {summary}");
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
        .args(["run", "--", "/usr/bin/python3", "-c", &script])
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
