//! Pipes (`-`: standard input as a source, standard output as a destination): sequential
//! only, size unknown. Requests must arrive in order at the current position; holes going to
//! a pipe are written out as zeroes.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::sync::Mutex;

use super::{Backend, BlockSizes, Caps, Extent, ZeroFlags};
use crate::error::{Error, ErrorKind, Op, Result};

pub struct PipeBackend {
    name: String,
    writable: bool,
    /// The pipe and the position of the next byte.
    state: Mutex<(File, u64)>,
}

impl PipeBackend {
    /// Standard input, for reading.
    pub fn stdin() -> Result<PipeBackend> {
        let fd =
            std::io::stdin().as_fd().try_clone_to_owned().map_err(|e| Error::io(Op::Open, e).path("-"))?;
        Ok(PipeBackend { name: "-".into(), writable: false, state: Mutex::new((File::from(fd), 0)) })
    }

    /// Standard output, for writing.
    pub fn stdout() -> Result<PipeBackend> {
        let fd =
            std::io::stdout().as_fd().try_clone_to_owned().map_err(|e| Error::io(Op::Open, e).path("-"))?;
        Ok(PipeBackend { name: "-".into(), writable: true, state: Mutex::new((File::from(fd), 0)) })
    }

    /// Any file opened for sequential use (tests use a file or one end of a pipe).
    pub fn from_file(name: &str, file: File, writable: bool) -> PipeBackend {
        PipeBackend { name: name.into(), writable, state: Mutex::new((file, 0)) }
    }

    fn out_of_order(&self, op: Op, offset: u64, len: u64, pos: u64) -> Error {
        Error::new(ErrorKind::InvalidInput, op)
            .path(&self.name)
            .at(offset, len)
            .detail(format!("a pipe is sequential: the next byte is at offset {pos}"))
    }

    fn write_zeroes_at(&self, offset: u64, len: u64) -> Result<()> {
        let zeroes = vec![0u8; (1u64 << 20).min(len) as usize];
        let mut at = offset;
        while at < offset + len {
            let n = (zeroes.len() as u64).min(offset + len - at) as usize;
            self.write(&zeroes[..n], at, false)?;
            at += n as u64;
        }
        Ok(())
    }
}

impl Backend for PipeBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn size(&self) -> Option<u64> {
        None
    }

    fn caps(&self) -> Caps {
        Caps {
            read_only: !self.writable,
            can_flush: self.writable,
            can_fua: false,
            can_trim: false,
            can_zero: self.writable,
            can_fast_zero: false,
            can_extents: false,
            sequential: true,
            growable: true,
            rotational: false,
            block: BlockSizes { minimum: 1, preferred: 1 << 20, maximum: 32 << 20 },
            alloc_unit: None,
            at_hand: false,
        }
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let mut state = self.state.lock().unwrap();
        let (file, pos) = &mut *state;
        if offset != *pos {
            return Err(self.out_of_order(Op::Read, offset, buf.len() as u64, *pos));
        }
        let mut done = 0;
        while done < buf.len() {
            match file.read(&mut buf[done..]) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(Error::io(Op::Read, e)
                        .path(&self.name)
                        .at(offset + done as u64, (buf.len() - done) as u64))
                }
            }
        }
        *pos += done as u64;
        Ok(done)
    }

    fn read_at_hand(&self, _buf: &mut [u8], _offset: u64) -> Option<Result<usize>> {
        None
    }

    fn write(&self, buf: &[u8], offset: u64, _fua: bool) -> Result<()> {
        let mut state = self.state.lock().unwrap();
        let (file, pos) = &mut *state;
        if offset != *pos {
            return Err(self.out_of_order(Op::Write, offset, buf.len() as u64, *pos));
        }
        file.write_all(buf)
            .map_err(|e| Error::io(Op::Write, e).path(&self.name).at(offset, buf.len() as u64))?;
        *pos += buf.len() as u64;
        Ok(())
    }

    // A pipe's reader may be slow, and no page cache stands between lightfoot and the pipe.
    super::writes_leave_at_once!();

    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        if flags.fast {
            return Err(Error::new(ErrorKind::NotSupported, Op::Zero)
                .path(&self.name)
                .detail("a pipe cannot zero quickly"));
        }
        self.write_zeroes_at(offset, len)
    }

    fn trim(&self, offset: u64, len: u64, _fua: bool) -> Result<()> {
        // A pipe cannot skip bytes: the trimmed range is sent as zeroes.
        self.write_zeroes_at(offset, len)
    }

    fn flush(&self) -> Result<()> {
        let mut state = self.state.lock().unwrap();
        state.0.flush().map_err(|e| Error::io(Op::Flush, e).path(&self.name))
    }

    fn cache(&self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }

    fn extents(&self, _offset: u64, len: u64) -> Result<Vec<Extent>> {
        Ok(vec![Extent::data(len)])
    }

    crate::backend::nothing_to_report!();

    fn finish(&self) -> Result<()> {
        Ok(())
    }
}
