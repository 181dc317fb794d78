//! The byte stream an NBD connection runs over, for the server and the client alike.
//! Negotiation uses it whole; transmission splits it into a reading half and a writing half.
//! TCP and Unix sockets implement it here; TLS (STARTTLS) is one more implementation, [`crate::tls::TlsStream`], over either.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

pub trait Stream: Read + Write + Send + 'static {
    /// Splits into independently usable reading and writing halves.
    fn split(self: Box<Self>) -> io::Result<(Box<dyn Read + Send>, Box<dyn Write + Send>)>;

    /// Something that ends the connection from another thread (server shutdown).
    fn closer(&self) -> io::Result<Closer>;

    /// A handle on the socket, for reading only what has already arrived (`recv` with
    /// `MSG_DONTWAIT`) between reads of the reading half; `None` where bytes can wait elsewhere
    /// than in the socket (a TLS session's buffer).
    fn arrived(&self) -> Option<OwnedFd> {
        None
    }
}

/// Shuts a connection down from outside its threads.
pub type Closer = Box<dyn Fn() + Send + Sync>;

/// Plain sockets: the halves are two handles on one socket; shutdown ends both.
macro_rules! socket_stream {
    ($($t:ty),*) => {$(
        impl Stream for $t {
            fn split(self: Box<Self>) -> io::Result<(Box<dyn Read + Send>, Box<dyn Write + Send>)> {
                let w = self.try_clone()?;
                Ok((self, Box::new(w)))
            }

            fn closer(&self) -> io::Result<Closer> {
                let s = self.try_clone()?;
                Ok(Box::new(move || drop(s.shutdown(std::net::Shutdown::Both))))
            }

            fn arrived(&self) -> Option<OwnedFd> {
                self.try_clone().ok().map(OwnedFd::from)
            }
        }
    )*};
}

socket_stream!(TcpStream, UnixStream);

/// Writes every byte of `bufs` with as few `writev` calls as the kernel allows, so a reply
/// (header and data) normally leaves in one system call.
pub fn write_all_vectored(w: &mut dyn Write, bufs: &[&[u8]]) -> io::Result<()> {
    let mut slices: Vec<IoSlice> = bufs.iter().filter(|b| !b.is_empty()).map(|b| IoSlice::new(b)).collect();
    let mut slices = &mut slices[..];
    while !slices.is_empty() {
        match w.write_vectored(slices) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    w.flush()
}
