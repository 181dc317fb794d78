//! Lock stripes: blocks hash onto [`STRIPES`] `RwLock`s over their dirty data; a request
//! locks the stripes of the blocks it touches, in ascending order (no deadlock).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{RwLockReadGuard, RwLockWriteGuard};

use super::dirty::Block;
use super::HeldWrites;

/// Lock stripes. More than the server's threads times a few connections, so two requests
/// rarely meet on one stripe unless they touch the same block.
pub const STRIPES: usize = 256;

/// Locked stripes, ascending by index.
pub(super) struct Locked<G> {
    pub(super) idx: Vec<usize>,
    pub(super) guards: Vec<G>,
}

impl<G: std::ops::Deref<Target = HashMap<u64, Block>>> Locked<G> {
    pub(super) fn get(&mut self, stripe: usize) -> &mut G {
        let i = self.idx.binary_search(&stripe).expect("stripe locked");
        &mut self.guards[i]
    }

    pub(super) fn holds(&self, stripe: usize) -> bool {
        self.idx.binary_search(&stripe).is_ok()
    }

    pub(super) fn map(&self, stripe: usize) -> &HashMap<u64, Block> {
        &self.guards[self.idx.binary_search(&stripe).expect("stripe locked")]
    }
}

impl HeldWrites {
    pub(super) fn block_of(&self, offset: u64) -> u64 {
        offset / self.cfg.block
    }

    /// The stripes of the blocks `[offset, offset+len)` touches, ascending.
    pub(super) fn stripe_set(&self, offset: u64, len: u64) -> Vec<usize> {
        let (first, last) = (self.block_of(offset), self.block_of(offset + len.max(1) - 1));
        if last - first + 1 >= STRIPES as u64 {
            return (0..STRIPES).collect();
        }
        let mut v: Vec<usize> = (first..=last).map(Self::stripe_of).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Locks the stripes of `[offset, offset+len)` in ascending order with `lock`; `None` as
    /// soon as `lock` gives up on one (the guards taken so far are released).
    fn lock_set<'a, G>(
        &'a self,
        offset: u64,
        len: u64,
        lock: impl Fn(&'a super::Stripe) -> Option<G>,
    ) -> Option<Locked<G>> {
        let idx = self.stripe_set(offset, len);
        let guards = idx.iter().map(|&i| lock(&self.stripes[i])).collect::<Option<Vec<G>>>()?;
        Some(Locked { idx, guards })
    }

    pub(super) fn write_locks(
        &self,
        offset: u64,
        len: u64,
    ) -> Locked<RwLockWriteGuard<'_, HashMap<u64, Block>>> {
        self.lock_set(offset, len, |s| Some(s.write().unwrap())).expect("waits for every lock")
    }

    pub(super) fn read_locks(
        &self,
        offset: u64,
        len: u64,
    ) -> Locked<RwLockReadGuard<'_, HashMap<u64, Block>>> {
        self.lock_set(offset, len, |s| Some(s.read().unwrap())).expect("waits for every lock")
    }

    /// Like `write_locks`, but `None` rather than wait.
    pub(super) fn try_write_locks(
        &self,
        offset: u64,
        len: u64,
    ) -> Option<Locked<RwLockWriteGuard<'_, HashMap<u64, Block>>>> {
        self.lock_set(offset, len, |s| s.try_write().ok())
    }

    /// Like `read_locks`, but `None` rather than wait.
    pub(super) fn try_read_locks(
        &self,
        offset: u64,
        len: u64,
    ) -> Option<Locked<RwLockReadGuard<'_, HashMap<u64, Block>>>> {
        self.lock_set(offset, len, |s| s.try_read().ok())
    }

    /// The dirty blocks among `[offset, offset+len)`, ascending, with the part of the range
    /// in each (relative to the block). Their stripes are locked in `locks`.
    pub(super) fn dirty_in<G: std::ops::Deref<Target = HashMap<u64, Block>>>(
        &self,
        locks: &Locked<G>,
        offset: u64,
        len: u64,
    ) -> Vec<(u64, Range<u32>)> {
        let bs = self.cfg.block;
        let (first, last) = (self.block_of(offset), self.block_of(offset + len.max(1) - 1));
        let piece = |b: u64| {
            let s = offset.max(b * bs) - b * bs;
            let e = (offset + len).min((b + 1) * bs) - b * bs;
            (b, s as u32..e as u32)
        };
        let mut out: Vec<(u64, Range<u32>)> = if last - first < 4 * STRIPES as u64 {
            (first..=last).filter(|b| locks.map(Self::stripe_of(*b)).contains_key(b)).map(piece).collect()
        } else {
            // A huge range (a trim of the whole disk): walk what is dirty instead.
            let keys = locks.guards.iter().flat_map(|m| m.keys().copied());
            keys.filter(|b| (first..=last).contains(b)).map(piece).collect()
        };
        out.sort_unstable_by_key(|(b, _)| *b);
        out
    }

    /// A block's stripe: its number hashed ([`crate::io::spread`]), so that clients writing
    /// blocks a multiple of 256 apart do not wait for each other's write-backs.
    pub(super) fn stripe_of(b: u64) -> usize {
        const _: () = assert!(STRIPES == 256, "8 bits of hash");
        crate::io::spread(b, 8)
    }
}
