//! The NBD client backend: an export on an NBD server, reached by URI
//! ([`uri::Uri`]: `nbd://host[:port]/export`, `nbd+unix:///export?socket=PATH`, and over TLS
//! `nbds://`, `nbds+unix://`) or on a captive server lightfoot starts itself
//! ([`captive::Captive`]: `[ qemu-nbd disk.qcow2 ]`).
//!
//! - [`handshake`]: fixed newstyle negotiation: structured replies, `base:allocation`, GO with
//!   block sizes.
//! - [`conn`]: one connection shared by many threads, each with a request in flight, taking
//!   turns to read the replies; `reply`: reading one reply straight into the caller's buffer,
//!   and the checks that refuse a hostile server's.
//! - [`NbdBackend`]: one or more connections (more only when the server advertises
//!   `CAN_MULTI_CONN`), requests split to the server's maximum size, extents from
//!   `base:allocation`, zeroing with `WRITE_ZEROES` (`FAST_ZERO` when asked), never `TRIM`
//!   for zeroes.
//! - [`interrupt_all`]: ends every connection of the process (Ctrl-C, when a server stops
//!   answering).
//!
//! Every byte of the protocol is encoded and decoded by [`crate::proto`]; this module reads
//! and writes the socket and decides what to ask.

mod align;
pub mod captive;
pub mod conn;
mod extents;
pub mod handshake;
mod interrupt;
mod reply;
pub mod uri;

use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use super::{write_zeroes, Backend, BlockSizes, CacheInfo, Caps, Extent, Report, ZeroFlags};
use crate::error::{Error, ErrorKind, Op, Result};
use crate::io::sys;
use crate::proto::*;
use crate::stream::Stream;
use crate::tls::{ClientTls, Verify};
pub use captive::Captive;
pub use conn::Connection;
pub use handshake::ExportInfo;
pub use interrupt::{interrupt_all, interrupted};
pub use uri::{Address, TlsParams, Uri};

/// Zero, trim and cache requests carry a 32-bit length: larger ranges go in pieces of this.
const RANGE_PIECE: u64 = 1 << 30;

/// Where the server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Uri(Uri),
    /// A command line to start as a captive server.
    Captive(Vec<String>),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Uri(u) => write!(f, "{u}"),
            Target::Captive(argv) => write!(f, "[ {} ]", argv.join(" ")),
        }
    }
}

pub struct NbdBackend {
    name: String,
    info: ExportInfo,
    conns: Vec<Connection>,
    next: AtomicUsize,
    finished: AtomicBool,
    /// The allocation map, fetched in large windows: only for a copy's source
    /// ([`NbdBackend::keeping_extents`]).
    extent_cache: Option<extents::Cache>,
    /// Read-modify-write of partial blocks (`align`).
    locks: align::BlockLocks,
    /// Declared last: the server is stopped after the connections are closed.
    captive: Option<Captive>,
}

impl NbdBackend {
    /// Keeps the allocation map it fetches, in large windows (`extents`), for a reader
    /// that asks about every request, such as a copy's source. Not for a backend under a
    /// filter stack: writes through the stack's other backends (coalesce's write-back) would
    /// leave it saying "zero" over written data.
    pub fn keeping_extents(mut self) -> NbdBackend {
        self.extent_cache = Some(Default::default());
        self
    }

    /// Forgets the kept allocation map (after a write through this backend).
    fn forget_extents(&self) {
        if let Some(c) = &self.extent_cache {
            c.clear();
        }
    }

    /// Connects to `target`. `connections` > 1 opens that many when the server advertises
    /// `CAN_MULTI_CONN` (and one otherwise).
    pub fn open(target: &Target, connections: usize) -> Result<NbdBackend> {
        Self::open_with_bitmap(target, connections, None)
    }

    /// [`NbdBackend::open`], also agreeing on the dirty bitmap `bitmap` (the meta context
    /// `qemu:dirty-bitmap:BITMAP`): extents then say which ranges it marks clean
    /// ([`Extent::clean`]). A server without it is an error naming the contexts it offers.
    pub fn open_with_bitmap(target: &Target, connections: usize, bitmap: Option<&str>) -> Result<NbdBackend> {
        match target {
            Target::Uri(uri) => {
                let tls = match &uri.tls {
                    Some(params) => Some(client_tls(uri, params)?),
                    None => None,
                };
                let how = How { address: &uri.address, export: &uri.export, tls: tls.as_ref(), bitmap };
                Self::connect_all(uri.text.clone(), how, connections, None)
            }
            Target::Captive(argv) => {
                let captive = Captive::start(argv)?;
                let address = Address::Unix(captive.socket().to_path_buf());
                let name = captive.display.clone();
                let how = How { address: &address, export: "", tls: None, bitmap };
                Self::connect_all(name, how, connections, Some(captive))
            }
        }
    }

    /// Negotiates `export` over a stream that is already connected (one connection); `name`
    /// names it in messages.
    pub fn from_stream(mut stream: Box<dyn Stream>, export: &str, name: &str) -> Result<NbdBackend> {
        let registered = register(&*stream, name)?;
        let info = handshake::negotiate(&mut *stream, export, name).map_err(|e| if_interrupted(e, name))?;
        let conn = Connection::new(stream, info, name, registered)?;
        Ok(Self::assemble(name.to_string(), info, vec![conn], None))
    }

    fn connect_all(
        name: String,
        how: How,
        connections: usize,
        captive: Option<Captive>,
    ) -> Result<NbdBackend> {
        let first = match connect(&how, &name) {
            Ok(c) => c,
            Err(e) => return Err(explain_captive(e, captive.as_ref())),
        };
        let info = first.info;
        let mut conns = vec![first];
        if info.has(TF_CAN_MULTI_CONN) {
            for _ in 1..connections {
                let c = connect(&how, &name)?;
                // Requests go to any connection, aligned and shaped by the first one's terms.
                let same = |i: &ExportInfo| {
                    (i.size, i.flags, i.block, i.structured, i.allocation.is_some(), i.bitmap.is_some())
                };
                if same(&c.info) != same(&info) {
                    return Err(Error::new(ErrorKind::Io, Op::Connect)
                        .path(&name)
                        .detail("the server describes the export differently on a second connection"));
                }
                conns.push(c);
            }
        } else if connections > 1 {
            tracing::info!("{name}: one connection: the server does not advertise multi-conn");
        }
        tracing::debug!("{name}: {} connection(s), {info:?}", conns.len());
        Ok(Self::assemble(name, info, conns, captive))
    }

    fn assemble(
        name: String,
        info: ExportInfo,
        conns: Vec<Connection>,
        captive: Option<Captive>,
    ) -> NbdBackend {
        NbdBackend {
            name,
            info,
            conns,
            next: AtomicUsize::new(0),
            finished: AtomicBool::new(false),
            extent_cache: None,
            locks: Default::default(),
            captive,
        }
    }

    pub fn info(&self) -> &ExportInfo {
        &self.info
    }

    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Connections are used in turn, request by request.
    fn conn(&self) -> &Connection {
        &self.conns[self.next.fetch_add(1, Ordering::Relaxed) % self.conns.len()]
    }

    /// The largest piece a request is cut into: the server's maximum payload, rounded down to
    /// whole minimum blocks (the spec lets the maximum be any number, and pieces of it would
    /// leave the next piece unaligned).
    fn max_payload(&self) -> u64 {
        let b = &self.info.block;
        u64::from((b.maximum / b.minimum * b.minimum).max(b.minimum))
    }

    /// The server's extents from `offset`, covering at most `len` bytes (at least one).
    fn fetch_extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        // Lengths are 32-bit; ask for at most that, in whole blocks from a block boundary.
        let (start, wide) = self.widen(offset, len);
        let mut skip = offset - start;
        let align = u64::from(self.info.block.minimum).max(4096);
        let ask = wide.min(u64::from(u32::MAX) / align * align);
        // Keep what lies inside the range: the first extent may start before it (widened to
        // a block), the last may reach past it.
        let mut extents = Vec::new();
        let mut total = 0;
        for mut e in self.conn().block_status(start, ask)? {
            if total >= len || e.len == 0 {
                break;
            }
            let dropped = skip.min(e.len);
            skip -= dropped;
            e.len = (e.len - dropped).min(len - total);
            if e.len > 0 {
                total += e.len;
                extents.push(e);
            }
        }
        if extents.is_empty() {
            return Err(Error::new(ErrorKind::Io, Op::BlockStatus)
                .path(&self.name)
                .at(offset, len)
                .detail("protocol error: the server described no extent"));
        }
        Ok(extents)
    }

    /// Reads an aligned range in pieces of at most the maximum payload.
    fn read_pieces(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let mut at = offset;
        for piece in buf.chunks_mut(self.max_payload() as usize) {
            self.conn().read(piece, at)?;
            at += piece.len() as u64;
        }
        Ok(())
    }

    /// Writes an aligned range in pieces of at most the maximum payload.
    fn write_pieces(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let native_fua = fua && self.info.has(TF_SEND_FUA);
        let flags = if native_fua { CMD_FLAG_FUA } else { 0 };
        let mut at = offset;
        let written = buf.chunks(self.max_payload() as usize).try_for_each(|piece| {
            let r = self.conn().write(piece, at, flags);
            at += piece.len() as u64;
            r
        });
        // Even a failed write may have changed the allocation map.
        self.forget_extents();
        written?;
        if fua && !native_fua {
            self.flush()?;
        }
        Ok(())
    }

    /// `cmd` over `[offset, offset+len)` in pieces a 32-bit length can carry.
    fn ranged(&self, op: Op, cmd: u16, flags: u16, offset: u64, len: u64) -> Result<()> {
        let mut at = offset;
        while at < offset + len {
            let n = RANGE_PIECE.min(offset + len - at);
            self.conn().command(op, cmd, flags, at, n)?;
            at += n;
        }
        Ok(())
    }
}

/// How to reach the export, for each connection.
struct How<'a> {
    address: &'a Address,
    export: &'a str,
    tls: Option<&'a ClientTls>,
    /// A dirty bitmap to agree on.
    bitmap: Option<&'a str>,
}

/// The TLS configuration of an `nbds` URI: its certificate directory (or libnbd's default
/// one), and what of the server's certificate is checked: the name the URI gives
/// (`tls-hostname`, else the host), only the CA over a Unix socket without `tls-hostname`,
/// nothing with `tls-verify-peer=0`.
fn client_tls(uri: &Uri, params: &TlsParams) -> Result<ClientTls> {
    let verify = match (&params.hostname, &uri.address) {
        _ if !params.verify_peer => Verify::Nothing,
        (Some(name), _) => Verify::Name(name.clone()),
        (None, Address::Tcp { host, .. }) => Verify::Name(host.clone()),
        (None, Address::Unix(_)) => Verify::Chain,
    };
    let dir = match params.certificates.clone().or_else(crate::tls::default_client_dir) {
        Some(d) => d,
        None if verify == Verify::Nothing => std::path::PathBuf::new(),
        None => {
            return Err(Error::new(ErrorKind::InvalidInput, Op::Connect).path(&uri.text).detail(
                "no certificate directory: add ?tls-certificates=DIR (holding ca-cert.pem) to the URI",
            ))
        }
    };
    ClientTls::load(&dir, verify)
}

fn connect(how: &How, who: &str) -> Result<Connection> {
    // Ctrl-C ([`interrupt_all`]) also ends a connect that waits: a host dropping its SYNs
    // would hold it for the kernel's two minutes of retries, a Unix socket with a full
    // listen queue for ever.
    let failed = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::Interrupted && interrupted() {
            Error::new(ErrorKind::Interrupted, Op::Connect).path(who).detail("interrupted while connecting")
        } else {
            Error::io(Op::Connect, e).path(who)
        }
    };
    let stream: Box<dyn Stream> = match how.address {
        Address::Tcp { host, port } => {
            let s = connect_tcp(host, *port).map_err(failed)?;
            s.set_nodelay(true).map_err(|e| Error::io(Op::Connect, e).path(who))?;
            // A server that vanishes while we wait for its replies is found out.
            sys::tcp_keepalive(std::os::fd::AsFd::as_fd(&s))
                .map_err(|e| Error::io(Op::Connect, e).path(who))?;
            Box::new(s)
        }
        Address::Unix(path) => Box::new(sys::unix_connect(path, &interrupted).map_err(failed)?),
    };
    // From here on Ctrl-C can end it (a TLS stream runs over this socket: shutting the socket
    // down ends it too).
    let registered = register(&*stream, who)?;
    let (stream, info) = negotiate(stream, how, who).map_err(|e| if_interrupted(e, who))?;
    Connection::new(stream, info, who, registered)
}

/// The handshake of a connected socket, with STARTTLS when `how` asks for TLS.
fn negotiate(mut stream: Box<dyn Stream>, how: &How, who: &str) -> Result<(Box<dyn Stream>, ExportInfo)> {
    let no_zeroes = handshake::greet(&mut *stream, who)?;
    if let Some(tls) = how.tls {
        handshake::starttls(&mut *stream, who)?;
        stream = Box::new(tls.connect(stream).map_err(|e| {
            Error::io(Op::Connect, e).kind_as(ErrorKind::Io).path(who).detail("TLS handshake failed")
        })?);
    }
    let info = handshake::options(&mut *stream, how.export, who, no_zeroes, how.bitmap)?;
    Ok((stream, info))
}

fn register(stream: &dyn Stream, who: &str) -> Result<interrupt::Registered> {
    let closer = stream.closer().map_err(|e| Error::io(Op::Connect, e).path(who))?;
    Ok(interrupt::register(closer))
}

/// A handshake that failed because [`interrupt_all`] shut its socket down says so.
fn if_interrupted(e: Error, who: &str) -> Error {
    if interrupted() {
        Error::new(ErrorKind::Interrupted, Op::Connect).path(who).detail("interrupted during the handshake")
    } else {
        e
    }
}

/// Connects to `host:port`, each of its addresses in turn (as `TcpStream::connect` does):
/// the first that answers, else the last error.
fn connect_tcp(host: &str, port: u16) -> std::io::Result<TcpStream> {
    use std::net::ToSocketAddrs;
    let mut last = None;
    for addr in (host, port).to_socket_addrs()? {
        match sys::tcp_connect(&addr, &interrupted) {
            Ok(s) => return Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return Err(e),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "the host name has no address")
    }))
}

/// A failed connection to a captive server usually means the server failed: say how it ended.
fn explain_captive(e: Error, captive: Option<&Captive>) -> Error {
    let Some(c) = captive else { return e };
    match c.exited(Duration::from_secs(2)) {
        Some(status) => Error::new(e.kind(), Op::StartServer)
            .path(&c.display)
            .detail(format!("the server exited ({status}) before serving; see its messages above")),
        None => e,
    }
}

impl Backend for NbdBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn size(&self) -> Option<u64> {
        Some(self.info.size)
    }

    fn caps(&self) -> Caps {
        let i = &self.info;
        let writable = !i.has(TF_READ_ONLY);
        let max = u32::try_from(self.max_payload()).unwrap_or(u32::MAX);
        Caps {
            read_only: !writable,
            can_flush: i.has(TF_SEND_FLUSH),
            can_fua: i.has(TF_SEND_FUA),
            can_trim: writable && i.has(TF_SEND_TRIM),
            can_zero: writable,
            can_fast_zero: writable && i.has(TF_SEND_WRITE_ZEROES) && i.has(TF_SEND_FAST_ZERO),
            can_extents: i.allocation.is_some() || i.bitmap.is_some(),
            sequential: false,
            growable: false,
            rotational: i.has(TF_ROTATIONAL),
            block: BlockSizes { minimum: i.block.minimum, preferred: i.block.preferred, maximum: max },
            alloc_unit: None,
            at_hand: false,
        }
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        debug_assert!(offset + buf.len() as u64 <= self.info.size);
        if self.aligned(offset, buf.len() as u64) {
            self.read_pieces(buf, offset)?;
        } else {
            self.read_unaligned(buf, offset)?;
        }
        Ok(buf.len())
    }

    /// A round trip to the server: never at hand.
    fn read_at_hand(&self, _buf: &mut [u8], _offset: u64) -> Option<Result<usize>> {
        None
    }

    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        debug_assert!(offset + buf.len() as u64 <= self.info.size);
        if self.aligned(offset, buf.len() as u64) {
            self.write_pieces(buf, offset, fua)
        } else {
            self.write_unaligned(buf, offset, fua)
        }
    }

    // A round trip to the server; its cache is the server's business (NBD has no way to say
    // a write was merged).
    super::writes_leave_at_once!();

    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        if flags.fast && !self.caps().can_fast_zero {
            return Err(Error::new(ErrorKind::NotSupported, Op::Zero)
                .path(&self.name)
                .detail("no fast zero"));
        }
        if !self.info.has(TF_SEND_WRITE_ZEROES) {
            return write_zeroes(self, offset, len, flags.fua);
        }
        let (offset, len) = self.zero_edges(offset, len, flags.fast, flags.fua)?;
        if len == 0 {
            return Ok(());
        }
        let mut f = 0;
        if !flags.may_trim {
            f |= CMD_FLAG_NO_HOLE;
        }
        if flags.fast {
            f |= CMD_FLAG_FAST_ZERO;
        }
        if flags.fua && self.info.has(TF_SEND_FUA) {
            f |= CMD_FLAG_FUA;
        }
        let zeroed = self.ranged(Op::Zero, CMD_WRITE_ZEROES, f, offset, len);
        self.forget_extents();
        zeroed?;
        if flags.fua && !self.info.has(TF_SEND_FUA) {
            self.flush()?;
        }
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        // Advisory: a server without TRIM keeps the data, which is allowed.
        if !self.info.has(TF_SEND_TRIM) {
            return Ok(());
        }
        let (offset, len) = self.shrink(offset, len);
        if len == 0 {
            return Ok(());
        }
        let f = if fua && self.info.has(TF_SEND_FUA) { CMD_FLAG_FUA } else { 0 };
        let trimmed = self.ranged(Op::Trim, CMD_TRIM, f, offset, len);
        self.forget_extents();
        trimmed
    }

    fn flush(&self) -> Result<()> {
        if !self.info.has(TF_SEND_FLUSH) {
            tracing::debug!("{}: the server has no FLUSH; durability is up to it", self.name);
            return Ok(());
        }
        // One flush covers every connection under multi-conn; flushing each as well costs
        // little (nothing is left to write) and does not rely on the server getting that right.
        for c in &self.conns {
            c.command(Op::Flush, CMD_FLUSH, 0, 0, 0)?;
        }
        Ok(())
    }

    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        if !self.info.has(TF_SEND_CACHE) {
            return Ok(());
        }
        let (offset, len) = self.widen(offset, len);
        self.ranged(Op::Cache, CMD_CACHE, 0, offset, len)
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        debug_assert!(len > 0 && offset + len <= self.info.size);
        if self.info.allocation.is_none() && self.info.bitmap.is_none() {
            return Ok(vec![Extent::data(len)]);
        }
        let Some(cache) = &self.extent_cache else {
            return self.fetch_extents(offset, len);
        };
        let mut window = cache.lock();
        if let Some(known) = window.lookup(offset, len) {
            return Ok(known);
        }
        let ask = len.max(extents::WINDOW).min(self.info.size - offset);
        *window = extents::Window::new(offset, self.fetch_extents(offset, ask)?);
        Ok(window.lookup(offset, len).expect("a fresh window covers its start"))
    }

    fn cache_info(&self) -> Option<CacheInfo> {
        None
    }

    /// How the captive server ended, if it ended on its own. [`Backend::finish`] has given a
    /// server whose connection broke its moment to finish dying; this only asks. Nothing for
    /// a server reached by URI, or one still running.
    fn report(&self) -> Report {
        let server_ended = self.captive.as_ref().and_then(|c| {
            let status = c.ended().or_else(|| c.exited(Duration::ZERO))?;
            Some(format!("the server {} ended during the copy ({status})", c.display))
        });
        Report { requests: None, server_ended }
    }

    fn finish(&self) -> Result<()> {
        if self.finished.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        // A lost connection to a captive server: give the server a moment to finish dying, so
        // that how it ended is its own doing, not our SIGTERM's (see `report`).
        let lost = self.conns.iter().any(|c| c.is_dead());
        for c in &self.conns {
            c.disconnect();
        }
        if let Some(c) = &self.captive {
            if lost {
                c.exited(Duration::from_millis(200));
            }
            c.stop();
        }
        Ok(())
    }
}

impl Drop for NbdBackend {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}
