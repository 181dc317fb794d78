//! A simulated power loss: a backend that keeps what has been made durable apart from what
//! was merely written, so a test can cut the power and see what survives.
//!
//! `kill -9` of a server cannot catch a missing `fdatasync`: the page cache outlives the
//! process. Here a write is volatile until a flush (everything) or a FUA request (its own
//! range) makes it durable, and [`PowerLoss::power_loss`] returns only the durable image.
//! Trims read back as zeroes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::backend::{Backend, CacheInfo, Caps, Extent, MemoryBackend, Report, ZeroFlags};
use crate::error::Result;

pub struct PowerLoss {
    name: String,
    /// What reads return: every completed write.
    current: MemoryBackend,
    /// What survives a power loss. Its lock is held across every change of `current` too, so
    /// that a FUA request makes durable exactly its own bytes.
    durable: Mutex<Vec<u8>>,
    flushes: AtomicU64,
}

impl PowerLoss {
    /// A device of `size` bytes of zeroes, all of it durable.
    pub fn new(size: u64) -> PowerLoss {
        PowerLoss {
            name: format!("powerloss:{size}"),
            current: MemoryBackend::new(size),
            durable: Mutex::new(vec![0u8; size as usize]),
            flushes: Default::default(),
        }
    }

    /// Cuts the power: returns what survived, and from now on the device holds only that.
    pub fn power_loss(&self) -> Vec<u8> {
        let durable = self.durable.lock().unwrap();
        self.current.write(&durable, 0, false).expect("memory");
        durable.clone()
    }

    /// Flushes seen so far.
    pub fn flushes(&self) -> u64 {
        self.flushes.load(Ordering::SeqCst)
    }

    /// Carries out `change` on the current image; with `fua`, its range is durable on return.
    fn change(
        &self,
        offset: u64,
        len: u64,
        fua: bool,
        change: impl FnOnce(&MemoryBackend) -> Result<()>,
    ) -> Result<()> {
        let mut durable = self.durable.lock().unwrap();
        change(&self.current)?;
        if fua {
            let (o, n) = (offset as usize, len as usize);
            self.current.read(&mut durable[o..o + n], offset)?;
        }
        Ok(())
    }
}

/// A memory backend as far as reads go; writes, zeroes and trims are volatile until a flush or
/// their own FUA.
impl Backend for PowerLoss {
    fn name(&self) -> &str {
        &self.name
    }

    fn size(&self) -> Option<u64> {
        self.current.size()
    }

    fn caps(&self) -> Caps {
        self.current.caps()
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        self.current.read(buf, offset)
    }

    fn read_at_hand(&self, buf: &mut [u8], offset: u64) -> Option<Result<usize>> {
        self.current.read_at_hand(buf, offset)
    }

    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.change(offset, buf.len() as u64, fua, |m| m.write(buf, offset, false))
    }

    /// A device: writes wait for it.
    fn write_at_hand(&self, _buf: &[u8], _offset: u64) -> Option<Result<()>> {
        None
    }

    /// A device keeps no pages: merged or not, a write is a write.
    fn write_merged(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.write(buf, offset, fua)
    }

    fn will_write(&self, offset: u64, len: u64) {
        self.current.will_write(offset, len)
    }

    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.change(offset, len, flags.fua, |m| m.zero(offset, len, ZeroFlags { fua: false, ..flags }))
    }

    /// Trimmed bytes read back as zeroes (the memory backend's holes).
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.change(offset, len, fua, |m| m.trim(offset, len, false))
    }

    fn flush(&self) -> Result<()> {
        self.flushes.fetch_add(1, Ordering::SeqCst);
        let mut durable = self.durable.lock().unwrap();
        self.current.read(&mut durable, 0)?;
        Ok(())
    }

    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        self.current.cache(offset, len)
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.current.extents(offset, len)
    }

    fn cache_info(&self) -> Option<CacheInfo> {
        self.current.cache_info()
    }

    fn report(&self) -> Report {
        self.current.report()
    }

    fn finish(&self) -> Result<()> {
        self.current.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_flushed_and_fua_bytes_survive() {
        let d = PowerLoss::new(100);
        d.write(&[1; 10], 0, false).unwrap();
        d.flush().unwrap();
        d.write(&[2; 10], 0, false).unwrap();
        d.write(&[3; 10], 20, true).unwrap();
        d.write(&[4; 10], 40, false).unwrap();
        let img = d.power_loss();
        assert_eq!((&img[0..10], &img[20..30], &img[40..50]), (&[1; 10][..], &[3; 10][..], &[0; 10][..]));
        let mut buf = [9u8; 10];
        d.read(&mut buf, 40).unwrap();
        assert_eq!(buf, [0; 10]);
    }
}
