//! Request validation, in one place, as the NBD specification asks. Inner layers only
//! `debug_assert!` the same invariants.

use crate::proto::*;

/// What the connection negotiated and the export offers, as validation needs it.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub size: u64,
    pub read_only: bool,
    /// Client asked for block sizes (`NBD_INFO_BLOCK_SIZE`): alignment is then enforced.
    pub block_sizes_agreed: bool,
    pub min_block: u32,
    /// Largest payload served (READ and WRITE length): see [`max_payload`].
    pub max_payload: u32,
    pub structured: bool,
    pub meta_context: bool,
    pub can_trim: bool,
    pub can_zero: bool,
    pub can_fast_zero: bool,
    pub can_flush: bool,
    pub can_cache: bool,
}

/// The largest READ or WRITE served to a client that did not negotiate block sizes. Such a
/// client knows no limit but the spec's 32 MiB "SHOULD", and many send more: nbdkit serves up
/// to 64 MiB, and the NBD reference implementation's own tests send 47.5 MiB.
pub const UNNEGOTIATED_MAX: u32 = 64 << 20;

/// A WRITE over the largest payload served, up to this length, has its payload read and
/// thrown away through the connection's small buffer (nothing allocated for it) and is
/// answered EINVAL, so the connection goes on. A longer one would take too long to skip: the
/// connection is closed without reading it (the spec allows either). Twice the largest
/// payload served, as nbdkit does.
pub const MAX_DRAIN: u64 = 2 * UNNEGOTIATED_MAX as u64;

/// The largest payload served on a connection: the advertised maximum to a client that asked
/// for block sizes (and so agreed to keep to them), [`UNNEGOTIATED_MAX`] to one that did not
/// (backends accept requests of any length: see `BlockSizes::maximum`).
pub fn max_payload(block_sizes_agreed: bool, advertised: u32) -> u32 {
    if block_sizes_agreed {
        advertised
    } else {
        advertised.max(UNNEGOTIATED_MAX)
    }
}

/// The verdict on a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    /// Answer with this NBD error (after reading and discarding any payload).
    Error(u32),
    /// The request cannot be answered in a way the client could follow: close.
    Disconnect,
}

/// Checks a request against the spec and what was negotiated.
pub fn check(r: &Request, l: &Limits) -> Verdict {
    use Verdict::*;
    let allowed_flags = match r.cmd {
        CMD_READ => CMD_FLAG_FUA,
        CMD_WRITE | CMD_FLUSH | CMD_TRIM | CMD_CACHE => CMD_FLAG_FUA,
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        CMD_BLOCK_STATUS => CMD_FLAG_FUA | CMD_FLAG_REQ_ONE,
        CMD_DISC => CMD_FLAG_FUA,
        _ => {
            // An unknown WRITE-like command could carry a payload we cannot skip.
            return Error(EINVAL);
        }
    };
    if r.cmd == CMD_WRITE && r.len > u64::from(l.max_payload) {
        return if r.len > MAX_DRAIN { Disconnect } else { Error(EINVAL) };
    }
    if r.flags & !allowed_flags != 0 {
        return Error(EINVAL);
    }
    let end = match r.offset.checked_add(r.len) {
        Some(e) => e,
        None => return Error(EINVAL),
    };
    let writes = matches!(r.cmd, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if writes && l.read_only {
        return Error(EPERM);
    }
    match r.cmd {
        CMD_TRIM if !l.can_trim => return Error(EINVAL),
        CMD_WRITE_ZEROES if !l.can_zero => return Error(EINVAL),
        // FAST_ZERO not advertised: EINVAL, the spec says (ENOTSUP answers a fast zero that
        // was advertised but cannot be done: the backend's, below).
        CMD_WRITE_ZEROES if r.flags & CMD_FLAG_FAST_ZERO != 0 && !l.can_fast_zero => return Error(EINVAL),
        CMD_FLUSH if !l.can_flush => return Error(EINVAL),
        CMD_CACHE if !l.can_cache => return Error(EINVAL),
        CMD_BLOCK_STATUS if !(l.structured && l.meta_context) => return Error(EINVAL),
        CMD_BLOCK_STATUS if r.len == 0 => return Error(EINVAL),
        _ => {}
    }
    // A READ over the maximum: with structured replies the spec lets the server refuse it
    // with EOVERFLOW (the client may retry smaller); with simple replies the client broke a
    // MUST.
    if r.cmd == CMD_READ && r.len > u64::from(l.max_payload) {
        return Error(if l.structured { EOVERFLOW } else { EINVAL });
    }
    if r.cmd != CMD_FLUSH && end > l.size {
        return Error(if matches!(r.cmd, CMD_WRITE | CMD_WRITE_ZEROES) { ENOSPC } else { EINVAL });
    }
    if l.block_sizes_agreed && l.min_block > 1 && r.cmd != CMD_FLUSH {
        let m = u64::from(l.min_block);
        // The final partial block of an export whose size is not a multiple is allowed.
        if !r.offset.is_multiple_of(m) || (!r.len.is_multiple_of(m) && end != l.size) {
            return Error(EINVAL);
        }
    }
    Ok
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Limits = Limits {
        size: 1 << 20,
        read_only: false,
        block_sizes_agreed: false,
        min_block: 1,
        max_payload: 32 << 20,
        structured: true,
        meta_context: true,
        can_trim: true,
        can_zero: true,
        can_fast_zero: true,
        can_flush: true,
        can_cache: true,
    };

    fn req(cmd: u16, flags: u16, offset: u64, len: u64) -> Request {
        Request { flags, cmd, cookie: 1, offset, len }
    }

    #[test]
    fn out_of_range_answers_per_command() {
        assert_eq!(check(&req(CMD_READ, 0, (1 << 20) - 1, 2), &L), Verdict::Error(EINVAL));
        assert_eq!(check(&req(CMD_WRITE, 0, (1 << 20) - 1, 2), &L), Verdict::Error(ENOSPC));
        assert_eq!(check(&req(CMD_WRITE_ZEROES, 0, 1 << 20, 1), &L), Verdict::Error(ENOSPC));
        assert_eq!(check(&req(CMD_TRIM, 0, 0, (1 << 20) + 1), &L), Verdict::Error(EINVAL));
        assert_eq!(check(&req(CMD_CACHE, 0, 1 << 20, 1), &L), Verdict::Error(EINVAL));
        assert_eq!(check(&req(CMD_BLOCK_STATUS, 0, 1 << 20, 1), &L), Verdict::Error(EINVAL));
        assert_eq!(check(&req(CMD_READ, 0, u64::MAX, 2), &L), Verdict::Error(EINVAL));
        assert_eq!(check(&req(CMD_READ, 0, (1 << 20) - 1, 1), &L), Verdict::Ok);
    }

    #[test]
    fn read_only_refuses_writes() {
        let ro = Limits { read_only: true, ..L };
        for cmd in [CMD_WRITE, CMD_TRIM, CMD_WRITE_ZEROES] {
            assert_eq!(check(&req(cmd, 0, 0, 1), &ro), Verdict::Error(EPERM));
        }
        assert_eq!(check(&req(CMD_READ, 0, 0, 1), &ro), Verdict::Ok);
    }

    #[test]
    fn payload_limits() {
        let small = Limits { max_payload: 1 << 20, size: 1 << 30, ..L };
        assert_eq!(check(&req(CMD_WRITE, 0, 0, 2 << 20), &small), Verdict::Error(EINVAL));
        assert_eq!(check(&req(CMD_WRITE, 0, 0, MAX_DRAIN), &small), Verdict::Error(EINVAL));
        assert_eq!(check(&req(CMD_WRITE, 0, 0, MAX_DRAIN + 1), &small), Verdict::Disconnect);
        assert_eq!(check(&req(CMD_WRITE, 0, 0, u64::from(u32::MAX)), &small), Verdict::Disconnect);
        // Structured replies: EOVERFLOW (the client may retry smaller).
        assert_eq!(check(&req(CMD_READ, 0, 0, 2 << 20), &small), Verdict::Error(EOVERFLOW));
        // Commands without payload may exceed the maximum payload size.
        assert_eq!(check(&req(CMD_WRITE_ZEROES, 0, 0, 1 << 30), &small), Verdict::Ok);
        assert_eq!(check(&req(CMD_TRIM, 0, 0, 1 << 30), &small), Verdict::Ok);
        assert_eq!(check(&req(CMD_BLOCK_STATUS, 0, 0, 1 << 30), &small), Verdict::Ok);
    }

    #[test]
    fn clients_that_did_not_ask_get_64_mib() {
        assert_eq!(max_payload(true, 32 << 20), 32 << 20);
        assert_eq!(max_payload(false, 32 << 20), 64 << 20);
        assert_eq!(max_payload(false, 128 << 20), 128 << 20);
        let l = Limits { max_payload: max_payload(false, 32 << 20), size: 1 << 30, ..L };
        assert_eq!(check(&req(CMD_READ, 0, 0, 48 << 20), &l), Verdict::Ok);
        assert_eq!(check(&req(CMD_WRITE, 0, 0, 64 << 20), &l), Verdict::Ok);
        assert_eq!(check(&req(CMD_READ, 0, 0, 65 << 20), &l), Verdict::Error(EOVERFLOW));
        assert_eq!(check(&req(CMD_WRITE, 0, 0, 65 << 20), &l), Verdict::Error(EINVAL));
    }

    #[test]
    fn flags_and_capabilities() {
        assert_eq!(check(&req(CMD_READ, CMD_FLAG_NO_HOLE, 0, 1), &L), Verdict::Error(EINVAL));
        assert_eq!(check(&req(CMD_WRITE, CMD_FLAG_FUA, 0, 1), &L), Verdict::Ok);
        assert_eq!(check(&req(CMD_FLUSH, CMD_FLAG_FUA, 0, 0), &L), Verdict::Ok);
        assert_eq!(check(&req(99, 0, 0, 1), &L), Verdict::Error(EINVAL));
        let no_fast = Limits { can_fast_zero: false, ..L };
        assert_eq!(check(&req(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 0, 1), &no_fast), Verdict::Error(EINVAL));
        let big = u64::from(L.max_payload) + 1;
        assert_eq!(check(&req(CMD_READ, 0, 0, big), &L), Verdict::Error(EOVERFLOW));
        let simple = Limits { structured: false, ..L };
        assert_eq!(check(&req(CMD_READ, 0, 0, big), &simple), Verdict::Error(EINVAL));
        assert_eq!(check(&req(CMD_BLOCK_STATUS, 0, 0, 1), &simple), Verdict::Error(EINVAL));
    }

    #[test]
    fn alignment_only_for_clients_that_agreed() {
        let aligned = Limits { min_block: 512, ..L };
        assert_eq!(check(&req(CMD_READ, 0, 1, 1), &aligned), Verdict::Ok);
        let agreed = Limits { block_sizes_agreed: true, ..aligned };
        assert_eq!(check(&req(CMD_READ, 0, 1, 1), &agreed), Verdict::Error(EINVAL));
        assert_eq!(check(&req(CMD_READ, 0, 512, 512), &agreed), Verdict::Ok);
    }
}
