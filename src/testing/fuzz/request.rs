//! The request target: request headers decoded (`parse_request`) and validated
//! (`validate::check`) against limits decoded from the same input. Checked, from the spec
//! rather than from the validator's own code:
//!
//! - decoding round-trips, and fails exactly when the magic is wrong;
//! - an accepted request is a known command with flags it may carry, lies within the export
//!   (FLUSH aside), does not overflow, writes only a writable export, needs only what the
//!   export can do and what was negotiated, fits the payload limit (READ, WRITE) and, when the
//!   client asked for block sizes, is aligned (the final partial block aside);
//! - a refused request gets an error the spec allows for it (`ENOSPC` only for writes past the
//!   end, `EPERM` only for writes on a read-only export, `ENOTSUP` only for `FAST_ZERO`);
//! - only a WRITE whose payload is too large even to be read and discarded closes the
//!   connection: everything else keeps the stream in step.

use super::Input;
use crate::proto::*;
use crate::server::validate::{check, Limits, Verdict, MAX_DRAIN};

fn limits(inp: &mut Input) -> Limits {
    let bits = inp.u16();
    let bit = |i: u32| bits & (1 << i) != 0;
    let min_block = 1u32 << [0, 9, 12, 16][(inp.u8() % 4) as usize];
    // A multiple of the minimum, up to 32 MiB.
    let max_payload = (min_block.max(4096) * (1 + inp.u16() as u32 % 8192)).min(32 << 20);
    let size = match inp.u8() % 4 {
        0 => inp.u64(),
        1 => inp.u64() % (1 << 40),
        _ => u64::from(inp.u32()),
    };
    Limits {
        size,
        read_only: bit(0),
        block_sizes_agreed: bit(1),
        min_block,
        max_payload,
        structured: bit(2),
        meta_context: bit(2) && bit(3),
        can_trim: bit(4),
        can_zero: bit(5),
        can_fast_zero: bit(5) && bit(6),
        can_flush: bit(7),
        can_cache: bit(8),
    }
}

/// Runs one input; panics when a verdict breaks an invariant.
pub fn run(data: &[u8]) {
    let mut inp = Input::new(data);
    let l = limits(&mut inp);
    while !inp.is_empty() {
        let mut h = [0u8; REQUEST_LEN];
        let got = inp.bytes(REQUEST_LEN);
        h[..got.len()].copy_from_slice(got);
        // One byte in two headers: keep the magic right, so the fuzzer gets past it.
        if h[0] & 1 == 0 {
            h[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        }
        let Some(r) = parse_request(&h) else {
            assert_ne!(be32(&h[0..4]), REQUEST_MAGIC, "a good magic refused");
            continue;
        };
        assert_eq!(encode_request(&r), h, "request round trip");
        one(&r, &l);
    }
}

fn one(r: &Request, l: &Limits) {
    let v = check(r, l);
    let what = format!("{r:?} with {l:?}: {v:?}");
    let writes = matches!(r.cmd, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    match v {
        Verdict::Disconnect => {
            assert!(r.cmd == CMD_WRITE && r.len > MAX_DRAIN, "only a huge WRITE disconnects: {what}")
        }
        Verdict::Error(e) => {
            assert!(r.cmd != CMD_WRITE || r.len <= MAX_DRAIN, "a huge WRITE must disconnect: {what}");
            match e {
                EINVAL => {}
                ENOSPC => assert!(matches!(r.cmd, CMD_WRITE | CMD_WRITE_ZEROES), "{what}"),
                EPERM => assert!(writes && l.read_only, "{what}"),
                EOVERFLOW => {
                    assert!(r.cmd == CMD_READ && l.structured && r.len > u64::from(l.max_payload), "{what}")
                }
                _ => panic!("an error the spec does not name: {what}"),
            }
        }
        Verdict::Ok => {
            let allowed = match r.cmd {
                CMD_READ | CMD_WRITE | CMD_FLUSH | CMD_TRIM | CMD_CACHE | CMD_DISC => CMD_FLAG_FUA,
                CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
                CMD_BLOCK_STATUS => CMD_FLAG_FUA | CMD_FLAG_REQ_ONE,
                _ => panic!("an unknown command accepted: {what}"),
            };
            assert_eq!(r.flags & !allowed, 0, "a flag the command does not take: {what}");
            let end = r.offset.checked_add(r.len).expect(&what);
            if r.cmd != CMD_FLUSH {
                assert!(end <= l.size, "past the end: {what}");
            }
            assert!(!(writes && l.read_only), "a write on a read-only export: {what}");
            let needs = match r.cmd {
                CMD_TRIM => l.can_trim,
                CMD_WRITE_ZEROES => l.can_zero && (r.flags & CMD_FLAG_FAST_ZERO == 0 || l.can_fast_zero),
                CMD_FLUSH => l.can_flush,
                CMD_CACHE => l.can_cache,
                CMD_BLOCK_STATUS => l.structured && l.meta_context && r.len > 0,
                _ => true,
            };
            assert!(needs, "needs what the export cannot do or was not negotiated: {what}");
            if matches!(r.cmd, CMD_READ | CMD_WRITE) {
                assert!(r.len <= u64::from(l.max_payload), "over the payload limit: {what}");
            }
            if l.block_sizes_agreed && r.cmd != CMD_FLUSH {
                let m = u64::from(l.min_block);
                assert!(
                    r.offset.is_multiple_of(m) && (r.len.is_multiple_of(m) || end == l.size),
                    "unaligned: {what}"
                );
            }
        }
    }
}
