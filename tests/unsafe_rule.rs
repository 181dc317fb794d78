//! The `unsafe` rule of STYLE.md, read off the source: `unsafe` lives in `src/io/sys/` alone,
//! and every `unsafe` block says why it is sound. (The preload library, `preload/`, is a cdylib
//! whose `unsafe` is its own business; `record/`, which it shares with this crate, has none.)
//!
//! The compiler enforces most of it, through lint levels at the crate roots: `lib.rs` and
//! `main.rs` deny `unsafe_code`, `io::sys` allows it back, `lib.rs` denies clippy's
//! `undocumented_unsafe_blocks`, and `record/src/lib.rs` forbids `unsafe_code`. This test keeps
//! those levels in place: it fails if a crate root loses its `deny`, if `unsafe` appears in
//! `src/` outside `io/sys/` or anywhere in `record/src/`, if a module there allows (or warns
//! about, or expects) `unsafe_code`, or if a test or example crate uses `unsafe` without
//! denying undocumented blocks. Comments, strings and character literals are blanked out
//! first, so that prose about `unsafe` does not count.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    files.sort();
    files
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `src` with comments and the contents of string and character literals replaced by spaces
/// (line breaks kept, so that line numbers still hold): what is left is code.
fn code_only(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let at = |k: usize| c.get(k).copied();
    let mut out = String::with_capacity(src.len());
    // Copies `c[from..to]` into `out` as spaces, keeping line breaks.
    let blank = |out: &mut String, from: usize, to: usize| {
        out.extend(c[from..to.min(c.len())].iter().map(|&ch| if ch == '\n' { '\n' } else { ' ' }))
    };
    let mut i = 0;
    while i < c.len() {
        let after_ident = i > 0 && is_ident(c[i - 1]);
        // Raw strings: r"…", r#"…"#, and their b and c forms (an `r#name` is an identifier).
        if !after_ident && matches!(c[i], 'r' | 'b' | 'c') {
            let r = if c[i] == 'r' { i } else { i + 1 };
            let mut q = r + 1;
            while at(q) == Some('#') {
                q += 1;
            }
            if at(r) == Some('r') && at(q) == Some('"') {
                let hashes = q - r - 1;
                out.extend(&c[i..=q]);
                let mut end = q + 1;
                while end < c.len() && !(c[end] == '"' && (1..=hashes).all(|h| at(end + h) == Some('#'))) {
                    end += 1;
                }
                blank(&mut out, q + 1, end);
                let close = (end + 1 + hashes).min(c.len());
                out.extend(&c[end.min(c.len())..close]);
                i = close;
                continue;
            }
        }
        let start = i;
        match (c[i], at(i + 1)) {
            ('/', Some('/')) => {
                while i < c.len() && c[i] != '\n' {
                    i += 1;
                }
                blank(&mut out, start, i);
            }
            ('/', Some('*')) => {
                // Block comments nest.
                let mut depth = 0;
                while i < c.len() {
                    match (c[i], at(i + 1)) {
                        ('/', Some('*')) => (depth, i) = (depth + 1, i + 2),
                        ('*', Some('/')) => (depth, i) = (depth - 1, i + 2),
                        _ => i += 1,
                    }
                    if depth == 0 {
                        break;
                    }
                }
                blank(&mut out, start, i);
            }
            ('"', _) => {
                i += 1;
                while i < c.len() && c[i] != '"' {
                    i += if c[i] == '\\' { 2 } else { 1 };
                }
                out.push('"');
                blank(&mut out, start + 1, i);
                out.push('"');
                i += 1;
            }
            // A character literal ('x', '\n', '\'', '\u{1F600}'); otherwise a lifetime ('a).
            ('\'', Some('\\')) => {
                i += 3;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                out.push('\'');
                blank(&mut out, start + 1, i);
                out.push('\'');
                i += 1;
            }
            ('\'', Some(_)) if at(i + 2) == Some('\'') => {
                out.push_str("' '");
                i += 3;
            }
            (ch, _) => {
                out.push(ch);
                i += 1;
            }
        }
    }
    out
}

/// Where the identifier `word` occurs in `code`: (byte offset, line from 1).
fn occurrences(code: &str, word: &str) -> Vec<(usize, usize)> {
    code.match_indices(word)
        .map(|(k, _)| k)
        .filter(|&k| !code[..k].ends_with(is_ident) && !code[k + word.len()..].starts_with(is_ident))
        .map(|k| (k, code[..k].matches('\n').count() + 1))
        .collect()
}

/// The lines (from 1) where the identifier `word` occurs in `code`.
fn lines_with(code: &str, word: &str) -> Vec<usize> {
    let mut lines: Vec<usize> = occurrences(code, word).into_iter().map(|(_, line)| line).collect();
    lines.dedup();
    lines
}

/// The attributes of `code` that name `lint`, each as (its text from `#` to the lint name with
/// the spaces taken out, as in `#![deny(` or `#[cfg_attr(test,allow(`; its line). A mention
/// outside any attribute comes with an empty text, which sets no level.
fn attributes_naming(code: &str, lint: &str) -> Vec<(String, usize)> {
    occurrences(code, lint)
        .into_iter()
        .map(|(k, line)| {
            let attr = code[..k].rfind('#').map(|h| &code[h..k]).unwrap_or_default();
            (attr.chars().filter(|c| !c.is_whitespace()).collect(), line)
        })
        .collect()
}

/// The lint level an attribute text sets (`allow`, `deny`, …): the name before its last `(`.
fn level(attr: &str) -> &str {
    let head = &attr[..attr.rfind('(').unwrap_or(0)];
    let from = head.rfind(|c: char| !is_ident(c)).map_or(0, |k| k + 1);
    &head[from..]
}

/// Whether `code` denies (or forbids) `lint` for the whole crate: `#![deny(…)]`, not under a
/// `cfg_attr`.
fn denies_crate_wide(code: &str, lint: &str) -> bool {
    attributes_naming(code, lint).iter().any(|(attr, _)| {
        let rest = attr.strip_prefix("#![deny(").or_else(|| attr.strip_prefix("#![forbid("));
        rest.is_some_and(|r| r.chars().all(|c| is_ident(c) || c == ',' || c == ':'))
    })
}

fn relative(path: &Path) -> String {
    path.strip_prefix(root()).unwrap_or(path).display().to_string()
}

#[test]
fn unsafe_code_is_denied_at_the_crate_roots() {
    for root_file in ["src/lib.rs", "src/main.rs", "record/src/lib.rs"] {
        let code = code_only(&read(&root().join(root_file)));
        assert!(denies_crate_wide(&code, "unsafe_code"), "{root_file} lacks #![deny(unsafe_code)]");
    }
    let lib = code_only(&read(&root().join("src/lib.rs")));
    assert!(
        denies_crate_wide(&lib, "undocumented_unsafe_blocks"),
        "src/lib.rs lacks #![deny(clippy::undocumented_unsafe_blocks)]"
    );
}

#[test]
fn no_module_outside_io_sys_uses_or_allows_unsafe() {
    let sys = root().join("src/io/sys");
    let mut wrong = Vec::new();
    for path in rust_files(&root().join("src")).into_iter().chain(rust_files(&root().join("record/src"))) {
        if path.starts_with(&sys) {
            continue;
        }
        let code = code_only(&read(&path));
        for line in lines_with(&code, "unsafe") {
            wrong.push(format!("{}:{line}: unsafe", relative(&path)));
        }
        for (attr, line) in attributes_naming(&code, "unsafe_code") {
            if !matches!(level(&attr), "deny" | "forbid") {
                wrong.push(format!("{}:{line}: {attr}unsafe_code", relative(&path)));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "unsafe outside src/io/sys/ (STYLE.md: unsafe lives in one module; record/ has none):\n{}",
        wrong.join("\n")
    );
}

#[test]
fn test_and_example_crates_with_unsafe_deny_undocumented_blocks() {
    // Each file directly in tests/ and examples/ is a crate root (tests/common is a module).
    let mut roots: Vec<PathBuf> = ["tests", "examples"]
        .iter()
        .flat_map(|d| std::fs::read_dir(root().join(d)).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .collect();
    roots.sort();
    assert!(roots.iter().any(|p| p.ends_with("tests/unsafe_rule.rs")), "no crates found");
    let mut wrong = Vec::new();
    for path in roots {
        let code = code_only(&read(&path));
        if !lines_with(&code, "unsafe").is_empty() && !denies_crate_wide(&code, "undocumented_unsafe_blocks")
        {
            wrong.push(relative(&path));
        }
    }
    assert!(
        wrong.is_empty(),
        "these use unsafe without #![deny(clippy::undocumented_unsafe_blocks)]:\n{}",
        wrong.join("\n")
    );
}

/// The checks above are only as good as the reading of the source: it must see `unsafe` in
/// code, and only there.
#[test]
fn the_reading_sees_code_not_comments_or_literals() {
    let src = r####"//! unsafe in a doc comment
let a = "unsafe \" unsafe"; // unsafe
/* unsafe /* nested unsafe */ unsafe */ let b = 1;
let c = r#"unsafe " unsafe"#; let d = b"unsafe"; let e = '"'; let f = 'x';
fn g<'a>(x: &'a str) -> &'a str { unsafe { x } }
let h = br##"unsafe"##; let not_unsafe = is_unsafe; let i = '\''; let j = c"unsafe";
#![allow(dead_code, unsafe_code)]
#[cfg_attr(test, allow(
    unsafe_code))]
#![deny(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]
"####;
    let code = code_only(src);
    assert_eq!(code.lines().count(), src.lines().count());
    assert_eq!(lines_with(&code, "unsafe"), vec![5]);
    let attrs = attributes_naming(&code, "unsafe_code");
    let levels: Vec<(&str, usize)> = attrs.iter().map(|(a, l)| (level(a), *l)).collect();
    assert_eq!(levels, vec![("allow", 7), ("allow", 9), ("deny", 10)]);
    assert!(denies_crate_wide(&code, "unsafe_code"));
    assert!(denies_crate_wide(&code, "undocumented_unsafe_blocks"));
    assert!(!denies_crate_wide(&code_only("#![cfg_attr(test, deny(unsafe_code))]"), "unsafe_code"));
    assert!(!denies_crate_wide(&code_only("// #![deny(unsafe_code)]"), "unsafe_code"));
}
