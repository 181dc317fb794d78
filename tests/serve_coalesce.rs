//! `lightfoot serve --coalesce` against libnbd (the system Python's `nbd` module, from
//! `make test`): writes from several connections, FLUSH then `kill -9`, holes in a sparse
//! file, clean shutdown, `--stats`.

mod common;

use std::path::Path;
use std::process::Output;

use common::*;

/// `lightfoot serve --coalesce EXTRA... FILE`.
fn coalescing(file: &Path, extra: &[&str]) -> Served {
    Served::start(file, &[&["--coalesce"], extra].concat())
}

fn python(script: &str, uri: &str) -> Output {
    let out = libnbd(script, uri);
    assert!(out.status.success(), "{}", text(&out));
    out
}

/// 1 KiB written every 4 KiB over the first 4 MiB, alternating between two connections.
const STRIDED: &str = r#"
import os, nbd
def conn():
    h = nbd.NBD()
    h.connect_uri(os.environ['URI'])
    return h
a, b = conn(), conn()
want = bytearray(a.pread(4 << 20, 0))
for i in range(1024):
    d = bytes([i % 251 + 1]) * 1024
    (a if i % 2 else b).pwrite(d, i * 4096)
    want[i * 4096:i * 4096 + 1024] = d
# Either connection reads what both wrote, before any flush; small sequential reads
# (a prefetch stream) too.
got = b''.join(b.pread(4096, o) for o in range(0, 4 << 20, 4096))
assert got == want, 'reads before the flush'
assert a.pread(4 << 20, 0) == want
a.flush()
"#;

fn strided_expected(file: &Path) -> Vec<u8> {
    let mut want = std::fs::read(file).unwrap();
    for i in 0..1024usize {
        want[i * 4096..i * 4096 + 1024].fill((i % 251 + 1) as u8);
    }
    want
}

/// FLUSH answered, then `kill -9`: every byte written before the flush is in the file, in
/// every cache mode, with --prefetch stacked above.
#[test]
fn flushed_writes_survive_kill_9() {
    let dir = scratch();
    for mode in ["neutral", "keep", "drop", "direct"] {
        let file = dir.path().join(format!("{mode}.img"));
        random_file(&file, 16 * MIB);
        let want = strided_expected(&file);
        // One of them with a larger block.
        let block = if mode == "direct" { "256K" } else { "64K" };
        let s = coalescing(&file, &["--prefetch", "--cache", mode, "--coalesce-block", block]);
        python(STRIDED, &s.uri());
        s.kill9();
        assert!(
            std::fs::read(&file).unwrap() == want,
            "--cache={mode}: flushed writes missing after kill -9"
        );
    }
}

/// Unflushed writes are written back at a clean shutdown; `--stats` counts far fewer backend
/// writes than client writes.
#[test]
fn clean_shutdown_writes_back_and_stats_count() {
    let dir = scratch();
    let file = dir.path().join("disk.img");
    random_file(&file, 16 * MIB);
    let want = strided_expected(&file);
    evict(&file);
    let s = coalescing(&file, &["--stats", "--json", "--coalesce-age", "1h"]);
    // The same writes without the flush at the end.
    python(&STRIDED.replace("a.flush()", ""), &s.uri());
    let (status, err) = s.stop();
    assert!(status.success(), "{err}");
    // Neutral mode: the written blocks (and the gaps read to fill them) leave the cache.
    let left = cached(&file, 0, None);
    assert!(std::fs::read(&file).unwrap() == want, "held writes lost at a clean shutdown");
    let line = err.lines().rev().find(|l| l.starts_with('{')).unwrap_or_else(|| panic!("no JSON: {err}"));
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    let c = &v["coalesce"];
    assert_eq!(c["client_writes"], 1024, "{c}");
    let backend = c["backend_writes"].as_u64().unwrap();
    // 1 KiB every 4 KiB over 4 MiB: 64 blocks of 64 KiB.
    assert!(backend <= 64, "{backend} backend writes for 1024 client writes: {c}");
    assert!(c["bytes_filled"].as_u64().unwrap() > 0, "{c}");
    assert!(left <= MIB, "{left} bytes of the file left in the page cache");
}

/// 1 KiB pieces into a sparse file, two per 64 KiB with a hole between: block status reports
/// them as data before the flush, and afterwards the file holds no more than the 4 KiB blocks
/// they touch (no gap filled over a hole).
#[test]
fn holes_stay_holes_in_a_sparse_file() {
    let dir = scratch();
    let file = dir.path().join("sparse.img");
    std::fs::File::create(&file).unwrap().set_len(64 * MIB).unwrap();
    let s = coalescing(&file, &[]);
    let script = r#"
import os, nbd
h = nbd.NBD()
h.add_meta_context('base:allocation')
h.connect_uri(os.environ['URI'])
for i in range(64):
    h.pwrite(b'\xab' * 1024, i * (1 << 20) + 1024)
    h.pwrite(b'\xcd' * 1024, i * (1 << 20) + 40960)
seen = []
def f(meta, off, ents, err):
    seen.extend(zip(ents[0::2], ents[1::2]))
h.block_status(1 << 20, 0, f)
at, data = 0, []
for n, flags in seen:
    if not flags & 1:
        data.append((at, n))
    at += n
assert any(o <= 1024 and o + n >= 2048 for o, n in data), seen
assert any(o <= 40960 and o + n >= 41984 for o, n in data), seen
assert h.pread(1024, 40960) == b'\xcd' * 1024
h.flush()
"#;
    python(script, &s.uri());
    s.kill9();
    let f = std::fs::read(&file).unwrap();
    for i in 0..64usize {
        assert!(f[i * MIB as usize + 1024..i * MIB as usize + 2048].iter().all(|&b| b == 0xab));
        assert!(f[i * MIB as usize + 40960..i * MIB as usize + 41984].iter().all(|&b| b == 0xcd));
    }
    // 128 blocks of 4 KiB, plus room for the filesystem's extent tree; filling the gaps would
    // have allocated 40 KiB more per MiB (2.5 MiB).
    let alloc = allocated(&file);
    assert!(
        alloc <= 64 * 2 * 4096 + 256 * 1024,
        "{alloc} bytes allocated for 128 KiB written in 1 KiB pieces"
    );
}

/// 1 KiB every 4 KiB into a sparse file merges (each 4 KiB block is allocated anyway) without
/// allocating more than the exact writes would; 1 KiB every 8 KiB leaves the blocks between
/// unallocated.
#[test]
fn strided_writes_into_a_sparse_file_merge_without_inflating_it() {
    let dir = scratch();
    for stride in [4096u64, 8192] {
        let file = dir.path().join(format!("sparse{stride}.img"));
        std::fs::File::create(&file).unwrap().set_len(64 * MIB).unwrap();
        let s = coalescing(&file, &["--stats", "--json"]);
        let script = format!(
            "import os, nbd\nh = nbd.NBD()\nh.connect_uri(os.environ['URI'])\n\
             for i in range({n}):\n    h.pwrite(b'\\xab' * 1024, i * {stride})\nh.flush()\n",
            n = 4 * MIB / stride
        );
        python(&script, &s.uri());
        let (status, err) = s.stop();
        assert!(status.success(), "{err}");
        let line = err.lines().rev().find(|l| l.starts_with('{')).unwrap_or_else(|| panic!("no JSON: {err}"));
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let backend = v["coalesce"]["backend_writes"].as_u64().unwrap();
        // The FLUSH's time, in its two parts: the fdatasync of a file just written takes some.
        assert!(v["coalesce"]["flushes"].as_u64().unwrap() >= 1, "{line}");
        assert!(v["coalesce"]["flush_write_back_us"].as_u64().is_some(), "{line}");
        assert!(v["coalesce"]["flush_below_us"].as_u64().unwrap() > 0, "{line}");
        let alloc = allocated(&file);
        let f = std::fs::read(&file).unwrap();
        for (i, x) in f[..4 * MIB as usize].iter().enumerate() {
            assert_eq!(*x, if (i as u64 % stride) < 1024 { 0xab } else { 0 }, "stride {stride}: byte {i}");
        }
        let blocks = 4 * MIB / stride;
        assert!(alloc <= blocks * 4096 + 256 * 1024, "stride {stride}: {alloc} bytes allocated");
        if stride == 4096 {
            assert!(backend <= 64, "stride {stride}: {backend} backend writes for {blocks}");
        } else {
            assert_eq!(backend, blocks, "stride {stride}: gaps over never-written blocks filled");
        }
    }
}

/// Held writes into a sparse file are data to clients that skip holes: nbdcopy and qemu-img
/// read the export through block status (and OFFSET_HOLE chunks) before anything was flushed,
/// and must copy every held byte.
#[test]
fn nbdcopy_and_qemu_img_see_held_writes_in_holes() {
    let dir = scratch();
    let file = dir.path().join("sparse.img");
    std::fs::File::create(&file).unwrap().set_len(24 * MIB).unwrap();
    let s = coalescing(&file, &["--coalesce-age", "1h"]);
    let script = r#"
import os, nbd
h = nbd.NBD()
h.connect_uri(os.environ['URI'])
for i in range(24):
    h.pwrite(bytes([i + 1]) * 1000, i * (1 << 20) + 4096 * i + 7)
"#;
    python(script, &s.uri());
    let mut want = vec![0u8; 24 * MIB as usize];
    for i in 0..24usize {
        let at = i * MIB as usize + 4096 * i + 7;
        want[at..at + 1000].fill(i as u8 + 1);
    }
    let (out1, out2) = (dir.path().join("o1"), dir.path().join("o2"));
    let out = tool("nbdcopy", "libnbd-bin").args([&s.uri(), out1.to_str().unwrap()]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let out = tool("qemu-img", "qemu-utils")
        .args(["convert", "-f", "raw", "-O", "raw", &s.uri()])
        .arg(&out2)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(std::fs::read(&out1).unwrap() == want, "nbdcopy skipped held writes");
    assert!(std::fs::read(&out2).unwrap() == want, "qemu-img skipped held writes");
    let (status, err) = s.stop();
    assert!(status.success(), "{err}");
    assert!(std::fs::read(&file).unwrap() == want);
}

/// On a nearly full filesystem, held writes with gaps over holes between them are written back
/// exactly (filling those gaps would need 4.5 times the space and fail with ENOSPC); once the
/// space really runs out, the write-back error fails that FLUSH and every later one.
#[test]
fn a_full_filesystem_fails_flush_only_when_written_bytes_do_not_fit() {
    if !root_or_skip("needs root to mount a small tmpfs") {
        return;
    }
    let dir = scratch();
    let mnt = Mount::new(dir.path(), "small", &["-t", "tmpfs", "-o", "size=1m", "tmpfs"]);
    let file = mnt.path.join("sparse.img");
    std::fs::File::create(&file).unwrap().set_len(64 * MIB).unwrap();
    let s = coalescing(&file, &["--coalesce-age", "1h"]);
    // 1 MiB is 256 pages. 100 blocks with 1 KiB in their first and in their ninth 4 KiB page:
    // 200 pages written exactly, 900 with the gaps filled.
    let script = r#"
import errno, os, nbd
h = nbd.NBD()
h.connect_uri(os.environ['URI'])
def pieces(first):
    for i in range(first, first + 100):
        h.pwrite(b'\xab' * 1024, i * 65536)
        h.pwrite(b'\xcd' * 1024, i * 65536 + 32768)
pieces(0)
h.flush()
# Another 200 pages do not fit: the flush fails, and so does every later one.
pieces(100)
for _ in range(2):
    try:
        h.flush()
        raise SystemExit('a flush succeeded after a lost write-back')
    except nbd.Error as e:
        assert e.errno in (errno.ENOSPC, 'ENOSPC'), e
# The held bytes are still there to read.
assert h.pread(1024, 150 * 65536 + 32768) == b'\xcd' * 1024
print('ok')
"#;
    let out = libnbd(script, &s.uri());
    let (status, err) = s.stop();
    assert!(out.status.success() && text(&out).contains("ok"), "{}\nserver: {err}", text(&out));
    // The write-back at exit fails too, and says so.
    assert!(!status.success(), "exit status {status} after a lost write-back: {err}");
    let f = std::fs::read(&file).unwrap();
    for i in 0..100usize {
        assert!(f[i * 65536..i * 65536 + 1024].iter().all(|&b| b == 0xab), "block {i}");
        assert!(f[i * 65536 + 32768..i * 65536 + 33792].iter().all(|&b| b == 0xcd), "block {i}");
    }
}

/// On a filesystem with 1 KiB blocks (ext4 made with `-b 1024`, on a loop device), 1 KiB
/// written every 4 KiB into a hole is written back exactly: the gaps between the writes lie in
/// blocks nobody wrote, and filling them would allocate three blocks of zeroes for every one
/// written. Before the filter took the unit from the filesystem, it filled them as it does
/// with 4 KiB blocks (1 MiB allocated here instead of 256 KiB).
#[test]
fn gaps_are_not_filled_across_a_small_block_filesystems_holes() {
    if !root_or_skip("needs root to mount") {
        return;
    }
    let dir = scratch();
    let mnt = Mount::made(dir.path(), "mnt", 32 * MIB, &["mkfs.ext4", "-q", "-F", "-b", "1024"]);
    let file = mnt.path.join("sparse.img");
    std::fs::File::create(&file).unwrap().set_len(8 * MIB).unwrap();
    let s = coalescing(&file, &["--coalesce-age", "1h"]);
    let script = r#"
import os, nbd
h = nbd.NBD()
h.connect_uri(os.environ['URI'])
for i in range(256):
    h.pwrite(bytes([i % 251 + 1]) * 1024, i * 4096)
h.flush()
print('ok')
"#;
    let out = libnbd(script, &s.uri());
    let (status, err) = s.stop();
    let used = allocated(&file);
    let data = std::fs::read(&file).unwrap();
    assert!(out.status.success() && text(&out).contains("ok"), "{}\nserver: {err}", text(&out));
    assert!(status.success(), "{err}");
    for i in 0..256usize {
        assert!(data[i * 4096..i * 4096 + 1024].iter().all(|&b| b == (i % 251 + 1) as u8), "write {i}");
        assert!(data[i * 4096 + 1024..i * 4096 + 4096].iter().all(|&b| b == 0), "gap {i}");
    }
    // 256 KiB of data, and a few blocks of extent tree for its 256 extents.
    assert!(used < 300 * 1024, "{used} bytes allocated for 256 KiB written");
}
