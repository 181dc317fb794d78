//! An in-memory duplex byte stream implementing [`Stream`]: two ends, each reading what the
//! other wrote, usable from different threads (a server connection on one, its client on
//! another) without sockets, so the fuzz targets run a whole connection in one process and
//! many times a second.
//!
//! Each direction is a pipe: a byte queue, a condition variable and a closed flag. Reads block
//! until bytes arrive or the writing end is gone (then end of file); writes never block (the
//! queue is unbounded: the client in a test reads every reply) and fail with `BrokenPipe`
//! once the reading end is gone. A read can be given a timeout, so a test whose peer never
//! answers fails instead of hanging.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::stream::{Closer, Stream};

#[derive(Default)]
struct Queue {
    bytes: VecDeque<u8>,
    /// The writing end is gone: reads drain what is left, then see end of file.
    writer_gone: bool,
    /// The reading end is gone: writes fail.
    reader_gone: bool,
}

#[derive(Default)]
struct Pipe {
    q: Mutex<Queue>,
    cv: Condvar,
}

impl Pipe {
    fn read(&self, buf: &mut [u8], timeout: Option<Duration>) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let mut q = self.q.lock().unwrap();
        while q.bytes.is_empty() && !q.writer_gone && !q.reader_gone {
            q = match timeout {
                None => self.cv.wait(q).unwrap(),
                Some(t) => {
                    let (q, r) = self.cv.wait_timeout(q, t).unwrap();
                    if r.timed_out() && q.bytes.is_empty() && !q.writer_gone {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, "no data from the peer"));
                    }
                    q
                }
            };
        }
        let n = buf.len().min(q.bytes.len());
        for (d, s) in buf[..n].iter_mut().zip(q.bytes.drain(..n)) {
            *d = s;
        }
        Ok(n)
    }

    fn write(&self, buf: &[u8]) -> io::Result<usize> {
        let mut q = self.q.lock().unwrap();
        if q.reader_gone || q.writer_gone {
            return Err(io::Error::from(io::ErrorKind::BrokenPipe));
        }
        q.bytes.extend(buf);
        self.cv.notify_all();
        Ok(buf.len())
    }

    fn close_writer(&self) {
        self.q.lock().unwrap().writer_gone = true;
        self.cv.notify_all();
    }

    fn close_reader(&self) {
        let mut q = self.q.lock().unwrap();
        q.reader_gone = true;
        q.bytes.clear();
        self.cv.notify_all();
    }
}

/// One end of an in-memory connection (see [`pair`]).
pub struct Duplex {
    reader: Half,
    writer: Half,
}

/// The reading or writing half of a [`Duplex`]; dropping it closes that direction.
pub struct Half {
    pipe: Arc<Pipe>,
    reading: bool,
    timeout: Option<Duration>,
}

impl Drop for Half {
    fn drop(&mut self) {
        if self.reading {
            self.pipe.close_reader()
        } else {
            self.pipe.close_writer()
        }
    }
}

impl Read for Half {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        debug_assert!(self.reading);
        self.pipe.read(buf, self.timeout)
    }
}

impl Write for Half {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        debug_assert!(!self.reading);
        self.pipe.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Two connected ends: what one writes, the other reads.
pub fn pair() -> (Duplex, Duplex) {
    let (a, b) = (Arc::new(Pipe::default()), Arc::new(Pipe::default()));
    let end = |r: &Arc<Pipe>, w: &Arc<Pipe>| Duplex {
        reader: Half { pipe: r.clone(), reading: true, timeout: None },
        writer: Half { pipe: w.clone(), reading: false, timeout: None },
    };
    (end(&a, &b), end(&b, &a))
}

impl Duplex {
    /// Reads fail with `TimedOut` after waiting this long for the peer.
    pub fn set_read_timeout(&mut self, t: Option<Duration>) {
        self.reader.timeout = t;
    }

    /// Closes the writing direction only (the peer reads end of file), like
    /// `shutdown(SHUT_WR)`.
    pub fn shutdown_write(&self) {
        self.writer.pipe.close_writer();
    }
}

impl Read for Duplex {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.reader.read(buf)
    }
}

impl Write for Duplex {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.writer.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Stream for Duplex {
    fn split(self: Box<Self>) -> io::Result<(Box<dyn Read + Send>, Box<dyn Write + Send>)> {
        let Duplex { reader, writer } = *self;
        Ok((Box::new(reader), Box::new(writer)))
    }

    fn closer(&self) -> io::Result<Closer> {
        let (r, w) = (self.reader.pipe.clone(), self.writer.pipe.clone());
        Ok(Box::new(move || {
            r.close_reader();
            w.close_writer();
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_cross_and_ends_are_seen() {
        let (mut a, b) = pair();
        a.write_all(b"hello").unwrap();
        let (mut br, mut bw) = Box::new(b).split().unwrap();
        let mut got = [0u8; 5];
        br.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello");
        let t = std::thread::spawn(move || {
            bw.write_all(b"back").unwrap();
            // Dropping the writing half: the peer reads end of file after the bytes.
        });
        let mut got = Vec::new();
        a.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"back");
        t.join().unwrap();
        drop(br);
        assert_eq!(a.write(b"x").unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn read_timeout_and_closer() {
        let (mut a, b) = pair();
        a.set_read_timeout(Some(Duration::from_millis(10)));
        assert_eq!(a.read(&mut [0u8; 1]).unwrap_err().kind(), io::ErrorKind::TimedOut);
        let close = b.closer().unwrap();
        close();
        assert_eq!(a.read(&mut [0u8; 1]).unwrap(), 0);
        assert!(a.write(b"x").is_err());
    }
}
