//! The TLS stream split into halves and used from several threads at once, as transmission and
//! the NBD client use it: both peers writing large amounts at the same time must not deadlock
//! (a design that held one lock across the socket write would: both writers block on full
//! sockets while their readers wait for the lock), every byte must arrive in order, and a
//! dropped writing half ends the peer's reading cleanly (close_notify).

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::time::Duration;

use common::certs::Certs;
use lightfoot::stream::{write_all_vectored, Stream};
use lightfoot::tls::{ClientTls, ServerTls, TlsStream, Verify};

/// Bytes each side sends: far more than two socket buffers hold.
const SENT: usize = 48 << 20;

fn byte(i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 13)) as u8
}

/// Writes [`SENT`] bytes in pieces of varied sizes, each as a header and a body (two slices,
/// as replies go out), from `writers` threads taking turns under one mutex.
fn send(w: Box<dyn Write + Send>, writers: usize) {
    let w = std::sync::Mutex::new(w);
    let next = std::sync::Mutex::new(0usize);
    std::thread::scope(|s| {
        for _ in 0..writers {
            s.spawn(|| {
                let mut buf = Vec::new();
                loop {
                    // Taking the offset and writing happen under the writer lock, so pieces
                    // leave in offset order.
                    let mut w = w.lock().unwrap();
                    let mut at = next.lock().unwrap();
                    if *at == SENT {
                        return;
                    }
                    let n = (1 + (*at * 7919) % (300 << 10)).min(SENT - *at);
                    buf.clear();
                    buf.extend((*at..*at + n).map(byte));
                    let head = n.min(16);
                    write_all_vectored(&mut **w, &[&buf[..head], &buf[head..]]).unwrap();
                    *at += n;
                }
            });
        }
    });
}

/// Reads everything the peer sends, checks it, and expects a clean end after it.
fn receive(mut r: Box<dyn Read + Send>) {
    let mut buf = vec![0u8; 100_000];
    let mut at = 0;
    while at < SENT {
        let n = r.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended after {at} bytes");
        for (k, b) in buf[..n].iter().enumerate() {
            assert_eq!(*b, byte(at + k), "byte {}", at + k);
        }
        at += n;
    }
    assert_eq!(r.read(&mut buf).unwrap(), 0, "more bytes than were sent, or no clean end");
}

fn exchange(side: TlsStream, writers: usize) {
    let (r, w) = Box::new(side).split().unwrap();
    std::thread::scope(|s| {
        s.spawn(move || send(w, writers));
        s.spawn(move || receive(r));
    });
}

#[test]
fn both_peers_writing_at_once_neither_deadlocks_nor_loses_bytes() {
    let certs = Certs::new();
    let server = ServerTls::load(&certs.server, false, true).unwrap();
    let client = ClientTls::load(&certs.client, Verify::Name("localhost".into())).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        let accepting = std::thread::spawn(move || server.accept(Box::new(a)));
        let c = client.connect(Box::new(b)).unwrap();
        let s = accepting.join().unwrap().unwrap();
        std::thread::scope(|scope| {
            scope.spawn(|| exchange(s, 4));
            scope.spawn(|| exchange(c, 1));
        });
        done.send(()).unwrap();
    });
    // A panic in the exchange drops `done` (disconnected); a deadlock times out.
    match finished.recv_timeout(Duration::from_secs(60)) {
        Ok(()) => {}
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("deadlock: the exchange did not finish in 60 s"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the exchange failed (see the panic above)"),
    }
}

#[test]
fn a_client_the_server_does_not_trust_fails_the_handshake_on_both_sides() {
    let certs = Certs::new();
    let server = ServerTls::load(&certs.server, true, true).unwrap();
    let client = ClientTls::load(&certs.stranger, Verify::Nothing).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let accepting = std::thread::spawn(move || server.accept(Box::new(a)).map(drop));
    // TLS 1.3: the client may finish its side before the server rejects its certificate; the
    // rejection then arrives as an alert on the first read.
    let client_side = client.connect(Box::new(b)).and_then(|mut c| c.read(&mut [0u8; 1]));
    let server_side = accepting.join().unwrap();
    let e = server_side.expect_err("the server accepted an untrusted client certificate");
    assert!(
        e.to_string().contains("UnknownIssuer") || e.to_string().contains("invalid peer certificate"),
        "{e}"
    );
    assert!(client_side.is_err(), "the client did not see the rejection: {client_side:?}");
}
