//! Certificates for the TLS tests, made with `openssl` in a scratch directory: a CA, a server
//! certificate for localhost and 127.0.0.1, a client certificate, and a second CA (with a
//! client certificate of its own) that nobody trusts.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{scratch, text};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Certificate directories, in the layout qemu, nbdkit and libnbd read.
pub struct Certs {
    _dir: tempfile::TempDir,
    /// ca-cert.pem, server-cert.pem, server-key.pem.
    pub server: PathBuf,
    /// ca-cert.pem, client-cert.pem, client-key.pem.
    pub client: PathBuf,
    /// ca-cert.pem only.
    pub anonymous: PathBuf,
    /// Another CA's ca-cert.pem, client-cert.pem and client-key.pem.
    pub stranger: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let found = Command::new("sh").arg("-c").arg("command -v openssl").output().unwrap();
    assert!(found.status.success(), "openssl is missing: `make test` installs it (Debian package openssl)");
    let out = Command::new("openssl").current_dir(dir).args(args).output().unwrap();
    assert!(out.status.success(), "openssl {args:?}: {}", text(&out));
}

/// A CA in `dir`: `NAME-key.pem`, `NAME-cert.pem`.
fn make_ca(dir: &Path, name: &str) {
    let (key, cert) = (format!("{name}-key.pem"), format!("{name}-cert.pem"));
    let subj = format!("/CN=lightfoot test {name}");
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &subj,
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout",
            &key,
            "-out",
            &cert,
        ],
    );
}

/// A certificate signed by CA `ca`, written as `out_dir/NAME-cert.pem` and `NAME-key.pem`.
fn make_leaf(dir: &Path, ca: &str, cn: &str, ext: &str, cert: &Path, key: &Path) {
    let csr = dir.join(format!("{cn}.csr"));
    let extfile = dir.join(format!("{cn}.ext"));
    std::fs::write(&extfile, ext).unwrap();
    let subj = format!("/CN={cn}");
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-subj",
            &subj,
            "-keyout",
            s(key),
            "-out",
            s(&csr),
        ],
    );
    let (ca_cert, ca_key) = (format!("{ca}-cert.pem"), format!("{ca}-key.pem"));
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            s(&csr),
            "-CA",
            &ca_cert,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            s(cert),
            "-extfile",
            s(&extfile),
        ],
    );
}

impl Certs {
    pub fn new() -> Certs {
        let dir = scratch();
        let d = dir.path();
        make_ca(d, "ca");
        make_ca(d, "other");
        let [server, client, anonymous, stranger] =
            ["server", "client", "anonymous", "stranger"].map(|n| d.join(n));
        for p in [&server, &client, &anonymous, &stranger] {
            std::fs::create_dir(p).unwrap();
        }
        for p in [&server, &client, &anonymous] {
            std::fs::copy(d.join("ca-cert.pem"), p.join("ca-cert.pem")).unwrap();
        }
        std::fs::copy(d.join("other-cert.pem"), stranger.join("ca-cert.pem")).unwrap();
        make_leaf(
            d,
            "ca",
            "localhost",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
            &server.join("server-cert.pem"),
            &server.join("server-key.pem"),
        );
        make_leaf(
            d,
            "ca",
            "client",
            "extendedKeyUsage=clientAuth\n",
            &client.join("client-cert.pem"),
            &client.join("client-key.pem"),
        );
        make_leaf(
            d,
            "other",
            "stranger",
            "extendedKeyUsage=clientAuth\n",
            &stranger.join("client-cert.pem"),
            &stranger.join("client-key.pem"),
        );
        Certs { _dir: dir, server, client, anonymous, stranger }
    }
}
