//! The allocation map, asked for in large windows. A copy wants the extents of every request
//! (256 KiB to 4 MiB); asking the server each time doubles the round trips of a copy. So one
//! `NBD_CMD_BLOCK_STATUS` covers [`WINDOW`] bytes from the first offset not yet known, and
//! later questions inside it are answered from the answer kept here.
//!
//! Kept answers are only as old as the last write through this backend: every write, zero
//! and trim clears them. A writer on another connection or client can change the map at any
//! time, which makes any answer stale the moment it arrives; a kept one is no worse for a
//! copy's source, the only backend that keeps them (`NbdBackend::keeping_extents`). It is
//! worse under a filter stack: coalesce writes back through a backend of its own, and a front's
//! backend that kept an answer from before would call the written bytes zero (the conformance
//! matrix caught this).

use std::sync::{Mutex, MutexGuard};

use crate::backend::Extent;

/// Bytes of allocation map asked for at once.
pub const WINDOW: u64 = 64 << 20;

/// The last answer: extents that together cover `[start, start + their lengths)`.
#[derive(Default)]
pub struct Window {
    start: u64,
    extents: Vec<Extent>,
}

impl Window {
    pub fn new(start: u64, extents: Vec<Extent>) -> Window {
        Window { start, extents }
    }

    /// The extents of `[offset, offset+len)` as far as this window knows them, starting at
    /// `offset`; `None` when it does not cover `offset`.
    pub fn lookup(&self, offset: u64, len: u64) -> Option<Vec<Extent>> {
        if offset < self.start {
            return None;
        }
        let mut at = self.start;
        let mut out = Vec::new();
        let end = offset + len;
        for e in &self.extents {
            let e_end = at + e.len;
            if e_end > offset && at < end {
                let from = at.max(offset);
                out.push(Extent { len: e_end.min(end) - from, ..*e });
            }
            at = e_end;
            if at >= end {
                break;
            }
        }
        (!out.is_empty()).then_some(out)
    }
}

/// The window, behind a lock held while a new one is fetched (so concurrent readers wait for
/// one answer instead of all asking).
#[derive(Default)]
pub struct Cache(Mutex<Window>);

impl Cache {
    pub fn lock(&self) -> MutexGuard<'_, Window> {
        self.0.lock().unwrap()
    }

    /// Forgets the kept answer (after a write through this backend).
    pub fn clear(&self) {
        *self.lock() = Window::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_clip_to_the_question_and_the_window() {
        let w = Window::new(100, vec![Extent::data(50), Extent::hole(100), Extent::data(10)]);
        assert_eq!(w.lookup(50, 10), None);
        assert_eq!(w.lookup(100, 10), Some(vec![Extent::data(10)]));
        assert_eq!(w.lookup(140, 20), Some(vec![Extent::data(10), Extent::hole(10)]));
        // Past the window's end: what it knows, then the caller asks again.
        assert_eq!(w.lookup(240, 100), Some(vec![Extent::hole(10), Extent::data(10)]));
        assert_eq!(w.lookup(260, 5), None);
        assert_eq!(Window::default().lookup(0, 1), None);
    }
}
