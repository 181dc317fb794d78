//! The reader's buffer over a connection's incoming half: what it reads of the socket, in
//! which requests are parsed in place and a small WRITE's payload is written from where it
//! lies, with no allocation or copy of its own.
//!
//! It differs from `std::io::BufReader` in two ways the reader needs. It reads more after
//! what it already holds (a request cut in two by a read is completed in the buffer, not
//! copied out piece by piece). And a read that would wait for the client can first look at
//! what has already arrived without waiting, and call back before it waits: the reader
//! writes its gathered replies then, and only then (see `transmission::Cork`).

use std::io::{self, Read};

/// The reading half of a connection, which can also read only what has already arrived.
pub struct Incoming {
    half: Box<dyn Read + Send>,
    /// A handle on the socket `half` reads ([`crate::stream::Stream::arrived`]); `None` for a
    /// TLS session, whose own buffer may hold bytes the socket no longer does.
    fd: Option<std::os::fd::OwnedFd>,
}

impl Incoming {
    pub fn new(half: Box<dyn Read + Send>, fd: Option<std::os::fd::OwnedFd>) -> Self {
        Incoming { half, fd }
    }

    /// Reads what has already arrived, without waiting: `None` if nothing has, or if there is
    /// no socket handle to look with; `Some(0)` at the end of the stream.
    fn read_arrived(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        match &self.fd {
            Some(fd) => crate::io::sys::recv_arrived(std::os::fd::AsFd::as_fd(fd), buf),
            None => Ok(None),
        }
    }

    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        crate::io::sys::retry(|| self.half.read(buf))
    }
}

pub struct Inbox {
    src: Incoming,
    buf: Box<[u8]>,
    /// What is held: `buf[start..end]`.
    start: usize,
    end: usize,
}

impl Inbox {
    pub fn new(src: Incoming, capacity: usize) -> Self {
        Inbox { src, buf: vec![0u8; capacity].into_boxed_slice(), start: 0, end: 0 }
    }

    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// What is held, not yet consumed.
    pub fn buffer(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    pub fn consume(&mut self, n: usize) {
        assert!(n <= self.end - self.start, "consumed more than is held");
        self.start += n;
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        }
    }

    /// Makes the buffer hold at least `n` bytes (at most its capacity), reading from the
    /// connection; false if the stream ends first. With `look` it takes what has already
    /// arrived first, and calls `before_wait` only when it must wait for more; without, it
    /// calls `before_wait` before every read.
    pub fn fill_to(&mut self, n: usize, look: bool, mut before_wait: impl FnMut()) -> io::Result<bool> {
        assert!(n <= self.buf.len(), "{n} bytes do not fit in the reader's buffer");
        while self.end - self.start < n {
            // What is held (less than `n`) moves to the front when less than half the buffer
            // is left after it, so that each read can take many requests at once, or when `n`
            // would not fit.
            let room = self.buf.len() - self.end;
            if self.start > 0 && (room < self.buf.len() / 2 || self.buf.len() - self.start < n) {
                self.buf.copy_within(self.start..self.end, 0);
                (self.start, self.end) = (0, self.end - self.start);
            }
            let end = self.end;
            if look {
                match self.src.read_arrived(&mut self.buf[end..])? {
                    Some(0) => return Ok(false),
                    Some(k) => {
                        self.end += k;
                        continue;
                    }
                    None => {}
                }
            }
            before_wait();
            match self.src.read(&mut self.buf[end..])? {
                0 => return Ok(false),
                k => self.end += k,
            }
        }
        Ok(true)
    }

    /// Reads `dst.len()` bytes: what is held first, the rest straight from the connection
    /// (a payload too large to be held). `before_wait` is called before the first read of the
    /// connection.
    pub fn read_exact(&mut self, dst: &mut [u8], before_wait: impl FnOnce()) -> io::Result<()> {
        let held = dst.len().min(self.end - self.start);
        dst[..held].copy_from_slice(&self.buf[self.start..self.start + held]);
        self.consume(held);
        if held < dst.len() {
            before_wait();
            let mut done = held;
            while done < dst.len() {
                match self.src.read(&mut dst[done..])? {
                    0 => return Err(cut_short()),
                    k => done += k,
                }
            }
        }
        Ok(())
    }

    /// Reads and throws away `n` bytes (a refused WRITE's payload).
    pub fn skip(&mut self, mut n: u64, mut before_wait: impl FnMut()) -> io::Result<()> {
        loop {
            let held = n.min((self.end - self.start) as u64);
            self.consume(held as usize);
            n -= held;
            if n == 0 {
                return Ok(());
            }
            if !self.fill_to(1, false, &mut before_wait)? {
                return Err(cut_short());
            }
        }
    }
}

/// The stream ended inside a WRITE's payload.
pub(super) fn cut_short() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "payload cut short")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    fn inbox(s: UnixStream, with_fd: bool, capacity: usize) -> Inbox {
        // A read that waits when it should not fails the test rather than hanging it.
        s.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
        let fd = with_fd.then(|| std::os::fd::OwnedFd::from(s.try_clone().unwrap()));
        Inbox::new(Incoming::new(Box::new(s), fd), capacity)
    }

    /// Looking first takes what has arrived without calling back; the call back comes only
    /// before a wait, and the bytes sent from it (a client answering the replies) are read.
    #[test]
    fn looking_first_calls_back_only_before_a_wait() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut r = inbox(a, true, 64);
        b.write_all(b"0123456789").unwrap();
        assert!(r.fill_to(4, true, || panic!("waited with bytes there")).unwrap());
        assert_eq!(r.buffer(), b"0123456789", "all that had arrived is taken");
        r.consume(10);
        let mut calls = 0;
        assert!(r
            .fill_to(3, true, || {
                calls += 1;
                b.write_all(b"abc").unwrap();
            })
            .unwrap());
        assert_eq!((calls, r.buffer()), (1, &b"abc"[..]));
        // A request cut in two: the rest is read after what is held.
        b.write_all(b"de").unwrap();
        assert!(r.fill_to(5, true, || panic!("waited with bytes there")).unwrap());
        assert_eq!(r.buffer(), b"abcde");
        drop(b);
        assert!(!r.fill_to(6, true, || {}).unwrap(), "the client is gone");
        assert_eq!(r.buffer(), b"abcde", "what was held is still held");
    }

    /// Without looking, or without a socket handle to look with (a TLS session, whose buffer
    /// may hold bytes the socket no longer does), nothing is read early: the call back comes
    /// before the read, even with bytes there.
    #[test]
    fn without_looking_it_calls_back_before_reading() {
        for (with_fd, look) in [(true, false), (false, true)] {
            let (a, mut b) = UnixStream::pair().unwrap();
            let mut r = inbox(a, with_fd, 64);
            b.write_all(b"xyz").unwrap();
            let mut calls = 0;
            assert!(r.fill_to(3, look, || calls += 1).unwrap());
            assert_eq!((calls, r.buffer()), (1, &b"xyz"[..]), "socket handle {with_fd}, look {look}");
        }
    }

    /// An error on the socket is returned, not taken for "nothing arrived": a client that
    /// closes with our bytes unread resets the connection.
    #[test]
    fn looking_returns_a_reset() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut ours = a.try_clone().unwrap();
        let mut r = inbox(a, true, 64);
        ours.write_all(b"unread by the client").unwrap();
        drop(b);
        let e = r.fill_to(1, true, || panic!("waited")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}");
    }

    /// Near the end of the buffer, what is held moves to the front to make room, in order;
    /// payloads larger than the buffer and skipped ones read the right bytes.
    #[test]
    fn bytes_come_out_in_order() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut r = inbox(a, true, 64);
        let data: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        b.write_all(&data[..60]).unwrap();
        assert!(r.fill_to(60, true, || panic!("waited")).unwrap());
        r.consume(50);
        b.write_all(&data[60..100]).unwrap();
        assert!(r.fill_to(30, true, || panic!("waited")).unwrap());
        assert_eq!(r.buffer(), &data[50..100]);
        r.consume(5);
        b.write_all(&data[100..]).unwrap();
        let mut big = vec![0u8; 200];
        r.read_exact(&mut big, || {}).unwrap();
        assert_eq!(big, &data[55..255]);
        r.skip(300, || {}).unwrap();
        assert!(r.fill_to(64, true, || panic!("waited")).unwrap());
        assert_eq!(r.buffer(), &data[555..619]);
        // What is held comes first, then the rest from the connection.
        let mut rest = vec![0u8; 1000 - 555];
        r.read_exact(&mut rest, || {}).unwrap();
        assert_eq!(rest, &data[555..]);
        drop(b);
        assert_eq!(r.skip(1, || {}).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }
}
