//! `null:`: reads zeroes, discards writes. As a copy destination it measures the source side
//! alone; `null:SIZE` gives it a size (default: as large as anything it is asked to take).

use super::{Backend, Caps, Extent, ZeroFlags};
use crate::error::Result;

pub struct NullBackend {
    name: String,
    size: u64,
}

/// The size of `null:` without one: large enough for any source, small enough that offsets
/// plus lengths never overflow.
pub const UNBOUNDED: u64 = i64::MAX as u64;

impl NullBackend {
    pub fn new(size: Option<u64>) -> NullBackend {
        let name = match size {
            Some(s) => format!("null:{s}"),
            None => "null:".to_string(),
        };
        NullBackend { name, size: size.unwrap_or(UNBOUNDED) }
    }
}

impl Backend for NullBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn size(&self) -> Option<u64> {
        Some(self.size)
    }

    fn caps(&self) -> Caps {
        Caps::in_memory()
    }

    fn read(&self, buf: &mut [u8], _offset: u64) -> Result<usize> {
        buf.fill(0);
        Ok(buf.len())
    }

    fn read_at_hand(&self, buf: &mut [u8], offset: u64) -> Option<Result<usize>> {
        Some(self.read(buf, offset))
    }

    fn write(&self, _buf: &[u8], _offset: u64, _fua: bool) -> Result<()> {
        Ok(())
    }

    /// Nothing to wait for: written (discarded) at once.
    fn write_at_hand(&self, _buf: &[u8], _offset: u64) -> Option<Result<()>> {
        Some(Ok(()))
    }

    fn write_merged(&self, _buf: &[u8], _offset: u64, _fua: bool) -> Result<()> {
        Ok(())
    }

    fn will_write(&self, _offset: u64, _len: u64) {}

    fn zero(&self, _offset: u64, _len: u64, _flags: ZeroFlags) -> Result<()> {
        Ok(())
    }

    fn trim(&self, _offset: u64, _len: u64, _fua: bool) -> Result<()> {
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }

    fn cache(&self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }

    fn extents(&self, _offset: u64, len: u64) -> Result<Vec<Extent>> {
        Ok(vec![Extent::hole(len)])
    }

    crate::backend::nothing_to_report!();

    fn finish(&self) -> Result<()> {
        Ok(())
    }
}
