//! Errors as a stranger meets them (docs/errors.md): the rows of its tables that the command
//! line can trigger, each with its exit status and the parts of its message that say what
//! failed and where (and, where the table says so, what to do). And no message, at any
//! verbosity, carries a secret when an object store, an NBD URI or a TLS file is what fails.
//!
//! Rows already tested elsewhere are not repeated here (docs/errors.md names the test):
//! tests/copy.rs (`bad_input_gets_a_clear_error`: a missing SRC, SRC = DST, a directory DST,
//! --request-size, --cache; `full_disk…`, `preallocate…`, `interrupt_stops_cleanly`,
//! `stdin_from_the_destination…`: null: without a size, the same export;
//! `block_devices_in_use…`; `a_source_that_shrinks…`), tests/copy_nbd.rs
//! (`bad_endpoints_fail_before_writing`: a missing socket, TLS-PSK, captive servers that are
//! not found or exit, too small and read-only exports, an unknown export), tests/serve.rs
//! (`bad_input_gets_a_clear_error`), tests/serve_tls.rs (missing certificate files, failed
//! handshakes), tests/serve_errors.rs (NBD error replies), tests/s3.rs (wrong credentials,
//! refused requests, a skewed clock, `secrets_never_show` against a real store), tests/run.rs
//! (CMD's statuses, not found, --watch always without root), tests/cache.rs (residency not
//! visible to nobody).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};

use common::*;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// One row of docs/errors.md: `lightfoot ARGS` (with `env` set) exits `status`, and its
/// output holds each of `says`.
struct Row {
    args: Vec<String>,
    env: Vec<(String, String)>,
    status: i32,
    says: Vec<String>,
}

fn row(args: &[&str], status: i32, says: &[&str]) -> Row {
    Row {
        args: args.iter().map(|a| a.to_string()).collect(),
        env: Vec::new(),
        status,
        says: says.iter().map(|a| a.to_string()).collect(),
    }
}

impl Row {
    fn env(mut self, k: &str, v: &str) -> Row {
        self.env.push((k.into(), v.into()));
        self
    }
}

/// Runs `lightfoot ARGS` under `timeout 60` (every row fails at once; one that starts
/// serving instead fails the test with 124, not a hang), as `nobody` with `as_nobody`.
fn run(args: &[String], env: &[(String, String)], as_nobody: bool) -> Output {
    let mut c = Command::new("timeout");
    c.args(["-k", "10", "60"]);
    if as_nobody {
        c.args(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]);
    }
    c.arg(bin()).args(args).envs(env.iter().map(|(k, v)| (k, v))).stdin(Stdio::null());
    c.output().expect("run lightfoot under timeout")
}

/// Runs every row and fails listing all the rows that went wrong, not only the first.
fn check(rows: Vec<Row>, as_nobody: bool) {
    let mut wrong = Vec::new();
    for r in &rows {
        let out = run(&r.args, &r.env, as_nobody);
        let t = text(&out);
        let missing: Vec<_> = r.says.iter().filter(|s| !t.contains(s.as_str())).collect();
        if out.status.code() != Some(r.status) || !missing.is_empty() {
            wrong.push(format!(
                "lightfoot {}: status {:?} (want {}), missing {missing:?} in:\n{t}",
                r.args.join(" "),
                out.status.code(),
                r.status
            ));
        }
    }
    assert!(wrong.is_empty(), "{} of {} rows:\n\n{}", wrong.len(), rows.len(), wrong.join("\n\n"));
}

/// A TCP port nothing listens on (bound, then let go).
fn closed_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A TCP server that answers every connection with `greeting` and closes it: not NBD.
fn impostor(greeting: &'static [u8]) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            let _ = c.write_all(greeting);
        }
    });
    port
}

/// A stand-in for an object store, or a proxy in front of one, that refuses every request
/// with 403 and quotes it back, headers and all: inside S3's XML as SignatureDoesNotMatch
/// does (its StringToSign and CanonicalRequest carry the signed headers), or as a plain
/// body, as a misbehaving proxy might. Keeps the Authorization headers it was sent.
struct Refuser {
    endpoint: String,
    authorizations: Arc<Mutex<Vec<String>>>,
}

impl Refuser {
    fn start(xml: bool) -> Refuser {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://127.0.0.1:{}", l.local_addr().unwrap().port());
        let authorizations = Arc::new(Mutex::new(Vec::new()));
        let seen = authorizations.clone();
        std::thread::spawn(move || {
            for c in l.incoming().flatten() {
                let seen = seen.clone();
                std::thread::spawn(move || Refuser::answer(c, xml, &seen));
            }
        });
        Refuser { endpoint, authorizations }
    }

    /// One request, one answer, then the connection is closed.
    fn answer(mut c: TcpStream, xml: bool, seen: &Mutex<Vec<String>>) {
        let mut r = BufReader::new(c.try_clone().unwrap());
        let (mut head, mut len) = (String::new(), 0);
        loop {
            let mut line = String::new();
            if r.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            if line == "\r\n" {
                break;
            }
            let lower = line.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("content-length:") {
                len = v.trim().parse().unwrap_or(0);
            }
            if lower.starts_with("authorization:") {
                seen.lock().unwrap().push(line.trim().to_string());
            }
            head.push_str(&line);
        }
        let _ = r.take(len).read_to_end(&mut Vec::new());
        let body = if xml {
            format!(
                "<?xml version=\"1.0\"?><Error><Code>SignatureDoesNotMatch</Code><Message>The request \
                 signature we calculated does not match</Message><StringToSign>{head}</StringToSign>\
                 <CanonicalRequest>{head}</CanonicalRequest></Error>"
            )
        } else {
            format!("request was:\n{head}")
        };
        let body = if head.starts_with("HEAD ") { String::new() } else { body };
        let _ = write!(
            c,
            "HTTP/1.1 403 Forbidden\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
    }

    /// The signatures of the requests it refused.
    fn signatures(&self) -> Vec<String> {
        let seen = self.authorizations.lock().unwrap();
        seen.iter().filter_map(|a| a.split("Signature=").nth(1)).map(|s| s.trim().to_string()).collect()
    }
}

/// A certificate that parses as PEM (three bytes of DER: enough to get to the key).
const DUMMY_CERT: &str = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";

/// A private key that parses as PEM (it is checked against the certificate later).
const DUMMY_KEY: &str = "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n";

/// A private key pasted onto one line, as keys kept in environment variables or YAML end up.
const ONE_LINE_KEY: &str =
    "-----BEGIN PRIVATE KEY----- KEYMATERIALf00dfeed0123456789 -----END PRIVATE KEY-----\n";

#[test]
fn copy_errors() {
    let dir = scratch();
    let d = dir.path();
    let (src, dst) = (d.join("src"), d.join("dst"));
    random_file(&src, 256 << 10);
    let (src, dst) = (s(&src), s(&dst));
    let refused = format!("nbd://127.0.0.1:{}/x", closed_port());
    let http = format!("nbd://127.0.0.1:{}/", impostor(b"HTTP/1.1 400 Bad Request\r\n\r\n"));
    let silent = format!("nbd://127.0.0.1:{}/", impostor(b""));
    let store = Refuser::start(true);
    let no_pem = d.join("no-pem");
    std::fs::write(&no_pem, "not a certificate\n").unwrap();
    let usage = "Usage: lightfoot copy";
    let mut rows = vec![
        // Usage errors: clap's, and lightfoot's own in the same form.
        row(&["copy", src], 2, &["2 values required", usage]),
        row(&["copy", src, "a", "b"], 2, &["expected SRC and DST, got 3 endpoints", usage]),
        row(&["copy", "null:1X", dst], 2, &["'null:1X': invalid size '1X'", "K, M, G or T", usage]),
        row(&["copy", "", dst], 2, &["empty endpoint", usage]),
        row(&["copy", "[", "x", dst], 2, &["'[' without ']'", usage]),
        row(&["copy", "]", dst], 2, &["']' without '['"]),
        row(&["copy", "[", "]", dst], 2, &["'[ ]' names no server command"]),
        row(&["copy", "[", "a", "[", "]", "]", dst], 2, &["captive servers do not nest"]),
        row(&["copy", "[", "sh", "-c", "true", "]", dst], 2, &["unexpected argument '-c'"]),
        row(&["copy", "-j", "0", src, dst], 2, &["--workers", "1..=64"]),
        row(&["copy", "--connections", "17", src, dst], 2, &["--connections", "1..=16"]),
        row(&["copy", "--request-size", "1.5M", src, dst], 2, &["invalid size '1.5M'", "whole number"]),
        row(&["copy", "--object-size", "100", src, dst], 2, &["--object-size", "between 512 and 1G"]),
        row(&["copy", "--size", "1M", src, dst], 2, &["--object-size"]),
        row(&["copy", "--break-lease", "--without-lease", src, dst], 2, &["cannot be used with"]),
        row(&["copy", "--footprint=1", src, "-"], 2, &["--footprint=1: standard output carries", usage]),
        row(&["copy", "nbdx://h/e", dst], 2, &["'nbdx://h/e': unknown scheme"]),
        row(&["copy", "nbd:///e", dst], 2, &["'nbd:///e'", "need a host"]),
        row(&["copy", "nbd://h:99999/e", dst], 2, &["invalid port '99999'"]),
        row(&["copy", "nbd+unix:///e", dst], 2, &["need ?socket=PATH"]),
        row(&["copy", "nbd+unix://h/e?socket=/s", dst], 2, &["take no host"]),
        row(&["copy", "nbd://h/e?socket=/s", dst], 2, &["only for nbd+unix"]),
        row(&["copy", "nbd://h/e?frob=1", dst], 2, &["unknown query parameter 'frob'"]),
        row(&["copy", "nbd://h/%zz", dst], 2, &["bad percent escape"]),
        row(&["copy", "nbds://h/e?tls-verify-peer=maybe", dst], 2, &["tls-verify-peer takes 0 or 1"]),
        row(&["copy", "nbds://h/e?tls-type=anon", dst], 2, &["anonymous TLS is not supported"]),
        row(&["copy", "s3:///k", dst], 2, &["'s3:///k': no bucket"]),
        row(&["copy", "s3://b", dst], 2, &["'s3://b': the key must be an object name"]),
        row(&["copy", "s3://b/k?x=1", dst], 2, &["no query"]),
        row(&["copy", "s3://KEYID:KEYSECRET@b/k", dst], 2, &["credentials in an s3:// URI are refused"]),
        // Failures.
        row(&["copy", &refused, dst], 1, &[&format!("connect {refused}: connection refused")]),
        row(&["copy", &http, dst], 1, &[&format!("connect {http}: not an NBD server")]),
        row(&["copy", &silent, dst], 1, &[&format!("connect {silent}: the server closed the connection")]),
        row(
            &["copy", "--no-sparse", "null:64K", "/dev/full"],
            1,
            &[
                "write /dev/full at offset 0 (length 65536): no space left on device",
                "/dev/full is incomplete: 0 B copied of 64.0 KiB before the failure",
            ],
        ),
        // The store refuses: what, where, and what to do.
        row(&["copy", "s3://b/k", dst], 1, &["read s3://b/k/", "SignatureDoesNotMatch: wrong credentials"])
            .env("AWS_ENDPOINT_URL", &store.endpoint)
            .env("AWS_ACCESS_KEY_ID", "AKIDTEST")
            .env("AWS_SECRET_ACCESS_KEY", "wrongsecret0123"),
        row(
            &["copy", "s3://b/k", dst],
            1,
            &["read s3://b/k/", "no credentials were found", "AWS_ACCESS_KEY_ID"],
        )
        .env("AWS_ENDPOINT_URL", &Refuser::start(false).endpoint)
        .env("HOME", s(d)),
        row(&["copy", "s3://b/k", dst], 1, &["open s3://b/k: AWS_PROFILE=nope: no such profile"])
            .env("AWS_PROFILE", "nope")
            .env("HOME", s(d)),
        row(&["copy", "s3://b/k", dst], 1, &["open s3://b/k: an access key id needs its secret access key"])
            .env("AWS_ACCESS_KEY_ID", "AKIDTEST")
            .env("HOME", s(d)),
        row(&["copy", "s3://b/k", dst], 1, &["open s3://b/k: endpoint '127.0.0.1:9'", "https://"])
            .env("AWS_ENDPOINT_URL", "127.0.0.1:9"),
        row(&["copy", "s3://b/k", dst], 1, &[
            "open s3://b/k: endpoint 'http://<redacted>@127.0.0.1:9': credentials in the endpoint URL are refused",
        ])
        .env("AWS_ENDPOINT_URL", "http://user:pw@127.0.0.1:9"),
        row(&["copy", "s3://b/k", dst], 1, &["open /no/bundle.pem: AWS_CA_BUNDLE: no such file"])
            .env("AWS_CA_BUNDLE", "/no/bundle.pem"),
        row(&["copy", "s3://b/k", dst], 1, &[&format!("CA bundle {}: no PEM certificate", s(&no_pem))])
            .env("AWS_CA_BUNDLE", s(&no_pem)),
        // A warning: the copy goes on.
        row(
            &["copy", "--footprint=77", src, "null:"],
            0,
            &["--footprint=77: descriptor 77 cannot be used (bad file descriptor)"],
        ),
    ];
    // Without a certificate directory (libnbd's default ones absent): where to put one.
    if euid() != 0 || !Path::new("/etc/pki/libnbd").is_dir() {
        let tls = format!("nbds://127.0.0.1:{}/", closed_port());
        rows.push(
            row(
                &["copy", &tls, dst],
                1,
                &[&format!("connect {tls}: no certificate directory: add ?tls-certificates=DIR")],
            )
            .env("HOME", s(d)),
        );
    }
    check(rows, false);
    assert!(!Path::new(dst).exists(), "a failed copy created its destination");
}

#[test]
fn serve_errors() {
    let dir = scratch();
    let d = dir.path();
    let img = d.join("disk.img");
    random_file(&img, 256 << 10);
    let img = s(&img);
    let sock = d.join("s.sock");
    let sock = s(&sock);
    let plain = d.join("plain");
    std::fs::write(&plain, "").unwrap();
    let [no_key, bad_cert, no_ca, one_line, wrong_kind] =
        ["no-key", "bad-cert", "no-ca", "one-line", "wrong-kind"].map(|n| d.join(n));
    for (dir, cert, key) in [
        (&no_key, Some(DUMMY_CERT), None),
        (&bad_cert, Some("not a certificate\n"), None),
        (&no_ca, Some(DUMMY_CERT), Some(DUMMY_KEY)),
        (&one_line, Some(DUMMY_CERT), Some(ONE_LINE_KEY)),
        (&wrong_kind, Some(DUMMY_CERT), Some(DUMMY_CERT)),
    ] {
        std::fs::create_dir(dir).unwrap();
        if let Some(c) = cert {
            std::fs::write(dir.join("server-cert.pem"), c).unwrap();
        }
        if let Some(k) = key {
            std::fs::write(dir.join("server-key.pem"), k).unwrap();
        }
    }
    let live_img = d.join("live.img");
    random_file(&live_img, 64 << 10);
    let live = Served::start(&live_img, &["--read-only"]);
    let usage = "Usage: lightfoot serve";
    fn tls<'a>(sock: &'a str, dir: &'a Path, img: &'a str) -> [&'a str; 7] {
        ["serve", "--unix", sock, "--tls=require", "--tls-certificates", s(dir), img]
    }
    let rows = vec![
        row(
            &["serve", "--tls=on", img],
            2,
            &["--tls=on and --tls=require need --tls-certificates DIR", usage],
        ),
        row(&["serve", "--tls-verify-peer", img], 2, &["need --tls=on or --tls=require", usage]),
        row(
            &["serve", "--object-size", "1M", img],
            2,
            &["--object-size and --size are for s3:// images", usage],
        ),
        row(&["serve", "s3://b"], 2, &["'s3://b': the key must be an object name", usage]),
        row(&["serve", "--unix", sock, "--listen", "127.0.0.1:1", img], 2, &["cannot be used with"]),
        row(&["serve", "--json", img], 2, &["--stats"]),
        row(&["serve", "--coalesce-block", "5K", img], 2, &["a multiple of 4K, at most 16M"]),
        row(&["serve", "--coalesce-age", "1.5d", img], 2, &["invalid time '1.5d'", "ms, s, m or h"]),
        row(&["serve", "--threads", "0", img], 2, &["--threads"]),
        row(&["serve", "--tls=maybe", img], 2, &["possible values"]),
        row(&["serve", "--unix", sock, s(d)], 1, &[&format!("open {}: is a directory", s(d))]),
        row(
            &["serve", "--unix", sock, "/dev/null"],
            1,
            &["open /dev/null: not a regular file or block device"],
        ),
        row(
            &["serve", "--unix", &format!("{}/no/dir/s.sock", s(d)), img],
            1,
            &["listen on", "/no/dir/s.sock: no such file"],
        ),
        row(&["serve", "--unix", s(&plain), img], 1, &[&format!("listen on {}: address in use", s(&plain))]),
        row(&["serve", "--unix", s(&live.sock), img], 1, &["address in use (a server listens there"]),
        row(&["serve", "--listen", "nonsense", img], 1, &["listen on nonsense: invalid socket address"]),
        row(
            &["serve", "--listen", "127.0.0.1:99999", img],
            1,
            &["listen on 127.0.0.1:99999: invalid port value"],
        ),
        row(&tls(sock, &no_key, img), 1, &[&format!("tls {}/server-key.pem: no such file", s(&no_key))]),
        row(
            &tls(sock, &bad_cert, img),
            1,
            &[&format!("tls {}/server-cert.pem: no certificate in the file", s(&bad_cert))],
        ),
        row(
            &tls(sock, &wrong_kind, img),
            1,
            &["server-key.pem: no private key in the file (PKCS#8, PKCS#1 or SEC1 PEM)"],
        ),
        row(&tls(sock, &one_line, img), 1, &["server-key.pem: no private key found"]),
        row(
            &[
                "serve",
                "--unix",
                sock,
                "--tls=require",
                "--tls-verify-peer",
                "--tls-certificates",
                s(&no_ca),
                img,
            ],
            1,
            &[&format!("tls {}/ca-cert.pem: no such file", s(&no_ca))],
        ),
        // --run's CMD not found: the shell says so, and its status is serve's.
        row(&["serve", "--unix", sock, "--read-only", "--run", "/no/such/cmd", img], 127, &["/no/such/cmd"]),
    ];
    check(rows, false);
    assert!(!Path::new(sock).exists(), "a failed serve left its socket behind");
    drop(live);
}

/// The pid file was written after --run had started CMD: a pid file that could not be
/// written failed the server and left CMD running.
#[test]
fn a_pid_file_that_cannot_be_written_starts_no_run_command() {
    let dir = scratch();
    let img = dir.path().join("disk.img");
    random_file(&img, 64 << 10);
    let ran = dir.path().join("ran");
    let pid = dir.path().join("no/dir/pid");
    let out = lightfoot(&[
        "serve",
        "--unix",
        s(&dir.path().join("s.sock")),
        "--pid-file",
        s(&pid),
        "--run",
        &format!("touch {}", s(&ran)),
        s(&img),
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains(&format!("write pid file {}: no such file", s(&pid))), "{}", text(&out));
    // Final now: `lightfoot` read the server's standard output and error to their end, and a
    // --run command started would have held them open (it inherits them) until it ended.
    assert!(!ran.exists(), "--run's command ran though the server failed");
}

/// `cache`'s errors for named files (the walk's, with `-r`, are tested in cache_tree.rs).
#[test]
fn cache_errors() {
    let dir = scratch();
    let f = dir.path().join("f");
    random_file(&f, 64 << 10);
    let missing = dir.path().join("missing");
    let (f, missing) = (s(&f), s(&missing));
    check(
        vec![
            row(&["cache", "stat", missing], 1, &[missing, "no such file"]),
            row(&["cache", "evict", missing, f], 1, &[missing, "no such file", &format!("{f}: ")]),
            row(&["cache", "stat", "/dev/null"], 1, &["/dev/null"]),
            row(&["cache", "stat", dir.path().to_str().unwrap()], 1, &["a directory: walk it with -r"]),
            row(&["cache", "stat", "--summary", f], 2, &["--recursive"]),
            row(&["cache", "stat", "--range", "5", f], 2, &["--range", "OFFSET:LENGTH"]),
            row(&["cache", "stat", "--range", "1X:", f], 2, &["invalid size '1X'"]),
            row(&["cache", "stat"], 2, &["<FILE>"]),
            row(&["cache", "frob"], 2, &["unrecognized subcommand 'frob'"]),
        ],
        false,
    );
}

#[test]
fn run_errors() {
    let dir = scratch();
    let d = dir.path();
    let spaced = d.join("with space.so");
    std::fs::write(&spaced, "").unwrap();
    check(
        vec![
            row(&["run"], 2, &["<CMD>"]),
            row(&["run", "--watch", "sometimes", "--", "true"], 2, &["possible values: auto, always, never"]),
            row(&["run", "--max-cache", "1Q", "--", "true"], 2, &["invalid size '1Q'"]),
            row(
                &["run", "--", s(d)],
                126,
                &[&format!("lightfoot run: {}: not executable: permission denied", s(d))],
            ),
            row(&["run", "--", "true"], 125, &["LIGHTFOOT_PRELOAD names /no/lib.so, which is not a file"])
                .env("LIGHTFOOT_PRELOAD", "/no/lib.so"),
            row(
                &["run", "--", "true"],
                125,
                &["LD_PRELOAD cannot name a path with ':' or a space", "LIGHTFOOT_PRELOAD"],
            )
            .env("LIGHTFOOT_PRELOAD", s(&spaced)),
        ],
        false,
    );
}

/// Permission denied as `nobody`, and a read-only filesystem.
#[test]
fn errors_that_need_root_to_stage() {
    if !root_or_skip("needs root to switch to nobody and to mount") {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch();
    let d = dir.path();
    let (secret, public, closed) = (d.join("secret"), d.join("public"), d.join("closed"));
    random_file(&secret, 64 << 10);
    random_file(&public, 64 << 10);
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::set_permissions(&public, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::create_dir(&closed).unwrap();
    std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o755)).unwrap();
    let aws = d.join("home/.aws");
    std::fs::create_dir_all(&aws).unwrap();
    std::fs::write(aws.join("credentials"), "[default]\naws_access_key_id = X\n").unwrap();
    std::fs::set_permissions(aws.join("credentials"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let (secret, public, into_closed) = (s(&secret), s(&public), d.join("closed/dst"));
    let into_closed = s(&into_closed);
    let dst = d.join("dst");
    let sock = d.join("s.sock");
    let mut rows = vec![
        row(&["copy", secret, s(&dst)], 1, &[&format!("open {secret}: permission denied")]),
        row(&["copy", public, into_closed], 1, &[&format!("open {into_closed}: permission denied")]),
        row(
            &["serve", "--unix", s(&sock), public],
            1,
            &[&format!("open {public}: permission denied (--read-only serves it without writing)")],
        ),
        row(
            &["copy", "s3://b/k", s(&dst)],
            1,
            &[&format!("read {}/credentials: permission denied", s(&aws))],
        )
        .env("HOME", s(&d.join("home"))),
    ];
    // Unless this host lets everyone bind low ports.
    let unprivileged =
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_unprivileged_port_start").unwrap_or_default();
    if unprivileged.trim().parse::<u32>().is_ok_and(|p| p > 80) {
        rows.push(row(
            &["serve", "--read-only", "--listen", "127.0.0.1:80", public],
            1,
            &["listen on 127.0.0.1:80: permission denied (ports below 1024 need root)"],
        ));
    }
    check(rows, true);

    let ro = Mount::new(d, "ro", &["-t", "tmpfs", "-o", "ro", "tmpfs"]);
    let into_ro = ro.path.join("dst");
    check(
        vec![row(
            &["copy", public, s(&into_ro)],
            1,
            &[&format!("open {}: read-only file system", s(&into_ro))],
        )],
        false,
    );
}

/// Ctrl-C reaches the writer of a pipe too (one process group): the end of the data that
/// follows is the interruption, not the end of SRC. The copy reported success with what it
/// had read.
#[test]
fn ctrl_c_while_reading_a_pipe_exits_130() {
    let dir = scratch();
    let dst = dir.path().join("dst");
    let mut child = Command::new(bin())
        .args(["copy", "-", s(&dst)])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(&[7u8; 64 << 10]).unwrap();
    // DST exists once the handler is in place (it is set before SRC is opened).
    assert!(within(10, || dst.exists()), "the copy did not start");
    // Ctrl-C, taken (the copy's flag set) before the writer's end of the data comes.
    signal_handled(child.id(), "INT");
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", text(&out));
    assert!(text(&out).contains("copy: interrupted"), "{}", text(&out));
    assert!(text(&out).contains("is incomplete"), "{}", text(&out));
}

/// `lightfoot ARGS` with `env`, at each verbosity (none, -v, -vv, and RUST_LOG=trace): the
/// outputs, all failures (status 1).
fn at_every_verbosity(args: &[&str], env: &[(&str, &str)]) -> String {
    let mut seen = String::new();
    for (v, trace) in [(None, false), (Some("-v"), false), (Some("-vv"), false), (None, true)] {
        let mut all: Vec<String> = vec![args[0].to_string()];
        all.extend(v.map(String::from));
        all.extend(args[1..].iter().map(|a| a.to_string()));
        let mut env: Vec<(String, String)> =
            env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        if trace {
            env.push(("RUST_LOG".into(), "trace".into()));
        }
        let out = run(&all, &env, false);
        assert_eq!(out.status.code(), Some(1), "lightfoot {}: {}", all.join(" "), text(&out));
        seen += &text(&out);
    }
    seen
}

/// A store that refuses every request, quoting it back (headers, signatures and the session
/// token's header included), a store that cannot be reached, and an endpoint with a password
/// in it: no output shows the secret key, the session token, the endpoint's password or a
/// request's signature, at any verbosity, from copy (both ways) or serve.
#[test]
fn a_failing_store_shows_no_secret() {
    let dir = scratch();
    let src = dir.path().join("src");
    random_file(&src, 128 << 10);
    let secrets = ["SECRETSECRETf00d", "TOKENTOKENbeef", "ENDPOINTPWcafe"];
    let [xml, plain] = [true, false].map(Refuser::start);
    let mut seen = String::new();
    for store in [&xml, &plain] {
        let with_password = store.endpoint.replace("http://", &format!("http://user:{}@", secrets[2]));
        for endpoint in [&store.endpoint, &with_password] {
            let env = [
                ("AWS_ENDPOINT_URL", endpoint.as_str()),
                ("AWS_ACCESS_KEY_ID", "AKIDTEST"),
                ("AWS_SECRET_ACCESS_KEY", secrets[0]),
                ("AWS_SESSION_TOKEN", secrets[1]),
            ];
            let sock = dir.path().join("s.sock");
            for args in [
                vec!["copy", "s3://b/k", s(&dir.path().join("back"))],
                vec!["copy", s(&src), "s3://b/k", "--object-size", "64K"],
                vec!["serve", "--unix", s(&sock), "s3://b/k"],
            ] {
                let out = at_every_verbosity(&args, &env);
                assert!(out.contains("s3://b/k"), "the message names no object: {out}");
                seen += &out;
            }
        }
    }
    let unreachable = format!("http://127.0.0.1:{}", closed_port());
    let out = run(
        &["copy", "-vv", "s3://b/k", s(&dir.path().join("back"))].map(String::from),
        &[
            ("AWS_ENDPOINT_URL".into(), unreachable),
            ("AWS_ACCESS_KEY_ID".into(), "AKIDTEST".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), secrets[0].into()),
            ("AWS_SESSION_TOKEN".into(), secrets[1].into()),
        ],
        false,
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("read s3://b/k"), "{}", text(&out));
    seen += &text(&out);

    let signatures: Vec<String> = [&xml, &plain].iter().flat_map(|r| r.signatures()).collect();
    assert!(!signatures.is_empty(), "the stores saw no signed request");
    for secret in secrets.iter().map(|s| s.to_string()).chain(signatures) {
        assert!(!seen.contains(&secret), "{secret} appeared in the output:\n{seen}");
    }
    assert!(seen.contains("<redacted>"), "nothing was quoted back to redact: {seen}");
}

/// A password in an NBD URI, a private key pasted onto one line (server and client side),
/// and a TLS-PSK key file: none of them shows, at any verbosity.
#[test]
fn a_failing_nbd_or_tls_endpoint_shows_no_secret() {
    let dir = scratch();
    let d = dir.path();
    let img = d.join("disk.img");
    random_file(&img, 64 << 10);
    let (server, client) = (d.join("server"), d.join("client"));
    for (dir, who) in [(&server, "server"), (&client, "client")] {
        std::fs::create_dir(dir).unwrap();
        std::fs::write(dir.join(format!("{who}-cert.pem")), DUMMY_CERT).unwrap();
        std::fs::write(dir.join(format!("{who}-key.pem")), ONE_LINE_KEY).unwrap();
    }
    let psk = d.join("keys.psk");
    std::fs::write(&psk, "alice:PSKSECRET0123456789abcdef\n").unwrap();
    let port = closed_port();
    let nbd = format!("nbd://alice:NBDPASSWORD99@127.0.0.1:{port}/x");
    let nbds = format!("nbds://127.0.0.1:{port}/?tls-certificates={}&tls-verify-peer=0", s(&client));
    let out_file = d.join("out");
    let out = s(&out_file);
    let mut seen = String::new();
    for (args, says) in [
        (
            vec!["copy", &nbd, out],
            format!("connect nbd://alice:<redacted>@127.0.0.1:{port}/x: connection refused"),
        ),
        (vec!["copy", &nbds, out], format!("tls {}/client-key.pem: no private key found", s(&client))),
        (
            vec![
                "serve",
                "--unix",
                s(&d.join("s.sock")),
                "--tls=require",
                "--tls-certificates",
                s(&server),
                s(&img),
            ],
            format!("tls {}/server-key.pem: no private key found", s(&server)),
        ),
    ] {
        let t = at_every_verbosity(&args, &[]);
        assert!(t.contains(&says), "want {says:?} in {t}");
        seen += &t;
    }
    // Refused as it is parsed: a usage error, the URI shown without its password.
    for uri in
        ["nbd://alice:NBDPASSWORD99@h:port/x".to_string(), format!("nbds://h/?tls-psk-file={}", s(&psk))]
    {
        let o = lightfoot(&["copy", "-vv", &uri, out]);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        seen += &text(&o);
    }
    for secret in ["NBDPASSWORD99", "KEYMATERIALf00dfeed", "PSKSECRET"] {
        assert!(!seen.contains(secret), "{secret} appeared in the output:\n{seen}");
    }
}
