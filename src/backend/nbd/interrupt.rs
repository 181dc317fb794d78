//! Ending every NBD connection of the process from outside, for an interrupted job.
//!
//! Ctrl-C stops a copy at the next request, but a thread waiting for a server's reply, or
//! for its handshake, only sees the flag once the server answers, and a server that is alive
//! but no longer answering (stopped, wedged, behind a dead proxy) never does: the copy used
//! to need a second Ctrl-C, which exits without the cache clean-up. So every socket is
//! registered from the moment it connects until its connection is dropped, and
//! [`interrupt_all`] shuts them all down: blocked reads and writes return, the requests fail
//! as interrupted, and the copy ends the ordinary way, cleaning up. A connect that is still
//! waiting (a host dropping SYNs, a Unix socket with a full listen queue) has no socket to
//! shut down yet: it asks [`interrupted`] every 100 ms instead. A process-wide registry
//! rather than a method of the backend: the handshake runs before any backend exists, and
//! the caller (the CLI's signal handler) holds no backend.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::stream::Closer;

struct Registry {
    next: u64,
    open: BTreeMap<u64, Arc<Closer>>,
}

static OPEN: Mutex<Registry> = Mutex::new(Registry { next: 0, open: BTreeMap::new() });
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// A socket's place in the registry; dropping it takes the socket out. It also ends the
/// socket for its owner ([`Registered::close`]), so a connection keeps no closer of its own.
pub(super) struct Registered {
    id: u64,
    closer: Arc<Closer>,
}

impl Registered {
    /// Shuts the socket down (as [`interrupt_all`] would, for this one alone).
    pub(super) fn close(&self) {
        (self.closer)();
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        OPEN.lock().unwrap().open.remove(&self.id);
    }
}

/// Registers a connected socket. One registered after [`interrupt_all`] is shut down at once.
pub(super) fn register(closer: Closer) -> Registered {
    let mut reg = OPEN.lock().unwrap();
    if INTERRUPTED.load(Ordering::SeqCst) {
        closer();
    }
    let id = reg.next;
    reg.next += 1;
    let closer = Arc::new(closer);
    reg.open.insert(id, closer.clone());
    Registered { id, closer }
}

/// Shuts down every NBD socket of the process, now and from now on (for Ctrl-C: nothing
/// afterwards may wait on a server).
pub fn interrupt_all() {
    let reg = OPEN.lock().unwrap();
    INTERRUPTED.store(true, Ordering::SeqCst);
    reg.open.values().for_each(|close| close());
}

/// [`interrupt_all`] has been called: a connection that broke broke because of it.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}
