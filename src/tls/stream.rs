//! [`TlsStream`]: a rustls session over a plain socket, as one more [`Stream`].
//!
//! Transmission splits a stream into a reading half and a writing half used by different
//! threads at once, but a TLS session is one state machine. The halves share it behind a
//! mutex that is held only for the CPU work (sealing or opening records), never across a
//! socket call:
//!
//! - The reader receives ciphertext from its own socket handle into a buffer of its own with
//!   no lock held, then takes the session lock to open records and copy out plaintext.
//! - A writer takes the socket's write lock, then the session lock, seals its bytes into
//!   records, releases the session lock and sends the records. The write lock keeps records
//!   in the order they were sealed (TLS sequence numbers); the session lock is free while the
//!   records are on their way, so a writer blocked on a full socket never stops the reader.
//!
//! (Rejected: a dedicated I/O thread per connection, which would copy every payload once more
//! and add two hand-offs per request; and one lock around session and socket together, which
//! deadlocks as soon as both peers block writing: neither reads, so neither drains.)
//!
//! Records the reader makes the session queue (a TLS 1.3 `KeyUpdate` answer, an alert) are sent
//! by the reader only if the write lock is free at once, and otherwise go out with the next
//! write: the reader must never wait for a writer that waits for the peer.

use std::io::{self, IoSlice, Read, Write};
use std::sync::{Arc, Mutex};

use rustls::Connection;

use crate::stream::{Closer, Stream};

/// Ciphertext the reader takes from the socket per system call: several full records.
const READ_BUFFER: usize = 64 << 10;

/// Most plaintext one write seals (a 256 KiB READ reply plus its header fits): the session
/// lock is held for the sealing, so the reader waits at most that long.
const MAX_WRITE: usize = (256 << 10) + 64;

/// What rustls queues before `writer()` accepts less: enough for one [`MAX_WRITE`] sealed.
const SESSION_BUFFER: usize = 512 << 10;

/// A rustls error, and for the common ones what to do, from this side's view (`client`).
fn explain(e: &rustls::Error, client: bool) -> String {
    use rustls::{AlertDescription as Alert, CertificateError, Error as E};
    let (peer, ours) = if client { ("server", "client-cert.pem") } else { ("client", "server-cert.pem") };
    let hint = match e {
        E::InvalidCertificate(CertificateError::UnknownIssuer) => {
            format!("the {peer}'s certificate is not signed by the CA in ca-cert.pem")
        }
        E::AlertReceived(Alert::CertificateRequired) => {
            "the server wants a client certificate: put client-cert.pem and client-key.pem \
             beside ca-cert.pem"
                .into()
        }
        E::AlertReceived(Alert::UnknownCA | Alert::BadCertificate) => {
            format!("the {peer} does not trust {ours}")
        }
        E::NoCertificatesPresented => {
            "the client sent no certificate, which --tls-verify-peer requires".into()
        }
        _ => return e.to_string(),
    };
    format!("{e} ({hint})")
}

struct Tls {
    /// Encryption and decryption state. Held for CPU work only.
    session: Mutex<Connection>,
    /// The socket's writing half. Taken before `session`, and held until the records sealed
    /// under it are sent.
    out: Mutex<Box<dyn Write + Send>>,
}

impl Tls {
    /// Seals what the session has queued and sends it; `out` is the held write lock.
    fn send_queued(&self, out: &mut dyn Write, scratch: &mut Vec<u8>) -> io::Result<()> {
        scratch.clear();
        {
            let mut s = self.session.lock().unwrap();
            while s.wants_write() {
                s.write_tls(scratch)?;
            }
        }
        if !scratch.is_empty() {
            out.write_all(scratch)?;
            out.flush()?;
        }
        Ok(())
    }
}

/// A TLS session over a socket, after its handshake. Negotiation (the NBD options after
/// STARTTLS) uses it whole; transmission splits it.
pub struct TlsStream {
    reader: TlsReader,
    writer: TlsWriter,
    closer: Arc<dyn Fn() + Send + Sync>,
}

impl TlsStream {
    /// Runs the TLS handshake of `session` over `plain` (blocking), then wraps the two.
    /// A failed handshake (bad certificate, not TLS, peer gone) is an `Err`; the alert rustls
    /// queued for the peer has been sent where the socket allowed it.
    pub fn handshake(mut plain: Box<dyn Stream>, mut session: Connection) -> io::Result<TlsStream> {
        session.set_buffer_limit(Some(SESSION_BUFFER));
        while session.is_handshaking() {
            if let Err(e) = session.complete_io(&mut plain) {
                // complete_io sends the alert before failing when it can; make sure.
                while session.wants_write() && session.write_tls(&mut plain).is_ok() {}
                let client = matches!(session, Connection::Client(_));
                return Err(match e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
                    Some(tls) => io::Error::new(e.kind(), explain(tls, client)),
                    None => e,
                });
            }
        }
        // Session tickets and the like, queued at the end of the handshake.
        while session.wants_write() {
            session.write_tls(&mut plain)?;
        }
        plain.flush()?;
        let plain_closer = plain.closer()?;
        let (r, w) = plain.split()?;
        let shared = Arc::new(Tls { session: Mutex::new(session), out: Mutex::new(w) });
        // Closing from outside (server shutdown) only shuts the socket down: sending a
        // close_notify there could block on a peer that stopped reading.
        let closer: Arc<dyn Fn() + Send + Sync> = Arc::from(plain_closer);
        Ok(TlsStream {
            reader: TlsReader {
                shared: shared.clone(),
                sock: r,
                buf: vec![0; READ_BUFFER].into_boxed_slice(),
                start: 0,
                end: 0,
                eof: false,
            },
            writer: TlsWriter { shared, scratch: Vec::new() },
            closer,
        })
    }
}

impl Read for TlsStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.reader.read(buf)
    }
}

impl Write for TlsStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.writer.write(buf)
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.writer.write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.writer.flush()
    }
}

impl Stream for TlsStream {
    fn split(self: Box<Self>) -> io::Result<(Box<dyn Read + Send>, Box<dyn Write + Send>)> {
        let TlsStream { reader, writer, .. } = *self;
        Ok((Box::new(reader), Box::new(writer)))
    }

    fn closer(&self) -> io::Result<Closer> {
        let c = self.closer.clone();
        Ok(Box::new(move || c()))
    }
}

struct TlsReader {
    shared: Arc<Tls>,
    sock: Box<dyn Read + Send>,
    /// Ciphertext received and not yet handed to the session: `buf[start..end]`.
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// The socket reached its end (the session has been told).
    eof: bool,
}

impl TlsReader {
    /// Sends what the reader made the session queue, if no writer holds the socket; a writer
    /// that does will send it with its own records.
    fn send_queued_if_free(&self) -> io::Result<()> {
        match self.shared.out.try_lock() {
            Ok(mut out) => self.shared.send_queued(&mut **out, &mut Vec::new()),
            Err(_) => Ok(()),
        }
    }

    /// Hands buffered ciphertext (or the end of the stream) to the session and opens what it
    /// completes.
    fn feed(&mut self) -> io::Result<()> {
        let processed = {
            let mut s = self.shared.session.lock().unwrap();
            let client = matches!(*s, Connection::Client(_));
            if self.start < self.end {
                let n = s.read_tls(&mut &self.buf[self.start..self.end])?;
                self.start += n;
            } else {
                s.read_tls(&mut io::empty())?;
            }
            let r = s.process_new_packets().map_err(|e| explain(&e, client));
            (r, s.wants_write())
        };
        let (result, wants_write) = processed;
        if wants_write {
            // An alert on failure, a KeyUpdate answer: best effort, see the module comment.
            let sent = self.send_queued_if_free();
            if result.is_ok() {
                sent?;
            }
        }
        result.map(|_| ()).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("tls: {e}")))
    }
}

impl Read for TlsReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        loop {
            {
                let mut s = self.shared.session.lock().unwrap();
                match s.reader().read(out) {
                    // 0: the peer sent close_notify, a clean end.
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    // Includes UnexpectedEof: the socket ended without close_notify.
                    Err(e) => return Err(e),
                }
            }
            if self.start < self.end {
                let before = self.start;
                self.feed()?;
                if self.start == before {
                    // The session took nothing and has no plaintext: it would never progress.
                    return Err(io::Error::other("tls: the session accepts no more data"));
                }
                continue;
            }
            if self.eof {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            // No lock held while waiting for the peer.
            match self.sock.read(&mut self.buf) {
                Ok(0) => {
                    self.eof = true;
                    (self.start, self.end) = (0, 0);
                    self.feed()?;
                }
                Ok(n) => {
                    (self.start, self.end) = (0, n);
                    self.feed()?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

struct TlsWriter {
    shared: Arc<Tls>,
    /// Sealed records on their way out, reused.
    scratch: Vec<u8>,
}

impl Write for TlsWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    /// Seals up to [`MAX_WRITE`] bytes of `bufs` into records and sends them (one `write` of
    /// the socket for a whole reply).
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let mut out = self.shared.out.lock().unwrap();
        let mut taken = 0;
        {
            let mut s = self.shared.session.lock().unwrap();
            for b in bufs {
                let part = &b[..b.len().min(MAX_WRITE - taken)];
                let n = s.writer().write(part)?;
                taken += n;
                if n < part.len() || taken == MAX_WRITE {
                    break;
                }
            }
        }
        self.shared.send_queued(&mut **out, &mut self.scratch)?;
        if self.scratch.capacity() > 2 * SESSION_BUFFER {
            self.scratch = Vec::new();
        }
        if taken == 0 && bufs.iter().any(|b| !b.is_empty()) {
            return Err(io::ErrorKind::WriteZero.into());
        }
        Ok(taken)
    }

    /// Every write is sent before it returns.
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for TlsWriter {
    /// Ends the session cleanly (close_notify), so the peer can tell an end from a cut.
    fn drop(&mut self) {
        if let Ok(mut out) = self.shared.out.lock() {
            self.shared.session.lock().unwrap().send_close_notify();
            let _ = self.shared.send_queued(&mut **out, &mut self.scratch);
        }
    }
}
