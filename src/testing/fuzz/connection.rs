//! The stateful target: a whole server connection, in process. The first byte picks the
//! filter stack over a [`MemoryBackend`] (none, prefetch, coalesce, prefetch over coalesce, as
//! `serve` stacks them) and what the client negotiates (structured replies, `base:allocation`,
//! block sizes, or the old `EXPORT_NAME`); the rest decodes into NBD commands: READ, WRITE,
//! TRIM, WRITE_ZEROES, FLUSH, BLOCK_STATUS, CACHE with fuzzed flags, offsets and lengths
//! (edges, past the end, overflowing), bursts of READs sent together (merged by the server,
//! served from the prefetch buffer), raw headers, and endings (DISC with requests in flight,
//! a bad magic, a WRITE too large to read).
//!
//! The client sends them to `Server::connection` over [`duplex`](crate::testing::duplex) and
//! checks every reply: cookie, magic and framing; an error exactly when the spec (not the
//! validator) calls for one, with an errno it allows; data equal to a byte-vector model
//! ([`Model`]; trimmed bytes are unspecified); structured READs covering the request exactly
//! once with holes that read as zero; BLOCK_STATUS extents within the request whose zero ranges
//! are zero. At the end the connection must close as expected, and the image, read through a
//! new connection's backend and, for coalesce, below it after write-back, must equal the
//! model.
//!
//! This file builds the server, negotiates, decodes the input and sends the requests; what
//! the spec allows for each request and the checks of its replies are in [`replies`].

use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

use super::Input;
use crate::backend::{Backend, MemoryBackend};
use crate::filters::coalesce::CoalesceConfig;
use crate::filters::prefetch::PrefetchConfig;
use crate::filters::{self, StackConfig};
use crate::proto::handshake::*;
use crate::proto::*;
use crate::server::validate::MAX_DRAIN;
use crate::server::{Export, Server};
use crate::testing::conformance::{Expect, Model, Rng};
use crate::testing::duplex::{pair, Duplex};
use crate::testing::fault::{FaultInjector, Rule};

mod replies;

use replies::Pending;

/// Not a multiple of any block size: the last block is partial.
const SIZE: u64 = (1 << 20) + 4097;
/// Most operations decoded from one input.
const MAX_OPS: usize = 256;
/// Longest wait for a reply before the server is declared stuck.
const REPLY_TIMEOUT: Duration = Duration::from_secs(20);
/// The payload limit the server advertises for the memory backend (and keeps to with clients
/// that asked for block sizes; those that did not get `UNNEGOTIATED_MAX`).
const MAX_PAYLOAD: u64 = 32 << 20;

/// The filter stacks `serve` builds, over one memory backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stack {
    Plain,
    Prefetch,
    Coalesce,
    PrefetchCoalesce,
}

struct Built {
    mem: Arc<MemoryBackend>,
    filters: Arc<filters::Stack>,
    server: Arc<Server>,
}

/// `faults` go between the memory backend and the filters: the harness's own tests use them
/// to show that a misbehaving server fails it.
fn build(stack: Stack, busy_coalesce: bool, faults: Vec<Rule>) -> Built {
    let mem = Arc::new(MemoryBackend::new(SIZE));
    let below: Arc<dyn Backend> =
        if faults.is_empty() { mem.clone() } else { Arc::new(FaultInjector::new(mem.clone(), faults)) };
    let ccfg = if busy_coalesce {
        // Write-back by age and under pressure runs amid the requests.
        CoalesceConfig { size: 128 << 10, age: Duration::from_millis(1), threads: 2, ..Default::default() }
    } else {
        CoalesceConfig { threads: 2, ..Default::default() }
    };
    let cfg = StackConfig {
        read_only: false,
        prefetch: matches!(stack, Stack::Prefetch | Stack::PrefetchCoalesce)
            .then_some(PrefetchConfig { threads: 1, ..Default::default() }),
        coalesce: matches!(stack, Stack::Coalesce | Stack::PrefetchCoalesce).then_some(ccfg),
    };
    let filters = Arc::new(filters::Stack::new(cfg, move |_| Ok(below.clone())).unwrap());
    let f = filters.clone();
    let export = Export::new("", None, true, move || f.open()).unwrap();
    Built { mem, filters, server: Arc::new(Server::new(export, 2, 4)) }
}

/// What was negotiated, as the client sees it.
#[derive(Debug, Clone, Copy)]
struct Session {
    structured: bool,
    meta: bool,
    flags: u16,
    /// The largest READ or WRITE the server serves on this connection.
    max_payload: u64,
}

struct Client {
    c: Duplex,
    s: Session,
    model: Model,
    pending: HashMap<u64, Pending>,
    next_cookie: u64,
    stack: Stack,
}

/// Runs one input; panics when a reply or the final image breaks an invariant.
pub fn run(data: &[u8]) {
    let mut inp = Input::new(data);
    let setup = inp.u8();
    let stack =
        [Stack::Plain, Stack::Prefetch, Stack::Coalesce, Stack::PrefetchCoalesce][(setup & 3) as usize];
    run_stack(stack, setup, &mut inp);
}

/// Runs the operations of `inp` on `stack`; `setup` chooses what is negotiated.
pub fn run_stack(stack: Stack, setup: u8, inp: &mut Input) {
    run_faulty(stack, setup, inp, Vec::new())
}

fn run_faulty(stack: Stack, setup: u8, inp: &mut Input, faults: Vec<Rule>) {
    let built = build(stack, setup & 0x80 != 0, faults);
    let (client_end, server_end) = pair();
    let server = built.server.clone();
    let conn = std::thread::spawn(move || server.connection(Box::new(server_end)));
    let mut c = client_end;
    c.set_read_timeout(Some(REPLY_TIMEOUT));
    let s = handshake(&mut c, setup);
    let mut cl = Client {
        c,
        s,
        model: Model::new(SIZE as usize, Expect::Store),
        pending: HashMap::new(),
        next_cookie: 1,
        stack,
    };
    let ending = cl.operations(inp);
    // Whatever is in flight is answered before the connection ends.
    cl.drain();
    let mut rest = Vec::new();
    match cl.c.read_to_end(&mut rest) {
        Ok(_) => assert!(rest.is_empty(), "{stack:?}: {} bytes after the last reply", rest.len()),
        Err(e) => panic!("{stack:?}: the connection did not end: {e}"),
    }
    let result = conn.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
    match ending {
        Ending::Disc => result.unwrap_or_else(|e| panic!("{stack:?}: DISC ended in an error: {e}")),
        Ending::Close => assert!(result.is_err(), "{stack:?}: a protocol violation ended cleanly"),
    }
    drop(cl.c);
    // The image, as a new connection sees it, then below the filters once written back.
    let b = built.server.export.open().unwrap();
    check_image(&*b, &cl.model, &format!("{stack:?}: through a new connection"));
    b.finish().unwrap();
    if built.filters.coalesce().is_some() {
        built.filters.finish().unwrap();
        check_image(&*built.mem, &cl.model, &format!("{stack:?}: below coalesce after write-back"));
    }
}

fn check_image(b: &dyn Backend, m: &Model, what: &str) {
    let mut buf = vec![0u8; SIZE as usize];
    crate::backend::read_exact(b, &mut buf, 0).unwrap();
    m.check(&buf, 0, what).unwrap_or_else(|e| panic!("{e}"));
}

fn read_exact(c: &mut Duplex, n: usize, what: &str) -> Vec<u8> {
    let mut b = vec![0u8; n];
    c.read_exact(&mut b).unwrap_or_else(|e| panic!("{what}: {e}"));
    b
}

fn option_reply(c: &mut Duplex, option: u32) -> (u32, Vec<u8>) {
    let h = read_exact(c, 20, "option reply");
    let r = parse_option_reply(h[..].try_into().unwrap()).expect("option reply magic");
    assert_eq!(r.option, option);
    (r.ty, read_exact(c, r.len as usize, "option reply data"))
}

/// Negotiates as `setup` says: bit 2 structured replies, bit 3 `base:allocation`, bit 4 block
/// sizes, bit 5 `EXPORT_NAME` instead of `GO`.
fn handshake(c: &mut Duplex, setup: u8) -> Session {
    let g = read_exact(c, 18, "greeting");
    assert_eq!(be64(&g[0..8]), NBDMAGIC);
    c.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes()).unwrap();
    let structured = setup & 4 != 0;
    let meta = structured && setup & 8 != 0;
    if structured {
        c.write_all(&option_request(OPT_STRUCTURED_REPLY, &[])).unwrap();
        assert_eq!(option_reply(c, OPT_STRUCTURED_REPLY).0, REP_ACK);
    }
    if meta {
        c.write_all(&option_request(OPT_SET_META_CONTEXT, &meta_data("", &[BASE_ALLOCATION]))).unwrap();
        assert_eq!(option_reply(c, OPT_SET_META_CONTEXT).0, REP_META_CONTEXT);
        assert_eq!(option_reply(c, OPT_SET_META_CONTEXT).0, REP_ACK);
    }
    let (size, flags) = if setup & 0x20 != 0 {
        c.write_all(&option_request(OPT_EXPORT_NAME, b"")).unwrap();
        let d = read_exact(c, 10, "EXPORT_NAME reply");
        (be64(&d[0..8]), be16(&d[8..10]))
    } else {
        let infos: &[u16] = if setup & 0x10 != 0 { &[INFO_BLOCK_SIZE] } else { &[] };
        c.write_all(&option_request(OPT_GO, &go_data("", infos))).unwrap();
        let mut export = None;
        loop {
            let (ty, d) = option_reply(c, OPT_GO);
            match ty {
                REP_INFO => {
                    if let Ok(Info::Export { size, flags }) = parse_info(&d) {
                        export = Some((size, flags));
                    }
                }
                REP_ACK => break,
                other => panic!("GO answered {other:#x}"),
            }
        }
        export.expect("GO without NBD_INFO_EXPORT")
    };
    assert_eq!(size, SIZE, "export size");
    let asked = setup & 0x20 == 0 && setup & 0x10 != 0;
    let max_payload = if asked { MAX_PAYLOAD } else { u64::from(crate::server::validate::UNNEGOTIATED_MAX) };
    Session { structured, meta, flags, max_payload }
}

enum Ending {
    /// DISC sent: the server answers what is in flight and ends cleanly.
    Disc,
    /// A protocol violation sent: the server closes the connection.
    Close,
}

/// An offset: anywhere, near the end, 4 KiB-aligned, or near the start; sometimes past the
/// end.
fn offset(inp: &mut Input) -> u64 {
    let v = inp.u32();
    let x = u64::from(v >> 2);
    match v & 3 {
        0 => x % (SIZE + 8192),
        1 => SIZE.saturating_sub(x % (160 << 10)),
        2 => (x % (SIZE / 4096 + 1)) * 4096,
        _ => x % (256 << 10),
    }
}

/// A length up to about `max`: any, whole 4 KiB blocks, small, or whole 64 KiB blocks.
fn length(inp: &mut Input, max: u64) -> u64 {
    let v = inp.u32();
    let x = u64::from(v >> 2);
    match v & 3 {
        0 => x % (max + 1),
        1 => 4096 * (1 + x % (max / 4096 + 1)),
        2 => x % 600,
        _ => (64 << 10) * (1 + x % (max / 65536 + 1)),
    }
}

/// Flags: mostly ones the command takes, sometimes anything.
fn flags(inp: &mut Input) -> u16 {
    let v = inp.u16();
    if v & 0x8000 != 0 {
        v & 0x7fff
    } else {
        v & (CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_REQ_ONE | CMD_FLAG_FAST_ZERO)
    }
}

impl Client {
    /// Sends `r` (and its payload) and records what it expects.
    fn send(&mut self, r: Request, payload: Option<&[u8]>) -> u64 {
        let mut b = Vec::new();
        let cookie = self.queue(r, payload, &mut b);
        self.c.write_all(&b).unwrap_or_else(|e| panic!("{:?}: send {r:?}: {e}", self.stack));
        cookie
    }

    /// Adds `r` (and its payload) to `out`, to be sent with others in one write, and records
    /// what it expects. Requests written together reach the server's reader together, so
    /// which READs it merges depends on the input only.
    fn queue(&mut self, mut r: Request, payload: Option<&[u8]>, out: &mut Vec<u8>) -> u64 {
        r.cookie = self.next_cookie;
        self.next_cookie += 1;
        out.extend_from_slice(&encode_request(&r));
        if let Some(p) = payload {
            out.extend_from_slice(p);
        }
        self.expect(r);
        r.cookie
    }

    /// Sends one request, waits for its reply, and applies it to the model when it succeeded.
    fn one(&mut self, r: Request, payload: Option<Vec<u8>>) {
        let cookie = self.send(r, payload.as_deref());
        let ok = self.receive_until(cookie);
        if ok {
            let r = Request { cookie, ..r };
            match r.cmd {
                CMD_WRITE => self.model.write(payload.as_deref().unwrap(), r.offset),
                CMD_WRITE_ZEROES => self.model.zero(r.offset, r.len),
                CMD_TRIM => self.model.trim(r.offset, r.len),
                _ => {}
            }
        }
    }

    fn operations(&mut self, inp: &mut Input) -> Ending {
        let mut rng = Rng::new(inp.u64());
        // Where the sequential reads continue.
        let mut seq = 0u64;
        for _ in 0..MAX_OPS {
            if inp.is_empty() {
                break;
            }
            let op = inp.u8();
            let req = |cmd, flags, offset, len| Request { flags, cmd, cookie: 0, offset, len };
            match op % 13 {
                0 | 1 => {
                    let (f, off, len) = (flags(inp), offset(inp), length(inp, 300 << 10));
                    self.one(req(CMD_READ, f & !CMD_FLAG_NO_HOLE, off, len), None);
                }
                2 => {
                    // The next read of a sequential stream: prefetch's business.
                    let len = [512, 4096, 16384, 65536][(inp.u8() % 4) as usize];
                    if seq + len > SIZE {
                        seq = 0;
                    }
                    self.one(req(CMD_READ, 0, seq, len), None);
                    seq += len;
                }
                3 | 4 => {
                    let (f, off, len) = (flags(inp), offset(inp), length(inp, 200 << 10));
                    let mut data = vec![0u8; len as usize];
                    if !inp.u8().is_multiple_of(4) {
                        rng.fill(&mut data);
                    }
                    self.one(req(CMD_WRITE, f & !CMD_FLAG_NO_HOLE, off, len), Some(data));
                }
                5 => {
                    let (f, off, len) = (flags(inp), offset(inp), length(inp, SIZE));
                    self.one(req(CMD_TRIM, f, off, len), None);
                }
                6 => {
                    let (f, off, len) = (flags(inp), offset(inp), length(inp, SIZE));
                    self.one(req(CMD_WRITE_ZEROES, f, off, len), None);
                }
                7 => {
                    let f = flags(inp);
                    self.one(req(CMD_FLUSH, f & CMD_FLAG_FUA, 0, 0), None);
                }
                8 => {
                    let (f, off, len) = (flags(inp), offset(inp), length(inp, SIZE));
                    self.one(req(CMD_BLOCK_STATUS, f, off, len), None);
                }
                9 => {
                    let (f, off, len) = (flags(inp), offset(inp), length(inp, SIZE));
                    self.one(req(CMD_CACHE, f, off, len), None);
                }
                10 => {
                    // READs sent together: contiguous ones are merged, small ones may be
                    // answered from the prefetch buffer; replies come in any order.
                    let n = 2 + inp.u8() % 15;
                    let f = flags(inp) & CMD_FLAG_FUA;
                    let mut off = offset(inp);
                    let gap = inp.u8().is_multiple_of(4);
                    let mut burst = Vec::new();
                    for _ in 0..n {
                        let len = length(inp, 128 << 10);
                        self.queue(req(CMD_READ, f, off, len), None, &mut burst);
                        off += len + if gap { 512 } else { 0 };
                    }
                    self.c.write_all(&burst).unwrap();
                    self.drain();
                }
                11 => {
                    // A raw header: any command, flags, offset and length.
                    let r = req(inp.u16() % 12, inp.u16(), inp.u64(), u64::from(inp.u32()));
                    match r.cmd {
                        CMD_DISC => return self.disconnect(r),
                        // Over the maximum: drained and refused up to MAX_DRAIN (sending that
                        // much only costs time), the connection closed past it.
                        CMD_WRITE if r.len > self.s.max_payload => {
                            return self.huge_write(Request { len: r.len.max(MAX_DRAIN + 1), ..r })
                        }
                        CMD_WRITE => {
                            // Kept small: a large payload only costs time.
                            let r = Request { len: r.len % (256 << 10), ..r };
                            let mut data = vec![0u8; r.len as usize];
                            rng.fill(&mut data);
                            self.one(r, Some(data));
                        }
                        _ => self.one(r, None),
                    }
                }
                _ => {
                    return match inp.u8() % 3 {
                        0 => self.disconnect(req(CMD_DISC, 0, 0, 0)),
                        1 => {
                            // Bad magic: nothing the server can answer.
                            let mut h = encode_request(&req(CMD_READ, 0, 0, 512));
                            h[0] ^= 0x80;
                            self.c.write_all(&h).unwrap();
                            Ending::Close
                        }
                        _ => self.huge_write(req(CMD_WRITE, 0, 0, MAX_DRAIN + 1)),
                    };
                }
            }
        }
        self.disconnect(Request { flags: 0, cmd: CMD_DISC, cookie: 0, offset: 0, len: 0 })
    }

    /// DISC, with a few READs in flight that must still be answered.
    fn disconnect(&mut self, r: Request) -> Ending {
        for i in 0..3 {
            self.send(Request { flags: 0, cmd: CMD_READ, cookie: 0, offset: i * 4096, len: 4096 }, None);
        }
        self.c.write_all(&encode_request(&r)).unwrap();
        Ending::Disc
    }

    /// A WRITE too large to read and discard: the server closes without answering it.
    fn huge_write(&mut self, r: Request) -> Ending {
        self.c.write_all(&encode_request(&r)).unwrap();
        Ending::Close
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::fault::{Fault, Op};

    /// Setup byte, RNG seed, then: WRITE 16 KiB at 12 KiB, READ it back, TRIM, WRITE_ZEROES,
    /// FLUSH, BLOCK_STATUS, CACHE, a burst of 8 READs.
    fn ops(setup: u8) -> Vec<u8> {
        let mut v = vec![setup];
        v.extend_from_slice(&7u64.to_be_bytes());
        let word = |kind: u32, x: u32| ((x << 2) | kind).to_be_bytes();
        v.push(3);
        v.extend_from_slice(&[0, 0]);
        v.extend_from_slice(&word(2, 3));
        v.extend_from_slice(&word(1, 3));
        v.push(1);
        v.push(0);
        v.extend_from_slice(&[0, 0]);
        v.extend_from_slice(&word(2, 3));
        v.extend_from_slice(&word(1, 3));
        for op in [5u8, 6] {
            v.push(op);
            v.extend_from_slice(&[0, 0]);
            v.extend_from_slice(&word(2, 8));
            v.extend_from_slice(&word(1, 1));
        }
        v.extend_from_slice(&[7, 0, 0]);
        for op in [8u8, 9] {
            v.push(op);
            v.extend_from_slice(&[0, 0]);
            v.extend_from_slice(&word(2, 0));
            v.extend_from_slice(&word(3, 1));
        }
        v.extend_from_slice(&[10, 6, 0, 0]);
        v.extend_from_slice(&word(2, 2));
        for _ in 0..8 {
            v.extend_from_slice(&word(1, 0));
        }
        v.push(1);
        v
    }

    #[test]
    fn every_stack_passes() {
        for setup in [0u8, 0x0d, 0x0e, 0x1f, 0x8e, 0x27] {
            run(&ops(setup));
        }
    }

    #[test]
    #[should_panic(expected = "failed with 5")]
    fn a_read_error_fails_the_harness() {
        let rules = vec![Rule::new(Op::Read, Fault::Fail(crate::ErrorKind::Io)).at(16384, 1)];
        run_faulty(Stack::Plain, 0x0c, &mut Input::new(&ops(0x0c)[1..]), rules);
    }

    #[test]
    #[should_panic(expected = "failed with 5")]
    fn a_torn_write_fails_the_harness_under_coalesce() {
        // Coalesce holds the WRITE; its write-back at FLUSH is torn: the FLUSH must fail.
        let rules = vec![Rule::new(Op::Write, Fault::Short)];
        run_faulty(Stack::Coalesce, 0x0e, &mut Input::new(&ops(0x0e)[1..]), rules);
    }
}
