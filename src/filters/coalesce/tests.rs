//! Unit tests of the filter over memory backends (with faults injected where needed).

use super::*;
use crate::backend::MemoryBackend;
use crate::error::ErrorKind;
use crate::filters::Front;
use crate::testing::fault::{Fault, FaultInjector, Op, Rule};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const K: u64 = 1024;

/// A memory backend with data everywhere (no holes).
fn full(size: u64) -> Arc<MemoryBackend> {
    let m = MemoryBackend::new(size);
    let buf: Vec<u8> = (0..size).map(|i| (i / 4096 % 251) as u8 + 1).collect();
    m.write(&buf, 0, false).unwrap();
    Arc::new(m)
}

fn cfg() -> CoalesceConfig {
    // No background write-back unless a test asks for it.
    CoalesceConfig { age: Duration::from_secs(3600), ..CoalesceConfig::default() }
}

fn read(b: &dyn Backend, off: u64, len: u64) -> Vec<u8> {
    let mut v = vec![0u8; len as usize];
    crate::backend::read_exact(b, &mut v, off).unwrap();
    v
}

#[test]
fn strided_writes_become_one_request_per_block() {
    let mem = full(4 * MIB);
    let c = Front::whole(Coalesce::new(mem.clone(), cfg()));
    let mut want = read(&*mem, 0, 4 * MIB);
    for i in 0..MIB / (4 * K) {
        let data = vec![(i % 200) as u8; K as usize];
        c.write(&data, i * 4 * K, false).unwrap();
        want[(i * 4 * K) as usize..(i * 4 * K + K) as usize].copy_from_slice(&data);
    }
    // Reads see the dirty data, whatever has been written back yet: the last block, which
    // no write has passed, certainly has not.
    assert_eq!(read(&c, 0, 4 * MIB), want);
    assert!(c.stats().backend_writes < MIB / (64 * K), "{:?}", c.stats());
    assert!(c.stats().held >= K);
    c.flush().unwrap();
    let s = c.stats();
    assert_eq!((s.client_writes, s.absorbed, s.held), (256, 256, 0), "{s:?}");
    assert_eq!(s.backend_writes, MIB / (64 * K), "{s:?}");
    assert!(s.fill_reads > 0 && s.bytes_filled > 0, "{s:?}");
    assert_eq!(read(&*mem, 0, 4 * MIB), want);
}

/// Blocks a strided writer has moved past are written back by the background thread before
/// any FLUSH (and with the age bound far away); the block it is still in, and blocks random
/// writes left behind without reaching their end, stay held.
#[test]
fn passed_blocks_are_written_back_early() {
    let mem = full(4 * MIB);
    let c = Front::whole(Coalesce::new(mem.clone(), cfg()));
    // Blocks 0-3: 1 KiB every 4 KiB, then one write into block 4.
    for i in 0..65 {
        c.write(&[0x5a; 1024], i * 4 * K, false).unwrap();
    }
    // Scattered writes that end early in their blocks (never passed), entering new blocks.
    for b in [20, 21, 22, 40, 41] {
        c.write(&[0xa5; 1024], b * 64 * K + 1000, false).unwrap();
    }
    let t = Instant::now();
    while c.stats().backend_writes < 4 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    // Give a wrongly queued block time to show up as well.
    std::thread::sleep(Duration::from_millis(50));
    let s = c.stats();
    assert_eq!(s.backend_writes, 4, "blocks 0-3, one request each: {s:?}");
    // Six runs: 6 KiB and a run's cost each.
    assert_eq!(s.held, 6 * K + 6 * dirty::RUN_COST, "block 4 and the five scattered writes stay held: {s:?}");
    for i in 0..64 {
        assert_eq!(read(&*mem, i * 4 * K, K), [0x5a; 1024], "write {i} below");
    }
    c.flush().unwrap();
    assert_eq!(c.stats().backend_writes, 10);
}

#[test]
fn gaps_over_holes_are_not_filled() {
    // A fresh memory backend is all holes: each range is written as it is.
    let mem = Arc::new(MemoryBackend::new(4 * MIB));
    let c = Front::whole(Coalesce::new(mem.clone(), cfg()));
    for i in 0..64 {
        c.write(&[7u8; 1024], i * MIB / 16, false).unwrap();
    }
    // Touching writes still merge: one request for the two.
    c.write(&[8u8; 512], 3 * MIB + 20000, false).unwrap();
    c.write(&[9u8; 512], 3 * MIB + 20512, false).unwrap();
    c.flush().unwrap();
    let s = c.stats();
    assert_eq!((s.backend_writes, s.fill_reads), (65, 0), "{s:?}");
    // Exactly the bytes written: block 48's two ranges 19 KiB apart went down apart. (The
    // memory backend's 64 KiB pages cannot tell: one per block either way.)
    assert_eq!(s.bytes_written, 65 * K, "{s:?}");
    assert_eq!(read(&*mem, 3 * MIB + 20000, 4), [8; 4]);
    assert_eq!(read(&*mem, 3 * MIB + 21000, 24), [9; 24]);
}

#[test]
fn gaps_over_data_are_filled_only_inside_written_units() {
    // Data below everywhere. 1 KiB every 8 KiB and 4 KiB every 8 KiB leave a unit nobody
    // wrote between ranges: reading it only to write it back unchanged costs a synchronous
    // read per block, so each range is written as it is. 1 KiB every 4 KiB (gaps inside
    // written units) is one filled request per block (strided_writes_become_one_...).
    for (stride, len) in [(8 * K, K), (8 * K, 4 * K)] {
        let mem = full(MIB);
        let mut want = read(&*mem, 0, MIB);
        let c = Front::whole(Coalesce::new(mem.clone(), cfg()));
        for i in 0..MIB / stride {
            let data = vec![(i % 250) as u8 + 1; len as usize];
            c.write(&data, i * stride, false).unwrap();
            want[(i * stride) as usize..(i * stride + len) as usize].copy_from_slice(&data);
        }
        c.flush().unwrap();
        let s = c.stats();
        assert_eq!((s.backend_writes, s.fill_reads), (MIB / stride, 0), "stride {stride} len {len}: {s:?}");
        assert_eq!(s.bytes_written, MIB / stride * len, "{s:?}");
        assert_eq!(read(&*mem, 0, MIB), want);
    }
}

#[test]
fn strided_writes_into_holes_merge_within_touched_units() {
    // 1 KiB every 4 KiB: every 4 KiB unit is allocated anyway, so each block is one
    // request; 1 KiB every 8 KiB: the units between were never written, so not filled.
    for (stride, writes) in [(4 * K, 16), (8 * K, 128)] {
        let mem = Arc::new(MemoryBackend::new(4 * MIB));
        let c = Front::whole(Coalesce::new(mem.clone(), cfg()));
        for i in 0..MIB / stride {
            c.write(&[0xaa; 1024], i * stride + 512, false).unwrap();
        }
        c.flush().unwrap();
        assert_eq!(c.stats().backend_writes, writes, "stride {stride}: {:?}", c.stats());
        let got = read(&*mem, 0, MIB);
        for (i, x) in got.iter().enumerate() {
            let written = (i as u64 % stride) >= 512 && (i as u64 % stride) < 1536;
            assert_eq!(*x, if written { 0xaa } else { 0 }, "stride {stride} byte {i}");
        }
    }
}

#[test]
fn trims_and_zeroes_discard_earlier_writes_and_lose_to_later_ones() {
    let mem = full(MIB);
    let c = Front::whole(Coalesce::new(mem.clone(), cfg()));
    c.write(&[1u8; 4096], 8192, false).unwrap();
    c.zero(8192 + 1024, 1024, ZeroFlags::default()).unwrap();
    c.write(&[2u8; 512], 8192 + 1024 + 256, false).unwrap();
    let mut want = vec![1u8; 4096];
    want[1024..2048].fill(0);
    want[1280..1792].fill(2);
    assert_eq!(read(&c, 8192, 4096), want);
    c.trim(0, 64 * K, false).unwrap();
    c.write(&[3u8; 100], 9000, false).unwrap();
    c.flush().unwrap();
    assert_eq!(read(&*mem, 9000, 100), [3u8; 100]);
    // The trimmed bytes around it are whatever the layer below says (zeroes here), not
    // the dirty bytes written before the trim.
    assert_eq!(read(&*mem, 8192, 100), [0u8; 100]);
    // A large write passes through and supersedes dirty bytes under it.
    c.write(&[4u8; 100], 200 * K, false).unwrap();
    c.write(&vec![5u8; 256 * K as usize], 128 * K, false).unwrap();
    assert_eq!(read(&c, 200 * K, 100), [5u8; 100]);
    c.flush().unwrap();
    assert_eq!(read(&*mem, 200 * K, 100), [5u8; 100]);
}

#[test]
fn extents_report_dirty_data_as_data() {
    let mem = Arc::new(MemoryBackend::new(4 * MIB));
    let c = Front::whole(Coalesce::new(mem.clone(), cfg()));
    assert_eq!(c.extents(0, 4 * MIB).unwrap(), [Extent::hole(4 * MIB)]);
    c.write(&[1u8; 1000], MIB + 24, false).unwrap();
    // Whole 4 KiB units are data (qemu misreads unaligned extents).
    assert_eq!(
        c.extents(0, 4 * MIB).unwrap(),
        [Extent::hole(MIB), Extent::data(4 * K), Extent::hole(3 * MIB - 4 * K)]
    );
    // Clipped to the request.
    assert_eq!(c.extents(MIB + 100, 100).unwrap(), [Extent::data(100)]);
    assert_eq!(c.extents(MIB + 4000, 200).unwrap(), [Extent::data(96), Extent::hole(104)]);
    c.flush().unwrap();
    assert!(c.extents(0, 4 * MIB).unwrap().iter().any(|e| !e.hole));
}

#[test]
fn a_failed_write_back_fails_every_later_flush_and_fua() {
    let mem = full(MIB);
    let bad = Rule::new(Op::Write, Fault::Fail(ErrorKind::Io)).at(64 * K, 64 * K).times(1);
    let f = Arc::new(FaultInjector::new(mem.clone(), vec![bad]));
    let c = Front::whole(Coalesce::new(f, cfg()));
    c.write(&[1u8; 1024], 64 * K + 10, false).unwrap();
    c.write(&[2u8; 1024], 10, false).unwrap();
    let e = c.flush().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io);
    // The data was kept: reads still see it, and the retry at the next flush lands.
    assert_eq!(read(&c, 64 * K + 10, 1024), [1u8; 1024]);
    assert!(c.flush().is_err(), "a later flush succeeded after a lost write-back");
    assert_eq!(read(&*mem, 64 * K + 10, 1024), [1u8; 1024]);
    assert!(c.write(&[3u8; 10], 0, true).is_err(), "a FUA write succeeded after the error");
    assert!(c.write(&[], 0, true).is_err(), "an empty FUA write succeeded after the error");
    c.write(&[], 0, false).unwrap();
    assert!(c.finish().is_err());
    assert_eq!(c.stats().errors, 1);
}

/// With an error latched and the bound full, small writes go straight down: a FUA one among
/// them still reports the error (it was answered OK).
#[test]
fn a_fua_write_past_a_full_bound_reports_a_latched_error() {
    let mem = full(MIB);
    let bad = Rule::new(Op::Write, Fault::Fail(ErrorKind::Io)).at(0, 64 * K);
    let f = Arc::new(FaultInjector::new(mem.clone(), vec![bad]));
    let c = Front::whole(Coalesce::new(f, CoalesceConfig { size: 128 * K, ..cfg() }));
    c.write(&[1u8; 1024], 10, false).unwrap();
    assert!(c.flush().is_err());
    // Fill the bound with blocks elsewhere (held: no room for more).
    for b in 1..3u64 {
        c.write(&vec![2u8; 64 * K as usize - 1024], b * 64 * K, false).unwrap();
    }
    assert!(c.stats().held + 4096 > 128 * K, "{:?}", c.stats());
    assert!(c.write(&[3u8; 4096], 512 * K, true).is_err(), "a FUA write succeeded after the error");
}

/// A bound that holds only two blocks: a whole-block write waits for room, and the background
/// thread must make it (it stopped at 3/4 of the bound, and the writer waited for the age).
#[test]
fn a_write_larger_than_a_quarter_of_the_bound_gets_room() {
    let mem = full(MIB);
    // An age bound that ends the wait in 20 s at the latest.
    let c = Front::whole(Coalesce::new(
        mem.clone(),
        CoalesceConfig { size: 128 * K, age: Duration::from_secs(20), ..cfg() },
    ));
    c.write(&vec![1u8; 16 * K as usize], 0, false).unwrap();
    c.write(&vec![2u8; 64 * K as usize], 64 * K, false).unwrap();
    let t0 = Instant::now();
    c.write(&vec![3u8; 64 * K as usize], 256 * K, false).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10), "the write waited {:?}", t0.elapsed());
    c.finish().unwrap();
    assert_eq!(read(&*mem, 256 * K, 64 * K), vec![3u8; 64 * K as usize]);
}

#[test]
fn writers_wait_within_the_memory_bound() {
    let mem = full(16 * MIB);
    let cfg = CoalesceConfig { size: 256 * K, ..cfg() };
    let c = Front::whole(Coalesce::new(mem.clone(), cfg));
    let mut rng = crate::testing::conformance::Rng::new(5);
    let mut want = read(&*mem, 0, 16 * MIB);
    for _ in 0..4000 {
        let off = rng.below(16 * MIB - 4096);
        let mut data = vec![0u8; 1 + rng.below(4096) as usize];
        rng.fill(&mut data);
        c.write(&data, off, false).unwrap();
        want[off as usize..off as usize + data.len()].copy_from_slice(&data);
        assert!(c.stats().held <= cfg.size);
    }
    assert!(c.stats().backend_writes > 0);
    assert_eq!(read(&c, 0, 16 * MIB), want);
    c.finish().unwrap();
    assert_eq!(c.stats().held, 0);
    assert_eq!(read(&*mem, 0, 16 * MIB), want);
}

#[test]
fn old_data_is_written_back_in_the_background() {
    let mem = full(MIB);
    let c =
        Front::whole(Coalesce::new(mem.clone(), CoalesceConfig { age: Duration::from_millis(20), ..cfg() }));
    c.write(&[9u8; 100], 5000, false).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.stats().held > 0 {
        assert!(Instant::now() < deadline, "never written back");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(read(&*mem, 5000, 100), [9u8; 100]);
}

#[test]
fn concurrent_flushes_each_flush_below() {
    let mem = full(MIB);
    let slow = Rule::new(Op::Flush, Fault::Slow(Duration::from_millis(100)));
    let c =
        Arc::new(Front::whole(Coalesce::new(Arc::new(FaultInjector::new(mem.clone(), vec![slow])), cfg())));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let c = c.clone();
            std::thread::spawn(move || {
                c.write(&[t as u8 + 1; 100], t * 70 * K, false).unwrap();
                c.flush().unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = c.stats();
    assert_eq!(s.flushes, 4);
    // No group commit: each FLUSH flushes below itself (the filesystem shares the commit).
    assert_eq!(s.backend_flushes, 4, "{s:?}");
    for t in 0..4 {
        assert_eq!(read(&*mem, t * 70 * K, 100), [t as u8 + 1; 100]);
    }
}

/// A FLUSH that finds a block's stripe held by a write-back in progress (the background
/// thread's) writes back the other blocks first and waits for that one last; it still returns
/// only once both are down.
#[test]
fn a_flush_writes_back_other_blocks_while_a_stripe_is_busy() {
    let mem = full(MIB);
    let (a, b) = (0u64, 5u64);
    assert_ne!(HeldWrites::stripe_of(a), HeldWrites::stripe_of(b));
    let slow = Rule::new(Op::Write, Fault::Slow(Duration::from_secs(2))).at(a * 64 * K, 64 * K);
    let c =
        Arc::new(Front::whole(Coalesce::new(Arc::new(FaultInjector::new(mem.clone(), vec![slow])), cfg())));
    c.write(&[0xeeu8; 100], a * 64 * K, false).unwrap();
    c.write(&[2u8; 100], b * 64 * K, false).unwrap();
    let bg = {
        let c = c.clone();
        std::thread::spawn(move || c.shared.write_back_one(a).unwrap())
    };
    let t = Instant::now();
    while c.shared.stripes[HeldWrites::stripe_of(a)].try_read().is_ok() {
        assert!(t.elapsed() < Duration::from_secs(10), "the write-back never took its stripe");
        std::thread::yield_now();
    }
    let fl = {
        let c = c.clone();
        std::thread::spawn(move || c.flush().unwrap())
    };
    // Block b lands while block a's write is still sleeping.
    while read(&*mem, b * 64 * K, 100) != [2u8; 100] {
        assert!(t.elapsed() < Duration::from_millis(1500), "block b waited for block a's stripe");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_ne!(read(&*mem, a * 64 * K, 100), [0xeeu8; 100]);
    assert!(!fl.is_finished(), "the FLUSH returned before block a was down");
    fl.join().unwrap();
    assert_eq!(read(&*mem, a * 64 * K, 100), [0xeeu8; 100]);
    bg.join().unwrap();
    assert_eq!(c.stats().held, 0);
}

#[test]
fn reads_at_hand_see_held_bytes_and_never_wait() {
    let mem = full(MIB);
    let c = Front::whole(Coalesce::new(mem.clone(), cfg()));
    c.write(&[9u8; 100], 5000, false).unwrap();
    let mut buf = [0u8; 200];
    assert_eq!(c.read_at_hand(&mut buf, 4950).unwrap().unwrap(), 200);
    assert_eq!(&buf[50..150], &[9u8; 100]);
    assert_eq!(buf[0], read(&*mem, 4950, 1)[0]);
    // A write-back holding the stripe: the reader thread must not wait for it.
    let _busy = c.shared.stripes[0].write().unwrap();
    assert!(c.read_at_hand(&mut buf, 4950).is_none());
}

#[test]
fn dropping_writes_everything_back() {
    let mem = full(MIB);
    let c = Front::whole(Coalesce::new(mem.clone(), cfg()));
    c.write(&[9u8; 100], 5000, false).unwrap();
    drop(c);
    assert_eq!(read(&*mem, 5000, 100), [9u8; 100]);
    // After finish, writes go straight through: nothing would write them back.
    let c = Front::whole(Coalesce::new(mem.clone(), cfg()));
    c.finish().unwrap();
    c.write(&[7u8; 100], 5000, false).unwrap();
    assert_eq!((c.stats().held, c.stats().backend_writes), (0, 1));
    assert_eq!(read(&*mem, 5000, 100), [7u8; 100]);
}

/// `write_at_hand` holds a small write at once, or does nothing at all: not for a write
/// that would go straight down, not without room, not while a stripe is locked (a
/// write-back holds it across device I/O), not after `finish`.
#[test]
fn writes_at_hand_are_held_or_left_alone() {
    let mem = full(4 * MIB);
    let c = Front::whole(Coalesce::new(mem.clone(), CoalesceConfig { size: 128 * K, ..cfg() }));
    let before = read(&*mem, 0, 4 * MIB);
    let mut want = before.clone();

    assert!(c.write_at_hand(&[1u8; 1024], 5000).unwrap().is_ok());
    want[5000..6024].fill(1);
    assert_eq!(read(&c, 0, 4 * MIB), want, "held bytes are read back");
    assert_eq!(read(&*mem, 0, 4 * MIB), before, "nothing written below yet");
    let s = c.stats();
    assert_eq!((s.client_writes, s.absorbed, s.held), (1, 1, 1024 + dirty::RUN_COST), "{s:?}");

    // Larger than max_request: it goes straight down, so not here.
    let big = vec![2u8; (c.shared.cfg.max_request + 1) as usize];
    assert!(c.write_at_hand(&big, MIB).is_none());
    // No room: 128 KiB held at most.
    assert!(c.write_at_hand(&[3u8; 64 * 1024], 2 * MIB).unwrap().is_ok());
    assert!(c.write_at_hand(&[3u8; 64 * 1024], 3 * MIB).is_none());
    // A locked stripe.
    {
        let _held = c.shared.write_locks(5000, 1);
        assert!(c.write_at_hand(&[4u8; 16], 5100).is_none());
    }
    let s = c.stats();
    assert_eq!(
        (s.client_writes, s.absorbed, s.held),
        (2, 2, 1024 + 64 * 1024 + 2 * dirty::RUN_COST),
        "only what was held counts: {s:?}"
    );
    want[2 * MIB as usize..2 * MIB as usize + 64 * 1024].fill(3);

    c.flush().unwrap();
    assert_eq!(read(&*mem, 0, 4 * MIB), want, "a flush writes the held bytes back");
    c.finish().unwrap();
    assert!(c.write_at_hand(&[5u8; 16], 0).is_none(), "after finish nothing is held");
}

#[test]
fn concurrent_writers_never_hold_more_than_the_bound() {
    let mem = full(8 * MIB);
    let bound = 64 * K;
    let c = Arc::new(Front::whole(Coalesce::new(mem.clone(), CoalesceConfig { size: bound, ..cfg() })));
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let c = c.clone();
            std::thread::spawn(move || {
                for i in 0..400u64 {
                    c.write(&[t as u8 + 1; 4096], t * MIB + (i % 256) * 4096, false).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    c.flush().unwrap();
    let s = c.stats();
    assert!(s.peak_held > 0 && s.peak_held <= bound, "held {} at most, bound {bound}", s.peak_held);
    assert_eq!(s.held, 0);
    for t in 0..8 {
        assert_eq!(read(&*mem, t * MIB, 256 * 4096), vec![t as u8 + 1; 256 * 4096]);
    }
}

#[test]
fn gaps_known_to_read_as_zeroes_are_filled_without_reading() {
    // Holes everywhere but the second MiB, which holds data before the filter starts.
    let mem = Arc::new(MemoryBackend::new(4 * MIB));
    mem.write(&vec![5u8; MIB as usize], MIB, false).unwrap();
    let c = Front::whole(Coalesce::new(mem.clone(), cfg()));
    // 1 KiB every 4 KiB over 256 KiB of holes and 256 KiB of data: four 64 KiB blocks each.
    for i in 0..64u64 {
        c.write(&[9u8; 1024], i * 4096, false).unwrap();
        c.write(&[9u8; 1024], MIB + i * 4096, false).unwrap();
    }
    c.flush().unwrap();
    let s = c.stats();
    assert_eq!(s.fill_reads, 4, "only the data region's blocks read their gaps: {s:?}");
    let page = |region: u64, i: u64| read(&*mem, region + i * 4096, 4096);
    for i in 0..64 {
        assert_eq!(page(0, i), [&[9u8; 1024][..], &[0u8; 3072][..]].concat());
        assert_eq!(page(MIB, i), [&[9u8; 1024][..], &[5u8; 3072][..]].concat());
    }
    // Written since: no longer known zeroes, so the next write-back there reads its gaps and
    // keeps the bytes written before.
    for i in 0..64u64 {
        c.write(&[7u8; 1024], i * 4096 + 2048, false).unwrap();
    }
    c.flush().unwrap();
    assert_eq!(c.stats().fill_reads, 8, "{:?}", c.stats());
    for i in 0..64 {
        assert_eq!(page(0, i), [&[9u8; 1024][..], &[0u8; 1024], &[7u8; 1024], &[0u8; 1024]].concat());
    }
}

/// Counts the writes that reach it by the way they came (`write` or `write_merged`).
struct Recorder {
    inner: Arc<MemoryBackend>,
    plain: AtomicU64,
    merged: AtomicU64,
    /// `will_write` hints, in order.
    hinted: Mutex<Vec<(u64, u64)>>,
}

impl Recorder {
    fn over(inner: Arc<MemoryBackend>) -> Arc<Recorder> {
        Arc::new(Recorder {
            inner,
            plain: AtomicU64::new(0),
            merged: AtomicU64::new(0),
            hinted: Mutex::default(),
        })
    }
}

impl Backend for Recorder {
    fn name(&self) -> &str {
        "recorder"
    }
    fn size(&self) -> Option<u64> {
        self.inner.size()
    }
    fn caps(&self) -> Caps {
        self.inner.caps()
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        self.inner.read(buf, offset)
    }
    fn read_at_hand(&self, buf: &mut [u8], offset: u64) -> Option<Result<usize>> {
        self.inner.read_at_hand(buf, offset)
    }
    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.plain.fetch_add(1, SeqCst);
        self.inner.write(buf, offset, fua)
    }
    /// Not at hand: counted as a plain write when it comes through `write`.
    fn write_at_hand(&self, _buf: &[u8], _offset: u64) -> Option<Result<()>> {
        None
    }
    fn write_merged(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.merged.fetch_add(1, SeqCst);
        self.inner.write(buf, offset, fua)
    }
    fn will_write(&self, offset: u64, len: u64) {
        self.hinted.lock().unwrap().push((offset, len));
    }
    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.inner.zero(offset, len, flags)
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.inner.trim(offset, len, fua)
    }
    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }
    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.cache(offset, len)
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.inner.extents(offset, len)
    }
    crate::backend::reports_of!(inner);
    fn finish(&self) -> Result<()> {
        self.inner.finish()
    }
}

/// A write-back that joins writes over holes between them says so to the layer below
/// (`write_merged`: a file keeps it out of the cache as a large write); one joined over data
/// read from below, and one range written as it is (a lone write, or touching ones), go down
/// as plain writes.
#[test]
fn write_backs_that_join_writes_say_so() {
    for holes in [false, true] {
        let mem = if holes { Arc::new(MemoryBackend::new(4 * MIB)) } else { full(4 * MIB) };
        let rec = Recorder::over(mem.clone());
        let c = Front::whole(Coalesce::new(rec.clone(), cfg()));
        // Block 0: 1 KiB every 4 KiB (joined, gaps read or known to be zeroes). Block 2: two
        // touching writes (one range). Block 4: a lone write.
        for i in 0..8 {
            c.write(&[1; 1024], i * 4 * K, false).unwrap();
        }
        c.write(&[2; 512], 2 * 64 * K + 100, false).unwrap();
        c.write(&[3; 512], 2 * 64 * K + 612, false).unwrap();
        c.write(&[4; 1024], 4 * 64 * K + 4 * K, false).unwrap();
        c.flush().unwrap();
        let got = (rec.merged.load(SeqCst), rec.plain.load(SeqCst));
        let want = if holes { (1, 2) } else { (0, 3) };
        assert_eq!(got, want, "holes {holes}: (merged, plain) write-backs");
        assert_eq!(read(&*mem, 28 * K, 1024), [1; 1024]);
        assert_eq!(read(&*mem, 2 * 64 * K + 100, 1024), [[2; 512], [3; 512]].concat());
    }
}

/// Before a FLUSH's write-backs, the layer below is told of every range that will be written
/// as it is (it reads the pages such a write covers in part, all at once), also in blocks
/// with several ranges; ranges joined into one filled request are not (their gaps are read in
/// one piece).
#[test]
fn exact_ranges_are_hinted_before_the_write_backs() {
    let rec = Recorder::over(full(4 * MIB));
    let c = Front::whole(Coalesce::new(rec.clone(), cfg()));
    // Block 0: 1 KiB every 4 KiB (joined). Block 1: two ranges 32 KiB apart (not joined).
    // Block 3: a lone write.
    for i in 0..8 {
        c.write(&[1; 1024], i * 4 * K, false).unwrap();
    }
    c.write(&[2; 1024], 64 * K + 1000, false).unwrap();
    c.write(&[3; 1024], 64 * K + 33000, false).unwrap();
    c.write(&[4; 100], 3 * 64 * K + 5, false).unwrap();
    c.flush().unwrap();
    let mut hinted = rec.hinted.lock().unwrap().clone();
    hinted.sort_unstable();
    assert_eq!(hinted, [(64 * K + 1000, 1024), (64 * K + 33000, 1024), (3 * 64 * K + 5, 100)]);
}

/// The bound counts each run's bookkeeping, not only its bytes: 1-byte writes 2 bytes apart
/// (a run each) fill a 64 KiB bound after about 670 writes, not 64K of them, and writers then
/// wait for write-back as for any full bound.
#[test]
fn tiny_scattered_writes_fill_the_bound_with_their_runs() {
    let mem = Arc::new(MemoryBackend::new(4 * MIB));
    let bound = 64 * K;
    let c = Front::whole(Coalesce::new(mem.clone(), CoalesceConfig { size: bound, ..cfg() }));
    let mut held_before_write_back = 0;
    for i in 0..4096u64 {
        c.write(&[0x11], i * 2, false).unwrap();
        let s = c.stats();
        assert!(s.held <= bound, "{s:?}");
        if s.backend_writes == 0 {
            held_before_write_back = s.absorbed;
        }
    }
    // Each held write costs 1 + RUN_COST: the bound took at most bound / 97 of them.
    assert!(held_before_write_back <= bound / (1 + dirty::RUN_COST), "{held_before_write_back} held");
    assert!(c.stats().backend_writes > 0);
    c.flush().unwrap();
    assert_eq!(c.stats().held, 0);
    let got = read(&*mem, 0, 8192);
    for (i, b) in got.iter().enumerate() {
        assert_eq!(*b, if i % 2 == 0 { 0x11 } else { 0 }, "byte {i}");
    }
}
