//! `make install`: the binary, a man page per command and the bash, zsh and fish completions,
//! the last two generated from the clap definitions by the binary being installed
//! (`lightfoot __generate`). Every page must render with man(1) and pass mandoc's lint.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;

/// Every page `make install` writes: its file, the command as the page's synopsis spells it,
/// and a flag the page must describe.
const PAGES: &[(&str, &str, &str)] = &[
    ("lightfoot.1", "lightfoot", "--version"),
    ("lightfoot-copy.1", "lightfoot copy", "--request-size"),
    ("lightfoot-serve.1", "lightfoot serve", "--prefetch"),
    ("lightfoot-cache.1", "lightfoot cache", "--help"),
    ("lightfoot-cache-stat.1", "lightfoot cache stat", "--range"),
    ("lightfoot-cache-evict.1", "lightfoot cache evict", "--sync"),
    ("lightfoot-run.1", "lightfoot run", "--json"),
    ("lightfoot-bitmap.1", "lightfoot bitmap", "--help"),
    ("lightfoot-bitmap-list.1", "lightfoot bitmap list", "--json"),
    ("lightfoot-bitmap-show.1", "lightfoot bitmap show", "--bitmaps"),
    ("lightfoot-bitmap-add.1", "lightfoot bitmap add", "--granularity"),
    ("lightfoot-bitmap-remove.1", "lightfoot bitmap remove", "--bitmaps"),
    ("lightfoot-bitmap-clear.1", "lightfoot bitmap clear", "--bitmaps"),
    ("lightfoot-bitmap-enable.1", "lightfoot bitmap enable", "--bitmaps"),
    ("lightfoot-bitmap-disable.1", "lightfoot bitmap disable", "--bitmaps"),
    ("lightfoot-bitmap-merge.1", "lightfoot bitmap merge", "--bitmaps"),
];

/// mandoc messages that come from clap_mangen's own markup, which we cannot change; any other
/// message, at any level from style up, fails the test (the DETAILS and SEE ALSO sections are
/// roff we write ourselves, so even a style message there is ours to fix).
const MANDOC_TOLERATED: &[&str] = &[
    // clap_mangen writes each help text as one input line (and we each line of the text after
    // the options): roff fills them to the reader's width, only the source is long.
    "STYLE: input text line longer than 80 bytes",
    // clap_mangen's synopsis puts a space after its last item.
    "STYLE: whitespace at end of input line",
    // clap_mangen's "Possible values" list (serve --tls) starts with `.br`, a blank line and
    // `.br`: mandoc drops the redundant breaks, and both formatters show the blank line meant.
    "WARNING: skipping paragraph macro: br before sp",
    "WARNING: skipping paragraph macro: br after sp",
];

/// `make -C <this repository> ARGS`, as a user would run it.
fn make(args: &[String]) -> Output {
    need("make", "make");
    Command::new("make")
        .args(["-s", "--no-print-directory", "-C", env!("CARGO_MANIFEST_DIR")])
        .args(args)
        // Under `make test` the outer make's flags and jobserver are in the environment.
        .env_remove("MAKEFLAGS")
        .env_remove("MFLAGS")
        .env_remove("MAKELEVEL")
        .output()
        .expect("run make")
}

/// `make install DESTDIR=<tmp> PREFIX=/usr` with the binary under test (its dep-info beside
/// it, as `make` leaves it); the DESTDIR and its `usr`.
fn install() -> (tempfile::TempDir, PathBuf) {
    let dest = tempfile::tempdir().unwrap();
    let out = make(&[
        "install".into(),
        format!("DESTDIR={}", dest.path().display()),
        "PREFIX=/usr".into(),
        format!("BIN={}", bin()),
    ]);
    assert!(out.status.success(), "make install failed: {}", text(&out));
    let usr = dest.path().join("usr");
    (dest, usr)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn install_puts_the_binary_pages_and_completions_where_debian_looks() {
    let (_dest, usr) = install();
    let version = Command::new(usr.join("bin/lightfoot")).arg("--version").output().unwrap();
    assert_eq!(text(&version).trim(), format!("lightfoot {}", env!("CARGO_PKG_VERSION")));

    let mut pages: Vec<String> = std::fs::read_dir(usr.join("share/man/man1"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    pages.sort();
    let mut want: Vec<String> = PAGES.iter().map(|p| p.0.to_string()).collect();
    want.sort();
    assert_eq!(pages, want, "a page per command, named as git and nbdkit name theirs");

    // `lightfoot run`'s library, found by the installed binary in ../lib/lightfoot/.
    let lib = usr.join("lib/lightfoot/liblightfoot_preload.so");
    assert!(lib.is_file(), "no {}", lib.display());
    let out = Command::new(usr.join("bin/lightfoot"))
        .args(["run", "--", "sh", "-c", "echo \"$LD_PRELOAD\""])
        .env_remove("LD_PRELOAD")
        .env_remove("LIGHTFOOT_PRELOAD")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), lib.canonicalize().unwrap().to_str().unwrap());

    let zsh = read(&usr.join("share/zsh/vendor-completions/_lightfoot"));
    assert!(zsh.starts_with("#compdef lightfoot"), "zsh completion: {zsh:.200}");
    let fish = read(&usr.join("share/fish/vendor_completions.d/lightfoot.fish"));
    assert!(fish.contains("complete -c lightfoot"), "fish completion: {fish:.200}");
    for (what, script) in [("zsh", &zsh), ("fish", &fish)] {
        assert!(!script.contains("__generate"), "{what} completion offers the internal command");
    }
}

/// The bash completion loads, and completes commands and flags (not the internal generator).
#[test]
fn bash_completes_commands_and_flags() {
    let (_dest, usr) = install();
    let script = usr.join("share/bash-completion/completions/lightfoot");
    // Each case: the words typed so far (the last one being completed), then what must be
    // offered and what must not.
    let probe = |words: &str| -> String {
        let cmd = format!(
            "source '{}' && complete -p lightfoot >/dev/null && COMP_WORDS=({words}) && \
             COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1)) && \
             _lightfoot lightfoot \"${{COMP_WORDS[COMP_CWORD]}}\" \"${{COMP_WORDS[COMP_CWORD-1]}}\" && \
             echo \"${{COMPREPLY[*]}}\"",
            script.display()
        );
        let out = tool("bash", "bash").args(["--norc", "-c", &cmd]).output().unwrap();
        assert!(out.status.success(), "bash completion for `{words}` failed: {}", text(&out));
        String::from_utf8(out.stdout).unwrap()
    };
    let offered = probe("lightfoot ''");
    for command in ["copy", "serve", "cache", "run"] {
        assert!(offered.split_whitespace().any(|w| w == command), "{command} not offered: {offered}");
    }
    assert!(!offered.contains("__generate"), "the internal command is offered: {offered}");
    let offered = probe("lightfoot copy --req");
    assert_eq!(offered.trim(), "--request-size");
    let offered = probe("lightfoot cache stat --");
    assert!(offered.split_whitespace().any(|w| w == "--range"), "--range not offered: {offered}");
}

#[test]
fn every_page_renders_with_man() {
    need("man", "man-db");
    let (_dest, usr) = install();
    let dir = usr.join("share/man/man1");
    for (file, command, flag) in PAGES {
        // The C locale gives ASCII hyphens (UTF-8 would print U+2010 in "lightfoot-copy").
        let out = Command::new("man")
            .args(["-P", "cat", "-l"])
            .arg(dir.join(file))
            .env("LC_ALL", "C")
            .env("MANWIDTH", "80")
            .env_remove("MANPAGER")
            .env_remove("MAN_KEEP_FORMATTING")
            .output()
            .unwrap();
        let page = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && !page.trim().is_empty(), "man -l {file}: {}", text(&out));
        // Words, not spacing: a synopsis may be wrapped.
        let words = page.split_whitespace().collect::<Vec<_>>().join(" ");
        let title = file.trim_end_matches(".1").to_uppercase();
        for want in [&*format!("{title}(1)"), command, flag, "SEE ALSO", env!("CARGO_PKG_VERSION")] {
            assert!(words.contains(want), "{file} rendered without {want:?}:\n{page}");
        }
        assert!(!page.contains("__generate"), "{file} shows the internal command:\n{page}");
    }
}

#[test]
fn every_page_passes_mandoc_lint() {
    need("mandoc", "mandoc");
    let (_dest, usr) = install();
    let dir = usr.join("share/man/man1");
    for (file, _, _) in PAGES {
        // -W style: every level mandoc has (style, warning, error, unsupported).
        let out =
            Command::new("mandoc").args(["-T", "lint", "-W", "style"]).arg(dir.join(file)).output().unwrap();
        let messages = String::from_utf8_lossy(&out.stdout);
        let untolerated: Vec<&str> =
            messages.lines().filter(|m| !MANDOC_TOLERATED.iter().any(|t| m.contains(t))).collect();
        // 0: no message; 1: style only; 2: warnings. 3 and up are errors, unsupported
        // features or mandoc's own failures, never tolerated.
        assert!(
            untolerated.is_empty() && matches!(out.status.code(), Some(0..=2)),
            "mandoc -T lint {file} (status {:?}):\n{}\n{}",
            out.status.code(),
            untolerated.join("\n"),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `make install` runs as root and must not build: without a binary, or with a binary or a
/// preload library older than the sources it was built from, it stops and says to run `make`,
/// installing nothing.
#[test]
fn install_refuses_a_missing_or_stale_binary() {
    let scratch = tempfile::tempdir().unwrap();
    let dest = scratch.path().join("dest");
    let try_install = |binary: &Path| {
        make(&["install".into(), format!("DESTDIR={}", dest.display()), format!("BIN={}", binary.display())])
    };

    let out = try_install(&scratch.path().join("missing"));
    assert!(!out.status.success() && text(&out).contains("is missing: run `make` first"), "{}", text(&out));
    assert!(!dest.exists(), "installed without a binary");

    // Copies of the binary and of `lightfoot run`'s library with their dep-info; one of them
    // at a time dated before the sources it names.
    let stale = scratch.path().join("lightfoot");
    let lib = Path::new(bin()).with_file_name("liblightfoot_preload");
    for (from, to) in [
        (PathBuf::from(bin()), stale.clone()),
        (PathBuf::from(format!("{}.d", bin())), scratch.path().join("lightfoot.d")),
        (lib.with_extension("so"), scratch.path().join("liblightfoot_preload.so")),
        (lib.with_extension("d"), scratch.path().join("liblightfoot_preload.d")),
    ] {
        std::fs::copy(&from, &to).unwrap_or_else(|e| panic!("{}: {e}", from.display()));
    }
    let date = |path: &Path, secs: u64| {
        let t = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(secs);
        std::fs::File::options().write(true).open(path).unwrap().set_modified(t).unwrap();
    };
    let (old, now) =
        (946_684_800, std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs());
    for outdated in [stale.clone(), scratch.path().join("liblightfoot_preload.so")] {
        date(&stale, now);
        date(&scratch.path().join("liblightfoot_preload.so"), now);
        date(&outdated, old);
        let out = try_install(&stale);
        assert!(!out.status.success() && text(&out).contains("is older than"), "{}", text(&out));
        assert!(text(&out).contains(&format!("{} is older", outdated.display())), "{}", text(&out));
        assert!(text(&out).contains("run `make` first"), "{}", text(&out));
        assert!(!dest.exists(), "installed a stale {}", outdated.display());
    }
}
