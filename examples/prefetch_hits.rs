//! prefetch_hits: the CPU cost of `--prefetch`'s hit path, without a network or a device.
//!
//! THREADS threads (default 4, as `bench/serve.sh`'s seqread4k jobs) each read their own
//! region of an in-memory export sequentially in BLOCK-byte reads (default 4096) through one
//! prefetch filter, as the server's connections do: `read_at_hand` first (a hit is answered
//! there), `read` on a miss. Read-ahead fills from memory, so what is timed is the filter's
//! own work per read and its lock. Runs ROUNDS rounds (default 5) over fresh filters and prints
//! each round's nanoseconds per read, then their median and least (the least is the
//! steadiest on a shared machine).
//!
//!     cargo build --release --examples
//!     target/release/examples/prefetch_hits [THREADS] [MIB_PER_THREAD] [ROUNDS] [BLOCK]
//!
//! Built from two revisions, it shows whether the hit path got dearer between them (used for
//! the seqread4k A/B of issue 44: docs/benchmarks/runs/).

use std::sync::Arc;
use std::time::Instant;

use lightfoot::backend::{Backend, MemoryBackend};
use lightfoot::filters::prefetch::{Prefetch, PrefetchConfig};
use lightfoot::filters::Filter;

fn main() {
    let arg = |i: usize, d: u64| std::env::args().nth(i).map_or(d, |a| a.parse().expect("a number"));
    let (threads, mib, rounds, block) = (arg(1, 4), arg(2, 256), arg(3, 5), arg(4, 4096));
    let region = mib << 20;
    let size = region * threads;
    let below: Arc<dyn Backend> = Arc::new(MemoryBackend::new(size));
    let mut per_read = Vec::new();
    for _ in 0..rounds {
        let filter = Arc::new(Prefetch::new(below.clone(), PrefetchConfig::default()));
        let start = Instant::now();
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (filter, below) = (filter.clone(), below.clone());
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; block as usize];
                    let mut at = t * region;
                    while at + block <= (t + 1) * region {
                        match filter.read_at_hand(&*below, &mut buf, at) {
                            Some(r) => r.map(|_| ()).expect("read"),
                            None => filter.read(&*below, &mut buf, at).map(|_| ()).expect("read"),
                        }
                        at += block;
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().expect("a reader");
        }
        let ns = start.elapsed().as_nanos() as f64 / (size / block) as f64;
        println!("{ns:.0} ns per read; {:?}", filter.stats());
        per_read.push(ns);
        drop(filter);
    }
    per_read.sort_by(|a, b| a.total_cmp(b));
    println!(
        "median {:.0} min {:.0} ns per read ({threads} threads, {block}-byte reads)",
        per_read[per_read.len() / 2],
        per_read[0]
    );
}
