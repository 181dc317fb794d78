//! The client's side of every reply: what the spec allows for each request sent (the errors it
//! names, from the transmission flags negotiated, not from the server's validator), and the
//! checks of each reply as it comes ([`Client::receive`]): cookie, magic and framing, an error
//! exactly when allowed, data equal to the model, structured READs covering the request exactly
//! once, BLOCK_STATUS extents inside the request whose zero ranges are zero.

use super::{read_exact, Client, SIZE};
use crate::proto::*;

/// A request sent and not yet fully answered.
pub(super) struct Pending {
    req: Request,
    /// The errors the spec allows; empty: it must succeed.
    errors: Vec<u32>,
    /// Structured READ chunks received so far: (offset, len).
    covered: Vec<(u64, u64)>,
}

impl Client {
    /// Records what the reply to `r` must be, until it has come.
    pub(super) fn expect(&mut self, r: Request) {
        let errors = self.errors(&r);
        self.pending.insert(r.cookie, Pending { req: r, errors, covered: Vec::new() });
    }

    /// The errors the spec allows for `r` (empty: it must succeed), worked out from the spec
    /// and the transmission flags the client was given, not from the server's validator.
    /// When several rules are broken, any of their errors will do.
    fn errors(&self, r: &Request) -> Vec<u32> {
        let mut e = Vec::new();
        let tf = |bit: u16| self.s.flags & bit != 0;
        let allowed = match r.cmd {
            CMD_READ | CMD_WRITE | CMD_FLUSH | CMD_TRIM | CMD_CACHE => CMD_FLAG_FUA,
            CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
            CMD_BLOCK_STATUS => CMD_FLAG_FUA | CMD_FLAG_REQ_ONE,
            _ => return vec![EINVAL],
        };
        if r.flags & !allowed != 0 {
            e.push(EINVAL);
        }
        let end = r.offset.checked_add(r.len);
        match end {
            None => e.push(EINVAL),
            Some(end) if end > SIZE && r.cmd != CMD_FLUSH => {
                e.push(if matches!(r.cmd, CMD_WRITE | CMD_WRITE_ZEROES) { ENOSPC } else { EINVAL })
            }
            _ => {}
        }
        let unsupported = match r.cmd {
            CMD_FLUSH => !tf(TF_SEND_FLUSH),
            CMD_TRIM => !tf(TF_SEND_TRIM),
            // FAST_ZERO the server did not advertise: EINVAL too, the spec says (ENOTSUP is for
            // an advertised fast zero that cannot be done).
            CMD_WRITE_ZEROES => {
                !tf(TF_SEND_WRITE_ZEROES) || (r.flags & CMD_FLAG_FAST_ZERO != 0 && !tf(TF_SEND_FAST_ZERO))
            }
            CMD_CACHE => !tf(TF_SEND_CACHE),
            CMD_BLOCK_STATUS => !self.s.meta || r.len == 0,
            CMD_WRITE => r.len > self.s.max_payload,
            // With structured replies a READ over the maximum may be refused with EOVERFLOW
            // (the client may retry smaller); with simple ones the client broke a MUST.
            CMD_READ if r.len > self.s.max_payload && self.s.structured => {
                e.push(EOVERFLOW);
                false
            }
            CMD_READ => r.len > self.s.max_payload,
            _ => false,
        };
        if unsupported {
            e.push(EINVAL);
        }
        e
    }

    pub(super) fn drain(&mut self) {
        while !self.pending.is_empty() {
            self.receive();
        }
    }

    /// Receives replies until `cookie`'s is complete; true if it succeeded. `cookie` must be
    /// the only request in flight.
    pub(super) fn receive_until(&mut self, cookie: u64) -> bool {
        debug_assert_eq!(self.pending.len(), 1);
        loop {
            if let Some((c, ok)) = self.receive() {
                if c == cookie {
                    return ok;
                }
            }
        }
    }

    /// Reads one reply or chunk and checks it; `Some((cookie, ok))` when a request is done.
    fn receive(&mut self) -> Option<(u64, bool)> {
        let st = self.stack;
        let waiting: Vec<Request> = self.pending.values().map(|p| p.req).collect();
        let m = read_exact(&mut self.c, 4, &format!("{st:?}: reply magic, waiting for {waiting:?}"));
        match be32(&m) {
            SIMPLE_REPLY_MAGIC => {
                let rest = read_exact(&mut self.c, 12, "simple reply");
                let (err, cookie) = (be32(&rest[0..4]), be64(&rest[4..12]));
                let p = self
                    .pending
                    .remove(&cookie)
                    .unwrap_or_else(|| panic!("{st:?}: reply to cookie {cookie}"));
                let r = p.req;
                assert!(
                    !self.s.structured || !matches!(r.cmd, CMD_READ | CMD_BLOCK_STATUS),
                    "{st:?}: simple reply to {r:?} after structured replies were agreed"
                );
                if err == 0 {
                    assert!(p.errors.is_empty(), "{st:?}: {r:?} succeeded; expected one of {:?}", p.errors);
                    if r.cmd == CMD_READ {
                        let data = read_exact(&mut self.c, r.len as usize, "read data");
                        self.model
                            .check(&data, r.offset, &format!("{st:?}: {r:?}"))
                            .unwrap_or_else(|e| panic!("{e}"));
                    }
                } else {
                    self.check_error(&p, err);
                }
                Some((cookie, err == 0))
            }
            STRUCTURED_REPLY_MAGIC => {
                let rest = read_exact(&mut self.c, 16, "chunk header");
                let (flags, ty, cookie, len) =
                    (be16(&rest[0..2]), be16(&rest[2..4]), be64(&rest[4..12]), be32(&rest[12..16]));
                assert!(self.s.structured, "{st:?}: a chunk without structured replies agreed");
                let payload = read_exact(&mut self.c, len as usize, "chunk payload");
                let done = flags & REPLY_FLAG_DONE != 0;
                let p = self
                    .pending
                    .get_mut(&cookie)
                    .unwrap_or_else(|| panic!("{st:?}: chunk for cookie {cookie}"));
                let r = p.req;
                assert!(matches!(r.cmd, CMD_READ | CMD_BLOCK_STATUS), "{st:?}: chunk {ty} for {r:?}");
                let what = format!("{st:?}: {r:?}, chunk {ty}");
                match ty {
                    REPLY_TYPE_ERROR | REPLY_TYPE_ERROR_OFFSET => {
                        assert!(done, "{what}: error chunks end the reply here");
                        assert!(payload.len() >= 6, "{what}: short error chunk");
                        let n = be16(&payload[4..6]) as usize;
                        let extra = if ty == REPLY_TYPE_ERROR_OFFSET { 8 } else { 0 };
                        assert_eq!(payload.len(), 6 + n + extra, "{what}: error chunk length");
                        let p = self.pending.remove(&cookie).unwrap();
                        self.check_error(&p, be32(&payload[0..4]));
                        return Some((cookie, false));
                    }
                    REPLY_TYPE_NONE => {
                        assert!(done && payload.is_empty(), "{what}: NONE must be empty and final");
                    }
                    REPLY_TYPE_OFFSET_DATA if r.cmd == CMD_READ => {
                        assert!(payload.len() > 8, "{what}: empty data chunk");
                        let off = be64(&payload[0..8]);
                        let data = &payload[8..];
                        p.covered.push((off, data.len() as u64));
                        assert!(
                            off >= r.offset && off + data.len() as u64 <= r.offset + r.len,
                            "{what}: outside the request"
                        );
                        self.model.check(data, off, &what).unwrap_or_else(|e| panic!("{e}"));
                    }
                    REPLY_TYPE_OFFSET_HOLE if r.cmd == CMD_READ => {
                        assert_eq!(payload.len(), 12, "{what}: hole chunk length");
                        let (off, n) = (be64(&payload[0..8]), u64::from(be32(&payload[8..12])));
                        assert!(n > 0, "{what}: empty hole");
                        p.covered.push((off, n));
                        assert!(
                            off >= r.offset && off + n <= r.offset + r.len,
                            "{what}: outside the request"
                        );
                        self.model
                            .check(&vec![0u8; n as usize], off, &format!("{what}: hole"))
                            .unwrap_or_else(|e| panic!("{e}"));
                    }
                    REPLY_TYPE_BLOCK_STATUS if r.cmd == CMD_BLOCK_STATUS => {
                        assert!(done, "{what}: one base:allocation chunk, final");
                        assert!(
                            payload.len() >= 12 && (payload.len() - 4).is_multiple_of(8),
                            "{what}: length {}",
                            payload.len()
                        );
                        assert_eq!(
                            be32(&payload[0..4]),
                            crate::server::handshake::BASE_ALLOCATION_ID,
                            "{what}: context id"
                        );
                        let n = (payload.len() - 4) / 8;
                        if r.flags & CMD_FLAG_REQ_ONE != 0 {
                            assert_eq!(n, 1, "{what}: REQ_ONE");
                        }
                        let mut at = r.offset;
                        for d in payload[4..].chunks(8) {
                            let (len, state) = (u64::from(be32(&d[0..4])), be32(&d[4..8]));
                            assert!(len > 0, "{what}: an empty extent");
                            assert_eq!(state & !(STATE_HOLE | STATE_ZERO), 0, "{what}: state {state:#x}");
                            assert!(at + len <= r.offset + r.len, "{what}: extents past the request");
                            if state & STATE_ZERO != 0 {
                                self.model
                                    .check(&vec![0u8; len as usize], at, &format!("{what}: zero extent"))
                                    .unwrap_or_else(|e| panic!("{e}"));
                            }
                            at += len;
                        }
                    }
                    _ => panic!("{what}: unexpected chunk type"),
                }
                if !done {
                    return None;
                }
                let p = self.pending.remove(&cookie).unwrap();
                assert!(p.errors.is_empty(), "{st:?}: {r:?} succeeded; expected one of {:?}", p.errors);
                if r.cmd == CMD_READ {
                    // Every byte of the request exactly once.
                    let mut cov = p.covered;
                    cov.sort_unstable();
                    let mut at = r.offset;
                    for (off, n) in cov {
                        assert_eq!(off, at, "{st:?}: {r:?}: chunks leave a gap or overlap at {at}");
                        at += n;
                    }
                    assert_eq!(at, r.offset + r.len, "{st:?}: {r:?}: chunks end at {at}");
                }
                Some((cookie, true))
            }
            other => panic!("{st:?}: reply magic {other:#x}"),
        }
    }

    fn check_error(&self, p: &Pending, err: u32) {
        assert!(
            p.errors.contains(&err),
            "{:?}: {:?} failed with {err}; expected {}",
            self.stack,
            p.req,
            if p.errors.is_empty() { "success".to_string() } else { format!("one of {:?}", p.errors) }
        );
    }
}
