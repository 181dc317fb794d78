//! What the reader hands out: a [`Job`] (a request, its payload, READs merged into it), and
//! the connection's [`Budget`] of request bytes in flight.

use std::borrow::Cow;
use std::sync::Mutex;

use super::{INLINE_MAX, MERGE_MAX};
use crate::proto::*;

/// Bytes of READ and WRITE requests one connection may have in flight (read, not yet
/// answered). Beyond it the reader stops reading requests until replies go out, and TCP
/// pushes back on the client: without it one client could make the server hold its queue's
/// worth of 64 MiB payloads (16 of them per connection). One request is always let in, so a
/// request up to the maximum payload is never refused by it. Refused requests weigh nothing:
/// a refused WRITE's payload is thrown away as it is read.
const IN_FLIGHT_MAX: u64 = 64 << 20;

/// Request bytes in flight on one connection (see [`IN_FLIGHT_MAX`]).
#[derive(Default)]
pub(super) struct Budget {
    state: Mutex<BudgetState>,
    freed: std::sync::Condvar,
}

#[derive(Default)]
struct BudgetState {
    used: u64,
    /// The reader is waiting in `take` (only the reader takes: one waiter at most): only
    /// then does `give` wake it. A notification costs a futex system call whether anyone
    /// waits or not (std's condition variable does not count waiters), one per request
    /// otherwise.
    waiting: bool,
}

impl Budget {
    pub(super) fn try_take(&self, n: u64) -> bool {
        let mut st = self.state.lock().unwrap();
        if st.used == 0 || st.used + n <= IN_FLIGHT_MAX {
            st.used += n;
            return true;
        }
        false
    }

    pub(super) fn take(&self, n: u64) {
        let mut st = self.state.lock().unwrap();
        while st.used != 0 && st.used + n > IN_FLIGHT_MAX {
            st.waiting = true;
            st = self.freed.wait(st).unwrap();
        }
        st.waiting = false;
        st.used += n;
    }

    pub(super) fn give(&self, n: u64) {
        if n > 0 {
            let mut st = self.state.lock().unwrap();
            st.used -= n;
            if st.waiting {
                self.freed.notify_one();
            }
        }
    }
}

/// The bytes of a request that count against the budget.
pub(super) fn weight(req: &Request) -> u64 {
    if matches!(req.cmd, CMD_READ | CMD_WRITE) {
        req.len
    } else {
        0
    }
}

/// A request to carry out. A WRITE's payload is its own (a job for the workers), or borrowed
/// from the reader's buffer (a small WRITE the reader carries out itself: no allocation or
/// copy).
pub(super) struct Job<'p> {
    pub(super) req: Request,
    pub(super) payload: Option<Cow<'p, [u8]>>,
    /// When the request was read, for the latency figures.
    pub(super) arrived: std::time::Instant,
    /// READs that continue `req` (and one another), merged into one backend read.
    pub(super) merged: Vec<(Request, std::time::Instant)>,
}

impl Job<'_> {
    /// The job with a payload of its own, for the workers.
    pub(super) fn into_owned(self) -> Job<'static> {
        let Job { req, payload, arrived, merged } = self;
        Job { req, payload: payload.map(|p| Cow::Owned(p.into_owned())), arrived, merged }
    }

    /// A READ or WRITE of at most [`INLINE_MAX`] bytes, not merged.
    pub(super) fn is_small_io(&self) -> bool {
        matches!(self.req.cmd, CMD_READ | CMD_WRITE) && self.req.len <= INLINE_MAX && self.merged.is_empty()
    }

    fn end(&self) -> u64 {
        self.merged.last().map_or(self.req.offset + self.req.len, |(r, _)| r.offset + r.len)
    }

    pub(super) fn weight(&self) -> u64 {
        weight(&self.req) + self.merged.iter().map(|(r, _)| weight(r)).sum::<u64>()
    }

    pub(super) fn merged_len(&self) -> u64 {
        self.end() - self.req.offset
    }

    /// Whether `req` is a READ that continues this one within [`MERGE_MAX`]. Empty READs are
    /// never merged: the merged reply gives each request an `OFFSET_DATA` chunk, which must
    /// hold at least one byte; alone, an empty READ gets `NBD_REPLY_TYPE_NONE` (found by the
    /// `connection` fuzz target).
    pub(super) fn can_merge(&self, req: &Request) -> bool {
        self.req.cmd == CMD_READ
            && req.cmd == CMD_READ
            && self.req.len > 0
            && req.len > 0
            && req.flags == self.req.flags
            && req.offset == self.end()
            && self.merged_len() + req.len <= MERGE_MAX
    }
}
