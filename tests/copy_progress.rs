//! `lightfoot copy --progress=FD`: the lines nbdcopy writes for virt-v2v and other tools
//! (`N/100`, never going back, `0/100` first, `100/100` last and only on success), and a
//! descriptor that is closed or whose reader goes away never failing the copy.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::*;

/// `sh -c SCRIPT` in `dir`, with `$LF` the binary under test.
fn sh(dir: &Path, script: &str) -> Output {
    Command::new("sh").args(["-c", script]).env("LF", bin()).current_dir(dir).output().unwrap()
}

/// The percentages in `lines`, checked line by line against `^(100|[1-9]?[0-9])/100$` and
/// for never going back.
fn percents(lines: &str) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::new();
    for l in lines.lines() {
        let n: u32 = l.strip_suffix("/100").and_then(|n| n.parse().ok()).unwrap_or(999);
        assert!(n <= 100 && format!("{n}/100") == l, "a line that is not N/100: {l:?} in {lines:?}");
        assert!(out.last().is_none_or(|&p| p < n), "went back or repeated: {lines:?}");
        out.push(n);
    }
    assert!(lines.is_empty() || lines.ends_with('\n'), "a line left unfinished: {lines:?}");
    out
}

#[test]
fn progress_fd_lines_are_nbdcopys() {
    let dir = scratch();
    let d = dir.path();
    random_file(&d.join("src"), 256 * MIB);
    let out = sh(d, "$LF copy --progress=3 src dst 3>prog");
    assert!(out.status.success(), "{}", text(&out));
    assert!(same_contents(&d.join("src"), &d.join("dst")), "the copy differs");
    let p = percents(&std::fs::read_to_string(d.join("prog")).unwrap());
    assert_eq!(p.first(), Some(&0), "{p:?}");
    assert_eq!(p.last(), Some(&100), "{p:?}");
    eprintln!("256 MiB: {p:?}");
    // A size not known in advance (a pipe): 0/100, then 100/100 at the end.
    let out = sh(d, "cat src | $LF copy --progress=3 - piped 3>prog");
    assert!(out.status.success(), "{}", text(&out));
    assert!(same_contents(&d.join("src"), &d.join("piped")), "the piped copy differs");
    assert_eq!(percents(&std::fs::read_to_string(d.join("prog")).unwrap()), [0, 100]);
    // The value only with '=': `--progress SRC DST` is the bar and two endpoints.
    let out = sh(d, "$LF copy --progress src bar");
    assert!(out.status.success(), "{}", text(&out));
    assert!(same_contents(&d.join("src"), &d.join("bar")), "the copy with --progress differs");
}

#[test]
fn a_closed_or_abandoned_progress_fd_never_fails_the_copy() {
    let dir = scratch();
    let d = dir.path();
    random_file(&d.join("src"), 64 * MIB);
    // Not open at all.
    let out = sh(d, "$LF copy --progress=7 src a");
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("--progress=7: descriptor 7 cannot be used"), "{}", text(&out));
    assert!(same_contents(&d.join("src"), &d.join("a")), "the copy differs");
    // A reader that takes the first line and goes.
    let out = Command::new("bash")
        .args([
            "-c",
            "set -o pipefail; $LF copy --progress=3 src b 3>&1 >/dev/null | head -n 1; echo status $?",
        ])
        .env("LF", bin())
        .current_dir(d)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.starts_with("0/100\n"), "{said} {}", text(&out));
    assert!(
        said.contains("status 0"),
        "the copy failed when its progress reader went: {said} {}",
        text(&out)
    );
    assert!(same_contents(&d.join("src"), &d.join("b")), "the copy differs");
    // Standard output when it carries the data: refused before anything is opened.
    let out = sh(d, "$LF copy --progress=1 src - > c");
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("standard output carries the copy's data"), "{}", text(&out));
    assert_eq!(std::fs::metadata(d.join("c")).unwrap().len(), 0, "data went out anyway");
}

/// A copy that fails never says 100/100.
#[test]
fn a_failed_copy_never_reaches_100() {
    if !root_or_skip("needs root to mount a small tmpfs") {
        return;
    }
    let dir = scratch();
    let d = dir.path();
    random_file(&d.join("src"), 32 * MIB);
    let mnt = Mount::new(d, "small", &["-t", "tmpfs", "-o", "size=8m", "tmpfs"]);
    let out = sh(d, &format!("$LF copy --progress=3 src {}/dst 3>prog", mnt.path.display()));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let p = percents(&std::fs::read_to_string(d.join("prog")).unwrap());
    assert_eq!(p.first(), Some(&0), "{p:?}");
    assert!(p.last().is_some_and(|&l| l < 100), "a failed copy said {p:?}");
}

/// `lightfoot cache stat --json FILE`: its cached bytes.
fn cache_stat(path: &Path) -> u64 {
    let out = lightfoot(&["cache", "stat", "--json", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    let s = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(&s)
        .ok()
        .map(|v: serde_json::Value| if v.is_array() { v[0].clone() } else { v })
        .unwrap_or_else(|| serde_json::from_str(s.lines().next().unwrap()).unwrap());
    v["cached_bytes"].as_u64().unwrap_or_else(|| panic!("no cached_bytes in {s}"))
}

/// `--footprint=FD`: JSON lines while the copy runs and one at the end, whose page cache of
/// SRC and DST is what `lightfoot cache stat` says afterwards; what it says was evicted is
/// what the copy brought in (SRC's part not cached before, and all of DST).
#[test]
fn footprint_lines_end_where_cache_stat_does() {
    let dir = scratch();
    let d = dir.path();
    let (src, dst) = (d.join("src"), d.join("dst"));
    random_file(&src, 128 * MIB);
    for args in
        [&[][..], &["--cache=drop"], &["--read-mechanism=evict-behind", "--write-mechanism=write-behind"]]
    {
        let _ = std::fs::remove_file(&dst);
        evict(&src);
        warm(&src, 0, 32 * MIB);
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("$LF copy --footprint=3 {} src dst 3>footprint", args.join(" ")))
            .env("LF", bin())
            .current_dir(d)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {}", text(&out));
        let lines = std::fs::read_to_string(d.join("footprint")).unwrap();
        let records: Vec<serde_json::Value> =
            lines.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect();
        assert!(records.len() >= 2, "{args:?}: {lines}");
        assert!(records[..records.len() - 1].iter().all(|r| r["end"] == false), "{lines}");
        let last = records.last().unwrap();
        assert_eq!(last["end"], true, "{lines}");
        assert_eq!(last["done"], 128 * MIB, "{lines}");
        assert_eq!(last["source"]["cached"], cache_stat(&src), "{args:?}: {lines}");
        assert_eq!(last["destination"]["cached"], cache_stat(&dst), "{args:?}: {lines}");
        // The 32 MiB warmed, but for the few pages the host's reclaim may take before the
        // copy starts (4 KiB once, in a clean-clone run).
        assert_kept(
            last["source"]["cached_before"].as_u64().unwrap(),
            32 * MIB,
            &format!("cached_before: {lines}"),
        );
        let evicted = last["evicted"].as_u64().unwrap();
        // --cache=drop drops SRC's cached 32 MiB too.
        let expected = if args.contains(&"--cache=drop") { 256 * MIB } else { 224 * MIB };
        assert!(
            expected - 2 * MIB <= evicted && evicted <= expected + 2 * MIB,
            "{args:?}: evicted {evicted}, expected about {expected}: {lines}"
        );
        let held = last["held"].as_u64().unwrap();
        assert!(held <= MIB, "{args:?}: still held {held} at the end: {lines}");
        assert!(same_contents(&src, &dst), "the copy differs");
    }
    // Standard output when it carries the data: refused.
    let out = Command::new("sh")
        .args(["-c", "$LF copy --footprint=1 src - > c"])
        .env("LF", bin())
        .current_dir(d)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}
