//! A simulated power loss: a backend that keeps what has been made durable apart from what
//! was merely written, so a test can cut the power and see what survives.
//!
//! `kill -9` of a server cannot catch a missing `fdatasync`: the page cache outlives the
//! process. Here a write is volatile until a flush (everything) or a FUA request (its own
//! range) makes it durable, and [`PowerLoss::power_loss`] returns only the durable image.
//! Trims read back as zeroes.

use std::sync::Mutex;

use crate::backend::{Backend, BlockSizes, CacheInfo, Caps, Extent, ZeroFlags};
use crate::error::Result;

struct Images {
    /// What reads return: every completed write.
    current: Vec<u8>,
    /// What survives a power loss.
    durable: Vec<u8>,
}

pub struct PowerLoss {
    name: String,
    images: Mutex<Images>,
    flushes: std::sync::atomic::AtomicU64,
}

impl PowerLoss {
    /// A device of `size` bytes of zeroes, all of it durable.
    pub fn new(size: u64) -> PowerLoss {
        let zeroes = vec![0u8; size as usize];
        PowerLoss {
            name: format!("powerloss:{size}"),
            images: Mutex::new(Images { current: zeroes.clone(), durable: zeroes }),
            flushes: Default::default(),
        }
    }

    /// Cuts the power: returns what survived, and from now on the device holds only that.
    pub fn power_loss(&self) -> Vec<u8> {
        let mut im = self.images.lock().unwrap();
        im.current = im.durable.clone();
        im.durable.clone()
    }

    /// Flushes seen so far.
    pub fn flushes(&self) -> u64 {
        self.flushes.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn change(&self, offset: u64, len: u64, fua: bool, f: impl FnOnce(&mut [u8])) {
        let (o, n) = (offset as usize, len as usize);
        let mut im = self.images.lock().unwrap();
        f(&mut im.current[o..o + n]);
        if fua {
            let Images { current, durable } = &mut *im;
            durable[o..o + n].copy_from_slice(&current[o..o + n]);
        }
    }
}

impl Backend for PowerLoss {
    fn name(&self) -> &str {
        &self.name
    }

    fn size(&self) -> Option<u64> {
        Some(self.images.lock().unwrap().current.len() as u64)
    }

    fn caps(&self) -> Caps {
        Caps {
            read_only: false,
            can_flush: true,
            can_fua: true,
            can_trim: true,
            can_zero: true,
            can_fast_zero: true,
            can_extents: false,
            sequential: false,
            growable: false,
            rotational: false,
            block: BlockSizes { minimum: 1, preferred: 4096, maximum: 32 << 20 },
            alloc_unit: None,
        }
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let o = offset as usize;
        buf.copy_from_slice(&self.images.lock().unwrap().current[o..o + buf.len()]);
        Ok(buf.len())
    }

    fn read_at_hand(&self, buf: &mut [u8], offset: u64) -> Option<Result<usize>> {
        Some(self.read(buf, offset))
    }

    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.change(offset, buf.len() as u64, fua, |d| d.copy_from_slice(buf));
        Ok(())
    }

    /// In memory, as reads are.
    fn write_at_hand(&self, buf: &[u8], offset: u64) -> Option<Result<()>> {
        Some(self.write(buf, offset, false))
    }

    fn write_merged(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.write(buf, offset, fua)
    }

    fn will_write(&self, _offset: u64, _len: u64) {}

    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.change(offset, len, flags.fua, |d| d.fill(0));
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.change(offset, len, fua, |d| d.fill(0));
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        self.flushes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut im = self.images.lock().unwrap();
        let Images { current, durable } = &mut *im;
        durable.copy_from_slice(current);
        Ok(())
    }

    fn cache(&self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }

    fn extents(&self, _offset: u64, len: u64) -> Result<Vec<Extent>> {
        Ok(vec![Extent::data(len)])
    }

    fn cache_info(&self) -> Option<CacheInfo> {
        None
    }

    fn finish(&self) -> Result<()> {
        Ok(())
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
