//! Replays the kept fuzz inputs through the same harnesses cargo-fuzz runs
//! (`lightfoot::testing::fuzz`), on stable Rust: the minimised corpus of each target
//! (`fuzz/corpus/<target>/`) and every crash the fuzzers found (`fuzz/regressions/<target>/`,
//! each fixed by the commit that added it). `FUZZ_REPLAY=path` replays one file only, on the
//! target named by its directory.

use std::path::{Path, PathBuf};

use lightfoot::testing::fuzz;

fn inputs(target: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut files = Vec::new();
    for dir in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else { continue };
        files.extend(entries.map(|e| e.unwrap().path()).filter(|p| p.is_file()));
    }
    files.sort();
    if let Ok(one) = std::env::var("FUZZ_REPLAY") {
        let one = PathBuf::from(one);
        let parent = one.parent().and_then(|p| p.file_name()).and_then(|n| n.to_str());
        return if parent == Some(target) { vec![one] } else { vec![] };
    }
    files
}

fn replay(target: &str, run: fn(&[u8]), at_least: usize) {
    let files = inputs(target);
    if std::env::var("FUZZ_REPLAY").is_err() {
        assert!(
            files.len() >= at_least,
            "{target}: {} inputs kept, expected at least {at_least}",
            files.len()
        );
    }
    for f in files {
        let data = std::fs::read(&f).unwrap();
        let r = std::panic::catch_unwind(|| run(&data));
        assert!(r.is_ok(), "{target}: {} fails (replay alone: FUZZ_REPLAY={})", f.display(), f.display());
    }
}

#[test]
fn handshake() {
    replay("handshake", fuzz::handshake::run, 4);
}

#[test]
fn request() {
    replay("request", fuzz::request::run, 2);
}

#[test]
fn bitmap() {
    replay("bitmap", fuzz::bitmap::run, 4);
}

#[test]
fn s3_records() {
    replay("s3_records", fuzz::s3_records::run, 4);
}

#[test]
fn connection() {
    replay("connection", fuzz::connection::run, 8);
}
