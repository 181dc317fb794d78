//! The client side of the fixed newstyle handshake: structured replies, the `base:allocation`
//! context (and a `qemu:dirty-bitmap:` one when asked for), then `NBD_OPT_GO` asking for
//! block sizes (with `NBD_OPT_EXPORT_NAME` as the fallback for servers without GO).
//!
//! For `nbds://` URIs the caller runs it in steps: [`greet`], [`starttls`], the TLS handshake
//! on the same socket, then [`options`] over TLS (nothing is asked before TLS, so nothing
//! leaks and nothing needs resetting).

use std::io::{Read, Write};

use crate::backend::BlockSizes;
use crate::error::{Error, ErrorKind, Op, Result};
use crate::proto::handshake::*;
use crate::proto::*;

/// What negotiation settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportInfo {
    pub size: u64,
    /// Transmission flags (`TF_*`).
    pub flags: u16,
    pub block: BlockSizes,
    pub structured: bool,
    /// The id of `base:allocation`, when the server agreed to it.
    pub allocation: Option<u32>,
    /// The id of the `qemu:dirty-bitmap:NAME` context asked for (negotiation fails without it).
    pub bitmap: Option<u32>,
    /// That bitmap's epoch and the one before it, from a lightfoot server (`lightfoot:epoch:`).
    pub epoch: Option<(u64, u64)>,
}

impl ExportInfo {
    pub fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }
}

/// Contexts named in the error for a missing one; the rest are counted.
const MAX_LISTED: usize = 16;

/// Option replies carry at most an error string or a few fields; anything this long means the
/// stream is not NBD.
const MAX_OPTION_REPLY: u32 = 1 << 20;

/// The spec's default limits when the server gives none: any alignment, 32 MiB payloads.
pub const DEFAULT_BLOCK: BlockSizes = BlockSizes { minimum: 1, preferred: 4096, maximum: 32 << 20 };

/// Negotiates `export` over `s`; `who` names the server in errors.
pub fn negotiate<S: Read + Write + ?Sized>(s: &mut S, export: &str, who: &str) -> Result<ExportInfo> {
    let no_zeroes = greet(s, who)?;
    options(s, export, who, no_zeroes, None)
}

fn failure(who: &str, kind: ErrorKind, detail: String) -> Error {
    Error::new(kind, Op::Connect).path(who).detail(detail)
}

fn io_error(who: &str) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => {
            failure(who, ErrorKind::Io, "the server closed the connection during the handshake".into())
        }
        _ => Error::io(Op::Connect, e).path(who),
    }
}

/// Reads the server's greeting and sends the client flags; true when the server omits the
/// zeroes after `NBD_OPT_EXPORT_NAME`.
pub fn greet<S: Read + Write + ?Sized>(s: &mut S, who: &str) -> Result<bool> {
    let fail = |kind, detail: String| failure(who, kind, detail);
    let io = io_error(who);
    let mut greeting = [0u8; GREETING_LEN];
    s.read_exact(&mut greeting).map_err(&io)?;
    let server_flags = match parse_greeting(&greeting) {
        Some(Greeting::Newstyle { flags }) => flags,
        Some(Greeting::Oldstyle) => {
            return Err(fail(ErrorKind::NotSupported, "old-style NBD servers are not supported".into()))
        }
        None => return Err(fail(ErrorKind::Io, "not an NBD server (bad greeting)".into())),
    };
    if server_flags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(fail(ErrorKind::NotSupported, "the server does not speak fixed newstyle NBD".into()));
    }
    let no_zeroes = server_flags & FLAG_NO_ZEROES != 0;
    let flags = FLAG_C_FIXED_NEWSTYLE | if no_zeroes { FLAG_C_NO_ZEROES } else { 0 };
    s.write_all(&client_flags(flags)).map_err(&io)?;
    Ok(no_zeroes)
}

/// `NBD_OPT_STARTTLS`: `Ok` when the server agreed; the TLS handshake comes next.
pub fn starttls<S: Read + Write + ?Sized>(s: &mut S, who: &str) -> Result<()> {
    let io = io_error(who);
    let mut haggle = Haggle { s, who, io: &io };
    haggle.send(OPT_STARTTLS, &[])?;
    let (ty, data) = haggle.reply(OPT_STARTTLS)?;
    let why = match ty {
        REP_ACK => return Ok(()),
        REP_ERR_UNSUP | REP_ERR_POLICY => "the server does not offer TLS",
        _ => "the server refused STARTTLS",
    };
    let msg = String::from_utf8_lossy(&data);
    let detail = if msg.is_empty() { why.to_string() } else { format!("{why}: {msg}") };
    Err(failure(who, ErrorKind::NotSupported, detail))
}

/// Option haggling after the greeting (and after TLS): structured replies, `base:allocation`
/// and, with `bitmap`, the context `qemu:dirty-bitmap:BITMAP`, then GO. A bitmap the server
/// does not agree to is an error that lists the contexts it offers.
pub fn options<S: Read + Write + ?Sized>(
    s: &mut S,
    export: &str,
    who: &str,
    no_zeroes: bool,
    bitmap: Option<&str>,
) -> Result<ExportInfo> {
    let fail = |kind, detail: String| failure(who, kind, detail);
    let io = io_error(who);
    let mut haggle = Haggle { s, who, io: &io };
    let structured = haggle.simple_option(OPT_STRUCTURED_REPLY, &[])?;
    let dirty_context = bitmap.map(|b| format!("{DIRTY_BITMAP_PREFIX}{b}"));
    let (mut allocation, mut dirty, mut epoch) = (None, None, None);
    if let (true, Some(name)) = (structured, bitmap) {
        // A lightfoot server says which epoch the bitmap is in; others list nothing for a
        // namespace they do not know (or refuse the query: no epoch either).
        haggle.send(OPT_LIST_META_CONTEXT, &meta_data(export, &[&format!("{EPOCH_PREFIX}{name}")]))?;
        loop {
            let (ty, data) = haggle.reply(OPT_LIST_META_CONTEXT)?;
            match ty {
                REP_META_CONTEXT => {
                    let (_, context) = parse_meta_context(&data).map_err(|e| haggle.invalid(e))?;
                    epoch = epoch.or(parse_epoch_context(&context, name));
                }
                REP_ACK => break,
                _ => {
                    epoch = None;
                    break;
                }
            }
        }
    }
    if structured {
        let mut queries = vec![BASE_ALLOCATION];
        queries.extend(dirty_context.as_deref());
        haggle.send(OPT_SET_META_CONTEXT, &meta_data(export, &queries))?;
        loop {
            let (ty, data) = haggle.reply(OPT_SET_META_CONTEXT)?;
            match ty {
                REP_META_CONTEXT => {
                    let (id, name) = parse_meta_context(&data).map_err(|e| haggle.invalid(e))?;
                    if name == BASE_ALLOCATION {
                        allocation = Some(id);
                    } else if dirty_context.as_deref() == Some(name.as_str()) {
                        dirty = Some(id);
                    }
                }
                REP_ACK => break,
                // Errors only mean no allocation map: copies then read everything. Contexts
                // named before the error were not agreed.
                _ => {
                    (allocation, dirty) = (None, None);
                    break;
                }
            }
        }
    }
    if let (Some(context), None) = (&dirty_context, dirty) {
        let e = haggle.no_context(export, context, structured);
        // Said goodbye, so the server does not report a client that vanished.
        if haggle.send(OPT_ABORT, &[]).is_ok() {
            let _ = haggle.reply(OPT_ABORT);
        }
        return Err(e);
    }

    haggle.send(OPT_GO, &go_data(export, &[INFO_BLOCK_SIZE]))?;
    let mut size_flags = None;
    let mut block = DEFAULT_BLOCK;
    loop {
        let (ty, data) = haggle.reply(OPT_GO)?;
        match ty {
            REP_INFO => match parse_info(&data).map_err(|e| haggle.invalid(e))? {
                Info::Export { size, flags } => size_flags = Some((size, flags)),
                Info::BlockSize { minimum, preferred, maximum } => {
                    block = BlockSizes { minimum, preferred, maximum }
                }
                Info::Other(_) => {}
            },
            REP_ACK => break,
            REP_ERR_UNSUP => {
                size_flags = Some(haggle.export_name(export, no_zeroes)?);
                break;
            }
            err => return Err(refused(who, export, err, &data)),
        }
    }
    let (size, flags) =
        size_flags.ok_or_else(|| fail(ErrorKind::Io, "the server sent no export size".into()))?;
    // The spec: the minimum a power of two up to 64 KiB, the preferred a power of two at least
    // the minimum and 512, the maximum at least the preferred. Sizes that break it are ignored
    // (with a warning) rather than the server refused: the defaults hold, and a server that
    // really needs larger blocks refuses the requests it cannot take (an error naming the
    // request) rather than the connection.
    let BlockSizes { minimum, preferred, maximum } = block;
    if !minimum.is_power_of_two()
        || minimum > 1 << 16
        || !preferred.is_power_of_two()
        || preferred < minimum.max(512)
        || maximum < preferred
    {
        tracing::warn!("{who}: ignoring the server's invalid block sizes {block:?}");
        block = DEFAULT_BLOCK;
    }
    Ok(ExportInfo { size, flags, block, structured, allocation, bitmap: dirty, epoch })
}

/// An error reply to GO, in words.
fn refused(who: &str, export: &str, ty: u32, data: &[u8]) -> Error {
    let msg = String::from_utf8_lossy(data);
    let (kind, what) = match ty {
        REP_ERR_UNKNOWN => (ErrorKind::NotFound, format!("the server has no export named '{export}'")),
        REP_ERR_POLICY => (ErrorKind::Permission, "the server refused the connection".to_string()),
        REP_ERR_TLS_REQD => {
            (ErrorKind::Permission, "the server requires TLS: use an nbds:// or nbds+unix:// URI".to_string())
        }
        REP_ERR_SHUTDOWN => (ErrorKind::Io, "the server is shutting down".to_string()),
        other => (ErrorKind::Io, format!("the server refused the export (error {:#x})", other)),
    };
    // A server's own words, unless they only repeat ours (lightfoot's: "no export named 'x'").
    let detail = if msg.is_empty() || what.contains(msg.as_ref()) { what } else { format!("{what}: {msg}") };
    Error::new(kind, Op::Connect).path(who).detail(detail)
}

struct Haggle<'a, S: Read + Write + ?Sized, F: Fn(std::io::Error) -> Error> {
    s: &'a mut S,
    who: &'a str,
    io: &'a F,
}

impl<S: Read + Write + ?Sized, F: Fn(std::io::Error) -> Error> Haggle<'_, S, F> {
    fn send(&mut self, option: u32, data: &[u8]) -> Result<()> {
        self.s.write_all(&option_request(option, data)).map_err(self.io)
    }

    /// The next reply to `option`: its type and data.
    fn reply(&mut self, option: u32) -> Result<(u32, Vec<u8>)> {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).map_err(self.io)?;
        let r = parse_option_reply(&h).ok_or_else(|| self.protocol("bad option reply magic"))?;
        if r.option != option {
            return Err(self.protocol("option reply for another option"));
        }
        if r.len > MAX_OPTION_REPLY {
            return Err(self.protocol("option reply too long"));
        }
        let mut data = vec![0u8; r.len as usize];
        self.s.read_exact(&mut data).map_err(self.io)?;
        Ok((r.ty, data))
    }

    /// An option answered by one ACK or one error: true on ACK.
    fn simple_option(&mut self, option: u32, data: &[u8]) -> Result<bool> {
        self.send(option, data)?;
        let (ty, _) = self.reply(option)?;
        Ok(ty == REP_ACK)
    }

    /// `NBD_OPT_EXPORT_NAME`: no reply header; the size and flags follow directly.
    fn export_name(&mut self, export: &str, no_zeroes: bool) -> Result<(u64, u16)> {
        self.send(OPT_EXPORT_NAME, export.as_bytes())?;
        let mut b = [0u8; EXPORT_NAME_REPLY_LEN + EXPORT_NAME_ZEROES];
        let n = if no_zeroes { EXPORT_NAME_REPLY_LEN } else { b.len() };
        self.s.read_exact(&mut b[..n]).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => Error::new(ErrorKind::NotFound, Op::Connect)
                .path(self.who)
                .detail(format!("the server closed the connection (no export named '{export}'?)")),
            _ => (self.io)(e),
        })?;
        Ok(parse_export_name_reply(b[..EXPORT_NAME_REPLY_LEN].try_into().unwrap()))
    }

    /// The error for a meta `context` the server did not agree to, naming the ones it offers
    /// (`NBD_OPT_LIST_META_CONTEXT` with no query: all of them).
    fn no_context(&mut self, export: &str, context: &str, structured: bool) -> Error {
        let who = self.who;
        let missing = |detail: String| Error::new(ErrorKind::NotFound, Op::Connect).path(who).detail(detail);
        if !structured {
            return missing(format!(
                "the server has no meta contexts (no structured replies), so no '{context}'"
            ));
        }
        let (mut offered, mut count) = (Vec::new(), 0usize);
        let listed = self.send(OPT_LIST_META_CONTEXT, &meta_data(export, &[])).and_then(|()| loop {
            let (ty, data) = self.reply(OPT_LIST_META_CONTEXT)?;
            match ty {
                REP_META_CONTEXT => match parse_meta_context(&data) {
                    Ok((_, name)) => {
                        count += 1;
                        if offered.len() < MAX_LISTED {
                            offered.push(format!("'{name}'"));
                        }
                    }
                    Err(e) => return Err(self.invalid(e)),
                },
                REP_ACK => return Ok(true),
                _ => return Ok(false),
            }
        });
        match listed {
            Err(e) => e,
            Ok(false) => {
                missing(format!("the server offers no '{context}' (and does not list its contexts)"))
            }
            Ok(true) if offered.is_empty() => {
                missing(format!("the server offers no '{context}' (it offers no contexts)"))
            }
            Ok(true) => {
                let more = match count - offered.len() {
                    0 => String::new(),
                    n => format!(" and {n} more"),
                };
                missing(format!("the server offers no '{context}'; it offers {}{more}", offered.join(", ")))
            }
        }
    }

    fn invalid(&self, e: Invalid) -> Error {
        self.protocol(e.0)
    }

    fn protocol(&self, what: &str) -> Error {
        Error::new(ErrorKind::Io, Op::Connect).path(self.who).detail(format!("protocol error: {what}"))
    }
}
