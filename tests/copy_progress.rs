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
    if !root_or_skip("a_failed_copy_never_reaches_100: needs root to mount a small tmpfs") {
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
