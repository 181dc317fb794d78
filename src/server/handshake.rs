//! The fixed newstyle handshake: greeting, client flags, option haggling until the client
//! picks the export (`NBD_OPT_GO` or `NBD_OPT_EXPORT_NAME`), aborts or breaks the protocol.
//!
//! With TLS configured, `NBD_OPT_STARTTLS` is acknowledged, the TLS handshake runs on the
//! same socket and haggling starts again over TLS with nothing agreed (the spec: state
//! negotiated before STARTTLS is reset). With TLS required (`--tls=require`, the spec's
//! FORCEDTLS), every option before TLS but STARTTLS and ABORT gets `NBD_REP_ERR_TLS_REQD`,
//! and `NBD_OPT_EXPORT_NAME`, which cannot be refused, ends the connection.

use std::io::{self, Read, Write};

use std::sync::Arc;

use super::{Export, Server};
use crate::backend::Backend;
use crate::proto::handshake::*;
use crate::proto::*;
use crate::stream::Stream;

/// The most option data the server takes in: no option we know needs more than a few KiB.
/// Larger data, up to [`MAX_OPTION_DISCARD`], is read and thrown away, and the option is
/// answered `NBD_REP_ERR_TOO_BIG` (the length in every option exists so that a server can
/// skip what it will not take); negotiation goes on.
pub const MAX_OPTION_LEN: u32 = 64 << 10;

/// Option data larger than this ends the connection without being read: reading it would
/// only keep a connection slot busy (the handshake timeout bounds the time either way).
pub const MAX_OPTION_DISCARD: u32 = 16 << 20;

/// Options in one handshake beyond this end the connection. Real clients send a handful
/// (qemu and libnbd: fewer than ten; `nbdinfo --list` a few per export); without a bound a
/// client could keep a connection slot and a thread busy forever with `NBD_OPT_LIST`.
pub const MAX_OPTIONS: usize = 256;

/// What the client agreed to, carried into transmission.
#[derive(Debug, Clone, Copy, Default)]
pub struct Agreed {
    pub structured: bool,
    /// `base:allocation` selected (context id [`BASE_ALLOCATION_ID`]).
    pub meta_context: bool,
    /// The dirty bitmaps selected: bit `i` for bitmap `i` of the export's tracker (context id
    /// [`BITMAP_ID_BASE`] + `i`).
    pub bitmaps: u64,
    pub block_sizes: bool,
}

/// The id lightfoot gives `base:allocation`.
pub const BASE_ALLOCATION_ID: u32 = 1;
/// The id of the export's first dirty bitmap; the others follow.
pub const BITMAP_ID_BASE: u32 = 2;

/// How negotiation ended.
pub enum Outcome {
    /// Enter transmission with these agreements, on this connection's own backend, over
    /// this stream (a TLS one after STARTTLS).
    Go(Agreed, Arc<dyn Backend>, Box<dyn Stream>),
    /// The client aborted or disconnected, or the server is shutting down.
    Close,
}

fn reply(s: &mut dyn Write, option: u32, ty: u32, data: &[u8]) -> io::Result<()> {
    let (header, data) = option_reply(option, ty, data);
    crate::stream::write_all_vectored(s, &[&header, data])
}

/// Runs the handshake on `s`. `Err` is an I/O error, a failed TLS handshake or a protocol
/// violation that ends the connection (the caller logs it; other connections are not
/// affected).
pub fn negotiate(server: &Server, mut s: Box<dyn Stream>) -> io::Result<Outcome> {
    s.write_all(&greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES))?;
    let mut flags = [0u8; 4];
    s.read_exact(&mut flags)?;
    let client_flags = parse_client_flags(&flags);
    if client_flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(invalid(format!("unknown client flags {client_flags:#x}")));
    }
    let no_zeroes = client_flags & FLAG_C_NO_ZEROES != 0;
    let export = &server.export;
    let mut agreed = Agreed::default();
    let mut tls_active = false;

    let mut options = 0usize;
    loop {
        options += 1;
        let mut h = [0u8; 16];
        s.read_exact(&mut h)?;
        let Some(OptionHeader { option, len }) = parse_option_header(&h) else {
            return Err(invalid("bad option magic".into()));
        };
        if options > MAX_OPTIONS {
            // A limit hit, like `--max-connections`: worth a warning, not only the -v line.
            tracing::warn!("connection closed: more than {MAX_OPTIONS} options in one handshake");
            return Err(invalid(format!("more than {MAX_OPTIONS} options in one handshake")));
        }
        if len > MAX_OPTION_LEN {
            // EXPORT_NAME has no error reply: hang up, as for a name too long.
            if len > MAX_OPTION_DISCARD || option == OPT_EXPORT_NAME {
                return Err(invalid(format!("option {option} with {len} bytes of data")));
            }
            let skipped = io::copy(&mut Read::by_ref(&mut s).take(u64::from(len)), &mut io::sink())?;
            if skipped < u64::from(len) {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "option data cut short"));
            }
            let msg = format!("{len} bytes of option data: this server takes at most {MAX_OPTION_LEN}");
            reply(&mut s, option, REP_ERR_TOO_BIG, msg.as_bytes())?;
            continue;
        }
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data)?;
        let s = &mut s;
        if server.is_shutting_down() {
            match option {
                // EXPORT_NAME has no error reply (an option reply would be read as the
                // export's size and flags): hang up, as for an export refused.
                OPT_EXPORT_NAME => {}
                // ABORT is acknowledged, shutting down or not.
                OPT_ABORT => {
                    let _ = reply(s, option, REP_ACK, &[]);
                }
                _ => reply(s, option, REP_ERR_SHUTDOWN, b"server is shutting down")?,
            }
            return Ok(Outcome::Close);
        }
        let tls_missing = !tls_active && server.tls.as_ref().is_some_and(|t| t.required);
        if tls_missing && option != OPT_STARTTLS && option != OPT_ABORT {
            if option == OPT_EXPORT_NAME {
                return Err(invalid("NBD_OPT_EXPORT_NAME before STARTTLS, and TLS is required".into()));
            }
            reply(s, option, REP_ERR_TLS_REQD, b"TLS is required: send NBD_OPT_STARTTLS first")?;
            continue;
        }
        match option {
            OPT_EXPORT_NAME => {
                if data.len() > MAX_STRING {
                    // No error reply exists for EXPORT_NAME: hang up, as for an unknown name.
                    return Err(invalid(format!("export name of {} bytes", data.len())));
                }
                let name = String::from_utf8_lossy(&data);
                if !export.matches(&name) {
                    // No way to answer with an error here: the spec says to hang up.
                    return Err(invalid(format!("unknown export '{name}'")));
                }
                let backend = export.open().map_err(|e| invalid(e.to_string()))?;
                s.write_all(&export_name_reply(export.size, export.flags(), no_zeroes))?;
                return Ok(Outcome::Go(agreed, backend, std::mem::replace(s, Box::new(Gone))));
            }
            OPT_ABORT => {
                let _ = reply(s, option, REP_ACK, &[]);
                return Ok(Outcome::Close);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    reply(s, option, REP_ERR_INVALID, b"LIST takes no data")?;
                    continue;
                }
                reply(s, option, REP_SERVER, &rep_server(&export.name))?;
                reply(s, option, REP_ACK, &[])?;
            }
            OPT_INFO | OPT_GO => {
                let go = match parse_go(&data) {
                    Ok(go) => go,
                    Err(Invalid(why)) => {
                        reply(s, option, REP_ERR_INVALID, why.as_bytes())?;
                        continue;
                    }
                };
                if !export.matches(&go.name) {
                    reply(s, option, REP_ERR_UNKNOWN, format!("no export named '{}'", go.name).as_bytes())?;
                    continue;
                }
                // The connection's backend is opened before the final ACK, so a failure can
                // still be reported.
                let backend = match option {
                    OPT_GO => match export.open() {
                        Ok(b) => Some(b),
                        Err(e) => {
                            tracing::warn!("{e}");
                            reply(
                                s,
                                option,
                                REP_ERR_UNKNOWN,
                                format!("export not available: {e}").as_bytes(),
                            )?;
                            continue;
                        }
                    },
                    _ => None,
                };
                send_info(s, option, export, &go.infos)?;
                reply(s, option, REP_ACK, &[])?;
                if let Some(backend) = backend {
                    agreed.block_sizes = go.infos.contains(&INFO_BLOCK_SIZE);
                    return Ok(Outcome::Go(agreed, backend, std::mem::replace(s, Box::new(Gone))));
                }
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    reply(s, option, REP_ERR_INVALID, b"STRUCTURED_REPLY takes no data")?;
                    continue;
                }
                agreed.structured = true;
                reply(s, option, REP_ACK, &[])?;
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                meta_context(s, option, export, &data, &mut agreed)?;
            }
            OPT_STARTTLS => match &server.tls {
                // NOTLS mode (no --tls): as for any option the server does not do.
                None => reply(s, option, REP_ERR_UNSUP, b"TLS is not enabled on this server")?,
                Some(_) if tls_active => reply(s, option, REP_ERR_INVALID, b"TLS is already in use")?,
                Some(_) if !data.is_empty() => reply(s, option, REP_ERR_INVALID, b"STARTTLS takes no data")?,
                Some(tls) => {
                    reply(s, option, REP_ACK, &[])?;
                    let plain = std::mem::replace(s, Box::new(Gone));
                    *s = Box::new(tls.accept(plain)?);
                    tls_active = true;
                    agreed = Agreed::default();
                    tracing::debug!("TLS handshake done");
                }
            },
            _ => reply(s, option, REP_ERR_UNSUP, b"option not supported")?,
        }
    }
}

fn send_info(s: &mut dyn Write, option: u32, export: &Export, infos: &[u16]) -> io::Result<()> {
    reply(s, option, REP_INFO, &info_export(export.size, export.flags()))?;
    // Block sizes are sent whether asked for or not (clients ignore what they did not ask
    // for); they are only enforced for clients that asked.
    let b = export.caps.block;
    reply(s, option, REP_INFO, &info_block_size(b.minimum, b.preferred, b.maximum))?;
    if infos.contains(&INFO_NAME) {
        reply(s, option, REP_INFO, &info_string(INFO_NAME, &export.name))?;
    }
    if infos.contains(&INFO_DESCRIPTION) {
        if let Some(d) = &export.description {
            reply(s, option, REP_INFO, &info_string(INFO_DESCRIPTION, d))?;
        }
    }
    Ok(())
}

fn meta_context(
    s: &mut dyn Write,
    option: u32,
    export: &Export,
    data: &[u8],
    agreed: &mut Agreed,
) -> io::Result<()> {
    // SET replaces the earlier selection even when it fails (the spec).
    if option == OPT_SET_META_CONTEXT {
        agreed.meta_context = false;
        agreed.bitmaps = 0;
    }
    if !agreed.structured {
        return reply(s, option, REP_ERR_INVALID, b"negotiate structured replies first");
    }
    let m = match parse_meta(data) {
        Ok(m) => m,
        Err(Invalid(why)) => return reply(s, option, REP_ERR_INVALID, why.as_bytes()),
    };
    if !export.matches(&m.export) {
        return reply(s, option, REP_ERR_UNKNOWN, format!("no export named '{}'", m.export).as_bytes());
    }
    let listing = option == OPT_LIST_META_CONTEXT;
    // Every context the export has, with its id: base:allocation, then the dirty bitmaps.
    let mut offered = vec![(BASE_ALLOCATION.to_string(), BASE_ALLOCATION_ID)];
    if let Some(t) = &export.bitmaps {
        for (i, name) in t.names().iter().enumerate() {
            offered.push((format!("{DIRTY_BITMAP_PREFIX}{name}"), BITMAP_ID_BASE + i as u32));
        }
    }
    // Queries of unknown names are ignored. Listing, no query lists everything, and a query
    // ending in ':' ("base:", "qemu:", "qemu:dirty-bitmap:") lists what starts with it.
    let wanted = |name: &str| {
        (listing && m.queries.is_empty())
            || m.queries
                .iter()
                .any(|q| q == name || (listing && q.ends_with(':') && name.starts_with(q.as_str())))
    };
    // Epochs are listed to clients that ask for them by namespace ("lightfoot:", or one
    // bitmap's "lightfoot:epoch:NAME"), never selected: a plain listing stays as qemu's.
    if listing {
        if let Some(t) = &export.bitmaps {
            for (i, name) in t.names().iter().enumerate() {
                let (epoch, parent) = t.epoch(i);
                let context = epoch_context(name, epoch, parent);
                let asked = m
                    .queries
                    .iter()
                    .any(|q| q == "lightfoot:" || q == EPOCH_PREFIX || *q == format!("{EPOCH_PREFIX}{name}"));
                if asked {
                    reply(s, option, REP_META_CONTEXT, &rep_meta_context(0, &context))?;
                }
            }
        }
    }
    for (name, id) in &offered {
        if !wanted(name) {
            continue;
        }
        if !listing {
            match id - BASE_ALLOCATION_ID {
                0 => agreed.meta_context = true,
                _ => agreed.bitmaps |= 1 << (id - BITMAP_ID_BASE),
            }
        }
        reply(s, option, REP_META_CONTEXT, &rep_meta_context(if listing { 0 } else { *id }, name))?;
    }
    reply(s, option, REP_ACK, &[])
}

/// What is left in place of a stream moved out of negotiation (it is never used again).
struct Gone;

impl io::Read for Gone {
    fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
        Err(io::ErrorKind::NotConnected.into())
    }
}

impl Write for Gone {
    fn write(&mut self, _: &[u8]) -> io::Result<usize> {
        Err(io::ErrorKind::NotConnected.into())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Stream for Gone {
    fn split(self: Box<Self>) -> io::Result<(Box<dyn io::Read + Send>, Box<dyn Write + Send>)> {
        Err(io::ErrorKind::NotConnected.into())
    }

    fn closer(&self) -> io::Result<crate::stream::Closer> {
        Ok(Box::new(|| {}))
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}
