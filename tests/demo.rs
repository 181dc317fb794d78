//! `make demo` (scripts/demo.sh) on a machine with and without nbdcopy: the serve step is
//! shown either way, read back through nbdcopy or through lightfoot's own NBD client.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;

/// A PATH directory with every command of this machine's but those in `without`.
fn path_without(dir: &Path, without: &[&str]) -> String {
    let bin = dir.join("bin");
    std::fs::create_dir(&bin).unwrap();
    for d in ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"] {
        for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
            let name = e.file_name();
            if !without.iter().any(|w| name == *w) && !bin.join(&name).exists() {
                let _ = std::os::unix::fs::symlink(e.path(), bin.join(&name));
            }
        }
    }
    bin.to_str().unwrap().to_string()
}

fn demo(dir: &Path, path: &str) -> String {
    let out = Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/demo.sh"))
        .env("PATH", path)
        .env("LIGHTFOOT", bin())
        .env("DEMO_DIR", dir.join("demo"))
        .env("DEMO_MIB", "256")
        .output()
        .unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "demo failed: {said}");
    assert!(said.contains("copy: identical"), "{said}");
    assert!(said.contains("served read-back: identical"), "the serve step was not shown: {said}");
    said
}

#[test]
fn the_demo_serves_without_nbdcopy() {
    let dir = scratch();
    let path = path_without(dir.path(), &["nbdcopy"]);
    let said = demo(dir.path(), &path);
    assert!(said.contains("through lightfoot copy, lightfoot's own NBD client"), "{said}");
}

#[test]
fn the_demo_uses_nbdcopy_where_it_is_installed() {
    if !tool_or_skip("nbdcopy", "libnbd-bin") {
        return;
    }
    let dir = scratch();
    let said = demo(dir.path(), &std::env::var("PATH").unwrap());
    assert!(said.contains("read back over NBD through nbdcopy"), "{said}");
}
