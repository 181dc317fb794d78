//! The handshake target: the fuzzer's bytes are everything a client sends (client flags, then
//! option requests); the server's negotiation runs over a scripted stream that returns them
//! and then end of file. The reply stream is then walked alongside a reference reading of the
//! client's bytes, option by option:
//!
//! - the greeting is the fixed newstyle one;
//! - every option received whole gets well-formed replies for that option (magic, option
//!   number, lengths), the last one final (ACK or an error), with the types the spec names
//!   for it (`LIST` → `SERVER` then ACK, `GO` → `INFO`s then ACK or an error, unknown →
//!   `ERR_UNSUP`, malformed → `ERR_INVALID`, …), error strings within the spec's 4096 bytes;
//! - the handshake ends where the spec says (after `GO`'s ACK, `EXPORT_NAME`, `ABORT`, a bad
//!   magic, unknown client flags, an oversized option, too many options, end of input) and
//!   the server sends nothing for an option it has not received whole;
//! - what the server agreed (structured replies, `base:allocation`) is what it acknowledged.
//!
//! The option payloads also go through the proto parsers, which must re-encode what they
//! accept to the same bytes.

use std::io::{self, Cursor, Read, Write};
use std::sync::{Arc, OnceLock};

use super::Input;
use crate::backend::{Backend, MemoryBackend};
use crate::proto::handshake::*;
use crate::proto::*;
use crate::server::handshake::{
    negotiate, Outcome, BASE_ALLOCATION_ID, MAX_OPTIONS, MAX_OPTION_DISCARD, MAX_OPTION_LEN,
};
use crate::server::{Export, Server};
use crate::stream::{Closer, Stream};

/// The export every handshake input is negotiated against.
pub const EXPORT_NAME: &str = "disk";
const EXPORT_SIZE: u64 = (1 << 20) + 512;
const DESCRIPTION: &str = "fuzzed export";

fn server() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        let mem: Arc<dyn Backend> = Arc::new(MemoryBackend::new(EXPORT_SIZE));
        let export =
            Export::new(EXPORT_NAME, Some(DESCRIPTION.into()), true, move || Ok(mem.clone())).unwrap();
        Server::new(export, 1, 1)
    })
}

/// A stream whose reads return a script, then end of file, and whose writes are kept (shared,
/// so they can be read after `negotiate` has taken the stream).
struct Scripted {
    input: Cursor<Vec<u8>>,
    output: Arc<std::sync::Mutex<Vec<u8>>>,
}

impl Read for Scripted {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Scripted {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.output.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Stream for Scripted {
    fn split(self: Box<Self>) -> io::Result<(Box<dyn Read + Send>, Box<dyn Write + Send>)> {
        Ok((Box::new(self.input), Box::new(io::sink())))
    }

    fn closer(&self) -> io::Result<Closer> {
        Ok(Box::new(|| {}))
    }
}

/// How the reference reading says the handshake ends.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// Transmission starts, with structured replies and `base:allocation` as agreed.
    Go { structured: bool, meta: bool },
    /// Closed by the client (ABORT).
    Abort,
    /// The server hangs up or the input ran out: nothing more is sent.
    Hangup,
}

/// Runs one input; panics when the server's answers break an invariant.
pub fn run(data: &[u8]) {
    let output = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = Scripted { input: Cursor::new(data.to_vec()), output: output.clone() };
    let outcome = negotiate(server(), Box::new(s));
    let output = output.lock().unwrap().clone();
    let mut replies = Input::new(&output);
    let end = walk(&mut Input::new(data), &mut replies);
    assert!(replies.is_empty(), "{} bytes sent after the handshake ended ({end:?})", replies.0.len());
    match (&end, outcome) {
        (End::Go { structured, meta }, Ok(Outcome::Go(agreed, _, _))) => {
            assert_eq!(agreed.structured, *structured, "structured replies agreed");
            assert_eq!(agreed.meta_context, *meta, "base:allocation agreed");
        }
        (End::Abort, Ok(Outcome::Close)) | (End::Hangup, Err(_)) => {}
        (end, Ok(Outcome::Go(..))) => panic!("transmission started; expected {end:?}"),
        (end, Ok(Outcome::Close)) => panic!("closed cleanly; expected {end:?}"),
        (end, Err(e)) => panic!("failed ({e}); expected {end:?}"),
    }
}

/// One option reply: (type, data).
fn reply(out: &mut Input, option: u32) -> (u32, Vec<u8>) {
    let h = out.bytes(20);
    assert_eq!(h.len(), 20, "option {option}: reply header cut short");
    assert_eq!(be64(&h[0..8]), REPLY_MAGIC, "option {option}: reply magic");
    assert_eq!(be32(&h[8..12]), option, "reply to the wrong option");
    let ty = be32(&h[12..16]);
    let len = be32(&h[16..20]) as usize;
    let data = out.bytes(len);
    assert_eq!(data.len(), len, "option {option}: reply data cut short");
    if ty & (1 << 31) != 0 {
        assert!(len <= MAX_STRING, "option {option}: error message of {len} bytes (the spec allows 4096)");
        assert!(std::str::from_utf8(data).is_ok(), "option {option}: error message not UTF-8");
    }
    (ty, data.to_vec())
}

/// The replies to one option, up to and including the final one.
fn replies(out: &mut Input, option: u32) -> Vec<(u32, Vec<u8>)> {
    let mut v = Vec::new();
    loop {
        let r = reply(out, option);
        let last = r.0 == REP_ACK || r.0 & (1 << 31) != 0;
        v.push(r);
        if last {
            return v;
        }
        assert!(v.len() < 16, "option {option}: endless replies");
    }
}

fn types(r: &[(u32, Vec<u8>)]) -> Vec<u32> {
    r.iter().map(|(t, _)| *t).collect()
}

/// Walks the client's bytes the way the spec reads them, checking the server's replies.
fn walk(inp: &mut Input, out: &mut Input) -> End {
    let g = out.bytes(18);
    assert_eq!(g.len(), 18, "greeting cut short");
    assert_eq!(be64(&g[0..8]), NBDMAGIC);
    assert_eq!(be64(&g[8..16]), IHAVEOPT);
    assert_eq!(be16(&g[16..18]), FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    let flags = inp.bytes(4);
    if flags.len() < 4 || be32(flags) & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return End::Hangup;
    }
    let no_zeroes = be32(flags) & FLAG_C_NO_ZEROES != 0;
    let (mut structured, mut meta) = (false, false);
    let export_flags = server().export.flags();
    for count in 1.. {
        let h = inp.bytes(16);
        if h.len() < 16 || be64(&h[0..8]) != IHAVEOPT || count > MAX_OPTIONS {
            return End::Hangup;
        }
        let (option, len) = (be32(&h[8..12]), be32(&h[12..16]));
        if len > MAX_OPTION_DISCARD || (len > MAX_OPTION_LEN && option == OPT_EXPORT_NAME) {
            return End::Hangup;
        }
        let data = inp.bytes(len as usize);
        if data.len() < len as usize {
            return End::Hangup;
        }
        if len > MAX_OPTION_LEN {
            // Skipped, whatever the option.
            assert_eq!(types(&replies(out, option)), [REP_ERR_TOO_BIG], "option data over the limit");
            continue;
        }
        check_parsers(data);
        match option {
            OPT_EXPORT_NAME => {
                let ok = data.len() <= MAX_STRING && matches(&String::from_utf8_lossy(data));
                if !ok {
                    return End::Hangup;
                }
                let info = out.bytes(if no_zeroes { 10 } else { 134 });
                assert_eq!(info.len(), if no_zeroes { 10 } else { 134 }, "EXPORT_NAME reply cut short");
                assert_eq!(be64(&info[0..8]), EXPORT_SIZE);
                assert_eq!(be16(&info[8..10]), export_flags);
                assert!(info[10..].iter().all(|&b| b == 0), "EXPORT_NAME padding is not zero");
                return End::Go { structured, meta };
            }
            OPT_ABORT => {
                assert_eq!(types(&replies(out, option)), [REP_ACK], "ABORT");
                return End::Abort;
            }
            OPT_LIST => {
                let r = replies(out, option);
                if data.is_empty() {
                    assert_eq!(types(&r), [REP_SERVER, REP_ACK], "LIST");
                    assert_eq!(r[0].1, rep_server(EXPORT_NAME), "LIST: the export");
                } else {
                    assert_eq!(types(&r), [REP_ERR_INVALID], "LIST with data");
                }
            }
            OPT_STRUCTURED_REPLY => {
                let r = replies(out, option);
                if data.is_empty() {
                    assert_eq!(types(&r), [REP_ACK], "STRUCTURED_REPLY");
                    structured = true;
                } else {
                    assert_eq!(types(&r), [REP_ERR_INVALID], "STRUCTURED_REPLY with data");
                }
            }
            OPT_INFO | OPT_GO => {
                let r = replies(out, option);
                let want = go_request(data);
                match want {
                    Err(e) => assert_eq!(types(&r), [e], "INFO/GO"),
                    Ok(infos) => {
                        check_infos(&r, &infos, export_flags);
                        if option == OPT_GO {
                            return End::Go { structured, meta };
                        }
                    }
                }
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                let r = replies(out, option);
                let listing = option == OPT_LIST_META_CONTEXT;
                match meta_request(data, structured) {
                    Err(e) => assert_eq!(types(&r), [e], "META_CONTEXT"),
                    Ok(queries) => {
                        let wanted = if listing && queries.is_empty() {
                            true
                        } else {
                            queries.iter().any(|q| q == BASE_ALLOCATION || (listing && q == "base:"))
                        };
                        if !listing {
                            meta = wanted;
                        }
                        let id = if listing { 0 } else { BASE_ALLOCATION_ID };
                        if wanted {
                            assert_eq!(types(&r), [REP_META_CONTEXT, REP_ACK], "META_CONTEXT");
                            assert_eq!(r[0].1, rep_meta_context(id, BASE_ALLOCATION));
                        } else {
                            assert_eq!(types(&r), [REP_ACK], "META_CONTEXT without a known query");
                        }
                    }
                }
            }
            _ => assert_eq!(types(&replies(out, option)), [REP_ERR_UNSUP], "unknown option {option}"),
        }
    }
    unreachable!()
}

fn matches(name: &str) -> bool {
    name.is_empty() || name == EXPORT_NAME
}

/// Reads a length-prefixed string as the spec defines it; `Err` is the reply type.
fn string(f: &mut Input) -> Result<String, u32> {
    let n = f.bytes(4);
    if n.len() < 4 {
        return Err(REP_ERR_INVALID);
    }
    let n = be32(n) as usize;
    if n > MAX_STRING {
        return Err(REP_ERR_INVALID);
    }
    let b = f.bytes(n);
    if b.len() < n {
        return Err(REP_ERR_INVALID);
    }
    String::from_utf8(b.to_vec()).map_err(|_| REP_ERR_INVALID)
}

/// The information types asked for by INFO/GO data, or the error reply it deserves.
fn go_request(data: &[u8]) -> Result<Vec<u16>, u32> {
    let mut f = Input::new(data);
    let name = string(&mut f)?;
    let n = f.bytes(2);
    if n.len() < 2 {
        return Err(REP_ERR_INVALID);
    }
    let n = be16(n) as usize;
    let infos = f.bytes(2 * n);
    if infos.len() < 2 * n || !f.is_empty() {
        return Err(REP_ERR_INVALID);
    }
    if !matches(&name) {
        return Err(REP_ERR_UNKNOWN);
    }
    Ok(infos.chunks(2).map(be16).collect())
}

/// The queries of META_CONTEXT data, or the error reply it deserves.
fn meta_request(data: &[u8], structured: bool) -> Result<Vec<String>, u32> {
    if !structured {
        return Err(REP_ERR_INVALID);
    }
    let mut f = Input::new(data);
    let export = string(&mut f)?;
    let n = f.bytes(4);
    if n.len() < 4 {
        return Err(REP_ERR_INVALID);
    }
    let mut queries = Vec::new();
    for _ in 0..be32(n) {
        queries.push(string(&mut f)?);
    }
    if !f.is_empty() {
        return Err(REP_ERR_INVALID);
    }
    if !matches(&export) {
        return Err(REP_ERR_UNKNOWN);
    }
    Ok(queries)
}

/// The replies to a successful INFO/GO: `INFO`s then ACK; the export's size and flags first,
/// block sizes as the spec constrains them, the name and description when asked for.
fn check_infos(r: &[(u32, Vec<u8>)], asked: &[u16], export_flags: u16) {
    let (last, infos) = r.split_last().unwrap();
    assert_eq!(last.0, REP_ACK, "INFO/GO ended with {:#x}", last.0);
    let mut seen = Vec::new();
    for (ty, d) in infos {
        assert_eq!(*ty, REP_INFO, "INFO/GO: reply type");
        assert!(d.len() >= 2, "INFO without a type");
        let info = be16(&d[0..2]);
        seen.push(info);
        match info {
            INFO_EXPORT => {
                assert_eq!(d.len(), 12, "NBD_INFO_EXPORT length");
                assert_eq!(be64(&d[2..10]), EXPORT_SIZE);
                assert_eq!(be16(&d[10..12]), export_flags);
            }
            INFO_BLOCK_SIZE => {
                assert_eq!(d.len(), 14, "NBD_INFO_BLOCK_SIZE length");
                let (min, pref, max) = (be32(&d[2..6]), be32(&d[6..10]), be32(&d[10..14]));
                assert!(min.is_power_of_two() && min <= 64 << 10, "minimum block size {min}");
                assert!(pref.is_power_of_two() && pref >= min.max(512), "preferred block size {pref}");
                assert!(max >= pref.min(EXPORT_SIZE as u32) && max % min == 0, "maximum block size {max}");
            }
            INFO_NAME => assert_eq!(&d[2..], EXPORT_NAME.as_bytes()),
            INFO_DESCRIPTION => assert_eq!(&d[2..], DESCRIPTION.as_bytes()),
            other => panic!("INFO type {other} sent"),
        }
    }
    assert_eq!(seen.first(), Some(&INFO_EXPORT), "NBD_INFO_EXPORT comes first");
    for info in [INFO_NAME, INFO_DESCRIPTION] {
        assert_eq!(seen.contains(&info), asked.contains(&info), "INFO {info} sent iff asked");
    }
    let mut unique = seen.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), seen.len(), "an INFO type sent twice");
}

/// What the proto parsers accept, they re-encode to the same bytes.
fn check_parsers(data: &[u8]) {
    if let Ok(g) = parse_go(data) {
        assert_eq!(go_data(&g.name, &g.infos), data, "parse_go round trip");
    }
    if let Ok(m) = parse_meta(data) {
        let q: Vec<&str> = m.queries.iter().map(|s| s.as_str()).collect();
        assert_eq!(meta_data(&m.export, &q), data, "parse_meta round trip");
    }
    if let Ok(Info::Export { size, flags }) = parse_info(data) {
        assert_eq!(info_export(size, flags), data, "parse_info round trip");
    }
    let _ = parse_meta_context(data);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn option(v: &mut Vec<u8>, opt: u32, data: &[u8]) {
        v.extend_from_slice(&option_request(opt, data));
    }

    #[test]
    fn a_full_negotiation_passes() {
        let mut v = (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes().to_vec();
        option(&mut v, OPT_LIST, &[]);
        option(&mut v, OPT_STRUCTURED_REPLY, &[]);
        option(&mut v, OPT_SET_META_CONTEXT, &meta_data("", &[BASE_ALLOCATION]));
        option(&mut v, 4242, b"x");
        option(&mut v, OPT_INFO, &go_data("nope", &[]));
        option(&mut v, OPT_GO, &go_data(EXPORT_NAME, &[INFO_NAME, INFO_DESCRIPTION]));
        run(&v);
        for cut in 0..v.len() {
            run(&v[..cut]);
        }
    }

    #[test]
    #[should_panic(expected = "sent after the handshake ended")]
    fn the_walk_notices_replies_the_spec_does_not_ask_for() {
        // Bad magic: the server hangs up. Feeding the walk a reply anyway must fail it.
        let output = Arc::new(std::sync::Mutex::new(Vec::new()));
        let s = Scripted { input: Cursor::new(vec![0; 20]), output: output.clone() };
        let _ = negotiate(server(), Box::new(s));
        let mut output = output.lock().unwrap().clone();
        output.extend_from_slice(&option_reply_header(OPT_GO, REP_ACK, 0));
        let mut out = Input::new(&output);
        walk(&mut Input::new(&[0; 20]), &mut out);
        assert!(out.is_empty(), "{} bytes sent after the handshake ended", out.0.len());
    }
}
