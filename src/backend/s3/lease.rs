//! One writer per writable block image: a lease object, `KEY/lightfoot.lease`.
//!
//! Two servers writing one image would each keep their own map of objects (BLOCK_STATUS) and
//! their own object locks, and a read-modify-write of one could undo the other's write. So a
//! writer holds the lease:
//!
//! - It is **created** with a conditional PUT (`If-None-Match: *`): of two writers starting
//!   at once, exactly one gets it. A lease found expired is taken over with `If-Match` on the
//!   ETag read, so two takers cannot both succeed either.
//! - It is **renewed** every [`RENEW`] with `If-Match` on the ETag of our last write of it:
//!   a lease broken by someone else (`--break-lease`) fails the renewal.
//! - It **expires** [`TTL`] after its last renewal. The writer stops writing before that:
//!   every write checks that less than `TTL - MARGIN` has passed since the start of the last
//!   renewal that succeeded, and fails with EIO otherwise. A writer cut off from the store
//!   therefore stops before another may take the image over.
//! - It is **deleted** when the writer ends cleanly.
//!
//! All of this rests on the store enforcing conditional writes, which not every
//! S3-compatible store does. [`probe_conditional_writes`] checks it at open: a second create
//! of one name must be refused.
//!
//! The name sorts after every block name, so nbdkit's TRIM does not delete it; nbdkit's S3
//! plugin itself ignores the lease (it writes whatever is leased).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use object_store::{PutMode, UpdateVersion};

use super::store::Store;
use super::S3Options;
use crate::error::{Error, ErrorKind, Op, Result, Sticky};

pub const LEASE: &str = "lightfoot.lease";
/// How long a lease lasts after its last renewal.
pub const TTL: Duration = Duration::from_secs(30);
/// How often it is renewed.
pub const RENEW: Duration = Duration::from_secs(10);
/// How long before expiry the holder stops writing (a write already sent may still land).
const MARGIN: Duration = Duration::from_secs(8);

/// What a lease object holds (JSON).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Record {
    pub holder: String,
    /// Random, one writer's own: tells its lease from another writer's of the same `holder`
    /// text (containers can share a pid and a hostname). Absent from older leases.
    #[serde(default)]
    pub token: String,
    /// Seconds since the epoch.
    pub expires: u64,
}

impl Record {
    /// A lease object's bytes read: `None` if they are not a lease (another program's
    /// object, a damaged one), which counts as no lease held.
    pub fn parse(bytes: &[u8]) -> Option<Record> {
        serde_json::from_slice(bytes).ok()
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("lease serializes")
    }
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Whether the store refuses a second create of one name (`If-None-Match: *`). Writes nothing
/// that stays: the probe object is deleted.
pub fn probe_conditional_writes(store: &Store, key: &str) -> Result<bool> {
    let probe = format!("{key}/lightfoot.probe-{}-{}", std::process::id(), now_secs());
    let first = store.run(store.put(&probe, Bytes::from_static(b"probe"), PutMode::Create))?;
    let second = store.run(store.put(&probe, Bytes::from_static(b"probe"), PutMode::Create))?;
    store.run(store.delete(vec![probe]))?;
    Ok(first.is_some() && second.is_none())
}

/// A live lease held by another writer, if there is one (for read-only opens).
pub fn held_by_other(store: &Store, key: &str) -> Result<Option<String>> {
    let name = format!("{key}/{LEASE}");
    let Some((bytes, _)) = store.run(store.get(&name, None, None))? else { return Ok(None) };
    Ok(Record::parse(&bytes).filter(|r| r.expires > now_secs()).map(|r| r.holder))
}

/// How an open of the block image at `key` stands towards its one writer: the lease it
/// holds (writable, unless `--without-lease`), and whether no other writer can change the
/// image while it is open (so the map of its objects made at open stays true). A writable
/// open fails on a store without conditional writes unless `--without-lease`.
pub fn at_open(store: &Arc<Store>, key: &str, name: &str, opts: &S3Options) -> Result<(Option<Lease>, bool)> {
    if !opts.writable {
        return Ok(match held_by_other(store, key)? {
            Some(holder) => {
                tracing::info!("{name}: {holder} is writing the image: block status reports it all as data");
                (None, false)
            }
            None => (None, true),
        });
    }
    if !probe_conditional_writes(store, key)? {
        if !opts.without_lease {
            return Err(Error::new(ErrorKind::NotSupported, Op::Open).path(name).detail(
                "the store does not enforce conditional writes (a second create of one name succeeded), \
                 so lightfoot cannot make sure it is the image's only writer; --without-lease writes anyway",
            ));
        }
        tracing::warn!(
            "{name}: --without-lease on a store without conditional writes: nothing stops a second writer"
        );
        return Ok((None, true));
    }
    if opts.without_lease {
        tracing::warn!("{name}: --without-lease: nothing stops a second writer");
        return Ok((None, true));
    }
    Ok((Some(Lease::take(store.clone(), key, opts.break_lease)?), true))
}

/// A lease this process holds, renewed by a thread of its own until dropped.
pub struct Lease {
    state: Arc<State>,
    renewer: Mutex<Option<std::thread::JoinHandle<()>>>,
}

struct State {
    store: Arc<Store>,
    name: String,
    holder: String,
    token: String,
    etag: Mutex<Option<String>>,
    /// When (ms since the epoch) the last successful renewal was started.
    renewed_ms: AtomicU64,
    /// Why writing stopped: the lease was taken by another writer, or released.
    lost: Sticky,
    stop: Mutex<bool>,
    wake: Condvar,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl Lease {
    /// Takes the lease of `key`'s image: creates it, takes over one that expired, or with
    /// `force` (`--break-lease`) replaces a live one. Fails naming the holder otherwise.
    pub fn take(store: Arc<Store>, key: &str, force: bool) -> Result<Lease> {
        let name = format!("{key}/{LEASE}");
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let holder = format!("lightfoot pid {} on {}", std::process::id(), host.trim());
        let token = new_token();
        let started = now_ms();
        let body = || record(&holder, &token);
        let etag = match store.run(store.put(&name, body(), PutMode::Create))? {
            Some((etag, version)) => {
                warn_if_versioned(&store, &name, version.as_deref());
                etag
            }
            None => {
                let (old, meta) = store.run(store.get(&name, None, None))?.ok_or_else(|| {
                    Error::new(ErrorKind::Io, Op::Open)
                        .path(store.uri(&name))
                        .detail("the lease was released while it was being taken: try again")
                })?;
                let rec = Record::parse(&old);
                let live = rec.as_ref().is_some_and(|r| r.expires > now_secs());
                if live && !force {
                    let r = rec.expect("live");
                    return Err(Error::new(ErrorKind::Permission, Op::Open).path(store.uri(&name)).detail(format!(
                        "the image has a writer: {} holds its lease for {} s more (if that writer is dead, --break-lease)",
                        r.holder,
                        r.expires.saturating_sub(now_secs())
                    )));
                }
                if live {
                    tracing::warn!(
                        "{}: breaking the lease of {}",
                        store.uri(&name),
                        rec.expect("live").holder
                    );
                }
                // Taken over only if nobody changed it since we read it.
                let update = UpdateVersion { e_tag: meta.etag, version: None };
                match store.run(store.put(&name, body(), PutMode::Update(update)))? {
                    Some((etag, _)) => etag,
                    None => {
                        return Err(Error::new(ErrorKind::Permission, Op::Open)
                            .path(store.uri(&name))
                            .detail("another writer took the lease at the same moment"))
                    }
                }
            }
        };
        let state = Arc::new(State {
            store,
            name,
            holder,
            token,
            etag: Mutex::new(etag),
            renewed_ms: AtomicU64::new(started),
            lost: Sticky::default(),
            stop: Mutex::new(false),
            wake: Condvar::new(),
        });
        let s = state.clone();
        let renewer = std::thread::Builder::new()
            .name("lightfoot-lease".into())
            .spawn(move || s.renew_until_stopped())
            .map_err(|e| Error::io(Op::Open, e))?;
        Ok(Lease { state, renewer: Mutex::new(Some(renewer)) })
    }

    /// Ok while writing is safe: the lease is ours and cannot have expired.
    pub fn check(&self) -> Result<()> {
        let s = &self.state;
        let age = now_ms().saturating_sub(s.renewed_ms.load(Relaxed));
        let stop = "the image's lease was lost or could not be renewed in time: writes stop before another writer may take over";
        if let Some(lost) = s.lost.get() {
            return Err(Error::after(Op::Write, lost)
                .kind_as(ErrorKind::Io)
                .path(s.store.uri(&s.name))
                .detail(stop));
        }
        if age >= (TTL - MARGIN).as_millis() as u64 {
            return Err(Error::new(ErrorKind::Io, Op::Write).path(s.store.uri(&s.name)).detail(stop));
        }
        Ok(())
    }
}

impl State {
    fn renew_until_stopped(&self) {
        let mut stop = self.stop.lock().unwrap();
        loop {
            stop = self.wake.wait_timeout(stop, RENEW).unwrap().0;
            if *stop {
                return;
            }
            drop(stop);
            if !self.renew() {
                let taken = Error::new(ErrorKind::Permission, Op::Lease)
                    .path(self.store.uri(&self.name))
                    .detail("the lease was taken by another writer");
                tracing::error!("{taken}: writes stop");
                self.lost.set(&taken);
                return;
            }
            stop = self.stop.lock().unwrap();
        }
    }

    /// One renewal; false when the lease has become another writer's. A failure to reach the
    /// store is not that: it is tried again at the next round, and writes stop by themselves
    /// if it never works.
    fn renew(&self) -> bool {
        // Twice at most: again at once when the lease turns out to be still ours.
        for _ in 0..2 {
            let started = now_ms();
            let etag = self.etag.lock().unwrap().clone();
            let update = UpdateVersion { e_tag: etag, version: None };
            match self.store.run(self.store.put(
                &self.name,
                record(&self.holder, &self.token),
                PutMode::Update(update),
            )) {
                Ok(Some((etag, _))) => {
                    *self.etag.lock().unwrap() = etag;
                    self.renewed_ms.store(started, Relaxed);
                    return true;
                }
                // The ETag changed. Our own renewal that timed out may have landed since: a
                // store can finish a request its client gave up on (SeaweedFS's gateway goes
                // on for 30 s waiting for a writable volume, and stores it then, its If-Match
                // still true). The lease is still ours if it still carries our token: go on
                // from its ETag.
                Ok(None) => match self.still_ours() {
                    Ok(Some(etag)) => {
                        tracing::warn!(
                            "{}: a late renewal of ours landed: going on",
                            self.store.uri(&self.name)
                        );
                        *self.etag.lock().unwrap() = etag;
                    }
                    Ok(None) => return false,
                    Err(e) => {
                        tracing::warn!("renewing the lease: {e}");
                        return true;
                    }
                },
                Err(e) => {
                    tracing::warn!("renewing the lease: {e}");
                    return true;
                }
            }
        }
        true
    }

    /// The ETag of the lease if it is this writer's (its token), `None` if it is gone or
    /// someone else's.
    fn still_ours(&self) -> Result<Option<Option<String>>> {
        let Some((bytes, meta)) = self.store.run(self.store.get(&self.name, None, None))? else {
            return Ok(None);
        };
        let ours = Record::parse(&bytes).is_some_and(|r| r.token == self.token);
        Ok(ours.then_some(meta.etag))
    }
}

impl Lease {
    /// Stops renewing and deletes the lease if it is still ours (the end of the job; also on
    /// drop). Writes fail from then on.
    pub fn release(&self) {
        *self.state.stop.lock().unwrap() = true;
        self.state.wake.notify_all();
        let Some(h) = self.renewer.lock().unwrap().take() else { return };
        let _ = h.join();
        let s = &self.state;
        let released = Error::new(ErrorKind::Io, Op::Lease).path(s.store.uri(&s.name)).detail("released");
        if !s.lost.set(&released) {
            return;
        }
        let ours = s.store.run(s.store.head(&s.name)).ok().flatten().and_then(|m| m.etag);
        if ours.is_some() && ours == *s.etag.lock().unwrap() {
            if let Err(e) = s.store.run(s.store.delete(vec![s.name.clone()])) {
                tracing::warn!("releasing the lease: {e}");
            }
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.release();
    }
}

/// 64 random bits in hex: std's hasher keys come from the OS's randomness, fresh in each
/// process.
fn new_token() -> String {
    use std::hash::BuildHasher;
    format!(
        "{:016x}",
        std::collections::hash_map::RandomState::new().hash_one((std::process::id(), now_ms()))
    )
}

fn record(holder: &str, token: &str) -> Bytes {
    let r =
        Record { holder: holder.to_string(), token: token.to_string(), expires: now_secs() + TTL.as_secs() };
    Bytes::from(r.encode())
}

/// Versioned buckets keep every rewrite of an object: a block image rewritten in place grows
/// the bucket without bound.
pub fn warn_if_versioned(store: &Store, name: &str, version: Option<&str>) {
    if version.is_some_and(|v| v != "null") {
        tracing::warn!(
            "{}: the bucket keeps versions: every rewrite of a block object keeps the old one too \
             (storage grows with every write); a lifecycle rule that expires noncurrent versions keeps it bounded",
            store.uri(name)
        );
    }
}
