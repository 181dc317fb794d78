//! `lightfoot cache stat|evict` end to end.

mod common;

use std::process::Command;

use common::*;

fn json(out: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(out)))
}

#[test]
fn stat_and_evict_report_what_is_cached() {
    let dir = scratch();
    let f = dir.path().join("f");
    sample(&f, 16 * MIB, MIB);
    warm(&f, 4 * MIB, 2 * MIB);
    let p = f.to_str().unwrap();

    let out = lightfoot(&["cache", "stat", "--json", p]);
    assert!(out.status.success(), "{}", text(&out));
    let v = json(&out);
    assert_eq!(v[0]["cached_bytes"], 2 * MIB);
    assert_eq!(v[0]["len"], 16 * MIB);
    assert_eq!(v[0]["stat"]["dirty"], 0);
    assert_eq!(v[0]["source"], "cachestat");

    let out = lightfoot(&["cache", "stat", "--json", "--range", "5M:4M", p]);
    assert_eq!(json(&out)[0]["cached_bytes"], MIB);
    let out = lightfoot(&["cache", "stat", "--json", "--range", "8M:", p]);
    assert_eq!(json(&out)[0]["cached_bytes"], 0);

    let out = lightfoot(&["cache", "stat", p]);
    let t = text(&out);
    assert!(t.contains("FILE") && t.contains("2.0 MiB (12.5%)"), "{t}");

    // Evicting a range leaves the rest.
    let out = lightfoot(&["cache", "evict", "--range", "4M:1M", p]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(cached(&f, 0, None), MIB);
    let out = lightfoot(&["cache", "evict", "--json", p]);
    let v = json(&out);
    assert_eq!(v[0]["cached_before"], MIB);
    assert_eq!(v[0]["cached_after"], 0);
}

#[test]
fn evict_sync_writes_dirty_pages_back_first() {
    use std::io::Write;
    let dir = scratch();
    let f = dir.path().join("dirty");
    let mut file = std::fs::File::create(&f).unwrap();
    file.write_all(&vec![7u8; 4 * MIB as usize]).unwrap();
    let p = f.to_str().unwrap();
    let v = json(&lightfoot(&["cache", "stat", "--json", p]));
    assert!(v[0]["stat"]["dirty"].as_u64().unwrap() + v[0]["stat"]["writeback"].as_u64().unwrap() > 0, "{v}");
    let out = lightfoot(&["cache", "evict", "--sync", p]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(cached(&f, 0, None), 0);
    assert_eq!(std::fs::read(&f).unwrap(), vec![7u8; 4 * MIB as usize]);
}

#[test]
fn errors_name_the_file_and_the_others_are_still_shown() {
    let dir = scratch();
    let f = dir.path().join("f");
    sample(&f, MIB, MIB);
    let missing = dir.path().join("missing");
    let out = lightfoot(&["cache", "stat", missing.to_str().unwrap(), f.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let t = text(&out);
    assert!(t.contains("missing") && t.contains("no such file"), "{t}");
    assert!(t.lines().any(|l| l.starts_with(f.to_str().unwrap())), "{t}");
    let out = lightfoot(&["cache", "stat", "--range", "nonsense", f.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    // A directory or a character device has no figures that mean anything: refused by name
    // (a directory showed a row of zeroes before), the file beside them still shown.
    let d = dir.path().to_str().unwrap();
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let fifo = fifo.to_str().unwrap();
    let out = lightfoot(&["cache", "stat", d, "/dev/null", fifo, f.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let t = text(&out);
    assert!(t.contains(&format!("{d}: a directory")), "{t}");
    assert!(t.contains("/dev/null: not a regular file or block device"), "{t}");
    assert!(t.contains(&format!("{fifo}: not a regular file or block device")), "{t}");
    assert!(!t.lines().any(|l| l.starts_with(d) && !l.starts_with(f.to_str().unwrap())), "{t}");
    assert!(t.lines().any(|l| l.starts_with(f.to_str().unwrap())), "{t}");
    let out = lightfoot(&["cache", "evict", d]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("a directory"), "{}", text(&out));
}

/// cachestat answers EPERM for files the user cannot write: say residency is not visible,
/// never print a guess.
#[test]
fn unprivileged_stat_says_residency_is_not_visible() {
    if !root_or_skip("needs root to switch to nobody") {
        return;
    }
    let dir = scratch();
    let f = dir.path().join("f");
    sample(&f, MIB, MIB);
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", bin(), "cache", "stat"])
        .arg(&f)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("not visible"), "{}", text(&out));
    // Eviction needs only read access.
    warm(&f, 0, MIB);
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", bin(), "cache", "evict"])
        .arg(&f)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(cached(&f, 0, None), 0);
}

/// What cachestat asks of an unprivileged caller (owning the file or being allowed to write
/// it) is met through the read-only descriptor `cache stat` opens: a file nobody owns but may
/// not write, and one nobody may write but does not own.
#[test]
fn unprivileged_stat_sees_files_it_owns_or_may_write() {
    if !root_or_skip("needs root to switch to nobody") {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let owned = dir.path().join("owned");
    let writable = dir.path().join("writable");
    for (f, mode) in [(&owned, 0o444), (&writable, 0o666)] {
        sample(f, MIB, MIB);
        warm(f, 0, MIB);
        std::fs::set_permissions(f, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    std::os::unix::fs::chown(&owned, Some(65534), Some(65534)).unwrap();
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", bin(), "cache", "stat", "--json"])
        .args([&owned, &writable])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let files = v.as_array().unwrap_or_else(|| panic!("{v}"));
    assert_eq!(files.len(), 2, "{v}");
    for f in files {
        assert_eq!(f["cached_bytes"].as_u64(), Some(MIB), "{v}");
    }
}

/// A 64 MiB sample file in `dir`, nothing cached but 48-52 MiB (cached before the job: not
/// the job's to evict), opened for writing in neutral mode.
fn neutral_file_with_cached_block(
    dir: &std::path::Path,
) -> (std::path::PathBuf, lightfoot::backend::FileBackend) {
    use lightfoot::io::{CacheMode, OpenOptions, Tuning};
    let f = dir.join("f");
    sample(&f, 64 * MIB, MIB);
    evict(&f);
    warm(&f, 48 * MIB, 4 * MIB);
    let opts = OpenOptions { write: true, create: false, truncate: false };
    let b = lightfoot::backend::FileBackend::open(&f, opts, CacheMode::Neutral, &Tuning::default()).unwrap();
    (f, b)
}

/// `will_write` (the coalesce filter's hint before a write-back) reads the pages a write will
/// overwrite in part; they must leave the cache with the write like any written page, and
/// pages cached before the job must stay.
#[test]
fn pages_read_ahead_for_partial_writes_leave_with_them() {
    use lightfoot::backend::Backend;
    let dir = scratch();
    let (f, b) = neutral_file_with_cached_block(dir.path());
    let at = |i: u64| (i * 7919 * 4096) % (64 * MIB) + 1000;
    for i in 0..512u64 {
        b.will_write(at(i), 1024);
    }
    assert!(cached(&f, 0, Some(48 * MIB)) > 0, "will_write read nothing ahead");
    for i in 0..512u64 {
        b.write(&[0xa5; 1024], at(i), false).unwrap();
    }
    b.flush().unwrap();
    assert_eq!(cached(&f, 0, Some(48 * MIB)), 0, "pages read ahead for the writes left after the flush");
    assert_eq!(
        cached(&f, 52 * MIB, Some(12 * MIB)),
        0,
        "pages read ahead for the writes left after the flush"
    );
    assert_eq!(cached(&f, 48 * MIB, Some(4 * MIB)), 4 * MIB, "pages cached before the job were evicted");
    b.finish().unwrap();
}

/// Neutral writes below 64 KiB are made through the cache (DONTCACHE per small write is slow:
/// see `io::file::SMALL_WRITE`); a flush must still leave none of their pages behind, and
/// pages that were cached before must stay.
#[test]
fn small_neutral_writes_leave_no_pages_after_a_flush_and_keep_the_cached_ones() {
    use lightfoot::backend::Backend;
    let dir = scratch();
    let (f, b) = neutral_file_with_cached_block(dir.path());
    for i in 0..512u64 {
        // 1 KiB every 3 KiB of the first 1.5 MiB, and 1 KiB scattered over the file.
        b.write(&[0x5a; 1024], i * 3072, false).unwrap();
        b.write(&[0xa5; 1024], (i * 7919 * 4096) % (64 * MIB), false).unwrap();
    }
    b.write(&[0x77; 4096], 49 * MIB, false).unwrap();
    b.flush().unwrap();
    assert_eq!(cached(&f, 0, Some(48 * MIB)), 0, "pages of small writes left after the flush");
    assert_eq!(cached(&f, 52 * MIB, Some(12 * MIB)), 0, "pages of small writes left after the flush");
    assert_eq!(cached(&f, 48 * MIB, Some(4 * MIB)), 4 * MIB, "pages cached before the job were evicted");
    b.finish().unwrap();
    let mut got = vec![0u8; 4096];
    std::os::unix::fs::FileExt::read_exact_at(&std::fs::File::open(&f).unwrap(), &mut got, 49 * MIB).unwrap();
    assert_eq!(got, [0x77; 4096]);
}

/// The coalesce filter's write-backs that join several small writes (`Backend::write_merged`)
/// leave the cache as large writes do (RWF_DONTCACHE drops each page once it is written back),
/// not at the next flush as the small writes they are made of: their pages are gone before
/// any flush. Plain small writes of the same size are still cached then.
#[test]
fn merged_writes_leave_no_pages_before_a_flush() {
    use lightfoot::backend::Backend;
    use lightfoot::io::{CacheMode, OpenOptions, Tuning, WriteMech};
    let dir = scratch();
    let f = dir.path().join("sparse");
    std::fs::File::create(&f).unwrap().set_len(64 * MIB).unwrap();
    let opts = OpenOptions { write: true, create: false, truncate: false };
    let b = lightfoot::backend::FileBackend::open(&f, opts, CacheMode::Neutral, &Tuning::default()).unwrap();
    if b.policy().mechanism().write != WriteMech::DontCache {
        // The kernel's or the filesystem's: root changes nothing.
        skip(&format!("no RWF_DONTCACHE here (writes use {:?})", b.policy().mechanism().write));
        return;
    }
    // 20 KiB each (below the 64 KiB of a large write), into holes, 1 MiB apart.
    for i in 0..16u64 {
        b.write_merged(&[0x3c; 20 << 10], i * MIB + 1024, false).unwrap();
        b.write(&[0xc3; 20 << 10], 32 * MIB + i * MIB + 1024, false).unwrap();
    }
    // Waits for the writeback of both halves, evicting nothing.
    std::fs::File::open(&f).unwrap().sync_data().unwrap();
    // The kernel skips a page's drop now and then (its lock busy when the writeback ends):
    // a page or two may stay until the flush. Plain small writes keep all 96 of theirs.
    assert!(
        within(10, || cached(&f, 0, Some(32 * MIB)) <= 2 * 4096),
        "merged writes left pages before a flush"
    );
    assert_eq!(
        cached(&f, 32 * MIB, Some(32 * MIB)),
        96 * 4096,
        "plain small writes were not cached until the flush"
    );
    b.flush().unwrap();
    assert_eq!(cached(&f, 0, None), 0, "pages left after the flush");
    b.finish().unwrap();
    let got = std::fs::read(&f).unwrap();
    for i in 0..16usize {
        let (m, p) = (i * MIB as usize + 1024, 32 * MIB as usize + i * MIB as usize + 1024);
        assert!(got[m..m + (20 << 10)].iter().all(|&x| x == 0x3c), "merged write {i} lost");
        assert!(got[p..p + (20 << 10)].iter().all(|&x| x == 0xc3), "plain write {i} lost");
    }
}

/// A neutral FileBackend on a fully written 8 MiB file, nothing cached but 4-5 MiB and the
/// page at [`LONE`] (cached before the job), with the file's contents as the test's model.
const LONE: u64 = 5 * MIB + 30 * 4096;

fn neutral_written_file(
    dir: &std::path::Path,
) -> (std::path::PathBuf, lightfoot::backend::FileBackend, Vec<u8>) {
    use lightfoot::io::{CacheMode, OpenOptions, Tuning};
    let f = dir.join("f");
    random_file(&f, 8 * MIB);
    let model = std::fs::read(&f).unwrap();
    evict(&f);
    warm(&f, 4 * MIB, MIB);
    warm(&f, LONE, 4096);
    let opts = OpenOptions { write: true, create: false, truncate: false };
    let b = lightfoot::backend::FileBackend::open(&f, opts, CacheMode::Neutral, &Tuning::default()).unwrap();
    (f, b, model)
}

/// A small write into part of a page of written data that is not cached goes straight to the
/// disk (through the cache, the kernel would read the page first): no page comes in, not even
/// until the flush. Pages cached before stay cached and take the write; writes not aligned for
/// O_DIRECT, and every small write once the file may have holes, go through the cache.
#[test]
fn small_writes_into_uncached_written_pages_skip_the_cache() {
    use lightfoot::backend::Backend;
    let dir = scratch();
    let (f, b, mut model) = neutral_written_file(dir.path());
    if b.policy().align() != 512 {
        // The device's logical block size: root changes nothing.
        skip(&format!("O_DIRECT alignment here is {}, not 512", b.policy().align()));
        return;
    }
    let write = |b: &lightfoot::backend::FileBackend, model: &mut Vec<u8>, at: u64, len: usize, v: u8| {
        b.write(&vec![v; len], at, false).unwrap();
        model[at as usize..at as usize + len].fill(v);
    };
    write(&b, &mut model, 1024, 1024, 1);
    write(&b, &mut model, 3 * 4096 + 512, 512, 2);
    write(&b, &mut model, 7 * 4096 - 1024, 2048, 3); // the end of one page and the start of the next
    assert_eq!(cached(&f, 0, Some(4 * MIB)), 0, "aligned small writes into uncached data were cached");
    write(&b, &mut model, 4 * MIB + 1024, 1024, 4);
    assert_eq!(cached(&f, 4 * MIB, Some(MIB)), MIB, "a page cached before the job left");
    // A page cached before, covered whole by a write whose edges are uncached: the write
    // goes through the cache (direct, it would drop that page).
    write(&b, &mut model, LONE - 3072, 8192, 7);
    assert_eq!(cached(&f, LONE, Some(4096)), 4096, "a page cached before, covered by a write, left");
    write(&b, &mut model, 20 * 4096 + 100, 1000, 5);
    assert_eq!(
        cached(&f, 20 * 4096, Some(4096)),
        4096,
        "an unaligned small write did not go through the cache"
    );
    // A trim may make holes: from then on small writes are buffered (a direct write of part
    // of an unallocated block is slow).
    b.trim(6 * MIB, MIB, false).unwrap();
    model[6 * MIB as usize..7 * MIB as usize].fill(0);
    write(&b, &mut model, 40 * 4096 + 1024, 1024, 6);
    assert_eq!(cached(&f, 40 * 4096, Some(4096)), 4096, "small writes went direct after a trim");
    b.flush().unwrap();
    assert_eq!(cached(&f, 0, Some(4 * MIB)), 0, "pages of small writes left after the flush");
    assert_eq!(cached(&f, 4 * MIB, Some(MIB)), MIB, "a page cached before the job left");
    assert_eq!(cached(&f, LONE, Some(4096)), 4096, "a page cached before, covered by a write, left");
    b.finish().unwrap();
    drop(b);
    assert!(std::fs::read(&f).unwrap() == model, "the file does not hold what was written");
}

/// Direct and buffered writes to different parts of the same pages, from several threads,
/// with flushes evicting pages in between (so each write finds its page cached or not): a
/// buffered write that read a page while a direct write to it was in flight would cache, and
/// later write back, the bytes the direct write replaced. Every byte must end up as written.
/// On ext4 with 4 KiB blocks the kernel serialises the two itself (a direct write of part of a
/// block takes the inode's lock like a buffered one); on a block device only lightfoot's page
/// locks do: without them the kernel finds the stale page after the direct write and the next
/// flush fails with EIO (seen in 5 runs of 5 on a loop device).
fn writes_sharing_pages_lose_nothing(path: &std::path::Path) {
    use lightfoot::backend::Backend;
    use lightfoot::io::{CacheMode, OpenOptions, Tuning};
    const PAGES: u64 = 64;
    let mut model = vec![0u8; (PAGES * 4096) as usize];
    lightfoot::testing::conformance::Rng::new(7).fill(&mut model);
    std::fs::write(path, &model).unwrap();
    evict(path);
    let opts = OpenOptions { write: true, create: false, truncate: false };
    let b =
        lightfoot::backend::FileBackend::open(path, opts, CacheMode::Neutral, &Tuning::default()).unwrap();
    let b = std::sync::Arc::new(b);
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let b = b.clone();
            std::thread::spawn(move || {
                let mut rng = lightfoot::testing::conformance::Rng::new(t + 1);
                for round in 0..40u64 {
                    for i in 0..PAGES {
                        let page = (i * 37 + round * 11 + t * 5) % PAGES;
                        // Thread 0 writes 1022 bytes (not aligned for O_DIRECT: through the
                        // cache, reading the page), the others 1 KiB (direct where uncached).
                        let (at, len) =
                            if t == 0 { (page * 4096 + 1, 1022) } else { (page * 4096 + t * 1024, 1024) };
                        b.write(&vec![(round * 4 + t) as u8; len], at, false).unwrap();
                    }
                    if rng.below(4) == 0 {
                        b.flush().unwrap();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    b.flush().unwrap();
    b.finish().unwrap();
    drop(b);
    for page in 0..PAGES as usize {
        let p = page * 4096;
        model[p + 1..p + 1023].fill((39 * 4) as u8);
        for t in 1..4usize {
            model[p + t * 1024..p + (t + 1) * 1024].fill((39 * 4 + t) as u8);
        }
    }
    evict(path);
    let mut got = vec![0u8; model.len()];
    std::os::unix::fs::FileExt::read_exact_at(&std::fs::File::open(path).unwrap(), &mut got, 0).unwrap();
    for page in 0..PAGES as usize {
        let r = page * 4096..(page + 1) * 4096;
        assert!(got[r.clone()] == model[r], "{}: page {page} does not hold the last writes", path.display());
    }
}

#[test]
fn direct_and_buffered_writes_sharing_pages_lose_nothing() {
    let dir = scratch();
    writes_sharing_pages_lose_nothing(&dir.path().join("f"));
    if euid() == 0 {
        let dev = Loop::new(4 * MIB);
        writes_sharing_pages_lose_nothing(std::path::Path::new(&dev.dev));
    }
}
