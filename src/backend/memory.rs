//! An in-memory sparse store: the reference backend for tests, and `memory:SIZE` exports.
//!
//! Bytes live in 64 KiB pages allocated on first write; absent pages read as zeroes and are
//! reported as holes. Pages are spread over shards, each behind its own lock, so parallel
//! requests to different places do not contend.

use std::collections::HashMap;
use std::sync::RwLock;

use super::{Backend, Caps, Extent, ZeroFlags};
use crate::error::Result;

const PAGE: u64 = 64 << 10;
const SHARDS: usize = 64;

type Page = Box<[u8]>;

pub struct MemoryBackend {
    name: String,
    size: u64,
    shards: Vec<RwLock<HashMap<u64, Page>>>,
}

impl MemoryBackend {
    pub fn new(size: u64) -> MemoryBackend {
        MemoryBackend {
            name: format!("memory:{size}"),
            size,
            shards: (0..SHARDS).map(|_| RwLock::new(HashMap::new())).collect(),
        }
    }

    fn shard(&self, page: u64) -> &RwLock<HashMap<u64, Page>> {
        &self.shards[(page % SHARDS as u64) as usize]
    }

    /// Calls `f(page, offset in page, range in the request)` for each page piece of a range.
    fn pieces(offset: u64, len: u64, mut f: impl FnMut(u64, usize, std::ops::Range<usize>)) {
        let mut at = offset;
        while at < offset + len {
            let page = at / PAGE;
            let in_page = (at % PAGE) as usize;
            let n = (PAGE - at % PAGE).min(offset + len - at) as usize;
            let start = (at - offset) as usize;
            f(page, in_page, start..start + n);
            at += n as u64;
        }
    }

    /// Zeroes a range: whole pages are dropped, partial ones cleared.
    fn clear(&self, offset: u64, len: u64) {
        Self::pieces(offset, len, |page, in_page, r| {
            let mut shard = self.shard(page).write().unwrap();
            if r.len() as u64 == PAGE {
                shard.remove(&page);
            } else if let Some(p) = shard.get_mut(&page) {
                p[in_page..in_page + r.len()].fill(0);
            }
        });
    }

    /// Bytes of pages allocated (for tests of sparseness).
    pub fn allocated(&self) -> u64 {
        self.shards.iter().map(|s| s.read().unwrap().len() as u64 * PAGE).sum()
    }
}

impl Backend for MemoryBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn size(&self) -> Option<u64> {
        Some(self.size)
    }

    fn caps(&self) -> Caps {
        Caps { alloc_unit: Some(PAGE as u32), ..Caps::in_memory() }
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        debug_assert!(offset + buf.len() as u64 <= self.size);
        Self::pieces(offset, buf.len() as u64, |page, in_page, r| {
            let shard = self.shard(page).read().unwrap();
            match shard.get(&page) {
                Some(p) => buf[r.clone()].copy_from_slice(&p[in_page..in_page + r.len()]),
                None => buf[r].fill(0),
            }
        });
        Ok(buf.len())
    }

    fn read_at_hand(&self, buf: &mut [u8], offset: u64) -> Option<Result<usize>> {
        Some(self.read(buf, offset))
    }

    fn write(&self, buf: &[u8], offset: u64, _fua: bool) -> Result<()> {
        debug_assert!(offset + buf.len() as u64 <= self.size);
        Self::pieces(offset, buf.len() as u64, |page, in_page, r| {
            let mut shard = self.shard(page).write().unwrap();
            let p = shard.entry(page).or_insert_with(|| vec![0u8; PAGE as usize].into_boxed_slice());
            p[in_page..in_page + r.len()].copy_from_slice(&buf[r]);
        });
        Ok(())
    }

    /// Memory never waits for a device: written at once, as reads are.
    fn write_at_hand(&self, buf: &[u8], offset: u64) -> Option<Result<()>> {
        Some(self.write(buf, offset, false))
    }

    fn write_merged(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.write(buf, offset, fua)
    }

    fn will_write(&self, _offset: u64, _len: u64) {}

    fn zero(&self, offset: u64, len: u64, _flags: ZeroFlags) -> Result<()> {
        self.clear(offset, len);
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64, _fua: bool) -> Result<()> {
        self.clear(offset, len);
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }

    fn cache(&self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let mut out: Vec<Extent> = Vec::new();
        Self::pieces(offset, len, |page, _, r| {
            let hole = !self.shard(page).read().unwrap().contains_key(&page);
            match out.last_mut() {
                Some(last) if last.hole == hole => last.len += r.len() as u64,
                _ => out.push(if hole { Extent::hole(r.len() as u64) } else { Extent::data(r.len() as u64) }),
            }
        });
        if out.is_empty() {
            out.push(Extent::hole(0));
        }
        Ok(out)
    }

    crate::backend::nothing_to_report!();

    fn finish(&self) -> Result<()> {
        Ok(())
    }
}
