//! Ranges known to read as zeroes below: the holes and zero extents of the layer below when
//! the filter starts, minus every range the filter has written since. Write-back fills the
//! gaps of a block from below; where the whole range is known zeroes it fills them with
//! zeroes without reading.
//!
//! Why it stays true: every write the filter sends down goes through `HeldWrites::write_below`,
//! which forgets its range first (also when the write fails); zeroes and trims make bytes read
//! as zero or leave them as they were, so they never make a known-zero range wrong; and the
//! filter is the only writer of the export (a server's connections all write through it).
//! Knowing nothing is always safe (gaps are then read), so the map is dropped rather than
//! grown past [`MAX`] ranges.

use std::collections::BTreeMap;

use crate::backend::Backend;

/// Most ranges kept (a few MiB); past it the map is dropped.
const MAX: usize = 1 << 16;

/// Disjoint ranges, start → end.
#[derive(Default, Debug)]
pub(super) struct Zeroes {
    ranges: BTreeMap<u64, u64>,
}

impl Zeroes {
    /// The zero extents of `inner` over `[0, size)`; empty where it cannot say.
    pub(super) fn of(inner: &dyn Backend, size: u64) -> Zeroes {
        let mut z = Zeroes::default();
        if !inner.caps().can_extents {
            return z;
        }
        let mut at = 0;
        while at < size {
            let Ok(exts) = inner.extents(at, size - at) else { return Zeroes::default() };
            let before = at;
            for e in exts {
                let n = e.len.min(size - at);
                if e.zero && n > 0 {
                    z.add(at, at + n);
                }
                at += n;
                if at >= size {
                    break;
                }
            }
            if z.ranges.len() > MAX {
                return Zeroes::default();
            }
            if at == before {
                // Nothing more from below: the rest stays unknown.
                break;
            }
        }
        z
    }

    fn add(&mut self, start: u64, end: u64) {
        if let Some((_, e)) = self.ranges.range_mut(..=start).next_back() {
            if *e >= start {
                *e = (*e).max(end);
                return;
            }
        }
        self.ranges.insert(start, end);
    }

    /// Whether all of `[offset, offset+len)` is known to read as zeroes.
    pub(super) fn covers(&self, offset: u64, len: u64) -> bool {
        let Some(end) = offset.checked_add(len) else { return false };
        matches!(self.ranges.range(..=offset).next_back(), Some((_, &e)) if e >= end)
    }

    /// `[offset, offset+len)` is about to be written: no longer known zeroes.
    pub(super) fn forget(&mut self, offset: u64, len: u64) {
        if len == 0 || self.ranges.is_empty() {
            return;
        }
        let end = offset.saturating_add(len);
        // Disjoint ranges sorted by start have sorted ends too: walking back from the last
        // one starting before `end`, they overlap until one ends at or before `offset`.
        let hit: Vec<(u64, u64)> =
            self.ranges.range(..end).rev().take_while(|(_, &e)| e > offset).map(|(&s, &e)| (s, e)).collect();
        for (s, e) in hit {
            self.ranges.remove(&s);
            if s < offset {
                self.ranges.insert(s, offset);
            }
            if e > end {
                self.ranges.insert(end, e);
            }
        }
        if self.ranges.len() > MAX {
            self.ranges.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_carve_known_zeroes() {
        let mut z = Zeroes::default();
        z.add(0, 100);
        z.add(200, 300);
        assert!(z.covers(0, 100) && z.covers(210, 10) && !z.covers(90, 20) && !z.covers(150, 1));
        z.forget(50, 10);
        assert!(z.covers(0, 50) && !z.covers(49, 2) && !z.covers(55, 1) && z.covers(60, 40));
        z.forget(80, 150);
        assert!(z.covers(60, 20) && !z.covers(80, 1) && !z.covers(229, 1) && z.covers(230, 70));
        assert_eq!(z.ranges.len(), 3, "{z:?}");
        z.forget(0, u64::MAX);
        assert!(z.ranges.is_empty());
        assert!(!z.covers(u64::MAX, 2));
    }
}
