//! TLS for NBD (`NBD_OPT_STARTTLS`), X.509 only, with rustls and its `ring` provider.
//!
//! - [`TlsStream`] ([`stream`]): a session over a plain socket, as one more
//!   [`crate::stream::Stream`]; the server switches to it after acknowledging STARTTLS, the
//!   NBD client after its STARTTLS is acknowledged.
//! - [`ServerTls`]: `lightfoot serve --tls-certificates DIR`, with the files qemu's
//!   `tls-creds-x509` and nbdkit read: `ca-cert.pem` (to verify clients, with
//!   `--tls-verify-peer`), `server-cert.pem`, `server-key.pem`.
//! - [`ClientTls`]: `nbds://` and `nbds+unix://` URIs, with the files qemu and libnbd read:
//!   `ca-cert.pem` to verify the server, `client-cert.pem` and `client-key.pem` offered when
//!   both are present.
//!
//! TLS-PSK (`--tls-psk`, psktool's `user:hexkey` files) is not supported: rustls implements
//! no external pre-shared keys (rustls/rustls#174, open; the client-side draft, PR #2524, was
//! closed unmerged). See docs/tls.md.

pub mod stream;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig};

use crate::error::{Error, ErrorKind, Op, Result};
pub use stream::TlsStream;

/// The certificate authority, in the server's and the client's directory.
pub const CA_CERT: &str = "ca-cert.pem";
pub const SERVER_CERT: &str = "server-cert.pem";
pub const SERVER_KEY: &str = "server-key.pem";
pub const CLIENT_CERT: &str = "client-cert.pem";
pub const CLIENT_KEY: &str = "client-key.pem";

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn bad(path: &Path, detail: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidInput, Op::Tls).path(path).detail(detail)
}

fn read_pem(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::io(Op::Tls, e).path(path))
}

/// What is wrong with a PEM file, in words that quote none of it: the parser's own messages
/// carry the offending line, which in a key file pasted onto one line is the key itself.
fn pem_problem(e: &pem::Error) -> String {
    match e {
        pem::Error::MissingSectionEnd { .. } => "a PEM section has no END line".into(),
        pem::Error::IllegalSectionStart { .. } => {
            "a malformed BEGIN line (PEM keeps its line breaks: was it pasted onto one line?)".into()
        }
        pem::Error::Base64Decode(_) => "bad base64 inside a PEM section".into(),
        pem::Error::Io(e) => crate::error::io_message(e),
        pem::Error::NoItemsFound => "no PEM section of that kind".into(),
        _ => "not readable as PEM".into(),
    }
}

fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let pem = read_pem(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| bad(path, format!("not a PEM certificate file: {}", pem_problem(&e))))?;
    if certs.is_empty() {
        return Err(bad(path, "no certificate in the file"));
    }
    Ok(certs)
}

fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>> {
    let pem = read_pem(path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| match e {
        pem::Error::NoItemsFound => bad(path, "no private key in the file (PKCS#8, PKCS#1 or SEC1 PEM)"),
        e => bad(path, format!("no private key found: {}", pem_problem(&e))),
    })
}

/// Why a key does not go with its certificate.
fn key_problem(e: &rustls::Error) -> String {
    match e {
        rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch) => {
            "it is the key of another certificate".into()
        }
        e => e.to_string(),
    }
}

fn load_roots(path: &Path) -> Result<Arc<RootCertStore>> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(path)? {
        roots.add(cert).map_err(|e| bad(path, format!("unusable CA certificate: {e}")))?;
    }
    Ok(Arc::new(roots))
}

/// The server side: one configuration for every connection.
#[derive(Clone)]
pub struct ServerTls {
    config: Arc<ServerConfig>,
    /// Options other than STARTTLS are refused before TLS (`--tls=require`).
    pub required: bool,
}

impl ServerTls {
    /// Reads `server-cert.pem` (the chain, leaf first), `server-key.pem` and, when clients
    /// must present a certificate (`verify_peer`), `ca-cert.pem` from `dir`.
    pub fn load(dir: &Path, verify_peer: bool, required: bool) -> Result<ServerTls> {
        let provider = provider();
        let certs = load_certs(&dir.join(SERVER_CERT))?;
        let key = load_key(&dir.join(SERVER_KEY))?;
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| bad(dir, e.to_string()))?;
        let builder = if verify_peer {
            let ca = dir.join(CA_CERT);
            let verifier = WebPkiClientVerifier::builder_with_provider(load_roots(&ca)?, provider)
                .build()
                .map_err(|e| bad(&ca, e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let config = builder.with_single_cert(certs, key).map_err(|e| {
            bad(&dir.join(SERVER_KEY), format!("does not fit server-cert.pem: {}", key_problem(&e)))
        })?;
        Ok(ServerTls { config: Arc::new(config), required })
    }

    /// Runs the handshake on a connection whose STARTTLS was just acknowledged.
    pub fn accept(&self, plain: Box<dyn crate::stream::Stream>) -> std::io::Result<TlsStream> {
        let session = rustls::ServerConnection::new(self.config.clone()).map_err(std::io::Error::other)?;
        TlsStream::handshake(plain, session.into())
    }
}

/// How the client checks the server's certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verify {
    /// Signed by the CA and issued for this name (DNS name or IP address).
    Name(String),
    /// Signed by the CA, for whatever name (a Unix socket with no `tls-hostname`).
    Chain,
    /// Not checked at all (`tls-verify-peer=0`): encryption without authentication.
    Nothing,
}

/// The client side: one configuration for every connection to one server.
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<ClientConfig>,
    name: ServerName<'static>,
}

impl ClientTls {
    /// Reads `ca-cert.pem` (unless nothing is verified) and, when both exist,
    /// `client-cert.pem` and `client-key.pem` from `dir`.
    pub fn load(dir: &Path, verify: Verify) -> Result<ClientTls> {
        let provider = provider();
        let algorithms = provider.signature_verification_algorithms;
        let chain = match verify {
            Verify::Nothing => None,
            _ => {
                let ca = dir.join(CA_CERT);
                let v = WebPkiServerVerifier::builder_with_provider(load_roots(&ca)?, provider.clone())
                    .build()
                    .map_err(|e| bad(&ca, e.to_string()))?;
                Some(v)
            }
        };
        let name = match &verify {
            Verify::Name(n) => ServerName::try_from(n.clone())
                .map_err(|_| bad(dir, format!("'{n}' is not a host name or address to verify")))?,
            // No name to send (an IP address sends no SNI); none is checked.
            _ => ServerName::IpAddress(std::net::Ipv4Addr::UNSPECIFIED.into()),
        };
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad(dir, e.to_string()))?;
        let builder = match (verify, chain) {
            (Verify::Name(_), Some(v)) => builder.with_webpki_verifier(v),
            (_, chain) => {
                builder.dangerous().with_custom_certificate_verifier(Arc::new(Lenient { chain, algorithms }))
            }
        };
        let (cert, key) = (dir.join(CLIENT_CERT), dir.join(CLIENT_KEY));
        let config = if cert.exists() && key.exists() {
            builder
                .with_client_auth_cert(load_certs(&cert)?, load_key(&key)?)
                .map_err(|e| bad(&key, format!("does not fit client-cert.pem: {}", key_problem(&e))))?
        } else {
            builder.with_no_client_auth()
        };
        Ok(ClientTls { config: Arc::new(config), name })
    }

    /// Runs the handshake on a connection whose STARTTLS the server just acknowledged.
    pub fn connect(&self, plain: Box<dyn crate::stream::Stream>) -> std::io::Result<TlsStream> {
        let session = rustls::ClientConnection::new(self.config.clone(), self.name.clone())
            .map_err(std::io::Error::other)?;
        TlsStream::handshake(plain, session.into())
    }
}

/// The certificate directory a client uses when the URI names none: libnbd's defaults
/// (`/etc/pki/libnbd` for root; `$HOME/.pki/libnbd`, then `$HOME/.config/pki/libnbd`).
pub fn default_client_dir() -> Option<PathBuf> {
    let root = crate::io::sys::euid() == 0;
    let candidates: Vec<PathBuf> = if root {
        vec![PathBuf::from("/etc/pki/libnbd")]
    } else {
        let home = std::env::var_os("HOME").map(PathBuf::from)?;
        vec![home.join(".pki/libnbd"), home.join(".config/pki/libnbd")]
    };
    candidates.into_iter().find(|d| d.is_dir())
}

/// A server verifier that checks less than the default: the chain without the name
/// (`chain`), or nothing. Handshake signatures are always checked, against the certificate
/// the server presented.
#[derive(Debug)]
struct Lenient {
    chain: Option<Arc<WebPkiServerVerifier>>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        // webpki checks the chain first and the name last: a name error means the chain
        // was good.
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}
