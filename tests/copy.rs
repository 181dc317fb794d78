//! `lightfoot copy` end to end: content, sparseness, page-cache footprint, endpoints, errors.

// A test crate of its own, outside the library's `deny(unsafe_code)`: it calls libc where std
// has no way (marked at each call); each `unsafe` block says why it is sound.
#![deny(clippy::undocumented_unsafe_blocks)]

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use common::*;

const SIZE: u64 = 96 * MIB;
const PIECE: u64 = 4 * MIB;

fn copy(args: &[&str]) -> std::process::Output {
    let mut all = vec!["copy"];
    all.extend_from_slice(args);
    lightfoot(&all)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn copies_content_and_keeps_holes() {
    let dir = scratch();
    let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
    sample(&src, SIZE, PIECE);
    let out = copy(&[s(&src), s(&dst)]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("copied 96.0 MiB"), "{}", text(&out));
    assert_eq!(std::fs::metadata(&dst).unwrap().len(), SIZE);
    // Data pieces minus the all-zero one: holes and zeroes are not allocated.
    assert!(allocated(&dst) <= allocated(&src) - PIECE, "dst {} src {}", allocated(&dst), allocated(&src));
    assert!(same_contents(&src, &dst));
}

/// The neutral contract, for each mechanism a kernel may end up using: pages cached before
/// stay, pages the job brought in are gone (source and destination).
#[test]
fn neutral_leaves_the_cache_as_found() {
    type Case<'a> = (&'a str, &'a [&'a str], &'a [(&'a str, &'a str)]);
    let cases: &[Case] = &[
        ("default", &[], &[]),
        ("no dontcache (O_DIRECT reads)", &[], &[("LIGHTFOOT_NO_DONTCACHE", "1")]),
        ("evict-behind reads", &["--read-mechanism", "evict-behind", "--no-dontcache"], &[]),
        ("write-behind writes", &["--write-mechanism", "write-behind"], &[]),
        ("one worker, small requests", &["-j", "1", "--request-size", "256K"], &[]),
    ];
    let dir = scratch();
    let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
    sample(&src, SIZE, PIECE);
    // The working set: 16 MiB in the middle, cached before the job.
    let (ws, ws_len) = (32 * MIB, 16 * MIB);
    for (name, args, env) in cases {
        let mut out = None;
        let kept = kept_despite_host_reclaim(dir.path(), ws_len, name, || {
            evict(&src);
            warm(&src, ws, ws_len);
            assert_eq!(cached(&src, ws, Some(ws_len)), ws_len);
            assert_eq!(cached(&src, 0, None), ws_len, "only the working set is cached before the job");
            let mut cmd = Command::new(bin());
            cmd.arg("copy").args(*args).args(["--json", s(&src), s(&dst)]);
            for (k, v) in *env {
                cmd.env(k, v);
            }
            let o = cmd.output().unwrap();
            assert!(o.status.success(), "{name}: {}", text(&o));
            out = Some(o);
            cached(&src, ws, Some(ws_len))
        });
        let out = out.unwrap();
        // Outside the working set, allowing one 2 MiB folio at each edge.
        let before = cached(&src, 0, Some(ws - 2 * MIB));
        let after = cached(&src, ws + ws_len + 2 * MIB, None);
        let dst_cached = cached(&dst, 0, None);
        assert_kept(kept, ws_len, name);
        assert!(before + after <= SIZE / 100, "{name}: source left {} bytes cached", before + after);
        assert!(dst_cached <= SIZE / 100, "{name}: destination left {dst_cached} bytes cached");
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json["ok"], true);
        assert_eq!(json["bytes"], SIZE);
        assert!(json["source"]["mechanism"]["read"].is_string(), "{json}");
        assert!(same_contents(&src, &dst), "{name}: contents differ");
    }
}

#[test]
fn keep_keeps_and_drop_drops() {
    let dir = scratch();
    let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
    sample(&src, SIZE, PIECE);
    let out = copy(&["--cache=keep", s(&src), s(&dst)]);
    assert!(out.status.success(), "{}", text(&out));
    // Buffered reads of the data pieces leave them cached.
    assert!(cached(&src, 0, None) >= SIZE / 4, "keep left only {}", cached(&src, 0, None));
    let out = copy(&["--cache=drop", s(&src), s(&dst)]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(cached(&src, 0, None) <= SIZE / 100, "drop left {}", cached(&src, 0, None));
    assert!(cached(&dst, 0, None) <= SIZE / 100, "drop left {} of dst", cached(&dst, 0, None));
    let out = copy(&["--cache=direct", s(&src), s(&dst)]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(cached(&dst, 0, None) <= SIZE / 100);
    assert!(same_contents(&src, &dst));
}

#[test]
fn no_sparse_and_preallocate_allocate_everything() {
    let dir = scratch();
    let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
    sample(&src, 16 * MIB, MIB);
    for flag in ["--no-sparse", "--preallocate"] {
        let out = copy(&[flag, s(&src), s(&dst)]);
        assert!(out.status.success(), "{flag}: {}", text(&out));
        assert!(allocated(&dst) >= 16 * MIB, "{flag}: only {} allocated", allocated(&dst));
        assert!(same_contents(&src, &dst));
    }
    // Where it cannot be done, it says so rather than being dropped silently.
    let out = copy(&["--preallocate", s(&src), "null:"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("not a regular file: nothing to preallocate"), "{}", text(&out));
}

#[test]
fn pipes_and_null() {
    let dir = scratch();
    let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
    sample(&src, 8 * MIB + 123, MIB);
    // File to stdout: holes come out as zeroes.
    let out = copy(&[s(&src), "-"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(out.stdout, std::fs::read(&src).unwrap());
    // Stdin to file.
    let mut child = Command::new(bin())
        .args(["copy", "-", s(&dst)])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(&std::fs::read(&src).unwrap()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(same_contents(&src, &dst));
    // null: as source (a size) and destination.
    let out = copy(&["null:1M", s(&dst)]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(std::fs::read(&dst).unwrap(), vec![0u8; MIB as usize]);
    evict(&src);
    let out = copy(&[s(&src), "null:"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(cached(&src, 0, None) <= MIB, "reading to null: left {}", cached(&src, 0, None));
}

#[test]
fn a_reader_closing_stdout_early_is_quiet_but_not_success() {
    let dir = scratch();
    let src = dir.path().join("src");
    sample(&src, 64 * MIB, MIB);
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "{} copy {} - | head -c 1000 > /dev/null; echo \"status ${{PIPESTATUS[0]}}\"",
            bin(),
            s(&src)
        ))
        .output()
        .unwrap();
    // sh may be dash (no PIPESTATUS): run under bash explicitly instead.
    let out = if text(&out).contains("status ") && !text(&out).contains("status \n") {
        out
    } else {
        Command::new("bash")
            .arg("-c")
            .arg(format!(
                "{} copy {} - | head -c 1000 > /dev/null; echo \"status ${{PIPESTATUS[0]}}\"",
                bin(),
                s(&src)
            ))
            .output()
            .unwrap()
    };
    // Incomplete, so not success; quiet, with the status of a SIGPIPE death, as `cat` gives.
    assert!(text(&out).contains("status 141"), "{}", text(&out));
    assert!(!text(&out).contains("lightfoot:"), "{}", text(&out));
}

#[test]
fn bad_input_gets_a_clear_error() {
    let dir = scratch();
    let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
    sample(&src, MIB, 64 * 1024);

    let out = copy(&[s(&dir.path().join("missing")), s(&dst)]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out).contains("open") && text(&out).contains("missing") && text(&out).contains("no such file"),
        "{}",
        text(&out)
    );
    assert!(!dst.exists(), "a failed open must not create the destination");

    let out = copy(&[s(&src), s(&src)]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("same file"), "{}", text(&out));
    assert_eq!(std::fs::metadata(&src).unwrap().len(), MIB, "source must be untouched");

    let out = copy(&[s(&src), s(dir.path())]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("is a directory"), "{}", text(&out));

    let out = copy(&["--request-size", "1K", s(&src), s(&dst)]);
    assert_eq!(out.status.code(), Some(2));
    let out = copy(&["--cache", "sometimes", s(&src), s(&dst)]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains("neutral"), "{}", text(&out));
}

#[test]
fn full_disk_fails_cleanly_and_says_the_destination_is_incomplete() {
    if !root_or_skip("needs root to mount a small tmpfs") {
        return;
    }
    let dir = scratch();
    let src = dir.path().join("src");
    sample(&src, 32 * MIB, 4 * MIB);
    let mnt = Mount::new(dir.path(), "small", &["-t", "tmpfs", "-o", "size=8m", "tmpfs"]);
    let out = copy(&[s(&src), s(&mnt.path.join("dst"))]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let t = text(&out);
    assert!(t.contains("no space left on device") && t.contains("at offset"), "{t}");
    assert!(t.contains("is incomplete"), "{t}");
}

/// `--preallocate` where the filesystem cannot allocate in advance (ext2: fallocate answers
/// EOPNOTSUPP) says so and copies; it failed the copy before, leaving DST empty. Where there
/// is no room for DST (ENOSPC), it still fails, before any data is written.
#[test]
fn preallocate_without_fallocate_or_without_room() {
    if !root_or_skip("needs root to mount") {
        return;
    }
    let dir = scratch();
    let src = dir.path().join("src");
    sample(&src, 16 * MIB, MIB);
    let ext2 = Mount::made(dir.path(), "ext2", 64 * MIB, &["mkfs.ext2", "-q", "-F"]);
    let dst = ext2.path.join("dst");
    let out = copy(&["--preallocate", s(&src), s(&dst)]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("cannot allocate in advance: copying without it"), "{}", text(&out));
    assert!(same_contents(&src, &dst));
    let small = Mount::new(dir.path(), "small", &["-t", "tmpfs", "-o", "size=8m", "tmpfs"]);
    let out = copy(&["--preallocate", s(&src), s(&small.path.join("dst"))]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let t = text(&out);
    assert!(t.contains("preallocate") && t.contains("no space left on device"), "{t}");
}

/// A source on squashfs, which refuses both O_DIRECT and RWF_DONTCACHE: read with
/// evict-behind (it has cachestat), copied whole, the cache left as found. The copy failed
/// before ("O_DIRECT: invalid argument"), as it would on iso9660.
#[test]
fn copies_from_a_filesystem_without_direct_io() {
    if !root_or_skip("needs root to mount") {
        return;
    }
    let found = Command::new("sh").args(["-c", "command -v mksquashfs"]).output().unwrap();
    assert!(
        found.status.success(),
        "mksquashfs is missing: `make test` installs it (Debian package squashfs-tools)"
    );
    let dir = scratch();
    let tree = dir.path().join("tree");
    std::fs::create_dir(&tree).unwrap();
    random_file(&tree.join("disk.img"), 24 * MIB);
    let image = dir.path().join("fs.squashfs");
    let out =
        Command::new("mksquashfs").arg(&tree).arg(&image).args(["-noappend", "-quiet"]).output().unwrap();
    assert!(out.status.success(), "mksquashfs: {}", text(&out));
    let image = image.to_str().unwrap();
    let mnt = Mount::new(dir.path(), "mnt", &["-t", "squashfs", "-o", "loop,ro", image]);
    let src = mnt.path.join("disk.img");
    evict(&src);
    let (ws, ws_len) = (8 * MIB, 4 * MIB);
    warm(&src, ws, ws_len);
    let dst = dir.path().join("dst");
    let out = copy(&[s(&src), s(&dst)]);
    assert!(out.status.success(), "{}", text(&out));
    assert_kept(cached(&src, ws, Some(ws_len)), ws_len, "squashfs source");
    // Reading the working set, squashfs also cached the 128 KiB block after it: the 2 MiB
    // block holding those pages counts as cached before the job, and is left alone.
    let outside = cached(&src, 0, Some(ws - 2 * MIB)) + cached(&src, ws + ws_len + 2 * MIB, None);
    assert_eq!(outside, 0, "bytes of the source left cached outside the working set");
    assert_eq!(cached(&dst, 0, None), 0, "destination left cached");
    assert!(same_contents(&tree.join("disk.img"), &dst));
}

#[test]
fn block_device_destination() {
    if !root_or_skip("needs root for losetup") {
        return;
    }
    let dir = scratch();
    let src = dir.path().join("src");
    sample(&src, 16 * MIB, MIB);
    let dev = Loop::new(16 * MIB);
    // Junk on the device: holes of the source must be zeroed on it.
    std::fs::write(&dev.dev, vec![0xa5u8; 16 * MIB as usize]).unwrap();
    let out = copy(&[s(&src), &dev.dev]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(std::fs::read(&dev.dev).unwrap(), std::fs::read(&src).unwrap());
    // A device smaller than the source is refused before anything is written.
    let small = Loop::new(8 * MIB);
    std::fs::write(&small.dev, vec![0x5au8; 8 * MIB as usize]).unwrap();
    let out = copy(&[s(&src), &small.dev]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("smaller than the source"), "{}", text(&out));
    assert!(std::fs::read(&small.dev).unwrap().iter().all(|&b| b == 0x5a));
}

/// A device in use is refused (O_EXCL: here another holder; a mounted filesystem is the
/// case it is for), and a second device node for the same device counts as the same file.
#[test]
fn block_devices_in_use_or_named_twice() {
    if !root_or_skip("needs root for losetup") {
        return;
    }
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let dir = scratch();
    let src = dir.path().join("src");
    sample(&src, 4 * MIB, MIB);
    let dev = Loop::new(4 * MIB);
    std::fs::write(&dev.dev, vec![0x5au8; 4 * MIB as usize]).unwrap();
    let held = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_EXCL).open(&dev.dev).unwrap();
    let out = copy(&[s(&src), &dev.dev]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("in use"), "{}", text(&out));
    drop(held);
    assert!(std::fs::read(&dev.dev).unwrap().iter().all(|&b| b == 0x5a), "written while in use");
    // The same device under another name.
    let alias = dir.path().join("alias");
    let rdev = std::fs::metadata(&dev.dev).unwrap().rdev();
    let c = std::ffi::CString::new(alias.to_str().unwrap()).unwrap();
    // libc's mknod: std cannot make a device node.
    // SAFETY: mknod reads the NUL-terminated path `c`, which outlives the call; the rest are
    // integers.
    assert_eq!(unsafe { libc::mknod(c.as_ptr(), libc::S_IFBLK | 0o600, rdev) }, 0);
    let out = copy(&[&dev.dev, s(&alias)]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("same file"), "{}", text(&out));
}

/// Standard input redirected from the destination: refused before it is truncated (it was
/// truncated and the copy reported 0 bytes). A `null:` source needs a size (one of 0 bytes
/// emptied the destination): a usage error.
#[test]
fn stdin_from_the_destination_and_null_without_a_size() {
    let dir = scratch();
    let img = dir.path().join("img");
    random_file(&img, MIB);
    let before = std::fs::read(&img).unwrap();
    let out = Command::new(bin())
        .args(["copy", "-", s(&img)])
        .stdin(std::fs::File::open(&img).unwrap())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("same file"), "{}", text(&out));
    assert_eq!(std::fs::read(&img).unwrap(), before);
    let out = copy(&["null:", s(&img)]);
    assert_eq!(out.status.code(), Some(2), "a usage error: {}", text(&out));
    assert!(text(&out).contains("needs a size"), "{}", text(&out));
    assert_eq!(std::fs::read(&img).unwrap(), before);
    // One export on both sides, however spelt.
    let sock = dir.path().join("none.sock");
    let (a, b) = (format!("nbd+unix:///?socket={}", s(&sock)), format!("nbd+unix://?socket={}", s(&sock)));
    let out = copy(&[&a, &b]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("same export"), "{}", text(&out));
}

/// A FIFO destination, end to end. lightfoot measured the page cache of every path before
/// the copy, opening the FIFO and closing it again: that woke the reader at the other end,
/// which could see no writer, read nothing and leave, and the copy then waited for ever for a
/// reader. A race the copy's own open usually won: this test passed with the old code too,
/// and guards the path rather than the race.
#[test]
fn a_fifo_destination_is_opened_once() {
    let dir = scratch();
    let (src, fifo, out_file) = (dir.path().join("src"), dir.path().join("fifo"), dir.path().join("out"));
    random_file(&src, 4 * MIB);
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // libc's mkfifo: std cannot make a FIFO.
    // SAFETY: mkfifo reads the NUL-terminated path `c`, which outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let out = std::fs::File::create(&out_file).unwrap();
    let mut reader = Command::new("cat").arg(&fifo).stdout(out).spawn().unwrap();
    // The reader blocks in its open of the FIFO first (waiting there for a writer).
    let pid = reader.id();
    wait_until("cat to wait in its open of the FIFO", std::time::Duration::from_secs(10), || {
        matches!(wchan(pid).as_str(), "wait_for_partner" | "fifo_open")
    });
    let mut lf =
        Command::new(bin()).args(["copy", s(&src), s(&fifo)]).stderr(Stdio::piped()).spawn().unwrap();
    if !within(20, || lf.try_wait().unwrap().is_some()) {
        let _ = lf.kill();
        let _ = reader.kill();
        panic!("the copy into a FIFO hung");
    }
    let status = lf.wait().unwrap();
    assert!(status.success());
    assert!(reader.wait().unwrap().success());
    assert!(same_contents(&src, &out_file));
}

/// A sparse source cut short during the copy: its vanished end read as a hole, and the copy
/// succeeded with zeroes the source no longer has. The size is checked again at the end.
#[test]
fn a_source_that_shrinks_during_the_copy_fails_it() {
    let dir = scratch();
    let src = dir.path().join("src");
    // 16 MiB of data, then 48 MiB of hole; cut to 32 MiB while the data is being copied.
    random_file(&src, 16 * MIB);
    std::fs::OpenOptions::new().write(true).open(&src).unwrap().set_len(64 * MIB).unwrap();
    let slow = format!("nbdkit --filter=delay memory {} wdelay=100ms", 64 * MIB);
    let mut args = vec!["copy", "-j1", "--request-size=1M", "--", s(&src), "["];
    args.extend(slow.split(' '));
    args.push("]");
    // The progress lines on standard output: the cut comes with the first above `0/100`, once
    // the first MiB is copied (the size was taken before the first line), with 15 MiB of data
    // and 1.5 s still to go.
    args.insert(1, "--progress=1");
    let mut lf =
        Command::new(bin()).args(&args).stderr(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut progress = std::io::BufReader::new(lf.stdout.take().unwrap());
    let mut said = String::new();
    loop {
        let mut line = String::new();
        // The end of the lines, if the copy ended first: its status says why, below.
        let n = std::io::BufRead::read_line(&mut progress, &mut line).unwrap();
        said.push_str(&line);
        if n == 0 || line.trim().strip_suffix("/100").is_some_and(|p| p != "0") {
            break;
        }
    }
    std::fs::OpenOptions::new().write(true).open(&src).unwrap().set_len(32 * MIB).unwrap();
    let out = lf.wait_with_output().unwrap();
    std::io::Read::read_to_string(&mut progress, &mut said).unwrap();
    assert_eq!(out.status.code(), Some(1), "{said}{}", text(&out));
    assert!(text(&out).contains("shrank during the copy"), "{said}{}", text(&out));
}

/// Files this user cannot write: cachestat answers EPERM, so residency is unknown; the copy
/// must say so and still be neutral (DONTCACHE or O_DIRECT need no residency).
#[test]
fn unprivileged_user_on_a_root_owned_source() {
    if !root_or_skip("needs root to switch to nobody") {
        return;
    }
    let dir = scratch();
    let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
    sample(&src, 32 * MIB, MIB);
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o644)).unwrap();
    for env in [None, Some("LIGHTFOOT_NO_DONTCACHE=1")] {
        // One clean-clone `make test` lost 256 KiB of the working set here, once in about ten,
        // to the host's reclaim.
        let kept = kept_despite_host_reclaim(dir.path(), 4 * MIB, &format!("{env:?}"), || {
            let _ = std::fs::remove_file(&dst);
            evict(&src);
            warm(&src, 8 * MIB, 4 * MIB);
            let mut cmd = Command::new("setpriv");
            cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", "env"]);
            if let Some(e) = env {
                cmd.arg(e);
            }
            let out = cmd.args([bin(), "copy", "-v", s(&src), s(&dst)]).output().unwrap();
            assert!(out.status.success(), "{env:?}: {}", text(&out));
            assert!(text(&out).contains("cachestat denied"), "{env:?}: {}", text(&out));
            cached(&src, 8 * MIB, Some(4 * MIB))
        });
        assert_kept(kept, 4 * MIB, &format!("{env:?}"));
        let outside = cached(&src, 0, Some(6 * MIB)) + cached(&src, 14 * MIB, None);
        assert!(outside <= 32 * MIB / 100, "{env:?}: left {outside} cached");
        assert!(same_contents(&src, &dst));
        std::fs::remove_file(&dst).unwrap();
    }
}

/// Ctrl-C stops the copy at the next request, cleans the cache and exits 130.
#[test]
fn interrupt_stops_cleanly() {
    let dir = scratch();
    let dst = dir.path().join("dst");
    let mut child = Command::new(bin())
        .args(["copy", "--request-size", "64K", "-", s(&dst)])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(&vec![1u8; 4 * MIB as usize]).unwrap();
    // Ctrl-C, once the copy has taken it (its flag is set).
    signal_handled(child.id(), "INT");
    // The copy is blocked reading: more data lets it see the flag at the next request.
    let _ = stdin.write_all(&vec![1u8; MIB as usize]);
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", text(&out));
    assert!(text(&out).contains("interrupted") && text(&out).contains("is incomplete"), "{}", text(&out));
    assert!(cached(&dst, 0, None) <= MIB, "left {} cached", cached(&dst, 0, None));
}

/// Regression: a DONTCACHE copy reading through folios another reader's readahead had marked
/// started readahead windows of its own, and left the one past the last read cached (12 MiB
/// after `dd` had read 16 MiB of the source).
#[test]
fn readahead_left_by_another_reader_does_not_spill() {
    let dir = scratch();
    let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
    sample(&src, 128 * MIB, 32 * MIB);
    let blocks = |p: &Path| -> Vec<u64> { (0..64).map(|b| cached(p, b * 2 * MIB, Some(2 * MIB))).collect() };
    for args in [&[][..], &["--no-dontcache", "--read-mechanism", "evict-behind"][..]] {
        // dd's pages are read once, so cold to the host's background reclaim, which took 1 MiB
        // of them during a CI run: a control read once beside them tells its work from the copy's.
        let what = format!("{args:?}: dd's pages");
        let (kept, want) = despite_host_reclaim(dir.path(), Warmth::ReadOnce, &what, || {
            evict(&src);
            // Like `dd bs=1M count=16`: plain buffered reads with the default readahead.
            let out = Command::new("dd")
                .args([&format!("if={}", s(&src)), "of=/dev/null", "bs=1M", "count=16", "status=none"])
                .output()
                .unwrap();
            assert!(out.status.success());
            let before = blocks(&src);
            assert!(before.iter().sum::<u64>() > 16 * MIB, "dd should have read ahead: {before:?}");
            let mut all = vec!["copy"];
            all.extend_from_slice(args);
            all.extend_from_slice(&[s(&src), s(&dst)]);
            let out = lightfoot(&all);
            assert!(out.status.success(), "{}", text(&out));
            let after = blocks(&src);
            // Nothing added anywhere (the regression left a readahead window cached), whatever
            // the host's reclaim did meanwhile.
            for (b, (a, w)) in after.iter().zip(&before).enumerate() {
                assert!(a <= w, "{args:?}: block {b} gained cache ({w} -> {a}): {after:?}");
            }
            (after.iter().sum(), before.iter().sum())
        });
        assert_kept(kept, want, &what);
    }
}
