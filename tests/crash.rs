//! Crash consistency: the power is cut, or the server is killed with SIGKILL, while clients
//! are writing, and every byte a client had flushed is still there afterwards.
//!
//! - Power loss: an in-process server over the simulated power-loss device
//!   (`testing::powerloss`), with each filter stack. Only bytes made durable by a flush or FUA
//!   survive the cut, so a missing or early flush reply shows up here.
//! - `kill -9`: a `lightfoot serve` process in every cache mode with each filter stack. The
//!   page cache outlives the process, so this catches what the server held in its own memory
//!   (the coalesce filter's dirty blocks) rather than a missing fdatasync.
//!
//! Each client writes and zeroes in a region of its own and flushes now and then. A byte it
//! wrote (or zeroed) after its last acknowledged flush may hold either value, unless a FUA
//! write acknowledged since wrote it last; every other byte must hold exactly what it held at
//! that flush (or that FUA write).

mod common;

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use lightfoot::backend::{Backend, NbdBackend, ZeroFlags};
use lightfoot::testing::conformance::Rng;
use lightfoot::testing::powerloss::PowerLoss;

const CLIENTS: u64 = 4;
const REGION: u64 = 2 * MIB;

/// What one client has made durable, as of its last acknowledged flush.
struct Durable {
    /// The region's bytes at that flush.
    flushed: Vec<u8>,
    /// Bytes written or zeroed since (or in flight): they may hold the old or the new value.
    touched: Vec<bool>,
    flushes: u64,
    /// FUA writes acknowledged before the cut (their bytes are counted as flushed).
    fua: u64,
}

struct Client {
    id: u64,
    state: Mutex<Durable>,
    /// A request begun after the cut has ended, or the client has (on an error the crash
    /// caused).
    past_cut: AtomicBool,
}

impl Client {
    fn new(id: u64) -> Client {
        let state = Durable {
            flushed: vec![0; REGION as usize],
            touched: vec![false; REGION as usize],
            flushes: 0,
            fua: 0,
        };
        Client { id, state: Mutex::new(state), past_cut: AtomicBool::new(false) }
    }

    /// Writes, zeroes and flushes at random until `stop`. Flushes acknowledged after `cut` is
    /// set are not counted: the cut may have come first. Errors end the client quietly once
    /// `cut` is set (the server may be gone).
    fn run(&self, b: &dyn Backend, cut: &AtomicBool, stop: &AtomicBool) {
        let base = self.id * REGION;
        let mut rng = Rng::new(0xc7a5 + self.id);
        let mut model = vec![0u8; REGION as usize];
        let mut buf = vec![0u8; 64 << 10];
        while !stop.load(Ordering::Relaxed) {
            let len = 512 * (1 + rng.below(128)) as usize;
            let at = (rng.below(REGION - len as u64 + 1) & !511) as usize;
            // Touched before it is sent: a request in flight at the crash may have landed.
            let mark = |s: &Mutex<Durable>| s.lock().unwrap().touched[at..at + len].fill(true);
            let after_cut = cut.load(Ordering::SeqCst);
            let r = match rng.below(10) {
                0..=6 => {
                    rng.fill(&mut buf[..len]);
                    mark(&self.state);
                    let fua = rng.below(8) == 0;
                    let r = b.write(&buf[..len], base + at as u64, fua);
                    model[at..at + len].copy_from_slice(&buf[..len]);
                    if fua && r.is_ok() && !cut.load(Ordering::SeqCst) {
                        // Durable when answered: these bytes must survive as written.
                        let mut s = self.state.lock().unwrap();
                        s.flushed[at..at + len].copy_from_slice(&buf[..len]);
                        s.touched[at..at + len].fill(false);
                        s.fua += 1;
                    }
                    r
                }
                7 => {
                    mark(&self.state);
                    let flags = ZeroFlags { may_trim: rng.below(2) == 0, fast: false, fua: false };
                    let r = b.zero(base + at as u64, len as u64, flags);
                    model[at..at + len].fill(0);
                    r
                }
                _ => {
                    let r = b.flush();
                    if r.is_ok() && !cut.load(Ordering::SeqCst) {
                        let mut s = self.state.lock().unwrap();
                        s.flushed.copy_from_slice(&model);
                        s.touched.fill(false);
                        s.flushes += 1;
                    }
                    r
                }
            };
            if let Err(e) = r {
                assert!(cut.load(Ordering::SeqCst), "client {}: {e}", self.id);
                self.past_cut.store(true, Ordering::SeqCst);
                return;
            }
            if after_cut {
                self.past_cut.store(true, Ordering::SeqCst);
            }
        }
    }

    /// Checks what survived of this client's region; the flushes and FUA writes it counted.
    fn check(&self, image: &[u8], what: &str) -> (u64, u64) {
        let s = self.state.lock().unwrap();
        let at = (self.id * REGION) as usize;
        let got = &image[at..at + REGION as usize];
        for (i, (&g, &f)) in got.iter().zip(&s.flushed).enumerate() {
            assert!(
                s.touched[i] || g == f,
                "{what}: client {}: byte +{i} is {g:#x}, flushed {f:#x}",
                self.id
            );
        }
        (s.flushes, s.fua)
    }
}

/// Runs the clients on `connect`ed backends; once `pause` has passed and each client has
/// flushed at least once, sets `cut` and calls `crash`; stops the clients once each has sent
/// a request after the crash (or ended on the error it caused); returns the flushes counted.
fn crash_during_writes(
    connect: impl Fn() -> Box<dyn Backend> + Sync,
    pause: Duration,
    crash: impl FnOnce(),
) -> Vec<Arc<Client>> {
    let clients: Vec<Arc<Client>> = (0..CLIENTS).map(|id| Arc::new(Client::new(id))).collect();
    let (cut, stop) = (AtomicBool::new(false), AtomicBool::new(false));
    std::thread::scope(|s| {
        for c in &clients {
            let b = connect();
            let (cut, stop) = (&cut, &stop);
            s.spawn(move || c.run(&*b, cut, stop));
        }
        // The workload's length: writes go on for `pause` (and until each client has flushed)
        // before the crash, however fast they are. Not a wait for something to happen.
        std::thread::sleep(pause);
        let flushed = within(20, || clients.iter().all(|c| c.state.lock().unwrap().flushes > 0));
        if flushed {
            cut.store(true, Ordering::SeqCst);
            crash();
        }
        let went_on = flushed && within(20, || clients.iter().all(|c| c.past_cut.load(Ordering::SeqCst)));
        // Stopped before any assertion fails: the scope waits for the clients.
        stop.store(true, Ordering::Relaxed);
        assert!(flushed, "a client never flushed");
        assert!(went_on, "a client sent no request after the crash, nor ended");
    });
    clients
}

fn nbd(sock: &Path) -> Box<dyn Backend> {
    let s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    Box::new(NbdBackend::from_stream(Box::new(s), "", "crash").unwrap())
}

/// How many times each test runs its matrix: 1 in `make test`; more by hand with
/// `LIGHTFOOT_CRASH_ROUNDS=N cargo test --release --test crash -- --nocapture`.
fn rounds() -> usize {
    std::env::var("LIGHTFOOT_CRASH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(1)
}

const STACKS: [&[&str]; 4] = [&[], &["--prefetch"], &["--coalesce"], &["--prefetch", "--coalesce"]];

#[test]
fn power_loss_during_writes_with_every_stack() {
    let (mut crashes, mut flushes_checked, mut fua_checked) = (0, 0, 0);
    for stack in (0..rounds()).flat_map(|_| STACKS) {
        let device = Arc::new(PowerLoss::new(CLIENTS * REGION));
        let opener =
            stack_opener(device.clone(), stack.contains(&"--prefetch"), stack.contains(&"--coalesce"));
        let srv = InProcess::start(opener, |_| {});
        let sock = srv.sock.clone();
        let mut survived = Vec::new();
        let clients =
            crash_during_writes(|| nbd(&sock), Duration::from_millis(300), || survived = device.power_loss());
        let (mut flushes, mut fua) = (0, 0);
        for c in &clients {
            let (f, u) = c.check(&survived, &format!("power loss, {stack:?}"));
            (flushes, fua) = (flushes + f, fua + u);
        }
        assert!(flushes >= CLIENTS, "{stack:?}: {flushes} flushes");
        crashes += 1;
        flushes_checked += flushes;
        fua_checked += fua;
        // The server's final flush may fail: the device lost power under the filters.
        let _ = srv.stop();
    }
    println!(
        "power loss: {crashes} cuts, {flushes_checked} acknowledged flushes and {fua_checked} FUA writes checked, 0 bytes lost"
    );
}

#[test]
fn kill_9_during_writes_in_every_cache_mode_and_stack() {
    let (mut crashes, mut flushes_checked, mut fua_checked) = (0, 0, 0);
    for mode in (0..rounds()).flat_map(|_| ["neutral", "keep", "drop", "direct"]) {
        for stack in STACKS {
            let dir = scratch();
            let img = dir.path().join("disk.img");
            std::fs::File::create(&img).unwrap().set_len(CLIENTS * REGION).unwrap();
            let cache = format!("--cache={mode}");
            let mut args = vec![cache.as_str()];
            args.extend_from_slice(stack);
            let served = Served::start(&img, &args);
            let sock = served.sock.clone();
            let mut served = Some(served);
            let clients = crash_during_writes(
                || nbd(&sock),
                Duration::from_millis(150),
                || served.take().unwrap().kill9(),
            );
            let image = std::fs::read(&img).unwrap();
            for c in &clients {
                let (f, u) = c.check(&image, &format!("kill -9, --cache={mode} {stack:?}"));
                (flushes_checked, fua_checked) = (flushes_checked + f, fua_checked + u);
            }
            crashes += 1;
        }
    }
    println!(
        "kill -9: {crashes} kills, {flushes_checked} acknowledged flushes and {fua_checked} FUA writes checked, 0 bytes lost"
    );
}
