//! TLS (STARTTLS, X.509): `lightfoot serve --tls` against nbdinfo, nbdcopy and qemu-img, and
//! `lightfoot copy nbds://` against lightfoot serve and qemu-nbd. Certificates (a CA, a server
//! certificate for localhost and 127.0.0.1, a client certificate, and a second CA nobody
//! trusts) are made for each test with `openssl`. The tools come from `make test` (Debian:
//! libnbd-bin, qemu-utils, openssl); a missing one fails the test with a message saying which.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::certs::Certs;
use common::*;
use lightfoot::proto::handshake::*;
use lightfoot::proto::*;

const SIZE: u64 = 16 * MIB;

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{cmd:?} failed: {}", text(&out));
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn fails(out: &Output, words: &[&str]) {
    assert!(!out.status.success(), "expected a failure: {}", text(out));
    let t = text(out);
    for w in words {
        assert!(t.contains(w), "message lacks '{w}': {t}");
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `lightfoot serve --listen 127.0.0.1:0 -v ARGS FILE`, its port read from its log.
struct Tcp {
    child: Child,
    port: u16,
    log: BufReader<ChildStderr>,
}

impl Tcp {
    fn start(file: &Path, args: &[&str]) -> Tcp {
        let mut child = Command::new(bin())
            .args(["serve", "--listen", "127.0.0.1:0", "-v"])
            .args(args)
            .arg(file)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = BufReader::new(child.stderr.take().unwrap());
        // Owned from here: killed and waited for if the test fails.
        let mut server = Tcp { child, port: 0, log };
        let mut line = String::new();
        while server.port == 0 {
            line.clear();
            if server.log.read_line(&mut line).unwrap() == 0 {
                panic!("the server exited before serving");
            }
            if let Some(at) = line.find("127.0.0.1:") {
                server.port = line[at + 10..].split('/').next().unwrap().parse().unwrap();
            }
        }
        server
    }

    /// `nbds://localhost:PORT/?tls-certificates=DIR`.
    fn nbds(&self, dir: &Path) -> String {
        format!("nbds://localhost:{}/?tls-certificates={}", self.port, dir.display())
    }

    fn nbd(&self) -> String {
        format!("nbd://localhost:{}/", self.port)
    }

    /// Stops the server (SIGTERM) and returns its log.
    fn stop(mut self) -> String {
        let _ = Command::new("kill").arg(self.child.id().to_string()).status();
        let mut rest = String::new();
        let _ = self.log.read_to_string(&mut rest);
        assert!(self.child.wait().unwrap().success(), "the server failed: {rest}");
        rest
    }
}

impl Drop for Tcp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn nbdinfo(uri: &str) -> Output {
    tool("nbdinfo", "libnbd-bin").args(["--json", uri]).output().unwrap()
}

/// The export is reached over TLS: nbdinfo says so and sees its size.
fn sees_tls_export(uri: &str) {
    let out = nbdinfo(uri);
    assert!(out.status.success(), "nbdinfo {uri}: {}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["TLS"], true, "{v}");
    assert_eq!(v["structured"], true, "{v}");
    assert_eq!(v["exports"][0]["export-size"], SIZE, "{v}");
}

fn image(dir: &Path) -> PathBuf {
    let img = dir.join("disk.img");
    sample(&img, SIZE, MIB);
    img
}

#[test]
fn nbdinfo_and_nbdcopy_over_required_tls() {
    let certs = Certs::new();
    let dir = scratch();
    let img = image(dir.path());
    let server = Tcp::start(&img, &["--tls=require", "--tls-certificates", s(&certs.server)]);
    sees_tls_export(&server.nbds(&certs.client));
    let out = dir.path().join("out.img");
    run_ok(tool("nbdcopy", "libnbd-bin").args([&server.nbds(&certs.client), s(&out)]));
    assert!(same_contents(&img, &out));
    // And back: nbdcopy writes over TLS.
    let copy = dir.path().join("copy.img");
    random_file(&copy, SIZE);
    run_ok(tool("nbdcopy", "libnbd-bin").args([s(&copy), &server.nbds(&certs.client)]));
    server.stop();
    assert!(same_contents(&img, &copy));
}

#[test]
fn required_tls_refuses_plaintext_clients_and_keeps_serving() {
    let certs = Certs::new();
    let dir = scratch();
    let img = image(dir.path());
    let server = Tcp::start(&img, &["--tls=require", "--tls-certificates", s(&certs.server)]);
    let out = nbdinfo(&server.nbd());
    fails(&out, &[]);
    let out = lightfoot(&["copy", &server.nbd(), s(&dir.path().join("x.img"))]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("the server requires TLS"), "{}", text(&out));
    // Option by option, on the wire.
    let mut c = RawClient::connect(server.port);
    for option in [OPT_LIST, OPT_GO, OPT_INFO, OPT_STRUCTURED_REPLY, OPT_SET_META_CONTEXT] {
        let data = if option == OPT_GO || option == OPT_INFO { go_data("", &[]) } else { vec![] };
        assert_eq!(c.option(option, &data).0, REP_ERR_TLS_REQD, "option {option}");
    }
    // EXPORT_NAME cannot be refused: the server hangs up.
    c.send(OPT_EXPORT_NAME, b"");
    let mut b = [0u8; 1];
    assert!(matches!(c.s.read(&mut b), Ok(0) | Err(_)), "the server answered EXPORT_NAME without TLS");
    // The server still serves TLS clients.
    sees_tls_export(&server.nbds(&certs.client));
    server.stop();
}

#[test]
fn tls_on_serves_plaintext_and_tls_clients() {
    let certs = Certs::new();
    let dir = scratch();
    let img = image(dir.path());
    let server = Tcp::start(&img, &["--tls=on", "--tls-certificates", s(&certs.server)]);
    let out = nbdinfo(&server.nbd());
    assert!(out.status.success(), "{}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["TLS"], false, "{v}");
    sees_tls_export(&server.nbds(&certs.client));
    server.stop();
}

#[test]
fn tls_off_refuses_starttls() {
    let dir = scratch();
    let img = image(dir.path());
    let server = Tcp::start(&img, &[]);
    let certs = Certs::new();
    fails(&nbdinfo(&server.nbds(&certs.client)), &[]);
    let out = lightfoot(&["copy", &server.nbds(&certs.client), s(&dir.path().join("x.img"))]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("the server does not offer TLS"), "{}", text(&out));
    let mut c = RawClient::connect(server.port);
    assert_eq!(c.option(OPT_STARTTLS, &[]).0, REP_ERR_UNSUP);
    server.stop();
}

#[test]
fn untrusted_server_certificate_fails_cleanly_and_the_server_keeps_serving() {
    let certs = Certs::new();
    let dir = scratch();
    let img = image(dir.path());
    let server = Tcp::start(&img, &["--tls=require", "--tls-certificates", s(&certs.server)]);
    // The client trusts another CA.
    fails(&nbdinfo(&server.nbds(&certs.stranger)), &[]);
    let out = lightfoot(&["copy", &server.nbds(&certs.stranger), s(&dir.path().join("x.img"))]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("TLS handshake failed"), "{}", text(&out));
    // The certificate names localhost and 127.0.0.1, not other names.
    let wrong_name = format!("{}&tls-hostname=elsewhere.example", server.nbds(&certs.client));
    let out = lightfoot(&["copy", &wrong_name, "null:"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("not valid for name"), "{}", text(&out));
    let by_address = format!("nbds://127.0.0.1:{}/?tls-certificates={}", server.port, certs.client.display());
    let out = lightfoot(&["copy", &by_address, "null:"]);
    assert!(out.status.success(), "{}", text(&out));
    // Unverified: encrypted, anyone could be the server; works with any CA.
    let unverified = format!("{}&tls-verify-peer=0", server.nbds(&certs.stranger));
    let out = lightfoot(&["copy", &unverified, "null:"]);
    assert!(out.status.success(), "{}", text(&out));
    sees_tls_export(&server.nbds(&certs.client));
    let log = server.stop();
    assert!(log.contains("connection ended"), "failed handshakes are not logged: {log}");
}

#[test]
fn client_certificates_are_verified_with_verify_peer() {
    let certs = Certs::new();
    let dir = scratch();
    let img = image(dir.path());
    let server =
        Tcp::start(&img, &["--tls=require", "--tls-verify-peer", "--tls-certificates", s(&certs.server)]);
    // No client certificate.
    fails(&nbdinfo(&server.nbds(&certs.anonymous)), &[]);
    let out = lightfoot(&["copy", &server.nbds(&certs.anonymous), "null:"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("CertificateRequired"), "{}", text(&out));
    // A client certificate from a CA the server does not trust (the client itself is told to
    // trust nothing, so only the server's check can fail).
    let stranger = format!("{}&tls-verify-peer=0", server.nbds(&certs.stranger));
    let out = lightfoot(&["copy", &stranger, "null:"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    // The right one, from both clients.
    sees_tls_export(&server.nbds(&certs.client));
    let out_img = dir.path().join("out.img");
    let out = lightfoot(&["copy", &server.nbds(&certs.client), s(&out_img)]);
    assert!(out.status.success(), "{}", text(&out));
    let log = server.stop();
    assert!(same_contents(&img, &out_img));
    assert!(log.contains("peer sent no certificates"), "{log}");
}

#[test]
fn qemu_img_reads_over_tls() {
    let certs = Certs::new();
    let dir = scratch();
    let img = image(dir.path());
    let server =
        Tcp::start(&img, &["--tls=require", "--tls-verify-peer", "--tls-certificates", s(&certs.server)]);
    let object = format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", certs.client.display());
    let opts = format!("driver=nbd,host=localhost,port={},tls-creds=tls0", server.port);
    let info =
        run_ok(tool("qemu-img", "qemu-utils").args(["info", "--object", &object, "--image-opts", &opts]));
    assert!(info.contains(&format!("({SIZE} bytes)")), "{info}");
    let out = dir.path().join("out.img");
    run_ok(tool("qemu-img", "qemu-utils").args([
        "convert",
        "-O",
        "raw",
        "--object",
        &object,
        "--image-opts",
        &opts,
        s(&out),
    ]));
    assert!(same_contents(&img, &out));
    // Without a client certificate qemu-img is refused.
    let object = format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", certs.anonymous.display());
    let out = tool("qemu-img", "qemu-utils")
        .args(["info", "--object", &object, "--image-opts", &opts])
        .output()
        .unwrap();
    fails(&out, &[]);
    server.stop();
}

#[test]
fn lightfoot_copy_over_tls_both_ways_on_tcp_and_unix_sockets() {
    let certs = Certs::new();
    let dir = scratch();
    let img = image(dir.path());
    let tls = ["--tls=require", "--tls-certificates", s(&certs.server)];
    let served = Served::start(&img, &tls);
    let client = certs.client.display().to_string();
    let unix = format!("nbds+unix:///?socket={}&tls-certificates={client}", served.sock.display());
    // Over a Unix socket the chain is checked; the name only when tls-hostname is given.
    let out_img = dir.path().join("out.img");
    let out = lightfoot(&["copy", "--connections", "4", &unix, s(&out_img)]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(same_contents(&img, &out_img));
    // libnbd over the same socket, with and without a name to check.
    sees_tls_export(&unix);
    sees_tls_export(&format!("{unix}&tls-hostname=localhost"));
    let out = lightfoot(&["copy", &format!("{unix}&tls-hostname=localhost"), "null:"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = lightfoot(&["copy", &format!("{unix}&tls-hostname=elsewhere.example"), "null:"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stranger = format!(
        "nbds+unix:///?socket={}&tls-certificates={}",
        served.sock.display(),
        certs.stranger.display()
    );
    let out = lightfoot(&["copy", &stranger, "null:"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("TLS handshake failed"), "{}", text(&out));
    // Writing: new contents over TLS, read back over TLS.
    let new = dir.path().join("new.img");
    sample(&new, SIZE, 256 << 10);
    let out = lightfoot(&["copy", s(&new), &unix]);
    assert!(out.status.success(), "{}", text(&out));
    let back = dir.path().join("back.img");
    let out = lightfoot(&["copy", &unix, s(&back)]);
    assert!(out.status.success(), "{}", text(&out));
    let (status, log) = served.stop();
    assert!(status.success(), "{log}");
    assert!(same_contents(&new, &back));
    assert!(same_contents(&new, &img));
}

/// A certificate directory without ca-cert.pem: the client says which file is missing.
#[test]
fn missing_certificate_files_are_named() {
    let dir = scratch();
    let img = image(dir.path());
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let out = lightfoot(&["serve", "--tls=on", "--tls-certificates", s(&empty), s(&img)]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("server-cert.pem"), "{}", text(&out));
    let out = lightfoot(&["serve", "--tls=on", s(&img)]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let out = lightfoot(&["serve", "--tls-certificates", s(&empty), s(&img)]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let uri = format!("nbds://localhost:1/?tls-certificates={}", empty.display());
    let out = lightfoot(&["copy", &uri, "null:"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("ca-cert.pem"), "{}", text(&out));
}

/// A qemu-nbd server with TLS (it verifies client certificates by default).
#[test]
fn lightfoot_copy_from_qemu_nbd_over_tls() {
    let certs = Certs::new();
    let dir = scratch();
    let img = image(dir.path());
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let object = format!("tls-creds-x509,id=tls0,endpoint=server,dir={}", certs.server.display());
    need("qemu-nbd", "qemu-utils");
    let mut qemu = Command::new("qemu-nbd")
        .args(["--object", &object, "--tls-creds", "tls0", "-f", "raw", "-r", "-t", "-b", "127.0.0.1"])
        .args(["-p", &port.to_string(), s(&img)])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let listening = within(10, || {
        if let Ok(Some(st)) = qemu.try_wait() {
            let mut e = String::new();
            let _ = qemu.stderr.take().unwrap().read_to_string(&mut e);
            panic!("qemu-nbd exited ({st}): {e}");
        }
        TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    assert!(listening, "qemu-nbd did not listen on {port}");
    let uri = format!("nbds://127.0.0.1:{port}/?tls-certificates={}", certs.client.display());
    let out_img = dir.path().join("out.img");
    let out = lightfoot(&["copy", &uri, s(&out_img)]);
    let anonymous = format!("nbds://127.0.0.1:{port}/?tls-certificates={}", certs.anonymous.display());
    let refused = lightfoot(&["copy", &anonymous, "null:"]);
    let plain = lightfoot(&["copy", &format!("nbd://127.0.0.1:{port}/"), "null:"]);
    let _ = qemu.kill();
    let _ = qemu.wait();
    assert!(out.status.success(), "{}", text(&out));
    assert!(same_contents(&img, &out_img));
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused));
    assert_eq!(plain.status.code(), Some(1), "{}", text(&plain));
    assert!(text(&plain).contains("requires TLS"), "{}", text(&plain));
}

/// Structured replies agreed before STARTTLS are forgotten after it (the spec: state
/// negotiated before is reset), so meta contexts need them agreed again.
#[test]
fn starttls_resets_what_was_agreed() {
    let certs = Certs::new();
    let dir = scratch();
    let img = image(dir.path());
    let server = Tcp::start(&img, &["--tls=on", "--tls-certificates", s(&certs.server)]);
    let mut c = RawClient::connect(server.port);
    assert_eq!(c.option(OPT_STRUCTURED_REPLY, &[]).0, REP_ACK);
    let meta = meta_data("", &[BASE_ALLOCATION]);
    assert_eq!(c.option(OPT_SET_META_CONTEXT, &meta).0, REP_META_CONTEXT);
    let _ack = c.reply(OPT_SET_META_CONTEXT);
    assert_eq!(c.option(OPT_STARTTLS, &[]).0, REP_ACK);
    let tls =
        lightfoot::tls::ClientTls::load(&certs.client, lightfoot::tls::Verify::Name("localhost".into()))
            .unwrap();
    let stream = tls.connect(Box::new(c.s)).unwrap();
    let mut c = RawClient { s: stream };
    let (ty, msg) = c.option(OPT_SET_META_CONTEXT, &meta);
    assert_eq!(ty, REP_ERR_INVALID, "{}", String::from_utf8_lossy(&msg));
    assert_eq!(c.option(OPT_STARTTLS, &[]).0, REP_ERR_INVALID, "a second STARTTLS");
    assert_eq!(c.option(OPT_STRUCTURED_REPLY, &[]).0, REP_ACK);
    assert_eq!(c.option(OPT_SET_META_CONTEXT, &meta).0, REP_META_CONTEXT);
    drop(c);
    server.stop();
}

/// A client that speaks options by hand, over a plain or a TLS stream.
struct RawClient<S: Read + Write> {
    s: S,
}

impl RawClient<TcpStream> {
    fn connect(port: u16) -> RawClient<TcpStream> {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting).unwrap();
        s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes()).unwrap();
        RawClient { s }
    }
}

impl<S: Read + Write> RawClient<S> {
    fn send(&mut self, option: u32, data: &[u8]) {
        self.s.write_all(&option_request(option, data)).unwrap();
    }

    fn reply(&mut self, option: u32) -> (u32, Vec<u8>) {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).unwrap();
        let r = parse_option_reply(&h).unwrap();
        assert_eq!(r.option, option);
        let mut data = vec![0u8; r.len as usize];
        self.s.read_exact(&mut data).unwrap();
        (r.ty, data)
    }

    /// Sends `option` and returns the type and data of its first reply.
    fn option(&mut self, option: u32, data: &[u8]) -> (u32, Vec<u8>) {
        self.send(option, data);
        self.reply(option)
    }
}

/// A client that sends STARTTLS and then stalls inside the TLS handshake is cut like any
/// client that does not choose an export in time; the server goes on serving.
#[test]
fn a_stalled_tls_handshake_is_cut_after_the_handshake_timeout() {
    let certs = Certs::new();
    let tls = lightfoot::tls::ServerTls::load(&certs.server, false, true).unwrap();
    let server = InProcess::start(
        || Ok(std::sync::Arc::new(lightfoot::backend::MemoryBackend::new(SIZE)) as _),
        |s| {
            s.handshake_timeout = Duration::from_millis(300);
            s.tls = Some(tls);
        },
    );
    let mut c = std::os::unix::net::UnixStream::connect(&server.sock).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut greeting = [0u8; 18];
    c.read_exact(&mut greeting).unwrap();
    c.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes()).unwrap();
    let mut c = RawClient { s: c };
    assert_eq!(c.option(OPT_STARTTLS, &[]).0, REP_ACK);
    // No ClientHello: the server waits in the TLS handshake until the reaper cuts it.
    let started = Instant::now();
    let mut b = [0u8; 1];
    // A signal to this test process ends a read with a timeout set in EINTR (signal(7): never
    // restarted); that is not an answer from the server, so read again.
    let got = loop {
        match c.s.read(&mut b) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            other => break other,
        }
    };
    match got {
        Ok(0) => {}
        other => panic!("expected the server to hang up, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(10), "cut after {:?}", started.elapsed());
    // Others are still served (over TLS).
    let uri =
        format!("nbds+unix:///?socket={}&tls-certificates={}", server.sock.display(), certs.client.display());
    let out = lightfoot(&["copy", &uri, "null:"]);
    assert!(out.status.success(), "{}", text(&out));
    server.stop().unwrap();
}
